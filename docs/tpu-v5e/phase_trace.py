"""Where the kernel's step goes, phase by phase, measured on this TPU: the kernel's `jax.named_scope`
regions traced by libtpu (`mk.notebooks.helpers.enable_region_trace`), summed per step, next to the
simulator's modelled phases for the same plan. JSON on stdout: {"record": {...} (kind "phase_trace"),
"rows": [...], ...}; progress on stderr.

    python3 docs/tpu-v5e/phase_trace.py --config k3-d48 --batch 1 --experts bf16

With jax 0.10.2's libtpu on a v5e (2026-12-06g) the trace held per-engine busy lines (MXU, Vector
ALU, ...) and `bundle.N` markers, and this script then looked for regions everywhere but 'XLA TraceMe',
where the TraceMeStart / TraceMeEnd `vtrace` pairs that libtpu makes of the named scopes (its LLO
says so) most likely land: it now reads that line, reports each engine's busy time
("engines_busy_ms") and what each line holds ("lines_inside").

Region tracing instruments the kernel (each region start and stop is an instruction), so the traced
step is slower than the plain one; `instrumented_ms` is its time, `plain_ms` the same step untraced
by regions is not measured here (`mk bench` measures it). Shares of the step are what to read.
Off a TPU it refuses (one line, exit 2).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
import tempfile
import time

# A phase's group: the first word of its name (kernel regions 'kda_projections', modelled phases
# 'kda.in', 'expert[3].gu'), these renamed so that both sides use one set.
GROUPS = {"expert": "moe", "routing": "moe", "attn": "mix", "mlp": "mix", "final": "mix", "lm": "lm_head"}


def group(name: str) -> str:
    head = name.replace("[", "_").replace(".", "_").split("_")[0]
    return GROUPS.get(head, head)


def log(msg: str):
    print(f"phase_trace: {msg}", file=sys.stderr, flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="k3-d48")
    p.add_argument("--experts", choices=("bf16", "mxfp4"), default="bf16")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=2, help="traced steps (each ~1e5 regions at 48 layers)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    from mk.notebooks.helpers import enable_region_trace
    flags = enable_region_trace()               # before JAX opens the TPU
    import jax
    import jax.numpy as jnp
    import numpy as np
    from mk.model import reference
    from mk.model.config import get_config
    from mk.model.params import init_fast
    from mk.kernel.decode import KERNEL_NAME
    from mk.kernel.plan import make_plan
    from mk.notebooks.helpers import _is_kernel_op, chip_machine, outermost
    from mk.perf import sim
    from mk.perf.bench import _kernel_step, chip_of_device
    from mk.perf.results import provenance
    from mk.perf.trace import ENGINES, NOT_REGION_LINES, device_event_list, is_region_event, profile_data

    chips = chip_of_device(jax.devices()[0].device_kind)
    if jax.default_backend() != "tpu" or not chips:
        print(f"phase_trace: needs a TPU this toolkit knows (found {jax.devices()[0].device_kind})", file=sys.stderr)
        return 2
    plan_chip, hw_chip = chips
    cfg = get_config(args.config)
    t0 = time.perf_counter()
    params = jax.block_until_ready(init_fast(cfg, args.seed, args.experts))
    log(f"{args.config} weights ({args.experts}) in {time.perf_counter() - t0:.1f} s")
    plan = make_plan(cfg, args.batch, chip=plan_chip, experts=args.experts, ctx=256)
    step = _kernel_step(plan, params, {"key": None, "weights": None})
    del params
    tok = jnp.zeros((args.batch,), jnp.int32)
    cache = reference.init_cache(cfg, args.batch, 256)
    t0 = time.perf_counter()
    for _ in range(2):                           # compile and warm, outside the trace
        cache = jax.block_until_ready(step(cache, tok))[1]
    log(f"compiled and warm in {time.perf_counter() - t0:.1f} s (tile {plan.tile_k}x{plan.tile_n}, "
        f"prefetch depth {plan.prefetch_depth})")
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(args.steps):
                cache = jax.block_until_ready(step(cache, tok))[1]
        t0 = time.perf_counter()
        data = profile_data(glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)[0])
        events = device_event_list(data)
    log(f"{len(events)} device events read in {time.perf_counter() - t0:.1f} s")
    kern = sorted((e for e in events if _is_kernel_op(e.name, KERNEL_NAME)), key=lambda e: e.start_ns)
    planes = sorted({e.plane for e in kern})
    if not kern:
        log(f"no {KERNEL_NAME} executions on the device planes")
        return 1
    line = statistics.mode(e.line for e in kern if e.plane == planes[0])
    kern = [e for e in kern if e.plane == planes[0] and e.line == line][-args.steps:]
    inside = [e for e in events if e.plane == planes[0] and e.line not in NOT_REGION_LINES and e.line != line]
    engine_lines = {e.line for e in inside if e.name == e.line or e.name in ENGINES}
    cand = [e for e in inside if is_region_event(e.line, e.name) and e.line not in engine_lines]
    lines_inside = {}                            # line -> events per traced step, and a few names: what the trace holds
    for e in inside:
        c = lines_inside.setdefault(e.line, {"events": 0, "names": []})
        c["events"] += 1
        if len(c["names"]) < 8 and e.name not in c["names"]:
            c["names"].append(e.name)
    for c in lines_inside.values():
        c["events"] /= max(len(kern), 1)
    busy = {}                                    # engine line -> its busy union per kernel execution, ms
    for ln in sorted(engine_lines):
        spans = sorted((e.start_ns, e.start_ns + e.dur_ns) for e in inside if e.line == ln)
        total, reach = 0, None
        for lo, hi in spans:
            reach = lo if reach is None else max(reach, lo)
            total += max(0, hi - reach)
            reach = max(reach, hi)
        busy[ln] = total / 1e6 / max(len(kern), 1)
    top_ms: dict[str, float] = {}
    all_ms: dict[str, float] = {}
    count: dict[str, int] = {}
    cover = []
    for k in kern:
        lo, hi = k.start_ns, k.start_ns + k.dur_ns
        r = [e for e in cand if e.start_ns >= lo and e.start_ns + e.dur_ns <= hi]
        if not r:
            continue
        start = np.array([e.start_ns for e in r])
        end = start + np.array([e.dur_ns for e in r])
        top = outermost(start, end)
        for e, t in zip(r, top):
            all_ms[e.name] = all_ms.get(e.name, 0.0) + e.dur_ns / 1e6 / len(kern)
            count[e.name] = count.get(e.name, 0) + 1
            if t:
                top_ms[e.name] = top_ms.get(e.name, 0.0) + e.dur_ns / 1e6 / len(kern)
        cover.append(sum(e.dur_ns for e, t in zip(r, top) if t) / k.dur_ns)
    step_ms = statistics.median(k.dur_ns / 1e6 for k in kern)
    if not top_ms:
        log(f"the trace holds no named regions inside the kernel (lines {sorted({e.line for e in events})}); "
            f"LIBTPU_INIT_ARGS={flags}")
    for ln, ms in sorted(busy.items(), key=lambda x: -x[1]):
        log(f"engine {ln:14s} busy {ms:7.3f} ms per step ({ms / statistics.median(k.dur_ns / 1e6 for k in kern):5.1%})")
    modelled = sim.simulate(plan, chip_machine(hw_chip), record=True)
    m_ms = {n: v * 1e3 for n, v in modelled.time_by("name").items()}
    groups = sorted({group(n) for n in top_ms} | {group(n) for n in m_ms})
    rows = []
    for g in groups:
        meas = sum(v for n, v in top_ms.items() if group(n) == g)
        mod = sum(v for n, v in m_ms.items() if group(n) == g)
        rows.append({"group": g, "measured_ms": round(meas, 4), "measured_share": round(meas / step_ms, 4),
                     "modelled_ms": round(mod, 4), "modelled_share": round(mod / (modelled.step_time * 1e3), 4)})
        log(f"{g:12s} measured {meas:7.3f} ms ({meas / step_ms:5.1%})   modelled {mod:7.3f} ms")
    summary = (f"kernel {args.config} {args.experts} B={args.batch}, region-traced {step_ms:.3f} ms per step; "
               + (", ".join(f"{r['group']} {r['measured_share']:.0%}" for r in sorted(rows, key=lambda r: -r['measured_ms'])[:5])
                  if top_ms else "no named regions in the trace")
               + ("; engines busy: " + ", ".join(f"{ln} {ms / step_ms:.0%}" for ln, ms in
                                                 sorted(busy.items(), key=lambda x: -x[1])[:4]) if busy else ""))
    record = provenance("phase_trace", {"config": args.config, "experts": args.experts, "batch": args.batch}, summary)
    record["command"] = " ".join(["python3 docs/tpu-v5e/phase_trace.py"] + list(sys.argv[1:] if argv is None else argv))
    out = {"record": record, "rows": rows, "instrumented_ms": [k.dur_ns / 1e6 for k in kern],
           "modelled_step_ms": modelled.step_time * 1e3, "coverage": cover,
           "engines_busy_ms": {ln: round(ms, 4) for ln, ms in busy.items()}, "lines_inside": lines_inside, "line": line, "plane": planes[0],
           "tile": [plan.tile_k, plan.tile_n], "prefetch_depth": plan.prefetch_depth, "libtpu_flags": flags,
           "regions": {n: {"top_ms": round(top_ms.get(n, 0.0), 4), "all_ms": round(all_ms[n], 4),
                           "per_step": count[n] / len(kern)} for n in sorted(all_ms, key=all_ms.get, reverse=True)},
           "modelled_phases_ms": {n: round(v, 4) for n, v in sorted(m_ms.items(), key=lambda x: -x[1])}}
    json.dump(out, sys.stdout, indent=1)
    sys.stdout.write("\n")
    log(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
