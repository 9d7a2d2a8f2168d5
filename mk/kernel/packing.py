"""Laying the weights out in stream order: jitted JAX, on the device the weights go to.

`pack_weights(plan, params, rank)` cuts rank `rank`'s share of the parameters (`mk.model.sharding`)
and lays it out as the kernel reads it: every dense tile in `mk.kernel.plan`'s stream order, the
per-layer vector tables, and the routed experts in the plan's format (bf16 tiles, or MXFP4 codes and
scales packed into int32 words, `pack_mxfp4_tiles`). The plan describes the layout; this module
writes it, reading the parameters from `mk.model.params` or a checkpoint (`mk.io.checkpoint`).

The layout is pure data movement (tiling, padding, transposes, integer bit packing), written once
in `jax.numpy` and run by XLA: the weights are packed where they live (random presets are drawn on
the device, `mk.model.params.init_fast`, and never leave it) and the program is compiled once per
plan (the persistent compile cache keeps it, `mk.model.compile_cache`). Parameters held as arrays
(jax or numpy) are packed by one program (`_pack_share`); a checkpoint's lazy tree
(`Checkpoint.lazy_params`) is read and packed piece by piece (`pack_pieces`), each piece by the same
layout functions, so the host never holds more than one piece.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from mk.model.config import MX_GROUP, K3Config
from mk.kernel.plan import CODES_PER_WORD, SCALES_PER_WORD, Matrix, Plan, PlanError, vector_rows

# E8M0 bytes whose products with every E2M1 magnitude (0.5 .. 6) are normal, finite bf16 values, so
# the kernel's integer dequantization (exponent arithmetic, no rounding) is exact; 2^(e - 127) for
# e = 1 makes 0.5 * 2^-126 subnormal, e >= 253 makes 4 * 2^126 overflow.
KERNEL_SCALE_RANGE = (2, 252)
BF16 = np.dtype(ml_dtypes.bfloat16)
EXPERT_CHUNK_BYTES = 16 << 20   # experts packed at a time: about this many bytes of [K, N] matrices


def _dense_matrix(ws, cfg: K3Config, m: Matrix, latent_offset: int = 0):
    """The [k_pad, n_pad] bf16 matrix `m`, fused and zero padded from its parts' weights `ws` (one
    per part, `_dense_sources`; bf16 throughout: the values are copied, never widened).
    `latent_offset`: this rank's `latent_offsets` entry; latent_down's columns and latent_up's rows
    start that many lanes into their block."""
    out = jnp.zeros((m.k_pad, m.n_pad), jnp.bfloat16)
    row = latent_offset if m.name == "moe.latent_up" else 0
    for p, w in zip(m.parts, ws):
        w = _bf16(w)
        col = p.offset + (latent_offset if p.source == ("moe", "latent_down") else 0)
        if p.head_pad:                      # h heads of src lanes, each in a dst-lane slot (zeros between)
            h, src, dst = p.head_pad
            w = jnp.pad(w[:, :h * src].reshape(w.shape[0], h, src), ((0, 0), (0, 0), (0, dst - src)))
            w = w.reshape(w.shape[0], h * dst)[:, :(h - 1) * dst + src]
        out = out.at[row:row + w.shape[0], col:col + w.shape[1]].set(w)
    return out


def _dense_sources(params: dict, cfg: K3Config, m: Matrix, layer: int) -> tuple:
    """The arrays `m`'s parts are cut from, for `layer` (indexing only: works on jax, numpy and lazy trees)."""
    out = []
    for p in m.parts:
        fam, key = p.source
        if fam == "lm_head":
            out.append(params["lm_head"])
        elif fam == "dense":
            out.append(params["dense"][key])
        else:
            out.append(params[fam][key][layer - 1 if fam == "moe" else cfg.family_index(layer)])
    return tuple(out)


def _bf16(w):
    """`w` as bf16 (a cast only where it is not: round to nearest even, as ml_dtypes does)."""
    w = jnp.asarray(w)
    return w if w.dtype == jnp.bfloat16 else w.astype(jnp.bfloat16)


def tile_matrix(w, tk: int, tn: int):
    """[..., k_pad, n_pad] -> [..., n_tiles * k_tiles, tk, tn], column block major (the stream order)."""
    *lead, k, n = w.shape
    kt, nt = k // tk, n // tn
    t = jnp.moveaxis(jnp.reshape(w, (*lead, kt, tk, nt, tn)), -2, -4)      # [..., nt, kt, tk, tn]
    return t.reshape(*lead, nt * kt, tk, tn)


def to_latent_blocks(x: np.ndarray, plan: Plan, axis: int) -> np.ndarray:
    """Lay the latent axis (length `latent`) of x out as the kernel's gathered latent vector:
    `devices` blocks of `latent_block` lanes, block j holding rank j's slice from lane
    `latent_offsets[j]` on, zeros elsewhere. Keeps x's dtype."""
    N, lb, offs = plan.devices, plan.latent_block, plan.latent_offsets
    x = np.moveaxis(np.asarray(x), axis, -1)
    per = x.shape[-1] // N
    out = np.zeros(x.shape[:-1] + (N * lb,), x.dtype)
    for j in range(N):
        out[..., j * lb + offs[j]:j * lb + offs[j] + per] = x[..., j * per:(j + 1) * per]
    return np.moveaxis(out, -1, axis)


def pack_weights(plan: Plan, params: dict, rank: int = 0, device=None, *, stream: bool | None = None) -> dict:
    """Lay rank `rank`'s share of the parameters out for the kernel. Returns jax arrays on `device`
    (default: where JAX puts them):
        tiles    [dense_tiles, tile_k, tile_n]                  bf16  every dense tile in stream order
        vectors  [L + 1, rows, width]                           f32   per-layer vector table (+ globals)
    and the routed experts, each local expert's [w1|w3] then w2 tiles, in `plan.experts` format:
        experts        [n_moe, E_local, expert_tiles, tile_k, tile_n]       bf16   ("bf16")
        expert_codes   [n_moe, E_local, expert_tiles, tile_k / 8, tile_n]   int32  ("mxfp4": E2M1 codes,
        expert_scales  [n_moe, E_local, expert_tiles, tile_k / 128, tile_n] int32   E8M0 scales; see
                                                                                   `pack_mxfp4_tiles`)
    MXFP4 experts come from `mk.io.checkpoint.load(..., experts="mxfp4")`'s tree (or
    `mk.model.params.init_fast(..., "mxfp4")`) and stay packed; bf16 experts may come from either
    tree (MXFP4 ones are dequantized).
    `params` is the whole model (mk.model.params layout); `mk.model.sharding.local_params` cuts the share.

    stream (default: when `params` holds anything but arrays, e.g. `Checkpoint.lazy_params`): read
    and pack piece by piece (`pack_pieces`), each piece written in place into arrays allocated on
    the device once, so the host holds one piece at a time. Otherwise the share is packed by one
    jitted program (`_pack_share`) on the device (where `params` already lives, nothing crosses
    the host). Both run the same layout functions: the same bits."""
    if stream is None:
        stream = not all(isinstance(x, (np.ndarray, jax.Array)) for x in jax.tree_util.tree_leaves(params))
    _check_rank(plan, rank)
    if stream:
        return _pack_streamed(plan, params, rank, device)
    params = {k: v for k, v in params.items() if k != "embed"}        # the kernel's embedding: whole, not packed
    if not plan.layout.single:
        from mk.model.sharding import local_params
        params = local_params(params, plan.layout, rank)
    params = jax.device_put(params, device)          # once (numpy leaves: not again for every program)
    out, bad = _pack_share(plan, rank, params)
    if bool(bad):                                   # name the tensor and index, as the pieces do
        for piece in _pieces(plan, rank):
            _check_piece(plan, piece, piece.read(params))
        raise AssertionError("the packer flagged an MXFP4 scale byte that no piece's check finds")
    return out


def _check_rank(plan: Plan, rank: int):
    if not 0 <= rank < plan.devices:
        raise PlanError(f"rank {rank} outside the plan's {plan.devices} devices")


def pack_key(plan: Plan) -> tuple:
    """What `pack_weights` reads from a plan besides the params: equal keys, equal packs."""
    return (plan.config, plan.layout, plan.tile_k, plan.tile_n, plan.streams, plan.expert_gu, plan.expert_down,
            plan.vector_width, plan.latent_offsets, plan.dense_tiles, plan.experts, plan.mxfp4_unpack)


class _Packing:
    """A plan as the packer's programs' static argument: equal when their `pack_key`s are (plans that
    differ in batch, context or schedule share one program)."""
    __slots__ = ("plan", "key", "_hash")

    def __init__(self, plan: Plan):
        self.plan, self.key = plan, pack_key(plan)
        self._hash = hash(self.key)

    def __hash__(self):
        return self._hash

    def __eq__(self, other):
        return isinstance(other, _Packing) and (self is other or self.key == other.key)


def _pack_share(plan: Plan, rank: int, share: dict):
    """Rank `rank`'s packed arrays from its share of the parameters (arrays, `embed` left out, on
    the device that packs): each group of pieces (one stream layer's dense matrices, the vector
    table, one MoE layer's experts) laid out and written in place by one dispatch (`_pack_group`;
    the parameters passed by reference, the packed arrays donated), so the device holds the
    parameters, the packed arrays and one group's blocks at a time. The first dispatch allocates
    the packed arrays (zeros) inside its program; every MoE layer runs one program, the layer an
    argument (`_program_group`). Also returns whether any MXFP4 scale byte is one the kernel cannot
    unpack exactly (`_bad_scales`; the caller names it)."""
    key = _Packing(plan)
    out, bad = None, []
    for g in dict.fromkeys(p.group for p in _pieces(plan, rank)):
        program, layer = _program_group(g)
        out, flag = _pack_group_program(key, rank, program)(share, out, layer)
        bad.append(flag)
    return out, any(bool(b) for b in bad)


def _program_group(group) -> tuple:
    """(the group `_pack_group` traces, the layer it is given): MoE layer i's pieces are layer 0's
    read from and written to layer i (`("moe",)`, i), so every MoE layer shares one program; other
    groups are their own (layer 0, unused)."""
    if group[0] == "moe":
        return ("moe",), np.int32(group[1])
    return group, np.int32(0)


@functools.lru_cache(maxsize=64)
def _group_pieces(key: "_Packing", rank: int) -> dict:
    groups: dict = {}
    for p in _pieces(key.plan, rank):
        groups.setdefault(p.group, []).append(p)
    return groups


@functools.lru_cache(maxsize=64)
def _pack_group_program(key: "_Packing", rank: int, group):
    """`_pack_group` for (key, rank, group) as a `Program` (kept across runs), `out` donated."""
    from mk.model.compile_cache import Program
    return Program(functools.partial(_pack_group, key, rank, group), name="pack_group",
                   identity=repr((key.key, rank, group)), donate_argnums=(1,))


def _pack_group(key: "_Packing", rank: int, group, share: dict, out: dict | None, layer):
    """`out` (donated: written in place; None: allocated here, zeros) with the blocks of group
    `group`'s pieces at their places; group ("moe",): MoE layer `layer`'s (traced), laid out as
    layer 0's pieces are."""
    from mk.kernel.aot import kernel_weight_shapes
    plan = key.plan
    if out is None:
        out = {k: jnp.zeros(shape, dtype) for k, (shape, dtype) in kernel_weight_shapes(plan).items() if k != "embed"}
    moe = group == ("moe",)
    bad = jnp.zeros((), bool)
    for piece in _group_pieces(key, rank)[("moe", 0) if moe else group]:
        arrays = piece.read(share, layer=layer) if moe else piece.read(share)
        bad |= _bad_scales(plan, piece, arrays)
        for (name, start), block in zip(piece.outs, _lay(plan, piece.lay, *arrays)):
            if moe:                                  # layer 0's start, at layer `layer`
                start = (layer, *start[1:])
            out[name] = jax.lax.dynamic_update_slice(out[name], block, start)
    return out, bad


def _pack_streamed(plan: Plan, params: dict, rank: int, device) -> dict:
    """`pack_weights` piece by piece: each array allocated on the device once, then filled as pieces
    are packed (a donated `dynamic_update_slice`); the piece is freed before the next is read."""
    from mk.kernel.aot import kernel_weight_shapes
    out = {k: jnp.zeros(shape, dtype, device=device)
           for k, (shape, dtype) in kernel_weight_shapes(plan).items() if k != "embed"}
    for name, start, block in pack_pieces(plan, params, rank, device):
        out[name] = jax.block_until_ready(_fill(out[name], block, start))
    return out


@functools.partial(jax.jit, donate_argnums=0)
def _fill(array, piece, start):
    """`array` with `piece` written at index `start` (a tuple of ints), in place (`array` is donated)."""
    return jax.lax.dynamic_update_slice(array, piece, start)


def piece_index(start, shape) -> tuple[slice, ...]:
    """The slices of the array a `pack_pieces` block fills: [start[i], start[i] + shape[i]) per axis."""
    return tuple(slice(a, a + n) for a, n in zip(start, shape))


def pack_pieces(plan: Plan, params: dict, rank: int = 0, device=None):
    """`pack_weights`'s arrays for rank `rank`, as pieces in the order they are packed: yields
    (name, start, block), `block` a jax array (on `device`) of the array's rank that goes at index
    `start` (one int per axis; `piece_index`, or `lax.dynamic_update_slice`). A piece is one dense
    matrix's tiles [n, tile_k, tile_n], the vector table, or one chunk of one MoE layer's experts
    (about EXPERT_CHUNK_BYTES of [K, N] codes or bf16 weights; [1, n, tiles, rows, tile_n], the
    [w1|w3] and the w2 tiles apart). Only one piece and the parameters it is cut from (read
    expert chunk by expert chunk from a `lazy_params` tree) are held at a time. Each piece is
    read on the host and laid out by `_lay` jitted (one program per piece shape)."""
    _check_rank(plan, rank)
    if not plan.layout.single:
        from mk.model.sharding import local_params
        params = local_params(params, plan.layout, rank)
    for piece in _pieces(plan, rank):
        arrays = jax.tree_util.tree_map(_host_or_device, piece.read(params))
        _check_piece(plan, piece, arrays)
        blocks = _lay_jit(_Packing(plan), piece.lay, *jax.device_put(arrays, device))
        for (name, start), block in zip(piece.outs, blocks):
            yield name, start, block


def _host_or_device(x):
    """An array as it is (jax or numpy), anything else (a whole `LazyLeaf`) read into numpy."""
    return x if isinstance(x, (np.ndarray, jax.Array)) else np.asarray(x)


class _Piece:
    """One piece of a share: `outs` ((name, start) of each block it makes), `read(params)` -> the
    arrays it is cut from (indexing only: jax, numpy and lazy trees alike), `lay` the static key
    of its layout function (`_lay`), `what` for error messages: (tensor, index of the first slot)."""
    __slots__ = ("outs", "read", "lay", "what", "group")

    def __init__(self, outs, read, lay, what=None, group=None):
        self.outs, self.read, self.lay, self.what, self.group = outs, read, lay, what, group


def _pieces(plan: Plan, rank: int) -> list[_Piece]:
    """Every piece of rank `rank`'s share, in packing order (static: from the plan alone)."""
    cfg = plan.config
    off, at, out = plan.latent_offsets[rank], 0, []
    tiles_of = lambda m: (m.k_pad // plan.tile_k) * (m.n_pad // plan.tile_n)
    for g, s in enumerate(plan.streams):
        for m in s.pre + s.post:
            out.append(_Piece(((("tiles", (at, 0, 0)),)),
                              functools.partial(_dense_sources, cfg=cfg, m=m, layer=s.layer), ("dense", m, off),
                              group=("stream", g)))
            at += tiles_of(m)
    assert at == plan.dense_tiles, (at, plan.dense_tiles)
    out.append(_Piece((("vectors", (0, 0, 0)),), _vector_sources, ("vectors", off), group=("vectors",)))
    mx = plan.experts == "mxfp4"
    gu_tiles = plan.expert_gu.tiles
    for i in range(cfg.n_moe):
        for ex in _expert_chunks(plan, 1 if mx else BF16.itemsize):
            for part, keys, t0 in (("gu", ("w1", "w3"), 0), ("dn", ("w2",), gu_tiles)):
                read = functools.partial(_expert_sources, keys=keys, layer=i, ex=ex, mxfp4=mx)
                if mx:
                    outs = (("expert_codes", (i, ex.start, t0, 0, 0)), ("expert_scales", (i, ex.start, t0, 0, 0)))
                    out.append(_Piece(outs, read, ("mxfp4", part), (keys, i, ex.start), ("moe", i)))
                else:
                    out.append(_Piece((("experts", (i, ex.start, t0, 0, 0)),), read, ("bf16", part), (keys, i, ex.start),
                                      ("moe", i)))
    return out


def _lay(plan: Plan, key: tuple, *arrays) -> tuple:
    """The blocks of a piece whose layout is `key` (`_pieces`), from its arrays (jnp: traced inside
    `_pack_share`, jitted per piece by `_lay_jit`)."""
    kind = key[0]
    if kind == "dense":
        _, m, off = key
        return (tile_matrix(_dense_matrix(arrays, plan.config, m, off), plan.tile_k, plan.tile_n),)
    if kind == "vectors":
        return (_vector_table(plan, key[1], arrays[0]),)
    if kind == "bf16":
        return (_bf16_expert_tiles(plan, key[1], arrays)[None],)
    codes, scales = _mxfp4_expert_tiles(plan, key[1], arrays)
    return codes[None], scales[None]


_lay_jit = jax.jit(lambda packing, key, *arrays: _lay(packing.plan, key, *arrays), static_argnums=(0, 1))


def _expert_chunks(plan: Plan, elem_bytes: int) -> list[slice]:
    """Local experts in chunks of about EXPERT_CHUNK_BYTES of one [K, N] matrix each (elements of
    `elem_bytes` bytes), the larger of the gate/up and down matrices."""
    gu, dn, E = plan.expert_gu, plan.expert_down, plan.local_experts
    n = max(1, EXPERT_CHUNK_BYTES // (max(gu.k_pad * gu.n_pad, dn.k_pad * dn.n_pad) * elem_bytes))
    return [slice(e, min(E, e + n)) for e in range(0, E, n)]


def _expert_sources(params: dict, keys, layer: int, ex: slice, mxfp4: bool) -> tuple:
    """params["moe"][key][layer, ex] for each key: [n, K, N] weights, or with MXFP4 leaves the
    (packed, scale) pair (u8, checkpoint orientation [n, N, K/2], [n, N, K/32]) flattened in."""
    out = []
    for k in keys:
        w = params["moe"][k]
        if isinstance(w, dict):
            out += [w["packed"][layer, ex], w["scale"][layer, ex]]
        elif mxfp4:
            raise PlanError(f"experts='mxfp4' needs the routed experts as MXFP4 (moe.{k} = {{'packed', "
                            f"'scale'}}, mk.io.checkpoint.load(..., experts='mxfp4')); moe.{k} is a "
                            f"{np.dtype(w.dtype)} array")
        else:
            out.append(w[layer, ex])
    return tuple(out)


def _latent_blocks(plan: Plan):
    """(dst, src) lanes of each rank's latent slice: rank j's slice (latent / devices features from
    j * per) lands at lane latent_offsets[j] of block j."""
    per = plan.config.latent // plan.devices
    return per, [(j * plan.latent_block + plan.latent_offsets[j], j * per) for j in range(plan.devices)]


def _bf16_expert_tiles(plan: Plan, part: str, arrays: tuple):
    """One chunk's [w1|w3] ("gu") or w2 ("dn") tiles [n, tiles, tile_k, tile_n] bf16 from its
    `_expert_sources` (bf16 [n, K, N], or MXFP4 pairs, dequantized as `mk.io.convert` does)."""
    cfg = plan.config
    fe = cfg.expert_hidden // plan.layout.tp_expert
    per, blocks = _latent_blocks(plan)
    if len(arrays) in (2, 4) and jnp.asarray(arrays[0]).dtype == jnp.uint8:          # MXFP4 leaves
        arrays = tuple(_dequantize_kn(arrays[j], arrays[j + 1]) for j in range(0, len(arrays), 2))
    ws = [_bf16(w) for w in arrays]
    n = ws[0].shape[0]
    if part == "gu":
        gu = plan.expert_gu
        a = jnp.zeros((n, gu.k_pad, gu.n_pad), jnp.bfloat16)
        for dst, src in blocks:                                             # latent rank blocks
            for key, w in zip(("w1", "w3"), ws):                            # [n, latent, fe]
                o = gu.part(key).offset
                a = a.at[:, dst:dst + per, o:o + fe].set(w[:, src:src + per])
    else:
        dn = plan.expert_down
        a = jnp.zeros((n, dn.k_pad, dn.n_pad), jnp.bfloat16)
        for dst, src in blocks:
            a = a.at[:, :fe, dst:dst + per].set(ws[0][:, :, src:src + per])   # [n, fe, latent]
    return tile_matrix(a, plan.tile_k, plan.tile_n)


def _dequantize_kn(packed, scale):
    """MXFP4 u8 [..., N, K/2], [..., N, K/32] -> bf16 [..., K, N]: `mk.io.convert.dequantize_mxfp4`'s
    bits (its table, looked up per packed byte on the device). Scale bytes 0 and 255 are refused
    before (`_check_piece`, or `_bad_scales` in one program)."""
    from mk.io.convert import _pair_lut
    packed, scale = jnp.asarray(packed, jnp.uint8), jnp.asarray(scale, jnp.uint8)
    idx = jnp.repeat(scale.astype(jnp.int32) << 8, MX_GROUP // 2, axis=-1) | packed.astype(jnp.int32)
    v = jnp.take(jnp.asarray(_pair_lut()), idx, mode="clip")                 # u32: element 2j low
    w = jnp.stack([v & 0xFFFF, v >> 16], axis=-1).astype(jnp.uint16).reshape(*packed.shape[:-1], -1)
    return jnp.swapaxes(jax.lax.bitcast_convert_type(w, jnp.bfloat16), -1, -2)


def _check_piece(plan: Plan, piece: _Piece, arrays: tuple):
    """On the host: refuse a piece's MXFP4 scale bytes the packing cannot take (the kernel's range
    for MXFP4 experts, `check_kernel_scales`; 0 and 255 for their bf16 dequantization), naming the
    tensor and index."""
    if piece.what is None or len(arrays) not in (2, 4) or np.dtype(arrays[0].dtype) != np.uint8:
        return
    keys, layer, first = piece.what
    for k, scale in zip(keys, arrays[1::2]):
        scale = np.asarray(scale, np.uint8)
        if piece.lay[0] == "mxfp4":
            check_kernel_scales(scale, f"moe.{k} (MoE layer {layer + 1})", first=(first, 0, 0))
        else:
            from mk.io.convert import bad_scale_position
            pos = bad_scale_position(scale)
            if pos is not None:
                raise ValueError(f"moe.{k} (MoE layer {layer + 1}): E8M0 scale byte {int(scale[pos])} at "
                                 f"{[first + pos[0], *pos[1:]]} (0 and 255 are invalid)")


def _bad_scales(plan: Plan, piece: _Piece, arrays: tuple):
    """`_check_piece`'s test as one traced bool (inside `_pack_share`, which cannot raise)."""
    if piece.what is None or len(arrays) not in (2, 4) or arrays[0].dtype != jnp.uint8:
        return jnp.zeros((), bool)
    lo, hi = KERNEL_SCALE_RANGE if piece.lay[0] == "mxfp4" else (1, 254)
    bad = [jnp.any((s < lo) | (s > hi)) for s in arrays[1::2]]
    return functools.reduce(jnp.logical_or, bad)


# ---- MXFP4 expert tiles -------------------------------------------------------------------------
# One [tile_k, tile_n] tile of an mxfp4 matrix (kernel orientation: rows = K, the contraction) is
#     codes  int32 [tile_k / 8, tile_n]:   bits 4j..4j+3 of word [i, n] = E2M1 code of row 8i + j
#     scales int32 [tile_k / 128, tile_n]: bits 8j..8j+7 of word [i, n] = E8M0 byte of row group j * tile_k / 128 + i
# (row group g = rows 32g .. 32g + 31). Codes are interleaved as `pltpu.bitcast` unpacks them (spec
# 2.3's kernel layout); scale byte j of the words covers a contiguous block of groups, unpacked
# with one shift and mask. Padding is code 0 (+0.0) with scale byte 127. The bits are the
# checkpoint's own; only their positions change.
MXFP4_PAD_SCALE = 127


def mxfp4_codes_kn(packed):
    """Checkpoint packed bytes u8 [..., N, K/2] (element 2j in the low nibble) -> codes u8 [..., K, N]."""
    packed = jnp.asarray(packed, jnp.uint8)
    codes = jnp.stack([packed & 15, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)   # [..., N, K]
    return jnp.swapaxes(codes, -1, -2)


# `Plan.mxfp4_unpack` -> the code word layout it reads ('pairs_mul' builds the 'pairs' values with
# other ops, from the same words)
UNPACK_LAYOUT = {"pairs": "pairs", "pairs_mul": "pairs", "shift": "shift", "bitcast": "bitcast"}
UNPACKS = tuple(UNPACK_LAYOUT)
LAYOUTS = tuple(dict.fromkeys(UNPACK_LAYOUT.values()))


def pack_mxfp4_tiles(codes, scales, tk: int, tn: int, unpack: str = "bitcast"):
    """codes u8 [..., k_pad, n_pad] (values 0..15), scales u8 [..., k_pad / 32, n_pad] -> the
    stream-ordered tiles: (codes int32 [..., T, tk / 8, tn], scales int32 [..., T, tk / 128, tn])
    (jax arrays; jnp, traced inside the packer's programs).

    Code words, by how the kernel unpacks them (`Plan.mxfp4_unpack`): 'bitcast': word w holds tile
    rows 8w .. 8w + 7 of a column, row 8w + j in bits 4j .. 4j + 3 (spec 2.3's kernel layout, the
    order in which `pltpu.bitcast` unpacks an int32 [r, n] into E2M1 [8r, n]); 'shift': planes, row
    j * tk / 8 + w in bits 4j .. 4j + 3 (a shift by 4j gives rows j * tk / 8 .. as one block);
    'pairs': bf16 pairs, rows j * tk / 4 + 2w (+ 1) in bits 4j .. (16 + 4j ..), codes re-encoded by
    `pairs_nibble` (a shift by 4j puts the two codes of rows j * tk / 4 + 2w, + 1 at bits 0 and 16).
    Scale byte j of word w is row-group block j (group j * tk / 128 + w). 'pairs_mul' reads the
    'pairs' words (`UNPACK_LAYOUT`)."""
    if unpack not in UNPACKS:
        raise PlanError(f"unpack must be one of {UNPACKS}, found {unpack!r}")
    unpack = UNPACK_LAYOUT[unpack]
    codes, scales = jnp.asarray(codes, jnp.uint8), jnp.asarray(scales, jnp.uint8)
    *lead, kp, npad = codes.shape
    kt, nt = kp // tk, npad // tn

    def tiles(x, rows):                     # [..., kt * rows, nt * tn] -> [..., nt * kt, rows, tn]
        x = x.reshape(*lead, kt, rows, nt, tn)
        x = jnp.moveaxis(x, -2, -4)         # [..., nt, kt, rows, tn]
        return x.reshape(*lead, nt * kt, rows, tn)

    def words(x, per, bits, order):         # [..., T, per * r, tn] -> [..., T, r, tn] int32
        r = x.shape[-2] // per
        if order == "bitcast":              # part j of word w: row per * w + j
            x = jnp.moveaxis(x.reshape(*x.shape[:-2], r, per, tn), -2, -3)
        elif order == "pairs":              # part j + 4h of word w: row j * 2r + 2w + h
            x = x.reshape(*x.shape[:-2], per // 2, r, 2, tn)
            x = jnp.moveaxis(x, -2, -4).reshape(*x.shape[:-4], per, r, tn)
        else:                               # part j of word w: row j * r + w
            x = x.reshape(*x.shape[:-2], per, r, tn)
        w = jnp.zeros(x.shape[:-3] + x.shape[-2:], jnp.uint32)
        for j in range(per):
            w = w | (x[..., j, :, :].astype(jnp.uint32) << jnp.uint32(bits * j))
        return jax.lax.bitcast_convert_type(w, jnp.int32)

    codes = pairs_nibble(codes) if unpack == "pairs" else codes
    return (words(tiles(codes, tk), CODES_PER_WORD, 4, unpack),
            words(tiles(scales, tk // MX_GROUP), SCALES_PER_WORD, 8, "shift"))


def pairs_nibble(codes):
    """E2M1 codes u8 -> the 'pairs' unpack's nibbles: sign | k, where the magnitude codes 0 (zero) and 1
    (0.5) trade places, so that every nonzero magnitude's bf16 bits are linear in k
    (`mk.kernel.ring.pair_bits`). Its own inverse. (numpy in, numpy out; jax in, jax out.)"""
    xp = np if isinstance(codes, (np.ndarray, np.generic, list, tuple)) else jnp
    codes = xp.asarray(codes, xp.uint8)
    return codes ^ ((codes & 6) == 0).astype(xp.uint8)


def check_kernel_scales(scale: np.ndarray, what: str, first=None):
    """Refuse E8M0 bytes outside KERNEL_SCALE_RANGE (see there), naming the tensor and index (`first`:
    the index of `scale`'s first element in that tensor, where `scale` is a part of it)."""
    lo, hi = KERNEL_SCALE_RANGE
    s = np.asarray(scale, np.uint8)
    bad = (s < lo) | (s > hi)
    if bad.any():
        at = np.argwhere(bad)[0]
        pos = [int(x) + int(f) for x, f in zip(at, first or (0,) * s.ndim)]
        raise PlanError(f"{what}: E8M0 scale byte {int(s[tuple(at)])} at {pos} is outside {lo}..{hi}, "
                        f"where every E2M1 value times the scale is a normal, finite bf16 number; the "
                        f"kernel's in-register unpack would not be exact (use experts='bf16')")


def _mxfp4_expert_tiles(plan: Plan, part: str, arrays: tuple):
    """One chunk's [w1|w3] ("gu") or w2 ("dn") MXFP4 experts (`_expert_sources`: (packed, scale)
    pairs in checkpoint orientation) -> (codes, scales) int32 [n, tiles, rows, tile_n], never
    expanded to bf16. Padding: code 0, scale byte MXFP4_PAD_SCALE."""
    cfg = plan.config
    tk, tn = plan.tile_k, plan.tile_n
    fe = cfg.expert_hidden // plan.layout.tp_expert
    N, lb, per, offs = plan.devices, plan.latent_block, cfg.latent // plan.devices, plan.latent_offsets
    g_lb = lb // MX_GROUP
    # rank j's slice lands at lane offs[j] of block j: padded group j * g_lb + q holds rows of the
    # one source group (j * per - offs[j]) / 32 + q (and zeros), so it takes that group's scale
    blocks = [(j * lb + offs[j], j * per, j * g_lb, (j * per - offs[j]) // MX_GROUP,
               -(-(offs[j] + per) // MX_GROUP)) for j in range(N)]
    pairs = [(jnp.asarray(arrays[j], jnp.uint8), jnp.asarray(arrays[j + 1], jnp.uint8))
             for j in range(0, len(arrays), 2)]
    n = pairs[0][0].shape[0]
    if part == "gu":
        gu = plan.expert_gu
        a = jnp.zeros((n, gu.k_pad, gu.n_pad), jnp.uint8)                     # [n, K, N] codes
        sa = jnp.full((n, gu.k_pad // MX_GROUP, gu.n_pad), MXFP4_PAD_SCALE, jnp.uint8)
        for key, (packed, scale) in zip(("w1", "w3"), pairs):
            c = mxfp4_codes_kn(packed)                                         # [n, latent, fe]
            sc = jnp.swapaxes(scale, -1, -2)                                   # [n, latent/32, fe]
            off = gu.part(key).offset
            for dst, src, gdst, gsrc, ng in blocks:                           # latent rank blocks
                a = a.at[:, dst:dst + per, off:off + fe].set(c[:, src:src + per])
                sa = sa.at[:, gdst:gdst + ng, off:off + fe].set(sc[:, gsrc:gsrc + ng])
    else:
        dn = plan.expert_down
        a = jnp.zeros((n, dn.k_pad, dn.n_pad), jnp.uint8)
        sa = jnp.full((n, dn.k_pad // MX_GROUP, dn.n_pad), MXFP4_PAD_SCALE, jnp.uint8)
        packed, scale = pairs[0]
        c = mxfp4_codes_kn(packed)                                             # [n, fe, latent]
        sc = jnp.swapaxes(scale, -1, -2)                                       # [n, fe/32, latent]
        for dst, src, *_ in blocks:
            a = a.at[:, :fe, dst:dst + per].set(c[:, :, src:src + per])
            sa = sa.at[:, :fe // MX_GROUP, dst:dst + per].set(sc[:, :, src:src + per])
    return pack_mxfp4_tiles(a, sa, tk, tn, plan.mxfp4_unpack)


_VECTOR_KEYS = (("layer", ("attn_res", "mlp_res", "attn_norm", "ffn_norm")), ("mla", ("q_a_norm", "kv_a_norm")),
                ("kda", ("conv", "a_log", "dt_bias", "o_norm")), ("moe", ("router_bias", "latent_norm")))


def _vector_sources(params: dict) -> tuple:
    """The leaves the vector table is cut from (whole: small), as one dict."""
    src = {f"{fam}.{k}": params[fam][k] for fam, keys in _VECTOR_KEYS for k in keys if k in params.get(fam, {})}
    src["output_res"], src["final_norm"] = params["output_res"], params["final_norm"]
    return ({k: v if isinstance(v, (np.ndarray, jax.Array)) else np.asarray(v) for k, v in src.items()},)


def _vector_table(plan: Plan, latent_offset: int, src: dict):
    """The per-layer vector table [L + 1, rows, width] f32 from `_vector_sources` (a share's): each
    row gathered at once for every layer from the leaves stacked over their layers (a row a layer
    has not is zero)."""
    cfg = plan.config
    rows, width, L = vector_rows(cfg), plan.vector_width, cfg.layers
    entries: dict[str, list] = {name: [] for name in rows}

    def add(name, leaf, mapping, at=0):     # leaf [n, ...]: its row mapping[l] goes to layer l's row `name`
        if mapping:
            leaf = jnp.asarray(leaf).astype(jnp.float32)
            entries[name].append((leaf.reshape(leaf.shape[0], -1), mapping, at))

    every = {l: l for l in range(L)}
    for key in ("attn_res", "mlp_res", "attn_norm", "ffn_norm"):
        add(key, src[f"layer.{key}"], every)
    mla = {l: cfg.family_index(l) for l in range(L) if cfg.is_mla(l)}
    kda = {l: cfg.family_index(l) for l in range(L) if not cfg.is_mla(l)}
    add("q_a_norm", src.get("mla.q_a_norm"), mla)
    add("kv_a_norm", src.get("mla.kv_a_norm"), mla)
    if kda:
        conv = jnp.asarray(src["kda.conv"]).astype(jnp.float32)                 # [n, 3, C, HD]
        for j in range(3):
            for t in range(cfg.conv_size):
                add(f"conv{j}_{t}", conv[:, j, t], kda)
        add("a_log", jnp.repeat(jnp.asarray(src["kda.a_log"]).astype(jnp.float32), cfg.head_dim, axis=-1), kda)
        add("dt_bias", src["kda.dt_bias"], kda)
        add("o_norm", src["kda.o_norm"], kda)
    moe = {l: l - 1 for l in range(1, L)}
    add("router_bias", src["moe.router_bias"], moe)
    add("latent_norm", src["moe.latent_norm"], moe, latent_offset)
    add("attn_res", jnp.asarray(src["output_res"])[None], {L: 0})      # globals live in row set L
    add("attn_norm", jnp.asarray(src["final_norm"])[None], {L: 0})
    cols = []
    for name, _ in sorted(rows.items(), key=lambda kv: kv[1]):
        parts, idx, base = [], [None] * (L + 1), 0
        for leaf, mapping, at in entries[name]:
            parts.append(jnp.pad(leaf, ((0, 0), (at, width - at - leaf.shape[1]))))
            for l, i in mapping.items():
                idx[l] = base + i
            base += leaf.shape[0]
        parts.append(jnp.zeros((1, width), jnp.float32))
        stacked = jnp.concatenate(parts) if len(parts) > 1 else parts[0]
        cols.append(stacked[np.array([base if i is None else i for i in idx])])
    return jnp.stack(cols, axis=1)


def pack_vectors(plan: Plan, params: dict, rank: int = 0):
    """Rank's per-layer vector table [L + 1, rows, width] f32 (`params`: its share)."""
    return _vector_table(plan, plan.latent_offsets[rank], *_vector_sources(params))
