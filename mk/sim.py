"""A small deterministic discrete-event simulation of one decode step's schedule.

What is simulated (one device; everything else in the system is symmetric):

- a **DMA engine** of bandwidth `dma_bw` shared equally by all outstanding descriptors
  (processor sharing = the round-robin service of the TPU DMA engine, spec App. B.1/B.2); each
  descriptor first waits a fixed issue-to-first-byte latency `dma_latency` (which does not use
  bandwidth). Weight DMAs, routed-expert DMAs, cache/state reads (`hbm_bytes`) and write-backs
  all share it.
- **compute phases** on one core, strictly in plan order. MXU phases take
  `2 * rows_eff * K * N / peak(dtype)` where `K * N = flops / (2 * rows)` is the weight size and
  `rows_eff = max(round_up(rows, min_rows), mxu_dim)`: at decode batch sizes the MXU is
  weight-push bound (spec App. B.1: "the MXU is weight-push bound, so the wasted rows are free"),
  so a matmul costs as if its LHS had `mxu_dim` rows. Vector phases take
  `max(flops / vector_flops, vector_bytes / vector_bw)`.
- **collectives**: `collective_phases * latency + collective_bytes / link_bw[link]`.
- **VMEM slots**: a DMA may be issued only into a free slot (its previous occupant consumed).

A phase that consumes several DMAs consumes them one by one in index order ("units"): unit j
starts when its DMA has landed and unit j-1 is done, computes its share of the phase (by bytes),
then frees its slot. So a 100-tile matmul streams through a 4-slot ring without deadlock.

Two schedules replay the same plan:

- **megakernel**: one program. DMA i (in issue order) may be issued when (1) every DMA before it
  has been issued, (2) its slot is free, (3) `i <= a + plan.prefetch_depth`, where the anchor `a`
  is the next DMA the current phase will consume, or, while the current phase has none left,
  (the next DMA any later phase consumes) - 1 — so depth 0 fetches each DMA only when its consumer
  runs and depth d keeps d DMAs in flight ahead of the consumer, across layer boundaries — and
  (4) the phase named by its optional `issue_after` has ended. No launch gaps.
- **conventional**: the same phases grouped into kernels (consecutive phases with the same
  `kernel` attribute, or by (layer, sublayer) when absent). Each kernel starts `launch_gap` after
  the previous kernel ended, and no DMA may be issued before the kernel that consumes it starts
  (no cross-kernel prefetch). Rules (1)-(4) still apply inside a kernel.

A fixed per-step overhead (dispatch, XLA glue, barrier) is added to the step time.

THE PLAN INTERFACE (read with getattr, so `mk.plan.Plan` objects work directly)
-------------------------------------------------------------------------------
    plan.config (K3Config), plan.batch (int), plan.prefetch_depth (int), plan.num_slots (int),
    plan.layout (chips, cores_per_chip, tp_attn, ep, tp_expert), plan.dmas, plan.phases
    WeightDMA(index, layer, tensor: str, tile: int, bytes: int, slot: int, phase: int)
        index == position in plan.dmas (issue order); phase = index of the consuming Phase.
        optional: issue_after: int = -1   (phase that must have ENDED before this DMA is issued:
                                           e.g. the lookahead callback after the experts)
    Phase(index, layer, name, kind: 'mxu'|'vector'|'collective', flops, rows, vector_bytes,
          collective_bytes, collective_phases, dmas: tuple[int, ...], expert_dmas: int)
        optional (defaults in parentheses):
          hbm_bytes (0)         non-weight HBM traffic the phase streams itself (caches, states);
                                the phase ends no earlier than that transfer
          writeback_bytes (0)   bytes written back asynchronously when the phase ends
          dtype ('bf16')        MXU rate: 'bf16' | 'fp8' | 'int8' | 'fp4'
          link ('ici')          collective link: 'ici' | 'sibling' | 'nvlink'
          pipelined (False)     compute streams with its own DMAs (a GPU kernel): the phase ends at
                                max(start + compute, its last byte landed) instead of unit by unit
          expert_count (0.0)    expected distinct experts behind `expert_dmas` (chunking)
          expert_slots (())     slot ids the expert chunks cycle through (default: 4 private slots)
          expert_issue_after (-1) phase whose END makes the routing known, releasing the expert
                                DMAs before this phase starts (default: they issue when it starts)
          kernel (None)         conventional-schedule kernel name (default: (layer, sublayer))
          sublayer (None)       'attn' | 'mlp' | 'head' (default: inferred from the name)
          fixed_s (0.0)         extra fixed time (measured per-phase costs)
        `expert_dmas` bytes NOT already covered by the phase's own `dmas` are fetched by the
        phase itself after it starts (data-dependent: the router ran in an earlier phase), in
        `ceil(expert_count)` chunks through `expert_slots`.

`build_plan(config, batch, system=...)` builds such a plan for one device's share of a sharded K3
step from the per-layer byte / FLOP / collective accounting of `mk.roofline` (spec 3.2-3.8 for the
TPU megakernel, a conventional one-kernel-per-op stack for the GPU), so `simulate` works before
`mk.plan` describes sharded steps.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

from mk.config import K3Config
from mk.errors import UserError
from mk import hardware as hwlib
from mk import roofline as rl


class SimError(UserError, ValueError):
    """A plan the simulator cannot replay (inconsistent indices, a deadlock)."""


# ------------------------------------------------------------------------------------------------
# Plan-like objects (for plans built here and for tests)
# ------------------------------------------------------------------------------------------------
# One definition of the schedule records, shared with the kernel's plans.
from mk.plan import Phase, WeightDMA  # noqa: E402


@dataclasses.dataclass
class SimPlan:
    config: K3Config
    batch: int
    prefetch_depth: int
    num_slots: int
    layout: Any
    dmas: list
    phases: list
    name: str = ""
    context: int = 0
    notes: dict = dataclasses.field(default_factory=dict)


# ------------------------------------------------------------------------------------------------
# The machine
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Machine:
    """Per-device rates the simulator uses (see `mk.hardware.System` for their sources)."""
    dma_bw: float
    dma_latency: float = 0.0
    flops: dict = dataclasses.field(default_factory=lambda: {"bf16": 1e15})
    mxu_dim: int = 1
    min_rows: int = 1
    vector_flops: float = 1e13
    vector_bw: float = 1e13
    collective_latency: float = 0.0
    link_bw: dict = dataclasses.field(default_factory=lambda: {"ici": 1e11})
    link_latency: dict = dataclasses.field(default_factory=dict)   # per-link override of collective_latency
    launch_gap: float = 0.0
    step_overhead: float = 0.0
    hbm_bw: float | None = None
    name: str = "machine"

    @classmethod
    def from_system(cls, s: hwlib.System) -> "Machine":
        return cls(dma_bw=s.dma_bw, dma_latency=s.dma_latency, flops=dict(s.flops), mxu_dim=s.mxu_dim,
                   min_rows=s.min_rows, vector_flops=s.vector_flops, vector_bw=s.vector_bw,
                   collective_latency=s.collective_latency, link_bw=dict(s.link_bw),
                   link_latency=dict(s.link_latency), launch_gap=s.launch_gap,
                   step_overhead=s.step_overhead, hbm_bw=s.hbm_bw, name=s.name)

    def peak(self, dtype: str) -> float:
        if dtype in self.flops and self.flops[dtype] > 0:
            return self.flops[dtype]
        if dtype == "fp4" and self.flops.get("fp8"):
            return self.flops["fp8"]
        return self.flops["bf16"]

    def compute_time(self, ph) -> float:
        kind = ph.kind
        fixed = float(getattr(ph, "fixed_s", 0.0) or 0.0)
        if kind == "mxu":
            flops, rows = float(ph.flops), int(getattr(ph, "rows", 0) or 0)
            peak = self.peak(getattr(ph, "dtype", "bf16") or "bf16")
            if rows <= 0:
                return flops / peak + fixed
            rows_eff = max(-(-rows // self.min_rows) * self.min_rows, self.mxu_dim)
            return flops * rows_eff / rows / peak + fixed
        if kind == "vector":
            return max(float(ph.flops) / self.vector_flops,
                       float(getattr(ph, "vector_bytes", 0) or 0) / self.vector_bw) + fixed
        if kind == "collective":
            link = getattr(ph, "link", "ici") or "ici"
            bw = self.link_bw.get(link) or next(iter(self.link_bw.values()))
            lat = self.link_latency.get(link, self.collective_latency)
            return int(ph.collective_phases) * lat + float(ph.collective_bytes) / bw + fixed
        raise SimError(f"phase {ph.index} ({ph.name}): unknown kind {kind!r}; expected 'mxu', 'vector' or 'collective'")


def as_machine(m) -> Machine:
    if isinstance(m, Machine):
        return m
    if isinstance(m, hwlib.System):
        return Machine.from_system(m)
    if isinstance(m, str):
        return Machine.from_system(hwlib.get_system(m))
    raise SimError(f"expected a Machine, a hardware.System or a system name, found {m!r}")


# ------------------------------------------------------------------------------------------------
# Result
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class SimResult:
    schedule: str
    batch: int
    step_time: float                  # s, including the fixed per-step overhead
    kernel_time: float                # s, first phase start .. last phase end (and write-backs)
    bytes_moved: float                # through the DMA engine
    timeline: dict                    # engine -> [(start, end, label)]: 'dma' (busy spans),
                                      # 'descriptors', 'compute', 'collective', 'launch'
    phase_times: list                 # (index, layer, name, kind, start, end): start = when the phase
                                      # became current (time waiting for its DMAs included)
    hbm_bw: float | None
    overhead: float

    @property
    def tokens_per_s(self) -> float:
        return self.batch / self.step_time

    @property
    def hbm_roofline_time(self) -> float:
        return self.bytes_moved / self.hbm_bw if self.hbm_bw else float("nan")

    @property
    def roofline_fraction(self) -> float:
        """HBM-roofline time of the bytes moved / the step time."""
        return self.hbm_roofline_time / self.step_time

    def busy(self, engine: str) -> float:
        return sum(e - s for s, e, _ in self.timeline.get(engine, ()))

    def time_by(self, key: str = "name") -> dict[str, float]:
        """Phase time summed by phase name (or 'kind', 'layer')."""
        idx = {"name": 2, "kind": 3, "layer": 1}[key]
        out: dict = {}
        for row in self.phase_times:
            out[row[idx]] = out.get(row[idx], 0.0) + row[5] - row[4]
        return out

    def summary(self) -> dict:
        return {
            "schedule": self.schedule, "batch": self.batch, "step_time_s": self.step_time,
            "tokens_per_s": self.tokens_per_s, "kernel_time_s": self.kernel_time, "overhead_s": self.overhead,
            "bytes_moved": self.bytes_moved, "hbm_roofline_fraction": self.roofline_fraction,
            "dma_busy_s": self.busy("dma"), "compute_busy_s": self.busy("compute"),
            "collective_busy_s": self.busy("collective"), "launch_gaps_s": self.busy("launch"),
        }


# ------------------------------------------------------------------------------------------------
# The simulator
# ------------------------------------------------------------------------------------------------
_MLP_PREFIXES = ("mlp", "moe", "router", "routing", "topk", "expert", "latent", "shared", "dense", "ffn")
_HEAD_PREFIXES = ("final", "lm_head", "head", "logits", "sample")


def sublayer_of(ph) -> str:
    s = getattr(ph, "sublayer", None)
    if s:
        return s
    name = ph.name.lower()
    if name.startswith(_HEAD_PREFIXES):
        return "head"
    if name.startswith(_MLP_PREFIXES):
        return "mlp"
    return "attn"


class _Desc:
    __slots__ = ("id", "label", "bytes", "remaining", "slot", "issue_t", "start_t", "done_t", "consumed")

    def __init__(self, id_, label, nbytes, slot):
        self.id, self.label, self.bytes, self.remaining, self.slot = id_, label, float(nbytes), float(nbytes), slot
        self.issue_t = self.start_t = self.done_t = None
        self.consumed = False


_EPS_BYTES = 1e-3


def simulate(plan, machine="tpu-v7x16", schedule: str = "megakernel", *, launch_gap: float | None = None,
             step_overhead: float | None = None, record: bool = True) -> SimResult:
    """Replay `plan` on `machine` (a `Machine`, a `hardware.System` or a system name).
    Deterministic: the same inputs give the same result."""
    if schedule not in ("megakernel", "conventional"):
        raise SimError(f"schedule must be 'megakernel' or 'conventional', found {schedule!r}")
    m = as_machine(machine)
    gap = m.launch_gap if launch_gap is None else launch_gap
    overhead = m.step_overhead if step_overhead is None else step_overhead
    phases = list(plan.phases)
    dmas = list(plan.dmas)
    depth = int(plan.prefetch_depth)
    if depth < 0:
        raise SimError(f"plan.prefetch_depth must be >= 0, found {depth}")
    nP = len(phases)

    # ---- validate and index ---------------------------------------------------------------
    for i, d in enumerate(dmas):
        if d.index != i:
            raise SimError(f"plan.dmas[{i}].index is {d.index}: dmas must be listed in issue order with index == position")
        if not 0 <= d.phase < nP:
            raise SimError(f"plan.dmas[{i}] ({d.tensor}): phase {d.phase} is not a phase index (0..{nP - 1})")
        ia = getattr(d, "issue_after", -1)
        if ia is not None and ia >= nP:
            raise SimError(f"plan.dmas[{i}] ({d.tensor}): issue_after {ia} is not a phase index")
    for j, ph in enumerate(phases):
        if ph.index != j:
            raise SimError(f"plan.phases[{j}].index is {ph.index}: phases must be listed in order with index == position")
    units: list[list[int]] = [[] for _ in range(nP)]
    for d in dmas:
        units[d.phase].append(d.index)
    for j, ph in enumerate(phases):
        listed = tuple(getattr(ph, "dmas", ()) or ())
        if listed and sorted(listed) != units[j]:
            raise SimError(f"phase {j} ({ph.name}) lists dmas {list(listed)[:8]} but the dmas naming it as "
                           f"consumer are {units[j][:8]}")
        if units[j] and j > 0 and units[j - 1] and units[j][0] < units[j - 1][-1]:
            raise SimError(f"phase {j} ({ph.name}): its dmas must come after those of phase {j - 1} in issue order")

    # kernels for the conventional schedule
    kernel_of = [0] * nP
    kernel_first = []
    prev_key = object()
    for j, ph in enumerate(phases):
        key = getattr(ph, "kernel", None) or (ph.layer, sublayer_of(ph))
        if key != prev_key:
            kernel_first.append(j)
            prev_key = key
        kernel_of[j] = len(kernel_first) - 1
    conventional = schedule == "conventional"

    compute = [m.compute_time(ph) for ph in phases]
    # issue order: plan order for the megakernel; in the conventional schedule each kernel issues
    # its own DMAs, so the queue is ordered by consuming kernel (stable within a kernel)
    order = list(range(len(dmas)))
    if conventional:
        order.sort(key=lambda i: (kernel_of[dmas[i].phase], i))

    # ---- state ----------------------------------------------------------------------------
    desc: list[_Desc] = [_Desc(d.index, f"L{d.layer}:{d.tensor}#{d.tile}", d.bytes, d.slot) for d in dmas]
    extra: list[_Desc] = []                      # expert chunks, hbm streams, write-backs
    slot_busy: dict = {}                         # slot -> _Desc occupying it
    active: list[_Desc] = []                     # transferring
    latent: list[_Desc] = []                     # issued, inside their fixed latency
    next_issue = 0
    phase_end = [None] * nP
    phase_start = [None] * nP
    kernel_started = [False] * len(kernel_first)
    kernel_ready = [None] * len(kernel_first)
    kernel_ready[0] = gap if conventional else 0.0
    lowest_unconsumed = 0
    t = 0.0
    timeline = {"dma": [], "descriptors": [], "compute": [], "collective": [], "launch": []}
    if conventional and gap > 0:
        timeline["launch"].append((0.0, gap, f"launch k0"))
    dma_busy_since = None

    # current phase execution state
    p = 0
    cur_units: list[_Desc] = []
    cur_shares: list[float] = []
    cur_u = 0
    unit_end = None                 # end time of the unit being computed
    unit_label = ""
    chunks: dict[int, list[_Desc]] = {}          # phase -> its routed-expert chunks
    expert_queue: list[_Desc] = []               # released, not yet issued (in order)
    cur_stream: _Desc | None = None
    pipelined_end = None
    release_at: dict[int, list[int]] = {}
    if not conventional:
        for j, ph in enumerate(phases):
            q = getattr(ph, "expert_issue_after", -1)
            if q is not None and 0 <= q < j:
                release_at.setdefault(q, []).append(j)

    def make_chunks(j: int) -> list[_Desc]:
        if j in chunks:
            return chunks[j]
        ph = phases[j]
        static = sum(desc[i].bytes for i in units[j])
        ex_total = float(getattr(ph, "expert_dmas", 0) or 0) - static
        out: list[_Desc] = []
        if ex_total > _EPS_BYTES:
            cnt = float(getattr(ph, "expert_count", 0.0) or 0.0)
            pipelined = bool(getattr(ph, "pipelined", False))
            if pipelined or cnt <= 0:
                sizes = [ex_total]
            else:
                per = ex_total / cnt
                full = int(math.floor(cnt + 1e-9))
                sizes = [per] * full
                rest = ex_total - per * full
                if rest > _EPS_BYTES:
                    sizes.append(rest)
            slots = tuple(getattr(ph, "expert_slots", ()) or ())
            ids = [None] if pipelined else (list(slots) if slots else [("_expert", j, k) for k in range(4)])
            for k, sz in enumerate(sizes):
                dsc = _Desc(("e", j, k), f"L{ph.layer}:expert#{k}", sz, ids[k % len(ids)])
                extra.append(dsc)
                out.append(dsc)
        chunks[j] = out
        expert_queue.extend(out)
        return out

    def issue(dsc: _Desc, now: float):
        dsc.issue_t = now
        dsc.start_t = now + m.dma_latency
        if dsc.slot is not None:
            slot_busy[dsc.slot] = dsc
        if m.dma_latency > 0:
            latent.append(dsc)
        else:
            active.append(dsc)
        if dsc.remaining <= _EPS_BYTES:
            dsc.remaining = 0.0

    def anchor() -> int:
        nonlocal lowest_unconsumed
        while lowest_unconsumed < len(desc) and desc[lowest_unconsumed].consumed:
            lowest_unconsumed += 1
        c = lowest_unconsumed
        if c >= len(desc):
            return len(desc)
        return c if dmas[c].phase == p else c - 1

    def try_issue(now: float) -> bool:
        nonlocal next_issue
        changed = False
        # released routed-expert chunks first (data-dependent: the phase is waiting for them)
        while expert_queue:
            dsc = expert_queue[0]
            if dsc.slot is not None and slot_busy.get(dsc.slot) is not None:
                break
            issue(dsc, now)
            expert_queue.pop(0)
            changed = True
        a = anchor() if p < nP else len(desc)
        while next_issue < len(order):
            d = dmas[order[next_issue]]
            if d.index > a + depth:
                break
            if slot_busy.get(d.slot) is not None:
                break
            ia = getattr(d, "issue_after", -1)
            if ia is not None and ia >= 0 and phase_end[ia] is None:
                break
            if conventional and not kernel_started[kernel_of[d.phase]]:
                break
            issue(desc[d.index], now)
            next_issue += 1
            changed = True
        return changed

    def landed(dsc: _Desc) -> bool:
        return dsc.done_t is not None

    def start_phase(now: float):
        nonlocal cur_units, cur_shares, cur_u, unit_end, cur_stream, pipelined_end
        ph = phases[p]
        phase_start[p] = now
        if conventional and kernel_first[kernel_of[p]] == p:
            kernel_started[kernel_of[p]] = True
        static = [desc[i] for i in units[p]]
        ex_chunks = make_chunks(p)
        cur_stream = None
        hb = float(getattr(ph, "hbm_bytes", 0) or 0)
        if hb > 0:
            cur_stream = _Desc(("h", p), f"L{ph.layer}:{ph.name}:hbm", hb, None)
            extra.append(cur_stream)
            issue(cur_stream, now)
        cur_units = static + ex_chunks
        tot = sum(x.bytes for x in cur_units)
        if cur_units and tot > 0:
            cur_shares = [compute[p] * x.bytes / tot for x in cur_units]
        elif cur_units:
            cur_shares = [compute[p] / len(cur_units)] * len(cur_units)
        else:
            cur_shares = []
        cur_u = 0
        unit_end = None
        pipelined_end = now + compute[p] if getattr(ph, "pipelined", False) else None
        if not cur_units and pipelined_end is None:
            unit_end = now + compute[p]      # compute-only phase
            record_compute(now, unit_end)

    def record_compute(s, e):
        if record and e > s:
            ph = phases[p]
            eng = "collective" if ph.kind == "collective" else "compute"
            timeline[eng].append((s, e, f"L{ph.layer}:{ph.name}"))

    def end_phase(now: float):
        nonlocal p, cur_units, unit_end, pipelined_end, cur_stream
        ph = phases[p]
        phase_end[p] = now
        for dsc in cur_units:
            dsc.consumed = True
            if dsc.slot is not None and slot_busy.get(dsc.slot) is dsc:
                slot_busy[dsc.slot] = None
        wb = float(getattr(ph, "writeback_bytes", 0) or 0)
        if wb > 0:
            w = _Desc(("w", p), f"L{ph.layer}:{ph.name}:writeback", wb, None)
            extra.append(w)
            issue(w, now)
        for j in release_at.get(p, ()):                 # routing known: release expert DMAs
            make_chunks(j)
        p += 1
        cur_units, unit_end, pipelined_end, cur_stream = [], None, None, None
        if p < nP and conventional and kernel_first[kernel_of[p]] == p:
            kernel_ready[kernel_of[p]] = now + gap
            if record and gap > 0:
                timeline["launch"].append((now, now + gap, f"launch k{kernel_of[p]}"))

    def advance_phase(now: float) -> bool:
        """Start/progress/end the current phase at time `now`. Returns True if anything changed."""
        nonlocal cur_u, unit_end, unit_label
        if p >= nP:
            return False
        ph = phases[p]
        if phase_start[p] is None:
            if conventional and kernel_first[kernel_of[p]] == p and now + 1e-15 < kernel_ready[kernel_of[p]]:
                return False
            start_phase(now)
            return True
        changed = False
        if pipelined_end is not None:
            if now + 1e-15 >= pipelined_end and all(landed(x) for x in cur_units) and \
                    (cur_stream is None or landed(cur_stream)):
                record_compute(phase_start[p], now)
                end_phase(now)
                return True
            return False
        # unit-by-unit
        if unit_end is not None and now + 1e-15 >= unit_end:
            if cur_units:
                dsc = cur_units[cur_u]
                dsc.consumed = True
                if dsc.slot is not None and slot_busy.get(dsc.slot) is dsc:
                    slot_busy[dsc.slot] = None
                cur_u += 1
            else:
                cur_u = 1
            unit_end = None
            changed = True
        if unit_end is None:
            n_units = max(1, len(cur_units))
            if cur_u >= n_units:
                if cur_stream is None or landed(cur_stream):
                    end_phase(now)
                    return True
                return changed
            dsc = cur_units[cur_u]
            if landed(dsc):
                unit_end = now + cur_shares[cur_u]
                record_compute(now, unit_end)
                changed = True
        return changed

    # ---- main loop --------------------------------------------------------------------------
    guard = 0
    while p < nP:
        guard += 1
        if guard > 50_000_000:
            raise SimError("simulation did not converge")
        # react at time t until nothing changes
        while True:
            c1 = try_issue(t)
            c2 = advance_phase(t)
            if p >= nP:
                break
            if not (c1 or c2):
                break
        if p >= nP:
            break
        # next event
        cands = []
        if active:
            share = m.dma_bw / len(active)
            cands.append(t + min(d.remaining for d in active) / share)
        if latent:
            cands.append(min(d.start_t for d in latent))
        if unit_end is not None:
            cands.append(unit_end)
        if pipelined_end is not None and pipelined_end > t:
            cands.append(pipelined_end)
        if conventional and phase_start[p] is None:
            kr = kernel_ready[kernel_of[p]]
            if kr is not None and kr > t:
                cands.append(kr)
        if not cands:
            raise SimError(_deadlock_message(plan, p, order[next_issue] if next_issue < len(order) else len(dmas),
                                             dmas, slot_busy, phase_end, depth, anchor()))
        t_next = max(t, min(cands))
        if record and active and dma_busy_since is None:
            dma_busy_since = t
        # progress transfers
        if active:
            share = m.dma_bw / len(active)
            moved = share * (t_next - t)
            still = []
            for d in active:
                d.remaining -= moved
                if d.remaining <= _EPS_BYTES * max(1.0, d.bytes * 1e-9):
                    d.remaining = 0.0
                    d.done_t = t_next
                    if record:
                        timeline["descriptors"].append((d.start_t, t_next, d.label))
                else:
                    still.append(d)
            active[:] = still
        if latent:
            keep = []
            for d in latent:
                if d.start_t <= t_next + 1e-15:
                    if d.remaining <= 0:
                        d.done_t = max(t_next, d.start_t)
                    else:
                        active.append(d)
                else:
                    keep.append(d)
            latent[:] = keep
        # DMA busy spans
        if record and not active and dma_busy_since is not None:
            timeline["dma"].append((dma_busy_since, t_next, "busy"))
            dma_busy_since = None
        t = t_next
    # drain write-backs (they extend the step: the next step's reads would queue behind them)
    end_compute = t
    pend = [d for d in active + latent if d.done_t is None]
    while pend:
        cands = []
        if active:
            share = m.dma_bw / len(active)
            cands.append(t + min(d.remaining for d in active) / share)
        if latent:
            cands.append(min(d.start_t for d in latent))
        t_next = min(cands)
        if record and active and dma_busy_since is None:
            dma_busy_since = t
        if active:
            moved = m.dma_bw / len(active) * (t_next - t)
            still = []
            for d in active:
                d.remaining -= moved
                if d.remaining <= _EPS_BYTES:
                    d.done_t = t_next
                else:
                    still.append(d)
            active[:] = still
        keep = []
        for d in latent:
            if d.start_t <= t_next + 1e-15:
                active.append(d)
            else:
                keep.append(d)
        latent[:] = keep
        t = t_next
        pend = [d for d in active + latent if d.done_t is None]
    if record and dma_busy_since is not None:
        timeline["dma"].append((dma_busy_since, t, "busy"))
    kernel_time = max(t, end_compute)
    moved = sum(d.bytes for d in desc) + sum(d.bytes for d in extra)
    rows = [(j, phases[j].layer, phases[j].name, phases[j].kind, phase_start[j], phase_end[j]) for j in range(nP)]
    return SimResult(schedule, int(plan.batch), kernel_time + overhead, kernel_time, moved, timeline, rows,
                     m.hbm_bw, overhead)


def _deadlock_message(plan, p, next_issue, dmas, slot_busy, phase_end, depth, anchor) -> str:
    ph = plan.phases[p]
    msg = f"deadlock at phase {p} ({ph.name}, layer {ph.layer})"
    if next_issue < len(dmas):
        d = dmas[next_issue]
        why = []
        if next_issue > anchor + depth:
            why.append(f"outside the prefetch window (anchor {anchor} + depth {depth})")
        occ = slot_busy.get(d.slot)
        if occ is not None:
            why.append(f"slot {d.slot} held by {occ.label}")
        ia = getattr(d, "issue_after", -1)
        if ia is not None and ia >= 0 and phase_end[ia] is None:
            why.append(f"issue_after phase {ia} has not ended")
        msg += (f"; next DMA {next_issue} ({d.tensor}, for phase {d.phase}) cannot issue: "
                + ("; ".join(why) or "its consumer's kernel has not started"))
    return msg


# ------------------------------------------------------------------------------------------------
# Plans for one device's share of a sharded K3 step
# ------------------------------------------------------------------------------------------------
class _Builder:
    def __init__(self):
        self.dmas: list[dict] = []
        self.phases: list[dict] = []
        self.slots: dict[str, int] = {}
        self.waiting: dict[tuple, list[int]] = {}

    def slot(self, name: str) -> int:
        return self.slots.setdefault(name, len(self.slots))

    def dma(self, layer, tensor, nbytes, slot, issue_after=-1, key=None, tile=0):
        """Add a DMA (in issue order); its consumer is bound later by `phase(..., consumes=[key])`."""
        i = len(self.dmas)
        self.dmas.append(dict(index=i, layer=layer, tensor=tensor, tile=tile, bytes=int(round(nbytes)),
                              slot=self.slot(slot) if isinstance(slot, str) else slot, phase=None,
                              issue_after=issue_after))
        self.waiting.setdefault(key or (layer, tensor), []).append(i)
        return i

    def phase(self, layer, name, kind, consumes=(), **kw) -> int:
        j = len(self.phases)
        ids = []
        for key in consumes:
            for i in self.waiting.pop(key, []):
                self.dmas[i]["phase"] = j
                ids.append(i)
        self.phases.append(dict(index=j, layer=layer, name=name, kind=kind, dmas=tuple(sorted(ids)), **kw))
        return j

    def build(self, **plan_kw) -> SimPlan:
        unbound = [d for d in self.dmas if d["phase"] is None]
        if unbound:
            raise SimError(f"plan builder: DMAs without a consumer: {[d['tensor'] for d in unbound[:5]]}")
        # issue order must follow consumption order for the in-order engine; stable sort by
        # (position) is already issue order — check monotone consumers per phase group
        dmas = [WeightDMA(**d) for d in self.dmas]
        phases = [Phase(**{k: v for k, v in p.items()}) for p in self.phases]
        return SimPlan(dmas=dmas, phases=phases, num_slots=len(self.slots), **plan_kw)


GPU_WHATIF_DEPTH = 4      # DMAs in flight ahead of the consumer if the GPU plan ran as one program
DEFAULT_CONTEXT = 512     # mean attended tokens over the benchmark's 1024 generated tokens (spec 6.1)


def build_plan(cfg: K3Config, batch: int, layout: Any = None, system: "str | hwlib.System" = "tpu-v7x16",
               context: int = DEFAULT_CONTEXT, formats: rl.WeightFormats | None = None,
               straggler: bool = True, prefetch_depth: int | None = None) -> SimPlan:
    """A plan for one device's share of a sharded K3 decode step, from the roofline accounting.

    TPU style (`layout.style == 'tpu'`): the K3 megakernel's schedule (spec 3.4): attention
    projections, norms/vectors, KDA state (B <= 4) and the router half of layer l+1 are issued by
    the lookahead right after layer l's routed experts; MLA's scoped projections at the MLA
    sublayer start; latent_down / shared at MoE entry; latent_up when the reductions begin;
    routed experts through the 4 expert slots aliasing the attention pool; the collectives of
    spec 3.8 as latency-bound phases; the LM head in XLA after the kernel.
    GPU style: one kernel per op as a conventional serving stack launches them (see
    `_gpu_plan`); weights stream inside each kernel (`pipelined`).
    """
    sys_ = system if isinstance(system, hwlib.System) else hwlib.get_system(system)
    layout = rl.as_layout(layout) if layout is not None else rl.SYSTEM_LAYOUTS.get(sys_.name, rl.SEED_TPU_LAYOUT)
    formats = formats or rl.SYSTEM_FORMATS.get(sys_.name, rl.TPU_SEED_FORMATS)
    if not 1 <= batch <= 64:
        raise SimError(f"batch must be in 1..64, found {batch}")
    acc = rl.step_accounting(cfg, batch, context, layout, formats, straggler)
    if layout.style == "tpu":
        plan = _tpu_plan(cfg, batch, layout, acc, context)
    else:
        plan = _gpu_plan(cfg, batch, layout, acc, context)
    if prefetch_depth is not None:
        plan.prefetch_depth = prefetch_depth
    plan.notes.update(system=sys_.name, formats=dataclasses.asdict(formats), straggler=straggler,
                      experts_per_layer=acc["experts_per_layer"], expert_count=dataclasses.asdict(acc["expert_count"]))
    return plan


def _tensor_map(acc) -> dict[str, rl.TensorShare]:
    return {t.name: t for ts in acc["tensors"].values() for t in ts}


def _mix_flops(cfg, B, n_blocks):
    return B * (n_blocks + 1) * cfg.dim * 8 + B * cfg.dim * 4


def _tpu_plan(cfg: K3Config, B: int, layout: rl.ParallelLayout, acc: dict, context: int) -> SimPlan:
    T = _tensor_map(acc)
    colls = acc["collectives"]
    mb = hwlib.load_microbench()
    routing_s = mb.get("tpu-v7", "routing_per_layer")
    hpr = cfg.heads // layout.tp_attn
    D = cfg.head_dim
    st = acc["state"]
    kda_state_b = st["kda_state_read"] / cfg.n_kda          # per KDA layer, all B rows
    cache_read_b = st["mla_cache_read"] / cfg.n_mla
    cache_commit_b = st["mla_cache_write"] / cfg.n_mla
    ex = acc["expert"]
    n_exp = acc["experts_per_layer"]
    persistent_state = B <= 4                               # spec 3.6
    b = _Builder()
    pool = ["pool0", "pool1", "pool2", "pool3"]
    vec_layer = T["layer.vectors"].bytes

    def flops_of(t: rl.TensorShare) -> int:
        return 2 * B * t.elements

    def prefetch_layer(l: int, issue_after: int):
        """The lookahead: everything layer l needs before its first matmul (spec 3.4)."""
        b.dma(l, "vec.attn", vec_layer / 2 + (T["kda.aux"].bytes if not cfg.is_mla(l) else T["mla.norms"].bytes),
              "vecA", issue_after)
        b.dma(l, "vec.mlp", vec_layer / 2 + (T["moe.vectors"].bytes if l >= 1 else 0), "vecB", issue_after)
        if cfg.is_mla(l):
            b.dma(l, "mla.m_qa", T["mla.m_qa"].bytes, pool[0], issue_after)
            b.dma(l, "mla.m_ka", T["mla.m_ka"].bytes, pool[1], issue_after)
        else:
            b.dma(l, "kda.k_gate", T["kda.k_gate"].bytes, pool[0], issue_after)
            b.dma(l, "kda.k_fb", T["kda.k_fb"].bytes, pool[1], issue_after)
            b.dma(l, "kda.k_projection", T["kda.k_projection"].bytes, pool[2], issue_after)
            b.dma(l, "kda.k_o", T["kda.k_o"].bytes, pool[3], issue_after)
            if persistent_state:
                b.dma(l, "kda.state", kda_state_b, "kstate", issue_after)
        if l >= 1:
            b.dma(l, "moe.router_half", T["moe.router_half"].bytes, "router", issue_after)

    def coll(l, c: rl.Collective):
        return b.phase(l, c.name, "collective", collective_phases=c.phases, collective_bytes=int(round(c.bytes)),
                       link=c.link, sublayer="mlp" if c.sublayer in ("mlp", "dense") else c.sublayer)

    prefetch_layer(0, -1)
    for l in range(cfg.layers):
        mla = cfg.is_mla(l)
        attn_res = b.phase(l, "attn_res", "vector", consumes=[(l, "vec.attn")],
                           flops=_mix_flops(cfg, B, cfg.n_attn_blocks(l)),
                           vector_bytes=(cfg.n_attn_blocks(l) + 2) * B * cfg.dim * 4, rows=B)
        if mla:
            for name in ("mla.m_qb", "mla.m_kb", "mla.m_gate", "mla.m_o"):
                b.dma(l, name, T[name].bytes, name, attn_res)
            tq, tk = T["mla.m_qa"], T["mla.m_ka"]
            b.phase(l, "mla.in", "mxu", consumes=[(l, "mla.m_qa"), (l, "mla.m_ka")],
                    flops=flops_of(tq) + flops_of(tk), rows=B)
            b.phase(l, "mla.q_b+kv_b", "mxu", consumes=[(l, "mla.m_qb"), (l, "mla.m_kb")],
                    flops=flops_of(T["mla.m_qb"]) + flops_of(T["mla.m_kb"]), rows=B)
            b.phase(l, "mla.gate", "mxu", consumes=[(l, "mla.m_gate")], flops=flops_of(T["mla.m_gate"]), rows=B)
            b.phase(l, "mla.attention", "vector", hbm_bytes=int(cache_read_b),
                    flops=2 * B * hpr * (context + 64) * (cfg.qk_head_dim + D) + 5 * B * hpr * (context + 64),
                    vector_bytes=int(cache_read_b), rows=B)
            b.phase(l, "mla.commit", "vector", hbm_bytes=int(cache_commit_b), vector_bytes=int(cache_commit_b), rows=B)
            out_t = "mla.m_o"
        else:
            if not persistent_state:
                b.dma(l, "kda.state", kda_state_b, "kstate", attn_res)
            b.phase(l, "kda.gate", "mxu", consumes=[(l, "kda.k_gate"), (l, "kda.k_fb")],
                    flops=flops_of(T["kda.k_gate"]) + flops_of(T["kda.k_fb"]), rows=B)
            b.phase(l, "kda.proj", "mxu", consumes=[(l, "kda.k_projection")],
                    flops=flops_of(T["kda.k_projection"]), rows=B)
            b.phase(l, "kda.recurrence", "vector", consumes=[(l, "kda.state")],
                    flops=B * hpr * D * D * 10 + B * 3 * hpr * D * (cfg.conv_size * 2 + 8),
                    vector_bytes=int(3 * kda_state_b), writeback_bytes=int(kda_state_b), rows=B)
            out_t = "kda.k_o"
        attn_colls = colls["attn"]
        coll(l, attn_colls[0])                                     # pair exchange of features
        b.phase(l, out_t.replace("kda.k_", "kda.").replace("mla.m_", "mla."), "mxu", consumes=[(l, out_t)],
                flops=flops_of(T[out_t]), rows=B)
        last_attn = None
        for c in attn_colls[1:]:
            last_attn = coll(l, c)
        # ---- channel mixer -----------------------------------------------------------------
        if l == 0:
            mlp_res = b.phase(l, "mlp_res", "vector", consumes=[(l, "vec.mlp")],
                              flops=_mix_flops(cfg, B, cfg.n_mlp_blocks(l)),
                              vector_bytes=(cfg.n_mlp_blocks(l) + 2) * B * cfg.dim * 4, rows=B)
            gu, dn = T["dense.gate_up"], T["dense.down"]
            slabs = [("dense.gate_up", gu.bytes / 7)] * 7 + [("dense.down", dn.bytes / 3)] * 3   # spec 3.4
            for k, (name, nb) in enumerate(slabs):
                b.dma(l, name, nb, pool[k % 4], last_attn, key=(l, "dense"), tile=k)
            dense = b.phase(l, "dense_mlp", "mxu", consumes=[(l, "dense")],
                            flops=flops_of(gu) + flops_of(dn), rows=B)
            prefetch_layer(1, dense)
            for c in colls["dense"]:
                coll(l, c)
            continue
        mlp_res = b.phase(l, "mlp_res", "vector", consumes=[(l, "vec.mlp")],
                          flops=_mix_flops(cfg, B, cfg.n_mlp_blocks(l)),
                          vector_bytes=(cfg.n_mlp_blocks(l) + 2) * B * cfg.dim * 4, rows=B)
        for name in ("moe.latent_down", "moe.shared_gu", "moe.shared_down"):
            b.dma(l, name, T[name].bytes, name, last_attn)                   # at MoE entry
        moe_c = {c.name: c for c in colls["moe"]}
        b.phase(l, "moe.router", "mxu", consumes=[(l, "moe.router_half")], flops=flops_of(T["moe.router_half"]), rows=B)
        xchg = coll(l, moe_c["router_exchange"])
        topk = b.phase(l, "moe.topk", "vector", flops=B * cfg.top_k * cfg.experts * 4, fixed_s=routing_s, rows=B)
        b.phase(l, "moe.latent_down", "mxu", consumes=[(l, "moe.latent_down")], flops=flops_of(T["moe.latent_down"]), rows=B)
        coll(l, moe_c["latent_gather"])
        # the shared experts need only m: computed while the routed-expert DMAs land
        b.phase(l, "moe.shared", "mxu", consumes=[(l, "moe.shared_gu"), (l, "moe.shared_down")],
                flops=flops_of(T["moe.shared_gu"]) + flops_of(T["moe.shared_down"]), rows=B)
        # spec 3.4: at B = 1 (shared routes) each local expert's copy is issued the moment the top-k
        # loop selects it (~ as top-k starts); otherwise the first copies right after routing.
        experts = b.phase(l, "moe.experts", "mxu", dtype="fp8", rows=1,      # ~1 row per distinct expert
                          flops=int(round(2 * n_exp * ex["elements"])),
                          expert_dmas=int(round(n_exp * ex["total"])), expert_count=n_exp,
                          expert_slots=tuple(b.slot(s) for s in pool),
                          expert_issue_after=xchg if B == 1 else topk)
        # the lookahead callback fires here (expert slots free): latent_up and layer l+1
        b.dma(l, "moe.latent_up", T["moe.latent_up"].bytes, "moe.latent_up", experts)
        if l + 1 < cfg.layers:
            prefetch_layer(l + 1, experts)
        else:
            b.dma(l, "lm_head", T["lm_head"].bytes, "lm_head", experts, key=("head", "lm_head"))
        for c in colls["moe"]:
            if c.name.startswith("moe_reduce") or c.name == "moe_gather_local":
                coll(l, c)
        b.phase(l, "moe.latent_up", "mxu", consumes=[(l, "moe.latent_up")], flops=flops_of(T["moe.latent_up"]), rows=B)
        for c in colls["moe"]:
            if c.name in ("moe_output_gather", "pre_attn_gather"):
                coll(l, c)
    L = cfg.layers
    b.phase(L, "final_mix", "vector", flops=_mix_flops(cfg, B, cfg.n_blocks), sublayer="head",
            vector_bytes=(cfg.n_blocks + 2) * B * cfg.dim * 4, rows=B)
    # XLA after the kernel: the LM head streams its shard; the DMA was issued as a placeholder
    # above only to keep issue order; it may not start before the kernel ends.
    head_dma = b.waiting[("head", "lm_head")][0]
    b.dmas[head_dma]["issue_after"] = len(b.phases) - 1
    b.phase(L, "lm_head", "mxu", consumes=[("head", "lm_head")], flops=flops_of(T["lm_head"]), rows=B,
            pipelined=True, sublayer="head")
    return b.build(config=cfg, batch=B, prefetch_depth=1 << 20, layout=layout, context=context,
                   name=f"tpu megakernel plan (spec 3.4), B={B}")


def _gpu_plan(cfg: K3Config, B: int, layout: rl.ParallelLayout, acc: dict, context: int) -> SimPlan:
    """One kernel per op, as a CUDA-graph-captured conventional stack runs a K3 layer.

    KDA layer: AttnRes mix+norm, fused q|k|v|g|beta GEMM, f_a GEMM, f_b GEMM, conv1d update,
    gate, recurrent KDA (state read + write), gated o-norm, o_proj, all-reduce (10 kernels).
    MLA layer: mix, fused q_a|kv_a GEMM, a-norms, q_b GEMM, kv_b(k) GEMM, cache write, decode
    attention (latent cache read), kv_b(v) GEMM, g_proj GEMM, gate multiply, o_proj, all-reduce (12).
    MoE: mix, router GEMM, top-k, latent_down GEMM, align/sort, experts w1|w3, activation,
    experts w2, weighted combine, latent norm, latent_up GEMM, shared gate|up GEMM, activation,
    shared down GEMM, add, all-reduce (16). Layer 0's dense MLP: mix, gate|up, act, down,
    all-reduce. Step: embedding + all-reduce; final mix, LM head GEMM, logits gather, sampling.
    """
    T = _tensor_map(acc)
    colls = acc["collectives"]
    hpr = cfg.heads // layout.tp_attn
    D = cfg.head_dim
    st = acc["state"]
    kda_state_b = st["kda_state_read"] / cfg.n_kda
    cache_read_b = st["mla_cache_read"] / cfg.n_mla
    cache_write_b = st["mla_cache_write"] / cfg.n_mla
    ex = acc["expert"]
    n_exp = acc["experts_per_layer"]
    b = _Builder()
    act_bytes = B * cfg.dim * 2

    def gemm(l, name, tensors, k_name=None, frac=1.0):
        nb = sum(T[t].bytes for t in tensors) * frac
        b.dma(l, name, nb, f"{name}@{len(b.dmas)}")
        b.phase(l, name, "mxu", consumes=[(l, name)], rows=B, pipelined=True, kernel=f"{l}:{name}",
                flops=int(2 * B * sum(T[t].elements for t in tensors) * frac))

    def vec(l, name, flops=0, nbytes=None, hbm=0, wb=0, sub=None):
        b.phase(l, name, "vector", flops=int(flops), vector_bytes=int(act_bytes * 2 if nbytes is None else nbytes),
                hbm_bytes=int(hbm), writeback_bytes=int(wb), pipelined=True, kernel=f"{l}:{name}", rows=B,
                sublayer=sub)

    def allreduce(l, c: rl.Collective):
        b.phase(l, c.name, "collective", collective_phases=c.phases, collective_bytes=int(c.bytes), link=c.link,
                kernel=f"{l}:{c.name}", sublayer="head" if c.sublayer == "head" else None)

    vec(-1, "embed", nbytes=act_bytes)
    allreduce(-1, rl.Collective("embed_allreduce", "attn", 1, act_bytes, "nvlink"))
    for l in range(cfg.layers):
        vec(l, "attn_res", _mix_flops(cfg, B, cfg.n_attn_blocks(l)), (cfg.n_attn_blocks(l) + 2) * act_bytes)
        if cfg.is_mla(l):
            gemm(l, "mla.qkv_a", ["mla.m_qa", "mla.m_ka"])
            vec(l, "mla.a_norms", B * (cfg.q_rank + cfg.kv_rank) * 4)
            gemm(l, "mla.q_b", ["mla.m_qb"])
            gemm(l, "mla.kv_b_k", ["mla.m_kb"], frac=0.5)
            vec(l, "mla.cache_write", hbm=cache_write_b)
            vec(l, "mla.attention", 2 * B * hpr * context * (cfg.kv_rank + cfg.qk_extra) * 2, hbm=cache_read_b)
            gemm(l, "mla.kv_b_v", ["mla.m_kb"], frac=0.5)
            gemm(l, "mla.g_proj", ["mla.m_gate"])
            vec(l, "mla.gate_mul", B * hpr * D * 4)
            gemm(l, "mla.o_proj", ["mla.m_o"])
        else:
            gemm(l, "kda.in_proj", ["kda.k_projection"])
            gemm(l, "kda.f_a", ["kda.k_gate"])
            gemm(l, "kda.f_b", ["kda.k_fb"])
            conv = B * (cfg.conv_size - 1) * 3 * hpr * D * 2
            vec(l, "kda.conv", B * 3 * hpr * D * cfg.conv_size * 2, hbm=conv, wb=conv)
            vec(l, "kda.gate", B * hpr * D * 8)
            vec(l, "kda.recurrent", B * hpr * D * D * 10, hbm=kda_state_b, wb=kda_state_b)
            vec(l, "kda.o_norm_gate", B * hpr * D * 8)
            gemm(l, "kda.o_proj", ["kda.k_o"])
        allreduce(l, colls["attn"][0])
        vec(l, "mlp_res", _mix_flops(cfg, B, cfg.n_mlp_blocks(l)), (cfg.n_mlp_blocks(l) + 2) * act_bytes)
        if l == 0:
            gemm(l, "dense.gate_up", ["dense.gate_up"])
            vec(l, "dense.act", B * T["dense.down"].k * 8)
            gemm(l, "dense.down", ["dense.down"])
            allreduce(l, colls["dense"][0])
            continue
        gemm(l, "moe.router", ["moe.router"])
        vec(l, "moe.topk", B * cfg.experts * (cfg.top_k + 4))
        gemm(l, "moe.latent_down", ["moe.latent_down"])
        vec(l, "moe.align", B * cfg.top_k * 4)
        for part, name in (("gate_up", "moe.w13"), ("down", "moe.w2")):
            # grouped GEMM: each distinct expert sees ~B*k/(E*q) ~ 1 token (rows=1, padded by the sim)
            b.phase(l, name, "mxu", rows=1, pipelined=True, kernel=f"{l}:{name}", dtype="bf16",
                    flops=int(2 * n_exp * ex["elements"] * (2 / 3 if part == "gate_up" else 1 / 3)),
                    expert_dmas=int(round(n_exp * ex[part])), expert_count=n_exp)
            if part == "gate_up":
                vec(l, "moe.act", B * cfg.top_k * ex["elements"] / (3 * cfg.latent) * 8)
        vec(l, "moe.combine", B * cfg.top_k * cfg.latent * 2)
        vec(l, "moe.latent_norm", B * cfg.latent * 4)
        gemm(l, "moe.latent_up", ["moe.latent_up"])
        gemm(l, "moe.shared_gu", ["moe.shared_gu"])
        vec(l, "moe.shared_act", B * T["moe.shared_down"].k * 8)
        gemm(l, "moe.shared_down", ["moe.shared_down"])
        vec(l, "moe.add", B * cfg.dim)
        allreduce(l, colls["moe"][0])
    L = cfg.layers
    vec(L, "final_mix", _mix_flops(cfg, B, cfg.n_blocks), (cfg.n_blocks + 2) * act_bytes, sub="head")
    b.dma(L, "lm_head", T["lm_head"].bytes, "lm_head")
    b.phase(L, "lm_head", "mxu", consumes=[(L, "lm_head")], rows=B, pipelined=True, kernel=f"{L}:lm_head",
            flops=2 * B * T["lm_head"].elements, sublayer="head")
    for c in colls["head"]:
        allreduce(L, c)
    vec(L, "sample", B * T["lm_head"].n * 4, B * T["lm_head"].n * 4, sub="head")
    # depth only matters for the megakernel what-if on this plan: a few kernels' weights ahead
    return b.build(config=cfg, batch=B, prefetch_depth=GPU_WHATIF_DEPTH, layout=layout, context=context,
                   name=f"gpu conventional plan (one kernel per op), B={B}")


# ------------------------------------------------------------------------------------------------
# Predictions vs the published table
# ------------------------------------------------------------------------------------------------
def predict(cfg: K3Config, batch: int, system: str = "tpu-v7x16", *, context: int = DEFAULT_CONTEXT,
            straggler: bool = True, record: bool = True) -> dict:
    """Both schedules, the roofline floors and the published figure for one batch size."""
    sys_ = hwlib.get_system(system)
    plan = build_plan(cfg, batch, system=sys_, context=context, straggler=straggler)
    mach = Machine.from_system(sys_)
    res = {s: simulate(plan, mach, s, record=record) for s in ("megakernel", "conventional")}
    roof = rl.roofline(cfg, batch, context, plan.layout, None, sys_, straggler)
    pub = hwlib.published_value(sys_.published_system, "plain", batch)
    head = res[sys_.schedule]
    return {
        "system": system, "batch": batch, "schedule": sys_.schedule,
        "megakernel": res["megakernel"].summary(), "conventional": res["conventional"].summary(),
        "predicted_tok_s": head.tokens_per_s,
        "roofline": {"t_hbm_s": roof.t_hbm, "t_compute_s": roof.t_compute, "t_collective_s": roof.t_collective,
                     "bound": roof.bound, "ceiling_tok_s": roof.ceiling_tok_s,
                     "serial_floor_tok_s": roof.serial_floor_tok_s, "bytes_per_device": roof.total_bytes,
                     "experts_per_layer": roof.experts_per_layer},
        "published_tok_s": pub,
        "ratio": (head.tokens_per_s / pub) if pub else None,
        "_results": res, "_roofline": roof, "_plan": plan,
    }


def sensitivity(cfg: K3Config, system: str = "tpu-v7x16", batches: Sequence[int] = (1, 2, 4, 8),
                context: int = DEFAULT_CONTEXT) -> list[dict]:
    """Predicted tokens/s of the published schedule under alternative values of the uncertain
    inputs (each from a measurement or an explicit bound, none fitted): the ends of the measured
    collective-latency range, mean instead of slowest-group expert counts, the DMA engine at the
    datasheet HBM peak, and (GPU) the single-node H100 all-reduce latency / no launch gap."""
    sys_ = hwlib.get_system(system)
    mb = hwlib.load_microbench()
    base = Machine.from_system(sys_)
    variants: list[tuple[str, Machine, bool]] = [("base", base, True), ("mean experts (no straggler)", base, False),
                                                 ("DMA at datasheet HBM peak", dataclasses.replace(base, dma_bw=sys_.hbm_bw), True)]
    if sys_.chip.kind == "tpu":
        for q in ("collective_phase_latency_min", "collective_phase_latency_max"):
            v = mb.get("tpu-v7", q)
            variants.append((f"collective phase latency {v * 1e6:.1f} us", dataclasses.replace(base, collective_latency=v), True))
    else:
        v = mb.get("gpu", "allreduce_small_latency")
        variants.append((f"all-reduce latency {v * 1e6:.1f} us (H100 NCCL)", dataclasses.replace(base, collective_latency=v), True))
        variants.append(("no launch gap", dataclasses.replace(base, launch_gap=0.0), True))
    rows = []
    plans = {}
    for name, mach, strag in variants:
        row = {"variant": name}
        for b in batches:
            key = (b, strag)
            if key not in plans:
                plans[key] = build_plan(cfg, b, system=sys_, context=context, straggler=strag)
            res = simulate(plans[key], mach, sys_.schedule, record=False)
            pub = hwlib.published_value(sys_.published_system, "plain", b)
            row[b] = {"tokens_per_s": res.tokens_per_s, "ratio": res.tokens_per_s / pub if pub else None}
        rows.append(row)
    return rows
