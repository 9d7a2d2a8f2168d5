"""Where the kernel's step goes, phase by phase, measured on this TPU: the kernel's `jax.named_scope`
regions traced by libtpu (`mk.notebooks.helpers.enable_region_trace`), summed per step, next to the
simulator's modelled phases for the same plan. JSON on stdout: {"record": {...} (kind "phase_trace"),
"rows": [...], ...}; progress on stderr.

    python3 docs/tpu-v5e/phase_trace.py --config k3-d48 --batch 8,1 --experts bf16 --out DIR

With several batches the weights are drawn once and each batch's JSON is written to DIR as soon as it
is read (phase-CONFIG-EXPERTS-bB.json), so a call stopped at its limit keeps what it finished.

With jax 0.10.2's libtpu on a v5e (2026-12-06g) the trace held per-engine busy lines (MXU, Vector
ALU, ...) and `bundle.N` markers, and this script then looked for regions everywhere but 'XLA TraceMe',
where the TraceMeStart / TraceMeEnd `vtrace` pairs that libtpu makes of the named scopes (its LLO
says so) most likely land: it now reads that line, reports each engine's busy time
("engines_busy_ms") and what each line holds ("lines_inside").

Each row steps its own random token, so at B > 1 the rows route apart as `mk bench`'s do (the
2026-12-06h run stepped zeros in every row: its B = 8 read B = 1's experts).

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
    p.add_argument("--batch", default="1", help="one batch or several, comma-separated (one JSON each)")
    p.add_argument("--steps", type=int, default=1, help="traced steps (each ~2e6 engine events at 48 layers)")
    p.add_argument("--out", default=None, help="a folder for one JSON per batch (default: stdout)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    from mk.notebooks.helpers import enable_region_trace
    flags = enable_region_trace()               # before JAX opens the TPU
    import jax
    from mk.model.config import get_config
    from mk.model.params import init_fast
    from mk.perf.bench import chip_of_device

    chips = chip_of_device(jax.devices()[0].device_kind)
    if jax.default_backend() != "tpu" or not chips:
        print(f"phase_trace: needs a TPU this toolkit knows (found {jax.devices()[0].device_kind})", file=sys.stderr)
        return 2
    plan_chip, hw_chip = chips
    cfg = get_config(args.config)
    t0 = time.perf_counter()
    params = jax.block_until_ready(init_fast(cfg, args.seed, args.experts))
    log(f"{args.config} weights ({args.experts}) in {time.perf_counter() - t0:.1f} s")
    for batch in [int(x) for x in str(args.batch).split(",")]:
        out = trace_batch(args, cfg, params, batch, plan_chip, hw_chip, flags, argv)
        if out is None:
            return 1
        text = json.dumps(out, indent=1) + "\n"
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            path = os.path.join(args.out, f"phase-{args.config}-{args.experts}-b{batch}.json")
            with open(path, "w") as f:
                f.write(text)
            log(f"wrote {path}")
        else:
            sys.stdout.write(text)
    return 0


def trace_batch(args, cfg, params, batch, plan_chip, hw_chip, flags, argv) -> dict | None:
    """One batch: compile, warm, trace `args.steps` steps, read the regions -> the JSON (None: no kernel)."""
    import jax
    import jax.numpy as jnp
    from mk.model import reference
    from mk.kernel.decode import KERNEL_NAME
    from mk.kernel.plan import make_plan
    from mk.notebooks.helpers import chip_machine
    from mk.perf import sim
    from mk.perf.bench import _kernel_step
    from mk.perf.results import command_line, provenance
    from mk.perf.trace import device_event_list, kernel_phases, profile_data
    args = argparse.Namespace(**{**vars(args), "batch": batch})
    plan = make_plan(cfg, args.batch, chip=plan_chip, experts=args.experts, ctx=256)
    step = _kernel_step(plan, params, {"key": None, "weights": None})
    tok = jax.random.randint(jax.random.PRNGKey(args.seed), (args.batch,), 0, cfg.vocab, jnp.int32)   # rows route apart
    cache = reference.init_cache(cfg, args.batch, 256)
    t0 = time.perf_counter()
    for _ in range(2):                           # compile and warm, outside the trace
        cache = jax.block_until_ready(step(cache, tok))[1]
    log(f"compiled and warm in {time.perf_counter() - t0:.1f} s (tile {plan.tile_k}x{plan.tile_n}, "
        f"prefetch depth {plan.prefetch_depth})")
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        with jax.profiler.trace(d):
            for _ in range(args.steps):
                cache = jax.block_until_ready(step(cache, tok))[1]
        log(f"traced {args.steps} step(s) in {time.perf_counter() - t0:.1f} s (the profiler's collection included)")
        t0 = time.perf_counter()
        data = profile_data(glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)[0])
        events = device_event_list(data)
    log(f"{len(events)} device events read in {time.perf_counter() - t0:.1f} s")
    t0 = time.perf_counter()
    ph = kernel_phases(events, KERNEL_NAME, args.steps)
    log(f"read the kernel's lines in {time.perf_counter() - t0:.1f} s")
    if ph is None:
        log(f"no {KERNEL_NAME} executions on the device planes")
        return None
    top_ms, busy, step_ms = ph["top_ms"], ph["busy_ms"], statistics.median(ph["kernel_ms"])
    if not top_ms:
        log(f"the trace holds no named regions inside the kernel (lines {sorted(ph['lines'])}); "
            f"LIBTPU_INIT_ARGS={flags}")
    for ln, ms in sorted(busy.items(), key=lambda x: -x[1]):
        log(f"engine {ln:14s} busy {ms:7.3f} ms per step ({ms / step_ms:5.1%})")
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
    record["command"] = command_line("docs/tpu-v5e/phase_trace.py", argv)
    out = {"record": record, "rows": rows, "instrumented_ms": ph["kernel_ms"],
           "modelled_step_ms": modelled.step_time * 1e3, "coverage": ph["coverage"], "line": ph["line"],
           "plane": ph["plane"], "engines_busy_ms": {ln: round(ms, 4) for ln, ms in busy.items()},
           "lines_inside": ph["lines"], "tile": [plan.tile_k, plan.tile_n], "prefetch_depth": plan.prefetch_depth,
           "libtpu_flags": flags,
           "regions": {n: {"top_ms": round(top_ms.get(n, 0.0), 4), "all_ms": round(v, 4), "per_step": ph["count"][n] / len(ph["kernel_ms"])}
                       for n, v in sorted(ph["all_ms"].items(), key=lambda x: -x[1])},
           "modelled_phases_ms": {n: round(v, 4) for n, v in sorted(m_ms.items(), key=lambda x: -x[1])}}
    log(summary)
    return out


if __name__ == "__main__":
    sys.exit(main())
