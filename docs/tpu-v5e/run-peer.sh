#!/usr/bin/env bash
# The kernel against the fair XLA step and the peer (vLLM TPU's fused MoE kernel, tpu-inference 0.26.0:
# mk.perf.peer) on the lent TPU v5e, k3-chip and the depth family (k3-d12, k3-d24, k3-d48), bf16 experts
# (peer bf16) and MXFP4 experts (peer int4), B = 1, 2, 4, 8. One call per part, each under 9 minutes:
#   OUT=DIR bash docs/tpu-v5e/run-peer.sh part1    the peer against the CPU oracle on mini-tp8 (peer_check.py),
#                                                  then k3-chip bf16                                    (~6 min)
#   OUT=DIR bash docs/tpu-v5e/run-peer.sh part2    k3-chip mxfp4, then k3-d12 bf16 B = 1, 2             (~7 min)
#   OUT=DIR bash docs/tpu-v5e/run-peer.sh part3    k3-d12 bf16 B = 4, 8, k3-d12 mxfp4 B = 1, 2          (~7 min)
#   OUT=DIR bash docs/tpu-v5e/run-peer.sh part4    k3-d12 mxfp4 B = 4, 8, k3-d24 bf16 B = 1, 2          (~8 min)
#   OUT=DIR bash docs/tpu-v5e/run-peer.sh part5    k3-d24 bf16 B = 4, 8, k3-d24 mxfp4 B = 1, 2          (~8 min)
#   OUT=DIR bash docs/tpu-v5e/run-peer.sh part6    k3-d24 mxfp4 B = 4, 8                                (~4 min)
#   OUT=DIR bash docs/tpu-v5e/run-peer.sh part7    k3-d48 bf16 B = 1, 2                                 (~7.5 min)
#   OUT=DIR bash docs/tpu-v5e/run-peer.sh part8    k3-d48 bf16 B = 4, 8                                 (~7.5 min)
#   OUT=DIR bash docs/tpu-v5e/run-peer.sh part9    k3-d48 mxfp4 B = 1, 2                                (~7.5 min)
#   OUT=DIR bash docs/tpu-v5e/run-peer.sh part10   k3-d48 mxfp4 B = 4, 8                                (~7.5 min)
# Estimates (docs/tpu.md, "The peer"): k3-chip kernel + XLA took 2-3 min per format for B = 1, 2, 4, 8;
# the peer step compiles about as long as the XLA step (~25 s a batch at k3-chip); at 48 layers XLA's
# compile and first steps took 89 s a batch, the kernel's 28 s, so a deep config is split by batch.
# All parts: ~70 min of device time, more than one session's 30: run part1, part2, part7 first.
# Each step writes $OUT/NAME.out (stdout: the JSON) and $OUT/NAME.log (stderr: one `bench:` line per
# case): at most 4 steps, 8 files, per part. Wheels: .whl-tpu/ with tpu_inference-0.26.0-py3-none-any.whl
# beside mk's (`make peer-wheels`), carried.
set -u
bench() {   # bench NAME SECONDS CONFIG EXPERTS BATCHES
  step "$1" "$2" python3 -m mk bench --config "$3" --experts "$4" --batch "$5" --impl kernel,xla,peer --json
}
case "${1:?which part: part1 .. part10}" in
  part1) STEP_PAUSE=2 source docs/tpu-v5e/steps.sh
     step peer-check 150 python3 docs/tpu-v5e/peer_check.py
     bench bench-k3chip-bf16 330 k3-chip bf16 1,2,4,8 ;;
  part2) STEP_PAUSE=2 source docs/tpu-v5e/steps.sh
     bench bench-k3chip-mxfp4 330 k3-chip mxfp4 1,2,4,8
     bench bench-d12-bf16-b12 200 k3-d12 bf16 1,2 ;;
  part3) STEP_PAUSE=2 source docs/tpu-v5e/steps.sh
     bench bench-d12-bf16-b48 230 k3-d12 bf16 4,8
     bench bench-d12-mxfp4-b12 230 k3-d12 mxfp4 1,2 ;;
  part4) STEP_PAUSE=2 source docs/tpu-v5e/steps.sh
     bench bench-d12-mxfp4-b48 230 k3-d12 mxfp4 4,8
     bench bench-d24-bf16-b12 290 k3-d24 bf16 1,2 ;;
  part5) STEP_PAUSE=2 source docs/tpu-v5e/steps.sh
     bench bench-d24-bf16-b48 260 k3-d24 bf16 4,8
     bench bench-d24-mxfp4-b12 260 k3-d24 mxfp4 1,2 ;;
  part6) STEP_PAUSE=2 source docs/tpu-v5e/steps.sh
     bench bench-d24-mxfp4-b48 290 k3-d24 mxfp4 4,8 ;;
  part7) STEP_PAUSE=2 source docs/tpu-v5e/steps.sh
     bench bench-d48-bf16-b12 520 k3-d48 bf16 1,2 ;;
  part8) STEP_PAUSE=2 source docs/tpu-v5e/steps.sh
     bench bench-d48-bf16-b48 520 k3-d48 bf16 4,8 ;;
  part9) STEP_PAUSE=2 source docs/tpu-v5e/steps.sh
     bench bench-d48-mxfp4-b12 520 k3-d48 mxfp4 1,2 ;;
  part10) STEP_PAUSE=2 source docs/tpu-v5e/steps.sh
     bench bench-d48-mxfp4-b48 520 k3-d48 mxfp4 4,8 ;;
  *) echo "run-peer.sh: unknown part '$1' (part1 .. part10)" >&2; exit 2 ;;
esac
