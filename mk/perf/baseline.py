"""A fair XLA decode step: what a TPU serving stack would write in JAX, for `mk bench` to race.

`mk.model.reference.decode_step` is the oracle, written for clarity, not speed: K-chunked matmuls, a
`lax.map` over every (row, head) of KDA and MLA, and each row reading its own top-k experts. This
module computes the same function (the spec's bf16 rounding points, fp32 accumulation) the way
XLA is meant to be fed:

* plain `jnp.dot` / `einsum` with `preferred_element_type=f32`, no K-chunking, batched over rows;
* KDA's delta rule and MLA's attention as batched elementwise/reduction expressions over
  `[B, H, ...]` (no per-row or per-head map; the MLA scores as one bf16 x bf16 -> f32 dot over
  the whole cache with a causal mask);
* each distinct routed expert read once per step for the whole batch (`moe=`):
    "loop"   (default) a `fori_loop` over the step's distinct experts (sorted ids, a dynamic trip
             count); each iteration dynamic-slices one expert's w1/w3/w2 and runs it on all B rows,
             rows that did not choose it weighted exactly 0 (so every row sums its experts in
             ascending id order, as the reference does). An expert's bytes are read once, only the
             chosen ones; MXFP4 experts are dequantized on the fly inside the loop (the slice of
             codes and scales, `dequantize`).
    "ragged" rows sorted by expert and `jax.lax.ragged_dot` with group sizes over all E experts
             (XLA's grouped matmul; MXFP4 experts: the whole layer dequantized each step).

`make_baseline_step(cfg, experts="bf16"|"mxfp4", moe="loop")` returns
`step(params, cache, tokens) -> (logits [B, V] f32, cache)`, jitted with the cache donated; params
as `mk.model.params` (experts="mxfp4": the packed tree of `mk.io.checkpoint.load(..., experts="mxfp4")` /
`mk.io.synth.mxfp4_params`: moe.w1/w3/w2 = {"packed": u8 [n_moe, E, N, K/2], "scale": u8
[n_moe, E, N, K/32]}); cache as `mk.model.reference.init_cache`.

What grows with B in XLA: `cost_report(cfg, B, impl)` compiles a step deviceless for `v5e:2x2`
(1 device, the real XLA:TPU compiler) and reads `compiled.cost_analysis()`,
`compiled.memory_analysis()` and the largest buffers of the optimized HLO (`as_text()`). On
k3-chip (6.02 GB of bf16 params; 3.91 GB dense, 2.11 GB routed experts = 66 MB per expert):

    step                  B   flops    bytes accessed   temp (memory_analysis)
    reference.decode_step 1   3.59e10  15.6 GB          1.96 GB
    reference.decode_step 8   9.51e10  32.5 GB          3.20 GB
    baseline (loop) bf16  1   5.37e9    5.0 GB          5.7 MB
    baseline (loop) bf16  8   2.87e10   4.7 GB          7.5 MB
    baseline (loop) mxfp4 1   6.53e9    5.9 GB          28 MB
    baseline (loop) mxfp4 8   3.00e10  12.0 GB          752 MB
    baseline (ragged) bf16 1/8  6.2e9 / 3.6e10   9.6 / 8.9 GB   6 / 8 MB

(cost_analysis counts a while loop's body once, so the loop's routed experts appear as one expert
per layer; "bytes accessed" also counts XLA's prefetch copies into VMEM (S(1)) as traffic.)
What the HLO showed:
1. A static layer slice of a stacked expert family (`params["moe"]["w1"][l]`, as the reference's
   `layer_slice` does) feeding a loop/gather is materialized: `slice_bitcast_fusion` copies of
   every layer's [E, Lt, Fe] experts, 6 x 352 MB = 2.1 GB of temporaries per step at any B (the
   reference's 1.96 GB; my first draft of this step had it too). Fixed here by indexing
   `[layer * E + expert]` of the whole stacked array inside the loop (`expert_matrix`), and in
   the ragged mode by giving `ragged_dot` every layer's groups (the other layer's empty).
2. What grows with B in the reference: the per-row expert gathers under `vmap`: 48 buffers of
   bf16 [B, 1, 3584, 3072] (176 MB each at B = 8) materialize each row's chosen experts (B x k
   copies per MoE matrix), plus the `lax.map` over B x H (row, head) pairs of KDA and MLA, a
   sequential loop whose trip count is 8x longer at B = 8. Temporaries 1.96 -> 3.20 GB, bytes
   15.6 -> 32.5 GB. The baseline has neither: its bytes do not grow with B (5.0 / 4.7 GB at B = 1 / 8;
   the KDA state, f32 [B, 2, 32, 128, 128] = 33.6 MB at B = 8, is its largest B-sized buffer).
3. MXFP4 in XLA: at B = 8 (not at B = 1) XLA's layout assignment picks a tiled layout for the
   u8 packed experts inside the loop and relayouts the whole stacked packed arrays (3 x 176 MB
   `copy` per step, temp 752 MB) before it. Transposing the bytes at load time (N on lanes) moved
   the copy to B = 1 instead (temp 318 MB / 224 MB at B = 1 / 8), an optimization barrier on the
   slice did not remove it; the step keeps the checkpoint's layout and this copy is XLA's cost.
4. `ragged_dot` reads every group's weights (all E experts of the layer) whatever the group sizes:
   cost 9.6 GB at B = 1 against the loop's 5.0 (at k3-chip's 16 experts top-8 B = 8 touches
   15.9 of 16 experts anyway). Hence "loop" is the default.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from mk.model.config import K3Config
from mk.model.layers.attn_res import mix
from mk.model.layers.common import BF16, F32, bf, f32, rms, rsqrt, sigmoid, situ
from mk.model.layers.kda import QK_NORM_EPS, decay, output_gate, short_conv
from mk.model.config import MX_GROUP

EXPERT_FORMATS = ("bf16", "mxfp4")
MOE_MODES = ("loop", "ragged")

def dot(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., K] @ w [K, N] in one dot, bf16 operands, fp32 accumulation -> [..., N] f32."""
    return jnp.dot(x, w, preferred_element_type=F32)


# ---- MXFP4 on the fly ---------------------------------------------------------------------------
def dequantize(packed: jax.Array, scale: jax.Array) -> jax.Array:
    """MXFP4 bytes -> bf16 in the checkpoint's orientation, inside a jitted step (spec 2.3).

    packed u8 [..., N, K/2] (element 2j in the low nibble), scale u8 [..., N, K/32] (E8M0 bytes
    1..254) -> bf16 [..., N, K] = E2M1 value * 2^(scale - 127), exactly as
    `mk.io.convert.dequantize_mxfp4(..., transpose=False)` (integer ops, one fp32 product, one
    rounding; a subnormal result, 0.5 * 2^-126 at scale byte 1, is flushed to zero where XLA
    flushes denormals, as on TPU). An E2M1 code c = s|e e|m is (-1)^s * halves / 2 with halves = m (e = 0) or
    (2 + m) << (e - 1)."""
    p = packed.astype(jnp.int32)
    codes = jnp.stack([p & 15, p >> 4], axis=-1).reshape(*p.shape[:-1], -1)       # [..., N, K]
    value = e2m1(codes)
    step = scale_step(scale)
    lead = codes.shape[:-1]
    k = codes.shape[-1]
    out = value.reshape(*lead, k // MX_GROUP, MX_GROUP) * step[..., None]
    return bf(out.reshape(*lead, k))


def e2m1(codes: jax.Array) -> jax.Array:
    """E2M1 codes (int32 0..15) -> their fp32 values (`dequantize`)."""
    e, m = (codes >> 1) & 3, codes & 1
    halves = jnp.where(e == 0, m, (2 + m) << jnp.maximum(e - 1, 0)).astype(F32)
    return jnp.where(codes >= 8, -halves, halves) * 0.5                              # code 8 = -0.0


def scale_step(scale: jax.Array) -> jax.Array:
    """E8M0 scale bytes -> 2^(s - 127), fp32."""
    return jax.lax.bitcast_convert_type(scale.astype(jnp.int32) << 23, F32)


def dequantize_halves(packed: jax.Array, scale: jax.Array) -> tuple[jax.Array, jax.Array]:
    """MXFP4 bytes -> the bf16 weights of the even and of the odd contraction rows, [..., K/2, N]
    each (values as `dequantize`): x @ W = x[:, 0::2] @ even + x[:, 1::2] @ odd. Nothing is
    interleaved: `dequantize`'s nibble interleave and group broadcast along the minor axis compile
    on a TPU to int32 / fp32 copies of the whole matrix; here the bytes are transposed first
    (N on lanes), each scale multiplies its [16, N] block, and only major axes are merged."""
    step = scale_step(jnp.swapaxes(scale, -1, -2))[..., None, :]                      # [..., K/32, 1, N]
    *lead, groups, _, N = step.shape
    p = jnp.swapaxes(packed, -1, -2).astype(jnp.int32).reshape(*lead, groups, MX_GROUP // 2, N)
    half = lambda codes: bf(e2m1(codes) * step).reshape(*lead, groups * MX_GROUP // 2, N)
    return half(p & 15), half(p >> 4)


def expert_matrix(w, i: int, e, experts: str) -> tuple[jax.Array, tuple]:
    """MoE layer i's expert e of a stacked family [n_moe, E, ...] and the dot_general dims that
    contract it with x [R, K]: bf16 [K, N] (contract dim 0), or MXFP4 dequantized to [N, K] (dim 1).
    One dynamic slice of the whole stacked array: a static layer slice first (`w[i]`) is
    materialized by XLA as a copy of all the layer's experts every step (module doc, finding 1)."""
    flat = lambda x: x.reshape(-1, *x.shape[2:])[i * x.shape[1] + e]          # one dynamic index
    if experts == "mxfp4":
        return dequantize(flat(w["packed"]), flat(w["scale"])), (((1,), (1,)), ((), ()))
    return flat(w), (((1,), (0,)), ((), ()))


def _apply(x, wd):
    w, dims = wd
    if dims[0][1] == (1,):          # MXFP4 [N, K]: w @ x^T, then the small [N, B] result transposed
        return jax.lax.dot_general(w, x, (((1,), (1,)), ((), ())), preferred_element_type=F32).T
    return jax.lax.dot_general(x, w, dims, preferred_element_type=F32)


# ---- layers ------------------------------------------------------------------------------------
def kda_layer(a, w: dict, state, conv_state, cfg: K3Config):
    """One KDA layer, all rows and heads at once. a [B, d] bf16, state [B, H, D, D] f32,
    conv_state [B, 3, C-1, HD] bf16 -> (y [B, d] bf16, state, conv_state)."""
    B = a.shape[0]
    H, D = cfg.heads, cfg.head_dim
    g_raw = bf(dot(bf(dot(a, w["f_a"])), w["f_b"])).reshape(B, H, D)
    qkv = jnp.stack([bf(dot(a, w[n])) for n in ("q", "k", "v")], axis=1)            # [B, 3, HD]
    g_o = bf(dot(a, w["g"])).reshape(B, H, D)
    beta = sigmoid(bf(dot(a, w["b"])))                                                # [B, H]
    window = jnp.concatenate([conv_state, qkv[:, :, None]], axis=2)                 # [B, 3, C, HD]
    conv = short_conv(window, w["conv"]).reshape(B, 3, H, D)
    g = decay(g_raw, w["a_log"], w["dt_bias"].reshape(H, D), cfg.gate_lower_bound)   # [B, H, D]
    l2 = lambda x: f32(x) * rsqrt(jnp.sum(f32(x) * f32(x), axis=-1, keepdims=True) + QK_NORM_EPS)
    q, k, v = l2(conv[:, 0]) * (D ** -0.5), l2(conv[:, 1]), f32(conv[:, 2])
    # the gated delta rule, state [B, H, key, value]
    s = jnp.exp(g)[..., :, None] * state
    u = beta[..., None] * (v - jnp.sum(s * k[..., :, None], axis=-2))
    s = s + k[..., :, None] * u[..., None, :]
    o = jnp.sum(s * q[..., :, None], axis=-2)                                         # [B, H, D]
    out = output_gate(o, g_o, w["o_norm"], cfg.eps).reshape(B, H * D)
    return bf(dot(out, w["o"])), s, window[:, :, 1:]


def mla_layer(a, w: dict, k_cache, v_cache, pos, cfg: K3Config):
    """One MLA layer, all rows and heads at once, dense causal attention over the whole cache.
    a [B, d] bf16, caches [B, H, ctx, Kc] / [B, H, ctx, D] bf16, pos [B] -> (y [B, d], caches)."""
    B, H, D, Kc = a.shape[0], cfg.heads, cfg.head_dim, cfg.k_cache_dim
    c_q = rms(bf(dot(a, w["q_a"])), w["q_a_norm"], cfg.eps)
    kva = bf(dot(a, w["kv_a"]))
    c_kv = rms(kva[:, :cfg.kv_rank], w["kv_a_norm"], cfg.eps)
    k_r = kva[:, cfg.kv_rank:]
    q = bf(dot(c_q, w["q_b"])).reshape(B, H, cfg.qk_head_dim)
    kv = bf(dot(c_kv, w["kv_b"])).reshape(B, H, 2 * D)
    pad = Kc - cfg.qk_head_dim
    q = jnp.pad(q, ((0, 0), (0, 0), (0, pad)))
    k = jnp.concatenate([kv[..., :D], jnp.broadcast_to(k_r[:, None], (B, H, cfg.qk_extra)),
                         jnp.zeros((B, H, pad), kv.dtype)], axis=-1)
    write = jax.vmap(lambda c, n, t: jax.lax.dynamic_update_slice_in_dim(c, n[:, None], t, axis=1))
    k_cache, v_cache = write(k_cache, k, pos), write(v_cache, kv[..., D:], pos)
    s = jnp.einsum("bhk,bhtk->bht", q, k_cache, preferred_element_type=F32) * cfg.mla_scale
    valid = jnp.arange(k_cache.shape[2])[None, None, :] <= pos[:, None, None]
    s = jnp.where(valid, s, -jnp.inf)
    p = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))
    o = jnp.sum(p[..., None] * jnp.where(valid[..., None], f32(v_cache), 0.0), axis=2)
    o = o / jnp.sum(p, axis=-1)[..., None]                                             # [B, H, D]
    gate = bf(sigmoid(bf(dot(a, w["g"])))).reshape(B, H, D)
    out = bf(f32(bf(o)) * f32(gate)).reshape(B, H * D)
    return bf(dot(out, w["o"])), k_cache, v_cache


def route(m, router, bias, top_k: int):
    """`mk.model.layers.moe.route` with one dot: (ids [B, k] ascending, weights [B, k] f32)."""
    s = sigmoid(dot(m, router))
    _, ids = jax.lax.top_k(s + bias[None], top_k)
    chosen = jnp.take_along_axis(s, ids, axis=-1)
    denom = chosen[:, 0:1]
    for j in range(1, top_k):                                    # selection order, as the reference
        denom = denom + chosen[:, j:j + 1]
    order = jnp.argsort(ids, axis=-1)
    ids = jnp.take_along_axis(ids, order, axis=-1).astype(jnp.int32)
    return ids, jnp.take_along_axis(chosen, order, axis=-1) / denom


def routed_loop(latent, ids, weights, w: dict, i: int, cfg: K3Config, experts: str):
    """Sum over each row's experts, one pass per distinct expert of the step. latent [B, Lt] bf16,
    ids / weights [B, k]; w: the stacked expert families (params["moe"]), i: the MoE layer
    -> r_sum [B, Lt] f32 (before its bf16 rounding)."""
    B, k = ids.shape
    slots = min(cfg.experts, B * k)
    distinct = jnp.unique(ids.reshape(-1), size=slots, fill_value=cfg.experts)       # ascending, padded
    n = jnp.sum(distinct < cfg.experts)

    def body(j, acc):
        e = distinct[j]
        row_w = jnp.sum(jnp.where(ids == e, weights, 0.0), axis=-1)                   # [B]: w or exactly 0
        h = situ(bf(_apply(latent, expert_matrix(w["w1"], i, e, experts))),
                 bf(_apply(latent, expert_matrix(w["w3"], i, e, experts))), cfg.situ_beta, cfg.situ_linear_beta)
        out = bf(_apply(h, expert_matrix(w["w2"], i, e, experts)))
        return acc + row_w[:, None] * f32(out)

    acc = jax.lax.optimization_barrier(jnp.zeros(latent.shape, F32))
    return jax.lax.fori_loop(0, n, body, acc)


def routed_ragged(latent, ids, weights, w: dict, i: int, cfg: K3Config, experts: str, one_layer: bool = False):
    """Same sum with rows sorted by expert and `jax.lax.ragged_dot` over all E experts.
    one_layer: MXFP4 experts of layer i only are dequantized, as even and odd contraction rows
    (`dequantize_halves`, two products summed: another fp32 summation order); the default
    dequantizes every layer's whole (8.9 GB of temporaries and 79 GB of traffic in a deviceless
    v5e compile of k3-chip's 1024-token prefill): the parallel prefill's choice, `mk.perf.prefill`."""
    B, k = ids.shape
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    x = latent[order // k]                                                            # [B*k, Lt]
    # groups of every layer's experts, this layer's the only non-empty ones: a static layer slice
    # `w[n][i]` would be copied by XLA every step (module doc)
    E, n_moe = cfg.experts, cfg.n_moe
    counts = jnp.bincount(flat, length=E)
    if one_layer and experts == "mxfp4":                   # layer i's experts, even and odd K rows
        def rd(x, n):
            even, odd = dequantize_halves(w[n]["packed"][i], w[n]["scale"][i])      # [E, K/2, N]
            dot_ = lambda x, h: jax.lax.ragged_dot(x, h, counts, preferred_element_type=F32)
            return dot_(x[:, 0::2], even) + dot_(x[:, 1::2], odd)
    else:
        sizes = jnp.zeros((n_moe * E,), jnp.int32).at[i * E:(i + 1) * E].set(counts)
        merge = lambda x: x.reshape(n_moe * E, *x.shape[2:])
        fam = lambda n: (jnp.swapaxes(dequantize(merge(w[n]["packed"]), merge(w[n]["scale"])), -1, -2)
                         if experts == "mxfp4" else merge(w[n]))                      # [n_moe * E, K, N]
        rd = lambda x, n: jax.lax.ragged_dot(x, fam(n), sizes, preferred_element_type=F32)
    h = situ(bf(rd(x, "w1")), bf(rd(x, "w3")), cfg.situ_beta, cfg.situ_linear_beta)
    out = bf(rd(h, "w2"))
    out = jnp.zeros_like(out).at[order].set(out).reshape(B, k, -1)                   # back to (row, slot)
    acc = jax.lax.optimization_barrier(jnp.zeros(latent.shape, F32))
    for j in range(k):                                                               # ascending ids per row
        acc = acc + weights[:, j:j + 1] * f32(out[:, j])
    return acc


def moe_layer(m, params: dict, i: int, cfg: K3Config, experts: str, moe: str, routed=None):
    """MoE layer i, m [B, d] bf16 -> (z [B, d] bf16, ids [B, k]), the reference's rounding points.
    params: the step's whole tree (params["moe"] stacked over MoE layers). routed: None (this
    module's `moe` mode on params["moe"]'s w1/w3/w2) or a function (latent [B, Lt] bf16, ids [B, k],
    weights [B, k] f32, params, i) -> r_sum [B, Lt] (rounded to bf16 here) that computes the routed
    experts another way (`mk.perf.peer`: tpu-inference's fused MoE kernel)."""
    moe_params = params["moe"]
    w = {k: v[i] for k, v in moe_params.items() if k not in ("w1", "w3", "w2")}
    ids, weights = route(m, w["router"], w["router_bias"], cfg.top_k)
    latent = bf(dot(m, w["latent_down"]))
    if routed is None:
        mode = routed_loop if moe == "loop" else routed_ragged
        routed = lambda latent, ids, weights, params, i: mode(latent, ids, weights, params["moe"], i, cfg, experts)
    with jax.named_scope("routed_experts"):
        r_sum = bf(routed(latent, ids, weights, params, i))
    z_routed = dot(rms(r_sum, w["latent_norm"], cfg.eps), w["latent_up"])
    h = situ(bf(dot(m, w["shared_gate"])), bf(dot(m, w["shared_up"])), cfg.situ_beta, cfg.situ_linear_beta)
    return bf(z_routed + dot(h, w["shared_down"])), ids


def dense_layer(m, w: dict, cfg: K3Config):
    h = situ(bf(dot(m, w["gate"])), bf(dot(m, w["up"])), cfg.situ_beta, cfg.situ_linear_beta)
    return bf(dot(h, w["down"]))


def _slice(tree: dict, i: int) -> dict:
    return jax.tree.map(lambda x: x[i], tree)


def step(params: dict, cache: dict, tokens: jax.Array, *, cfg: K3Config, experts: str = "bf16",
         moe: str = "loop", routing: bool = False, routed=None):
    """One decode step (not jitted; `make_baseline_step` jits it): tokens [B] int32 ->
    (logits [B, V] f32, cache advanced by one position), and with `routing` the chosen experts
    ids [n_moe, B, k] int32 (ascending per row) as a third output. routed: see `moe_layer`."""
    chosen = []
    pos = cache["pos"]
    kda_state, conv_state = cache["kda_state"], cache["conv_state"]
    mla_k, mla_v = cache["mla_k"], cache["mla_v"]
    p = params["embed"][tokens]                                                       # [B, d] bf16
    blocks: list[jax.Array] = []
    for l in range(cfg.layers):
        lw = _slice(params["layer"], l)
        x = mix(p, blocks[:cfg.n_attn_blocks(l)], lw["attn_res"], cfg.eps)
        if cfg.starts_block(l):
            blocks.append(p)
        a = rms(x, lw["attn_norm"], cfg.eps)
        i = cfg.family_index(l)
        if cfg.is_mla(l):
            y, k_i, v_i = mla_layer(a, _slice(params["mla"], i), mla_k[:, i], mla_v[:, i], pos, cfg)
            mla_k, mla_v = mla_k.at[:, i].set(k_i), mla_v.at[:, i].set(v_i)
        else:
            y, s_i, c_i = kda_layer(a, _slice(params["kda"], i), kda_state[:, i], conv_state[:, i], cfg)
            kda_state, conv_state = kda_state.at[:, i].set(s_i), conv_state.at[:, i].set(c_i)
        p = y if cfg.starts_block(l) else bf(p + y)
        x = mix(p, blocks[:cfg.n_mlp_blocks(l)], lw["mlp_res"], cfg.eps)
        mm_in = rms(x, lw["ffn_norm"], cfg.eps)
        if l == 0:
            z = dense_layer(mm_in, params["dense"], cfg)
        else:
            z, ids = moe_layer(mm_in, params, l - 1, cfg, experts, moe, routed)
            chosen.append(ids)
        p = bf(p + z)
    h = mix(p, blocks, params["output_res"], cfg.eps)
    logits = dot(rms(h, params["final_norm"], cfg.eps), params["lm_head"])
    cache = {"pos": pos + 1, "kda_state": kda_state, "conv_state": conv_state, "mla_k": mla_k, "mla_v": mla_v}
    return (logits, cache, jnp.stack(chosen)) if routing else (logits, cache)


def _check_options(experts: str, moe: str) -> None:
    """The fair step's options, checked once for the decode and the verify step."""
    if experts not in EXPERT_FORMATS:
        raise ValueError(f"experts must be one of {EXPERT_FORMATS}, found {experts!r}")
    if moe not in MOE_MODES:
        raise ValueError(f"moe must be one of {MOE_MODES}, found {moe!r}")


def make_baseline_step(cfg: K3Config, experts: str = "bf16", moe: str = "loop", routing: bool = False):
    """The fair XLA step, jitted with the cache donated: step(params, cache, tokens) -> (logits, cache)
    (+ the routed ids with `routing`, see `step`). experts: the format `params` holds the routed
    experts in; moe: "loop" or "ragged" (module doc)."""
    _check_options(experts, moe)
    return jax.jit(functools.partial(step, cfg=cfg, experts=experts, moe=moe, routing=routing), donate_argnums=(1,))


# ---- the verify step (speculative decoding) -----------------------------------------------------
def kda_tokens(a, w: dict, state, conv_state, cfg: K3Config):
    """One KDA layer over T consecutive tokens of each row: a [B, T, d] bf16, state [B, H, D, D] f32,
    conv_state [B, 3, C-1, HD] bf16 -> (y [B * T, d] bf16, the states after each token [B, T, H, D, D],
    the conv states after each token [B, T, 3, C-1, HD]). The projections are `kda_layer`'s dots on
    all B x T rows at once (each weight read once); the short conv and the delta rule, which chain
    token to token, run T times on [B, H, ...] (`kda_layer`'s expressions)."""
    B, T, _ = a.shape
    H, D = cfg.heads, cfg.head_dim
    x = a.reshape(B * T, -1)
    g_raw = bf(dot(bf(dot(x, w["f_a"])), w["f_b"])).reshape(B * T, H, D)
    qkv = jnp.stack([bf(dot(x, w[n])) for n in ("q", "k", "v")], axis=1).reshape(B, T, 3, H * D)
    g_o = bf(dot(x, w["g"])).reshape(B, T, H, D)
    beta = sigmoid(bf(dot(x, w["b"]))).reshape(B, T, H)
    g = decay(g_raw, w["a_log"], w["dt_bias"].reshape(H, D), cfg.gate_lower_bound).reshape(B, T, H, D)
    l2 = lambda x: f32(x) * rsqrt(jnp.sum(f32(x) * f32(x), axis=-1, keepdims=True) + QK_NORM_EPS)
    states, convs, outs = [], [], []
    for t in range(T):
        window = jnp.concatenate([conv_state, qkv[:, t, :, None]], axis=2)          # [B, 3, C, HD]
        conv = short_conv(window, w["conv"]).reshape(B, 3, H, D)
        q, k, v = l2(conv[:, 0]) * (D ** -0.5), l2(conv[:, 1]), f32(conv[:, 2])
        s = jnp.exp(g[:, t])[..., :, None] * state
        u = beta[:, t, :, None] * (v - jnp.sum(s * k[..., :, None], axis=-2))
        state = s + k[..., :, None] * u[..., None, :]
        outs.append(jnp.sum(state * q[..., :, None], axis=-2))                      # [B, H, D]
        conv_state = window[:, :, 1:]
        states.append(state)
        convs.append(conv_state)
    out = output_gate(jnp.stack(outs, axis=1), g_o, w["o_norm"], cfg.eps).reshape(B * T, H * D)
    return bf(dot(out, w["o"])), jnp.stack(states, axis=1), jnp.stack(convs, axis=1)


def mla_tokens(a, w: dict, k_cache, v_cache, pos, cfg: K3Config):
    """One MLA layer over T consecutive tokens of each row at positions pos[b]..pos[b]+T-1: a [B, T, d]
    bf16, caches [B, H, ctx, Kc] / [B, H, ctx, D] bf16 -> (y [B * T, d] bf16, caches with the T slots
    written). `mla_layer`'s dots on all B x T rows; each query attends to the cache up to its own
    position (one bf16 x bf16 -> f32 dot over the whole cache, a causal mask, fp32 softmax)."""
    B, T, _ = a.shape
    H, D, Kc = cfg.heads, cfg.head_dim, cfg.k_cache_dim
    x = a.reshape(B * T, -1)
    c_q = rms(bf(dot(x, w["q_a"])), w["q_a_norm"], cfg.eps)
    kva = bf(dot(x, w["kv_a"]))
    c_kv = rms(kva[:, :cfg.kv_rank], w["kv_a_norm"], cfg.eps)
    k_r = kva[:, cfg.kv_rank:]
    q = bf(dot(c_q, w["q_b"])).reshape(B * T, H, cfg.qk_head_dim)
    kv = bf(dot(c_kv, w["kv_b"])).reshape(B * T, H, 2 * D)
    pad = Kc - cfg.qk_head_dim
    q = jnp.pad(q, ((0, 0), (0, 0), (0, pad)))
    k = jnp.concatenate([kv[..., :D], jnp.broadcast_to(k_r[:, None], (B * T, H, cfg.qk_extra)),
                         jnp.zeros((B * T, H, pad), kv.dtype)], axis=-1)
    heads_first = lambda z: jnp.swapaxes(z.reshape(B, T, H, -1), 1, 2)                # [B, H, T, X]
    q, k, v = heads_first(q), heads_first(k), heads_first(kv[..., D:])
    write = jax.vmap(lambda c, n, t: jax.lax.dynamic_update_slice_in_dim(c, n, t, axis=1))
    k_cache, v_cache = write(k_cache, k, pos), write(v_cache, v, pos)
    s = jnp.einsum("bhtk,bhsk->bhts", q, k_cache, preferred_element_type=F32) * cfg.mla_scale
    token_pos = pos[:, None] + jnp.arange(T, dtype=pos.dtype)[None]                     # [B, T]
    valid = jnp.arange(k_cache.shape[2])[None, None, None, :] <= token_pos[:, None, :, None]
    s = jnp.where(valid, s, -jnp.inf)
    p = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))
    o = jnp.einsum("bhts,bhsd->bhtd", p, f32(v_cache), precision=jax.lax.Precision.HIGHEST,
                   preferred_element_type=F32)                                         # unseen slots: p = 0
    o = jnp.swapaxes(o / jnp.sum(p, axis=-1)[..., None], 1, 2).reshape(B * T, H, D)
    gate = bf(sigmoid(bf(dot(x, w["g"])))).reshape(B * T, H, D)
    out = bf(f32(bf(o)) * f32(gate)).reshape(B * T, H * D)
    return bf(dot(out, w["o"])), k_cache, v_cache


def verify_step(params: dict, cache: dict, tokens: jax.Array, *, cfg: K3Config, experts: str = "bf16",
                moe: str = "loop", aux_layers: tuple[int, ...] = ()):
    """The fair XLA step as a speculative verify step (not jitted; `make_verify_step` jits it):
    tokens [B, T] int32 (the anchor and T - 1 drafts of each row, at positions pos[b]..pos[b]+T-1)
    -> (logits [B, T, V] f32, block), as `mk.model.reference.verify_step`: the step of `step` over
    B x T rows (every projection, the dense MLP and the MoE on all rows at once: each weight and each
    distinct routed expert of the B x T rows read once), KDA chained token to token (`kda_tokens`),
    MLA causal over the T new slots (`mla_tokens`). block: kda_state [B, T, n_kda, H, D, D] and
    conv_state [B, T, n_kda, 3, C-1, HD] (after each token), mla_k / mla_v (the T slots written),
    aux [B, T, len(aux_layers), d] bf16 (the prefix p each aux layer starts with), and pos (the
    step's start positions, so `commit_block` needs no cache: the step may donate it)."""
    B, T = tokens.shape
    pos = cache["pos"]
    kda_state, conv_state = cache["kda_state"], cache["conv_state"]
    kda_states, conv_states = [None] * cfg.n_kda, [None] * cfg.n_kda
    mla_k, mla_v = cache["mla_k"], cache["mla_v"]
    p = params["embed"][tokens.reshape(B * T)]                                        # [B*T, d] bf16
    blocks: list[jax.Array] = []
    aux = {}
    for l in range(cfg.layers):
        if l in aux_layers:
            aux[l] = p
        lw = _slice(params["layer"], l)
        x = mix(p, blocks[:cfg.n_attn_blocks(l)], lw["attn_res"], cfg.eps)
        if cfg.starts_block(l):
            blocks.append(p)
        a = rms(x, lw["attn_norm"], cfg.eps).reshape(B, T, -1)
        i = cfg.family_index(l)
        if cfg.is_mla(l):
            y, k_i, v_i = mla_tokens(a, _slice(params["mla"], i), mla_k[:, i], mla_v[:, i], pos, cfg)
            mla_k, mla_v = mla_k.at[:, i].set(k_i), mla_v.at[:, i].set(v_i)
        else:
            y, kda_states[i], conv_states[i] = kda_tokens(a, _slice(params["kda"], i), kda_state[:, i],
                                                          conv_state[:, i], cfg)
        p = y if cfg.starts_block(l) else bf(p + y)
        x = mix(p, blocks[:cfg.n_mlp_blocks(l)], lw["mlp_res"], cfg.eps)
        m = rms(x, lw["ffn_norm"], cfg.eps)
        z = dense_layer(m, params["dense"], cfg) if l == 0 else moe_layer(m, params, l - 1, cfg, experts, moe)[0]
        p = bf(p + z)
    h = mix(p, blocks, params["output_res"], cfg.eps)
    logits = dot(rms(h, params["final_norm"], cfg.eps), params["lm_head"]).reshape(B, T, -1)
    rows = lambda x: x.reshape(B, T, -1)
    block = {"kda_state": jnp.stack(kda_states, axis=2), "conv_state": jnp.stack(conv_states, axis=2),
             "mla_k": mla_k, "mla_v": mla_v, "pos": pos,
             "aux": (jnp.stack([rows(aux[l]) for l in aux_layers], axis=2) if aux_layers else
                     jnp.zeros((B, T, 0, cfg.dim), BF16))}
    return logits, block


def commit_block(cache, block: dict, count) -> dict:
    """`mk.model.reference.commit` from the block alone (its pos): the cache after accepting rows
    0..count[b] of each row's verify block; `cache` is not read (the verify step donated it)."""
    from mk.model.reference import commit
    return commit({"pos": block["pos"]}, block, jnp.asarray(count, jnp.int32))


def make_verify_step(cfg: K3Config, experts: str = "bf16", moe: str = "loop", aux_layers: tuple[int, ...] = ()):
    """`verify_step` jitted with the cache donated, as `make_baseline_step` jits the decode step:
    verify(params, cache, tokens [B, T]) -> (logits [B, T, V] f32, block)."""
    _check_options(experts, moe)
    return jax.jit(functools.partial(verify_step, cfg=cfg, experts=experts, moe=moe, aux_layers=tuple(aux_layers)),
                   donate_argnums=(1,))


class XlaVerifier:
    """The fair XLA step as a speculative verifier (`mk.kernel.speculative`'s interface, as
    `ReferenceVerifier` and `mk.kernel.step.KernelVerifier`): `verify_step` over batch x (1 + k) rows,
    the reference's cache layout (`init_cache`, `adopt` as they are), rollback by `commit_block`.
    experts: the format `params` holds the routed experts in (as `make_baseline_step`)."""

    def __init__(self, cfg: K3Config, experts: str = "bf16", moe: str = "loop"):
        self.cfg, self.experts, self.moe = cfg, experts, moe
        self._steps: dict = {}
        self._step(())                                        # the options checked here

    def _step(self, aux_layers):
        aux_layers = tuple(aux_layers)
        if aux_layers not in self._steps:
            self._steps[aux_layers] = make_verify_step(self.cfg, self.experts, self.moe, aux_layers)
        return self._steps[aux_layers]

    def init_cache(self, batch: int, ctx: int) -> dict:
        from mk.model.reference import init_cache
        return init_cache(self.cfg, batch, ctx)

    def adopt(self, cache: dict) -> dict:
        return cache

    def verify(self, params, cache, tokens, aux_layers=()):
        """tokens [B, 1 + k] -> (logits [B, 1 + k, V] f32, block); the cache is donated (consumed)."""
        return self._step(aux_layers)(params, cache, jnp.asarray(tokens, jnp.int32))

    def commit(self, cache, block, count):
        return commit_block(cache, block, count)

    def traced(self, params, aux_layers):
        """(weights, verify(weights, cache, tokens), commit(cache, block, count)), traceable, for
        `mk.kernel.speculative.device_generate`."""
        verify = functools.partial(verify_step, cfg=self.cfg, experts=self.experts, moe=self.moe,
                                   aux_layers=tuple(aux_layers))
        return params, verify, commit_block


def abstract_params(cfg: K3Config, experts: str = "bf16") -> dict:
    """ShapeDtypeStructs of the params tree the step reads in `experts` format (no memory)."""
    from mk.model import params as params_mod
    p = params_mod.shapes(cfg)
    if experts == "mxfp4":
        p = dict(p, moe=dict(p["moe"]))
        for n in ("w1", "w3", "w2"):
            *lead, K, N = p["moe"][n].shape
            p["moe"][n] = {"packed": jax.ShapeDtypeStruct((*lead, N, K // 2), jnp.uint8),
                           "scale": jax.ShapeDtypeStruct((*lead, N, K // MX_GROUP), jnp.uint8)}
    return p


# ---- deviceless cost analysis --------------------------------------------------------------------
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "f64": 8}


def largest_buffers(hlo_text: str, top: int = 10) -> list[dict]:
    """The `top` largest arrays an optimized HLO module produces outside fused computations (no
    parameters, tuples, bitcasts or get-tuple-elements): [{"bytes", "op", "shape", "computation"}],
    largest first."""
    import re
    rows, comp = [], None
    for line in hlo_text.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            comp = line.split()[1] if line.startswith("ENTRY") else line.split()[0]
        m = re.match(r"\s*(?:ROOT )?%?[\w.\-]+ = (\w+)\[([\d,]*)\]\{[^}]*\} ([\w\-]+)\(", line)
        if not m or m.group(1) not in _DTYPE_BYTES:
            continue
        op = m.group(3)
        if "fus" in (comp or "") or op in ("parameter", "get-tuple-element", "bitcast", "tuple", "constant"):
            continue
        n = 1
        for d in filter(None, m.group(2).split(",")):
            n *= int(d)
        rows.append({"bytes": n * _DTYPE_BYTES[m.group(1)], "op": op, "shape": f"{m.group(1)}[{m.group(2)}]",
                     "computation": comp})
    return sorted(rows, key=lambda r: -r["bytes"])[:top]


def cost_report(cfg: K3Config, batch: int, impl: str = "xla", experts: str = "bf16", moe: str = "loop",
                topology: str = "v5e:2x2", ctx: int = 256, top: int = 10) -> dict:
    """Compile one step deviceless for the first device of `topology` and read what XLA says.

    impl: "xla" (this module's step) or "reference" (`mk.model.reference.decode_step`, bf16 experts).
    Returns {"impl", "batch", "experts", "flops", "bytes_accessed", "memory": memory_analysis
    fields (bytes), "largest": `largest_buffers`, "compile_s"}."""
    import time
    from jax.sharding import SingleDeviceSharding

    from mk.kernel.aot import _topology
    from mk.model.reference import decode_step, init_cache

    device = _topology(topology).devices[0]
    put = lambda tree: jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype,
                                                                   sharding=SingleDeviceSharding(device)), tree)
    if impl == "reference":
        fn = jax.jit(lambda p, c, t: decode_step(p, c, t, cfg=cfg), donate_argnums=(1,))
        experts = "bf16"
    elif impl == "xla":
        fn = make_baseline_step(cfg, experts, moe)
    else:
        raise ValueError(f"impl must be 'xla' or 'reference', found {impl!r}")
    args = (put(abstract_params(cfg, experts)), put(jax.eval_shape(lambda: init_cache(cfg, batch, ctx))),
            put(jax.ShapeDtypeStruct((batch,), jnp.int32)))
    t0 = time.perf_counter()
    with jax.default_device(device):
        compiled = fn.lower(*args).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    m = compiled.memory_analysis()
    memory = {k: int(getattr(m, k)) for k in ("argument_size_in_bytes", "output_size_in_bytes",
                                              "alias_size_in_bytes", "temp_size_in_bytes")}
    return {"impl": impl, "batch": batch, "experts": experts, "moe": moe if impl == "xla" else None,
            "flops": float(cost.get("flops", 0.0)), "bytes_accessed": float(cost.get("bytes accessed", 0.0)),
            "memory": memory, "largest": largest_buffers(compiled.as_text(), top),
            "compile_s": time.perf_counter() - t0}
