#!/usr/bin/env bash
# The first bench run on the lent TPU v5e (2026-12-05): a bare TPU process's host RSS, the DMA
# microbench, then `mk bench` with bf16 and with MXFP4 experts (both cases timed out here; the
# figures come from run-bench2.sh).   OUT=DIR bash docs/tpu-v5e/run-bench.sh
# Writes DIR/NAME.out (stdout: the JSON) and DIR/NAME.log (stderr: one `bench:` line per case).
source docs/tpu-v5e/steps.sh
# a bare TPU process (JAX initialised, one array on the chip): the host RSS libtpu itself holds,
# the baseline for `mk logits --bench`'s peak RSS (run-logits-rss.sh)
step bare-rss 60 python3 -c 'import resource, jax, jax.numpy as jnp
x = jnp.ones((4096, 4096), jnp.bfloat16).block_until_ready()
print({"device": jax.devices()[0].device_kind, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024})'
step microbench 70 python3 -m mk microbench --json --write data/microbench.csv
cp data/microbench.csv "$OUT/microbench.csv"
step bench-bf16 280 python3 -m mk bench --config k3-chip --experts bf16 --json
step bench-mxfp4 190 python3 -m mk bench --config k3-chip --experts mxfp4 --impl kernel,xla --json
