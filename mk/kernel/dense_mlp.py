"""Layer 0's dense MLP in the kernel: fused gate|up tiles, then down tiles, through the ring."""
from __future__ import annotations

from mk.layers.common import bf, situ


def dense_mlp(k, m):
    """m [R, d] bf16 -> z [R, d] bf16 (spec 1.4.7)."""
    cfg, s = k.cfg, k.plan.stream(0)
    gate_up, down = s.pre[-2], s.pre[-1]
    gu = k.ring.matmul(m, gate_up)
    g, u = (gu[:, p.offset:p.offset + p.width] for p in gate_up.parts)
    h = situ(bf(g), bf(u), cfg.situ_beta, cfg.situ_linear_beta)
    return bf(k.ring.matmul(h, down)[:, :cfg.dim])
