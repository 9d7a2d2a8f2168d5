"""The experts a bench's steps route, counted on this machine's CPU: `mk bench`'s fair XLA step (with its
routing output) over the same weights, tokens and steps as `mk bench --config C --experts E --batch
B,.. --seed S` draws, for a case whose chip call ran no XLA step (the kernel and the peer alone).
`mk simulate --routed-from` reads the file as it reads a bench's XLA rows.

    python3 docs/tpu-v5e/routed_counts.py --config k3-d48 --experts mxfp4 --batch 2,4 > FILE.json

JSON on stdout: {"record": {...} (kind "routing", a detail record: not a chip measurement),
"metadata": {config, experts, ...}, "rows": [{"impl": "xla", "batch", "distinct_experts" (mean per MoE
layer over the timed steps), "distinct_source": "routed (xla step, on CPU)"}]}; progress on stderr.

XLA on a CPU rounds as XLA on a TPU does not, so a row at a routing near tie may pick another expert
here than on the chip: the counts are the same function's, close to the chip's, not the chip's.
Check them against a case the chip counted (`--compare BENCH.json`: the largest difference per layer).
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
import time

import numpy as np


def log(msg: str):
    print(f"routed_counts: {msg}", file=sys.stderr, flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True)
    p.add_argument("--experts", choices=("bf16", "mxfp4"), default="bf16")
    p.add_argument("--batch", default="2,4", help="the bench's --batch, in its order (it draws the tokens so)")
    p.add_argument("--steps", type=int, default=8, help="the bench's --steps")
    p.add_argument("--warmup", type=int, default=3, help="the bench's --warmup")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compare", default=None, help="a chip bench of the same case with XLA rows: print the difference")
    args = p.parse_args(argv)

    import jax

    from mk.model import reference
    from mk.model.config import get_config
    from mk.model.params import init_fast
    from mk.perf import baseline
    from mk.perf.bench import CTX as ctx, _distinct, bench_tokens, time_steps
    from mk.perf.results import command_line, provenance

    cfg = get_config(args.config)
    batches = [int(b) for b in args.batch.split(",")]
    t0 = time.perf_counter()
    params = jax.block_until_ready(init_fast(cfg, args.seed, args.experts))
    log(f"{args.config} weights ({args.experts} experts) in {time.perf_counter() - t0:.1f} s")
    tokens = bench_tokens(cfg, batches, args.warmup + args.steps, args.seed)
    step = functools.partial(baseline.make_baseline_step(cfg, args.experts, "loop", routing=True), params)
    rows = []
    for B in batches:
        seen = []
        t0 = time.perf_counter()
        time_steps(step, lambda: reference.init_cache(cfg, B, ctx), tokens[B], args.warmup, ctx,
                   on_output=lambda t, out: seen.append(_distinct(out[2])) if t >= args.warmup else None)
        mean = np.mean(np.stack(seen), axis=0)
        log(f"B={B}: {np.mean(mean):.3f} distinct experts per MoE layer ({time.perf_counter() - t0:.1f} s)")
        rows.append({"impl": "xla", "batch": B, "experts": args.experts, "error": None,
                     "distinct_experts": [round(float(x), 3) for x in mean],
                     "distinct_source": "routed (xla step, on CPU)"})
    if args.compare:
        chip = {r["batch"]: r for r in json.load(open(args.compare))["rows"]
                if str(r.get("distinct_source", "")).startswith("routed") and r.get("impl") == "xla"}
        for r in rows:
            if r["batch"] in chip:
                d = np.abs(np.subtract(r["distinct_experts"], chip[r["batch"]]["distinct_experts"]))
                r["chip_difference"] = {"max": float(d.max()), "mean": float(d.mean()), "bench": args.compare}
                log(f"B={r['batch']}: against the chip's {args.compare}: largest difference {d.max():.3f} "
                    f"experts per layer, mean {d.mean():.3f}")
    summary = "; ".join(f"B={r['batch']}: {np.mean(r['distinct_experts']):.2f} distinct experts per MoE layer" for r in rows)
    record = provenance("routing", {"config": args.config, "experts": args.experts, "batch": args.batch},
                        summary + " (the fair XLA step on CPU)")
    record["command"] = command_line("docs/tpu-v5e/routed_counts.py", argv)
    meta = {"config": args.config, "experts": args.experts, "seed": args.seed, "steps": args.steps,
            "warmup": args.warmup, "device_kind": jax.devices()[0].device_kind, "date": record["date"],
            "backend": jax.default_backend()}
    json.dump({"record": record, "metadata": meta, "rows": rows}, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
