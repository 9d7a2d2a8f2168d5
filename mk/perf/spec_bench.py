"""`mk bench --mode speculative`: speculative decoding at a fixed acceptance length, timed on one TPU.

    rows = measure_speculative(get_config("k3-chip"), batches=(1, 2), ks=(3, 7))

For each impl and batch B, in one process: plain decoding (`mk.perf.bench.generate_row`: the device
loop `mk.model.loop` and the step's device time from a `jax.profiler` trace), then for each k that
fits the kernel's rows (B x (1 + k) <= MAX_ROWS) and each acceptance length L (default 1..k + 1):
the speculative device loop (`mk.kernel.speculative.device_generate`, its drafter's pass, verify
step, forced acceptance of L - 1 drafts and rollback on the device) with a random drafter
(`mk.model.drafter.config_for`). The tokens are not meaningful at a fixed acceptance length: this
is a speed measurement. Every program is compiled and run once before a clock starts (a warm-up
run of each case; one chunk program serves every L of a (B, k)).

Per case: tokens/s on the wall clock (emitted tokens / decode_s, prefill excluded) and from device
time (the chunk program's device time in a trace of the same run), each beside plain decoding's
(`speedup_device`, `speedup_wall`); the verify step's device time against the decode step's
(`verify_over_decode`), and the drafter's pass (`draft` + `observe`, jitted alone) as a share of a
speculative step's device time (`drafter_share`).

Impls: "kernel" (`mk.kernel.step.KernelVerifier`) and "xla", the fair XLA step (`mk.perf.baseline`):
its plain rows from its decode step, its speculative rows from its verify step
(`mk.perf.baseline.XlaVerifier`: the same step over B x (1 + k) rows, rolled back as the
reference's), with the same drafter, forced acceptance and device loop as the kernel's.
Off a TPU it refuses, like `mk bench`: interpret mode is no speed claim.
"""
from __future__ import annotations

import gc
import glob
import json
import os
import re
import tempfile
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mk.model.config import K3Config
from mk.perf.bench import BenchError, check_mode_options, chip_of_device, generate_row, log, require_tpu

SPEC_IMPLS = ("kernel", "xla")
PROMPT_TOKENS = 4           # the prompt of every row: a short one, as a user types


def cases(batches: Sequence[int], ks: Sequence[int], lengths: Sequence[int] | None) -> list[tuple[int, int, list[int]]]:
    """(B, k, [L, ...]) of every batch and k whose verify step fits the kernel's rows, with each asked
    L in 1..k + 1 (default all of them); a BenchError naming the option where none is left."""
    from mk.kernel.plan import MAX_ROWS, max_drafts
    bad = [b for b in batches if not 1 <= b <= MAX_ROWS]
    if bad or not batches:
        raise BenchError(f"--batch: each batch must lie in 1..{MAX_ROWS}, found {list(batches)}")
    bad = [k for k in ks if k < 1]
    if bad or not ks:
        raise BenchError(f"--speculative: each k must be at least 1 draft, found {list(ks)}")
    if lengths is not None:
        bad = [L for L in lengths if not 1 <= L <= max(ks) + 1]
        if bad or not lengths:
            raise BenchError(f"--acceptance: each length must lie in 1..{max(ks) + 1} (1 + the largest "
                             f"--speculative), found {list(lengths)}")
    out = [(B, k, [L for L in (lengths or range(1, k + 2)) if L <= k + 1])
           for B in batches for k in ks if k <= max_drafts(B)]
    if not out:
        raise BenchError(f"--speculative {','.join(map(str, ks))}: no k fits the kernel's {MAX_ROWS} rows at "
                         f"--batch {','.join(map(str, batches))} (k <= {max_drafts(max(batches))} at batch "
                         f"{max(batches)}, <= {max_drafts(min(batches))} at batch {min(batches)})")
    return out


def program_device_seconds(run: Callable[[], object], runs: int, program: str | None = None) -> float | None:
    """Device seconds of the program that `run()` executes `runs` times (summed over those runs),
    from a `jax.profiler` trace (`mk.perf.trace.step_device_seconds`; with `program`, the last `runs`
    executions of the programs so named, `mk.perf.trace.program_runs_seconds`); None without a
    device plane."""
    from mk.perf.trace import device_event_list, profile_data, program_runs_seconds, step_device_seconds
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            jax.block_until_ready(run())
        files = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
        if not files:
            return None
        events = device_event_list(profile_data(files[0]))
        secs = program_runs_seconds(events, program, runs) if program else step_device_seconds(events, runs)
    return sum(secs) if secs else None


def repeated(fn: Callable, times: int) -> Callable[[], object]:
    """A run of `fn()` `times` times, each output kept (for `program_device_seconds`)."""
    return lambda: [fn() for _ in range(times)]


def drafter_ms(drafter, batch: int, k: int, ctx: int, calls: int = 5) -> float | None:
    """Device ms of one step's drafter pass (`draft` of k tokens then `observe` of 1 + k aux rows),
    jitted as one program and traced alone."""
    from mk.model import drafter as mkdrafter
    dc = drafter.dc

    @jax.jit
    def step(params, cache, anchor, pos, aux):
        drafts = mkdrafter.draft(params, cache, anchor, pos, dc=dc, k=k)
        return drafts, mkdrafter.observe(params, cache, aux, pos, dc=dc)

    cache = mkdrafter.init_cache(dc, batch, ctx)
    args = (drafter.params, cache, jnp.zeros((batch,), jnp.int32), jnp.full((batch,), PROMPT_TOKENS, jnp.int32),
            jnp.zeros((batch, 1 + k, len(dc.aux_layers), dc.target_hidden), jnp.bfloat16))
    jax.block_until_ready(step(*args))                                              # compiles
    s = program_device_seconds(repeated(lambda: step(*args), calls), calls)
    return 1e3 * s / calls if s else None


def verify_ms(verifier, cfg: K3Config, batch: int, k: int, ctx: int, calls: int = 5, *, params=None,
              aux_layers=None, seed: int = 0) -> float | None:
    """Device ms of the verify step alone (`verifier.verify` on `params`, None for a verifier that
    packed its own, with `aux_layers` where given; each call's cache committed at count 0 for the
    next: the step donates its cache), traced. Its B x (1 + k) rows are random token ids drawn from
    `seed`, as a drafter's guesses are distinct tokens: each row routes on its own. (Rows repeating one
    token route as one and stream a decode step's experts: the verify step's cost past a decode step
    is the experts its rows add, `mk simulate --speculative --verify-routing`.)"""
    state = {"cache": verifier.init_cache(batch, ctx)}
    tokens = jnp.asarray(np.random.default_rng(seed).integers(0, cfg.vocab, (batch, 1 + k)), jnp.int32)
    aux = {} if aux_layers is None else {"aux_layers": tuple(aux_layers)}

    def run():                                   # a fresh count: it becomes the cache's state_row, donated next
        logits, block = verifier.verify(params, state["cache"], tokens, **aux)
        state["cache"] = verifier.commit(state["cache"], block, jnp.zeros((batch,), jnp.int32))
        return logits
    jax.block_until_ready(run())                                                    # compiles
    s = program_device_seconds(repeated(run, calls), calls)
    return 1e3 * s / calls if s else None


def speculative_row(params, cfg: K3Config, prompt, drafter, verifier, k: int, L: int, steps: int, chunk: int,
                    ctx: int, programs: dict) -> dict:
    """One (k, L) case: a warm-up run (compiles), a timed run (wall clock), a traced run (device
    time of the chunk program) of `steps` speculative steps at fixed acceptance length L."""
    from mk.kernel.speculative import device_generate
    B = prompt.shape[0]
    run = lambda: device_generate(params, cfg, prompt, 1 + steps * L, drafter, k, ctx=ctx, verifier=verifier,
                                  chunk=chunk, fixed_acceptance=L, programs=programs)
    run()
    res = run()
    emitted = int(res["lengths"].sum()) - B
    dev = program_device_seconds(run, res["chunks"], "speculative_chunk")   # its two layouts' programs
    return {"L": L, "steps": res["steps"], "chunks": res["chunks"], "emitted": emitted,
            "tokens_per_step": res["tokens_per_step"], "decode_s": res["decode_s"], "prefill_s": res["prefill_s"],
            "wall_tok_s": res["tokens_per_s"], "wall_step_ms": 1e3 * res["decode_s"] / max(res["steps"], 1),
            "device_step_ms": 1e3 * dev / max(res["steps"], 1) if dev else None,
            "device_tok_s": emitted / dev if dev else None}


def measure_speculative(cfg: K3Config, batches: Sequence[int] = (1, 2), ks: Sequence[int] = (3, 7),
                        lengths: Sequence[int] | None = None, experts: str = "bf16",
                        impls: Sequence[str] = SPEC_IMPLS, steps: int = 32, chunk: int = 16, *, seed: int = 0,
                        device_steps: int = 5) -> list[dict]:
    """Rows (impl, batch, k, L, experts, ...; see the module doc) of every case on this TPU."""
    from mk.kernel.plan import make_plan
    from mk.kernel.speculative import context_for
    from mk.kernel.step import KernelVerifier
    from mk.model import drafter as mkdrafter
    from mk.model.loop import LoopStep
    from mk.model.params import init_fast
    from mk.perf import baseline
    from mk.perf.bench import _kernel_loop_step

    require_tpu()
    impls = check_mode_options(impls, SPEC_IMPLS, "speculative", experts)
    todo = cases(batches, ks, lengths)
    kmax = max(k for _, k, _ in todo)
    ctx = context_for(PROMPT_TOKENS, 1 + steps * (kmax + 1), kmax)          # one cache size for every case
    chips = chip_of_device(jax.devices()[0].device_kind)
    plan_chip = chips[0] if chips else "v5e"
    t0 = time.perf_counter()
    params = jax.block_until_ready(init_fast(cfg, seed, experts))
    dc = mkdrafter.config_for(cfg)
    drafter = mkdrafter.DSparkDrafter(dc, mkdrafter.init(dc, seed))
    log(f"weights ready ({experts} experts) in {time.perf_counter() - t0:.1f} s; cache {ctx} positions")
    rng = np.random.default_rng(seed)
    prompts = {B: rng.integers(0, cfg.vocab, (B, PROMPT_TOKENS)).astype(np.int32) for B in batches}
    rows = []

    def attempt(fn, row):
        try:
            row.update(fn())
        except Exception as e:                  # a case that does not compile or run: say why, go on
            row["error"] = _error(e)
        log("row " + json.dumps(row, default=float))
        return row

    for impl in impls:
        for B in sorted({B for B, _, _ in todo}):
            base = {"impl": impl, "batch": B, "experts": experts, "error": None}
            if impl == "kernel":
                kcache = {"key": None, "weights": None}
                make_step = lambda: _kernel_loop_step(make_plan(cfg, B, chip=plan_chip, experts=experts, ctx=ctx),
                                                      params, kcache)
            else:
                make_step = lambda: LoopStep(baseline.make_baseline_step(cfg, experts, "loop"), params)
            plain = attempt(lambda: generate_row(make_step(), cfg, B, prompts[B][:, 0], steps, chunk, ctx,
                                                 device_steps, 0), dict(base, k=0, L=1))
            rows.append(plain)
            if impl == "kernel":
                kcache.clear()
                gc.collect()
            for _, k, Ls in [c for c in todo if c[0] == B]:
                verifier, programs = None, {}
                try:                                # its plan, weights and verify step; a failure: each L says why
                    if impl == "kernel":
                        verifier = KernelVerifier(params, cfg, B, k, dc.aux_layers, ctx=ctx, experts=experts)
                        timed = verify_ms(verifier, cfg, B, k, ctx, seed=seed)
                    else:
                        verifier = baseline.XlaVerifier(cfg, experts)
                        timed = verify_ms(verifier, cfg, B, k, ctx, params=params, aux_layers=dc.aux_layers, seed=seed)
                    per_k = {"verify_ms": timed, "drafter_ms": drafter_ms(drafter, B, k, ctx)}
                except Exception as e:
                    per_k = {"error": _error(e)}
                for L in Ls:
                    row = dict(base, k=k, L=L, **per_k)
                    if not row["error"]:
                        row = attempt(lambda: speculative_row(params, cfg, prompts[B], drafter, verifier, k, L, steps,
                                                              chunk, ctx, programs), row)
                    rows.append(finish(row, plain))
                del verifier, programs
                gc.collect()
    return rows


def _error(e: Exception) -> str:
    """A case's failure in one line: the exception's type and first line."""
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0] if msg else ''}"[:300]


def finish(row: dict, plain: dict) -> dict:
    """A speculative row's ratios against plain decoding of the same impl and batch: speedup_device
    and speedup_wall (tokens/s over plain's), verify_over_decode (verify / decode step, device time),
    drafter_share (the drafter's pass over a speculative step, device time)."""
    ratio = lambda a, b: a / b if a and b else None
    row["plain_device_tok_s"], row["plain_wall_tok_s"] = plain.get("device_tok_s"), plain.get("loop_tok_s")
    row["speedup_device"] = ratio(row.get("device_tok_s"), row["plain_device_tok_s"])
    row["speedup_wall"] = ratio(row.get("wall_tok_s"), row["plain_wall_tok_s"])
    row["verify_over_decode"] = ratio(row.get("verify_ms"), plain.get("device_step_ms"))
    row["drafter_share"] = ratio(row.get("drafter_ms"), row.get("device_step_ms"))
    return row


def _f(x, fmt: str, suffix: str = "") -> str:
    """x formatted (then suffix), or "-" right-aligned to the same width where it is None."""
    width = int(re.match(r"\d*", fmt).group() or 0) + len(suffix)
    return "-".rjust(width) if x is None else format(x, fmt) + suffix


def _x(ratio) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def summary(rows: list[dict]) -> str:
    """One line for the record: per batch and k, the kernel's speculative / plain tokens/s (device,
    wall) at each L, at a fixed acceptance length."""
    parts = []
    for (B, k) in dict.fromkeys((r["batch"], r["k"]) for r in rows if r["impl"] == "kernel" and r["k"]):
        got = [r for r in rows if r["impl"] == "kernel" and (r["batch"], r["k"]) == (B, k)]
        ok = [r for r in got if not r.get("error")]
        if not ok:
            parts.append(f"B={B} k={k}: not run")
            continue
        parts.append(f"B={B} k={k}: " + ", ".join(
            f"L={r['L']} {_x(r['speedup_device'])} device / {_x(r['speedup_wall'])} wall" for r in ok)
            + f" of plain (verify {_x(ok[0]['verify_over_decode'])} a decode step, drafter "
              f"{_f(ok[0]['drafter_share'], '.1%')} of a step)")
    return "kernel, at a fixed acceptance length (tokens not meaningful): " + "; ".join(parts)


def format_table(rows: list[dict], meta: dict) -> str:
    lines = [f"{meta['config']} on {meta['device_kind']}, experts {meta['experts']}: speculative decoding at a fixed "
             f"acceptance length (tokens not meaningful; a speed measurement), {meta['steps']} steps a case; "
             f"jax {meta['jax_version']}, {meta['date']}",
             f"{'impl':6s} {'B':>2s} {'k':>2s} {'L':>2s} {'device tok/s':>12s} {'wall tok/s':>10s} {'x plain dev':>11s} "
             f"{'x plain wall':>12s} {'step ms':>8s} {'verify/decode':>13s} {'drafter':>8s}"]
    for r in rows:
        head = f"{r['impl']:6s} {r['batch']:2d} {r['k']:2d} {r['L']:2d}"
        if r.get("error"):
            lines.append(f"{head}  not run: {r['error']}")
        elif r["k"] == 0:
            lines.append(f"{head} {_f(r.get('device_tok_s'), '12.1f')} {_f(r.get('loop_tok_s'), '10.1f')}"
                         f"  (plain decoding; device step {_f(r.get('device_step_ms'), '.3f')} ms)")
        else:
            lines.append(f"{head} {_f(r['device_tok_s'], '12.1f')} {_f(r['wall_tok_s'], '10.1f')} "
                         f"{_f(r['speedup_device'], '10.2f', 'x')} {_f(r['speedup_wall'], '11.2f', 'x')} "
                         f"{_f(r['device_step_ms'], '8.3f')} {_f(r['verify_over_decode'], '12.2f', 'x')} "
                         f"{_f(r['drafter_share'], '8.1%')}")
    return "\n".join(lines)
