"""Deviceless TPU compilation: the real Mosaic + XLA TPU compiler, run on this CPU machine.

`compile_kernel(plan, topology)` lowers one decode step (the megakernel; `compile_reference`: the
XLA reference, sharded over the same mesh) against abstract TPU devices from libtpu
(`jax.experimental.topologies`), with ShapeDtypeStructs (sharded like the real arrays) instead
of weights, and compiles it. No weight is ever materialised: full-size K3 (1.4 TB of bf16
experts) compiles on a laptop-sized host. The compiler enforces the chip's HBM and VMEM
capacity, layouts and lowering rules exactly as on a TPU VM, which interpret mode cannot.

A `CompileResult` carries the compiler's verdict and what it measured: per-device HBM
(`compiled.memory_analysis()`, or the figures of its out-of-memory message), the number of
`pallas_call`s in the step (Mosaic custom calls in the lowered program), and optionally whether
the compiler fits the kernel into the VMEM the plan budgets (`probe_vmem`).
"""
from __future__ import annotations

import base64
import dataclasses
import os
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

from mk.model.config import K3Config
from mk.kernel.plan import Plan

# Topology name prefix -> chip name used by mk.kernel.plan
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
    memory: dict | None = None             # compiled.memory_analysis(), bytes per device
    pallas_calls: int | None = None        # Mosaic kernels (tpu_custom_call) in the lowered step
    mosaic_ops: int | None = None          # MLIR ops of those kernels (`mosaic_ops`): the program's size
    argument_bytes: int | None = None      # per device, from the abstract inputs' shard shapes
    hbm_required_bytes: int | None = None  # the compiler's out-of-HBM message, when it refused
    hbm_available_bytes: int | None = None
    vmem_check: dict | None = None         # probe_vmem: compiled within the plan's VMEM budget?
    error_text: str | None = dataclasses.field(default=None, repr=False)   # the compiler's whole message

    @property
    def total_s(self) -> float:
        return self.lower_s + self.compile_s

    @property
    def hbm_bytes(self) -> int | None:
        """Per-device HBM of the step: arguments + outputs - aliased + temporaries (compiled)."""
        m = self.memory
        if not m:
            return None
        return (m["argument_size_in_bytes"] + m["output_size_in_bytes"] - m["alias_size_in_bytes"]
                + m["temp_size_in_bytes"])


def _topology(topology: str):
    """The deviceless topology description; libtpu's refusal of the string becomes one line."""
    from mk.errors import UserError
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "")
    from jax.experimental import topologies
    try:
        return topologies.get_topology_desc(topology, "tpu")
    except jax.errors.JaxRuntimeError as e:
        reason = str(e).splitlines()[0].split(": ", 1)[-1]
        raise UserError(f"--topology {topology!r}: libtpu refuses it ({reason}); single-chip topologies are "
                        f"compiled as one device of a 2x2 slice, e.g. --topology v5e:2x2 --mesh 1") from None


def topology_devices(topology: str) -> int:
    return len(_topology(topology).devices)


def _struct(x, sharding):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


def kernel_weight_shapes(plan: Plan) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """One device's kernel weights, {name: (shape, dtype)}, exactly what `mk.kernel.packing.pack_weights`
    returns for a rank (tests/test_aot.py pins the two together), plus the embedding (whole: the
    kernel indexes its own vocabulary rows)."""
    import ml_dtypes
    cfg = plan.config
    bf16 = np.dtype(ml_dtypes.bfloat16)
    return {
        "embed": ((cfg.vocab // plan.devices, cfg.dim), bf16),
        "tiles": ((plan.dense_tiles, plan.tile_k, plan.tile_n), bf16),
        **expert_shapes(plan),
        "vectors": ((cfg.layers + 1, len(_vector_rows(cfg)), plan.vector_width), np.dtype(np.float32)),
    }


def expert_shapes(plan: Plan) -> dict:
    """The routed experts' per-device HBM arrays in the plan's storage format (`mk.kernel.packing.pack_weights`):
    bf16 tiles, or MXFP4 E2M1 codes and E8M0 scales packed in int32 words."""
    import ml_dtypes
    lead = (plan.config.n_moe, plan.local_experts, plan.expert_tiles)
    if plan.experts == "mxfp4":
        m = plan.expert_gu
        return {"expert_codes": (lead + (m.code_rows, plan.tile_n), np.dtype(np.int32)),
                "expert_scales": (lead + (m.scale_rows, plan.tile_n), np.dtype(np.int32))}
    return {"experts": (lead + (plan.tile_k, plan.tile_n), np.dtype(ml_dtypes.bfloat16))}


def kernel_abstract_inputs(plan: Plan, mesh):
    """ShapeDtypeStructs of the kernel's weights, cache and tokens, sharded over `mesh` as the
    kernel reads them (per-device shares stacked on the leading axis; caches by head). A verify
    plan (k > 0): KDA / conv states per row, `state_row`, tokens [sequences, 1 + k]
    (`mk.kernel.decode.sharded_block`)."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    from mk.model.reference import init_cache
    from mk.model.sharding import ALL, CACHE_SPECS
    N = plan.devices
    shard = lambda *spec: NamedSharding(mesh, P(*spec))
    weights = {k: jax.ShapeDtypeStruct((N * shape[0],) + shape[1:], dtype, sharding=shard(ALL))
               for k, (shape, dtype) in kernel_weight_shapes(plan).items()}
    shapes = jax.eval_shape(lambda: init_cache(plan.config, plan.sequences, plan.ctx))
    if plan.k:
        for n in ("kda_state", "conv_state"):                     # one state per row
            shapes[n] = jax.ShapeDtypeStruct((plan.batch,) + shapes[n].shape[1:], shapes[n].dtype)
        shapes["state_row"] = jax.ShapeDtypeStruct((plan.sequences,), jnp.int32)
    cache = {k: _struct(v, shard(*CACHE_SPECS[k])) for k, v in shapes.items()}
    tokens = jax.ShapeDtypeStruct((plan.sequences, plan.seq_rows) if plan.k else (plan.batch,), jnp.int32,
                                  sharding=shard())
    return weights, cache, tokens


def _kernel_step(plan: Plan, mesh):
    """The jitted step `compile_kernel` compiles: the decode step, or a verify plan's verify step."""
    from mk.kernel.decode import make_decode_step, make_verify_step
    make = make_verify_step if plan.k else make_decode_step
    return make(plan, interpret=False, mesh=mesh)


def _vector_rows(cfg):
    from mk.kernel.plan import vector_rows
    return vector_rows(cfg)


def per_device_bytes(args) -> int:
    """Bytes one device holds of sharded ShapeDtypeStructs (the largest share, if uneven)."""
    total = 0
    for s in jax.tree.leaves(args):
        shard = s.sharding.shard_shape(s.shape) if getattr(s, "sharding", None) is not None else s.shape
        total += int(np.prod(shard, dtype=np.int64)) * jnp.dtype(s.dtype).itemsize
    return total


_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _xla_bytes(text: str) -> int:
    """'209.35G' -> bytes (XLA prints binary units: G = GiB)."""
    m = re.fullmatch(r"([\d.]+)\s*([KMGT]?)i?B?", text.strip())
    return int(round(float(m.group(1)) * _UNITS[m.group(2)]))


def _hbm_figures(error: str) -> tuple[int | None, int | None]:
    """(required, available) bytes from the compiler's out-of-HBM message, if it is one."""
    m = re.search(r"memory required for [^(]*\(([\d.]+[KMGT]?)i?B?\) exceeds available HBM \(([\d.]+[KMGT]?)i?B?\)",
                  error or "")
    return (_xla_bytes(m.group(1)), _xla_bytes(m.group(2))) if m else (None, None)


def _first_error_line(e: Exception) -> str:
    msg = str(e).strip().splitlines()
    first = next((m for m in msg if "RESOURCE_EXHAUSTED" in m or "rror" in m), msg[0] if msg else repr(e))
    if os.environ.get("MK_AOT_DEBUG"):
        first = "\n".join(msg)
    return first[:20000]


def mosaic_ops(lowered_text: str) -> int:
    """MLIR ops of every Mosaic kernel in a lowered program's text (each `tpu_custom_call`'s body,
    deserialized): the size of the kernel program, which neither the machine nor its load changes."""
    from jax._src.interpreters import mlir
    from jax._src.lib import tpu
    from jaxlib.mlir import ir
    from jaxlib.mlir.passmanager import PassManager
    bodies = re.findall(r'\\22body\\22: \\22([A-Za-z0-9+/=]+)\\22', lowered_text)
    ctx = mlir.make_ir_context()
    tpu.register_dialect(ctx)
    n = 0
    with ctx, ir.Location.unknown():
        ctx.allow_unregistered_dialects = True
        for body in bodies:
            module = ir.Module.parse(base64.b64decode(body))
            PassManager.parse("builtin.module(mosaic-serde{serialize=false})").run(module.operation)
            ops = []
            module.operation.walk(lambda op: ops.append(1) or ir.WalkResult.ADVANCE)
            n += len(ops)
    return n


def _place(args, device):
    """Abstract args with every unsharded one replicated on `device`."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    replicated = NamedSharding(Mesh(np.array([device]), ("x",)), PartitionSpec())
    return jax.tree.map(lambda s: s if getattr(s, "sharding", None) is not None else _struct(s, replicated), args)


def _lower(fn, args, device):
    """fn lowered for TPU on abstract args placed by `_place`."""
    fn = fn if hasattr(fn, "lower") else jax.jit(fn)
    with jax.default_device(device):
        return fn.lower(*_place(args, device))


def lower(fn, args, topology: str = "tpu7x:2x2x1"):
    """fn lowered (no compile) for the first device of `topology` on abstract args."""
    return _lower(fn, args, _topology(topology).devices[0])


def lower_kernel(plan: Plan, topology: str = "tpu7x:2x2x1"):
    """The megakernel step of `plan` lowered (no compile) for `topology` (`compile_kernel`'s program)."""
    mesh, device = _mesh(plan.layout, topology)
    return _lower(_kernel_step(plan, mesh), kernel_abstract_inputs(plan, mesh), device)


def _compile(fn, args, device) -> CompileResult:
    """Lower + compile fn on abstract args (ShapeDtypeStructs, sharded or not) for TPU."""
    arg_bytes = per_device_bytes(_place(args, device))
    t0 = time.perf_counter()
    try:
        lowered = _lower(fn, args, device)
    except Exception as e:
        t = time.perf_counter() - t0
        return CompileResult(False, 0.0, t, error=_first_error_line(e), argument_bytes=arg_bytes)
    lower_s = time.perf_counter() - t0
    text = lowered.as_text()
    calls, ops = text.count("@tpu_custom_call"), mosaic_ops(text)
    t1 = time.perf_counter()                    # counting is neither lowering nor compiling
    try:
        with jax.default_device(device):
            compiled = lowered.compile()
    except Exception as e:  # the compiler's verdict is the result
        err = _first_error_line(e)
        need, have = _hbm_figures(str(e))
        return CompileResult(False, time.perf_counter() - t1, lower_s, error=err, pallas_calls=calls,
                             mosaic_ops=ops, argument_bytes=arg_bytes, hbm_required_bytes=need,
                             hbm_available_bytes=have, error_text=str(e))
    t2 = time.perf_counter()
    mem = None
    try:
        m = compiled.memory_analysis()
        mem = {k: int(getattr(m, k)) for k in ("argument_size_in_bytes", "output_size_in_bytes",
                                               "alias_size_in_bytes", "temp_size_in_bytes",
                                               "generated_code_size_in_bytes")}
    except Exception:
        pass
    return CompileResult(True, t2 - t1, lower_s, memory=mem, pallas_calls=calls, mosaic_ops=ops,
                         argument_bytes=arg_bytes)


def _mesh(plan_layout, topology: str):
    from mk.model.layout import PlanError
    from mk.model.sharding import make_mesh
    topo = _topology(topology)
    if len(topo.devices) < plan_layout.devices:
        raise PlanError(f"topology {topology} has {len(topo.devices)} devices, the plan needs {plan_layout.devices}")
    return make_mesh(plan_layout, topo.devices), topo.devices[0]


def compile_kernel(plan: Plan, topology: str = "tpu7x:2x2x1", probe_vmem: bool = False) -> CompileResult:
    """Lower + compile the megakernel step for the first `plan.devices` cores of `topology` (one
    pallas_call per core under shard_map, collectives inside).

    probe_vmem: also compile it with its VMEM limit set to the plan's budget (`vmem_probe`)."""
    mesh, device = _mesh(plan.layout, topology)
    r = _compile(_kernel_step(plan, mesh), kernel_abstract_inputs(plan, mesh), device)
    if probe_vmem:
        r.vmem_check = vmem_probe(plan, mesh, device)
    return r


def compile_loop_chunk(plan: Plan, topology: str = "tpu7x:2x2x1", chunk: int = 16, sampling=None) -> CompileResult:
    """`mk.model.loop`'s decode chunk (`chunk` steps of the megakernel in a while_loop, sampling on
    the device) compiled for `topology`; its memory shows whether the cache stays in place
    (alias_size_in_bytes = the cache's) and what the loop adds (temp_size_in_bytes)."""
    import functools
    from mk.model import loop
    sampling = sampling or loop.Sampling()
    mesh, device = _mesh(plan.layout, topology)
    weights, cache, _ = kernel_abstract_inputs(plan, mesh)
    state = jax.eval_shape(functools.partial(loop.first_token, sampling=sampling),
                           jax.ShapeDtypeStruct((plan.batch, plan.config.vocab), jnp.float32), jax.random.PRNGKey(0), 1)
    fn = jax.jit(functools.partial(loop.decode_chunk, _kernel_step(plan, mesh), n=chunk, sampling=sampling),
                 donate_argnums=(1,))
    return _compile(fn, (weights, cache, state), device)


def vmem_probe(plan: Plan, mesh, device) -> dict:
    """Does the compiler fit the kernel into the VMEM the plan budgets? Compiles the same kernel
    (same plan, same scratch) once more with its VMEM limit set to the plan's budget
    (`vmem_planned_bytes`, rounded up to 1 MiB): {"limit_bytes", "fits", "error"}.

    The probe's HBM weight operands are cut to one slice per device along their leading axis: the
    kernel reads them by DMA at run-time indices, so their size does not change its VMEM, and a
    step whose weights exceed HBM (refused before Mosaic runs) still gets its VMEM checked.
    (The size in Mosaic's message under a far too small limit is not the kernel's need: at K3
    widths and >= 84 layers it says 41 MiB for a kernel that compiles within 20 MiB.)"""
    from mk.kernel.plan import MiB
    from mk.model.layout import round_up
    limit = round_up(plan.vmem_planned_bytes, MiB)
    probe = dataclasses.replace(plan, vmem_limit=limit)
    weights, cache, tokens = kernel_abstract_inputs(probe, mesh)
    cut = {k: jax.ShapeDtypeStruct((plan.devices,) + s.shape[1:], s.dtype, sharding=s.sharding)
           for k, s in weights.items()}
    r = _compile(_kernel_step(probe, mesh), (cut, cache, tokens), device)
    return {"limit_bytes": limit, "fits": r.compiled, "error": r.error}


def reference_abstract_inputs(cfg: K3Config, batch: int, ctx: int, mesh):
    """ShapeDtypeStructs of the reference step's params, cache and tokens, placed by
    `mk.model.sharding.param_specs` / `cache_specs` over `mesh` (bf16 experts: the reference's layout)."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    from mk.model import params as params_mod, sharding
    from mk.model.reference import init_cache
    p = params_mod.shapes(cfg)
    c = jax.eval_shape(lambda: init_cache(cfg, batch, ctx))
    ps, cs = sharding.param_specs(p), sharding.cache_specs(c)
    place = lambda x, s: _struct(x, NamedSharding(mesh, s))
    return (jax.tree.map(place, p, ps), {k: place(v, cs[k]) for k, v in c.items()},
            jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=NamedSharding(mesh, P())))


def compile_reference(cfg: K3Config, batch: int, topology: str = "tpu7x:2x2x1", ctx: int = 256,
                      devices: int = 1) -> CompileResult:
    """Lower + compile the XLA reference decode step (the conventional multi-kernel baseline):
    `mk.model.reference_sharded`'s step over the same mesh as the kernel's (`mk.model.sharding.default_layout`
    for `devices` cores of `topology`; 1: `mk.model.reference.decode_step` on one core)."""
    if devices == 1:
        from mk.model.reference import decode_step
        topo = _topology(topology)
        from mk.model import params as params_mod
        from mk.model.reference import init_cache
        args = (params_mod.shapes(cfg), jax.eval_shape(lambda: init_cache(cfg, batch, ctx)),
                jax.ShapeDtypeStruct((batch,), jnp.int32))
        return _compile(lambda p, c, t: decode_step(p, c, t, cfg=cfg), args, topo.devices[0])
    from mk.model.reference_sharded import make_sharded_step
    from mk.model.sharding import default_layout
    mesh, device = _mesh(default_layout(cfg, devices), topology)
    return _compile(make_sharded_step(cfg, mesh), reference_abstract_inputs(cfg, batch, ctx, mesh), device)
