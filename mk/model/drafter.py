"""A DSpark-style block drafter (spec 4.1) in plain JAX, its config and its checkpoint format.

The drafter is a small Qwen3-like transformer. Its context keys/values come from the TARGET's aux
rows: for every verified token, the running prefix p with which each aux layer of the target
starts (`mk.model.reference.verify_step(..., aux_layers=)`), concatenated, projected by `fc` and
normalised (`c_t`). A draft block is the anchor token plus mask tokens at positions P, P+1, ...;
slot i predicts the token at P+i+1. Drafts are chosen greedily left to right with the low-rank
Markov bias `markov_w1[prev] . markov_w2^T` added to the slot's logits.

Shapes (B rows, n = len(aux_layers), d = target width, h = hidden, Hq/Hkv heads of hd):
    aux       [B, T, n, d] bf16        context rows of T verified tokens
    cache k/v [B, layers, ctx, Hkv, hd] bf16   context keys/values by position (slot = position)
    drafts    [B, k] int32

Checkpoint: a directory with `config.json` (spec 4.1's keys, plus `target_hidden_size`) and
`model.safetensors` (spec 4.1's tensor names, bf16, HF [out, in] orientation).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from mk.errors import UserError
from mk.model.layers.common import BF16, F32, bf, f32, mm, rms

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


class DrafterError(UserError):
    """A drafter checkpoint or config that cannot be used; the message names the file/tensor/key."""


@dataclasses.dataclass(frozen=True)
class DraftConfig:
    hidden: int = 7168
    layers: int = 5
    heads: int = 96
    kv_heads: int = 16
    head_dim: int = 64
    mlp: int = 14336
    vocab: int = 163840
    aux_layers: tuple[int, ...] = (24, 48, 72, 88, 92)
    mask_token: int = 163837
    window: int = 2048
    rope_theta: float = 10000.0
    eps: float = 1e-5
    markov_rank: int = 256
    target_hidden: int = 7168

    _KEYS = {  # field -> config.json key (spec 4.1)
        "hidden": "transformer_layer_config.hidden_size",
        "layers": "transformer_layer_config.num_hidden_layers",
        "heads": "transformer_layer_config.num_attention_heads",
        "kv_heads": "transformer_layer_config.num_key_value_heads",
        "head_dim": "transformer_layer_config.head_dim",
        "mlp": "transformer_layer_config.intermediate_size",
        "vocab": "transformer_layer_config.vocab_size",
        "window": "transformer_layer_config.sliding_window",
        "rope_theta": "transformer_layer_config.rope_parameters.rope_theta",
        "eps": "transformer_layer_config.rms_norm_eps",
        "aux_layers": "aux_hidden_state_layer_ids",
        "mask_token": "mask_token_id",
        "markov_rank": "markov_rank",
        "target_hidden": "target_hidden_size",
    }

    def __post_init__(self):
        where = lambda f: f"drafter config '{self._KEYS[f]}'"
        for f in ("hidden", "layers", "heads", "kv_heads", "head_dim", "mlp", "vocab", "window",
                  "markov_rank", "target_hidden"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise DrafterError(f"{where(f)} must be a positive integer, found {v!r}")
        if self.heads % self.kv_heads:
            raise DrafterError(f"{where('heads')} ({self.heads}) is not a multiple of "
                               f"{self._KEYS['kv_heads']} ({self.kv_heads})")
        if self.head_dim % 2:
            raise DrafterError(f"{where('head_dim')} must be even (RoPE rotates halves), found {self.head_dim}")
        aux = self.aux_layers
        if not aux or not all(isinstance(l, int) and not isinstance(l, bool) for l in aux) \
                or list(aux) != sorted(set(aux)):
            raise DrafterError(f"{where('aux_layers')} must be a non-empty increasing list of layer ids, found {list(aux)}")
        if not 0 <= self.mask_token < self.vocab:
            raise DrafterError(f"{where('mask_token')} = {self.mask_token} outside the vocabulary [0, {self.vocab})")

    def to_json(self) -> dict:
        out: dict = {}
        for f, key in self._KEYS.items():
            *path, leaf = key.split(".")
            node = out
            for p in path:
                node = node.setdefault(p, {})
            v = getattr(self, f)
            node[leaf] = list(v) if isinstance(v, tuple) else v
        return out

    @classmethod
    def from_json(cls, raw: dict, file: str = CONFIG_FILE) -> "DraftConfig":
        kw = {}
        for f, key in cls._KEYS.items():
            node = raw
            for p in key.split("."):
                if not isinstance(node, dict) or p not in node:
                    if f == "target_hidden":       # optional: the target's width = the drafter's
                        node = None
                        break
                    raise DrafterError(f"{file}: key '{key}' missing")
                node = node[p]
            if node is not None:
                kw[f] = tuple(node) if f == "aux_layers" and isinstance(node, list) else node
        kw.setdefault("target_hidden", kw.get("hidden"))
        try:
            return cls(**kw)
        except DrafterError as e:
            raise DrafterError(f"{file}: {e}") from None

    def fit(self, cfg, source: str = "drafter") -> None:
        """Raise DrafterError unless this drafter can run on the target config `cfg` (a K3Config)."""
        if self.vocab != cfg.vocab:
            raise DrafterError(f"{source}: vocabulary {self.vocab} does not match the target's {cfg.vocab}")
        if self.target_hidden != cfg.dim:
            raise DrafterError(f"{source}: target_hidden_size {self.target_hidden} does not match the "
                               f"target's width {cfg.dim}")
        bad = [l for l in self.aux_layers if not 0 < l < cfg.layers]
        if bad:
            raise DrafterError(f"{source}: aux layers {bad} do not exist in the target (its layers "
                               f"1..{cfg.layers - 1} can be read)")


def config_for(cfg, **kw) -> DraftConfig:
    """A small drafter config for target `cfg`: 1 layer, hidden 128, 2 query heads over 1 KV head of
    64, MLP 256, aux layers spread over the target's depth (as K3's 24/48/72/88/92 of 93)."""
    n = min(3, cfg.layers - 1)
    aux = tuple(sorted({max(1, round(cfg.layers * (j + 1) / (n + 1))) for j in range(n)}))
    base = dict(hidden=128, layers=1, heads=2, kv_heads=1, head_dim=64, mlp=256, vocab=cfg.vocab,
                aux_layers=aux, mask_token=cfg.vocab - 3, window=2048, markov_rank=16, target_hidden=cfg.dim)
    base.update(kw)
    return DraftConfig(**base)


# ---- parameters -----------------------------------------------------------------------------

def layout(dc: DraftConfig) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor name -> shape (HF [out, in] orientation), spec 4.1."""
    h, q, kv = dc.hidden, dc.heads * dc.head_dim, dc.kv_heads * dc.head_dim
    out = {"embed_tokens.weight": (dc.vocab, h), "lm_head.weight": (dc.vocab, h),
           "fc.weight": (h, len(dc.aux_layers) * dc.target_hidden), "hidden_norm.weight": (h,),
           "norm.weight": (h,), "markov_head.markov_w1.weight": (dc.vocab, dc.markov_rank),
           "markov_head.markov_w2.weight": (dc.vocab, dc.markov_rank)}
    for l in range(dc.layers):
        p = f"layers.{l}."
        out.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                    p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                    p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                    p + "self_attn.q_norm.weight": (dc.head_dim,), p + "self_attn.k_norm.weight": (dc.head_dim,),
                    p + "mlp.gate_proj.weight": (dc.mlp, h), p + "mlp.up_proj.weight": (dc.mlp, h),
                    p + "mlp.down_proj.weight": (h, dc.mlp)})
    return out


def init(dc: DraftConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Random bf16 weights by checkpoint name (norms near 1, projections ~ 1/sqrt(fan_in))."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in layout(dc).items():
        if len(shape) == 1:
            w = 1.0 + 0.05 * rng.standard_normal(shape)
        elif "embed" in name:
            w = rng.standard_normal(shape)
        elif "markov" in name:
            w = rng.standard_normal(shape) / np.sqrt(dc.markov_rank)
        else:
            w = rng.standard_normal(shape) / np.sqrt(shape[1])
        out[name] = w.astype(np.float32).astype(jnp.bfloat16)
    return out


def write(dc: DraftConfig, out_dir, seed: int = 0, weights: dict | None = None) -> dict:
    """Write a drafter checkpoint (config.json + model.safetensors); returns the weights written."""
    from safetensors.numpy import save_file
    os.makedirs(out_dir, exist_ok=True)
    weights = weights if weights is not None else init(dc, seed)
    with open(os.path.join(out_dir, CONFIG_FILE), "w") as f:
        json.dump(dc.to_json(), f, indent=1)
    save_file({k: np.ascontiguousarray(v) for k, v in weights.items()}, os.path.join(out_dir, WEIGHTS_FILE),
              metadata={"format": "pt"})
    return weights


def load(path, target_cfg=None) -> tuple[DraftConfig, dict]:
    """Read and validate a drafter checkpoint directory -> (DraftConfig, weights by name, numpy bf16).
    With `target_cfg`, also checks that the drafter fits the target (vocabulary, width, aux layers)."""
    from safetensors import SafetensorError, safe_open
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise DrafterError(f"{path}: drafter directory not found")
    cfile, wfile = os.path.join(path, CONFIG_FILE), os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(cfile):
        raise DrafterError(f"{cfile}: drafter config.json not found")
    try:
        with open(cfile) as f:
            raw = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DrafterError(f"{cfile}: not valid JSON ({e})") from None
    dc = DraftConfig.from_json(raw, cfile)
    if target_cfg is not None:
        dc.fit(target_cfg, path)
    if not os.path.isfile(wfile):
        raise DrafterError(f"{wfile}: drafter weights not found")
    try:
        h = safe_open(wfile, framework="np")
    except (SafetensorError, OSError) as e:
        raise DrafterError(f"{wfile}: cannot read safetensors file ({e})") from None
    have = set(h.keys())
    weights = {}
    for name, shape in layout(dc).items():
        if name not in have:
            raise DrafterError(f"{wfile}: tensor '{name}' missing")
        sl = h.get_slice(name)
        if sl.get_dtype() != "BF16":
            raise DrafterError(f"{wfile}: tensor '{name}' has dtype {sl.get_dtype()}, expected BF16")
        if tuple(sl.get_shape()) != shape:
            raise DrafterError(f"{wfile}: tensor '{name}' has shape {list(sl.get_shape())}, expected {list(shape)}")
        weights[name] = h.get_tensor(name)
    return dc, weights


def to_params(dc: DraftConfig, weights: dict) -> dict:
    """Checkpoint weights -> the pytree the math below uses ([in, out] matrices, stacked layers)."""
    t = lambda n: jnp.asarray(weights[n]).T
    layer = lambda n: jnp.stack([jnp.asarray(weights[f"layers.{l}.{n}"]) for l in range(dc.layers)])
    layer_t = lambda n: jnp.swapaxes(layer(n), 1, 2)
    return {"embed": jnp.asarray(weights["embed_tokens.weight"]), "lm_head": t("lm_head.weight"),
            "fc": t("fc.weight"), "hidden_norm": jnp.asarray(weights["hidden_norm.weight"]),
            "norm": jnp.asarray(weights["norm.weight"]),
            "w1": jnp.asarray(weights["markov_head.markov_w1.weight"]),
            "w2": jnp.asarray(weights["markov_head.markov_w2.weight"]),
            "ln1": layer("input_layernorm.weight"), "ln2": layer("post_attention_layernorm.weight"),
            "q": layer_t("self_attn.q_proj.weight"), "k": layer_t("self_attn.k_proj.weight"),
            "v": layer_t("self_attn.v_proj.weight"), "o": layer_t("self_attn.o_proj.weight"),
            "q_norm": layer("self_attn.q_norm.weight"), "k_norm": layer("self_attn.k_norm.weight"),
            "gate": layer_t("mlp.gate_proj.weight"), "up": layer_t("mlp.up_proj.weight"),
            "down": layer_t("mlp.down_proj.weight")}


# ---- math (spec 4.1, Qwen3 bf16 semantics) ---------------------------------------------------

def rope(x, pos, theta: float):
    """Rotate-half RoPE: x [..., hd] bf16 at positions pos (broadcast to x[..., 0]) -> bf16."""
    hd = x.shape[-1]
    inv = theta ** (-jnp.arange(0, hd, 2, dtype=F32) / hd)
    ang = f32(pos)[..., None] * inv
    cos, sin = (jnp.concatenate([c, c], -1) for c in (jnp.cos(ang), jnp.sin(ang)))
    xf = f32(x)
    rot = jnp.concatenate([-xf[..., hd // 2:], xf[..., :hd // 2]], -1)
    return bf(xf * cos + rot * sin)


def _lin(x, w):
    """[..., K] bf16 @ [K, N] -> [..., N] bf16 (fp32 accumulate)."""
    lead = x.shape[:-1]
    return bf(mm(x.reshape(-1, x.shape[-1]), w)).reshape(*lead, w.shape[-1])


def context_kv(params, aux, pos, dc: DraftConfig):
    """Context keys/values of T verified tokens: aux [B, T, n, d], pos [B, T] ->
    (k, v) [B, layers, T, Hkv, hd] bf16."""
    B, T = aux.shape[:2]
    c = rms(_lin(aux.reshape(B, T, -1), params["fc"]), params["hidden_norm"], dc.eps)
    ks, vs = [], []
    for l in range(dc.layers):
        k = _lin(c, params["k"][l]).reshape(B, T, dc.kv_heads, dc.head_dim)
        ks.append(rope(rms(k, params["k_norm"][l], dc.eps), pos[:, :, None], dc.rope_theta))
        vs.append(_lin(c, params["v"][l]).reshape(B, T, dc.kv_heads, dc.head_dim))
    return jnp.stack(ks, 1), jnp.stack(vs, 1)


@functools.partial(jax.jit, static_argnames="dc")
def observe(params, cache, aux, pos, *, dc: DraftConfig):
    """Write the context rows of T tokens at positions pos[b]..pos[b]+T-1 (rejected ones are masked
    by position until overwritten). cache {"k", "v"} [B, layers, ctx, Hkv, hd]."""
    T = aux.shape[1]
    k, v = context_kv(params, aux, pos[:, None] + jnp.arange(T)[None], dc)
    put = jax.vmap(lambda c, n, p: jax.lax.dynamic_update_slice_in_dim(c, n, p, axis=1))
    return {"k": put(cache["k"], k, pos), "v": put(cache["v"], v, pos)}


def init_cache(dc: DraftConfig, batch: int, ctx: int) -> dict:
    shape = (batch, dc.layers, ctx, dc.kv_heads, dc.head_dim)
    return {"k": jnp.zeros(shape, BF16), "v": jnp.zeros(shape, BF16)}


@functools.partial(jax.jit, static_argnames=("dc", "k"))
def draft(params, cache, anchor, pos, *, dc: DraftConfig, k: int):
    """k greedy Markov drafts after `anchor` [B] at position pos [B] -> [B, k] int32.

    The block is the anchor plus k-1 mask tokens (slot i predicts position pos+i+1; attention is
    causal, so more slots would not change these k)."""
    B = anchor.shape[0]
    ctx = cache["k"].shape[2]
    tokens = jnp.concatenate([anchor[:, None], jnp.full((B, k - 1), dc.mask_token, anchor.dtype)], 1)
    bpos = pos[:, None] + jnp.arange(k)[None]                                  # [B, k]
    x = params["embed"][tokens]                                                # [B, k, h]
    group = dc.heads // dc.kv_heads
    slot = jnp.arange(ctx)
    ctx_ok = (slot[None] < pos[:, None]) & (slot[None] >= pos[:, None] - dc.window)   # [B, ctx]
    causal = jnp.tril(jnp.ones((k, k), bool))
    for l in range(dc.layers):
        h = rms(x, params["ln1"][l], dc.eps)
        q = _lin(h, params["q"][l]).reshape(B, k, dc.heads, dc.head_dim)
        q = rope(rms(q, params["q_norm"][l], dc.eps), bpos[:, :, None], dc.rope_theta)
        kb = rope(rms(_lin(h, params["k"][l]).reshape(B, k, dc.kv_heads, dc.head_dim), params["k_norm"][l],
                      dc.eps), bpos[:, :, None], dc.rope_theta)
        vb = _lin(h, params["v"][l]).reshape(B, k, dc.kv_heads, dc.head_dim)
        keys = jnp.concatenate([cache["k"][:, l], kb], 1)                      # [B, ctx+k, Hkv, hd]
        vals = jnp.concatenate([cache["v"][:, l], vb], 1)
        ok = jnp.concatenate([jnp.broadcast_to(ctx_ok[:, None], (B, k, ctx)),
                              jnp.broadcast_to(causal[None], (B, k, k))], -1)  # [B, k, ctx+k]
        qg = f32(q).reshape(B, k, dc.kv_heads, group, dc.head_dim)
        s = jnp.einsum("bqkgd,bskd->bkgqs", qg, f32(keys)) / np.sqrt(dc.head_dim)
        s = jnp.where(ok[:, None, None], s, -jnp.inf)
        pr = bf(jax.nn.softmax(s, axis=-1))
        att = jnp.einsum("bkgqs,bskd->bqkgd", f32(pr), f32(vals)).reshape(B, k, dc.heads * dc.head_dim)
        x = bf(f32(x) + f32(_lin(bf(att), params["o"][l])))
        h2 = rms(x, params["ln2"][l], dc.eps)
        act = bf(jax.nn.silu(f32(_lin(h2, params["gate"][l]))) * f32(_lin(h2, params["up"][l])))
        x = bf(f32(x) + f32(_lin(act, params["down"][l])))
    base = f32(_lin(rms(x, params["norm"], dc.eps), params["lm_head"]))         # [B, k, V]

    def pick(prev, base_i):
        bias = f32(bf(mm(params["w1"][prev], params["w2"].T)))                # [B, V]
        d = jnp.argmax(base_i + bias, axis=-1).astype(jnp.int32)
        return d, d
    _, drafts = jax.lax.scan(pick, anchor.astype(jnp.int32), jnp.swapaxes(base, 0, 1))
    return jnp.swapaxes(drafts, 0, 1)


class DSparkDrafter:
    """The drafter as the speculative loop drives it: `start`, `observe`, `propose`."""

    def __init__(self, dc: DraftConfig, weights: dict):
        self.dc, self.params = dc, to_params(dc, weights)
        self.aux_layers = dc.aux_layers

    def start(self, batch: int, ctx: int):
        return init_cache(self.dc, batch, ctx)

    def observe(self, state, aux, pos):
        return observe(self.params, state, aux, jnp.asarray(pos, jnp.int32), dc=self.dc)

    def propose(self, state, anchor, pos, k: int) -> np.ndarray:
        return np.asarray(draft(self.params, state, jnp.asarray(anchor, jnp.int32),
                                jnp.asarray(pos, jnp.int32), dc=self.dc, k=k))
