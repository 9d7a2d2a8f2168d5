#!/usr/bin/env bash
# Issue 22's on-chip points, as run on the lent TPU v5e (one chip). From the repo root on the TPU VM,
# after ../shared/tools/tpu-prep pytest==8.3.4 pluggy iniconfig packaging (wheels carried as .whl-tpu):
#   OUT=DIR bash docs/tpu-v5e/run-check.sh
# Writes DIR/*.json and DIR/*.log; prints one line per step with its exit status.
set -u
OUT=${OUT:-tpu-out}; mkdir -p "$OUT"
source .whl-tpu/env.sh
export JAX_PLATFORMS=tpu,cpu        # the chip, and JAX's CPU backend for mk check's oracle
step() {   # step NAME SECONDS CMD...: run one program alone on the chip, log its exit status
  local name=$1 secs=$2; shift 2
  local t0=$(date +%s)
  timeout "$secs" "$@" > "$OUT/$name.out" 2> "$OUT/$name.log"
  echo "$name rc=$? $(( $(date +%s) - t0 ))s"
  sleep 4
}
python3 -c 'import jax; print(jax.devices())'
step dequant-tile 150 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_mxfp4.py -k dequant_bit_exact
step check-mini-mxfp4 240 python3 -m mk check --config mini --batch 4 --steps 8 --json
step check-mini-bf16 240 python3 -m mk check --config mini --batch 4 --steps 8 --experts bf16 --json
step check-mini-fault 240 python3 -m mk check --config mini --batch 4 --steps 8 --fault moe_combine_sign --json
step check-k3chip-mxfp4 420 python3 -m mk check --config k3-chip --batch 8 --steps 4 --json
step microbench 150 python3 -m mk microbench --json
