"""`python -m mk bench`: time the megakernel, the fair XLA step, the reference and the peer on this TPU.

Rows (`--json`: {"metadata": {...}, "rows": [...]}): impl, batch, experts, median_ms, min_ms,
max_ms, steps (timed), hbm_bytes (what the step must read, `mk.perf.bench.step_bytes`: weight_bytes +
expert_bytes + state_bytes; plan_weight_bytes = the kernel's DMAs), gb_s (hbm_bytes / median),
frac_datasheet (of the chip's HBM bandwidth), frac_stream (of `mk microbench`'s measured DMA
stream bandwidth; null if not measured), tok_s (batch / median), kernel_speedup (this impl's
median / the kernel's), device_median_ms (the step program's device time, from a `jax.profiler`
trace of 5 more steps: no host dispatch or sync), device_gb_s and device_frac_stream (the same bytes
over it), device_speedup (this impl's device time / the kernel's), device_ops (from the same trace,
`mk.perf.trace.step_op_breakdown`: ops per step, busy and idle ms between them, ms by op), distinct_experts (per MoE layer, mean over the timed steps), error (why a
case did not run); peer rows: peer_format, their bytes counting the experts in it; kernel rows: best_other
(the faster of xla and peer by device time), device_speedup_vs_best and speedup_vs_best (its device and
wall time / the kernel's). `--tile TKxTN` sets the kernel's weight tile (default: the plan's per-model tile;
the record's key then names it). `--ctx N`: the steps run at the last positions of an N-position cache,
attending up to N positions (metadata ctx and first_position; the record's key names it). Off a TPU it refuses (exit 2); so does --impl peer where tpu-inference is not
installed (`mk.perf.peer`: pip install --no-deps tpu-inference==0.26.0, the release for jax 0.10.2).

`--mode generate` (`mk.perf.bench.measure_generate`, impls kernel and xla): decode tokens/s of the
device loop (`mk.model.loop`: `--chunk` steps per dispatch, default 16; `--steps` decode steps per
case, default 128) against the device step rate. Rows: impl, batch, experts, chunk, decode_steps,
decode_s, loop_step_ms and loop_tok_s (the loop, wall clock), device_step_ms and device_tok_s (one
step's device time from a `jax.profiler` trace, as above), frac_of_device (loop_tok_s /
device_tok_s: 1.0 = no gap between steps), host_step_ms and host_tok_s (the per-token host loop,
each step timed to block_until_ready), loop_speedup (loop_tok_s / host_tok_s), ttft_s, compile_s,
wall_s, error. `--json` adds a record (`mk.perf.results`, kind "generate", key config, experts, chunk).

`--mode speculative` (`mk.perf.spec_bench`, impls kernel and xla; default --batch 1,2): speculative
decoding on the device loop at a fixed acceptance length (tokens not meaningful: a speed measurement),
`--speculative` k drafts (default 3,7; those that fit the kernel's rows at each batch), `--acceptance`
lengths L (default 1..k + 1), `--steps` speculative steps a case (default 32), beside plain decoding of
the same config in the same run. Rows: impl, batch, k (0: plain decoding), L, device_tok_s and
wall_tok_s, speedup_device and speedup_wall (over plain's), device_step_ms, verify_over_decode,
drafter_share, prefill_s, error. `--json` adds a record (kind "bench_speculative", key config, experts,
and the batches, ks and lengths where not the defaults).
"""
from __future__ import annotations

import json
import sys

from mk.cli.common import add_cache_option, at_least, ctx_int, int_list, positive_int, use_cache


def add_parser(subparsers):
    p = subparsers.add_parser("bench", help="time kernel vs fair XLA step vs reference on a TPU",
                              description=__doc__.splitlines()[0])
    p.add_argument("--config", default="k3-chip", help="preset or checkpoint config (default k3-chip)")
    p.add_argument("--batch", default=None, help="comma-separated batch sizes (default 1,2,4,8; --mode speculative: 1,2)")
    p.add_argument("--experts", choices=("bf16", "mxfp4"), default="bf16", help="routed experts' storage format")
    p.add_argument("--mode", choices=("step", "generate", "speculative"), default="step",
                   help="step: time single steps (default); generate: the device decode loop (mk.model.loop) "
                        "against the device step rate; speculative: the speculative device loop at fixed "
                        "acceptance lengths against plain decoding")
    p.add_argument("--speculative", default="3,7", metavar="KS",
                   help="--mode speculative: comma-separated drafts per step (default 3,7)")
    p.add_argument("--acceptance", default=None, metavar="LS",
                   help="--mode speculative: comma-separated fixed acceptance lengths (default 1..k + 1 of each k)")
    p.add_argument("--chunk", type=positive_int, default=16, help="--mode generate: steps per dispatch (default 16)")
    p.add_argument("--steps", type=positive_int, default=None,
                   help="timed steps per case (default 20; --mode generate: decode steps, default 128)")
    p.add_argument("--warmup", type=positive_int, default=3, help="untimed steps first, compile included (default 3)")
    p.add_argument("--impl", default=None,
                   help="comma-separated, of kernel, xla, xla-ragged, reference, peer (default kernel,xla,reference; --mode generate: kernel,xla; "
                        "peer: vLLM TPU's fused MoE kernel as the routed experts, needs tpu-inference 0.26.0)")
    p.add_argument("--peer-format", choices=("bf16", "int8", "int4"), default=None,
                   help="the peer's expert format (default bf16 with --experts bf16, int4 with mxfp4)")
    p.add_argument("--prefetch-depth", default=None,
                   help="the kernel's prefetch depth (default: the plan's); comma-separated: a sweep of the kernel "
                        "alone (--impl kernel), the weights drawn once, one row per depth and batch")
    p.add_argument("--tile", default=None, help="the kernel's weight tile TKxTN, e.g. 512x512 (default: the "
                   "plan's per-model tile, `mk.kernel.plan.default_tile`)")
    p.add_argument("--mxfp4-unpack", choices=("auto", "pairs", "pairs_mul", "shift", "bitcast"), default="auto",
                   help="how the kernel unpacks MXFP4 codes (`mk check --help`); default the chip's")
    p.add_argument("--ctx", type=ctx_int, default=None,
                   help="context length N (a multiple of 128): the cache holds N positions and the timed steps "
                        "(and the profiled ones) end at its last, attending up to N positions, as the last steps "
                        "of `mk generate` with that cache (default: a 256-position cache from position 0, each "
                        "step attending its first block)")
    p.add_argument("--seed", type=at_least(0), default=0, help="weights and tokens seed")
    p.add_argument("--json", action="store_true", help="print {metadata, rows} as JSON")
    add_cache_option(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from mk.perf import bench
    from mk.model.config import get_config

    generate = args.mode == "generate"
    impl = args.impl or (",".join(bench.GENERATE_IMPLS) if generate else "kernel,xla,reference")
    impls = [s.strip() for s in impl.split(",") if s.strip()]
    peer_format = args.peer_format or bench.default_peer_format(args.experts)
    if "peer" in impls:                                   # first: a missing package is said before the TPU
        from mk.perf import peer
        if not peer.available():
            raise bench.BenchError(f"--impl peer needs {peer.PEER_PACKAGE} {peer.PEER_VERSION}, not importable "
                                   f"here: {peer.INSTALL_HINT}")
    from mk.cli.kernel import _tile
    tile = _tile(args.tile)                               # a bad value is said before the TPU too
    if args.prefetch_depth is not None:                   # one depth: an int, as before; several: a sweep
        depths = bench.prefetch_depths(int_list(args.prefetch_depth, "--prefetch-depth", low=0), impls)
        args.prefetch_depth = depths[0] if len(depths) == 1 else depths
    speculative = args.mode == "speculative"
    batches = int_list(args.batch or ("1,2" if speculative else "1,2,4,8"), "--batch")
    if speculative:                                       # its options are checked before the TPU
        from mk.perf import spec_bench
        ks = int_list(args.speculative, "--speculative")
        lengths = int_list(args.acceptance, "--acceptance") if args.acceptance else None
        spec_bench.cases(batches, ks, lengths)
    use_cache(args)
    bench.require_tpu()                                   # then: nothing is loaded or built on CPU
    cfg = get_config(args.config)
    if speculative:
        return _run_speculative(args, cfg, batches, ks, lengths)
    if generate:
        return _run_generate(args, bench, cfg, batches, impls)
    args.steps = args.steps or 20
    ctx = args.ctx or bench.CTX
    start = 0 if args.ctx is None else bench.last_positions(ctx, args.warmup + args.steps)
    rows = bench.measure(cfg, batches, args.experts, args.steps, args.warmup, impls, args.prefetch_depth,
                         seed=args.seed, ctx=ctx, start=start, mxfp4_unpack=args.mxfp4_unpack,
                         peer_format=peer_format, tile=tile)
    meta = bench.metadata(cfg, args.experts, args.steps, args.warmup,
                          peer_format=peer_format if "peer" in impls else None, ctx=ctx, start=start)
    if args.json:
        from mk.perf.results import provenance
        record = provenance("bench", record_key(args, meta["config"], tile, batches, impls), bench.summary(rows))
        json.dump({"record": record, "metadata": meta, "rows": rows}, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(format_table(rows, meta))
    return 0


def record_key(args, config: str, tile, batches: list[int], impls=("kernel", "xla")) -> dict:
    """What a step record measured, for `mk results` (a later record of the same key supersedes it):
    config and experts, then each option that changes the kernel, the batches when B = 1 and 8
    (the headline's) are not among them, and the programs when they are not a race (the kernel
    beside XLA or the peer)."""
    key = {"config": config, "experts": args.experts}
    if args.mxfp4_unpack != "auto":
        key["mxfp4_unpack"] = args.mxfp4_unpack
    if args.prefetch_depth is not None:
        d = args.prefetch_depth
        key["prefetch_depth"] = ",".join(map(str, d)) if isinstance(d, (list, tuple)) else d
    if tile is not None:
        key["tile"] = f"{tile[0]}x{tile[1]}"
    if getattr(args, "ctx", None) is not None:
        key["ctx"] = args.ctx
    if not {1, 8} <= set(batches):
        key["batch"] = ",".join(map(str, batches))
    if "kernel" not in impls or not {"xla", "peer"} & set(impls):
        key["impl"] = ",".join(impls)
    return key


def _run_generate(args, bench, cfg, batches, impls) -> int:
    steps = args.steps or 128
    if args.prefetch_depth is not None or args.tile is not None or args.ctx is not None:
        raise bench.BenchError("--prefetch-depth, --tile and --ctx are --mode step options")
    rows = bench.measure_generate(cfg, batches, args.experts, impls, steps, args.chunk, seed=args.seed,
                                  mxfp4_unpack=args.mxfp4_unpack)
    meta = dict(bench.metadata(cfg, args.experts, steps, 1), mode="generate", chunk=args.chunk)
    if args.json:
        from mk.perf.results import provenance
        record = provenance("generate", {"config": meta["config"], "experts": args.experts, "chunk": args.chunk},
                            bench.generate_summary(rows))
        json.dump({"record": record, "metadata": meta, "rows": rows}, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    print(f"{meta['config']} on {meta['device_kind']}, experts {meta['experts']}, device loop: {steps} decode steps "
          f"in chunks of {args.chunk}; jax {meta['jax_version']}, {meta['date']}")
    print(f"{'impl':7s} {'B':>2s} {'loop tok/s':>10s} {'ms/step':>8s} {'device ms':>9s} {'device tok/s':>12s} "
          f"{'of device':>9s} {'host ms':>8s} {'vs host':>8s}")
    for r in rows:
        if r["error"]:
            print(f"{r['impl']:7s} {r['batch']:2d}  not run: {r['error']}")
            continue
        print(f"{r['impl']:7s} {r['batch']:2d} {r['loop_tok_s']:10.1f} {r['loop_step_ms']:8.3f} "
              f"{_f(r['device_step_ms'], '9.3f')} {_f(r['device_tok_s'], '12.1f')} {_f(r['frac_of_device'], '9.3f')} "
              f"{_f(r['host_step_ms'], '8.3f')} {_f(r['loop_speedup'], '7.2f')}x")
    return 0


def _run_speculative(args, cfg, batches, ks, lengths) -> int:
    from mk.perf import bench, spec_bench
    if args.prefetch_depth is not None or args.tile is not None:
        raise bench.BenchError("--prefetch-depth and --tile are --mode step options")
    impls = [s.strip() for s in (args.impl or ",".join(spec_bench.SPEC_IMPLS)).split(",") if s.strip()]
    steps = args.steps or 32
    rows = spec_bench.measure_speculative(cfg, batches, ks, lengths, args.experts, impls, steps, args.chunk,
                                          seed=args.seed)
    meta = dict(bench.metadata(cfg, args.experts, steps, 1), mode="speculative", chunk=args.chunk)
    if not args.json:
        print(spec_bench.format_table(rows, meta))
        return 0
    from mk.perf.results import provenance
    key = {"config": meta["config"], "experts": args.experts}
    for name, value, default in (("batch", batches, [1, 2]), ("speculative", ks, [3, 7]), ("acceptance", lengths, None)):
        if value is not None and list(value) != default:
            key[name] = ",".join(map(str, value))
    record = provenance("bench_speculative", key, spec_bench.summary(rows))
    json.dump({"record": record, "metadata": meta, "rows": rows}, sys.stdout, indent=2, default=float)
    sys.stdout.write("\n")
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
    sweep = len({r.get("prefetch_depth") for r in rows if r["impl"] == "kernel"}) > 1
    for r in rows:
        impl = f"kernel@{r['prefetch_depth']}" if sweep and r["impl"] == "kernel" else r["impl"]
        if r.get("error"):
            lines.append(f"{impl:11s} {r['batch']:2d}  not run: {r['error']}")
            continue
        lines.append(
            f"{impl:11s} {r['batch']:2d} {r['median_ms']:10.3f} {r['min_ms']:8.3f} {r['max_ms']:8.3f} "
            f"{r['hbm_bytes'] / 1e9:8.3f} {_f(r['gb_s'], '7.1f')} {_f(r['frac_datasheet'], '7.2f')} "
            f"{_f(r['frac_stream'], '9.2f')} {_f(r['tok_s'], '8.1f')} "
            f"{(_f(r['kernel_speedup'], '8.2f') + 'x') if r['kernel_speedup'] else '        -'} "
            f"{_f(r.get('device_median_ms'), '9.3f')} {_f(r.get('device_frac_stream'), '9.2f')} "
            f"{(_f(r['device_speedup'], '8.2f') + 'x') if r.get('device_speedup') else '        -'}  "
            f"{r['distinct_experts']} ({r['distinct_source']})")
    for r in rows:
        if r["impl"] == "kernel" and r.get("best_other"):
            lines.append(f"B={r['batch']}: the kernel against the better of xla and peer ({r['best_other']}"
                         f"{', ' + meta['peer_format'] if r['best_other'] == 'peer' and meta.get('peer_format') else ''}"
                         f"): device {_f(r['device_speedup_vs_best'], '.2f')}x, wall {_f(r['speedup_vs_best'], '.2f')}x")
    return "\n".join(lines)
