"""`python -m mk simulate`: modelled K3 decode throughput of the seed's schedule and of mk's plan.

For each system and batch size, `mk.perf.sim` replays (one device's share of the sharded step):
  seed  the schedule behind the published figure: the seed's K3 megakernel on TPU v7 (`mk.kernel.plan.SEED`),
        one kernel per op on GB200 (`mk.kernel.plan.CONVENTIONAL`, vLLM's decomposition), with the
        published figure and the ratio modelled / published (the model never reads the figure);
  mk    mk's own plan (`mk.kernel.plan.MK`: the kernel's mesh rule, MXFP4 experts; on the seed's system the
        fastest modelled choices and the deepest ring that fits VMEM, on tpu-v5e the kernel's defaults,
        as timed there), its speed-up over the seed's schedule, its step time over its HBM floor, and
        where it is slower, the bubbles that make it so; where mk's kernel was timed on the chip
        (data/published.csv, read after the model), the measured step and modelled / measured.
Every constant comes from data/ with a source; the output says which are measured, datasheet
figures and assumptions.

`--speculative K --acceptance L` models speculative decoding instead (`mk.perf.sim.speculative`): per
batch, a verify step of B x (1 + K) rows plus the drafter's pass, L tokens a step, against plain
decoding of B rows: step ms, the drafter's share, verify / decode step, tokens/s and the speed-up;
where the seed published DSpark tokens/s at L (tpu-v7x16, gb200x16: L = 3, 6), that figure beside it.
`--verify-routing sequence` models a verify step whose 1 + K rows of a sequence route as one token
(the routed experts of B rows) instead of each row on its own (`rows`, the default, uniformly);
`--routed-from BENCH_JSON` instead reads the experts a bench's batch of B x (1 + K) rows routed (the
verify step) and of B rows (the decode step).
"""
from __future__ import annotations

import json
import os
import sys

from mk.cli.common import positive_int
from mk.errors import UserError, writable_path


def add_parser(subparsers):
    p = subparsers.add_parser("simulate", help="modelled K3 decode step time / tokens/s: the seed's schedule and mk's plan",
                              description=__doc__.splitlines()[0])
    p.add_argument("--config", default="k3", help="preset name or checkpoint directory (default: k3)")
    p.add_argument("--system", default="tpu-v7x16",
                   help="tpu-v7x16 | gb200x16 | tpu-v5e (data/systems.csv), or several comma-separated "
                        "(default: tpu-v7x16)")
    p.add_argument("--batch", default="1,2,4,8", help="comma-separated batch sizes, 1..8 (default: 1,2,4,8)")
    p.add_argument("--context", type=positive_int, default=None,
                   help="mean attended tokens per sequence, a multiple of 128 (default: 512, the benchmark's mean "
                        "position; with --routed-from, 128: the bench's device steps attend one cache block)")
    p.add_argument("--plan", choices=("both", "seed", "mk"), default="both",
                   help="which plan to model: the seed's schedule, mk's plan, or both (default)")
    p.add_argument("--experts", choices=("bf16", "mxfp4"), default=None,
                   help="mk's plan: the routed experts' storage (default: mxfp4 where the layout allows it)")
    p.add_argument("--mxfp4-matmul", choices=("bf16", "fp8"), default=None,
                   help="mk's plan: how MXFP4 experts meet the MXU (default: the faster modelled, or the "
                        "kernel's default 'bf16' on a system modelled as run; 'fp8' needs an fp8 MXU)")
    p.add_argument("--mean-experts", action="store_true",
                   help="use the mean distinct experts per device instead of the slowest expert-parallel group")
    p.add_argument("--sensitivity", action="store_true",
                   help="also sweep every constant of the seed's schedule over its stated range, and the other layouts")
    p.add_argument("--trace", metavar="FILE", default=None,
                   help="write the modelled step(s) as Chrome trace-event JSON (Perfetto / XProf); several "
                        "(system, batch, plan) combinations go to FILE-<system>-b<B>-<plan>.json")
    p.add_argument("--microbench", metavar="CSV", default=None,
                   help="model with this copy of data/microbench.csv (e.g. one `mk microbench --write` made on "
                        "a TPU, with the assumed constants measured)")
    p.add_argument("--routed-from", metavar="BENCH_JSON", action="append", default=None,
                   help="a `mk bench --json` output: mk's plan reads the experts its steps routed (not uniform "
                        "routing), and is compared with its kernel's step (device time where it has it); several "
                        "(repeated or comma-separated): each batch from the first that counted it; with "
                        "--speculative K the verify step reads the batch of B x (1 + K) rows")
    p.add_argument("--routed-across-formats", action="store_true",
                   help="let --routed-from be a bench of the other expert format (the same seed draws the same "
                        "router, tokens and weights; quantized experts may move a near tie, so the routing is "
                        "close, not the same): its routing only, not its kernel's step")
    p.add_argument("--measured-from", metavar="BENCH_JSON", default=None,
                   help="with --routed-from: the kernel's step to compare with from this bench instead (of "
                        "--config and --experts; a kernel-alone bench)")
    p.add_argument("--speculative", type=positive_int, default=None, metavar="K",
                   help="model speculative decoding with K drafts a step (a verify step of B x (1 + K) rows and "
                        "the drafter), with --acceptance")
    p.add_argument("--acceptance", type=float, default=None, metavar="L",
                   help="--speculative: tokens emitted a step, 1..K + 1")
    p.add_argument("--verify-routing", choices=("rows", "sequence"), default=None,
                   help="--speculative: the experts the verify step streams: rows = each of the B x (1 + K) rows "
                        "routes on its own, uniformly (distinct drafts; default), sequence = the rows of a sequence "
                        "route as one token (a verify step of one repeated token); --routed-from instead: the "
                        "experts a bench's B x (1 + K) rows routed")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


def _measured_source(rows: list[dict]) -> str:
    """Where the rows' measured steps come from: a bench file (--routed-from) or data/published.csv."""
    return "; ".join(dict.fromkeys(r.get("mk_measured", "data/published.csv") for r in rows if "mk_measured_step_s" in r))


ROUTED_CONTEXT = 128   # --routed-from's default context: one cache block, what a bench's device steps attend


def _bench_file(path: str, option: str, config: str, experts: str | None) -> tuple[dict, list[dict]]:
    """(metadata, rows) of a `mk bench --json` file of `config` (and `experts` where given), else a
    UserError naming the option and the file."""
    try:
        bench = json.loads(open(path).read())
        rec, rows = bench.get("record") or {}, bench["rows"]
        meta = bench["metadata"] if rec.get("kind") != "bench_log" else {   # the cases a stopped call logged
            **rec["key"], "device_kind": rec.get("chip"), "date": rec.get("date")}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise UserError(f"{option} {path}: not a `mk bench --json` output ({type(e).__name__}: {e})") from None
    if meta.get("config") != config:
        raise UserError(f"{option} {path}: benched {meta.get('config')!r}, not --config {config!r}")
    if experts and meta.get("experts") != experts:
        raise UserError(f"{option} {path}: benched {meta.get('experts')} experts, not --experts {experts}"
                        + (" (--routed-across-formats takes its routing only)" if option == "--routed-from" else ""))
    return meta, rows


def _kernel_steps(path: str, meta: dict, rows: list[dict], b: int) -> dict:
    """{prefetch depth (None: not recorded): (seconds, where from)} of the bench's kernel steps at
    batch b (several for a `--prefetch-depth` sweep): device time where traced, else wall."""
    out = {}
    for r in rows:
        if r.get("batch") == b and r.get("impl") == "kernel" and not r.get("error"):
            dev = r.get("device_median_ms")
            out.setdefault(r.get("prefetch_depth"), (
                (dev or r["median_ms"]) / 1e3, f"{'device time' if dev else 'wall clock'}, {os.path.basename(path)}"
                f"{'' if r.get('prefetch_depth') is None else ', depth ' + str(r['prefetch_depth'])} "
                f"({meta.get('device_kind')}, {str(meta.get('date', ''))[:10]})"))
    return out


def measured_at(got: dict, depth: int) -> tuple[float | None, str | None]:
    """(seconds, where from) of a `routed_from` batch's measured kernel step at the plan's prefetch
    `depth` (`collect` models a bench of one depth at that depth, a sweep at the plan's default): the
    step of that depth, or the one step a bench without depths recorded; a UserError where the bench
    swept other depths only (a step at another depth is not this plan's)."""
    steps = got.get("steps") or {}
    if depth in steps or None in steps:
        return steps.get(depth) or steps[None]
    if steps:
        raise UserError(f"{got['source']}: no kernel step at the modelled plan's prefetch depth {depth} "
                        f"(it timed depths {', '.join(map(str, sorted(steps)))})")
    return None, None


def bench_paths(values: list[str] | str | None) -> list[str]:
    """The files of --routed-from, given once or more, each possibly comma-separated."""
    values = [values] if isinstance(values, str) else values or []
    return [p.strip() for v in values for p in v.split(",") if p.strip()]


def routed_from(paths: list[str] | str, config: str, experts: str | None, batches: list[int], *,
                across_formats: bool = False, measured_from: str | None = None,
                why: dict[int, str] | None = None) -> dict[int, dict]:
    """batch -> {"distinct_experts", "steps", "source", "routing", "file"} from `mk bench --json`
    files (`bench_paths`), each batch from the first file with routed counts at it (`distinct_source`
    'routed ...'): those counts and that file's kernel steps by prefetch depth (`_kernel_steps`;
    `measured_at` picks the modelled plan's), device time where the bench traced it, else the wall
    clock. Refuses a file of another config, expert format (unless `across_formats`: then its
    routing only, no step), or a batch asked for that no file counted, naming the files and the
    batch (and `why[batch]`, what needs it, where given). `measured_from`: another bench (this
    config and format) for the step."""
    paths = bench_paths(paths)
    files = [(path, *_bench_file(path, "--routed-from", config, None if across_formats else experts))
             for path in paths]
    if measured_from:
        m_meta, m_rows = _bench_file(measured_from, "--measured-from", config, experts)
    out = {}
    for b in batches:
        hit = next(((path, meta, rows, r) for path, meta, rows in files for r in rows if r.get("batch") == b
                    and str(r.get("distinct_source", "")).startswith("routed")), None)
        if not hit:
            need = f", {why[b]}," if why and b in why else ""
            raise UserError(f"--routed-from {', '.join(paths)}: no routed expert counts at batch {b}{need} "
                            f"(bench --batch {b} with --impl kernel,xla)")
        path, meta, rows, row = hit
        other = bool(experts) and meta.get("experts") != experts
        if measured_from:
            steps, source = _kernel_steps(measured_from, m_meta, m_rows, b), f"--measured-from {measured_from}"
            if not steps:
                raise UserError(f"--measured-from {measured_from}: no kernel step at batch {b}")
        else:                                     # another format's kernel is not this one's step
            steps, source = ({} if other else _kernel_steps(path, meta, rows, b)), f"--routed-from {path}"
        out[b] = {"distinct_experts": row["distinct_experts"], "steps": steps, "source": source, "file": path,
                  "routing": f"{meta.get('experts')} bench {os.path.basename(path)}" if other else None}
    return out


def _batches(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--batch: expected comma-separated integers, found {text!r}") from None
    if not out or any(b < 1 or b > 8 for b in out):
        raise UserError(f"--batch: batch sizes must be in 1..8 (the plan's rows), found {text!r}")
    return out


def _trace_paths(path: str, combos: list[tuple]) -> dict[tuple, str]:
    if len(combos) == 1:
        return {combos[0]: path}
    stem, ext = os.path.splitext(path)
    return {c: f"{stem}-{c[0]}-b{c[1]}-{c[2]}{ext or '.json'}" for c in combos}


def _check_system(system, plans, mxfp4_matmul, sensitivity=False):
    """One-line refusals of what `system` cannot run: the seed's fp8 schedule or the fp8 MXFP4 path
    on a chip without an fp8 MXU (v5e), mk's kernel off a TPU."""
    from mk.perf import sim
    no_fp8 = f"{system.name}'s chip {system.chip.name} has no fp8 MXU (data/hardware.csv fp8_flops = 0)"
    if mxfp4_matmul == "fp8" and not sim.has_fp8_mxu(system):
        raise UserError(f"--mxfp4-matmul fp8: {no_fp8}; its kernel runs MXFP4 experts on the bf16 path")
    if (plans == ("seed",) or sensitivity) and not sim.seed_runs_on(system):
        raise UserError(f"{'--sensitivity' if sensitivity else '--plan seed'}: the seed's schedule (fp8 experts) "
                        f"is not modelled on {system.name}: {no_fp8}")
    if plans == ("mk",) and system.program != "megakernel":
        raise UserError(f"--plan mk: mk's kernel is a TPU program; {system.name} runs one kernel per op")


def collect(config: str, systems: list[str], batches: list[int], context: int | None = None,
            straggler: bool = True, plans: tuple[str, ...] = ("seed", "mk"), trace: str | None = None,
            microbench: str | None = None, experts: str | None = None, mxfp4_matmul: str | None = None,
            sensitivity: bool = False, routed: dict[int, dict] | None = None) -> list[dict]:
    from mk.model.config import get_config
    from mk.kernel import conventional
    from mk.perf import hardware, roofline, sim

    cfg = get_config(config)
    ctx = sim.DEFAULT_CONTEXT if context is None else context
    if ctx % 128:
        raise UserError(f"--context: must be a multiple of 128 (whole cache blocks), found {ctx}")
    for name in systems:
        if name not in hardware.system_names():
            raise UserError(f"--system: unknown system {name!r}; expected one of {list(hardware.system_names())}")
    for name in systems:
        _check_system(hardware.get_system(name, microbench_csv=microbench), plans, mxfp4_matmul, sensitivity)
    paths = _trace_paths(trace, [(s, b, p) for s in systems for b in batches for p in plans]) if trace else {}
    for path in paths.values():                    # before any step is modelled
        writable_path(path, "--trace")
    out = []
    for name in systems:
        system = hardware.get_system(name, microbench_csv=microbench)
        rows = []
        for b in batches:
            got = (routed or {}).get(b)
            ran = [d for d in (got or {}).get("steps", {}) if d is not None]
            r = sim.predict(cfg, b, system, context=ctx, straggler=straggler, plans=plans, record=bool(trace),
                            experts=experts, mxfp4_matmul=mxfp4_matmul,
                            mk_distinct_experts=got["distinct_experts"] if got else None,
                            mk_prefetch_depth=ran[0] if len(ran) == 1 else None)   # the depth its one step ran
            row = {k: v for k, v in r.items() if not k.startswith("_")}
            if got and "mk" in r["_results"]:
                row["mk_distinct_experts"] = got["distinct_experts"]
                if got.get("routing"):
                    row["mk_routing"] = got["routing"]
                step, where = measured_at(got, r["_results"]["mk"].plan.prefetch_depth)
                if step:
                    row["mk_measured_step_s"], row["mk_measured"] = step, where
                    row["mk_modelled_over_measured"] = r["_results"]["mk"].step_time / step
            if "seed" in r["_results"]:
                roof = roofline.roofline(cfg, b, ctx, system=system, straggler=straggler,
                                         plan=r["_results"]["seed"].plan)
                row["roofline"] = {"t_hbm_s": roof.t_hbm, "t_compute_s": roof.t_compute,
                                   "t_collective_s": roof.t_collective, "bound": roof.bound,
                                   "ceiling_tok_s": roof.ceiling_tok_s, "bytes_per_device": roof.total_bytes,
                                   "experts_per_layer": roof.experts_per_layer}
            if "mk_bubbles_s" in row:
                row["mk_bubbles_s"] = [{"category": c, "extra_s": v} for c, v in row["mk_bubbles_s"]]
            for p, res in r["_results"].items():
                if (name, b, p) in paths:
                    from mk.perf.trace import write_trace
                    row.setdefault("trace", {})[p] = write_trace(res, paths[(name, b, p)])
            rows.append(row)
        out.append({
            "config": config, "system": name, "context": ctx, "straggler": straggler,
            "seed_schedule": ("the seed's K3 megakernel (mk.kernel.plan.SEED, spec 3.4-3.8)" if system.program == "megakernel"
                              else "one kernel per op (mk.kernel.plan.CONVENTIONAL; mk.kernel.conventional: vLLM's decomposition)"),
            "layout": system.setup.label(), "layout_source": system.setup.source,
            "layout_assumption": system.setup.assumption,
            "assumptions": system.assumptions() + (["K3-only kernels of the decomposition"]
                                                   if system.program == "per_op" else []),
            "basis": {k: c.basis for k, c in system.constants.items()},
            "decomposition": conventional.DECOMPOSITION_SOURCE if system.program == "per_op" else None,
            "constants": {k: c.summary() for k, c in system.constants.items()},
            "microbench": microbench or "data/microbench.csv",
            "rows": rows,
        })
    return out


def _ms(s):
    return f"{s * 1e3:6.2f} ms"


def format_table(report: list[dict]) -> str:
    lines = []
    for rep in report:
        lines.append(f"{rep['system']}: {rep['layout']}" + ("  [layout: ASSUMPTION]" if rep["layout_assumption"] else ""))
        lines.append(f"  layout source: {rep['layout_source']}")
        seed = any("seed" in r for r in rep["rows"])
        lines.append((f"  seed's schedule: {rep['seed_schedule']}; " if seed else "  seed's schedule: not modelled here; ")
                     + f"context {rep['context']}; experts per device: "
                     f"{'slowest expert-parallel group' if rep['straggler'] else 'mean'}")
        if rep.get("decomposition"):
            lines.append(f"  kernel decomposition: {rep['decomposition']}")
        measured = any("mk_measured_step_s" in r for r in rep["rows"])
        mk_tok = lambda r: (_ms(r["mk"]["step_time_s"]) + " " + format(r["mk"]["tokens_per_s"], "5.0f") + "/s"
                            if "mk" in r else "-")
        # (header, width, cell of a row), the seed's and the measured columns only where a row has them
        cols = [("B", 3, lambda r: str(r["batch"]))]
        if seed:
            cols += [("seed (modelled)", 20, lambda r: _ms(r["seed"]["step_time_s"]) + " " +
                      format(r["seed"]["tokens_per_s"], "5.0f") + "/s" if "seed" in r else "-"),
                     ("published", 9, lambda r: f"{r['published_tok_s']:7.0f}/s" if r.get("published_tok_s") else "-"),
                     ("ratio", 5, lambda r: f"{r['ratio']:5.2f}" if r.get("ratio") else "-")]
        cols += [("mk plan (modelled)", 20, mk_tok)]
        if seed:
            cols += [("mk/seed", 7, lambda r: f"{r['mk_speedup']:6.2f}x" if "mk_speedup" in r else "-")]
        cols += [("mk/HBM floor", 12, lambda r: f"{r['mk_hbm_floor_ratio']:11.2f}x" if "mk_hbm_floor_ratio" in r else "-")]
        if measured:
            cols += [("mk measured", 11, lambda r: _ms(r["mk_measured_step_s"]) if "mk_measured_step_s" in r else "-"),
                     ("modelled/measured", 17, lambda r: f"{r['mk_modelled_over_measured']:.2f}"
                      if "mk_measured_step_s" in r else "-")]
        hdr = " | ".join(f"{h:>{w}}" for h, w, _ in cols)
        lines.append(hdr)
        lines.append("-" * len(hdr))
        notes = []
        for r in rep["rows"]:
            lines.append(" | ".join(f"{cell(r):>{w}}" for _, w, cell in cols))
            if r.get("mk_bubbles_s"):
                top = ", ".join(f"{x['category']} +{x['extra_s'] * 1e3:.2f} ms" for x in r["mk_bubbles_s"][:4])
                notes.append(f"  B={r['batch']}: mk slower than the seed's schedule; bubbles: {top}")
        plan_notes = {r["mk_plan"]["note"] for r in rep["rows"] if r.get("mk_plan", {}).get("note")}
        notes += [f"  mk plan: {n}" for n in sorted(plan_notes)]
        info = next((r["mk_plan"] for r in rep["rows"] if "mk_plan" in r), None)
        if info:
            how = ("the kernel's defaults (mk.kernel.step.make_step_fn), as timed on the chip" if info["mk_plan"] == "defaults"
                   else "per batch the fastest modelled of the choices the kernel runs (tiles, all-reduce rounds, "
                        "MXFP4 MXU path), the deepest ring that fits VMEM")
            notes.append(f"  mk plan: {info['devices']} device(s) (EP{info['ep']} x TP{info['tp_expert']} experts), "
                         f"{info['experts']} experts, chip {info['chip']}; {how}:")
            picks = {r["batch"]: r["mk_plan"] for r in rep["rows"] if "mk_plan" in r}
            for b, i in picks.items():
                mx = (f", MXFP4 on the {i['mxfp4_matmul']} MXU path ({i['dequant_ops_per_weight']} vector ops per "
                      f"weight to dequantize)" if i["experts"] == "mxfp4" else "")
                ar = f", {i['all_reduce'].replace('_', ' ')} all-reduces" if i["devices"] > 1 else ""
                notes.append(f"    B={b}: tiles {i['tile'][0]}x{i['tile'][1]}, prefetch depth {i['prefetch_depth']}{ar}{mx}")
            if any(i["mxfp4_matmul"] == "fp8" for i in picks.values()):
                notes.append("  the fp8 path (bf16 activations x e4m3 codes) is modelled at the fp8 MXU rate, which "
                             "no measurement confirms yet: `mk microbench` on a TPU times it (mxu.bf16xfp8)")
        lines += notes
        lines.append(("  ratio = modelled (seed's schedule) / published; mk/seed = seed step / mk step (> 1: mk faster); "
                      if seed else "  ") + "all times modelled (mk.perf.sim)" +
                     (f"; mk measured: mk's kernel timed on the chip ({_measured_source(rep['rows'])}, read after the model)"
                      if measured else ""))
        routed = [r for r in rep["rows"] if "mk_distinct_experts" in r]
        if routed:
            lines.append("  mk's plan reads the experts its measured steps routed (--routed-from): " + ", ".join(
                f"B={r['batch']}: {'/'.join(f'{x:g}' for x in r['mk_distinct_experts'])}" for r in routed) + " per MoE layer")
            across = next((r["mk_routing"] for r in routed if r.get("mk_routing")), None)
            if across:
                lines.append(f"  routed as the {across} routed (--routed-across-formats): the same seed's router, "
                             f"tokens and weights; this format's own routing may differ at a near tie")
        by = {}
        for k, b in rep["basis"].items():
            by.setdefault(b, []).append(k)
        for b, what in (("measured", "measured (data/microbench.csv; sources say where and when)"),
                        ("datasheet", "datasheet (data/hardware.csv)")):
            if by.get(b):
                lines.append(f"  {what}: {', '.join(by[b])}")
        if rep["assumptions"]:
            lines.append(f"  assumptions (no measurement behind them): {', '.join(rep['assumptions'])}"
                         + ("; `mk microbench` on a TPU measures the TPU ones" if rep["system"].startswith("tpu") else ""))
        if rep["microbench"] != "data/microbench.csv":
            lines.append(f"  constants from: {rep['microbench']}")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def format_sensitivity(system: str, rows: list[dict], batches: list[int]) -> str:
    lines = [f"sensitivity ({system}, the seed's schedule): modelled / published at each end of each range"]
    lines.append(f"{'constant':58s} " + " ".join(f"{'B=' + str(b):>13}" for b in batches))
    key = lambda r: -max(abs(r["tokens_per_s"][b]["high"] - r["tokens_per_s"][b]["low"]) / r["tokens_per_s"][b]["base"]
                         for b in batches)
    for r in sorted(rows, key=key):
        cells = []
        for b in batches:
            t = r["tokens_per_s"][b]
            cells.append(f"{t['ratio_low']:.2f} .. {t['ratio_high']:.2f}" if t.get("ratio_low") else
                         f"{t['low']:.0f} .. {t['high']:.0f}/s")
        name = r["name"] + (" (assumption)" if r["assumption"] else "")
        lines.append(f"{name[:58]:58s} " + " ".join(f"{c:>13}" for c in cells))
    return "\n".join(lines) + "\n"


def speculative_report(args, systems: list[str], batches: list[int]) -> list[dict]:
    """`sim.speculative` for every system and batch (`--speculative K --acceptance L`). With
    --routed-from, mk's plan reads the routed experts of the bench's batch B (the decode step) and of
    its batch of B x (1 + K) rows (the verify step: that many random tokens routed on the same seed's
    weights), refusing files without either; the context defaults to the bench's (`ROUTED_CONTEXT`)."""
    from mk.kernel.plan import MAX_ROWS
    from mk.model.config import get_config
    from mk.perf import hardware, sim
    if args.acceptance is None:
        raise UserError("--speculative K needs --acceptance L (tokens a step, 1..K + 1)")
    for option in ("sensitivity", "trace", "routed_across_formats", "measured_from"):
        if getattr(args, option):
            raise UserError(f"--{option.replace('_', '-')} models plain decoding; drop it with --speculative")
    if args.routed_from and args.verify_routing:
        raise UserError("--verify-routing: with --routed-from the verify step reads the experts the bench's "
                        "B x (1 + K) rows routed; drop one")
    cfg = get_config(args.config)
    plans = ("seed", "mk") if args.plan == "both" else (args.plan,)
    routed = {}
    if args.routed_from:
        k = args.speculative
        why = {b * (1 + k): f"the verify step's {b} x (1 + {k}) rows" for b in batches if b * (1 + k) <= MAX_ROWS}
        for b in batches:
            why.setdefault(b, f"the decode step's batch")
        routed = routed_from(args.routed_from, args.config, args.experts, sorted(why), why=why)
        if args.context is None:
            args.context = ROUTED_CONTEXT
    out = []
    for name in systems:
        if name not in hardware.system_names():
            raise UserError(f"--system: unknown system {name!r}; expected one of {list(hardware.system_names())}")
        system = hardware.get_system(name, microbench_csv=args.microbench)
        _check_system(system, plans, args.mxfp4_matmul)
        for b in batches:
            wide = routed.get(b * (1 + args.speculative)) if routed else None
            kw = {"verify_routing": "routed", "verify_distinct_experts": wide["distinct_experts"],
                  "mk_distinct_experts": routed[b]["distinct_experts"]} if wide else {
                      "verify_routing": args.verify_routing or "rows"}
            row = sim.speculative(cfg, b, args.speculative, args.acceptance, system,
                                  context=args.context or sim.DEFAULT_CONTEXT, plans=plans, experts=args.experts,
                                  mxfp4_matmul=args.mxfp4_matmul, straggler=not args.mean_experts, **kw)
            if wide:
                row["verify_routed_from"], row["decode_routed_from"] = wide["file"], routed[b]["file"]
                row["decode_distinct_experts"] = routed[b]["distinct_experts"]
            out.append(row)
    return out


def format_speculative(rows: list[dict]) -> str:
    """One line per system, batch and plan: the modelled speculative step and tokens/s."""
    lines = [f"{'system':10s} {'B':>2s} {'k':>2s} {'L':>4s} {'plan':4s} {'verify ms':>9s} {'drafter':>8s} "
             f"{'x decode':>8s} {'tok/s':>7s} {'plain':>7s} {'speedup':>7s}  published (seed, measured)"]
    for r in rows:
        for p in ("seed", "mk"):
            if p not in r:
                continue
            m = r[p]
            pub = (f"  {r['published_tok_s']:.0f} tok/s (modelled / published {r['ratio']:.2f})"
                   if p == "seed" and r.get("published_tok_s") else "")
            lines.append(f"{r['system']:10s} {r['batch']:2d} {r['k']:2d} {r['acceptance']:4g} {p:4s} "
                         f"{m['verify_s'] * 1e3:9.3f} {m['drafter_share']:7.1%} {m['verify_over_decode']:7.2f}x "
                         f"{m['tokens_per_s']:7.1f} {m['plain_tokens_per_s']:7.1f} {m['speedup']:6.2f}x{pub}")
    notes = {f"{r['system']}: drafter {r['drafter']}" + (f" ({r['drafter_assumption']}: an assumption)"
                                                         if r["drafter_assumption"] else "") for r in rows}
    lines += sorted(notes)
    counts = lambda c: "/".join(f"{x:g}" for x in c)
    for r in rows:
        if r["verify_routing"] == "routed":
            lines.append(f"{r['system']} B={r['batch']}: verify routing: routed, {r['rows']} rows from "
                         f"{os.path.basename(r['verify_routed_from'])} ({counts(r['verify_distinct_experts'])} experts "
                         f"per MoE layer); decode step: {r['batch']} row{'s' * (r['batch'] > 1)} from {os.path.basename(r['decode_routed_from'])} "
                         f"({counts(r['decode_distinct_experts'])}); the seed's schedule, where modelled: uniform rows")
    routing = {r["verify_routing"] for r in rows}
    lines.append("all times modelled (mk.perf.sim): a verify step of B x (1 + k) rows (the KDA row chaining not "
                 "modelled) plus the drafter's bytes at the DMA stream rate; drafter = its share of a step; "
                 + ("mk's plan reads the experts the bench's steps routed (--routed-from)" if routing == {"routed"}
                    else "the rows of a sequence route as one token (--verify-routing sequence)" if routing == {"sequence"}
                    else "every row routes on its own (--verify-routing rows)"))
    return "\n".join(lines) + "\n"


def run(args) -> int:
    from mk.model.config import get_config
    from mk.perf import sim

    systems = [s.strip() for s in args.system.split(",") if s.strip()]
    batches = _batches(args.batch)
    if args.speculative is not None or args.acceptance is not None:
        if args.speculative is None:
            raise UserError("--acceptance L goes with --speculative K")
        rows = speculative_report(args, systems, batches)
        if args.json:
            json.dump(rows, sys.stdout, indent=2, default=float)
            sys.stdout.write("\n")
        else:
            sys.stdout.write(format_speculative(rows))
        return 0
    plans = ("seed", "mk") if args.plan == "both" else (args.plan,)
    if (args.routed_across_formats or args.measured_from) and not args.routed_from:
        raise UserError("--routed-across-formats and --measured-from go with --routed-from")
    routed = routed_from(args.routed_from, args.config, args.experts, batches, across_formats=args.routed_across_formats,
                         measured_from=args.measured_from) if args.routed_from else None
    if routed and args.context is None:      # `mk bench` times each case's device steps from a new cache
        args.context = ROUTED_CONTEXT        # (positions 0..4), so like for like the rows attend one block
    report = collect(args.config, systems, batches, args.context, not args.mean_experts, plans, args.trace,
                     args.microbench, args.experts, args.mxfp4_matmul, args.sensitivity, routed)
    if args.sensitivity:
        from mk.perf.hardware import get_system
        for rep in report:
            system = get_system(rep["system"], microbench_csv=args.microbench)
            rep["sensitivity"] = sim.sensitivity(get_config(args.config), system, batches, rep["context"])
    if args.json:
        for rep in report:
            for r in rep.get("sensitivity", ()):
                r["tokens_per_s"] = {str(b): v for b, v in r["tokens_per_s"].items()}
        json.dump(report if len(report) > 1 else report[0], sys.stdout, indent=2, default=float)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(format_table(report))
        for rep in report:
            if "sensitivity" in rep:
                sys.stdout.write("\n" + format_sensitivity(rep["system"], rep["sensitivity"], batches))
    return 0
