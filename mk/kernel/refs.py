"""The megakernel's refs by name: `pallas_call`'s scratch and outputs come from `Plan.buffers`.

`scratch_shapes(plan)` maps the plan's buffer table to Pallas TPU types; `Refs` names the refs the
kernel body receives, so sublayer code says `r.kda_state` instead of counting positional arguments.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from mk.kernel.plan import Buffer, Plan

# Launch inputs in SMEM, per step: tokens [B] and row_pos [B] (each row's token and position; B =
# plan.batch rows), state_row [S] (per sequence: which of its rows' states in HBM the step starts
# from, the accepted row of the previous verify step), rank [1] (this device's rank in the mesh).
SCALARS = ("tokens", "row_pos", "state_row", "rank")
# Plan tables in SMEM (`Plan.tables`): per layer, and per row (row_seq: each row's sequence).
TABLES = ("expert_at", "next_base", "is_mla", "family_index", "n_attn_blocks", "n_mlp_blocks", "row_seq",
          "aux_slot")
# HBM inputs; the routed experts' entries depend on their format (`expert_inputs`).
INPUTS = ("embed", "tiles", "experts", "vectors_hbm", "kda_state_in", "conv_state_in", "mla_k_in", "mla_v_in")
EXPERT_INPUTS = {"bf16": ("experts",), "mxfp4": ("expert_codes", "expert_scales")}
# HBM input -> the output it is updated into in place (pallas_call's input_output_aliases).
ALIASES = {"kda_state_in": "kda_state_hbm", "conv_state_in": "conv_state_hbm",
           "mla_k_in": "mla_k_hbm", "mla_v_in": "mla_v_hbm"}


def expert_inputs(plan: Plan) -> tuple[str, ...]:
    return EXPERT_INPUTS[plan.experts]


def inputs(plan: Plan) -> tuple[str, ...]:
    """The pallas_call's HBM inputs by name, in order (the experts as their format stores them)."""
    i = INPUTS.index("experts")
    return INPUTS[:i] + expert_inputs(plan) + INPUTS[i + 1:]


def _pallas_type(b: Buffer):
    if b.space == "dma_sem":
        return pltpu.SemaphoreType.DMA(b.shape)
    space = {"vmem": pltpu.VMEM, "smem": pltpu.SMEM}[b.space]
    return space(b.shape, jnp.dtype(b.dtype))


def new_outputs(plan: Plan) -> list[Buffer]:
    """The pallas_call's own outputs: logits and final prefix p (VMEM), the aux rows (HBM, when the
    plan has aux layers); the aliased HBM state outputs follow them."""
    return [b for b in plan.buffers if b.output]


def outputs(plan: Plan) -> list[str]:
    return [b.name for b in new_outputs(plan)] + list(ALIASES.values())


def scratch_shapes(plan: Plan) -> list:
    return [_pallas_type(b) for b in plan.buffers if not b.output]


def scratch_names(plan: Plan) -> list[str]:
    return [b.name for b in plan.buffers if not b.output]


class Refs:
    """Attribute access to every ref of the kernel, by the names above."""

    def __init__(self, plan: Plan, args):
        names = [*SCALARS, *TABLES, *inputs(plan), *outputs(plan), *scratch_names(plan)]
        assert len(names) == len(args), (len(names), len(args))
        self.__dict__.update(zip(names, args))
        self.tables = {n: getattr(self, n) for n in TABLES}
