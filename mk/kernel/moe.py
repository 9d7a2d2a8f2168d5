"""K3's latent MoE in the kernel (spec 1.4.5).

Order of the layer's weight stream (see mk.kernel.plan): router, then latent_down|shared_gate|shared_up,
shared_down, then the routed experts, then latent_up. Routing runs right after the router
matmul and publishes the layer's distinct experts (ascending id, union over the batch rows) to
the ring, which can then fetch expert tiles while the shared expert still computes. (Putting
latent_down first, so that the latent all-gather also flies during routing, is modelled slower:
the expert tiles then start later, `mk.perf.sim`.) Each distinct expert is fetched once and applied
to all rows; rows that did not choose it weigh it by exactly 0, so each row accumulates its own
experts in ascending id order, as the reference does.

On a mesh (mk.model.sharding): the router is replicated, so every device makes the same routing
decisions; a device runs only the chosen experts of its expert group (E / ep of them), over its
slice of each expert's FFN width. Three collectives:

    latent_down (this device's latent slice) --moe_latent all-gather--> l [R, N * latent_block]
        (in flight while the shared expert computes: `start_all_gather`, the plan's `overlap`)
    experts on l -> routed partial [R, N * latent_block] --moe_routed all-reduce--> r_sum
    latent norm of r_sum (statistics over the whole width), this device's slice @ latent_up rows
        + shared-expert partial (its slice of the shared width) --moe_out all-reduce--> z

The routed and shared partials are summed anyway, so one all-reduce carries both. Rank r's latent
slice sits at lane `plan.latent_offsets[r]` of its block (its latent_down columns, latent_up rows
and latent_norm lanes are packed there, `mk.kernel.packing.pack_weights`), so MXFP4 scale groups of the expert
weights never straddle two blocks; the kernel itself only moves whole blocks.
"""
from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp

from jax.experimental import pallas as pl

from mk.kernel.collectives import all_reduce, start_all_gather
from mk.model.layers.common import bf, f32, rsqrt, sigmoid, situ


def route(k, scores_raw, bias):
    """scores_raw [R, E_pad] f32 router logits, bias [1, E_pad] -> (coef [R, E_pad] f32 with the
    renormalised weights of each row's top-k and 0 elsewhere, chosen-by-any-row mask [1, E_pad])."""
    cfg, B = k.cfg, k.plan.batch
    R, E_pad = scores_raw.shape
    lane = jax.lax.broadcasted_iota(jnp.int32, (R, E_pad), 1)
    row = jax.lax.broadcasted_iota(jnp.int32, (R, E_pad), 0)
    s = sigmoid(scores_raw)
    pick = jnp.where(lane < cfg.experts, s + bias, -jnp.inf)
    chosen = jnp.zeros((R, E_pad), jnp.bool_)
    denom = jnp.zeros((R, 1), jnp.float32)
    for _ in range(cfg.top_k):                       # iterative argmax, ties -> lowest id
        best = jnp.max(pick, axis=-1, keepdims=True)
        first = jnp.min(jnp.where(pick == best, lane, E_pad), axis=-1, keepdims=True)
        hit = lane == first
        chosen = jnp.logical_or(chosen, hit)
        denom = denom + jnp.sum(jnp.where(hit, s, 0.0), axis=-1, keepdims=True)   # selection order
        pick = jnp.where(hit, -jnp.inf, pick)
    coef = jnp.where(jnp.logical_and(chosen, row < B), s / denom, 0.0)
    any_row = jnp.max(jnp.where(jnp.logical_and(chosen, row < B), 1, 0), axis=0, keepdims=True)
    return coef, any_row


def expert_group_base(k):
    """Global id of this device's first expert (its expert group times E / ep)."""
    return (k.refs.rank[0] // k.plan.layout.tp_expert) * k.plan.local_experts


def publish_distinct(k, layer, any_row):
    """Write the ascending local ids of this device's experts chosen by any row to SMEM and
    unblock the ring."""
    r, E = k.refs, k.cfg.experts
    lane = jax.lax.broadcasted_iota(jnp.int32, any_row.shape, 1)
    base = expert_group_base(k)
    mine = (lane >= base) & (lane < base + k.plan.local_experts)

    def next_id(j, carry):
        remaining, count = carry
        e = jnp.min(jnp.where((remaining > 0) & mine, lane, E))
        found = e < E
        r.distinct[j] = jnp.where(found, e - base, 0)
        return jnp.where(lane == e, 0, remaining), count + found.astype(jnp.int32)

    _, count = jax.lax.fori_loop(0, k.plan.max_distinct_experts, next_id, (any_row, jnp.int32(0)))
    k.ring.publish_routing(layer, count)
    return count


# -1.0 only inside `negated_combine()`: a deliberately wrong kernel (routed experts combined with
# negated weights) that `mk check --fault moe_combine_sign` uses to show the check catches a bug.
COMBINE_SIGN = 1.0


@contextlib.contextmanager
def negated_combine():
    """Kernels traced inside combine the routed experts with negated weights (a planted bug)."""
    global COMBINE_SIGN
    COMBINE_SIGN = -1.0
    try:
        yield
    finally:
        COMBINE_SIGN = 1.0


def moe(k, m, layer):
    """m [R, d] bf16 (normalized input) -> z [R, d] bf16."""
    cfg, r, ring, plan = k.cfg, k.refs, k.ring, k.plan
    s = plan.stream(1)
    router, fused_in, shared_down, latent_up = (
        s.matrix(n) for n in ("moe.router", "moe.in", "moe.shared_down", "moe.latent_up"))
    E_pad, lb = router.n, plan.latent_block
    with jax.named_scope("moe_routing"):
        coef, any_row = route(k, ring.matmul(m, router), k.vec("router_bias", E_pad))
        r.route_coef[...] = coef
        n_distinct = publish_distinct(k, layer, any_row)
    with jax.named_scope("moe_shared"):
        y = ring.matmul(m, fused_in)
        sg, su = (bf(fused_in.part(n).cols(y)) for n in ("shared_gate", "shared_up"))
        down = fused_in.part("latent_down")                                 # this rank's latent slice
        # the latent all-gather flies while the shared expert computes (the plan's `overlap`)
        latent_in = start_all_gather(k, "moe_latent", bf(y[:, down.offset:down.offset + lb]))
        h = situ(sg, su, cfg.situ_beta, cfg.situ_linear_beta)
        z_shared = ring.matmul(h, shared_down)[:, :cfg.dim]                   # partial on a mesh
        latent = latent_in()                                                # [R, N * lb]
    with jax.named_scope("moe_experts"):
        gu_m, down_m = plan.expert_gu, plan.expert_down
        lane = jax.lax.broadcasted_iota(jnp.int32, (plan.rows, E_pad), 1)
        base = expert_group_base(k)
        r.routed_acc[...] = jnp.zeros(r.routed_acc.shape, jnp.float32)

        def expert(j):
            e = r.distinct[j] + base
            gu = ring.matmul(latent, gu_m)
            g, u = (bf(gu_m.part(n).cols(gu)) for n in ("w1", "w3"))
            out = bf(ring.matmul(situ(g, u, cfg.situ_beta, cfg.situ_linear_beta), down_m)[:, :plan.latent_padded])
            weight = jnp.sum(jnp.where(lane == e, r.route_coef[...], 0.0), axis=-1, keepdims=True)
            if COMBINE_SIGN != 1.0:                                         # the planted bug only
                weight = COMBINE_SIGN * weight
            r.routed_acc[...] = r.routed_acc[...] + weight * f32(out)
        ring.fori(0, n_distinct, expert)
    with jax.named_scope("moe_latent_up"):
        r_sum = f32(all_reduce(k, "moe_routed", r.routed_acc[...]))      # [R, N * lb]
        r.routed_acc[...] = r_sum
        mine = r.routed_acc[:, pl.ds(pl.multiple_of(r.rank[0] * lb, 128), lb)]
        inv = rsqrt(jnp.sum(r_sum * r_sum, axis=-1, keepdims=True) / cfg.latent + cfg.eps)
        r_n = bf(mine * inv * k.vec("latent_norm", lb))
        z_routed = ring.matmul(r_n, latent_up)[:, :cfg.dim]                  # partial on a mesh
    return all_reduce(k, "moe_out", z_routed + z_shared)
