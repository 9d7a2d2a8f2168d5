#!/usr/bin/env bash
# The 'pairs' MXFP4 unpack on the lent TPU v5e (2026-12-05, its second run): the every-code,
# every-scale tile test compiled on the chip, `mk check` with MXFP4 experts (the default, now 'pairs'),
# and `mk microbench` (each unpack's dequantization rate beside the DMA and MXU constants).
#   OUT=DIR bash docs/tpu-v5e/run-pairs.sh
STEP_PAUSE=3 source docs/tpu-v5e/steps.sh
step dequant-tile 150 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_mxfp4.py -k dequant_bit_exact
step check-mini-mxfp4 200 python3 -m mk check --config mini --batch 4 --steps 8 --json
step microbench 200 python3 -m mk microbench --json --write "$OUT/microbench.csv"
