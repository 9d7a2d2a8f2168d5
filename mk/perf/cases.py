"""The measured cases in the records, and the sweep table that makes mk's case.

A *case* is one program (impl: kernel, xla, peer) at one batch of one config and expert format. Many
records measured the same case (a bench of B = 1, 8, a later one of B = 2, 4, a `mk sweep` record of
one batch, a stopped bench's log); the case's row is the newest on the kernel's defaults:

    records = mk.perf.results.find_records("docs")
    cases = newest_cases(records)        # {(config, experts, batch, impl): row}
    raced = races(records)               # {(config, experts, batch): {impl: row}}, the kernel and a rival
    print(sweep_table(records, DEPTH_PRESETS))

The sweep table is what `mk sweep` prints at its end and the README shows: per config, expert format
and batch, the kernel's device time, its edge over the better rival (`edge`: the faster of the fair
XLA step and the peer; with MXFP4 experts the int4 peer, the XLA step being a strawman there) and its
share of the stream. The share counts the experts the steps routed (`routed_counts`: an XLA step's
own count, else one made on CPU by docs/tpu-v5e/routed_counts.py), else, marked, the uniform routing
expectation the kernel's own row used.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

from mk.model.config import get_config

EXPERTS = ("bf16", "mxfp4")
BATCHES = (1, 2, 4, 8)


@functools.lru_cache(maxsize=None)
def config_of(name: str):
    """The K3Config a record's config names (a preset, or a config directory as the command gave it,
    from the working directory or the repository root), or None where neither exists."""
    from mk.perf.results import REPO
    for candidate in (name, str(REPO / str(name))):
        try:
            return get_config(candidate)
        except Exception:
            pass
    return None


def record_rows(records, kind: str) -> list[dict]:
    """The rows of the newest records of one kind (`mk.perf.results.current`), each with its record's key
    (config, experts, ...), date ("recorded": with the time), commit (7 characters), chip, file ("record")
    and key names ("record_key") added: one flat dict per measured case, ready for a DataFrame. records:
    `mk.perf.results.find_records`."""
    from mk.perf.results import current
    out = []
    for path, rec in current(records):
        if rec["kind"] != kind:
            continue
        for r in json.loads(Path(path).read_text()).get("rows", []):
            out.append({**rec.get("key", {}), **r, "date": (rec.get("date") or "")[:10],
                        "commit": (rec.get("commit") or "")[:7], "chip": rec.get("chip"), "record": Path(path).name,
                        "path": str(path), "recorded": rec.get("date") or "",
                        "record_key": ",".join(sorted(rec.get("key") or {}))})
    return out


def default_tile_of(r) -> str | None:
    """The tile ("512x512") the kernel now plans by default for a bench row's config and experts, or None
    for a config that is no preset."""
    from mk.kernel.plan import default_tile
    cfg = config_of(r.get("config"))
    return "x".join(map(str, default_tile(cfg, experts=r.get("experts") or "bf16"))) if cfg else None


def default_depth_of(r) -> int | None:
    """The prefetch depth the kernel now plans by default for a bench row's (a dict or a DataFrame row)
    config, experts and batch (on a v5e), or None for a config that is no preset."""
    from mk.kernel.plan import make_plan
    cfg = config_of(r.get("config"))
    try:
        return make_plan(cfg, r["batch"], chip="v5e", experts=r.get("experts")).prefetch_depth if cfg else None
    except Exception:
        return None


def newest_cases(records) -> dict[tuple, dict]:
    """{(config, experts, batch, impl): the newest bench row of that case on the kernel's defaults} over
    the bench records and the cases read back from a stopped bench's log (`record_rows`). A tuning run
    (a key with `mk.perf.results.TUNING_KEYS`) counts only where it ran what the plan now takes by
    default (its tile, its `--prefetch-depth` sweep's row at today's depth); a hand-set unpack or
    `--ctx` (steps at other positions than the sweep's) never.
    Rows without a device time, with an error, or of the reference are left out."""
    out = {}
    for r in record_rows(records, "bench") + record_rows(records, "bench_log"):
        if r["impl"] == "reference" or not r.get("device_median_ms") or r.get("error"):
            continue
        key = set(r["record_key"].split(","))
        if "mxfp4_unpack" in key or "ctx" in key or ("tile" in key and r.get("tile") != default_tile_of(r)):
            continue
        if "prefetch_depth" in key and r.get("prefetch_depth") != default_depth_of(r):
            continue
        case = (r.get("config"), r.get("experts"), r["batch"], r["impl"])
        if case not in out or (r["recorded"], r["record"]) >= (out[case]["recorded"], out[case]["record"]):
            out[case] = r
    return out


def races(records) -> dict[tuple, dict[str, dict]]:
    """{(config, experts, batch): {impl: row}} of the cases where the kernel met a rival
    (`mk.perf.bench.RIVALS`), each row the newest of its case (`newest_cases`). With MXFP4 experts the
    fair XLA step is no rival (it unpacks every packed expert each step, a strawman): the peer is."""
    from mk.perf.bench import RIVALS
    by = {}
    for (config, experts, b, impl), r in newest_cases(records).items():
        if impl == "kernel" or (impl in RIVALS and not (experts == "mxfp4" and impl == "xla")):
            by.setdefault((config, experts, b), {})[impl] = r
    return {case: impls for case, impls in by.items() if "kernel" in impls and len(impls) > 1}


def better_rival(impls: dict[str, dict]) -> str:
    """The faster rival (by device time) in one of `races`' cases."""
    return min((i for i in impls if i != "kernel"), key=lambda i: impls[i]["device_median_ms"])


def edge(impls: dict[str, dict]) -> float:
    """The kernel's edge in one of `races`' cases: the better rival's device time over the kernel's."""
    return impls[better_rival(impls)]["device_median_ms"] / impls["kernel"]["device_median_ms"]


def routed_counts(records) -> dict:
    """{(config, experts, batch): (distinct experts per MoE layer, record file)}: the newest count a chip's
    XLA step made (a bench row whose distinct_source is "routed"), else the newest made on CPU (a
    "routing" record)."""
    from mk.perf.results import current
    out, rank = {}, {}
    for path, rec in current(records):
        if rec["kind"] not in ("bench", "routing"):
            continue
        for r in json.loads(Path(path).read_text()).get("rows", []):
            if str(r.get("distinct_source", "")).startswith("routed"):
                k = (rec["key"].get("config"), rec["key"].get("experts"), r["batch"])
                this = (rec["kind"] == "bench", rec.get("date") or "")      # the chip's count before a CPU's
                if k not in out or this >= rank[k]:
                    out[k], rank[k] = (r["distinct_experts"], Path(path).name), this
    return out


def stream_share(kernel_row: dict, counts: dict) -> tuple[float | None, bool]:
    """(the kernel's share of the chip's stream bandwidth, whether the routed experts were counted): the
    bytes its step must read (`mk.perf.bench.step_bytes`) with the experts a record counted at this config
    and batch (the same seed routes both formats alike: the other format's count stands in), over its
    device time and the chip's stream (data/microbench.csv); else the row's own share, of uniform
    routing's expected experts (False)."""
    from mk.perf.bench import bandwidths, step_bytes
    config, experts, b = kernel_row.get("config"), kernel_row.get("experts"), kernel_row["batch"]
    other = EXPERTS[1 - EXPERTS.index(experts)] if experts in EXPERTS else experts
    got = counts.get((config, experts, b)) or counts.get((config, other, b))
    stream = bandwidths(kernel_row.get("chip") or "tpu-v5e")["stream_bw"]
    cfg = config_of(config)
    if got and stream and cfg:
        nbytes = step_bytes(cfg, b, experts, got[0])["hbm_bytes"]
        return nbytes / (kernel_row["device_median_ms"] / 1e3) / stream, True
    return kernel_row.get("device_frac_stream"), False


def _cell(kernel: dict | None, race: dict | None, counts: dict) -> str:
    if kernel is None:
        return "not run"
    share, routed = stream_share(kernel, counts)
    vs = f"{edge(race):.2f}x {better_rival(race)}" if race else "no rival"
    of = "-" if share is None else f"{share:.2f}" + ("" if routed else "*")
    return f"{kernel['device_median_ms']:.2f} ms, {vs}, {of}"


def sweep_table(records, configs, experts=EXPERTS, batches=BATCHES) -> str:
    """The sweep as markdown: a row per config and expert format, a column per batch, each cell the
    kernel's device ms, its edge over the better rival and its share of the stream (`_cell`), then a line
    naming the records the cells come from. Configs, formats and batches are those asked for, measured
    or not ("not run")."""
    cases, raced, counts = newest_cases(records), races(records), routed_counts(records)
    lines = ["| config | experts | " + " | ".join(f"B = {b}" for b in batches) + " |",
             "|---|---|" + "---|" * len(batches)]
    used, uniform = [], False
    for config in configs:
        for e in experts:
            cells = []
            for b in batches:
                kernel, race = cases.get((config, e, b, "kernel")), raced.get((config, e, b))
                cells.append(_cell(kernel, race, counts))
                uniform |= cells[-1].endswith("*")
                used += [kernel] + list((race or {}).values()) if kernel else []
            lines.append(f"| `{config}` | {e} | " + " | ".join(cells) + " |")
    dates = sorted(r["recorded"][:10] for r in used)
    lines.append("")
    lines.append(f"Each cell: the kernel's device time, its edge over the better rival, its share of the stream"
                 + (" (*: of uniform routing's expected experts, no step counted the routed ones)" if uniform else "")
                 + (f"; from {_records(len({r['path'] for r in used}))}, {dates[0]} to {dates[-1]}" if dates else "")
                 + ".")
    return "\n".join(lines)


def _records(n: int) -> str:
    return f"{n} record" + ("" if n == 1 else "s")


def readme_block(records) -> str:
    """The README's results block: the depth family's sweep table, then one row each for the kinds of
    `mk.perf.results.HEADLINE_KINDS` (generation, prefill, the checks)."""
    from mk.model.config import DEPTH_PRESETS
    from mk.perf.results import headline, results_table
    return sweep_table(records, DEPTH_PRESETS) + "\n\n" + results_table(headline(records))
