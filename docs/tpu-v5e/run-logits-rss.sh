#!/usr/bin/env bash
# Issue 22's host-memory point, as run on the lent TPU v5e (2026-12-05, as part of an earlier
# run-bench.sh): the 1.36 GB K3-byte-mix checkpoint written on the host's CPU (about 190 s there),
# then `mk logits --backend kernel --bench` on it (peak RSS in all and by kind), and a bare TPU process
# by kind.   OUT=DIR [BARE_ONLY=1] bash docs/tpu-v5e/run-logits-rss.sh
source docs/tpu-v5e/steps.sh
# the floor, by kind: a bare TPU process (import jax, one array on the chip) under the same sampler
step bare-rss-kinds 60 python3 -c 'import json, jax, jax.numpy as jnp
from mk.cli.checkpoint import RssSampler
with RssSampler() as s:
    jax.block_until_ready(jnp.ones((4096, 4096), jnp.bfloat16))
print(json.dumps({"device": jax.devices()[0].device_kind, "peak_rss_by_kind": s.peaks}))'
[ "${BARE_ONLY:-0}" = 1 ] && exit 0
JAX_PLATFORMS=cpu step synth 420 python3 -m mk synth --config mini --no-progress --out /tmp/k3mix --override \
  'dim=1024,layers=8,heads=8,latent=1024,expert_hidden=512,experts=192,top_k=8,dense_hidden=2048,q_rank=512,kv_rank=256,vocab=16384,full_attention=[3,7]'
du -sb /tmp/k3mix >> "$OUT/synth.log"
step logits-rss 90 python3 -m mk logits --checkpoint /tmp/k3mix --tokens 1,2,3,4 --backend kernel --bench --json --out /tmp/l.npy
