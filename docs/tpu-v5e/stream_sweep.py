"""The HBM -> VMEM stream alone on this TPU: `mk microbench`'s stream sweep without its other families.

Does the chunk size bound the kernel's share of the stream? The depth presets stream 256 x 256 bf16
tiles (128 KiB copies, 64 in flight by default), k3-chip 512 x 512 ones (512 KiB, 16 in flight);
`mk.perf.microbench.STREAM_POINTS` holds both rings and larger chunks. JSON on stdout: {"record":
{...} (kind "stream_sweep"), "stream": {"CHUNKxINFLIGHT": {chunk_bytes, inflight, s_per_copy,
stream_bw}}, "relative": {point: stream_bw / the fastest point's}}; progress on stderr.

    python3 docs/tpu-v5e/stream_sweep.py [--trials 5]

Off a TPU it refuses (one line, exit 2).
"""
from __future__ import annotations

import argparse
import json
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=5, help="timed runs per point; the best counts")
    args = p.parse_args(argv)
    import jax
    if jax.default_backend() != "tpu":
        print(f"stream_sweep: times the stream on a TPU; this backend is {jax.default_backend()!r}", file=sys.stderr)
        return 2
    from mk.perf.microbench import stream_rates
    from mk.perf.results import command_line, provenance
    stream = stream_rates(args.trials, lambda what: print(f"stream_sweep: {what}", file=sys.stderr, flush=True))
    best = max(r["stream_bw"] or 0.0 for r in stream.values())
    relative = {k: (r["stream_bw"] or 0.0) / best for k, r in stream.items()}
    summary = ", ".join(f"{k} {r['stream_bw'] / 1e9:.0f} GB/s" for k, r in stream.items() if r["stream_bw"])
    record = provenance("stream_sweep", {}, summary)
    record["command"] = command_line("docs/tpu-v5e/stream_sweep.py", argv)
    json.dump({"record": record, "stream": stream, "relative": relative}, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
