"""The K3 decode megakernel: `make_decode_step(plan)` builds one pallas_call per step.

    plan    = mk.plan.make_plan(cfg, batch, prefetch_depth=4)
    weights = kernel_weights(plan, params)          # params in mk.params layout, packed once
    step    = make_decode_step(plan)                # jitted; cache donated
    logits, cache = step(weights, cache, tokens)    # cache as mk.reference.init_cache

On a TPU backend the kernel is compiled by Mosaic; anywhere else it runs in TPU interpret mode.
"""
from __future__ import annotations

import gc

import jax
import jax.numpy as jnp
import numpy as np

from mk.config import K3Config
from mk.kernel.decode import KERNEL_NAME, build_call, default_mesh, interpret_params, make_decode_step, on_tpu
from mk.plan import Plan, make_plan, pack_weights

__all__ = ["experts_format", "KERNEL_NAME", "build_call", "default_mesh", "interpret_params", "make_decode_step",
           "kernel_weights", "place_cache", "make_step_fn", "teacher_forced_logits", "make_plan", "on_tpu"]


# TPU interpret mode copies the kernel's inputs (the weights) into its simulated memory on every
# call and leaves those copies in reference cycles, which only a full collection frees: measured
# on a 1.36 GB checkpoint, host RSS grew by 1.39 GB per decode step (5 steps: 10.5 GB) and fell back
# to 3.7 GB after gc.collect(). So interpreted steps collect when the weights are this large
# (a collection costs 0.1-0.3 s; small test models skip it).
COLLECT_ABOVE_BYTES = 64 << 20


def kernel_weights(plan: Plan, params: dict, mesh=None) -> dict:
    """Device arrays the kernel reads: packed tiles, experts, vector tables, the embedding.

    On a mesh each device gets its own share (`pack_weights(plan, params, rank)`), stacked along
    the leading axis and placed by `NamedSharding(mesh, P(ALL))`."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    from mk.sharding import ALL

    mesh = mesh if mesh is not None else default_mesh(plan)
    shares = [pack_weights(plan, params, r) for r in range(plan.devices)]
    place = lambda x: jax.device_put(x, NamedSharding(mesh, P(ALL)))
    out = {}
    for k in list(shares[0]):       # one array at a time, each share's copy dropped once placed
        parts = [s.pop(k) for s in shares]
        out[k] = jax.block_until_ready(place(parts[0] if len(parts) == 1 else np.concatenate(parts)))
        del parts
    out["embed"] = place(np.asarray(params["embed"]))
    return jax.block_until_ready(out)


def place_cache(cache: dict, mesh) -> dict:
    """Put a cache (mk.reference.init_cache layout) on `mesh`, sharded as mk.sharding says."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    from mk.sharding import CACHE_SPECS
    return jax.block_until_ready(
        {k: jax.device_put(v, NamedSharding(mesh, P(*CACHE_SPECS[k]))) for k, v in cache.items()})


def experts_format(params: dict) -> str:
    """"mxfp4" if params' routed experts are packed (`mk.checkpoint.load(..., experts="mxfp4")`:
    moe.w1 = {"packed", "scale"}), else "bf16"."""
    moe = params.get("moe", {}) if isinstance(params, dict) else {}
    return "mxfp4" if isinstance(moe.get("w1"), dict) else "bf16"


def make_step_fn(params: dict, cfg: K3Config, batch: int, *, prefetch_depth: int | None = None,
                 ctx: int = 256, interpret=None, mesh: int | None = None, **plan_kw):
    """A `step_fn(params, cache, tokens) -> (logits, cache)` backed by the kernel (the `params`
    argument is ignored: weights are packed once here), for `mk.reference.generate`.

    The routed experts keep the format `params` holds them in (`experts_format`): packed MXFP4
    experts stay packed in HBM and are dequantized in VMEM; `experts="bf16"` in `plan_kw` asks
    for bf16 expert tiles instead.

    mesh: number of devices (default 1); the layout is `mk.sharding.default_layout`. Caches
    passed in are placed on the mesh on first use. After each call `step_fn.last_prefix` holds
    every device's final residual prefix p, [devices, B, d] bf16 (replicated: equal bits)."""
    from mk.sharding import default_layout

    kw = dict(plan_kw)
    kw.setdefault("experts", experts_format(params))
    if prefetch_depth is not None:
        kw["prefetch_depth"] = prefetch_depth
    if mesh is not None and mesh > 1 and "layout" not in kw:
        kw["layout"] = default_layout(cfg, mesh)
    plan = make_plan(cfg, batch, ctx=ctx, **kw)
    device_mesh = default_mesh(plan)
    weights = kernel_weights(plan, params, device_mesh)
    step = make_decode_step(plan, interpret, device_mesh, return_prefix=True)
    interpreted = bool(interpret) or (interpret is None and not on_tpu())
    collect = interpreted and sum(w.nbytes for w in weights.values()) > COLLECT_ABOVE_BYTES
    if collect:
        gc.collect()

    def step_fn(_params, cache, tokens):
        logits, cache, step_fn.last_prefix = step(weights, place_cache(cache, device_mesh),
                                                  jnp.asarray(tokens, jnp.int32))
        if collect:
            jax.block_until_ready(logits)
            gc.collect()                       # the interpreter's copies of the weights (above)
        return logits, cache

    step_fn.plan = plan
    step_fn.mesh = device_mesh
    return step_fn


def teacher_forced_logits(params: dict, cfg: K3Config, tokens, ctx: int | None = None, **kw) -> np.ndarray:
    """tokens [T] as one row from position 0 -> float32 logits [T, V], via the kernel."""
    from mk.reference import DEFAULT_CTX, init_cache

    tokens = np.asarray(tokens, np.int32).reshape(-1)
    ctx = ctx or max(DEFAULT_CTX, -(-tokens.size // 128) * 128)
    step_fn = make_step_fn(params, cfg, 1, ctx=ctx, **kw)
    cache = init_cache(cfg, 1, ctx)
    rows = []
    for t in tokens:
        logits, cache = step_fn(None, cache, jnp.asarray([t]))
        rows.append(np.asarray(logits[0], np.float32))
    return np.stack(rows)
