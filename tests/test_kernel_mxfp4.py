"""MXFP4 routed experts in the kernel: packed bytes in the plan, the packing, the in-VMEM dequant.

The end-to-end comparisons (kernel with MXFP4 experts == reference on the dequantized weights) run
inside the existing kernel tests: tests/test_kernel.py (mini, B = 1 and 8), tests/test_kernel_sharded.py
(mini-tp8 on 8 devices, B = 1 and 8) and tests/test_kernel_paths.py (weights from `mk synth`).
"""
import ml_dtypes
import numpy as np
import pytest

from mk import plan as plan_mod
from mk.config import get_config
from mk.plan import PlanError, make_plan

# E2M1 is 4 bits plus one 8-bit E8M0 scale per 32 values: 4.25 bits per weight against bf16's 16.
PACKED_RATIO = 16 / (4 + 8 / 32)


def test_expert_bytes_drop_by_the_packed_ratio():
    """Plan (its DMA list), simulator (bytes it moves) and roofline count packed expert bytes."""
    from mk import roofline, sim
    cfg = get_config("k3").replace(layers=3, full_attention=(2,))   # K3 widths, 896 experts; 3 layers
    lay = plan_mod.Layout()                     # one core's plan (VMEM not checked)
    bf16, mx = (make_plan(cfg, 1, layout=lay, experts=f, check=False) for f in ("bf16", "mxfp4"))
    assert bf16.routed_expert_bytes_per_step() / mx.routed_expert_bytes_per_step() == pytest.approx(PACKED_RATIO, rel=1e-12)
    assert PACKED_RATIO == pytest.approx(3.765, abs=1e-3)
    # the other weights are unchanged
    assert (bf16.weight_bytes_per_step() - bf16.routed_expert_bytes_per_step()
            == mx.weight_bytes_per_step() - mx.routed_expert_bytes_per_step())
    # the simulator replays the plan's DMAs: it moves exactly the plan's bytes
    r_bf16, r_mx = (sim.simulate(p, "tpu-v7x16") for p in (bf16, mx))
    assert r_bf16.bytes_moved - r_mx.bytes_moved == pytest.approx(
        bf16.weight_bytes_per_step() - mx.weight_bytes_per_step(), rel=1e-9)
    # the roofline's per-expert bytes agree with the plan's (k3 expert tiles have no padding)
    rl_lay = roofline.as_layout(lay)
    for p, fmt in ((bf16, "bf16"), (mx, "mxfp4")):
        slice_bytes = roofline.expert_slice_bytes(cfg, rl_lay, roofline.WeightFormats(fmt, fmt, fmt))
        assert p.expert_bytes == pytest.approx(slice_bytes["total"], rel=1e-12), fmt
    # the mxfp4 pool is separate: its slots carry their own ids, after the bf16 ring's
    slots = {d.slot for d in mx.dmas if d.tensor.startswith("expert[")}
    assert min(slots) >= mx.num_slots and {d.slot for d in mx.dmas if not d.tensor.startswith("expert[")} <= set(range(mx.num_slots))


def test_mxfp4_buffers_and_checks():
    cfg = get_config("mini")
    p = make_plan(cfg, 1, experts="mxfp4")
    names = {b.name: b for b in p.buffers}
    assert names["code_slots"].shape == (p.num_slots, p.tile_k // 8, p.tile_n) and names["code_slots"].dtype == "int32"
    assert names["scale_slots"].shape == (p.num_slots, p.tile_k // 128, p.tile_n)
    assert names["dequant"].shape == (p.tile_k, p.tile_n) and names["dequant"].dtype == "bfloat16"
    assert "code_slots" not in {b.name for b in make_plan(cfg, 1).buffers}
    with pytest.raises(PlanError, match="tile_k to be a multiple of 256"):
        make_plan(cfg, 1, experts="mxfp4", tile=(128, 128))
    with pytest.raises(PlanError, match="experts must be one of"):
        make_plan(cfg, 1, experts="fp8")


def _run_dequant(codes, scales, m):
    """The kernel's `dequantize_tile` on [T] tiles, in TPU interpret mode -> bf16 [T, tk, tn]."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu
    from mk.kernel import interpret_params
    from mk.kernel.ring import dequantize_tile

    def kernel(c_ref, s_ref, o_ref):
        for t in range(codes.shape[0]):
            dequantize_tile(c_ref.at[t], s_ref.at[t], o_ref.at[t], m)

    vmem = pl.BlockSpec(memory_space=pltpu.VMEM)
    out = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((codes.shape[0], m.tile_k, m.tile_n), jnp.bfloat16),
                         in_specs=[vmem, vmem], out_specs=vmem,
                         interpret=interpret_params(detect_races=True))(jnp.asarray(codes), jnp.asarray(scales))
    return np.asarray(out)


def test_in_kernel_dequant_bit_exact_against_ml_dtypes():
    """One expert tile holding every E2M1 code under every allowed E8M0 byte (2..252), unpacked by
    the kernel's integer dequantization, equals ml_dtypes' float4_e2m1fn x float8_e8m0fnu in bf16
    bit for bit (signed zeros included)."""
    tk, tn = 512, 256
    m = plan_mod.Matrix("expert.down", tk, tn, (), tk, tn, "mxfp4")
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 16, (tk, tn), dtype=np.uint8)
    codes[:16, :] = np.arange(16, dtype=np.uint8)[:, None]              # every code in every column
    lo, hi = plan_mod.KERNEL_SCALE_RANGE
    scales = rng.integers(lo, hi + 1, (tk // 32, tn), dtype=np.uint8)
    scales[0, :] = np.arange(tn) % (hi - lo + 1) + lo                   # every scale byte, group 0
    scales[1, :2] = (lo, hi)
    c, s = plan_mod.pack_mxfp4_tiles(codes, scales, tk, tn)
    got = _run_dequant(c, s, m)[0]
    want = (codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
            * np.repeat(scales.view(ml_dtypes.float8_e8m0fnu).astype(np.float32), 32, axis=0)).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))


def test_packed_expert_tiles_dequantize_to_the_bf16_tiles():
    """`pack_weights` on mini-tp8's rank 5 share (latent blocks, a tp slice of each expert): every
    tile of one packed expert, dequantized by the kernel, equals the bf16 tile that the bf16 format
    packs from `dequantize_mxfp4` of the same checkpoint bytes; padding dequantizes to +0."""
    from mk import synth
    from mk.sharding import default_layout
    cfg = get_config("mini-tp8")
    packed, _ = synth.mxfp4_params(cfg, 1)
    kw = dict(layout=default_layout(cfg, 8))
    mx = plan_mod.pack_weights(make_plan(cfg, 1, experts="mxfp4", **kw), packed, rank=5)
    bf = plan_mod.pack_weights(make_plan(cfg, 1, experts="bf16", **kw), packed, rank=5)
    m = make_plan(cfg, 1, experts="mxfp4", **kw).expert_gu
    assert mx["expert_codes"].nbytes + mx["expert_scales"].nbytes < bf["experts"].nbytes / 3.7
    layer, expert = 1, 2
    got = _run_dequant(mx["expert_codes"][layer, expert], mx["expert_scales"][layer, expert], m)
    np.testing.assert_array_equal(got.view(np.uint16), np.asarray(bf["experts"][layer, expert]).view(np.uint16))


def test_scale_bytes_the_kernel_cannot_dequantize_exactly_are_refused():
    from mk import synth
    cfg = get_config("mini")
    packed, _ = synth.mxfp4_params(cfg, 0)
    packed["moe"]["w3"]["scale"] = packed["moe"]["w3"]["scale"].copy()
    packed["moe"]["w3"]["scale"][1, 2, 3, 0] = 1
    with pytest.raises(PlanError, match=r"moe.w3 \(MoE layer 2\): E8M0 scale byte 1 at \[2, 3, 0\] is outside 2..252"):
        plan_mod.pack_weights(make_plan(cfg, 1, experts="mxfp4"), packed)
    with pytest.raises(PlanError, match="needs the routed experts as MXFP4"):
        from mk import params
        plan_mod.pack_weights(make_plan(cfg, 1, experts="mxfp4"), params.init(cfg, 0))
