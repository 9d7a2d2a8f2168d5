"""Speculative decoding on the reference (spec 4.3): drafts, one verify step, acceptance, rollback.

Per step and row: the anchor (the last emitted token, at position P) and k drafts d_1..d_k are
verified as T = 1 + k rows of one step (`mk.model.reference.verify_step`); `count` leading drafts are
accepted, then a bonus token is taken from the target row `count`; the emitted tokens are
d_1..d_count, bonus (acceptance length count + 1); the next step continues from state_row = count
(`mk.model.reference.commit`) with the bonus as its anchor.

Acceptance: greedy (draft i accepted iff it equals the target's argmax after d_{i-1}), or exact
speculative sampling with temperature / top-p: the target distribution p'_i of verify row i is the
temperature-scaled nucleus (`nucleus_probs`); a draft with proposal q is accepted iff
u < p'(d) / q(d) (q is one-hot for greedy drafters, so u < p'(d)); after a rejection the bonus is
drawn from the residual max(p' - q, 0) renormalised, after full acceptance from p'_k. Uniforms come
from `PRNGKey(seed)` folded with the row and the step's first position: reproducible.

Prefill runs the prompt through the same verify step in blocks of T tokens (the last one padded
with its last token, the padding rolled back), so one compiled step serves the whole run.

The verify step is a `verifier`: `ReferenceVerifier` (mk.model.reference, XLA) or
`mk.kernel.step.KernelVerifier` (the megakernel with 1 + k rows per sequence, per-row KDA states and
state_row rollback, aux rows copied out by the kernel).
"""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from mk.model import reference as ref
from mk.errors import UserError
from mk.kernel.plan import MAX_ROWS, max_drafts  # rows of one step (batch x (1 + k)); the kernel plan's row limit


class SpeculativeError(UserError):
    """Speculative settings that cannot run; the message names the option."""


def check_k(k: int, batch: int = 1):
    """Refuse k drafts per step that are fewer than one or do not fit the kernel's rows at `batch`."""
    if k < 1:
        raise SpeculativeError(f"--speculative must be at least 1 draft, found {k}")
    if k > max_drafts(batch):
        raise SpeculativeError(f"--speculative {k}: a verify step of batch {batch} x (1 + {k}) = "
                               f"{batch * (1 + k)} rows exceeds the {MAX_ROWS} rows a step allows "
                               f"(k <= {max_drafts(batch)} at batch {batch})")


def check_fixed_acceptance(fixed_acceptance: int | None, k: int):
    """Refuse a fixed acceptance length L outside 1..k + 1 (L - 1 accepted drafts of k)."""
    if fixed_acceptance is not None and not 1 <= fixed_acceptance <= k + 1:
        raise SpeculativeError(f"--fixed-acceptance-length must lie in 1..{k + 1} (1 + --speculative), "
                               f"found {fixed_acceptance}")


FIXED_NOTE = ("tokens not meaningful: --fixed-acceptance-length L forces L - 1 accepted drafts every step "
              "(a speed measurement at a chosen acceptance length)")


def context_for(prompt_len: int, max_new_tokens: int, k: int, ctx: int | None = None) -> int:
    """The cache capacity a run needs (drafts and prefill padding may run 2 x (1 + k) past the end):
    `ctx` if given (checked), else the least multiple of 128 >= that, at least DEFAULT_CTX."""
    total = prompt_len + max_new_tokens + 2 * (1 + k)
    ctx = ctx or max(ref.DEFAULT_CTX, -(-total // 128) * 128)
    if total > ctx:
        raise SpeculativeError(f"prompt + max_new_tokens + 2 x (1 + k) = {total} exceed ctx={ctx}")
    return ctx


# ---- target distributions and acceptance -----------------------------------------------------

def nucleus_probs(logits, temperature: float, top_p: float):
    """logits [..., V] -> p' [..., V] f32: softmax(logits / temperature) restricted to the nucleus
    (tokens, in descending order, whose preceding mass is < top_p; at least one), renormalised;
    the same rule as `mk.model.reference.sample`. temperature 0 -> one-hot argmax."""
    logits = jnp.asarray(logits, jnp.float32)
    if temperature <= 0:
        return jax.nn.one_hot(jnp.argmax(logits, -1), logits.shape[-1], dtype=jnp.float32)
    probs = jax.nn.softmax(logits / temperature, axis=-1)
    order = jnp.argsort(-probs, axis=-1)
    sp = jnp.take_along_axis(probs, order, axis=-1)
    keep_sorted = (jnp.cumsum(sp, -1) - sp) < top_p
    keep = jnp.take_along_axis(keep_sorted, jnp.argsort(order, axis=-1), axis=-1)   # back to token order
    kept = jnp.where(keep, probs, 0.0)
    return kept / jnp.sum(kept, -1, keepdims=True)


def accept_greedy(logits, drafts):
    """logits [T, V] (T = 1 + k), drafts [k] -> (count, bonus): leading drafts equal to the target's
    argmax, and the argmax of row count."""
    target = np.argmax(np.asarray(logits), -1)
    k = len(drafts)
    count = 0
    while count < k and int(drafts[count]) == int(target[count]):
        count += 1
    return count, int(target[count])


def accept_sample(p, drafts, u, q=None):
    """Exact speculative sampling for one row. p [T, V] target distributions (rows 0..k), drafts
    [k], u [T, 2] uniforms, q [k, V] proposal distributions (None: one-hot at the drafts) ->
    (count, bonus)."""
    p = np.asarray(p, np.float64)
    k = len(drafts)
    for i in range(k):
        d = int(drafts[i])
        qd = 1.0 if q is None else float(q[i][d])
        if not u[i, 0] < p[i, d] / qd:                  # reject draft i: bonus from the residual
            qi = np.zeros(p.shape[-1]) if q is None else np.asarray(q[i], np.float64)
            if q is None:
                qi[d] = 1.0
            resid = np.maximum(p[i] - qi, 0.0)
            return i, _inverse_cdf(resid / resid.sum(), u[i, 1])
    return k, _inverse_cdf(p[k], u[k, 1])


def _inverse_cdf(probs, u: float) -> int:
    c = np.cumsum(probs)
    return int(min(np.searchsorted(c, u * c[-1], side="right"), len(probs) - 1))


def uniforms(seed: int, row: int, position: int, T: int) -> np.ndarray:
    """[T, 2] uniforms for one row's step starting at `position` (reproducible)."""
    key = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(seed), row), position)
    return np.asarray(jax.random.uniform(key, (T, 2)), np.float64)


# ---- drafters for tests ----------------------------------------------------------------------

class AgreeingDrafter:
    """Test drafter: knows a reference continuation `truth` [B, N] (token at each position) and
    proposes it with probability `agree` per draft (else a wrong token), so acceptance can be set.
    `schedule`, if given, fixes how many leading drafts agree at each step instead (then cycles):
    k = full acceptance, 0 = forced rejection of every draft. `aux_layers` only chooses which aux
    rows the verify step returns (unused here; lets a test share one compiled verify step)."""

    def __init__(self, truth, agree: float = 1.0, seed: int = 0, schedule=None, vocab: int | None = None,
                 aux_layers: tuple[int, ...] = ()):
        self.aux_layers = tuple(aux_layers)
        self.truth = np.asarray(truth)
        self.agree, self.seed, self.schedule = agree, seed, schedule
        self.vocab = vocab or int(self.truth.max()) + 2
        self.step = 0

    def start(self, batch, ctx):
        self.step = 0
        return None

    def observe(self, state, aux, pos):
        return state

    def propose(self, state, anchor, pos, k):
        B = len(anchor)
        out = np.zeros((B, k), np.int32)
        for b in range(B):
            want = [int(self.truth[b, min(pos[b] + 1 + i, self.truth.shape[1] - 1)]) for i in range(k)]
            if self.schedule is not None:
                n = self.schedule[self.step % len(self.schedule)]
                ok = [i < n for i in range(k)]
            else:
                rng = np.random.default_rng([self.seed, b, int(pos[b])])
                ok = list(rng.random(k) < self.agree)
            out[b] = [w if o else (w + 1) % self.vocab for w, o in zip(want, ok)]
        self.step += 1
        return out


# ---- verify backends -------------------------------------------------------------------------

class ReferenceVerifier:
    """The verify step on `mk.model.reference` (XLA). A verifier has `init_cache(batch, ctx)`,
    `adopt(reference_cache)` (its own layout from the reference's), `verify(params, cache, tokens
    [B, 1 + k], aux_layers) -> (logits [B, 1 + k, V], block)` with block["aux"] [B, 1 + k, n, d],
    and `commit(cache, block, count) -> cache`; the kernel's is `mk.kernel.step.KernelVerifier`."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.identity = f"ReferenceVerifier[{cfg!r}]"      # decides `traced` (a Program's identity)

    def init_cache(self, batch: int, ctx: int) -> dict:
        return ref.init_cache(self.cfg, batch, ctx)

    def adopt(self, cache: dict) -> dict:
        return cache

    def verify(self, params, cache, tokens, aux_layers):
        return ref.verify_step(params, cache, jnp.asarray(tokens, jnp.int32), cfg=self.cfg, aux_layers=tuple(aux_layers))

    def commit(self, cache, block, count):
        return ref.commit(cache, block, jnp.asarray(count, jnp.int32))

    def traced(self, params, aux_layers):
        """(weights, verify(weights, cache, tokens) -> (logits, block), commit(cache, block, count)),
        traceable, for `device_generate`."""
        verify = lambda w, c, t: ref.verify_step(w, c, t, cfg=self.cfg, aux_layers=tuple(aux_layers))
        return params, verify, ref.commit


# ---- the loop --------------------------------------------------------------------------------

def generate(params, cfg, prompt, max_new_tokens: int, drafter, k: int, *, temperature: float = 0.0,
             top_p: float = 1.0, seed: int = 0, ctx: int | None = None, fixed_acceptance: int | None = None,
             verifier=None, reference_prefill: bool = False, keep_logits: bool = False) -> dict:
    """Speculative generation from prompts [B, T0] (or [T0]). Returns tokens [B, max_new_tokens],
    `acceptance` (one list per row: acceptance length of every step), `steps`, `mean_acceptance`,
    `tokens_per_step`, `prefill_s` (= `ttft_s`: to the first token on the host), `decode_s`,
    `tokens_per_s` (emitted tokens / decode time), `compile_s` (the prefill rehearsed before the
    clock, `prefill_program`) and `prefill_in_clock` (what JAX compiled while the prefill's clock
    ran, `mk.model.compile_cache.Counts`: 0; the host loop's decode compiles its step programs as it
    goes, on its clock, as `mk.model.reference.generate` does).

    `fixed_acceptance` L forces count = L - 1 every step (speed at a chosen acceptance length; the
    tokens are then not meaningful). `verifier` runs the verify steps (`ReferenceVerifier`, the
    default, or `mk.kernel.step.KernelVerifier`). `reference_prefill`: the prompt runs through the
    reference's verify step and its cache is handed to the verifier (`verifier.adopt`), so a
    kernel in interpret mode spends its time on the generated tokens only. `keep_logits`: also return
    "emitted_logits", per row the verify step's logits [max_new_tokens - 1, vocab] f32 that chose each
    emitted token after the first (the first is the prefill's).
    """
    prompt = _prompt_rows(prompt)
    B, T0 = prompt.shape
    check_k(k, B)
    check_fixed_acceptance(fixed_acceptance, k)
    T = 1 + k
    ctx = context_for(T0, max_new_tokens, k, ctx)
    ref._check_tokens(prompt, cfg, ctx)
    aux_layers = tuple(drafter.aux_layers)
    verifier = verifier or ReferenceVerifier(cfg)
    prefiller = ReferenceVerifier(cfg) if reference_prefill else verifier

    from mk.model.compile_cache import counting
    run_prefill = prefill_program(params, drafter, k, verifier, prefiller, temperature, top_p, seed)
    new_caches = lambda: (prefiller.init_cache(B, ctx), drafter.start(B, ctx))
    t_compile = time.perf_counter()                  # the prefill's programs, on scratch caches
    jax.block_until_ready(run_prefill(new_caches(), run_prefill.rehearsal(prompt)))
    caches = jax.block_until_ready(new_caches())
    compile_s = time.perf_counter() - t_compile

    with counting() as compiled:                     # the prefill's clock: nothing left to compile
        t0 = time.perf_counter()
        (anchor, pos), (cache, dstate) = run_prefill(caches, prompt)
        t1 = time.perf_counter()

    out = [[int(a)] for a in anchor]
    acceptance: list[list[int]] = [[] for _ in range(B)]
    kept: list[list[np.ndarray]] = [[] for _ in range(B)]   # keep_logits: the rows that chose each token
    steps = 0
    while min(len(o) for o in out) < max_new_tokens:
        drafts = np.asarray(drafter.propose(dstate, anchor, pos, k), np.int32)
        tokens = np.concatenate([anchor[:, None], drafts], 1)
        logits, block = verifier.verify(params, cache, jnp.asarray(tokens), aux_layers)
        logits = np.asarray(logits)
        counts, bonus = np.zeros(B, np.int32), np.zeros(B, np.int32)
        for b in range(B):
            if temperature <= 0:
                counts[b], bonus[b] = accept_greedy(logits[b], drafts[b])
            else:
                p = np.asarray(nucleus_probs(logits[b], temperature, top_p))
                counts[b], bonus[b] = accept_sample(p, drafts[b], uniforms(seed, b, int(pos[b]), T))
            if fixed_acceptance is not None:
                counts[b] = fixed_acceptance - 1
                bonus[b] = int(np.argmax(logits[b, counts[b]]))
            out[b] += [int(x) for x in drafts[b, :counts[b]]] + [int(bonus[b])]
            if keep_logits:
                kept[b] += list(logits[b, :counts[b] + 1].astype(np.float32))
            acceptance[b].append(int(counts[b]) + 1)
        if aux_layers:
            dstate = drafter.observe(dstate, block["aux"], pos)
        cache = verifier.commit(cache, block, jnp.asarray(counts))
        pos = pos + counts + 1
        anchor = bonus
        steps += 1
    jax.block_until_ready(cache["pos"])
    t2 = time.perf_counter()
    emitted = sum(len(o) - 1 for o in out)         # the first token came from prefill
    flat = [a for row in acceptance for a in row]
    res = {"tokens": np.asarray([o[:max_new_tokens] for o in out], np.int32), "acceptance": acceptance,
           "steps": steps, "mean_acceptance": float(np.mean(flat)) if flat else 0.0,
           "tokens_per_step": emitted / max(steps, 1) / B, "prefill_s": t1 - t0, "ttft_s": t1 - t0,
           "decode_s": t2 - t1, "tokens_per_s": emitted / max(t2 - t1, 1e-9), "ctx": ctx, "compile_s": compile_s,
           "prefill_in_clock": compiled.as_dict()}
    if keep_logits:
        res["emitted_logits"] = [np.stack(k)[:max_new_tokens - 1] for k in kept]
    return res


def _prefill(params, prompt, drafter, k, verifier, prefiller, temperature, top_p, seed, cache, dstate):
    """The prompt [B, T0] through the verify step in blocks of 1 + k tokens, from empty caches
    (`cache` in `prefiller`'s layout, `dstate` the drafter's) -> (cache, drafter state, first tokens
    [B], their position [B]); the cache in `verifier`'s layout."""
    B, T0 = prompt.shape
    T = 1 + k
    aux_layers = tuple(drafter.aux_layers)
    for s in range(0, T0, T):                      # prefill: blocks of T prompt tokens
        chunk = prompt[:, s:s + T]
        real = chunk.shape[1]
        chunk = np.concatenate([chunk, np.repeat(chunk[:, -1:], T - real, 1)], 1)
        pos = np.asarray(cache["pos"])
        logits, block = prefiller.verify(params, cache, jnp.asarray(chunk), aux_layers)
        if aux_layers:
            dstate = drafter.observe(dstate, block["aux"], pos)
        cache = prefiller.commit(cache, block, jnp.full((B,), real - 1, jnp.int32))
    if prefiller is not verifier:
        cache = verifier.adopt(cache)
    last = np.asarray(logits)[:, real - 1]         # cut on the host: no indexing program per prompt length
    pos = np.asarray(cache["pos"])                 # = T0: the first generated token's position
    anchor = np.asarray([_first_token(last[b], temperature, top_p, seed, b, int(pos[b])) for b in range(B)])
    jax.block_until_ready(cache["pos"])
    return cache, dstate, anchor, pos


def prefill_program(params, drafter, k: int, verifier, prefiller, temperature: float, top_p: float, seed: int):
    """`_prefill` as `mk.model.loop.rehearse` takes a prefill: run(caches, prompt [B, T0]) ->
    ((first tokens [B], their position [B]), (cache, drafter state)), caches = (an empty cache in
    `prefiller`'s layout, the drafter's `start` state). `run.rehearsal(prompt)`: the first two blocks
    of 1 + k tokens, which run every program the whole prompt runs (the first block's verify takes
    a fresh cache, later ones a committed one; the first token is drawn on the host), so a
    rehearsal on scratch caches leaves nothing to compile for the timed prefill."""
    def run(caches, prompt):
        cache, dstate, anchor, pos = _prefill(params, prompt, drafter, k, verifier, prefiller, temperature, top_p,
                                              seed, *caches)
        return (anchor, pos), (cache, dstate)

    run.rehearsal = lambda prompt: prompt[:, :2 * (1 + k)]
    return run


# ---- on the device ---------------------------------------------------------------------------

def accept_on_device(logits, drafts, pos, temperature: float, top_p: float, seed: int):
    """`accept_greedy` / `accept_sample` (one-hot proposals) for every row at once, traceable:
    logits [B, 1 + k, V], drafts [B, k], pos [B] (each row's step position: its uniforms are
    `uniforms(seed, row, pos)`) -> (count [B], bonus [B]) int32. Sampling runs in f32 here (the
    host loop's residual draw in f64 may differ in a rare last bit)."""
    B, T, V = logits.shape
    k = T - 1
    if temperature <= 0:
        target = jnp.argmax(logits, -1).astype(jnp.int32)
        count = jnp.sum(jnp.cumprod((drafts == target[:, :k]).astype(jnp.int32), 1), 1)
        return count, jnp.take_along_axis(target, count[:, None], 1)[:, 0]
    p = nucleus_probs(logits, temperature, top_p)                                       # [B, T, V]
    base = jax.random.PRNGKey(seed)
    u = jax.vmap(lambda b, q: jax.random.uniform(jax.random.fold_in(jax.random.fold_in(base, b), q), (T, 2)))(
        jnp.arange(B), pos)                                                            # [B, T, 2]
    pd = jnp.take_along_axis(p[:, :k], drafts[..., None], -1)[..., 0]                  # [B, k]
    count = jnp.sum(jnp.cumprod((u[:, :k, 0] < pd).astype(jnp.int32), 1), 1)
    r = jnp.take_along_axis(p, count[:, None, None], 1)[:, 0]                          # [B, V]
    d = jnp.take_along_axis(jnp.pad(drafts, ((0, 0), (0, 1))), count[:, None], 1)[:, 0]
    resid = jnp.maximum(r - jnp.where((count < k)[:, None], jax.nn.one_hot(d, V, dtype=r.dtype), 0.0), 0.0)
    c = jnp.cumsum(resid, -1)
    x = jnp.take_along_axis(u[:, :, 1], count[:, None], 1)[:, 0] * c[:, -1]
    bonus = jnp.minimum(jnp.sum(c <= x[:, None], -1), V - 1).astype(jnp.int32)          # searchsorted, right
    return count, bonus


def force_acceptance(logits, fixed_acceptance):
    """The acceptance of a speed measurement at acceptance length L = fixed_acceptance (an int or a
    traced int32 scalar), traceable: logits [B, 1 + k, V] -> (count [B] = L - 1, bonus [B] = the
    argmax of verify row L - 1), int32; the drafts are taken whatever they are, so the tokens are
    not meaningful (`FIXED_NOTE`)."""
    count = jnp.full(logits.shape[:1], fixed_acceptance - 1, jnp.int32)
    row = jnp.take_along_axis(logits, count[:, None, None], 1)[:, 0]
    return count, jnp.argmax(row, -1).astype(jnp.int32)


def speculative_chunk(verify, commit, dc, weights, dparams, cache, dcache, s, *, n: int, k: int,
                      aux: bool, temperature: float, top_p: float, seed: int, stop_ids: tuple[int, ...], pad: int,
                      fixed: bool = False):
    """Up to n draft-verify-accept steps on the device -> (cache, dcache, state, tokens [B, n (1 + k)]
    int32 (each row's emitted tokens first, then pad), done [B]). fixed: every step accepts
    state["fixed"] - 1 drafts (`force_acceptance`; a traced length, so one program serves every
    L) instead of the acceptance rule.

    state: anchor [B], pos [B], done [B], count [B] (tokens emitted), max_new [], steps [],
    accepted [B] (sum of acceptance lengths), row_steps [B], fixed [] (the fixed acceptance length). A row emits its accepted drafts and the
    bonus, cut at a stop id (emitted) or at max_new. A done row keeps its position (the rows step
    together; its states are then not used again), so positions stay within prompt + max_new + 2(1 + k)."""
    from mk.model import drafter as mkdrafter
    from mk.model.loop import _is_stop
    B, T = s["anchor"].shape[0], 1 + k
    W = n * T
    j = jnp.arange(T)

    def cond(c):
        return (c[0] < n) & ~jnp.all(c[3]["done"])

    def body(c):
        i, cache, dcache, s, out, written = c
        live = ~s["done"]
        with jax.named_scope("draft"):
            drafts = mkdrafter.draft(dparams, dcache, s["anchor"], s["pos"], dc=dc, k=k)
        with jax.named_scope("verify"):
            logits, block = verify(weights, cache, jnp.concatenate([s["anchor"][:, None], drafts], 1))
        with jax.named_scope("accept"):
            if fixed:
                count, bonus = force_acceptance(logits, s["fixed"])
            else:
                count, bonus = accept_on_device(logits, drafts, s["pos"], temperature, top_p, seed)
            if aux:
                dcache = mkdrafter.observe(dparams, dcache, block["aux"], s["pos"], dc=dc)
            cache = commit(cache, block, count)
            cache["pos"] = jnp.where(live, cache["pos"], s["pos"])
            em = jnp.where(j[None] < count[:, None], jnp.pad(drafts, ((0, 0), (0, 1))), bonus[:, None])   # [B, T]
            stop = _is_stop(em, stop_ids) & (j[None] <= count[:, None])
            first_stop = jnp.where(stop.any(1), jnp.argmax(stop, 1), T)
            n_emit = jnp.minimum(jnp.minimum(count + 1, s["max_new"] - s["count"]), first_stop + 1)
            n_emit = jnp.where(live, n_emit, 0)
            idx = jnp.where(j[None] < n_emit[:, None], written[:, None] + j[None], W)
            out = out.at[jnp.arange(B)[:, None], idx].set(em, mode="drop")
            emitted = s["count"] + n_emit
            done = s["done"] | (live & ((emitted >= s["max_new"]) | (first_stop < n_emit)))
        s = dict(s, anchor=jnp.where(live, bonus, s["anchor"]), pos=cache["pos"], done=done, count=emitted,
                 steps=s["steps"] + 1, accepted=s["accepted"] + jnp.where(live, count + 1, 0),
                 row_steps=s["row_steps"] + live.astype(jnp.int32))
        return i + 1, cache, dcache, s, out, written + n_emit

    out = jnp.full((B, W), pad, jnp.int32)
    _, cache, dcache, s, out, _ = jax.lax.while_loop(
        cond, body, (jnp.zeros((), jnp.int32), cache, dcache, s, out, jnp.zeros((B,), jnp.int32)))
    return cache, dcache, s, out, s["done"]


def device_generate(params, cfg, prompt, max_new_tokens: int, drafter, k: int, *, temperature: float = 0.0,
                    top_p: float = 1.0, seed: int = 0, ctx: int | None = None, verifier=None, chunk: int = 16,
                    stop_ids=(), on_tokens=None, fixed_acceptance: int | None = None,
                    programs: dict | None = None) -> dict:
    """`generate` with the draft-verify-accept steps on the device (`speculative_chunk`, up to
    `chunk` steps per dispatch, the next dispatched before the previous is read, as `mk.model.loop`).
    drafter: a `mk.model.drafter.DSparkDrafter` (its JAX functions run inside the loop); verifier:
    `ReferenceVerifier` (default) or `mk.kernel.step.KernelVerifier`. Prefill and the first token as
    `generate`. Returns tokens [B, max emitted] (pad -1), lengths, acceptance means and timings as
    `generate` (acceptance: mean length per row), plus chunk, chunks, compile_s (every program of
    the run, the prefill's, the first token's and the chunk's, run once before the clock on scratch
    caches: `mk.model.loop.rehearse` with `prefill_program`) and in_clock (what JAX compiled while
    the clock ran, prefill and decode, `mk.model.compile_cache.Counts`: all 0).

    fixed_acceptance L (1..k + 1): every step on the device accepts L - 1 drafts, emits them and the
    bonus, and rolls the cache forward by L (speed at a chosen acceptance length; the tokens are not
    meaningful, and the result's "note" says so). programs: a dict the caller keeps across calls with
    the same verifier (`mk bench --mode speculative`): the jitted chunk is made once per setting (one
    for every fixed L: L is an input), so a warm-up run compiles what a timed run reuses."""
    import functools
    from mk.model.compile_cache import Program, counting
    from mk.model.loop import PAD, drive, rehearse
    prompt = _prompt_rows(prompt)
    B, T0 = prompt.shape
    if chunk < 1:
        raise SpeculativeError(f"--chunk must be at least 1 step, found {chunk}")
    check_k(k, B)
    check_fixed_acceptance(fixed_acceptance, k)
    ctx = context_for(T0, max_new_tokens, k, ctx)
    ref._check_tokens(prompt, cfg, ctx)
    verifier = verifier or ReferenceVerifier(cfg)
    aux_layers = tuple(drafter.aux_layers)
    weights, verify, commit = verifier.traced(params, aux_layers)
    stop_ids = tuple(int(t) for t in stop_ids)
    static = dict(n=chunk, k=k, aux=bool(aux_layers), temperature=temperature, top_p=top_p, seed=seed,
                  stop_ids=stop_ids, pad=PAD, fixed=fixed_acceptance is not None)
    programs = {} if programs is None else programs
    key = (drafter.dc, *sorted(static.items()))
    if key not in programs:
        chunk_fn = functools.partial(speculative_chunk, verify, commit, drafter.dc, **static)
        identity = getattr(verifier, "identity", None)      # kept across processes where the verifier says what it is
        programs[key] = (jax.jit(chunk_fn, donate_argnums=(2, 3)) if identity is None else Program(
            chunk_fn, name="speculative_chunk", donate_argnums=(2, 3),
            identity=f"{identity} aux_layers={aux_layers!r} {drafter.dc!r} {sorted(static.items())!r}"))
    fn = programs[key]

    fixed = jnp.asarray(fixed_acceptance or 0, jnp.int32)

    def first(head_pos, _key, max_new):
        """The loop state after the prefill's first tokens (`mk.model.loop.first_token`'s part): a
        limit of max_new tokens a row (0: every row done, `rehearse`'s)."""
        anchor, pos = head_pos
        done = np.isin(anchor, stop_ids) | (max_new <= 1)
        return {"anchor": jnp.asarray(anchor.astype(np.int32)), "pos": jnp.asarray(pos, jnp.int32),
                "done": jnp.asarray(done), "count": jnp.ones((B,), jnp.int32),
                "max_new": jnp.asarray(max_new, jnp.int32), "steps": jnp.zeros((), jnp.int32),
                "accepted": jnp.zeros((B,), jnp.int32), "row_steps": jnp.zeros((B,), jnp.int32), "fixed": fixed}

    def dispatch(caches, s):                         # the carry of `mk.model.loop`: (caches, state)
        cache, dcache, s, toks, done = fn(weights, drafter.params, *caches, s)
        return (cache, dcache), s, toks, done

    run_prefill = prefill_program(params, drafter, k, verifier, verifier, temperature, top_p, seed)
    new_caches = lambda: (verifier.init_cache(B, ctx), drafter.start(B, ctx))
    t_compile = time.perf_counter()   # prefill, first token and chunk rehearsed on scratch caches, before the clock
    rehearse(run_prefill, first, dispatch, new_caches(), prompt, None)
    caches = jax.block_until_ready(new_caches())
    compile_s = time.perf_counter() - t_compile
    with counting() as counts:                       # the clock's region: no compile expected
        t0 = time.perf_counter()
        head_pos, caches = run_prefill(caches, prompt)
        state = first(head_pos, None, max_new_tokens)
        head = head_pos[0].astype(np.int32)[:, None]
        t1 = time.perf_counter()
        pieces = [head]
        if on_tokens is not None:
            on_tokens(head)
        done = np.isin(head[:, 0], stop_ids) | (max_new_tokens <= 1)
        t_decode = time.perf_counter()
        (caches, state), chunks = drive(dispatch, (caches, state), done.all(), pieces, on_tokens)
        t2 = time.perf_counter()
    rows = [[int(t) for t in np.concatenate([p[b] for p in pieces]) if t != PAD] for b in range(B)]
    lengths = np.asarray([len(r) for r in rows], np.int32)
    tokens = np.full((B, int(lengths.max())), PAD, np.int32)
    for b, r in enumerate(rows):
        tokens[b, :len(r)] = r
    accepted, row_steps = np.asarray(state["accepted"]), np.asarray(state["row_steps"])
    steps = int(np.asarray(state["steps"]))
    emitted = int(lengths.sum()) - B
    return {"tokens": tokens, "lengths": lengths, "steps": steps,
            "acceptance": [float(a) / max(int(n), 1) for a, n in zip(accepted, row_steps)],
            "mean_acceptance": float(accepted.sum()) / max(int(row_steps.sum()), 1),
            "tokens_per_step": emitted / max(steps, 1) / B, "prefill_s": t1 - t0, "ttft_s": t1 - t0,
            "decode_s": t2 - t_decode, "tokens_per_s": emitted / max(t2 - t_decode, 1e-9), "ctx": ctx,
            "chunk": chunk, "chunks": chunks, "compile_s": compile_s, "in_clock": counts.as_dict(),
            "positions": np.asarray(state["pos"]) - T0, "fixed_acceptance": fixed_acceptance,
            **({"note": FIXED_NOTE} if fixed_acceptance is not None else {})}



def _prompt_rows(prompt) -> np.ndarray:
    """prompt [T] or [B, T] token ids -> [B, T] int32; refuses an empty prompt."""
    prompt = np.asarray(prompt, np.int32)
    prompt = prompt[None] if prompt.ndim == 1 else prompt
    if prompt.shape[1] == 0:
        raise SpeculativeError("the prompt must hold at least one token")
    return prompt

def _first_token(logits, temperature, top_p, seed, row, position) -> int:
    """The token after the prompt: greedy, or drawn from p' with this row/position's uniform."""
    if temperature <= 0:
        return int(np.argmax(logits))
    p = np.asarray(nucleus_probs(logits, temperature, top_p), np.float64)
    return _inverse_cdf(p, uniforms(seed, row, position, 1)[0, 1])
