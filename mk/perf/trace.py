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
    return [e.dur_ns / 1e9 for e in sorted(runs[name], key=lambda e: e.start_ns)[-steps:]]
