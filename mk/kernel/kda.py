"""Kimi Delta Attention in the kernel (spec 1.4.3), for the layer whose KDA index is `i`.

Gate-first order: the small gate path (f_a, f_b) streams in before the fused q|k|v|g|b
projection. The layer's recurrent and conv states are DMA'd HBM -> VMEM at entry (overlapping
the projections) and written back in place (the HBM arrays are aliased to the outputs); the write
back stays in flight past the layer, waited by the next KDA layer before it loads into the same
buffers, or by the step's end (`wait_state_stores`): a DMA issued behind the ring's tiles waits for
them, and nothing in the layer needs it done.
The delta rule runs per (row, head) on a [D, D] fp32 state with elementwise ops: the function
is `mk.model.layers.kda.kda_head`, the very one the reference maps over rows and heads.

The row model (`mk.kernel.plan.Plan.row_seq`): states live in HBM per ROW, [rows, n_kda, ...]. The
first row of a sequence starts from the state of its sequence's row `state_row[seq]` (the row a
previous verify step accepted; 0 for plain decode), every later row from the row before it: the
conv and the delta rule chain row to row, in order, and every row's post-state is written back
to its own row. The next step picks any of them by `state_row`: rollback copies nothing.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mk.kernel.collectives import all_reduce
from mk.model.layers.common import bf, f32, sigmoid
from mk.model.layers.kda import kda_head

# Heads of one row per trip of the delta rule's loop. A row's heads are independent, so the scheduler
# interleaves the unrolled heads' ops (the XLU reductions) and each head's arithmetic stays as it was:
# on the v5e's deviceless LLO (docs/tpu-v5e/llo_kda.py, k3-d48's 12 heads) 205 bundles per head at 1,
# 186 at 2, 161 at 4, 169 at 6; the chip measured 0.34 us per (row, head) at 1 (2026-12-06h) and
# 0.17 at 4 (2026-12-07). beta's broadcast over a head's lanes (an MXU product with a one-hot
# matrix) is made for every row of a head at once before the loop (`kda_feat[5]`): 150 bundles at 4.
HEADS_UNROLL = 4


def first_of_sequence(r, b: int):
    """Whether row b starts its sequence's block (traced, from the SMEM row table)."""
    if b == 0:
        return jnp.bool_(True)
    return r.row_seq[b] != r.row_seq[b - 1]


def source_row(r, b: int):
    """The VMEM row whose state row b continues: itself (loaded from HBM) or the row before."""
    if b == 0:
        return 0
    return jnp.where(first_of_sequence(r, b), b, b - 1)


class StateCopies:
    """DMA descriptors moving layer i's KDA and conv states between HBM and VMEM: `load` the state
    each sequence starts from (into its first row), `store` every row's post-state (to its row)."""

    def __init__(self, r, i, batch):
        self.r, self.i, self.batch = r, i, batch

    def _pairs(self, b, hbm_row):
        r, i = self.r, self.i
        yield (r.kda_state_hbm.at[hbm_row, i], r.kda_state.at[b], r.state_sems.at[0, b])
        yield (r.conv_state_hbm.at[hbm_row, i], r.conv_state.at[b], r.state_sems.at[1, b])

    def load(self, b):
        """Row b's load (issue it only where row b is the first of its sequence)."""
        hbm_row = b + self.r.state_row[self.r.row_seq[b]]
        return [pltpu.make_async_copy(src, dst, sem) for src, dst, sem in self._pairs(b, hbm_row)]

    def store(self):
        return [pltpu.make_async_copy(dst, src, sem) for b in range(self.batch)
                for src, dst, sem in self._pairs(b, b)]


def _when_first(r, b, copies, method):
    """`c.method()` for each copy where row b starts its sequence (statically for row 0)."""
    def run():
        for c in copies:
            getattr(c, method)()
    if b == 0:
        run()
    else:
        pl.when(first_of_sequence(r, b))(run)


def kda(k, a, i):
    """a [R, d] bf16 (normalized input), i: traced KDA index -> y [R, d] bf16.

    This device runs its H = heads / N heads; the output projection's partial sums meet in the
    `attn_out` all-reduce."""
    cfg, r, ring = k.cfg, k.refs, k.ring
    B, H, D, HD = k.plan.batch, k.plan.heads, cfg.head_dim, k.plan.attn_width
    C = cfg.conv_size
    s = k.plan.stream(cfg.kda_layers[0])
    f_a, f_b, proj, o_proj = (s.matrix(n) for n in ("kda.f_a", "kda.f_b", "kda.in", "kda.o"))
    copies = StateCopies(r, i, B)

    with jax.named_scope("kda_state_in"):
        pl.when(i > 0)(lambda: wait_state_stores(k))     # the KDA layer before's, out of these buffers
        for b in range(B):
            _when_first(r, b, copies.load(b), "start")
    with jax.named_scope("kda_projections"):
        f = bf(ring.matmul(a, f_a)[:, :D])
        g_raw = bf(ring.matmul(f, f_b)[:, :HD])
        y = ring.matmul(a, proj)
        q_t, k_t, v_t, g_o = (bf(proj.part(n).cols(y)) for n in "qkvg")
        beta = proj.part("b")                                                # H lanes, 128-aligned
        r.beta_raw[...] = bf(y[:, beta.offset:beta.offset + r.beta_raw.shape[1]])
    for b in range(B):
        _when_first(r, b, copies.load(b), "wait")

    with jax.named_scope("kda_conv"):
        for b in range(B):
            src = source_row(r, b)
            for j, new in enumerate((q_t, k_t, v_t)):
                history = f32(r.conv_state[src, j])                                     # [C-1, HD]
                window = [history[t:t + 1] for t in range(C - 1)] + [f32(new[b:b + 1])]  # oldest first
                acc = window[0] * k.vec(f"conv{j}_0", HD)
                for t in range(1, C):
                    acc = acc + window[t] * k.vec(f"conv{j}_{t}", HD)
                r.kda_feat[j, pl.ds(b, 1)] = f32(bf(acc * jax.nn.sigmoid(acc)))
                r.conv_state[b, j] = bf(jnp.concatenate(window[1:], axis=0))
        decay = cfg.gate_lower_bound * sigmoid(jnp.exp(k.vec("a_log", HD)) * (f32(g_raw) + k.vec("dt_bias", HD)))
        r.kda_feat[3] = decay
        r.kda_feat[4] = f32(g_o)

    with jax.named_scope("kda_delta_rule"):
        lanes = jax.lax.broadcasted_iota(jnp.int32, (r.beta_raw.shape[1], D), 0)

        def broadcast_beta(h, carry):                        # sigmoid(beta) of head h on its D lanes, every row
            off = pl.multiple_of(h * D, D)
            r.kda_feat[5, :, pl.ds(off, D)] = sigmoid(jnp.dot(
                r.beta_raw[...], (lanes == h).astype(jnp.bfloat16), preferred_element_type=jnp.float32))  # [R, D]
            return carry
        jax.lax.fori_loop(0, H, broadcast_beta, 0)
        o_norm = k.vec("o_norm", D)
        for b in range(B):                                   # in row order: row b continues src
            src = source_row(r, b)

            def head(h, carry, b=b, src=src):
                off = pl.multiple_of(h * D, D)
                feat = lambda n: r.kda_feat[n, pl.ds(b, 1), pl.ds(off, D)]             # [1, D]
                r.attn_out[pl.ds(b, 1), pl.ds(off, D)], r.kda_state[b, h] = kda_head(
                    r.kda_state[src, h], *(feat(n) for n in range(4)), feat(5), feat(4), o_norm, cfg.eps)
                return carry
            jax.lax.fori_loop(0, H, head, 0, unroll=min(HEADS_UNROLL, H))

    with jax.named_scope("kda_state_out"):
        for c in copies.store():                             # waited by the next KDA layer
            c.start()
    with jax.named_scope("kda_out_proj"):
        return all_reduce(k, "attn_out", ring.matmul(r.attn_out[...], o_proj)[:, :cfg.dim])


def wait_state_stores(k):
    """Wait for every row's state write back a KDA layer left in flight (`StateCopies.store`): at
    the next KDA layer's start, and at the step's end. A wait needs only the copy's size, which
    every layer shares."""
    for c in StateCopies(k.refs, 0, k.plan.batch).store():
        c.wait()
