"""`mk.model.loop`: decode chunks on the device against the host loop (`mk.model.reference.generate`).

A 2-layer config (compiling a chunk takes seconds); the kernel in TPU interpret mode.
"""
import numpy as np
import pytest

from mk.model import loop
from mk.model import params as mkparams
from mk.model import reference as ref
from mk.model.config import get_config

TINY = get_config("mini").replace(
    dim=128, latent=128, expert_hidden=128, dense_hidden=128, experts=4, top_k=2, layers=2, heads=1,
    q_rank=128, kv_rank=128, vocab=512, residual_block=1, full_attention=(1,))
CTX = 128
PROMPT = np.array([[1, 2, 3], [4, 5, 6]], np.int32)      # two different rows


@pytest.fixture(scope="module")
def params():
    return mkparams.init(TINY, 0)


@pytest.fixture(scope="module")
def host_greedy(params):
    return ref.generate(params, TINY, PROMPT, 9, ctx=CTX)["tokens"]


def device(params, n, chunk, **kw):
    return loop.generate(loop.reference_step(params, TINY), TINY, PROMPT, n, ctx=CTX, chunk=chunk, params=params,
                         **kw)


def test_greedy_equals_host_loop(params, host_greedy):
    """Chunks of 4 over 8 decode steps (the last chunk ends early at the limit): the host loop's tokens."""
    seen = []
    res = device(params, 9, 4, on_tokens=seen.append)
    assert res["tokens"].tolist() == host_greedy.tolist()
    assert res["lengths"].tolist() == [9, 9] and res["decode_steps"] == 8 and res["chunks"] == 2
    assert [s.shape for s in seen] == [(2, 1), (2, 4), (2, 4)]          # first token, then chunk by chunk
    assert np.concatenate(seen, 1).tolist() == host_greedy.tolist()
    assert res["tokens_per_s"] > 0 and res["ttft_s"] > 0 and res["chunk"] == 4


def test_stop_ids_and_limit_end_each_row(params, host_greedy):
    """A stop id ends its row right after emitting it (the other row runs to --max-new-tokens); rows
    that are done emit the pad value, and the loop stops once every row is done."""
    stop = int(host_greedy[0, 2])                          # row 0's third token
    assert stop not in host_greedy[1].tolist()
    seen = []
    res = device(params, 9, 3, sampling=loop.Sampling(stop_ids=(stop, 511)), on_tokens=seen.append)
    rows = loop.rows(res)
    assert rows[0] == host_greedy[0, :3].tolist() and rows[1] == host_greedy[1].tolist()
    assert res["lengths"].tolist() == [3, 9]
    assert all((s[0] == loop.PAD).all() for s in seen[2:])            # row 0 done: pad from the 2nd chunk
    both = device(params, 9, 3, sampling=loop.Sampling(stop_ids=(stop, int(host_greedy[1, 1]))))
    assert both["lengths"].tolist() == [3, 2] and both["decode_steps"] == 2   # all done: no more steps
    short = device(params, 1, 3)                            # the limit alone: the first token only
    assert short["tokens"].tolist() == host_greedy[:, :1].tolist() and short["decode_steps"] == 0


def test_sampling_reproducible_and_tiny_top_p_is_greedy(params, host_greedy):
    hot = loop.Sampling(temperature=2.0, top_p=0.95)
    a = device(params, 6, 4, sampling=hot, seed=3)["tokens"]
    assert device(params, 6, 4, sampling=hot, seed=3)["tokens"].tolist() == a.tolist()
    # the same key splits as the host loop: the same draws
    assert ref.generate(params, TINY, PROMPT, 6, ctx=CTX, temperature=2.0, top_p=0.95, seed=3)["tokens"].tolist() \
        == a.tolist()
    assert device(params, 6, 4, sampling=hot, seed=4)["tokens"].tolist() != a.tolist()
    tiny = device(params, 6, 4, sampling=loop.Sampling(temperature=2.0, top_p=1e-6), seed=3)["tokens"]
    assert tiny.tolist() == host_greedy[:, :6].tolist()


@pytest.mark.parametrize("kw, message", [
    (dict(chunk=0), "--chunk must be at least 1 step, found 0"),
    (dict(prompt=np.array([[1, 512]])), "token id 512 outside the vocabulary [0, 512)"),
    (dict(prompt=np.array([[-1, 3]])), "token id -1 outside the vocabulary"),
    (dict(prompt=np.ones((1, 120), np.int32), n=9), "= 129 exceed the cache capacity ctx=128"),
    (dict(prefill="both"), "--prefill must be one of sequential, parallel"),
])
def test_bad_runs_are_one_line(params, kw, message):
    prompt, n = kw.pop("prompt", PROMPT), kw.pop("n", 4)
    with pytest.raises(loop.LoopError, match=None) as e:
        loop.generate(loop.reference_step(params, TINY), TINY, prompt, n, ctx=CTX, params=params, **kw)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_parallel_prefill_refused_until_it_exists(params, monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "mk.model.prefill", None)
    with pytest.raises(loop.LoopError, match="--prefill parallel needs mk.model.prefill"):
        loop.make_prefill("parallel", loop.reference_step(params, TINY), params, TINY)


@pytest.fixture(scope="module")
def kernel_step_fn(params):
    from mk.kernel.step import make_step_fn
    return make_step_fn(params, TINY, 2, ctx=CTX)


def test_kernel_device_loop_is_the_reference(params, host_greedy, kernel_step_fn):
    """The interpret-mode kernel inside the device loop's while_loop: the reference's greedy tokens
    (the kernel equals the reference bit for bit on CPU, tests/test_kernel.py)."""
    res = loop.generate(loop.loop_step_of(kernel_step_fn, params, TINY), TINY, PROMPT, 4, ctx=CTX, chunk=2)
    assert res["tokens"].tolist() == host_greedy[:, :4].tolist() and res["chunks"] == 2


@pytest.mark.slow
def test_kernel_device_loop_equals_kernel_host_loop(params, kernel_step_fn):
    host = ref.generate(params, TINY, PROMPT, 4, ctx=CTX, step_fn=kernel_step_fn)["tokens"]
    res = loop.generate(loop.loop_step_of(kernel_step_fn, params, TINY), TINY, PROMPT, 4, ctx=CTX, chunk=3)
    assert res["tokens"].tolist() == host.tolist()
