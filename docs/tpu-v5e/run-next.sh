#!/usr/bin/env bash
# What is still open on the lent TPU v5e after 2026-12-06 (issues 22-24), as three calls of under
# 10 minutes each, one after another (the machine stays warm 100 s between calls):
#   OUT=DIR bash docs/tpu-v5e/run-next.sh 1   notebook 03 with the kernel's region trace, 2 steps (~6 min)
#   OUT=DIR bash docs/tpu-v5e/run-next.sh 2   notebook 04 at this commit, then mk microbench (~7 min)
#   OUT=DIR bash docs/tpu-v5e/run-next.sh 3   mk check (mini; k3-chip B = 8) and mk bench bf16 + MXFP4 at this commit (~9 min)
# Wheels: ../shared/tools/tpu-prep $(cat docs/tpu-v5e/notebook-wheels.txt), carry .whl-tpu.
set -u
case "${1:?which call: 1, 2 or 3}" in
  1) TAG=r PARAMS="-p region_trace True -p kernel_steps 2" bash docs/tpu-v5e/run-notebooks.sh 03:540 ;;
  2) bash docs/tpu-v5e/run-notebooks.sh 04:470
     STEP_PAUSE=2 source docs/tpu-v5e/steps.sh
     step microbench 120 python3 -m mk microbench --json --write "$OUT/microbench.csv" ;;
  3) STEP_PAUSE=2 source docs/tpu-v5e/steps.sh
     step check-mini 60 python3 -m mk check --config mini --batch 4 --steps 8 --json
     step check-k3chip 150 python3 -m mk check --config k3-chip --batch 8 --steps 4 --json
     step bench-bf16 180 python3 -m mk bench --config k3-chip --experts bf16 --impl kernel,xla --json
     step bench-mxfp4 190 python3 -m mk bench --config k3-chip --experts mxfp4 --impl kernel,xla --json ;;
  *) echo "run-next.sh: no call $1 (1, 2 or 3)" >&2; exit 2 ;;
esac
