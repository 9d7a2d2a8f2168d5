"""Parallel prefill vs token-by-token on this TPU (`mk.perf.prefill_bench.prefill_bench`), as JSON on stdout:
{"record": {...}, "metadata": {...}, "rows": [...]} (a measurement record, `mk.perf.results`, kind "prefill");
one `prefill bench:` line per case on stderr.

    python3 docs/tpu-v5e/prefill_bench.py --config k3-chip --experts bf16 --lengths 128,1024,4096 \
        --token-lengths 128,1024

Off a TPU it refuses (one line, exit 2).
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys


def main(argv=None) -> int:
    from mk.cli.common import int_list
    from mk.errors import UserError

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="k3-chip")
    p.add_argument("--experts", choices=("bf16", "mxfp4"), default="bf16")
    p.add_argument("--lengths", default="128,1024,4096", help="prompt lengths timed in parallel")
    p.add_argument("--token-lengths", default="128,1024", help="prompt lengths also timed token by token")
    p.add_argument("--reps", type=int, default=3, help="timed calls per case, after one untimed")
    p.add_argument("--chunk", type=int, default=None, help="prompt tokens per program (default mk.perf.prefill's)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        import jax
        from mk.model.config import get_config
        from mk.perf.prefill_bench import prefill_bench, prefill_summary
        from mk.perf.results import command_line, provenance
        cfg = get_config(args.config)
        lengths = int_list(args.lengths, "--lengths")
        token_lengths = int_list(args.token_lengths, "--token-lengths") if args.token_lengths else []
        rows = prefill_bench(cfg, lengths, args.experts, token_lengths, args.reps, args.chunk, args.seed,
                             log=lambda m: print(m, file=sys.stderr, flush=True))
    except UserError as e:
        print(f"prefill_bench: {e}", file=sys.stderr)
        return 2
    meta = {"config": args.config, "experts": args.experts, "device_kind": jax.devices()[0].device_kind,
            "jax_version": jax.__version__, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "reps": args.reps}
    record = provenance("prefill", {"config": args.config, "experts": args.experts}, prefill_summary(rows))
    record["command"] = command_line("docs/tpu-v5e/prefill_bench.py", argv)
    json.dump({"record": record, "metadata": meta, "rows": rows}, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
