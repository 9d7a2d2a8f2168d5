"""The Kimi K3 model contract as one frozen dataclass, plus the schedules derived from it.

`K3Config()` is the full-size model (spec 1.1). Named presets (`PRESETS`, `get_config`) give the
same architecture at other sizes: `mini` runs end-to-end in TPU interpret mode on a CPU in seconds,
`k3-slice` keeps every full K3 width but only four layers, for compiling at real widths.

Every layer schedule the kernel and the reference need (which layers are MLA, each layer's KDA
state index, the attention-residual block bookkeeping) is derived here from the config; nothing
downstream hard-codes a K3 number.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Mapping


from mk.errors import UserError

# MXFP4 (spec 2.3): one E8M0 scale per 32 consecutive contraction rows of a routed expert's weight.
MX_GROUP = 32


class ConfigError(UserError, ValueError):
    """A checkpoint config that K3's code cannot run. The message names the key at fault."""


@dataclasses.dataclass(frozen=True)
class K3Config:
    """Kimi K3 hyper-parameters. Defaults are the full checkpoint (spec 1.1)."""

    dim: int = 7168                  # hidden_size: residual width d
    latent: int = 3584               # routed_expert_hidden_size: latent MoE width
    expert_hidden: int = 3072        # moe_intermediate_size: routed expert FFN width
    num_shared_experts: int = 2      # num_shared_experts (fused into one FFN)
    dense_hidden: int = 33792        # intermediate_size: layer-0 dense MLP width
    experts: int = 896               # num_experts
    top_k: int = 16                  # num_experts_per_token
    layers: int = 93                 # num_hidden_layers
    heads: int = 96                  # num_attention_heads (KDA and MLA)
    head_dim: int = 128              # linear_attn_config.head_dim (also MLA nope / v head dim)
    q_rank: int = 1536               # q_lora_rank
    kv_rank: int = 512               # kv_lora_rank
    qk_extra: int = 64               # qk_rope_head_dim (shared raw key part, never rotated)
    vocab: int = 163840              # vocab_size
    conv_size: int = 4               # linear_attn_config.short_conv_kernel_size
    residual_block: int = 12         # attn_res_block_size
    eps: float = 1e-5                # rms_norm_eps
    situ_beta: float = 4.0           # activation_situ_beta
    situ_linear_beta: float = 25.0   # activation_situ_linear_beta
    gate_lower_bound: float = -5.0   # linear_attn_config.gate_lower_bound
    full_attention: tuple[int, ...] = tuple(range(3, 92, 4)) + (92,)  # 0-based MLA layers

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.type == "int" and (not isinstance(v, int) or v <= 0):
                raise ConfigError(f"K3Config.{f.name} must be a positive integer, found {v!r}")
        if self.top_k > self.experts:
            raise ConfigError(f"K3Config.top_k ({self.top_k}) exceeds experts ({self.experts})")
        if self.conv_size < 2:
            raise ConfigError(f"K3Config.conv_size must be >= 2, found {self.conv_size}")
        bad = [l for l in self.full_attention if not 0 <= l < self.layers]
        if bad:
            raise ConfigError(f"K3Config.full_attention names layers {bad} outside 0..{self.layers - 1}")
        if list(self.full_attention) != sorted(set(self.full_attention)):
            raise ConfigError(f"K3Config.full_attention must be strictly increasing, found {self.full_attention}")
        if 0 in self.full_attention:
            raise ConfigError("K3Config.full_attention: layer 0 must be a KDA layer (it carries the dense MLP)")

    # ---- widths derived from the contract -------------------------------------------------
    @property
    def shared_hidden(self) -> int:
        """Total width of the fused shared-expert FFN."""
        return self.expert_hidden * self.num_shared_experts

    @property
    def attn_width(self) -> int:
        """heads * head_dim: width of KDA q/k/v/g and of the attention output features."""
        return self.heads * self.head_dim

    @property
    def qk_head_dim(self) -> int:
        """MLA query/key width per head: nope part (head_dim) + shared raw part (qk_extra)."""
        return self.head_dim + self.qk_extra

    @property
    def k_cache_dim(self) -> int:
        """MLA key width as cached: qk_head_dim zero-padded to the 128-lane tile."""
        return _round_up(self.qk_head_dim, 128)

    @property
    def mla_scale(self) -> float:
        return 1.0 / math.sqrt(self.qk_head_dim)

    # ---- layer schedule --------------------------------------------------------------------
    def is_mla(self, layer: int) -> bool:
        return layer in self.full_attention

    @property
    def mla_layers(self) -> tuple[int, ...]:
        return tuple(self.full_attention)

    @property
    def kda_layers(self) -> tuple[int, ...]:
        return tuple(l for l in range(self.layers) if l not in self.full_attention)

    @property
    def n_mla(self) -> int:
        return len(self.full_attention)

    @property
    def n_kda(self) -> int:
        return self.layers - self.n_mla

    @property
    def n_moe(self) -> int:
        """Layers 1..L-1 carry a MoE (layer 0 has the dense MLP)."""
        return self.layers - 1

    def kda_index(self, layer: int) -> int:
        """Index of a KDA layer into the stacked KDA weights and states."""
        return self.kda_layers.index(layer)

    def mla_index(self, layer: int) -> int:
        """Index of an MLA layer into the stacked MLA weights and caches."""
        return self.full_attention.index(layer)

    def family_index(self, layer: int) -> int:
        """KDA index for KDA layers, MLA index for MLA layers (the kernel's per-kind index)."""
        return self.mla_index(layer) if self.is_mla(layer) else self.kda_index(layer)

    # ---- attention-residual bookkeeping (spec 1.4.2) ---------------------------------------
    def n_attn_blocks(self, layer: int) -> int:
        """Snapshots b_0..b_{n-1} mixed (with p) before layer `layer`'s attention."""
        return (layer - 1) // self.residual_block + 1

    def n_mlp_blocks(self, layer: int) -> int:
        """Snapshots mixed (with p) before layer `layer`'s channel mixer."""
        return layer // self.residual_block + 1

    def starts_block(self, layer: int) -> bool:
        """True where p is stored as snapshot b_{layer/R} and restarts from the attention output."""
        return layer % self.residual_block == 0

    @property
    def n_blocks(self) -> int:
        """Stored snapshots b_0..b_{n-1}; the final mix uses all of them."""
        return (self.layers - 1) // self.residual_block + 1

    # ---- (de)serialisation -----------------------------------------------------------------
    def replace(self, **kw) -> "K3Config":
        return dataclasses.replace(self, **kw)

    def to_hf(self) -> dict:
        """The `config.json` dict of a checkpoint with this config (text_config wrapper)."""
        text = {
            "model_type": "kimi_k3",
            "hidden_size": self.dim,
            "routed_expert_hidden_size": self.latent,
            "moe_intermediate_size": self.expert_hidden,
            "num_shared_experts": self.num_shared_experts,
            "intermediate_size": self.dense_hidden,
            "num_experts": self.experts,
            "num_experts_per_token": self.top_k,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "q_lora_rank": self.q_rank,
            "kv_lora_rank": self.kv_rank,
            "qk_rope_head_dim": self.qk_extra,
            "qk_nope_head_dim": self.head_dim,
            "v_head_dim": self.head_dim,
            "vocab_size": self.vocab,
            "attn_res_block_size": self.residual_block,
            "rms_norm_eps": self.eps,
            "activation_situ_beta": self.situ_beta,
            "activation_situ_linear_beta": self.situ_linear_beta,
            "tie_word_embeddings": False,
            "linear_attn_config": {
                "head_dim": self.head_dim,
                "short_conv_kernel_size": self.conv_size,
                "gate_lower_bound": self.gate_lower_bound,
                "full_attn_layers": [l + 1 for l in self.full_attention],
                "use_full_rank_gate": True,
            },
        }
        text.update(REQUIRED_SETTINGS)
        return {"architectures": ["KimiK3ForCausalLM"], "text_config": text}

    @classmethod
    def from_hf(cls, source: "str | os.PathLike | Mapping[str, Any]") -> "K3Config":
        """Read a checkpoint's `config.json` (a path to it, to its directory, or the parsed dict).

        Accepts the keys at top level or inside `text_config`; `full_attn_layers` is 1-based in the
        file. Raises `ConfigError` naming the key, the expected and the found value for every
        setting this code does not implement.
        """
        where = "config"
        if isinstance(source, Mapping):
            raw = dict(source)
        else:
            path = os.fspath(source)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            where = path
            try:
                with open(path) as f:
                    raw = json.load(f)
            except FileNotFoundError:
                raise ConfigError(f"{path}: config.json not found") from None
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{where}: the top level must be a JSON object, found {type(raw).__name__}")
        cfg = raw.get("text_config", raw)
        if not isinstance(cfg, Mapping):
            raise ConfigError(f"{where}: 'text_config' must be an object")
        lin = cfg.get("linear_attn_config", {})
        if not isinstance(lin, Mapping):
            raise ConfigError(f"{where}: 'linear_attn_config' must be an object, found {type(lin).__name__}")

        def get(key: str, table: Mapping = cfg, prefix: str = ""):
            if key not in table:
                raise ConfigError(f"{where}: missing key '{prefix}{key}'")
            return table[key]

        def get_float(key: str, table: Mapping = cfg, prefix: str = "") -> float:
            value = get(key, table, prefix)
            try:
                return float(value)
            except (TypeError, ValueError):
                raise ConfigError(f"{where}: '{prefix}{key}' must be a number, found {value!r}") from None

        for key, expected in REQUIRED_SETTINGS.items():
            found = cfg.get(key, _MISSING)
            if not _same(found, expected):
                raise ConfigError(f"{where}: unsupported setting '{key}': expected {expected!r}, found {_show(found)}")
        found = lin.get("use_full_rank_gate", _MISSING)
        if found is not True:
            raise ConfigError(f"{where}: unsupported setting 'linear_attn_config.use_full_rank_gate': "
                              f"expected True, found {_show(found)}")
        if cfg.get("tie_word_embeddings", False):
            raise ConfigError(f"{where}: unsupported setting 'tie_word_embeddings': expected False, found True")
        head_dim = get("head_dim", lin, "linear_attn_config.")
        for key in ("qk_nope_head_dim", "v_head_dim"):
            if key in cfg and cfg[key] != head_dim:
                raise ConfigError(f"{where}: unsupported setting '{key}': expected {head_dim} "
                                  f"(= linear_attn_config.head_dim), found {cfg[key]!r}")
        layers_1b = get("full_attn_layers", lin, "linear_attn_config.")
        try:
            full = tuple(int(l) - 1 for l in layers_1b)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: 'linear_attn_config.full_attn_layers' must be a list of "
                              f"1-based layer numbers, found {layers_1b!r}") from None
        fields = dict(                     # every key read here first: a missing one names `where` once
            dim=get("hidden_size"),
            latent=get("routed_expert_hidden_size"),
            expert_hidden=get("moe_intermediate_size"),
            num_shared_experts=get("num_shared_experts"),
            dense_hidden=get("intermediate_size"),
            experts=get("num_experts"),
            top_k=get("num_experts_per_token"),
            layers=get("num_hidden_layers"),
            heads=get("num_attention_heads"),
            head_dim=head_dim,
            q_rank=get("q_lora_rank"),
            kv_rank=get("kv_lora_rank"),
            qk_extra=get("qk_rope_head_dim"),
            vocab=get("vocab_size"),
            conv_size=get("short_conv_kernel_size", lin, "linear_attn_config."),
            residual_block=get("attn_res_block_size"),
            eps=get_float("rms_norm_eps"),
            situ_beta=get_float("activation_situ_beta"),
            situ_linear_beta=get_float("activation_situ_linear_beta"),
            gate_lower_bound=get_float("gate_lower_bound", lin, "linear_attn_config."),
            full_attention=full,
        )
        try:
            return cls(**fields)
        except ConfigError as e:           # __post_init__'s checks do not know the file
            raise ConfigError(f"{where}: {e}") from None


# Settings K3's code asserts (spec 1.1); anything else is refused by `K3Config.from_hf`.
REQUIRED_SETTINGS: dict[str, Any] = {
    "mla_use_nope": True,
    "mla_use_output_gate": True,
    "latent_moe_use_norm": True,
    "moe_renormalize": True,
    "moe_router_activation_func": "sigmoid",
    "hidden_act": "situ",
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "num_expert_group": 1,
    "routed_scaling_factor": 1.0,
}

_MISSING = object()


def _same(found, expected) -> bool:
    if found is _MISSING or type(found) is bool or type(expected) is bool:
        return found is expected
    return found == expected


def _show(v) -> str:
    return "<missing>" if v is _MISSING else repr(v)


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


PRESETS: dict[str, K3Config] = {
    "k3": K3Config(),
    # Same architecture, small enough for interpret mode: 8 layers (dense layer 0, MLA at 3 and 7 =
    # the last layer), AttnRes blocks of 3 layers -> snapshots b_0, b_1, b_2 (3 blocks), 16 experts
    # top-4, head_dim 128, every width a multiple of the 128-lane tile.
    "mini": K3Config(
        dim=256, latent=128, expert_hidden=128, num_shared_experts=2, dense_hidden=512,
        experts=16, top_k=4, layers=8, heads=2, head_dim=128, q_rank=128, kv_rank=128,
        qk_extra=64, vocab=2048, residual_block=3, full_attention=(3, 7)),
    # mini's shape with every split width divisible 2, 4 and 8 ways (heads 8, experts 16 top-8,
    # latent, dense, shared and vocab widths multiples of 8): the sharded kernel's interpret-mode tests.
    # 4 layers: dense 0, KDA 1-2, MLA 3; AttnRes blocks of 2 layers -> snapshots b_0, b_1.
    "mini-tp8": K3Config(
        dim=256, latent=256, expert_hidden=256, num_shared_experts=2, dense_hidden=1024,
        experts=16, top_k=8, layers=4, heads=8, head_dim=128, q_rank=128, kv_rank=128,
        qk_extra=64, vocab=2048, residual_block=2, full_attention=(3,)),
    # Full K3 widths, 4 layers (dense 0, KDA 1-2, MLA 3), 32 experts: weights fit one TPU v7 core.
    "k3-slice": K3Config(layers=4, experts=32, full_attention=(3,)),
    # Full K3 matrix widths (d 7168, latent 3584, expert hidden 3072, dense 33792, ranks, head_dim 128)
    # on one 16 GiB chip: 3 layers (dense KDA 0, MoE KDA 1, MoE MLA 2), 16 experts top-8, 32 heads,
    # vocab 32768. 3.0 B parameters, 6.0 GB in bf16: the kernel's packed weights and an XLA step's
    # fit one TPU v5e side by side. The notebooks' and `mk bench`'s default on a TPU.
    "k3-chip": K3Config(layers=3, experts=16, top_k=8, heads=32, vocab=32768, full_attention=(2,)),
    # The seed's depth on one 16 GiB chip (`DEPTH_PRESETS`): the K3 layer pattern (dense KDA layer 0,
    # MLA at every fourth layer from 3 -- KDA:MLA 3:1, the last layer MLA -- AttnRes blocks of 12
    # layers), 16 experts top-8, vocab 32768, widths thinner as layers multiply so that a step at
    # B = 1 reads 4.0-4.4 GB of bf16 weights (k3-chip: 4.5). Latent widths are multiples of 256 (the
    # peer MoE kernel's bf16 token packing; K3's latent is dim / 2). docs/tpu.md has the table.
    "k3-d12": K3Config(layers=12, dim=3584, latent=1792, expert_hidden=1536, dense_hidden=16896, experts=16,
                       top_k=8, heads=24, vocab=32768, full_attention=tuple(range(3, 12, 4))),
    "k3-d24": K3Config(layers=24, dim=2560, latent=1280, expert_hidden=1024, dense_hidden=12288, experts=16,
                       top_k=8, heads=16, q_rank=1024, vocab=32768, full_attention=tuple(range(3, 24, 4))),
    "k3-d48": K3Config(layers=48, dim=1792, latent=1024, expert_hidden=768, dense_hidden=8448, experts=16,
                       top_k=8, heads=12, q_rank=768, vocab=32768, full_attention=tuple(range(3, 48, 4))),
}

# k3-chip's matrix widths at 3 layers, then the seed's depth at thinner widths (`mk bench` on one v5e).
DEPTH_PRESETS = ("k3-chip", "k3-d12", "k3-d24", "k3-d48")


def get_config(name_or_path: "str | K3Config") -> K3Config:
    """A preset by name, or the config of a checkpoint directory / config.json path."""
    if isinstance(name_or_path, K3Config):
        return name_or_path
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    if os.path.exists(name_or_path):
        return K3Config.from_hf(name_or_path)
    raise ConfigError(f"unknown config {name_or_path!r}: expected one of {sorted(PRESETS)} "
                      f"or a checkpoint directory")
