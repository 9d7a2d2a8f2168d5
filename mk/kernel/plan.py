"""The decode step's schedule, written once: which weight tile moves when, where it lands, who uses it.

A `Plan` is computed on the host from (config, batch, prefetch depth, tile shape, slot count, VMEM
limit, chip). The megakernel (`mk.kernel`) executes it and the performance model (`mk.perf.sim`)
replays it, so the two can never disagree about the schedule.

The weight stream
-----------------
Every dense matrix of the step (attention projections, router, latent and shared projections,
layer 0's dense MLP, the LM head) is cut into tiles of one shape `[tile_k, tile_n]` (bf16; chosen per
model by `default_tile`, the shape that streams the least zero padding), laid
out once at load time in the order the kernel consumes them (`pack_weights`): for each matrix,
column block by column block, and inside a column block, row block by row block. Matrices that
read the same activation are fused side by side (KDA's q|k|v|g|b, MLA's q_a|kv_a|g, the MoE's
latent_down|shared_gate|shared_up), each part starting on a 128-lane boundary.

The tiles flow through a ring of `num_slots` VMEM slots. Before the kernel consumes tile c it
makes sure tiles c .. c + prefetch_depth have been issued (slot = issue count mod num_slots), so
`prefetch_depth` tiles are always in flight, *across layer boundaries*: the next layer's first
projections arrive while this layer's MoE computes. Depth 0 fetches each tile only when its
consumer starts: the no-overlap baseline of a conventional one-kernel-per-layer program.

Each matrix has a storage format (`Matrix.format`, `Matrix.tile_bytes`): bf16, or for routed
experts (`make_plan(..., experts="mxfp4")`) the checkpoint's MXFP4: E2M1 codes and E8M0 scales,
4.25 bits per weight, which land in their own slot pool (code and scale slots with their own
semaphores, `Plan.buffers`) and are dequantized in VMEM right before their matmul. Sublayers find
their matrices and the fused parts by name (`LayerStream.matrix`, `Matrix.part`).

Routed experts join the same stream: a MoE layer's stream is
    [router | latent_down+shared | shared_down] [expert tiles: each distinct chosen expert, ascending id] [latent_up]
The expert segment's length is known only once the router has run, so the issue cursor waits at
its start until routing is done (the kernel keeps the shared-expert tiles before it, so the ring
stays busy while routing). Each distinct expert is fetched once per step for the whole batch.

Per-layer small vectors (norms, folded AttnRes queries, KDA conv taps/decay, router bias, latent
norm) travel as one `[rows, width]` f32 table per layer, double-buffered one layer ahead.
"""
from __future__ import annotations

import dataclasses
import functools
from functools import cached_property
from typing import Sequence

import numpy as np

from mk.model.config import MX_GROUP, K3Config
from mk.model.layout import Layout, PlanError, latent_offsets, round_up

MiB = 1 << 20
BF16_BYTES = 2
# Storage formats of a streamed matrix's tiles. "bf16": [tile_k, tile_n] bf16. "mxfp4" (routed
# experts, spec 2.3): E2M1 codes, 8 per int32 word, and E8M0 scale bytes, 4 per int32 word, one per
# 32 rows (K) of a column: 4.25 bits per weight (see `MXFP4_TILE` and `pack_mxfp4_tiles`).
FORMATS = ("bf16", "mxfp4")
# Formats a streamed matrix may have in a *modelled* plan (mk.perf.sim): the kernel's, plus the seed's FP8
# re-blocked expert gate/up (spec 2.3 / 3.5): e4m3 bytes and one bf16 scale per FP8_BLOCK rows.
STREAM_FORMATS = FORMATS + ("fp8",)
FP8_BLOCK = 256
CODES_PER_WORD = 8       # E2M1 codes per int32 word
SCALES_PER_WORD = 4      # E8M0 bytes per int32 word


# VMEM capacity per TensorCore (bytes) of the chips we compile for.
VMEM_BYTES = {"v5e": 128 * MiB, "v5p": 96 * MiB, "v6e": 128 * MiB, "tpu7x": 64 * MiB, "cpu": 64 * MiB}
# Chips whose MXU takes fp8 operands (the `mxfp4_matmul='fp8'` path); "cpu" is interpret mode.
FP8_MXU = ("v6e", "tpu7x", "cpu")
# How each chip unpacks MXFP4 codes in VMEM (`Plan.mxfp4_unpack`): 'bitcast' reinterprets int32 words
# as E2M1 and converts (Mosaic lowers the fp4 unpack on TPU v7 only); 'pairs' builds two bf16 bit
# patterns per 32-bit lane with integer ops (every generation); 'pairs_mul', the same values with
# integer multiplies laying the masks (every generation; on the v5e 1.1% faster than 'pairs' at
# B = 1, 2, 4 and 8 on device time and bit-exact on the chip, 2026-12-06e: 415 against 457 LLO
# bundles per tile); 'shift', one f32 pattern per lane with shifts, masks and selects (the first v5e
# kernel's). Chips not named: 'pairs' (v6e: 'pairs_mul' compiles, not yet timed there).
MXFP4_UNPACK = {"tpu7x": "bitcast", "cpu": "bitcast", "v5e": "pairs_mul"}
DEFAULT_UNPACK = "pairs"
# Heads of one row the kernel's MLA loops take per step by default (`ScheduleOptions.attention_heads`).
ATTENTION_HEADS = 8
# Cache positions an MLA row writes back: the bf16 sublane tile (16 rows) that holds its new key / value,
# not its whole 128-position block (`mk.kernel.mla`): whole tiles, 1/8 of the block's bytes.
CACHE_WRITE_ROWS = 16
# jax `device_kind` -> mk.kernel.plan chip name
CHIP_OF_DEVICE_KIND = {"TPU v5 lite": "v5e", "TPU v5e": "v5e", "TPU v5": "v5p", "TPU v5p": "v5p",
                       "TPU v6 lite": "v6e", "TPU v6e": "v6e", "TPU7x": "tpu7x", "TPU v7": "tpu7x", "cpu": "cpu"}


def chip_unpack(chip: str) -> str:
    """The MXFP4 unpack the kernel uses on `chip` (a plan chip name) by default."""
    return MXFP4_UNPACK.get(chip, DEFAULT_UNPACK)


def chip_of_device(device) -> str:
    """The mk.kernel.plan chip name of a jax device (`jax.devices()[0]`); a device kind mk does not know
    is refused with its name."""
    kind = "cpu" if device.platform == "cpu" else device.device_kind
    if kind not in CHIP_OF_DEVICE_KIND:
        raise PlanError(f"device kind {kind!r} is not a chip mk plans for: expected one of {sorted(CHIP_OF_DEVICE_KIND)}")
    return CHIP_OF_DEVICE_KIND[kind]


# mk.kernel.plan chip name -> data/hardware.csv chip name
HARDWARE_CHIP = {"v5e": "tpu-v5e", "v5p": "tpu-v5p", "v6e": "tpu-v6e", "tpu7x": "tpu-v7"}
# Default scoped VMEM limit we ask Mosaic for: what the K3 kernel uses on TPU v7.
DEFAULT_VMEM_LIMIT = 64 * MiB
# VMEM that Mosaic uses beyond the kernel's buffers: values with no buffer of their own (the
# residual p, the mixes and norms, KDA/MLA/MoE intermediates) and its internal scratch. Measured
# as the compiler's "Used X of 64.00M vmem" minus the buffers' bytes, for k3-slice at depths 60
# and 70 (1 core, B = 1, 8) and 110 and 120 (8 cores, B = 1, 8): 3.03-3.04 MiB on one core,
# 1.25 MiB on eight, the same at every depth and batch. With the MLA cache blocks double-buffered
# (the attended block is a dynamic index into two): 3.18 MiB (bf16 experts, depths 39 and 40) and
# 2.68 MiB (MXFP4, depth 31) on one core. The largest, rounded up to 64 KiB.
COMPILER_ALLOWANCE = 3 * MiB + 192 * 1024


def tile_rows(rows: int, itemsize: int) -> int:
    """Rows of the VMEM row tile Mosaic gives an array `rows` tall (jaxlib/mosaic
    infer_memref_layout): 8 x packing (8 for 32-bit, 16 for 16-bit types) for arrays that tall,
    else the least power of two >= rows, at most 8 and at least the packing (1 for 32-bit, 2 for
    16-bit). Seen in the compiler's memref dump: bf16 [1, W] and [2, W] -> (2, 128) tiles, [3, W]
    -> (4, 128), [5, W] and [8, W] -> (8, 128)."""
    packing = 4 // itemsize
    return 8 * packing if rows >= 8 * packing else max(packing, min(8, 1 << (rows - 1).bit_length()))


def padded_bytes(shape: Sequence[int], itemsize: int) -> int:
    """VMEM bytes of an array as Mosaic lays it out: the minor dim padded to 128 lanes, the
    second-minor to its row tile (`tile_rows`)."""
    *lead, rows, lanes = (1,) + tuple(shape) if len(shape) == 1 else tuple(shape)
    return (int(np.prod(lead, dtype=np.int64)) * round_up(rows, tile_rows(rows, itemsize))
            * round_up(lanes, 128) * itemsize)


F32, BF16, I32, F8 = "float32", "bfloat16", "int32", "float8_e4m3fn"
ITEMSIZE = {F32: 4, BF16: 2, I32: 4, F8: 1}


@dataclasses.dataclass(frozen=True)
class Buffer:
    """One buffer of the kernel: `space` "vmem", "smem", "dma_sem" (an array of DMA semaphores,
    no dtype) or "hbm" (an output the kernel DMAs into, never in VMEM); `dtype` a numpy dtype name;
    `output`: an output of the pallas_call (VMEM or HBM), not scratch."""
    name: str
    space: str
    shape: tuple[int, ...]
    dtype: str | None = None
    output: bool = False

    @property
    def vmem_bytes(self) -> int:
        return padded_bytes(self.shape, ITEMSIZE[self.dtype]) if self.space == "vmem" else 0

    @property
    def label(self) -> str:
        return f"{self.name} {self.dtype}{list(self.shape)}"


# --------------------------------------------------------------------------------------------
# What gets streamed
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Part:
    """One checkpoint matrix placed into a (possibly fused) streamed matrix.

    `source` is the params path (family, key); its `name` is the key ('q', 'w1', 'latent_down').
    Columns land at `offset` (a multiple of 128). `head_pad`: (heads, src width, dst width) when
    each head's columns are padded (MLA q_b).
    """
    source: tuple[str, str]
    offset: int
    width: int
    head_pad: tuple[int, int, int] | None = None

    @property
    def name(self) -> str:
        return self.source[1] or self.source[0]

    def cols(self, y):
        """This part's columns of a [rows, n] matmul result."""
        return y[:, self.offset:self.offset + self.width]


@dataclasses.dataclass(frozen=True)
class Matrix:
    """A weight matrix as the kernel streams it: [k, n] (zero-padded) in [tile_k, tile_n] tiles,
    stored in `format` ("bf16" or "mxfp4", see FORMATS)."""
    name: str
    k: int                   # contraction rows actually used
    n: int                   # output columns (fused, lane-padded)
    parts: tuple[Part, ...]
    tile_k: int
    tile_n: int
    format: str = "bf16"

    def __post_init__(self):
        if self.format not in STREAM_FORMATS:
            raise PlanError(f"matrix {self.name}: unknown format {self.format!r}, expected one of {STREAM_FORMATS}")

    @property
    def code_rows(self) -> int:
        """mxfp4: int32 rows of one tile's codes, [tile_k / 8, tile_n]."""
        return self.tile_k // CODES_PER_WORD

    @property
    def scale_rows(self) -> int:
        """mxfp4: int32 rows of one tile's scales, [tile_k / 128, tile_n]."""
        return self.tile_k // (MX_GROUP * SCALES_PER_WORD)

    @property
    def tile_bytes(self) -> int:
        """HBM bytes of one tile as stored (and DMA'd): bf16 2 per weight, mxfp4 17/32 (a code
        nibble per weight and a scale byte per 32 rows), fp8 1 + a bf16 scale per FP8_BLOCK rows."""
        if self.format == "mxfp4":
            return self.tile_k * self.tile_n // 2 + self.tile_k // MX_GROUP * self.tile_n
        if self.format == "fp8":
            return self.tile_k * self.tile_n + -(-self.tile_k // FP8_BLOCK) * self.tile_n * BF16_BYTES
        return self.tile_k * self.tile_n * BF16_BYTES

    @property
    def bytes(self) -> int:
        return self.tiles * self.tile_bytes

    @property
    def k_tiles(self) -> int:
        return -(-self.k // self.tile_k)

    @property
    def n_tiles(self) -> int:
        return -(-self.n // self.tile_n)

    @property
    def tiles(self) -> int:
        return self.k_tiles * self.n_tiles

    @property
    def k_pad(self) -> int:
        return self.k_tiles * self.tile_k

    @property
    def n_pad(self) -> int:
        return self.n_tiles * self.tile_n

    def part(self, name: str) -> Part:
        """The part called `name` (its source key, e.g. 'b' of kda.in, 'w3' of expert.gu)."""
        for p in self.parts:
            if p.name == name:
                return p
        raise KeyError(f"matrix {self.name} has no part {name!r} (parts: {[p.name for p in self.parts]})")


@dataclasses.dataclass(frozen=True)
class LayerStream:
    """The weight stream of one layer (index `layers` = the LM head): `pre`, experts, `post`."""
    layer: int
    kind: str                          # 'kda+dense' | 'kda+moe' | 'mla+moe' | 'head'
    pre: tuple[Matrix, ...]
    post: tuple[Matrix, ...]
    dense_base: int                    # index of this layer's first tile in the packed array

    @property
    def has_experts(self) -> bool:
        return self.kind.endswith("moe")

    def matrix(self, name: str) -> "Matrix":
        """This layer's streamed matrix called `name` (e.g. 'moe.router')."""
        for m in self.pre + self.post:
            if m.name == name:
                return m
        raise KeyError(f"layer {self.layer} ({self.kind}) streams no matrix {name!r}")

    @property
    def pre_tiles(self) -> int:
        return sum(m.tiles for m in self.pre)

    @property
    def post_tiles(self) -> int:
        return sum(m.tiles for m in self.post)


# --------------------------------------------------------------------------------------------
# Where a plan sits in the space of schedules
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ScheduleOptions:
    """The choices that turn the same matrices into a schedule (`mk.kernel.schedule.schedule`). `MK` is what mk's
    kernel runs; `SEED` the seed's K3 kernel (spec 3.4-3.8), replayed by the simulator as another
    point of the same space; `CONVENTIONAL` one kernel per op (a GPU serving stack, `mk.kernel.conventional`).

    program        'megakernel': one program per step; 'per_op': one kernel launch per op
    dma            'tile': every matrix in [tile_k, tile_n] tiles through one ring (mk); 'matrix': one
                   DMA per matrix into its own VMEM buffer or pool slot (the seed's pool, spec 3.3)
    prefetch       'ring': `prefetch_depth` DMAs in flight ahead of their consumer, across layers (mk);
                   'lookahead': the seed's one-layer lookahead (spec 3.4): layer l+1's attention
                   projections and router issued once layer l's routed experts are done, the MoE's
                   matrices at MoE entry, latent_up when the reductions begin
    expert_slots   0: routed-expert tiles join the stream, each storage format in its own slot pool
                   (mk); n: n whole-expert slots refilled in route order (the seed: 4, spec App. B.2)
    expert_gate_up, expert_down   storage of the routed experts' matrices (None: the plan's
                   `experts`); the seed: 'fp8' gate/up re-blocked from MXFP4 (spec 2.3), 'mxfp4' down
    expert_issue   'routing': expert DMAs start once routing is done (mk); 'selection': at B = 1 each
                   is issued as the top-k loop selects it (the seed's shared-route path, spec 3.4)
    collectives    'merged': mk's six collectives, one exchange round each (4 per MoE layer, the
                   router replicated, the latent up-projection split by rows); 'seed': spec 3.8's
                   pattern (router halves swapped between sibling cores, paired attention output,
                   two-level reductions, latent up-projection by 1024-lane blocks + output all-gather)
    message_rows   rows of a collective's message: 'tile': the matmul rows (the batch padded to the
                   8-row sublane tile); 'packed': the B token rows (mk: a [B, width] bf16 buffer,
                   which Mosaic pads to its row tile, 2 rows at B = 1; the seed, spec 3.8: bf16
                   pairs packed lane-dense, no padding)
    all_reduce     rounds of mk's all-reduces: 'one_round': every rank sends its whole message to
                   every peer; 'two_round': a reduce-scatter then an all-gather of the reduced
                   chunks (fewer bytes, two hops; `mk.kernel.collectives.all_reduce`)
    recipe         'tuned': spec 3.7's batch-specific options (persistent KDA state at B <= 4, token
                   scatter at B = 8, routed reduce-scatter at B in {6, 8}); 'base': none
    mxfp4_matmul   how an MXFP4 matrix meets the MXU: 'bf16': its codes converted to scaled bf16 in
                   vector registers, 128 columns at a time (mk's kernel, `mk.kernel.ring.mxfp4_tile_product`);
                   'fp8': codes converted to fp8, block-diagonal LHS (the seed, spec 3.5; chips
                   with an fp8 MXU, `FP8_MXU`)
    mxfp4_unpack   how the kernel turns code words into values: 'auto': the chip's (`MXFP4_UNPACK`);
                   'pairs': integer ops building two bf16 bit patterns per 32-bit lane (every TPU);
                   'pairs_mul': the same words and values, with integer multiplies (every TPU);
                   'shift': integer shifts and masks into f32 bit patterns (every TPU); 'bitcast':
                   `pltpu.bitcast` to E2M1 and one conversion (TPU v7). The packed code layout
                   follows (`pack_mxfp4_tiles`)
    attention_heads  heads of one row that one step of the kernel's MLA loops attends together
                   (`mk.kernel.mla`): 1 walks the heads one at a time; G > 1 batches G heads' score
                   products and softmax updates (must divide the heads on a device); 0: the
                   largest divisor of the device's heads up to `ATTENTION_HEADS`
    """
    name: str = "custom"
    program: str = "megakernel"
    dma: str = "tile"
    prefetch: str = "ring"
    expert_slots: int = 0
    expert_gate_up: str | None = None
    expert_down: str | None = None
    expert_issue: str = "routing"
    collectives: str = "merged"
    message_rows: str = "packed"
    all_reduce: str = "one_round"
    recipe: str = "base"
    mxfp4_matmul: str = "bf16"
    mxfp4_unpack: str = "auto"
    attention_heads: int = 0

    CHOICES = {"program": ("megakernel", "per_op"), "dma": ("tile", "matrix"), "prefetch": ("ring", "lookahead"),
               "expert_issue": ("routing", "selection"), "collectives": ("merged", "seed"),
               "message_rows": ("tile", "packed"), "all_reduce": ("one_round", "two_round"), "recipe": ("base", "tuned"), "mxfp4_matmul": ("bf16", "fp8"),
               "mxfp4_unpack": ("auto", "pairs", "pairs_mul", "shift", "bitcast")}

    def __post_init__(self):
        for f, allowed in self.CHOICES.items():
            if getattr(self, f) not in allowed:
                raise PlanError(f"ScheduleOptions.{f} must be one of {allowed}, found {getattr(self, f)!r}")
        for f in ("expert_gate_up", "expert_down"):
            if getattr(self, f) not in (None,) + STREAM_FORMATS:
                raise PlanError(f"ScheduleOptions.{f} must be None or one of {STREAM_FORMATS}, found {getattr(self, f)!r}")
        if not isinstance(self.attention_heads, int) or self.attention_heads < 0:
            raise PlanError(f"ScheduleOptions.attention_heads must be an integer >= 0 (0: auto), "
                            f"found {self.attention_heads!r}")
        if not isinstance(self.expert_slots, int) or self.expert_slots < 0:
            raise PlanError(f"ScheduleOptions.expert_slots must be an integer >= 0, found {self.expert_slots!r}")
        if self.prefetch == "lookahead" and self.dma != "matrix":
            raise PlanError("ScheduleOptions: the one-layer lookahead moves whole matrices (dma='matrix')")
        if self.expert_slots and self.dma != "matrix":
            raise PlanError("ScheduleOptions: whole-expert slots move whole matrices (dma='matrix')")

    # Options the kernel executes either way (every other field must be MK's).
    KERNEL_FREE = ("message_rows", "all_reduce", "mxfp4_matmul", "mxfp4_unpack", "attention_heads")

    @property
    def kernel(self) -> bool:
        """Whether mk's kernel can execute a plan with these options (MK's, up to `KERNEL_FREE`)."""
        same = {f: getattr(MK, f) for f in self.KERNEL_FREE}
        return dataclasses.replace(self, name=MK.name, **same) == MK

    def differences(self, other: "ScheduleOptions") -> dict[str, tuple]:
        """{field: (self's, other's)} where the two differ (the name aside)."""
        return {f.name: (getattr(self, f.name), getattr(other, f.name)) for f in dataclasses.fields(self)
                if f.name != "name" and getattr(self, f.name) != getattr(other, f.name)}


MK = ScheduleOptions("mk")
SEED = ScheduleOptions("seed", dma="matrix", prefetch="lookahead", expert_slots=4, expert_gate_up="fp8",
                       expert_down="mxfp4", expert_issue="selection", collectives="seed", message_rows="packed",
                       recipe="tuned", mxfp4_matmul="fp8")
CONVENTIONAL = ScheduleOptions("conventional", program="per_op", dma="matrix", message_rows="packed",
                               mxfp4_matmul="fp8")


@dataclasses.dataclass(frozen=True)
class WeightDMA:
    """One weight DMA of the step, in issue order."""
    index: int
    layer: int
    tensor: str
    tile: int
    bytes: int
    slot: int
    phase: int              # index of the consuming Phase
    issue_after: int = -1   # a phase that must end before this DMA may be issued (the seed's lookahead
                            # anchors; routed experts wait for their routing phase)


@dataclasses.dataclass(frozen=True)
class Collective:
    """One in-kernel collective: every rank sends its `[rows, width]` message to `peers` peers
    (default: all N - 1) over `link` ('ici', 'sibling' = the other core of the same chip, 'nvlink').

    'all_reduce': the messages (fp32 partials rounded to bf16: the wire) are summed in fp32 in
    rank order on every rank, so all ranks hold the same bits. 'all_gather': they are laid side by
    side in rank order. 'exchange': a part of the seed's hierarchical patterns (spec 3.8). One
    phase each: a single round of remote copies per rank.
    """
    name: str            # embed | attn_out | dense_out | moe_latent | moe_routed | moe_out (mk)
    kind: str            # 'all_reduce' | 'all_gather' | 'exchange'
    width: int           # lanes of one rank's message
    rows: int            # token rows of the message
    devices: int
    peers: int | None = None
    link: str = "ici"
    itemsize: int = BF16_BYTES
    wire_rows: int | None = None   # rows a DMA moves (a VMEM buffer's row tile, `tile_rows`); None: `rows`
    rounds: int = 1      # an all-reduce in 2: reduce-scatter of `chunk`-lane parts, all-gather of them
    chunk: int = 0       # lanes of one rank's part in a two-round all-reduce

    @property
    def message_bytes(self) -> int:
        """Bytes of one message of a round (a chunk in a two-round all-reduce)."""
        return (self.wire_rows or self.rows) * (self.chunk or self.width) * self.itemsize

    @property
    def remote_bytes(self) -> int:
        """Bytes one rank sends (and receives) for this collective, all rounds."""
        return self.rounds * (self.devices - 1 if self.peers is None else self.peers) * self.message_bytes


@dataclasses.dataclass(frozen=True)
class Phase:
    """One compute phase of the step (a matmul, a vector sublayer, a collective, or in a per-op
    schedule one kernel launch). The simulator (`mk.perf.sim`) replays these; the kernel runs them."""
    index: int
    layer: int
    name: str
    kind: str                        # 'mxu' | 'vector' | 'collective'
    flops: int = 0                   # mxu: matmul flops of `rows` LHS rows; vector: elementwise ops
    rows: int = 0                    # matmul LHS rows
    vector_bytes: int = 0            # VMEM traffic of vector work (elementwise passes)
    hbm_bytes: int = 0               # non-weight HBM traffic the phase reads itself (caches, states)
    hbm_lead: int = 0                # ... issued when the phase `hbm_lead` phases earlier starts (0: at its own)
    writeback_bytes: int = 0         # ... and writes back asynchronously when it ends
    collective_bytes: int = 0        # bytes this device sends in a collective phase
    link: str = "ici"                # a collective's link
    overlap: int = 0                 # a collective: the next `overlap` phases run while it is in flight
                                     # (the one after them waits for it); 0: the core waits at once
    dmas: tuple[int, ...] = ()
    dtype: str = "bf16"              # MXU rate: 'bf16' | 'fp8' | 'fp4'
    vector_ops: int = 0              # extra elementwise ops of an mxu phase (the MXFP4 unpack)
    fixed_cost: str = ""             # a machine constant added to the phase time ('routing': spec App. B.6)
    pipelined: bool = False          # a GPU kernel: compute overlaps its own weight stream
    kernel: str | None = None        # per-op schedules: the kernel launch this phase is


# Rows of the per-layer vector table. KDA / MLA / MoE rows are unused (zero) in other layers.
def vector_rows(cfg: K3Config) -> dict[str, int]:
    names = ["attn_res", "mlp_res", "attn_norm", "ffn_norm"]
    names += [f"conv{j}_{t}" for j in range(3) for t in range(cfg.conv_size)]
    names += ["a_log", "dt_bias", "o_norm", "q_a_norm", "kv_a_norm", "router_bias", "latent_norm"]
    return {n: i for i, n in enumerate(names)}


@dataclasses.dataclass(frozen=True)
class Plan:
    config: K3Config
    batch: int
    prefetch_depth: int
    num_slots: int
    tile_k: int
    tile_n: int
    vmem_limit: int
    chip: str
    ctx: int
    layout: Layout
    streams: tuple[LayerStream, ...]      # layers 0..L-1, then the LM head
    expert_gu: Matrix                     # one expert's fused [w1 | w3]  (latent -> 2 Fe)
    expert_down: Matrix                   # one expert's w2               (Fe -> latent)
    options: ScheduleOptions = MK         # the schedule's choices (the kernel runs MK's)
    # ---- the row model: `batch` rows = `sequences` x `seq_rows` (see `row_seq`) ---------------
    seq_rows: int = 1                     # rows per sequence: 1 + k (anchor + k drafts); 1 = decode
    aux_layers: tuple[int, ...] = ()      # layers whose entry prefix p the step copies out (spec 4.1)

    # ---- rows and sequences --------------------------------------------------------------------
    # A step runs `batch` token rows (the matmul rows that carry tokens; `rows` pads them to the
    # sublane tile). Row r belongs to sequence r // seq_rows and sits at offset r % seq_rows of that
    # sequence's block: plain decode is seq_rows = 1 (one row per sequence), a speculative verify
    # step seq_rows = 1 + k (the anchor and k drafts at consecutive positions). Per-row state (KDA,
    # conv) lives in HBM per row, [batch, ...]; the MLA caches per sequence, [sequences, ...].
    @property
    def sequences(self) -> int:
        return self.batch // self.seq_rows

    @property
    def k(self) -> int:
        """Draft tokens per sequence verified by one step (0: plain decode)."""
        return self.seq_rows - 1

    def row_seq(self) -> np.ndarray:
        """[batch] int32: the sequence of each row."""
        return np.arange(self.batch, dtype=np.int32) // self.seq_rows

    def row_offset(self) -> np.ndarray:
        """[batch] int32: each row's offset in its sequence's block (position = pos[seq] + offset)."""
        return np.arange(self.batch, dtype=np.int32) % self.seq_rows

    # ---- one device's share (mk.model.sharding) ----------------------------------------------------
    @property
    def devices(self) -> int:
        return self.layout.devices

    @property
    def heads(self) -> int:
        """Attention heads on this device."""
        return self.config.heads // self.layout.tp_attn

    @property
    def attn_width(self) -> int:
        return self.heads * self.config.head_dim

    @property
    def local_experts(self) -> int:
        return self.config.experts // self.layout.ep

    @property
    def latent_block(self) -> int:
        """Lanes of one rank's latent slice (latent / N real ones, 128-aligned)."""
        return round_up(self.config.latent // self.devices, 128)

    @property
    def latent_offsets(self) -> tuple[int, ...]:
        """Lane of each rank's latent slice inside its block (`latent_offsets`)."""
        return latent_offsets(self.config.latent, self.devices)

    @property
    def latent_padded(self) -> int:
        """Width of the gathered latent vector: N blocks of `latent_block` (= latent on one device
        when latent is a multiple of 128)."""
        return self.devices * self.latent_block

    @property
    def vocab_local(self) -> int:
        return self.config.vocab // self.layout.tp_attn

    @cached_property
    def collectives(self) -> dict[str, Collective]:
        """The step's collectives by name (none on one device)."""
        c, M, N = self.config, self.message_rows, self.devices
        if N == 1:
            return {}

        def C(name, kind, width):
            two = kind == "all_reduce" and self.options.all_reduce == "two_round"
            return Collective(name, kind, width, M, N, wire_rows=round_up(M, tile_rows(M, BF16_BYTES)),
                              rounds=2 if two else 1, chunk=round_up(-(-width // N), 128) if two else 0)
        out = [C("embed", "all_reduce", c.dim), C("attn_out", "all_reduce", c.dim),
               C("dense_out", "all_reduce", c.dim), C("moe_latent", "all_gather", self.latent_block),
               C("moe_routed", "all_reduce", self.latent_padded), C("moe_out", "all_reduce", c.dim)]
        return {x.name: x for x in out}

    @property
    def message_rows(self) -> int:
        """Rows of a collective's message (`ScheduleOptions.message_rows`): the batch, or `rows`."""
        return self.batch if self.options.message_rows == "packed" else self.rows

    @property
    def exchange_width(self) -> int:
        """Lanes of the widest collective message, or of N chunks (the send / landing buffers' width)."""
        return max((max(x.width, self.devices * x.chunk) for x in self.collectives.values()), default=128)

    # ---- shapes the kernel allocates --------------------------------------------------------
    @property
    def rows(self) -> int:
        """Matmul LHS rows: the batch padded to the 8-row sublane tile."""
        return round_up(self.batch, 8)

    @property
    def tile_bytes(self) -> int:
        """Bytes of one tile of the bf16 ring (every matrix but mxfp4 experts)."""
        return self.tile_k * self.tile_n * BF16_BYTES

    @property
    def experts(self) -> str:
        """Storage format of the routed experts ("bf16" or "mxfp4")."""
        return self.expert_gu.format

    @property
    def mxfp4_unpack(self) -> str:
        """How the kernel unpacks MXFP4 code words on this plan's chip: 'pairs', 'shift' or 'bitcast'
        (`ScheduleOptions.mxfp4_unpack`; 'auto' takes the chip's, `MXFP4_UNPACK`)."""
        u = self.options.mxfp4_unpack
        return chip_unpack(self.chip) if u == "auto" else u

    @property
    def attention_heads(self) -> int:
        """Heads the kernel's MLA loops attend per step (`ScheduleOptions.attention_heads`; 0 takes
        the largest divisor of this device's heads up to `ATTENTION_HEADS`)."""
        g = self.options.attention_heads
        return g or max(d for d in range(1, ATTENTION_HEADS + 1) if self.heads % d == 0)

    @property
    def expert_bytes(self) -> int:
        """HBM bytes of one routed expert's share on this device, as stored (tile-padded)."""
        return self.expert_gu.bytes + self.expert_down.bytes

    @property
    def dense_tiles(self) -> int:
        return sum(s.pre_tiles + s.post_tiles for s in self.streams)

    @property
    def expert_tiles(self) -> int:
        """Tiles of one routed expert."""
        return self.expert_gu.tiles + self.expert_down.tiles

    @cached_property
    def matrices(self) -> tuple[Matrix, ...]:
        seen = {}
        for s in self.streams:
            for m in s.pre + s.post:
                seen.setdefault(m.name, m)
        seen[self.expert_gu.name] = self.expert_gu
        seen[self.expert_down.name] = self.expert_down
        return tuple(seen.values())

    @property
    def k_max(self) -> int:
        return max(m.k_pad for m in self.matrices)

    @property
    def n_max(self) -> int:
        return max(m.n_pad for m in self.matrices)

    @property
    def vector_width(self) -> int:
        c = self.config
        return round_up(max(c.dim, self.attn_width, c.q_rank, c.kv_rank, c.experts, self.latent_block), 128)

    @property
    def max_distinct_experts(self) -> int:
        """Most distinct experts this device can have to run in one MoE layer."""
        return min(self.local_experts, self.batch * self.config.top_k)

    def expected_distinct_experts(self) -> float:
        """Expected distinct experts per layer and device if B rows route independently and
        uniformly: E_local * (1 - (1 - k/E)^B)."""
        c, lay = self.config, self.layout
        local = c.experts / lay.ep
        return local * (1.0 - (1.0 - c.top_k / c.experts) ** self.batch)

    def expert_rows(self, distinct: float) -> float:
        """Rows one distinct routed expert multiplies on average: the device's (row, expert) routes, B x
        top_k / ep, shared by its `distinct` experts (at least one row; the MXU pads to its tile anyway)."""
        c = self.config
        return max(1.0, self.batch * c.top_k / self.layout.ep / max(distinct, 1e-9))

    def stream(self, layer: int) -> LayerStream:
        return self.streams[layer]

    # ---- the scalar tables the kernel reads from SMEM ----------------------------------------
    def tables(self) -> dict[str, np.ndarray]:
        c = self.config
        L = c.layers
        return {
            # dense tile index where a layer's expert tiles are spliced in (-1: no experts)
            "expert_at": np.array([s.dense_base + s.pre_tiles if s.has_experts else -1
                                   for s in self.streams], np.int32),
            # first dense tile of the next layer: the cursor moves on when it gets there
            "next_base": np.array([s.dense_base + s.pre_tiles + s.post_tiles for s in self.streams], np.int32),
            "is_mla": np.array([int(c.is_mla(l)) for l in range(L)], np.int32),
            "family_index": np.array([c.family_index(l) for l in range(L)], np.int32),
            "n_attn_blocks": np.array([c.n_attn_blocks(l) for l in range(L)], np.int32),
            "n_mlp_blocks": np.array([c.n_mlp_blocks(l) for l in range(L)], np.int32),
            # the row model: each row's sequence (its MLA cache, its state row base)
            "row_seq": self.row_seq(),
            # index into the aux output of a layer whose entry prefix p is copied out (-1: none)
            "aux_slot": np.array([self.aux_layers.index(l) if l in self.aux_layers else -1
                                  for l in range(L)], np.int32),
        }

    # ---- the kernel's buffers and their VMEM budget -------------------------------------------
    @cached_property
    def buffers(self) -> tuple[Buffer, ...]:
        """Every VMEM, SMEM and semaphore buffer of the kernel, by name: its outputs (logits and the
        final prefix p in VMEM, the aux rows in HBM when the plan has aux layers), then its scratch
        in argument order (`mk.kernel.refs` hands them to `pallas_call`)."""
        c, R, B = self.config, self.rows, self.batch
        H, D, HD, d = self.heads, c.head_dim, self.attn_width, c.dim     # this device's heads
        N, W, M = self.devices, self.exchange_width, self.message_rows
        E_pad = round_up(c.experts, 128)
        VM = lambda name, shape, dtype: Buffer(name, "vmem", shape, dtype)
        SM = lambda name, shape, dtype: Buffer(name, "smem", shape, dtype)
        DMA = lambda name, shape: Buffer(name, "dma_sem", shape)
        b = [
            # outputs
            Buffer("logits", "vmem", (R, self.stream(c.layers).matrix("lm_head").n), F32, output=True),
            Buffer("p", "vmem", (R, d), BF16, output=True),                  # final residual prefix
        ]
        if self.aux_layers:   # aux rows (spec 4.1): p at the entry of each aux layer, DMA'd to HBM
            b += [Buffer("aux", "hbm", (len(self.aux_layers), R, d), BF16, output=True)]
        b += [
            # weight ring
            VM("slots", (self.num_slots, self.tile_k, self.tile_n), BF16),   # [S, TK, TN]
            DMA("slot_sems", (self.num_slots,)),
            SM("distinct", (max(self.local_experts, 1),), I32),              # local ids of chosen experts
            VM("xbuf", (R, self.k_max), BF16),                               # matmul input  [R, K]
            VM("ybuf", (R, self.n_max), F32),                                # matmul output [R, N]
            # residual state
            VM("blocks", (c.n_blocks, R, d), F32),                           # snapshots b_0..b_{n-1}
            VM("embed_rows", (B, 16, d), BF16),                              # embedding row groups
            DMA("embed_sems", (B,)),
            VM("vectors", (2, len(vector_rows(c)), self.vector_width), F32), # layer tables, 2 parities
            DMA("vector_sems", (2,)),
        ]
        if self.aux_layers:
            b += [DMA("aux_sems", (1,))]
        b += [
            # KDA: every row's post-state (a row continues its sequence's previous row)
            VM("kda_state", (B, H, D, D), F32),                              # [row, head, key, value]
            VM("conv_state", (B, 3, c.conv_size - 1, HD), BF16),
            DMA("state_sems", (2, B)),                                       # [state | conv, row]
            VM("kda_feat", (6, R, HD), F32),                                 # conv'd q, k, v; decay; gate; beta
            VM("beta_raw", (R, round_up(H, 128)), BF16),
            VM("attn_out", (R, HD), BF16),                                   # gated heads -> o_proj
            # MLA
            VM("mla_q", (R, H * c.k_cache_dim), BF16),
            VM("mla_kv", (R, H * 2 * D), BF16),                              # per head [k_nope | v]
            VM("mla_kr", (R, c.k_cache_dim - D), BF16),                      # shared raw key part, padded
            VM("mla_gate", (R, HD), BF16),
            VM("k_block", (2, H, 128, c.k_cache_dim), BF16),                 # two 128-position blocks:
            VM("v_block", (2, H, 128, D), BF16),                             # one attended, one landing
            DMA("cache_sems", (3, 2)),                                       # [buffer 0 | 1 | last write back, K | V]
            VM("softmax", (3, H, 1, 128), F32),                              # running max, denom (lane-bcast)
            VM("softmax_acc", (H, 1, D), F32),
            # MoE
            VM("route_coef", (R, E_pad), F32),                               # routing weight, 0 = not chosen
            VM("routed_acc", (R, self.latent_padded), F32),                  # [R, N * latent_block]
        ]
        if self.experts == "mxfp4":   # routed experts' own slots: packed tiles, dequantized in VMEM
            m, S = self.expert_gu, self.num_slots
            b += [
                VM("code_slots", (S, m.code_rows, self.tile_n), I32),        # [S, TK/8, TN] E2M1 x 8
                VM("scale_slots", (S, m.scale_rows, self.tile_n), I32),      # [S, TK/128, TN] E8M0 x 4
                DMA("code_sems", (S,)),
                DMA("scale_sems", (S,)),
            ]
            if self.options.mxfp4_matmul == "fp8":   # fp8 path: e4m3 tile, block-diagonal LHS (spec 3.5)
                b += [VM("dequant", (self.tile_k, self.tile_n), F8),               # the tile, e4m3 [TK, TN]
                      VM("mx_lhs", (self.tile_k // MX_GROUP * R, self.tile_k), BF16)]  # [TK/32 * R, TK]
            # (the bf16 path unpacks in vector registers: no VMEM tile, `mk.kernel.ring.mxfp4_tile_product`)
        if N > 1:   # collectives (mk.kernel.collectives): double-buffered by parity, one landing slot per rank
            b += [
                VM("landing", (2, N, M, W), BF16),                           # [parity, source, row, lane]
                VM("send", (2, M, W), BF16),                                 # [parity, row, lane]
                DMA("send_sems", (2, N)),                                    # [parity, destination]
                DMA("recv_sems", (2, N)),                                    # [parity, source]
            ]
        return tuple(b)

    @cached_property
    def vmem_budget(self) -> dict[str, int]:
        """VMEM bytes by item: each "vmem" buffer of `buffers`, tile-padded (`padded_bytes`), plus
        `COMPILER_ALLOWANCE` for what Mosaic keeps in VMEM without a buffer of ours."""
        b = {x.label: x.vmem_bytes for x in self.buffers if x.space == "vmem"}
        b["compiler temporaries (allowance)"] = COMPILER_ALLOWANCE
        return b

    @property
    def vmem_planned_bytes(self) -> int:
        return sum(self.vmem_budget.values())

    def check_vmem(self):
        used, limit = self.vmem_planned_bytes, self.vmem_limit
        if used > limit:
            top = sorted(self.vmem_budget.items(), key=lambda kv: -kv[1])[:4]
            items = ", ".join(f"{k} {v / MiB:.1f} MiB" for k, v in top)
            raise PlanError(
                f"plan needs {used / MiB:.1f} MiB of VMEM but the limit is {limit / MiB:.1f} MiB "
                f"({self.config_name()} batch={self.batch} prefetch_depth={self.prefetch_depth} "
                f"num_slots={self.num_slots} tile={self.tile_k}x{self.tile_n}); largest: {items}")

    def config_name(self) -> str:
        for name, cfg in _presets().items():
            if cfg == self.config:
                return name
        return "custom config"

    # ---- the weight ring's slots --------------------------------------------------------------
    def slot_id(self, fmt: str, n: int) -> int:
        """Slot of the n-th tile (0-based) issued into `fmt`'s slot pool; the pools are numbered
        one after another: bf16 slots 0 .. S-1, then the mxfp4 code|scale slots S .. 2S-1."""
        return STREAM_FORMATS.index(fmt) * self.num_slots + n % self.num_slots

def _presets():
    from mk.model.config import PRESETS
    return PRESETS


# --------------------------------------------------------------------------------------------
# Building a plan
# --------------------------------------------------------------------------------------------
# The stream's tile shapes, largest first. Every matrix is zero-padded to whole tiles and the padding
# streams like weights, so the tile is chosen per model: K3's widths are multiples of 512, but the
# depth presets' thin layers (1792 = 3.5 x 512 wide, experts 768 = 1.5 x 512 deep) lose 16% of a
# 48-layer step to padding at 512 x 512, and 2.4% at 256 x 256 (`stream_bytes`).
TILE_CHOICES = ((512, 512), (512, 256), (256, 512), (256, 256))
PADDING_SLACK = 0.01          # a larger tile is kept while it streams at most 1% more bytes than the fewest
DEFAULT_PREFETCH_DEPTH = 4    # the fewest tiles in flight the default ring keeps (2 MiB at 512 x 512)
# The default ring's tiles in flight, as bytes of its bf16 slots, by the experts' format. Measured on the
# TPU v5e (docs/tpu-v5e/2026-12-07b): with bf16 experts 8 MiB beat 2 MiB by 1-4% at 12, 24 and 48
# layers and 16 MiB gained at most 1% more; MXFP4's unpack-bound expert phase leaves the DMA engine
# idle, which a deeper ring fills with the next layer's dense tiles: 16 MiB (32 tiles of 512 x 512)
# beat 2 MiB by 10% at B = 1 and 15% at B = 8 at 48 layers, 1% on k3-chip.
INFLIGHT_BYTES = {"bf16": 8 * MiB, "mxfp4": 16 * MiB}


@functools.lru_cache(maxsize=64)
def stream_bytes(cfg: K3Config, tile: tuple[int, int], layout: Layout = Layout(), experts: str = "bf16") -> int:
    """HBM bytes one B = 1 step streams with `tile`: every dense matrix's padded tiles and top_k routed
    experts per MoE layer (the plan's matrices, tile padding included)."""
    tk, tn = tile
    total = 0
    for l in range(cfg.layers + 1):
        _, pre, post = _layer_matrices(cfg, l, tk, tn, layout)
        total += sum(m.bytes for m in pre + post)
    gu, down = _expert_matrices(cfg, layout, tile, experts, MK)
    return total + cfg.n_moe * cfg.top_k * (gu.bytes + down.bytes)


def default_tile(cfg: K3Config, layout: Layout = Layout(), experts: str = "bf16") -> tuple[int, int]:
    """The kernel's tile for a model: small models (dim <= 1024) use 512 x 256 (few DMAs in interpret
    mode, and every contraction of `mini` fits one row block, so the kernel's fp32 sums run in the
    same order as the reference's: bit-exact comparisons). MXFP4 experts: 512 x 512, whatever the
    padding, since the unpack bounds that step and takes the fewest bundles per weight on the largest
    tile (`mk.kernel.schedule.DEQUANT_TILE_PACKING`: 1.26x more at 256 x 256). On the TPU v5e this
    was 1.06-1.14x faster than 256 x 256 at 12, 24 and 48 layers (docs/tpu-v5e/2026-12-06h). bf16
    experts: the largest of `TILE_CHOICES` whose step streams within `PADDING_SLACK` of the fewest
    bytes (`stream_bytes`), so 512 x 512 at K3's widths (k3, k3-chip) and 256 x 256 for the thin
    layers of the depth presets."""
    if cfg.dim <= 1024:
        return (512, 256)
    if experts == "mxfp4":
        return TILE_CHOICES[0]
    sizes = {t: stream_bytes(cfg, t, layout, experts) for t in TILE_CHOICES}
    fewest = min(sizes.values())
    return next(t for t in TILE_CHOICES if sizes[t] <= fewest * (1 + PADDING_SLACK))


def default_prefetch_depth(tile: tuple[int, int], experts: str = "bf16") -> int:
    """Tiles in flight by default: as many as fill `INFLIGHT_BYTES[experts]` of bf16 slots (bf16: 16 at
    512 x 512, 64 at 256 x 256; MXFP4: 32 at 512 x 512), at least `DEFAULT_PREFETCH_DEPTH`: the bytes in
    flight, not the count of descriptors, cover the DMA latency and the phases that stream nothing.
    `make_plan` halves it while the plan overflows VMEM."""
    tk, tn = tile
    if experts not in INFLIGHT_BYTES:
        raise PlanError(f"experts must be one of {tuple(INFLIGHT_BYTES)}, found {experts!r}")
    return max(DEFAULT_PREFETCH_DEPTH, INFLIGHT_BYTES[experts] // (tk * tn * BF16_BYTES))


MAX_ROWS = 8   # token rows of one step (sequences x (1 + k)): one sublane tile of matmul rows


def max_drafts(batch: int) -> int:
    """The most draft tokens per sequence a step of `batch` sequences holds: batch x (1 + k) <= MAX_ROWS."""
    return MAX_ROWS // batch - 1


def make_plan(cfg: K3Config, batch: int = 1, *, prefetch_depth: int | None = None,
              num_slots: int | None = None, tile: int | tuple[int, int] | None = None,
              vmem_limit: int | None = None, chip: str = "tpu7x", ctx: int = 256,
              layout: Layout = Layout(), check: bool = True, experts: str = "bf16", k: int = 0,
              aux_layers: Sequence[int] = (), options: ScheduleOptions = MK) -> Plan:
    """Compute the plan; raises PlanError for bad parameters or (if `check`) a VMEM overflow.

    batch: sequences. k: draft tokens per sequence of a speculative verify step (0: plain decode);
    the step runs batch x (1 + k) <= MAX_ROWS rows (`Plan.batch` counts rows). aux_layers: layers
    whose entry prefix p the step copies to its `aux` output (the drafter's context, spec 4.1).

    experts: storage format of the routed experts, "bf16" or "mxfp4" (packed E2M1 codes + E8M0
    scales in HBM, dequantized in VMEM; the checkpoint's own format). Every other matrix is bf16.
    tile None: `default_tile` (the least padding); prefetch_depth None: `default_prefetch_depth`.
    options: the schedule's choices (`ScheduleOptions`); the kernel runs `MK`, other points (the
    seed's schedule, `SEED`) are for the simulator and shape the matrices as that schedule does."""
    if not 1 <= batch <= MAX_ROWS:
        raise PlanError(f"batch must be in 1..{MAX_ROWS}, found {batch}")
    if k < 0:
        raise PlanError(f"k (draft tokens per sequence) must be >= 0, found {k}")
    if k > max_drafts(batch):
        raise PlanError(f"k = {k} drafts: a verify step of batch {batch} x (1 + k) = {batch * (1 + k)} rows "
                        f"exceeds the plan's limit of {MAX_ROWS} rows per step "
                        f"(k <= {max_drafts(batch)} at batch {batch})")
    aux_layers = tuple(int(l) for l in aux_layers)
    bad = [l for l in aux_layers if not 0 < l < cfg.layers]
    if bad or len(set(aux_layers)) != len(aux_layers):
        raise PlanError(f"aux layers {list(aux_layers)}: each must be a distinct layer in 1..{cfg.layers - 1}")
    if chip not in VMEM_BYTES:
        raise PlanError(f"unknown chip {chip!r}: expected one of {sorted(VMEM_BYTES)}")
    if ctx % 128 or ctx <= 0:
        raise PlanError(f"ctx must be a positive multiple of 128, found {ctx}")
    if not isinstance(options, ScheduleOptions):
        raise PlanError(f"options must be a ScheduleOptions (e.g. mk.kernel.plan.MK or SEED), found {options!r}")
    if not layout.single and options.kernel:
        from mk.model.sharding import check_layout
        check_layout(cfg, layout)
    layout.check(cfg)
    if options.attention_heads and (cfg.heads // layout.tp_attn) % options.attention_heads:
        raise PlanError(f"ScheduleOptions.attention_heads = {options.attention_heads} must divide the "
                        f"{cfg.heads // layout.tp_attn} attention heads on a device")
    if experts not in FORMATS:
        raise PlanError(f"experts must be one of {FORMATS}, found {experts!r}")
    tk, tn = (tile, tile) if isinstance(tile, int) else tuple(tile or default_tile(cfg, layout, experts))
    if tk % 128 or tn % 128 or tk <= 0 or tn <= 0:
        raise PlanError(f"tile {tk}x{tn}: both sides must be positive multiples of 128")
    default_depth = prefetch_depth is None and num_slots is None
    prefetch_depth = default_prefetch_depth((tk, tn), experts) if prefetch_depth is None else prefetch_depth
    if prefetch_depth < 0:
        raise PlanError(f"prefetch_depth must be >= 0, found {prefetch_depth}")
    num_slots = prefetch_depth + 1 if num_slots is None else num_slots
    if num_slots < prefetch_depth + 1:
        raise PlanError(f"num_slots ({num_slots}) must be at least prefetch_depth + 1 "
                        f"({prefetch_depth + 1}): a slot is refilled only after its tile is used")
    vmem_limit = vmem_limit or min(DEFAULT_VMEM_LIMIT, VMEM_BYTES[chip])
    if experts == "mxfp4" and options.kernel:
        _check_mxfp4(cfg, tk, layout)
        if options.mxfp4_matmul == "fp8" and chip not in FP8_MXU:
            raise PlanError(f"mxfp4_matmul='fp8' needs an fp8 MXU, which {chip} lacks "
                            f"(chips with one: {', '.join(c for c in FP8_MXU if c != 'cpu')}); use 'bf16'")

    mt = (tk, tn) if options.dma == "tile" else (None, None)       # 'matrix': one tile per matrix
    streams = []
    base = 0
    for l in range(cfg.layers + 1):
        kind, pre, post = _layer_matrices(cfg, l, *mt, layout, options)
        s = LayerStream(l, kind, pre, post, base)
        base += s.pre_tiles + s.post_tiles
        streams.append(s)
    gu, down = _expert_matrices(cfg, layout, mt, experts, options)
    plan = Plan(cfg, batch * (1 + k), prefetch_depth, num_slots, tk, tn, vmem_limit, chip, ctx, layout,
                tuple(streams), gu, down, options=options, seq_rows=1 + k, aux_layers=aux_layers)
    while default_depth and plan.prefetch_depth > DEFAULT_PREFETCH_DEPTH and \
            plan.vmem_planned_bytes > plan.vmem_limit:          # the default ring, halved until it fits
        d = max(DEFAULT_PREFETCH_DEPTH, plan.prefetch_depth // 2)
        plan = dataclasses.replace(plan, prefetch_depth=d, num_slots=d + 1)
    if check:
        plan.check_vmem()
    return plan


def _matrix(name, k, parts, tk, tn, head_pads=None, fmt="bf16", align=128) -> Matrix:
    """A streamed matrix [k, sum of parts]; each part starts on an `align`-lane boundary. tk / tn
    None: one tile holding the whole matrix (a whole-matrix DMA, `ScheduleOptions.dma='matrix'`)."""
    placed, off = [], 0
    for i, (src, width) in enumerate(parts):
        hp = head_pads.get(src) if head_pads else None
        placed.append(Part(src, off, width, hp))
        off += round_up(width, align)
    return Matrix(name, k, off, tuple(placed), tk or k, tn or round_up(off, 128), fmt)


def _expert_matrices(cfg: K3Config, layout: Layout, tile, experts: str, options: ScheduleOptions):
    """One routed expert's [w1 | w3] (latent -> 2 Fe) and w2 (Fe -> latent) on one device (Fe: its
    share of the expert's hidden width). mk's kernel contracts over its gathered latent layout (`lp`
    lanes: N blocks of 128); the seed's kernel and a GPU stack over the latent itself."""
    fe = cfg.expert_hidden // layout.tp_expert
    lp = layout.devices * round_up(cfg.latent // layout.devices, 128)     # the gathered latent width
    k = lp if options.collectives == "merged" and options.program == "megakernel" else cfg.latent
    gu = _matrix("expert.gu", k, [(("moe", "w1"), fe), (("moe", "w3"), fe)], *tile,
                 fmt=options.expert_gate_up or experts)
    down = _matrix("expert.down", fe, [(("moe", "w2"), k)], *tile, fmt=options.expert_down or experts)
    return gu, down


def _check_mxfp4(cfg: K3Config, tk: int, lay: Layout):
    """MXFP4 expert tiles must hold whole 32-row scale groups, in the kernel's word layout."""
    if tk % (MX_GROUP * CODES_PER_WORD):
        raise PlanError(f"MXFP4 experts need tile_k to be a multiple of {MX_GROUP * CODES_PER_WORD} "
                        f"(8 code blocks of whole 32-row scale groups), found {tk}")
    for what, width in (("latent", cfg.latent), ("expert_hidden / tp_expert", cfg.expert_hidden // lay.tp_expert)):
        if width % MX_GROUP:
            raise PlanError(f"MXFP4 experts: {what} = {width} is not a multiple of the scale group "
                            f"{MX_GROUP} (a group would straddle two devices' shares)")
    n = lay.devices
    per = cfg.latent // n
    if per % MX_GROUP and not any(latent_offsets(cfg.latent, n)):
        r = max(range(n), key=lambda r: (r * per) % MX_GROUP)
        raise PlanError(f"MXFP4 experts: latent / devices = {per} is not a multiple of the scale group "
                        f"{MX_GROUP}, and rank {r}'s slice, placed at lane {(r * per) % MX_GROUP} of its "
                        f"{round_up(per, 128)}-lane block so that no scale group straddles two ranks' "
                        f"blocks, would overrun the block (use experts='bf16' or another mesh)")


def _layer_matrices(cfg: K3Config, l: int, tk: int | None, tn: int | None, lay: Layout,
                    options: ScheduleOptions = MK):
    """The matrices layer `l` streams, in consumption order (layer `layers` = the LM head): mk's
    fused layout, or with `options.collectives == 'seed'` the seed kernel's per-rank shapes (spec
    3.2 / 3.4: m_gate a scoped copy of its own, half the router, latent_down 128 columns per rank,
    the latent up-projection by 1024-lane blocks, the dense MLP padded to 1152 and moved in 7 + 3
    row-block slabs)."""
    d, D = cfg.dim, cfg.head_dim
    H = cfg.heads // lay.tp_attn
    HD = H * D
    seed = options.collectives == "seed"
    if l == cfg.layers:
        vocab = cfg.vocab // lay.tp_attn
        return "head", (_matrix("lm_head", d, [(("lm_head", ""), vocab)], tk, tn),), ()
    if cfg.is_mla(l):
        kv_w = cfg.kv_rank + (cfg.k_cache_dim - D)   # k_r padded so [k_nope | k_r | 0] is aligned
        Hn = H
        q_b = (_matrix("mla.q_b", cfg.q_rank, [(("mla", "q_b"), Hn * cfg.k_cache_dim)], tk, tn,
                       {("mla", "q_b"): (Hn, cfg.qk_head_dim, cfg.k_cache_dim)}),
               _matrix("mla.kv_b", cfg.kv_rank, [(("mla", "kv_b"), Hn * 2 * D)], tk, tn))
        if seed:
            attn = (_matrix("mla.in", d, [(("mla", "q_a"), cfg.q_rank), (("mla", "kv_a"), kv_w)], tk, tn),) + q_b + (
                _matrix("mla.gate", d, [(("mla", "g"), HD)], tk, tn),)
        else:
            attn = (_matrix("mla.in", d, [(("mla", "q_a"), cfg.q_rank), (("mla", "kv_a"), kv_w), (("mla", "g"), HD)],
                            tk, tn),) + q_b
        attn += (_matrix("mla.o", HD, [(("mla", "o"), d)], tk, tn),)
        kind = "mla"
    else:
        attn = (
            _matrix("kda.f_a", d, [(("kda", "f_a"), D)], tk, tn),
            _matrix("kda.f_b", D, [(("kda", "f_b"), HD)], tk, tn),
            _matrix("kda.in", d, [(("kda", n), HD) for n in "qkvg"] + [(("kda", "b"), H)], tk, tn),
            _matrix("kda.o", HD, [(("kda", "o"), d)], tk, tn),
        )
        kind = "kda"
    if l == 0:
        F = cfg.dense_hidden // lay.tp_attn
        if seed:
            F = round_up(F, 128)
            slab = lambda k, n: -(-k // n) if tk is None else tk       # spec 3.4: 7 + 3 row-block slabs
            mlp = (_matrix("dense.gate_up", d, [(("dense", "gate"), F), (("dense", "up"), F)], slab(d, 7), tn),
                   _matrix("dense.down", F, [(("dense", "down"), d)], slab(F, 3), tn))
        else:
            mlp = (_matrix("dense.gate_up", d, [(("dense", "gate"), F), (("dense", "up"), F)], tk, tn),
                   _matrix("dense.down", F, [(("dense", "down"), d)], tk, tn))
        return kind + "+dense", attn + mlp, ()
    S = cfg.shared_hidden // lay.tp_attn
    if seed:
        lu_cols = min(round_up(-(-d // lay.lanes_per_host), 1024), d)
        pre = attn + (
            _matrix("moe.router", d, [(("moe", "router"), round_up(-(-cfg.experts // 2), 128))], tk, tn),
            _matrix("moe.latent_down", d, [(("moe", "latent_down"), round_up(-(-cfg.latent // lay.tp_attn), 128))],
                    tk, tn),
            _matrix("moe.shared_gu", d, [(("moe", "shared_gate"), S), (("moe", "shared_up"), S)], tk, tn, align=1),
            _matrix("moe.shared_down", S, [(("moe", "shared_down"), d)], tk, tn),
        )
        return kind + "+moe", pre, (_matrix("moe.latent_up", cfg.latent, [(("moe", "latent_up"), lu_cols)], tk, tn),)
    Lt = cfg.latent // lay.tp_attn                 # this rank's latent slice (all of it on one device)
    pre = attn + (
        _matrix("moe.router", d, [(("moe", "router"), cfg.experts)], tk, tn),
        _matrix("moe.in", d, [(("moe", "latent_down"), Lt), (("moe", "shared_gate"), S),
                              (("moe", "shared_up"), S)], tk, tn),
        _matrix("moe.shared_down", S, [(("moe", "shared_down"), d)], tk, tn),
    )
    post = (_matrix("moe.latent_up", Lt, [(("moe", "latent_up"), d)], tk, tn),)
    return kind + "+moe", pre, post
