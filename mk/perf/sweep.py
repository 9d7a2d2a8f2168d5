"""`mk sweep`'s cases: what a sweep measures, what it has measured already, how long the rest takes,
and the measurement of one case in its own process.

A sweep is configs x expert formats x impls x batches. Its unit of work, a `Case`, is one (config,
experts, impl) with its batches. One process measures it (`python -m mk sweep --case ...`, which `mk
sweep` spawns, one at a time on the chip): it draws the weights once (10-50 s on a v5e), then times each
batch exactly as `mk bench --batch B --impl IMPL` would (`mk.perf.bench.measure`, same seed, weights and
tokens) and writes it at once as its own record, `record_path`. A process cut by a time limit loses only
the batch it was timing; a batch is `done` when its record holds this commit and these options, so the
same command run again goes on where it stopped.

Some programs cannot run some cases (`refusal`): the peer where tpu-inference is missing or a config's
widths do not suit its kernel; the fair XLA step with MXFP4 experts is a strawman (it unpacks every
packed expert each step), no rival (`mk.perf.cases.races`), and is left out too.

`estimate_s` is a model, not a measurement: each batch's wall time (compile and steps) in the newest
record of its case, else of the same program at the preset nearest in depth, plus a process's start
(`SETUP_S`).
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
from pathlib import Path

from mk.errors import UserError
from mk.model.config import DEPTH_PRESETS, get_config

FAMILIES = {"depth": DEPTH_PRESETS}
IMPLS = ("kernel", "xla", "peer")
EXPERT_FORMATS = ("bf16", "mxfp4")
# A case process's start before its first batch, modelled: python, jax and the chip (about 10 s), then
# the weights, 14 s + 0.75 s a layer on the v5e (the "weights ready" lines of the 2026-12-06/07 bench logs).
SETUP_S = (24.0, 0.75)
UNMEASURED_BATCH_S = 60.0   # a batch of a program no record has timed at any preset


class SweepError(UserError):
    """A sweep that cannot run as asked (its message names the option)."""


@dataclasses.dataclass(frozen=True)
class Case:
    """One process of a sweep: a config (a preset name, or a config directory as given), an expert
    format, a program and the batches it times."""
    config: str
    experts: str
    impl: str
    batches: tuple[int, ...]

    @property
    def label(self) -> str:
        return f"{self.config} {self.experts} {self.impl}"


# ---- what a sweep asks for ------------------------------------------------------------------------
def resolve_configs(configs: str | None, family: str | None) -> list[str]:
    """The configs of `--configs A,B` (presets or config directories) or `--family NAME`; the depth family
    when neither is given. A config that is neither a preset nor a readable directory is refused."""
    if family is not None:
        if family not in FAMILIES:
            raise SweepError(f"--family: expected one of {', '.join(FAMILIES)}, found {family!r}")
        return list(FAMILIES[family])
    names = [c.strip() for c in (configs or ",".join(DEPTH_PRESETS)).split(",") if c.strip()]
    if not names:
        raise SweepError("--configs: no config given")
    out = []
    for name in names:
        try:
            get_config(name)
        except UserError as e:
            raise SweepError(f"--configs: {e}") from None
        out.append(name if _is_preset(name) else os.path.normpath(name))
    return out


def _is_preset(name: str) -> bool:
    from mk.model.config import PRESETS
    return name in PRESETS


def choices(text: str, option: str, allowed: tuple[str, ...]) -> list[str]:
    """'kernel,xla' -> ['kernel', 'xla'], each one of `allowed`."""
    out = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in out if t not in allowed]
    if bad or not out:
        raise SweepError(f"--{option}: expected some of {', '.join(allowed)}, found {text!r}")
    return out


def options(steps: int, warmup: int, seed: int) -> dict:
    """What a record must have been measured with to count as done (besides its commit)."""
    return {"steps": steps, "warmup": warmup, "seed": seed}


def refusal(config: str, experts: str, impl: str, installed: bool = True) -> str | None:
    """Why `impl` cannot race the kernel at this config and format, or None where it can; installed=False
    leaves out whether the peer's package is importable here (a plan made off the TPU VM)."""
    if impl == "xla" and experts == "mxfp4":
        return "with MXFP4 experts the fair XLA step unpacks every packed expert each step, a strawman, no rival"
    if impl == "peer":
        from mk.perf import peer
        if installed and not peer.available():
            return f"it needs {peer.PEER_PACKAGE} {peer.PEER_VERSION}, not importable here: {peer.INSTALL_HINT}"
        try:
            peer.block_sizes(get_config(config), 1)
        except UserError as e:
            return str(e)
    return None


def plan(configs, experts, impls, batches, installed: bool = True) -> tuple[list[Case], list[tuple[Case, str]]]:
    """(the cases to measure, config-major in the order given; the cases left out, with the reason);
    installed: as `refusal`."""
    todo, left_out = [], []
    for config in configs:
        for e in experts:
            for impl in impls:
                case = Case(config, e, impl, tuple(batches))
                why = refusal(config, e, impl, installed)
                if why:
                    left_out.append((case, why))
                else:
                    todo.append(case)
    return todo, left_out


# ---- what is done, what is left -------------------------------------------------------------------
def _slug(config: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.]+", "-", config).strip("-.")


def record_path(out, case: Case, batch: int) -> Path:
    """OUT/bench-<config>-<experts>-<impl>-b<batch>.json: one batch of one case."""
    return Path(out) / f"bench-{_slug(case.config)}-{case.experts}-{case.impl}-b{batch}.json"


def log_path(out, case: Case) -> Path:
    """OUT/sweep-<config>-<experts>-<impl>.log: what the case's process printed (`mk bench`'s lines)."""
    return Path(out) / f"sweep-{_slug(case.config)}-{case.experts}-{case.impl}.log"


def done(out, case: Case, batch: int, commit: str | None, opts: dict) -> bool:
    """Whether OUT holds this batch's record, measured at this commit with these options."""
    try:
        rec = json.loads(record_path(out, case, batch).read_text()).get("record") or {}
    except (OSError, ValueError, AttributeError):
        return False
    return commit is not None and rec.get("commit") == commit and rec.get("options") == opts


def pending(out, case: Case, commit: str | None, opts: dict) -> Case:
    """The case with only the batches not `done` in OUT (out None: all of them)."""
    if out is None:
        return case
    return dataclasses.replace(case, batches=tuple(b for b in case.batches if not done(out, case, b, commit, opts)))


def estimate_s(case: Case, cases: dict) -> float:
    """Modelled seconds of the case's process (module doc); cases: `mk.perf.cases.newest_cases`."""
    from mk.perf.cases import config_of
    cfg = config_of(case.config)
    layers = cfg.layers if cfg else 0
    return SETUP_S[0] + SETUP_S[1] * layers + sum(_batch_s(case, b, layers, cases) for b in case.batches)


def _batch_s(case: Case, batch: int, layers: int, cases: dict) -> float:
    from mk.perf.cases import config_of
    row = cases.get((case.config, case.experts, batch, case.impl))
    if row and row.get("wall_s"):
        return row["wall_s"]
    near = sorted((abs(config_of(c).layers - layers), r["wall_s"]) for (c, e, b, i), r in cases.items()
                  if (e, b, i) == (case.experts, batch, case.impl) and r.get("wall_s") and config_of(c))
    return near[0][1] if near else UNMEASURED_BATCH_S


def commands_needed(estimates: list[float], limit_s: float) -> int:
    """How many commands of `limit_s` run cases of these estimates one after another, each command
    starting the next case only where it fits."""
    n, left = 1, limit_s
    for s in estimates:
        if s > left and left < limit_s:
            n, left = n + 1, limit_s
        left -= s
    return n


# ---- one case, in its own process -----------------------------------------------------------------
def bench_command(case: Case, batch: int, opts: dict) -> str:
    """The `mk bench` command that measures what one batch of the case measures."""
    return (f"python -m mk bench --config {case.config} --experts {case.experts} --impl {case.impl} --batch {batch} "
            f"--steps {opts['steps']} --warmup {opts['warmup']} --seed {opts['seed']} --json")


def bench_key(case: Case, batch: int) -> dict:
    """The record key `mk bench` gives that command (`mk.cli.bench.record_key`)."""
    return {"config": case.config, "experts": case.experts, "batch": str(batch), "impl": case.impl}


def save(out, case: Case, batch: int, record: dict, body: dict) -> Path:
    """Write one batch's record (`record` gets the sweep's options' place) whole or not at all."""
    path = record_path(out, case, batch)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"record": record, **body}, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def measure_case(case: Case, out, opts: dict) -> list[Path]:
    """Time each batch of the case on this TPU (`mk.perf.bench.measure`, the weights drawn once) and write
    its record at once; returns the records written."""
    import jax
    from mk.model.params import init_fast
    from mk.perf import bench
    from mk.perf.results import provenance
    bench.require_tpu()
    cfg = get_config(case.config)
    peer_format = bench.default_peer_format(case.experts)
    params = jax.block_until_ready(init_fast(cfg, opts["seed"], case.experts))
    written = []
    for b in case.batches:
        rows = bench.measure(cfg, [b], case.experts, opts["steps"], opts["warmup"], [case.impl], params=params,
                             seed=opts["seed"], progress=False, peer_format=peer_format)
        command = bench_command(case, b, opts)
        meta = dict(bench.metadata(cfg, case.experts, opts["steps"], opts["warmup"],
                                   peer_format=peer_format if case.impl == "peer" else None),
                    config=case.config, command=command)
        record = dict(provenance("bench", bench_key(case, b), bench.summary(rows)), command=command, options=opts,
                      sweep=case.label)
        written.append(save(out, case, b, record, {"metadata": meta, "rows": rows}))
        print(f"sweep: {case.label} B={b}: {record['summary']}", file=sys.stderr, flush=True)
    return written
