"""MXFP4 routed experts in the kernel: packed bytes in the plan, the packing, the in-kernel unpack.

The end-to-end comparisons (kernel with MXFP4 experts == reference on the dequantized weights) run
inside the existing kernel tests: tests/test_kernel.py (mini, B = 1 and 8), tests/test_kernel_sharded.py
(mini-tp8 on 8 devices, B = 1 and 8) and tests/test_kernel_paths.py (weights from `mk synth`).
"""
import ml_dtypes
import numpy as np
import pytest

from mk.kernel import packing, plan as plan_mod
from mk.model.config import get_config
from mk.model.layout import PlanError
from mk.kernel.plan import make_plan
from mk.kernel.schedule import dmas, routed_expert_bytes_per_step, weight_bytes_per_step

# E2M1 is 4 bits plus one 8-bit E8M0 scale per 32 values: 4.25 bits per weight against bf16's 16.
PACKED_RATIO = 16 / (4 + 8 / 32)


def test_expert_bytes_drop_by_the_packed_ratio():
    """Plan (its DMA list), simulator (bytes it moves) and roofline count packed expert bytes."""
    from mk.perf import roofline, sim
    cfg = get_config("k3").replace(layers=3, full_attention=(2,))   # K3 widths, 896 experts; 3 layers
    lay = plan_mod.Layout()                     # one core's plan (VMEM not checked)
    bf16, mx = (make_plan(cfg, 1, layout=lay, experts=f, check=False) for f in ("bf16", "mxfp4"))
    assert routed_expert_bytes_per_step(bf16) / routed_expert_bytes_per_step(mx) == pytest.approx(PACKED_RATIO, rel=1e-12)
    assert PACKED_RATIO == pytest.approx(3.765, abs=1e-3)
    # the other weights are unchanged
    assert (weight_bytes_per_step(bf16) - routed_expert_bytes_per_step(bf16)
            == weight_bytes_per_step(mx) - routed_expert_bytes_per_step(mx))
    # the simulator replays the plan's DMAs: it moves exactly the plan's bytes
    r_bf16, r_mx = (sim.simulate(p, "tpu-v7x16") for p in (bf16, mx))
    assert r_bf16.bytes_moved - r_mx.bytes_moved == pytest.approx(
        weight_bytes_per_step(bf16) - weight_bytes_per_step(mx), rel=1e-9)
    # the roofline's per-expert bytes agree with the plan's (k3 expert tiles have no padding)
    rl_lay = roofline.as_layout(lay)
    for p, fmt in ((bf16, "bf16"), (mx, "mxfp4")):
        slice_bytes = roofline.expert_slice_bytes(cfg, rl_lay, roofline.WeightFormats(fmt, fmt, fmt))
        assert p.expert_bytes == pytest.approx(slice_bytes["total"], rel=1e-12), fmt
    # the mxfp4 pool is separate: its slots carry their own ids, after the bf16 ring's
    slots = {d.slot for d in dmas(mx) if d.tensor.startswith("expert[")}
    assert min(slots) >= mx.num_slots and {d.slot for d in dmas(mx) if not d.tensor.startswith("expert[")} <= set(range(mx.num_slots))


def test_mxfp4_buffers_and_checks():
    cfg = get_config("mini")
    p = make_plan(cfg, 1, experts="mxfp4")
    names = {b.name: b for b in p.buffers}
    assert names["code_slots"].shape == (p.num_slots, p.tile_k // 8, p.tile_n) and names["code_slots"].dtype == "int32"
    assert names["scale_slots"].shape == (p.num_slots, p.tile_k // 128, p.tile_n)
    assert "dequant" not in names       # unpacked in registers (mk.kernel.ring.mxfp4_tile_product)
    assert "code_slots" not in {b.name for b in make_plan(cfg, 1).buffers}
    with pytest.raises(PlanError, match="tile_k to be a multiple of 256"):
        make_plan(cfg, 1, experts="mxfp4", tile=(128, 128))
    with pytest.raises(PlanError, match="experts must be one of"):
        make_plan(cfg, 1, experts="fp8")


def _run_dequant(codes, scales, m, unpack="bitcast"):
    """The kernel's unpack (`unpack_values`) of [T] tiles, stored, in TPU interpret mode -> bf16 [T, tk, tn]."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu
    from mk.kernel.decode import interpret_params, on_tpu
    from mk.kernel.ring import group_exponents, unpack_values

    def kernel(c_ref, s_ref, o_ref):
        for t in range(codes.shape[0]):
            o_ref[t] = unpack_values(c_ref[t], group_exponents(s_ref.at[t]), unpack)

    vmem = pl.BlockSpec(memory_space=pltpu.VMEM)
    out = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((codes.shape[0], m.tile_k, m.tile_n), jnp.bfloat16),
                         in_specs=[vmem, vmem], out_specs=vmem,
                         interpret=False if on_tpu() else interpret_params(detect_races=True))(
        jnp.asarray(codes), jnp.asarray(scales))
    return np.asarray(out)


def _run_tile_product(x, codes, scales, unpack):
    """The kernel's `mxfp4_tile_product` (unpacked in registers, straight to the MXU) of x [R, tk] bf16
    and one packed tile, in TPU interpret mode (compiled on a TPU) -> f32 [R, tn]."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu
    from mk.kernel.decode import interpret_params, on_tpu
    from mk.kernel.ring import mxfp4_tile_product

    def kernel(x_ref, c_ref, s_ref, o_ref):
        o_ref[...] = mxfp4_tile_product(jnp.zeros(o_ref.shape, jnp.float32), x_ref[...], c_ref, s_ref, unpack,
                                        x_ref.shape[1])

    vmem = pl.BlockSpec(memory_space=pltpu.VMEM)
    out = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((x.shape[0], codes.shape[-1]), jnp.float32),
                         in_specs=[vmem] * 3, out_specs=vmem,
                         interpret=False if on_tpu() else interpret_params(detect_races=True))(
        jnp.asarray(x), jnp.asarray(codes), jnp.asarray(scales))
    return np.asarray(out)


def every_code_every_scale_tile(tk=512, tn=256, seed=0):
    """E2M1 codes u8 [tk, tn] holding every code in every column, E8M0 bytes u8 [tk / 32, tn] holding
    every byte the kernel accepts (`KERNEL_SCALE_RANGE`) under every code, and ml_dtypes' bf16
    dequantization of them [tk, tn] (the oracle)."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 16, (tk, tn), dtype=np.uint8)
    codes[:16, :] = np.arange(16, dtype=np.uint8)[:, None]              # every code in every column
    lo, hi = packing.KERNEL_SCALE_RANGE
    scales = rng.integers(lo, hi + 1, (tk // 32, tn), dtype=np.uint8)
    scales[0, :] = np.arange(tn) % (hi - lo + 1) + lo                   # every scale byte, group 0
    scales[1, :2] = (lo, hi)
    want = (codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
            * np.repeat(scales.view(ml_dtypes.float8_e8m0fnu).astype(np.float32), 32, axis=0)).astype(ml_dtypes.bfloat16)
    return codes, scales, want


@pytest.mark.parametrize("unpack", ["pairs", "pairs_mul", "shift", "bitcast"])
def test_in_kernel_dequant_bit_exact_against_ml_dtypes(unpack):
    """One expert tile holding every E2M1 code under every allowed E8M0 byte (2..252), unpacked by
    the kernel (integer shifts, every TPU; the fp4 bitcast, TPU v7), equals ml_dtypes'
    float4_e2m1fn x float8_e8m0fnu in bf16 bit for bit (signed zeros included), stored as a tile
    and as the kernel multiplies it (`mxfp4_tile_product`). In interpret mode on CPU; compiled on a TPU backend (`JAX_PLATFORMS=tpu,cpu pytest ...` on the chip)."""
    from mk.kernel.step import attached_chip
    from mk.kernel.decode import on_tpu
    if (on_tpu() and unpack == "bitcast"
            and make_plan(get_config("mini"), 1, chip=attached_chip(), experts="mxfp4").mxfp4_unpack != "bitcast"):
        pytest.skip(f"{unpack} unpack does not lower on {attached_chip()} (test_aot: fp4 bitcast is TPU v7's)")
    tk, tn = 512, 256
    m = plan_mod.Matrix("expert.down", tk, tn, (), tk, tn, "mxfp4")
    codes, scales, want = every_code_every_scale_tile(tk, tn)
    c, s = packing.pack_mxfp4_tiles(codes, scales, tk, tn, unpack)
    got = _run_dequant(c, s, m, unpack)[0]
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
    for other in set(packing.LAYOUTS) - {packing.UNPACK_LAYOUT[unpack]}:   # each layout is its own
        c2, s2 = packing.pack_mxfp4_tiles(codes, scales, tk, tn, other)
        assert not np.array_equal(_run_dequant(c2, s2, m, unpack)[0].view(np.uint16), want.view(np.uint16))
    # the kernel's own path: unpacked 128 columns at a time into the MXU; an identity LHS reads the tile
    # back exactly (one exact product per output, the rest zeros; signed zeros become +0). Also at
    # k3-chip's 512 x 512 tile (four column blocks)
    eye = np.eye(tk, dtype=ml_dtypes.bfloat16)
    np.testing.assert_array_equal(_run_tile_product(eye, c[0], s[0], unpack), want.astype(np.float32))
    codes, scales, want = every_code_every_scale_tile(tk, 512, seed=1)
    c, s = packing.pack_mxfp4_tiles(codes, scales, tk, 512, unpack)
    np.testing.assert_array_equal(_run_tile_product(eye, c[0], s[0], unpack), want.astype(np.float32))


def test_packed_expert_tiles_dequantize_to_the_bf16_tiles():
    """`pack_weights` on mini-tp8's rank 5 share (latent blocks, a tp slice of each expert): every
    tile of one packed expert, dequantized by the kernel, equals the bf16 tile that the bf16 format
    packs from `dequantize_mxfp4` of the same checkpoint bytes; padding dequantizes to +0."""
    from mk.io import synth
    from mk.model.sharding import default_layout
    cfg = get_config("mini-tp8")
    packed, _ = synth.mxfp4_params(cfg, 1)
    kw = dict(layout=default_layout(cfg, 8))
    mx = packing.pack_weights(make_plan(cfg, 1, experts="mxfp4", **kw), packed, rank=5)
    bf = packing.pack_weights(make_plan(cfg, 1, experts="bf16", **kw), packed, rank=5)
    m = make_plan(cfg, 1, experts="mxfp4", **kw).expert_gu
    assert mx["expert_codes"].nbytes + mx["expert_scales"].nbytes < bf["experts"].nbytes / 3.7
    layer, expert = 1, 2
    got = _run_dequant(mx["expert_codes"][layer, expert], mx["expert_scales"][layer, expert], m)
    np.testing.assert_array_equal(got.view(np.uint16), np.asarray(bf["experts"][layer, expert]).view(np.uint16))


def test_scale_bytes_the_kernel_cannot_dequantize_exactly_are_refused():
    from mk.io import synth
    cfg = get_config("mini")
    packed, _ = synth.mxfp4_params(cfg, 0)
    packed["moe"]["w3"]["scale"] = packed["moe"]["w3"]["scale"].copy()
    packed["moe"]["w3"]["scale"][1, 2, 3, 0] = 1
    with pytest.raises(PlanError, match=r"moe.w3 \(MoE layer 2\): E8M0 scale byte 1 at \[2, 3, 0\] is outside 2..252"):
        packing.pack_weights(make_plan(cfg, 1, experts="mxfp4"), packed)
    with pytest.raises(PlanError, match="needs the routed experts as MXFP4"):
        from mk.model import params
        packing.pack_weights(make_plan(cfg, 1, experts="mxfp4"), params.init(cfg, 0))


def _unpack_tiles(codes, scales, m):
    """Inverse of `pack_mxfp4_tiles` for one matrix (numpy): int32 words [T, tk/8, tn], [T, tk/128, tn]
    -> E2M1 codes u8 [k_pad, n_pad] and E8M0 bytes u8 [k_pad / 32, n_pad]."""
    tn = m.tile_n

    def unwords(w, per, bits, interleaved):   # [T, r, tn] -> [T, per * r, tn]
        w = np.asarray(w).view(np.uint32)
        parts = np.stack([(w >> np.uint32(bits * j)) & np.uint32((1 << bits) - 1) for j in range(per)],
                         axis=2 if interleaved else 1)          # row per * w + j, or j * r + w
        return parts.reshape(w.shape[0], per * w.shape[1], w.shape[2]).astype(np.uint8)

    def untile(x):                            # [nt * kt, rows, tn] (column block major) -> [kt * rows, nt * tn]
        x = x.reshape(m.n_tiles, m.k_tiles, x.shape[1], tn)
        return x.transpose(1, 2, 0, 3).reshape(m.k_tiles * x.shape[2], m.n_tiles * tn)

    return untile(unwords(codes, 8, 4, True)), untile(unwords(scales, 4, 8, False))


@pytest.mark.extended
def test_mxfp4_latent_slices_not_a_multiple_of_the_scale_group_stay_lossless():
    """latent / devices = 56 (mini-tp8 with latent 448, 8 devices): a 32-row scale group of w1/w3
    (K = latent) spans two ranks' slices. Each rank's slice sits at lane (rank * 56) mod 32 of its
    128-lane block, so every padded 32-row group holds rows of one source group: on every rank the
    packed tiles (arbitrary scale bytes per group) dequantize to exactly the checkpoint's weights
    laid out in the gathered latent layout, zeros elsewhere. K3 on 32 devices (112 per rank) plans."""
    from mk.io import synth
    from mk.io.convert import dequantize_mxfp4
    from mk.model.sharding import default_layout, local_params
    cfg = get_config("mini-tp8").replace(latent=448)
    lay = default_layout(cfg, 8)
    plan = make_plan(cfg, 1, experts="mxfp4", layout=lay)
    per, lb = cfg.latent // 8, plan.latent_block
    assert per % 32 and plan.latent_offsets == (0, 24, 16, 8) * 2
    # the layout: block j holds rank j's features contiguously, and each padded 32-lane group's
    # features come from one source scale group
    src = packing.to_latent_blocks(np.arange(1, cfg.latent + 1)[None], plan, axis=1)[0].astype(int) - 1
    assert sorted(src[src >= 0]) == list(range(cfg.latent))
    for j in range(8):
        blk = src[j * lb:(j + 1) * lb]
        assert list(blk[blk >= 0]) == list(range(j * per, (j + 1) * per))
    for g in src.reshape(-1, 32):
        assert len(set(g[g >= 0] // 32)) <= 1
    packed, _ = synth.mxfp4_params(cfg, 1)
    rng = np.random.default_rng(0)
    for k in ("w1", "w3", "w2"):                # a different scale in (nearly) every group
        packed["moe"][k] = dict(packed["moe"][k])
        packed["moe"][k]["scale"] = rng.integers(110, 140, packed["moe"][k]["scale"].shape, dtype=np.uint8)
    gu, dn = plan.expert_gu, plan.expert_down
    fe = cfg.expert_hidden // lay.tp_expert
    layer = 1
    for rank in range(8):
        got = packing.pack_weights(plan, packed, rank=rank)
        share = local_params(packed, lay, rank)["moe"]
        w1, w3, w2 = (dequantize_mxfp4(share[k]["packed"][layer], share[k]["scale"][layer]).astype(np.float32)
                      for k in ("w1", "w3", "w2"))                  # [E_local, K, N]
        for e in range(plan.local_experts):
            T = gu.tiles
            deq = {}
            for m, sl in ((gu, slice(0, T)), (dn, slice(T, None))):
                c, s = _unpack_tiles(got["expert_codes"][layer, e, sl], got["expert_scales"][layer, e, sl], m)
                deq[m.name] = (c.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
                               * np.repeat(s.view(ml_dtypes.float8_e8m0fnu).astype(np.float32), 32, axis=0))
            want_gu = np.zeros((gu.k_pad, gu.n_pad), np.float32)
            for key, w in (("w1", w1), ("w3", w3)):
                o = gu.part(key).offset
                want_gu[:plan.latent_padded, o:o + fe] = packing.to_latent_blocks(w[e], plan, axis=0)
            want_dn = np.zeros((dn.k_pad, dn.n_pad), np.float32)
            want_dn[:fe, :plan.latent_padded] = packing.to_latent_blocks(w2[e], plan, axis=1)
            np.testing.assert_array_equal(deq["expert.gu"], want_gu, err_msg=f"rank {rank} expert {e} w1|w3")
            np.testing.assert_array_equal(deq["expert.down"], want_dn, err_msg=f"rank {rank} expert {e} w2")
    from mk.model.sharding import default_layout as dl
    k3 = get_config("k3")
    assert make_plan(k3, 1, layout=dl(k3, 32), experts="mxfp4", check=False).latent_offsets[:2] == (0, 16)
    bad = get_config("mini-tp8").replace(latent=960)        # 120 per rank: lane 24 + 120 > 128
    with pytest.raises(PlanError, match="latent / devices = 120 .* would overrun the block"):
        make_plan(bad, 1, experts="mxfp4", layout=default_layout(bad, 8))
    make_plan(bad, 1, experts="bf16", layout=default_layout(bad, 8))


def _run_fp8_tile(x, codes, scales, m, unpack="bitcast"):
    """The kernel's `fp8_tile_product` (zero accumulator) in TPU interpret mode -> f32 [R, tn]."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu
    from mk.kernel.decode import interpret_params
    from mk.kernel.ring import fp8_tile_product

    R, G = x.shape[0], m.tile_k // plan_mod.MX_GROUP

    def kernel(x_ref, c_ref, s_ref, o_ref, lhs, w8):
        o_ref[...] = fp8_tile_product(jnp.zeros(o_ref.shape, jnp.float32), x_ref[...], c_ref.at[0], s_ref.at[0],
                                      lhs, w8, m, unpack)

    vmem = pl.BlockSpec(memory_space=pltpu.VMEM)
    out = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((R, m.tile_n), jnp.float32),
                         in_specs=[vmem] * 3, out_specs=vmem,
                         scratch_shapes=[pltpu.VMEM((G * R, m.tile_k), jnp.bfloat16),
                                         pltpu.VMEM((m.tile_k, m.tile_n), jnp.float8_e4m3fn)],
                         interpret=interpret_params(detect_races=True))(jnp.asarray(x), jnp.asarray(codes),
                                                                         jnp.asarray(scales))
    return np.asarray(out)


@pytest.mark.parametrize("unpack", ["pairs", "pairs_mul", "shift", "bitcast"])
def test_fp8_path_sums_group_partials_in_order(unpack):
    """One MXFP4 tile on the fp8 MXU path (`fp8_tile_product`: e4m3 codes, block-diagonal LHS, group
    partials scaled by 2^(s - 127)) equals, bit for bit, the fp32 sum over the 32-row groups in order of
    x_g @ dequantized w_g (what the references compute with `mm(..., k_chunk=MX_GROUP)`).

    The control: on these inputs the order shows in the bits, so the comparison can fail. One dot
    over the whole tile rounded once, and the same group partials summed last group first, each
    differ from the in-order sum in about half the outputs (numpy in float64, rounded to float32:
    platform-independent). Not XLA's own whole-tile dot: XLA:CPU's dot (jax 0.10.2) rounds as 32-deep
    blocks summed in order (`mm(x, w)` over these 512 rows equals `mm(x, w, k_chunk=32)` bit for bit,
    and differs from k_chunk 16 and 64, on 9 input draws), so it could not tell the orders apart."""
    import jax.numpy as jnp
    from mk.model.layers.common import mm
    tk, tn, R = 512, 256, 8
    m = plan_mod.Matrix("expert.down", tk, tn, (), tk, tn, "mxfp4")
    rng = np.random.default_rng(3)
    codes = rng.integers(0, 16, (tk, tn), dtype=np.uint8)
    scales = rng.integers(120, 134, (tk // 32, tn), dtype=np.uint8)
    x = rng.standard_normal((R, tk)).astype(ml_dtypes.bfloat16)
    c, s = packing.pack_mxfp4_tiles(codes, scales, tk, tn, unpack)
    got = _run_fp8_tile(x, c[None] if c.ndim == 2 else c, s[None] if s.ndim == 2 else s, m, unpack)
    w = (codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
         * np.repeat(scales.view(ml_dtypes.float8_e8m0fnu).astype(np.float32), 32, axis=0)).astype(ml_dtypes.bfloat16)
    grouped = np.asarray(mm(jnp.asarray(x), jnp.asarray(w), k_chunk=plan_mod.MX_GROUP))
    np.testing.assert_array_equal(got.view(np.uint32), grouped.view(np.uint32))
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    whole = (x64 @ w64).astype(np.float32)                            # one dot over the tile, one rounding
    G = plan_mod.MX_GROUP
    backwards = np.zeros_like(grouped)
    for g in reversed(range(tk // G)):                                # the group partials, last group first
        backwards += (x64[:, g * G:(g + 1) * G] @ w64[g * G:(g + 1) * G]).astype(np.float32)
    for other in (whole, backwards):
        assert np.count_nonzero(other != grouped) > grouped.size // 4
