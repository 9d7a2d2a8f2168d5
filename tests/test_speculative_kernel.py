"""Speculative decoding through the megakernel (`mk.kernel.step.KernelVerifier`) on `mini`, in TPU
interpret mode with the race detector on: the kernel's verify step (1 + k rows of one sequence,
per-row KDA states, state_row rollback, aux rows copied out) against `mk.model.reference.verify_step`,
and greedy speculative decoding through the kernel against plain greedy decoding.

Tolerances are test_kernel.py's (mk.kernel.check): logits within 0.1, caches and states within 0.1, no
NaN, no race. Measured: the verify step equals the reference bit for bit. Cost: one compile of a
2-sequence, k = 3 kernel (8 rows, the plan's limit) shared by every test, five kernel steps
(~5-10 s each in interpret mode with the race detector); prompts are prefilled by the reference.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from mk.model import params as mkparams
from mk.model import reference as ref
from mk.kernel import speculative as spec
from mk.kernel.check import races_found

LOGIT_TOL = CACHE_TOL = 0.0     # the verify step equals the reference bit for bit on CPU
from mk.model.config import get_config
from mk.errors import UserError

CFG = get_config("mini")
CTX = 256
B, K = 2, 3     # two sequences x (1 + 3) rows: batch > 1 with speculation, at the row limit
AUX = (4, 2)    # the aux rows test_speculative.py's reference verify step returns: one compile


@pytest.fixture(scope="module")
def params():
    return mkparams.init(CFG, seed=0)


class RaceChecked:
    """A KernelVerifier whose every verify step runs with a fresh race detector and must not race."""

    def __init__(self, verifier):
        self.v, self.steps = verifier, 0

    def __getattr__(self, name):
        return getattr(self.v, name)

    def verify(self, params, cache, tokens, aux_layers=None):
        pltpu.reset_tpu_interpret_mode_state()
        logits, block = jax.block_until_ready(self.v.verify(params, cache, tokens, aux_layers))
        assert not races_found(), "race detector flagged the kernel's verify step"
        self.steps += 1
        return logits, block


@pytest.fixture(scope="module")
def verifier(params):
    from mk.kernel.step import KernelVerifier
    from mk.kernel.decode import interpret_params
    v = KernelVerifier(params, CFG, B, K, AUX, ctx=CTX, interpret=interpret_params(detect_races=True))
    assert (v.plan.batch, v.plan.sequences, v.plan.k, v.plan.aux_layers) == (B * (1 + K), B, K, AUX)
    return RaceChecked(v)


def cache_near(params, pos) -> dict:
    """A reference cache of len(pos) sequences after three decode steps, its MLA slots filled with
    random keys and values and its positions moved to `pos` (the MLA block boundary without 125
    steps)."""
    cache = ref.init_cache(CFG, len(pos), CTX)
    for t in ((5, 6), (77, 70), (901, 33)):
        _, cache = ref.decode_step(params, cache, jnp.asarray(t, jnp.int32), cfg=CFG)
    k1, k2 = jax.random.split(jax.random.PRNGKey(1))
    mla_k = (jax.random.normal(k1, cache["mla_k"].shape) * 0.5).astype(cache["mla_k"].dtype)
    cache["mla_k"] = mla_k.at[..., CFG.qk_head_dim:].set(0)
    cache["mla_v"] = (jax.random.normal(k2, cache["mla_v"].shape) * 0.5).astype(cache["mla_v"].dtype)
    cache["pos"] = jnp.asarray(pos, jnp.int32)
    return cache


def assert_block_close(k_logits, k_block, r_logits, r_block, what):
    k_logits, r_logits = np.asarray(k_logits), np.asarray(r_logits)
    assert k_logits.shape == r_logits.shape and np.isfinite(k_logits).all(), what
    err = float(np.max(np.abs(k_logits - r_logits)))
    assert err <= LOGIT_TOL, f"{what}: max |logit err| {err}"
    assert (k_logits.argmax(-1) == r_logits.argmax(-1)).all(), what
    for n in ("kda_state", "conv_state", "mla_k", "mla_v", "aux"):
        a = np.asarray(k_block[n], np.float32)
        b = np.asarray(r_block[n], np.float32).reshape(a.shape)   # states: [B, T, ...] -> [B * T, ...]
        assert np.isfinite(a).all(), f"{what}: NaN/inf in kernel {n}"
        c_err = float(np.max(np.abs(a - b)))
        assert c_err <= CACHE_TOL, f"{what}: {n} max abs err {c_err}"


@pytest.mark.extended
@pytest.mark.slow
def test_verify_step_matches_reference_and_rolls_back(params, verifier):
    """Two sequences, two verify steps. Step 1 at positions 126..129 (across the 127 | 128 MLA
    block boundary) and 120..123; then sequence 0 accepts one draft (state_row = 1: the KDA and
    conv states of its row 1, slots 128..129 of the rejected rows left behind) and sequence 1 all
    three (state_row = 3), and step 2 runs at 128..131 and 124..127: logits, every row's KDA / conv
    post-state, the MLA caches and the aux rows as the reference's verify step and commit give them."""
    cache = cache_near(params, [126, 120])
    tokens = jnp.asarray([[11, 1500, 7, 300], [3, 4, 1999, 64]], jnp.int32)
    r_logits, r_block = ref.verify_step(params, cache, tokens, cfg=CFG, aux_layers=AUX)
    k_logits, k_block = verifier.verify(params, verifier.adopt(jax.tree.map(jnp.array, cache)), tokens, AUX)
    assert k_block["aux"].shape == (B, 1 + K, len(AUX), CFG.dim)
    assert_block_close(k_logits, k_block, r_logits, r_block, "step 1")

    count = jnp.asarray([1, 3], jnp.int32)
    k_cache = verifier.commit(None, k_block, count)
    r_cache = ref.commit(cache, r_block, count)
    assert list(k_cache["pos"]) == list(r_cache["pos"]) == [128, 124] and list(k_cache["state_row"]) == [1, 3]
    back = verifier.to_reference(k_cache)
    for n in ("kda_state", "conv_state"):      # rollback picked rows 1 and 3's post-states, copying nothing
        np.testing.assert_array_equal(np.asarray(back[n], np.float32), np.asarray(r_cache[n], np.float32))

    tokens = jnp.asarray([[42, 9, 2000, 5], [8, 800, 80, 1]], jnp.int32)
    r_logits, r_block = ref.verify_step(params, r_cache, tokens, cfg=CFG, aux_layers=AUX)
    k_logits, k_block = verifier.verify(params, k_cache, tokens, AUX)
    assert_block_close(k_logits, k_block, r_logits, r_block, "step 2 (from state_rows 1 and 3)")


@pytest.mark.extended
@pytest.mark.slow
def test_greedy_speculative_through_kernel_equals_plain_greedy(params, verifier):
    """Two 124-token prompts (prefilled by the reference), then 8 tokens each: three kernel verify
    steps with k = 3 at positions 124..132 (across the 128-slot MLA block), the drafter's agreement
    scheduled as full (4 tokens), zero (every draft forced wrong: 3 rows rolled back) and partial
    (1 of 3). The tokens equal `reference.generate`'s plain greedy ones."""
    prompt = np.asarray([[(i * 37 + 11 + 500 * b) % CFG.vocab for i in range(124)] for b in range(B)], np.int32)
    n_new = 8
    plain = ref.generate(params, CFG, prompt, n_new, ctx=CTX)["tokens"]
    truth = np.concatenate([prompt, plain], 1)
    drafter = spec.AgreeingDrafter(truth, schedule=[3, 0, 1], vocab=CFG.vocab, aux_layers=AUX)
    before = verifier.steps
    res = spec.generate(params, CFG, prompt, n_new, drafter, K, ctx=CTX, verifier=verifier, reference_prefill=True)
    np.testing.assert_array_equal(res["tokens"], plain)
    assert res["acceptance"] == [[4, 1, 2]] * B                 # full, zero and partial acceptance
    assert verifier.steps - before == res["steps"] == 3


def test_k_beyond_the_plan_is_refused(params):
    """More rows than a step holds: a UserError naming k and the limit, before any weight is packed."""
    from mk.kernel.step import KernelVerifier
    from mk.kernel.plan import MAX_ROWS, make_plan
    with pytest.raises(UserError, match=rf"k = 4 drafts: a verify step of batch 2 x \(1 \+ k\) = 10 rows exceeds "
                                        rf"the plan's limit of {MAX_ROWS} rows per step \(k <= 3 at batch 2\)"):
        KernelVerifier(params, CFG, 2, 4, AUX)
    with pytest.raises(UserError, match=r"k = 8 drafts.*9 rows.*limit of 8 rows"):
        make_plan(CFG, 1, k=8)
    with pytest.raises(UserError, match=r"aux layers \[0\]"):
        make_plan(CFG, 1, k=1, aux_layers=(0,))
    plan = make_plan(CFG, 2, k=3, aux_layers=AUX)               # exactly the limit: fine
    assert plan.batch == MAX_ROWS and list(plan.tables()["row_seq"]) == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [b.name for b in plan.buffers if b.output] == ["logits", "p", "aux"]
    assert next(b for b in plan.buffers if b.name == "aux").shape == (len(AUX), 8, CFG.dim)


def test_chip_policy_compares_each_token_with_the_teacher_forced_oracle(params):
    """`mk check --speculative` on a TPU (`check_speculative`'s chip policy): row i of `forced_logits` is
    what plain greedy decoding sees before its token i, so along plain greedy's own tokens every
    argmax is that token and `greedy_flips` finds none; a token off the argmax is a flip whose
    `ref_margin` is the oracle's top logit minus the token's, a pass only below its near-tie bound or
    at a routing near tie (the oracle's routing margin there below ROUTE_NEAR_TIE)."""
    from mk.kernel.check import ROUTE_NEAR_TIE, far_from_tie, forced_logits, greedy_flips, route_near_ties
    from mk.model.layers.common import K_CHUNK
    prompt = np.asarray([(i * 37 + 11) % CFG.vocab for i in range(5)], np.int32)
    plain = np.asarray(ref.generate(params, CFG, prompt[None], 6, ctx=CTX)["tokens"])[0]
    logits, margins = forced_logits(CFG, params, prompt, plain, ctx=CTX, device=jax.devices("cpu")[0],
                                    expert_k_chunk=K_CHUNK, route_margins=True)
    assert logits.shape == (6, CFG.vocab) and margins.shape == (6, CFG.layers - 1) and (margins >= 0).all()
    tied = margins.copy()
    tied[4, 2] = 0.001
    assert {"sequence": 1, "position": 4, "moe_layer": 3, "route_margin": float(np.float32(0.001))} in \
        route_near_ties(tied, "position", sequence=1)
    far = {"ref_margin": 0.5, "near_tie_below": 0.05}
    assert far_from_tie([far]) == [far]
    assert far_from_tie([at := far | {"route_margin": ROUTE_NEAR_TIE}]) == [at]
    assert far_from_tie([far | {"route_margin": ROUTE_NEAR_TIE / 2}]) == []
    np.testing.assert_array_equal(logits.argmax(-1), plain)
    assert greedy_flips(plain, logits, 0.05) == []
    other = plain.copy()
    other[3] = np.argsort(logits[3])[-2]                      # the oracle's second choice at position 3
    gap = float(logits[3].max() - logits[3, other[3]])
    (flip,) = greedy_flips(other, logits, [0.05] * 6)
    assert flip == {"position": 3, "token": int(other[3]), "greedy": int(plain[3]), "ref_margin": gap,
                    "near_tie_below": 0.05}


@pytest.mark.extended
def test_kept_verify_logits_line_up_with_the_teacher_forced_oracle(params):
    """`generate(keep_logits=True)` keeps, per emitted token after the prefill's, the verify step's logits
    row that chose it: row i - 1 is `forced_logits`' row i (`emitted_logit_err`, the kernel's distance
    the chip policy reports), whatever each step accepted."""
    from mk.kernel.check import emitted_logit_err, forced_logits
    from mk.model.layers.common import K_CHUNK
    prompt = np.asarray([(i * 37 + 11) % CFG.vocab for i in range(5)], np.int32)
    plain = np.asarray(ref.generate(params, CFG, prompt[None], 7, ctx=CTX)["tokens"])[0]
    drafter = spec.AgreeingDrafter(np.concatenate([prompt, plain])[None], agree=0.6, seed=0, vocab=CFG.vocab)
    res = spec.generate(params, CFG, prompt[None], 7, drafter, 3, ctx=CTX, keep_logits=True)
    np.testing.assert_array_equal(res["tokens"][0], plain)
    (kept,) = res["emitted_logits"]
    assert kept.shape == (6, CFG.vocab) and kept.dtype == np.float32
    np.testing.assert_array_equal(kept.argmax(-1), plain[1:])
    oracle = forced_logits(CFG, params, prompt, plain, ctx=CTX, device=jax.devices("cpu")[0], expert_k_chunk=K_CHUNK)
    err = emitted_logit_err(kept, oracle)
    assert np.isnan(err[0]) and np.nanmax(err) < 0.05, err
    with pytest.raises(ValueError, match="do not match"):
        emitted_logit_err(kept[1:], oracle)
    assert "emitted_logits" not in spec.generate(params, CFG, prompt[None], 3, drafter, 3, ctx=CTX)
