"""Attention residuals (spec 1.4.2): a learned softmax mixture over block snapshots and the prefix.

K3 keeps no single residual stream. `p` is the bf16 running sum of sublayer outputs since the
current block began; `b_0..b_{n-1}` are snapshots of finished blocks (b_0 = the embedding). Every
sublayer reads `Mix(p, b_0..b_{n-1}; w)`, where w is the folded (norm weight x projection) fp32
pseudo-query.
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp

from mk.layers.common import bf, f32


def mix(p: jax.Array, blocks: Sequence[jax.Array], w: jax.Array, eps: float) -> jax.Array:
    """Softmax mixture over candidates (b_0, ..., b_{n-1}, p).

    p [B, d] bf16; blocks: n arrays [B, d] (bf16-valued); w [d] f32 -> [B, d] bf16.
    Scores `s_j = (w . v_j) / sqrt(mean(v_j^2) + eps)` in fp32; the weighted sum runs in candidate
    order; one rounding to bf16 at the end.
    """
    cands = [f32(b) for b in blocks] + [f32(p)]
    if len(cands) == 1:
        return bf(cands[0])
    wf = f32(w)
    scores = [jnp.sum(v * wf, axis=-1) / jnp.sqrt(jnp.mean(v * v, axis=-1) + eps) for v in cands]
    s = jnp.stack(scores, axis=-1)                       # [B, n+1]
    alpha = jax.nn.softmax(s, axis=-1)
    out = alpha[:, 0:1] * cands[0]
    for j in range(1, len(cands)):
        out = out + alpha[:, j:j + 1] * cands[j]
    return bf(out)
