"""Multi-head latent attention for one decode token (spec 1.4.4): NoPE, no weight absorption.

Per-head keys/values are materialised and cached (not the latent):
    k_cache [B, H, ctx, Kc] bf16   per position [k_nope (D) | shared raw k_r (qk_extra) | zeros]
    v_cache [B, H, ctx, D]  bf16
Row b writes position pos[b] and attends causally to slots 0..pos[b].
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from mk.model.config import K3Config
from mk.model.layers.common import F32, bf, f32, mm, rms, rows_padded, sigmoid

BLOCK = 128  # cache positions per online-softmax block (and per kernel DMA)


def project_qkv(a, w: dict, cfg: K3Config):
    """Query, new key and new value of one token. a [B, d] bf16 ->
    q [B, H, Kc], k [B, H, Kc], v [B, H, D], all bf16 (q and k zero-padded from qk_head_dim to Kc)."""
    B, H, D, Kc = a.shape[0], cfg.heads, cfg.head_dim, cfg.k_cache_dim
    c_q = rows_padded(rms, bf(mm(a, w["q_a"])), w["q_a_norm"], cfg.eps)
    kva = bf(mm(a, w["kv_a"]))
    c_kv = rows_padded(rms, kva[:, :cfg.kv_rank], w["kv_a_norm"], cfg.eps)
    k_r = kva[:, cfg.kv_rank:]                                              # [B, qk_extra], raw
    q = bf(mm(c_q, w["q_b"])).reshape(B, H, cfg.qk_head_dim)
    kv = bf(mm(c_kv, w["kv_b"])).reshape(B, H, 2 * D)
    pad = Kc - cfg.qk_head_dim
    q = jnp.pad(q, ((0, 0), (0, 0), (0, pad)))
    k = jnp.concatenate([kv[..., :D], jnp.broadcast_to(k_r[:, None], (B, H, cfg.qk_extra)),
                         jnp.zeros((B, H, pad), kv.dtype)], axis=-1)
    return q, k, kv[..., D:]


def attend_block(q, k_block, v_block, valid, m, l, acc, scale: float):
    """One cache block of the online softmax (spec 1.4.4 step 6), for G heads of one row, fp32.

    q [G, 1, Kc] f32 (bf16 values); k_block [G, BLOCK, Kc] bf16, v_block [G, BLOCK, D] (bf16
    values); valid [BLOCK, 1] bool; running max m and denominator l [G, 1, 128] (one value on
    every lane), accumulator acc [G, 1, D] -> updated (m, l, acc). Each head's arithmetic is the
    same whatever G is. Invalid slots count exactly zero, even if they hold NaN. The kernel runs
    this very function on the blocks it DMAs in (G heads at a time, `ScheduleOptions.attention_heads`).
    """
    # The scores as a matmul (bf16 operands, fp32 accumulation, like `common.mm`), not as
    # sum(f32(k) * q): XLA:CPU sums that reduction in another order when the bf16 -> f32 convert
    # is fused into it (the kernel, whose block is a fresh VMEM load) than when it is not (the
    # reference, whose loop-invariant block's convert XLA hoists out of the block loop).
    s = jax.lax.dot_general(bf(q), k_block, (((2,), (2,)), ((0,), (0,))), preferred_element_type=F32)
    s = jnp.where(valid, jnp.swapaxes(s, 1, 2) * scale, -jnp.inf)              # [G, BLOCK, 1]
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))                  # [G, 1, 128]
    p = jnp.exp(s - m_new[..., :1])
    corr = jnp.exp(m - m_new)
    l = l * corr + jnp.sum(p, axis=1, keepdims=True)
    # The weighted sum of values head by head, on the same [BLOCK, D] shapes for any G: XLA:CPU
    # orders a reduction over the middle axis of [G, BLOCK, D] differently from one over [BLOCK, D].
    pv = jnp.stack([jnp.sum(p[g] * jnp.where(valid, f32(v_block[g]), 0.0), axis=0, keepdims=True)
                    for g in range(q.shape[0])])                               # [G, 1, D]
    acc = acc * corr[..., :1] + pv
    return m_new, l, acc


def softmax_start(D: int):
    """The online softmax's (m, l, acc) of one head before the first block: [1, 1, 128] x 2, [1, 1, D]."""
    return (jnp.full((1, 1, 128), -jnp.inf, jnp.float32), jnp.zeros((1, 1, 128), jnp.float32),
            jnp.zeros((1, 1, D), jnp.float32))


def attend(q, k_cache, v_cache, pos, scale: float):
    """Causal attention of one query per row over its cache, as an online softmax over BLOCK-slot
    blocks 0..pos[b] // BLOCK (spec 1.4.4 step 6), one head of one row at a time like the kernel.

    q [B, H, Kc] bf16, caches [B, H, ctx, *], pos [B] int32 -> o [B, H, D] f32.
    Slots after pos[b] are excluded exactly (their contents never matter, even if NaN).
    """
    B, H, ctx, Kc = k_cache.shape
    D = v_cache.shape[-1]
    pad = -ctx % BLOCK                      # a short test cache is padded to whole blocks
    k_cache, v_cache = (jnp.pad(c, ((0, 0), (0, 0), (0, pad), (0, 0))) for c in (k_cache, v_cache))
    slot = jax.lax.broadcasted_iota(jnp.int32, (BLOCK, 1), 0)

    def one(args):
        q, kc, vc, t = args                 # [Kc], [ctx, Kc], [ctx, D], position

        def block(j, carry):
            kb, vb = (jax.lax.dynamic_slice_in_dim(c, j * BLOCK, BLOCK) for c in (kc, vc))
            return attend_block(f32(q)[None, None], kb[None], vb[None], j * BLOCK + slot <= t, *carry, scale)
        m, l, acc = jax.lax.fori_loop(0, t // BLOCK + 1, block, softmax_start(D))
        return (acc / l[..., :1])[0, 0]

    o = jax.lax.map(one, (q.reshape(B * H, Kc), k_cache.reshape(B * H, ctx + pad, Kc),
                          v_cache.reshape(B * H, ctx + pad, D), jnp.repeat(pos, H)))
    return o.reshape(B, H, D)


def write_cache(cache, new, pos):
    """cache [B, H, ctx, X] with new [B, H, X] written at slot pos[b] of row b, or new [B, H, T, X]
    at slots pos[b]..pos[b]+T-1 (the caller keeps pos[b] + T <= ctx)."""
    if new.ndim == 3:
        new = new[:, :, None]
    return jax.vmap(lambda c, n, t: jax.lax.dynamic_update_slice_in_dim(c, n, t, axis=1))(cache, new, pos)


def mla(a, w: dict, k_cache, v_cache, pos, cfg: K3Config, reduce=lambda partial: partial):
    """One MLA layer for one token per row. Returns (y [B, d] bf16, new k_cache, new v_cache).
    `reduce`: as in `mk.model.layers.kda.kda` (the output projection's partials over devices on a mesh)."""
    y, k_cache, v_cache = mla_tokens(a[:, None], w, k_cache, v_cache, pos, cfg, reduce)
    return y[:, 0], k_cache, v_cache


def mla_tokens(a, w: dict, k_cache, v_cache, pos, cfg: K3Config, reduce=lambda partial: partial):
    """One MLA layer over T consecutive tokens per row at positions pos[b]..pos[b]+T-1 (a verify
    block; T = 1 is a decode step). a [B, T, d] bf16 -> (y [B, T, d] bf16, k_cache, v_cache).

    All T keys and values are written first; token t attends to slots 0..pos[b]+t (causal within
    the block), each (token, head) exactly as a one-token step computes it. Slots of rejected
    drafts stay written but lie past the next step's position, so they are masked until the
    next block overwrites them.
    """
    B, T = a.shape[:2]
    q, k, v = project_qkv(a.reshape(B * T, -1), w, cfg)
    to_block = lambda x: jnp.swapaxes(x.reshape(B, T, *x.shape[1:]), 1, 2)   # [B, H, T, X]
    k_cache, v_cache = write_cache(k_cache, to_block(k), pos), write_cache(v_cache, to_block(v), pos)
    token_pos = (pos[:, None] + jnp.arange(T, dtype=pos.dtype)[None]).reshape(B * T)
    rows = lambda c: c if T == 1 else jnp.repeat(c, T, axis=0)               # each token's row cache
    o = attend(q, rows(k_cache), rows(v_cache), token_pos, cfg.mla_scale)
    gate = bf(sigmoid(bf(mm(a.reshape(B * T, -1), w["g"])))).reshape(o.shape)
    out = bf(f32(bf(o)) * f32(gate)).reshape(B * T, -1)
    return bf(reduce(mm(out, w["o"]))).reshape(B, T, -1), k_cache, v_cache
