#!/usr/bin/env bash
# What the depth family still needs on the lent TPU v5e (after 2026-12-06g), one call of under 10 minutes
# per part. Write the commit out here (the VM's copy of .git may be stale, 2026-12-06g/NOTES.md):
#   MK_COMMIT=<hash> MK_DIRTY=0 OUT=DIR bash docs/tpu-v5e/run-depth-next.sh phases
#       the kernel's phases from its region trace ('XLA TraceMe', phase_trace.py): k3-d48 bf16 at B = 8
#       (the 0.75 of stream to explain) and B = 1 in one process, k3-d12 MXFP4 at B = 1 (~9 min; the
#       first try, three processes of 150-175 s, each ran out of time after reading its events)
#   ... run-depth-next.sh mxfp4tile
#       MXFP4 at thin widths with 512-row tiles (the v5e's LLO: 1.26x fewer bundles per weight than
#       256 x 256): k3-d12 and k3-d48, kernel only, B = 1, 8, tiles 512x512 and 512x256 (~7 min)
#   ... run-depth-next.sh middle
#       B = 2 and 4 at 48 layers, bf16, kernel / XLA / peer (run-depth.sh k3-d48 bf16 2,4; ~8 min)
# Carry .whl-tpu (make tpu-wheels && make peer-wheels PEER_WHEELS=.whl-tpu).
set -u
case "${1:?which part: phases, mxfp4tile or middle}" in
  phases) STEP_PAUSE=1 source docs/tpu-v5e/steps.sh
     step phase-k3d48-bf16 330 python3 docs/tpu-v5e/phase_trace.py --config k3-d48 --batch 8,1 --experts bf16 --out "$OUT"
     step phase-k3d12-mxfp4 200 python3 docs/tpu-v5e/phase_trace.py --config k3-d12 --batch 1 --experts mxfp4 --out "$OUT" ;;
  mxfp4tile) STEP_PAUSE=1 source docs/tpu-v5e/steps.sh
     for t in 512x512 512x256; do
       step bench-k3d12-mxfp4-t$t 110 python3 -m mk bench --config k3-d12 --experts mxfp4 --impl kernel --batch 1,8 --steps 8 --tile $t --json
       step bench-k3d48-mxfp4-t$t 120 python3 -m mk bench --config k3-d48 --experts mxfp4 --impl kernel --batch 1,8 --steps 8 --tile $t --json
     done ;;
  middle) bash docs/tpu-v5e/run-depth.sh k3-d48 bf16 2,4 ;;
esac
for f in "$OUT"/*.out; do [ -s "$f" ] && mv "$f" "${f%.out}.json"; done
true
