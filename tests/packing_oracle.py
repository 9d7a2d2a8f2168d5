"""Laying the weights out in stream order: host side, once per plan.

`pack_weights(plan, params, rank)` cuts rank `rank`'s share of the parameters (`mk.model.sharding`)
and lays it out as the kernel reads it: every dense tile in `mk.kernel.plan`'s stream order, the
per-layer vector tables, and the routed experts in the plan's format (bf16 tiles, or MXFP4 codes and
scales packed into int32 words, `pack_mxfp4_tiles`). The plan describes the layout; this module
writes it, reading the parameters from `mk.model.params` or a checkpoint (`mk.io.checkpoint`).
"""
from __future__ import annotations

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


def _dense_matrix(params: dict, cfg: K3Config, m: Matrix, layer: int, latent_offset: int = 0) -> np.ndarray:
    """The [k_pad, n_pad] bf16 matrix `m` of `layer`, fused and zero padded (bf16 throughout: the
    values are copied, never widened). `latent_offset`: this rank's `latent_offsets` entry;
    latent_down's columns and latent_up's rows start that many lanes into their block."""
    out = np.zeros((m.k_pad, m.n_pad), BF16)
    row = latent_offset if m.name == "moe.latent_up" else 0
    for p in m.parts:
        fam, key = p.source
        if fam == "lm_head":
            w = params["lm_head"]
        elif fam == "dense":
            w = params["dense"][key]
        else:
            idx = layer - 1 if fam == "moe" else cfg.family_index(layer)
            w = params[fam][key][idx]
        w = _bf16(w)
        col = p.offset + (latent_offset if p.source == ("moe", "latent_down") else 0)
        if p.head_pad:                      # h heads of src lanes, each in a dst-lane slot
            h, src, dst = p.head_pad
            for j in range(h):
                out[row:row + w.shape[0], col + j * dst:col + j * dst + src] = w[:, j * src:(j + 1) * src]
        else:
            out[row:row + w.shape[0], col:col + w.shape[1]] = w
    return out


def _bf16(w) -> np.ndarray:
    """A host bf16 view of `w` (a jax or numpy array): a copy off the device, no widening."""
    w = np.asarray(w)
    return w if w.dtype == BF16 else w.astype(BF16)


def tile_matrix(w: np.ndarray, tk: int, tn: int) -> np.ndarray:
    """[..., k_pad, n_pad] -> [..., n_tiles * k_tiles, tk, tn], column block major (the stream order)."""
    *lead, k, n = w.shape
    kt, nt = k // tk, n // tn
    t = np.moveaxis(w.reshape(*lead, kt, tk, nt, tn), -2, -4)      # [..., nt, kt, tk, tn]
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


def pack_weights(plan: Plan, params: dict, rank: int = 0) -> dict:
    """Lay rank `rank`'s share of the parameters out for the kernel. Returns numpy arrays:
        tiles    [dense_tiles, tile_k, tile_n]                  bf16  every dense tile in stream order
        vectors  [L + 1, rows, width]                           f32   per-layer vector table (+ globals)
    and the routed experts, each local expert's [w1|w3] then w2 tiles, in `plan.experts` format:
        experts        [n_moe, E_local, expert_tiles, tile_k, tile_n]       bf16   ("bf16")
        expert_codes   [n_moe, E_local, expert_tiles, tile_k / 8, tile_n]   int32  ("mxfp4": E2M1 codes,
        expert_scales  [n_moe, E_local, expert_tiles, tile_k / 128, tile_n] int32   E8M0 scales; see
                                                                                   `pack_mxfp4_tiles`)
    MXFP4 experts come from `mk.io.checkpoint.load(..., experts="mxfp4")`'s tree and stay packed; bf16
    experts may come from either tree (MXFP4 ones are dequantized).
    `params` is the whole model (mk.model.params layout); `mk.model.sharding.local_params` cuts the share.
    The arrays are 64-byte aligned (`aligned_empty`: handed to JAX without a copy on CPU), filled from
    `pack_pieces`, which `mk.kernel.step.kernel_weights` streams to the device instead.
    """
    from mk.io.convert import aligned_empty
    from mk.kernel.aot import kernel_weight_shapes

    out = {k: aligned_empty(shape, dtype) for k, (shape, dtype) in kernel_weight_shapes(plan).items()
           if k != "embed"}
    for name, start, block in pack_pieces(plan, params, rank):
        out[name][piece_index(start, block.shape)] = block
    return out


def piece_index(start, shape) -> tuple[slice, ...]:
    """The slices of the array a `pack_pieces` block fills: [start[i], start[i] + shape[i]) per axis."""
    return tuple(slice(a, a + n) for a, n in zip(start, shape))


def pack_pieces(plan: Plan, params: dict, rank: int = 0):
    """`pack_weights`'s arrays for rank `rank`, as pieces in the order they are packed: yields
    (name, start, block), `block` a numpy array of the array's rank that goes at index `start`
    (one int per axis; `piece_index`, or `lax.dynamic_update_slice`). A piece is one dense
    matrix's tiles [n, tile_k, tile_n], the vector table, or one chunk of one MoE layer's experts
    (about EXPERT_CHUNK_BYTES of [K, N] codes or bf16 weights; [1, n, tiles, rows, tile_n], the
    [w1|w3] and the w2 tiles apart). Only one piece and the parameters it is cut from (read
    expert chunk by expert chunk from a `lazy_params` tree) are held at a time."""
    from mk.model.sharding import local_params

    cfg = plan.config
    if not 0 <= rank < plan.devices:
        raise PlanError(f"rank {rank} outside the plan's {plan.devices} devices")
    if not plan.layout.single:
        params = local_params(params, plan.layout, rank)
    off, at = plan.latent_offsets[rank], 0
    for s in plan.streams:
        for m in s.pre + s.post:
            t = tile_matrix(_dense_matrix(params, cfg, m, s.layer, off), plan.tile_k, plan.tile_n)
            yield "tiles", (at, 0, 0), t
            at += t.shape[0]
    assert at == plan.dense_tiles, (at, plan.dense_tiles)
    yield "vectors", (0, 0, 0), pack_vectors(plan, params, rank)
    yield from (_pack_mxfp4_experts if plan.experts == "mxfp4" else _pack_bf16_experts)(plan, params)


def _expert_chunks(plan: Plan, elem_bytes: int) -> list[slice]:
    """Local experts in chunks of about EXPERT_CHUNK_BYTES of one [K, N] matrix each (elements of
    `elem_bytes` bytes), the larger of the gate/up and down matrices."""
    gu, dn, E = plan.expert_gu, plan.expert_down, plan.local_experts
    n = max(1, EXPERT_CHUNK_BYTES // (max(gu.k_pad * gu.n_pad, dn.k_pad * dn.n_pad) * elem_bytes))
    return [slice(e, min(E, e + n)) for e in range(0, E, n)]


def _pack_bf16_experts(plan: Plan, params: dict):
    """Rank's share of the routed experts (bf16 or MXFP4 leaves, already cut to this rank) ->
    `experts` pieces [1, n, tiles, tile_k, tile_n] bf16, chunk by chunk (`pack_pieces`)."""
    cfg = plan.config
    gu, dn = plan.expert_gu, plan.expert_down
    fe = cfg.expert_hidden // plan.layout.tp_expert
    tk, tn = plan.tile_k, plan.tile_n
    per = cfg.latent // plan.devices                     # rank j's latent slice, at lane offs[j] of block j
    blocks = [(j * plan.latent_block + plan.latent_offsets[j], j * per) for j in range(plan.devices)]
    for i in range(cfg.n_moe):
        for ex in _expert_chunks(plan, BF16.itemsize):
            w1, w3, w2 = (_expert_weights(params, k, i, ex) for k in ("w1", "w3", "w2"))   # [n, K, N]
            n = ex.stop - ex.start
            a = np.zeros((n, gu.k_pad, gu.n_pad), BF16)
            b = np.zeros((n, dn.k_pad, dn.n_pad), BF16)
            for dst, src in blocks:                                             # latent rank blocks
                for key, w in (("w1", w1), ("w3", w3)):                         # [n, latent, fe]
                    o = gu.part(key).offset
                    a[:, dst:dst + per, o:o + fe] = w[:, src:src + per]
                b[:, :fe, dst:dst + per] = w2[:, :, src:src + per]               # [n, fe, latent]
            yield "experts", (i, ex.start, 0, 0, 0), tile_matrix(a, tk, tn)[None]
            yield "experts", (i, ex.start, gu.tiles, 0, 0), tile_matrix(b, tk, tn)[None]


def _expert_weights(params: dict, key: str, layer: int, ex: slice) -> np.ndarray:
    """params["moe"][key][layer, ex] as bf16 [n, K, N] (MXFP4 leaves dequantized)."""
    w = params["moe"][key]
    if isinstance(w, dict):
        from mk.io.convert import dequantize_mxfp4
        return dequantize_mxfp4(np.asarray(w["packed"][layer, ex]), np.asarray(w["scale"][layer, ex]))
    return _bf16(w[layer, ex])


# ---- MXFP4 expert tiles -------------------------------------------------------------------------
# One [tile_k, tile_n] tile of an mxfp4 matrix (kernel orientation: rows = K, the contraction) is
#     codes  int32 [tile_k / 8, tile_n]:   bits 4j..4j+3 of word [i, n] = E2M1 code of row 8i + j
#     scales int32 [tile_k / 128, tile_n]: bits 8j..8j+7 of word [i, n] = E8M0 byte of row group j * tile_k / 128 + i
# (row group g = rows 32g .. 32g + 31). Codes are interleaved as `pltpu.bitcast` unpacks them (spec
# 2.3's kernel layout); scale byte j of the words covers a contiguous block of groups, unpacked
# with one shift and mask. Padding is code 0 (+0.0) with scale byte 127. The bits are the
# checkpoint's own; only their positions change.
MXFP4_PAD_SCALE = 127


def mxfp4_codes_kn(packed: np.ndarray) -> np.ndarray:
    """Checkpoint packed bytes u8 [..., N, K/2] (element 2j in the low nibble) -> codes u8 [..., K, N]."""
    packed = np.asarray(packed, np.uint8)
    codes = np.stack([packed & 15, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)   # [..., N, K]
    return np.swapaxes(codes, -1, -2)


# `Plan.mxfp4_unpack` -> the code word layout it reads ('pairs_mul' builds the 'pairs' values with
# other ops, from the same words)
UNPACK_LAYOUT = {"pairs": "pairs", "pairs_mul": "pairs", "shift": "shift", "bitcast": "bitcast"}
UNPACKS = tuple(UNPACK_LAYOUT)
LAYOUTS = tuple(dict.fromkeys(UNPACK_LAYOUT.values()))


def pack_mxfp4_tiles(codes: np.ndarray, scales: np.ndarray, tk: int, tn: int,
                     unpack: str = "bitcast") -> tuple[np.ndarray, np.ndarray]:
    """codes u8 [..., k_pad, n_pad] (values 0..15), scales u8 [..., k_pad / 32, n_pad] -> the
    stream-ordered tiles: (codes int32 [..., T, tk / 8, tn], scales int32 [..., T, tk / 128, tn]).

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
    *lead, kp, npad = codes.shape
    kt, nt = kp // tk, npad // tn

    def tiles(x, rows):                     # [..., kt * rows, nt * tn] -> [..., nt * kt, rows, tn]
        x = x.reshape(*lead, kt, rows, nt, tn)
        x = np.moveaxis(x, -2, -4)          # [..., nt, kt, rows, tn]
        return x.reshape(*lead, nt * kt, rows, tn)

    def words(x, per, bits, order):         # [..., T, per * r, tn] -> [..., T, r, tn] int32
        r = x.shape[-2] // per
        if order == "bitcast":              # part j of word w: row per * w + j
            x = np.moveaxis(x.reshape(*x.shape[:-2], r, per, tn), -2, -3)
        elif order == "pairs":              # part j + 4h of word w: row j * 2r + 2w + h
            x = x.reshape(*x.shape[:-2], per // 2, r, 2, tn)
            x = np.moveaxis(x, -2, -4).reshape(*x.shape[:-4], per, r, tn)
        else:                               # part j of word w: row j * r + w
            x = x.reshape(*x.shape[:-2], per, r, tn)
        w = np.zeros(x.shape[:-3] + x.shape[-2:], np.uint32)
        for j in range(per):                # widened one code plane at a time (bounded temporaries)
            w |= x[..., j, :, :].astype(np.uint32) << np.uint32(bits * j)
        return w.view(np.int32)

    codes = pairs_nibble(codes) if unpack == "pairs" else codes
    return (words(tiles(codes, tk), CODES_PER_WORD, 4, unpack),
            words(tiles(scales, tk // MX_GROUP), SCALES_PER_WORD, 8, "shift"))


def pairs_nibble(codes: np.ndarray) -> np.ndarray:
    """E2M1 codes u8 -> the 'pairs' unpack's nibbles: sign | k, where the magnitude codes 0 (zero) and 1
    (0.5) trade places, so that every nonzero magnitude's bf16 bits are linear in k
    (`mk.kernel.ring.pair_bits`). Its own inverse."""
    codes = np.asarray(codes, np.uint8)
    return codes ^ ((codes & 6) == 0).astype(np.uint8)


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


def _pack_mxfp4_experts(plan: Plan, params: dict):
    """Rank's share of the MXFP4 experts (params["moe"]["w1"/"w3"/"w2"] = {"packed", "scale"} in
    checkpoint orientation, already cut to this rank) -> `expert_codes` / `expert_scales` pieces
    [1, n, tiles, rows, tile_n] int32, chunk by chunk (`pack_pieces`), never expanded to bf16."""
    cfg = plan.config
    leaves = {k: params["moe"][k] for k in ("w1", "w3", "w2")}
    for k, w in leaves.items():
        if not isinstance(w, dict):
            raise PlanError(f"experts='mxfp4' needs the routed experts as MXFP4 (moe.{k} = {{'packed', "
                            f"'scale'}}, mk.io.checkpoint.load(..., experts='mxfp4')); moe.{k} is a "
                            f"{np.asarray(w).dtype} array")
    gu, dn = plan.expert_gu, plan.expert_down
    tk, tn = plan.tile_k, plan.tile_n
    fe = cfg.expert_hidden // plan.layout.tp_expert
    N, lb, per, offs = plan.devices, plan.latent_block, cfg.latent // plan.devices, plan.latent_offsets
    g_lb = lb // MX_GROUP
    # rank j's slice lands at lane offs[j] of block j: padded group j * g_lb + q holds rows of the
    # one source group (j * per - offs[j]) / 32 + q (and zeros), so it takes that group's scale
    blocks = [(j * lb + offs[j], j * per, j * g_lb, (j * per - offs[j]) // MX_GROUP,
               -(-(offs[j] + per) // MX_GROUP)) for j in range(N)]
    for i in range(cfg.n_moe):
        for ex in _expert_chunks(plan, 1):
            # this chunk's leaves: [n, N, K/2] packed, [n, N, K/32] scale (checkpoint orientation)
            chunk = {k: tuple(np.asarray(leaves[k][sub][i, ex], np.uint8) for sub in ("packed", "scale"))
                     for k in ("w1", "w3", "w2")}
            for k, (_, scale) in chunk.items():
                check_kernel_scales(scale, f"moe.{k} (MoE layer {i + 1})", first=(ex.start, 0, 0))
            n = ex.stop - ex.start
            a = np.zeros((n, gu.k_pad, gu.n_pad), np.uint8)                      # [n, K, N] codes
            sa = np.full((n, gu.k_pad // MX_GROUP, gu.n_pad), MXFP4_PAD_SCALE, np.uint8)
            for key in ("w1", "w3"):
                c = mxfp4_codes_kn(chunk[key][0])                                  # [n, latent, fe]
                sc = np.swapaxes(chunk[key][1], -1, -2)                            # [n, latent/32, fe]
                off = gu.part(key).offset
                for dst, src, gdst, gsrc, ng in blocks:                           # latent rank blocks
                    a[:, dst:dst + per, off:off + fe] = c[:, src:src + per]
                    sa[:, gdst:gdst + ng, off:off + fe] = sc[:, gsrc:gsrc + ng]
            b = np.zeros((n, dn.k_pad, dn.n_pad), np.uint8)
            sb = np.full((n, dn.k_pad // MX_GROUP, dn.n_pad), MXFP4_PAD_SCALE, np.uint8)
            c = mxfp4_codes_kn(chunk["w2"][0])                                     # [n, fe, latent]
            sc = np.swapaxes(chunk["w2"][1], -1, -2)                               # [n, fe/32, latent]
            for dst, src, *_ in blocks:
                b[:, :fe, dst:dst + per] = c[:, :, src:src + per]
                sb[:, :fe // MX_GROUP, dst:dst + per] = sc[:, :, src:src + per]
            for t0, (cm, sm) in ((0, (a, sa)), (gu.tiles, (b, sb))):
                codes, scales = pack_mxfp4_tiles(cm, sm, tk, tn, plan.mxfp4_unpack)
                yield "expert_codes", (i, ex.start, t0, 0, 0), codes[None]
                yield "expert_scales", (i, ex.start, t0, 0, 0), scales[None]


def pack_vectors(plan: Plan, params: dict, rank: int = 0) -> np.ndarray:
    """Rank's per-layer vector table [L + 1, rows, width] f32 (`params`: its share)."""
    cfg = plan.config
    rows = vector_rows(cfg)
    from mk.io.convert import aligned_empty

    v = aligned_empty((cfg.layers + 1, len(rows), plan.vector_width), np.float32)   # zero-copy hand-off to JAX
    v[...] = 0

    def put(l, name, x, at=0):
        x = np.asarray(x, np.float32).reshape(-1)
        v[l, rows[name], at:at + x.size] = x

    for l in range(cfg.layers):
        for key in ("attn_res", "mlp_res", "attn_norm", "ffn_norm"):
            put(l, key, params["layer"][key][l])
        i = cfg.family_index(l)
        if cfg.is_mla(l):
            put(l, "q_a_norm", params["mla"]["q_a_norm"][i])
            put(l, "kv_a_norm", params["mla"]["kv_a_norm"][i])
        else:
            k = params["kda"]
            conv = np.asarray(k["conv"][i], np.float32)          # [3, C, HD]
            for j in range(3):
                for t in range(cfg.conv_size):
                    put(l, f"conv{j}_{t}", conv[j, t])
            put(l, "a_log", np.repeat(np.asarray(k["a_log"][i], np.float32), cfg.head_dim))
            put(l, "dt_bias", k["dt_bias"][i])
            put(l, "o_norm", k["o_norm"][i])
        if l >= 1:
            put(l, "router_bias", params["moe"]["router_bias"][l - 1])
            put(l, "latent_norm", params["moe"]["latent_norm"][l - 1], plan.latent_offsets[rank])
    put(cfg.layers, "attn_res", params["output_res"])          # globals live in row set L
    put(cfg.layers, "attn_norm", params["final_norm"])
    return v
