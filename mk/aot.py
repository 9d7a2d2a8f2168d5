"""Deviceless TPU compilation: the real Mosaic + XLA TPU compiler, run on this CPU machine.

`compile_step(plan, topology)` lowers one decode step (the megakernel, or the XLA reference)
against abstract TPU devices from libtpu (`jax.experimental.topologies`), with ShapeDtypeStructs
instead of weights, and compiles it. The compiler enforces the chip's VMEM capacity, layouts and
lowering rules exactly as on a TPU VM, which interpret mode cannot.
"""
from __future__ import annotations

import dataclasses
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from mk.config import K3Config
from mk.plan import Plan

# Topology name prefix -> chip name used by mk.plan
CHIP_OF_TOPOLOGY = {"v5e": "v5e", "v5p": "v5p", "v6e": "v6e", "tpu7x": "tpu7x", "v4": "v5p"}


def chip_of(topology: str) -> str:
    prefix = topology.split(":")[0]
    if prefix not in CHIP_OF_TOPOLOGY:
        raise ValueError(f"unknown topology {topology!r}: expected e.g. tpu7x:2x2x1, v6e:2x2, v5e:2x2")
    return CHIP_OF_TOPOLOGY[prefix]


@dataclasses.dataclass
class CompileResult:
    compiled: bool
    compile_s: float
    lower_s: float
    error: str | None = None
    memory: dict | None = None


def _topology(topology: str):
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "")
    from jax.experimental import topologies
    return topologies.get_topology_desc(topology, "tpu")


def _topology_device(topology: str):
    return _topology(topology).devices[0]


def _struct(x, sharding):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


def kernel_abstract_inputs(plan: Plan, mesh):
    """ShapeDtypeStructs of the kernel's weights, cache and tokens, sharded over `mesh` as the
    kernel reads them (per-device shares stacked on the leading axis; caches by head)."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    from mk.reference import init_cache
    from mk.sharding import ALL, CACHE_SPECS
    cfg, N = plan.config, plan.devices
    shard = lambda *spec: NamedSharding(mesh, P(*spec))
    sds = lambda shape, dtype, *spec: jax.ShapeDtypeStruct(shape, dtype, sharding=shard(*spec))
    weights = {
        "embed": sds((cfg.vocab, cfg.dim), jnp.bfloat16, ALL),
        "tiles": sds((N * plan.dense_tiles, plan.tile_k, plan.tile_n), jnp.bfloat16, ALL),
        **expert_structs(plan, sds, ALL),
        "vectors": sds((N * (cfg.layers + 1), _n_vector_rows(cfg), plan.vector_width), jnp.float32, ALL),
    }
    cache = {k: _struct(v, shard(*CACHE_SPECS[k]))
             for k, v in jax.eval_shape(lambda: init_cache(cfg, plan.batch, plan.ctx)).items()}
    tokens = sds((plan.batch,), jnp.int32)
    return weights, cache, tokens


def expert_structs(plan: Plan, sds, spec) -> dict:
    """The routed experts' abstract HBM arrays in `plan.experts` format (mk.plan.pack_weights)."""
    N, lead = plan.devices, (plan.devices * plan.config.n_moe, plan.local_experts, plan.expert_tiles)
    if plan.experts == "mxfp4":
        m = plan.expert_gu
        return {"expert_codes": sds(lead + (m.code_rows, plan.tile_n), jnp.int32, spec),
                "expert_scales": sds(lead + (m.scale_rows, plan.tile_n), jnp.int32, spec)}
    return {"experts": sds(lead + (plan.tile_k, plan.tile_n), jnp.bfloat16, spec)}


def _n_vector_rows(cfg):
    from mk.plan import vector_rows
    return len(vector_rows(cfg))


def _compile(fn, args, device) -> CompileResult:
    """Lower + compile fn on abstract args (ShapeDtypeStructs, sharded or not) for TPU."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    mesh = Mesh(np.array([device]), ("x",))
    replicated = NamedSharding(mesh, PartitionSpec())
    args = jax.tree.map(lambda s: s if getattr(s, "sharding", None) is not None else _struct(s, replicated), args)
    t0 = time.perf_counter()
    try:
        with jax.default_device(device):
            lowered = jax.jit(fn).lower(*args)
            t1 = time.perf_counter()
            compiled = lowered.compile()
        t2 = time.perf_counter()
    except Exception as e:  # the compiler's verdict is the result
        t = time.perf_counter() - t0
        msg = str(e).strip().splitlines()
        first = next((m for m in msg if "RESOURCE_EXHAUSTED" in m or "rror" in m), msg[0] if msg else repr(e))
        if os.environ.get("MK_AOT_DEBUG"):
            first = "\n".join(msg)
        return CompileResult(False, t, t, error=first[:20000])
    mem = None
    try:
        m = compiled.memory_analysis()
        mem = {k: int(getattr(m, k)) for k in ("argument_size_in_bytes", "output_size_in_bytes",
                                               "temp_size_in_bytes", "generated_code_size_in_bytes")}
    except Exception:
        pass
    return CompileResult(True, t2 - t1, t1 - t0, memory=mem)


def compile_kernel(plan: Plan, topology: str = "tpu7x:2x2x1") -> CompileResult:
    """Lower + compile the megakernel step for the first `plan.devices` cores of `topology` (one
    pallas_call per core under shard_map, collectives inside)."""
    from mk.kernel.decode import make_decode_step
    from mk.plan import PlanError
    from mk.sharding import make_mesh
    topo = _topology(topology)
    if len(topo.devices) < plan.devices:
        raise PlanError(f"topology {topology} has {len(topo.devices)} devices, the plan needs {plan.devices}")
    mesh = make_mesh(plan.layout, topo.devices)
    step = make_decode_step(plan, interpret=False, mesh=mesh)
    return _compile(step, kernel_abstract_inputs(plan, mesh), topo.devices[0])


def compile_reference(cfg: K3Config, batch: int, topology: str = "tpu7x:2x2x1", ctx: int = 256) -> CompileResult:
    """Lower + compile the XLA reference decode step (the conventional multi-kernel baseline)."""
    from mk import params as params_mod
    from mk.reference import decode_step, init_cache
    device = _topology_device(topology)
    p = params_mod.shapes(cfg)
    cache = jax.eval_shape(lambda: init_cache(cfg, batch, ctx))
    tokens = jax.ShapeDtypeStruct((batch,), jnp.int32)
    return _compile(lambda p, c, t: decode_step(p, c, t, cfg=cfg), (p, cache, tokens), device)
