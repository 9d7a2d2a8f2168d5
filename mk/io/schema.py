"""A Kimi K3 checkpoint's schema: its files, the errors a bad one raises, and the one table that maps
its tensors to the parameter tree (`layout(cfg)`, spec 2.2).

`mk.io.checkpoint` reads checkpoints through this table and `mk.io.synth` writes them with it; each
`Entry` names the tree slot, and each `Source` the checkpoint tensor (name, shape, dtypes) it comes from.
"""
from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

from mk.model.config import MX_GROUP, ConfigError, K3Config
from mk.errors import UserError

PREFIX = "language_model.model."
LM_HEAD = "language_model.lm_head.weight"
CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
CHUNK_BYTES = 16 << 20   # row-chunk size for streaming big tensors

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)
U8 = np.dtype(np.uint8)

_NP_DTYPES = {"BF16": BF16, "F32": F32, "F16": np.dtype(np.float16), "U8": U8}
_FLOAT = ("F32", "BF16", "F16")  # accepted for fp32 targets: all widen to fp32 exactly


# ---- errors -------------------------------------------------------------------------------------
class CheckpointError(UserError):
    """A checkpoint this loader cannot use. The message names the file and the tensor or key."""


class MissingFileError(CheckpointError):
    """config.json, the index, a shard or a tokenizer file does not exist."""


class CheckpointConfigError(CheckpointError, ConfigError):
    """config.json holds a setting this code does not implement (wraps `ConfigError`)."""


class IndexFormatError(CheckpointError):
    """model.safetensors.index.json is not valid JSON or has no usable `weight_map`."""


class MissingShardError(MissingFileError):
    """An index entry names a shard file that does not exist."""


class MissingTensorError(CheckpointError):
    """A tensor the model needs is absent from the index or from its shard."""


class TensorShapeError(CheckpointError):
    """A tensor has the wrong shape."""


class TensorDtypeError(CheckpointError):
    """A tensor has the wrong dtype."""


class CorruptShardError(CheckpointError):
    """A shard is not a readable safetensors file."""


class TruncatedShardError(CorruptShardError):
    """A shard is shorter than its header says."""


class CorruptHeaderError(CorruptShardError):
    """A shard's safetensors header cannot be parsed."""


class ScaleByteError(CheckpointError):
    """An MXFP4 E8M0 scale byte is 0 or 255 (rejected, spec 2.3)."""


class TokenizerError(CheckpointError):
    """The tokenizer files are malformed (e.g. `pat_str` is not a literal list)."""


# ---- the checkpoint <-> parameter tree table ------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Source:
    """One checkpoint tensor: name, PyTorch shape, accepted safetensors dtypes (first = written)."""
    name: str
    shape: tuple[int, ...]
    dtypes: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Entry:
    """How checkpoint tensor(s) fill one slot `tree[dest][index]` of the parameter tree.

    kind: "copy" (same orientation), "T" (2-D transpose), "conv" ([HD,1,C] -> [C,HD]),
    "fold" (norm * proj, fp32), "mxfp4" (packed + scale -> dequantized, transposed).
    """
    kind: str
    dest: tuple[str, ...]
    index: tuple[int, ...]
    sources: tuple[Source, ...]
    group: str  # progress unit: "embed", "layer 3", "head"


def _bf(name, shape):
    return Source(name, tuple(shape), ("BF16",))


def _fp(name, shape):
    return Source(name, tuple(shape), _FLOAT)


def layout(cfg: K3Config) -> list[Entry]:
    """Every checkpoint tensor of `cfg` and where it goes, in file (layer) order."""
    _check_mx(cfg)
    d, H, D, HD = cfg.dim, cfg.heads, cfg.head_dim, cfg.attn_width
    E, Lt, Fe, S, F = cfg.experts, cfg.latent, cfg.expert_hidden, cfg.shared_hidden, cfg.dense_hidden
    out: list[Entry] = []

    def add(kind, dest, index, sources, group):
        out.append(Entry(kind, dest, tuple(index), tuple(sources), group))

    def mat(dest, index, name, n_out, n_in, group):
        add("T", dest, index, [_bf(name, (n_out, n_in))], group)

    add("copy", ("embed",), (), [_bf(PREFIX + "embed_tokens.weight", (cfg.vocab, d))], "embed")
    for l in range(cfg.layers):
        p, g = f"{PREFIX}layers.{l}.", f"layer {l}"
        add("copy", ("layer", "attn_norm"), (l,), [_bf(p + "input_layernorm.weight", (d,))], g)
        add("copy", ("layer", "ffn_norm"), (l,), [_bf(p + "post_attention_layernorm.weight", (d,))], g)
        add("fold", ("layer", "attn_res"), (l,), [_fp(p + "self_attention_res_norm.weight", (d,)),
                                                  _fp(p + "self_attention_res_proj.weight", (1, d))], g)
        add("fold", ("layer", "mlp_res"), (l,), [_fp(p + "mlp_res_norm.weight", (d,)),
                                                 _fp(p + "mlp_res_proj.weight", (1, d))], g)
        a = p + "self_attn."
        if cfg.is_mla(l):
            i = (cfg.mla_index(l),)
            mat(("mla", "q_a"), i, a + "q_a_proj.weight", cfg.q_rank, d, g)
            add("copy", ("mla", "q_a_norm"), i, [_bf(a + "q_a_layernorm.weight", (cfg.q_rank,))], g)
            mat(("mla", "q_b"), i, a + "q_b_proj.weight", H * cfg.qk_head_dim, cfg.q_rank, g)
            mat(("mla", "kv_a"), i, a + "kv_a_proj_with_mqa.weight", cfg.kv_rank + cfg.qk_extra, d, g)
            add("copy", ("mla", "kv_a_norm"), i, [_bf(a + "kv_a_layernorm.weight", (cfg.kv_rank,))], g)
            mat(("mla", "kv_b"), i, a + "kv_b_proj.weight", H * 2 * D, cfg.kv_rank, g)
            mat(("mla", "g"), i, a + "g_proj.weight", HD, d, g)
            mat(("mla", "o"), i, a + "o_proj.weight", d, HD, g)
        else:
            i = (cfg.kda_index(l),)
            mat(("kda", "f_a"), i, a + "f_a_proj.weight", D, d, g)
            mat(("kda", "f_b"), i, a + "f_b_proj.weight", HD, D, g)
            for x in ("q", "k", "v", "g"):
                mat(("kda", x), i, a + f"{x}_proj.weight", HD, d, g)
            mat(("kda", "b"), i, a + "b_proj.weight", H, d, g)
            mat(("kda", "o"), i, a + "o_proj.weight", d, HD, g)
            for j, x in enumerate("qkv"):
                add("conv", ("kda", "conv"), i + (j,), [_fp(a + f"{x}_conv1d.weight", (HD, 1, cfg.conv_size))], g)
            add("copy", ("kda", "a_log"), i, [_fp(a + "A_log", (H,))], g)
            add("copy", ("kda", "dt_bias"), i, [_fp(a + "dt_bias", (HD,))], g)
            add("copy", ("kda", "o_norm"), i, [_fp(a + "o_norm.weight", (D,))], g)
        if l == 0:
            m = p + "mlp."
            mat(("dense", "gate"), (), m + "gate_proj.weight", F, d, g)
            mat(("dense", "up"), (), m + "up_proj.weight", F, d, g)
            mat(("dense", "down"), (), m + "down_proj.weight", d, F, g)
        else:
            m, i = p + "block_sparse_moe.", (l - 1,)
            mat(("moe", "router"), i, m + "gate.weight", E, d, g)
            add("copy", ("moe", "router_bias"), i, [_fp(m + "gate.e_score_correction_bias", (E,))], g)
            mat(("moe", "latent_down"), i, m + "routed_expert_down_proj.weight", Lt, d, g)
            mat(("moe", "latent_up"), i, m + "routed_expert_up_proj.weight", d, Lt, g)
            add("copy", ("moe", "latent_norm"), i, [_fp(m + "routed_expert_norm.weight", (Lt,))], g)
            mat(("moe", "shared_gate"), i, m + "shared_experts.gate_proj.weight", S, d, g)
            mat(("moe", "shared_up"), i, m + "shared_experts.up_proj.weight", S, d, g)
            mat(("moe", "shared_down"), i, m + "shared_experts.down_proj.weight", d, S, g)
            for e in range(E):
                for w, (n, k) in (("w1", (Fe, Lt)), ("w3", (Fe, Lt)), ("w2", (Lt, Fe))):
                    x = f"{m}experts.{e}.{w}."
                    add("mxfp4", ("moe", w), i + (e,),
                        [Source(x + "weight_packed", (n, k // 2), ("U8",)),
                         Source(x + "weight_scale", (n, k // MX_GROUP), ("U8",))], g)
    add("copy", ("final_norm",), (), [_bf(PREFIX + "norm.weight", (d,))], "head")
    add("fold", ("output_res",), (), [_fp(PREFIX + "output_attn_res_norm.weight", (d,)),
                                      _fp(PREFIX + "output_attn_res_proj.weight", (1, d))], "head")
    add("T", ("lm_head",), (), [_bf(LM_HEAD, (cfg.vocab, d))], "head")
    return out


def _check_mx(cfg: K3Config, where: str = "config"):
    for key, v in (("routed_expert_hidden_size", cfg.latent), ("moe_intermediate_size", cfg.expert_hidden)):
        if v % MX_GROUP:
            raise CheckpointConfigError(f"{where}: '{key}' = {v} is not a multiple of the MXFP4 "
                                        f"group size {MX_GROUP}")
