#!/usr/bin/env bash
# The 'pairs_mul' MXFP4 unpack (mk.kernel.ring.pair_bits_mul) against 'pairs' on the lent TPU v5e,
# two calls of under 10 minutes each (the machine stays warm 100 s between calls):
#   OUT=DIR bash docs/tpu-v5e/run-unpack.sh a   every code and scale through every unpack the chip
#                                               lowers (pairs, pairs_mul, shift), the dequant family
#                                               (pairs, pairs_mul, shift), mk bench k3-chip MXFP4 with
#                                               pairs_mul, kernel only (~6 min)
#   OUT=DIR bash docs/tpu-v5e/run-unpack.sh b   mk bench k3-chip MXFP4 with pairs, kernel only: the A/B
#                                               in the same session (~3 min)
# Deviceless, on any machine: python3 docs/tpu-v5e/llo_unpack.py (bundles per tile of each unpack).
# Wheels: as run-next.sh (carry .whl-tpu).
set -u
case "${1:?which call: a or b}" in
  a) STEP_PAUSE=2 source docs/tpu-v5e/steps.sh
     step dequant-tile 150 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_mxfp4.py -k bit_exact
     step dequant-rate 90 python3 docs/tpu-v5e/dequant_rate.py
     step bench-mxfp4-pairs_mul 260 python3 -m mk bench --config k3-chip --experts mxfp4 --impl kernel --mxfp4-unpack pairs_mul --json ;;
  b) STEP_PAUSE=2 source docs/tpu-v5e/steps.sh
     step bench-mxfp4-pairs 260 python3 -m mk bench --config k3-chip --experts mxfp4 --impl kernel --mxfp4-unpack pairs --json ;;
  *) echo "run-unpack.sh: no call $1 (a or b)" >&2; exit 2 ;;
esac
