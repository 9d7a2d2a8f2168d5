"""A conventional serving stack's decode step, one kernel launch per op, in the plan's vocabulary.

`per_op(plan, distinct_experts)` -> (dmas, phases) for a plan with `options.program == 'per_op'`
(`mk.kernel.plan.CONVENTIONAL`): every phase is one kernel (`Phase.kernel`), a GEMM kernel streams its own
weights while it computes (`pipelined`), and no kernel's weights move before it starts. The
simulator replays it like any plan; only the launches differ from a megakernel's.

The decomposition follows vLLM's Kimi-Linear model code (`vllm/model_executor/models/kimi_linear.py`,
`layers/kda.py` at commit 01a7e5d, read through the public index): per KDA layer separate q, k, v
and b projections, f_a -> f_b and the fused KDA gate, three `causal_conv1d_update`s,
`fused_recurrent_kda`, the gated o-norm and the row-parallel o_proj with its all-reduce; the MoE as
`KimiMoE.forward` runs it (shared experts, the replicated router, `FusedMoE`: top-k, align, w13,
activation, w2, sum; one all-reduce); MLA as vLLM's DeepSeek-V2 MLA decode path (fused q_a|kv_a,
the two a-norms, q_b, the W_UK / W_UV absorptions around the latent-cache attention, o_proj).
K3's own pieces have no vLLM source and are ASSUMPTIONS, one kernel each: the AttnRes mixing before
each sublayer (with its RMSNorm), the full-rank KDA output gate projection, MLA's output gate
(projection + sigmoid multiply), the latent MoE's down-projection, norm and up-projection.
"""
from __future__ import annotations

from mk.kernel.plan import Matrix, Phase, PlanError, WeightDMA

DECOMPOSITION_SOURCE = ("vLLM Kimi-Linear model code (kimi_linear.py, layers/kda.py @ 01a7e5d) and DeepSeek-V2 MLA "
                        "decode; K3-only ops (AttnRes mixing, full-rank KDA gate, MLA output gate, latent MoE): "
                        "assumption, one kernel each")
_MXU = {"bf16": "bf16", "fp8": "fp8", "mxfp4": "fp4"}


def _part(m: Matrix, names: tuple[str, ...], k: int | None = None) -> Matrix:
    """The GEMM over parts `names` of the fused matrix `m`, at their real widths (no lane padding)."""
    width = 0
    for n in names:
        p = m.part(n)
        width += p.head_pad[0] * p.head_pad[1] if p.head_pad else p.width
    k = k or m.k
    return Matrix(f"{m.name}[{'|'.join(names)}]", k, width, (), k, width, m.format)


def per_op(plan, distinct_experts: list[float]):
    c, B, lay = plan.config, plan.batch, plan.layout
    H, D, d = plan.heads, c.head_dim, c.dim
    if lay.style != "gpu":
        raise PlanError("a per-op schedule describes a GPU serving stack: use a layout with style='gpu'")
    dmas: list[WeightDMA] = []
    phases: list[Phase] = []
    act = B * d * 2                                       # one [B, d] bf16 activation

    def kernel(l, name, kind, rows=B, **kw) -> int:
        phases.append(Phase(len(phases), l, name, kind, rows=max(1, round(rows)), pipelined=True,
                            kernel=f"{l}:{name}", **kw))
        return len(phases) - 1

    def gemm(l, name, mats: list[tuple[Matrix, float]], rows=B):
        """One GEMM kernel streaming `mats` (matrix, fraction) through its own slot; `rows` LHS rows
        per matrix."""
        j = len(phases)
        ids = []
        for i, (m, frac) in enumerate(mats):
            ids.append(len(dmas))
            dmas.append(WeightDMA(len(dmas), l, f"{name}#{i}" if len(mats) > 1 else name, 0,
                                  int(round(m.tile_bytes * frac)), 1_000_000 + len(dmas), j))
        flops = sum(2 * rows * m.k * m.n * f for m, f in mats)
        kernel(l, name, "mxu", rows, flops=int(flops), dtype=_MXU[mats[0][0].format], dmas=tuple(ids))

    def vec(l, name, flops=0, nbytes=0, state=0):
        """An elementwise kernel: reads its activations (and a state of `state` bytes) from HBM,
        writes the state back."""
        kernel(l, name, "vector", flops=int(flops), vector_bytes=int(nbytes), hbm_bytes=int(act + state),
               writeback_bytes=int(state))

    def allreduce(l, name, nbytes=act):
        kernel(l, name, "collective", collective_bytes=int(nbytes), link="nvlink")

    def mix(l, name, n_blocks):
        vec(l, name, B * (n_blocks + 1) * d * 8 + B * d * 4, (n_blocks + 2) * act * 2)

    vec(0, "embed")
    allreduce(0, "embed_allreduce")
    conv = B * (c.conv_size - 1) * H * D * 2                       # one of q / k / v's conv state
    state = B * H * D * D * 4
    for s in plan.streams:
        l = s.layer
        if s.kind == "head":
            mix(l, "final_mix", c.n_blocks)
            gemm(l, "lm_head", [(s.matrix("lm_head"), 1.0)])
            allreduce(l, "logits_gather", B * s.matrix("lm_head").n * 4)
            vec(l, "sample", B * c.vocab * 4, B * c.vocab * 4)
            continue
        mix(l, "attn_mix", c.n_attn_blocks(l))
        if c.is_mla(l):
            mi, kvb = s.matrix("mla.in"), s.matrix("mla.kv_b")
            gemm(l, "mla.fused_qkv_a", [(_part(mi, ("q_a", "kv_a")), 1.0)])
            vec(l, "mla.q_a_norm", B * c.q_rank * 4)
            vec(l, "mla.kv_a_norm", B * c.kv_rank * 4)
            gemm(l, "mla.q_b", [(_part(s.matrix("mla.q_b"), ("q_b",)), 1.0)])
            gemm(l, "mla.w_uk", [(_part(kvb, ("kv_b",)), 0.5)])
            latent = B * (c.kv_rank + c.qk_extra) * 2
            kernel(l, "mla.cache_write", "vector", writeback_bytes=latent)
            kernel(l, "mla.attention", "vector", flops=2 * B * H * plan.ctx * (c.kv_rank + c.qk_extra) * 2,
                   hbm_bytes=plan.ctx * latent)
            gemm(l, "mla.w_uv", [(_part(kvb, ("kv_b",)), 0.5)])
            gemm(l, "mla.g_proj", [(_part(mi, ("g",)), 1.0)])
            vec(l, "mla.gate_mul", B * H * D * 4)
            gemm(l, "mla.o_proj", [(s.matrix("mla.o"), 1.0)])
        else:
            ki = s.matrix("kda.in")
            for p in "qkv":
                gemm(l, f"kda.{p}_proj", [(_part(ki, (p,)), 1.0)])
            gemm(l, "kda.b_proj", [(_part(ki, ("b",)), 1.0)])
            gemm(l, "kda.f_a_proj", [(s.matrix("kda.f_a"), 1.0)])
            gemm(l, "kda.f_b_proj", [(s.matrix("kda.f_b"), 1.0)])
            vec(l, "kda.fused_gate", B * H * D * 8)
            gemm(l, "kda.g_proj", [(_part(ki, ("g",)), 1.0)])
            vec(l, "kda.zeros")
            for p in "qkv":
                vec(l, f"kda.conv1d_{p}", B * H * D * c.conv_size * 2, state=conv)
            vec(l, "kda.fused_recurrent", B * H * D * D * 10, state=state)
            vec(l, "kda.copy_out")
            vec(l, "kda.o_norm", B * H * D * 8)
            gemm(l, "kda.o_proj", [(s.matrix("kda.o"), 1.0)])
        allreduce(l, "attn_allreduce")
        mix(l, "mlp_mix", c.n_mlp_blocks(l))
        if not s.has_experts:
            gu, dn = s.matrix("dense.gate_up"), s.matrix("dense.down")
            gemm(l, "dense.gate_up", [(_part(gu, ("gate", "up")), 1.0)])
            vec(l, "dense.act", B * dn.k * 8)
            gemm(l, "dense.down", [(_part(dn, ("down",)), 1.0)])
            allreduce(l, "dense_allreduce")
            continue
        mi = s.matrix("moe.in")
        gemm(l, "moe.shared_gate_up", [(_part(mi, ("shared_gate", "shared_up")), 1.0)])
        vec(l, "moe.shared_act", B * s.matrix("moe.shared_down").k * 8)
        gemm(l, "moe.shared_down", [(s.matrix("moe.shared_down"), 1.0)])
        gemm(l, "moe.router", [(_part(s.matrix("moe.router"), ("router",)), 1.0)])
        vec(l, "moe.topk", B * c.experts * (c.top_k + 4))
        gemm(l, "moe.latent_down", [(_part(mi, ("latent_down",)), 1.0)])
        vec(l, "moe.align", B * c.top_k * 4)
        n = float(distinct_experts[l - 1])
        whole, frac = int(n), n - int(n)
        experts = lambda m: [(m, 1.0)] * whole + ([(m, frac)] if frac > 1e-9 else [])
        if n > 0:
            rows = plan.expert_rows(n)
            gemm(l, "moe.w13", experts(plan.expert_gu), rows)
            vec(l, "moe.act", B * c.top_k * plan.expert_down.k * 8)
            gemm(l, "moe.w2", experts(plan.expert_down), rows)
        vec(l, "moe.sum", B * c.top_k * c.latent * 2)
        vec(l, "moe.latent_norm", B * c.latent * 4)
        gemm(l, "moe.latent_up", [(s.matrix("moe.latent_up"), 1.0)])
        vec(l, "moe.add_shared", B * d)
        allreduce(l, "moe_allreduce")
    return dmas, phases
