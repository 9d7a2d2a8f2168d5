#!/usr/bin/env bash
# What the depth family still needs on the lent TPU v5e (after 2026-12-07b), one call of under 10
# minutes per part. Write the commit out here (the VM's copy of .git may be stale, 2026-12-06g/NOTES.md):
#   MK_COMMIT=<hash> MK_DIRTY=0 OUT=DIR bash docs/tpu-v5e/run-depth-next.sh retime
#       the kernel alone on the default ring of 2026-12-07b (8 MiB in flight with bf16 experts) at
#       B = 2, 4 for k3-chip, k3-d12, k3-d24 and k3-d48 (B = 1, 8 ran in the depth sweeps) (~8 min)
#   ... run-depth-next.sh mxfp4race
#       MXFP4 on its default ring (32 tiles of 512 x 512 since 2026-12-07b) raced beside the int4 peer at
#       k3-d12 and k3-d24, B = 1, 8, with room for the weights and the peer's compile (~8 min)
#   ... run-depth-next.sh middle
#       k3-d48 at B = 2, 4: the peer with bf16 experts (XLA and the peer's B = 2 ran on 2026-12-07),
#       then MXFP4 kernel / int4 peer (~9 min)
#   ... run-depth-next.sh check
#       the kernel with its write backs in flight (2026-12-07c) checked on the chip: mini B = 8 steps,
#       then the verify step under the chip policy with its routing near-tie rule, one and 2 sequences
#       x (1 + 3) rows (its flip of 2026-12-07b/c was a routing near tie; see docs/tpu.md) (~5 min)
#   ... run-depth-next.sh trace
#       the verify check at one sequence (kernel logits kept), then the region trace on the default ring
#       of 2026-12-07b: k3-d48 bf16 B = 1 and k3-chip bf16 B = 1, 8 (~8 min)
#   ... run-depth-next.sh stream
#       mk microbench (not written to data/): the stream sweep with the kernel's own rings, 128 KiB x 64
#       (the depth family's 256 x 256 tiles) and 512 KiB x 16 (k3-chip's): does the tile size bound 48
#       layers' share of the stream? Then k3-chip's region trace at B = 1 (cut at 170 s on 2026-12-07c) (~8 min)
#   ... run-depth-next.sh inflight
#       the kernel with its write backs in flight past the layer and MLA's first block fetched early:
#       k3-d48 and k3-chip, bf16 B = 1, 8 and MXFP4 B = 1, 8 (k3-chip MXFP4 also B = 2, 4) (~9 min)
#   ... run-depth-next.sh fillA
#       the kernel with its write backs in flight checked on the chip (mini B = 8 steps, the verify step under
#       the routing near-tie rule), the stream sweep alone (stream_sweep.py), then k3-chip bf16 at B = 2, 4:
#       kernel, XLA and peer (~7 min)
#   ... run-depth-next.sh fillB
#       k3-d12 and k3-d24 bf16 at B = 2, 4: kernel, XLA and peer (~7 min)
#   ... run-depth-next.sh fillC
#       k3-d12 and k3-d24 MXFP4 at B = 2, 4: kernel and int4 peer; k3-chip's int4 peer at B = 2, 4 (~7 min)
#   ... run-depth-next.sh fillD
#       k3-d48 MXFP4 at B = 2, 4: kernel and int4 peer (~5 min)
# Carry .whl-tpu (make tpu-wheels && make peer-wheels PEER_WHEELS=.whl-tpu).
set -u
case "${1:?which part: fillA..fillD, retime, mxfp4race, middle, check, trace, stream or inflight}" in
  retime) STEP_PAUSE=1 source docs/tpu-v5e/steps.sh
     for c in k3-chip k3-d12 k3-d24 k3-d48; do
       step bench-$c-bf16-kernel-b24 110 python3 -m mk bench --config $c --experts bf16 --impl kernel --batch 2,4 --steps 8 --json
     done ;;
  mxfp4race) STEP_PAUSE=1 source docs/tpu-v5e/steps.sh
     for c in k3-d12 k3-d24; do
       step bench-$c-mxfp4-peer 240 python3 -m mk bench --config $c --experts mxfp4 --impl kernel,peer --batch 1,8 --steps 8 --json
     done ;;
  middle) STEP_PAUSE=1 source docs/tpu-v5e/steps.sh
     step bench-k3-d48-bf16-peer-b4 200 python3 -m mk bench --config k3-d48 --experts bf16 --impl peer --batch 4 --steps 6 --json
     step bench-k3-d48-mxfp4-peer-b24 330 python3 -m mk bench --config k3-d48 --experts mxfp4 --impl kernel,peer --batch 2,4 --steps 6 --json ;;
  check) STEP_PAUSE=1 source docs/tpu-v5e/steps.sh
     step check-mini-mxfp4-b8 120 python3 -m mk check --config mini --batch 8 --steps 4 --json
     step check-mini-verify-b1 120 python3 -m mk check --config mini --speculative 3 --json
     step check-mini-verify-b2 150 python3 -m mk check --config mini --batch 2 --speculative 3 --json ;;
  trace) STEP_PAUSE=1 source docs/tpu-v5e/steps.sh
     step check-mini-verify-b1 150 python3 -m mk check --config mini --speculative 3 --json
     step phase-k3-d48 200 python3 docs/tpu-v5e/phase_trace.py --config k3-d48 --batch 1 --experts bf16 --out "$OUT"
     step phase-k3-chip 170 python3 docs/tpu-v5e/phase_trace.py --config k3-chip --batch 8,1 --experts bf16 --out "$OUT" ;;
  stream) STEP_PAUSE=1 source docs/tpu-v5e/steps.sh
     step microbench 240 python3 -m mk microbench --json
     step phase-k3-chip 240 python3 docs/tpu-v5e/phase_trace.py --config k3-chip --batch 1 --experts bf16 --out "$OUT" ;;
  inflight) STEP_PAUSE=1 source docs/tpu-v5e/steps.sh
     step bench-k3-d48-bf16-kernel 150 python3 -m mk bench --config k3-d48 --experts bf16 --impl kernel --batch 1,8 --steps 8 --json
     step bench-k3-chip-bf16-kernel 100 python3 -m mk bench --config k3-chip --experts bf16 --impl kernel --batch 1,8 --steps 8 --json
     step bench-k3-d48-mxfp4-kernel 150 python3 -m mk bench --config k3-d48 --experts mxfp4 --impl kernel --batch 1,8 --steps 8 --json
     step bench-k3-chip-mxfp4-kernel 130 python3 -m mk bench --config k3-chip --experts mxfp4 --impl kernel --batch 1,2,4,8 --steps 8 --json ;;
  fillA) STEP_PAUSE=1 source docs/tpu-v5e/steps.sh
     step check-mini-mxfp4-b8 110 python3 -m mk check --config mini --batch 8 --steps 4 --json
     step check-mini-verify-b1 140 python3 -m mk check --config mini --speculative 3 --json
     step stream-sweep 80 python3 docs/tpu-v5e/stream_sweep.py
     step bench-k3-chip-bf16-b24 200 python3 -m mk bench --config k3-chip --experts bf16 --impl kernel,xla,peer --batch 2,4 --steps 8 --json ;;
  fillB) STEP_PAUSE=1 source docs/tpu-v5e/steps.sh
     step bench-k3-d12-bf16-b24 240 python3 -m mk bench --config k3-d12 --experts bf16 --impl kernel,xla,peer --batch 2,4 --steps 8 --json
     step bench-k3-d24-bf16-b24 310 python3 -m mk bench --config k3-d24 --experts bf16 --impl kernel,xla,peer --batch 2,4 --steps 8 --json ;;
  fillC) STEP_PAUSE=1 source docs/tpu-v5e/steps.sh
     step bench-k3-d12-mxfp4-b24 180 python3 -m mk bench --config k3-d12 --experts mxfp4 --impl kernel,peer --batch 2,4 --steps 8 --json
     step bench-k3-d24-mxfp4-b24 230 python3 -m mk bench --config k3-d24 --experts mxfp4 --impl kernel,peer --batch 2,4 --steps 8 --json
     step bench-k3-chip-mxfp4-peer-b24 120 python3 -m mk bench --config k3-chip --experts mxfp4 --impl peer --batch 2,4 --steps 8 --json ;;
  fillD) STEP_PAUSE=1 source docs/tpu-v5e/steps.sh
     step bench-k3-d48-mxfp4-b24 340 python3 -m mk bench --config k3-d48 --experts mxfp4 --impl kernel,peer --batch 2,4 --steps 8 --json ;;
esac
for f in "$OUT"/*.out; do [ -s "$f" ] && mv "$f" "${f%.out}.json"; done
true
