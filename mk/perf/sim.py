"""A small deterministic discrete-event simulation of one decode step, replaying a `mk.kernel.plan.Plan`.

The simulator reads nothing but a plan's entries (`mk.kernel.schedule.schedule(plan)`: weight DMAs in issue order,
phases in execution order) and a `Machine` (one device's rates, each from `data/` with a source,
`mk.perf.hardware.System`). mk's kernel plan (`mk.kernel.plan.MK`), the seed's K3 kernel (`mk.kernel.plan.SEED`,
the same plan type with the seed's options) and a GPU serving stack's one-kernel-per-op step
(`mk.kernel.plan.CONVENTIONAL`, built by `mk.kernel.conventional`) are all replayed by the same code.

Two parts:

- `DmaEngine`: transfers of bytes over one resource, shared equally by every active transfer
  (processor sharing = the round-robin service of the TPU DMA engine, spec App. B.1 / B.2). Each
  transfer first waits a fixed latency that uses no bandwidth. One engine moves weights, routed
  experts, cache/state reads and write-backs (HBM); one per link moves collectives ('ici',
  'sibling', 'nvlink'). `advance(now, t)` is the only place bytes move.
- `PhaseExecutor`: runs the phases strictly in order on one core. An MXU phase consumes its DMAs
  one by one ("units": unit j computes its share of the phase, by bytes, once its DMA has landed
  and unit j-1 is done, then frees its slot), so a 100-tile matmul streams through a 4-slot ring.
  A phase that reads caches/states (`hbm_bytes`, issued `hbm_lead` phases earlier) ends no
  earlier than that stream; a collective phase is one transfer on its link; a `pipelined` phase
  (a GPU kernel) ends at max(start + compute, its last byte landed). Phase costs
  (`Machine.costs`): MXU `2 * rows_eff * K * N / peak(dtype)` with `rows_eff = max(round_up(rows, mxu_min_rows), mxu_push_rows)` (decode matmuls
  are weight-push bound, spec App. B.1), plus MXFP4 unpack ops at the measured `dequant_op_rate`
  (on the bf16 path they feed the MXU as they go: only their time beyond the MXU's counts); vector
  phases `max(ops / vector_flops, bytes / vector_bw)`; a named fixed cost (routing, spec App. B.6).

The DMA issue rules (`_Issuer`): DMA i may be issued when every DMA before it has been, its slot is
free (its previous occupant consumed), the phase named by `issue_after` has ended, and, for a
ring plan (`options.prefetch == 'ring'`), `i <= anchor + prefetch_depth` (anchor: the next DMA the
current phase consumes, or while it has none left the next any later phase consumes, minus 1).
In a per-op plan a DMA waits for its kernel to start, and each kernel starts `launch_gap` after
the previous one ended. A fixed per-step overhead is added to the step time.

`SimResult.breakdown` splits the step into what the core was doing (MXU, dequantization, vector,
waiting for weights, for cache streams, for collectives' latency and bytes, launch gaps): the
bubbles `mk simulate` names where one plan is slower than another. `mk.perf.trace.write_trace` writes
the modelled step as Chrome trace-event JSON (Perfetto, XProf), one track per engine.
"""
from __future__ import annotations

import dataclasses
import heapq

import numpy as np
from typing import Any, Sequence

from mk.model.config import K3Config
from mk.errors import UserError
from mk.perf import hardware as hwlib
from mk.kernel import plan as planlib
from mk.kernel import schedule
from mk.kernel.plan import CONVENTIONAL, MK, SEED, Plan, ScheduleOptions, make_plan


class SimError(UserError, ValueError):
    """A plan the simulator cannot replay (inconsistent indices, a deadlock)."""


DEFAULT_CONTEXT = 512     # mean attended tokens over the benchmark's 1024 generated tokens (spec 6.1)
INF = float("inf")
_EPS = 1e-3               # bytes
_T_EPS = 1e-15            # s


# ------------------------------------------------------------------------------------------------
# The machine
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Machine:
    """Per-device rates the simulator uses (`from_system`: from `mk.perf.hardware.System.constants`)."""
    dma_bw: float
    dma_latency: float = 0.0
    flops: dict = dataclasses.field(default_factory=lambda: {"bf16": 1e15})
    mxu_min_rows: int = 1
    mxu_push_rows: int = 1
    vector_flops: float = 1e13
    vector_bw: float = 1e13
    dequant_op_rate: float | None = None    # MXFP4 unpack into the MXU, measured; None: vector_flops
    links: dict = dataclasses.field(default_factory=lambda: {"ici": (0.0, 1e11)})   # link -> (latency, bw)
    launch_gap: float = 0.0
    step_overhead: float = 0.0
    fixed: dict = dataclasses.field(default_factory=dict)     # named fixed costs (Phase.fixed_cost)
    hbm_bw: float | None = None
    name: str = "machine"

    @classmethod
    def from_system(cls, s: hwlib.System) -> "Machine":
        v = s.value
        K = s.constants
        links = {k.split(".")[0]: (v(k), v(k.split(".")[0] + ".bw")) for k in K if k.endswith(".latency")}
        return cls(dma_bw=v("dma_bw"), dma_latency=v("dma_latency"),
                   flops={k.split(".")[1]: c.value for k, c in K.items() if k.startswith("flops.")},
                   mxu_min_rows=int(v("mxu_min_rows")), mxu_push_rows=int(v("mxu_push_rows")),
                   vector_flops=v("vector_flops"), vector_bw=v("vector_bw"), links=links,
                   dequant_op_rate=K["dequant_op_rate"].value if "dequant_op_rate" in K else None,
                   launch_gap=K["launch_gap"].value if "launch_gap" in K else 0.0,
                   step_overhead=v("step_overhead"),
                   fixed={"routing": K["routing"].value} if "routing" in K else {},
                   hbm_bw=v("hbm_bw"), name=s.name)

    def peak(self, dtype: str) -> float:
        for d in (dtype, "fp8" if dtype == "fp4" else "bf16", "bf16"):
            if self.flops.get(d):
                return self.flops[d]
        raise SimError(f"machine {self.name}: no MXU rate for {dtype!r} (have {sorted(self.flops)})")

    def link(self, name: str) -> tuple[float, float]:
        if name in self.links:
            return self.links[name]
        if len(self.links) == 1:
            return next(iter(self.links.values()))
        raise SimError(f"machine {self.name}: no link {name!r} (have {sorted(self.links)})")

    def costs(self, ph) -> dict[str, float]:
        """The phase's own work, by category: 'mxu', 'dequant', 'vector', 'fixed' (collectives and
        waits are the engines')."""
        out = {}
        if ph.kind == "mxu":
            rows = max(int(ph.rows or 0), 1)
            rows_eff = max(-(-rows // self.mxu_min_rows) * self.mxu_min_rows, self.mxu_push_rows)
            out["mxu"] = float(ph.flops) * rows_eff / rows / self.peak(ph.dtype or "bf16")
            if ph.vector_ops:     # MXFP4: the unpack's ops; on the bf16 path they feed the MXU as they go
                dequant = float(ph.vector_ops) / (self.dequant_op_rate or self.vector_flops)
                out["dequant"] = max(dequant - out["mxu"], 0.0) if ph.dtype == "bf16" else dequant
        elif ph.kind == "vector":
            out["vector"] = max(float(ph.flops) / self.vector_flops, float(ph.vector_bytes or 0) / self.vector_bw)
        elif ph.kind != "collective":
            raise SimError(f"phase {ph.index} ({ph.name}): unknown kind {ph.kind!r}; expected 'mxu', 'vector' "
                           f"or 'collective'")
        if ph.fixed_cost:
            if ph.fixed_cost not in self.fixed:
                raise SimError(f"phase {ph.index} ({ph.name}): machine {self.name} has no fixed cost "
                               f"{ph.fixed_cost!r} (have {sorted(self.fixed)})")
            out["fixed"] = self.fixed[ph.fixed_cost]
        return out

    def compute_time(self, ph) -> float:
        """The phase's time on an idle machine (a collective: its link's latency + bytes / bw)."""
        if ph.kind == "collective":
            lat, bw = self.link(ph.link)
            return lat + ph.collective_bytes / bw
        return sum(self.costs(ph).values())


def as_machine(m) -> Machine:
    if isinstance(m, Machine):
        return m
    if isinstance(m, hwlib.System):
        return Machine.from_system(m)
    if isinstance(m, str):
        return Machine.from_system(hwlib.get_system(m))
    raise SimError(f"expected a Machine, a hardware.System or a system name, found {m!r}")


# ------------------------------------------------------------------------------------------------
# Engines
# ------------------------------------------------------------------------------------------------
class Transfer:
    __slots__ = ("key", "label", "bytes", "slot", "issued", "begin", "done", "consumed", "finish")

    def __init__(self, key, label, nbytes, slot=None):
        self.key, self.label, self.slot = key, label, slot
        self.bytes = float(nbytes)
        self.issued = self.begin = self.done = self.finish = None
        self.consumed = False


class DmaEngine:
    """Transfers sharing one bandwidth `bw` equally (processor sharing); each first waits `latency`
    (no bandwidth used). `spans` records (begin, done, label) per transfer, `busy` the intervals
    with a transfer in progress.

    Every active transfer is served at the same rate, bw / n, so the engine keeps one counter of
    the service each active transfer has received (`served`, bytes): a transfer that starts when it
    reads S finishes when it reads S + its bytes. Both queues are heaps: O(log n) per event."""

    def __init__(self, name: str, bw: float, latency: float, record: bool = True, span_from_issue: bool = False):
        self.name, self.bw, self.latency, self.record = name, float(bw), float(latency), record
        self.span_from_issue = span_from_issue      # spans from issue (a collective) or from the first byte
        self.waiting: list = []            # (begin, seq, transfer): inside their latency
        self.active: list = []             # (finish, seq, transfer)
        self.served = 0.0
        self.seq = 0
        self.spans: list[tuple[float, float, str]] = []
        self.busy: list[tuple[float, float]] = []
        self._busy_since = None
        self.moved = 0.0

    def start(self, tr: Transfer, now: float, latency: float | None = None):
        tr.issued = now
        tr.begin = now + (self.latency if latency is None else latency)
        self.seq += 1
        heapq.heappush(self.waiting, (tr.begin, self.seq, tr))
        self.moved += tr.bytes

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.active

    def next_event(self, now: float) -> float:
        t = self.waiting[0][0] if self.waiting else INF
        if self.active:
            t = min(t, now + max(0.0, self.active[0][0] - self.served) * len(self.active) / self.bw)
        return t

    def advance(self, now: float, t: float) -> list[Transfer]:
        """Move bytes from `now` to `t` (no event strictly between them); returns the transfers
        that completed at `t`."""
        done = []
        if self.active:
            self.served += self.bw / len(self.active) * (t - now)
            while self.active and self.active[0][0] <= self.served + max(_EPS, 1e-12 * self.served):
                tr = heapq.heappop(self.active)[2]
                tr.done = t
                done.append(tr)
        while self.waiting and self.waiting[0][0] <= t + _T_EPS:
            tr = heapq.heappop(self.waiting)[2]
            if tr.bytes <= _EPS:
                tr.done = max(t, tr.begin)
                done.append(tr)
                continue
            if self.record and self._busy_since is None:
                self._busy_since = t
            self.seq += 1
            tr.finish = self.served + tr.bytes
            heapq.heappush(self.active, (tr.finish, self.seq, tr))
        if self.record:
            for tr in done:
                self.spans.append((tr.issued if self.span_from_issue else tr.begin, tr.done, tr.label))
            if not self.active and self._busy_since is not None:
                self.busy.append((self._busy_since, t))
                self._busy_since = None
        return done


# ------------------------------------------------------------------------------------------------
# DMA issue and the phases
# ------------------------------------------------------------------------------------------------
class _Issuer:
    """Issues the plan's weight DMAs in order on the HBM engine, under the rules of the module docstring."""

    def __init__(self, plan, dmas, phases, hbm: DmaEngine, ex: "PhaseExecutor"):
        o = plan.options
        self.dmas, self.hbm, self.ex = dmas, hbm, ex
        self.depth = int(plan.prefetch_depth) if o.program == "megakernel" and o.prefetch == "ring" else None
        if self.depth is not None and self.depth < 0:
            raise SimError(f"plan.prefetch_depth must be >= 0, found {self.depth}")
        self.per_op = o.program == "per_op"
        self.tr = [Transfer(("w", d.index), f"L{d.layer}:{d.tensor}#{d.tile}", d.bytes, d.slot) for d in dmas]
        self.next = 0
        self.slot_busy: dict = {}
        self.lowest = 0

    def anchor(self) -> int:
        while self.lowest < len(self.tr) and self.tr[self.lowest].consumed:
            self.lowest += 1
        c = self.lowest
        if c >= len(self.tr):
            return c
        return c if self.dmas[c].phase == self.ex.p else c - 1

    def _why(self, i: int) -> tuple | None:
        """What holds DMA i back, as (rule, detail) (None: it can be issued now): the hot path of
        `issue`, so no message is formatted here (`blocked`)."""
        d = self.dmas[i]
        if self.depth is not None:
            anchor = self.anchor()
            if i > anchor + self.depth:
                return "window", anchor
        occ = self.slot_busy.get(d.slot)
        if occ is not None:
            return "slot", occ
        if d.issue_after >= 0 and self.ex.end[d.issue_after] is None:
            return "after", d.issue_after
        if self.per_op and self.ex.start[d.phase] is None:
            return "kernel", None
        return None

    def blocked(self, i: int) -> str | None:
        """Why DMA i cannot be issued now (None: it can)."""
        why = self._why(i)
        if why is None:
            return None
        rule, x = why
        if rule == "window":
            return f"outside the prefetch window (anchor {x} + depth {self.depth})"
        if rule == "slot":
            return f"slot {self.dmas[i].slot} held by {x.label}"
        if rule == "after":
            return f"issue_after phase {x} has not ended"
        return "its kernel has not started"

    def issue(self, now: float) -> bool:
        changed = False
        while self.next < len(self.dmas) and self._why(self.next) is None:
            tr = self.tr[self.next]
            self.slot_busy[tr.slot] = tr
            self.hbm.start(tr, now)
            self.next += 1
            changed = True
        return changed

    def consume(self, tr: Transfer):
        tr.consumed = True
        if self.slot_busy.get(tr.slot) is tr:
            self.slot_busy[tr.slot] = None


class PhaseExecutor:
    """Runs the phases in order on one core (see the module docstring); records each phase's
    start / end and its time by category (`breakdown`)."""

    def __init__(self, phases, units, machine: Machine, engines: dict[str, DmaEngine], record: bool):
        self.ph, self.units, self.m, self.eng, self.record = phases, units, machine, engines, record
        self.n = len(phases)
        self.p = 0
        self.start: list = [None] * self.n
        self.end: list = [None] * self.n
        self.costs = [machine.costs(ph) if ph.kind != "collective" else {} for ph in phases]
        self.compute = [sum(c.values()) for c in self.costs]
        self.breakdown: dict[str, float] = {}
        self.spans: dict[str, list] = {"mxu": [], "vector": [], "launch": []}
        self.kernel_ready = 0.0
        self.issuer: _Issuer | None = None
        self.inflight: dict[int, list] = {}      # phase index -> collectives it must wait for
        self.leads: dict[int, list] = {}         # phase index -> later phases whose hbm read it issues
        for q, ph in enumerate(phases):
            if ph.hbm_bytes and ph.hbm_lead:
                self.leads.setdefault(max(0, q - ph.hbm_lead), []).append(q)
        self.early: dict[int, Transfer] = {}     # phase index -> its hbm read, issued by an earlier phase
        self.current_since = 0.0                 # when the current phase became current
        self._reset()

    def _reset(self):
        self.u = 0                     # current unit
        self.unit_end = None
        self.ready_since = None        # when the current unit could have started (for the wait)
        self.stream = None             # the phase's own cache / state read, or its collective
        self.pipe_end = None

    @property
    def done(self) -> bool:
        return self.p >= self.n

    def _add(self, cat: str, dt: float):
        if dt > 0:
            self.breakdown[cat] = self.breakdown.get(cat, 0.0) + dt

    def _work(self, share: float, t0: float, t1: float):
        """Unit work from t0 to t1: a `share` of the phase's costs, by category."""
        ph = self.ph[self.p]
        for cat, v in self.costs[self.p].items():
            self._add(cat, v * share)
        if self.record and t1 > t0:
            self.spans["mxu" if ph.kind == "mxu" else "vector"].append((t0, t1, f"L{ph.layer}:{ph.name}"))

    def _begin(self, now: float):
        ph = self.ph[self.p]
        self.start[self.p] = now
        if ph.kind == "collective":
            lat, bw = self.m.link(ph.link)
            eng = self.eng.setdefault(ph.link, DmaEngine(ph.link, bw, lat, self.record, span_from_issue=True))
            self.stream = Transfer(("c", self.p), f"L{ph.layer}:{ph.name}", ph.collective_bytes)
            eng.start(self.stream, now)
            if ph.overlap:                       # in flight while the next phases run
                self.inflight.setdefault(self.p + ph.overlap + 1, []).append((self.stream, lat, ph.collective_bytes / bw))
            return
        for q in self.leads.pop(self.p, ()):      # later phases' cache / state reads issued now
            self.early[q] = self._cache_read(q, now)
        if ph.hbm_bytes:
            self.stream = self.early.pop(self.p, None) or self._cache_read(self.p, now)
        units = self.units[self.p]
        tot = sum(tr.bytes for tr in units)
        self.shares = [tr.bytes / tot if tot > 0 else 1.0 / len(units) for tr in units] or [1.0]
        if ph.pipelined:
            self.pipe_end = now + self.compute[self.p]
            self._work(1.0, now, self.pipe_end)
        self.ready_since = now

    def _cache_read(self, q: int, now: float) -> Transfer:
        """Start phase q's own cache / state read on the HBM engine."""
        ph = self.ph[q]
        tr = Transfer(("h", q), f"L{ph.layer}:{ph.name}:cache", ph.hbm_bytes)
        self.eng["dma"].start(tr, now)
        return tr

    def _finish(self, now: float):
        ph = self.ph[self.p]
        self.end[self.p] = now
        for tr in self.units[self.p]:
            self.issuer.consume(tr)
        if ph.writeback_bytes:
            self.eng["dma"].start(Transfer(("wb", self.p), f"L{ph.layer}:{ph.name}:writeback", ph.writeback_bytes), now)
        self.p += 1
        self.current_since = now
        self._reset()
        if self.p < self.n and self.ph[self.p].kernel is not None:       # a new kernel launch
            gap = self.m.launch_gap
            self.kernel_ready = now + gap
            self._add("launch gap", gap)
            if self.record and gap > 0:
                self.spans["launch"].append((now, now + gap, f"launch {self.ph[self.p].kernel}"))

    def step(self, now: float) -> bool:
        """Start / progress / end the current phase at time `now`; True if anything changed."""
        if self.p >= self.n:
            return False
        ph = self.ph[self.p]
        if self.start[self.p] is None:
            if ph.kernel is not None and now + _T_EPS < self.kernel_ready:
                return False
            waits = self.inflight.get(self.p, ())
            if any(tr.done is None for tr, *_ in waits):
                return False
            if waits and now > self.current_since:          # waited for overlapped collectives
                lat, byt = max(((l, b) for tr, l, b in waits), key=lambda x: x[0] + x[1])
                dt = now - self.current_since
                self._add("collective latency", dt * lat / (lat + byt))
                self._add("collective bytes", dt * byt / (lat + byt))
            self._begin(now)
            return True
        if ph.kind == "collective":
            if ph.overlap:
                self._finish(now)
                return True
            if self.stream.done is None:
                return False
            lat, bw = self.m.link(ph.link)
            took = now - self.start[self.p]
            self._add("collective latency", min(took, lat))
            self._add("collective bytes", max(0.0, took - lat))
            self._finish(now)
            return True
        units = self.units[self.p]
        if ph.pipelined:
            if now + _T_EPS < self.pipe_end or any(tr.done is None for tr in units) or \
                    (self.stream is not None and self.stream.done is None):
                return False
            self._add("weights wait", now - self.pipe_end)
            self._finish(now)
            return True
        changed = False
        if self.unit_end is not None and now + _T_EPS >= self.unit_end:
            if units:
                self.issuer.consume(units[self.u])
            self.u += 1
            self.unit_end = None
            self.ready_since = now
            changed = True
        if self.unit_end is None:
            if self.u >= max(1, len(units)):
                if self.stream is not None and self.stream.done is None:
                    return changed
                self._add("cache/state wait", now - self.ready_since)
                self._finish(now)
                return True
            if units and units[self.u].done is None:
                return changed
            self._add("weights wait", now - self.ready_since)
            share = self.shares[self.u]
            self.unit_end = now + self.compute[self.p] * share
            self._work(share, now, self.unit_end)
            changed = True
        return changed

    def next_event(self, now: float) -> float:
        if self.p >= self.n:
            return INF
        ph = self.ph[self.p]
        if self.start[self.p] is None:
            return self.kernel_ready if ph.kernel is not None and self.kernel_ready > now else INF
        t = INF
        if self.unit_end is not None:
            t = self.unit_end
        if self.pipe_end is not None and self.pipe_end > now:
            t = min(t, self.pipe_end)
        return t


# ------------------------------------------------------------------------------------------------
# Result
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class SimResult:
    plan: Any                         # the Plan replayed
    dmas: list                        # its entries, as replayed
    phases: list
    machine: str
    batch: int
    step_time: float                  # s, including the fixed per-step overhead
    kernel_time: float                # s, first phase start .. last phase end (and write-backs)
    overhead: float
    bytes_moved: float                # through the HBM engine (weights, caches, states, write-backs)
    weight_bytes: float
    breakdown: dict                   # category -> s (what the core did or waited for)
    tracks: dict                      # engine -> [(start, end, label)] for the trace
    phase_times: list                 # (index, layer, name, kind, start, end)
    hbm_bw: float | None

    @property
    def schedule(self) -> str:
        return self.plan.options.name

    @property
    def tokens_per_s(self) -> float:
        return self.batch / self.step_time

    @property
    def hbm_floor(self) -> float:
        """bytes moved / datasheet HBM bandwidth: the HBM floor of this plan."""
        return self.bytes_moved / self.hbm_bw if self.hbm_bw else float("nan")

    @property
    def roofline_fraction(self) -> float:
        """HBM floor / step time."""
        return self.hbm_floor / self.step_time

    def busy(self, engine: str) -> float:
        return sum(e - s for s, e, _ in self.tracks.get(engine, ()))

    def time_by(self, key: str = "name") -> dict[str, float]:
        """Phase time summed by phase name (or 'kind', 'layer')."""
        idx = {"name": 2, "kind": 3, "layer": 1}[key]
        out: dict = {}
        for row in self.phase_times:
            out[row[idx]] = out.get(row[idx], 0.0) + row[5] - row[4]
        return out

    def summary(self) -> dict:
        return {"schedule": self.schedule, "batch": self.batch, "step_time_s": self.step_time,
                "tokens_per_s": self.tokens_per_s, "kernel_time_s": self.kernel_time, "overhead_s": self.overhead,
                "bytes_moved": self.bytes_moved, "weight_bytes": self.weight_bytes, "hbm_floor_s": self.hbm_floor,
                "hbm_roofline_fraction": self.roofline_fraction, "breakdown_s": dict(self.breakdown),
                "phases": len(self.phases), "dmas": len(self.dmas)}


# ------------------------------------------------------------------------------------------------
# The simulator
# ------------------------------------------------------------------------------------------------
def _validate(dmas, phases):
    nP = len(phases)
    for j, ph in enumerate(phases):
        if ph.index != j:
            raise SimError(f"the plan's phases[{j}].index is {ph.index}: phases must be listed in order with index == position")
    units: list[list[int]] = [[] for _ in range(nP)]
    for i, d in enumerate(dmas):
        if d.index != i:
            raise SimError(f"the plan's dmas[{i}].index is {d.index}: dmas must be listed in issue order with index == position")
        if not 0 <= d.phase < nP:
            raise SimError(f"the plan's dmas[{i}] ({d.tensor}): phase {d.phase} is not a phase index (0..{nP - 1})")
        if not -1 <= d.issue_after < nP:
            raise SimError(f"the plan's dmas[{i}] ({d.tensor}): issue_after {d.issue_after} is not a phase index")
        units[d.phase].append(i)
    for j, ph in enumerate(phases):
        if tuple(ph.dmas) and sorted(ph.dmas) != units[j]:
            raise SimError(f"phase {j} ({ph.name}) lists dmas {list(ph.dmas)[:8]} but the dmas naming it as "
                           f"consumer are {units[j][:8]}")
    return units


def simulate(plan, machine="tpu-v7x16", *, distinct_experts: Sequence[float] | None = None,
             step_overhead: float | None = None, record: bool = True, entries=None) -> SimResult:
    """Replay `plan` (a `mk.kernel.plan.Plan`) on `machine` (a `Machine`, a `hardware.System` or a system
    name). `distinct_experts`: per MoE layer (default: the plan's expected count). `entries`: the
    (dmas, phases) to replay (default: the plan's, `mk.kernel.schedule.schedule(plan, distinct_experts)`);
    the plan then only gives its options, prefetch depth and batch. Deterministic."""
    m = as_machine(machine)
    dmas, phases = entries if entries is not None else schedule.schedule(plan, distinct_experts)
    unit_idx = _validate(dmas, phases)
    hbm = DmaEngine("dma", m.dma_bw, m.dma_latency, record)
    engines = {"dma": hbm}
    ex = PhaseExecutor(phases, [], m, engines, record)
    iss = _Issuer(plan, dmas, phases, hbm, ex)
    ex.units = [[iss.tr[i] for i in u] for u in unit_idx]
    ex.issuer = iss
    t, guard = 0.0, 0
    while not ex.done:
        guard += 1
        if guard > 20_000_000:
            raise SimError("simulation did not converge")
        while iss.issue(t) | ex.step(t):
            pass
        if ex.done:
            break
        t_next = min([e.next_event(t) for e in engines.values()] + [ex.next_event(t)])
        if t_next == INF:
            raise SimError(_deadlock(iss, ex, phases))
        t_next = max(t, t_next)
        for e in list(engines.values()):
            e.advance(t, t_next)
        t = t_next
    end_compute = t
    while not all(e.idle for e in engines.values()):                  # write-backs drain
        t_next = min(e.next_event(t) for e in engines.values())
        for e in engines.values():
            e.advance(t, t_next)
        t = t_next
    if t > end_compute:
        ex._add("write-back drain", t - end_compute)
    overhead = m.step_overhead if step_overhead is None else step_overhead
    tracks = {"dma": hbm.spans, "dma busy": [(s, e, "busy") for s, e in hbm.busy], **ex.spans}
    for name, e in engines.items():
        if name != "dma":
            tracks[f"ici {name}"] = e.spans
    rows = [(j, ph.layer, ph.name, ph.kind, ex.start[j], ex.end[j]) for j, ph in enumerate(phases)]
    weight = float(sum(d.bytes for d in dmas))
    return SimResult(plan, dmas, phases, m.name, int(plan.batch), t + overhead, t, overhead, hbm.moved, weight,
                     dict(ex.breakdown), tracks, rows, m.hbm_bw)


def _deadlock(iss: _Issuer, ex: PhaseExecutor, phases) -> str:
    ph = phases[ex.p]
    msg = f"deadlock at phase {ex.p} ({ph.name}, layer {ph.layer})"
    if iss.next < len(iss.dmas):
        d = iss.dmas[iss.next]
        msg += f"; next DMA {iss.next} ({d.tensor}, for phase {d.phase}) cannot issue: {iss.blocked(iss.next)}"
    return msg


# ------------------------------------------------------------------------------------------------
# The seed's systems: which plan, the prediction, the sensitivity sweep
# ------------------------------------------------------------------------------------------------
PLANS = ("seed", "mk")


def _system(system) -> hwlib.System:
    return system if isinstance(system, hwlib.System) else hwlib.get_system(system)


def expert_counts(cfg: K3Config, batch: int, layout, straggler: bool = True) -> list[float]:
    """Distinct experts one device fetches per MoE layer: the expected maximum over the
    expert-parallel groups (every MoE layer ends in a collective that waits for the slowest group),
    or the mean (`straggler=False`); `mk.perf.routing.distinct_experts`."""
    from mk.perf.routing import distinct_experts
    return [distinct_experts(cfg, batch, layout).value(straggler)] * cfg.n_moe


def seed_plan(cfg: K3Config, batch: int, system="tpu-v7x16", context: int = DEFAULT_CONTEXT,
              setup: hwlib.SystemLayout | None = None) -> Plan:
    """The schedule behind `system`'s published figure, as a plan: the seed's K3 kernel (`SEED`) on
    the TPU, one kernel per op (`CONVENTIONAL`, `mk.kernel.conventional`) on the GPU; the layout and the
    experts' storage from `data/systems.csv` (`setup`: another row of it)."""
    s = _system(system)
    setup = setup or s.setup
    opts = SEED if setup.program == "megakernel" else CONVENTIONAL
    opts = dataclasses.replace(opts, expert_gate_up=setup.expert_gate_up, expert_down=setup.expert_down)
    return make_plan(cfg, batch, layout=setup.layout.fit(cfg), options=opts, check=False, ctx=context)


def has_fp8_mxu(system) -> bool:
    """Whether the system's chip has an fp8 MXU rate (data/hardware.csv `fp8_flops` > 0; v5e: 0)."""
    return bool(_system(system).chip.get("fp8_flops"))


KERNEL_RING = "kernel"   # `mk_plan`'s prefetch_depth: the ring the kernel takes by default (`make_plan`'s)


def mk_plan(cfg: K3Config, batch: int, system="tpu-v7x16", context: int = DEFAULT_CONTEXT, *,
            options: ScheduleOptions = MK, prefetch_depth: int | str | None = None, tile=None,
            experts: str = "mxfp4") -> Plan:
    """mk's plan for `system`: the kernel's mesh rule over all its devices (`default_layout`), MXFP4
    experts, its chip (`Plan.chip`; the VMEM limit: the kernel's 64 MiB or the chip's VMEM,
    data/hardware.csv, whichever is less), and (prefetch_depth None) the deepest ring that fits it;
    `KERNEL_RING`: the kernel's default ring (`default_prefetch_depth`, halved by `make_plan` to fit)."""
    from mk.model.sharding import default_layout
    s = _system(system)
    if experts == "mxfp4" and options.mxfp4_matmul == "fp8" and not has_fp8_mxu(s):
        raise SimError(f"mxfp4_matmul 'fp8': {s.name}'s chip {s.chip.name} has no fp8 MXU (data/hardware.csv "
                       f"fp8_flops = 0); its kernel runs MXFP4 experts on the 'bf16' path")
    chip = {v: k for k, v in planlib.HARDWARE_CHIP.items()}.get(s.chip.name)
    if chip is None:
        raise SimError(f"system {s.name}: chip {s.chip.name!r} is no TPU mk's kernel compiles for "
                       f"(expected one of {sorted(planlib.HARDWARE_CHIP.values())})")
    vmem = min(planlib.DEFAULT_VMEM_LIMIT, int(s.chip.per_core("onchip_bytes")))
    kw = dict(layout=default_layout(cfg, s.devices), ctx=context, experts=experts, options=options, tile=tile,
              chip=chip, vmem_limit=vmem)
    if prefetch_depth == KERNEL_RING:
        return make_plan(cfg, batch, check=False, **kw)
    if prefetch_depth is None:
        prefetch_depth = _deepest_ring(cfg, batch, kw)
    return make_plan(cfg, batch, prefetch_depth=prefetch_depth, check=False, **kw)


def _deepest_ring(cfg: K3Config, batch: int, kw: dict, most: int = 512) -> int:
    """The deepest prefetch depth (<= most) whose plan `make_plan` accepts (fits VMEM): guessed from
    the VMEM bytes per slot (two unchecked plans), then stepped to the boundary with checked ones."""
    def fits(d):
        try:
            make_plan(cfg, batch, prefetch_depth=d, **kw)
            return True
        except planlib.PlanError:
            return False
    a, b = (make_plan(cfg, batch, prefetch_depth=d, check=False, **kw) for d in (4, 12))
    per = (b.vmem_planned_bytes - a.vmem_planned_bytes) / 8
    d = most if per <= 0 else max(0, min(most, 4 + int((a.vmem_limit - a.vmem_planned_bytes) // per)))
    while d > 0 and not fits(d):
        d -= 1
    while d < most and fits(d + 1):
        d += 1
    return d


def mk_plan_for(cfg: K3Config, batch: int, system="tpu-v7x16", context: int = DEFAULT_CONTEXT, *,
                experts: str | None = None, mxfp4_matmul: str | None = None,
                prefetch_depth: int | None = None) -> tuple[Plan, dict]:
    """mk's plan for `system` and `info` describing it. experts None: MXFP4, or bf16 expert tiles where
    `make_plan` refuses MXFP4 for the layout (`info["note"]` says why). The system's `mk_plan`
    (data/systems.csv) says how the rest is chosen: 'defaults', the kernel's own (`make_step_fn`:
    `default_tile`, `default_prefetch_depth`, MK's options; the bf16 MXFP4 path), as timed on the chip;
    'tuned', the kernel's free choices (`MK_CHOICES`: all-reduce rounds, MXFP4 MXU path, fp8 only
    where the chip has an fp8 MXU; `MK_TILES`; the kernel runs every combination) that the model
    finds fastest for this batch, and the deepest ring that fits VMEM. mxfp4_matmul: fixes that choice;
    prefetch_depth: fixes the ring's depth (e.g. the one a measured step ran)."""
    s = _system(system)
    note = ""
    if experts is None:
        experts = "mxfp4"
        try:
            mk_plan(cfg, batch, s, context, prefetch_depth=planlib.DEFAULT_PREFETCH_DEPTH)
        except planlib.PlanError as e:
            if "MXFP4" not in str(e):
                raise
            experts = "bf16"
            note = f"MXFP4 experts refused for this layout ({e}); modelled with bf16 expert tiles"
    elif experts not in planlib.FORMATS:
        raise SimError(f"experts must be one of {planlib.FORMATS}, found {experts!r}")
    choices = {f: ScheduleOptions.CHOICES[f] for f in MK_CHOICES}
    if experts != "mxfp4" or not has_fp8_mxu(s):
        choices["mxfp4_matmul"] = (MK.mxfp4_matmul,)
    if mxfp4_matmul is not None:
        if mxfp4_matmul not in ScheduleOptions.CHOICES["mxfp4_matmul"]:
            raise SimError(f"mxfp4_matmul must be one of {ScheduleOptions.CHOICES['mxfp4_matmul']}, "
                           f"found {mxfp4_matmul!r}")
        choices["mxfp4_matmul"] = (mxfp4_matmul,)
    choices["tile"] = MK_TILES
    depth = prefetch_depth
    if s.setup.mk_plan == "defaults":
        from mk.model.sharding import default_layout
        tile = planlib.default_tile(cfg, default_layout(cfg, s.devices), experts)
        choices = {f: (getattr(MK, f),) for f in MK_CHOICES} | {"mxfp4_matmul": choices["mxfp4_matmul"][:1],
                                                                  "tile": (tile,)}
        if depth is None:
            depth = KERNEL_RING
    step: dict[tuple, tuple] = {}
    key = lambda pick: tuple(f"{v[0]}x{v[1]}" if f == "tile" else v for f, v in pick.items())

    def run(pick: dict) -> float:
        if key(pick) not in step:
            opts = dataclasses.replace(MK, **{f: v for f, v in pick.items() if f != "tile"})
            p = mk_plan(cfg, batch, s, context, experts=experts, tile=pick["tile"], options=opts,
                        prefetch_depth=depth)
            if depth is not None:
                p.check_vmem()
            step[key(pick)] = (p, simulate(p, Machine.from_system(s), record=False,     # its time, no trace
                                           distinct_experts=expert_counts(cfg, batch, p.layout, True)).step_time)
        return step[key(pick)][1]

    # one choice at a time, the others at their best so far (each choice's effect hardly depends on
    # the others': an exhaustive search gave the same plans at B = 1, 2, 4 and 8)
    best = {f: v[0] for f, v in choices.items()}
    for f, values in choices.items():
        best[f] = min(values, key=lambda v: run({**best, f: v}))
    plan, _ = step[key(best)]
    info = {"options": plan.options.name, "experts": plan.experts, "prefetch_depth": plan.prefetch_depth,
            "tile": [plan.tile_k, plan.tile_n], "devices": plan.devices, "ep": plan.layout.ep,
            "tp_expert": plan.layout.tp_expert, "kernel_executes": plan.options.kernel, "chip": plan.chip,
            "mk_plan": s.setup.mk_plan, "all_reduce": plan.options.all_reduce,
            "mxfp4_matmul": plan.options.mxfp4_matmul,
            "dequant_ops_per_weight": schedule.dequant_ops(plan.options.mxfp4_matmul, plan.mxfp4_unpack)
            if plan.experts == "mxfp4" else 0,
            "choices_step_s": {"/".join(c): t for c, (_, t) in step.items()},
            "all_reduce_step_s": {a: min(t for c, (_, t) in step.items() if c[0] == a) for a in choices["all_reduce"]},
            "tile_step_s": {f"{tk}x{tn}": min(t for c, (_, t) in step.items() if c[-1] == f"{tk}x{tn}")
                            for tk, tn in choices["tile"]}}
    if note:
        info["note"] = note
    return plan, info


# The options mk's kernel executes either way (`ScheduleOptions.KERNEL_FREE` less the message rows,
# which are MK's 'packed'), and the tiles it runs bit-exact against the references (512-deep: the
# references' K_CHUNK; the lanes are free); `mk_plan_for` models every combination, keeps the fastest.
# attention_heads is left at MK's: the model prices the MLA attention's vector work, not the head loop's steps.
MK_CHOICES = tuple(f for f in ScheduleOptions.KERNEL_FREE if f not in ("message_rows", "attention_heads"))
MK_TILES = ((512, 512), (512, 256))


# Plan changes toward the seed's schedule's strengths, applied one after another to mk's plan
# (`mk_whatifs`): what each would buy. Only the first is what the kernel executes today.
MK_WHATIFS = (
    ("mk's kernel today (mk.kernel.plan.MK)", {}),
    ("+ 256-row tiles (narrow contractions padded less)", {"tile_k": 256}),
    ("+ the seed's gate/up re-blocked to FP8 (spec 2.3)", {"expert_gate_up": "fp8", "expert_down": "mxfp4",
                                                          "mxfp4_matmul": "fp8"}),
)


def mk_whatifs(cfg: K3Config, batch: int, system="tpu-v7x16", context: int = DEFAULT_CONTEXT,
               straggler: bool = True) -> list[dict]:
    """mk's plan with the `MK_WHATIFS` changes applied cumulatively: name, options changed, modelled
    step. Each is a plan option the simulator models; the kernel runs only the first."""
    base, info = mk_plan_for(cfg, batch, system, context)
    opts, tile, rows = base.options, (base.tile_k, base.tile_n), []
    for name, change in MK_WHATIFS:
        change = dict(change)
        tile = (change.pop("tile_k", tile[0]), tile[1])
        if change:
            opts = dataclasses.replace(opts, name="mk what-if", **change)
        plan = mk_plan(cfg, batch, system, context, options=opts, tile=tile, experts=base.experts)
        r = model(cfg, batch, system, plan, context=context, straggler=straggler)
        rows.append({"name": name, "options": opts.differences(MK), "tile": list(tile),
                     "prefetch_depth": plan.prefetch_depth, "step_time_s": r.step_time,
                     "tokens_per_s": r.tokens_per_s, "hbm_floor_s": r.hbm_floor, "breakdown_s": r.breakdown})
    return rows


def model(cfg: K3Config, batch: int, system="tpu-v7x16", plan: str | Plan = "seed", *,
          context: int = DEFAULT_CONTEXT, straggler: bool = True, record: bool = False,
          machine: Machine | None = None, distinct_experts: Sequence[float] | None = None) -> SimResult:
    """The modelled step of `plan` ('seed': the published schedule, `seed_plan`; 'mk': `mk_plan`;
    or a Plan) on `system`. Reads data/hardware.csv, microbench.csv and systems.csv, never the
    published figures it is compared with. distinct_experts: per MoE layer, e.g. what a measured
    step routed (default: `expert_counts` under uniform routing)."""
    s = _system(system)
    if isinstance(plan, str):
        if plan not in PLANS:
            raise SimError(f"plan must be one of {PLANS} or a mk.kernel.plan.Plan, found {plan!r}")
        plan = seed_plan(cfg, batch, s, context) if plan == "seed" else mk_plan_for(cfg, batch, s, context)[0]
    if distinct_experts is not None and len(distinct_experts) != cfg.n_moe:
        raise SimError(f"distinct_experts: {len(distinct_experts)} counts for {cfg.n_moe} MoE layers")
    return simulate(plan, machine or Machine.from_system(s), record=record,
                    distinct_experts=(list(distinct_experts) if distinct_experts is not None
                                      else expert_counts(cfg, batch, plan.layout, straggler)))


def bubbles(slow: SimResult, fast: SimResult) -> list[tuple[str, float]]:
    """(category, extra seconds per step) where `slow` spends more than `fast`, largest first."""
    cats = set(slow.breakdown) | set(fast.breakdown) | {"step overhead"}
    d = {c: slow.breakdown.get(c, 0.0) - fast.breakdown.get(c, 0.0) for c in cats}
    d["step overhead"] = slow.overhead - fast.overhead
    return sorted(((c, v) for c, v in d.items() if v > 1e-9), key=lambda kv: -kv[1])


def seed_runs_on(system) -> bool:
    """Whether the seed's schedule can be modelled on `system`: a GPU stack, or a TPU with the fp8
    MXU its K3 kernel's experts need (`SEED`: fp8 gate/up, MXFP4 on the fp8 path)."""
    s = _system(system)
    return s.program != "megakernel" or has_fp8_mxu(s)


def measured_setting(plan: Plan) -> str:
    """data/published.csv `setting` of mk's kernel timed on a chip: 'mk <config> <experts>-experts'."""
    return f"mk {plan.config_name()} {plan.experts}-experts"


def predict(cfg: K3Config, batch: int, system: str = "tpu-v7x16", *, context: int = DEFAULT_CONTEXT,
            straggler: bool = True, record: bool = False, plans: Sequence[str] = PLANS,
            experts: str | None = None, mxfp4_matmul: str | None = None,
            mk_distinct_experts: Sequence[float] | None = None, mk_prefetch_depth: int | None = None) -> dict:
    """Modelled step of each plan in `plans` that `system` runs (mk's: a TPU; the seed's:
    `seed_runs_on`), then the published figure and the ratio for the seed's schedule, and mk's
    kernel's step measured on the chip where data/published.csv has it (`measured_setting`). The
    model runs with data/published.csv locked (`hardware.published_locked`). experts, mxfp4_matmul:
    `mk_plan_for`'s. mk_distinct_experts: the experts mk's plan reads per MoE layer (`model`'s
    distinct_experts), e.g. those a step measured by `mk bench` routed. mk_prefetch_depth: mk's ring
    depth (default: the system's rule), e.g. the one a measured step ran."""
    s = _system(system)
    res, info = {}, {}
    plans = [p for p in plans if (p != "mk" or s.program == "megakernel") and (p != "seed" or seed_runs_on(s))]
    with hwlib.published_locked():
        for p in plans:
            if p == "mk":
                plan, info = mk_plan_for(cfg, batch, s, context, experts=experts, mxfp4_matmul=mxfp4_matmul,
                                         prefetch_depth=mk_prefetch_depth)
            else:
                plan = p
            res[p] = model(cfg, batch, s, plan, context=context, straggler=straggler, record=record,
                           distinct_experts=mk_distinct_experts if p == "mk" else None)
    pub = hwlib.published_value(s.published_system, "plain", batch)
    out = {"system": s.name, "batch": batch, "schedule": "seed", "context": context,
           "published_tok_s": pub, "_results": res}
    if info:
        out["mk_plan"] = info
    for p, r in res.items():
        out[p] = r.summary()
    if "seed" in res:
        out["predicted_tok_s"] = res["seed"].tokens_per_s
        out["ratio"] = res["seed"].tokens_per_s / pub if pub else None
    if "mk" in res:
        ours = res["mk"]
        out["mk_hbm_floor_ratio"] = ours.step_time / ours.hbm_floor
        measured = hwlib.published_value(s.published_system, measured_setting(ours.plan), batch, "step_time")
        if measured:
            out["mk_measured_step_s"] = measured
            out["mk_modelled_over_measured"] = ours.step_time / measured
    if "seed" in res and "mk" in res:
        ours, sd = res["mk"], res["seed"]
        out["mk_speedup"] = sd.step_time / ours.step_time
        out["mk_bubbles_s"] = bubbles(ours, sd) if ours.step_time > sd.step_time else []
    return out


def sensitivity(cfg: K3Config, system: str = "tpu-v7x16", batches: Sequence[int] = (1, 8),
                context: int = DEFAULT_CONTEXT) -> list[dict]:
    """The seed's schedule on `system` with every swept constant (`System.constants` with low !=
    high) at each end of its range, every other layout of data/systems.csv, and the mean instead of
    the slowest group's expert count. Rows: {"name", "what", "source", "assumption", "low", "high",
    "tokens_per_s": {batch: {"base", "low", "high"}}}; published figures are added after the model."""
    s = _system(system)
    with hwlib.published_locked():
        base_plans = {b: seed_plan(cfg, b, s, context) for b in batches}
        base = Machine.from_system(s)
        run = lambda b, plan=None, mach=base, strag=True: model(cfg, b, s, plan or base_plans[b], context=context,
                                                               straggler=strag, machine=mach).tokens_per_s
        ref = {b: run(b) for b in batches}
        rows = []
        for name, c in s.constants.items():
            if not c.swept:
                continue
            ends = {e: Machine.from_system(s.replace(**{name: v})) for e, v in (("low", c.low), ("high", c.high))}
            rows.append({"name": name, "what": "constant", "source": c.source, "assumption": c.assumption,
                         "value": c.value, "low": c.low, "high": c.high, "unit": c.unit,
                         "tokens_per_s": {b: {"base": ref[b], "low": run(b, mach=ends["low"]),
                                              "high": run(b, mach=ends["high"])} for b in batches}})
        for alt in s.alternatives:
            tok = {b: run(b, seed_plan(cfg, b, s, context, setup=alt)) for b in batches}
            rows.append({"name": f"layout: {alt.label()}", "what": "layout", "source": alt.source,
                         "assumption": alt.assumption, "value": None, "low": None, "high": None, "unit": "",
                         "tokens_per_s": {b: {"base": ref[b], "low": tok[b], "high": tok[b]} for b in batches}})
        tok = {b: run(b, strag=False) for b in batches}
        rows.append({"name": "experts per device: mean instead of the slowest group", "what": "model",
                     "source": "mk.perf.routing.distinct_experts", "assumption": False, "value": None, "low": None,
                     "high": None, "unit": "",
                     "tokens_per_s": {b: {"base": ref[b], "low": tok[b], "high": tok[b]} for b in batches}})
    for r in rows:
        for b in batches:
            pub = hwlib.published_value(s.published_system, "plain", b)
            t = r["tokens_per_s"][b]
            t["ratio_low"], t["ratio_high"] = (t["low"] / pub, t["high"] / pub) if pub else (None, None)
            t["ratio_base"] = t["base"] / pub if pub else None
    return rows


# ------------------------------------------------------------------------------------------------
# Speculative decoding: a verify step of batch x (1 + k) rows, the drafter's pass, L tokens a step
# ------------------------------------------------------------------------------------------------
def drafter_config(cfg: K3Config):
    """The drafter a speculative run of `cfg` uses: DSpark's own (spec 4.1, `DraftConfig()`) for K3,
    else `mk.model.drafter.config_for(cfg)`, the small drafter `mk generate` and `mk bench` draw."""
    from mk.model import drafter
    from mk.model.config import get_config
    return drafter.DraftConfig() if cfg == get_config("k3") else drafter.config_for(cfg)


def drafter_bytes(dc, batch: int, k: int, context: int = DEFAULT_CONTEXT) -> float:
    """HBM bytes of one step's drafter work (`mk.model.drafter.draft` then `observe`), bf16: every
    layer's weights, the lm_head, the Markov head's w2 once per draft and w1's k rows, the k
    embedding rows, the context keys / values attended (up to the window) and written (1 + k rows),
    `fc` over the 1 + k aux rows; the verify step's logits [B, 1 + k, V] f32, read once by the
    acceptance."""
    from mk.model.drafter import layout
    shapes = layout(dc)
    per_layer = sum(int(np.prod(s)) for n, s in shapes.items() if n.startswith("layers."))
    kv_row = 2 * dc.kv_heads * dc.head_dim * dc.layers            # one position's keys and values
    attended = min(context, dc.window)
    weights = per_layer + dc.vocab * dc.hidden + k * dc.vocab * dc.markov_rank + int(np.prod(shapes["fc.weight"]))
    rows = batch * (k * (dc.hidden + dc.markov_rank) + (attended + 1 + k) * kv_row)
    return 2.0 * (weights + rows) + 4.0 * batch * (1 + k) * dc.vocab


VERIFY_ROUTINGS = ("rows", "sequence", "routed")


def speculative(cfg: K3Config, batch: int, k: int, acceptance: float, system="tpu-v7x16", *,
                context: int = DEFAULT_CONTEXT, plans: Sequence[str] = PLANS, verify_routing: str = "rows",
                verify_distinct_experts: Sequence[float] | None = None, **predict_kw) -> dict:
    """Modelled speculative decoding at acceptance length `acceptance` (tokens a step, 1..k + 1):
    a verify step of batch x (1 + k) rows (`predict` at that many rows: the same weight traffic and
    MoE activation as a decode step of those rows; the KDA row chaining is not modelled), plus the
    drafter's pass at the system's DMA stream rate (`drafter_bytes`; on a system of several devices
    its weights assumed split over them, as the target's), against plain decoding's step of `batch`
    rows (`predict_kw`'s `mk_distinct_experts`, where given, are that step's). Per plan: verify_s,
    drafter_s, step_s, tokens_per_s = batch x acceptance / step_s, plain_tokens_per_s, speedup,
    drafter_share; plus the seed's published DSpark tokens/s where data/published.csv has it
    (`dspark_al<L>`, read after the model).

    verify_routing: which experts the verify step's rows stream (each distinct routed expert once a
    step). "rows": every one of the batch x (1 + k) rows routes on its own, uniformly (`expert_counts`
    at that many rows: distinct drafts); "sequence": the 1 + k rows of a sequence route as one token
    (the distinct experts of `batch` rows: the plain step's `mk_distinct_experts` where given), the
    case of a verify step whose rows repeat one token; "routed": mk's plan reads
    `verify_distinct_experts` (per MoE layer), the experts that many rows were measured to route,
    e.g. the counts a `mk bench` of batch x (1 + k) rows on the same seed's weights counted (random
    weights' router biases concentrate routing: fewer distinct experts than uniform); the seed's
    schedule then streams its "rows" count. The row count is the model's one term that grows the
    verify step past the decode step: at 8 rows of k3-chip, 15.9 of 16 experts a layer under "rows",
    8 under "sequence", about 10 routed on the bench's random weights (docs/performance.md)."""
    if verify_routing not in VERIFY_ROUTINGS:
        raise SimError(f"--verify-routing must be one of {', '.join(VERIFY_ROUTINGS)}, found {verify_routing!r}")
    if not 1 <= acceptance <= k + 1:
        raise SimError(f"--acceptance must lie in 1..{k + 1} (1 + --speculative), found {acceptance:g}")
    if batch * (1 + k) > planlib.MAX_ROWS:
        raise SimError(f"--speculative {k}: a verify step of batch {batch} x (1 + {k}) = {batch * (1 + k)} rows "
                       f"exceeds the {planlib.MAX_ROWS} rows a step allows (k <= {planlib.max_drafts(batch)} at "
                       f"batch {batch})")
    if (verify_routing == "routed") != (verify_distinct_experts is not None):
        raise SimError("verify_distinct_experts (the experts the verify step's rows routed) go with "
                       "verify_routing='routed', and it with them")
    s = _system(system)
    plain = predict(cfg, batch, s, context=context, plans=plans, **predict_kw)
    rows = batch * (1 + k)
    wide_kw = {key: v for key, v in predict_kw.items() if key != "mk_distinct_experts"}   # not the plain step's
    if verify_routing == "rows":
        verify = predict(cfg, rows, s, context=context, plans=plans, **wide_kw)["_results"]
    elif verify_routing == "routed":
        verify = predict(cfg, rows, s, context=context, plans=plans, mk_distinct_experts=verify_distinct_experts,
                         **wide_kw)["_results"]
    else:                                           # each plan's experts of `batch` rows, on B x (1 + k) rows
        straggler = predict_kw.get("straggler", True)
        alike = {p: expert_counts(cfg, batch, r.plan.layout, straggler) for p, r in plain["_results"].items()}
        if predict_kw.get("mk_distinct_experts") is not None and "mk" in alike:
            alike["mk"] = list(predict_kw["mk_distinct_experts"])
        verify = {}
        if "mk" in alike:
            verify["mk"] = predict(cfg, rows, s, context=context, plans=("mk",),
                                   **dict(wide_kw, mk_distinct_experts=alike["mk"]))["_results"]["mk"]
        if "seed" in alike:
            with hwlib.published_locked():
                verify["seed"] = model(cfg, rows, s, "seed", context=context, straggler=straggler,
                                       distinct_experts=alike["seed"])
    dc = drafter_config(cfg)
    drafter_s = drafter_bytes(dc, batch, k, context) / s.devices / s.value("dma_bw")
    out = {"system": s.name, "batch": batch, "k": k, "acceptance": acceptance, "rows": rows,
           "verify_routing": verify_routing, "context": context,
           "verify_distinct_experts": None if verify_distinct_experts is None else list(verify_distinct_experts),
           "drafter": f"{'DSpark (spec 4.1)' if dc.hidden == 7168 else 'config_for(cfg)'}: "
           f"{dc.layers} layer(s), hidden {dc.hidden}", "drafter_assumption": "weights split over the devices"
           if s.devices > 1 else None}
    for p in verify:
        v, d = verify[p].step_time, plain["_results"][p].step_time
        step = v + drafter_s
        out[p] = {"verify_s": v, "drafter_s": drafter_s, "step_s": step, "decode_step_s": d,
                  "verify_over_decode": v / d, "drafter_share": drafter_s / step,
                  "tokens_per_s": batch * acceptance / step, "plain_tokens_per_s": batch / d,
                  "speedup": batch * acceptance / step / (batch / d)}
    if float(acceptance).is_integer():
        pub = hwlib.published_value(s.published_system, f"dspark_al{int(acceptance)}", batch)
        if pub and "seed" in out:
            out["published_tok_s"], out["ratio"] = pub, out["seed"]["tokens_per_s"] / pub
    return out
