"""The peer: the fair XLA step with each MoE layer's routed experts run by vLLM TPU's fused MoE kernel.

What TPU users serve MoE models with is vLLM TPU (`tpu-inference`); its MoE layer is one Pallas
kernel, `tpu_inference.kernels.fused_moe.v1.kernel.fused_ep_moe`. `make_peer_step(cfg, fmt)` is
`mk.perf.baseline.step` (everything but the routed experts exactly as the fair XLA step) with
`routed=` computing each MoE layer's routed experts by one `fused_ep_moe` call. tpu-inference 0.26.0
is the release built for jax 0.10.2 (mk's pin); install it without vLLM's serving stack with
`pip install --no-deps tpu-inference==0.26.0` (`make peer-wheels` downloads it for a machine without
network; docs/tpu.md).

How K3's latent MoE maps onto the kernel's arguments (spec 1.4.5, `mk.model.layers.moe`):

* tokens: the latent rows, bf16 [B, Lt] (hidden_size = Lt, intermediate_size = Fe). The down
  projection, the latent RMSNorm after the sum, the up projection and the shared experts stay in
  XLA, as in the fair XLA step; the kernel returns r_sum [B, Lt] bf16.
* w1: [E, 2, Lt, Fe] = w1 and w3 stacked (gate, up); w2: [E, Fe, Lt] as stored.
* routing: the kernel takes top-k of its own scores and has no selection bias, which K3's router has
  (top-k of sigmoid + bias, weights from the un-biased scores). So the routing runs in XLA
  (`mk.perf.baseline.route`) and the kernel gets gating_output [B, E] bf16 = logit(w) for the k
  chosen experts and -inf elsewhere, with scoring_fn="sigmoid" and renormalize_topk_logits=True:
  its scores are sigmoid(logit(w)) = w on the chosen experts and 0 elsewhere, so it picks the same
  experts with the same weights, up to the bf16 gating (the kernel reads the gating in the tokens'
  dtype; with f32 Mosaic rejects a DMA): a weight w is off by about |logit(w)| bf16 ulps, below
  2^-9 absolute at 16 experts top-8 (tests/test_peer.py).
* activation: the kernel knows silu, gelu and swigluoai, not K3's situ. The kernel module is loaded
  on its own (importing the `tpu_inference` package imports vLLM) and its `apply_act_fn` gains
  act_fn "situ:<beta>:<linear_beta>" = `mk.model.layers.common.situ` of the bf16-rounded gate and up
  (the spec's rounding points), a bf16 result; its w2 product is then bf16 x weights -> f32 (the
  shipped silu path multiplies an f32 activation).
* B is padded to an even row count (bf16 tokens are packed in pairs); padded rows are zero.

Numerics against the reference: the routing weights' bf16 gating (above), and the kernel's expert
output rounding (it truncates each expert's f32 w2 product to bf16, then sums the k weighted experts
in f32 in its top-k order). tests/test_peer.py states the tolerance.

Expert formats (`PEER_FORMATS`), quantized from the same params (MXFP4 params are dequantized first,
exactly): bf16; int8 and int4 with one f32 scale per output channel and per `block` contraction
rows (default: the whole contraction, per channel; the kernel takes sub-channel blocks that are
multiples of 256), symmetric, round to nearest. `expert_bytes(cfg, fmt)` counts one expert's bytes.

Block sizes (`block_sizes`) come from the config: bt = btc = the padded batch, bf = bfc = the
largest divisor of Fe that is a multiple of 128 and at most 1024, bd1 = bd2 = bd1c = bd2c = the
largest divisor of Lt that is a multiple of 256 and at most 2048 (the kernel's defaults are a TPU
v7 table that does not divide K3's widths). On k3-chip: bf 1024, bd 1792, timed on a v5e.
"""
from __future__ import annotations

import functools
import importlib.util
import logging
import os
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np

from mk.errors import UserError
from mk.model.config import K3Config
from mk.model.layers.common import BF16, F32, bf, situ

PEER_FORMATS = ("bf16", "int8", "int4")
PEER_PACKAGE, PEER_VERSION = "tpu-inference", "0.26.0"
INSTALL_HINT = (f"pip install --no-deps {PEER_PACKAGE}=={PEER_VERSION} (the release for jax 0.10.2; "
                f"`make peer-wheels` downloads it for a TPU VM without network, docs/tpu.md)")
KERNEL_MODULE = "tpu_inference.kernels.fused_moe.v1.kernel"
EXPERT_FAMILIES = ("w1", "w3", "w2")
_QMAX = {"int8": 127, "int4": 7}
_QDTYPE = {"int8": jnp.int8, "int4": jnp.int4}


class PeerError(UserError):
    """The peer cannot run here or on this config; the message says why and what to do."""


# ---- loading the kernel without vLLM ---------------------------------------------------------------
def package_dir() -> str | None:
    """The installed `tpu_inference` package's directory, or None (found without importing it)."""
    try:
        spec = importlib.util.find_spec("tpu_inference")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    root = list(spec.submodule_search_locations)[0]
    return root if os.path.isfile(os.path.join(root, *KERNEL_MODULE.split(".")[1:]) + ".py") else None


def available() -> bool:
    return package_dir() is not None


@functools.cache
def kernel_module() -> types.ModuleType:
    """tpu-inference's fused MoE kernel module, loaded from its file with stub parent packages (the
    real `tpu_inference/__init__` and its logger import vLLM), its `apply_act_fn` taught K3's situ.
    The stubs live in sys.modules only while the module loads. Raises PeerError if not installed."""
    root = package_dir()
    if root is None:
        raise PeerError(f"--impl peer needs {PEER_PACKAGE} {PEER_VERSION}, which is not importable here: {INSTALL_HINT}")
    parents = ["tpu_inference", "tpu_inference.kernels", "tpu_inference.kernels.fused_moe",
               "tpu_inference.kernels.fused_moe.v1"]
    files = ["tpu_inference.kernels.fused_moe.v1.tuned_block_sizes", KERNEL_MODULE]
    saved = {n: sys.modules.get(n) for n in parents + files + ["tpu_inference.logger"]}
    try:
        for n in parents:
            stub = types.ModuleType(n)
            stub.__path__ = [os.path.join(root, *n.split(".")[1:])]
            sys.modules[n] = stub
        logger = types.ModuleType("tpu_inference.logger")
        logger.init_logger = logging.getLogger
        sys.modules["tpu_inference.logger"] = logger
        for n in files:
            spec = importlib.util.spec_from_file_location(n, os.path.join(root, *n.split(".")[1:]) + ".py")
            mod = importlib.util.module_from_spec(spec)
            sys.modules[n] = mod
            spec.loader.exec_module(mod)
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m
    shipped = mod.apply_act_fn

    def apply_act_fn(acc1, acc3, act_fn):
        if act_fn.startswith("situ:"):
            _, beta, linear_beta = act_fn.split(":")
            return situ(bf(acc1), bf(acc3), float(beta), float(linear_beta))
        return shipped(acc1, acc3, act_fn)

    mod.apply_act_fn = apply_act_fn
    return mod


def act_fn(cfg: K3Config) -> str:
    """The patched kernel's name for K3's activation with this config's betas."""
    return f"situ:{cfg.situ_beta!r}:{cfg.situ_linear_beta!r}"


def single_device_mesh(device=None) -> jax.sharding.Mesh:
    """The kernel's 2D mesh on one device: axes ("data", "model"), both `AxisType.Auto`, experts on "model"."""
    device = device if device is not None else jax.devices()[0]
    return jax.sharding.Mesh(np.array([device]).reshape(1, 1), ("data", "model"),
                             axis_types=(jax.sharding.AxisType.Auto,) * 2)


# ---- shapes, block sizes, bytes ----------------------------------------------------------------------
def _largest_divisor(n: int, multiple: int, cap: int) -> int | None:
    ds = [d for d in range(multiple, min(n, cap) + 1, multiple) if n % d == 0]
    return max(ds) if ds else None


def rows(batch: int) -> int:
    """Token rows the kernel gets: the batch padded to a multiple of 2 (bf16 tokens packed in pairs)."""
    return batch + batch % 2


def block_sizes(cfg: K3Config, batch: int) -> dict:
    """The kernel's tuning arguments for this config and batch (module doc); PeerError if none fit."""
    bd = _largest_divisor(cfg.latent, 256, 2048)
    bfs = _largest_divisor(cfg.expert_hidden, 128, 1024)
    if bd is None or bfs is None:
        raise PeerError(f"the peer kernel needs the latent width a multiple of 256 and the expert hidden width "
                        f"a multiple of 128; this config has latent {cfg.latent}, expert_hidden {cfg.expert_hidden}")
    t = rows(batch)
    return {"bt": t, "btc": t, "bf": bfs, "bfc": bfs, "bd1": bd, "bd1c": bd, "bd2": bd, "bd2c": bd}


def _check(fmt: str, block: int | None, cfg: K3Config):
    if fmt not in PEER_FORMATS:
        raise PeerError(f"--peer-format: expected one of {', '.join(PEER_FORMATS)}, found {fmt!r}")
    if block is not None and (block % 256 or (cfg.latent // 2) % block or cfg.expert_hidden % block):
        raise PeerError(f"peer scale block {block}: the kernel needs a multiple of 256 dividing half the latent "
                        f"width ({cfg.latent // 2}) and the expert hidden width ({cfg.expert_hidden})")


def layer_shapes(cfg: K3Config, fmt: str = "bf16", block: int | None = None) -> dict:
    """One MoE layer's expert arrays for the kernel, as ShapeDtypeStructs: w1 [E, 2, Lt, Fe], w2 [E, Fe, Lt]
    (bf16 / int8 / int4), and for int formats w1_scale f32 [E, 2, Lt / b1, 1, Fe], w2_scale f32
    [E, Fe / b2, 1, Lt] (b1 = b2 = block, or the whole contraction)."""
    _check(fmt, block, cfg)
    E, Lt, Fe = cfg.experts, cfg.latent, cfg.expert_hidden
    dt = BF16 if fmt == "bf16" else _QDTYPE[fmt]
    out = {"w1": jax.ShapeDtypeStruct((E, 2, Lt, Fe), dt), "w2": jax.ShapeDtypeStruct((E, Fe, Lt), dt)}
    if fmt != "bf16":
        b1, b2 = block or Lt, block or Fe
        out["w1_scale"] = jax.ShapeDtypeStruct((E, 2, Lt // b1, 1, Fe), F32)
        out["w2_scale"] = jax.ShapeDtypeStruct((E, Fe // b2, 1, Lt), F32)
    return out


def expert_bytes(cfg: K3Config, fmt: str, block: int | None = None) -> float:
    """Bytes of one routed expert (w1, w3, w2 and their scales) in the peer's format."""
    tree = layer_shapes(cfg, fmt, block)
    bits = {"bf16": 16, "int8": 8, "int4": 4}[fmt]
    total = 0.0
    for name, s in tree.items():
        per = bits / 8 if name in ("w1", "w2") else s.dtype.itemsize
        total += float(np.prod(s.shape)) * per
    return total / cfg.experts


def abstract_params(cfg: K3Config, fmt: str = "bf16", block: int | None = None) -> dict:
    """ShapeDtypeStructs of the peer step's params: `mk.perf.baseline`'s tree without the routed
    expert families, plus "peer": one `layer_shapes` dict per MoE layer."""
    from mk.perf.baseline import abstract_params as xla_params
    p = xla_params(cfg, "bf16")
    return dict(p, moe={k: v for k, v in p["moe"].items() if k not in EXPERT_FAMILIES},
                peer=[layer_shapes(cfg, fmt, block) for _ in range(cfg.n_moe)])


# ---- quantization ------------------------------------------------------------------------------------
def quantize(w: jax.Array, fmt: str, axis: int, block: int | None):
    """Symmetric int quantization of w (any float dtype) along its contraction `axis`, one f32 scale
    per `block` rows of it (None: all) and per other index, round to nearest:
    -> (q int8/int4 like w, scale f32 with axis split into [n_blocks, 1])."""
    axis = axis % w.ndim
    n = w.shape[axis]
    b = block or n
    wf = w.astype(F32)
    split = wf.reshape(*w.shape[:axis], n // b, b, *w.shape[axis + 1:])
    scale = jnp.max(jnp.abs(split), axis=axis + 1, keepdims=True) / _QMAX[fmt]
    q = jnp.where(scale > 0, jnp.round(split / jnp.where(scale > 0, scale, 1.0)), 0.0)
    q = jnp.clip(q, -_QMAX[fmt], _QMAX[fmt]).reshape(w.shape).astype(_QDTYPE[fmt])
    return q, scale


def dequantize(q: jax.Array, scale: jax.Array, axis: int) -> jax.Array:
    """The f32 weights a quantized array stands for (`quantize`'s inverse, up to its rounding)."""
    axis = axis % q.ndim
    n, nb = q.shape[axis], scale.shape[axis]
    split = q.astype(F32).reshape(*q.shape[:axis], nb, n // nb, *q.shape[axis + 1:])
    return (split * scale).reshape(q.shape)


def layer_experts(w1, w3, w2, fmt: str, block: int | None = None) -> dict:
    """One MoE layer's experts in the kernel's layout and format: w1/w3 [E, Lt, Fe], w2 [E, Fe, Lt]
    (bf16, as `mk.model.params`) -> `layer_shapes`' dict of arrays."""
    w13 = jnp.stack([w1, w3], axis=1)                                       # [E, 2, Lt, Fe]
    if fmt == "bf16":
        return {"w1": bf(w13), "w2": bf(w2)}
    q1, s1 = quantize(w13, fmt, axis=2, block=block)                        # s1 [E, 2, Lt/b, 1, Fe]
    q2, s2 = quantize(w2, fmt, axis=1, block=block)                         # s2 [E, Fe/b, 1, Lt]
    return {"w1": q1, "w2": q2, "w1_scale": s1, "w2_scale": s2}


def peer_params(params: dict, cfg: K3Config, fmt: str = "bf16", experts: str = "bf16",
                block: int | None = None) -> dict:
    """The peer step's params from `mk.model.params` ones (experts="mxfp4": the packed tree, dequantized
    exactly first): the same arrays (no copy) but the routed experts, which become "peer", one dict
    per MoE layer in `fmt`, built on the device one layer at a time."""
    _check(fmt, block, cfg)
    from mk.perf.baseline import dequantize as mxfp4
    moe = params["moe"]

    @jax.jit
    def one(w1, w3, w2):
        if experts == "mxfp4":                                               # [E, N, K] codes -> bf16 [E, K, N]
            w1, w3, w2 = (jnp.swapaxes(mxfp4(w["packed"], w["scale"]), -1, -2) for w in (w1, w3, w2))
        return layer_experts(w1, w3, w2, fmt, block)

    pick = lambda w, i: jax.tree.map(lambda x: x[i], w)
    layers = [one(*(pick(moe[n], i) for n in EXPERT_FAMILIES)) for i in range(cfg.n_moe)]
    return dict(params, moe={k: v for k, v in moe.items() if k not in EXPERT_FAMILIES}, peer=layers)


def as_stored(params: dict, cfg: K3Config, fmt: str, block: int | None = None) -> dict:
    """bf16 `mk.model.params` with each routed expert replaced by what `fmt` stores (dequantized,
    rounded to bf16): the reference on these is the function the peer step computes in `fmt`."""
    moe = dict(params["moe"])
    layers = peer_params(params, cfg, fmt, block=block)["peer"]
    deq = lambda l, n, axis: dequantize(l[n], l[n + "_scale"], axis) if fmt != "bf16" else l[n]
    w13 = jnp.stack([deq(l, "w1", 2) for l in layers])                       # [n_moe, E, 2, Lt, Fe]
    w2 = jnp.stack([deq(l, "w2", 1) for l in layers])
    moe["w1"], moe["w3"], moe["w2"] = (bf(x) for x in (w13[:, :, 0], w13[:, :, 1], w2))
    return dict(params, moe=moe)


# ---- the step ----------------------------------------------------------------------------------------
def gating(ids: jax.Array, weights: jax.Array, experts: int) -> jax.Array:
    """ids [B, k] int32, weights [B, k] f32 -> gating_output [B, E] bf16: logit(w) at the chosen
    experts, -inf elsewhere (the kernel's sigmoid scores are then w and 0; module doc)."""
    logit = jnp.log(weights) - jnp.log1p(-weights)                          # +inf where w = 1 (top-1)
    rows_ = jnp.arange(ids.shape[0])[:, None]
    g = jnp.full((ids.shape[0], experts), -jnp.inf, F32).at[rows_, ids].set(logit)
    return g.astype(BF16)


def routed_fn(cfg: K3Config, fmt: str, mesh=None, block: int | None = None, moe_fn=None):
    """`mk.perf.baseline.moe_layer`'s `routed=`: (latent [B, Lt] bf16, ids, weights, params, i) ->
    r_sum [B, Lt] bf16 from one fused_ep_moe call on params["peer"][i]. moe_fn: the kernel
    (default: tpu-inference's, on `mesh`); tests pass the wheel's own XLA reference of it."""
    mod = kernel_module()
    kw = {"renormalize_topk_logits": True, "act_fn": act_fn(cfg), "scoring_fn": "sigmoid"}

    def routed(latent, ids, weights, params, i):
        w = params["peer"][i]
        B = latent.shape[0]
        g = gating(ids, weights, cfg.experts)
        pad = rows(B) - B
        if pad:                                  # a zero row: situ(0, 0) = 0 whatever experts it picks
            latent = jnp.pad(latent, ((0, pad), (0, 0)))
            g = jnp.pad(g, ((0, pad), (0, 0)))
        quant = {}
        if fmt != "bf16":
            quant = {"w1_scale": w["w1_scale"], "w2_scale": w["w2_scale"],
                     "subc_quant_w1_sz": cfg.latent // w["w1_scale"].shape[2],
                     "subc_quant_w2_sz": cfg.expert_hidden // w["w2_scale"].shape[1]}
        if moe_fn is not None:
            out = moe_fn(latent, w["w1"], w["w2"], g, cfg.top_k, **kw, **quant)
        else:
            out = mod.fused_ep_moe(mesh if mesh is not None else single_device_mesh(), latent, w["w1"], w["w2"], g,
                                   cfg.top_k, **kw, **quant, **block_sizes(cfg, B))
        return out[:B]

    return routed


def make_peer_step(cfg: K3Config, fmt: str = "bf16", mesh=None, block: int | None = None, moe_fn=None):
    """The peer step, jitted with the cache donated: step(peer_params, cache, tokens) -> (logits [B, V]
    f32, cache); peer_params from `peer_params`. Everything but the routed experts is
    `mk.perf.baseline.step`."""
    from mk.perf import baseline
    _check(fmt, block, cfg)
    block_sizes(cfg, 1)
    routed = routed_fn(cfg, fmt, mesh, block, moe_fn)
    return jax.jit(functools.partial(baseline.step, cfg=cfg, routed=routed), donate_argnums=(1,))


def compile_deviceless(cfg: K3Config, batch: int, fmt: str = "bf16", topology: str = "v5e:2x2",
                       ctx: int = 256, block: int | None = None):
    """Compile the peer step for the first device of `topology` with the real TPU compiler, no chip
    needed (`mk.kernel.aot`); returns the compiled executable."""
    from jax.sharding import SingleDeviceSharding
    from mk.kernel.aot import _topology
    from mk.model.reference import init_cache
    device = _topology(topology).devices[0]
    put = lambda tree: jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype,
                                                                   sharding=SingleDeviceSharding(device)), tree)
    fn = make_peer_step(cfg, fmt, single_device_mesh(device), block)
    args = (put(abstract_params(cfg, fmt, block)), put(jax.eval_shape(lambda: init_cache(cfg, batch, ctx))),
            put(jax.ShapeDtypeStruct((batch,), jnp.int32)))
    with jax.default_device(device):
        return fn.lower(*args).compile()
