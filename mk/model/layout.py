"""How one step is split over devices, as data: `Layout` (a plan, the roofline and the sharding rule
describe ONE device's share of it), `PlanError` (a plan, a layout or a mesh that cannot run) and
where each rank's latent slice sits in its block (`latent_offsets`).

The rule that picks a layout for a mesh is `mk.model.sharding`; the kernel's plan (`mk.kernel.plan`)
and the performance model (`mk.perf`) read layouts, and none of them is imported here.
"""
from __future__ import annotations

import dataclasses

from mk.model.config import MX_GROUP, K3Config
from mk.errors import UserError


class PlanError(UserError, ValueError):
    """A plan that cannot run: bad parameter, or its VMEM budget exceeds the limit."""


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


@dataclasses.dataclass(frozen=True)
class Layout:
    """How one step is split over devices; a plan (and the roofline) describes ONE device's share.

    tp_attn: attention heads, dense/shared FFN width, latent projections and vocab split this many
    ways; ep x tp_expert: routed experts split over `ep` groups, each expert's FFN width over
    `tp_expert`. The kernel's rule (`mk.model.sharding.default_layout`) has tp_attn = ep x tp_expert =
    devices; the seed's TPU v7 system is 16 chips x 2 cores, tp_attn 32, ep 8, tp_expert 4.
    style: the per-rank shapes of a TPU megakernel ('tpu': 128-lane padding, spec 3.2) or of a GPU
    serving stack ('gpu': plain TP/EP, used by the modelled conventional schedule, `mk.kernel.conventional`).
    `name` describes the layout (and its source); it takes no part in comparisons.
    """
    chips: int = 1
    cores_per_chip: int = 1
    tp_attn: int = 1
    ep: int = 1
    tp_expert: int = 1
    style: str = "tpu"
    name: str = dataclasses.field(default="", compare=False)

    def __post_init__(self):
        for f in ("chips", "cores_per_chip", "tp_attn", "ep", "tp_expert"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise PlanError(f"layout.{f} must be a positive integer, found {v!r}")
        if self.style not in ("tpu", "gpu"):
            raise PlanError(f"layout.style must be 'tpu' or 'gpu', found {self.style!r}")
        if self.tp_attn > self.devices or self.ep * self.tp_expert > self.devices:
            raise PlanError(f"layout tp_attn={self.tp_attn}, ep={self.ep} x tp_expert={self.tp_expert}: "
                            f"a split cannot exceed the {self.devices} devices")

    @property
    def devices(self) -> int:
        return self.chips * self.cores_per_chip

    @property
    def single(self) -> bool:
        return self.devices == 1

    @property
    def lanes_per_host(self) -> int:
        """Devices sharing one host's fast links (TPU v7: 4 chips x 2 cores; spec 3.2)."""
        return min(8, self.devices)

    def check(self, cfg: K3Config):
        """Raise PlanError naming the config width a split does not divide."""
        for f, width, what in (("tp_attn", cfg.heads, "heads"), ("ep", cfg.experts, "experts"),
                               ("tp_expert", cfg.expert_hidden, "expert_hidden")):
            if width % getattr(self, f):
                raise PlanError(f"layout {f}={getattr(self, f)} does not divide {what}={width}")

    def fit(self, cfg: K3Config) -> "Layout":
        """This layout with each split shrunk to the largest divisor of what it splits (gcd): a
        smaller model (e.g. `mini`, 2 heads) on the seed's 32-device system replicates what it
        cannot split. Returns the layout itself when it already fits `cfg`."""
        import math
        fitted = dataclasses.replace(self, tp_attn=math.gcd(self.tp_attn, cfg.heads), ep=math.gcd(self.ep, cfg.experts),
                                     tp_expert=math.gcd(self.tp_expert, cfg.expert_hidden))
        if fitted == self:
            return self
        return dataclasses.replace(fitted, name=f"{self.name} (fitted to the model: TP{fitted.tp_attn} attention, "
                                                f"EP{fitted.ep} x TP{fitted.tp_expert} experts)")


SEED_TPU7X16 = Layout(chips=16, cores_per_chip=2, tp_attn=32, ep=8, tp_expert=4,
                      name="16 TPU v7 chips x 2 TensorCores: TP32 attention, EP8 x TP4 experts (spec 3.2)")


def latent_offsets(latent: int, devices: int) -> tuple[int, ...]:
    """Lane at which rank r's latent slice (features r * per .. (r + 1) * per, per = latent /
    devices) starts inside its `round_up(per, 128)`-lane block of the gathered latent vector:
    (r * per) mod MX_GROUP. Then every 32-lane group of the padded layout holds features of exactly
    one 32-feature group of the unpadded latent (plus zero lanes), so an MXFP4 expert weight whose
    contraction axis is the latent keeps its E8M0 scales as they are: each padded group takes its
    one source group's scale (K3 on 32 devices: per = 112, offsets 0 and 16). All 0 when per is a
    multiple of 32, and when a shifted slice would overrun its block (MXFP4 experts are then
    refused, `_check_mxfp4`)."""
    per = latent // devices
    offs = tuple((r * per) % MX_GROUP for r in range(devices))
    return offs if max(offs) + per <= round_up(per, 128) else (0,) * devices
