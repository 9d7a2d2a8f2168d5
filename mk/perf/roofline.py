"""Roofline of one K3 decode step on one device of a sharded system, read off the plan itself.

`roofline(cfg, batch, ...)` takes the plan behind a system's published figure (`mk.perf.sim.seed_plan`:
the seed's K3 kernel on the TPU, one kernel per op on the GPU; or any `mk.kernel.plan.Plan`) and sums its
own entries (`mk.kernel.schedule.schedule(plan)`, the list the simulator replays), per decode step and per device:

- weight bytes by destination (KDA, MLA, MoE router / latent / shared / routed experts, dense MLP
  of layer 0, LM head), with the routed experts counted as the expected number of distinct experts
  a device fetches, `E_local * (1 - (1 - k/E)^B)` rows routing independently and uniformly, or
  (`straggler`, the default) the expected maximum over the `ep` groups, which every MoE layer's
  closing collective waits for (`distinct_experts`, exact from the binomial distribution);
- cache and state traffic (the phases' own HBM reads and write-backs);
- FLOPs (matmuls as the MXU runs them, vector work);
- collectives: count, bytes each device sends, and their time at the system's link latency and
  bandwidth (`mk.perf.sim.Machine`).

From those: the HBM, compute and collective lower bounds, arithmetic intensity, the ridge point
and the implied ceiling in tokens/s. `.breakdown` is a list of plain dict rows (tables, plots).
`seed_efficiency_ratio()` reproduces the seed article's "about 1.7x output per unit of peak
compute (and of bandwidth)" from its own table figures.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

from mk.model.config import K3Config
from mk.errors import UserError
from mk.perf import hardware as hwlib
from mk.model.layout import Layout
from mk.perf.routing import ExpertCount, distinct_experts
from mk.kernel.schedule import schedule


class RooflineError(UserError, ValueError):
    """A layout, format or batch the accounting cannot describe."""


# ------------------------------------------------------------------------------------------------
# Bytes per weight of a storage format (a cross-check of mk.kernel.plan.Matrix.tile_bytes)
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


def expert_slice_bytes(cfg: K3Config, layout: Layout, formats: WeightFormats = WeightFormats()) -> dict[str, float]:
    """Bytes of ONE routed expert's share on one device: gate|up ([latent, 2 Fe/tp_e]) and down."""
    fe = cfg.expert_hidden // layout.tp_expert
    gu = cfg.latent * 2 * fe * formats.bpp("expert_gate_up")
    dn = fe * cfg.latent * formats.bpp("expert_down")
    return {"gate_up": gu, "down": dn, "total": gu + dn, "elements": 3 * cfg.latent * fe}


def as_layout(obj: Any) -> Layout:
    """A `mk.model.layout.Layout` from any object with chips/cores_per_chip/tp_attn/ep/tp_expert."""
    if isinstance(obj, Layout):
        return obj
    try:
        fields = {f: int(getattr(obj, f)) for f in ("chips", "cores_per_chip", "tp_attn", "ep", "tp_expert")}
    except AttributeError as e:
        raise RooflineError(f"layout {obj!r} lacks {e.name!r} (need chips, cores_per_chip, tp_attn, ep, tp_expert)") from None
    return Layout(**fields, style=getattr(obj, "style", "tpu"), name=getattr(obj, "name", ""))


# ------------------------------------------------------------------------------------------------
# The roofline, from a plan's entries
# ------------------------------------------------------------------------------------------------
def category(name: str) -> str:
    """Where a DMA (its tensor) or a phase (its name) belongs in the byte / FLOP accounting."""
    if name.startswith("expert["):
        return "moe_experts"
    if name.startswith(("kda.state", "kda_recurrence", "kda.conv1d", "kda.fused_recurrent")):
        return "kda_state"
    if name.startswith(("mla_attention", "mla_commit", "mla_cache", "mla.attention", "mla.cache")):
        return "mla_cache"
    if name.startswith("moe.router"):
        return "moe_router"
    if name.startswith(("moe.in", "moe.latent")):
        return "moe_latent"
    if name.startswith("moe.shared"):
        return "moe_shared"
    if name.startswith(("moe.w13", "moe.w2")):
        return "moe_experts"
    for prefix, cat in (("kda", "kda"), ("mla", "mla"), ("dense", "dense_mlp"), ("lm_head", "lm_head")):
        if name.startswith(prefix):
            return cat
    return "vector"


@dataclasses.dataclass
class Roofline:
    """Lower bounds of one decode step on one device. Times in s; bytes per device per step."""
    batch: int
    context: int
    layout: Layout
    system: str
    schedule: str
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
        """Tokens/s if HBM traffic and collectives could not overlap at all."""
        return self.batch / (self.t_hbm + self.t_collective)

    def as_dict(self) -> dict:
        return {
            "batch": self.batch, "context": self.context, "system": self.system, "schedule": self.schedule,
            "layout": dataclasses.asdict(self.layout), "experts_per_layer": self.experts_per_layer,
            "expert_count": dataclasses.asdict(self.expert_count),
            "bytes": dict(self.bytes), "total_bytes": self.total_bytes,
            "flops": dict(self.flops), "total_flops": self.total_flops,
            "collectives": dict(self.collectives),
            "t_hbm_s": self.t_hbm, "t_compute_s": self.t_compute, "t_collective_s": self.t_collective,
            "bound": self.bound, "intensity_flop_per_byte": self.intensity, "ridge_flop_per_byte": self.ridge,
            "ceiling_tok_s": self.ceiling_tok_s, "serial_floor_tok_s": self.serial_floor_tok_s,
            "breakdown": self.breakdown,
        }


def roofline(cfg: K3Config, batch: int, context: int = 512, layout: Layout | None = None,
             system: "str | hwlib.System" = "tpu-v7x16", straggler: bool = True, plan=None) -> Roofline:
    """The roofline of one decode step per device, summed from `plan`'s entries (default: the plan
    behind `system`'s published figure, `mk.perf.sim.seed_plan`, with `layout` instead of the system's if
    given). Peak rates: datasheet; collective latency / bandwidth: `mk.perf.sim.Machine`."""
    from mk.perf import sim

    sys_ = system if isinstance(system, hwlib.System) else hwlib.get_system(system)
    if not 1 <= batch:
        raise RooflineError(f"batch must be >= 1, found {batch}")
    if plan is None:
        setup = dataclasses.replace(sys_.setup, layout=layout) if layout is not None else None
        if layout is not None:
            layout.check(cfg)
        plan = sim.seed_plan(cfg, batch, sys_, context, setup=setup)
    ec = distinct_experts(cfg, batch, plan.layout)
    n = ec.value(straggler)
    dmas, phases = schedule(plan, [n] * cfg.n_moe)
    mach = sim.Machine.from_system(sys_)
    by_bytes: dict[str, float] = {}
    by_flops: dict[str, float] = {}
    rows: dict[tuple, dict] = {}

    def add(cat, name, nbytes=0.0, flops=0.0):
        by_bytes[cat] = by_bytes.get(cat, 0.0) + nbytes
        by_flops[cat] = by_flops.get(cat, 0.0) + flops
        r = rows.setdefault((cat, name), {"category": cat, "tensor": name, "bytes": 0.0, "flops": 0.0, "count": 0})
        r["bytes"] += nbytes
        r["flops"] += flops
        r["count"] += 1

    for d in dmas:
        name = d.tensor.split("#")[0]
        add(category(name), "expert" if name.startswith("expert[") else name, d.bytes)
    t_comp = t_coll = coll_bytes = 0.0
    n_coll = 0
    for ph in phases:
        if ph.kind == "collective":
            t = mach.compute_time(ph)
            t_coll += t
            coll_bytes += ph.collective_bytes
            n_coll += 1
            r = rows.setdefault(("collective", ph.name), {"category": "collective", "tensor": ph.name, "bytes": 0.0,
                                                          "flops": 0.0, "count": 0, "collective_bytes": 0.0,
                                                          "time_s": 0.0})
            r["collective_bytes"] += ph.collective_bytes
            r["time_s"] += t
            r["count"] += 1
            continue
        cat = category(ph.name)
        if ph.hbm_bytes or ph.writeback_bytes:
            add(cat, ph.name, ph.hbm_bytes + ph.writeback_bytes)
        if ph.flops:
            add(cat if ph.kind == "mxu" else f"{cat} (vector)" if cat != "vector" else "vector", ph.name, 0.0, ph.flops)
        if ph.kind == "mxu":
            t_comp += ph.flops / sys_.peak_flops(ph.dtype)
    by_bytes = {k: v for k, v in by_bytes.items() if v}
    by_flops = {k: v for k, v in by_flops.items() if v}
    total = sum(by_bytes.values())
    out = list(rows.values())
    for r in out:
        r.setdefault("time_s", r["bytes"] / sys_.hbm_bw)
    return Roofline(batch, int(plan.ctx), plan.layout, sys_.name, plan.options.name, n, ec, by_bytes, by_flops,
                    {"phases": n_coll, "bytes": coll_bytes}, total / sys_.hbm_bw, t_comp, t_coll,
                    sys_.peak_flops("bf16"), sys_.hbm_bw, out)


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
