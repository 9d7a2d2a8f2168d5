#!/usr/bin/env bash
# The second bench run on the lent TPU v5e (2026-12-05): kernel and fair XLA step only (the oracle's
# compiles do not fit one 10-minute call beside them), bf16 then MXFP4 experts.
#   OUT=DIR bash docs/tpu-v5e/run-bench2.sh
STEP_PAUSE=2 source docs/tpu-v5e/steps.sh
step bench-bf16 300 python3 -m mk bench --config k3-chip --experts bf16 --impl kernel,xla --json
step bench-mxfp4 265 python3 -m mk bench --config k3-chip --experts mxfp4 --impl kernel,xla --json
