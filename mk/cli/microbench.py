"""`python -m mk microbench`: measure, on a TPU, the constants `mk simulate` otherwise assumes.

On a TPU VM: times the kernels of `mk.perf.microbench` (MXU weight push, DMA latency and streaming,
vector rates), prints the curves and the constants, and with `--write FILE` writes a copy of
data/microbench.csv in which the measured chip's rows (e.g. tpu-v5e on "TPU v5 lite") are added or
replaced and every other chip's are kept, for `mk simulate --microbench FILE`. Anywhere:
`--check` runs every kernel once in TPU interpret mode against numpy, and `--compile TOPOLOGY`
compiles them for a TPU topology on this machine. Nothing is timed off a TPU.
"""
from __future__ import annotations

import json
import sys

from mk.cli.common import positive_int
from mk.errors import writable_path


def add_parser(subparsers):
    p = subparsers.add_parser("microbench", help="measure the simulator's assumed TPU constants on a TPU",
                              description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true",
                   help="run each kernel once in TPU interpret mode (CPU) and compare with numpy; no timing")
    p.add_argument("--compile", metavar="TOPOLOGY", default=None,
                   help="compile each kernel at its timed size for a TPU topology (e.g. tpu7x:2x2x1); no timing")
    p.add_argument("--trials", type=positive_int, default=5, help="timed runs per point; the best counts (default 5)")
    p.add_argument("--write", metavar="CSV", default=None,
                   help="write a copy of data/microbench.csv to this file with the measured chip's rows (jax's device "
                        "kind, e.g. 'TPU v5 lite' -> tpu-v5e) added or replaced; other chips' rows as they are")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def run(args) -> int:
    from mk.perf import microbench as mb
    from mk.cli.common import progress

    if args.write:                                 # before minutes of timing, and before the TPU check
        writable_path(args.write, "--write")
    if args.check or args.compile:
        out = {}
        if args.check:
            out["check"] = mb.check()
        if args.compile:
            out["compile"] = mb.compile_all(args.compile)
        ok = all(r["ok"] for r in out.get("check", ())) and all(r["compiled"] for r in out.get("compile", ()))
        if args.json:
            json.dump(out | {"ok": ok}, sys.stdout, indent=2)
            sys.stdout.write("\n")
        else:
            for r in out.get("check", ()):
                print(f"check   {r['name']:18s} {'ok' if r['ok'] else 'WRONG'}  (max rel. error {r['max_err']:.1e}, interpret mode)")
            for r in out.get("compile", ()):
                print(f"compile {r['name']:18s} {'compiled' if r['compiled'] else 'FAILED: ' + str(r['error'])}"
                      f"  ({args.compile})")
        return 0 if ok else 1

    bar = progress(desc="microbench", total=len(mb.MXU_ROWS) + len(mb.MXU_DTYPES) - 1 + len(mb.DMA_SIZES) + len(mb.STREAM_POINTS) + 1)

    def step(what):
        bar.set_postfix_str(what)
        bar.update(1)

    res = mb.measure(args.trials, step)
    bar.close()
    res["implausible"] = mb.implausible(res)
    refused = mb.implausible_by_constant(res)
    if args.write:
        keep = {k: v for k, v in res["constants"].items() if k not in refused}
        if not keep:
            raise mb.MicrobenchError(f"--write: not writing {args.write}: no constant's timings are plausible "
                                     f"({'; '.join(res['implausible'][:3])}); run it again on an idle chip")
        res["written"] = str(mb.write_microbench_csv(keep, args.write, mb.source_label(res["device_kind"]), res["chip"]))
        res["not_written"] = sorted(refused)
        for k in sorted(refused):
            print(f"--write: {k} not written ({'; '.join(refused[k][:2])})", file=sys.stderr)
    if args.json:
        from mk.perf.results import provenance
        c = res["constants"]
        summary = (f"stream {c['dma_stream_bw'] / 1e9:.0f} GB/s, descriptor latency {c['dma_descriptor_latency'] * 1e6:.2f} us, "
                   f"push rows {c['mxu_push_rows']:.1f}, dequant {c['dequant_op_rate']:.3g} op/s"
                   + (f"; not written: {', '.join(res['not_written'])}" if res.get("not_written") else ""))
        json.dump({"record": provenance("microbench", {}, summary)} | res, sys.stdout, indent=2, default=float)
        sys.stdout.write("\n")
        return 0
    print(f"measured on {res['device_kind']} (one TensorCore; best of {args.trials} runs per point, "
          f"time per repeat by difference of two repeat counts)")
    print(f"MXU [R, {mb.MXU_K}] @ [{mb.MXU_K}, {mb.MXU_N}] bf16 from VMEM:")
    for rows, r in res["mxu"].items():
        print(f"  R = {rows:4d}: {r['s'] * 1e6:8.2f} us per matmul  (as if {r['push_rows']:6.1f} rows at peak)")
    for name, r in res.get("mxu_dtypes", {}).items():
        print(f"  {name:>8s} at R = {mb.DTYPE_ROWS}: {r['s'] * 1e6:8.2f} us per matmul = {r['vs_bf16']:.2f}x bf16's")
    print("DMA HBM -> VMEM:")
    for nbytes, r in res["dma"].items():
        print(f"  {nbytes >> 10:5d} KiB: one at a time {r['s_one_at_a_time'] * 1e6:8.2f} us, "
              f"{mb.DMA_INFLIGHT} in flight {r['stream_bw'] / 1e12:5.2f} TB/s")
    print(f"HBM -> VMEM stream ({mb.STREAM_BYTES[0] >> 20} MiB against {mb.STREAM_BYTES[1] >> 20} MiB of copies):")
    for name, r in res["stream"].items():
        print(f"  {name:>10s}: {r['s_per_copy'] * 1e6:8.2f} us per copy = "
              f"{(r['stream_bw'] or 0) / 1e9:6.1f} GB/s")
    print(f"constants (data/microbench.csv rows, {res['chip']}):")
    for k, v in res["constants"].items():
        print(f"  {k:24s} {v:.4g}")
    if args.write:
        print(f"wrote {res['written']}: model with it by `python -m mk simulate --microbench {res['written']}`")
    return 0
