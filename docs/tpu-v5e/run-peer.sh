#!/usr/bin/env bash
# The kernel against the fair XLA step and the peer (vLLM TPU's fused MoE kernel, tpu-inference 0.26.0:
# mk.perf.peer) on the lent TPU v5e: k3-chip and the depth family (k3-d12, k3-d24, k3-d48), bf16 experts
# (peer bf16) and MXFP4 experts (peer int4), B = 1, 2, 4, 8, each `mk bench --impl kernel,xla,peer --json`.
# One call per part, each under 9 minutes (the sum of its steps' timeouts, below 530 s):
#   OUT=DIR bash docs/tpu-v5e/run-peer.sh part1     peer_check.py (the compiled peer against the CPU oracle,
#                                                   mini-tp8, all three formats), then k3-chip bf16
#   OUT=DIR bash docs/tpu-v5e/run-peer.sh part2     k3-chip mxfp4; k3-d12 bf16 B = 1, 2
#   OUT=DIR bash docs/tpu-v5e/run-peer.sh part3     k3-d12 bf16 B = 4, 8; k3-d12 mxfp4 B = 1, 2
#   OUT=DIR bash docs/tpu-v5e/run-peer.sh part4     k3-d12 mxfp4 B = 4, 8; k3-d24 bf16 B = 1
#   OUT=DIR bash docs/tpu-v5e/run-peer.sh part5     k3-d24 bf16 B = 2; B = 4
#   OUT=DIR bash docs/tpu-v5e/run-peer.sh part6     k3-d24 bf16 B = 8; k3-d24 mxfp4 B = 1
#   OUT=DIR bash docs/tpu-v5e/run-peer.sh part7     k3-d24 mxfp4 B = 2; B = 4
#   OUT=DIR bash docs/tpu-v5e/run-peer.sh part8     k3-d24 mxfp4 B = 8; peer_mla.py (tpu-inference's MLA decode
#                                                   kernel alone at k3-chip's shapes)
#   OUT=DIR bash docs/tpu-v5e/run-peer.sh part9 .. part12    k3-d48 bf16, B = 1 / 2 / 4 / 8, one per part
#   OUT=DIR bash docs/tpu-v5e/run-peer.sh part13 .. part16   k3-d48 mxfp4, B = 1 / 2 / 4 / 8, one per part
# Estimates: k3-chip's kernel + fair XLA step took 2-3 min per format for B = 1, 2, 4, 8 (about 25 s a
# batch for XLA's compile and first steps); the peer step compiles about as long as the XLA step (its
# deviceless compile here: k3-chip B = 8 70 s, k3-d48 B = 8 int4 320 s, on a 2-core machine about 3-4x
# slower than the VM); at 48 layers XLA's compile and first steps took 89 s a batch, the kernel's 28 s,
# plus ~30 s of weights: about 4-5 min per k3-d48 batch, ~3 min per k3-d24 batch, ~1.5 min per k3-d12
# batch. All parts: about 100 min of device time, several sessions; run part1, part2, part9, part13 first.
# Each step writes $OUT/NAME.out (stdout: the JSON) and $OUT/NAME.log (stderr: one `bench:` line per
# case): at most 2 steps, 4 files, per part. Wheels: .whl-tpu/ with tpu_inference-0.26.0-py3-none-any.whl
# beside mk's (`make peer-wheels`), carried; steps.sh sources .whl-tpu/env.sh.
set -u
bench() {   # bench NAME SECONDS CONFIG EXPERTS BATCHES
  step "$1" "$2" python3 -m mk bench --config "$3" --experts "$4" --batch "$5" --impl kernel,xla,peer --json
}
d48() {     # d48 EXPERTS B: one k3-d48 batch, alone in its part
  STEP_PAUSE=2 source docs/tpu-v5e/steps.sh
  bench "bench-d48-$1-b$2" 520 k3-d48 "$1" "$2"
}
case "${1:?which part: part1 .. part16}" in
  part1) STEP_PAUSE=2 source docs/tpu-v5e/steps.sh
     step peer-check 150 python3 docs/tpu-v5e/peer_check.py
     bench bench-k3chip-bf16 330 k3-chip bf16 1,2,4,8 ;;
  part2) STEP_PAUSE=2 source docs/tpu-v5e/steps.sh
     bench bench-k3chip-mxfp4 330 k3-chip mxfp4 1,2,4,8
     bench bench-d12-bf16-b12 190 k3-d12 bf16 1,2 ;;
  part3) STEP_PAUSE=2 source docs/tpu-v5e/steps.sh
     bench bench-d12-bf16-b48 230 k3-d12 bf16 4,8
     bench bench-d12-mxfp4-b12 230 k3-d12 mxfp4 1,2 ;;
  part4) STEP_PAUSE=2 source docs/tpu-v5e/steps.sh
     bench bench-d12-mxfp4-b48 230 k3-d12 mxfp4 4,8
     bench bench-d24-bf16-b1 260 k3-d24 bf16 1 ;;
  part5) STEP_PAUSE=2 source docs/tpu-v5e/steps.sh
     bench bench-d24-bf16-b2 260 k3-d24 bf16 2
     bench bench-d24-bf16-b4 260 k3-d24 bf16 4 ;;
  part6) STEP_PAUSE=2 source docs/tpu-v5e/steps.sh
     bench bench-d24-bf16-b8 260 k3-d24 bf16 8
     bench bench-d24-mxfp4-b1 260 k3-d24 mxfp4 1 ;;
  part7) STEP_PAUSE=2 source docs/tpu-v5e/steps.sh
     bench bench-d24-mxfp4-b2 260 k3-d24 mxfp4 2
     bench bench-d24-mxfp4-b4 260 k3-d24 mxfp4 4 ;;
  part8) STEP_PAUSE=2 source docs/tpu-v5e/steps.sh
     bench bench-d24-mxfp4-b8 260 k3-d24 mxfp4 8
     step peer-mla 150 python3 docs/tpu-v5e/peer_mla.py k3-chip ;;
  part9) d48 bf16 1 ;;
  part10) d48 bf16 2 ;;
  part11) d48 bf16 4 ;;
  part12) d48 bf16 8 ;;
  part13) d48 mxfp4 1 ;;
  part14) d48 mxfp4 2 ;;
  part15) d48 mxfp4 4 ;;
  part16) d48 mxfp4 8 ;;
  *) echo "run-peer.sh: unknown part '$1' (part1 .. part16)" >&2; exit 2 ;;
esac
