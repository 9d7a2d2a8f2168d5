#!/usr/bin/env bash
# Host memory of a kernel load on the lent TPU v5e, one call (227 s on 2026-12-06; the limits sum to
# 500 s): `mk logits --backend kernel --bench --json` (peak host RSS against the checkpoint's bytes,
# and the chip's peak memory) on a 10.0 GB checkpoint (MXFP4 experts: the kernel's packed weights
# 10.0 GB of the chip's 16.9), then on the 1.36 GB K3-byte-mix shapes of 2026-12-05, after a bare
# TPU process by kind (import jax, one array on the chip: libtpu's own host memory, 14.5 GB on this
# VM, is the floor of both). The checkpoints are written to /tmp on the host's CPU by `mk synth
# --fast` (random tensors in the checkpoint's layout, shards in parallel: 10 GB in 17 s there;
# `mk synth` took ~190 s for the 1.36 GB one). Results: docs/tpu-v5e/2026-12-06/logits-rss.txt.
#   OUT=DIR [BARE_ONLY=1] bash docs/tpu-v5e/run-logits-rss.sh
source docs/tpu-v5e/steps.sh
# the floor, by kind: a bare TPU process (import jax, one array on the chip) under the same sampler
step bare-rss-kinds 45 python3 -c 'import json, jax, jax.numpy as jnp
from mk.cli.checkpoint import RssSampler
with RssSampler() as s:
    jax.block_until_ready(jnp.ones((4096, 4096), jnp.bfloat16))
print(json.dumps({"device": jax.devices()[0].device_kind, "peak_rss_by_kind": s.peaks}))'
[ "${BARE_ONLY:-0}" = 1 ] && exit 0
SHAPES='dim=1024,layers=8,heads=8,latent=1024,expert_hidden=512,top_k=8,dense_hidden=2048,q_rank=512,kv_rank=256,vocab=16384,full_attention=[3,7]'
rss() {   # rss NAME EXPERTS SYNTH_S LOGITS_S: write /tmp/NAME (SHAPES with EXPERTS routed experts), run
  local name=$1   # mk logits on it (its JSON: logits-rss-NAME.out), delete it
  JAX_PLATFORMS=cpu step synth-$name $3 python3 -m mk synth --config mini --fast --no-progress --out /tmp/$name \
    --override "$SHAPES,experts=$2"
  du -sb /tmp/$name >> "$OUT/synth-$name.log"
  step logits-rss-$name $4 python3 -m mk logits --checkpoint /tmp/$name --tokens 1,2,3,4 --backend kernel \
    --bench --json --out /tmp/l.npy
  rm -rf /tmp/$name
}
rss k3big 1664 120 230   # 10.0 GB: at most 2x is a peak of 20.0 GB, the floor plus 5.5 (2026-12-06: 14.9 GB, 1.49x)
rss k3mix 192 30 75      # 1.36 GB: 17.6 GB (12.9x) on 2026-12-05, 14.8 GB (10.9x) on 2026-12-06
