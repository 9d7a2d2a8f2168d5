"""The parameter pytree every part of mk reads, and a well-behaved random initializer.

Layout (matrices are `[in, out]`, y = x @ W; stacked families carry a leading index axis):

    embed         [V, d]                bf16   row per token
    lm_head       [d, V]                bf16
    final_norm    [d]                   bf16
    output_res    [d]                   f32    folded output_attn_res_norm * output_attn_res_proj
    layer:        (leading L = config.layers)
      attn_norm   [L, d] bf16     ffn_norm [L, d] bf16
      attn_res    [L, d] f32      mlp_res  [L, d] f32      (folded AttnRes pseudo-queries)
    kda:          (leading n = config.n_kda; HD = heads * head_dim)
      f_a [n, d, D]  f_b [n, D, HD]  q, k, v, g [n, d, HD]  b [n, d, H]  o [n, HD, d]   bf16
      conv [n, 3, conv_size, HD] f32   (q/k/v; tap 0 = oldest)
      a_log [n, H] f32   dt_bias [n, HD] f32   o_norm [n, D] f32
    mla:          (leading n = config.n_mla; Dq = head_dim + qk_extra)
      q_a [n, d, q_rank]  q_a_norm [n, q_rank]  kv_a [n, d, kv_rank + qk_extra]  kv_a_norm [n, kv_rank]
      q_b [n, q_rank, H*Dq]  (per head [nope | extra])   kv_b [n, kv_rank, H*2D] (per head [k_nope | v])
      g [n, d, HD]  o [n, HD, d]                                                bf16 (norms bf16)
    dense:        (layer 0)  gate, up [d, F]  down [F, d]                       bf16
    moe:          (leading n = config.n_moe = L - 1, MoE of layer l at index l - 1)
      router [n, d, E] bf16   router_bias [n, E] f32
      latent_down [n, d, Lt]  latent_up [n, Lt, d]  bf16   latent_norm [n, Lt] f32
      shared_gate, shared_up [n, d, S]  shared_down [n, S, d]                     bf16
      w1, w3 [n, E, Lt, Fe]  (gate, up)   w2 [n, E, Fe, Lt]  (down)            bf16 (dequantized)

The initializer follows spec section 5's advice for random-weight tests: output projections are
damped so every sublayer adds a small correction to the residual state, and the router bias gives
each layer a decisive, input-dependent ranking (graded biases well above bf16 noise), so that
rounding-order noise between two correct implementations stays far below the logit spread.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from mk.model.config import K3Config

BF16 = jnp.bfloat16
F32 = jnp.float32

# Families stored in fp32 (spec 2.2); everything else is bf16.
FP32_FAMILIES = {
    ("output_res",), ("layer", "attn_res"), ("layer", "mlp_res"), ("kda", "conv"), ("kda", "a_log"),
    ("kda", "dt_bias"), ("kda", "o_norm"), ("moe", "router_bias"), ("moe", "latent_norm"),
}


def shapes(cfg: K3Config) -> dict:
    """The parameter tree as nested dicts of `jax.ShapeDtypeStruct` (no memory allocated)."""
    d, H, D, HD = cfg.dim, cfg.heads, cfg.head_dim, cfg.attn_width
    nk, nm, ne, L = cfg.n_kda, cfg.n_mla, cfg.n_moe, cfg.layers
    E, Lt, Fe, S, F = cfg.experts, cfg.latent, cfg.expert_hidden, cfg.shared_hidden, cfg.dense_hidden
    Dq = cfg.qk_head_dim
    tree = {
        "embed": (cfg.vocab, d), "lm_head": (d, cfg.vocab), "final_norm": (d,), "output_res": (d,),
        "layer": {"attn_norm": (L, d), "ffn_norm": (L, d), "attn_res": (L, d), "mlp_res": (L, d)},
        "kda": {
            "f_a": (nk, d, D), "f_b": (nk, D, HD), "q": (nk, d, HD), "k": (nk, d, HD), "v": (nk, d, HD),
            "g": (nk, d, HD), "b": (nk, d, H), "o": (nk, HD, d), "conv": (nk, 3, cfg.conv_size, HD),
            "a_log": (nk, H), "dt_bias": (nk, HD), "o_norm": (nk, D),
        },
        "mla": {
            "q_a": (nm, d, cfg.q_rank), "q_a_norm": (nm, cfg.q_rank),
            "kv_a": (nm, d, cfg.kv_rank + cfg.qk_extra), "kv_a_norm": (nm, cfg.kv_rank),
            "q_b": (nm, cfg.q_rank, H * Dq), "kv_b": (nm, cfg.kv_rank, H * 2 * D),
            "g": (nm, d, HD), "o": (nm, HD, d),
        },
        "dense": {"gate": (d, F), "up": (d, F), "down": (F, d)},
        "moe": {
            "router": (ne, d, E), "router_bias": (ne, E),
            "latent_down": (ne, d, Lt), "latent_up": (ne, Lt, d), "latent_norm": (ne, Lt),
            "shared_gate": (ne, d, S), "shared_up": (ne, d, S), "shared_down": (ne, S, d),
            "w1": (ne, E, Lt, Fe), "w3": (ne, E, Lt, Fe), "w2": (ne, E, Fe, Lt),
        },
    }

    def to_struct(path, shape):
        key = tuple(p.key for p in path)
        return jax.ShapeDtypeStruct(shape, F32 if key in FP32_FAMILIES else BF16)

    return jax.tree_util.tree_map_with_path(to_struct, tree, is_leaf=lambda x: isinstance(x, tuple))


# Output projections whose contribution to the residual is damped, with their true fan-in.
_DAMPED = {("kda", "o"), ("mla", "o"), ("dense", "down"), ("moe", "shared_down"), ("moe", "latent_up"),
           ("moe", "w2")}
_NORMS = {("final_norm",), ("layer", "attn_norm"), ("layer", "ffn_norm"), ("kda", "o_norm"),
          ("mla", "q_a_norm"), ("mla", "kv_a_norm"), ("moe", "latent_norm")}
OUTPUT_DAMPING = 0.25


# Above this many parameters `init` draws on the default device (`jax.random`) instead of host numpy:
# 3 B parameters took 104 s of host numpy on a TPU VM.
DEVICE_INIT_ABOVE = 1 << 29


def _family(cfg: K3Config, key: tuple, shape) -> tuple[str, float, float]:
    """How `init` draws one family: (distribution, scale, offset); x = offset + scale * N(0, 1) for
    "normal" and "matrix" (numpy draws matrices in float32); "conv", "a_log" and "router_bias" are
    special (see `init`)."""
    if key in _NORMS:
        return "normal", 0.05, 1.0
    if key in {("output_res",), ("layer", "attn_res"), ("layer", "mlp_res")}:
        return "normal", 0.5 / np.sqrt(cfg.dim), 0.0                  # scores ~ N(0, 0.25)
    if key == ("embed",):
        return "normal", 1.0, 0.0
    if key == ("kda", "dt_bias"):
        return "normal", 0.5, 0.0
    if key in {("kda", "conv"), ("kda", "a_log"), ("moe", "router_bias")}:
        return key[1], 0.0, 0.0
    scale = 1.0 / np.sqrt(shape[-2])                                   # a matrix [..., in, out]
    return "matrix", scale * (OUTPUT_DAMPING if key in _DAMPED else 1.0), 0.0


def init(cfg: K3Config, seed: int = 0, *, on_device: bool | None = None) -> dict:
    """Random parameters for any config, well-behaved in the sense of the module docstring.

    Deterministic in (cfg, seed); returns jax arrays with the dtypes of `shapes(cfg)`. Host-side
    numpy (the same weights on any backend) unless `on_device` (default: more than
    DEVICE_INIT_ABOVE parameters), where `init_fast` draws the same families on the default device
    (seconds for billions of parameters; other values than numpy's).
    """
    if on_device is None:
        on_device = num_params(cfg) > DEVICE_INIT_ABOVE
    if on_device:
        return init_fast(cfg, seed)
    rng = np.random.default_rng(seed)
    structs = shapes(cfg)

    def make(path, s: jax.ShapeDtypeStruct):
        # cast on the host and device_put: jnp.asarray compiles a program per shape (a cast or a copy)
        return jax.device_put(draw(cfg, tuple(p.key for p in path), s.shape, rng).astype(s.dtype))

    return jax.tree_util.tree_map_with_path(make, structs)


def draw(cfg: K3Config, key: tuple, shape, rng: np.random.Generator) -> np.ndarray:
    """Family `key` (or part of it, leading axes cut: `shape`) drawn as `init` draws it, float32."""
    kind, scale, offset = _family(cfg, key, shape)
    if kind == "conv":
        # Causal filter with most weight on the current token (tap conv_size - 1).
        x = 0.1 * rng.standard_normal(shape)
        x[..., -1, :] += 1.0
    elif kind == "a_log":
        x = np.log(rng.uniform(1.0, 16.0, shape))
    elif kind == "router_bias":
        x = _decisive_router_bias(rng, shape, cfg.top_k)
    elif kind == "matrix":
        x = scale * rng.standard_normal(shape, dtype=np.float32)
    else:
        x = offset + scale * rng.standard_normal(shape)
    return np.asarray(x, np.float32)


def init_fast(cfg: K3Config, seed: int = 0, experts: str = "bf16") -> dict:
    """Random parameters drawn on the default device from a counter hash (`_hash_bits`), for configs
    too big for `init`'s host-side numpy (3 B parameters: ~100 s there, seconds here). `init`'s
    families and scales (norms, AttnRes queries, conv taps, decays, damped matrices, decisive router
    biases; normals as a standardized sum of four uniform bytes), not its values; deterministic in
    (cfg, seed, experts).

    experts="mxfp4": the routed experts as the MXFP4 checkpoint tree holds them
    (`mk.io.checkpoint.load(..., experts="mxfp4")`): moe.w1/w3/w2 = {"packed": u8 [n_moe, E, N, K/2]
    uniformly random E2M1 code pairs, "scale": u8 [n_moe, E, N, K/32] E8M0 bytes giving each
    family `init`'s standard deviation (within a factor 2)}."""
    if experts not in ("bf16", "mxfp4"):
        raise ValueError(f"experts must be 'bf16' or 'mxfp4', found {experts!r}")
    return _init_fast_program(cfg, experts)(jnp.uint32(seed))


@functools.lru_cache(maxsize=8)
def _init_fast_program(cfg: K3Config, experts: str):
    """`_init_fast_tree` for (cfg, experts) as a `Program` (kept across runs)."""
    from mk.model.compile_cache import Program
    return Program(functools.partial(_init_fast_tree, cfg, experts), name="init_fast", identity=repr((cfg, experts)))


def _init_fast_tree(cfg: K3Config, experts: str, seed) -> dict:
    """One program for the whole tree (eager `jax.random` compiled ~170 small programs, 117 s for
    k3-chip on a TPU v5e), drawn from a counter hash (`_hash_bits`): libtpu's compile time of
    `jax.random` grows with the array (k3-chip's tree, deviceless for a v5e: 30 s to compile; the hash: 10 s)."""
    structs = shapes(cfg)
    leaves, tree = jax.tree_util.tree_flatten_with_path(structs)
    base = jax.random.PRNGKey(seed)
    out = []
    for n, (path, s) in enumerate(leaves):
        key = tuple(p.key for p in path)
        salt = seed.astype(jnp.uint32) * jnp.uint32(0x9E3779B1) + jnp.uint32(n)
        out.append(_fast_leaf(cfg, key, s, salt, jax.random.fold_in(base, n), experts))
    return jax.tree_util.tree_unflatten(tree, out)


# RMS of an E2M1 code drawn uniformly from all 16: sqrt(mean of the squared magnitudes 0 .. 6)
_E2M1_RMS = float(np.sqrt(np.mean(np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6]) ** 2)))


def mxfp4_scale_byte(std: float) -> int:
    """The E8M0 byte whose scale gives uniformly random E2M1 codes about this std (random experts
    draw it or the byte below, `init_fast` and `mk.io.synth.write_random_checkpoint`)."""
    return int(round(np.log2(std / _E2M1_RMS))) + 127


def _mix32(x):
    """A 32-bit integer finalizer (lowbias32): each output bit depends on every input bit."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def _hash_bits(shape, salt):
    """u32[shape] of uniformly random bits: the element's flat index (mod 2^32) hashed with salt."""
    index = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for d in reversed(range(len(shape))):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, shape, d) * jnp.uint32(stride % 2**32)
        stride *= shape[d]
    return _mix32(_mix32(index + _mix32(salt)) ^ salt)


def _hash_normal(shape, salt):
    """f32[shape], about N(0, 1): the sum of the four bytes of `_hash_bits`, standardized (Irwin-Hall:
    bounded at +-3.5 std, which random weights do not miss; erf_inv costs libtpu seconds to compile)."""
    x = _hash_bits(shape, salt)
    total = (x & 0xFF) + ((x >> 8) & 0xFF) + ((x >> 16) & 0xFF) + (x >> 24)
    return (total.astype(F32) - 510.0) * np.float32(1.0 / np.sqrt(4 * (256**2 - 1) / 12))


def _fast_leaf(cfg: K3Config, key: tuple, s: jax.ShapeDtypeStruct, salt, k, experts: str):
    shape, dtype = s.shape, s.dtype
    normal = lambda scale: (_hash_normal(shape, salt) * np.float32(scale)).astype(dtype)
    if key in _NORMS:
        return (1.0 + 0.05 * _hash_normal(shape, salt)).astype(dtype)
    if key in {("output_res",), ("layer", "attn_res"), ("layer", "mlp_res")}:
        return normal(0.5 / np.sqrt(cfg.dim))
    if key == ("embed",):
        return normal(1.0)
    if key == ("kda", "conv"):
        x = 0.1 * _hash_normal(shape, salt)
        return x.at[..., -1, :].add(1.0).astype(dtype)
    if key == ("kda", "a_log"):
        u = (_hash_bits(shape, salt) >> 8).astype(F32) * np.float32(2.0**-24)
        return jnp.log(1.0 + 15.0 * u).astype(dtype)
    if key == ("kda", "dt_bias"):
        return normal(0.5)
    if key == ("moe", "router_bias"):                  # small: jax.random's permutation
        keys = jax.random.split(k, shape[0])
        return jnp.stack([jax.random.permutation(kk, shape[1]) * 0.15 for kk in keys]).astype(dtype)
    scale = 1.0 / np.sqrt(shape[-2]) * (OUTPUT_DAMPING if key in _DAMPED else 1.0)
    if experts == "mxfp4" and key[0] == "moe" and key[1] in ("w1", "w3", "w2"):
        *lead, K, N = shape
        byte = mxfp4_scale_byte(scale)
        packed = (_hash_bits((*lead, N, K // 2), salt) >> 24).astype(jnp.uint8)
        flip = _hash_bits((*lead, N, K // 32), salt ^ jnp.uint32(0x5BD1E995)) >> 31     # byte - 1 or byte
        return {"packed": packed, "scale": (jnp.uint32(byte - 1) + flip).astype(jnp.uint8)}
    return normal(scale)


def _decisive_router_bias(rng, shape, top_k):
    """Per layer: a random permutation of evenly spaced biases 0, 0.15, 0.3, ...

    The router's sigmoid scores vary with the input by about +-0.2, so the choice among the
    highest-biased experts still depends on the token, but neighbouring candidates are typically
    separated by far more than the ~1e-3 that bf16 rounding-order noise can move a score.
    """
    n, E = shape
    out = np.empty(shape)
    for i in range(n):
        out[i] = rng.permutation(E) * 0.15
    return out


def num_params(cfg: K3Config) -> int:
    return sum(int(np.prod(s.shape)) for s in jax.tree.leaves(shapes(cfg)))


def nbytes(tree) -> int:
    return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def experts_format(params: dict) -> str:
    """"mxfp4" if params' routed experts are packed (`mk.io.checkpoint.load(..., experts="mxfp4")`:
    moe.w1 = {"packed", "scale"}), else "bf16"."""
    moe = params.get("moe", {}) if isinstance(params, dict) else {}
    return "mxfp4" if isinstance(moe.get("w1"), dict) else "bf16"
