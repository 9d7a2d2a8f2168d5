#!/usr/bin/env bash
# One preset of the depth family (mk.model.config.DEPTH_PRESETS) on the lent TPU v5e: `mk bench` with the
# kernel, the vLLM TPU peer and the fair XLA step, at B = 1 and 8, with the kernel's default plan (the
# per-model tile of mk.kernel.plan.default_tile and its prefetch depth). Carry .whl-tpu with the
# tpu-inference wheel (`make tpu-wheels && make peer-wheels PEER_WHEELS=.whl-tpu`).
#   MK_COMMIT=$(git rev-parse HEAD) MK_DIRTY=0 OUT=DIR bash docs/tpu-v5e/run-depth.sh k3-d48 bf16
# 2026-12-06f, k3-d48 bf16: weights 92 s, the kernel 28 / 19 s, XLA 101 / 80 s, the peer 76 / 66 s at
# B = 1 / 8 (480 s in all). Writes DIR/bench-PRESET-FORMAT-peer.json (a record) and its .log.
config=${1:?which preset: k3-d12, k3-d24, k3-d48 (or k3-chip)}
experts=${2:-bf16}
STEP_PAUSE=1 source docs/tpu-v5e/steps.sh
name=bench-${config//-/}-$experts-peer
step $name 540 python3 -m mk bench --config $config --experts $experts --impl kernel,peer,xla --batch 1,8 --steps 8 --json
grep -h "bench: B=" "$OUT/$name.log"
[ -s "$OUT/$name.out" ] && mv "$OUT/$name.out" "$OUT/$name.json"
true
