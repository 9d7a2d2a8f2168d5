"""The parallel prefill (`mk.perf.prefill`) against the token-by-token decode steps, on `mini`.

Tolerance: the rule of docs/numerics.md ("When the order differs", `mk.kernel.check.order_violations`).
The prefill sums in other orders than the decode step (the chunked delta rule's matrix products
instead of one rank-1 update per token, one dot over all of K instead of 512-deep slices, one
softmax over the cache instead of an online one over 128-slot blocks), so an fp32 sum now and then
flips one bf16 rounding: each value may be 2 bf16 ulps at its array's scale off per layer it passed
through. A position at a routing near tie on the oracle may pick another expert (on mini, about one
position in four is that close, and one in ten of those flips on our CPU): its logits and MLA slots
are compared separately, within half their scale. A wrong state, decay, mask or conv state moves
the logits by their own scale (~4) at most positions. The tests take `seed` (`pytest --seeds 10`,
`make test-seeds` draws params and prompts from seeds 0-9).

The delta rule itself (fp32 in, no bf16 rounding) is checked tightly (1e-5) against
`mk.model.layers.kda.delta_rule_head`.
"""
from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from mk.kernel.check import order_violations, route_ties
from mk.model import reference as ref
from mk.model.config import get_config
from mk.model.layers.kda import delta_rule_head, l2_normalize
from mk.model.params import init
from mk.perf.prefill import PrefillError, chunked_delta_rule, kda_chunk, prefill

CTX = 256
T, SHORT = 24, 13          # prompt width; the ragged row's length


@pytest.fixture(scope="module")
def setup(seed):
    """mini params, a [2, T] prompt, and the reference decode steps' (the oracle's) logits [2, T, V],
    caches after SHORT and T tokens, and routing near ties [2, T]."""
    cfg = get_config("mini")
    params = init(cfg, seed)
    tokens = np.random.default_rng(seed).integers(0, cfg.vocab, (2, T)).astype(np.int32)
    step = jax.jit(lambda c, t: ref.decode_step(params, c, t, cfg=cfg, route_margins=True))
    cache, logits, margins, at = ref.init_cache(cfg, 2, CTX), [], [], {}
    for t in range(T):
        out, cache, m = step(cache, jnp.asarray(tokens[:, t]))
        logits.append(np.asarray(out))
        margins.append(np.asarray(m))
        if t + 1 in (SHORT, T):
            at[t + 1] = jax.tree.map(np.asarray, cache)
    return cfg, params, tokens, np.stack(logits, axis=1), at, route_ties(np.stack(margins, axis=1))


def violations(cfg, got: dict, want: dict, tie, row=slice(None)) -> list[str]:
    """Why got is not want up to summation order (the rule), rows `row` of every array."""
    pick = lambda d: {n: np.asarray(v)[row] for n, v in d.items()}
    return order_violations(cfg, pick(got), pick(want), np.asarray(tie)[row])


def whole_prompt(setup) -> list[str]:
    """Every position's logits and every cache array; chunk 10 does not divide T = 24."""
    cfg, params, tokens, r_logits, r_at, tie = setup
    logits, cache = prefill(params, ref.init_cache(cfg, 2, CTX), tokens, cfg=cfg, chunk=10)
    assert logits.shape == (2, T, cfg.vocab) and logits.dtype == jnp.float32
    return violations(cfg, {"logits": logits, **cache}, {"logits": r_logits, **r_at[T]}, tie)


def ragged_prompt(setup) -> list[str]:
    """Row 1 holds SHORT real tokens: its caches are the decode steps' after SHORT tokens (MLA slots
    past SHORT untouched), row 0's after T; padding reads as garbage ids."""
    cfg, params, tokens, r_logits, r_at, tie = setup
    prompt = tokens.copy()
    prompt[1, SHORT:] = -7                                                   # never read
    logits, cache = prefill(params, ref.init_cache(cfg, 2, CTX), prompt, np.array([T, SHORT]), cfg=cfg, chunk=16)
    return [r for row, n in ((0, T), (1, SHORT))
            for r in violations(cfg, {"logits": logits[:, :n], **cache}, {"logits": r_logits[:, :n], **r_at[n]},
                                tie[:, :n], row=slice(row, row + 1))]


def continued_prompt(setup) -> list[str]:
    """Two calls (the prompt's first SHORT tokens, then the rest) give the one call's caches."""
    cfg, params, tokens, r_logits, r_at, tie = setup
    _, cache = prefill(params, ref.init_cache(cfg, 2, CTX), tokens[:, :SHORT], cfg=cfg, chunk=16)
    logits, cache = prefill(params, cache, tokens[:, SHORT:], cfg=cfg, chunk=16)
    return (violations(cfg, {"logits": logits}, {"logits": r_logits[:, SHORT:]}, tie[:, SHORT:]) +
            violations(cfg, cache, r_at[T], tie))


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


@pytest.mark.parametrize("compare", [whole_prompt, ragged_prompt, continued_prompt], ids=lambda f: f.__name__)
def test_prefill_matches_decode_steps(setup, compare):
    reasons = compare(setup)
    assert not reasons, "; ".join(reasons)


def dropped_expert(routed):
    """A planted fault: the routed experts' sum without each row's last chosen expert."""
    return lambda latent, ids, weights, *a, **kw: routed(latent, ids, weights.at[:, -1].set(0.0), *a, **kw)


def halved_decay(rule):
    """A planted fault: KDA's log-decay halved (a decay of sqrt(exp(g)) per token)."""
    return lambda state, q, k, v, g, beta, chunk: rule(state, q, k, v, 0.5 * g, beta, chunk)


# make test: each fault at one prompt shape; make test-extended adds the continued prompt's
@pytest.mark.parametrize("fault, compare", [(dropped_expert, whole_prompt), (halved_decay, ragged_prompt),
                                            pytest.param(halved_decay, continued_prompt, marks=pytest.mark.extended)],
                         ids=lambda f: f.__name__)
def test_a_planted_fault_fails_the_comparison(setup, fault, compare, monkeypatch):
    """The rule still sees a real bug: each comparison above reports one planted in the prefill."""
    import mk.perf.prefill as module
    name = {dropped_expert: "routed_ragged", halved_decay: "chunked_delta_rule"}[fault]
    monkeypatch.setattr(module, name, fault(getattr(module, name)))
    module.prefill_chunk.clear_cache()                                       # traced anew, with the fault
    try:
        assert compare(setup), f"{fault.__name__}: {compare.__name__} passed"
    finally:
        monkeypatch.undo()
        module.prefill_chunk.clear_cache()


@pytest.mark.extended
def test_greedy_continuation_after_prefill(setup):
    """Greedy decoding from the parallel prefill's caches picks the same tokens as from the
    token-by-token prefill's."""
    cfg, params, tokens, r_logits, r_at, _ = setup
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


@pytest.mark.extended
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
