"""The weight ring: every streamed weight tile of the step flows through `num_slots` VMEM slots.

The plan (mk.kernel.plan) fixes the order: layer by layer, matrix by matrix, tile by tile; MoE layers
splice in the tiles of each distinct routed expert once the router has chosen them. The ring
keeps an *issue cursor* (layer, position in that layer's stream) in SMEM, ahead of the consumer:

    advance(): issue tiles until `prefetch_depth` tiles beyond the next one needed are in flight
              (at the start of the step, and when a router unblocks the cursor);
    take():    wait for the needed tile's DMA, return its slot;
    release(): the slot may be refilled: issue (at most) the one tile that keeps the window full.

Issuing at release, after the tile's compute in program order, puts the issue's scalar work (slot
and address arithmetic, SMEM reads) in the same basic block as the tile's vector work, so the
compiler packs it into the free scalar slots of those bundles: on TPU v5e (deviceless LLO, one
512 x 512 MXFP4 tile of k3-chip) the tile's loop body is 533 bundles, against 664 for an issue
loop run before each wait (131 of them the loop, bounds checks included).

Because the cursor walks straight from one layer's stream into the next, the next layer's first
tiles arrive while this layer is still computing: cross-layer prefetch. The cursor stops at the
start of a MoE layer's expert segment until the router of that layer has published its distinct
experts (`publish_routing`).

Tiles land in the slot pool of their matrix's storage format (`Matrix.format`): bf16 tiles in
`slots`; MXFP4 expert tiles (`plan.experts == "mxfp4"`) in their own `code_slots` / `scale_slots`
with their own semaphores, and are unpacked 128 columns at a time into vector registers that feed
the MXU directly (`mxfp4_tile_product`, by the plan's `mxfp4_unpack`: integer ops on every TPU, the
fp4 bitcast on TPU v7). One cursor, one stream order, one prefetch depth for both pools; a
pool's slot is its own issue count mod `num_slots`.
"""
from __future__ import annotations


import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mk.model.layers.common import K_CHUNK
from mk.kernel.plan import CODES_PER_WORD, SCALES_PER_WORD, Matrix, Plan
from mk.model.config import MX_GROUP


def group_exponents(scales) -> jax.Array:
    """scales [tile_k / 128, tile_n] int32 (ref; layout `mk.kernel.packing.pack_mxfp4_tiles`) -> the 32-row
    groups' E8M0 bytes s [tile_k / 32, tile_n] int32, group g in row g. Scale byte j of every word
    is row-group block j."""
    s_words = scales[...]
    return jnp.concatenate([jax.lax.shift_right_logical(s_words, 8 * j) & 255 for j in range(SCALES_PER_WORD)],
                           axis=0)                                                 # [tk / 32, tn]


def group_scales(scales) -> jax.Array:
    """scales as `group_exponents` -> the groups' 2^(s - 127) [tile_k / 32, tile_n] f32, built as
    exponent bits: exact (s in 2..252, `mk.kernel.packing.KERNEL_SCALE_RANGE`)."""
    return jax.lax.bitcast_convert_type(group_exponents(scales) << 23, jnp.float32)


# An MXFP4 tile goes to the MXU this many columns at a time: unpacked in vector registers and
# multiplied there, never stored as a bf16 tile (`mxfp4_tile_product`).
DEQUANT_LANES = 128


def tile_product(acc, x, w, chunk: int) -> jax.Array:
    """acc [R, n] f32 + x [R, tk] bf16 @ w [tk, n] bf16 (ref or value): `chunk`-deep products summed
    in order, as `mk.model.layers.common.mm` sums them."""
    for c in range(0, w.shape[0], chunk):
        acc = acc + jnp.dot(x[:, c:c + chunk], w[c:c + chunk], preferred_element_type=jnp.float32)
    return acc


def mxfp4_tile_product(acc, x, codes, scales, unpack: str, chunk: int) -> jax.Array:
    """acc [R, tile_n] f32 + x [R, tile_k] bf16 @ one MXFP4 tile (codes [tile_k / 8, tile_n], scales
    [tile_k / 128, tile_n] int32 refs) -> [R, tile_n] f32, `DEQUANT_LANES` columns at a time: each
    block is unpacked (`unpack_values`) and fed to the MXU straight from the vector registers.

    Why by columns: a bf16 tile stored to VMEM and loaded back for the MXU is relaid out on both
    sides (v5e LLO, one 512 x 512 tile and an 8-row product: 3335 vector ops through a VMEM tile,
    2091 fused, no loads, stores or repacking of weights). Each output column is the same sum in
    the same order either way."""
    s = group_exponents(scales)                                                       # [tk / 32, tn]
    L = min(DEQUANT_LANES, acc.shape[1])
    blocks = []
    for c in range(0, acc.shape[1], L):
        w = unpack_values(codes[:, c:c + L], s[:, c:c + L], unpack)                   # [tk, L] bf16
        blocks.append(tile_product(acc[:, c:c + L], x, w, chunk))
    return jnp.concatenate(blocks, axis=1)


def _rows(group_rows, rows: int) -> jax.Array:
    """[g, n] -> [g * rows, n]: row i of group_rows repeated `rows` times (a sublane broadcast)."""
    g, n = group_rows.shape
    return jnp.broadcast_to(group_rows[:, None, :], (g, rows, n)).reshape(g * rows, n)


def _shift(x, n: int) -> jax.Array:
    """x << n, or a logical x >> -n for n < 0."""
    return x << n if n >= 0 else jax.lax.shift_right_logical(x, -n)


def _i32(c: int) -> int:
    """A 32-bit pattern as the int32 constant that holds it."""
    return c - (1 << 32) if c >= 1 << 31 else c


def nonzero_bits(words) -> jax.Array:
    """words [r, n] int32 of re-encoded codes (`mk.kernel.packing.pairs_nibble`: sign | k in each
    nibble) -> bit 3 of each nibble set where that code is not zero (k != 1), all eight at once:
    (k ^ 1) + 7 carries into bit 3 unless k ^ 1 is 0. 4 integer ops for eight weights."""
    return (((words & 0x77777777) ^ 0x11111111) + 0x77777777) & _i32(0x88888888)


def pair_bits(words, j: int, e_pair, nonzero) -> jax.Array:
    """words [r, n] int32 holding re-encoded codes (`mk.kernel.packing.pairs_nibble`: sign | k) at
    bits 4j .. 4j + 3 and 16 + 4j .. (the rest ignored), e_pair [r, n] int32: (s - 1) << 7 in both
    16-bit halves, nonzero: `nonzero_bits(words)` -> both halves' bf16 bit patterns of
    value(code) * 2^(s - 127).

    The re-encoding makes a magnitude's bf16 bits linear in k: 0.5, 1, 1.5, 2, 3, 4, 6 are k = 0, 2,
    3, .. 7, bits (s - 1) << 7 + 64 k, which stay below bit 15 (s <= 252); zero is k = 1 and masked
    to 0. The mask spans bits 6 .. 14, built from the code's nonzero bit p = 4j + 3 as
    2^15 - 2^6 = (bit << (15 - p)) - (bit >> (p - 6)). Every op acts on both 16-bit halves at once
    (no carry or borrow crosses bit 16): 11 integer ops for two weights (9 for plane 3)."""
    p = 4 * j + 3
    k6 = _shift(words, 6 - 4 * j) & 0x01C001C0                   # k << 6 in each half (bits 6-8, 22-24)
    bit = nonzero & _i32(0x00080008 << 4 * j)                     # bits p and 16 + p: code != 0
    keep = _shift(bit, 15 - p) - _shift(bit, 6 - p)               # bits 6-14 of each half where code != 0
    sign = _shift(words, 12 - 4 * j) & _i32(0x80008000)           # the code's bit 3 -> bits 15 and 31
    return ((e_pair + k6) & keep) | sign


def pair_bits_mul(words, j: int, e_pair, nonzero) -> jax.Array:
    """`pair_bits` (same words, same result, bit for bit) with the integer multiplies the v5e/v6e VPU
    issues as one ALU op (`vmul.u32`): the mask of bits 6 .. 14 is the nonzero bit times 2^12 - 2^3
    once that bit sits at bit 3 (and 19) of the word; for planes 0 and 1 one multiply of the plane's
    two nibbles by 2^(6 - 4j) + 2^(12 - 4j) lays two copies of each (bits 6 .. 9 and 12 .. 15, no
    carries) from which one mask keeps k << 6 and the sign at bit 15. The sign then rides in e_pair +
    k << 6 (below 2^15, so no carry), and the mask keeps bit 15 for every code (+-0 stay signed).
    9, 9, 10, 9 integer ops for planes 0..3 against `pair_bits`' 11, 11, 11, 9 (v5e LLO of a
    512 x 512 tile times an 8-row LHS: 457 -> 415 bundles, `docs/tpu-v5e/llo_unpack.py`)."""
    bit = _shift(nonzero, -4 * j) & 0x00080008                    # the nonzero bits at bits 3 and 19
    keep = bit * ((1 << 12) - (1 << 3))                           # bits 6-14 of each half where code != 0
    if j <= 1:
        plane = words & (0x000F000F << 4 * j)                    # this plane's two nibbles
        ks = (plane * ((1 << (6 - 4 * j)) + (1 << (12 - 4 * j)))) & _i32(0x81C081C0)   # k << 6 | sign << 15
        return (e_pair + ks) & (keep | _i32(0x80008000))
    k6 = _shift(words, 6 - 4 * j) & 0x01C001C0
    sign = _shift(words, 12 - 4 * j) & _i32(0x80008000)
    return ((e_pair + k6) & keep) | sign


def e2m1_bits(nibbles, exponent) -> jax.Array:
    """nibbles [r, n] int32 whose low 4 bits are E2M1 codes (higher bits ignored), exponent [r, n]
    int32: (s - 1) << 23 for a scale 2^(s - 127) -> the f32 bit patterns of value(code) * 2^(s - 127).

    E2M1 is sign | e (2 bits) | m: 0, 0.5 (e = 0) and 2^(e - 1) (1 + m / 2). Shifted left by 22,
    e and m land on the low exponent bits and the top mantissa bit of an f32: adding (s - 1) << 23
    gives the exponent e + s - 1 of value * 2^(s - 127) for e >= 1; the subnormal 0.5 is 2^(s - 128),
    exponent s - 1 with no mantissa: `exponent` itself. Integer ops only, no rounding: exact for
    s in 2..252, where every product is a normal f32 (and bf16) number."""
    em = (nibbles & 7) << 22                                     # e, m at f32 bits 23-24, 22
    mag = jnp.where(em >= 2 << 22, em + exponent, jnp.where(em == 1 << 22, exponent, 0))
    return mag | ((nibbles & 8) << 28)                           # the sign bit


def unpack_values(words, s, unpack: str) -> jax.Array:
    """words [tk / 8, n] int32 (layout: `mk.kernel.packing.pack_mxfp4_tiles` for `unpack`), s [tk / 32,
    n] int32 E8M0 bytes (group g = rows 32 g ..) -> [tk, n] bf16 = value(code) * 2^(s - 127), exactly.

    'pairs' (every TPU): bits 4j .. and 16 + 4j .. of the words hold rows j tk/4 + 2w and + 1 (plane
    j), built as bf16 patterns two at a time in 32-bit lanes (`pair_bits`) and reinterpreted as bf16
    (`pltpu.bitcast`: low half row 2w, high half row 2w + 1), which the MXU takes as it is.
    'pairs_mul' (every TPU): the same words and values, built with integer multiplies (`pair_bits_mul`).
    'shift' (every TPU): plane j is rows j tk/8 .., one f32 bit pattern per lane (`e2m1_bits`, about
    10 integer ops per weight), then converted to bf16.
    'bitcast' (TPU v7): `pltpu.bitcast` to E2M1 (row 8w + j = bits 4j .. of word w), one conversion
    to bf16 and a multiply by the power of two (exact)."""
    r = words.shape[0]                                                                 # word rows
    if unpack in ("pairs", "pairs_mul"):
        bits = pair_bits_mul if unpack == "pairs_mul" else pair_bits
        e_pair = (s - 1) << 7
        e_pair = _rows(e_pair | (e_pair << 16), MX_GROUP // 2)                         # [tk / 2, n], one per word row
        nonzero = nonzero_bits(words)                                                  # [tk / 8, n]
        return jnp.concatenate([pltpu.bitcast(bits(words, j, e_pair[j * r:(j + 1) * r], nonzero), jnp.bfloat16)
                                for j in range(CODES_PER_WORD // 2)], axis=0)          # 4 planes of [tk / 4, n]
    if unpack == "bitcast":
        scale = jax.lax.bitcast_convert_type(_rows(s, MX_GROUP) << 23, jnp.float32).astype(jnp.bfloat16)
        return pltpu.bitcast(words, jnp.float4_e2m1fn).astype(jnp.bfloat16) * scale
    nibbles = jnp.concatenate([jax.lax.shift_right_logical(words, 4 * j) for j in range(CODES_PER_WORD)],
                              axis=0)                                                  # [tk, n]
    bits = e2m1_bits(nibbles, (_rows(s, MX_GROUP) - 1) << 23)
    return jax.lax.bitcast_convert_type(bits, jnp.float32).astype(jnp.bfloat16)


def fp8_tile_product(acc, x, codes, scales, lhs, w8, m: Matrix, unpack: str = "shift"):
    """acc [R, tile_n] f32 + x [R, tile_k] bf16 @ one MXFP4 tile on the fp8 path (spec 3.5): the
    codes' values (`unpack_values` with scale 1) converted to float8_e4m3fn (exact: E2M1 values are
    e4m3 values) into `w8` [tile_k, tile_n]; a block-diagonal LHS `lhs` [G R, tile_k] bf16 (G =
    tile_k / 32 groups; block g holds x's columns of group g, zeros elsewhere); one MXU dot gives
    every group's partial product [G R, tile_n] f32; each is scaled by its group's 2^(s - 127) and
    added to acc in group order.

    Exactness: a bf16 x E2M1 product has at most 10 significant bits (exact in fp32), the zeros add
    nothing, and scaling by a power of two commutes with rounding, so the result is the fp32 sum,
    group by group in order, of the dequantized weights' products: `mk.model.layers.common.mm` with
    `k_chunk = MX_GROUP` (what `mk.kernel.step.expert_k_chunk` tells the references). Per weight: the
    unpack and its store; the scale multiply-adds are per group."""
    tk, tn = m.tile_k, m.tile_n
    G, R = tk // MX_GROUP, x.shape[0]
    if unpack == "bitcast":
        w8[...] = pltpu.bitcast(codes[...], jnp.float4_e2m1fn).astype(jnp.float8_e4m3fn)   # [tk, tn]
    else:
        unit = jnp.full((G, tn), 127, jnp.int32)                                     # scale 2^0
        w8[...] = unpack_values(codes[...], unit, unpack).astype(w8.dtype)           # [tk, tn] e4m3
    xs = jnp.concatenate([x.astype(jnp.float32)] * G, axis=0)                        # [G R, tk]
    row_group = jax.lax.broadcasted_iota(jnp.int32, (G * R, tk), 0) // R
    col_group = jax.lax.broadcasted_iota(jnp.int32, (G * R, tk), 1) // MX_GROUP
    lhs[...] = jnp.where(row_group == col_group, xs, 0.0).astype(jnp.bfloat16)
    part = jnp.dot(lhs[...], w8[...], preferred_element_type=jnp.float32)            # [G R, tn]
    scale = group_scales(scales)                                                     # [G, tn]
    for g in range(G):
        acc = acc + part[g * R:(g + 1) * R] * scale[g:g + 1]
    return acc


class WeightRing:
    """The ring's buffers, plus its counters as traced scalars (`self.c`) threaded through every
    loop and branch that touches the ring (`fori`, `cond`), so the hot path does no SMEM traffic.

    Counters: issued / consumed tiles (both pools); `issued_mx` / `consumed_mx`, those of the mxfp4
    pool; `dense_next`, the next dense tile to issue (the packed array is in stream order);
    `layer`, the cursor's layer; `expert_pos`, expert tiles issued in that layer; `routed` /
    `n_distinct`, the last layer whose router published its experts.

    Refs (`mk.kernel.refs.Refs`, shapes in `Plan.buffers`): tables (expert_at, next_base, SMEM);
    tiles [dense_tiles, TK, TN] bf16 and the experts (HBM): experts [n_moe, E_local, T, TK, TN] bf16
    or expert_codes / expert_scales [n_moe, E_local, T, TK/8 | TK/128, TN] int32; slots
    [S, TK, TN] bf16 + slot_sems; code_slots / scale_slots + code_sems / scale_sems (mxfp4),
    dequant and mx_lhs (its fp8 path); distinct [E_local] int32 (SMEM); xbuf [R, K] bf16, ybuf [R, N] f32.
    """

    FIELDS = ("issued", "consumed", "issued_mx", "consumed_mx", "dense_next", "layer", "expert_pos",
              "routed", "n_distinct", "coll")

    def __init__(self, plan: Plan, refs):
        self.plan, self.r, self.tables = plan, refs, refs.tables
        self.mxfp4 = plan.experts == "mxfp4"
        self.fp8 = self.mxfp4 and plan.options.mxfp4_matmul == "fp8"     # MXFP4 tiles on the fp8 MXU path
        self.c = None

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

    # ---- the copies -----------------------------------------------------------------------------
    def _bf16_copy(self, src, slot):
        return pltpu.make_async_copy(src, self.r.slots.at[slot], self.r.slot_sems.at[slot])

    def _mxfp4_copies(self, layer, expert, tile, slot):
        r = self.r
        return (pltpu.make_async_copy(r.expert_codes.at[layer, expert, tile], r.code_slots.at[slot],
                                      r.code_sems.at[slot]),
                pltpu.make_async_copy(r.expert_scales.at[layer, expert, tile], r.scale_slots.at[slot],
                                      r.scale_sems.at[slot]))

    # ---- issuing --------------------------------------------------------------------------------
    def _missing(self):
        """Tiles short of the window: consumed .. consumed + prefetch_depth in flight."""
        return self.c["consumed"] + self.plan.prefetch_depth + 1 - self.c["issued"]

    def _issue_next(self, go=True):
        """Issue the next tile of the stream if `go` and its source is known (experts need routing)."""
        c, t, Te, S = self.c, self.tables, self.plan.expert_tiles, self.plan.num_slots
        layer = c["layer"]
        at_experts = c["dense_next"] == t["expert_at"][layer]        # -1 for layers without experts
        known = c["routed"] == layer
        expert = at_experts & known & (c["expert_pos"] < c["n_distinct"] * Te) & go
        blocked = at_experts & jnp.logical_not(known)
        dense = jnp.logical_not(expert | blocked) & (c["dense_next"] < self.plan.dense_tiles) & go
        bf16_slot = (c["issued"] - c["issued_mx"]) % S

        @pl.when(expert)
        def _():
            j = c["expert_pos"]
            e, tile = self.r.distinct[j // Te], j % Te
            if self.mxfp4:
                for cp in self._mxfp4_copies(layer - 1, e, tile, c["issued_mx"] % S):
                    cp.start()
            else:
                self._bf16_copy(self.r.experts.at[layer - 1, e, tile], bf16_slot).start()

        @pl.when(dense)
        def _():
            self._bf16_copy(self.r.tiles.at[c["dense_next"]], bf16_slot).start()

        dense_next = c["dense_next"] + dense.astype(jnp.int32)
        next_layer = dense & (dense_next == t["next_base"][layer]) & (layer < self.plan.config.layers)
        self.c = dict(c, issued=c["issued"] + (expert | dense).astype(jnp.int32), dense_next=dense_next,
                      issued_mx=c["issued_mx"] + (expert & self.mxfp4).astype(jnp.int32),
                      layer=jnp.where(next_layer, layer + 1, layer),
                      expert_pos=jnp.where(next_layer, 0, c["expert_pos"] + expert.astype(jnp.int32)))

    def advance(self):
        """Issue until tiles consumed .. consumed + prefetch_depth are in flight (or blocked)."""
        self.fori(0, jnp.maximum(self._missing(), 0), lambda i: self._issue_next())

    def publish_routing(self, layer, n_distinct):
        """The router of `layer` wrote its distinct experts to `distinct`: unblock the cursor."""
        self.c = dict(self.c, routed=layer, n_distinct=n_distinct)
        self.advance()

    # ---- consuming ------------------------------------------------------------------------------
    def take(self, m: Matrix):
        """Wait for the next tile in stream order (a tile of `m`); returns its slot in m's pool.
        It was issued by `advance` or by an earlier `release`."""
        S = self.plan.num_slots
        if m.format == "mxfp4":
            slot = self.c["consumed_mx"] % S
            for cp in self._mxfp4_copies(0, 0, 0, slot):
                cp.wait()
        else:
            slot = (self.c["consumed"] - self.c["consumed_mx"]) % S
            self._bf16_copy(self.r.tiles.at[0], slot).wait()
        return slot

    def release(self, m: Matrix):
        """The tile taken last is used: its slot may be refilled. Issues the tile that keeps the
        window full: one at most, since `advance` filled it and each release opens it by one
        (a cursor blocked at the experts is caught up by `publish_routing`)."""
        self.c = dict(self.c, consumed=self.c["consumed"] + 1,
                      consumed_mx=self.c["consumed_mx"] + int(m.format == "mxfp4"))
        self._issue_next(self._missing() > 0)

    def matmul(self, x: jax.Array, m: Matrix) -> jax.Array:
        """x [rows, <= m.k] bf16 @ the streamed matrix m -> [rows, m.n] f32 (fp32 accumulation).

        Consumes m.tiles tiles: column block by column block, row blocks inside.
        """
        tk, tn = m.tile_k, m.tile_n
        chunk = K_CHUNK if tk % K_CHUNK == 0 else tk
        rows = x.shape[0]
        xbuf, ybuf = self.r.xbuf, self.r.ybuf
        xbuf[:, :x.shape[1]] = x
        if m.k_pad > x.shape[1]:
            xbuf[:, x.shape[1]:m.k_pad] = jnp.zeros((rows, m.k_pad - x.shape[1]), x.dtype)

        def column(n):
            def row_block(k, carry):
                acc, self.c = carry
                slot, r = self.take(m), self.r
                xk = xbuf[:, pl.ds(pl.multiple_of(k * tk, tk), tk)]                         # [rows, tk] bf16
                if m.format == "mxfp4" and self.fp8:          # group partials on the fp8 path
                    acc = fp8_tile_product(acc, xk, r.code_slots.at[slot], r.scale_slots.at[slot], r.mx_lhs,
                                           r.dequant, m, self.plan.mxfp4_unpack)
                elif m.format == "mxfp4":                     # unpacked in registers, straight to the MXU
                    acc = mxfp4_tile_product(acc, xk, r.code_slots.at[slot], r.scale_slots.at[slot],
                                             self.plan.mxfp4_unpack, chunk)
                else:
                    acc = tile_product(acc, xk, r.slots.at[slot], chunk)
                self.release(m)
                return acc, self.c
            acc, self.c = jax.lax.fori_loop(0, m.k_tiles, row_block,
                                            (jnp.zeros((rows, tn), jnp.float32), self.c))
            ybuf[:, pl.ds(pl.multiple_of(n * tn, tn), tn)] = acc

        self.fori(0, m.n_tiles, column)
        return ybuf[:, :m.n]
