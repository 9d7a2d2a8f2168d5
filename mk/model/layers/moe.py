"""K3's latent mixture of experts (spec 1.4.5), layers 1..L-1.

Routing: sigmoid scores; the correction bias only chooses WHICH experts (top-k of score + bias,
ties to the lowest id); weights are the un-biased scores renormalised over the chosen ones.
Routed experts run in a latent space of width Lt: down-project, experts, weighted sum (in
ascending expert id, the kernel's order), latent RMSNorm after the sum, up-project.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from mk.model.config import K3Config
from mk.model.layers.common import F32, K_CHUNK, bf, f32, mm, rms, rows_padded, sigmoid, situ


def route(m, router, bias, top_k: int):
    """m [B, d] bf16, router [d, E] bf16, bias [E] f32 ->
    (ids [B, k] int32 ascending, weights [B, k] f32 summing to 1).

    The normaliser sums the chosen scores in selection order (best first), the order an
    iterative-argmax kernel finds them in.
    """
    s = sigmoid(mm(m, router))                                   # [B, E] f32
    _, ids = jax.lax.top_k(s + bias[None], top_k)                # best first; ties -> lowest id
    chosen = jnp.take_along_axis(s, ids, axis=-1)
    denom = chosen[:, 0:1]
    for j in range(1, top_k):
        denom = denom + chosen[:, j:j + 1]
    order = jnp.argsort(ids, axis=-1)
    ids = jnp.take_along_axis(ids, order, axis=-1).astype(jnp.int32)
    return ids, jnp.take_along_axis(chosen, order, axis=-1) / denom


def route_margin(m, router, bias, top_k: int) -> jax.Array:
    """m [B, d] bf16 -> [B] f32: the gap between the top_k-th and the (top_k + 1)-th of score + bias,
    how far each row's expert choice is from a tie (inf when every expert is chosen)."""
    if top_k >= router.shape[-1]:
        return jnp.full((m.shape[0],), jnp.inf, F32)
    v, _ = jax.lax.top_k(sigmoid(mm(m, router)) + bias[None], top_k + 1)
    return v[:, top_k - 1] - v[:, top_k]


def expert(l, w1, w3, w2, cfg: K3Config, k_chunk: int = K_CHUNK):
    """One routed expert on latent rows: l [R, Lt] bf16, w1/w3 [Lt, Fe], w2 [Fe, Lt] -> [R, Lt] bf16.
    k_chunk: the depth of the K slices its matmuls sum in order (`mm`)."""
    h = situ(bf(mm(l, w1, k_chunk)), bf(mm(l, w3, k_chunk)), cfg.situ_beta, cfg.situ_linear_beta)
    return bf(mm(h, w2, k_chunk))


def moe(m, w: dict, cfg: K3Config, expert_k_chunk: int = K_CHUNK):
    """One MoE layer. m [B, d] bf16; w holds this layer's slice of params['moe'] -> z [B, d] bf16.
    expert_k_chunk: the routed experts' matmul slice depth (`mk.kernel.step.expert_k_chunk`)."""
    ids, weights = route(m, w["router"], w["router_bias"], cfg.top_k)
    latent = bf(mm(m, w["latent_down"]))                         # [B, Lt]

    def row(l, row_ids, row_w):                                  # one row, its k experts in id order
        # The sum starts from an fp32 zero XLA cannot see through, as the kernel's accumulator
        # (a VMEM load) is. XLA CPU contracts every `acc + w * e` into an FMA (LLVM fp-contract
        # fast); with a literal zero it first folds `0 + w0*e0` away and then contracts the FIRST
        # product of `w0*e0 + w1*e1` (rounding the second), while the kernel computes
        # fma(w1, e1, round(w0*e0)). That one rounding flipped a bf16 tie in r_sum on mini.
        acc = jax.lax.optimization_barrier(jnp.zeros((l.shape[-1],), F32))
        for j in range(cfg.top_k):
            e = row_ids[j]
            out = expert(l[None], w["w1"][e], w["w3"][e], w["w2"][e], cfg, expert_k_chunk)[0]
            acc = acc + row_w[j] * f32(out)
        return acc

    r_sum = bf(jax.vmap(row)(latent, ids, weights))
    r_n = rows_padded(rms, r_sum, w["latent_norm"], cfg.eps)
    z_routed = mm(r_n, w["latent_up"])
    h = situ(bf(mm(m, w["shared_gate"])), bf(mm(m, w["shared_up"])), cfg.situ_beta, cfg.situ_linear_beta)
    z_shared = mm(h, w["shared_down"])
    return bf(z_routed + z_shared)
