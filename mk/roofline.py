"""Roofline of one K3 decode step on one device of a sharded system.

For (config, batch, context, weight formats, parallel layout, system) this module counts, per
decode step and per device:

- weight bytes by tensor and by destination (KDA, MLA, MoE router / latent / shared / routed
  experts, dense MLP of layer 0, embedding rows, LM head, small per-layer vectors);
- routed experts: the expected number of distinct experts a device must fetch for batch B,
  `E_local * (1 - (1 - k/E)^B)` (rows route independently and uniformly), and — because every MoE
  layer ends in a collective that waits for the slowest expert-parallel group — the expected
  maximum over the `ep` groups (the straggler), computed exactly from the binomial distribution;
- cache and state traffic (KDA recurrent + conv state read and written back, MLA K/V cache read
  and the touched 128-token block written back);
- FLOPs (true matmul FLOPs, attention, vector work);
- collectives per layer from the kernel's communication schedule (spec 3.8 / 3.7): the count of
  latency-bound phases and the bytes each device sends over its bottleneck link.

and from those the HBM, compute and collective lower bounds, arithmetic intensity, the ridge
point and the implied ceiling in tokens/s. Everything is returned as dataclasses whose
`.breakdown` is a list of plain dict rows (for tables and plots).

Two layout styles reproduce the two systems the seed compares:
- 'tpu': the K3 megakernel's per-rank shapes (spec 2.2 / 3.2): replicated small input projections
  (`k_gate`, `m_qa`, `m_ka`), each rank DMAs half of the router, 128-lane padding
  (k_projection 1539 -> 1664 columns, m_ka 576 -> 640, MLA heads 192 -> 256, dense 1056 -> 1152),
  `latent_down` 128 columns per rank, `latent_up` 1024-column lane blocks, experts EP x TP with
  FP8 gate/up (bf16 scale per 256 rows) and MXFP4 down.
- 'gpu': plain tensor / expert parallelism as a conventional serving stack shards it
  (ReplicatedLinear router and low-rank input projections, column/row parallel everything else,
  no lane padding, MLA latent cache replicated per TP rank), experts MXFP4.

`seed_efficiency_ratio()` reproduces the seed article's "about 1.7x output per unit of peak
compute (and of bandwidth)" from its own table figures.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

from mk.config import K3Config
from mk.errors import UserError
from mk import hardware as hwlib


class RooflineError(UserError, ValueError):
    """A layout, format or batch the accounting cannot describe."""


def _ru(x: float, m: int) -> int:
    return int(-(-int(math.ceil(x)) // m) * m)


# ------------------------------------------------------------------------------------------------
# Weight formats
# ------------------------------------------------------------------------------------------------
FORMATS = ("bf16", "fp8", "mxfp4", "int8")


def bytes_per_param(fmt: str, fp8_block: int = 256) -> float:
    """Bytes per weight element including scales.

    bf16: 2. fp8 (e4m3): 1 + one bf16 scale per `fp8_block` contraction rows (spec 2.3 re-blocking).
    mxfp4: 0.5 + one E8M0 byte per 32 elements (OCP MX). int8: 1 + one bf16 scale per 128 rows.
    """
    if fmt == "bf16":
        return 2.0
    if fmt == "fp8":
        return 1.0 + 2.0 / fp8_block
    if fmt == "mxfp4":
        return 0.5 + 1.0 / 32
    if fmt == "int8":
        return 1.0 + 2.0 / 128
    raise RooflineError(f"unknown weight format {fmt!r}: expected one of {FORMATS}")


MATMUL_DTYPE = {"bf16": "bf16", "fp8": "fp8", "mxfp4": "fp8", "int8": "int8"}


@dataclasses.dataclass(frozen=True)
class WeightFormats:
    """dense: every non-expert matrix; expert_gate_up / expert_down: the routed experts' w1|w3 and w2."""
    dense: str = "bf16"
    expert_gate_up: str = "fp8"
    expert_down: str = "mxfp4"
    fp8_block: int = 256

    def __post_init__(self):
        for f in ("dense", "expert_gate_up", "expert_down"):
            if getattr(self, f) not in FORMATS:
                raise RooflineError(f"WeightFormats.{f}: unknown format {getattr(self, f)!r}; expected one of {FORMATS}")

    def bpp(self, which: str) -> float:
        return bytes_per_param(getattr(self, which), self.fp8_block)


TPU_SEED_FORMATS = WeightFormats("bf16", "fp8", "mxfp4")      # spec 2.3 / 3.9
GPU_MXFP4_FORMATS = WeightFormats("bf16", "mxfp4", "mxfp4")   # the checkpoint's native MXFP4 experts


# ------------------------------------------------------------------------------------------------
# Parallel layout
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ParallelLayout:
    """How a step is split; the accounting is for ONE device's share.

    Same five fields as `mk.plan.Layout` (chips, cores_per_chip, tp_attn, ep, tp_expert) plus the
    sharding `style` ('tpu' = the K3 megakernel's per-rank layout, 'gpu' = plain TP/EP).
    tp_attn splits attention heads, dense / shared FFN widths, latent projections and the vocab;
    ep x tp_expert splits the routed experts (ep groups of experts, each expert's FFN width over
    tp_expert devices).
    """
    chips: int = 1
    cores_per_chip: int = 1
    tp_attn: int = 1
    ep: int = 1
    tp_expert: int = 1
    style: str = "tpu"
    name: str = ""

    def __post_init__(self):
        for f in ("chips", "cores_per_chip", "tp_attn", "ep", "tp_expert"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 1:
                raise RooflineError(f"ParallelLayout.{f} must be a positive integer, found {v!r}")
        if self.style not in ("tpu", "gpu"):
            raise RooflineError(f"ParallelLayout.style must be 'tpu' or 'gpu', found {self.style!r}")
        if self.tp_attn > self.devices or self.ep * self.tp_expert > self.devices:
            raise RooflineError(f"layout {self}: tp_attn and ep*tp_expert cannot exceed the "
                                f"{self.devices} devices")

    @property
    def devices(self) -> int:
        return self.chips * self.cores_per_chip

    @property
    def lanes_per_host(self) -> int:
        """Devices sharing one host's fast links (TPU: 4 chips x 2 cores)."""
        return min(8, self.devices)

    def check(self, cfg: K3Config):
        if cfg.heads % self.tp_attn:
            raise RooflineError(f"layout tp_attn={self.tp_attn} does not divide heads={cfg.heads}")
        if cfg.experts % self.ep:
            raise RooflineError(f"layout ep={self.ep} does not divide experts={cfg.experts}")
        if cfg.expert_hidden % self.tp_expert:
            raise RooflineError(f"layout tp_expert={self.tp_expert} does not divide expert_hidden={cfg.expert_hidden}")


SEED_TPU_LAYOUT = ParallelLayout(16, 2, 32, 8, 4, "tpu",
                                 "16 TPU v7 chips x 2 TensorCores: TP32 attention, EP8 x TP4 experts (spec 3.2)")
# The GPU side: the seed does not describe vLLM's layout. We use the common vLLM recipe for a
# 16-GPU NVLink domain: tensor parallel 16 for attention / dense / shared / latent / vocab and
# expert parallel 16 (56 whole experts per GPU, `--enable-expert-parallel`), MXFP4 experts.
GB200_LAYOUT = ParallelLayout(16, 1, 16, 16, 1, "gpu",
                              "16 GB200 GPUs: TP16 attention/dense/shared, EP16 experts (vLLM TP16 + expert parallel)")

SYSTEM_LAYOUTS = {"tpu-v7x16": SEED_TPU_LAYOUT, "gb200x16": GB200_LAYOUT}
SYSTEM_FORMATS = {"tpu-v7x16": TPU_SEED_FORMATS, "gb200x16": GPU_MXFP4_FORMATS}


def fit_layout(layout: ParallelLayout, cfg: K3Config) -> ParallelLayout:
    """`layout` with each split shrunk to the largest divisor of what it splits (gcd): a smaller
    model (e.g. `mini`, 2 heads) on the seed's 32-device system replicates what it cannot split.
    Returns `layout` itself when it already fits `cfg`."""
    fitted = dataclasses.replace(layout, tp_attn=math.gcd(layout.tp_attn, cfg.heads),
                                 ep=math.gcd(layout.ep, cfg.experts),
                                 tp_expert=math.gcd(layout.tp_expert, cfg.expert_hidden))
    if fitted == layout:
        return layout
    return dataclasses.replace(fitted, name=f"{layout.name} (fitted to the model: TP{fitted.tp_attn} "
                                            f"attention, EP{fitted.ep} x TP{fitted.tp_expert} experts)")


def as_layout(obj: Any, style: str | None = None) -> ParallelLayout:
    """A ParallelLayout from any object with chips/cores_per_chip/tp_attn/ep/tp_expert
    (e.g. `mk.plan.Layout`)."""
    if isinstance(obj, ParallelLayout) and style is None:
        return obj
    if obj is None:
        return SEED_TPU_LAYOUT
    try:
        fields = {f: int(getattr(obj, f)) for f in ("chips", "cores_per_chip", "tp_attn", "ep", "tp_expert")}
    except AttributeError as e:
        raise RooflineError(f"layout {obj!r} lacks {e.name!r} (need chips, cores_per_chip, tp_attn, ep, tp_expert)") from None
    return ParallelLayout(**fields, style=style or getattr(obj, "style", "tpu"), name=getattr(obj, "name", ""))


# ------------------------------------------------------------------------------------------------
# Per-device weight tensors
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class TensorShare:
    """One weight matrix as one device holds and streams it, per layer it occurs in."""
    name: str          # e.g. 'kda.k_projection'
    group: str         # 'kda' | 'mla' | 'moe_router' | 'moe_latent' | 'moe_shared' | 'dense_mlp' | 'lm_head' | 'embedding' | 'vectors'
    sublayer: str      # 'attn' | 'mlp' | 'head'
    k: int             # contraction rows (as stored, padded)
    n: int             # output columns (as stored, padded)
    bpp: float         # bytes per element incl. scales
    layers: int        # how many layers carry it
    replicated: bool = False

    @property
    def elements(self) -> int:
        return self.k * self.n

    @property
    def bytes(self) -> float:
        return self.elements * self.bpp

    @property
    def total_bytes(self) -> float:
        return self.bytes * self.layers


def layer_tensors(cfg: K3Config, layout: ParallelLayout, formats: WeightFormats = TPU_SEED_FORMATS) -> dict[str, list[TensorShare]]:
    """Per-device weight matrices, keyed by layer kind: 'kda', 'mla', 'moe', 'dense', 'head'."""
    layout.check(cfg)
    tp = layout.tp_attn
    tpu = layout.style == "tpu"
    d, D, H = cfg.dim, cfg.head_dim, cfg.heads
    hpr = H // tp
    b = formats.bpp("dense")
    nk, nm, ne = cfg.n_kda, cfg.n_mla, cfg.n_moe
    T = TensorShare
    pad = (lambda x: _ru(x, 128)) if tpu else (lambda x: int(x))
    out: dict[str, list[TensorShare]] = {}
    out["kda"] = [
        T("kda.k_gate", "kda", "attn", d, D, b, nk, replicated=True),
        T("kda.k_fb", "kda", "attn", D, hpr * D, b, nk),
        T("kda.k_projection", "kda", "attn", d, pad(4 * hpr * D + hpr), b, nk),   # q|k|v|g|beta
        T("kda.k_o", "kda", "attn", hpr * D, d, b, nk),                          # paired layout: same bytes
        # conv filter [C,3,hpr,D] f32, A_log, dt_bias [hpr,D] f32, o_norm [8,128] f32 (spec 2.2)
        T("kda.aux", "vectors", "attn", 1, cfg.conv_size * 3 * hpr * D + hpr + hpr * D + 8 * 128, 4.0, nk),
    ]
    kv_a = pad(cfg.kv_rank + cfg.qk_extra)
    qk = cfg.k_cache_dim if tpu else cfg.qk_head_dim
    out["mla"] = [
        T("mla.m_qa", "mla", "attn", d, cfg.q_rank, b, nm, replicated=True),
        T("mla.m_ka", "mla", "attn", d, kv_a, b, nm, replicated=True),
        T("mla.m_qb", "mla", "attn", cfg.q_rank, hpr * qk, b, nm),
        T("mla.m_kb", "mla", "attn", cfg.kv_rank, hpr * 2 * D, b, nm),
        T("mla.m_gate", "mla", "attn", d, hpr * D, b, nm),
        T("mla.m_o", "mla", "attn", hpr * D, d, b, nm),
        T("mla.norms", "vectors", "attn", 1, cfg.q_rank + cfg.kv_rank, 2.0, nm),
    ]
    if tpu:
        router_cols = _ru(math.ceil(cfg.experts / 2), 128)        # each rank DMAs one half (spec 3.2)
        ld_cols = _ru(math.ceil(cfg.latent / tp), 128)            # 128 columns per rank
        lanes = layout.lanes_per_host
        lu_cols = min(_ru(math.ceil(d / lanes), 1024), d)         # 1024-wide lane blocks
        lu = T("moe.latent_up", "moe_latent", "mlp", cfg.latent, lu_cols, b, ne)
        router = T("moe.router_half", "moe_router", "mlp", d, router_cols, b, ne, replicated=True)
        ld = T("moe.latent_down", "moe_latent", "mlp", d, ld_cols, b, ne)
    else:
        router = T("moe.router", "moe_router", "mlp", d, cfg.experts, b, ne, replicated=True)
        ld = T("moe.latent_down", "moe_latent", "mlp", d, cfg.latent // tp if cfg.latent % tp == 0 else math.ceil(cfg.latent / tp), b, ne)
        lu = T("moe.latent_up", "moe_latent", "mlp", math.ceil(cfg.latent / tp), d, b, ne)
    S = cfg.shared_hidden // tp
    out["moe"] = [
        router,
        ld,
        T("moe.shared_gu", "moe_shared", "mlp", d, 2 * S, b, ne),
        T("moe.shared_down", "moe_shared", "mlp", S, d, b, ne),
        lu,
        T("moe.vectors", "vectors", "mlp", 1, cfg.experts + _ru(cfg.latent, 128 if tpu else 1), 4.0, ne),
    ]
    F = pad(math.ceil(cfg.dense_hidden / tp))
    out["dense"] = [
        T("dense.gate_up", "dense_mlp", "mlp", d, 2 * F, b, 1),
        T("dense.down", "dense_mlp", "mlp", F, d, b, 1),
    ]
    out["layer"] = [   # attn_norm, ffn_norm bf16; attn_res, mlp_res f32 (folded) per layer
        T("layer.vectors", "vectors", "attn", 1, 2 * d * 2 + 2 * d * 4, 1.0, cfg.layers),
    ]
    out["head"] = [
        T("lm_head", "lm_head", "head", d, math.ceil(cfg.vocab / tp), b, 1),
        T("final.vectors", "vectors", "head", 1, d * 2 + d * 4, 1.0, 1),
    ]
    return out


def expert_slice_bytes(cfg: K3Config, layout: ParallelLayout, formats: WeightFormats = TPU_SEED_FORMATS) -> dict[str, float]:
    """Bytes of ONE routed expert's share on one device: gate|up ([latent, 2 Fe/tp_e]) and down."""
    fe = cfg.expert_hidden // layout.tp_expert
    gu = cfg.latent * 2 * fe * formats.bpp("expert_gate_up")
    dn = fe * cfg.latent * formats.bpp("expert_down")
    return {"gate_up": gu, "down": dn, "total": gu + dn, "elements": 3 * cfg.latent * fe}


# ------------------------------------------------------------------------------------------------
# Distinct experts
# ------------------------------------------------------------------------------------------------
def touch_probability(cfg: K3Config, batch: int) -> float:
    """P(a given expert is chosen by at least one of B rows), rows routing uniformly: 1-(1-k/E)^B."""
    return 1.0 - (1.0 - cfg.top_k / cfg.experts) ** batch


def _binom_cdf(n: int, p: float) -> list[float]:
    pmf = [math.comb(n, i) * p ** i * (1 - p) ** (n - i) for i in range(n + 1)]
    cdf, s = [], 0.0
    for x in pmf:
        s += x
        cdf.append(min(1.0, s))
    return cdf


def expected_max_binomial(n: int, p: float, groups: int) -> float:
    """E[max of `groups` iid Binomial(n, p)] = sum_m (1 - F(m-1)^groups)."""
    if groups <= 1:
        return n * p
    cdf = _binom_cdf(n, p)
    return sum(1.0 - cdf[m - 1] ** groups for m in range(1, n + 1))


@dataclasses.dataclass(frozen=True)
class ExpertCount:
    """Distinct routed experts one device fetches per MoE layer."""
    local_experts: int      # experts a device's EP group owns
    mean: float             # expected distinct local experts
    straggler: float        # expected max over the ep groups (what a synchronized step waits for)
    groups: int

    def value(self, straggler: bool = True) -> float:
        return self.straggler if straggler else self.mean


def distinct_experts(cfg: K3Config, batch: int, layout: ParallelLayout) -> ExpertCount:
    q = touch_probability(cfg, batch)
    local = cfg.experts // layout.ep
    mean = local * q
    if layout.ep > 1:
        # Each group's distinct count ~ Binomial(local, q) (experts touched independently: exact for
        # the marginals, a close approximation of the joint); groups treated as independent.
        mx = expected_max_binomial(local, q, layout.ep)
    else:
        mx = mean
    return ExpertCount(local, mean, mx, layout.ep)


# ------------------------------------------------------------------------------------------------
# States and caches
# ------------------------------------------------------------------------------------------------
def state_traffic(cfg: K3Config, batch: int, context: int, layout: ParallelLayout) -> dict[str, float]:
    """Per-device HBM bytes per step for KDA states and MLA caches (B sequences, `context` tokens
    attended on average). TPU style reads whole 128-token cache blocks (+ half a block on average)
    and its commit pass reads and writes the touched block; GPU style (latent MLA cache, replicated
    per TP rank) reads `context` latent rows and writes one."""
    tp = layout.tp_attn
    hpr = cfg.heads // tp
    D = cfg.head_dim
    state = hpr * D * D * 4                              # fp32 [hpr, Dk, Dv]
    conv = (cfg.conv_size - 1) * 3 * hpr * D * 2         # bf16 [taps, q/k/v, hpr, D]
    out = {
        "kda_state_read": batch * cfg.n_kda * (state + conv),
        "kda_state_write": batch * cfg.n_kda * (state + conv),
    }
    if layout.style == "tpu":
        per_tok = hpr * (cfg.k_cache_dim + D) * 2
        ctx = context + 64                                 # whole 128-token blocks
        out["mla_cache_read"] = batch * cfg.n_mla * ctx * per_tok
        out["mla_cache_write"] = batch * cfg.n_mla * 2 * 128 * per_tok   # commit: read + write the block
    else:
        per_tok = (cfg.kv_rank + cfg.qk_extra) * 2
        out["mla_cache_read"] = batch * cfg.n_mla * context * per_tok
        out["mla_cache_write"] = batch * cfg.n_mla * per_tok
    return out


# ------------------------------------------------------------------------------------------------
# Collectives (spec 3.8, tuned recipe 3.7)
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Collective:
    name: str
    sublayer: str        # 'attn' | 'mlp' | 'dense' | 'head'
    phases: int          # latency-bound exchange-and-wait rounds
    bytes: float         # bytes this device sends over the bottleneck link
    link: str            # 'sibling' | 'ici' | 'nvlink'


def layer_collectives(cfg: K3Config, batch: int, layout: ParallelLayout) -> dict[str, list[Collective]]:
    """Collectives per layer kind: 'attn' (every layer), 'moe', 'dense' (layer 0), 'head' (once)."""
    B, d, Lt = batch, cfg.dim, cfg.latent
    C = Collective
    if layout.style == "gpu":
        P = layout.tp_attn
        # One all-reduce kernel per sublayer output (TP all-reduce; with EP the MoE combine is an
        # all-reduce of the [B, d] partial outputs since hidden states are replicated after TP
        # attention). NVLS / one-shot: ~one payload per device on the wire.
        ar = lambda name, sub: C(name, sub, 1, B * d * 2, "nvlink")
        return {"attn": [ar("attn_allreduce", "attn")], "moe": [ar("moe_allreduce", "mlp")],
                "dense": [ar("dense_allreduce", "mlp")],
                "head": [C("logits_gather", "head", 1, B * math.ceil(cfg.vocab / P) * 4, "nvlink")]}
    # TPU megakernel (32 ranks = 4 hosts x 8 lanes; r^1 = sibling core). Bytes are bf16 on the wire.
    tp = layout.tp_attn
    lanes = layout.lanes_per_host
    hosts = max(1, tp // lanes)
    hpr = cfg.heads // tp
    half = d // 2
    scatter = B == 8                                        # attention/MoE token scatter (B=8)
    rs = B in (6, 8)                                        # routed reduce-scatter, grouped routes
    attn = [C("attn_pair_exchange", "attn", 1, B * hpr * cfg.head_dim * 2, "sibling")]
    if scatter:
        pairs = lanes // 2
        own = B / pairs                                      # rows each pair owns after the reduction
        attn += [C("attn_reduce_host", "attn", 1, (pairs - 1) * own * half * 2, "ici"),
                 C("attn_reduce_cross_host", "attn", 1, (hosts - 1) * own * half * 2, "ici"),
                 C("attn_pair_swap", "attn", 1, own * half * 2, "sibling"),
                 C("attn_row_gather", "attn", 1, (pairs - 1) * own * d * 2, "ici")]
    else:
        peers = tp // 2 - 1                                  # ranks sharing this output half
        attn += [C("attn_reduce", "attn", 1, peers * B * half * 2, "ici"),
                 C("attn_pair_swap", "attn", 1, B * half * 2, "sibling")]
    moe = [C("router_exchange", "mlp", 1, B * _ru(math.ceil(cfg.experts / 2), 128) * 4, "sibling"),
           C("latent_gather", "mlp", 1, (tp - 1) * B * _ru(math.ceil(Lt / tp), 128) * 2, "ici")]
    wide = B * (d + Lt) * 2                                 # shared [B,d] + routed [B,Lt] partials
    if rs:
        shard = B * (1024 + Lt / lanes) * 2
        moe += [C("moe_reduce_scatter_local", "mlp", 1, (lanes - 1) * shard, "ici"),
                C("moe_reduce_host", "mlp", 1, (hosts - 1) * shard, "ici"),
                C("moe_gather_local", "mlp", 1, (lanes - 1) * B * Lt / lanes * 2, "ici")]
    else:
        moe += [C("moe_reduce_local", "mlp", 1, (lanes - 1) * wide, "ici"),
                C("moe_reduce_host", "mlp", 1, (hosts - 1) * wide, "ici")]
    out_rows = B / (lanes // 2) if scatter else B
    moe += [C("moe_output_gather", "mlp", 1, (lanes - 1) * out_rows * 1024 * 2, "ici")]
    if scatter:                                             # sequence-parallel pre-attention gather
        moe += [C("pre_attn_gather", "mlp", 1, (lanes // 2 - 1) * out_rows * d * 2, "ici")]
    dense = [C("dense_reduce_local", "mlp", 1, (lanes - 1) * B * d * 2, "ici"),
             C("dense_reduce_host", "mlp", 1, (hosts - 1) * B * d * 2, "ici")]
    return {"attn": attn, "moe": moe, "dense": dense, "head": []}


# ------------------------------------------------------------------------------------------------
# FLOPs
# ------------------------------------------------------------------------------------------------
def attention_flops(cfg: K3Config, batch: int, context: int, layout: ParallelLayout) -> dict[str, float]:
    hpr = cfg.heads // layout.tp_attn
    D = cfg.head_dim
    kda = batch * cfg.n_kda * hpr * D * D * 10          # decay, S^T k, delta, outer product, S^T q
    mla = batch * cfg.n_mla * 2 * hpr * context * (cfg.qk_head_dim + D)
    mix = batch * sum((cfg.n_attn_blocks(l) + cfg.n_mlp_blocks(l) + 2) * cfg.dim * 8 for l in range(cfg.layers))
    return {"kda_recurrence": kda, "mla_attention": mla, "attnres_mix": mix}


# ------------------------------------------------------------------------------------------------
# The roofline
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Roofline:
    """Lower bounds of one decode step on one device. Times in s; bytes per device per step."""
    batch: int
    context: int
    layout: ParallelLayout
    formats: WeightFormats
    system: str
    experts_per_layer: float
    expert_count: ExpertCount
    bytes: dict[str, float]          # by destination
    flops: dict[str, float]          # by destination
    collectives: dict[str, float]    # phases / bytes per step
    t_hbm: float
    t_compute: float
    t_collective: float
    peak_flops: float
    hbm_bw: float
    breakdown: list[dict]

    @property
    def total_bytes(self) -> float:
        return sum(self.bytes.values())

    @property
    def total_flops(self) -> float:
        return sum(self.flops.values())

    @property
    def intensity(self) -> float:
        """FLOPs per byte of HBM traffic."""
        return self.total_flops / self.total_bytes

    @property
    def ridge(self) -> float:
        """FLOPs per byte at which compute and HBM take equal time (peak bf16 / peak HBM)."""
        return self.peak_flops / self.hbm_bw

    @property
    def t_bound(self) -> float:
        return max(self.t_hbm, self.t_compute, self.t_collective)

    @property
    def bound(self) -> str:
        return max((("hbm", self.t_hbm), ("compute", self.t_compute), ("collective", self.t_collective)),
                   key=lambda kv: kv[1])[0]

    @property
    def ceiling_tok_s(self) -> float:
        """Tokens/s if the step took only its largest lower bound (perfect overlap)."""
        return self.batch / self.t_bound

    @property
    def serial_floor_tok_s(self) -> float:
        """Tokens/s if HBM traffic and collective latency could not overlap at all."""
        return self.batch / (self.t_hbm + self.t_collective)

    def as_dict(self) -> dict:
        return {
            "batch": self.batch, "context": self.context, "system": self.system,
            "layout": dataclasses.asdict(self.layout), "formats": dataclasses.asdict(self.formats),
            "experts_per_layer": self.experts_per_layer,
            "expert_count": dataclasses.asdict(self.expert_count),
            "bytes": dict(self.bytes), "total_bytes": self.total_bytes,
            "flops": dict(self.flops), "total_flops": self.total_flops,
            "collectives": dict(self.collectives),
            "t_hbm_s": self.t_hbm, "t_compute_s": self.t_compute, "t_collective_s": self.t_collective,
            "bound": self.bound, "intensity_flop_per_byte": self.intensity, "ridge_flop_per_byte": self.ridge,
            "ceiling_tok_s": self.ceiling_tok_s, "serial_floor_tok_s": self.serial_floor_tok_s,
            "breakdown": self.breakdown,
        }


def step_accounting(cfg: K3Config, batch: int, context: int, layout: ParallelLayout,
                    formats: WeightFormats, straggler: bool = True) -> dict:
    """Everything the roofline and the plan builder share: tensors, expert count, traffic."""
    if not 1 <= batch:
        raise RooflineError(f"batch must be >= 1, found {batch}")
    if context < 1:
        raise RooflineError(f"context must be >= 1, found {context}")
    tensors = layer_tensors(cfg, layout, formats)
    ec = distinct_experts(cfg, batch, layout)
    return {
        "tensors": tensors,
        "expert": expert_slice_bytes(cfg, layout, formats),
        "expert_count": ec,
        "experts_per_layer": ec.value(straggler),
        "state": state_traffic(cfg, batch, context, layout),
        "collectives": layer_collectives(cfg, batch, layout),
        "attention_flops": attention_flops(cfg, batch, context, layout),
    }


def roofline(cfg: K3Config, batch: int, context: int = 512, layout: Any = None,
             formats: WeightFormats | None = None, system: "str | hwlib.System" = "tpu-v7x16",
             straggler: bool = True) -> Roofline:
    """The roofline of one decode step per device. `system` gives peak rates (datasheet) and the
    collective phase latency / link bandwidth (microbenchmarks)."""
    sys_ = system if isinstance(system, hwlib.System) else hwlib.get_system(system)
    if layout is None:
        layout = SYSTEM_LAYOUTS.get(sys_.name, SEED_TPU_LAYOUT)
    layout = as_layout(layout)
    formats = formats or SYSTEM_FORMATS.get(sys_.name, TPU_SEED_FORMATS)
    acc = step_accounting(cfg, batch, context, layout, formats, straggler)
    by_bytes: dict[str, float] = {}
    by_flops: dict[str, float] = {}
    rows: list[dict] = []
    B = batch
    for kind, ts in acc["tensors"].items():
        for t in ts:
            by_bytes[t.group] = by_bytes.get(t.group, 0.0) + t.total_bytes
            fl = 2 * B * t.elements * t.layers if t.group not in ("vectors",) else 0
            if t.group == "lm_head":
                fl = 2 * B * t.elements
            by_flops[t.group] = by_flops.get(t.group, 0.0) + fl
            rows.append({"category": t.group, "tensor": t.name, "per_layer_bytes": t.bytes, "layers": t.layers,
                         "bytes": t.total_bytes, "flops": fl, "replicated": t.replicated})
    n = acc["experts_per_layer"]
    ex = acc["expert"]
    e_bytes = n * ex["total"] * cfg.n_moe
    routes_local = B * cfg.top_k / layout.ep                 # (token, expert) pairs per device
    e_flops = 2 * routes_local * ex["elements"] * cfg.n_moe
    by_bytes["moe_experts"] = e_bytes
    by_flops["moe_experts"] = e_flops
    rows.append({"category": "moe_experts", "tensor": "experts", "per_layer_bytes": n * ex["total"],
                 "layers": cfg.n_moe, "bytes": e_bytes, "flops": e_flops, "replicated": False,
                 "experts_per_layer": n})
    emb = B * cfg.dim * 2 / layout.tp_attn
    by_bytes["embedding"] = emb
    rows.append({"category": "embedding", "tensor": "embed rows", "per_layer_bytes": emb, "layers": 1,
                 "bytes": emb, "flops": 0, "replicated": False})
    for k, v in acc["state"].items():
        cat = "kda_state" if k.startswith("kda") else "mla_cache"
        by_bytes[cat] = by_bytes.get(cat, 0.0) + v
        rows.append({"category": cat, "tensor": k, "per_layer_bytes": v, "layers": 1, "bytes": v, "flops": 0,
                     "replicated": False})
    for k, v in acc["attention_flops"].items():
        by_flops[k] = v
    # collectives per step
    colls = acc["collectives"]
    per_kind = {"attn": cfg.layers, "moe": cfg.n_moe, "dense": 1, "head": 1}
    phases = sum(c.phases * per_kind[k] for k, cs in colls.items() for c in cs)
    t_coll = 0.0
    cbytes = 0.0
    for k, cs in colls.items():
        for c in cs:
            t = per_kind[k] * (c.phases * sys_.collective_latency + c.bytes / sys_.link_bw.get(c.link, sys_.link_bw["ici"]))
            t_coll += t
            cbytes += per_kind[k] * c.bytes
            rows.append({"category": "collective", "tensor": c.name, "per_layer_bytes": c.bytes,
                         "layers": per_kind[k], "bytes": 0, "flops": 0, "collective_bytes": per_kind[k] * c.bytes,
                         "collective_phases": per_kind[k] * c.phases, "time_s": t})
    total_bytes = sum(by_bytes.values())
    t_hbm = total_bytes / sys_.hbm_bw
    # compute: expert matmuls at the expert dtype rate, the rest at bf16; vector work ignored here
    mm = sum(v for k, v in by_flops.items() if k not in ("moe_experts", "kda_recurrence", "attnres_mix"))
    t_comp = mm / sys_.peak_flops("bf16") + e_flops / sys_.peak_flops(MATMUL_DTYPE[formats.expert_gate_up])
    for r in rows:
        if "time_s" not in r:
            r["time_s"] = r["bytes"] / sys_.hbm_bw
    return Roofline(batch, context, layout, formats, sys_.name, n, acc["expert_count"], by_bytes, by_flops,
                    {"phases": phases, "bytes": cbytes}, t_hbm, t_comp, t_coll,
                    sys_.peak_flops("bf16"), sys_.hbm_bw, rows)


# ------------------------------------------------------------------------------------------------
# The seed's "1.7x per unit of peak compute / bandwidth"
# ------------------------------------------------------------------------------------------------
def seed_efficiency_ratio(tpu_tok_s: float | None = None, gpu_tok_s: float | None = None,
                          tpu_chip: str = "tpu-v7", gpu_chip: str = "gb200") -> dict[str, float]:
    """Reproduce the seed article's rough read: with DSpark (AL 6) TPU v7 gives 709 tok/s vs 452 on
    GB200 (1.57x) while its peak bf16 is 2.31 vs 2.5 PF (0.92x) and HBM bandwidth 7380 vs 8000 GB/s:
    output per unit of peak compute ~1.7x, and per unit of bandwidth ~1.7x."""
    if tpu_tok_s is None:
        tpu_tok_s = hwlib.published_value("tpu-v7x16", "dspark_al6", 1)
    if gpu_tok_s is None:
        gpu_tok_s = hwlib.published_value("gb200x16", "dspark_al6", 1)
    chips = hwlib.load_chips()
    t, g = chips[tpu_chip], chips[gpu_chip]
    thr = tpu_tok_s / gpu_tok_s
    comp = t.bf16_flops / g.bf16_flops
    bw = t.hbm_bw / g.hbm_bw
    return {"tpu_tok_s": tpu_tok_s, "gpu_tok_s": gpu_tok_s, "throughput_ratio": thr,
            "peak_compute_ratio": comp, "bandwidth_ratio": bw,
            "per_peak_compute": thr / comp, "per_bandwidth": thr / bw}
