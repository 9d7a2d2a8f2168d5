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
# Carry .whl-tpu (make tpu-wheels && make peer-wheels PEER_WHEELS=.whl-tpu).
set -u
case "${1:?which part: phases, mxfp4race or middle}" in
  phases) STEP_PAUSE=1 source docs/tpu-v5e/steps.sh
     step phase-k3d48-bf16 300 python3 docs/tpu-v5e/phase_trace.py --config k3-d48 --batch 8,1 --experts bf16 --out "$OUT"
     step bench-k3d48-bf16-kernel 150 python3 -m mk bench --config k3-d48 --experts bf16 --impl kernel --batch 1,8 --steps 8 --json ;;
  mxfp4race) STEP_PAUSE=1 source docs/tpu-v5e/steps.sh
     for c in k3-d12 k3-d24 k3-d48; do
       step bench-$c-mxfp4-peer 150 python3 -m mk bench --config $c --experts mxfp4 --impl kernel,peer --batch 1,8 --steps 8 --json
     done ;;
  middle) bash docs/tpu-v5e/run-depth.sh k3-d48 bf16 2,4 ;;
esac
for f in "$OUT"/*.out; do [ -s "$f" ] && mv "$f" "${f%.out}.json"; done
true
