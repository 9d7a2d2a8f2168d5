"""The parallel prefill's FLOPs, and a benchmark of it against token-by-token prefill on a TPU.

    prefill_flops(cfg, T=1024, B=1)   -> {"total", "matmul", "attention", "kda_chunked", "by_category"}
    prefill_bench(cfg, lengths=(128, 1024, 4096), experts="bf16")   -> JSON-able rows (TPU only)

FLOPs are counted as the prompt needs them (2 per multiply-add): every weight matrix a token
passes through once per token (`mk.model.params.shapes`; the routed experts top_k of E; the
embedding is a gather), MLA's causal attention over the prompt (query x key pairs with j <= t, the
192-wide scores and 128-wide values of each head), and the chunked delta rule's products
(`mk.perf.prefill.chunked_delta_rule`: per token and head 3 [D, D] products with the state and
the sub-chunk's c-wide ones). Vector work (norms, softmax, conv, activations) is not counted. The
roofline time is FLOPs / the chip's datasheet bf16 peak (data/hardware.csv); the fp32 products of
the delta rule and of attention's values run at full precision (several MXU passes) and count once.

`prefill_bench` times, per prompt length T (batch 1, random ids, a fresh cache of ctx = T rounded up
to 128 slots per call): "parallel" (`mk.perf.prefill.prefill`, one compiled chunk program per
chunk) and, for T in `token_lengths`, "token_by_token": the fair XLA decode step
(`mk.perf.baseline.step`, the same experts format) scanned over the prompt in one program, as
`mk.model.reference.prefill` scans the reference's step (the fair step is the faster of the two).
Each is run once untimed (compile), then `reps` times to `jax.block_until_ready`, wall clock. Each
row is also logged as JSON as soon as it is measured (a run stopped later keeps it).
"""
from __future__ import annotations

import functools
import json
import math
import statistics
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mk.model.config import K3Config
from mk.perf.roofline import category

MATMUL_FAMILIES = ("kda", "mla", "dense", "moe")
ROUTED = ("w1", "w3", "w2")


def prefill_flops(cfg: K3Config, T: int, B: int = 1, start: int = 0) -> dict:
    """FLOPs of prefilling B prompts of T tokens each from position `start` (module doc).
    Returns {"total", "matmul", "attention", "kda_chunked", "by_category": {category: flops}}
    (categories as `mk.perf.roofline.category` names them)."""
    from mk.model.params import shapes
    from mk.perf.prefill import kda_chunk
    s = shapes(cfg)
    by: dict[str, float] = {}
    per_token = {"lm_head": math.prod(s["lm_head"].shape)}
    for fam in MATMUL_FAMILIES:
        for name, st in s[fam].items():
            matrix_rank = 2 if fam == "dense" else 3                 # the others stack layers first
            if len(st.shape) < matrix_rank or name == "conv":
                continue                                             # vectors: norms, biases, decays; taps
            n = math.prod(st.shape)
            per_token[f"{fam}.{name}"] = n * cfg.top_k / cfg.experts if name in ROUTED else n
    for name, n in per_token.items():
        cat = "moe_experts" if name.split(".")[-1] in ROUTED else category(name)
        by[cat] = by.get(cat, 0.0) + 2.0 * n * B * T
    matmul = sum(by.values())
    pairs = T * start + T * (T + 1) / 2                                   # keys j <= t of each query
    attention = 2.0 * B * cfg.n_mla * cfg.heads * pairs * (cfg.qk_head_dim + cfg.head_dim)
    D, c = cfg.head_dim, kda_chunk(cfg)
    kda = 2.0 * B * T * cfg.n_kda * cfg.heads * (3 * D * D + 5 * c * D)
    by["mla_attention"], by["kda_chunked"] = attention, kda
    return {"total": matmul + attention + kda, "matmul": matmul, "attention": attention, "kda_chunked": kda,
            "by_category": by}


def _scanned_steps(cfg: K3Config, experts: str):
    """Token-by-token prefill in one program: the fair XLA step scanned over tokens [B, T]."""
    from mk.perf.baseline import step

    @functools.partial(jax.jit, donate_argnums=(1,))
    def run(params, cache, tokens):
        def one(c, tok):
            logits, c = step(params, c, tok, cfg=cfg, experts=experts)
            return c, logits[:, :8]                    # a slice: the [T, B, V] stack is not the point
        cache, out = jax.lax.scan(one, cache, tokens.T)
        return out, cache
    return run


def prefill_bench(cfg: K3Config, lengths: Sequence[int] = (128, 1024, 4096), experts: str = "bf16",
                  token_lengths: Sequence[int] = (128, 1024), reps: int = 3, chunk: int | None = None,
                  seed: int = 0, log=print) -> list[dict]:
    """Time parallel vs token-by-token prefill on this TPU (module doc). Rows: impl, experts, tokens,
    batch, chunk, median_ms, min_ms, times_ms, first_call_s (compile + one run), tok_s, flops,
    roofline_ms (flops / bf16 peak), x_roofline (median / roofline), frac_roofline (its inverse),
    and on parallel rows speedup (token_by_token's median / this one's, where both ran).
    Refuses off a TPU (`mk.perf.bench.BenchError`)."""
    from mk.model.params import init_fast
    from mk.perf.prefill import DEFAULT_CHUNK, prefill
    from mk.model.reference import init_cache
    from mk.perf.bench import BenchError, chip_of_device, require_tpu
    from mk.perf.hardware import load_chips

    require_tpu()
    if reps < 1:
        raise BenchError(f"reps must be >= 1, found {reps}")
    chunk = chunk or DEFAULT_CHUNK
    hw = (chip_of_device(jax.devices()[0].device_kind) or (None, None))[1]
    peak = load_chips()[hw].bf16_flops if hw else None
    t0 = time.perf_counter()
    params = jax.block_until_ready(init_fast(cfg, seed, experts))
    log(f"prefill bench: weights ({experts} experts) in {time.perf_counter() - t0:.1f} s")
    rng = np.random.default_rng(seed)
    scanned = _scanned_steps(cfg, experts)
    rows = []
    for T in lengths:
        ctx = -(-T // 128) * 128
        tokens = rng.integers(0, cfg.vocab, (1, T)).astype(np.int32)
        runs = {"parallel": lambda c: prefill(params, c, tokens, cfg=cfg, chunk=chunk, experts=experts)}
        if T in token_lengths:
            runs["token_by_token"] = lambda c: scanned(params, c, jnp.asarray(tokens))
        for impl, fn in runs.items():
            times, first = [], None
            for r in range(reps + 1):
                cache = jax.block_until_ready(init_cache(cfg, 1, ctx))
                t = time.perf_counter()
                out = jax.block_until_ready(fn(cache))
                dt = time.perf_counter() - t
                del out, cache
                if r == 0:
                    first = dt
                else:
                    times.append(dt)
            flops = prefill_flops(cfg, T, 1)["total"]
            med = statistics.median(times)
            row = {"impl": impl, "experts": experts, "tokens": T, "batch": 1, "ctx": ctx,
                   "chunk": min(chunk, T) if impl == "parallel" else None,
                   "median_ms": 1e3 * med, "min_ms": 1e3 * min(times), "times_ms": [1e3 * x for x in times],
                   "first_call_s": first, "tok_s": T / med, "flops": flops,
                   "roofline_ms": 1e3 * flops / peak if peak else None}
            row["x_roofline"] = row["median_ms"] / row["roofline_ms"] if peak else None
            row["frac_roofline"] = 1.0 / row["x_roofline"] if peak else None
            log(f"prefill bench: {impl} T={T} {experts}: {row['median_ms']:.1f} ms "
                f"({row['x_roofline'] or float('nan'):.2f}x roofline), first call {first:.1f} s; {json.dumps(row)}")
            rows.append(row)
        by_impl = {r["impl"]: r for r in rows if r["tokens"] == T}
        if "token_by_token" in by_impl:
            by_impl["parallel"]["speedup"] = by_impl["token_by_token"]["median_ms"] / by_impl["parallel"]["median_ms"]
    return rows


def prefill_summary(rows: list[dict]) -> str:
    """One line of a `prefill_bench` run, for its record: each parallel length's time, its multiple of
    the MXU roofline and, where timed, its speedup over token by token."""
    parts = []
    for r in rows:
        if r["impl"] != "parallel":
            continue
        s = f"T = {r['tokens']}: {r['median_ms']:.1f} ms"
        if r.get("x_roofline") is not None:
            s += f", {r['x_roofline']:.2f}x roofline"
        if r.get("speedup") is not None:
            s += f", {r['speedup']:.0f}x token by token"
        parts.append(s)
    return "parallel prefill " + "; ".join(parts) if parts else "no parallel prefill timed"
