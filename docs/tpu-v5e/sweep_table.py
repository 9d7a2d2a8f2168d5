"""The depth family's sweep as markdown, from the records under docs/: for each preset, expert format and
batch, the kernel's device ms, the better rival's and the edge, and the kernel's share of the stream
counted with the experts the steps routed. Reads records only; prints to stdout.

    python3 docs/tpu-v5e/sweep_table.py [--root docs]

Each case is the newest bench row on the kernel's defaults (`mk.notebooks.helpers.newest_cases`), its
rivals those of `mk.notebooks.helpers.races` (what the README's figure draws): the better of the fair
XLA step and the peer with bf16 experts, the int4 peer with MXFP4. "Of
stream" divides `mk.perf.bench.step_bytes` of the routed experts by the device time and the stream
bandwidth of data/microbench.csv. The routed experts of a case come from a record that counted them at
that preset and batch: a bench's XLA step (either format: the same seed draws the same router and
tokens; a quantized expert may move a near tie) or `routed_counts.py` on CPU (the chip's first), the same format first.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

BATCHES = (1, 2, 4, 8)


def routed_counts(records) -> dict:
    """{(config, experts, batch): (distinct experts per MoE layer, record file, rank)}: the newest count a
    chip's XLA step made, else the newest made on CPU."""
    from mk.perf.results import current
    out = {}
    for path, rec in current(records):
        if rec["kind"] not in ("bench", "routing"):
            continue
        for r in json.loads(path.read_text()).get("rows", []):
            if str(r.get("distinct_source", "")).startswith("routed"):
                k = (rec["key"].get("config"), rec["key"].get("experts"), r["batch"])
                rank = (rec["kind"] == "bench", rec["date"])      # the chip's count before a CPU's
                if k not in out or rank >= out[k][2]:
                    out[k] = (r["distinct_experts"], path.name, rank)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", default=None, help="the records' folder (default: the repository's docs/)")
    args = p.parse_args(argv)
    from mk.model.config import DEPTH_PRESETS, get_config
    from mk.notebooks.helpers import edge, newest_cases, races
    from mk.perf.bench import bandwidths, step_bytes
    from mk.perf.results import REPO, find_records
    records = find_records(args.root or os.path.join(REPO, "docs"))
    cases, raced, counts = newest_cases(records), races(records), routed_counts(records)
    stream = bandwidths("tpu-v5e")["stream_bw"]
    print(f"kernel device ms / the better rival's (edge); of stream: routed bytes / time / {stream / 1e9:.0f} GB/s\n")
    print("| preset | experts | " + " | ".join(f"B = {b}" for b in BATCHES) + " |")
    print("|---|---|" + "---|" * len(BATCHES))
    share = {}
    for config in DEPTH_PRESETS:
        for experts in ("bf16", "mxfp4"):
            cells = []
            for b in BATCHES:
                k = cases.get((config, experts, b, "kernel"))
                if not k:
                    cells.append("not run")
                    continue
                ms, race = k["device_median_ms"], raced.get((config, experts, b))
                cells.append(f"{ms:.2f} / {edge(race) * ms:.2f} ({edge(race):.2f}x)" if race else f"{ms:.2f} / -")
                got = counts.get((config, experts, b)) or counts.get((config, "bf16" if experts == "mxfp4" else "mxfp4", b))
                if got:
                    nbytes = step_bytes(get_config(config), b, experts, got[0])["hbm_bytes"]
                    share[config, experts, b] = (nbytes / (ms / 1e3) / stream, got[1])
            print(f"| `{config}` | {experts} | " + " | ".join(cells) + " |")
    print("\n| preset | experts | " + " | ".join(f"of stream, B = {b}" for b in BATCHES) + " |")
    print("|---|---|" + "---|" * len(BATCHES))
    for config in DEPTH_PRESETS:
        for experts in ("bf16", "mxfp4"):
            cells = [f"{share[config, experts, b][0]:.3f}" if (config, experts, b) in share else "-" for b in BATCHES]
            print(f"| `{config}` | {experts} | " + " | ".join(cells) + " |")
    print("\nrouted counts from: " + ", ".join(sorted({v[1] for v in share.values()})))
    return 0


if __name__ == "__main__":
    sys.exit(main())
