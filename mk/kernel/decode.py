"""One K3 decode step = one grid-less `pallas_call` for all layers.

Everything lives in HBM (`memory_space=ANY`) and moves by explicit DMA: the packed weight tiles
(mk.kernel.plan), the routed experts, the per-layer vector tables, the embedding rows, the KDA states
and MLA caches (aliased in place to the outputs). Inside, the layers run in a runtime
`fori_loop`, so the program does not grow with depth; KDA vs MLA and dense MLP vs MoE are
`lax.cond` branches. The embedding lookup, the final mix, norm and LM head are inside the kernel
too: the step is this single call plus two trivial XLA ops (slice of the padded logits, pos + 1).

On a mesh of N devices (mk.model.sharding) the same kernel runs once per device under `shard_map`,
on that device's share of the weights, states and caches; six kinds of in-kernel collective
(mk.kernel.collectives, listed by `Plan.collectives`) join the shares: the embedding sum, the
attention output projection, layer 0's dense MLP, and the MoE's latent gather, routed sum and
output sum. One device is the 1-device mesh: the collectives vanish, nothing else changes.

The whole step, in one screen:

    embed tokens -> p;                       b_0 <- p at layer 0
    for l in layers:                         (runtime loop)
        x = Mix(p, b_0..; attn_res[l]);      if l % R == 0: b_{l/R} <- p
        y = KDA(rms(x)) or MLA(rms(x));      p = y if l % R == 0 else p + y      [attn_out]
        x = Mix(p, b_0..; mlp_res[l])
        p = p + (DenseMLP(rms(x)) if l == 0 else MoE(rms(x)))   [dense_out | moe_latent, moe_routed, moe_out]
    logits = rms(Mix(p, b_0..; output_res)) @ lm_head          (this device's vocabulary columns)
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mk.model.config import K3Config
from mk.kernel import refs as refs_mod
from mk.kernel.attn_res import mix
from mk.kernel.collectives import all_reduce, barrier
from mk.kernel.dense_mlp import dense_mlp
from mk.kernel.kda import kda, wait_state_stores
from mk.kernel.mla import mla, wait_write_back
from mk.kernel.moe import moe
from mk.kernel.ring import WeightRing
from mk.model.layers.common import bf, f32, rms
from mk.kernel.plan import Plan, vector_rows

KERNEL_NAME = "k3_decode_step"


@dataclasses.dataclass
class StepContext:
    """What every sublayer of the kernel needs: the plan, the refs, the ring, the layer's vectors."""
    cfg: K3Config
    plan: Plan
    refs: refs_mod.Refs
    ring: WeightRing
    vector_slot: object = 0

    def vec(self, name: str, width: int) -> jax.Array:
        """Row `name` of the current layer's vector table: [1, width] f32."""
        row = vector_rows(self.cfg)[name]
        return self.refs.vectors[self.vector_slot, pl.ds(row, 1), pl.ds(0, width)]

    def vector_copy(self, layer):
        slot = layer % 2
        r = self.refs
        return pltpu.make_async_copy(r.vectors_hbm.at[layer], r.vectors.at[slot], r.vector_sems.at[slot])


EMBED_ROWS = 16  # bf16 sublane tile: embedding rows move in aligned groups of 16


def _embed(k: StepContext):
    """p <- embedding rows of the step's tokens (padded rows 0).

    The vocabulary is split over the devices: each fetches the rows it owns (zeros for tokens it
    does not) and the `embed` all-reduce adds the shares, exactly (one is nonzero). HBM arrays are
    tiled too, so each token's row is fetched inside its aligned 16-row group and picked out with
    an exact masked sum.
    """
    r, B, R, V = k.refs, k.plan.batch, k.plan.rows, k.plan.vocab_local
    local = [r.tokens[b] - r.rank[0] * V for b in range(B)]
    owned = [(t >= 0) & (t < V) for t in local]
    local = [jnp.clip(t, 0, V - 1) for t in local]
    groups = [pl.multiple_of((t // EMBED_ROWS) * EMBED_ROWS, EMBED_ROWS) for t in local]
    copies = [pltpu.make_async_copy(r.embed.at[pl.ds(groups[b], EMBED_ROWS)], r.embed_rows.at[b],
                                    r.embed_sems.at[b]) for b in range(B)]
    for c in copies:
        c.start()
    for c in copies:
        c.wait()
    iota = jax.lax.broadcasted_iota(jnp.int32, (EMBED_ROWS, k.cfg.dim), 0)
    rows = [jnp.sum(jnp.where((iota == local[b] % EMBED_ROWS) & owned[b], f32(r.embed_rows[b]), 0.0),
                    axis=0, keepdims=True) for b in range(B)]
    if R > B:
        rows.append(jnp.zeros((R - B, k.cfg.dim), jnp.float32))
    r.p[...] = all_reduce(k, "embed", jnp.concatenate(rows, axis=0))


def _aux_copy(r, slot):
    """The DMA of the running prefix p [R, d] bf16 into aux row set `slot` of the HBM output."""
    return pltpu.make_async_copy(r.p, r.aux.at[jnp.maximum(slot, 0)], r.aux_sems.at[0])


def _zero_scratch(r):
    r.blocks[...] = jnp.zeros(r.blocks.shape, jnp.float32)
    r.attn_out[...] = jnp.zeros(r.attn_out.shape, r.attn_out.dtype)
    r.kda_feat[...] = jnp.zeros(r.kda_feat.shape, jnp.float32)


def decode_kernel(plan: Plan):
    cfg = plan.config
    d, R_blk, L, eps = cfg.dim, cfg.residual_block, cfg.layers, cfg.eps

    def kernel(*args):
        r = refs_mod.Refs(plan, args)
        ring = WeightRing(plan, r)
        k = StepContext(cfg, plan, r, ring)
        with jax.named_scope("step_init"):
            ring.reset()
            ring.advance()                               # the step's first tiles, before anything else
            if plan.devices > 1:
                barrier(plan, r)
            _zero_scratch(r)
            k.vector_copy(0).start()
            _embed(k)

        def layer(l):
            k.vector_slot = l % 2
            k.vector_copy(l).wait()
            k.vector_copy(l + 1).start()                 # the next layer's (or the head's) vectors
            p = r.p[...]
            if plan.aux_layers:                          # aux rows: this layer's entry prefix -> HBM
                aux = r.aux_slot[l]

                @pl.when(aux >= 0)
                def _aux_out():
                    _aux_copy(r, aux).start()
            starts_block = l % R_blk == 0
            with jax.named_scope("attn_res_mix"):
                x = mix(p, r.blocks, r.n_attn_blocks[l], k.vec("attn_res", d), eps)

            @pl.when(starts_block)
            def _snapshot():
                r.blocks[l // R_blk] = f32(p)

            a = rms(x, k.vec("attn_norm", d), eps)
            i = r.family_index[l]
            if cfg.n_mla:
                y = ring.cond(r.is_mla[l] == 1, lambda: mla(k, a, i), lambda: kda(k, a, i))
            else:
                y = kda(k, a, i)
            p = jnp.where(starts_block, y, bf(p + y))
            with jax.named_scope("mlp_res_mix"):
                x = mix(p, r.blocks, r.n_mlp_blocks[l], k.vec("mlp_res", d), eps)
            m = rms(x, k.vec("ffn_norm", d), eps)
            z = ring.cond(l == 0, lambda: dense_mlp(k, m), lambda: moe(k, m, l))
            if plan.aux_layers:

                @pl.when(aux >= 0)
                def _aux_done():                         # before p is overwritten
                    _aux_copy(r, aux).wait()
            r.p[...] = bf(p + z)

        ring.fori(0, L, layer)

        with jax.named_scope("lm_head"):
            k.vector_slot = L % 2
            k.vector_copy(L).wait()
            h = mix(r.p[...], r.blocks, cfg.n_blocks, k.vec("attn_res", d), eps)   # row set L: output_res
            normed = rms(h, k.vec("attn_norm", d), eps)                             # ... and final_norm
            r.logits[...] = ring.matmul(normed, plan.stream(L).matrix("lm_head"))
        with jax.named_scope("step_end"):               # the last layers' write backs, left in flight
            if cfg.n_mla:
                wait_write_back(k)
            if cfg.n_kda:
                wait_state_stores(k)

    return kernel


def interpret_params(detect_races: bool = False, dma_execution_mode: str = "on_wait"):
    """TPU interpret mode on CPU (HBM/VMEM, DMAs and semaphores simulated; NaN-filled memory)."""
    return pltpu.InterpretParams(detect_races=detect_races, dma_execution_mode=dma_execution_mode,
                                 uninitialized_memory="nan")


def on_tpu() -> bool:
    return jax.default_backend() == "tpu"


def build_call(plan: Plan, interpret=None):
    """The pallas_call of one device's share of a step. `interpret`: InterpretParams, False
    (compile for TPU), or None (compile on a TPU backend, interpret elsewhere)."""
    if interpret is None:
        interpret = False if on_tpu() else interpret_params()
    n_prefetch = len(refs_mod.SCALARS) + len(refs_mod.TABLES)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    in_names = refs_mod.inputs(plan)
    n_in = len(in_names)
    out_names = refs_mod.outputs(plan)
    own_out = refs_mod.new_outputs(plan)
    # aliased input -> output, by name; input indices count the scalar-prefetch args.
    aliases = {n_prefetch + in_names.index(i): out_names.index(o) for i, o in refs_mod.ALIASES.items()}
    # The entry barrier's semaphore exists only with a collective id (mesh runs).
    collective = {"collective_id": 0} if plan.devices > 1 else {}

    def call(scalars, inputs):
        states = [inputs[in_names.index(i)] for i in refs_mod.ALIASES]
        return pl.pallas_call(
            decode_kernel(plan),
            out_shape=[jax.ShapeDtypeStruct(b.shape, jnp.dtype(b.dtype)) for b in own_out]
                      + [jax.ShapeDtypeStruct(s.shape, s.dtype) for s in states],
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=n_prefetch, grid=(),
                in_specs=[any_spec] * n_in,
                out_specs=[any_spec if b.space == "hbm" else pl.BlockSpec(memory_space=pltpu.VMEM)
                           for b in own_out] + [any_spec] * len(states),
                scratch_shapes=refs_mod.scratch_shapes(plan)),
            input_output_aliases=aliases,
            # No Mosaic bounds checks on the DMAs: ~60 scalar bundles per streamed tile (v5e LLO),
            # on the path every tile takes. Interpret mode, where the tests run, raises on any
            # out-of-bounds read; the DMA indices come from the plan's tables.
            compiler_params=pltpu.CompilerParams(vmem_limit_bytes=plan.vmem_limit, has_side_effects=False,
                                                 disable_bounds_checks=True, **collective),
            interpret=interpret,
            name=KERNEL_NAME,
        )(*scalars, *inputs)

    return call


def default_mesh(plan: Plan):
    """The mesh a plan runs on: its N devices of `jax.devices()` (one device: the first)."""
    from mk.model.sharding import make_mesh
    return make_mesh(plan.layout)


STATE_NAMES = ("kda_state", "conv_state", "mla_k", "mla_v")


def sharded_block(plan: Plan, mesh, interpret=None):
    """`run(weights, cache, tokens) -> (logits [S, T, V] f32, block)`: one step of T = plan.seq_rows
    consecutive tokens for each of S = plan.sequences sequences (T = 1: a decode step; T = 1 + k: a
    speculative verify step), as one `shard_map` over `mesh` of one pallas_call per device.

    cache: pos [S] int32 (position of each sequence's first row), state_row [S] int32 (optional,
    default 0: which of a sequence's rows' states the step starts from), kda_state [S*T, n_kda, H, D,
    D] f32 and conv_state [S*T, n_kda, 3, C-1, HD] bf16 (one state per ROW), mla_k / mla_v [S, n_mla,
    H, ctx, *] bf16 (per sequence); on a mesh sharded as `mk.model.sharding.CACHE_SPECS`. tokens [S, T].
    block: kda_state / conv_state holding every row's post-state, mla_k / mla_v with every row's key
    and value written (all updated in place: the cache is consumed), pos and state_row (the step's
    own, unchanged: the states they pointed at are overwritten; see `commit`), aux [S, T,
    n_aux, d] bf16 (each aux layer's entry prefix, in `plan.aux_layers` order; if the plan has aux
    layers), prefix [N, S*T, d] bf16 (every device's final residual prefix p). `commit` turns it into
    the next step's cache."""
    from jax.sharding import PartitionSpec as P
    from mk.model.sharding import ALL, CACHE_SPECS

    N, B, V, S, T = plan.devices, plan.batch, plan.vocab_local, plan.sequences, plan.seq_rows
    n_aux = len(plan.aux_layers)
    if interpret is None:
        interpret = False if on_tpu() else interpret_params()
    if interpret is not False:            # interpreted: no deadlock on a mesh, no extra weight copies
        from mk.kernel.interpret_shim import install
        install()
    call = build_call(plan, interpret)
    tables = plan.tables()
    state_specs = tuple(P(*CACHE_SPECS[n]) for n in STATE_NAMES)
    n_tables = len(refs_mod.TABLES)
    n_out = len(refs_mod.new_outputs(plan))
    expert_names = refs_mod.expert_inputs(plan)        # ("experts",) or ("expert_codes", "expert_scales")

    def per_device(tokens, row_pos, state_row, rank, table_args, embed, tiles, experts, vectors, states):
        out = call([tokens, row_pos, state_row, rank, *table_args], [embed, tiles, *experts, vectors, *states])
        return tuple(out[:n_out]), tuple(out[n_out:])

    mapped = jax.shard_map(
        per_device, mesh=mesh,
        in_specs=(P(), P(), P(), P(ALL), (P(),) * n_tables, P(ALL), P(ALL), (P(ALL),) * len(expert_names), P(ALL),
                  state_specs),
        out_specs=((P(ALL),) * n_out, state_specs), check_vma=False)
    row_seq, row_offset = plan.row_seq(), plan.row_offset()      # numpy: constants of the step (no eager program)

    def run(weights, cache, tokens):
        pos = cache["pos"].astype(jnp.int32)
        state_row = cache.get("state_row", jnp.zeros((S,), jnp.int32)).astype(jnp.int32)
        row_pos = pos[row_seq] + row_offset                          # [B] each row's position
        rank = jnp.arange(N, dtype=jnp.int32)
        table_args = tuple(jnp.asarray(tables[n]) for n in refs_mod.TABLES)
        outs, new_states = mapped(tokens.astype(jnp.int32).reshape(B), row_pos, state_row, rank, table_args,
                                  weights["embed"], weights["tiles"], tuple(weights[n] for n in expert_names),
                                  weights["vectors"], tuple(cache[n] for n in STATE_NAMES))
        logits, prefix = outs[0], outs[1]
        # [N * rows, cols] (device r's vocabulary block r) -> [S, T, V]
        logits = logits.reshape(N, plan.rows, -1)[:, :B, :V].transpose(1, 0, 2).reshape(S, T, N * V)
        block = dict(zip(STATE_NAMES, new_states), pos=pos, state_row=state_row,
                     prefix=prefix.reshape(N, plan.rows, -1)[:, :B])
        if n_aux:                                                    # replicated: device 0's copy
            block["aux"] = outs[2][:n_aux, :B].reshape(n_aux, S, T, -1).transpose(1, 2, 0, 3)
        return logits, block

    return run


def commit(block: dict, count) -> dict:
    """The cache after a step whose rows 0..count[s] of each sequence s are accepted (count [S] int32
    in [0, T-1]): pos advances by count + 1 and `state_row` = count selects the post-state of row
    count (the states of every row are in the block already: rolling back copies nothing). MLA
    slots of rejected rows lie past the new position: masked until the next step overwrites them."""
    count = jnp.asarray(count, jnp.int32)
    out = {n: block[n] for n in STATE_NAMES}
    out.update(pos=block["pos"] + count + 1, state_row=count)
    return out


def sharded_step(plan: Plan, mesh, interpret=None, return_prefix: bool = False):
    """`step(weights, cache, tokens) -> (logits [B, V] f32, cache)`: the decode step, i.e. the
    T = 1 case of `sharded_block` committed at row 0; weights from `mk.kernel.step.kernel_weights(plan,
    params, mesh)`, cache as `mk.model.reference.init_cache`, tokens [B].
    return_prefix: also return every device's final residual prefix p, [N, B, d] bf16 (replicated
    state: the same bits on every device)."""
    if plan.seq_rows != 1:
        raise ValueError(f"sharded_step is the decode step (k = 0); this plan verifies k = {plan.k} drafts "
                         f"(use sharded_block)")
    run = sharded_block(plan, mesh, interpret)

    def step(weights, cache, tokens):
        logits, block = run(weights, cache, tokens.reshape(plan.sequences, 1))
        new_cache = commit(block, jnp.zeros((plan.sequences,), jnp.int32))
        if "state_row" not in cache:                 # the reference's layout: no state_row (always 0)
            del new_cache["state_row"]
        if return_prefix:
            return logits[:, 0], new_cache, block["prefix"]
        return logits[:, 0], new_cache

    return step


def make_decode_step(plan: Plan, interpret=None, mesh=None, return_prefix: bool = False):
    """step(weights, cache, tokens) -> (logits [B, V] f32, new cache); one pallas_call per device.

    weights: `kernel_weights(plan, params, mesh)`; cache: as `mk.model.reference.init_cache` (same
    layout; on a mesh, sharded as `mk.model.sharding.cache_specs`); tokens [B] int32. The cache is
    donated and updated in place. `mesh`: default `default_mesh(plan)`.
    """
    from mk.model.compile_cache import Program
    mesh = mesh if mesh is not None else default_mesh(plan)
    return Program(sharded_step(plan, mesh, interpret, return_prefix), name="decode_step",
                   identity=repr((plan, mesh, interpret, return_prefix)), donate_argnums=(1,))


def make_verify_step(plan: Plan, interpret=None, mesh=None):
    """verify(weights, cache, tokens [S, 1 + k]) -> (logits [S, 1 + k, V] f32, block), jitted, the
    cache donated; see `sharded_block` (cache and block) and `commit` (the next step's cache)."""
    from mk.model.compile_cache import Program
    mesh = mesh if mesh is not None else default_mesh(plan)
    return Program(sharded_block(plan, mesh, interpret), name="verify_step", identity=repr((plan, mesh, interpret)),
                   donate_argnums=(1,))
