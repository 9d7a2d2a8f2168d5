"""Kimi Delta Attention for one decode token (spec 1.4.3).

Shapes for a batch of B rows, H heads of D channels (HD = H * D):
    a           [B, d]            bf16   normalized sublayer input
    state       [B, H, D, D]      f32    recurrent state S_h, indexed [key, value]
    conv_state  [B, 3, C-1, HD]   bf16   last C-1 pre-conv q/k/v projections (oldest first)
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from mk.config import K3Config
from mk.layers.common import bf, f32, mm, pad_rows, rms, rows_padded, sigmoid

QK_NORM_EPS = 1e-6  # added to the squared L2 norm of q and k


def short_conv(window: jax.Array, taps: jax.Array) -> jax.Array:
    """Causal depthwise conv + SiLU. window [B, 3, C, HD] bf16 (tap 0 oldest), taps [3, C, HD] f32.

    Returns [B, 3, HD] bf16: `bf(SiLU(sum_tau taps[tau] * window[tau]))`, summed in tap order.
    """
    acc = f32(window[:, :, 0]) * taps[None, :, 0]
    for tau in range(1, window.shape[2]):
        acc = acc + f32(window[:, :, tau]) * taps[None, :, tau]
    return bf(acc * jax.nn.sigmoid(acc))


def decay(g_raw: jax.Array, a_log: jax.Array, dt_bias: jax.Array, lower_bound: float) -> jax.Array:
    """Per-channel log-decay `lower_bound * sigmoid(exp(A_log_h) * (g_raw + dt_bias))`, in (lb, 0).

    g_raw [B, H, D] bf16, a_log [H] f32, dt_bias [H, D] f32 -> [B, H, D] f32.
    """
    return lower_bound * sigmoid(jnp.exp(a_log)[None, :, None] * (f32(g_raw) + dt_bias[None]))


def l2_normalize(x: jax.Array) -> jax.Array:
    """x / sqrt(||x||^2 + 1e-6) over the last axis, fp32."""
    xf = f32(x)
    return xf / jnp.sqrt(jnp.sum(xf * xf, axis=-1, keepdims=True) + QK_NORM_EPS)


def delta_rule(state, q, k, v, g, beta):
    """One gated delta-rule step per head, all fp32, elementwise (no MXU).

    state [B, H, D, D]; q, k, v, g [B, H, D]; beta [B, H] -> (o [B, H, D], new state).
        S <- diag(exp(g)) S;  u = beta (v - S^T k);  S <- S + k u^T;  o = S^T q
    """
    s = jnp.exp(g)[..., :, None] * state
    u = beta[..., None] * (v - jnp.sum(s * k[..., :, None], axis=-2))
    s = s + k[..., :, None] * u[..., None, :]
    o = jnp.sum(s * q[..., :, None], axis=-2)
    return o, s


def output_gate(o: jax.Array, g_o: jax.Array, o_norm: jax.Array, eps: float) -> jax.Array:
    """`bf(RMS_D(bf(o); o_norm)) * bf(sigmoid(g_o))`, rounded: o f32 [B, H, D], g_o bf16 [B, H, D]."""
    normed = rows_padded(rms, bf(o), o_norm, eps)
    return bf(f32(normed) * f32(bf(sigmoid(g_o))))


def kda(a, w: dict, state, conv_state, cfg: K3Config, reduce=lambda partial: partial):
    """One KDA layer. w holds this layer's slice of params['kda'] (see mk.params).

    `reduce` sums the output projection's fp32 partials over devices on a mesh
    (`mk.reference_sharded.reduce_bf16`, with cfg.heads = this device's heads); identity here.

    Returns (y [B, d] bf16, new state, new conv_state).
    """
    B = a.shape[0]
    H, D = cfg.heads, cfg.head_dim
    f = bf(mm(a, w["f_a"]))
    g_raw = bf(mm(f, w["f_b"])).reshape(B, H, D)
    qkv = jnp.stack([bf(mm(a, w[n])) for n in ("q", "k", "v")], axis=1)      # [B, 3, HD]
    g_o = bf(mm(a, w["g"])).reshape(B, H, D)
    beta = sigmoid(bf(mm(a, w["b"])))                                         # [B, H]
    window = jnp.concatenate([conv_state, qkv[:, :, None]], axis=2)           # [B, 3, C, HD]
    conv = short_conv(window, w["conv"]).reshape(B, 3, H, D)
    q = rows_padded(l2_normalize, conv[:, 0]) * (D ** -0.5)
    k = rows_padded(l2_normalize, conv[:, 1])
    v = f32(conv[:, 2])
    g = decay(g_raw, w["a_log"], w["dt_bias"].reshape(H, D), cfg.gate_lower_bound)
    # rows padded to the row tile: the key-axis sums then reduce one shape for every batch size
    o, state = delta_rule(*(pad_rows(x) for x in (state, q, k, v, g, beta)))
    o, state = o[:B], state[:B]
    out = output_gate(o, g_o, w["o_norm"], cfg.eps).reshape(B, H * D)
    return bf(reduce(mm(out, w["o"]))), state, window[:, :, 1:]
