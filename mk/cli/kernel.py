"""`check` (kernel vs reference in interpret mode) and `aot` (deviceless TPU compile)."""
from __future__ import annotations

import json

from mk.errors import UserError


def add_parser(sub):
    p = sub.add_parser("check", help="run kernel and reference side by side; print their differences")
    p.add_argument("--config", default="mini")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--prefetch-depth", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ctx", type=int, default=256)
    p.add_argument("--no-races", action="store_true", help="disable the race detector (faster)")
    p.add_argument("--dma-mode", choices=["on_wait", "eager"], default="on_wait")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run_check)

    p = sub.add_parser("aot", help="compile one decode step for a TPU topology on this machine")
    p.add_argument("--config", default="mini")
    p.add_argument("--topology", default="tpu7x:2x2x1")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prefetch-depth", type=int, default=None)
    p.add_argument("--num-slots", type=int, default=None)
    p.add_argument("--tile", type=str, default=None, help="TKxTN, e.g. 512x512")
    p.add_argument("--ctx", type=int, default=256)
    p.add_argument("--layers", type=int, default=None, help="override the config's layer count")
    p.add_argument("--reference", action="store_true", help="compile the XLA reference instead")
    p.add_argument("--force", action="store_true", help="compile even if the plan refuses (VMEM)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run_aot)

    p = sub.add_parser("compile-time", help="lower + deviceless-compile stacks of several depths")
    p.add_argument("--config", default="k3-slice")
    p.add_argument("--layers", default="4,24", help="comma-separated layer counts")
    p.add_argument("--experts", type=int, default=16, help="override experts (HBM of one core)")
    p.add_argument("--topology", default="tpu7x:2x2x1")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--reference", action="store_true", help="also compile the XLA reference (slow)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run_compile_time)


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
    from mk.check import check
    res = check(_config(args.config), args.batch, args.steps, args.prefetch_depth, seed=args.seed,
                ctx=args.ctx, detect_races=not args.no_races, dma_execution_mode=args.dma_mode,
                progress=not args.json)
    if args.json:
        print(json.dumps(res, indent=1))
    else:
        for k, v in res.items():
            if k != "per_step":
                print(f"{k:>22}: {v}")
    ok = res["greedy_match"] and not res["nan"] and res["races"] == 0
    return 0 if ok else 1


def run_aot(args) -> int:
    from mk.aot import chip_of, compile_kernel, compile_reference
    from mk.plan import PlanError, make_plan
    cfg = _config(args.config, args.layers)
    try:
        chip = chip_of(args.topology)
    except ValueError as e:
        raise UserError(str(e)) from None
    out = {"config": args.config, "layers": cfg.layers, "topology": args.topology, "batch": args.batch}
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
            kw["tile"] = tuple(int(x) for x in args.tile.lower().split("x"))
        plan = make_plan(cfg, args.batch, chip=chip, ctx=args.ctx, check=False, **kw)
        out.update(program="megakernel", vmem_planned_bytes=plan.vmem_planned_bytes,
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


def compile_times(config: str, layers, *, experts=None, topology="tpu7x:2x2x1", batch=1, reference=False):
    """[{layers, program, lower_s, compile_s, total_s, compiled}] for each depth (measured here,
    deviceless: the TPU compiler running on this CPU)."""
    from mk.aot import chip_of, compile_kernel, compile_reference
    from mk.plan import make_plan
    rows = []
    for L in layers:
        cfg = _config(config, L)
        if experts:
            cfg = cfg.replace(experts=experts, top_k=min(cfg.top_k, experts))
        runs = [("megakernel", lambda: compile_kernel(make_plan(cfg, batch, chip=chip_of(topology)), topology))]
        if reference:
            runs.append(("xla_reference", lambda: compile_reference(cfg, batch, topology)))
        for name, fn in runs:
            r = fn()
            rows.append({"layers": L, "program": name, "compiled": r.compiled, "lower_s": round(r.lower_s, 3),
                         "compile_s": round(r.compile_s, 3), "total_s": round(r.lower_s + r.compile_s, 3),
                         "error": r.error})
    return rows


def run_compile_time(args) -> int:
    layers = [int(x) for x in args.layers.split(",")]
    rows = compile_times(args.config, layers, experts=args.experts, topology=args.topology,
                         batch=args.batch, reference=args.reference)
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
