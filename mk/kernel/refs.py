"""Every buffer the megakernel uses, declared once: shapes, dtypes, memory spaces.

`scratch_shapes(plan)` feeds `pallas_call`; `Refs` names the refs the kernel body receives, so
sublayer code says `r.kda_state` instead of counting positional arguments.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from mk.plan import Plan, round_up, vector_rows

F32, BF16 = jnp.float32, jnp.bfloat16

# name -> (memory space, shape fn, dtype); order = the kernel's scratch argument order.
def _scratch(plan: Plan):
    c, R, B = plan.config, plan.rows, plan.batch
    H, D, HD, d = plan.heads, c.head_dim, plan.attn_width, c.dim     # this device's heads
    N, W = plan.devices, plan.exchange_width
    E_pad = round_up(c.experts, 128)
    VM, SM, DMA = pltpu.VMEM, pltpu.SMEM, pltpu.SemaphoreType.DMA
    return {
        # weight ring
        "slots": VM((plan.num_slots, plan.tile_k, plan.tile_n), BF16),   # [S, TK, TN]
        "slot_sems": DMA((plan.num_slots,)),
        "distinct": SM((max(plan.local_experts, 1),), jnp.int32),        # local ids of chosen experts
        "xbuf": VM((R, plan.k_max), BF16),                               # matmul input  [R, K]
        "ybuf": VM((R, plan.n_max), F32),                                # matmul output [R, N]
        # residual state
        "blocks": VM((c.n_blocks, R, d), F32),                           # snapshots b_0..b_{n-1}
        "embed_rows": VM((B, 16, d), BF16),                              # embedding row groups
        "embed_sems": DMA((B,)),
        "vectors": VM((2, len(vector_rows(c)), plan.vector_width), F32), # layer tables, 2 parities
        "vector_sems": DMA((2,)),
        # KDA
        "kda_state": VM((B, H, D, D), F32),                              # [row, head, key, value]
        "conv_state": VM((B, 3, c.conv_size - 1, HD), BF16),
        "state_sems": DMA((2, B)),                                       # [state | conv, row]
        "kda_feat": VM((5, R, HD), F32),                                 # conv'd q, k, v; decay; gate
        "beta_raw": VM((R, round_up(H, 128)), BF16),
        "attn_out": VM((R, HD), BF16),                                   # gated heads -> o_proj
        # MLA
        "mla_q": VM((R, H * c.k_cache_dim), BF16),
        "mla_kv": VM((R, H * 2 * D), BF16),                              # per head [k_nope | v]
        "mla_kr": VM((R, c.k_cache_dim - D), BF16),                      # shared raw key part, padded
        "mla_gate": VM((R, HD), BF16),
        "k_block": VM((H, 128, c.k_cache_dim), BF16),                    # one 128-position block
        "v_block": VM((H, 128, D), BF16),
        "cache_sems": DMA((2,)),
        "softmax": VM((3, H, 1, 128), F32),                              # running max, denom (lane-bcast)
        "softmax_acc": VM((H, 1, D), F32),
        # MoE
        "route_coef": VM((R, E_pad), F32),                               # routing weight, 0 = not chosen
        "routed_acc": VM((R, plan.latent_padded), F32),                  # [R, N * latent_block]
    } | ({
        # collectives (mk.kernel.collectives): double-buffered by parity, one landing slot per rank
        "landing": VM((2, N, R, W), BF16),                               # [parity, source, row, lane]
        "send": VM((2, R, W), BF16),                                     # [parity, row, lane]
        "send_sems": DMA((2, N)),                                        # [parity, destination]
        "recv_sems": DMA((2, N)),                                        # [parity, source]
    } if N > 1 else {})


def scratch_shapes(plan: Plan) -> list:
    return list(_scratch(plan).values())


def scratch_names(plan: Plan) -> list[str]:
    return list(_scratch(plan).keys())


SCALARS = ("tokens", "positions", "rank")   # [B], [B], [1]: this device's rank in the mesh
TABLES = ("expert_at", "next_base", "is_mla", "family_index", "n_attn_blocks", "n_mlp_blocks")
INPUTS = ("embed", "tiles", "experts", "vectors_hbm", "kda_state_in", "conv_state_in", "mla_k_in", "mla_v_in")
OUTPUTS = ("logits", "p", "kda_state_hbm", "conv_state_hbm", "mla_k_hbm", "mla_v_hbm")


class Refs:
    """Attribute access to every ref of the kernel, by the names above."""

    def __init__(self, plan: Plan, args):
        names = [*SCALARS, *TABLES, *INPUTS, *OUTPUTS, *scratch_names(plan)]
        assert len(names) == len(args), (len(names), len(args))
        self.__dict__.update(zip(names, args))
        self.tables = {n: getattr(self, n) for n in TABLES}
