"""Speculative decoding on `mini` (reference backend): the verify step against successive decode
steps, rollback by state_row, the drafter, acceptance, exact speculative sampling, and greedy
speculative decoding emitting exactly the plain greedy tokens.

Tolerance of verify_step vs decode_step: the same functions run on the same per-token shapes, so
the logits are usually bit-identical, but XLA may fuse the AttnRes mixture of a T-token graph
differently from a one-token graph (an FMA contraction): a bf16 rounding apart. So the rule of
docs/numerics.md ("When the order differs", `mk.kernel.check.order_violations`), with params and
tokens from `seed` (`make test-seeds`).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mk.model import params as mkparams
from mk.model import reference as ref
from mk.kernel.check import order_violations, route_ties
from mk.model.config import get_config

CFG = get_config("mini")
CTX = 256
AUX = (4, 2)    # every verify step here returns these aux rows: one compiled verify step for the file


@pytest.fixture(scope="module")
def params():
    return mkparams.init(CFG, seed=0)


def cache_near(params, batch: int, pos) -> dict:
    """A cache after three real decode steps, then MLA slots filled with random keys/values and the
    positions moved to `pos` (e.g. near the 128-slot block boundary without 125 steps)."""
    cache = ref.init_cache(CFG, batch, CTX)
    for t in (5, 77, 901):
        _, cache = ref.decode_step(params, cache, jnp.full((batch,), t, jnp.int32), cfg=CFG)
    k1, k2 = jax.random.split(jax.random.PRNGKey(1))
    mla_k = (jax.random.normal(k1, cache["mla_k"].shape) * 0.5).astype(cache["mla_k"].dtype)
    cache["mla_k"] = mla_k.at[..., CFG.qk_head_dim:].set(0)     # key padding stays zero
    cache["mla_v"] = (jax.random.normal(k2, cache["mla_v"].shape) * 0.5).astype(cache["mla_v"].dtype)
    cache["pos"] = jnp.asarray(pos, jnp.int32)
    return cache


def test_verify_step_equals_successive_decode_steps(seed):
    """T = 4 tokens verified at positions 126..129 (crossing the MLA block boundary 127 | 128).
    Each token's logits and post-states equal the decode step's up to summation order, and
    committing row t (state_row = t, a rollback of the later rows) gives the cache of t + 1 decode
    steps. Batch 1, the shapes the greedy test below compiles anyway."""
    T, start = 4, 126
    params = mkparams.init(CFG, seed=seed)
    cache = cache_near(params, 1, [start])
    tokens = jnp.asarray(np.random.default_rng(seed).integers(0, CFG.vocab, (1, T)), jnp.int32)
    logits, block = ref.verify_step(params, cache, tokens, cfg=CFG, aux_layers=AUX)
    assert logits.shape == (1, T, CFG.vocab) and block["aux"].shape == (1, T, 2, CFG.dim)
    states = lambda c: {n: c[n] for n in ("kda_state", "conv_state")}
    stepped, ties, reasons = cache, [], []
    for t in range(T):
        one, stepped, margins = ref.decode_step(params, stepped, tokens[:, t], cfg=CFG, route_margins=True)
        ties.append(route_ties(margins))
        reasons += order_violations(CFG, {"logits": logits[:, t]}, {"logits": one}, ties[-1])
        kept = ref.commit(cache, block, jnp.full((1,), t, jnp.int32))
        assert int(kept["pos"][0]) == start + t + 1
        reasons += order_violations(CFG, states(kept), states(stepped), np.stack(ties, axis=1), start)
        if t == 1:              # rolled back to token 1: the next decode step sees slots <= 127 only
            nxt, _ = ref.decode_step(params, kept, jnp.asarray([5], jnp.int32), cfg=CFG)
            want, _, margins = ref.decode_step(params, stepped, jnp.asarray([5], jnp.int32), cfg=CFG, route_margins=True)
            reasons += order_violations(CFG, {"logits": nxt}, {"logits": want}, route_ties(margins))
            # the rule still sees a real bug: a rollback that keeps the row before the right one
            wrong = ref.commit(cache, block, jnp.full((1,), t - 1, jnp.int32))
            assert order_violations(CFG, states(wrong), states(stepped), np.stack(ties, axis=1), start)
    # every slot the four decode steps wrote holds the verify step's key/value
    mla = lambda c: {n: c[n] for n in ("mla_k", "mla_v")}
    reasons += order_violations(CFG, mla(block), mla(stepped), np.stack(ties, axis=1), start)
    assert not reasons, "; ".join(reasons)


# ---- greedy speculative decoding == plain greedy ---------------------------------------------

def test_greedy_speculative_equals_plain_greedy(params):
    """64 tokens from a 72-token prompt (positions 72..135 cross the 128-slot MLA block), k = 3,
    with a drafter whose agreement is scheduled: full (4), zero (1 = every draft forced wrong, a
    rollback of 3 rows), partial acceptance. The tokens equal `reference.generate`'s greedy ones."""
    from mk.kernel import speculative as spec
    prompt = np.asarray([(i * 37 + 11) % CFG.vocab for i in range(72)], np.int32)
    plain = ref.generate(params, CFG, prompt, 64, ctx=CTX)["tokens"]
    truth = np.concatenate([prompt[None], plain], 1)
    drafter = spec.AgreeingDrafter(truth, schedule=[3, 0, 1, 3, 2], vocab=CFG.vocab, aux_layers=AUX)
    res = spec.generate(params, CFG, prompt, 64, drafter, 3, ctx=CTX)
    np.testing.assert_array_equal(res["tokens"], plain)
    lengths = res["acceptance"][0]
    assert {1, 2, 3, 4} <= set(lengths)                          # zero, partial and full acceptance
    assert res["steps"] == len(lengths) < 64 and sum(lengths) >= 63


# ---- exact speculative sampling --------------------------------------------------------------

def _chi2_pvalue(counts, probs):
    from scipy.stats import chisquare
    counts, probs = np.asarray(counts, float), np.asarray(probs, float)
    assert counts[probs == 0].sum() == 0, "a token outside the nucleus was emitted"
    live = probs > 0
    return chisquare(counts[live], probs[live] / probs[live].sum() * counts.sum()).pvalue


def test_speculative_sampling_matches_target_distribution():
    """A tiny Markov 'target' over 6 tokens, top-p 0.8 at temperature 0.7, k = 2 drafts from a
    deterministic drafter (one-hot q) and from a random proposal q: the first two emitted tokens
    (joint, 36 cells) follow the target's nucleus distribution. 20000 draws, fixed seed;
    chi-square at significance 0.001."""
    from mk.kernel import speculative as spec
    V, k, N = 6, 2, 20000
    rng = np.random.default_rng(0)
    table = rng.normal(size=(V, V)) * 1.5                          # target logits given the previous token
    p = np.asarray(spec.nucleus_probs(table, 0.7, 0.8), np.float64)
    assert (p == 0).any()                                          # the nucleus cuts some tokens
    q_rand = rng.dirichlet(np.ones(V), size=V)                     # proposal given the previous token
    want = (p[0][:, None] * p).ravel()                             # P(x1, x2 | x0 = 0)
    for mode in ("one-hot", "random q"):
        counts = np.zeros(V * V)
        for _ in range(N):
            emitted, prev = [], 0
            while len(emitted) < 2:
                if mode == "one-hot":
                    drafts, q = [(prev + 1) % V, (prev + 3) % V], None
                else:
                    d1 = rng.choice(V, p=q_rand[prev]); d2 = rng.choice(V, p=q_rand[d1])
                    drafts, q = [d1, d2], np.stack([q_rand[prev], q_rand[d1]])
                rows = np.stack([p[prev], p[drafts[0]], p[drafts[1]]])
                count, bonus = spec.accept_sample(rows, drafts, rng.random((k + 1, 2)), q)
                new = list(drafts[:count]) + [bonus]
                emitted += new
                prev = new[-1]
            counts[emitted[0] * V + emitted[1]] += 1
        assert _chi2_pvalue(counts, want) > 1e-3, mode


def test_speculative_sampling_on_mini(params):
    """The first emitted token of a speculative step on mini (k = 3, drafts = the target's top
    tokens) follows the target's nucleus distribution p'_0 (temperature 1, top-p 0.9): 4000 draws
    of the acceptance rule on one verify step's logits, chi-square at significance 0.001."""
    from mk.kernel import speculative as spec
    cache = cache_near(params, 1, [3])
    logits, _ = ref.verify_step(params, cache, jnp.asarray([[9, 10, 11, 12]], jnp.int32), cfg=CFG, aux_layers=AUX)
    p = np.asarray(spec.nucleus_probs(logits[0] / 0.5, 1.0, 0.9), np.float64)   # sharpen: a ~dozen-token nucleus
    drafts = np.argsort(-p[:3], axis=-1)[:, 0]                      # likely drafts: all three paths occur
    rng = np.random.default_rng(1)
    counts = np.zeros(CFG.vocab)
    seen = set()
    for _ in range(4000):
        count, bonus = spec.accept_sample(p, drafts, rng.random((4, 2)))
        counts[drafts[0] if count else bonus] += 1
        seen.add(count)
    assert {0, 1} <= seen
    assert _chi2_pvalue(counts, p[0]) > 1e-3


def test_uniforms_reproducible():
    from mk.kernel import speculative as spec
    a, b = spec.uniforms(7, 0, 130, 4), spec.uniforms(7, 0, 130, 4)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, spec.uniforms(7, 0, 131, 4)) and not np.array_equal(a, spec.uniforms(7, 1, 130, 4))
    assert a.shape == (4, 2) and ((0 <= a) & (a < 1)).all()


# ---- the drafter -----------------------------------------------------------------------------

def test_drafter_checkpoint_roundtrip_and_errors(tmp_path):
    from safetensors.numpy import load_file, save_file
    from mk.model import drafter as D
    dc = D.config_for(CFG)
    d = tmp_path / "drafter"
    written = D.write(dc, d, seed=2)
    dc2, weights = D.load(d, CFG)
    assert dc2 == dc and set(weights) == set(written)
    assert all(np.array_equal(weights[n].view(np.uint16), written[n].view(np.uint16)) for n in written)
    st = D.DSparkDrafter(dc2, weights)
    state = st.observe(st.start(1, 128), jnp.ones((1, 4, len(dc.aux_layers), CFG.dim), jnp.bfloat16), [0])
    drafts = st.propose(state, [5], [4], 3)
    assert drafts.shape == (1, 3) and ((0 <= drafts) & (drafts < CFG.vocab)).all()

    def fails(message, target=CFG):
        with pytest.raises(D.DrafterError, match=message):
            D.load(d, target)
    fails("vocabulary 2048 does not match the target's 512", CFG.replace(vocab=512))
    fails(r"aux layers \[4, 6\] do not exist in the target", CFG.replace(layers=4, full_attention=(3,)))
    tensors = load_file(d / D.WEIGHTS_FILE)
    tensors["fc.weight"] = tensors["fc.weight"][:, :8]
    save_file(tensors, d / D.WEIGHTS_FILE)
    fails(r"model.safetensors: tensor 'fc.weight' has shape \[128, 8\], expected \[128, 768\]")
    tensors["fc.weight"] = written["fc.weight"]
    del tensors["norm.weight"]
    save_file(tensors, d / D.WEIGHTS_FILE)
    fails("tensor 'norm.weight' missing")
    (d / D.WEIGHTS_FILE).unlink()
    fails("model.safetensors: drafter weights not found")
    (d / D.CONFIG_FILE).write_text('{"markov_rank": 4}')
    fails("config.json: key 'transformer_layer_config.hidden_size' missing")
    with pytest.raises(D.DrafterError, match="drafter directory not found"):
        D.load(tmp_path / "nope")
