"""Kernel vs reference: run both on the same tokens and measure how far apart they are.

`check(cfg, batch, steps, prefetch_depth)` starts both from empty caches, feeds a random prompt,
then continues with the reference's greedy tokens (both see identical inputs every step), and
compares logits, greedy choices and every cache array after each step.
"""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from mk.config import K3Config


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


def check(cfg: K3Config, batch: int = 1, steps: int = 8, prefetch_depth: int | None = None, *,
          seed: int = 0, ctx: int = 256, detect_races: bool = True, dma_execution_mode: str = "on_wait",
          params=None, prompt_len: int = 3, progress: bool = False) -> dict:
    from mk import params as params_mod
    from mk import reference
    from mk.kernel import interpret_params, make_step_fn, on_tpu
    from jax.experimental.pallas import tpu as pltpu

    params = params if params is not None else params_mod.init(cfg, seed)
    interp = None if on_tpu() else interpret_params(detect_races, dma_execution_mode)
    kw = {} if prefetch_depth is None else {"prefetch_depth": prefetch_depth}
    step_fn = make_step_fn(params, cfg, batch, ctx=ctx, interpret=interp, **kw)
    plan = step_fn.plan
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, cfg.vocab, (batch, max(1, min(prompt_len, steps))), dtype=np.int32)

    k_cache = reference.init_cache(cfg, batch, ctx)
    r_cache = reference.init_cache(cfg, batch, ctx)
    n_calls = count_pallas_calls(lambda c, t: step_fn(None, c, t), k_cache, jnp.asarray(prompt[:, 0]))
    worst, scale, greedy, races, nan, cache_err = 0.0, [], True, 0, False, 0.0
    per_step, flips = [], []
    tokens = jnp.asarray(prompt[:, 0])
    t0 = time.perf_counter()
    it = range(steps)
    if progress:
        from tqdm.auto import tqdm
        it = tqdm(it, desc=f"check B={batch} depth={plan.prefetch_depth}", leave=False)
    for s in it:
        if not on_tpu():
            pltpu.reset_tpu_interpret_mode_state()
        k_logits, k_cache = step_fn(None, k_cache, tokens)
        k_logits = np.asarray(k_logits)
        races += int(races_found())
        r_logits, r_cache = reference.decode_step(params, r_cache, tokens, cfg=cfg)
        r_logits = np.asarray(r_logits)
        err = float(np.max(np.abs(k_logits - r_logits)))
        nan |= bool(np.isnan(k_logits).any())
        worst = max(worst, err)
        scale.append(float(np.std(r_logits)))
        k_arg, r_arg = k_logits.argmax(-1), r_logits.argmax(-1)
        same = bool((k_arg == r_arg).all())
        greedy &= same
        for row in np.flatnonzero(k_arg != r_arg):   # how close the reference itself was to a tie
            flips.append({"step": s, "row": int(row), "ref_margin":
                          float(r_logits[row, r_arg[row]] - r_logits[row, k_arg[row]])})
        c_err = max(float(jnp.max(jnp.abs(k_cache[n].astype(jnp.float32) - r_cache[n].astype(jnp.float32))))
                    for n in ("kda_state", "conv_state", "mla_k", "mla_v"))
        cache_err = max(cache_err, c_err)
        per_step.append({"step": s, "max_abs_logit_err": err, "greedy_match": same, "cache_max_abs_err": c_err})
        nxt = s + 1
        tokens = jnp.asarray(prompt[:, nxt]) if nxt < prompt.shape[1] else jnp.asarray(r_logits.argmax(-1), jnp.int32)
    elapsed = time.perf_counter() - t0
    return {
        "config": plan.config_name(), "batch": batch, "steps": steps, "prefetch_depth": plan.prefetch_depth,
        "num_slots": plan.num_slots, "max_abs_logit_err": worst, "logit_scale": float(np.mean(scale)),
        "greedy_match": greedy, "greedy_flips": flips, "cache_max_abs_err": cache_err, "races": races, "nan": nan,
        "pallas_calls_per_step": n_calls, "dma_execution_mode": dma_execution_mode,
        "detect_races": detect_races, "mode": "compiled (TPU)" if on_tpu() else "TPU interpret mode (CPU)",
        "wall_s": elapsed, "per_step": per_step,
    }
