"""Multi-head latent attention in the kernel (spec 1.4.4), for the layer whose MLA index is `i`.

Projections stream through the ring (fused q_a|kv_a|g, then q_b, then kv_b). Attention walks the
row's cache in 128-position blocks, DMA'd HBM -> VMEM into two buffers, with an online softmax:
block j + 1 is in flight while block j is attended, and while a row attends its last block the
next row's first block lands in the other buffer (when that row reads another sequence: a verify
block's next row reads the block this one writes back, so it waits for it). The buffers alternate
across rows (`base`). The block that holds the row's position gets the new key/value merged in (by
position mask) before it is used, and of it only the 16-position tile that holds the new position is
written back (`CACHE_WRITE_ROWS`, the bf16 sublane tile): only touched slices move.

Two transfers leave the layer's critical path, because a DMA issued behind the ring's tiles waits for
them (up to `INFLIGHT_BYTES` of weights): row 0's first block is fetched before the projections, which
it then lands under, and the last row's write back is left in flight on its own semaphores
(`cache_sems[2]`), waited by the next MLA layer before it fetches, or by the step's end
(`wait_write_back`).

Heads go G at a time (`Plan.attention_heads`, 8 on K3): one loop step forms G heads' scores in one
batched product and updates their softmax state together (on the v5e at B = 8, 2048 attended
tokens cost 2.48 ms over 1 token with one head per step, 0.61 ms with 8, of which the cache
blocks' DMA is about 0.5 ms).

The row model: row b reads and writes the cache of its sequence `row_seq[b]` at its position
`row_pos[b]` (SMEM). Rows run in order, so the rows of a verify block (consecutive positions of
one sequence) see each other causally: row t attends to slots 0..pos + t, which hold the earlier
rows' keys/values already written back. Slots past a row's position (drafts a previous step
rejected) are masked, and overwritten when a later row reaches them.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mk.kernel.collectives import all_reduce
from mk.kernel.kda import first_of_sequence
from mk.kernel.plan import CACHE_WRITE_ROWS
from mk.model.layers.common import bf, f32, rms, sigmoid
from mk.model.layers.mla import BLOCK, attend_block, softmax_start


def _block_copies(r, b, i, j, buf, tile=None):
    """Descriptors for cache block j of row b's sequence, layer i, in VMEM buffer `buf` (0 | 1):
    (K, V) HBM <-> k_block[buf] [H, 128, Kc], v_block[buf] [H, 128, D]; with `tile` (traced, a
    multiple of CACHE_WRITE_ROWS below 128) only the block's positions tile..tile + CACHE_WRITE_ROWS - 1."""
    if tile is None:
        at, rows = pl.ds(0, BLOCK), pl.ds(pl.multiple_of(j * BLOCK, BLOCK), BLOCK)
    else:
        at = pl.ds(pl.multiple_of(tile, CACHE_WRITE_ROWS), CACHE_WRITE_ROWS)
        rows = pl.ds(pl.multiple_of(j * BLOCK + tile, CACHE_WRITE_ROWS), CACHE_WRITE_ROWS)
    seq = r.row_seq[b]
    return ((r.mla_k_hbm.at[seq, i, :, rows], r.k_block.at[buf, :, at], r.cache_sems.at[buf, 0]),
            (r.mla_v_hbm.at[seq, i, :, rows], r.v_block.at[buf, :, at], r.cache_sems.at[buf, 1]))


LAST_WRITE_BACK = 2   # cache_sems[2]: the semaphores of the write back left in flight past the layer


def _copy_block(r, b, i, j, buf, *, wait: bool, to_hbm: bool = False, tile=None, sems=None):
    """Start (wait=False) or wait for (wait=True) the K and V copies of `_block_copies` (on the
    semaphores of row `sems` of cache_sems, default the buffer's)."""
    for n, (src, dst, sem) in enumerate(_block_copies(r, b, i, j, buf, tile)):
        sem = sem if sems is None else r.cache_sems.at[sems, n]
        copy = pltpu.make_async_copy(dst, src, sem) if to_hbm else pltpu.make_async_copy(src, dst, sem)
        if wait:
            copy.wait()
        else:
            copy.start()


def _attend_row(k, b, i, base):
    """Online-softmax attention of row b over its sequence's positions 0..row_pos[b]; writes
    the row's key/value at row_pos[b] and attn_out row b. Heads go G at a time
    (`Plan.attention_heads`): one step of each head loop handles heads h0..h0 + G - 1. Block j
    lands in buffer (base + j) % 2 (base: traced int32, the blocks of the rows before);
    returns the next row's base."""
    cfg, r = k.cfg, k.refs
    H, D, Kc, G = k.plan.heads, cfg.head_dim, cfg.k_cache_dim, k.plan.attention_heads
    pos = r.row_pos[b]
    n_blocks = pos // BLOCK + 1
    m, l, acc = softmax_start(D)
    r.softmax[0] = jnp.broadcast_to(m, (H, 1, 128))
    r.softmax[1] = jnp.broadcast_to(l, (H, 1, 128))
    r.softmax_acc[...] = jnp.broadcast_to(acc, (H, 1, D))
    slot_iota = jax.lax.broadcasted_iota(jnp.int32, (BLOCK, 1), 0)

    def per_head(load):
        """[G, 1, X]: load(h) [1, X] for heads h0..h0 + G - 1, stacked on a leading axis."""
        return lambda h0: jnp.stack([load(h0 + g) for g in range(G)])

    q_heads = per_head(lambda h: r.mla_q[pl.ds(b, 1), pl.ds(pl.multiple_of(h * Kc, Kc), Kc)])        # [G, 1, Kc]
    k_new = per_head(lambda h: jnp.concatenate(
        [r.mla_kv[pl.ds(b, 1), pl.ds(pl.multiple_of(h * 2 * D, D), D)], r.mla_kr[pl.ds(b, 1), :]], axis=-1))
    v_new = per_head(lambda h: r.mla_kv[pl.ds(b, 1), pl.ds(pl.multiple_of(h * 2 * D + D, D), D)])   # [G, 1, D]

    def head_loop(body):
        """body(h0, heads) for h0 = 0, G, 2G, ...; heads: the pl.ds of those G heads."""
        def step(g, c):
            h0 = pl.multiple_of(g * G, G)
            body(h0, pl.ds(h0, G))
            return c
        jax.lax.fori_loop(0, H // G, step, 0)

    def fetch_first():
        _copy_block(r, b, i, 0, base % 2, wait=False)
    if b > 0:                                       # row 0's was started before the projections (`mla`);
        pl.when(~first_of_sequence(r, b))(fetch_first)   # a row starting its sequence: row b - 1 started it

    def block(j, carry):
        buf = (base + j) % 2
        _copy_block(r, b, i, j, buf, wait=True)
        last = j == n_blocks - 1

        @pl.when(~last)
        def _prefetch_next():                       # block j + 1 lands while block j is attended
            _copy_block(r, b, i, j + 1, 1 - buf, wait=False)

        if b + 1 < k.plan.batch:
            @pl.when(last & first_of_sequence(r, b + 1))
            def _prefetch_next_row():               # the next row's first block lands meanwhile
                _copy_block(r, b + 1, i, 0, 1 - buf, wait=False)

        k_block, v_block = r.k_block.at[buf], r.v_block.at[buf]                 # [H, 128, Kc], [H, 128, D]
        here = slot_iota == pos - j * BLOCK                                  # [128, 1]

        @pl.when(last)
        def _merge_new_token():
            def merge(h0, heads):
                k_block[heads] = jnp.where(here, k_new(h0), k_block[heads])     # [G, 128, Kc]
                v_block[heads] = jnp.where(here, v_new(h0), v_block[heads])     # [G, 128, D]
            head_loop(merge)

        valid = j * BLOCK + slot_iota <= pos                                  # [128, 1]

        def attend(h0, heads):
            r.softmax[0, heads], r.softmax[1, heads], r.softmax_acc[heads] = attend_block(
                f32(q_heads(h0)), k_block[heads], v_block[heads], valid, r.softmax[0, heads],
                r.softmax[1, heads], r.softmax_acc[heads], cfg.mla_scale)
        head_loop(attend)

        @pl.when(last)
        def _write_back():                          # the 16 positions around the new one
            tile = (pos - j * BLOCK) // CACHE_WRITE_ROWS * CACHE_WRITE_ROWS
            if b + 1 < k.plan.batch:                # the next row may read it, or fetch into `buf`
                _copy_block(r, b, i, j, buf, wait=False, to_hbm=True, tile=tile)
                _copy_block(r, b, i, j, buf, wait=True, to_hbm=True, tile=tile)
            else:                                   # the layer's last: in flight past the layer
                _copy_block(r, b, i, j, buf, wait=False, to_hbm=True, tile=tile, sems=LAST_WRITE_BACK)
        return carry

    jax.lax.fori_loop(0, n_blocks, block, 0)

    def output(h0, heads):
        o = r.softmax_acc[heads] / r.softmax[1, heads][..., :1]                 # [G, 1, D]
        for g in range(G):
            off = pl.multiple_of((h0 + g) * D, D)
            gate = bf(sigmoid(r.mla_gate[pl.ds(b, 1), pl.ds(off, D)]))
            r.attn_out[pl.ds(b, 1), pl.ds(off, D)] = bf(f32(bf(o[g])) * f32(gate))
    head_loop(output)
    return base + n_blocks


def mla(k, a, i):
    """a [R, d] bf16 (normalized input), i: traced MLA index -> y [R, d] bf16.

    q_a / kv_a are replicated (every device computes c_q, c_kv); q_b, kv_b, the gate and the
    cache hold this device's heads; the output projection's partials meet in `attn_out`."""
    cfg, r, ring = k.cfg, k.refs, k.ring
    D = cfg.head_dim
    s = k.plan.stream(cfg.mla_layers[0])
    proj, q_b, kv_b, o_proj = (s.matrix(n) for n in ("mla.in", "mla.q_b", "mla.kv_b", "mla.o"))
    with jax.named_scope("mla_projections"):
        pl.when(i > 0)(lambda: wait_write_back(k))    # the MLA layer before's last write back, out of buffer 0 | 1
        _copy_block(r, 0, i, 0, 0, wait=False)          # row 0's first block lands under the projections
        y = ring.matmul(a, proj)
        q_a, kv_a, g = (proj.part(n).cols(y) for n in ("q_a", "kv_a", "g"))
        c_q = rms(bf(q_a), k.vec("q_a_norm", cfg.q_rank), cfg.eps)
        kva = bf(kv_a)
        c_kv = rms(kva[:, :cfg.kv_rank], k.vec("kv_a_norm", cfg.kv_rank), cfg.eps)
        r.mla_kr[...] = kva[:, cfg.kv_rank:cfg.kv_rank + cfg.k_cache_dim - D]   # [k_r | zeros]
        r.mla_gate[...] = bf(g)
        r.mla_q[...] = bf(ring.matmul(c_q, q_b)[:, :r.mla_q.shape[1]])
        r.mla_kv[...] = bf(ring.matmul(c_kv, kv_b)[:, :r.mla_kv.shape[1]])
    with jax.named_scope("mla_attention"):
        base = jnp.int32(0)
        for b in range(k.plan.batch):                    # in row order: causal within a verify block
            base = _attend_row(k, b, i, base)
    with jax.named_scope("mla_out_proj"):
        return all_reduce(k, "attn_out", ring.matmul(r.attn_out[...], o_proj)[:, :cfg.dim])


def wait_write_back(k):
    """Wait for the last write back an MLA layer left in flight (`cache_sems[2]`): at the next MLA
    layer's start, and at the step's end. The wait needs only the copy's size, which every row and
    layer share."""
    _copy_block(k.refs, 0, 0, 0, 0, wait=True, to_hbm=True, tile=0, sems=LAST_WRITE_BACK)
