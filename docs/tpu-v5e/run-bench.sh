#!/usr/bin/env bash
# Issue 23's measurements (and issue 22's host-memory point) as run on the lent TPU v5e. From the repo
# root on the TPU VM, wheels carried as .whl-tpu (../shared/tools/tpu-prep):   OUT=DIR bash docs/tpu-v5e/run-bench.sh
set -u
OUT=${OUT:-tpu-out}; mkdir -p "$OUT"
source .whl-tpu/env.sh
step() {   # step NAME SECONDS CMD...: one program alone on the chip; its exit status and wall time
  local name=$1 secs=$2; shift 2
  local t0=$(date +%s)
  timeout "$secs" "$@" > "$OUT/$name.out" 2> "$OUT/$name.log"
  echo "$name rc=$? $(( $(date +%s) - t0 ))s"
  sleep 3
}
# the 1.36 GB K3-byte-mix checkpoint, written on the host's CPU while the chip benchmarks
( JAX_PLATFORMS=cpu timeout 420 python3 -m mk synth --config mini --no-progress --out /tmp/k3mix --override \
  'dim=1024,layers=8,heads=8,latent=1024,expert_hidden=512,experts=192,top_k=8,dense_hidden=2048,q_rank=512,kv_rank=256,vocab=16384,full_attention=[3,7]' \
  > "$OUT/synth.log" 2>&1; echo "synth rc=$?" >> "$OUT/synth.log" ) &
export JAX_PLATFORMS=tpu,cpu
step microbench 90 python3 -m mk microbench --json --write data/microbench.csv
cp data/microbench.csv "$OUT/microbench.csv"
step bench-bf16 200 python3 -m mk bench --config k3-chip --experts bf16 --json
step bench-mxfp4 170 python3 -m mk bench --config k3-chip --experts mxfp4 --impl kernel,xla --json
wait
du -sb /tmp/k3mix >> "$OUT/synth.log"
step logits-rss 90 python3 -m mk logits --checkpoint /tmp/k3mix --tokens 1,2,3,4 --backend kernel --bench --json --out /tmp/l.npy
