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

from mk.layers.common import K_CHUNK
from mk.plan import Matrix, Plan



@dataclasses.dataclass
class WeightRing:
    """The ring's buffers, plus its counters as traced scalars (`self.c`) threaded through every
    loop and branch that touches the ring (`fori`, `cond`), so the hot path does no SMEM traffic.

    Counters: issued / consumed tiles; `dense_next`, the next dense tile to issue (the packed array
    is in stream order); `layer`, the cursor's layer; `expert_pos`, expert tiles issued in that
    layer; `routed` / `n_distinct`, the last layer whose router published its experts.
    """
    plan: Plan
    tables: dict              # SMEM refs: expert_at, next_base [L + 1] int32
    tiles_hbm: object         # [dense_tiles, tile_k, tile_n] bf16 (HBM)
    experts_hbm: object       # [n_moe, E_local, expert_tiles, tile_k, tile_n] bf16 (HBM)
    slots: object             # [num_slots, tile_k, tile_n] bf16 (VMEM)
    sems: object              # DMA semaphores [num_slots]
    distinct: object          # [max(E_local, 1)] int32 (SMEM): local ids of the routed layer's experts
    xbuf: object              # [rows, k_max] bf16 (VMEM): matmul input
    ybuf: object              # [rows, n_max] f32 (VMEM): matmul output
    c: dict = None

    FIELDS = ("issued", "consumed", "dense_next", "layer", "expert_pos", "routed", "n_distinct", "coll")

    def reset(self):
        self.c = {f: jnp.int32(-1 if f == "routed" else 0) for f in self.FIELDS}

    # ---- threading the counters through control flow -------------------------------------------
    def fori(self, lo, hi, body):
        """`for i in range(lo, hi): body(i)` where body may use the ring."""
        def step(i, c):
            self.c = c
            body(i)
            return self.c
        self.c = jax.lax.fori_loop(lo, hi, step, self.c)

    def cond(self, pred, true_fn, false_fn):
        """`true_fn() if pred else false_fn()` where both may use the ring; returns their value."""
        c0 = self.c

        def branch(fn):
            def run():
                self.c = c0
                out = fn()
                return out, self.c
            return run
        out, self.c = jax.lax.cond(pred, branch(true_fn), branch(false_fn))
        return out

    # ---- issuing --------------------------------------------------------------------------------
    def _copy(self, src, slot):
        return pltpu.make_async_copy(src, self.slots.at[slot], self.sems.at[slot])

    def _issue_next(self):
        """Issue the next tile of the stream if its source is known (experts need routing)."""
        c, t, Te = self.c, self.tables, self.plan.expert_tiles
        layer = c["layer"]
        at_experts = c["dense_next"] == t["expert_at"][layer]        # -1 for layers without experts
        known = c["routed"] == layer
        expert = at_experts & known & (c["expert_pos"] < c["n_distinct"] * Te)
        blocked = at_experts & jnp.logical_not(known)
        dense = jnp.logical_not(expert | blocked) & (c["dense_next"] < self.plan.dense_tiles)
        slot = c["issued"] % self.plan.num_slots

        @pl.when(expert)
        def _():
            j = c["expert_pos"]
            self._copy(self.experts_hbm.at[layer - 1, self.distinct[j // Te], j % Te], slot).start()

        @pl.when(dense)
        def _():
            self._copy(self.tiles_hbm.at[c["dense_next"]], slot).start()

        dense_next = c["dense_next"] + dense.astype(jnp.int32)
        next_layer = dense & (dense_next == t["next_base"][layer]) & (layer < self.plan.config.layers)
        self.c = dict(c, issued=c["issued"] + (expert | dense).astype(jnp.int32), dense_next=dense_next,
                      layer=jnp.where(next_layer, layer + 1, layer),
                      expert_pos=jnp.where(next_layer, 0, c["expert_pos"] + expert.astype(jnp.int32)))

    def advance(self):
        """Issue until tiles consumed .. consumed + prefetch_depth are in flight (or blocked)."""
        missing = self.c["consumed"] + self.plan.prefetch_depth + 1 - self.c["issued"]
        self.fori(0, jnp.maximum(missing, 0), lambda i: self._issue_next())

    def publish_routing(self, layer, n_distinct):
        """The router of `layer` wrote its distinct experts to `distinct`: unblock the cursor."""
        self.c = dict(self.c, routed=layer, n_distinct=n_distinct)
        self.advance()

    # ---- consuming ------------------------------------------------------------------------------
    def take(self):
        """Wait for the next tile in stream order; returns its slot index."""
        self.advance()
        slot = self.c["consumed"] % self.plan.num_slots
        self._copy(self.tiles_hbm.at[0], slot).wait()
        return slot

    def release(self):
        self.c = dict(self.c, consumed=self.c["consumed"] + 1)

    def matmul(self, x: jax.Array, m: Matrix) -> jax.Array:
        """x [rows, <= m.k] bf16 @ the streamed matrix m -> [rows, m.n] f32 (fp32 accumulation).

        Consumes m.tiles tiles: column block by column block, row blocks inside.
        """
        tk, tn = m.tile_k, m.tile_n
        chunk = K_CHUNK if tk % K_CHUNK == 0 else tk
        rows = x.shape[0]
        self.xbuf[:, :x.shape[1]] = x
        if m.k_pad > x.shape[1]:
            self.xbuf[:, x.shape[1]:m.k_pad] = jnp.zeros((rows, m.k_pad - x.shape[1]), x.dtype)

        def column(n):
            def row_block(k, carry):
                acc, self.c = carry
                slot = self.take()
                for c in range(0, tk, chunk):   # K_CHUNK-deep products, summed in order (as mk.layers.common.mm)
                    xk = self.xbuf[:, pl.ds(pl.multiple_of(k * tk + c, chunk), chunk)]
                    acc = acc + jnp.dot(xk, self.slots[slot, c:c + chunk], preferred_element_type=jnp.float32)
                self.release()
                return acc, self.c
            acc, self.c = jax.lax.fori_loop(0, m.k_tiles, row_block,
                                            (jnp.zeros((rows, tn), jnp.float32), self.c))
            self.ybuf[:, pl.ds(pl.multiple_of(n * tn, tn), tn)] = acc

        self.fori(0, m.n_tiles, column)
        return self.ybuf[:, :m.n]
