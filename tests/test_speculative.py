"""Speculative decoding on `mini` (reference backend): the verify step against successive decode
steps, rollback by state_row, the drafter, acceptance, exact speculative sampling, and greedy
speculative decoding emitting exactly the plain greedy tokens.

Tolerance of verify_step vs decode_step: the same functions run on the same per-token shapes, so
the logits are usually bit-identical (they are in the case below), but XLA may fuse the AttnRes
mixture of a T-token graph differently from a one-token graph (an FMA contraction), a 1-ulp bf16
difference that was measured at most 0.016 in the logits (|logit| std ~ 1). The test allows 0.05
and requires equal argmax.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mk import params as mkparams
from mk import reference as ref
from mk.config import get_config

CFG = get_config("mini")
CTX = 256


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


def test_verify_step_equals_successive_decode_steps(params):
    """Row b verifies T = 4 tokens at positions pos[b]..pos[b]+3; row 0 crosses the MLA block
    boundary (126, 127 | 128, 129). Each token's logits and post-states equal the decode step's,
    and committing row t (state_row = t) gives the cache of t + 1 decode steps."""
    B, T = 2, 4
    cache = cache_near(params, B, [126, 3])
    tokens = jnp.asarray([[11, 1500, 7, 300], [42, 8, 2047, 0]], jnp.int32)
    logits, block = ref.verify_step(params, cache, tokens, cfg=CFG, aux_layers=(4, 2))
    assert logits.shape == (B, T, CFG.vocab) and block["aux"].shape == (B, T, 2, CFG.dim)
    stepped, after = cache, []
    for t in range(T):
        one, stepped = ref.decode_step(params, stepped, tokens[:, t], cfg=CFG)
        after.append(stepped)
        np.testing.assert_allclose(np.asarray(logits[:, t]), np.asarray(one), atol=0.05, rtol=0,
                                   err_msg=f"token {t}")
        assert (np.argmax(logits[:, t], -1) == np.argmax(one, -1)).all()
        kept = ref.commit(cache, block, jnp.full((B,), t, jnp.int32))
        assert np.asarray(kept["pos"]).tolist() == [126 + t + 1, 3 + t + 1]
        for name in ("kda_state", "conv_state"):
            np.testing.assert_allclose(np.asarray(kept[name], np.float32), np.asarray(stepped[name], np.float32),
                                       atol=2e-2, rtol=2e-2, err_msg=f"{name} after token {t}")
    # every slot the four decode steps wrote holds the verify step's key/value
    for name in ("mla_k", "mla_v"):
        np.testing.assert_allclose(np.asarray(block[name], np.float32), np.asarray(stepped[name], np.float32),
                                   atol=2e-2, rtol=2e-2, err_msg=name)
    # mixed rollback: row 0 keeps token 0 only (its drafts' MLA slots stay written, masked), row 1
    # keeps all four; the next decode step equals one from the caches of 1 and 4 decode steps
    kept = ref.commit(cache, block, jnp.asarray([0, 3], jnp.int32))
    nxt, _ = ref.decode_step(params, kept, jnp.asarray([5, 6], jnp.int32), cfg=CFG)
    mixed = {k: jnp.concatenate([after[0][k][:1], after[3][k][1:]]) for k in cache}
    want, _ = ref.decode_step(params, mixed, jnp.asarray([5, 6], jnp.int32), cfg=CFG)
    np.testing.assert_allclose(np.asarray(nxt), np.asarray(want), atol=0.05, rtol=0)
