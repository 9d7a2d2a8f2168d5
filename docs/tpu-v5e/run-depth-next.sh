#!/usr/bin/env bash
# What the depth family still needs on the lent TPU v5e (after 2026-12-06h), one call of under 10 minutes
# per part. Write the commit out here (the VM's copy of .git may be stale, 2026-12-06g/NOTES.md):
#   MK_COMMIT=<hash> MK_DIRTY=0 OUT=DIR bash docs/tpu-v5e/run-depth-next.sh phases
#       the kernel's phases with the delta rule unrolled 4 heads a trip (mk.kernel.kda.HEADS_UNROLL):
#       k3-d48 bf16 at B = 8 and 1 in one process (255 s on 2026-12-06h), then the kernel's k3-d48 bf16
#       step at B = 1, 8 (6.29 / 9.21 ms before the unroll, 2026-12-06g) (~8 min)
#   ... run-depth-next.sh mxfp4race
#       MXFP4 on its default tile (512 x 512 since 2026-12-06h) raced beside the int4 peer: k3-d12,
#       k3-d24, k3-d48 at B = 1, 8 (~8 min)
#   ... run-depth-next.sh middle
#       B = 2 and 4 at 48 layers, bf16, kernel / XLA / peer (run-depth.sh k3-d48 bf16 2,4; ~8 min)
#   ... run-depth-next.sh check
#       the kernel since 2026-12-06h (the delta rule unrolled, MLA's next-row fetch, MXFP4 on 512 x 512
#       at thin widths) against XLA on the chip and the CPU oracle: mini at B = 8 with both expert
#       formats, a verify step at B = 2 x 4 rows (rows of one sequence), then k3-chip MXFP4 at B = 8 (~8 min)
# Carry .whl-tpu (make tpu-wheels && make peer-wheels PEER_WHEELS=.whl-tpu).
set -u
case "${1:?which part: phases, mxfp4race, middle or check}" in
  phases) STEP_PAUSE=1 source docs/tpu-v5e/steps.sh
     step phase-k3d48-bf16 300 python3 docs/tpu-v5e/phase_trace.py --config k3-d48 --batch 8,1 --experts bf16 --out "$OUT"
     step bench-k3d48-bf16-kernel 150 python3 -m mk bench --config k3-d48 --experts bf16 --impl kernel --batch 1,8 --steps 8 --json ;;
  mxfp4race) STEP_PAUSE=1 source docs/tpu-v5e/steps.sh
     for c in k3-d12 k3-d24 k3-d48; do
       step bench-$c-mxfp4-peer 150 python3 -m mk bench --config $c --experts mxfp4 --impl kernel,peer --batch 1,8 --steps 8 --json
     done ;;
  middle) bash docs/tpu-v5e/run-depth.sh k3-d48 bf16 2,4 ;;
  check) STEP_PAUSE=1 source docs/tpu-v5e/steps.sh
     step check-mini-mxfp4-b8 100 python3 -m mk check --config mini --batch 8 --steps 4 --json
     step check-mini-bf16-b8 100 python3 -m mk check --config mini --batch 8 --steps 4 --experts bf16 --json
     step check-mini-verify 100 python3 -m mk check --config mini --batch 2 --speculative 3 --json
     step check-k3chip-mxfp4-b8 240 python3 -m mk check --config k3-chip --batch 8 --steps 4 --json ;;
esac
for f in "$OUT"/*.out; do [ -s "$f" ] && mv "$f" "${f%.out}.json"; done
true
