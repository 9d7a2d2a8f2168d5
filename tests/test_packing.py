"""The packer (jitted JAX, `mk.kernel.packing`) lays every weight out bit for bit as the host numpy
packer did before it (tests/packing_oracle.py: that packer, verbatim, kept as the layout's oracle):
bf16 and MXFP4 experts, MXFP4 leaves packed as bf16, a multi-device share (latent blocks, a tp
slice of each expert), zero-padded partial tiles; in one program and piece by piece."""
import dataclasses

import jax
import numpy as np
import pytest

from mk.kernel import packing
from mk.kernel.plan import MK, make_plan
from mk.model import params as params_mod
from mk.model.config import get_config

from tests import packing_oracle


def _bits(x) -> bytes:
    x = np.asarray(x)
    return x.view(np.uint8).tobytes()


def _thin_widths_config():
    """tests/test_kernel_paths.py's thin widths: k3-d48's widths in two layers, 4 experts top-2,
    vocab 512; with MXFP4 experts 512 x 512 tiles, every 1792-wide row block and 768-deep expert
    matrix ending in a zero-padded partial tile."""
    return get_config("k3-d48").replace(layers=2, full_attention=(1,), vocab=512, experts=4, top_k=2,
                                        dense_hidden=1024)


def _same_as_oracle(plan, params, rank=0, **kw):
    want = packing_oracle.pack_weights(plan, jax.device_get(params), rank)
    for stream in (False, True):
        got = packing.pack_weights(plan, params, rank, stream=stream, **kw)
        assert sorted(got) == sorted(want)
        for k in want:
            assert got[k].shape == want[k].shape and np.dtype(got[k].dtype) == want[k].dtype, (k, stream)
            assert _bits(got[k]) == _bits(want[k]), (k, stream)
    return got


@pytest.mark.parametrize("experts", ["bf16", "mxfp4"])
def test_mini_packs_as_the_numpy_packer(experts):
    cfg = get_config("mini")
    params = params_mod.init(cfg, 0) if experts == "bf16" else params_mod.init_fast(cfg, 3, "mxfp4")
    _same_as_oracle(make_plan(cfg, 1, experts=experts), params)


@pytest.mark.parametrize("unpack", ["pairs", pytest.param("shift", marks=pytest.mark.extended)])
def test_mxfp4_leaves_packed_as_bf16_and_other_unpacks(unpack):
    """MXFP4 leaves into bf16 tiles (dequantized on the device: the loader's table), and the code
    words of the other unpacks."""
    cfg = get_config("mini")
    params = params_mod.init_fast(cfg, 4, "mxfp4")
    _same_as_oracle(make_plan(cfg, 1, experts="bf16"), params)
    opts = dataclasses.replace(MK, mxfp4_unpack=unpack)
    _same_as_oracle(make_plan(cfg, 1, experts="mxfp4", options=opts), params)


def test_a_multi_device_share_packs_as_the_numpy_packer():
    """mini-tp8's rank 5 share: latent blocks at the rank's lane offsets, a tp slice of each expert."""
    from mk.io import synth
    from mk.model.sharding import default_layout
    cfg = get_config("mini-tp8")
    packed, _ = synth.mxfp4_params(cfg, 1)
    plan = make_plan(cfg, 1, experts="mxfp4", layout=default_layout(cfg, 8))
    _same_as_oracle(plan, packed, rank=5, device=jax.devices()[5])


def test_padded_partial_tiles_pack_as_the_numpy_packer():
    cfg = _thin_widths_config()
    params = params_mod.init_fast(cfg, 1, "mxfp4")
    plan = make_plan(cfg, 1, ctx=128, experts="mxfp4")
    assert (plan.tile_k, plan.tile_n) == (512, 512)
    assert plan.expert_down.k_pad > cfg.expert_hidden and any(m.n_pad % 1792 for s in plan.streams for m in s.pre)
    _same_as_oracle(plan, params)


def test_bad_scale_in_one_program_is_named_as_piece_by_piece():
    """The one-program packer cannot raise inside XLA: it flags the byte, and the host names it."""
    from mk.model.layout import PlanError
    cfg = get_config("mini")
    params = jax.device_get(params_mod.init_fast(cfg, 0, "mxfp4"))
    params["moe"]["w2"]["scale"] = params["moe"]["w2"]["scale"].copy()
    params["moe"]["w2"]["scale"][0, 1, 2, 0] = 253
    for stream in (False, True):
        with pytest.raises(PlanError, match=r"moe.w2 \(MoE layer 1\): E8M0 scale byte 253 at \[1, 2, 0\]"):
            packing.pack_weights(make_plan(cfg, 1, experts="mxfp4"), params, stream=stream)
    params["moe"]["w2"]["scale"][0, 1, 2, 0] = 0
    for stream in (False, True):
        with pytest.raises(ValueError, match=r"moe.w2 \(MoE layer 1\): E8M0 scale byte 0 at \[1, 2, 0\]"):
            packing.pack_weights(make_plan(cfg, 1, experts="bf16"), params, stream=stream)
