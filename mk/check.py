"""Kernel vs reference: run both on the same tokens and measure how far apart they are.

`check(cfg, batch, steps, prefetch_depth)` starts both from empty caches, feeds a random prompt,
then continues with the reference's greedy tokens (both see identical inputs every step), and
compares logits, greedy choices and every cache array after each step. NaN anywhere (either
side's logits or any cache array) is reported by name and fails the run; `verdict(result)` lists
every way a result falls outside the tolerances below (`result["verdict"]` is "pass" or "fail").
"""
from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from mk.config import K3Config
from mk.plan import MK

# ---- the tolerances: the one place they are stated (tests/test_kernel.py imports them) ----------
# Logits are fp32 but depend on hundreds of bf16 roundings; the kernel keeps the reference's
# rounding points and order (most steps are bit-exact), but an occasional fp32 sum-order difference
# flips one bf16 rounding, which then propagates. One bf16 ulp at |x| ~ 4 is 2^-6 = 0.016; we allow
# a few. The logit tolerance is absolute, so it is meaningful only for logits of std ~ 1.
LOGIT_TOL = 0.1                 # max |kernel - reference| over all logits of the run
CACHE_TOL = 0.1                 # max |kernel - reference| over every cache / state array
NEAR_TIE = 0.05                 # a greedy flip is accepted only where the reference's top-2 gap < this
MAX_FLIPS = 1                   # ... and at most this many per run (a near-tie is rare, not routine)
LOGIT_SCALE = (0.5, 5.0)        # the reference logits' std must lie in this open range
PALLAS_CALLS_PER_STEP = 1       # the megakernel: one pallas_call per decode step

TOLERANCES = {"logit_max_abs_err": LOGIT_TOL, "cache_max_abs_err": CACHE_TOL,
              "greedy_flip_ref_margin_below": NEAR_TIE, "greedy_flips_max": MAX_FLIPS,
              "logit_scale_range": list(LOGIT_SCALE), "nan": False, "races": 0,
              "pallas_calls_per_step": PALLAS_CALLS_PER_STEP, "replicated_bit_identical": True}


def verdict(res: dict) -> list[str]:
    """Why a `check` result is outside the tolerances above ([] = it passes)."""
    reasons = []
    if res["nan"]:
        reasons.append(f"NaN in {', '.join(res['nan_arrays'])}")
    if res.get("replicated_diff"):
        reasons.append(f"replicated state differs across devices: {', '.join(res['replicated_diff'][:3])}")
    if res["races"]:
        reasons.append(f"race detector fired in {res['races']} step(s)")
    err = res["max_abs_logit_err"]
    if err is None or not err <= LOGIT_TOL:
        reasons.append(f"max |logit error| {err} > {LOGIT_TOL}")
    err = res["cache_max_abs_err"]
    if err is None or not err <= CACHE_TOL:
        worst = max(res["cache_max_abs_err_by_array"].items(), key=lambda kv: float("inf") if kv[1] is None else kv[1],
                    default=("?", None))
        reasons.append(f"max |cache error| {err} > {CACHE_TOL} (worst: {worst[0]})")
    far = [f for f in res["greedy_flips"] if not f["ref_margin"] < NEAR_TIE]
    if far:
        f = far[0]
        reasons.append(f"{len(far)} greedy flip(s) away from a near-tie (step {f['step']} row {f['row']}: "
                       f"reference top-2 gap {f['ref_margin']:.4f} >= {NEAR_TIE})")
    if len(res["greedy_flips"]) > MAX_FLIPS:
        reasons.append(f"{len(res['greedy_flips'])} greedy flips > {MAX_FLIPS}")
    lo, hi = LOGIT_SCALE
    if not lo < res["logit_scale"] < hi:
        reasons.append(f"reference logit std {res['logit_scale']} outside ({lo}, {hi}): "
                       f"the absolute logit tolerance does not apply")
    if res["pallas_calls_per_step"] != PALLAS_CALLS_PER_STEP:
        reasons.append(f"{res['pallas_calls_per_step']} pallas_calls per step, expected {PALLAS_CALLS_PER_STEP}")
    return reasons


def _max_abs_diff(a, b) -> tuple[float | None, bool, bool]:
    """(max |a - b| or None where NaN makes it undefined, a has NaN, b has NaN); exact for ints."""
    a, b = np.asarray(a), np.asarray(b)
    if np.issubdtype(a.dtype, np.integer) and np.issubdtype(b.dtype, np.integer):
        d = np.abs(a.astype(np.int64) - b.astype(np.int64))
        return float(d.max()) if d.size else 0.0, False, False
    a, b = a.astype(np.float32), b.astype(np.float32)
    a_nan, b_nan = bool(np.isnan(a).any()), bool(np.isnan(b).any())
    if a_nan or b_nan:
        return None, a_nan, b_nan
    d = np.abs(a - b)
    return (float(d.max()) if d.size else 0.0), False, False


def _worst(a: float | None, b: float | None) -> float | None:
    """Running maximum of errors where None (a NaN was compared) stays None: never Python's
    max(0.0, nan) == 0.0."""
    return None if a is None or b is None else max(a, b)


def count_pallas_calls(fn, *args) -> int:
    """Number of pallas_call equations in fn's jaxpr (recursing into sub-jaxprs)."""
    closed = jax.make_jaxpr(fn)(*args)

    def count(jaxpr) -> int:
        n = 0
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                n += 1
                continue
            for v in eqn.params.values():
                subs = v if isinstance(v, (list, tuple)) else [v]
                for s in subs:
                    if hasattr(s, "jaxpr") and hasattr(s.jaxpr, "eqns"):
                        n += count(s.jaxpr)
                    elif hasattr(s, "eqns"):
                        n += count(s)
        return n
    return count(closed.jaxpr)


def races_found() -> bool:
    """Whether TPU interpret mode's race detector flagged anything since it was last reset."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc
    return bool(ipc.races is not None and ipc.races.races_found)


def bf16_scale_ulp(x) -> float:
    """One bf16 ulp at the largest magnitude of x (the array's scale)."""
    m = float(np.max(np.abs(np.asarray(x, np.float32)))) if np.size(x) else 0.0
    return float(2.0 ** (np.floor(np.log2(m)) - 7)) if m > 0 else 2.0 ** -126


def check(cfg: K3Config, batch: int = 1, steps: int = 8, prefetch_depth: int | None = None, *,
          seed: int = 0, ctx: int = 256, detect_races: bool = True, dma_execution_mode: str = "on_wait",
          params=None, prompt_len: int = 3, progress: bool = False, mesh: int = 1,
          experts: str | None = None, all_reduce: str = "one_round", mxfp4_matmul: str = "bf16") -> dict:
    """mesh > 1: the sharded kernel on `mesh` devices against the sharded reference
    (`mk.reference_sharded`) on the same mesh, which rounds its partial sums the same way.

    experts: the kernel's routed-expert format. "mxfp4": packed E2M1 + E8M0 (params from
    `mk.checkpoint.load(..., experts="mxfp4")`, or `mk.params.init` quantized as `mk synth` writes
    it); the reference runs on their dequantization (`mk.checkpoint.dequantize_experts`), the
    oracle. "bf16": bf16 expert tiles. Default: the format `params` holds (bf16 for init params).
    all_reduce: the kernel's all-reduce rounds (`mk.plan.ScheduleOptions.all_reduce`).
    mxfp4_matmul: how MXFP4 experts meet the MXU (`ScheduleOptions.mxfp4_matmul`); the reference
    sums the expert matmuls as the kernel does (`mk.kernel.expert_k_chunk`)."""
    from mk import params as params_mod
    from mk import reference
    from mk.kernel import interpret_params, make_step_fn, on_tpu
    from jax.experimental.pallas import tpu as pltpu

    from mk.checkpoint import dequantize_experts
    from mk.kernel import expert_k_chunk, experts_format

    params = params if params is not None else params_mod.init(cfg, seed)
    experts = experts or experts_format(params)
    if experts == "mxfp4" and experts_format(params) == "bf16":
        from mk.synth import mxfp4_params
        params = mxfp4_params(cfg, seed, params)[0]
    interp = None if on_tpu() else interpret_params(detect_races, dma_execution_mode)
    kw = {"experts": experts, "options": dataclasses.replace(MK, all_reduce=all_reduce, mxfp4_matmul=mxfp4_matmul)}
    if prefetch_depth is not None:
        kw["prefetch_depth"] = prefetch_depth
    step_fn = make_step_fn(params, cfg, batch, ctx=ctx, interpret=interp, mesh=mesh, **kw)
    plan = step_fn.plan
    params = dequantize_experts(params)          # the reference's weights: bf16 (the oracle)
    if mesh > 1:
        from mk import reference_sharded as rs
        ref_params = rs.shard_params(params, step_fn.mesh)
        ref_step = rs.step_fn_for(cfg, step_fn.mesh, expert_k_chunk(plan))
    else:
        ref_params = params
        ref_step = lambda p, c, t: reference.decode_step(p, c, t, cfg=cfg, expert_k_chunk=expert_k_chunk(plan))
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, cfg.vocab, (batch, max(1, min(prompt_len, steps))), dtype=np.int32)

    k_cache = reference.init_cache(cfg, batch, ctx)
    r_cache = reference.init_cache(cfg, batch, ctx)
    n_calls = count_pallas_calls(lambda c, t: step_fn(None, c, t), k_cache, jnp.asarray(prompt[:, 0]))
    worst, scale, greedy, races, cache_err = 0.0, [], True, 0, 0.0
    nan_arrays: list[str] = []                   # "kernel.cache.mla_k (step 3)", first sighting each
    cache_by_array: dict[str, float | None] = {}
    replicated_diff: list[str] = []               # devices whose replicated p differs from device 0's
    cache_ulp: dict[str, float] = {}             # one bf16 ulp at each array's scale (max |value|)
    cache_ulps: dict[str, float] = {}            # worst error in those ulps
    per_step, flips = [], []
    tokens = jnp.asarray(prompt[:, 0])

    def saw_nan(name, step, has):
        if has and not any(n.split(" (")[0] == name for n in nan_arrays):
            nan_arrays.append(f"{name} (step {step})")

    t0 = time.perf_counter()
    it = range(steps)
    if progress:
        from tqdm.auto import tqdm
        it = tqdm(it, desc=f"check B={batch} depth={plan.prefetch_depth}", leave=False, disable=None)
    for s in it:
        if not on_tpu():
            pltpu.reset_tpu_interpret_mode_state()
        k_logits, k_cache = step_fn(None, k_cache, tokens)
        k_logits = np.asarray(k_logits)
        prefix = getattr(step_fn, "last_prefix", None)
        if prefix is not None and prefix.shape[0] > 1:          # replicated state: same bits everywhere
            bits = np.asarray(prefix).view(np.uint16)
            replicated_diff += [f"step {s}: device {d}" for d in range(1, bits.shape[0])
                                if not np.array_equal(bits[d], bits[0])]
        races += int(races_found())
        r_logits, r_cache = ref_step(ref_params, r_cache, tokens)
        r_logits = np.asarray(r_logits)
        err, k_nan, r_nan = _max_abs_diff(k_logits, r_logits)
        saw_nan("kernel.logits", s, k_nan)
        saw_nan("reference.logits", s, r_nan)
        worst = _worst(worst, err)
        scale.append(float(np.std(r_logits)))
        k_arg, r_arg = k_logits.argmax(-1), r_logits.argmax(-1)
        same = bool((k_arg == r_arg).all())
        greedy &= same
        for row in np.flatnonzero(k_arg != r_arg):   # how close the reference itself was to a tie
            flips.append({"step": s, "row": int(row), "ref_margin":
                          float(r_logits[row, r_arg[row]] - r_logits[row, k_arg[row]])})
        c_err = 0.0
        for n in sorted(set(k_cache) | set(r_cache)):    # every cache and state array
            if n not in k_cache or n not in r_cache:
                raise KeyError(f"cache array {n!r} only in the {'kernel' if n in k_cache else 'reference'}'s cache")
            e, k_nan, r_nan = _max_abs_diff(k_cache[n], r_cache[n])
            saw_nan(f"kernel.cache.{n}", s, k_nan)
            saw_nan(f"reference.cache.{n}", s, r_nan)
            cache_by_array[n] = _worst(cache_by_array.get(n, 0.0), e)
            if not (k_nan or r_nan) and n != "pos":
                cache_ulp[n] = max(cache_ulp.get(n, 0.0), bf16_scale_ulp(r_cache[n]))
                cache_ulps[n] = max(cache_ulps.get(n, 0.0), (e or 0.0) / cache_ulp[n])
            c_err = _worst(c_err, e)
        cache_err = _worst(cache_err, c_err)
        per_step.append({"step": s, "max_abs_logit_err": err, "greedy_match": same, "cache_max_abs_err": c_err})
        nxt = s + 1
        tokens = jnp.asarray(prompt[:, nxt]) if nxt < prompt.shape[1] else jnp.asarray(r_logits.argmax(-1), jnp.int32)
    elapsed = time.perf_counter() - t0
    res = {
        "config": plan.config_name(), "experts": experts, "batch": batch, "steps": steps, "prefetch_depth": plan.prefetch_depth,
        "num_slots": plan.num_slots, "max_abs_logit_err": worst, "logit_scale": float(np.mean(scale)),
        "greedy_match": greedy, "greedy_flips": flips, "cache_max_abs_err": cache_err,
        "cache_max_abs_err_by_array": cache_by_array, "cache_max_bf16_ulps_by_array": cache_ulps,
        "cache_scale_ulp": cache_ulp,
        "replicated_bit_identical": not replicated_diff, "replicated_diff": replicated_diff,
        "devices": plan.devices, "all_reduce": plan.options.all_reduce, "mxfp4_matmul": plan.options.mxfp4_matmul,
        "collectives_per_step": plan.collectives_per_step,
        "remote_bytes_per_step": plan.remote_bytes_per_step, "races": races, "nan": bool(nan_arrays),
        "nan_arrays": nan_arrays, "pallas_calls_per_step": n_calls, "dma_execution_mode": dma_execution_mode,
        "detect_races": detect_races, "mode": "compiled (TPU)" if on_tpu() else "TPU interpret mode (CPU)",
        "wall_s": elapsed, "per_step": per_step,
    }
    reasons = verdict(res)
    res.update(verdict="fail" if reasons else "pass", reasons=reasons, tolerances=dict(TOLERANCES))
    return res


def check_speculative(cfg: K3Config, k: int = 3, new_tokens: int = 64, *, mesh: int = 1, prompt_len: int = 100,
                      agree: float = 0.6, seed: int = 0, ctx: int = 256, detect_races: bool = False) -> dict:
    """Greedy speculative decoding through the kernel's verify step against plain greedy decoding.

    One sequence: a random prompt of `prompt_len` tokens (prefilled by the reference), then
    `new_tokens` tokens, k drafts per step from `mk.speculative.AgreeingDrafter`, which proposes
    the plain greedy continuation with probability `agree` per draft (so steps of full, zero and
    partial acceptance all occur, and every rejection rolls the KDA/conv state back by its
    `state_row`). Plain greedy is the oracle: `mk.reference.generate`, on `mesh` devices the
    sharded reference (`mk.reference_sharded`), which rounds as the sharded kernel does.
    Returns {"tokens_equal", "first_difference", "acceptance", "steps", "full", "zero", "partial",
    "positions", "crosses_mla_block", "races", "seconds", "verdict"}."""
    from mk import params as params_mod
    from mk import reference, speculative
    from jax.experimental.pallas import tpu as pltpu

    from mk.kernel import KernelVerifier, interpret_params, on_tpu

    if prompt_len + new_tokens + k + 1 > ctx:
        raise ValueError(f"prompt_len + new_tokens + k + 1 = {prompt_len + new_tokens + k + 1} exceeds ctx {ctx}")
    params = params_mod.init(cfg, seed)
    prompt = np.random.default_rng(seed).integers(0, cfg.vocab, (1, prompt_len), dtype=np.int32)
    t0 = time.perf_counter()
    interp = None if on_tpu() else interpret_params(detect_races)
    verifier = KernelVerifier(params, cfg, 1, k, ctx=ctx, interpret=interp, mesh=mesh)
    if mesh > 1:
        from mk import reference_sharded as rs
        oracle = reference.generate(rs.shard_params(params, verifier.mesh), cfg, prompt, new_tokens, ctx=ctx,
                                    step_fn=rs.step_fn_for(cfg, verifier.mesh))["tokens"]
    else:
        oracle = reference.generate(params, cfg, prompt, new_tokens, ctx=ctx)["tokens"]
    oracle = np.asarray(oracle)
    drafter = speculative.AgreeingDrafter(np.concatenate([prompt, oracle], 1), agree=agree, seed=seed,
                                          vocab=cfg.vocab)
    races = 0

    class Verifier:                      # counts race-detector findings step by step
        def __getattr__(self, name):
            return getattr(verifier, name)

        def verify(self, params, cache, tokens, aux_layers=None):
            nonlocal races
            if not on_tpu():
                pltpu.reset_tpu_interpret_mode_state()
            out = jax.block_until_ready(verifier.verify(params, cache, tokens, aux_layers))
            races += int(races_found())
            return out

    res = speculative.generate(params, cfg, prompt, new_tokens, drafter, k, ctx=ctx, verifier=Verifier(),
                               reference_prefill=True)
    got = np.asarray(res["tokens"])
    acc = [int(a) for a in res["acceptance"][0]]
    diff = np.flatnonzero(got[0] != oracle[0])
    out = {"mesh": mesh, "k": k, "new_tokens": new_tokens,
           "tokens_equal": bool(diff.size == 0), "first_difference": int(diff[0]) if diff.size else None,
           "acceptance": acc, "steps": len(acc), "full": sum(a == k + 1 for a in acc),
           "zero": sum(a == 1 for a in acc), "partial": sum(1 < a <= k for a in acc),
           "positions": [prompt_len, prompt_len + new_tokens - 1],
           "crosses_mla_block": prompt_len // 128 != (prompt_len + new_tokens - 1) // 128,
           "races": races, "seconds": time.perf_counter() - t0}
    out["verdict"] = "pass" if out["tokens_equal"] and not races else "fail"
    return out
