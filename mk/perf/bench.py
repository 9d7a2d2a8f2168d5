"""`mk bench`: the megakernel, the fair XLA step and the oracle, timed side by side on one TPU.

    rows = measure(get_config("k3-chip"), batches=(1, 2, 4, 8), experts="bf16")

In one process, at each batch: the kernel (`mk.kernel.decode.make_decode_step` on `kernel_weights`),
the fair XLA step (`mk.perf.baseline`, impl "xla"; "xla-ragged": its ragged_dot MoE) and the oracle
(`mk.model.reference.decode_step`, jitted), and with impl "peer" the fair XLA step whose routed experts
are vLLM TPU's fused MoE kernel (`mk.perf.peer`, tpu-inference; `peer_format` bf16, int8 or int4,
its own expert bytes in the row). Each case decodes a stream of random token ids (the same for
every impl of a batch) with its cache advancing, `warmup` untimed steps then `steps` timed ones,
each timed to `jax.block_until_ready`.

Bytes a step must read (`step_bytes`): every weight but the embedding table and the routed experts
(plus the B embedding rows), the distinct routed experts of the step in their storage format
(bf16: 2 bytes per weight, MXFP4: 17/32), and the state the plan's phases read and write (KDA
states, MLA caches: `mk.kernel.schedule.schedule`). Distinct experts per MoE layer are counted from the XLA
step's routing of the very tokens timed (the reference's function, `tests/test_baseline.py`),
averaged over the timed steps; without "xla" among the impls, the plan's expectation for
independent uniform routing (`Plan.expected_distinct_experts`). `plan_weight_bytes` is the
kernel's DMA count (tile padding included). Effective GB/s = bytes / median time; fractions of
the chip's datasheet HBM bandwidth (data/hardware.csv) and of the DMA stream bandwidth
`mk microbench` measured (data/microbench.csv, `dma_stream_bw` of the chip; None if not measured).

Memory: params are shared by the XLA step and the reference (MXFP4: the XLA step reads the packed
experts, the reference a bf16 dequantization made on the device); the kernel's packed weights are
built once and reused across batches while the packing is the same (`pack_key`), else freed first.
Off a TPU, `measure` refuses: interpret mode is no speed claim.
"""
from __future__ import annotations

import datetime
import functools
import gc
import json
import os
import statistics
import sys
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mk.model.config import K3Config
from mk.errors import UserError
from mk.kernel.plan import CHIP_OF_DEVICE_KIND, HARDWARE_CHIP
from mk.kernel.schedule import schedule

IMPLS = ("kernel", "xla", "xla-ragged", "reference", "peer")
DEFAULT_IMPLS = ("kernel", "xla", "reference")
RIVALS = ("xla", "peer")          # the kernel's ratios against the better of these (`add_ratios`)
# jax device_kind -> (mk.kernel.plan chip, data/hardware.csv chip)
DEVICE_KINDS = {kind: (chip, HARDWARE_CHIP[chip]) for kind, chip in CHIP_OF_DEVICE_KIND.items() if chip in HARDWARE_CHIP}
STREAM_QUANTITY = "dma_stream_bw"


class BenchError(UserError):
    """A bench that cannot run here (no TPU, a config that does not fit, a bad option)."""


def chip_of_device(kind: str) -> tuple[str, str] | None:
    """(mk.kernel.plan chip, hardware.csv chip) of a jax device_kind, or None if mk does not know it."""
    return DEVICE_KINDS.get(kind)


def require_tpu(backend: str | None = None):
    backend = backend or jax.default_backend()
    if backend != "tpu":
        raise BenchError(f"mk bench times steps on a TPU; this backend is {backend!r} (interpret mode "
                         f"is no speed claim: use `mk check` for correctness)")


# ---- bytes ---------------------------------------------------------------------------------------
EXPERT_FAMILIES = ("w1", "w3", "w2")


def expert_weight_bytes(cfg: K3Config, experts: str) -> float:
    """Bytes of one routed expert (w1, w3, w2) as stored: bf16 2 per weight, MXFP4 17/32
    (a 4-bit code + one E8M0 byte per 32 weights)."""
    per_weight = {"bf16": 2.0, "mxfp4": 0.5 + 1.0 / 32}[experts]
    return 3 * cfg.latent * cfg.expert_hidden * per_weight


def dense_weight_bytes(cfg: K3Config, batch: int) -> int:
    """Bytes of every parameter a step reads whole: all but the embedding table (B rows of it are
    read) and the routed experts."""
    from mk.model.params import nbytes, shapes
    s = shapes(cfg)
    experts = sum(nbytes(s["moe"][n]) for n in EXPERT_FAMILIES)
    return nbytes(s) - nbytes(s["embed"]) - experts + batch * cfg.dim * 2


def step_bytes(cfg: K3Config, batch: int, experts: str, distinct: Sequence[float], plan=None) -> dict:
    """HBM bytes one step must read: {"weight_bytes", "expert_bytes", "state_bytes", "hbm_bytes",
    "plan_weight_bytes"}; distinct[l - 1] = distinct experts routed at MoE layer l (a mean is
    fine); plan: the kernel's plan at this batch (default: `make_plan(cfg, batch, experts=...)`)."""
    from mk.kernel.plan import make_plan
    plan = plan or make_plan(cfg, batch, experts=experts, check=False)
    dmas, phases = schedule(plan, list(distinct))
    out = {"weight_bytes": dense_weight_bytes(cfg, batch),
           "expert_bytes": float(sum(distinct)) * expert_weight_bytes(cfg, experts),
           "state_bytes": sum(p.hbm_bytes + p.writeback_bytes for p in phases),
           "plan_weight_bytes": sum(d.bytes for d in dmas)}
    out["hbm_bytes"] = out["weight_bytes"] + out["expert_bytes"] + out["state_bytes"]
    return out


def bandwidths(hw_chip: str | None, microbench_csv=None) -> dict:
    """{"datasheet_bw", "stream_bw", "stream_source"} of a hardware.csv chip (None where unknown)."""
    from mk.perf.hardware import HardwareDataError, load_chips, load_microbench
    out = {"datasheet_bw": None, "stream_bw": None, "stream_source": "not measured"}
    if hw_chip is None:
        return out
    chips = load_chips()
    if hw_chip in chips:
        out["datasheet_bw"] = chips[hw_chip].hbm_bw
    try:
        m = load_microbench(microbench_csv).measurement(hw_chip, STREAM_QUANTITY)
        out["stream_bw"], out["stream_source"] = m.value, m.source
    except (HardwareDataError, OSError):
        out["stream_source"] = f"not measured (no {hw_chip} {STREAM_QUANTITY} row in data/microbench.csv)"
    return out


# ---- timing --------------------------------------------------------------------------------------
def summarize(times_s: Sequence[float]) -> dict:
    """{"median_ms", "min_ms", "max_ms", "steps"} of per-step seconds."""
    if not times_s:
        raise ValueError("no timed steps")
    ms = [1e3 * t for t in times_s]
    return {"median_ms": statistics.median(ms), "min_ms": min(ms), "max_ms": max(ms), "steps": len(ms)}


def time_steps(step: Callable, new_cache: Callable[[], dict], tokens: np.ndarray, warmup: int, ctx: int,
               timer: Callable[[], float] = time.perf_counter, on_output: Callable | None = None) -> list[float]:
    """Run `step(cache, tokens[t]) -> (logits, cache, *extra)` for every row t of tokens [T, B];
    the first `warmup` untimed, each later one timed from its call to `jax.block_until_ready` of
    its outputs. The cache is recreated (untimed) before its positions would pass ctx.
    on_output(t, outputs) sees every step's outputs (e.g. routing). Returns the timed seconds."""
    cache, pos, times = new_cache(), 0, []
    for t in range(tokens.shape[0]):
        if pos >= ctx:
            del cache
            cache, pos = new_cache(), 0
        tok = jnp.asarray(tokens[t], jnp.int32)
        t0 = timer()
        out = jax.block_until_ready(step(cache, tok))
        dt = timer() - t0
        cache, pos = out[1], pos + 1
        if on_output is not None:
            on_output(t, out)
        if t >= warmup:
            times.append(dt)
    return times


def device_step_times(step: Callable, cache: dict, tok, steps: int) -> list[float]:
    """Device seconds of `steps` more steps from `cache`, read from a `jax.profiler` trace (XProf's
    device plane: the step program's own time, without the host's dispatch and sync that a wall
    clock around each step also counts). [] where the trace has no device plane (CPU)."""
    return device_step_profile(step, cache, tok, steps)[0]


def device_step_profile(step: Callable, cache: dict, tok, steps: int) -> tuple[list[float], dict | None]:
    """`device_step_times` and, from the same trace, what the device ran inside a step
    (`mk.perf.trace.step_op_breakdown`: ops per step, busy and idle time, time by op); None off a TPU."""
    import glob
    import tempfile
    from mk.perf.trace import device_event_list, profile_data, step_device_seconds, step_op_breakdown
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(steps):
                cache = jax.block_until_ready(step(cache, tok))[1]
        files = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
        if not files:
            return [], None
        data = profile_data(files[0])
        return step_device_seconds(device_event_list(data), steps), step_op_breakdown(data, steps)


def add_ratios(rows: list[dict]) -> list[dict]:
    """Set `kernel_speedup` = this impl's median / the kernel's at the same batch (how many times
    faster the kernel is, on the wall clock), and `device_speedup`, the same of their device times
    (the step programs alone: the wall clock adds about 1 ms of host dispatch and sync per step,
    which varies from run to run by as much); None for the kernel itself or where either has no time.
    On the kernel's rows: `best_other`, the faster of the impls in RIVALS that ran (by device time,
    else by wall clock), and `device_speedup_vs_best` / `speedup_vs_best`, its device / wall time
    over the kernel's (None where it has none)."""
    for key, out in (("median_ms", "kernel_speedup"), ("device_median_ms", "device_speedup")):
        kernel = {r["batch"]: r[key] for r in rows if r["impl"] == "kernel" and r.get(key)}
        for r in rows:
            k = kernel.get(r["batch"])
            r[out] = r[key] / k if r["impl"] != "kernel" and k and r.get(key) else None
    for r in rows:
        if r["impl"] != "kernel":
            continue
        rivals = [o for o in rows if o["batch"] == r["batch"] and o["impl"] in RIVALS
                  and (o.get("device_median_ms") or o.get("median_ms"))]
        by = "device_median_ms" if rivals and all(o.get("device_median_ms") for o in rivals) else "median_ms"
        best = min(rivals, key=lambda o: o[by]) if rivals else None
        r["best_other"] = best["impl"] if best else None
        r["device_speedup_vs_best"] = best["device_speedup"] if best else None
        r["speedup_vs_best"] = best["kernel_speedup"] if best else None
    return rows


def _series(values, fmt: str = ".2f") -> str:
    return " / ".join("-" if v is None else format(v, fmt) for v in values)


UNIFORM_NOTE = " (bytes of uniform routing's expected experts: no XLA step counted the routed ones)"


def _clock(by_batch: dict) -> tuple[str, str]:
    """("device", "device_median_ms") where every row of `by_batch` has a device time, else ("wall",
    "median_ms")."""
    if all(r.get("device_median_ms") for r in by_batch.values()):
        return "device", "device_median_ms"
    return "wall", "median_ms"


def summary(rows: list[dict]) -> str:
    """One line of a bench's figures (rows after `add_ratios`), for its record: the kernel's device
    (else wall) ms per batch, its fraction of the stream, and its device and wall speedups over the
    better of RIVALS (`best_other`); of a prefetch-depth sweep, that per depth."""
    depths = sorted({r.get("prefetch_depth") for r in rows if r["impl"] == "kernel"}, key=lambda d: (d is None, d))
    if len(depths) > 1:                          # a sweep of the kernel alone: one part per depth
        parts = [summary([r for r in rows if r.get("prefetch_depth") == d]) for d in depths]
        note = UNIFORM_NOTE if all(p.endswith(UNIFORM_NOTE) for p in parts) else ""
        return " | ".join(f"depth {d}: " + p.removesuffix(note) for d, p in zip(depths, parts)) + note
    batches = sorted({r["batch"] for r in rows})
    kern = {r["batch"]: r for r in rows if r["impl"] == "kernel" and not r.get("error")}
    if not kern:                                 # the rivals alone: each one's times
        ok: dict[str, dict] = {}
        for r in rows:
            if not r.get("error"):
                ok.setdefault(r["impl"], {})[r["batch"]] = r
        timed = {i: by for i, by in ok.items() if any(r.get("median_ms") for r in by.values())}
        errors = "; ".join(sorted({r["error"] for r in rows if r.get("error")}))[:200]
        if not timed:
            return "not run: " + errors
        parts = [f"{i} {clock} {_series([by.get(b, {}).get(key) for b in batches])} ms"
                 for i, by in timed.items() for clock, key in [_clock(by)]]
        return (f"{'; '.join(parts)} at B = {' / '.join(map(str, batches))} (kernel not run)"
                + (f"; not run: {errors}" if errors else ""))
    clock, key = _clock(kern)
    frac = "device_frac_stream" if clock == "device" else "frac_stream"
    col = lambda name: [kern.get(b, {}).get(name) for b in batches]
    out = (f"kernel {clock} {_series(col(key))} ms at B = {' / '.join(map(str, batches))}; "
           f"{_series(col(frac))} of stream")
    if any(r.get("distinct_source", "").startswith("expected") for r in kern.values()):
        out += UNIFORM_NOTE
    names = sorted({n for n in col("best_other") if n})
    if names:
        out += (f"; vs the better of {' and '.join(i for i in RIVALS if any(r['impl'] == i for r in rows))} "
                f"({'/'.join(names)}): {_series(col('device_speedup_vs_best'))}x device, "
                f"{_series(col('speedup_vs_best'))}x wall")
    return out


def finish_row(row: dict, nbytes: dict, bw: dict) -> dict:
    """Fill a timed row's bytes, GB/s, bandwidth fractions and tokens/s."""
    row.update(nbytes)
    med = row.get("median_ms")
    s = med / 1e3 if med else None
    row["gb_s"] = nbytes["hbm_bytes"] / s / 1e9 if s else None
    row["frac_datasheet"] = row["gb_s"] * 1e9 / bw["datasheet_bw"] if s and bw["datasheet_bw"] else None
    row["frac_stream"] = row["gb_s"] * 1e9 / bw["stream_bw"] if s and bw["stream_bw"] else None
    row["tok_s"] = row["batch"] / s if s else None
    dev = row.get("device_median_ms")          # the step program on the device (XProf), no host dispatch
    row["device_gb_s"] = nbytes["hbm_bytes"] / (dev / 1e3) / 1e9 if dev else None
    row["device_frac_stream"] = row["device_gb_s"] * 1e9 / bw["stream_bw"] if dev and bw["stream_bw"] else None
    return row


# ---- the kernel's weights, shared across batches where the packing is the same ---------------------
def pack_key(plan) -> tuple:
    """What `mk.kernel.packing.pack_weights` reads from a plan besides the params: equal keys, equal packs."""
    from mk.kernel.packing import pack_key
    return pack_key(plan)


def device_bytes_needed(cfg: K3Config, experts: str, impls: Sequence[str], batches: Sequence[int], ctx: int,
                        chip: str, peer_format: str = "bf16") -> dict:
    """Device bytes the bench holds at its peak: {"params", "reference_experts", "kernel", "peer", "caches",
    "total"}; the kernel's packed weights are freed before the reference's experts and the peer's
    are made, so the total counts the larger of the two."""
    from mk.kernel.aot import kernel_weight_shapes
    from mk.perf.baseline import abstract_params
    from mk.model.params import nbytes, shapes
    from mk.kernel.plan import make_plan
    from mk.model.reference import init_cache
    xla_like = [i for i in impls if i != "kernel"]
    kernel = "kernel" in impls
    params = nbytes(abstract_params(cfg, experts)) if (xla_like or kernel) else 0
    ref_experts = (sum(nbytes(shapes(cfg)["moe"][n]) for n in EXPERT_FAMILIES)
                   if experts == "mxfp4" and "reference" in impls else 0)
    kw = 0
    if kernel:
        plan = make_plan(cfg, max(batches), chip=chip, experts=experts, ctx=ctx, check=False)
        kw = sum(int(np.prod(s)) * np.dtype(d).itemsize for s, d in kernel_weight_shapes(plan).values())
    peer_bytes = 0
    if "peer" in impls:
        from mk.perf.peer import expert_bytes
        peer_bytes = int(cfg.n_moe * cfg.experts * expert_bytes(cfg, peer_format))
    caches = 2 * nbytes(jax.eval_shape(lambda: init_cache(cfg, max(batches), ctx)))
    return {"params": params, "reference_experts": ref_experts, "kernel": kw, "peer": peer_bytes, "caches": caches,
            "total": params + max(kw, ref_experts + peer_bytes) + caches}


def check_fits(cfg: K3Config, need: dict, device, hw_chip: str | None, name: str):
    """Refuse, before allocating, a bench whose arrays exceed the device's memory."""
    limit, what = None, "bytes_limit"
    try:
        limit = (device.memory_stats() or {}).get("bytes_limit")
    except Exception:
        pass
    if limit is None and hw_chip:
        from mk.perf.hardware import load_chips
        limit, what = load_chips()[hw_chip].per_core("hbm_bytes"), f"{hw_chip} HBM per core (data/hardware.csv)"
    if limit is not None and need["total"] > limit:
        raise BenchError(f"--config {name}: the bench needs {need['total'] / 1e9:.2f} GB on the device (params "
                         f"{need['params'] / 1e9:.2f} GB, reference experts {need['reference_experts'] / 1e9:.2f} GB, "
                         f"kernel weights {need['kernel'] / 1e9:.2f} GB, peer experts {need.get('peer', 0) / 1e9:.2f} GB, caches {need['caches'] / 1e9:.2f} GB), the "
                         f"device has {limit / 1e9:.2f} GB ({what})")


# ---- the measurement -------------------------------------------------------------------------------
CTX = 256   # the cache positions a bench's steps run in (from position 0 they attend its first block)


def cache_at(cfg: K3Config, batch: int, ctx: int, pos: int) -> dict:
    """An empty cache (`mk.model.reference.init_cache`) whose rows stand at position `pos`: the next
    step attends pos + 1 positions (the kernel reads the 128-position blocks up to its position, and
    zeros cost what keys do), without stepping there first."""
    from mk.model.reference import init_cache
    cache = init_cache(cfg, batch, ctx)
    cache["pos"] = jnp.full((batch,), pos, jnp.int32)
    return cache


def last_positions(ctx: int, steps: int) -> int:
    """The position from which `steps` steps end at the cache's last position (ctx - 1): a bench at
    context length ctx (`mk bench --ctx`)."""
    return max(ctx - steps, 0)


def bench_tokens(cfg: K3Config, batches: Sequence[int], steps: int, seed: int = 0) -> dict[int, np.ndarray]:
    """{B: the [steps, B] int32 tokens `measure` steps at batch B}, each batch drawn from (seed, B)
    alone: a case draws the same tokens whatever else its --batch list holds (a step at B = 8 costs
    what its tokens' distinct experts cost, so `--batch 8` and `--batch 1,8` time the same step)."""
    return {B: np.random.default_rng([seed, B]).integers(0, cfg.vocab, (steps, B)).astype(np.int32)
            for B in batches}


def measure(cfg: K3Config, batches: Sequence[int] = (1, 2, 4, 8), experts: str = "bf16", steps: int = 20,
            warmup: int = 3, impls: Sequence[str] = DEFAULT_IMPLS, prefetch_depth: int | Sequence[int] | None = None,
            params: dict | None = None, *, seed: int = 0, ctx: int = CTX, start: int = 0, progress: bool = True,
            microbench_csv=None, device_steps: int = 5, mxfp4_unpack: str = "auto",
            peer_format: str | None = None, tile: tuple[int, int] | None = None) -> list[dict]:
    """Time each impl at each batch on this TPU; returns rows (see `mk.cli.bench` for the fields).
    peer_format: the peer's expert format (`mk.perf.peer.PEER_FORMATS`; default `default_peer_format`).

    prefetch_depth: the kernel's (None: the plan's default); several: a sweep of the kernel alone, one
    row per depth and batch, the weights drawn once.

    ctx, start: the cache's capacity, and the position the timed steps start from (0: an empty
    cache, each step attending its first block; `mk bench --ctx N` starts at `last_positions(N, warmup
    + steps)`, so that the steps attend up to N positions, and the profile's steps end there too).

    device_steps: that many more steps of each case under `jax.profiler`, for the step program's
    device time (`device_median_ms`, next to the wall clock's `median_ms`); 0: none.
    mxfp4_unpack: the kernel's `ScheduleOptions.mxfp4_unpack` ('auto': the chip's). tile: the kernel's
    weight tile (tk, tn); None: the plan's per-model default (`mk.kernel.plan.default_tile`).

    params: in `experts` format (MXFP4: the packed tree of `mk.io.checkpoint.load(..., experts=
    "mxfp4")`); default `mk.model.params.init_fast(cfg, seed, experts)` on the device."""
    from tqdm.auto import tqdm
    from mk.kernel.plan import MAX_ROWS, make_plan
    from mk.model.layout import PlanError

    impls = tuple(impls)
    bad = [i for i in impls if i not in IMPLS]
    if bad or not impls:
        raise BenchError(f"--impl: unknown {bad or 'empty list'}; expected some of {', '.join(IMPLS)}")
    peer_format = peer_format or default_peer_format(experts)
    if "peer" in impls:
        require_peer(cfg, peer_format)
    require_tpu()
    if experts not in ("bf16", "mxfp4"):
        raise BenchError(f"--experts: expected bf16 or mxfp4, found {experts!r}")
    bad = [b for b in batches if not 1 <= b <= MAX_ROWS]
    if bad or not batches:
        raise BenchError(f"--batch: each batch must lie in 1..{MAX_ROWS}, found {list(batches)}")
    if steps < 1 or warmup < 1:
        raise BenchError(f"--steps and --warmup must be >= 1 (the first call compiles), found {steps} and {warmup}")
    depths = prefetch_depths(prefetch_depth, impls)
    device = jax.devices()[0]
    chips = chip_of_device(device.device_kind)
    plan_chip, hw_chip = chips if chips else ("v5e", None)
    name = _config_name(cfg)
    check_fits(cfg, device_bytes_needed(cfg, experts, impls, batches, ctx, plan_chip, peer_format), device, hw_chip,
               name)
    bw = bandwidths(hw_chip, microbench_csv)
    plan_kw = {}
    if tile is not None:
        plan_kw["tile"] = tuple(tile)
    if mxfp4_unpack != "auto":
        import dataclasses
        from mk.kernel.plan import MK
        plan_kw["options"] = dataclasses.replace(MK, mxfp4_unpack=mxfp4_unpack)
    depth_kw = lambda d: {} if d is None else {"prefetch_depth": d}
    try:                                         # before the weights: a plan that cannot run costs nothing
        plans = {(B, d): make_plan(cfg, B, chip=plan_chip, experts=experts, ctx=ctx, **plan_kw, **depth_kw(d))
                 for B in batches for d in depths}
    except PlanError as e:
        raise BenchError(f"the kernel's plan (--prefetch-depth {prefetch_depth}, --tile {tile}, --mxfp4-unpack "
                         f"{mxfp4_unpack}): {e}") from None

    from mk.perf import baseline
    from mk.model import reference
    from mk.model.params import init_fast
    t0 = time.perf_counter()
    params = params if params is not None else jax.block_until_ready(init_fast(cfg, seed, experts))
    log(f"{name} weights ready ({experts} experts) in {time.perf_counter() - t0:.1f} s")
    tokens = bench_tokens(cfg, batches, warmup + steps, seed)
    distinct: dict[int, list] = {B: [] for B in batches}   # per timed step: distinct experts per layer
    results: dict[tuple, dict] = {}
    bar = tqdm(desc=f"bench {name} {experts}", total=len(batches) * (len(impls) + len(depths) - 1), leave=False,
               disable=None if progress else True)   # stderr, on a terminal only

    def run_case(impl, B, make_step, on_output=None, depth=depths[0]):
        bar.set_postfix_str(f"B={B} {impl}" + (f" depth {depth}" if len(depths) > 1 else ""))
        plan = plans[B, depth]
        row = {"impl": impl, "batch": B, "experts": experts, "peer_format": peer_format if impl == "peer" else None,
               "median_ms": None, "min_ms": None, "max_ms": None,
               "steps": 0, "error": None, "prefetch_depth": plan.prefetch_depth if impl == "kernel" else None,
               "mxfp4_unpack": plan.mxfp4_unpack if impl == "kernel" and experts == "mxfp4" else None}
        t0 = time.perf_counter()
        try:
            step = make_step()
            row.update(summarize(time_steps(step, lambda: cache_at(cfg, B, ctx, start), tokens[B], warmup,
                                            ctx - start, on_output=on_output)))
            if device_steps:
                at = start if start == 0 else last_positions(ctx, device_steps)
                dev, row["device_ops"] = device_step_profile(step, cache_at(cfg, B, ctx, at),
                                                             jnp.asarray(tokens[B][0], jnp.int32), device_steps)
                row["device_median_ms"] = statistics.median(dev) * 1e3 if dev else None
        except Exception as e:                     # a case that does not compile or run: say why, go on
            msg = str(e).strip().splitlines()
            row["error"] = f"{type(e).__name__}: {msg[0] if msg else ''}"[:300]
        row["wall_s"] = time.perf_counter() - t0
        results[impl, B, depth if impl == "kernel" else depths[0]] = row
        bar.update(1)
        ops = row.get("device_ops")
        log(f"B={B} {impl}" + (f" depth {row['prefetch_depth']}" if len(depths) > 1 else "") + ": " + (f"median {row['median_ms']:.3f} ms (min {row['min_ms']:.3f}, max {row['max_ms']:.3f}), "
                                 if row["median_ms"] is not None else f"{row['error']}, ")
            + (f"device {ops['step_ms']:.3f} ms: {ops['ops']:.0f} ops, {ops['idle_ms']:.3f} ms idle between them, " if ops else "")
            + f"{row['wall_s']:.1f} s")

    # The kernel first (its packed weights are freed before the XLA steps, whose temporaries are GBs
    # at B = 8); then the XLA steps, each compiled when its case starts; the xla step's routing gives
    # the distinct experts.
    if "kernel" in impls:
        kernel_cache = {"key": None, "weights": None}
        for d in depths:
            for B in batches:
                run_case("kernel", B, lambda B=B, d=d: _kernel_step(plans[B, d], params, kernel_cache), depth=d)
        kernel_cache.clear()
        gc.collect()
    xla_impls = [i for i in ("xla", "xla-ragged", "reference") if i in impls]
    if xla_impls:
        ref_params = _dequantized_on_device(params) if "reference" in impls and experts == "mxfp4" else params
        fns = {}
        for impl in xla_impls:
            if impl == "reference":
                fns[impl] = (jax.jit(lambda p, c, t: reference.decode_step(p, c, t, cfg=cfg), donate_argnums=(1,)),
                             ref_params)
            else:
                fns[impl] = (baseline.make_baseline_step(cfg, experts, "loop" if impl == "xla" else "ragged",
                                                         routing=impl == "xla"), params)
        compiled = _compile_lazily(fns, batches, cfg, ctx)
        for B in batches:
            for impl in xla_impls:
                fn_params = fns[impl][1]
                make = lambda f=compiled[impl, B], p=fn_params: functools.partial(_call, f(), p)
                on_output = None
                if impl == "xla":
                    on_output = (lambda t, out, B=B: distinct[B].append(_distinct(out[2])) if t >= warmup else None)
                run_case(impl, B, make, on_output)
        del ref_params, fns, compiled
        gc.collect()
    if "peer" in impls:                          # last: its experts are made once the others' are freed
        from mk.perf import peer
        t0 = time.perf_counter()
        try:
            pparams = jax.block_until_ready(peer.peer_params(params, cfg, peer_format, experts))
            log(f"peer experts ready ({peer_format}, {peer.expert_bytes(cfg, peer_format) / 1e6:.1f} MB each) in "
                f"{time.perf_counter() - t0:.1f} s")
            compiled = _compile_lazily({"peer": (peer.make_peer_step(cfg, peer_format), pparams)}, batches, cfg, ctx)
            make = {B: (lambda f=compiled["peer", B]: functools.partial(_call, f(), pparams)) for B in batches}
        except Exception as e:                   # its cases say why; the other impls' rows stand
            pparams = compiled = None
            make = {B: functools.partial(_raise, e) for B in batches}
        for B in batches:
            run_case("peer", B, make[B])
        del pparams, compiled, make
        gc.collect()
    bar.close()

    rows: list[dict] = []
    for B in batches:
        if distinct[B]:
            mean, source = np.mean(np.stack(distinct[B]), axis=0), "routed (xla step)"
        else:
            mean, source = np.full(cfg.n_moe, plans[B, depths[0]].expected_distinct_experts()), "expected (uniform routing)"
        nbytes = step_bytes(cfg, B, experts, [float(x) for x in mean], plans[B, depths[0]])   # depth moves no byte
        for impl in impls:
            for d in depths if impl == "kernel" else depths[:1]:
                r = finish_row(results[impl, B, d], peer_step_bytes(cfg, nbytes, mean, peer_format)
                               if impl == "peer" else nbytes, bw)
                r["distinct_experts"] = [round(float(x), 3) for x in mean]
                r["distinct_source"] = source
                rows.append(r)
    return add_ratios(rows)


def prefetch_depths(prefetch_depth, impls: Sequence[str]) -> list:
    """The kernel's prefetch depths as a list ([None]: the plan's default); several are a sweep of the
    kernel alone, a BenchError beside a rival (it has no prefetch depth)."""
    depths = list(prefetch_depth) if isinstance(prefetch_depth, (list, tuple)) else [prefetch_depth]
    if len(depths) > 1 and set(impls) != {"kernel"}:
        raise BenchError(f"--prefetch-depth {','.join(map(str, depths))}: several depths time the kernel alone "
                         f"(--impl kernel; its rivals have no prefetch depth), found --impl {','.join(impls)}")
    return depths


def default_peer_format(experts: str) -> str:
    """The peer's expert format for a comparison: bf16 beside bf16 experts, int4 beside MXFP4."""
    return "bf16" if experts == "bf16" else "int4"


def require_peer(cfg: K3Config, peer_format: str):
    """Refuse --impl peer, before anything is loaded, where tpu-inference is missing or cannot run cfg."""
    from mk.perf import peer
    if peer_format not in peer.PEER_FORMATS:
        raise BenchError(f"--peer-format: expected one of {', '.join(peer.PEER_FORMATS)}, found {peer_format!r}")
    if not peer.available():
        raise BenchError(f"--impl peer needs {peer.PEER_PACKAGE} {peer.PEER_VERSION}, not importable here: "
                         f"{peer.INSTALL_HINT}")
    peer.block_sizes(cfg, 1)


def peer_step_bytes(cfg: K3Config, nbytes: dict, distinct, peer_format: str) -> dict:
    """`step_bytes` with the routed experts counted in the peer's format (scales included)."""
    from mk.perf.peer import expert_bytes
    out = dict(nbytes, expert_bytes=float(np.sum(distinct)) * expert_bytes(cfg, peer_format))
    out["hbm_bytes"] = out["weight_bytes"] + out["expert_bytes"] + out["state_bytes"]
    return out


def _raise(error: Exception):
    raise error


def _call(executable, params, cache, tokens):
    return executable(params, cache, tokens)


def _compile_lazily(fns: dict, batches, cfg: K3Config, ctx: int) -> dict:
    """{(impl, B): a function that compiles the step (when its case starts, inside its wall time)}."""
    from mk.model.reference import init_cache
    out = {}
    for B in batches:
        cache = jax.eval_shape(lambda B=B: init_cache(cfg, B, ctx))
        tok = jax.ShapeDtypeStruct((B,), jnp.int32)
        for impl, (fn, p) in fns.items():
            out[impl, B] = lambda fn=fn, p=p, c=cache, t=tok: fn.lower(p, c, t).compile()
    return out


def log(msg: str):
    """One progress line on stderr, always (a run cut short by a timeout still says how far it got)."""
    print(f"bench: {msg}", file=sys.stderr, flush=True)


def metadata(cfg: K3Config, experts: str, steps: int, warmup: int, microbench_csv=None,
             peer_format: str | None = None, ctx: int = CTX, start: int = 0) -> dict:
    from mk.perf.results import command_line
    dev = jax.devices()[0]
    chips = chip_of_device(dev.device_kind)
    bw = bandwidths(chips[1] if chips else None, microbench_csv)
    return {"device_kind": dev.device_kind, "chip": chips[1] if chips else None, "backend": jax.default_backend(),
            "date": datetime.datetime.now().isoformat(timespec="seconds"), "jax_version": jax.__version__,
            "config": _config_name(cfg), "experts": experts, "steps": steps, "warmup": warmup,
            "ctx": ctx, "first_position": start, "peer_format": peer_format, "peer": _peer_version() if peer_format else None,
            "command": command_line() if sys.argv else None,
            "datasheet_hbm_bw": bw["datasheet_bw"], "stream_bw": bw["stream_bw"], "stream_source": bw["stream_source"]}


def _peer_version() -> str | None:
    from importlib import metadata as md
    try:
        return f"tpu-inference {md.version('tpu-inference')}"
    except md.PackageNotFoundError:
        return None


def _config_name(cfg: K3Config) -> str:
    from mk.model.config import PRESETS
    return next((n for n, c in PRESETS.items() if c == cfg), "custom config")


def _distinct(ids) -> np.ndarray:
    """ids [n_moe, B, k] -> distinct experts per MoE layer [n_moe]."""
    ids = np.asarray(ids)
    return np.array([len(np.unique(ids[l])) for l in range(ids.shape[0])], np.float64)


def _dequantized_on_device(params: dict) -> dict:
    """params with MXFP4 experts replaced by their bf16 [.., K, N] dequantization (on the device,
    one MoE layer at a time), for the reference."""
    from mk.perf.baseline import dequantize
    deq = jax.jit(lambda p, s: jnp.swapaxes(dequantize(p, s), -1, -2))
    moe = dict(params["moe"])
    for n in EXPERT_FAMILIES:
        w = moe[n]
        moe[n] = jnp.stack([deq(w["packed"][l], w["scale"][l]) for l in range(w["packed"].shape[0])])
    return dict(params, moe=moe)


def _packed_weights(plan, params: dict, cache: dict):
    """The kernel's packed weights for `plan`: the previous batch's when `pack_key` is equal, else
    those are freed before packing anew (cache: {"key", "weights"}, shared across a bench's batches)."""
    from mk.kernel.step import kernel_weights
    key = pack_key(plan)
    if cache["key"] != key:
        cache["weights"] = None
        gc.collect()
        cache["weights"] = kernel_weights(plan, params)
        cache["key"] = key
    return cache["weights"]


def _kernel_step(plan, params: dict, cache: dict):
    """The kernel's step on its packed weights (`_packed_weights`)."""
    from mk.kernel.decode import make_decode_step
    weights = _packed_weights(plan, params, cache)
    fn = make_decode_step(plan)
    return lambda c, t: fn(weights, c, t)


# ---- mk bench --mode generate: the device loop against the device step rate -----------------------
GENERATE_IMPLS = ("kernel", "xla")


def generate_summary(rows: list[dict]) -> str:
    """One line of a `measure_generate` run, for its record: per impl, the loop's tokens/s per batch
    and its fraction of the device step rate (the XLA step with MXFP4 experts named the strawman it is)."""
    batches = sorted({r["batch"] for r in rows})
    parts = []
    for impl in dict.fromkeys(r["impl"] for r in rows):
        by = {r["batch"]: r for r in rows if r["impl"] == impl and not r.get("error")}
        if not by:
            parts.append(f"{impl} not run")
            continue
        name = impl
        if impl == "xla" and any(r.get("experts") == "mxfp4" for r in by.values()):
            name = "xla (a strawman with MXFP4: it unpacks every packed expert each step)"
        parts.append(f"{name} loop {_series((by.get(b, {}).get('loop_tok_s') for b in batches), '.1f')} tok/s, "
                     f"{_series(by.get(b, {}).get('frac_of_device') for b in batches)} of the device step rate")
    return f"B = {' / '.join(map(str, batches))}: " + "; ".join(parts)


def _kernel_loop_step(plan, params: dict, cache: dict):
    """The kernel's step as an `mk.model.loop.LoopStep` on its packed weights (`_packed_weights`)."""
    from mk.kernel.decode import make_decode_step
    from mk.model.loop import LoopStep
    return LoopStep(make_decode_step(plan), _packed_weights(plan, params, cache))


def generate_row(step, cfg: K3Config, batch: int, tokens: np.ndarray, steps: int, chunk: int, ctx: int,
                 device_steps: int, host_steps: int) -> dict:
    """One case of `measure_generate`: a `LoopStep` timed three ways.

    loop: `mk.model.loop.generate` from a 1-token prompt per row (tokens [B]), greedy, `steps` decode
    steps in chunks of `chunk` (a first run of one chunk compiles, untimed); loop_tok_s = B x steps /
    decode_s (first token on the host to the last chunk on the host). device: the step's own device
    time from a `jax.profiler` trace (`device_step_times`, as `mk bench`); device_tok_s = B / it, the
    rate the loop would reach with no gap between steps. host: the per-token host loop's wall clock
    (`time_steps`, each step timed to `block_until_ready`, as `mk bench`)."""
    from mk.model import loop, reference
    prompt = np.asarray(tokens, np.int32).reshape(batch, 1)
    warm = loop.generate(step, cfg, prompt, chunk + 1, ctx=ctx, chunk=chunk)           # compiles
    res = loop.generate(step, cfg, prompt, steps + 1, ctx=ctx, chunk=chunk)
    row = {"chunk": chunk, "decode_steps": res["decode_steps"], "decode_s": res["decode_s"],
           "compile_s": warm["compile_s"], "ttft_s": res["ttft_s"],
           "loop_step_ms": 1e3 * res["decode_s"] / max(res["decode_steps"], 1),
           "loop_tok_s": batch * res["decode_steps"] / res["decode_s"]}
    fn = lambda c, t: step.fn(step.weights, c, t)
    tok = jnp.asarray(prompt[:, 0])
    row["device_step_ms"] = None
    if device_steps:
        dev = device_step_times(fn, step.place(reference.init_cache(cfg, batch, ctx)), tok, device_steps)
        row["device_step_ms"] = statistics.median(dev) * 1e3 if dev else None
    row["device_tok_s"] = batch / (row["device_step_ms"] / 1e3) if row["device_step_ms"] else None
    row["frac_of_device"] = row["loop_tok_s"] / row["device_tok_s"] if row["device_tok_s"] else None
    row["host_step_ms"] = None
    if host_steps:
        host = time_steps(fn, lambda: step.place(reference.init_cache(cfg, batch, ctx)),
                          np.tile(prompt[:, 0], (host_steps + 2, 1)), 2, ctx)
        row["host_step_ms"] = statistics.median(host) * 1e3
    row["host_tok_s"] = batch / (row["host_step_ms"] / 1e3) if row["host_step_ms"] else None
    row["loop_speedup"] = row["loop_tok_s"] / row["host_tok_s"] if row["host_tok_s"] else None
    return row


def check_mode_options(impls: Sequence[str], allowed: Sequence[str], mode: str, experts: str) -> tuple[str, ...]:
    """The impls of a `--mode` bench as a tuple, after refusing (BenchError) an impl it does not run
    or an expert format that is not bf16 or mxfp4."""
    impls = tuple(impls)
    bad = [i for i in impls if i not in allowed]
    if bad or not impls:
        raise BenchError(f"--impl: unknown {bad or 'empty list'} for --mode {mode}; expected some of "
                         f"{', '.join(allowed)}")
    if experts not in ("bf16", "mxfp4"):
        raise BenchError(f"--experts: expected bf16 or mxfp4, found {experts!r}")
    return impls


def measure_generate(cfg: K3Config, batches: Sequence[int] = (1, 2, 4, 8), experts: str = "bf16",
                     impls: Sequence[str] = GENERATE_IMPLS, steps: int = 128, chunk: int = 16, *, seed: int = 0,
                     ctx: int = CTX, device_steps: int = 5, host_steps: int = 20, mxfp4_unpack: str = "auto",
                     params: dict | None = None) -> list[dict]:
    """Decode tokens/s of the device loop (`mk.model.loop`) for the kernel and the fair XLA step at
    each batch, beside the step's device rate and the host loop's; rows as `generate_row` plus impl,
    batch, experts, error. Off a TPU it refuses, like `measure`."""
    from mk.kernel.plan import MAX_ROWS, make_plan
    from mk.model.layout import PlanError
    from mk.model.loop import LoopStep
    from mk.model.params import init_fast
    from mk.perf import baseline

    require_tpu()
    impls = check_mode_options(impls, GENERATE_IMPLS, "generate", experts)
    bad = [b for b in batches if not 1 <= b <= MAX_ROWS]
    if bad or not batches:
        raise BenchError(f"--batch: each batch must lie in 1..{MAX_ROWS}, found {list(batches)}")
    if chunk < 1:
        raise BenchError(f"--chunk must be at least 1 step, found {chunk}")
    if not 1 <= steps <= ctx - 2:
        raise BenchError(f"--steps must lie in 1..{ctx - 2} (the cache holds {ctx} positions), found {steps}")
    device = jax.devices()[0]
    chips = chip_of_device(device.device_kind)
    plan_chip, hw_chip = chips if chips else ("v5e", None)
    name = _config_name(cfg)
    check_fits(cfg, device_bytes_needed(cfg, experts, impls, batches, ctx, plan_chip), device, hw_chip, name)
    t0 = time.perf_counter()
    params = params if params is not None else jax.block_until_ready(init_fast(cfg, seed, experts))
    log(f"{name} weights ready ({experts} experts) in {time.perf_counter() - t0:.1f} s")
    tokens = {B: t[0] for B, t in bench_tokens(cfg, batches, 1, seed).items()}     # one step's tokens a batch
    plan_kw = {}
    if mxfp4_unpack != "auto":
        import dataclasses
        from mk.kernel.plan import MK
        plan_kw["options"] = dataclasses.replace(MK, mxfp4_unpack=mxfp4_unpack)
    rows = []

    def run_case(impl, B, make_step):
        row = {"impl": impl, "batch": B, "experts": experts, "error": None}
        t = time.perf_counter()
        try:
            row.update(generate_row(make_step(), cfg, B, tokens[B], steps, chunk, ctx, device_steps, host_steps))
        except Exception as e:                     # a case that does not compile or run: say why, go on
            msg = str(e).strip().splitlines()
            row["error"] = f"{type(e).__name__}: {msg[0] if msg else ''}"[:300]
        row["wall_s"] = time.perf_counter() - t
        rows.append(row)
        log(f"B={B} {impl} loop: " + (f"{row['loop_tok_s']:.1f} tok/s ({row['loop_step_ms']:.3f} ms/step), device "
                                      f"{row['device_step_ms']} ms/step, host loop {row['host_step_ms']} ms/step, "
                                      if row["error"] is None else f"{row['error']}, ") + f"{row['wall_s']:.1f} s")
        log("row " + json.dumps(row))           # the whole row on stderr: kept if a timeout ends the run

    if "kernel" in impls:
        try:
            plans = {B: make_plan(cfg, B, chip=plan_chip, experts=experts, ctx=ctx, **plan_kw) for B in batches}
        except PlanError as e:
            raise BenchError(f"the kernel's plan (--mxfp4-unpack {mxfp4_unpack}): {e}") from None
        kernel_cache = {"key": None, "weights": None}
        for B in batches:
            run_case("kernel", B, lambda B=B: _kernel_loop_step(plans[B], params, kernel_cache))
        kernel_cache.clear()
        gc.collect()
    if "xla" in impls:
        xla = LoopStep(baseline.make_baseline_step(cfg, experts, "loop"), params)
        for B in batches:
            run_case("xla", B, lambda: xla)
    order = {i: n for n, i in enumerate(impls)}
    return sorted(rows, key=lambda r: (r["batch"], order[r["impl"]]))
