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


def test_the_compile_count_sees_a_compile():
    """The counter the clock's region uses (`mk.model.compile_cache.counting`) counts a new
    program's compile and trace, and nothing for a second call of it."""
    import jax
    from mk.model.compile_cache import counting
    f = jax.jit(lambda x: x * 3 + 1)
    with counting() as first:
        f(np.arange(5)).block_until_ready()
    with counting() as again:
        f(np.arange(5)).block_until_ready()
    assert first.compiles == 1 and first.traces >= 1 and again.as_dict() == {"compiles": 0, "cache_loads": 0,
                                                                                "traces": 0}


NOTHING = {"compiles": 0, "cache_loads": 0, "traces": 0}


@pytest.mark.parametrize("mode", ["sequential", "parallel"])
def test_nothing_compiles_on_the_clock(params, mode):
    """The timed region (prefill, first token, chunks) compiles and traces nothing: `rehearse` ran
    every program before it. Counted with jax.monitoring (`in_clock`): backend_compile_duration
    events, which fire for every jit-cache miss that reaches XLA (a compile, or a load from the
    persistent cache), and jaxpr traces. A fresh prompt length and limit, so nothing is left over
    from other tests; 3 chunks, so later chunks (a chunk's cache, not the prefill's) are covered."""
    from mk.perf import prefill
    prompt = np.array([[7, 8, 9, 10, 11]] * 2, np.int32)
    res = loop.generate(loop.reference_step(params, TINY), TINY, prompt, 8, ctx=CTX, chunk=3, params=params,
                        prefill=prefill if mode == "parallel" else mode)
    assert res["chunks"] == 3 and res["in_clock"] == NOTHING, res["in_clock"]


def test_parallel_prefill(params, host_greedy):
    """The parallel prefill (mk.perf.prefill, handed in: not bit-exact with the token-by-token prefill,
    close enough here that greedy picks the same tokens), compiled ahead of the clock like the sequential one."""
    from mk.perf import prefill
    res = device(params, 6, 4, prefill=prefill)
    assert res["tokens"].tolist() == host_greedy[:, :6].tolist()


@pytest.fixture(scope="module")
def kernel_step_fn(params):
    from mk.kernel.step import make_step_fn
    return make_step_fn(params, TINY, 2, ctx=CTX)


def test_kernel_device_loop_is_the_host_loop(params, host_greedy, kernel_step_fn):
    """The interpret-mode kernel inside the device loop's while_loop: the kernel's own host loop's
    greedy tokens, which are the reference's (the kernel equals the reference bit for bit on CPU,
    tests/test_kernel.py)."""
    host = ref.generate(params, TINY, PROMPT, 4, ctx=CTX, step_fn=kernel_step_fn)["tokens"]
    res = loop.generate(loop.loop_step_of(kernel_step_fn, params, TINY), TINY, PROMPT, 4, ctx=CTX, chunk=2)
    assert res["tokens"].tolist() == host.tolist() == host_greedy[:, :4].tolist() and res["chunks"] == 2
    assert res["in_clock"] == NOTHING, res["in_clock"]        # nothing compiled on the clock (above)


def test_kernel_chunk_compiles_for_tpu_with_the_cache_in_place():
    """Deviceless TPU v5e compile of a 16-step chunk around the megakernel (mini, B = 2, top-p
    sampling, a stop id): one pallas_call in the program, the whole cache aliased input to output
    (no copy per chunk), and little else."""
    import jax
    from mk.kernel.aot import compile_loop_chunk
    from mk.kernel.plan import make_plan
    from mk.model.params import nbytes
    cfg = get_config("mini")
    plan = make_plan(cfg, 2, chip="v5e", ctx=256)
    r = compile_loop_chunk(plan, "v5e:2x2", 16, loop.Sampling(0.7, 0.9, (5,)))
    assert r.compiled, r.error
    cache = nbytes(jax.eval_shape(lambda: ref.init_cache(cfg, 2, 256)))
    assert r.pallas_calls == 1
    assert r.memory["alias_size_in_bytes"] >= cache - 64 and r.memory["temp_size_in_bytes"] < cache // 4


@pytest.mark.slow
def test_sharded_reference_on_a_mesh_of_two():
    """--mesh 2 (the sharded reference, two virtual CPU devices): the device loop's tokens are the
    host loop's."""
    from mk.model import reference_sharded as rs
    cfg = TINY.replace(heads=2)
    mesh = rs.mesh_for(cfg, 2)
    params = rs.shard_params(mkparams.init(cfg, 0), mesh)
    step_fn = rs.step_fn_for(cfg, mesh)
    host = ref.generate(params, cfg, PROMPT, 4, ctx=CTX, step_fn=step_fn)["tokens"]
    res = loop.generate(loop.loop_step_of(step_fn, params, cfg), cfg, PROMPT, 4, ctx=CTX, chunk=2)
    assert res["tokens"].tolist() == host.tolist()


@pytest.mark.extended
@pytest.mark.slow
def test_kernel_on_a_mesh_of_two():
    """The interpret-mode kernel split over two virtual devices inside the device loop: the host loop's tokens."""
    from mk.kernel.step import make_step_fn
    cfg = TINY.replace(heads=2)
    params = mkparams.init(cfg, 0)
    step_fn = make_step_fn(params, cfg, 2, ctx=CTX, mesh=2)
    host = ref.generate(params, cfg, PROMPT, 3, ctx=CTX, step_fn=step_fn)["tokens"]
    res = loop.generate(loop.loop_step_of(step_fn, params, cfg), cfg, PROMPT, 3, ctx=CTX, chunk=2)
    assert res["tokens"].tolist() == host.tolist()


# ---- speculative decoding on the device (mk.kernel.speculative.device_generate) ----------------------

@pytest.fixture(scope="module")
def drafter():
    from mk.model import drafter as mkdrafter
    dc = mkdrafter.config_for(TINY)
    return mkdrafter.DSparkDrafter(dc, mkdrafter.init(dc, 3))


def test_speculative_device_loop_greedy(params, host_greedy, drafter):
    """Draft, verify, accept and roll back on the device: plain greedy's tokens and the host
    speculative loop's; a stop id ends its row."""
    from mk.kernel import speculative as sp
    host = sp.generate(params, TINY, PROMPT, 8, drafter, 2)
    res = sp.device_generate(params, TINY, PROMPT, 8, drafter, 2, chunk=3)
    assert res["tokens"].tolist() == host["tokens"].tolist() == host_greedy[:, :8].tolist()
    assert res["lengths"].tolist() == [8, 8] and res["mean_acceptance"] == host["mean_acceptance"]
    assert res["in_clock"] == NOTHING, res["in_clock"]        # the chunk compiled before the decode clock
    stop = int(host_greedy[0, 3])
    cut = sp.device_generate(params, TINY, PROMPT, 8, drafter, 2, chunk=3, stop_ids=(stop,))
    assert cut["lengths"].tolist() == [4, 8] and cut["tokens"][0, :4].tolist() == host_greedy[0, :4].tolist()


def test_speculative_prefill_is_rehearsed_and_on_the_counted_clock(params, host_greedy, drafter, monkeypatch):
    """The prefill (verify blocks, the drafter's observe, the first token) runs once before the clock
    on scratch caches (`prefill_program`'s rehearsal, through `mk.model.loop.rehearse`) and again,
    timed, inside the counted region: a first token that compiles a new program at every call
    shows in in_clock (once per row of the timed run), and the tokens are plain greedy's. The host
    loop counts its prefill alone (prefill_in_clock)."""
    import jax
    from mk.kernel import speculative as sp
    real, calls = sp._first_token, []

    def compiling(*a):
        calls.append(1)
        jax.jit(lambda x: x + 1)(np.zeros(1)).block_until_ready()        # a new function each call
        return real(*a)

    monkeypatch.setattr(sp, "_first_token", compiling)
    res = sp.device_generate(params, TINY, PROMPT, 3, drafter, 2, chunk=2)
    assert res["tokens"].tolist() == host_greedy[:, :3].tolist()
    assert len(calls) == 4 and res["in_clock"]["compiles"] == 2, res["in_clock"]   # rehearsal + run, 2 rows
    host = sp.generate(params, TINY, PROMPT, 3, drafter, 2)
    assert host["tokens"].tolist() == host_greedy[:, :3].tolist()
    assert len(calls) == 8 and host["prefill_in_clock"]["compiles"] == 2, host["prefill_in_clock"]
    monkeypatch.setattr(sp, "_first_token", real)
    host = sp.generate(params, TINY, PROMPT, 3, drafter, 2)
    assert host["prefill_in_clock"] == NOTHING and host["compile_s"] > 0 and host["ttft_s"] == host["prefill_s"]


def test_speculative_device_loop_accepts_drafts(params, host_greedy, drafter, monkeypatch):
    """A drafter whose first draft is the greedy continuation and second is wrong: every step
    accepts one draft (acceptance length 2), emits two tokens, and the rows end at max_new exactly."""
    import jax.numpy as jnp
    from mk.kernel import speculative as sp
    from mk.model import drafter as mkdrafter
    truth = jnp.asarray(np.concatenate([PROMPT, host_greedy], 1))

    def draft(params, cache, anchor, pos, *, dc, k):
        d = jnp.take_along_axis(truth, jnp.clip(pos[:, None] + 1 + jnp.arange(k)[None], 0, truth.shape[1] - 1), 1)
        return jnp.where(jnp.arange(k)[None] < 1, d, (d + 1) % TINY.vocab).astype(jnp.int32)

    monkeypatch.setattr(mkdrafter, "draft", draft)
    res = sp.device_generate(params, TINY, PROMPT, 8, drafter, 2, chunk=2)
    assert res["tokens"].tolist() == host_greedy[:, :8].tolist() and res["lengths"].tolist() == [8, 8]
    assert res["acceptance"] == [2.0, 2.0] and res["steps"] == 4        # 1 + 4 x 2 tokens, the last one cut


@pytest.mark.extended
@pytest.mark.slow
def test_speculative_device_loop_sampling(params, host_greedy, drafter):
    from mk.kernel import speculative as sp
    kw = dict(temperature=1.5, top_p=0.9, seed=2, chunk=2)
    a = sp.device_generate(params, TINY, PROMPT, 6, drafter, 2, **kw)["tokens"]
    assert sp.device_generate(params, TINY, PROMPT, 6, drafter, 2, **kw)["tokens"].tolist() == a.tolist()
    assert a.tolist() != host_greedy[:, :6].tolist()
    tiny = sp.device_generate(params, TINY, PROMPT, 6, drafter, 2, **dict(kw, top_p=1e-6))["tokens"]
    assert tiny.tolist() == host_greedy[:, :6].tolist()


@pytest.mark.extended
@pytest.mark.slow
def test_speculative_device_loop_on_the_kernel(params, host_greedy, drafter):
    """The kernel's verify step (interpret mode: per-row states, rollback by state_row, aux rows
    copied out) inside the device loop: plain greedy's tokens."""
    from mk.kernel import speculative as sp
    from mk.kernel.step import KernelVerifier
    verifier = KernelVerifier(params, TINY, 2, 2, drafter.aux_layers, ctx=CTX)
    res = sp.device_generate(params, TINY, PROMPT, 5, drafter, 2, ctx=CTX, verifier=verifier, chunk=2)
    assert res["tokens"].tolist() == host_greedy[:, :5].tolist()
    assert res["in_clock"] == NOTHING, res["in_clock"]     # the kernel's outputs are placed on its mesh


def fixed_run(params, drafter, L, **kw):
    """A device loop at fixed acceptance length L, one step per chunk: (result, each step's emitted
    tokens per row)."""
    from mk.kernel import speculative as sp
    pieces = []
    res = sp.device_generate(params, TINY, PROMPT, 1 + 2 * L, drafter, 2, ctx=CTX, chunk=1,
                             fixed_acceptance=L, on_tokens=pieces.append, **kw)
    return res, [(np.asarray(p) >= 0).sum(1).tolist() for p in pieces[1:]]   # pieces[0]: the prefill's token


def test_speculative_device_loop_fixed_acceptance(params, drafter, L=3):
    """--fixed-acceptance-length L on the device: every step emits L tokens per row (L - 1 drafts,
    whatever the drafter said, and the bonus) and the cache's positions advance by L a step."""
    res, per_step = fixed_run(params, drafter, L)
    assert per_step == [[L, L], [L, L]] and res["steps"] == 2
    assert res["positions"].tolist() == [2 * L, 2 * L] and res["lengths"].tolist() == [1 + 2 * L] * 2
    assert res["acceptance"] == [float(L)] * 2 and res["note"].startswith("tokens not meaningful")


def test_speculative_fixed_acceptance_refusals(params, drafter):
    """L outside 1..k + 1 and k beyond the kernel's rows: one-line UserErrors naming the option."""
    from mk.errors import UserError
    from mk.kernel import speculative as sp
    for L in (0, 4):
        with pytest.raises(UserError, match=f"--fixed-acceptance-length must lie in 1..3 .*found {L}"):
            sp.device_generate(params, TINY, PROMPT, 4, drafter, 2, fixed_acceptance=L)
    with pytest.raises(UserError, match=r"--speculative 4: a verify step of batch 2 x \(1 \+ 4\) = 10 rows"):
        sp.device_generate(params, TINY, PROMPT, 4, drafter, 4, fixed_acceptance=2)


@pytest.mark.slow
def test_speculative_device_loop_fixed_acceptance_on_the_kernel(params, drafter):
    """The same on the kernel's verify step (interpret mode): L tokens a step, positions by L."""
    from mk.kernel.step import KernelVerifier
    verifier = KernelVerifier(params, TINY, 2, 2, drafter.aux_layers, ctx=CTX)
    res, per_step = fixed_run(params, drafter, 2, verifier=verifier)
    assert per_step == [[2, 2], [2, 2]] and res["positions"].tolist() == [4, 4]
    assert res["in_clock"] == NOTHING, res["in_clock"]


@pytest.mark.parametrize("number", [0, 7, 2**31 - 1, 2**31, 2**32 + 3])
def test_the_first_token_key_is_prngkey_of_the_seed(number):
    """`loop.seed_word(number)` made into a key inside the first-token program is the key
    `jax.random.PRNGKey(number)` gives on the host (the host loop's), for seeds past int32 too."""
    import jax
    made = jax.jit(jax.random.PRNGKey)(loop.seed_word(number))
    np.testing.assert_array_equal(np.asarray(made), np.asarray(jax.random.PRNGKey(number)))
