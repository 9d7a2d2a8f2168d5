"""The megakernel's step as a list of weight DMAs and phases: one walk, every schedule.

`megakernel(plan, distinct_experts)` walks the plan's matrices in consumption order (`Plan.streams`,
then each MoE layer's routed experts) and emits `WeightDMA`s (in issue order) and `Phase`s (in
execution order). `plan.options` (`mk.kernel.plan.ScheduleOptions`) decides how:

    where a DMA lands      'tile': the ring slot of its format's pool (mk); 'matrix': a named buffer
                           (the seed's attention pool slots, scoped copies, expert slots)
    when it may start      'ring': depth-gated by the simulator, experts after routing (mk);
                           'lookahead': the phase it waits for (spec 3.4's anchors, `issue_after`)
    which collectives      'merged': `Plan.collectives` (mk); 'seed': `seed_collectives` (spec 3.8)

so mk's kernel plan (`MK`) and the seed's K3 kernel (`SEED`) are two points of one space, and the
simulator (`mk.perf.sim`) replays both the same way. Per layer (KDA or MLA, then the dense MLP or MoE):

    attn_mix | attention matmuls (+ the recurrence / attention before the output projection) | attention collectives
    mlp_mix  | router, routing | latent down (+ gather) and shared matmuls | routed experts | reductions
             | latent up | output collective

A fractional `distinct_experts` value (an expectation, e.g. the slowest expert-parallel group's)
makes the last expert's DMAs and work that fraction of a whole one.
"""
from __future__ import annotations

import functools
import math
from typing import Sequence

from mk.kernel import conventional
from mk.kernel.plan import CACHE_WRITE_ROWS, STREAM_FORMATS, Collective, Matrix, Phase, PlanError, WeightDMA, round_up

# Vector ops per weight of an MXFP4 matrix's conversion, by how it meets the MXU
# (`ScheduleOptions.mxfp4_matmul`) and how its codes are unpacked (`Plan.mxfp4_unpack`), counted in
# mk/kernel/ring.py (`unpack_values`, `mxfp4_tile_product`, `fp8_tile_product`):
#   ('bf16', *): unpacked in vector registers and fed to the MXU, no store (`mxfp4_tile_product`);
#       'bitcast': the E2M1 -> bf16 conversion of the bitcast words, the broadcast scale and the
#           multiply: 3 (TPU v7);
#       'shift': the plane shift and its concatenation, `e2m1_bits` (and, shift, compare, add,
#           compare, two selects, sign and / shift / or: 10), the broadcast exponent and the
#           f32 -> bf16 conversion: 14 (v5e, v6e, on request);
#       'pairs': per two weights in one 32-bit lane, `pair_bits` (11, or 9 for plane 3: the plane
#           shift folded in), a quarter of the word's `nonzero_bits` (4) and the broadcast exponent
#           pair: 12.5, so 6.25 per weight (v5e, v6e; the v5e LLO of a 512 x 512 tile: 1539 vector
#           ALU ops of 1024 lanes, 6.0 per weight);
#       'pairs_mul': the same words, `pair_bits_mul` (9, 9, 10, 9: integer multiplies lay the mask and
#           the sign), the quarter of `nonzero_bits` and the exponent pair: 11.25 per pair, so 5.625
#           per weight (`docs/tpu-v5e/llo_unpack.py`: 1668 -> 1477 vector ALU ops per tile, 0.89x);
#   ('fp8', *): the e4m3 tile stored to VMEM, then a block-diagonal LHS (`fp8_tile_product`);
#       'bitcast': the seed (spec 3.5): one fp4 -> fp8 conversion per weight, the E8M0 group scales
#           applied to [B, T/32, N] partial products (per group, not per weight): 1;
#       'shift': the shift, concatenation and `e2m1_bits` (12), the e4m3 conversion and store: 14;
#       'pairs', 'pairs_mul': as above, a bf16 -> e4m3 conversion and the store: 9.25, 8.625.
DEQUANT_OPS = {("bf16", "bitcast"): 3, ("bf16", "shift"): 14, ("bf16", "pairs"): 6.25, ("bf16", "pairs_mul"): 5.625,
               ("fp8", "bitcast"): 1, ("fp8", "shift"): 14, ("fp8", "pairs"): 9.25, ("fp8", "pairs_mul"): 8.625}


def dequant_ops(mxfp4_matmul: str, unpack: str) -> float:
    """Vector ops per weight of an MXFP4 tile's conversion (`DEQUANT_OPS`)."""
    return DEQUANT_OPS[mxfp4_matmul, unpack]


# How much worse a smaller tile's unpack packs into VLIW bundles than the 512 x 512 tile's (whose
# rate `mk microbench` measures): the v5e's deviceless LLO of one tile times an 8-row LHS, bundles
# per weight over the 512 x 512 tile's (`docs/tpu-v5e/llo_unpack.py --tile KxN`,
# docs/tpu-v5e/2026-12-06g/llo-tiles-v5e.json). The ALU ops per weight barely change (5.77 -> 5.95
# per 1024 for 'pairs_mul'); the bundles do: a smaller tile fills fewer of the four ALU slots.
# Chips without a count: 1.
DEQUANT_TILE_PACKING = {
    ("v5e", "pairs_mul"): {(512, 512): 1.0, (512, 256): 1.084, (256, 512): 1.176, (256, 256): 1.263},
    ("v5e", "pairs"): {(512, 512): 1.0, (512, 256): 1.077, (256, 512): 1.177, (256, 256): 1.243},
}


def dequant_packing(chip: str, unpack: str, tile_k: int, tile_n: int) -> float:
    """`DEQUANT_TILE_PACKING` for this chip, unpack and tile; 1 where not counted."""
    return DEQUANT_TILE_PACKING.get((chip, unpack), {}).get((tile_k, tile_n), 1.0)


# Vector ops per element of a KDA head's [D, D] fp32 state in mk's delta rule (`mk.kernel.kda`,
# `mk.model.layers.kda.kda_head`), counted in the kernel's own lowering: the v5e's deviceless LLO of
# the heads loop as the kernel runs it (4 heads a trip) holds 1456 vector ALU ops of 1024 lanes per
# 4 heads of 128 x 128 (docs/tpu-v5e/llo_kda.py, docs/tpu-v5e/2026-12-06h/llo-kda-v5e.json):
# 364 x 1024 / 128^2 = 22.75. The spec's arithmetic is about 10 (decay, two products with the state,
# the rank-1 update); the rest is the lane broadcasts and reductions the layout costs. The seed's
# recurrence keeps the spec's 10.
KDA_STATE_OPS = {"mk": 22.75, "seed": 10}


def _mix_flops(cfg, rows: int, n_blocks: int) -> int:
    """AttnRes mixing of `n_blocks` snapshots + the prefix, then the RMSNorm (fp32 ops)."""
    return rows * (n_blocks + 1) * cfg.dim * 8 + rows * cfg.dim * 4


def seed_collectives(plan) -> dict[str, Collective]:
    """The seed kernel's collectives (spec 3.8, with the tuned recipe of 3.7 if `plan.options.recipe`
    is 'tuned'), per rank: r XOR 1 is the sibling core; a host has `lanes_per_host` ranks (4 chips x
    2 cores); messages are bf16 packed lane-dense (B rows), router scores fp32."""
    c, lay, B = plan.config, plan.layout, plan.batch
    tuned = plan.options.recipe == "tuned"
    N, tp, lanes = lay.devices, lay.tp_attn, lay.lanes_per_host
    hosts, pairs = max(1, tp // lanes), max(1, lanes // 2)
    d, half, Lt = c.dim, c.dim // 2, c.latent
    scatter = tuned and B == 8 and B % pairs == 0        # token scatter: each lane pair owns B / 4 rows
    rs = tuned and B in (6, 8)                           # routed reduce-scatter (grouped routes)
    own = B // pairs if scatter else B

    def C(name, width, rows, peers, link="ici", kind="exchange", itemsize=2):
        return Collective(name, kind, int(width), int(rows), N, int(peers), link, itemsize)

    out = [C("attn_pair_exchange", plan.attn_width, B, 1, "sibling"),
           C("router_exchange", round_up(-(-c.experts // 2), 128), B, 1, "sibling", itemsize=4),
           C("latent_gather", round_up(-(-Lt // tp), 128), B, tp - 1, kind="all_gather"),
           C("moe_output_gather", min(round_up(-(-d // lanes), 1024), d), own, lanes - 1, kind="all_gather"),
           C("dense_reduce_local", d, B, lanes - 1), C("dense_reduce_host", d, B, hosts - 1)]
    if scatter:
        out += [C("attn_reduce_host", half, own, pairs - 1), C("attn_reduce_cross_host", half, own, hosts - 1),
                C("attn_pair_swap", half, own, 1, "sibling"), C("attn_row_gather", d, own, pairs - 1),
                C("pre_attn_gather", d, own, pairs - 1)]
    else:
        out += [C("attn_reduce", half, B, tp // 2 - 1), C("attn_pair_swap", half, B, 1, "sibling")]
    if rs:
        shard = 1024 + Lt // lanes
        out += [C("moe_reduce_scatter_local", shard, B, lanes - 1), C("moe_reduce_host", shard, B, hosts - 1),
                C("moe_gather_local", Lt // lanes, B, lanes - 1)]
    else:
        out += [C("moe_reduce_local", d + Lt, B, lanes - 1), C("moe_reduce_host", d + Lt, B, hosts - 1)]
    return {x.name: x for x in out}


def attention_collectives(plan) -> list[str]:
    """Names of the collectives after a layer's attention output projection, in order."""
    o, N = plan.options, plan.devices
    if o.collectives == "merged":
        return ["attn_out"] if N > 1 else []
    if "attn_reduce" in seed_collectives(plan):
        return ["attn_reduce", "attn_pair_swap"]
    return ["attn_reduce_host", "attn_reduce_cross_host", "attn_pair_swap", "attn_row_gather"]


class _Builder:
    """Collects DMAs (issue order) and phases (execution order); a phase consumes the DMAs queued
    under its key."""

    def __init__(self, plan):
        self.plan = plan
        self.dmas: list[dict] = []
        self.phases: list[Phase] = []
        self.pending: dict[tuple, list[int]] = {}
        self.issued = {f: 0 for f in STREAM_FORMATS}
        self.named: dict[str, int] = {}

    def slot(self, name: str) -> int:
        """A named buffer's slot id (after every ring pool's ids)."""
        return self.named.setdefault(name, len(STREAM_FORMATS) * self.plan.num_slots + len(self.named))

    def load(self, layer: int, m: Matrix, tensor: str, after: int = -1, slot: str | list[str] | None = None,
             scale: float = 1.0):
        """Queue the DMAs of matrix `m` for the matmul `tensor` of `layer`: each tile into its ring
        slot, or into the named buffer `slot` (a list: one name per tile)."""
        ids = self.pending.setdefault((layer, tensor), [])
        for t in range(m.tiles):
            if slot is None:
                sl = self.plan.slot_id(m.format, self.issued[m.format])
                self.issued[m.format] += 1
            else:
                sl = self.slot(slot[t] if isinstance(slot, list) else slot)
            ids.append(len(self.dmas))
            self.dmas.append(dict(index=len(self.dmas), layer=layer, tensor=tensor, tile=t,
                                  bytes=int(round(m.tile_bytes * scale)), slot=sl, phase=None, issue_after=after))

    def phase(self, layer: int, name: str, kind: str, consumes: tuple | None = None, **kw) -> int:
        j = len(self.phases)
        ids = tuple(self.pending.pop(consumes, ())) if consumes else ()
        for i in ids:
            self.dmas[i]["phase"] = j
        self.phases.append(Phase(j, layer, name, kind, dmas=ids, **kw))
        return j

    def build(self):
        left = [d["tensor"] for d in self.dmas if d["phase"] is None]
        if left:
            raise PlanError(f"schedule: DMAs without a consuming phase: {left[:5]}")
        return [WeightDMA(**d) for d in self.dmas], self.phases


def megakernel(plan, distinct_experts: list[float]):
    """(dmas, phases) of one step of a megakernel `plan` (see the module docstring)."""
    c, B, o = plan.config, plan.batch, plan.options
    N, H, D = plan.devices, plan.heads, c.head_dim
    look = o.prefetch == "lookahead"
    seed = o.collectives == "seed"
    colls = seed_collectives(plan) if seed else plan.collectives
    persistent_state = o.recipe == "tuned" and B <= 4            # spec 3.6
    state_bytes = B * H * (D * D * 4 + (c.conv_size - 1) * 3 * D * 2)   # KDA state f32 + conv state bf16
    b = _Builder(plan)

    def collective(l, name, overlap=0):
        if N == 1:                                              # one device: nothing to exchange
            return None
        x = colls[name]
        if x.rounds == 2:                                       # reduce-scatter, then all-gather
            b.phase(l, f"{name}.scatter", "collective", collective_bytes=x.remote_bytes // 2, link=x.link)
            return b.phase(l, f"{name}.gather", "collective", collective_bytes=x.remote_bytes // 2, link=x.link,
                           overlap=overlap)
        return b.phase(l, name, "collective", collective_bytes=x.remote_bytes, link=x.link, overlap=overlap)

    def matmul(l, m: Matrix, tensor=None, scale=1.0, after=-1, rows=B, **kw):
        tensor = tensor or m.name
        if (l, tensor) not in b.pending:
            b.load(l, m, tensor, after, scale=scale)
        dtype, ops = "bf16", 0
        if m.format == "fp8":
            dtype = "fp8"
        elif m.format == "mxfp4":
            dtype, ops = o.mxfp4_matmul, (dequant_ops(o.mxfp4_matmul, plan.mxfp4_unpack)
                                          * dequant_packing(plan.chip, plan.mxfp4_unpack, plan.tile_k, plan.tile_n))
        return b.phase(l, tensor, "mxu", consumes=(l, tensor), rows=max(1, round(rows)), dtype=dtype,
                       flops=int(2 * rows * m.k_pad * m.n_pad * scale), vector_ops=int(ops * m.k * m.n * scale), **kw)

    def vector(l, name, flops=0, nbytes=0, **kw):
        return b.phase(l, name, "vector", rows=B, flops=int(flops), vector_bytes=int(nbytes), **kw)

    def attention_matrices(s):
        return [m for m in s.pre if m.name.split(".")[0] in ("kda", "mla")]

    def lookahead(l, after):
        """The seed's lookahead callback (spec 3.4): layer l's attention projections into the pool,
        the persistent KDA state, the router half."""
        s = plan.streams[l]
        pool = [m for m in attention_matrices(s) if m.name not in ("mla.q_b", "mla.kv_b", "mla.gate", "mla.o")]
        for i, m in enumerate(pool):
            b.load(l, m, m.name, after, slot=f"pool{i}")
        if persistent_state and not c.is_mla(l):
            b.load(l, _state(state_bytes), "kda.state", after, slot="kda.state")
        if s.has_experts:
            b.load(l, s.matrix("moe.router"), "moe.router", after, slot="moe.router")

    if N > 1 and not seed:
        collective(0, "embed")
    if look:
        lookahead(0, -1)
    for s in plan.streams:
        l = s.layer
        if s.kind == "head":
            fm = vector(l, "final_mix", _mix_flops(c, B, c.n_blocks), (c.n_blocks + 2) * B * c.dim * 4)
            m = s.matrix("lm_head")
            if look:            # the seed's LM head runs in XLA after the kernel, streaming its shard
                b.load(l, m, m.name, fm, slot=m.name)
            matmul(l, m, pipelined=look)
            continue
        mla = c.is_mla(l)
        am = vector(l, "attn_mix", _mix_flops(c, B, c.n_attn_blocks(l)), (c.n_attn_blocks(l) + 2) * B * c.dim * 4)
        if look:
            for m in attention_matrices(s):
                if m.name in ("mla.q_b", "mla.kv_b", "mla.gate", "mla.o"):   # scoped copies at sublayer start
                    b.load(l, m, m.name, am, slot=m.name)
            if not mla and not persistent_state:
                b.load(l, _state(state_bytes), "kda.state", am, slot="kda.state")
        for m in attention_matrices(s):
            if m.name in ("kda.o", "mla.o"):
                if mla and seed:
                    cache = B * H * plan.ctx * (c.k_cache_dim + D) * 2
                    block = B * H * 128 * (c.k_cache_dim + D) * 2
                    vector(l, "mla_attention", 2 * B * H * plan.ctx * (c.qk_head_dim + D) + 5 * B * H * plan.ctx,
                           2 * cache, hbm_bytes=cache)
                    # spec 3.6: read the touched 128-token block, merge the new rows, write it back
                    vector(l, "mla_commit", 0, 2 * block, hbm_bytes=block, writeback_bytes=block)
                elif mla:   # mk's kernel (`mk.kernel.mla`): row after row, the row's cache blocks DMA'd in
                    # (row 0's first before the projections; each next in flight while one is attended;
                    # a row's first while the row before attends, where that row is of another
                    # sequence), then the 16-position tile holding the new key / value written back:
                    # waited before the next row starts, the last row's left in flight
                    cache = H * plan.ctx * (c.k_cache_dim + D) * 2
                    block = H * CACHE_WRITE_ROWS * (c.k_cache_dim + D) * 2
                    for row in range(B):
                        lead = len(b.phases) - am - 1 if row == 0 else 2 if row % plan.seq_rows == 0 else 0
                        last = row == B - 1
                        vector(l, "mla_attention", 2 * H * plan.ctx * (c.qk_head_dim + D) + 5 * H * plan.ctx,
                               2 * cache, hbm_bytes=cache, hbm_lead=lead, writeback_bytes=block if last else 0)
                        if not last:
                            vector(l, "mla_cache_write", 0, 0, hbm_bytes=block)
                else:       # mk's kernel starts the state read at KDA entry, before the projections
                    kw = (dict(hbm_bytes=state_bytes, hbm_lead=len(b.phases) - am - 1) if not look
                          else dict(consumes=(l, "kda.state")))
                    vector(l, "kda_recurrence", B * H * D * D * KDA_STATE_OPS["seed" if seed else "mk"]
                           + B * 3 * H * D * (c.conv_size * 2 + 8),
                           6 * state_bytes, writeback_bytes=state_bytes, **kw)
                if seed:
                    collective(l, "attn_pair_exchange")
            matmul(l, m)
        for name in attention_collectives(plan):
            collective(l, name)
        last_attn = len(b.phases) - 1
        vector(l, "mlp_mix", _mix_flops(c, B, c.n_mlp_blocks(l)), (c.n_mlp_blocks(l) + 2) * B * c.dim * 4)
        mlp = [m for m in s.pre if m.name.split(".")[0] in ("dense", "moe")]
        if not s.has_experts:                                   # layer 0: the dense MLP
            if look:                                            # row-block slabs, 4 in flight (spec 3.4)
                k = 0
                for m in mlp:
                    b.load(l, m, m.name, last_attn, slot=[f"pool{(k + t) % 4}" for t in range(m.tiles)])
                    k += m.tiles
            for m in mlp:
                matmul(l, m)
            if look:
                lookahead(l + 1, len(b.phases) - 1)             # the callback after the dense MLP
            for name in (["dense_reduce_local", "dense_reduce_host"] if seed else ["dense_out"] if N > 1 else []):
                collective(l, name)
            continue
        if look:                                                # MoE entry (spec 3.4)
            for m in mlp:
                if m.name != "moe.router":
                    b.load(l, m, m.name, last_attn, slot=m.name)
        routing = None
        topk = lambda: vector(l, "routing", 0, c.top_k * B * round_up(c.experts, 128) * 4, fixed_cost="routing")
        for m in mlp:
            matmul(l, m)
            if m.name == "moe.router":
                if seed:
                    collective(l, "router_exchange")
                else:
                    routing = topk()
            elif m.name == "moe.in" and N > 1:      # flies while the shared expert computes (mk.kernel.moe)
                collective(l, "moe_latent", overlap=1)
            elif m.name == "moe.latent_down":       # spec 3.8: the latent all-gather flies during the top-k loop
                collective(l, "latent_gather", overlap=1)
                routing = topk()
        # routed experts: known once routing is done; at B = 1 the seed issues each as top-k selects it
        anchor = routing - 1 if o.expert_issue == "selection" and B == 1 else routing
        n = float(distinct_experts[l - 1])
        rows_e = plan.expert_rows(n)
        for e in range(math.ceil(n - 1e-9)):
            frac = min(1.0, n - e)
            for m, part in ((plan.expert_gu, "gu"), (plan.expert_down, "down")):
                name = f"expert[{e}].{part}"
                slot = f"expert_slot{e % o.expert_slots}.{part}" if o.expert_slots else None
                b.load(l, m, name, anchor, slot=slot, scale=frac)
                matmul(l, m, name, scale=frac, rows=rows_e)
        last_expert = len(b.phases) - 1
        if look:
            post = s.post[0]
            b.load(l, post, post.name, last_expert, slot=post.name)    # latent_up: as the reductions begin
            if l + 1 < c.layers:
                lookahead(l + 1, last_expert)
        if seed:
            for name in ("moe_reduce_scatter_local", "moe_reduce_local", "moe_reduce_host", "moe_gather_local"):
                if name in colls:
                    collective(l, name)
        elif N > 1:
            collective(l, "moe_routed")
        for m in s.post:
            matmul(l, m)
        if seed:
            collective(l, "moe_output_gather")
            if "pre_attn_gather" in colls:
                collective(l, "pre_attn_gather")
        elif N > 1:
            collective(l, "moe_out")
    return b.build()


def _state(nbytes: int) -> Matrix:
    """A KDA state copy as a one-tile 'matrix' of `nbytes` (it moves like one)."""
    return Matrix("kda.state", 1, nbytes // 2, (), 1, nbytes // 2, "bf16")


# --------------------------------------------------------------------------------------------
# A plan's step, walked: what the kernel executes and the simulator replays
# --------------------------------------------------------------------------------------------
def schedule(plan, distinct_experts: Sequence[float] | None = None):
    """(dmas, phases) of one step of `plan`, as its options lay them out (`megakernel` here for a
    megakernel, `mk.kernel.conventional` for one kernel per op). `distinct_experts[l-1]` = distinct
    experts this device fetches at MoE layer l (default: the expected value, rounded; a fraction
    makes the last expert's DMAs and work that fraction: an expectation, for the simulator). Dense
    tiles are exactly what the kernel issues; expert tiles follow the routing."""
    if distinct_experts is None:
        return _expected(plan)
    c = plan.config
    if len(distinct_experts) != c.n_moe:
        raise PlanError(f"distinct_experts: expected {c.n_moe} values (one per MoE layer), "
                        f"found {len(distinct_experts)}")
    walk = conventional.per_op if plan.options.program == "per_op" else megakernel
    return walk(plan, list(distinct_experts))


@functools.lru_cache(maxsize=64)
def _expected(plan):
    """The step with the expected distinct experts per layer, walked once per plan."""
    n = max(1, round(plan.expected_distinct_experts()))
    return schedule(plan, [n] * plan.config.n_moe)


def dmas(plan) -> list[WeightDMA]:
    """The step's weight DMAs in issue order (expected routing)."""
    return schedule(plan)[0]


def phases(plan) -> list[Phase]:
    """The step's phases in execution order (expected routing)."""
    return schedule(plan)[1]


def layer_collectives(plan, layer: int) -> tuple[str, ...]:
    """Names of the collectives of `layer` in execution order (layer L = the LM head), read off
    the schedule (the step's leading `embed` belongs to no layer)."""
    return tuple(p.name for p in phases(plan)
                 if p.kind == "collective" and p.layer == layer and p.name != "embed")


def collective_sequence(plan) -> list[str]:
    """Every collective of one step, in schedule order."""
    return [p.name for p in phases(plan) if p.kind == "collective"]


def collectives_per_step(plan) -> int:
    return len(collective_sequence(plan))


def remote_bytes_per_step(plan) -> int:
    return sum(p.collective_bytes for p in phases(plan) if p.kind == "collective")


def routed_expert_bytes_per_step(plan, distinct_experts=None) -> int:
    """Routed-expert bytes one device streams per step (`schedule`'s expert DMAs)."""
    return sum(d.bytes for d in schedule(plan, distinct_experts)[0] if d.tensor.startswith("expert["))


def weight_bytes_per_step(plan, distinct_experts=None) -> int:
    return sum(d.bytes for d in schedule(plan, distinct_experts)[0])


def summary(plan) -> dict:
    """The plan and its step in numbers (JSON-ready)."""
    return {
        "config": plan.config_name(), "batch": plan.batch, "prefetch_depth": plan.prefetch_depth,
        "num_slots": plan.num_slots, "tile": [plan.tile_k, plan.tile_n], "chip": plan.chip,
        "dense_tiles": plan.dense_tiles, "expert_tiles_per_expert": plan.expert_tiles,
        "vmem_planned_bytes": plan.vmem_planned_bytes, "vmem_limit_bytes": plan.vmem_limit,
        "devices": plan.devices, "ep": plan.layout.ep, "tp_expert": plan.layout.tp_expert,
        "collectives_per_step": collectives_per_step(plan),
        "remote_bytes_per_step": remote_bytes_per_step(plan),
        "experts": plan.experts, "expert_bytes": plan.expert_bytes,
        "routed_expert_bytes_per_step": routed_expert_bytes_per_step(plan),
        "sequences": plan.sequences, "k": plan.k, "aux_layers": list(plan.aux_layers),
    }
