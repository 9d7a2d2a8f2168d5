"""Decode on the device: N steps per dispatch, sampling and stop checks on the device, one host sync
per chunk, the next chunk dispatched before the previous one is read.

`mk.model.reference.generate` is the host loop: per token it samples, copies the token to the host
(`np.asarray`) and dispatches the next step, so the device idles for the host's round trip. Here
one jitted `chunk` runs up to N decode steps of any step function in a `lax.while_loop`:

    step(weights, cache, tokens [B] int32) -> (logits [B, V] f32, cache, *extra)

(the kernel's `mk.kernel.decode.make_decode_step`, the fair XLA step `mk.perf.baseline.make_baseline_step`,
the reference `mk.model.reference.decode_step`, the sharded reference) with the cache donated and
kept on the device. Each iteration samples the next token of every row on the device
(`mk.model.reference.sample`: greedy, temperature, top-p; the PRNG key split on the device exactly as
the host loop splits it: with the same logits both draw the same tokens), emits it for rows still running and the pad
value for finished ones, and marks a row done when it emits a stop id or its `max_new` tokens. The
loop ends after N steps or when every row is done. Rows that finished keep stepping (the batch is
one step) on their last token; their positions stay below prompt + max_new <= ctx, the bound the
caller checks.

State between chunks (`LoopState`, small arrays, not donated, readable after the next dispatch):
    tok    [B] int32   the last emitted token (the next step's input)
    key    [2] uint32  the PRNG key
    done   [B] bool
    count  [B] int32   tokens emitted per row (the first comes from prefill's logits)
    max_new [] int32   the per-row limit
    steps  [] int32    decode steps run so far

`generate` drives it: prefill (`prefill_last`), the first token sampled on the device from the last
prompt logits, then chunks, streamed to `on_tokens` as each arrives.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mk.errors import UserError
from mk.model import compile_cache, reference as ref
from mk.model.config import K3Config

DEFAULT_CHUNK = 16
PAD = -1
PREFILL_MODES = ("sequential", "parallel")


class LoopError(UserError):
    """Settings the device loop cannot run; the message names the option."""


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the loop picks tokens: temperature 0 = greedy; top_p the nucleus mass; stop_ids end a row
    (the stop token is emitted); pad is what a finished row emits."""
    temperature: float = 0.0
    top_p: float = 1.0
    stop_ids: tuple[int, ...] = ()
    pad: int = PAD


class LoopStep(NamedTuple):
    """A step function the loop can trace, the weights it reads, and how to put a cache where it runs.

    fn(weights, cache, tokens [B] int32) -> (logits [B, V] f32, cache, *extra); place(cache) -> cache."""
    fn: Callable
    weights: Any
    place: Callable = lambda cache: cache


def reference_step(params: dict, cfg: K3Config) -> LoopStep:
    """The pure-JAX reference decode step (the oracle)."""
    return LoopStep(_reference_fn(cfg), params)


@functools.lru_cache(maxsize=None)
def _reference_fn(cfg: K3Config):
    """One function object per config, so the jitted chunk and prefill programs are reused across runs
    (and, as a `mk.model.compile_cache.Program`, across processes)."""
    return compile_cache.Program(lambda weights, cache, tokens: ref.decode_step(weights, cache, tokens, cfg=cfg),
                                 name="reference_step", identity=repr(cfg))


def loop_step_of(step_fn, params: dict, cfg: K3Config) -> LoopStep:
    """A LoopStep from a `generate`-style `step_fn(params, cache, tokens) -> (logits, cache)`: None =
    the reference; one with a `loop_step` attribute (`mk.kernel.step.make_step_fn`,
    `mk.model.reference_sharded.step_fn_for`) gives it; anything else is traced as it is, on `params`."""
    if step_fn is None:
        return reference_step(params, cfg)
    made = getattr(step_fn, "loop_step", None)
    return made(params) if made is not None else LoopStep(step_fn, params)


# ---- on the device -----------------------------------------------------------------------------

def _is_stop(tok, stop_ids: tuple[int, ...]):
    if not stop_ids:
        return jnp.zeros(tok.shape, bool)
    return jnp.isin(tok, jnp.asarray(stop_ids, jnp.int32))


def first_token(logits, key, max_new, sampling: Sampling) -> dict:
    """The loop state after the first token, drawn on the device from the last prompt logits [B, V]."""
    key, sub = jax.random.split(key)
    tok = ref.sample(logits, sub, sampling.temperature, sampling.top_p)
    count = jnp.ones(tok.shape, jnp.int32)
    max_new = jnp.asarray(max_new, jnp.int32)
    return {"tok": tok, "key": key, "done": _is_stop(tok, sampling.stop_ids) | (count >= max_new), "count": count,
            "max_new": max_new, "steps": jnp.zeros((), jnp.int32)}


def decode_chunk(fn: Callable, weights, cache: dict, state: dict, *, n: int, sampling: Sampling):
    """Up to n decode steps on the device -> (cache, state, tokens [B, n] int32 (pad where a row
    emitted nothing), done [B] bool). Ends early once every row is done."""
    B = state["tok"].shape[0]

    def cond(carry):
        i, _, s, _ = carry
        return (i < n) & ~jnp.all(s["done"])

    def body(carry):
        i, cache, s, out = carry
        with jax.named_scope("decode_step"):
            logits, cache = fn(weights, cache, s["tok"])[:2]
        with jax.named_scope("sample"):
            key, sub = jax.random.split(s["key"])
            nxt = ref.sample(logits, sub, sampling.temperature, sampling.top_p)
            live = ~s["done"]
            count = s["count"] + live.astype(jnp.int32)
            done = s["done"] | (live & _is_stop(nxt, sampling.stop_ids)) | (count >= s["max_new"])
            out = jax.lax.dynamic_update_slice(out, jnp.where(live, nxt, sampling.pad)[:, None], (0, i))
        s = dict(s, tok=jnp.where(live, nxt, s["tok"]), key=key, done=done, count=count, steps=s["steps"] + 1)
        return i + 1, cache, s, out

    out = jnp.full((B, n), sampling.pad, jnp.int32)
    _, cache, state, out = jax.lax.while_loop(cond, body, (jnp.zeros((), jnp.int32), cache, state, out))
    return cache, state, out, state["done"]


def drive(dispatch: Callable, carry: tuple, done: bool, pieces: list, on_tokens=None) -> tuple[tuple, int]:
    """The host's side of a device loop: dispatch(*carry) -> (*carry, tokens [B, n], done [B]) runs one
    chunk; the next chunk goes out before this one's tokens are read, so the device never waits for
    the host. Appends each chunk's tokens to `pieces` (and hands them to on_tokens) until every row
    is done. Returns (the last chunk's carry, chunks read); done: every row was done before the first."""
    chunks, pending = 0, None if done else dispatch(*carry)
    while pending is not None:
        carry, (toks, done_dev) = pending[:-2], pending[-2:]
        chunks += 1
        pending = dispatch(*carry)                # out before this chunk is read
        toks = np.asarray(toks)
        pieces.append(toks)
        if on_tokens is not None:
            on_tokens(toks)
        if np.asarray(done_dev).all():
            break
    if pending is not None:
        jax.block_until_ready(pending[-2])        # the last dispatch (no steps: every row was done)
    return tuple(carry), chunks


def make_chunk(step: LoopStep, n: int, sampling: Sampling):
    """chunk(weights, cache, state) -> (cache, state, tokens [B, n], done [B]), jitted, the cache donated
    (one per step function, chunk size and sampling: compiled programs are reused)."""
    if n < 1:
        raise LoopError(f"--chunk must be at least 1 step, found {n}")
    return _jitted(decode_chunk, step.fn, n=n, sampling=sampling)


@functools.lru_cache(maxsize=32)
def _jitted(body, fn, **static):
    """jax.jit(body(fn, weights, cache, ...)) with the cache donated, one per (body, fn, static); a
    `mk.model.compile_cache.Program` (kept across processes) when `fn` is one."""
    part = functools.partial(body, fn, **static)
    if not isinstance(fn, compile_cache.Program):
        return jax.jit(part, donate_argnums=(1,))
    identity = f"{fn.name}[{fn.identity}] {sorted(static.items())!r}"
    return compile_cache.Program(part, name=body.__name__, identity=identity, donate_argnums=(1,))


@functools.lru_cache(maxsize=32)
def _first_jitted(sampling: Sampling):
    """first(logits, seed, max_new): `first_token` with the key `PRNGKey(seed)` made inside the program
    (eagerly, `PRNGKey` is two programs of its own); `seed_word` gives its argument."""
    return compile_cache.Program(
        lambda logits, seed, max_new: first_token(logits, jax.random.PRNGKey(seed), max_new, sampling),
        name="first_token", identity=repr(sampling))


def seed_word(seed: int) -> np.ndarray:
    """`seed` as the uint32 scalar whose `jax.random.PRNGKey` (traced) is the key `PRNGKey(seed)` gives a
    Python int (with 64-bit types off, as mk runs: [0, seed mod 2^32])."""
    return np.uint32(int(seed) & 0xFFFFFFFF)


# ---- prefill ---------------------------------------------------------------------------------------

def _sequential(fn, weights, cache, tokens):
    """tokens [B, T] one position at a time through the step -> (last logits [B, V], cache). Each
    position is one dispatch of the step's own jitted program (the one a host loop or a trace of the
    step runs: no second compile), queued without a host sync; the columns are cut on the host
    (numpy), so no indexing program is compiled per position."""
    tokens, logits = np.asarray(tokens, np.int32), None
    for t in range(tokens.shape[1]):
        logits, cache = fn(weights, cache, tokens[:, t])[:2]
    return logits, cache


def make_prefill(mode, step: LoopStep, params: dict, cfg: K3Config):
    """prefill(cache, tokens [B, T] int32) -> (logits after each row's last token [B, V] f32, cache).

    "sequential": the decode step over the prompt, token by token (`_sequential`; `mk.model.reference.generate`'s prefill).
    The module `mk.perf.prefill` (the parallel prefill; built from the fair XLA step's layers, it
    lives in the perf layer, so the caller hands it in; anything with its `prefill` and
    `prefill_chunk` will do): the prompt's positions at once on `params` (bf16 or packed MXFP4
    experts); the caches have the reference's layout, which every step shares; not bit-exact with
    the sequential prefill.

    `prefill.rehearsal(tokens)` is the part of a prompt that runs every program the whole prompt
    runs (`rehearse`): the first two positions for the sequential prefill (the first step takes a
    placed cache, later ones a step's), the whole prompt for the parallel one (its last chunk's shape)."""
    if mode == "sequential":
        sequential = lambda cache, tokens: _sequential(step.fn, step.weights, cache, tokens)
        sequential.rehearsal = lambda tokens: tokens[:, :2]
        return sequential
    if not hasattr(mode, "prefill_chunk"):
        raise LoopError(f"--prefill must be one of {', '.join(PREFILL_MODES)}, found {mode!r}")
    from mk.model.params import experts_format
    experts, module = experts_format(params), mode

    def parallel(cache, tokens):
        logits, cache = module.prefill(params, cache, tokens, cfg=cfg, experts=experts)
        return logits[:, -1], step.place(cache)

    parallel.rehearsal = lambda tokens: tokens
    return parallel


def rehearse(run_prefill, first, dispatch, cache: dict, tokens: np.ndarray, key) -> None:
    """Run every program of a `generate` once, untimed, with arguments of the very kinds (shapes,
    dtypes, shardings) the timed run passes, so that jit's own caches hold them when the clock runs
    (compiled here, or loaded from the persistent compilation cache). An ahead-of-time
    `.lower(...).compile()` does not do that: it fills no jit cache, and the arrays a real call
    passes may carry other shardings than the abstract ones it lowered with.

    On a scratch `cache`: the prefill of `run_prefill.rehearsal(tokens)`, the first token with a
    limit of 0 new tokens (every row done: the state the loop's chunks take, with nothing left to
    run), then `warm_chunks`."""
    logits, cache = run_prefill(cache, run_prefill.rehearsal(tokens))
    state = first(logits, key, 0)
    jax.block_until_ready(warm_chunks(dispatch, (cache, state)))


def warm_chunks(dispatch: Callable, carry: tuple) -> tuple:
    """dispatch(*carry) -> (*carry, tokens, done) twice, for a loop whose state (carry[-1]) has every
    row done: a chunk then runs no step and hands its carry back unchanged, so this costs two
    dispatches and compiles both calls a loop makes (the first takes the prefill's carry, later ones
    a chunk's, whose arrays may be laid out otherwise). Returns the carry after them."""
    for _ in range(2):
        carry = dispatch(*carry)[:-2]
    return tuple(carry)


# ---- the host driver ----------------------------------------------------------------------------

def check_run(cfg: K3Config, prompt: np.ndarray, max_new_tokens: int, ctx: int, chunk: int):
    """One line (LoopError) for a run the loop cannot do: ids outside the vocabulary, an empty
    prompt, prompt + max_new_tokens past the cache, a chunk < 1."""
    if chunk < 1:
        raise LoopError(f"--chunk must be at least 1 step, found {chunk}")
    if max_new_tokens < 1:
        raise LoopError(f"--max-new-tokens must be at least 1, found {max_new_tokens}")
    if prompt.ndim != 2 or prompt.shape[1] == 0:
        raise LoopError("the prompt must hold at least one token")
    if prompt.min() < 0 or prompt.max() >= cfg.vocab:
        bad = int(prompt.min()) if prompt.min() < 0 else int(prompt.max())
        raise LoopError(f"token id {bad} outside the vocabulary [0, {cfg.vocab})")
    total = prompt.shape[1] + max_new_tokens
    if total > ctx:
        raise LoopError(f"prompt ({prompt.shape[1]} tokens) + max_new_tokens ({max_new_tokens}) = {total} "
                        f"exceed the cache capacity ctx={ctx}")


def generate(step: LoopStep, cfg: K3Config, prompt, max_new_tokens: int, *, sampling: Sampling = Sampling(),
             seed: int = 0, ctx: int | None = None, chunk: int = DEFAULT_CHUNK, prefill: str = "sequential",
             params: dict | None = None, on_tokens: Callable[[np.ndarray], None] | None = None) -> dict:
    """Generate from prompts [B, T] (or [T]) with the device loop.

    on_tokens(tokens [B, n] int32, pad where a row emitted nothing) is called with the first token
    and then with each chunk as it reaches the host. Returns tokens [B, max emitted] (pad-filled),
    lengths [B] (each row's emitted tokens, a stop id included), and timings: compile_s (`rehearse`:
    every program of the run compiled, or loaded from the persistent cache, and run once, before
    the clock starts), prefill_s and ttft_s (to the first token on the host), decode_s (first token
    to the last chunk on the host), decode_steps, tokens_per_s (tokens emitted after the first /
    decode_s), prefill_tokens_per_s, chunk, chunks; in_clock: what JAX compiled and traced while
    the clock ran (`mk.model.compile_cache.Counts`: all 0 when the rehearsal covered the run);
    rehearsal: the same for the rehearsal (compile_s's programs)."""
    prompt = np.asarray(prompt, np.int32)
    if prompt.ndim == 1:
        prompt = prompt[None]
    B = prompt.shape[0]
    ctx = ctx or max(ref.DEFAULT_CTX, -(-(prompt.shape[1] + max_new_tokens) // 128) * 128)
    check_run(cfg, prompt, max_new_tokens, ctx, chunk)
    run_prefill = make_prefill(prefill, step, params, cfg)
    chunk_fn = make_chunk(step, chunk, sampling)
    first = _first_jitted(sampling)

    dispatch = lambda cache, state: chunk_fn(step.weights, cache, state)
    new_cache = lambda: step.place(ref.init_cache(cfg, B, ctx))
    key = seed_word(seed)                              # PRNGKey(seed), made inside `first`

    t_compile = time.perf_counter()
    with compile_cache.counting() as warm:            # what the rehearsal compiled or loaded
        rehearse(run_prefill, first, dispatch, new_cache(), prompt, key)
        cache = jax.block_until_ready(new_cache())
    compile_s = time.perf_counter() - t_compile

    with compile_cache.counting() as counts:          # the clock's region: no compile expected
        t0 = time.perf_counter()
        logits, cache = run_prefill(cache, prompt)
        state = first(logits, key, max_new_tokens)
        head = np.asarray(state["tok"])[:, None]
        t1 = time.perf_counter()
        pieces = [head]
        if on_tokens is not None:
            on_tokens(head)
        done = np.asarray(state["done"])
        (cache, state), chunks = drive(dispatch, (cache, state), done.all(), pieces, on_tokens)
        steps = int(np.asarray(state["steps"]))
        t2 = time.perf_counter()
    allt = np.concatenate(pieces, axis=1)
    lengths = (allt != sampling.pad).sum(axis=1)
    out = np.full((B, int(lengths.max())), sampling.pad, np.int32)
    for b in range(B):
        row = allt[b][allt[b] != sampling.pad]
        out[b, :row.size] = row
    emitted = int(lengths.sum()) - B
    return {"tokens": out, "lengths": lengths.astype(np.int32), "compile_s": compile_s, "prefill_s": t1 - t0,
            "ttft_s": t1 - t0, "prefill_tokens_per_s": prompt.size / max(t1 - t0, 1e-9), "decode_s": t2 - t1,
            "decode_steps": steps, "tokens_per_s": emitted / max(t2 - t1, 1e-9), "chunk": chunk, "chunks": chunks,
            "ctx": ctx, "in_clock": counts.as_dict(), "rehearsal": warm.as_dict()}


def rows(result: dict) -> list[list[int]]:
    """Each row's emitted tokens (without padding) of a `generate` result."""
    return [[int(t) for t in r[:n]] for r, n in zip(result["tokens"], result["lengths"])]
