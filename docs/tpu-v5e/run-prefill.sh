#!/usr/bin/env bash
# Parallel prefill (mk.perf.prefill) vs token-by-token on the TPU v5e, k3-chip, batch 1: prompts of
# 1024 (the goal: <= 3x the MXU roofline, >= 50x token by token), 128 and 4096 tokens in parallel, 1024
# and 128 token by token (the fair XLA step scanned),
# bf16 then MXFP4 experts, 2 timed calls each after one untimed (under 6 min: 2 x 175 s at most;
# the weights alone take ~50 s to draw on the chip).   OUT=DIR bash docs/tpu-v5e/run-prefill.sh
# Writes DIR/prefill-k3chip-{bf16,mxfp4}.out (JSON: {metadata, rows}) and .log (one line per case).
# Wheels: .whl-tpu (see steps.sh), carried with the working tree.
source docs/tpu-v5e/steps.sh
for experts in bf16 mxfp4; do
  step prefill-k3chip-$experts 175 python3 docs/tpu-v5e/prefill_bench.py --config k3-chip --experts $experts \
    --lengths 1024,128,4096 --token-lengths 1024,128 --reps 2
done
