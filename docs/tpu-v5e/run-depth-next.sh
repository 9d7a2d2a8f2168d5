#!/usr/bin/env bash
# What the depth family still needs on the lent TPU v5e (after 2026-12-07), one call of under 10 minutes
# per part. Write the commit out here (the VM's copy of .git may be stale, 2026-12-06g/NOTES.md):
#   MK_COMMIT=<hash> MK_DIRTY=0 OUT=DIR bash docs/tpu-v5e/run-depth-next.sh depth
#       first: the prefetch depth at 48 layers, the kernel alone (`--prefetch-depth` a sweep, the weights
#       drawn once): the simulator has the weight stream stall through each long non-streaming phase
#       (MLA attention, the delta rule at B = 8) while only the default 2 MiB are in flight, and models
#       bf16 B = 8 at 7.95 -> 7.27 ms from depth 16 to 128, MXFP4 B = 8 at 7.85 -> 6.49 ms from 4 to 32
#       (modelled); each case about 25-33 s after 50 s of weights (~9 min)
#   ... run-depth-next.sh check
#       the verify step on the chip under the chip policy (each emitted token against the CPU oracle
#       teacher-forced along them): mini, one sequence and 2 sequences x (1 + 3) rows; then k3-chip's
#       MXFP4 step beside the int4 peer, never raced so (~7 min)
#   ... run-depth-next.sh retime
#       the kernel alone after the delta rule's unroll, MLA's next-row fetch, the 16-position write back
#       and beta's broadcast out of the heads loop (the last two since 2026-12-07), bf16 B = 1, 8 at
#       k3-chip, k3-d12, k3-d24 (their races are 2026-12-06e/g's), then k3-d48 at B = 2, 4 (~8 min)
#   ... run-depth-next.sh middle
#       k3-d48 at B = 2, 4: the peer with bf16 experts (XLA and the peer's B = 2 ran on 2026-12-07),
#       then MXFP4 kernel / int4 peer (~9 min)
#   ... run-depth-next.sh mxfp4race
#       MXFP4 on its default tile raced beside the int4 peer at k3-d24 and k3-d48, B = 1, 8, in one
#       call each with room for the weights (50 s) and the peer's compile (2026-12-07's 150 s limits cut
#       both) (~8 min)
# Carry .whl-tpu (make tpu-wheels && make peer-wheels PEER_WHEELS=.whl-tpu).
set -u
case "${1:?which part: depth, check, retime, middle or mxfp4race}" in
  depth) STEP_PAUSE=1 source docs/tpu-v5e/steps.sh
     step bench-k3-d48-bf16-depths 250 python3 -m mk bench --config k3-d48 --experts bf16 --impl kernel --batch 1,8 --prefetch-depth 16,64,128 --steps 8 --json
     step bench-k3-d48-mxfp4-depths 250 python3 -m mk bench --config k3-d48 --experts mxfp4 --impl kernel --batch 1,8 --prefetch-depth 4,16,32 --steps 8 --json ;;
  check) STEP_PAUSE=1 source docs/tpu-v5e/steps.sh
     step check-mini-verify-b1 120 python3 -m mk check --config mini --speculative 3 --json
     step check-mini-verify-b2 150 python3 -m mk check --config mini --batch 2 --speculative 3 --json
     step bench-k3-chip-mxfp4-peer 160 python3 -m mk bench --config k3-chip --experts mxfp4 --impl kernel,peer --batch 1,8 --steps 8 --json ;;
  retime) STEP_PAUSE=1 source docs/tpu-v5e/steps.sh
     for c in k3-chip k3-d12 k3-d24; do
       step bench-$c-bf16-kernel 110 python3 -m mk bench --config $c --experts bf16 --impl kernel --batch 1,8 --steps 8 --json
     done
     step bench-k3-d48-bf16-kernel-b24 120 python3 -m mk bench --config k3-d48 --experts bf16 --impl kernel --batch 2,4 --steps 8 --json ;;
  middle) STEP_PAUSE=1 source docs/tpu-v5e/steps.sh
     step bench-k3-d48-bf16-peer-b4 200 python3 -m mk bench --config k3-d48 --experts bf16 --impl peer --batch 4 --steps 6 --json
     step bench-k3-d48-mxfp4-peer-b24 330 python3 -m mk bench --config k3-d48 --experts mxfp4 --impl kernel,peer --batch 2,4 --steps 6 --json ;;
  mxfp4race) STEP_PAUSE=1 source docs/tpu-v5e/steps.sh
     for c in k3-d24 k3-d48; do
       step bench-$c-mxfp4-peer 240 python3 -m mk bench --config $c --experts mxfp4 --impl kernel,peer --batch 1,8 --steps 8 --json
     done ;;
esac
for f in "$OUT"/*.out; do [ -s "$f" ] && mv "$f" "${f%.out}.json"; done
true
