"""The sharded XLA reference: `mk.model.reference.decode_step` split over a mesh by `mk.model.sharding`'s rule.

One `jax.shard_map` over the mesh ("ep", "tp") of `mk.model.sharding.make_mesh`; every rank holds the
share of the params and caches that `mk.model.sharding.param_specs` / `cache_specs` give it and runs
the single-device step line by line on it. Wherever the step is split, a rank produces an fp32
partial and the ranks combine them with ONE reduction rule (spec 3.9 a-c), which the sharded
megakernel applies too:

    reduce_bf16(partial): every rank rounds its fp32 partial to bf16 (the wire), all ranks'
    bf16 partials are gathered and summed in fp32 in rank order 0, 1, ..., N-1 (not `psum`,
    whose order is unspecified), so every rank holds the same bits. Callers round with `bf`.

Where the step splits (per rank r of N, ep index g, tp index q):
    embedding         rows [r V/N, (r+1) V/N): p = bf(reduce(owned row or 0))        (exact)
    KDA / MLA         H/N heads; y = bf(reduce(mm(attn_out_local, o_local)))
    dense MLP         F/N columns; z = bf(reduce(mm(h_local, down_local)))
    MoE latent        Lt/N columns of latent_down, all-gathered (exact concatenation) into the
                      kernel's layout: N rank blocks, each zero-padded to whole 128-lane tiles,
                      rank j's features from lane mk.model.layout.latent_offsets(latent, N)[j] on
    routed experts    experts [g E/ep, (g+1) E/ep), FFN slice q of each, expert by expert in
                      ascending id on all rows at once (the kernel's order and tile shapes): each
                      row adds coef * f32(bf(partial down output)), coef = 0 if it did not choose
                      the expert; r_sum = bf(reduce(acc)); latent norm on the full width; this
                      rank's block times its latent_up rows, plus the shared experts' partial
                      (S/N columns): z = bf(reduce(z_routed_partial + z_shared_partial))
    LM head           V/N columns: logits come back sharded over the vocabulary
Everything on the residual stream p (mixes, norms, router, routing) is replicated: computed
identically on every rank from identical inputs. On a 1-device mesh the step is bit-identical
to `mk.model.reference.decode_step` (bf(f32(bf(x))) == bf(x)); on more devices it differs from it
only by the extra bf16 roundings of the partials (tested with stated tolerances).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from mk.model import sharding
from mk.model.config import K3Config
from mk.model.layers.attn_res import mix
from mk.model.layers.common import F32, K_CHUNK, bf, f32, mm, pad_rows, rms, rows_padded, rsqrt, sigmoid, situ
from mk.model.layers.dense_mlp import dense_mlp
from mk.model.layers.kda import kda
from mk.model.layers.mla import mla
from mk.model.layers.moe import route
from mk.model.layout import latent_offsets
from mk.model.reference import init_cache, layer_slice
from mk.model.sharding import ALL

TILE_N = 256   # the kernel's weight-tile width on the mini presets (mk.kernel.plan); column tiles do not
               # change a column's sum, but the reference keeps the kernel's shapes throughout

__all__ = ["reduce_bf16", "make_sharded_step", "decode_step_sharded", "shard_params", "shard_cache",
           "init_cache_sharded", "replicate", "mesh_for", "gather", "step_fn_for", "teacher_forced_logits"]


# --------------------------------------------------------------------------------------------
# The one cross-rank reduction
# --------------------------------------------------------------------------------------------
def reduce_bf16(partial: jax.Array) -> jax.Array:
    """Sum an fp32 partial over ALL ranks: bf16 wire, fp32 sum in rank order 0..N-1 (fp32 out).

    Call inside the shard_map of this module. Every rank returns the same bits."""
    g = jax.lax.all_gather(bf(partial), ALL)                     # [N, ...] in rank order
    acc = f32(g[0])
    for i in range(1, g.shape[0]):
        acc = acc + f32(g[i])
    return acc


def _rank():
    return jax.lax.axis_index(ALL)                               # ep_index * tp + tp_index


# --------------------------------------------------------------------------------------------
# Sublayers on one rank's share
# --------------------------------------------------------------------------------------------
def _kda_local(a, w: dict, state, conv_state, cfg: K3Config):
    """`mk.model.layers.kda.kda` on this rank's heads (cfg.heads = local heads); y reduced over ranks."""
    return kda(a, w, state, conv_state, cfg, reduce=reduce_bf16)


def _mla_local(a, w: dict, k_cache, v_cache, pos, cfg: K3Config):
    """`mk.model.layers.mla.mla` on this rank's heads (q_a / kv_a replicated); y reduced over ranks."""
    return mla(a, w, k_cache, v_cache, pos, cfg, reduce=reduce_bf16)


def _dense_local(m, w: dict, cfg: K3Config):
    """`mk.model.layers.dense_mlp.dense_mlp` on this rank's slice of the hidden width; z reduced over ranks."""
    return dense_mlp(m, w, cfg, reduce=reduce_bf16)


def _latent_blocks(x, n: int, axis: int):
    """x with its latent axis (length `latent`) laid out as the kernel's gathered latent vector
    (`mk.kernel.packing.to_latent_blocks`): n rank blocks of latent / n features, each zero-padded to whole
    128-lane tiles, rank j's features from lane `mk.model.layout.latent_offsets(latent, n)[j]` of its block.
    The zeros add nothing, but where they sit decides which real terms share a 512-deep K chunk of
    a matmul, so the latent-space math runs on the kernel's layout."""
    x = jnp.moveaxis(x, axis, -1)
    per = x.shape[-1] // n
    block = -(-per // 128) * 128
    pad = [(0, 0)] * (x.ndim - 1)
    x = jnp.concatenate([jnp.pad(x[..., j * per:(j + 1) * per], pad + [(o, block - o - per)])
                         for j, o in enumerate(latent_offsets(n * per, n))], axis=-1)
    return jnp.moveaxis(x, -1, axis)


def _tiled_mm(x, w, k_chunk: int = K_CHUNK):
    """`x @ w` as the kernel's ring runs it: x [rows, K] bf16, w [K, N] -> [rows, N] f32, with K
    zero-padded to whole K_CHUNK tiles and N cut into TILE_N-wide column tiles, each column tile
    summing its K slices (`k_chunk` deep) in order (`mk.kernel.ring.WeightRing.matmul`)."""
    rows, K = x.shape
    N = w.shape[1]
    kp, np_ = -K % K_CHUNK, -N % TILE_N
    x, w = jnp.pad(pad_rows(x), ((0, 0), (0, kp))), jnp.pad(w, ((0, kp), (0, np_)))
    if k_chunk != K_CHUNK:                     # the same column tiles, summed over thinner slices
        return jnp.concatenate([mm(x, w[:, j:j + TILE_N], k_chunk) for j in range(0, N + np_, TILE_N)],
                               1)[:rows, :N]
    cols = []
    for j in range(0, N + np_, TILE_N):
        acc = None
        for c in range(0, K + kp, K_CHUNK):
            part = jnp.dot(x[:, c:c + K_CHUNK], w[c:c + K_CHUNK, j:j + TILE_N], preferred_element_type=F32)
            acc = part if acc is None else acc + part
        cols.append(acc)
    return jnp.concatenate(cols, 1)[:rows, :N]


def _routed_experts(latent, coef, w1, w3, w2, cfg: K3Config, k_chunk: int = K_CHUNK):
    """This rank's routed experts, expert by expert as the kernel runs them: every row through each
    local expert in ascending id, weighted by its routing coefficient (exactly 0 where the row did
    not choose the expert, which adds nothing), accumulated in fp32.

    latent [B, Lp] bf16 (gathered layout); coef [E_local, B] f32; w1, w3 [E_local, Lp, fe];
    w2 [E_local, fe, Lp] -> acc [B, Lp] f32 (this rank's partial)."""
    fe = w1.shape[-1]
    lanes = -(-fe // 128) * 128                                  # [w1 | w3] fused, each part lane-aligned
    gu_w = jnp.concatenate([jnp.pad(w, ((0, 0), (0, 0), (0, lanes - fe))) for w in (w1, w3)], axis=-1)

    def expert(acc, xs):
        c, gu_e, w2_e = xs
        gu = _tiled_mm(latent, gu_e, k_chunk)
        h = situ(bf(gu[:, :fe]), bf(gu[:, lanes:lanes + fe]), cfg.situ_beta, cfg.situ_linear_beta)
        return acc + c[:, None] * f32(bf(_tiled_mm(h, w2_e, k_chunk))), None

    acc, _ = jax.lax.scan(expert, jnp.zeros(latent.shape, F32), (coef, gu_w, w2))
    return acc


def _moe_local(m, w: dict, cfg: K3Config, n: int, ep: int, expert_k_chunk: int = K_CHUNK):
    """`mk.model.layers.moe.moe` on this rank's share -> (z [B, d] bf16, (ids [B, k], route margin [B])).

    The latent space uses the kernel's gathered layout (`_latent_blocks`): [B, n * block]."""
    r = _rank()
    ids, weights = route(m, w["router"], w["router_bias"], cfg.top_k)   # replicated
    latent = jax.lax.all_gather(bf(mm(m, w["latent_down"])), ALL, axis=1, tiled=True)   # [B, Lt]
    latent = _latent_blocks(latent, n, axis=1)                   # [B, Lp = n * block]
    e_local = cfg.experts // ep
    first = (r // (n // ep)) * e_local                           # global id of this rank's first expert
    local_ids = first + jnp.arange(e_local)
    coef = jnp.sum(jnp.where(ids[None] == local_ids[:, None, None], weights[None], 0.0), axis=-1)   # [E_local, B]
    w1, w3 = (_latent_blocks(w[k], n, axis=1) for k in ("w1", "w3"))
    acc = _routed_experts(latent, coef, w1, w3, _latent_blocks(w["w2"], n, axis=2), cfg, expert_k_chunk)
    r_sum = f32(bf(reduce_bf16(acc)))                            # [B, Lp], every rank's full latent
    gamma = jax.lax.all_gather(w["latent_norm"], ALL, axis=0, tiled=True)   # full width, exact
    x = pad_rows(r_sum)
    inv = rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) / cfg.latent + cfg.eps)[:r_sum.shape[0]]
    block = r_sum.shape[1] // n
    mine = jax.lax.dynamic_slice_in_dim(r_sum, r * block, block, axis=1)      # this rank's rows of latent_up
    gamma = jax.lax.dynamic_slice_in_dim(_latent_blocks(gamma, n, axis=0), r * block, block)
    r_n = bf(mine * inv * gamma)
    up = w["latent_up"]                                          # [latent / n, d]: rows at the block's offset
    at = jnp.asarray(latent_offsets(cfg.latent, n), jnp.int32)[r]
    up = jax.lax.dynamic_update_slice(jnp.zeros((block, up.shape[1]), up.dtype), up, (at, jnp.int32(0)))
    z_routed = mm(r_n, up)
    h = situ(bf(mm(m, w["shared_gate"])), bf(mm(m, w["shared_up"])), cfg.situ_beta, cfg.situ_linear_beta)
    z_shared = mm(h, w["shared_down"])
    return bf(reduce_bf16(z_routed + z_shared)), (ids, _route_margin(m, w, cfg.top_k))


def _route_margin(m, w, top_k):
    """[B] gap between the k-th and (k+1)-th biased router score (inf if every expert is chosen):
    how far this row's routing is from a tie (diagnostics; the trace output)."""
    s = sigmoid(mm(m, w["router"])) + w["router_bias"][None]
    if top_k >= s.shape[-1]:
        return jnp.full(s.shape[:1], jnp.inf, F32)
    v = jax.lax.top_k(s, top_k + 1)[0]
    return v[:, top_k - 1] - v[:, top_k]


def _embed_local(embed, tokens, n: int):
    rows = embed.shape[0]                                        # V / N
    off = tokens - _rank() * rows
    owned = (off >= 0) & (off < rows)
    x = embed[jnp.clip(off, 0, rows - 1)]
    return bf(reduce_bf16(jnp.where(owned[:, None], f32(x), 0.0)))


def _step_local(params, cache, tokens, *, cfg: K3Config, n: int, ep: int, expert_k_chunk: int = K_CHUNK):
    """One rank's decode step (mirrors `mk.model.reference.decode_step`)."""
    lcfg = cfg.replace(heads=cfg.heads // n)
    pos = cache["pos"]
    kda_state, conv_state = cache["kda_state"], cache["conv_state"]
    mla_k, mla_v = cache["mla_k"], cache["mla_v"]
    p = _embed_local(params["embed"], tokens, n)
    blocks: list[jax.Array] = []
    routing = []
    for l in range(cfg.layers):
        lw = layer_slice(params["layer"], l)
        x = mix(p, blocks[:cfg.n_attn_blocks(l)], lw["attn_res"], cfg.eps, cfg.n_blocks)
        if cfg.starts_block(l):
            blocks.append(p)
        a = rows_padded(rms, x, lw["attn_norm"], cfg.eps)
        i = cfg.family_index(l)
        if cfg.is_mla(l):
            y, k_i, v_i = _mla_local(a, layer_slice(params["mla"], i), mla_k[:, i], mla_v[:, i], pos, lcfg)
            mla_k, mla_v = mla_k.at[:, i].set(k_i), mla_v.at[:, i].set(v_i)
        else:
            y, s_i, c_i = _kda_local(a, layer_slice(params["kda"], i), kda_state[:, i], conv_state[:, i], lcfg)
            kda_state, conv_state = kda_state.at[:, i].set(s_i), conv_state.at[:, i].set(c_i)
        p = y if cfg.starts_block(l) else bf(p + y)
        x = mix(p, blocks[:cfg.n_mlp_blocks(l)], lw["mlp_res"], cfg.eps, cfg.n_blocks)
        m = rows_padded(rms, x, lw["ffn_norm"], cfg.eps)
        if l == 0:
            z = _dense_local(m, params["dense"], cfg)
        else:
            z, ids = _moe_local(m, layer_slice(params["moe"], l - 1), cfg, n, ep, expert_k_chunk)
            routing.append(ids)
        p = bf(p + z)
    h = mix(p, blocks, params["output_res"], cfg.eps)
    logits = mm(rows_padded(rms, h, params["final_norm"], cfg.eps), params["lm_head"])
    cache = {"pos": pos + 1, "kda_state": kda_state, "conv_state": conv_state, "mla_k": mla_k, "mla_v": mla_v}
    B = tokens.shape[0]
    ids = jnp.stack([i for i, _ in routing]) if routing else jnp.zeros((0, B, cfg.top_k), jnp.int32)
    margin = jnp.stack([g for _, g in routing]) if routing else jnp.zeros((0, B), F32)
    return logits, cache, {"p": p[None], "ids": ids[None], "margin": margin[None]}


# --------------------------------------------------------------------------------------------
# Building the step
# --------------------------------------------------------------------------------------------
def _layout_of(mesh):
    from mk.model.layout import Layout
    ep, tp = mesh.shape["ep"], mesh.shape["tp"]
    return Layout(chips=ep * tp, cores_per_chip=1, tp_attn=ep * tp, ep=ep, tp_expert=tp)


def mesh_for(cfg: K3Config, devices: int, ep: int | None = None, device_list=None):
    """The mesh `mk.model.sharding` prescribes for `devices` devices (checks that the config divides)."""
    return sharding.make_mesh(sharding.default_layout(cfg, devices, ep), device_list)


@functools.lru_cache(maxsize=None)
def make_sharded_step(cfg: K3Config, mesh, *, trace: bool = False, expert_k_chunk: int = K_CHUNK):
    """A jitted `step(params, cache, tokens) -> (logits [B, V] f32 sharded over vocab, cache)`.

    params / cache: global arrays (any placement; `shard_params` / `shard_cache` put them where
    the step wants them, avoiding a copy per call); tokens [B] int32, replicated.
    trace=True returns a third output {"p": [N, B, d], "ids": [N, n_moe, B, top_k],
    "margin": [N, n_moe, B]}: every rank's own copy of the final residual p and of its routing
    decisions (which must agree bit for bit), and each row's router margin per MoE layer (the gap
    between the k-th and (k+1)-th biased score: a near-zero margin is a routing near-tie).
    expert_k_chunk: the routed experts' matmul slice depth, the kernel's (`mk.kernel.step.expert_k_chunk`).
    """
    sharding.check_layout(cfg, _layout_of(mesh))
    n, ep = mesh.size, mesh.shape["ep"]
    from mk.model.params import shapes
    pspecs = sharding.param_specs(shapes(cfg))
    cspecs = sharding.cache_specs(init_cache_abstract(cfg))
    body = functools.partial(_step_local, cfg=cfg, n=n, ep=ep, expert_k_chunk=expert_k_chunk)
    out_specs = (P(None, ALL), cspecs, {"p": P(ALL), "ids": P(ALL), "margin": P(ALL)})
    f = jax.shard_map(body, mesh=mesh, in_specs=(pspecs, cspecs, P()), out_specs=out_specs,
                      check_vma=False)
    out_sh = jax.tree.map(lambda s: NamedSharding(mesh, s), out_specs)
    if not trace:
        fn = jax.jit(lambda p, c, t: f(p, c, t)[:2], out_shardings=out_sh[:2])
    else:
        fn = jax.jit(f, out_shardings=out_sh)
    return fn


def decode_step_sharded(params: dict, cache: dict, tokens, *, cfg: K3Config, mesh):
    """tokens [B] int32 -> (logits [B, V] f32 sharded over the vocabulary, cache advanced)."""
    return make_sharded_step(cfg, mesh)(params, cache, tokens)


# --------------------------------------------------------------------------------------------
# Placement helpers (single- and multi-process)
# --------------------------------------------------------------------------------------------
def init_cache_abstract(cfg: K3Config, batch: int = 1, ctx: int = 128) -> dict:
    return jax.eval_shape(lambda: init_cache(cfg, batch, ctx))


def _put(x, mesh, spec):
    """A global array of host value x placed by spec (works when devices span processes)."""
    x = np.asarray(x)
    sh = NamedSharding(mesh, spec)
    return jax.make_array_from_callback(x.shape, sh, lambda idx: x[idx])


def shard_params(params: dict, mesh) -> dict:
    """Place a (host or single-device) params tree by `mk.model.sharding.param_specs`."""
    specs = sharding.param_specs(params)
    if jax.process_count() == 1:
        return jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
    return jax.tree.map(lambda x, s: _put(x, mesh, s), params, specs)


def shard_cache(cache: dict, mesh) -> dict:
    specs = sharding.cache_specs(cache)
    if jax.process_count() == 1:
        return jax.device_put(cache, {k: NamedSharding(mesh, s) for k, s in specs.items()})
    return {k: _put(v, mesh, specs[k]) for k, v in cache.items()}


def init_cache_sharded(cfg: K3Config, batch: int, ctx: int, mesh) -> dict:
    """Empty caches created directly in their shards (no full-size host copy)."""
    abstract = init_cache_abstract(cfg, batch, ctx)
    specs = sharding.cache_specs(abstract)
    out_sh = {k: NamedSharding(mesh, s) for k, s in specs.items()}
    return jax.jit(lambda: init_cache(cfg, batch, ctx), out_shardings=out_sh)()


def replicate(x, mesh):
    """A host value (e.g. tokens) as a replicated global array on `mesh`."""
    return _put(x, mesh, P())


def gather(x) -> np.ndarray:
    """The full host value of a global array, also when its shards span processes."""
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(x)
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


# --------------------------------------------------------------------------------------------
# Drivers for the commands (`mk logits --mesh N`, `mk generate --mesh N`)
# --------------------------------------------------------------------------------------------
def step_fn_for(cfg: K3Config, mesh, expert_k_chunk: int = K_CHUNK):
    """A `step_fn(params, cache, tokens)` for `mk.model.reference.generate`: places host / single-device
    caches and tokens on the mesh first (params must already be placed: `shard_params` or
    `mk.io.checkpoint.load_sharded`)."""
    step = make_sharded_step(cfg, mesh, expert_k_chunk=expert_k_chunk)
    want = NamedSharding(mesh, P())

    def step_fn(params, cache, tokens):
        if cache["pos"].sharding != want:
            cache = shard_cache(jax.tree.map(np.asarray, cache), mesh)
        if getattr(tokens, "sharding", None) != want:
            tokens = replicate(np.asarray(tokens, np.int32), mesh)
        return step(params, cache, tokens)

    def loop_step(params):
        """This step for `mk.model.loop` (traced inside its decode chunks), the cache placed first."""
        from mk.model.loop import LoopStep
        return LoopStep(step, params, lambda cache: shard_cache(jax.tree.map(np.asarray, cache), mesh))
    step_fn.loop_step = loop_step
    return step_fn


def teacher_forced_logits(params: dict, cfg: K3Config, tokens, mesh, ctx: int | None = None) -> np.ndarray:
    """`mk.model.reference.teacher_forced_logits` on the mesh: tokens [T] -> float32 logits [T, V] (the
    full array in every process)."""
    tokens = np.asarray(tokens, np.int32).reshape(-1)
    ctx = ctx or max(128, -(-tokens.shape[0] // 128) * 128)
    step = make_sharded_step(cfg, mesh)
    cache = init_cache_sharded(cfg, 1, ctx, mesh)
    out = []
    for t in tokens:
        logits, cache = step(params, cache, replicate(np.asarray([t], np.int32), mesh))
        out.append(gather(logits)[0])
    return np.stack(out)
