"""The megakernel against the reference, in TPU interpret mode (race detector on).

On CPU the kernel keeps the reference's rounding points and summation order, so the claim is bit
identity: `check(..., exact=True)` passes only when every logit, every cache element and every
greedy token equals the reference's (`mk.kernel.check.exact_verdict`). (On a TPU, `mk check` compares the
compiled kernel with XLA on the same chip instead: `mk.kernel.check.check_on_chip`.)
"""
import pytest

from mk.kernel.check import LOGIT_SCALE, check
from mk.model.config import get_config
from mk.kernel.plan import DEFAULT_PREFETCH_DEPTH

# Batch sizes 1, 2 and 8, every prefetch depth (0 = no overlap, 1, the default), 3 decode steps each
# (the prompt's tokens, then one greedy: the ring wraps many times per step at every depth, and the
# write backs a step leaves in flight past its layers are waited across them). Routed experts
# in both formats: "mxfp4" (packed in HBM; the reference runs on their dequantization) at B = 1
# (dequantized to bf16 tiles in VMEM) and 8 (the fp8 MXU path: e4m3 codes, block-diagonal LHS, group
# partials; the reference sums the expert matmuls by 32-row group), bf16 tiles elsewhere.
# MXFP4 codes are unpacked two bf16 patterns per integer lane at B = 1 (v5e / v6e's path) and by the
# fp4 bitcast at B = 8 (TPU v7's; `Plan.mxfp4_unpack`). B = 4 at the default depth with bf16 experts
# runs bit-exact in tests/test_kernel_paths.py (`mixed_run`: four rows at different positions).
# `make test` runs the MXFP4 case at B = 1 (v5e's path), `make test-extended` the others.
CASES = [pytest.param(1, 0, "bf16", "bf16", "auto", marks=pytest.mark.extended),
         (1, DEFAULT_PREFETCH_DEPTH, "mxfp4", "bf16", "pairs"),
         pytest.param(2, 1, "bf16", "bf16", "auto", marks=pytest.mark.extended),
         pytest.param(8, 0, "bf16", "bf16", "auto", marks=pytest.mark.extended),
         pytest.param(8, DEFAULT_PREFETCH_DEPTH, "mxfp4", "fp8", "bitcast", marks=pytest.mark.extended)]


@pytest.fixture(scope="module")
def mini():
    from mk.model import params
    cfg = get_config("mini")
    return cfg, params.init(cfg, 0)


def _assert_close(res):
    """On CPU the kernel is the reference bit for bit (`check(..., exact=True)`): logits, every cache
    element, greedy tokens."""
    assert res["races"] == 0, res
    assert not res["nan"], res
    assert res["verdict"] == "pass" and res["tolerances"] == {"bit_identical": True}, res["reasons"]
    assert res["max_abs_logit_err"] == 0.0 and res["cache_max_abs_err"] == 0.0, res["per_step"]
    assert res["greedy_match"] and not res["greedy_flips"]
    assert LOGIT_SCALE[0] < res["logit_scale"] < LOGIT_SCALE[1]    # logits of a healthy scale
    assert res["pallas_calls_per_step"] == 1


@pytest.mark.slow
@pytest.mark.parametrize("batch,depth,experts,mxfp4_matmul,unpack", CASES)
def test_kernel_matches_reference(mini, batch, depth, experts, mxfp4_matmul, unpack):
    cfg, params = mini
    res = check(cfg, batch, steps=3, prefetch_depth=depth, params=params, detect_races=True, experts=experts,
                mxfp4_matmul=mxfp4_matmul, mxfp4_unpack=unpack, exact=True)
    assert res["experts"] == experts and res["mxfp4_matmul"] == mxfp4_matmul
    _assert_close(res)


@pytest.mark.extended
@pytest.mark.slow
def test_kernel_eager_dma_mode(mini):
    """In 'eager' DMA mode a missing wait would silently read the right data; 'on_wait' (above)
    returns NaN for it. Both must agree with the reference."""
    cfg, params = mini
    res = check(cfg, 2, steps=3, prefetch_depth=2, params=params, detect_races=True,
                dma_execution_mode="eager", exact=True)
    _assert_close(res)


def test_one_pallas_call_per_step(mini):
    import jax.numpy as jnp
    from mk.model import reference
    from mk.kernel.check import count_pallas_calls
    from mk.kernel.step import make_step_fn
    cfg, params = mini
    fn = make_step_fn(params, cfg, 2)
    cache = reference.init_cache(cfg, 2)
    assert count_pallas_calls(lambda c, t: fn(None, c, t), cache, jnp.zeros((2,), jnp.int32)) == 1
    # and the reference baseline has none: it is plain XLA
    assert count_pallas_calls(lambda c, t: reference.decode_step(params, c, t, cfg=cfg), cache,
                              jnp.zeros((2,), jnp.int32)) == 0


def test_interpret_shim_hands_over_only_private_operand_copies():
    """The interpreter keeps an operand array as its simulated HBM (no copy) only when the array
    owns its data (jaxlib's private copy for one callback); views and JAX's buffers are copied."""
    import jax.numpy as jnp
    import numpy as np
    from mk.kernel.interpret_shim import owned_operand

    own = np.arange(8, dtype=np.int32)
    own.flags.writeable = False                       # as jaxlib hands it over
    kept = np.array(owned_operand(own))
    assert kept is own and kept.flags.writeable       # written in place by the simulated kernel
    for other in (own[2:], np.asarray(jnp.arange(8))):
        assert owned_operand(other) is other
        assert not np.shares_memory(np.array(owned_operand(other)), other)
