"""`python -m mk bench`: time the megakernel, the fair XLA step and the reference on this TPU.

Rows (`--json`: {"metadata": {...}, "rows": [...]}): impl, batch, experts, median_ms, min_ms,
max_ms, steps (timed), hbm_bytes (what the step must read, `mk.perf.bench.step_bytes`: weight_bytes +
expert_bytes + state_bytes; plan_weight_bytes = the kernel's DMAs), gb_s (hbm_bytes / median),
frac_datasheet (of the chip's HBM bandwidth), frac_stream (of `mk microbench`'s measured DMA
stream bandwidth; null if not measured), tok_s (batch / median), kernel_speedup (this impl's
median / the kernel's), device_median_ms (the step program's device time, from a `jax.profiler`
trace of 5 more steps: no host dispatch or sync), device_gb_s and device_frac_stream (the same bytes
over it), device_speedup (this impl's device time / the kernel's), distinct_experts (per MoE layer, mean over the timed steps), error (why a
case did not run). Off a TPU it refuses (exit 2).
"""
from __future__ import annotations

import json
import sys

from mk.cli.common import at_least, int_list, positive_int


def add_parser(subparsers):
    p = subparsers.add_parser("bench", help="time kernel vs fair XLA step vs reference on a TPU",
                              description=__doc__.splitlines()[0])
    p.add_argument("--config", default="k3-chip", help="preset or checkpoint config (default k3-chip)")
    p.add_argument("--batch", default="1,2,4,8", help="comma-separated batch sizes (default 1,2,4,8)")
    p.add_argument("--experts", choices=("bf16", "mxfp4"), default="bf16", help="routed experts' storage format")
    p.add_argument("--steps", type=positive_int, default=20, help="timed steps per case (default 20)")
    p.add_argument("--warmup", type=positive_int, default=3, help="untimed steps first, compile included (default 3)")
    p.add_argument("--impl", default="kernel,xla,reference",
                   help="comma-separated, of kernel, xla, xla-ragged, reference (default kernel,xla,reference)")
    p.add_argument("--prefetch-depth", type=at_least(0), default=None, help="the kernel's prefetch depth")
    p.add_argument("--mxfp4-unpack", choices=("auto", "pairs", "pairs_mul", "shift", "bitcast"), default="auto",
                   help="how the kernel unpacks MXFP4 codes (`mk check --help`); default the chip's")
    p.add_argument("--seed", type=at_least(0), default=0, help="weights and tokens seed")
    p.add_argument("--json", action="store_true", help="print {metadata, rows} as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    from mk.perf import bench
    from mk.model.config import get_config

    bench.require_tpu()                                   # first: nothing is loaded or built on CPU
    batches = int_list(args.batch, "--batch")
    impls = [s.strip() for s in args.impl.split(",") if s.strip()]
    cfg = get_config(args.config)
    rows = bench.measure(cfg, batches, args.experts, args.steps, args.warmup, impls, args.prefetch_depth,
                         seed=args.seed, mxfp4_unpack=args.mxfp4_unpack)
    meta = bench.metadata(cfg, args.experts, args.steps, args.warmup)
    if args.json:
        json.dump({"metadata": meta, "rows": rows}, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(format_table(rows, meta))
    return 0


def _f(x, fmt):
    return "-" if x is None else format(x, fmt)


def format_table(rows: list[dict], meta: dict) -> str:
    lines = [f"{meta['config']} on {meta['device_kind']} ({meta['chip']}), experts {meta['experts']}, "
             f"{meta['steps']} timed steps after {meta['warmup']} warm-up; jax {meta['jax_version']}, {meta['date']}",
             f"HBM datasheet {_f(meta['datasheet_hbm_bw'] and meta['datasheet_hbm_bw'] / 1e9, '.0f')} GB/s; "
             f"stream {_f(meta['stream_bw'] and meta['stream_bw'] / 1e9, '.0f')} GB/s ({meta['stream_source']})",
             f"{'impl':11s} {'B':>2s} {'median ms':>10s} {'min':>8s} {'max':>8s} {'GB read':>8s} {'GB/s':>7s} "
             f"{'of HBM':>7s} {'of stream':>9s} {'tok/s':>8s} {'vs kernel':>9s} {'device ms':>9s} {'of stream':>9s} "
             f"{'vs kernel':>9s}  distinct experts"]
    for r in rows:
        if r.get("error"):
            lines.append(f"{r['impl']:11s} {r['batch']:2d}  not run: {r['error']}")
            continue
        lines.append(
            f"{r['impl']:11s} {r['batch']:2d} {r['median_ms']:10.3f} {r['min_ms']:8.3f} {r['max_ms']:8.3f} "
            f"{r['hbm_bytes'] / 1e9:8.3f} {_f(r['gb_s'], '7.1f')} {_f(r['frac_datasheet'], '7.2f')} "
            f"{_f(r['frac_stream'], '9.2f')} {_f(r['tok_s'], '8.1f')} "
            f"{(_f(r['kernel_speedup'], '8.2f') + 'x') if r['kernel_speedup'] else '        -'} "
            f"{_f(r.get('device_median_ms'), '9.3f')} {_f(r.get('device_frac_stream'), '9.2f')} "
            f"{(_f(r['device_speedup'], '8.2f') + 'x') if r.get('device_speedup') else '        -'}  "
            f"{r['distinct_experts']} ({r['distinct_source']})")
    return "\n".join(lines)
