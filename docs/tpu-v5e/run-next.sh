#!/usr/bin/env bash
# The lent TPU v5e's runs of 2026-12-06 and what is still open, as calls of under 10 minutes each, one
# after another (the machine stays warm 100 s between calls). Ran: mxfp4 -> 2026-12-06b/, ring and
# shift -> 2026-12-06c/, nonzero -> 2026-12-06d/; not yet: rest, nb03.
#   OUT=DIR bash docs/tpu-v5e/run-next.sh nonzero the MXFP4 unpack with the nonzero bits of eight codes at once
#                                                 (mk.kernel.ring.nonzero_bits): tile test, mk check mini, the
#                                                 dequant family, mk bench k3-chip MXFP4 (~8 min)
#   OUT=DIR bash docs/tpu-v5e/run-next.sh ring    tiles issued at release (mk.kernel.ring), no DMA bounds checks:
#                                                 mk check mini MXFP4 and bf16, mk bench k3-chip MXFP4 and bf16,
#                                                 kernel and fair XLA (~9 min)
#   OUT=DIR bash docs/tpu-v5e/run-next.sh mxfp4   the fused MXFP4 tile product (mk.kernel.ring.mxfp4_tile_product):
#                                                 every code and scale on the chip, mk check mini (MXFP4),
#                                                 mk bench k3-chip MXFP4 and bf16, kernel and fair XLA (~8 min)
#   OUT=DIR bash docs/tpu-v5e/run-next.sh rest    mk check k3-chip B = 8 (stopped at 200 s while compiling on
#                                                 2026-12-06), mk microbench in full (~8 min)
#   OUT=DIR bash docs/tpu-v5e/run-next.sh shift   mk bench k3-chip MXFP4 with the fused 'shift' unpack, the
#                                                 A/B against 'pairs' (its microbenchmark ran faster; ~4 min)
#   OUT=DIR bash docs/tpu-v5e/run-logits-rss.sh   host RSS of mk logits, its own call (~4 min)
#   OUT=DIR bash docs/tpu-v5e/run-next.sh nb03    notebook 03 with the kernel's region trace, 2 steps (~6 min)
# Wheels: make tpu-wheels TPU_WHEELS_REQS=docs/tpu-v5e/notebook-wheels.txt here, carry .whl-tpu.
set -u
case "${1:?which call: nonzero, ring, mxfp4, rest, shift or nb03}" in
  nonzero) STEP_PAUSE=2 source docs/tpu-v5e/steps.sh
     step dequant-tile 90 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_mxfp4.py -k bit_exact
     step check-mini-mxfp4 80 python3 -m mk check --config mini --batch 4 --steps 8 --experts mxfp4 --json
     step dequant-rate 60 python3 docs/tpu-v5e/dequant_rate.py
     step bench-mxfp4 200 python3 -m mk bench --config k3-chip --experts mxfp4 --impl kernel,xla --json ;;
     # (2026-12-06d also timed the MXFP4 row-block loop unrolled by 2, an experiment since removed:
     #  5.470 / 5.990 ms at B = 1 / 8, the same as not unrolled; bench-k3chip-mxfp4-unroll2.json)
  ring) STEP_PAUSE=2 source docs/tpu-v5e/steps.sh
     step check-mini-mxfp4 80 python3 -m mk check --config mini --batch 4 --steps 8 --experts mxfp4 --json
     step check-mini-bf16 80 python3 -m mk check --config mini --batch 8 --steps 8 --experts bf16 --json
     step bench-mxfp4 200 python3 -m mk bench --config k3-chip --experts mxfp4 --impl kernel,xla --json
     step bench-bf16 200 python3 -m mk bench --config k3-chip --experts bf16 --impl kernel,xla --json ;;
  mxfp4) STEP_PAUSE=2 source docs/tpu-v5e/steps.sh
     step dequant-tile 90 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_mxfp4.py -k bit_exact
     step check-mini 90 python3 -m mk check --config mini --batch 4 --steps 8 --json
     step bench-mxfp4 200 python3 -m mk bench --config k3-chip --experts mxfp4 --impl kernel,xla --json
     step bench-bf16 190 python3 -m mk bench --config k3-chip --experts bf16 --impl kernel,xla --json ;;
  rest) STEP_PAUSE=2 source docs/tpu-v5e/steps.sh
     step check-k3chip 330 python3 -m mk check --config k3-chip --batch 8 --steps 4 --json
     step microbench 150 python3 -m mk microbench --json --write "$OUT/microbench.csv" ;;
  shift) STEP_PAUSE=2 source docs/tpu-v5e/steps.sh
     step bench-mxfp4-shift 240 python3 -m mk bench --config k3-chip --experts mxfp4 --impl kernel --mxfp4-unpack shift --json ;;
  nb03) TAG=r PARAMS="-p region_trace True -p kernel_steps 2" bash docs/tpu-v5e/run-notebooks.sh 03:540 ;;
  *) echo "run-next.sh: no call $1 (nonzero, ring, mxfp4, rest, shift or nb03)" >&2; exit 2 ;;
esac
