"""Layer 0's dense MLP (spec 1.4.7): `bf(situ(bf(m Wg), bf(m Wu)) Wd)`."""
from __future__ import annotations

import jax

from mk.model.config import K3Config
from mk.model.layers.common import bf, mm, situ


def dense_mlp(m: jax.Array, w: dict, cfg: K3Config, reduce=lambda partial: partial) -> jax.Array:
    """m [B, d] bf16; w: gate, up [d, F], down [F, d] -> [B, d] bf16. `reduce`: as in
    `mk.model.layers.kda.kda` (the down projection's partials over devices on a mesh, F split)."""
    h = situ(bf(mm(m, w["gate"])), bf(mm(m, w["up"])), cfg.situ_beta, cfg.situ_linear_beta)
    return bf(reduce(mm(h, w["down"])))
