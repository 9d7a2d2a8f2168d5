"""Layer 0's dense MLP in the kernel: fused gate|up tiles, then down tiles, through the ring."""
from __future__ import annotations

from mk.kernel.collectives import all_reduce
from mk.model.layers.common import bf, situ


def dense_mlp(k, m):
    """m [R, d] bf16 -> z [R, d] bf16 (spec 1.4.7). Each device holds F / N of the width; the
    down projection's partials meet in the `dense_out` all-reduce."""
    cfg, s = k.cfg, k.plan.stream(0)
    gate_up, down = s.matrix("dense.gate_up"), s.matrix("dense.down")
    gu = k.ring.matmul(m, gate_up)
    g, u = (gate_up.part(n).cols(gu) for n in ("gate", "up"))
    h = situ(bf(g), bf(u), cfg.situ_beta, cfg.situ_linear_beta)
    return all_reduce(k, "dense_out", k.ring.matmul(h, down)[:, :cfg.dim])
