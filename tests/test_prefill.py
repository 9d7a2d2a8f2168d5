"""The parallel prefill (`mk.perf.prefill`) against the token-by-token decode steps, on `mini`.

Tolerance, and why it is not bit-exact: the prefill sums in other orders than the decode step (the
chunked delta rule's matrix products instead of one rank-1 update per token, one dot over all of K
instead of 512-deep slices, one softmax over the cache instead of an online one over 128-slot
blocks). An fp32 difference in the last bit sometimes flips a bf16 rounding, and later layers and
tokens carry the flipped ulp on (a MoE routing decision near a tie flips a whole expert: on
mini, seed 0, one position of 40 moves 0.45 in logits that way). The fair XLA decode step
(`mk.perf.baseline`) is another correct implementation with its own summation order, and it
differs from the reference by as much (measured on mini: 0.02-0.06 logits, 0.45 at the flipped
position; KDA states 0.001-0.17 by layer). So the tolerance is calibrated against it, per
position and per cache array and layer: the prefill's error may be at most twice the XLA step's
plus a floor of two bf16 ulps at the array's scale (TOL_FLOOR). A wrong state, decay, mask or
conv state gives errors of the logits' own scale (~4) at most positions.

The delta rule itself (fp32 in, no bf16 rounding) is checked tightly (1e-5) against
`mk.model.layers.kda.delta_rule_head`.
"""
from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from mk.model import reference as ref
from mk.model.config import get_config
from mk.model.layers.kda import delta_rule_head, l2_normalize
from mk.model.params import init
from mk.perf.prefill import PrefillError, chunked_delta_rule, kda_chunk, prefill
from mk.perf.baseline import make_baseline_step

CTX = 256
T, SHORT = 24, 13          # prompt width; the ragged row's length
TOL_FLOOR = {"logits": 0.05, "kda_state": 5e-3, "conv_state": 0.04, "mla_k": 0.04, "mla_v": 0.04, "pos": 0}


@pytest.fixture(scope="module")
def setup():
    """mini params, a [2, T] prompt, and the decode steps' logits and caches after SHORT and T tokens:
    the reference's (the oracle) and the fair XLA step's (the calibration)."""
    cfg = get_config("mini")
    params = init(cfg, 0)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab, (2, T)).astype(np.int32)

    def run(step):
        cache, logits, at = ref.init_cache(cfg, 2, CTX), [], {}
        for t in range(T):
            out, cache = step(params, cache, jnp.asarray(tokens[:, t]))
            logits.append(np.asarray(out))
            if t + 1 in (SHORT, T):
                at[t + 1] = jax.tree.map(np.asarray, cache)
        return np.stack(logits, axis=1), at

    reference = run(lambda p, c, t: ref.decode_step(p, c, t, cfg=cfg))
    xla = run(make_baseline_step(cfg))
    return cfg, params, tokens, reference, xla


def assert_close(name, got, want, calib, row=slice(None)):
    """|got - want| <= 2 |calib - want| + floor, per layer (axis 1) of a cache array, or per
    position of logits [B, T, V]."""
    got, want, calib = (np.asarray(x, np.float32)[row] for x in (got, want, calib))
    if name == "pos":
        np.testing.assert_array_equal(got, want)
        return
    axis = 1 if name == "logits" or got.ndim > 1 else None
    red = lambda x: np.abs(x).max(axis=tuple(i for i in range(x.ndim) if i != axis)) if axis else np.abs(x).max()
    err, tol = red(got - want), 2 * red(calib - want) + TOL_FLOOR[name]
    assert np.all(err <= tol), f"{name}: error {err} exceeds {tol}"


def test_delta_rule_chunked_equals_recurrence():
    """fp32 in, fp32 out: the chunked form against the per-token rule, from a nonzero state, with
    the last positions padded (beta = 0, k = 0, decay 1): they leave the state exactly alone."""
    rng = np.random.default_rng(1)
    B, H, n, D, c = 1, 2, 24, 128, 8
    q = l2_normalize(jnp.asarray(rng.normal(size=(B, H, n, D)), jnp.float32)) * D ** -0.5
    k = l2_normalize(jnp.asarray(rng.normal(size=(B, H, n, D)), jnp.float32))
    v = jnp.asarray(rng.normal(size=(B, H, n, D)), jnp.float32)
    g = -5.0 * jax.nn.sigmoid(jnp.asarray(rng.normal(size=(B, H, n, D)) * 3, jnp.float32))
    beta = jax.nn.sigmoid(jnp.asarray(rng.normal(size=(B, H, n)), jnp.float32))
    real = 19                                                                # 5 padded positions
    k, g = k.at[:, :, real:].set(0.0), g.at[:, :, real:].set(0.0)
    beta = beta.at[:, :, real:].set(0.0)
    s0 = jnp.asarray(rng.normal(size=(B, H, D, D)) * 0.1, jnp.float32)
    o, s = chunked_delta_rule(s0, q, k, v, g, beta, c)
    for h in range(H):
        state = s0[0, h]
        for t in range(real):
            o_t, state = delta_rule_head(state, q[0, h, t][None], k[0, h, t][None], v[0, h, t][None],
                                         jnp.exp(g[0, h, t])[None], beta[0, h, t])
            np.testing.assert_allclose(o[0, h, t], o_t[0], atol=1e-5)
        np.testing.assert_allclose(s[0, h], state, atol=1e-5)


def test_kda_chunk_keeps_decay_in_range():
    cfg = get_config("mini")
    assert kda_chunk(cfg) == 16 and kda_chunk(cfg.replace(gate_lower_bound=-1.0)) == 64
    assert kda_chunk(cfg.replace(gate_lower_bound=-100.0)) == 1


def test_prefill_matches_decode_steps(setup):
    """Every position's logits and every cache array; chunk 10 does not divide T = 24."""
    cfg, params, tokens, (r_logits, r_at), (x_logits, x_at) = setup
    logits, cache = prefill(params, ref.init_cache(cfg, 2, CTX), tokens, cfg=cfg, chunk=10)
    assert logits.shape == (2, T, cfg.vocab) and logits.dtype == jnp.float32
    assert_close("logits", logits, r_logits, x_logits)
    for name in r_at[T]:
        assert_close(name, cache[name], r_at[T][name], x_at[T][name])


def test_prefill_ragged(setup):
    """Row 1 holds SHORT real tokens: its caches equal the decode steps' after SHORT tokens (MLA
    slots past SHORT untouched), row 0's after T; padding reads as garbage ids."""
    cfg, params, tokens, (r_logits, r_at), (x_logits, x_at) = setup
    prompt = tokens.copy()
    prompt[1, SHORT:] = -7                                                   # never read
    logits, cache = prefill(params, ref.init_cache(cfg, 2, CTX), prompt, np.array([T, SHORT]), cfg=cfg, chunk=16)
    for row, n in ((0, T), (1, SHORT)):
        assert_close("logits", logits[:, :n], r_logits[:, :n], x_logits[:, :n], row=slice(row, row + 1))
        for name in r_at[n]:
            assert_close(name, cache[name], r_at[n][name], x_at[n][name], row=slice(row, row + 1))


def test_greedy_continuation_after_prefill(setup):
    """Greedy decoding from the parallel prefill's caches picks the same tokens as from the
    token-by-token prefill's."""
    cfg, params, tokens, (r_logits, r_at), _ = setup
    logits, cache = prefill(params, ref.init_cache(cfg, 2, CTX), tokens, cfg=cfg, chunk=10)

    def greedy(last, cache, n=6):
        out = []
        for _ in range(n):
            tok = jnp.argmax(last, axis=-1).astype(jnp.int32)
            out.append(np.asarray(tok))
            last, cache = ref.decode_step(params, cache, tok, cfg=cfg)
        return np.stack(out, axis=1)

    want = greedy(jnp.asarray(r_logits[:, -1]), jax.tree.map(jnp.asarray, r_at[T]))
    np.testing.assert_array_equal(greedy(logits[:, -1], cache), want)


def test_prefill_continues_a_cache(setup):
    """Two calls (the prompt's first SHORT tokens, then the rest) give the one call's caches."""
    cfg, params, tokens, (r_logits, r_at), (x_logits, x_at) = setup
    _, cache = prefill(params, ref.init_cache(cfg, 2, CTX), tokens[:, :SHORT], cfg=cfg, chunk=16)
    logits, cache = prefill(params, cache, tokens[:, SHORT:], cfg=cfg, chunk=16)
    assert_close("logits", logits, r_logits[:, SHORT:], x_logits[:, SHORT:])
    for name in r_at[T]:
        assert_close(name, cache[name], r_at[T][name], x_at[T][name])


@pytest.mark.parametrize("kw, match", [
    (dict(tokens=np.zeros((1, CTX + 1), np.int32)), "past the cache capacity ctx=256"),
    (dict(tokens=np.full((1, 4), 2048, np.int32)), r"tokens: ids must lie in \[0, 2048\)"),
    (dict(tokens=np.full((1, 4), -1, np.int32)), "found -1"),
    (dict(chunk=0), "chunk: must be a positive integer"),
    (dict(lengths=np.array([5])), r"lengths: each must lie in \[0, 4\]"),
    (dict(tokens=np.zeros((4,), np.int32)), r"tokens: expected integer ids \[B, T\]"),
    (dict(experts="fp8"), "experts: expected one of"),
])
def test_bad_input_is_one_line(kw, match):
    cfg = get_config("mini")
    args = dict(tokens=np.zeros((1, 4), np.int32), lengths=None, chunk=4, experts="bf16") | kw
    with pytest.raises(PrefillError, match=match) as e:
        prefill({}, ref.init_cache(cfg, 1, CTX), args["tokens"], args["lengths"], cfg=cfg, chunk=args["chunk"],
                 experts=args["experts"])
    assert "\n" not in str(e.value)


def test_prefill_flops():
    """Linear in B and in T for the weights, quadratic in T for attention; the routed experts
    count top_k of E; k3-chip at 1024 tokens: 4.6 TFLOP (23 ms at the v5e's 197 TFLOP/s)."""
    from mk.perf.prefill_bench import prefill_flops
    cfg = get_config("mini")
    one, two = prefill_flops(cfg, 16, 1), prefill_flops(cfg, 16, 2)
    assert two["total"] == pytest.approx(2 * one["total"])
    assert prefill_flops(cfg, 32)["matmul"] == pytest.approx(2 * one["matmul"])
    assert prefill_flops(cfg, 32)["attention"] == pytest.approx(one["attention"] * (32 * 33) / (16 * 17))
    extra = prefill_flops(cfg.replace(top_k=cfg.top_k + 1), 16)["by_category"]["moe_experts"] - \
        one["by_category"]["moe_experts"]
    assert extra == pytest.approx(2 * 16 * cfg.n_moe * 3 * cfg.latent * cfg.expert_hidden)
    assert "vector" not in one["by_category"]
    assert prefill_flops(get_config("k3-chip"), 1024)["total"] == pytest.approx(4.61e12, rel=0.01)


def test_prefill_bench_refuses_off_tpu():
    """Timing is for the chip only (CPU or interpret mode is no speed claim): one line, before any work."""
    from mk.errors import UserError
    from mk.perf.prefill_bench import prefill_bench
    if jax.default_backend() == "tpu":
        pytest.skip("on a TPU the bench runs")
    with pytest.raises(UserError, match="on a TPU") as e:
        prefill_bench(get_config("mini"), (8,), log=lambda m: pytest.fail(f"bench started: {m}"))
    assert "\n" not in str(e.value)


def test_prefill_mxfp4_experts_equal_their_dequantization():
    """Packed MXFP4 experts (dequantized layer by layer inside the program) give the logits and
    caches of the same prefill on their bf16 dequantization. (The packed path sums the even and odd
    contraction rows as two products, another fp32 order; on mini, XLA:CPU, no bf16 rounding flips:
    equal to 1e-5. Should one flip, the tolerance is the one calibrated above.)"""
    from mk.io.synth import mxfp4_params
    cfg = get_config("mini")
    packed, deq = mxfp4_params(cfg, 0)
    tokens = np.random.default_rng(2).integers(0, cfg.vocab, (1, 12)).astype(np.int32)
    want_logits, want = prefill(deq, ref.init_cache(cfg, 1, CTX), tokens, cfg=cfg, chunk=12)
    logits, cache = prefill(packed, ref.init_cache(cfg, 1, CTX), tokens, cfg=cfg, chunk=12, experts="mxfp4")
    np.testing.assert_allclose(np.asarray(logits), np.asarray(want_logits), atol=1e-5)
    for name in want:
        np.testing.assert_allclose(np.asarray(cache[name], np.float32), np.asarray(want[name], np.float32), atol=1e-5)


def test_mxfp4_halves_are_the_dequantization():
    """`dequantize_halves` (the prefill's MXFP4 experts) = `dequantize`'s even and odd rows, exactly."""
    from mk.perf.baseline import dequantize, dequantize_halves
    rng = np.random.default_rng(0)
    packed = jnp.asarray(rng.integers(0, 256, (2, 64, 96)), jnp.uint8)         # [E, N, K/2], K = 192
    scale = jnp.asarray(rng.integers(100, 140, (2, 64, 6)), jnp.uint8)
    full = np.asarray(dequantize(packed, scale), np.float32)                    # [E, N, K]
    even, odd = (np.asarray(h, np.float32) for h in dequantize_halves(packed, scale))
    np.testing.assert_array_equal(even, np.swapaxes(full[..., 0::2], -1, -2))
    np.testing.assert_array_equal(odd, np.swapaxes(full[..., 1::2], -1, -2))
