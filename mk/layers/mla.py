"""Multi-head latent attention for one decode token (spec 1.4.4): NoPE, no weight absorption.

Per-head keys/values are materialised and cached (not the latent):
    k_cache [B, H, ctx, Kc] bf16   per position [k_nope (D) | shared raw k_r (qk_extra) | zeros]
    v_cache [B, H, ctx, D]  bf16
Row b writes position pos[b] and attends causally to slots 0..pos[b].
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from mk.config import K3Config
from mk.layers.common import bf, f32, mm, rms, rows_padded, sigmoid


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


def attend(q, k_cache, v_cache, pos, scale: float):
    """Causal softmax attention of one query per row over its cache, fp32.

    q [B, H, Kc] bf16, caches [B, H, ctx, *], pos [B] int32 -> o [B, H, D] f32.
    Slots after pos[b] are excluded exactly (their contents never matter, even if NaN).
    """
    ctx = k_cache.shape[2]
    valid = jnp.arange(ctx)[None, :] <= pos[:, None]                        # [B, ctx]
    s = jnp.einsum("bhk,bhtk->bht", f32(q), f32(k_cache), precision="highest") * scale
    s = jnp.where(valid[:, None, :], s, -jnp.inf)
    p = rows_padded(jax.nn.softmax, s, axis=-1)
    v = jnp.where(valid[:, None, :, None], f32(v_cache), 0.0)
    return jnp.einsum("bht,bhtd->bhd", p, v, precision="highest")


def write_cache(cache, new, pos):
    """cache [B, H, ctx, X] with new [B, H, X] written at slot pos[b] of row b."""
    return jax.vmap(lambda c, n, t: jax.lax.dynamic_update_slice_in_dim(c, n[:, None], t, axis=1))(
        cache, new, pos)


def mla(a, w: dict, k_cache, v_cache, pos, cfg: K3Config, reduce=lambda partial: partial):
    """One MLA layer. Returns (y [B, d] bf16, new k_cache, new v_cache). `reduce`: as in
    `mk.layers.kda.kda` (the output projection's partials over devices on a mesh)."""
    B = a.shape[0]
    q, k, v = project_qkv(a, w, cfg)
    k_cache, v_cache = write_cache(k_cache, k, pos), write_cache(v_cache, v, pos)
    o = attend(q, k_cache, v_cache, pos, cfg.mla_scale)
    gate = bf(sigmoid(bf(mm(a, w["g"])))).reshape(o.shape)
    out = bf(f32(bf(o)) * f32(gate)).reshape(B, -1)
    return bf(reduce(mm(out, w["o"]))), k_cache, v_cache
