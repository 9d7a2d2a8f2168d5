"""`check` (kernel vs reference in interpret mode), `aot` (deviceless TPU compile) and
`compile-time` (compile time vs depth).

`check` exits 0 when the kernel agrees with the reference within the tolerances of `mk.check`
(printed with the result, and in its JSON with `verdict` and `reasons`), 1 when it does not, and 2
for bad input.
"""
from __future__ import annotations

import json
import math

from mk.cli.common import add_step_options, ctx_int, int_list, nonnegative_int, positive_int, progress
from mk.errors import UserError


def add_parser(sub):
    p = sub.add_parser("check", help="run kernel and reference side by side; print their differences",
                       description="Kernel vs reference (TPU interpret mode on CPU). Exit 0: within the "
                                   "tolerances of mk.check; 1: outside them; 2: bad input.")
    p.add_argument("--config", default="mini")
    p.add_argument("--batch", type=positive_int, default=1)
    p.add_argument("--steps", type=positive_int, default=8)
    p.add_argument("--prefetch-depth", type=nonnegative_int, default=None)
    p.add_argument("--seed", type=nonnegative_int, default=0)
    p.add_argument("--ctx", type=ctx_int, default=256, help="cache capacity, a multiple of 128")
    p.add_argument("--no-races", action="store_true", help="disable the race detector (faster)")
    p.add_argument("--dma-mode", choices=["on_wait", "eager"], default="on_wait")
    p.add_argument("--experts", choices=("mxfp4", "bf16"), default="mxfp4",
                   help="the kernel's routed experts: MXFP4 (the random weights quantized as `mk synth` "
                        "writes them, packed in HBM, dequantized in VMEM; the reference runs on their "
                        "dequantization) or bf16 tiles")
    p.add_argument("--json", action="store_true")
    add_step_options(p)
    p.set_defaults(func=run_check)

    p = sub.add_parser("aot", help="compile one decode step for a TPU topology on this machine")
    p.add_argument("--config", default="mini")
    p.add_argument("--topology", default="tpu7x:2x2x1")
    p.add_argument("--batch", type=positive_int, default=1)
    p.add_argument("--prefetch-depth", type=nonnegative_int, default=None)
    p.add_argument("--num-slots", type=positive_int, default=None)
    p.add_argument("--tile", type=str, default=None, help="TKxTN, e.g. 512x512")
    p.add_argument("--ctx", type=ctx_int, default=256, help="cache capacity, a multiple of 128")
    p.add_argument("--layers", type=positive_int, default=None, help="override the config's layer count")
    p.add_argument("--reference", action="store_true", help="compile the XLA reference instead")
    p.add_argument("--force", action="store_true", help="compile even if the plan refuses (VMEM)")
    p.add_argument("--experts", choices=("mxfp4", "bf16"), default="mxfp4",
                   help="routed experts' storage: packed MXFP4 (the checkpoint's format, dequantized in "
                        "VMEM) or bf16 tiles")
    p.add_argument("--json", action="store_true")
    add_step_options(p)
    p.set_defaults(func=run_aot)

    p = sub.add_parser("compile-time", help="lower + deviceless-compile stacks of several depths")
    p.add_argument("--config", default="k3-slice")
    p.add_argument("--layers", default="4,24", help="comma-separated layer counts")
    p.add_argument("--experts", type=positive_int, default=16, help="override experts (HBM of one core)")
    p.add_argument("--topology", default="tpu7x:2x2x1")
    p.add_argument("--batch", type=positive_int, default=1)
    p.add_argument("--reference", action="store_true", help="also compile the XLA reference (slow)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run_compile_time)


def _chip(topology: str) -> str:
    from mk.aot import chip_of
    try:
        return chip_of(topology)
    except ValueError as e:
        raise UserError(f"--topology: {e}") from None


def _tile(text: str | None):
    if not text:
        return None
    parts = text.lower().split("x")
    try:
        tile = tuple(int(x) for x in parts)
    except ValueError:
        tile = ()
    if len(tile) != 2 or min(tile) < 1:
        raise UserError(f"--tile: expected TKxTN with positive integers, e.g. 512x512, found {text!r}")
    return tile


def _config(name, layers=None):
    from mk.config import get_config
    cfg = get_config(name)
    if layers:
        cfg = stacked(cfg, layers)
    return cfg


def stacked(cfg, layers: int):
    """cfg with `layers` layers, MLA every 4th (l % 4 == 3) and at the last layer, as in K3."""
    full = tuple(sorted(set(range(3, layers, 4)) | {layers - 1}))
    return cfg.replace(layers=layers, full_attention=full)


def run_check(args) -> int:
    cfg = _config(args.config)
    from mk.check import check
    from mk.plan import make_plan

    if args.steps > args.ctx:
        raise UserError(f"--steps ({args.steps}) exceed --ctx {args.ctx}")
    kw = {} if args.prefetch_depth is None else {"prefetch_depth": args.prefetch_depth}
    layout = _layout(cfg, args.mesh)
    make_plan(cfg, args.batch, ctx=args.ctx, check=False, layout=layout, experts=args.experts,
              **kw)                                                                # bad input: before any work
    _enough_devices(args.mesh)
    res = check(cfg, args.batch, args.steps, args.prefetch_depth, seed=args.seed,
                ctx=args.ctx, detect_races=not args.no_races, dma_execution_mode=args.dma_mode,
                progress=not args.json, mesh=args.mesh or 1, experts=args.experts)
    if args.json:
        print(json.dumps(_finite(res), indent=1, allow_nan=False))
    else:
        for k, v in res.items():
            if k not in ("per_step", "reasons", "verdict"):
                print(f"{k:>26}: {v}")
        print(f"{'verdict':>26}: {res['verdict']}" + "".join(f"\n{'':>28}{r}" for r in res["reasons"]))
    return 0 if res["verdict"] == "pass" else 1


def _layout(cfg, mesh):
    """The plan layout of `--mesh N` (one device without it); a mesh that does not divide the
    config is a PlanError naming the width at fault."""
    from mk.plan import Layout
    from mk.sharding import default_layout
    return default_layout(cfg, mesh) if mesh and mesh > 1 else Layout()


def _enough_devices(mesh):
    if mesh and mesh > 1:
        import jax
        if jax.device_count() < mesh:
            raise UserError(f"--mesh {mesh}: only {jax.device_count()} devices available")


def _finite(x):
    """JSON has no NaN / Infinity: such floats become null (the result says why, e.g. `nan_arrays`)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def run_aot(args) -> int:
    from mk.aot import compile_kernel, compile_reference
    from mk.plan import PlanError, make_plan
    cfg = _config(args.config, args.layers)
    chip = _chip(args.topology)
    out = {"config": args.config, "layers": cfg.layers, "topology": args.topology, "batch": args.batch,
           "devices": args.mesh or 1}
    if args.reference:
        r = compile_reference(cfg, args.batch, args.topology, args.ctx)
        out.update(program="xla_reference")
    else:
        kw = {}
        if args.prefetch_depth is not None:
            kw["prefetch_depth"] = args.prefetch_depth
        if args.num_slots is not None:
            kw["num_slots"] = args.num_slots
        if args.tile:
            kw["tile"] = _tile(args.tile)
        plan = make_plan(cfg, args.batch, chip=chip, ctx=args.ctx, check=False, layout=_layout(cfg, args.mesh),
                         experts=args.experts, **kw)
        out.update(program="megakernel", experts=plan.experts, expert_bytes=plan.expert_bytes,
                   routed_expert_bytes_per_step=plan.routed_expert_bytes_per_step(),
                   collectives_per_step=plan.collectives_per_step,
                   remote_bytes_per_step=plan.remote_bytes_per_step,
                   pallas_calls_per_step=1, vmem_planned_bytes=plan.vmem_planned_bytes,
                   vmem_limit_bytes=plan.vmem_limit, prefetch_depth=plan.prefetch_depth,
                   num_slots=plan.num_slots, tile=[plan.tile_k, plan.tile_n])
        try:
            plan.check_vmem()
            out["plan_fits"] = True
        except PlanError as e:
            out["plan_fits"] = False
            out["plan_error"] = str(e)
            if not args.force:
                out.update(compiled=False, compile_s=0.0, error=str(e))
                _print(out, args.json)
                return 2
        r = compile_kernel(plan, args.topology)
    out.update(compiled=r.compiled, compile_s=round(r.compile_s, 3), lower_s=round(r.lower_s, 3),
               error=r.error, memory=r.memory)
    _print(out, args.json)
    return 0 if r.compiled else 1


def _print(out, as_json):
    if as_json:
        print(json.dumps(out, indent=1))
    else:
        for k, v in out.items():
            print(f"{k:>20}: {v}")


def compile_times(config: str, layers, *, experts=None, topology="tpu7x:2x2x1", batch=1, reference=False,
                  show_progress: bool = False):
    """[{layers, program, lower_s, compile_s, total_s, compiled}] for each depth (measured here,
    deviceless: the TPU compiler running on this CPU)."""
    from mk.aot import compile_kernel, compile_reference
    from mk.plan import make_plan
    chip = _chip(topology)
    cfgs = []
    for L in layers:                       # every config first: a bad one fails before any compile
        cfg = _config(config, L)
        if experts:
            cfg = cfg.replace(experts=experts, top_k=min(cfg.top_k, experts))
        cfgs.append((L, cfg))
    jobs = []
    for L, cfg in cfgs:
        jobs.append((L, "megakernel", lambda cfg=cfg: compile_kernel(make_plan(cfg, batch, chip=chip), topology)))
        if reference:
            jobs.append((L, "xla_reference", lambda cfg=cfg: compile_reference(cfg, batch, topology)))
    rows = []
    bar = progress(jobs, desc="compile", unit="program", enabled=show_progress)
    for L, name, fn in bar:
        bar.set_postfix_str(f"{name} layers={L}")
        r = fn()
        rows.append({"layers": L, "program": name, "compiled": r.compiled, "lower_s": round(r.lower_s, 3),
                     "compile_s": round(r.compile_s, 3), "total_s": round(r.lower_s + r.compile_s, 3),
                     "error": r.error})
    return rows


def run_compile_time(args) -> int:
    layers = int_list(args.layers, "--layers", low=1)
    rows = compile_times(args.config, layers, experts=args.experts, topology=args.topology,
                         batch=args.batch, reference=args.reference, show_progress=True)
    by = {}
    for r in rows:
        by.setdefault(r["program"], []).append(r)
    ratios = {p: rs[-1]["total_s"] / max(rs[0]["total_s"], 1e-9) for p, rs in by.items()}
    out = {"config": args.config, "topology": args.topology, "measured": "deviceless TPU compile on this CPU",
           "runs": rows, "ratio_deepest_vs_shallowest": ratios}
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        for r in rows:
            print(f"{r['program']:>14} layers={r['layers']:>3}  lower {r['lower_s']:7.2f} s  "
                  f"compile {r['compile_s']:7.2f} s  total {r['total_s']:7.2f} s  ok={r['compiled']}")
        for p, q in ratios.items():
            print(f"{p}: deepest / shallowest = {q:.2f}x")
    return 0 if all(r["compiled"] for r in rows) else 1
