"""The megakernel as a decode step: weights packed onto the devices, a step function, a verifier.

    plan    = mk.kernel.plan.make_plan(cfg, batch, prefetch_depth=4)
    weights = kernel_weights(plan, params)          # params in mk.model.params layout, packed once
    step    = make_decode_step(plan)                # mk.kernel.decode: jitted; cache donated
    logits, cache = step(weights, cache, tokens)    # cache as mk.model.reference.init_cache

`make_step_fn(params, cfg, batch)` does all of that behind the reference's step signature.
Speculative decoding runs the same kernel with 1 + k rows per sequence (`make_plan(..., k=k)`):
`KernelVerifier` is the verify step `mk.kernel.speculative.generate` drives (`verifier=`).

On a TPU backend the kernel is compiled by Mosaic; anywhere else it runs in TPU interpret mode.
"""
from __future__ import annotations

import functools
import gc

import jax
import jax.numpy as jnp
import numpy as np

from mk.model.config import K3Config
from mk.model.params import experts_format
from mk.kernel.decode import commit, default_mesh, make_decode_step, make_verify_step, on_tpu
from mk.kernel.plan import Plan, make_plan
from mk.kernel.packing import pack_weights


# TPU interpret mode copies the kernel's inputs (the weights) into its simulated memory on every
# call and leaves those copies in reference cycles, which only a full collection frees: measured
# on a 1.36 GB checkpoint, host RSS grew by 1.39 GB per decode step (5 steps: 10.5 GB) and fell back
# to 3.7 GB after gc.collect(). So interpreted steps collect when the weights are this large
# (a collection costs 0.1-0.3 s; small test models skip it), and compile ahead of their first run
# so that what the compiler freed is returned before the interpreter holds its copy of the weights
# (measured: peak RSS of `mk logits --backend kernel` on that checkpoint 3.69 -> 3.43 GB).
COLLECT_ABOVE_BYTES = 64 << 20


def release_host_memory():
    """gc.collect(), then hand freed heap pages back to the OS (glibc `malloc_trim`, where there
    is one): after a step, freed interpreter buffers otherwise stay resident and raise the next
    step's peak (measured on the 1.36 GB checkpoint: step peak 3.44 -> 3.20 GB)."""
    import ctypes
    import ctypes.util

    gc.collect()
    global _TRIM
    if _TRIM is None:
        lib = ctypes.util.find_library("c")
        _TRIM = getattr(ctypes.CDLL(lib), "malloc_trim", False) if lib else False
    if _TRIM:
        _TRIM(0)


_TRIM = None


def kernel_weights(plan: Plan, params: dict, mesh=None) -> dict:
    """Device arrays the kernel reads: packed tiles, experts, vector tables, the embedding.

    On a mesh each device gets its own share (`pack_weights(plan, params, rank)`, packed there by
    `device_share`: jitted, on the device), the blocks of one global array per name, sharded along the leading axis by
    `NamedSharding(mesh, P(ALL))`. Shares are packed one device at a time and only for this
    process's devices. `params` may be `mk.io.checkpoint.Checkpoint.lazy_params(...)`: slots are
    then read as they are packed, and beyond what the devices hold the host holds one piece (see
    `device_share`) and the embedding (read whole), never a share, whatever the checkpoint's size."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    from mk.model.sharding import ALL

    mesh = mesh if mesh is not None else default_mesh(plan)
    sharding = NamedSharding(mesh, P(ALL))
    N = plan.devices
    rank_of = {d: (idx[0].start or 0) for d, idx in sharding.addressable_devices_indices_map((N,)).items()}
    blocks: dict[str, list] = {}
    for dev, rank in sorted(rank_of.items(), key=lambda kv: kv[1]):
        for k, x in device_share(plan, params, rank, dev).items():
            blocks.setdefault(k, []).append(x)
    out = {k: jax.make_array_from_single_device_arrays((N * v[0].shape[0],) + v[0].shape[1:], sharding, v)
           for k, v in blocks.items()}
    embed = params["embed"]                 # a jax array stays on the device (no round trip through the host)
    out["embed"] = jax.device_put(embed if isinstance(embed, jax.Array) else np.asarray(embed), sharding)
    return jax.block_until_ready(out)


def device_share(plan: Plan, params: dict, rank: int, device, stream: bool | None = None) -> dict:
    """Rank `rank`'s packed weights (the arrays of `pack_weights`) on `device`: packed there by one
    jitted program from arrays (the parameters move to `device` first where they are not there), or
    with `stream` (default: for a lazy tree, `Checkpoint.lazy_params`) read and packed piece by
    piece into arrays allocated on `device` once (`mk.kernel.packing.pack_pieces`), so the host
    holds one piece at a time, not the share."""
    return pack_weights(plan, params, rank, device, stream=stream)


def place_cache(cache: dict, mesh) -> dict:
    """Put a cache (mk.model.reference.init_cache layout) on `mesh`, sharded as mk.model.sharding says."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    from mk.model.sharding import CACHE_SPECS
    return jax.block_until_ready(
        {k: jax.device_put(v, NamedSharding(mesh, P(*CACHE_SPECS[k]))) for k, v in cache.items()})


def attached_chip() -> str:
    """The mk.kernel.plan chip the kernel runs on: the attached TPU's generation on a TPU backend; in
    interpret mode "tpu7x", the generation mk's design targets (VMEM budget, MXFP4 unpack)."""
    from mk.kernel.plan import chip_of_device
    return chip_of_device(jax.devices()[0]) if on_tpu() else "tpu7x"


def kernel_weight_bytes(plan: Plan) -> int:
    """HBM bytes of one device's packed kernel weights (`kernel_weights`), from the plan alone."""
    from mk.kernel.aot import kernel_weight_shapes
    return sum(int(np.prod(shape)) * dtype.itemsize for shape, dtype in kernel_weight_shapes(plan).values())


def fits_attached_chip(cfg: K3Config, experts: str = "bf16", *, kernel: bool = True, xla: bool = True,
                       batch: int = 8, ctx: int = 256) -> dict:
    """On a TPU backend, refuse in one line (`mk.errors.UserError`), before anything is allocated,
    a config whose weights do not fit the attached chip: the kernel's packed weights (`kernel`)
    plus a bf16 parameter tree for an XLA step (`xla`), against the device's memory limit. Returns
    the figures ({} on CPU, where the weights live in host memory)."""
    if not on_tpu():
        return {}
    from mk.model import params as params_mod
    from mk.errors import UserError
    from mk.model.reference import init_cache
    dev = jax.devices()[0]
    limit = (dev.memory_stats() or {}).get("bytes_limit")
    need = {}
    if kernel:
        need["kernel weights"] = kernel_weight_bytes(make_plan(cfg, batch, ctx=ctx, experts=experts, check=False,
                                                               chip=attached_chip()))
    if xla:
        need["XLA parameters (bf16)"] = params_mod.nbytes(params_mod.shapes(cfg))
    need["caches"] = params_mod.nbytes(jax.eval_shape(lambda: init_cache(cfg, batch, ctx)))
    total = sum(need.values())
    if limit and total > limit:
        parts = " + ".join(f"{k} {v / 1e9:.2f}" for k, v in need.items())
        raise UserError(f"config does not fit the attached {dev.device_kind}: {parts} = {total / 1e9:.2f} GB "
                        f"> {limit / 1e9:.2f} GB of device memory (try --config k3-chip)")
    return {"need_bytes": need, "total_bytes": total, "limit_bytes": limit}


def expert_k_chunk(plan: Plan) -> int:
    """The depth of the K slices the kernel's routed-expert matmuls sum in order, for the references
    to mirror (`mk.model.layers.common.mm`): MX_GROUP for MXFP4 experts on the fp8 path (group partials,
    `mk.kernel.ring.fp8_tile_product`), else K_CHUNK."""
    from mk.model.layers.common import K_CHUNK
    from mk.model.config import MX_GROUP
    return MX_GROUP if plan.experts == "mxfp4" and plan.options.mxfp4_matmul == "fp8" else K_CHUNK


def _plan_for(params: dict, cfg: K3Config, batch: int, prefetch_depth, ctx, mesh, plan_kw) -> Plan:
    from mk.model.sharding import default_layout

    kw = dict(plan_kw)
    kw.setdefault("experts", experts_format(params))
    kw.setdefault("chip", attached_chip())
    if prefetch_depth is not None:
        kw["prefetch_depth"] = prefetch_depth
    if mesh is not None and mesh > 1 and "layout" not in kw:
        kw["layout"] = default_layout(cfg, mesh)
    return make_plan(cfg, batch, ctx=ctx, **kw)


def make_step_fn(params: dict, cfg: K3Config, batch: int, *, prefetch_depth: int | None = None,
                 ctx: int = 256, interpret=None, mesh: int | None = None, **plan_kw):
    """A `step_fn(params, cache, tokens) -> (logits, cache)` backed by the kernel (the `params`
    argument is ignored: weights are packed once here), for `mk.model.reference.generate`.

    The routed experts keep the format `params` holds them in (`experts_format`): packed MXFP4
    experts stay packed in HBM and are dequantized in VMEM; `experts="bf16"` in `plan_kw` asks
    for bf16 expert tiles instead.

    mesh: number of devices (default 1); the layout is `mk.model.sharding.default_layout`. Caches
    passed in are placed on the mesh on first use. After each call `step_fn.last_prefix` holds
    every device's final residual prefix p, [devices, B, d] bf16 (replicated: equal bits)."""
    plan = _plan_for(params, cfg, batch, prefetch_depth, ctx, mesh, plan_kw)
    device_mesh = default_mesh(plan)
    weights = kernel_weights(plan, params, device_mesh)
    step = make_decode_step(plan, interpret, device_mesh, return_prefix=True)
    interpreted = bool(interpret) or (interpret is None and not on_tpu())
    collect = interpreted and sum(w.nbytes for w in weights.values()) > COLLECT_ABOVE_BYTES
    if collect:
        release_host_memory()                  # what packing freed

    compiled = {}

    def step_fn(_params, cache, tokens):
        args = (weights, place_cache(cache, device_mesh), jnp.asarray(tokens, jnp.int32))
        run = step
        leaves, tree = jax.tree.flatten(args[1:])
        if collect and not any(isinstance(x, jax.core.Tracer) for x in leaves):
            # compile first, release what compiling freed, then run (a lower peak); traced calls
            # (mk.kernel.check counting pallas_calls) go through the jitted step
            key = (tree, tuple((x.shape, x.dtype, x.sharding) for x in leaves))
            if key not in compiled:
                compiled[key] = step.lower(*args).compile()
                release_host_memory()
            run = compiled[key]
        logits, cache, step_fn.last_prefix = run(*args)
        if collect:
            jax.block_until_ready(logits)
            release_host_memory()              # the interpreter's copies of the weights (above)
        return logits, cache

    step_fn.plan = plan
    step_fn.mesh = device_mesh
    step_fn.loop_step = lambda _params=None: loop_step(step, weights, device_mesh)
    return step_fn


def loop_step(step, weights: dict, mesh):
    """The kernel's step for `mk.model.loop` (traced inside its decode chunks): `step` from
    `make_decode_step`, its packed weights, caches placed on `mesh`."""
    from mk.model.loop import LoopStep
    return LoopStep(step, weights, functools.partial(place_cache, mesh=mesh))


class KernelVerifier:
    """The speculative verify step on the kernel, for `mk.kernel.speculative.generate(..., verifier=)`:
    `batch` sequences x (1 + k) rows per step, the prefix p of `aux_layers` copied out.

    Its cache is the reference's (`mk.model.reference.init_cache`) with the KDA and conv states one per
    ROW, [batch * (1 + k), n_kda, ...], and `state_row` [batch]: the row of each sequence whose
    post-state the next step starts from. `verify` runs one step (the cache is consumed, updated
    in place); `commit(cache, block, count)` sets state_row = count and pos += count + 1, nothing
    else: the rejected rows' states stay where they are, their MLA slots are masked and later
    overwritten. `adopt` takes a reference-layout cache (e.g. prefilled by `mk.model.reference`),
    `to_reference` gives one back (the accepted rows' states).

    Weights are packed once here (`params` as for `make_step_fn`); mesh: number of devices."""

    def __init__(self, params: dict, cfg: K3Config, batch: int, k: int, aux_layers=(), *,
                 prefetch_depth: int | None = None, ctx: int = 256, interpret=None, mesh: int | None = None,
                 **plan_kw):
        self.cfg, self.k, self.aux_layers = cfg, k, tuple(aux_layers)
        self.plan = _plan_for(params, cfg, batch, prefetch_depth, ctx, mesh,
                              dict(plan_kw, k=k, aux_layers=self.aux_layers))
        self.mesh = default_mesh(self.plan)
        self.weights = kernel_weights(self.plan, params, self.mesh)
        self._verify = make_verify_step(self.plan, interpret, self.mesh)
        # what `traced` hands a device loop is decided by this (`mk.model.compile_cache.Program`'s identity)
        self.identity = f"KernelVerifier[{self._verify.identity}]"

    def init_cache(self, batch: int, ctx: int) -> dict:
        from mk.model.reference import init_cache
        return self.adopt(init_cache(self.cfg, batch, ctx))

    def adopt(self, cache: dict) -> dict:
        """A reference-layout cache -> this verifier's layout (each sequence's state on all its rows,
        state_row 0), placed on the mesh."""
        S, T = self.plan.sequences, self.plan.seq_rows
        if cache["pos"].shape != (S,):
            raise ValueError(f"cache of {cache['pos'].shape[0]} sequences, the verifier's plan has {S}")
        out = {n: v for n, v in cache.items() if n != "state_row"}
        for n in ("kda_state", "conv_state"):
            out[n] = jnp.repeat(cache[n], T, axis=0)
        out["state_row"] = jnp.zeros((S,), jnp.int32)
        return place_cache(out, self.mesh)

    def to_reference(self, cache: dict) -> dict:
        """This verifier's cache -> the reference's layout (each sequence's state_row state)."""
        T = self.plan.seq_rows
        rows = np.arange(self.plan.sequences) * T + np.asarray(cache["state_row"])
        out = {n: v for n, v in cache.items() if n != "state_row"}
        for n in ("kda_state", "conv_state"):
            out[n] = jnp.asarray(cache[n])[rows]
        return out

    def verify(self, params, cache: dict, tokens, aux_layers=None):
        """tokens [batch, 1 + k] -> (logits [batch, 1 + k, V] f32, block); `params` is ignored
        (the weights were packed at construction). block: see `mk.kernel.decode.sharded_block`."""
        if aux_layers is not None and tuple(aux_layers) != self.aux_layers:
            raise ValueError(f"aux layers {tuple(aux_layers)} requested, the verifier's plan copies {self.aux_layers}")
        tokens = jnp.asarray(tokens, jnp.int32)
        if tokens.shape != (self.plan.sequences, self.plan.seq_rows):
            raise ValueError(f"tokens of shape {tokens.shape}, the verifier's plan runs "
                             f"{(self.plan.sequences, self.plan.seq_rows)} (sequences, 1 + k)")
        return self._verify(self.weights, place_cache(cache, self.mesh), tokens)

    def commit(self, cache: dict, block: dict, count) -> dict:
        return commit(block, jnp.asarray(count, jnp.int32))

    def traced(self, _params, aux_layers):
        """(weights, verify, commit) traceable, for `mk.kernel.speculative.device_generate`: the jitted
        verify step on the packed weights (the cache must be `adopt`ed, i.e. on the mesh, already)."""
        if tuple(aux_layers) != self.aux_layers:
            raise ValueError(f"aux layers {tuple(aux_layers)} requested, the verifier's plan copies {self.aux_layers}")
        return self.weights, self._verify, lambda cache, block, count: commit(block, count)


def teacher_forced_logits(params: dict, cfg: K3Config, tokens, ctx: int | None = None, **kw) -> np.ndarray:
    """tokens [T] as one row from position 0 -> float32 logits [T, V], via the kernel."""
    from mk.model.reference import DEFAULT_CTX, init_cache

    tokens = np.asarray(tokens, np.int32).reshape(-1)
    ctx = ctx or max(DEFAULT_CTX, -(-tokens.size // 128) * 128)
    step_fn = make_step_fn(params, cfg, 1, ctx=ctx, **kw)
    cache = init_cache(cfg, 1, ctx)
    rows = []
    for t in tokens:
        logits, cache = step_fn(None, cache, jnp.asarray([t]))
        rows.append(np.asarray(logits[0], np.float32))
    return np.stack(rows)
