"""Kernel vs reference: run both on the same tokens and measure how far apart they are.

`check(cfg, batch, steps, prefetch_depth)` starts both from empty caches, feeds a random prompt,
then continues with the reference's greedy tokens (both see identical inputs every step), and
compares logits, greedy choices and every cache array after each step. NaN anywhere (either
side's logits or any cache array) is reported by name and fails the run; `verdict(result)` lists
every way a result falls outside the tolerances below (`result["verdict"]` is "pass" or "fail").

Three policies, one per place the kernel runs:
- CPU (TPU interpret mode), default: the tolerances below (a few bf16 ulps, rare near-tie flips).
- CPU, `exact=True`: every logit and every cache element bit-identical to the reference, greedy
  tokens equal. What mk claims on CPU (README, docs/numerics.md); tests use it where they claim it.
- TPU (compiled): the CPU reference is the oracle (bit-exact with the interpreted kernel); the
  compiled kernel and the XLA reference on the same chip both run from the oracle's cache each step
  (resynchronised) and the kernel passes when it is no further from the oracle than XLA on the chip
  is, up to `CHIP_FACTOR` (`check_on_chip`, `chip_verdict`).
"""
from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from mk.model.config import K3Config
from mk.errors import UserError
from mk.kernel.plan import MK
from mk.kernel.schedule import collectives_per_step, remote_bytes_per_step

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


# ---- on a TPU: the kernel against XLA on the same chip, both against the CPU oracle -------------
CHIP_FACTOR = 2.0               # kernel's distance from the oracle <= CHIP_FACTOR x XLA-on-chip's + floor
CHIP_ULP_FLOOR = 2              # ... floor: this many bf16 ulps at the array's scale (logits: at |x| = 4)
ROUTE_NEAR_TIE = 0.005          # a row whose oracle routing margin (score + bias, k-th vs k+1-th) is below
#                                 this in some MoE layer may pick another expert on the chip: the row is
#                                 reported and left out of that step's comparison
CHIP_TOLERANCES = {"factor_vs_xla_on_chip": CHIP_FACTOR, "floor_bf16_ulps": CHIP_ULP_FLOOR,
                   "route_near_tie_margin": ROUTE_NEAR_TIE, "greedy_flip_ref_margin_below": NEAR_TIE,
                   "nan": False, "pallas_calls_per_step": PALLAS_CALLS_PER_STEP}


# ---- on CPU, two implementations that sum in different orders (docs/numerics.md, "When the order differs")
# Neither is wrong: an fp32 sum in another order now and then flips one bf16 rounding, and each layer a
# value passes through may add such flips. So a value may be ORDER_ULPS_PER_LAYER bf16 ulps at its
# array's scale off per layer it has passed through. A routing near tie (ROUTE_NEAR_TIE on the oracle)
# can pick another expert: what the tied token writes (its logits, its MLA cache slots, and the
# recurrent KDA and conv states of its row, which carry it on) is compared separately, within TIE_SHARE
# of the array's scale. A bug (a wrong decay, a dropped expert, a transposed tile) moves values by
# their own scale at most positions.
ORDER_ULPS_PER_LAYER = 2
TIE_SHARE = 0.5


def route_ties(margins) -> np.ndarray:
    """The oracle's routing margins [..., n_moe] -> bool [...]: a near tie in some MoE layer."""
    return (np.asarray(margins) < ROUTE_NEAR_TIE).any(axis=-1)


def order_bound(want, depth: int) -> float:
    """The rule's bound for a value `depth` layers deep: ORDER_ULPS_PER_LAYER x depth bf16 ulps at want's scale."""
    return ORDER_ULPS_PER_LAYER * depth * bf16_scale_ulp(want)


def _units_over(name: str, err: np.ndarray, bound: float, tie: np.ndarray | None, scale: float) -> list[str]:
    """err: the max |error| of each unit (a position, a slot, a row); tie: those compared separately."""
    tie = np.zeros(err.shape, bool) if tie is None else np.broadcast_to(tie, err.shape)
    out = []
    for label, mask, limit in (("", ~tie, bound), (" at a routing near tie", tie, TIE_SHARE * scale)):
        bad = mask & ~(err <= limit)                                   # NaN fails too
        if bad.any():
            i = tuple(int(j) for j in np.argwhere(bad)[0])
            out.append(f"{name}: {int(bad.sum())} of {int(mask.sum())} unit(s){label} off by more than {limit:.3g} "
                       f"(worst {float(np.nanmax(np.where(bad, err, -np.inf))):.3g}, first at {i})")
    return out


def order_violations(cfg: K3Config, got: dict, want: dict, tie=None, start=0) -> list[str]:
    """Why `got` is not `want` up to summation order ([] = it is), under the rule above.

    got / want: "logits" [B, V] or [B, T, V] (depth cfg.layers, compared per position at the scale of
    all logits) and any cache arrays (`mk.model.reference.init_cache`; each family layer at its own
    scale and depth: its index in the model + 1; "pos" exactly). tie: bool [B] or [B, T], the
    oracle's routing near ties (`route_ties`) at the logits' positions, which start at cache slot
    `start` (an int, or one per row; 0: a prompt from an empty cache)."""
    reasons = []
    tie = None if tie is None else np.asarray(tie, bool).reshape(len(tie), -1)        # [B, T]
    for name in got:
        g, w = np.asarray(got[name], np.float32), np.asarray(want[name], np.float32)
        if g.shape != w.shape:
            reasons.append(f"{name}: shape {g.shape} != {w.shape}")
        elif name == "pos":
            reasons += [] if np.array_equal(g, w) else [f"pos: {g.tolist()} != {w.tolist()}"]
        elif name == "logits":
            err = np.abs(g - w).max(axis=-1)
            reasons += _units_over(name, err, order_bound(w, cfg.layers), None if tie is None else tie.reshape(err.shape),
                                   float(np.abs(w).max()))
        else:
            layers = cfg.mla_layers if name.startswith("mla") else cfg.kda_layers
            for i, l in enumerate(layers):
                gi, wi = g[:, i], w[:, i]
                bound, scale, where = order_bound(wi, l + 1), float(np.abs(wi).max(initial=0.0)), f"{name}[layer {l}]"
                if name.startswith("mla"):                              # [B, H, ctx, w]: per slot
                    err, t = np.abs(gi - wi).max(axis=(1, 3)), None
                    if tie is not None:
                        t = np.zeros(err.shape, bool)
                        for b, s0 in enumerate(np.broadcast_to(start, len(t))):
                            t[b, s0:s0 + tie.shape[1]] = tie[b]
                else:                                                   # a recurrent state: per row,
                    err = np.abs(gi - wi).reshape(len(gi), -1).max(axis=1)  # which carries every token on
                    t = None if tie is None else tie.any(axis=1)
                reasons += _units_over(where, err, bound, t, scale)
    return reasons


def verdict(res: dict) -> list[str]:
    """Why a `check` result is outside the tolerances above ([] = it passes)."""
    if res.get("policy") == "chip":
        return chip_verdict(res)
    if res.get("policy") == "exact":
        return exact_verdict(res)
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


def _common_reasons(res: dict) -> list[str]:
    reasons = []
    if res["nan"]:
        reasons.append(f"NaN in {', '.join(res['nan_arrays'])}")
    if res.get("replicated_diff"):
        reasons.append(f"replicated state differs across devices: {', '.join(res['replicated_diff'][:3])}")
    if res.get("races"):
        reasons.append(f"race detector fired in {res['races']} step(s)")
    if res["pallas_calls_per_step"] != PALLAS_CALLS_PER_STEP:
        reasons.append(f"{res['pallas_calls_per_step']} pallas_calls per step, expected {PALLAS_CALLS_PER_STEP}")
    return reasons


def exact_verdict(res: dict) -> list[str]:
    """`check(..., exact=True)`: anything but bit-identical logits, caches and greedy tokens fails."""
    reasons = _common_reasons(res)
    if res["max_abs_logit_err"] != 0.0:
        reasons.append(f"logits not bit-identical: max |error| {res['max_abs_logit_err']}")
    bad = {n: e for n, e in res["cache_max_abs_err_by_array"].items() if e != 0.0}
    if bad:
        reasons.append("caches not bit-identical: " + ", ".join(f"{n} max |error| {e}" for n, e in sorted(bad.items())))
    if not res["greedy_match"]:
        reasons.append(f"{len(res['greedy_flips'])} greedy token(s) differ")
    return reasons


def far_from_tie(flips: list[dict]) -> list[dict]:
    """The greedy flips whose oracle top gap is not below their own near-tie bound (`near_tie_below`)
    and whose position is not a routing near tie (`route_margin` below ROUTE_NEAR_TIE, where recorded)."""
    return [f for f in flips if not f["ref_margin"] < f["near_tie_below"]
            and not f.get("route_margin", np.inf) < ROUTE_NEAR_TIE]


def chip_verdict(res: dict) -> list[str]:
    """A `check_on_chip` result: the kernel's distance from the CPU oracle against XLA-on-chip's."""
    reasons = _common_reasons(res)
    for name, (k, x, floor) in res["vs_xla"].items():
        if k is None or x is None or not k <= CHIP_FACTOR * x + floor:
            reasons.append(f"{name}: kernel {k} from the oracle > {CHIP_FACTOR} x XLA on chip's {x} + {floor:.3g}")
    far = far_from_tie(res["greedy_flips"])
    if far:
        f = far[0]
        reasons.append(f"{len(far)} greedy flip(s) away from a near tie (step {f['step']} row {f['row']}: "
                       f"oracle top-2 gap {f['ref_margin']:.4f} >= {f['near_tie_below']:.4f})")
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
          experts: str | None = None, all_reduce: str = "one_round", mxfp4_matmul: str = "bf16",
          mxfp4_unpack: str = "auto", exact: bool = False, fault: str | None = None) -> dict:
    """mesh > 1: the sharded kernel on `mesh` devices against the sharded reference
    (`mk.model.reference_sharded`) on the same mesh, which rounds its partial sums the same way.

    experts: the kernel's routed-expert format. "mxfp4": packed E2M1 + E8M0 (params from
    `mk.io.checkpoint.load(..., experts="mxfp4")`, or `mk.model.params.init` quantized as `mk synth` writes
    it); the reference runs on their dequantization (`mk.io.convert.dequantize_experts`), the
    oracle. "bf16": bf16 expert tiles. Default: the format `params` holds (bf16 for init params).
    all_reduce: the kernel's all-reduce rounds (`mk.kernel.plan.ScheduleOptions.all_reduce`).
    mxfp4_matmul: how MXFP4 experts meet the MXU (`ScheduleOptions.mxfp4_matmul`); the reference
    sums the expert matmuls as the kernel does (`mk.kernel.step.expert_k_chunk`).
    exact: on CPU, pass only if every logit and cache element is bit-identical (`exact_verdict`).
    fault: a deliberately broken kernel to show the check catches it ("moe_combine_sign": the routed
    experts' combine weights negated, `mk.kernel.moe`); never for real runs.
    On a TPU backend the run is `check_on_chip` (module docstring)."""
    if fault is not None:
        if fault != "moe_combine_sign":
            raise UserError(f"fault must be 'moe_combine_sign', found {fault!r}")
        args = {k: v for k, v in locals().items() if k not in ("cfg", "batch", "steps", "prefetch_depth", "fault")}
        from mk.kernel.moe import negated_combine
        with negated_combine():                  # every trace of the kernel in this run has the planted bug
            return check(cfg, batch, steps, prefetch_depth, **args)
    from mk.model import params as params_mod
    from mk.model import reference
    from mk.kernel.decode import interpret_params, on_tpu
    from mk.kernel.step import make_step_fn
    from jax.experimental.pallas import tpu as pltpu

    from mk.io.convert import dequantize_experts
    from mk.kernel.step import expert_k_chunk, experts_format

    t_setup = time.perf_counter()
    params = params if params is not None else params_mod.init(cfg, seed)
    init_s = time.perf_counter() - t_setup
    experts = experts or experts_format(params)
    if experts == "mxfp4" and experts_format(params) == "bf16":
        from mk.io.synth import mxfp4_params
        params = mxfp4_params(cfg, seed, params)[0]
    interp = None if on_tpu() else interpret_params(detect_races, dma_execution_mode)
    kw = {"experts": experts, "options": dataclasses.replace(MK, all_reduce=all_reduce, mxfp4_matmul=mxfp4_matmul,
                                                             mxfp4_unpack=mxfp4_unpack)}
    if prefetch_depth is not None:
        kw["prefetch_depth"] = prefetch_depth
    step_fn = make_step_fn(params, cfg, batch, ctx=ctx, interpret=interp, mesh=mesh, **kw)
    plan = step_fn.plan
    params = dequantize_experts(params)          # the reference's weights: bf16 (the oracle)
    if on_tpu():
        if mesh > 1:
            raise UserError("mk check on a TPU compares one device's kernel (--mesh 1) with XLA on the chip")
        setup_s = {"params_init": round(init_s, 3), "total": round(time.perf_counter() - t_setup, 3)}
        res = check_on_chip(cfg, step_fn, params, batch, steps, ctx=ctx, seed=seed, prompt_len=prompt_len,
                            progress=progress)
        return res | {"setup_s": setup_s}    # params on the host, MXFP4 packing, the kernel's weights
    if mesh > 1:
        from mk.model import reference_sharded as rs
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
        "collectives_per_step": collectives_per_step(plan),
        "remote_bytes_per_step": remote_bytes_per_step(plan), "races": races, "nan": bool(nan_arrays),
        "nan_arrays": nan_arrays, "pallas_calls_per_step": n_calls, "dma_execution_mode": dma_execution_mode,
        "detect_races": detect_races, "mode": "compiled (TPU)" if on_tpu() else "TPU interpret mode (CPU)",
        "wall_s": elapsed, "per_step": per_step,
    }
    if exact:
        res["policy"] = "exact"
    reasons = verdict(res)
    res.update(verdict="fail" if reasons else "pass", reasons=reasons,
               tolerances={"bit_identical": True} if exact else dict(TOLERANCES))
    return res


def _cpu_oracle_device():
    """JAX's CPU device, where the oracle runs beside a TPU; a UserError where JAX_PLATFORMS leaves it out."""
    try:
        return jax.devices("cpu")[0]
    except RuntimeError:
        raise UserError("mk check on a TPU needs JAX's CPU backend for the oracle (JAX_PLATFORMS must allow cpu)") from None


def check_on_chip(cfg: K3Config, step_fn, params: dict, batch: int, steps: int, *, ctx: int = 256, seed: int = 0,
                  prompt_len: int = 3, progress: bool = False) -> dict:
    """The compiled kernel (`step_fn`) and `mk.model.reference.decode_step` compiled by XLA for the same
    chip, each against the reference on JAX's CPU backend (the oracle: bit-exact with the
    interpreted kernel), over `steps` steps of a random prompt and the oracle's greedy tokens.

    Every step all three start from the oracle's cache (resynchronised), so each step measures one
    step's error and drift cannot accumulate into a flip. Rows whose oracle routing margin is below
    ROUTE_NEAR_TIE in some MoE layer are near ties: reported with their margins and left out of that
    step's comparison. Greedy flips are near ties where the oracle's top-2 gap is below
    max(NEAR_TIE, 2 x XLA-on-chip's logit error for the step). The verdict (`chip_verdict`): for the
    logits and every cache array, kernel error <= CHIP_FACTOR x XLA-on-chip error + CHIP_ULP_FLOOR
    bf16 ulps; `factor` reports the measured ratio."""
    from mk.model import reference
    from mk.kernel.step import expert_k_chunk

    cpu = _cpu_oracle_device()
    chip = jax.devices()[0]
    kc = expert_k_chunk(step_fn.plan)
    ref = functools.partial(reference.decode_step, cfg=cfg, expert_k_chunk=kc)
    o_params = jax.device_put(params, cpu)
    x_params = jax.device_put(params, chip)
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, cfg.vocab, (batch, max(1, min(prompt_len, steps))), dtype=np.int32)
    o_cache = jax.device_put(reference.init_cache(cfg, batch, ctx), cpu)
    fresh = lambda tree, dev: jax.tree.map(lambda x: jax.device_put(np.array(x), dev), tree)   # a copy, always
    n_calls = count_pallas_calls(lambda c, t: step_fn(None, c, t), fresh(o_cache, chip),
                                 jnp.asarray(prompt[:, 0]))
    tokens = prompt[:, 0]
    worst = {"logits": [0.0, 0.0]}               # name -> [kernel, xla] max |error| over compared rows
    ulp = {"logits": 2.0 ** -6}                  # one bf16 ulp at |x| = 4 (logits of std ~1)
    nan_arrays, per_step, flips, near = [], [], [], []
    t0 = time.perf_counter()
    it = range(steps)
    if progress:
        from tqdm.auto import tqdm
        it = tqdm(it, desc=f"check on chip B={batch}", leave=False, disable=None)
    first_call_s = {}                            # kernel / XLA / oracle: compile + first step, seconds

    def timed(who, fn, *args, **kw):
        t = time.perf_counter()
        out = jax.block_until_ready(fn(*args, **kw))
        first_call_s.setdefault(who, round(time.perf_counter() - t, 3))
        return out

    for s in it:
        tok = jnp.asarray(tokens, jnp.int32)
        k_logits, k_cache = timed("kernel", step_fn, None, fresh(o_cache, chip), jax.device_put(tok, chip))  # (donated)
        x_logits, x_cache = timed("xla", ref, x_params, fresh(o_cache, chip), jax.device_put(tok, chip))
        o_logits, o_next, margins = timed("oracle", ref, o_params, o_cache, jax.device_put(tok, cpu), route_margins=True)
        o_logits, margins = np.asarray(o_logits), np.asarray(margins)
        k_logits, x_logits = np.asarray(k_logits), np.asarray(x_logits)
        ties = route_near_ties(margins, "row", step=s)
        near += ties
        tie_rows = [t["row"] for t in ties]
        rows = np.array([r for r in range(batch) if r not in tie_rows], dtype=np.int64)
        step_err = {}
        for name, k, x, o in [("logits", k_logits, x_logits, o_logits)] + [
                (f"cache.{n}", np.asarray(k_cache[n]), np.asarray(x_cache[n]), np.asarray(o_next[n]))
                for n in sorted(o_next)]:
            ek, k_nan, _ = _max_abs_diff(k[rows], o[rows])
            ex, x_nan, o_nan = _max_abs_diff(x[rows], o[rows])
            for who, has in (("kernel", k_nan), ("xla", x_nan), ("oracle", o_nan)):
                if has and f"{who}.{name}" not in nan_arrays:
                    nan_arrays.append(f"{who}.{name}")
            if name != "logits" and name not in ulp:
                ulp[name] = 0.0
            if name != "logits" and name != "cache.pos":
                ulp[name] = max(ulp[name], bf16_scale_ulp(o))
            w = worst.setdefault(name, [0.0, 0.0])
            w[0], w[1] = _worst(w[0], ek), _worst(w[1], ex)
            step_err[name] = (ek, ex)
        k_arg, o_arg = k_logits.argmax(-1), o_logits.argmax(-1)
        tie_below = max(NEAR_TIE, 2 * (step_err["logits"][1] or 0.0))
        for r in np.flatnonzero(k_arg != o_arg):
            flips.append({"step": s, "row": int(r), "ref_margin": float(o_logits[r, o_arg[r]] - o_logits[r, k_arg[r]]),
                          "near_tie_below": tie_below})
        per_step.append({"step": s, "logit_err_kernel": step_err["logits"][0], "logit_err_xla": step_err["logits"][1],
                         "rows_compared": int(rows.size), "greedy_match": bool((k_arg == o_arg).all())})
        o_cache = o_next
        tokens = prompt[:, s + 1] if s + 1 < prompt.shape[1] else o_arg.astype(np.int32)
    vs_xla = {n: (k, x, CHIP_ULP_FLOOR * ulp.get(n, 0.0)) for n, (k, x) in worst.items()}
    ratios = [k / x for k, x, _ in vs_xla.values() if k is not None and x]
    plan = step_fn.plan
    res = {"config": plan.config_name(), "experts": plan.experts, "batch": batch, "steps": steps,
           "prefetch_depth": plan.prefetch_depth, "num_slots": plan.num_slots, "chip": plan.chip,
           "mxfp4_unpack": plan.mxfp4_unpack if plan.experts == "mxfp4" else None,
           "mode": f"compiled ({chip.device_kind}) vs XLA on the chip, oracle: reference on CPU",
           "policy": "chip", "max_abs_logit_err": worst["logits"][0], "xla_max_abs_logit_err": worst["logits"][1],
           "factor": max(ratios) if ratios else None,
           "factor_logits": (worst["logits"][0] / worst["logits"][1]) if worst["logits"][1] else None,
           "vs_xla": vs_xla, "greedy_flips": flips, "route_near_ties": near, "nan": bool(nan_arrays),
           "nan_arrays": nan_arrays, "pallas_calls_per_step": n_calls, "races": 0,
           "wall_s": time.perf_counter() - t0, "first_call_s": first_call_s, "per_step": per_step}
    reasons = chip_verdict(res)
    res.update(verdict="fail" if reasons else "pass", reasons=reasons, tolerances=dict(CHIP_TOLERANCES))
    return res


def forced_logits(cfg: K3Config, params: dict, prompt: np.ndarray, tokens: np.ndarray, *, ctx: int,
                  device, expert_k_chunk: int, route_margins: bool = False):
    """The reference's logits [n, vocab] f32 for each of n emitted `tokens` [n], teacher-forced: row i
    is what plain greedy decoding sees after prompt [T] + tokens[:i] (row i's argmax is its token i).
    Runs `mk.model.reference.decode_step` on `device` (the CPU oracle, or XLA on the chip). With
    route_margins, (logits, margins [n, n_moe] f32): row i's routing margin in every MoE layer."""
    from mk.model import reference
    params = jax.device_put(params, device)
    cache = jax.device_put(reference.init_cache(cfg, 1, ctx), device)
    seq = np.concatenate([prompt, tokens[:-1]]).astype(np.int32)
    out, margins = [], []
    for i, t in enumerate(seq):
        logits, cache, *m = reference.decode_step(params, cache, jax.device_put(jnp.asarray([t]), device), cfg=cfg,
                                                  expert_k_chunk=expert_k_chunk, route_margins=route_margins)
        if i >= len(prompt) - 1:
            out.append(np.asarray(logits[0], np.float32))
            margins += [np.asarray(m[0][0], np.float32)] if m else []
    return (np.stack(out), np.stack(margins)) if route_margins else np.stack(out)


def route_near_ties(margins: np.ndarray, index: str, **where) -> list[dict]:
    """The rows of `margins` [n, n_moe] (the oracle's routing margin in every MoE layer: a step's rows,
    or a sequence's positions) whose margin is below ROUTE_NEAR_TIE in some MoE layer, ascending:
    {**where, index: the row, "moe_layer", "route_margin"} (the smallest)."""
    out = []
    for i in np.flatnonzero(route_ties(margins)):
        l = int(np.argmin(margins[i]))
        out.append({**where, index: int(i), "moe_layer": l + 1, "route_margin": float(margins[i, l])})
    return out


def speculative_prompt(cfg: K3Config, batch: int, prompt_len: int, seed: int) -> np.ndarray:
    """The random prompts [batch, prompt_len] int32 `check_speculative` decodes from."""
    return np.random.default_rng(seed).integers(0, cfg.vocab, (batch, prompt_len), dtype=np.int32)


def emitted_logit_err(kernel: np.ndarray, oracle: np.ndarray) -> np.ndarray:
    """Per emitted token [n], max |kernel - oracle| over the vocabulary: `kernel` [n - 1, vocab] the
    verify steps' logits that chose tokens 1..n-1 (`speculative.generate(keep_logits=True)`), `oracle`
    [n, vocab] the teacher-forced ones (`forced_logits`); token 0 (the prefill's) is NaN."""
    if kernel.shape != (oracle.shape[0] - 1, oracle.shape[1]):
        raise ValueError(f"kernel logits {kernel.shape} do not match the oracle's {oracle.shape} less the first row")
    return np.concatenate([[np.nan], np.abs(kernel.astype(np.float32) - oracle[1:]).max(-1)])


def _nan_none(x) -> float | None:
    return None if np.isnan(x) else float(x)


def greedy_flips(tokens: np.ndarray, oracle: np.ndarray, tie_below) -> list[dict]:
    """Emitted tokens [n] that are not the oracle's greedy choice under its teacher-forced logits
    `oracle` [n, vocab]: {"position", "token", "greedy", "ref_margin" (the oracle's max logit minus the
    token's), "near_tie_below"}. `tie_below`: a float, or one per position [n]."""
    tie = np.broadcast_to(np.asarray(tie_below, np.float64), tokens.shape)
    greedy = oracle.argmax(-1)
    return [{"position": int(i), "token": int(tokens[i]), "greedy": int(greedy[i]),
             "ref_margin": float(oracle[i, greedy[i]] - oracle[i, tokens[i]]), "near_tie_below": float(tie[i])}
            for i in np.flatnonzero(tokens != greedy)]


def check_speculative(cfg: K3Config, k: int = 3, new_tokens: int = 64, *, batch: int = 1, mesh: int = 1,
                      prompt_len: int = 100, agree: float = 0.6, seed: int = 0, ctx: int = 256,
                      detect_races: bool = False, policy: str | None = None) -> dict:
    """Greedy speculative decoding through the kernel's verify step against plain greedy decoding.

    `batch` sequences (a verify step of batch x (1 + k) rows): random prompts of `prompt_len` tokens
    (prefilled by the reference), then
    `new_tokens` tokens, k drafts per step from `mk.kernel.speculative.AgreeingDrafter`, which proposes
    the plain greedy continuation with probability `agree` per draft (so steps of full, zero and
    partial acceptance all occur, and every rejection rolls the KDA/conv state back by its
    `state_row`). Plain greedy is the oracle: `mk.model.reference.generate`, on `mesh` devices the
    sharded reference (`mk.model.reference_sharded`), which rounds as the sharded kernel does.

    In interpret mode the kernel is bit-exact with the reference, so the tokens must be equal
    ("policy": "exact"). On a TPU ("policy": "chip") the compiled kernel rounds otherwise, and one
    near tie sends greedy decoding down another sequence, so the tokens are compared as
    `check_on_chip` compares a step: every emitted token against the CPU oracle's logits
    teacher-forced along the emitted sequence (`forced_logits`); a token other than the oracle's
    argmax (`greedy_flips`) passes only at a near tie: a top gap below max(NEAR_TIE, 2 x XLA on the
    chip's logit error at that position), or a routing near tie (the oracle's routing margin there below
    ROUTE_NEAR_TIE in some MoE layer, `route_near_ties`, as `check_on_chip` leaves such rows out). The
    verify steps' logits of the emitted tokens must lie within CHIP_FACTOR x XLA on the chip's largest
    distance from the oracle's (`emitted_logit_err`) over the positions that are not routing near ties;
    each flip records both distances and the routing margin at its position. `policy` ("exact" or
    "chip") overrides the backend's.
    Returns {"batch", "tokens" (the emitted ones, per sequence), "tokens_equal", "first_difference" (per
    sequence), "acceptance" (per sequence),
    "steps", "full", "zero", "partial" (over every sequence's steps),
    "positions", "crosses_mla_block", "races", "policy", "greedy_flips", "seconds", "verdict",
    "reasons"}."""
    from mk.model import params as params_mod
    from mk.model import reference
    from mk.kernel import speculative
    from jax.experimental.pallas import tpu as pltpu

    from mk.kernel.step import KernelVerifier, expert_k_chunk
    from mk.kernel.decode import interpret_params, on_tpu

    if prompt_len + new_tokens + k + 1 > ctx:
        raise ValueError(f"prompt_len + new_tokens + k + 1 = {prompt_len + new_tokens + k + 1} exceeds ctx {ctx}")
    if policy not in (None, "exact", "chip"):
        raise ValueError(f"policy must be 'exact' or 'chip', found {policy!r}")
    chip = on_tpu()
    policy = policy or ("chip" if chip else "exact")
    params = params_mod.init(cfg, seed)
    prompt = speculative_prompt(cfg, batch, prompt_len, seed)
    t0 = time.perf_counter()
    interp = None if chip else interpret_params(detect_races)
    verifier = KernelVerifier(params, cfg, batch, k, ctx=ctx, interpret=interp, mesh=mesh)
    if mesh > 1:
        from mk.model import reference_sharded as rs
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
            if not chip:
                pltpu.reset_tpu_interpret_mode_state()
            out = jax.block_until_ready(verifier.verify(params, cache, tokens, aux_layers))
            races += int(races_found())
            return out

    res = speculative.generate(params, cfg, prompt, new_tokens, drafter, k, ctx=ctx, verifier=Verifier(),
                               reference_prefill=True, keep_logits=policy == "chip")
    got = np.asarray(res["tokens"])
    acc = [[int(a) for a in row] for row in res["acceptance"]]
    firsts = [int(d[0]) if d.size else None for d in (np.flatnonzero(g != o) for g, o in zip(got, oracle))]
    every = [a for row in acc for a in row]
    out = {"batch": batch, "mesh": mesh, "k": k, "new_tokens": new_tokens,
           "tokens_equal": all(f is None for f in firsts), "first_difference": firsts,
           "acceptance": acc, "steps": len(acc[0]), "full": sum(a == k + 1 for a in every),
           "zero": sum(a == 1 for a in every), "partial": sum(1 < a <= k for a in every),
           "positions": [prompt_len, prompt_len + new_tokens - 1],
           "crosses_mla_block": prompt_len // 128 != (prompt_len + new_tokens - 1) // 128,
           "races": races, "policy": policy, "tokens": got.tolist(), "prompt_len": prompt_len, "seed": seed}
    reasons = [f"race detector fired in {races} step(s)"] if races else []
    if policy == "chip" and mesh == 1:
        cpu = _cpu_oracle_device()
        kc = expert_k_chunk(verifier.plan)
        flips, near, x_max, k_max = [], [], 0.0, 0.0
        for b in range(batch):
            forced = functools.partial(forced_logits, cfg, params, prompt[b], got[b], ctx=ctx, expert_k_chunk=kc)
            o_logits, margins = forced(device=cpu, route_margins=True)
            x_err = np.abs(forced(device=jax.devices()[0]) - o_logits).max(-1)
            k_err = emitted_logit_err(res["emitted_logits"][b], o_logits)
            ties = route_near_ties(margins, "position", sequence=b)   # another expert a rounding away: not compared
            near += ties
            keep = np.ones(len(x_err), bool)
            keep[[t["position"] for t in ties]] = False
            x_max = max(x_max, float(x_err[keep].max(initial=0.0)))
            k_max = max(k_max, float(np.nanmax(k_err[keep], initial=0.0)))
            flips += [{"sequence": b, **f, "kernel_logit_err": _nan_none(k_err[f["position"]]),
                       "xla_logit_err": float(x_err[f["position"]]),
                       "route_margin": float(margins[f["position"]].min(initial=np.inf))}
                      for f in greedy_flips(got[b], o_logits, np.maximum(NEAR_TIE, 2 * x_err))]
        far = far_from_tie(flips)
        out.update(greedy_flips=flips, route_near_ties=near, xla_max_abs_logit_err=x_max, max_abs_logit_err=k_max,
                   factor_logits=k_max / x_max if x_max else None,
                   mode=f"{'compiled' if chip else 'interpreted'} ({jax.devices()[0].device_kind}); oracle: "
                        f"reference on CPU, teacher-forced along the emitted tokens")
        if far:
            f = far[0]
            reasons.append(f"{len(far)} emitted token(s) away from a near tie (sequence {f['sequence']}, position "
                           f"{f['position']}: token "
                           f"{f['token']}, oracle's {f['greedy']}, top gap {f['ref_margin']:.4f} >= "
                           f"{f['near_tie_below']:.4f}, routing margin {f['route_margin']:.4g} >= {ROUTE_NEAR_TIE}; "
                           f"the kernel's logits there {f['kernel_logit_err']} from the oracle's, XLA on the chip's "
                           f"{f['xla_logit_err']:.4g})")
        if not k_max <= CHIP_FACTOR * x_max:
            reasons.append(f"logits: kernel {k_max:.4g} from the oracle > {CHIP_FACTOR} x XLA on chip's {x_max:.4g}")
    elif not out["tokens_equal"]:
        b = next(i for i, f in enumerate(firsts) if f is not None)
        reasons.append(f"tokens differ from plain greedy decoding (sequence {b} from position {firsts[b]})"
                       + (" (a multi-device chip run compares tokens exactly)" if chip else ""))
    out.update(seconds=time.perf_counter() - t0, verdict="fail" if reasons else "pass", reasons=reasons)
    return out
