"""The modelled step as Chrome trace-event JSON: opens in Perfetto (ui.perfetto.dev) and in XProf's
trace viewer, next to a real `jax.profiler` trace.

One process per simulated step; one track (thread) per engine of the modelled device:

    core (phase)     the phase the core is in, waits included (every entry of `mk.kernel.schedule.schedule(plan)`)
    MXU              matmul work (per unit: one weight tile or matrix)
    vector unit      vector phases and the MXFP4 unpack
    DMA queue #i     weight / expert / cache DMAs and write-backs, from first byte to last (transfers
                     share the engine, so several are open at once: one lane each)
    ICI <link> #i    collectives on each link, from issue to completion
    kernel launches  the gaps before each kernel of a per-op (GPU) schedule

Event names come from the plan: `L<layer>:<tensor or phase>[#tile]`. Times are modelled (mk.perf.sim).
"""
from __future__ import annotations

import json
import os
from typing import NamedTuple, Sequence

import numpy as np

from mk.errors import writable_path


def _lanes(spans):
    """Greedy lane assignment so that the events of one lane never overlap."""
    ends: list[float] = []
    out = []
    for s, e, label in sorted(spans, key=lambda x: (x[0], x[1])):
        lane = next((i for i, t in enumerate(ends) if t <= s + 1e-15), None)
        if lane is None:
            lane = len(ends)
            ends.append(e)
        else:
            ends[lane] = e
        out.append((lane, s, e, label))
    return out


def trace_events(result, pid: int = 1, name: str | None = None) -> list[dict]:
    """Chrome trace events (`ph` 'M' names, 'X' complete events; µs) of one `mk.perf.sim.SimResult`."""
    plan = result.plan
    title = name or (f"modelled step: {plan.options.name} plan, B={result.batch}, on {result.machine} "
                     f"({result.step_time * 1e3:.3f} ms, mk.perf.sim)")
    ev = [{"ph": "M", "pid": pid, "name": "process_name", "args": {"name": title}}]
    tid = [0]

    def track(label: str, spans, cat: str):
        lanes = _lanes(spans)
        n = 1 + max((lane for lane, *_ in lanes), default=0)
        base = tid[0] + 1
        tid[0] += n
        for i in range(n):
            ev.append({"ph": "M", "pid": pid, "tid": base + i, "name": "thread_name",
                       "args": {"name": label if n == 1 else f"{label} #{i}"}})
            ev.append({"ph": "M", "pid": pid, "tid": base + i, "name": "thread_sort_index", "args": {"sort_index": base + i}})
        for lane, s, e, label_ in lanes:
            ev.append({"ph": "X", "pid": pid, "tid": base + lane, "ts": s * 1e6, "dur": max(e - s, 0.0) * 1e6,
                       "name": label_, "cat": cat})

    track("core (phase)", [(s, e, f"L{layer}:{n}") for _, layer, n, _, s, e in result.phase_times], "phase")
    track("MXU", result.tracks.get("mxu", []), "mxu")
    track("vector unit", result.tracks.get("vector", []), "vector")
    track("DMA queue", result.tracks.get("dma", []), "dma")
    for k in sorted(result.tracks):
        if k.startswith("ici "):
            track(f"ICI {k[4:]}", result.tracks[k], "ici")
    if result.tracks.get("launch"):
        track("kernel launches", result.tracks["launch"], "launch")
    return ev


def write_trace(results, path: str | os.PathLike) -> str:
    """Write one or several SimResults (one process each) to `path` as Chrome trace-event JSON."""
    path = writable_path(path, "--trace")
    results = results if isinstance(results, (list, tuple)) else [results]
    events = []
    for i, r in enumerate(results):
        events += trace_events(r, pid=i + 1)
    doc = {"traceEvents": events, "displayTimeUnit": "ns",
           "otherData": {"source": "mk.perf.sim (modelled, not measured)",
                         "steps": [{"plan": r.plan.options.name, "batch": r.batch, "machine": r.machine,
                                    "step_time_s": r.step_time} for r in results]}}
    with open(path, "w") as f:
        json.dump(doc, f)
    return path


# ---- reading a measured trace back (jax.profiler -> XProf's xplane) -------------------------------
SUMMARY_LINES = ("XLA Modules", "Steps", "XLA TraceMe", "Framework Ops", "Framework Name Scope")
# Where a kernel's named regions are not: the program and step lines, and the framework's op names.
# With --xla_enable_custom_call_region_trace libtpu lowers each `jax.named_scope` of a Pallas kernel to a
# `vtrace` pair (TraceMeStart(name) / TraceMeEnd(name) in the LLO), whose spans land on 'XLA TraceMe'.
NOT_REGION_LINES = ("XLA Modules", "Steps", "Framework Ops", "Framework Name Scope")
# --xla_xprof_register_llo_debug_info adds engine activity and zero-length `bundle.N` markers, not
# regions. On a TPU v5e with jax 0.10.2 (2026-12-06h) the markers are on 'Tensor Core' and the engines
# are samples on '_counters_' (events named 'MXU', 'XLU', ..., 'VDD Core FW Throttle(%)'): counter
# values, not busy spans, so no busy time is read from that line.
COUNTER_LINES = ("_counters_",)
ENGINES = ("MXU", "Vector ALU", "Vector Load", "Vector Store", "Scalar ALU", "XLU", "Vector EUP", "Vector Spills",
           "Vector Fills")


def is_region_event(line: str, name: str) -> bool:
    """Whether an event on a device plane may be one of a kernel's named regions."""
    return (line not in NOT_REGION_LINES and line not in COUNTER_LINES and name not in ENGINES and name != line
            and not name.startswith("bundle."))


def profile_data(xplane):
    """`xplane`: a path to *.xplane.pb, or a `jax.profiler.ProfileData` (returned as it is) -> the
    ProfileData. Read a large trace once and hand it to each reader below."""
    from jax.profiler import ProfileData
    return xplane if isinstance(xplane, ProfileData) else ProfileData.from_file(os.fspath(xplane))


class DeviceEvent(NamedTuple):
    """One event on a device plane of an XSpace (times in ns)."""
    plane: str
    line: str
    name: str
    start_ns: int
    dur_ns: int


def device_event_list(xplane) -> list[DeviceEvent]:
    """Every event on a device plane ('/device:...') of an XSpace, in plain Python (the core install
    has no pandas). `xplane`: as `profile_data` takes it."""
    data = profile_data(xplane)
    return [DeviceEvent(plane.name, line.name, e.name, e.start_ns, e.duration_ns)
            for plane in data.planes if plane.name.startswith("/device:")
            for line in plane.lines for e in line.events]


def device_events(xplane):
    """`device_event_list` as a pandas DataFrame (columns plane, line, name, start_ns, dur_ns), for
    the notebooks (pandas comes with the `notebooks` extra)."""
    import pandas as pd
    return pd.DataFrame(device_event_list(xplane), columns=list(DeviceEvent._fields))


def host_annotation_count(xplane, name: str) -> int:
    """How many host-side annotations (`jax.profiler.TraceAnnotation`, `StepTraceAnnotation`) named
    `name` an XSpace holds (TraceMe metadata after '#' ignored). The xplane keeps every event, where
    the trace viewer's trace.json stops at a million (a region-traced kernel fills that)."""
    data = profile_data(xplane)
    return sum(e.name.split("#")[0] == name for plane in data.planes if not plane.name.startswith("/device:")
               for line in plane.lines for e in line.events)


def step_device_seconds(events: Sequence[DeviceEvent], steps: int) -> list[float]:
    """Device time of each of `steps` executions of the traced step program: on the first device
    plane, the 'XLA Modules' program that ran at least `steps` times with the most time in all (a
    step's helpers, e.g. a fresh cache, are programs of their own). [] when the trace has none (a CPU).
    events: `device_event_list`'s."""
    return [e.dur_ns / 1e9 for e in _step_runs(events, steps)]


def program_runs_seconds(events: Sequence[DeviceEvent], program: str, runs: int) -> list[float]:
    """Device time of the `runs` longest executions, in order, of the 'XLA Modules' programs on the first
    device plane whose name contains `program`. One jitted function can compile to several programs
    (the speculative chunk gets the prefill's cache layout first, then its own), which
    `step_device_seconds` would count apart; and a device loop runs its chunk program more often than
    it has chunks of steps (the rehearsal's dispatches and the one dispatched after the last chunk, all
    with every row done: no step, microseconds), so the last `runs` executions would take an empty one."""
    mods = [e for e in events if e.line == "XLA Modules"]
    first = min((e.plane for e in mods), default=None)
    mine = [e for e in mods if e.plane == first and program in e.name]
    if len(mine) < runs:
        return []
    longest = sorted(mine, key=lambda e: e.dur_ns)[-runs:] if runs else []
    return [e.dur_ns / 1e9 for e in sorted(longest, key=lambda e: e.start_ns)]


def _step_runs(events: Sequence[DeviceEvent], steps: int) -> list[DeviceEvent]:
    """The last `steps` executions of the traced step program (see `step_device_seconds`), in order."""
    mods = [e for e in events if e.line == "XLA Modules"]
    if not mods:
        return []
    first = min(e.plane for e in mods)
    runs: dict[str, list[DeviceEvent]] = {}
    for e in mods:
        if e.plane == first:
            runs.setdefault(e.name, []).append(e)
    runs = {n: r for n, r in runs.items() if len(r) >= steps}
    if not runs:
        return []
    name = max(runs, key=lambda n: sum(e.dur_ns for e in runs[n]))
    return sorted(runs[name], key=lambda e: e.start_ns)[-steps:]


def _covered_ns(spans) -> int:
    """The length of the union of (start, end) spans: an overlap counted once (numpy; a
    region-traced step has millions of engine spans)."""
    a = np.array(list(spans), dtype=np.int64).reshape(-1, 2)
    if not len(a):
        return 0
    a = a[np.argsort(a[:, 0], kind="stable")]
    reach = np.maximum(a[:, 0], np.concatenate([[a[0, 0]], np.maximum.accumulate(a[:-1, 1])]))
    return int(np.maximum(0, a[:, 1] - reach).sum())


def _op_kind(name: str) -> str:
    """An op's name without XLA's '.N' suffix and HLO text ('%fusion.12 = ...' -> 'fusion')."""
    name = name.split(" = ")[0].lstrip("%")
    base, _, tail = name.rpartition(".")
    return base if base and tail.isdigit() else name


def step_op_breakdown(xplane, steps: int, top: int = 12) -> dict | None:
    """What the device did inside the last `steps` executions of the step program, per step on
    average, from the 'XLA Ops' line of the program's plane: `ops` (executions), `busy_ms` (the union
    of their intervals), `idle_ms` (the program's time no op covers: launches, pipeline drains and
    waits between ops), `by_kind` {op name without '.N': ms} and `top` [{"kind", "count", "ms"}] of the
    `top` kinds with the most time, plus `categories` {hlo_category: ms} where the trace's events
    carry that stat. None where the trace has no such program (a CPU). xplane: as `profile_data`."""
    data = profile_data(xplane)
    runs = _step_runs(device_event_list(data), steps)
    if not runs:
        return None
    plane = runs[0].plane
    ops = []                                     # (start, end, name, category)
    for pl in data.planes:
        if pl.name != plane:
            continue
        for line in pl.lines:
            if line.name != "XLA Ops":
                continue
            for e in line.events:
                cat = None
                try:
                    cat = next((str(v) for k, v in e.stats if k == "hlo_category"), None)
                except Exception:                # stats this reader cannot decode: no category
                    pass
                ops.append((e.start_ns, e.start_ns + e.duration_ns, e.name, cat))
    ops.sort()
    n_ops = busy = idle = 0.0
    by_kind: dict[str, float] = {}
    count: dict[str, int] = {}
    cats: dict[str, float] = {}
    for run in runs:
        lo, hi = run.start_ns, run.start_ns + run.dur_ns
        inside = [o for o in ops if o[0] >= lo and o[1] <= hi]
        covered = _covered_ns((s, e) for s, e, _, _ in inside)
        for s, e, name, cat in inside:
            kind = _op_kind(name)
            by_kind[kind] = by_kind.get(kind, 0.0) + (e - s)
            count[kind] = count.get(kind, 0) + 1
            if cat:
                cats[cat] = cats.get(cat, 0.0) + (e - s)
        n_ops += len(inside)
        busy += covered
        idle += run.dur_ns - covered
    k = len(runs)
    ms = lambda ns: ns / k / 1e6
    ranked = sorted(by_kind, key=by_kind.get, reverse=True)
    return {"steps": k, "step_ms": sum(r.dur_ns for r in runs) / k / 1e6, "ops": n_ops / k, "busy_ms": ms(busy),
            "idle_ms": ms(idle), "by_kind": {n: round(ms(by_kind[n]), 4) for n in ranked},
            "top": [{"kind": n, "count": count[n] / k, "ms": round(ms(by_kind[n]), 4)} for n in ranked[:top]],
            "categories": {c: round(ms(v), 4) for c, v in sorted(cats.items(), key=lambda x: -x[1])}}


def outermost(start, end) -> np.ndarray:
    """[n] bool: span i = [start[i], end[i]] lies inside no other span (of identical spans, the
    first counts as outermost). One sort, O(n log n): a region-traced step has 1e5 spans."""
    order = np.lexsort((np.arange(len(start)), -np.asarray(end), np.asarray(start)))   # by start, longest first
    e = np.asarray(end)[order]
    before = np.concatenate([[np.iinfo(np.int64).min], np.maximum.accumulate(e)[:-1]])  # latest end of any earlier span
    top = np.empty(len(start), bool)
    top[order] = e > before
    return top


def is_kernel_op(name: str, kernel: str) -> bool:
    """`name`: an op's name, or (XProf's device plane on a TPU) its HLO text '%name.N = (...) custom-call(...)'."""
    name = name.split(" = ", 1)[0].lstrip("%")
    return name == kernel or name.startswith(kernel + ".") or name.startswith(kernel + "_")


def kernel_phases(events: Sequence[DeviceEvent], kernel: str, steps: int) -> dict | None:
    """What a region-traced kernel's trace holds, per execution of the kernel op named `kernel` (XLA
    appends '.N'; the last `steps` on the first plane that ran it): `kernel_ms` (each execution),
    `top_ms` / `all_ms` {region: ms per execution} (outermost regions; every region, nested ones
    too), `count` {region: executions of it}, `coverage` (outermost regions' share of each
    execution), `busy_ms` {engine line: the union of its busy spans per execution} and `lines`
    {line: {"events" per execution, a few "names"}}. Regions: `is_region_event`'s events that lie
    inside an execution, on neither an engine's line nor the op's. None where no execution is found.
    events: `device_event_list`'s."""
    import statistics

    is_kernel = lambda name: is_kernel_op(name, kernel)
    kern = sorted((e for e in events if is_kernel(e.name)), key=lambda e: e.start_ns)
    if not kern:
        return None
    plane = min(e.plane for e in kern)
    line = statistics.mode(e.line for e in kern if e.plane == plane)
    kern = [e for e in kern if e.plane == plane and e.line == line][-steps:]
    n = len(kern)
    by_line: dict[str, list[DeviceEvent]] = {}          # one pass over the events, then numpy per line
    for e in events:
        if e.plane == plane and e.line != line and e.line not in NOT_REGION_LINES:
            by_line.setdefault(e.line, []).append(e)
    lo = np.array([k.start_ns for k in kern], np.int64)
    hi = lo + np.array([k.dur_ns for k in kern], np.int64)
    lines: dict[str, dict] = {}
    busy: dict[str, float] = {}
    top_ms: dict[str, float] = {}
    all_ms: dict[str, float] = {}
    count: dict[str, int] = {}
    covered = np.zeros(n)
    for ln, evs in by_line.items():
        names = list(dict.fromkeys(e.name for e in evs[:4096]))[:8]
        lines[ln] = {"events": len(evs) / n, "names": names}
        start = np.fromiter((e.start_ns for e in evs), np.int64, len(evs))
        end = start + np.fromiter((e.dur_ns for e in evs), np.int64, len(evs))
        if ln in COUNTER_LINES:
            continue
        if ln in ENGINES or any(nm == ln or nm in ENGINES for nm in names):       # an engine's busy spans
            busy[ln] = _covered_ns(np.stack([start, end], 1)) / 1e6 / n
            continue
        which = np.searchsorted(lo, start, side="right") - 1                  # the execution each starts in
        keep = (which >= 0) & (end <= hi[np.maximum(which, 0)])
        keep &= np.fromiter((is_region_event(ln, e.name) and not is_kernel(e.name) for e in evs), bool, len(evs))
        for x in range(n):
            idx = np.flatnonzero(keep & (which == x))
            if not len(idx):
                continue
            top = outermost(start[idx], end[idx])
            for j, t in zip(idx.tolist(), top.tolist()):
                nm, ms = evs[j].name, (end[j] - start[j]) / 1e6 / n
                all_ms[nm] = all_ms.get(nm, 0.0) + ms
                count[nm] = count.get(nm, 0) + 1
                if t:
                    top_ms[nm] = top_ms.get(nm, 0.0) + ms
            covered[x] += (end[idx] - start[idx])[top].sum()
    coverage = [float(c / k.dur_ns) for c, k in zip(covered, kern) if c]
    return {"kernel_ms": [k.dur_ns / 1e6 for k in kern], "plane": plane, "line": line, "top_ms": top_ms,
            "all_ms": all_ms, "count": count, "coverage": coverage, "busy_ms": busy, "lines": lines}
