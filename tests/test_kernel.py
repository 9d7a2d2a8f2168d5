"""The megakernel against the reference, in TPU interpret mode (race detector on).

Tolerances: logits are fp32 but depend on hundreds of bf16 roundings; the kernel keeps the
reference's rounding points and order (most steps are bit-exact), but an occasional fp32 sum
order difference (online vs one-pass softmax in MLA, per-head vs batched reductions) flips one
bf16 rounding, which then propagates. One bf16 ulp at |x| ~ 4 is 2^-6 = 0.016; we allow a few:
logits within 0.1 (logit std ~ 1), caches within 0.1, no NaN, no race, and greedy tokens identical
except at near-ties: a row whose reference top-2 gap is under NEAR_TIE (3 bf16 ulps at |x| ~ 4)
may flip (the reference itself would flip there under one rounding change); anywhere else a
different greedy token fails the test.
"""
import pytest

from mk.check import CACHE_TOL, LOGIT_SCALE, LOGIT_TOL, MAX_FLIPS, NEAR_TIE, check
from mk.config import get_config
from mk.plan import DEFAULT_PREFETCH_DEPTH

# Every batch size, every prefetch depth (0 = no overlap, 1, the default), 5 decode steps each
# (3 prompt tokens, then greedy: the ring wraps many times per step at every depth). Routed experts
# in both formats: "mxfp4" (packed in HBM; the reference runs on their dequantization) at B = 1
# (dequantized to bf16 tiles in VMEM) and 8 (the fp8 MXU path: e4m3 codes, block-diagonal LHS, group
# partials; the reference sums the expert matmuls by 32-row group), bf16 tiles elsewhere.
CASES = [(1, 0, "bf16", "bf16"), (1, DEFAULT_PREFETCH_DEPTH, "mxfp4", "bf16"), (2, 1, "bf16", "bf16"),
         (4, DEFAULT_PREFETCH_DEPTH, "bf16", "bf16"), (8, 0, "bf16", "bf16"), (8, DEFAULT_PREFETCH_DEPTH, "mxfp4", "fp8")]


@pytest.fixture(scope="module")
def mini():
    from mk import params
    cfg = get_config("mini")
    return cfg, params.init(cfg, 0)


def _assert_close(res):
    assert res["races"] == 0, res
    assert not res["nan"], res
    assert all(f["ref_margin"] < NEAR_TIE for f in res["greedy_flips"]), res["greedy_flips"]
    assert len(res["greedy_flips"]) <= MAX_FLIPS, res["greedy_flips"]   # a near-tie is rare, not routine
    assert res["max_abs_logit_err"] <= LOGIT_TOL, res["per_step"]
    assert res["cache_max_abs_err"] <= CACHE_TOL, res["per_step"]
    assert LOGIT_SCALE[0] < res["logit_scale"] < LOGIT_SCALE[1]    # tolerance is relative to this
    assert res["pallas_calls_per_step"] == 1


@pytest.mark.slow
@pytest.mark.parametrize("batch,depth,experts,mxfp4_matmul", CASES)
def test_kernel_matches_reference(mini, batch, depth, experts, mxfp4_matmul):
    cfg, params = mini
    res = check(cfg, batch, steps=5, prefetch_depth=depth, params=params, detect_races=True, experts=experts,
                mxfp4_matmul=mxfp4_matmul)
    assert res["experts"] == experts and res["mxfp4_matmul"] == mxfp4_matmul
    _assert_close(res)


@pytest.mark.slow
def test_kernel_eager_dma_mode(mini):
    """In 'eager' DMA mode a missing wait would silently read the right data; 'on_wait' (above)
    returns NaN for it. Both must agree with the reference."""
    cfg, params = mini
    res = check(cfg, 2, steps=4, prefetch_depth=2, params=params, detect_races=True,
                dma_execution_mode="eager")
    _assert_close(res)


def test_one_pallas_call_per_step(mini):
    import jax.numpy as jnp
    from mk import reference
    from mk.check import count_pallas_calls
    from mk.kernel import make_step_fn
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
