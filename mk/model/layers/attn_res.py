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

from mk.model.layers.common import bf, f32, pad_rows, rsqrt


def mix_candidates(cands: Sequence[jax.Array], w: jax.Array, eps: float,
                   valid: Sequence[jax.Array | bool] | None = None) -> jax.Array:
    """Softmax mixture of candidate rows, fp32 in, bf16 out.

    cands: n arrays [B, d] f32; w [d] or [1, d] f32; valid: optional per-candidate flags (a
    masked candidate gets weight exactly 0, so the kernel can pass a fixed number of snapshot
    slots). Scores `s_j = (w . v_j) * rsqrt(mean(v_j^2) + eps)` (`common.rsqrt`); the softmax and the weighted sum
    run sequentially in candidate order, so any implementation that keeps the order agrees bit
    for bit.
    """
    wf = f32(w).reshape(1, -1)
    scores = []
    for j, v in enumerate(cands):
        s = jnp.sum(v * wf, axis=-1, keepdims=True) * rsqrt(jnp.mean(v * v, axis=-1, keepdims=True) + eps)
        if valid is not None:
            s = jnp.where(valid[j], s, -jnp.inf)
        scores.append(s)                                            # [B, 1]
    top = scores[0]
    for s in scores[1:]:
        top = jnp.maximum(top, s)
    e = [jnp.exp(s - top) for s in scores]
    denom = e[0]
    for x in e[1:]:
        denom = denom + x
    # The sum starts from an fp32 zero that XLA cannot fold (denom >= 1, so min(denom, 0) = +0;
    # not a product), so every add below meets exactly one product. XLA:CPU contracts `a + w * v`
    # into an FMA (LLVM fp-contract fast), and in `w0 * v0 + w1 * v1` LLVM picks WHICH product to
    # fuse from the generated code: in the interpreted kernel and most reference graphs the first
    # (fma(w0, v0, w1 * v1)), but where v0 = b_0 is read through the bitcast of the embedding
    # gather (batch 8 = the row tile, so the reference pads nothing and fuses the gather's
    # [8, 1, d] output straight into the mix) the second: a 1-bf16-ulp difference in x at mini
    # B = 8, layer 6. From a zero, the chain is fma(w_j, v_j, acc) in candidate order everywhere.
    out = jnp.minimum(denom, 0.0) + (e[0] / denom) * cands[0]
    for x, v in zip(e[1:], cands[1:]):
        out = out + (x / denom) * v
    return bf(out)


def mix(p: jax.Array, blocks: Sequence[jax.Array], w: jax.Array, eps: float, slots: int | None = None) -> jax.Array:
    """Mix(p, b_0..b_{n-1}; w): candidates (b_0, ..., b_{n-1}, p), p [B, d] bf16 -> [B, d] bf16.

    slots: evaluate over this many snapshot slots, the ones past n zero and masked (weight exactly
    0), as the kernel does with its fixed slot array. Same value, and the same expression, so XLA
    fuses (and rounds) it the same way. Rows are padded to the row tile (`common.rows_padded`)."""
    n = len(blocks)
    slots = n if slots is None else slots
    pf = pad_rows(f32(p))
    cands = [pad_rows(f32(b)) for b in blocks] + [jnp.zeros_like(pf)] * (slots - n) + [pf]
    valid = [True] * n + [False] * (slots - n) + [True]
    return mix_candidates(cands, w, eps, valid)[:p.shape[0]]
