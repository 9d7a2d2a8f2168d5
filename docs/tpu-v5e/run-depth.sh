#!/usr/bin/env bash
# One preset of the depth family (mk.model.config.DEPTH_PRESETS) on the lent TPU v5e: `mk bench` with the
# kernel, the vLLM TPU peer and the fair XLA step, at B = 1 and 8, with the kernel's default plan (the
# per-model tile of mk.kernel.plan.default_tile and its prefetch depth). Carry .whl-tpu with the
# tpu-inference wheel (`make tpu-wheels && make peer-wheels PEER_WHEELS=.whl-tpu`).
#   MK_COMMIT=<hash> MK_DIRTY=0 OUT=DIR bash docs/tpu-v5e/run-depth.sh k3-d48 bf16 [BATCHES]
# (write the hash itself, expanded where the tree was committed: the VM's copy of .git may be stale,
# 2026-12-06g/NOTES.md). BATCHES: default 1,8; 2,4 for the middle of the sweep.
# 2026-12-06f, k3-d48 bf16: weights 92 s, the kernel 28 / 19 s, XLA 101 / 80 s, the peer 76 / 66 s at
# B = 1 / 8 (480 s in all); 2026-12-06g (counter-hash weights): weights 48 s, the kernel 24 / 17 s, XLA
# 102 / 78 s, the peer 80 / 56 s (423 s). Writes DIR/bench-PRESET-FORMAT-peer.json (a record) and its .log.
config=${1:?which preset: k3-d12, k3-d24, k3-d48 (or k3-chip)}
experts=${2:-bf16}
batches=${3:-1,8}
STEP_PAUSE=1 source docs/tpu-v5e/steps.sh
name=bench-${config//-/}-$experts-peer${3:+-b${batches//,/}}
step $name 540 python3 -m mk bench --config $config --experts $experts --impl kernel,peer,xla --batch $batches --steps 8 --json
grep -h "bench: B=" "$OUT/$name.log"
[ -s "$OUT/$name.out" ] && mv "$OUT/$name.out" "$OUT/$name.json"
true
