"""Parallel prefill: a whole prompt (or chunks of it) through the model in one program per chunk,
writing exactly the caches `mk.model.reference.decode_step` reads.

    logits, cache = prefill(params, init_cache(cfg, B, ctx), tokens, lengths, cfg=cfg, chunk=1024)

`mk.model.reference.prefill` runs a prompt as T decode steps (a `lax.scan`); this runs the B x chunk
rows of a chunk at once:

* KDA in its chunked form (the WY / UT representation of flash-linear-attention's chunk algorithm,
  with KDA's per-channel decay): the prompt is cut into sub-chunks of `kda_chunk(cfg)` tokens;
  inside one, the delta rule's interactions are a strictly lower triangular matrix A, solved by
  forward substitution ((I + A)^-1, the UT transform), all sub-chunks at once; across sub-chunks the
  state is carried by a `lax.scan` of four small matmuls. The short causal conv runs on all
  positions at once (`short_conv` on each position's window) and keeps the last C-1 inputs of each
  row as its conv state.
* MLA as causal attention of the chunk's queries over the cache (earlier chunks or an earlier
  prompt included), after writing the chunk's keys and values at slots pos[b]..pos[b]+n[b]-1.
* The dense MLP and the MoE on all rows at once (`mk.perf.baseline`'s one-dot layers; the routed
  experts with rows sorted by expert and `jax.lax.ragged_dot`, bf16 or packed MXFP4 experts).
* AttnRes over the layers, the final norm and the LM head for every prompt position.

Ragged prompts: row b holds lengths[b] tokens, padding at the end. A padded position writes
nothing: its KDA decay is 1 and its key and update rate 0 (an exact no-op on the state), the conv
state is taken after the row's last real token, its MLA key and value are dropped (a scatter out
of bounds), and pos advances by lengths[b]. Its logits are computed but meaningless.

Not bit-exact with the token-by-token prefill: the chunked delta rule sums the same terms in
another order (matrix products over a sub-chunk instead of one rank-1 update per token), the
projections are single dots over all K (the reference sums 512-deep K slices in order, the
kernel's order) on many rows, and attention takes one softmax over the whole cache instead of an
online one over 128-slot blocks. The tests state the tolerance.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from mk.errors import UserError
from mk.model.config import K3Config
from mk.model.layers.attn_res import mix
from mk.model.layers.common import F32, bf, f32, rms, sigmoid
from mk.model.layers.kda import decay, l2_normalize, output_gate, short_conv
from mk.model.layers.mla import project_qkv
from mk.perf.baseline import EXPERT_FORMATS, dense_layer, dot, moe_layer, routed_ragged

DEFAULT_CHUNK = 1024
HIGHEST = jax.lax.Precision.HIGHEST
# exp(-LOG_RANGE) .. exp(LOG_RANGE) stays a normal fp32 number (|log| < 87.3): the bound on a
# sub-chunk's accumulated log-decay, |gate_lower_bound| * kda_chunk(cfg)
LOG_RANGE = 80.0


class PrefillError(UserError, ValueError):
    """A prompt, length or option the prefill cannot run; the message names the parameter."""


def kda_chunk(cfg: K3Config) -> int:
    """Tokens per KDA sub-chunk: the largest power of two <= 64 whose accumulated log-decay
    (at most |gate_lower_bound| per token) keeps exp(+-decay) in fp32 range (16 for K3's -5)."""
    c = 64
    while c > 1 and c * abs(cfg.gate_lower_bound) > LOG_RANGE:
        c //= 2
    return c


def _mm(eq: str, a, b):
    """fp32 einsum at full precision (on a TPU the default rounds fp32 operands to bf16)."""
    return jnp.einsum(eq, a, b, precision=HIGHEST, preferred_element_type=F32)


def chunked_delta_rule(state, q, k, v, g, beta, chunk: int):
    """The gated delta rule over T tokens in sub-chunks of `chunk`, fp32.

    state [B, H, D, D] (key, value); q, k, v, g [B, H, T, D] (q, k normalised, q scaled, g the
    log-decay); beta [B, H, T]; T a multiple of chunk -> (o [B, H, T, D], state after token T).
    Per token, as `mk.model.layers.kda.delta_rule_head`:
        S <- diag(exp g_t) S;  u_t = beta_t (v_t - S^T k_t);  S <- S + k_t u_t^T;  o_t = S^T q_t.
    In a sub-chunk with cumulative log-decay G_t (G_0 = g_1 + ...), from its start state S0:
        S_t = diag(e^G_t) (S0 + sum_{s<=t} (k_s e^-G_s) u_s^T),
        (I + A) U = diag(beta) (V - (K e^G) S0),  A[t, s] = beta_t (k_t e^G_t) . (k_s e^-G_s), s < t,
        O = (Q e^G) S0 + [(Q e^G)(K e^-G)^T]_{s<=t} U,   S_end = e^G_end S0 + (K e^(G_end - G))^T U.
    U = W_v - W_k S0 with W = (I + A)^-1 diag(beta) [V | K e^G] found without the state ((I + A)^-1
    by forward substitution, all sub-chunks at once); only the four products with S0 chain sub-chunk to
    sub-chunk. |G| <= chunk * |gate_lower_bound| keeps e^+-G finite (`kda_chunk`).
    """
    B, H, T, D = q.shape
    n = T // chunk
    split = lambda x: x.reshape(B, H, n, chunk, *x.shape[3:])
    q, k, v, g, beta = map(split, (q, k, v, g, beta))
    G = jnp.cumsum(g, axis=3)                                                  # [B, H, n, c, D], <= 0
    k_in, k_out, q_in = k * jnp.exp(G), k * jnp.exp(-G), q * jnp.exp(G)
    k_end = k * jnp.exp(G[:, :, :, -1:] - G)
    t_idx = jnp.arange(chunk)
    below = t_idx[:, None] > t_idx[None, :]
    A = jnp.where(below, beta[..., None] * _mm("...td,...sd->...ts", k_in, k_out), 0.0)
    Pq = jnp.where(below | (t_idx[:, None] == t_idx[None, :]), _mm("...td,...sd->...ts", q_in, k_out), 0.0)
    # (I + A)^-1 by forward substitution, row by row: rows t.. of M still hold I's and A[t, s>=t] = 0,
    # so row t is e_t - sum_s A[t, s] M_s. On the [c, c] blocks, then one product with the values.
    def substitute(t, M):
        a_t = jax.lax.dynamic_index_in_dim(A, t, axis=3, keepdims=False)       # [B, H, n, c]
        e_t = jax.lax.dynamic_index_in_dim(M, t, axis=3, keepdims=False)
        return jax.lax.dynamic_update_index_in_dim(M, e_t - jnp.sum(a_t[..., None] * M, axis=3), t, axis=3)
    inv = jax.lax.fori_loop(1, chunk, substitute, jnp.broadcast_to(jnp.eye(chunk, dtype=F32), A.shape))
    W = _mm("...ts,...sd->...td", inv, beta[..., None] * jnp.concatenate([v, k_in], axis=-1))
    w_v, w_k = W[..., :D], W[..., D:]
    decay_end = jnp.exp(G[:, :, :, -1])                                        # [B, H, n, D]

    def step(S, xs):
        wv, wk, qi, pq, ke, de = xs
        U = wv - _mm("bhck,bhkv->bhcv", wk, S)
        O = _mm("bhck,bhkv->bhcv", qi, S) + _mm("bhts,bhsv->bhtv", pq, U)
        S = de[..., :, None] * S + _mm("bhck,bhcv->bhkv", ke, U)
        return S, O

    over_n = lambda x: jnp.moveaxis(x, 2, 0)
    state, o = jax.lax.scan(step, state, tuple(map(over_n, (w_v, w_k, q_in, Pq, k_end, decay_end))))
    return jnp.moveaxis(o, 0, 2).reshape(B, H, T, D), state


def kda_prefill(a, w: dict, state, conv_state, valid, cfg: K3Config):
    """One KDA layer over a chunk. a [B, T, d] bf16; state [B, H, D, D] f32; conv_state
    [B, 3, C-1, HD] bf16; valid [B, T] bool (a prefix of each row) -> (y [B, T, d] bf16, state,
    conv_state), both after each row's last valid token. Steps as `mk.model.layers.kda.kda_tokens`."""
    B, T, _ = a.shape
    H, D, C = cfg.heads, cfg.head_dim, cfg.conv_size
    x = a.reshape(B * T, -1)
    g_raw = bf(dot(bf(dot(x, w["f_a"])), w["f_b"])).reshape(B, T, H, D)
    qkv = jnp.stack([bf(dot(x, w[n])) for n in ("q", "k", "v")], axis=1)       # [B*T, 3, HD]
    qkv = jnp.swapaxes(qkv.reshape(B, T, 3, H * D), 1, 2)                       # [B, 3, T, HD]
    g_o = bf(dot(x, w["g"])).reshape(B, T, H, D)
    beta = sigmoid(bf(dot(x, w["b"]))).reshape(B, T, H)
    window = jnp.concatenate([conv_state, qkv], axis=2)                         # [B, 3, C-1+T, HD]
    with jax.named_scope("kda_conv"):
        taps = jnp.stack([window[:, :, tau:tau + T] for tau in range(C)], axis=3)   # [B, 3, T, C, HD]
        conv = short_conv(jnp.swapaxes(taps, 1, 2).reshape(B * T, 3, C, H * D), w["conv"])
        conv = conv.reshape(B, T, 3, H, D)
        count = jnp.sum(valid, axis=1)                                          # [B]
        conv_state = jax.vmap(lambda win, n: jax.lax.dynamic_slice_in_dim(win, n, C - 1, axis=1))(window, count)
    g = decay(g_raw, w["a_log"], w["dt_bias"].reshape(H, D), cfg.gate_lower_bound)   # [B, T, H, D]
    keep = valid[:, :, None, None]
    q = l2_normalize(conv[:, :, 0]) * (D ** -0.5)
    k = jnp.where(keep, l2_normalize(conv[:, :, 1]), 0.0)                       # padding: k = 0,
    g = jnp.where(keep, g, 0.0)                                                 # decay 1, beta 0
    beta = jnp.where(valid[:, :, None], beta, 0.0)
    c = kda_chunk(cfg)
    pad = -T % c
    heads_first = lambda x: jnp.pad(jnp.swapaxes(x, 1, 2), [(0, 0), (0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 3))
    with jax.named_scope("kda_chunked_delta_rule"):
        o, state = chunked_delta_rule(state, *map(heads_first, (q, k, f32(conv[:, :, 2]), g, beta)), c)
    o = jnp.swapaxes(o[:, :, :T], 1, 2)                                         # [B, T, H, D]
    out = output_gate(o, g_o, w["o_norm"], cfg.eps).reshape(B * T, H * D)
    return bf(dot(out, w["o"])).reshape(B, T, -1), state, conv_state


def mla_prefill(a, w: dict, k_cache, v_cache, pos, valid, cfg: K3Config):
    """One MLA layer over a chunk at positions pos[b]..pos[b]+T-1. a [B, T, d] bf16; caches
    [B, H, ctx, Kc] / [B, H, ctx, D] bf16; pos [B]; valid [B, T] -> (y [B, T, d] bf16, caches).
    The valid tokens' keys and values are written first, then every query attends causally to
    slots 0..pos[b]+t (one softmax over the cache, fp32). Steps as `mk.model.layers.mla.mla_tokens`."""
    B, T, _ = a.shape
    H, D = cfg.heads, cfg.head_dim
    ctx = k_cache.shape[2]
    x = a.reshape(B * T, -1)
    q, k, v = project_qkv(x, w, cfg)                                            # [B*T, H, Kc|D]
    heads_first = lambda z: jnp.swapaxes(z.reshape(B, T, H, -1), 1, 2)         # [B, H, T, X]
    q, k, v = map(heads_first, (q, k, v))
    token_pos = pos[:, None] + jnp.arange(T, dtype=pos.dtype)[None]             # [B, T]
    slot = jnp.where(valid, token_pos, ctx)                                     # padding: out of bounds
    write = jax.vmap(lambda c, new, s: c.at[:, s].set(new, mode="drop"))
    k_cache, v_cache = write(k_cache, k, slot), write(v_cache, v, slot)
    with jax.named_scope("mla_attention"):
        s = jnp.einsum("bhtk,bhsk->bhts", q, k_cache, preferred_element_type=F32) * cfg.mla_scale
        seen = jnp.arange(ctx)[None, None, None, :] <= token_pos[:, None, :, None]
        s = jnp.where(seen, s, -jnp.inf)
        p = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))
        o = _mm("bhts,bhsd->bhtd", p, f32(v_cache))                               # unseen slots: p = 0
        o = o / jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.swapaxes(o, 1, 2).reshape(B * T, H, D)
    gate = bf(sigmoid(bf(dot(x, w["g"])))).reshape(B * T, H, D)
    out = bf(f32(bf(o)) * f32(gate)).reshape(B * T, H * D)
    return bf(dot(out, w["o"])).reshape(B, T, -1), k_cache, v_cache


@functools.partial(jax.jit, static_argnames=("cfg", "experts"), donate_argnums=(1,))
def prefill_chunk(params: dict, cache: dict, tokens, count, *, cfg: K3Config, experts: str = "bf16"):
    """One chunk: tokens [B, T] int32 at positions pos[b].., the first count[b] of each row real
    -> (logits [B, T, V] f32, cache advanced by count). The cache is donated."""
    B, T = tokens.shape
    pos = cache["pos"]
    valid = jnp.arange(T)[None, :] < count[:, None]
    kda_state, conv_state = cache["kda_state"], cache["conv_state"]
    mla_k, mla_v = cache["mla_k"], cache["mla_v"]
    rows = lambda z: z.reshape(B, T, -1)
    # the routed experts sorted by expert through ragged_dot, MXFP4 dequantized layer by layer
    routed = lambda latent, ids, weights, params, i: routed_ragged(latent, ids, weights, params["moe"], i, cfg,
                                                                  experts, one_layer=True)
    p = params["embed"][jnp.where(valid, tokens, 0).reshape(B * T)]            # [B*T, d] bf16
    blocks = []
    take = lambda tree, i: {n: x[i] for n, x in tree.items()}
    for l in range(cfg.layers):
        with jax.named_scope(f"layer{l}"):
            lw = take(params["layer"], l)
            x = mix(p, blocks[:cfg.n_attn_blocks(l)], lw["attn_res"], cfg.eps, cfg.n_blocks)
            if cfg.starts_block(l):
                blocks.append(p)
            a = rows(rms(x, lw["attn_norm"], cfg.eps))
            i = cfg.family_index(l)
            if cfg.is_mla(l):
                y, k_i, v_i = mla_prefill(a, take(params["mla"], i), mla_k[:, i], mla_v[:, i], pos, valid, cfg)
                mla_k, mla_v = mla_k.at[:, i].set(k_i), mla_v.at[:, i].set(v_i)
            else:
                y, s_i, c_i = kda_prefill(a, take(params["kda"], i), kda_state[:, i], conv_state[:, i], valid, cfg)
                kda_state, conv_state = kda_state.at[:, i].set(s_i), conv_state.at[:, i].set(c_i)
            y = y.reshape(B * T, -1)
            p = y if cfg.starts_block(l) else bf(p + y)
            x = mix(p, blocks[:cfg.n_mlp_blocks(l)], lw["mlp_res"], cfg.eps, cfg.n_blocks)
            m = rms(x, lw["ffn_norm"], cfg.eps)
            z = dense_layer(m, params["dense"], cfg) if l == 0 else \
                moe_layer(m, params, l - 1, cfg, experts, "ragged", routed=routed)[0]
            p = bf(p + z)
    with jax.named_scope("head"):
        h = mix(p, blocks, params["output_res"], cfg.eps)
        logits = dot(rms(h, params["final_norm"], cfg.eps), params["lm_head"])
    cache = {"pos": pos + count, "kda_state": kda_state, "conv_state": conv_state, "mla_k": mla_k, "mla_v": mla_v}
    return logits.reshape(B, T, -1), cache


def check_prompt(cfg: K3Config, cache: dict, tokens, lengths, chunk) -> tuple[np.ndarray, np.ndarray]:
    """The host-side checks of `prefill`; returns (tokens, lengths) as int32 numpy arrays."""
    if isinstance(chunk, bool) or not isinstance(chunk, (int, np.integer)) or chunk < 1:
        raise PrefillError(f"chunk: must be a positive integer, found {chunk!r}")
    tokens = np.asarray(tokens)
    if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
        raise PrefillError(f"tokens: expected integer ids [B, T], found {tokens.dtype} {list(tokens.shape)}")
    B, T = tokens.shape
    lengths = np.full((B,), T) if lengths is None else np.asarray(lengths)
    if lengths.shape != (B,) or not np.issubdtype(lengths.dtype, np.integer):
        raise PrefillError(f"lengths: expected {B} integers (one per prompt), found {lengths.dtype} {list(lengths.shape)}")
    if lengths.min(initial=0) < 0 or lengths.max(initial=0) > T:
        raise PrefillError(f"lengths: each must lie in [0, {T}] (the tokens' width), found {lengths.tolist()}")
    real = np.arange(T)[None, :] < lengths[:, None]
    ids = tokens[real]
    if ids.size and (ids.min() < 0 or ids.max() >= cfg.vocab):
        bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
        raise PrefillError(f"tokens: ids must lie in [0, {cfg.vocab}) (the vocabulary), found {bad}")
    ctx = cache["mla_k"].shape[3]
    end = np.asarray(cache["pos"]) + lengths
    if end.max(initial=0) > ctx:
        b = int(np.argmax(end))
        raise PrefillError(f"tokens: prompt {b} ends at position {int(end[b])}, past the cache capacity ctx={ctx}")
    return tokens.astype(np.int32), lengths.astype(np.int32)


def prefill(params: dict, cache: dict, tokens, lengths=None, *, cfg: K3Config, chunk: int = DEFAULT_CHUNK,
            experts: str = "bf16"):
    """Prompts tokens [B, T] int32 (row b's first lengths[b] real, padding after; default all T)
    from `cache` (as `mk.model.reference.init_cache`; prompts continue from pos[b]) ->
    (logits [B, T, V] f32, cache advanced by lengths). logits[b, t] = what the decode step returns
    after consuming tokens[b, :t+1] (t < lengths[b]; padded positions' logits are meaningless).

    chunk: prompt tokens per program (T is cut into ceil(T / chunk) calls of one compiled chunk,
    the last padded); experts: "bf16" or "mxfp4" (params as `mk.perf.baseline.step` takes them).
    The cache passed in is donated (consumed)."""
    if experts not in EXPERT_FORMATS:
        raise PrefillError(f"experts: expected one of {EXPERT_FORMATS}, found {experts!r}")
    tokens, lengths = check_prompt(cfg, cache, tokens, lengths, chunk)
    B, T = tokens.shape
    if T == 0:
        raise PrefillError("tokens: the prompts must hold at least one position, found T = 0")
    chunk = min(int(chunk), T)
    padded = np.zeros((B, -(-T // chunk) * chunk), np.int32)
    padded[:, :T] = tokens
    outs = []
    for start in range(0, padded.shape[1], chunk):
        count = np.clip(lengths - start, 0, chunk).astype(np.int32)
        logits, cache = prefill_chunk(params, cache, jnp.asarray(padded[:, start:start + chunk]),
                                      jnp.asarray(count), cfg=cfg, experts=experts)
        outs.append(logits)
    logits = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)
    return logits[:, :T], cache
