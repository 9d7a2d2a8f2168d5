"""The weight ring: every streamed weight tile of the step flows through `num_slots` VMEM slots.

The plan (mk.plan) fixes the order: layer by layer, matrix by matrix, tile by tile; MoE layers
splice in the tiles of each distinct routed expert once the router has chosen them. The ring
keeps an *issue cursor* (layer, position in that layer's stream) in SMEM, ahead of the consumer:

    take():   issue tiles until `prefetch_depth` tiles beyond the one needed are in flight,
              wait for the needed tile's DMA, return its slot;
    release(): the slot may be refilled.

Because the cursor walks straight from one layer's stream into the next, the next layer's first
tiles arrive while this layer is still computing: cross-layer prefetch. The cursor stops at the
start of a MoE layer's expert segment until the router of that layer has published its distinct
experts (`publish_routing`).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mk.plan import Matrix, Plan

# Fields of the ring's SMEM state vector.
ISSUED, CONSUMED, CUR_LAYER, CUR_POS, ROUTED_LAYER, N_DISTINCT = range(6)
STATE_WORDS = 8


@dataclasses.dataclass
class WeightRing:
    plan: Plan
    tables: dict              # SMEM refs: dense_base, pre_tiles, post_tiles  [L + 1] int32
    tiles_hbm: object         # [dense_tiles, tile_k, tile_n] bf16 (HBM)
    experts_hbm: object       # [n_moe, E, expert_tiles, tile_k, tile_n] bf16 (HBM)
    slots: object             # [num_slots, tile_k, tile_n] bf16 (VMEM)
    sems: object              # DMA semaphores [num_slots]
    state: object             # [STATE_WORDS] int32 (SMEM)
    distinct: object          # [max(E, 1)] int32 (SMEM): distinct experts of the routed layer
    xbuf: object              # [rows, k_max] bf16 (VMEM): matmul input
    ybuf: object              # [rows, n_max] f32 (VMEM): matmul output

    def reset(self):
        for i in range(STATE_WORDS):
            self.state[i] = jnp.int32(-1 if i == ROUTED_LAYER else 0)

    # ---- issuing --------------------------------------------------------------------------------
    def _copy(self, src, slot):
        return pltpu.make_async_copy(src, self.slots.at[slot], self.sems.at[slot])

    def _issue_next(self, target):
        """Issue the tile under the cursor if it is needed (< target), known and exists."""
        plan, st, t = self.plan, self.state, self.tables
        L, Te = plan.config.layers, plan.expert_tiles
        # Step over the end of a finished layer stream.
        layer, u = st[CUR_LAYER], st[CUR_POS]
        moe = jnp.logical_and(layer >= 1, layer < L)
        known = st[ROUTED_LAYER] == layer
        n_exp = jnp.where(jnp.logical_and(moe, known), st[N_DISTINCT] * Te, 0)
        pre, post = t["pre_tiles"][layer], t["post_tiles"][layer]
        layer_done = jnp.logical_and(jnp.logical_or(known, jnp.logical_not(moe)),
                                     u >= pre + n_exp + post)

        @pl.when(jnp.logical_and(layer_done, layer < L))
        def _():
            st[CUR_LAYER] = layer + 1
            st[CUR_POS] = 0

        layer, u = st[CUR_LAYER], st[CUR_POS]
        moe = jnp.logical_and(layer >= 1, layer < L)
        known = st[ROUTED_LAYER] == layer
        n_exp = jnp.where(jnp.logical_and(moe, known), st[N_DISTINCT] * Te, 0)
        pre, post = t["pre_tiles"][layer], t["post_tiles"][layer]
        in_pre = u < pre
        in_experts = jnp.logical_and(jnp.logical_and(moe, known), jnp.logical_and(u >= pre, u < pre + n_exp))
        in_post = jnp.logical_and(jnp.logical_or(known, jnp.logical_not(moe)),
                                  jnp.logical_and(u >= pre + n_exp, u < pre + n_exp + post))
        wanted = st[ISSUED] < target
        slot = st[ISSUED] % plan.num_slots

        @pl.when(jnp.logical_and(wanted, jnp.logical_or(in_pre, in_post)))
        def _():
            idx = t["dense_base"][layer] + jnp.where(in_pre, u, u - n_exp)
            self._copy(self.tiles_hbm.at[idx], slot).start()

        @pl.when(jnp.logical_and(wanted, in_experts))
        def _():
            j = u - pre
            expert = self.distinct[j // Te]
            self._copy(self.experts_hbm.at[layer - 1, expert, j % Te], slot).start()

        issued = jnp.logical_and(wanted, jnp.logical_or(in_pre, jnp.logical_or(in_post, in_experts)))
        st[ISSUED] = st[ISSUED] + issued.astype(jnp.int32)
        st[CUR_POS] = st[CUR_POS] + issued.astype(jnp.int32)

    def advance(self):
        """Issue until tiles consumed .. consumed + prefetch_depth are in flight (or blocked)."""
        target = self.state[CONSUMED] + self.plan.prefetch_depth + 1
        # At most prefetch_depth + 1 tiles are missing; each pass issues at most one.
        jax.lax.fori_loop(0, self.plan.prefetch_depth + 1, lambda i, c: (self._issue_next(target), c)[1], 0)

    def publish_routing(self, layer, n_distinct):
        """The router of `layer` has written its distinct experts to `distinct`: unblock the cursor."""
        self.state[N_DISTINCT] = n_distinct
        self.state[ROUTED_LAYER] = layer
        self.advance()

    # ---- consuming ------------------------------------------------------------------------------
    def take(self):
        """Wait for the next tile in stream order; returns its slot index."""
        self.advance()
        slot = self.state[CONSUMED] % self.plan.num_slots
        self._copy(self.tiles_hbm.at[0], slot).wait()
        return slot

    def release(self):
        self.state[CONSUMED] = self.state[CONSUMED] + 1

    def matmul(self, x: jax.Array, m: Matrix) -> jax.Array:
        """x [rows, <= m.k] bf16 @ the streamed matrix m -> [rows, m.n] f32 (fp32 accumulation).

        Consumes m.tiles tiles: column block by column block, row blocks inside.
        """
        tk, tn = m.tile_k, m.tile_n
        rows = x.shape[0]
        self.xbuf[:, :x.shape[1]] = x
        if m.k_pad > x.shape[1]:
            self.xbuf[:, x.shape[1]:m.k_pad] = jnp.zeros((rows, m.k_pad - x.shape[1]), x.dtype)

        def column(n, carry):
            def row_block(k, acc):
                slot = self.take()
                xk = self.xbuf[:, pl.ds(pl.multiple_of(k * tk, tk), tk)]
                acc = acc + jnp.dot(xk, self.slots[slot], preferred_element_type=jnp.float32)
                self.release()
                return acc
            acc = jax.lax.fori_loop(0, m.k_tiles, row_block, jnp.zeros((rows, tn), jnp.float32))
            self.ybuf[:, pl.ds(pl.multiple_of(n * tn, tn), tn)] = acc
            return carry

        jax.lax.fori_loop(0, m.n_tiles, column, 0)
        return self.ybuf[:, :m.n]
