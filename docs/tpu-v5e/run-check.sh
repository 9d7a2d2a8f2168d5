#!/usr/bin/env bash
# The on-chip checks, as run on the lent TPU v5e (one chip, 2026-12-05). From the repo root on the TPU VM,
# after `make tpu-wheels TPU_WHEELS_EXTRA="pytest==8.3.4 pluggy iniconfig packaging"` here (.whl-tpu carried along):
#   OUT=DIR bash docs/tpu-v5e/run-check.sh
# Writes DIR/*.json and DIR/*.log; prints one line per step with its exit status.
STEP_PAUSE=4 source docs/tpu-v5e/steps.sh
python3 -c 'import jax; print(jax.devices())'
step dequant-tile 150 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_mxfp4.py -k dequant_bit_exact
step check-mini-mxfp4 240 python3 -m mk check --config mini --batch 4 --steps 8 --json
step check-mini-bf16 240 python3 -m mk check --config mini --batch 4 --steps 8 --experts bf16 --json
step check-mini-fault 240 python3 -m mk check --config mini --batch 4 --steps 8 --fault moe_combine_sign --json
step check-k3chip-mxfp4 420 python3 -m mk check --config k3-chip --batch 8 --steps 4 --json
step microbench 150 python3 -m mk microbench --json
