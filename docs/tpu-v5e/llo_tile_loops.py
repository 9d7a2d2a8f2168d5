"""Bundles per weight tile in the whole kernel's deviceless v5e LLO, against the tile's time at stream.

Compiles a preset's decode step for `v5e:2x2` without a chip (libtpu's deviceless compiler, the LLO
dumped as in `llo_unpack.py`), finds every loop of the kernel's `final_bundles` that pushes weights
into the MXU (a ring matmul's tile loop: the wait for its tile, the next tile's DMA issue, the
pushes and matmuls), and compares its bundles with the tile's bytes at the stream rate. A loop that
takes fewer bundles than its tile's stream time keeps up with the DMA engine, so the weight phases are
bound by the stream, not by the core; one that takes more is the core's bound.

    python3 docs/tpu-v5e/llo_tile_loops.py --config k3-d48 [--batch 1] [--experts bf16] > RECORD.json

Bundle time is taken at the rate the chip ran mk's unpack loop (1.07 G bundles/s: 457 bundles in
0.41-0.43 us, 2026-12-06d), the stream at 795 GB/s; both are stated in the record.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

BUNDLES_PER_S = 1.07e9          # measured: the unpack loop's bundles over its time on the v5e
STREAM_BW = 795e9               # the stream every "of stream" figure divides by (docs/tpu.md)


def tile_loops(text: str) -> list[dict]:
    """Every loop of a final_bundles text that pushes MXU weights: bundles, pushes, matmuls, DMA ops."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from llo_unpack import loop_bodies
    loops = []
    for body in loop_bodies(text):
        ops = [op for b in body for op in b]
        pushes = sum(op.startswith("vmatpush") for op in ops)
        if pushes:
            loops.append({"bundles": len(body), "mxu_pushes": pushes,
                          "matmuls": sum(op.startswith("vmatmul") for op in ops),
                          "dma_ops": sum("dma" in op for op in ops)})
    return loops


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="k3-d48")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--experts", choices=("bf16", "mxfp4"), default="bf16")
    ap.add_argument("--keep", type=Path, help="dump directory to keep (default: a temporary one)")
    a = ap.parse_args(argv)
    dump = a.keep or Path(tempfile.mkdtemp(prefix="mk-llo-tiles-"))
    dump.mkdir(parents=True, exist_ok=True)
    os.environ["LIBTPU_INIT_ARGS"] = (os.environ.get("LIBTPU_INIT_ARGS", "") +
                                      f" --xla_jf_dump_to={dump} --xla_jf_dump_llo_text=true").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from mk.kernel.aot import compile_kernel
    from mk.kernel.plan import make_plan
    from mk.model.config import get_config
    from mk.perf.results import command_line, provenance

    plan = make_plan(get_config(a.config), a.batch, chip="v5e", experts=a.experts)
    r = compile_kernel(plan, "v5e:2x2")
    if not r.compiled:
        print(f"llo_tile_loops: the kernel did not compile: {r.error}", file=sys.stderr)
        return 1
    path = max((p for p in dump.iterdir() if "decode_step" in p.name and p.name.endswith("-final_bundles.txt")
                and "schedule-analysis" not in p.name), key=lambda p: p.stat().st_size)
    loops = tile_loops(path.read_text())
    bf16_tile = plan.tile_k * plan.tile_n * 2
    stream_us = bf16_tile / STREAM_BW * 1e6
    common = statistics.mode(l["mxu_pushes"] for l in loops)      # the ring's tile loops: the most of them
    full = [l for l in loops if l["mxu_pushes"] == common]
    med = statistics.median(l["bundles"] for l in full)
    core_us = med / BUNDLES_PER_S * 1e6
    summary = (f"{a.config} {a.experts} B={a.batch}, tile {plan.tile_k}x{plan.tile_n}: a bf16 tile's loop "
               f"{med:g} bundles (median of the {len(full)} ring matmul loops of {common} MXU pushes), {core_us:.3f} us at "
               f"{BUNDLES_PER_S / 1e9:.2f} G bundles/s against {stream_us:.3f} us of stream "
               f"({core_us / stream_us:.2f} of it; deviceless v5e LLO)")
    record = provenance("llo", {"chip": "v5e", "config": a.config, "experts": a.experts, "batch": a.batch,
                                "loops": "tile"}, summary)
    record.update(chip="tpu-v5e", device_kind="deviceless compile (libtpu, v5e:2x2 topology) on a CPU host",
                  command=command_line("docs/tpu-v5e/llo_tile_loops.py", argv))
    print(json.dumps({
        "record": record,
        "tile": [plan.tile_k, plan.tile_n], "prefetch_depth": plan.prefetch_depth,
        "bundles_per_s": BUNDLES_PER_S, "stream_bw": STREAM_BW, "bf16_tile_bytes": bf16_tile,
        "median_full_tile_bundles": med, "core_us_per_tile": core_us, "stream_us_per_tile": stream_us,
        "loops": loops}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
