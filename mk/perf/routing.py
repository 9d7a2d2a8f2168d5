"""How many distinct routed experts one device fetches per MoE layer, rows routing uniformly.

`distinct_experts(cfg, batch, layout)`: the expected count on one device, `E_local * (1 - (1 -
k/E)^B)`, and the expected maximum over the `ep` groups (the straggler every MoE layer's closing
collective waits for), exact from the binomial distribution. Read by the roofline (`mk.perf.roofline`)
and the simulator's what-ifs (`mk.perf.sim`); it imports neither.
"""
from __future__ import annotations

import dataclasses
import math

from mk.model.config import K3Config
from mk.model.layout import Layout


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


def distinct_experts(cfg: K3Config, batch: int, layout: Layout) -> ExpertCount:
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
