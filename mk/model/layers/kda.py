"""Kimi Delta Attention for one decode token, or T consecutive tokens of a verify block (spec 1.4.3).

Shapes for a batch of B rows, H heads of D channels (HD = H * D):
    a           [B, d]            bf16   normalized sublayer input
    state       [B, H, D, D]      f32    recurrent state S_h, indexed [key, value]
    conv_state  [B, 3, C-1, HD]   bf16   last C-1 pre-conv q/k/v projections (oldest first)
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from mk.model.config import K3Config
from mk.model.layers.common import bf, f32, mm, rms, rsqrt, sigmoid

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
    """x * rsqrt(||x||^2 + 1e-6) over the last axis, fp32."""
    xf = f32(x)
    return xf * rsqrt(jnp.sum(xf * xf, axis=-1, keepdims=True) + QK_NORM_EPS)


def to_column(row: jax.Array) -> jax.Array:
    """[1, D] -> [D, 1] exactly: a sum over lanes of an identity-masked broadcast (TPU-friendly)."""
    D = row.shape[-1]
    eye = jax.lax.broadcasted_iota(jnp.int32, (D, D), 0) == jax.lax.broadcasted_iota(jnp.int32, (D, D), 1)
    return jnp.sum(jnp.where(eye, jnp.broadcast_to(row, (D, D)), 0.0), axis=1, keepdims=True)


def delta_rule_head(state, q, k, v, decay, beta):
    """The gated delta rule for one head of one row, fp32, elementwise (no MXU), as the kernel runs it.

    state [D, D] (key, value); q, k, v, beta [1, D] (beta broadcast over lanes); decay = exp(g)
    [1, D] -> (o [1, D], new state [D, D]):
        S <- diag(decay) S;  u = beta (v - S^T k);  S <- S + k u^T;  o = S^T q
    """
    s = to_column(decay) * state
    k_col = to_column(k)
    u = beta * (v - jnp.sum(s * k_col, axis=0, keepdims=True))
    s = s + k_col * u
    return jnp.sum(s * to_column(q), axis=0, keepdims=True), s


def output_gate(o: jax.Array, g_o: jax.Array, o_norm: jax.Array, eps: float) -> jax.Array:
    """`bf(RMS_D(bf(o); o_norm)) * bf(sigmoid(g_o))`, rounded: o f32 [..., D], g_o [..., D] (bf16 values)."""
    return bf(f32(rms(bf(o), o_norm, eps)) * f32(bf(sigmoid(bf(g_o)))))


def kda_head(state, q, k, v, g, beta, g_o, o_norm, eps: float):
    """Steps 3-8 of spec 1.4.3 for one head of one row, as the kernel runs it (one head at a time).

    state [D, D] f32; q, k, v [1, D] (after the conv, fp32 of bf16); g [1, D] log-decay f32;
    beta [1, D] (one value on every lane); g_o [1, D] (bf16 values); o_norm [D]
    -> (gated output [1, D] bf16, new state [D, D] f32).
    """
    D = q.shape[-1]
    o, state = delta_rule_head(state, l2_normalize(q) * (D ** -0.5), l2_normalize(k), f32(v), jnp.exp(g), beta)
    return output_gate(o, g_o, o_norm, eps), state


def heads(state, q, k, v, g, beta, g_o, o_norm, eps: float):
    """`kda_head` for every row and head in turn: state [B, H, D, D]; q, k, v, g, g_o [B, H, D];
    beta [B, H] -> (out [B, H, D] bf16, new state [B, H, D, D]).

    One head at a time rather than batched [B, H, ...] arrays: XLA picks a reduction's summation
    order (and where it fuses a multiply-add) from the shapes it sees, so the batched form rounds
    the norms and key-axis sums differently from the kernel by an fp32 ulp, which later steps
    amplify. The same function on the same shapes rounds the same.
    """
    B, H, D = q.shape
    rows = lambda x: x.reshape(B * H, 1, D)
    out, s = jax.lax.map(lambda x: kda_head(*x, o_norm, eps), (
        state.reshape(B * H, D, D), rows(q), rows(k), rows(v), rows(g),
        jnp.broadcast_to(beta.reshape(B * H, 1, 1), (B * H, 1, D)), rows(g_o)))
    return out.reshape(B, H, D), s.reshape(B, H, D, D)


def kda(a, w: dict, state, conv_state, cfg: K3Config, reduce=lambda partial: partial):
    """One KDA layer for one token per row. w holds this layer's slice of params['kda'] (see mk.model.params).

    `reduce` sums the output projection's fp32 partials over devices on a mesh
    (`mk.model.reference_sharded.reduce_bf16`, with cfg.heads = this device's heads); identity here.

    Returns (y [B, d] bf16, new state, new conv_state).
    """
    y, states, conv_states = kda_tokens(a[:, None], w, state, conv_state, cfg, reduce)
    return y[:, 0], states[:, 0], conv_states[:, 0]


def kda_tokens(a, w: dict, state, conv_state, cfg: K3Config, reduce=lambda partial: partial):
    """One KDA layer over T consecutive tokens per row (a verify block; T = 1 is a decode step).

    a [B, T, d] bf16 -> (y [B, T, d] bf16, states [B, T, H, D, D] f32, conv_states [B, T, 3, C-1, HD]
    bf16): entry t is the state after token t, so any token's state can be continued from (a
    rejected draft is rolled back by picking an earlier entry). The projections run on all B * T
    rows at once; the conv and the delta rule chain token to token in order, each token exactly
    as a one-token step computes it.
    """
    B, T = a.shape[:2]
    H, D, C = cfg.heads, cfg.head_dim, cfg.conv_size
    a = a.reshape(B * T, -1)
    f = bf(mm(a, w["f_a"]))
    g_raw = bf(mm(f, w["f_b"])).reshape(B, T, H, D)
    qkv = jnp.stack([bf(mm(a, w[n])) for n in ("q", "k", "v")], axis=1)      # [B*T, 3, HD]
    qkv = jnp.swapaxes(qkv.reshape(B, T, 3, H * D), 1, 2)                    # [B, 3, T, HD]
    g_o = bf(mm(a, w["g"])).reshape(B, T, H, D)
    beta = sigmoid(bf(mm(a, w["b"]))).reshape(B, T, H)
    window = jnp.concatenate([conv_state, qkv], axis=2)                       # [B, 3, C-1+T, HD]
    g = decay(g_raw, w["a_log"], w["dt_bias"].reshape(H, D), cfg.gate_lower_bound)
    outs, states, conv_states = [], [], []
    for t in range(T):
        conv = short_conv(window[:, :, t:t + C], w["conv"]).reshape(B, 3, H, D)
        out, state = heads(state, *(conv[:, j] for j in range(3)), g[:, t], beta[:, t], g_o[:, t],
                           w["o_norm"], cfg.eps)
        outs.append(out)
        states.append(state)
        conv_states.append(window[:, :, t + 1:t + C])
    out = jnp.stack(outs, axis=1).reshape(B * T, H * D)
    y = bf(reduce(mm(out, w["o"]))).reshape(B, T, -1)
    return y, jnp.stack(states, axis=1), jnp.stack(conv_states, axis=1)
