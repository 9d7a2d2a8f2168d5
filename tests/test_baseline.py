"""The fair XLA step (mk.perf.baseline) against the oracle (mk.model.reference) under mk check's tolerances."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mk.perf import baseline
from mk.model import reference
from mk.kernel.check import CACHE_TOL, LOGIT_TOL, LOGIT_SCALE
from mk.io.convert import dequantize_experts, dequantize_mxfp4
from mk.model.config import get_config
from mk.model.params import init
from mk.io.synth import mxfp4_params

CFG = get_config("mini")


@pytest.fixture(scope="module")
def params():
    return init(CFG, 0)


@pytest.fixture(scope="module")
def packed(params):
    return mxfp4_params(CFG, 0, params)[0]


def run_both(step_params, ref_params, batch, experts, moe="loop", steps=4, seed=0):
    """Reference and baseline from empty caches on the same tokens (the reference's greedy ones)."""
    step = baseline.make_baseline_step(CFG, experts, moe)
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(0, CFG.vocab, batch), jnp.int32)
    r_cache, b_cache = reference.init_cache(CFG, batch), reference.init_cache(CFG, batch)
    logit_err = cache_err = 0.0
    scales = []
    for _ in range(steps):
        r_logits, r_cache = reference.decode_step(ref_params, r_cache, tokens, cfg=CFG)
        b_logits, b_cache = step(step_params, b_cache, tokens)
        logit_err = max(logit_err, float(jnp.max(jnp.abs(r_logits - b_logits))))
        for n in r_cache:
            d = jnp.abs(r_cache[n].astype(jnp.float32) - b_cache[n].astype(jnp.float32))
            cache_err = max(cache_err, float(jnp.max(d)))
        scales.append(float(jnp.std(r_logits)))
        tokens = jnp.argmax(r_logits, -1).astype(jnp.int32)
    return logit_err, cache_err, float(np.mean(scales))


@pytest.mark.parametrize("batch", [1, pytest.param(4, marks=pytest.mark.extended)])
def test_bf16_agrees_with_reference(params, batch):
    logit_err, cache_err, scale = run_both(params, params, batch, "bf16")
    assert LOGIT_SCALE[0] < scale < LOGIT_SCALE[1]
    assert logit_err <= LOGIT_TOL and cache_err <= CACHE_TOL, (logit_err, cache_err)


@pytest.mark.parametrize("batch", [1, pytest.param(4, marks=pytest.mark.extended)])
def test_mxfp4_agrees_with_reference_on_dequantized_weights(packed, batch):
    logit_err, cache_err, _ = run_both(packed, dequantize_experts(packed), batch, "mxfp4")
    assert logit_err <= LOGIT_TOL and cache_err <= CACHE_TOL, (logit_err, cache_err)


def test_ragged_mode_agrees_with_reference(params):
    logit_err, cache_err, _ = run_both(params, params, 4, "bf16", moe="ragged", steps=3)
    assert logit_err <= LOGIT_TOL and cache_err <= CACHE_TOL, (logit_err, cache_err)


def test_comparison_can_fail(params):
    """The same harness sees a wrong step: the baseline given the attention output projections
    doubled (a sublayer's contribution off by 2x) is outside the tolerance."""
    kda = dict(params["kda"], o=params["kda"]["o"] * 2)
    logit_err, cache_err, _ = run_both(dict(params, kda=kda), params, 4, "bf16", steps=2)
    assert logit_err > LOGIT_TOL


def test_dequantize_matches_checkpoint_bits():
    """Bit for bit over every code and the scale bytes 2..254; at byte 1 only the subnormal
    results (0.5 * 2^-126) differ, flushed to zero as XLA flushes denormals."""
    rng = np.random.default_rng(1)
    packed = rng.integers(0, 256, (2, 3, 64, 48), dtype=np.uint8)
    scale = rng.integers(1, 255, (2, 3, 64, 3), dtype=np.uint8)
    scale[0, 0, 0] = [1, 2, 254]
    got = np.asarray(jax.jit(baseline.dequantize)(packed, scale)).view(np.uint16)
    want = dequantize_mxfp4(packed, scale, transpose=False).view(np.uint16)
    step_byte = np.repeat(scale, 32, axis=-1)
    assert np.array_equal(got[step_byte > 1], want[step_byte > 1])
    diff = got != want
    assert diff.any()                                  # byte 1 does produce subnormals here ...
    assert np.all((want[diff] & 0x7F80) == 0) and np.all((got[diff] & 0x7FFF) == 0)   # ... only those


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="experts"):
        baseline.make_baseline_step(CFG, "fp8")
    with pytest.raises(ValueError, match="moe"):
        baseline.make_baseline_step(CFG, moe="dense")


def expert_copies(report) -> list[dict]:
    """Buffers holding two or more experts' matrices (bf16 [..., Lt, Fe] / [..., Fe, Lt])."""
    Lt, Fe = CFG.latent, CFG.expert_hidden
    out = []
    for r in report["largest"]:
        dims = [int(d) for d in r["shape"].split("[")[1].rstrip("]").split(",") if d]
        if r["shape"].startswith("bf16") and len(dims) >= 3 and sorted(dims[-2:]) == sorted([Lt, Fe]) \
                and np.prod(dims[:-2]) >= 2:
            out.append(r)
    return out


@pytest.mark.aot
@pytest.mark.parametrize("experts", ["bf16", pytest.param("mxfp4", marks=pytest.mark.extended)])
def test_compiles_deviceless_for_v5e_without_expert_copies(experts):
    """The baseline compiles for one v5e core and materializes no copy of several experts (the
    reference does: its per-row expert gathers, so this check can fail)."""
    r = baseline.cost_report(CFG, 8, "xla", experts, topology="v5e:2x2", top=50)
    assert r["flops"] > 0 and r["bytes_accessed"] > 0
    assert not expert_copies(r), expert_copies(r)[:3]
    ref = baseline.cost_report(CFG, 8, "reference", topology="v5e:2x2", top=50)
    assert expert_copies(ref)


# ---- the verify step (speculative decoding) ----------------------------------------------------

@pytest.fixture(scope="module")
def tiny():
    """mini thinned to 2 layers (a KDA then an MLA layer; test_loop's): the verify step compiles in seconds."""
    from tests.test_loop import TINY
    return TINY, init(TINY, 0)


def verify_both(cfg, step_params, ref_params, experts, batch=2, k=3, steps=3, aux_layers=(1,), seed=0):
    """The fair XLA verify step (mk.perf.baseline.XlaVerifier) and the reference's (ReferenceVerifier)
    from the same prefilled cache on the same tokens, each step committing the same count per row
    (full, none, partial acceptance): max |logit|, |state, cache and aux| errors and the logits' scale."""
    from mk.kernel.speculative import ReferenceVerifier
    xla, oracle = baseline.XlaVerifier(cfg, experts), ReferenceVerifier(cfg)
    rng = np.random.default_rng(seed)
    r_cache = reference.init_cache(cfg, batch)
    r_cache = oracle.commit(r_cache, oracle.verify(ref_params, r_cache, rng.integers(0, cfg.vocab, (batch, 1 + k)),
                                                   ())[1], jnp.full((batch,), k, jnp.int32))   # a prompt of 1 + k
    x_cache = jax.tree.map(jnp.copy, r_cache)
    logit_err = cache_err = 0.0
    scales = []
    for s in range(steps):
        tokens = jnp.asarray(rng.integers(0, cfg.vocab, (batch, 1 + k)), jnp.int32)
        r_logits, r_block = oracle.verify(ref_params, r_cache, tokens, aux_layers)
        x_logits, x_block = xla.verify(step_params, x_cache, tokens, aux_layers)
        logit_err = max(logit_err, float(jnp.max(jnp.abs(r_logits - x_logits))))
        for n in ("kda_state", "conv_state", "aux"):
            assert x_block[n].shape == r_block[n].shape, n
            cache_err = max(cache_err, float(jnp.max(jnp.abs(f32(r_block[n]) - f32(x_block[n])))))
        scales.append(float(jnp.std(r_logits)))
        count = jnp.asarray([(k, 0, 1)[s % 3], (2, k, 0)[s % 3]][:batch], jnp.int32)
        r_cache, x_cache = oracle.commit(r_cache, r_block, count), xla.commit(None, x_block, count)
        for n in r_cache:
            cache_err = max(cache_err, float(jnp.max(jnp.abs(f32(r_cache[n]) - f32(x_cache[n])))))
    return logit_err, cache_err, float(np.mean(scales))


def f32(x):
    return jnp.asarray(x, jnp.float32)


def test_xla_verify_step_agrees_with_reference(tiny):
    """B = 2 sequences x (1 + 3) rows (8 rows: the kernel's limit), three steps with full, none and
    partial acceptance rolled back: within mk check's tolerances (docs/numerics.md); and the same
    harness sees a wrong verify step (the attention output projections doubled)."""
    cfg, params = tiny
    logit_err, cache_err, scale = verify_both(cfg, params, params, "bf16")
    assert LOGIT_SCALE[0] < scale < LOGIT_SCALE[1]
    assert logit_err <= LOGIT_TOL and cache_err <= CACHE_TOL, (logit_err, cache_err)
    wrong = dict(params, kda=dict(params["kda"], o=params["kda"]["o"] * 2),
                 mla=dict(params["mla"], o=params["mla"]["o"] * 2))
    logit_err, _, _ = verify_both(cfg, wrong, params, "bf16", steps=1)
    assert logit_err > LOGIT_TOL


@pytest.mark.extended
def test_xla_verify_step_mxfp4(tiny):
    """MXFP4 experts dequantized in the step, one sequence x (1 + 7) rows, against the reference on
    the dequantized weights."""
    cfg, params = tiny
    packed = mxfp4_params(cfg, 0, params)[0]
    logit_err, cache_err, _ = verify_both(cfg, packed, dequantize_experts(packed), "mxfp4", batch=1, k=7, steps=2)
    assert logit_err <= LOGIT_TOL and cache_err <= CACHE_TOL, (logit_err, cache_err)
