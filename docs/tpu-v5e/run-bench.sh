#!/usr/bin/env bash
# Issue 23's measurements as run on the lent TPU v5e: the DMA microbench on an idle chip, then
# `mk bench` with bf16 and with MXFP4 experts. From the repo root on the TPU VM, wheels carried as
# .whl-tpu (../shared/tools/tpu-prep):   OUT=DIR bash docs/tpu-v5e/run-bench.sh
# Writes DIR/NAME.out (stdout: the JSON) and DIR/NAME.log (stderr: one `bench:` line per case).
set -u
OUT=${OUT:-tpu-out}; mkdir -p "$OUT"
source .whl-tpu/env.sh
export JAX_PLATFORMS=tpu,cpu
step() {   # step NAME SECONDS CMD...: one program alone on the chip; its exit status and wall time
  local name=$1 secs=$2; shift 2
  local t0=$(date +%s)
  timeout "$secs" "$@" > "$OUT/$name.out" 2> "$OUT/$name.log"
  echo "$name rc=$? $(( $(date +%s) - t0 ))s"
  sleep 3
}
# a bare TPU process (JAX initialised, one array on the chip): the host RSS libtpu itself holds,
# the baseline for `mk logits --bench`'s peak RSS
step bare-rss 60 python3 -c 'import resource, jax, jax.numpy as jnp
x = jnp.ones((4096, 4096), jnp.bfloat16).block_until_ready()
print({"device": jax.devices()[0].device_kind, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024})'
step microbench 70 python3 -m mk microbench --json --write data/microbench.csv
cp data/microbench.csv "$OUT/microbench.csv"
step bench-bf16 280 python3 -m mk bench --config k3-chip --experts bf16 --json
step bench-mxfp4 190 python3 -m mk bench --config k3-chip --experts mxfp4 --impl kernel,xla --json
