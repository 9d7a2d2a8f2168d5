"""What a notebook's `parameters` cell turns into: a config and the weights to run.

Every notebook has the same two model parameters:

    config = None        # a preset name ("mini", "k3-chip", "k3-slice", "k3"); None: the backend's default
    checkpoint = None    # a Hugging Face checkpoint directory; overrides `config`

and calls `model_config(config, checkpoint)` when it only needs shapes (rooflines, the simulator,
the deviceless compiler) or `load_model(config, checkpoint)` when it runs the model. Defaults
follow the backend, so one notebook serves this CPU machine and a TPU VM unchanged:

    backend   config=None    weights when checkpoint is None
    cpu       "mini"         a synthetic checkpoint written on the fly (`mk.io.synth`) and loaded back
                             through `mk.io.checkpoint`: the notebook exercises the real loader
    tpu       "k3-chip"      random weights (`init_params`): full K3 matrix widths, 3 layers, 16
                             experts, 6.0 GB bf16, which fits one TPU v5e (15.7 GiB) beside a second
                             copy (the kernel's packed weights); k3-slice (16.7 GB) does not fit

`plan_config` is the shapes-only default (plans, the simulator, deviceless compiles): `k3-slice` on
CPU, the model that runs (`k3-chip`) on a TPU.

The rest are the notebooks' shared measurement helpers, for a TPU backend (they run on CPU too,
in interpret mode, where the times are NOT speed claims: `SPEED_CAVEAT`): `kernel_sweep` (the
compiled kernel's step time per prefetch depth / tile / batch / context, weights packed once per
tile), `verify_times` (the speculative verify step per k), `chip_machine` (the simulator's machine
for the local chip) and the XProf trace readers `device_events`, `kernel_ops`, `kernel_regions`.
"""
from __future__ import annotations

import dataclasses
import gc
import os
import tempfile
import time
from dataclasses import dataclass

import numpy as np

from mk.model.config import K3Config, get_config
from mk.errors import UserError
from mk.perf.cases import default_depth_of, default_tile_of, edge, newest_cases, races, record_rows  # noqa: F401  (notebook 04 reads the records with these)
from mk.perf.trace import SUMMARY_LINES, device_events, host_annotation_count, is_kernel_op, is_region_event, outermost, profile_data  # noqa: F401  (the notebooks read traces with these)

DEFAULT_CONFIG = {"cpu": "mini", "tpu": "k3-chip"}
PLAN_CONFIG = {"cpu": "k3-slice", "tpu": "k3-chip"}

SPEED_CAVEAT = ("CPU backend: the kernel runs in TPU interpret mode and the reference on XLA:CPU, so the times "
                "printed here are NOT speed claims (on CPU this notebook checks correctness; on a TPU it measures)")


class NotebookError(UserError, RuntimeError):
    """A measurement a notebook needs could not be made (the message says what and where)."""


def _backend() -> str:
    from mk.kernel.decode import on_tpu

    return "tpu" if on_tpu() else "cpu"


def backend_label() -> str:
    """Where a notebook's measurements come from, for printouts and figure titles."""
    if _backend() != "tpu":
        return "CPU (interpret mode / XLA:CPU; not a speed claim)"
    import jax
    n = jax.local_device_count()
    return f"{jax.devices()[0].device_kind} ({n} device{'s' if n > 1 else ''})"


def model_name(config: "str | K3Config | None" = None, checkpoint: "str | os.PathLike | None" = None,
               defaults: dict = DEFAULT_CONFIG) -> str:
    """A short label for figure titles: the checkpoint folder's name, or the preset's."""
    if checkpoint is not None:
        return os.path.basename(os.path.normpath(os.fspath(checkpoint)))
    if config is None:
        return defaults[_backend()]
    return config if isinstance(config, str) else "custom config"


def model_config(config: "str | K3Config | None" = None, checkpoint: "str | os.PathLike | None" = None,
                 defaults: dict = DEFAULT_CONFIG) -> K3Config:
    """The config a notebook analyses: the checkpoint's config.json, else `config`, else the default."""
    if checkpoint is not None:
        from mk.io.checkpoint import load_config

        return load_config(checkpoint)
    return get_config(defaults[_backend()] if config is None else config)


def plan_config(config: "str | K3Config | None" = None, checkpoint: "str | os.PathLike | None" = None) -> K3Config:
    """The shapes-only default (`PLAN_CONFIG`): k3-slice on CPU, the chip's model on a TPU."""
    return model_config(config, checkpoint, PLAN_CONFIG)


def init_params(cfg: K3Config, seed: int = 0) -> tuple[dict, str]:
    """Random weights for `cfg` (bf16 experts) and a description: THE one place notebooks make them.
    `mk.model.params.init` draws configs above `DEVICE_INIT_ABOVE` parameters (k3-chip) on the device."""
    from mk.model import params as pm

    where = "on the device" if pm.num_params(cfg) > pm.DEVICE_INIT_ABOVE else "host numpy"
    return pm.init(cfg, seed), f"random weights (mk.model.params.init, seed {seed}, {where})"


@dataclass(frozen=True)
class Model:
    name: str             # label for titles (`model_name`)
    cfg: K3Config
    params: dict          # the `mk.model.params` tree (bf16 experts), jax arrays
    source: str           # where the weights came from, for the notebook's printout

    def __iter__(self):   # cfg, params = load_model(...)
        return iter((self.cfg, self.params))


def load_model(config: "str | K3Config | None" = None, checkpoint: "str | os.PathLike | None" = None,
               seed: int = 0, synthetic: bool | None = None) -> Model:
    """Config and weights for a notebook (see the module docstring for the defaults).

    `synthetic`: with no checkpoint, write a synthetic checkpoint and load it (default: on CPU) or
    use `mk.model.params.init(cfg, seed)` directly (default: on TPU).
    """
    from mk.io import checkpoint as ckpt

    if checkpoint is not None:
        cfg, params = ckpt.load_with_config(checkpoint, progress=False)
        return Model(model_name(None, checkpoint), cfg, params, f"checkpoint {os.fspath(checkpoint)}")
    cfg = model_config(config)
    if synthetic is None:
        synthetic = _backend() == "cpu"
    if not synthetic:
        params, source = init_params(cfg, seed)
        return Model(model_name(config), cfg, params, source)
    from mk.io import synth

    with tempfile.TemporaryDirectory(prefix="mk-synth-") as tmp:
        synth.write_checkpoint(cfg, tmp, seed=seed)
        params = ckpt.load(tmp, progress=False)
    return Model(model_name(config), cfg, params, f"synthetic checkpoint (mk.io.synth, seed {seed}, MXFP4 experts), "
                              f"written and loaded back through mk.io.checkpoint")


def default_mesh(cfg: K3Config, mesh: "int | None" = None) -> int:
    """Devices the kernel runs on in a notebook: `mesh` if given, else every local device on a TPU
    backend (the largest count that divides the model: mk.model.sharding), else 1."""
    if mesh is not None:
        return int(mesh)
    if _backend() != "tpu":
        return 1
    import jax
    from mk.model.sharding import gcd_devices
    return gcd_devices(cfg, jax.local_device_count())


# ------------------------------------------------------------------------------------------------
# Measuring on the chip
# ------------------------------------------------------------------------------------------------
DEVICE_KIND_CHIP = {"TPU v5 lite": "tpu-v5e", "TPU v5e": "tpu-v5e", "TPU v5": "tpu-v5p", "TPU v5p": "tpu-v5p",
                    "TPU v6 lite": "tpu-v6e", "TPU v6e": "tpu-v6e", "TPU7x": "tpu-v7"}


def local_chip() -> str:
    """The data/hardware.csv name of the local TPU (from its JAX device kind)."""
    import jax
    kind = jax.devices()[0].device_kind
    if jax.default_backend() != "tpu" or kind not in DEVICE_KIND_CHIP:
        raise NotebookError(f"no known TPU here (backend {jax.default_backend()!r}, device kind {kind!r}; "
                            f"known: {sorted(DEVICE_KIND_CHIP)}): add it to mk.notebooks.helpers.DEVICE_KIND_CHIP")
    return DEVICE_KIND_CHIP[kind]


def chip_roof(chip: str) -> tuple[float, float]:
    """(bf16 FLOP/s, HBM bytes/s) of one device (TensorCore) of `chip`, datasheet (data/hardware.csv)."""
    from mk.perf.hardware import load_chips
    c = load_chips()[chip]
    return c.flops("bf16") / c.cores_per_chip, c.per_core("hbm_bw")


def chip_machine(chip: str):
    """The simulator's machine (`mk.perf.sim.Machine`) for one device of `chip`: the system of that name
    in data/systems.csv where there is one (`tpu-v5e`: measured constants, `mk simulate --system`);
    else HBM bandwidth (also the DMA stream rate) and MXU peaks from the chip's datasheet rows in
    data/hardware.csv, and every other
    rate (DMA latency, MXU push rows, vector rates, per-step overhead, routing) is the TPU v7
    system's (`tpu-v7x16`, data/microbench.csv), since data/ has no measurement for this chip. Its
    `name` says so: a modelled figure from it is labelled with that name."""
    import dataclasses

    from mk.perf import hardware, sim
    from mk.perf.hardware import load_chips
    if chip in {s.system for s in hardware.load_systems()}:   # a system of its own: its measured constants
        return sim.Machine.from_system(hardware.get_system(chip))
    c = load_chips()[chip]
    base = sim.Machine.from_system(hardware.get_system("tpu-v7x16"))
    flops = {dt: c.flops(dt) / c.cores_per_chip for dt in ("bf16", "fp8") if c.flops(dt)}
    bw = c.per_core("hbm_bw")
    return dataclasses.replace(base, dma_bw=bw, hbm_bw=bw, flops=flops,
                               name=f"{chip} (datasheet HBM and MXU; other rates tpu-v7's)")


def plan_bytes(plan) -> float:
    """HBM bytes one step of `plan` moves on one device (weights, caches, states; `mk.perf.roofline`,
    summed from the plan's own entries)."""
    from mk.perf import roofline as rl
    return rl.roofline(plan.config, plan.batch, plan.ctx, plan=plan, system="tpu-v7x16").total_bytes


def time_calls(call, steps: int, warmup: int = 2) -> np.ndarray:
    """Wall seconds of each of `steps` calls of `call()` (each blocked on its result), after
    `warmup` untimed calls (the first compiles)."""
    import jax
    if steps < 1:
        raise NotebookError(f"steps must be >= 1, found {steps}")
    for _ in range(warmup):
        jax.block_until_ready(call())
    out = np.empty(steps)
    for i in range(steps):
        t0 = time.perf_counter()
        jax.block_until_ready(call())
        out[i] = time.perf_counter() - t0
    return out


def bench_summary(seconds) -> dict:
    """median / min / max ms and steps of per-call seconds, as `mk bench` reports them."""
    from mk.perf.bench import summarize
    return summarize(list(seconds))


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300] if text else ''}"


def free_device_memory():
    """Collect what Python no longer references (a dropped kernel's packed weights: 6 GB at k3-chip)."""
    gc.collect()


def _time_decode(step, weights, cfg: K3Config, batch: int, ctx: int, context: int, steps: int, warmup: int) -> dict:
    """Time `step(weights, cache, tokens)` (a `make_decode_step`) from position `context - 1`, as
    `mk bench` times its cases (`mk.perf.bench.time_steps`, `summarize`)."""
    from mk.perf import bench

    new_cache = lambda: bench.cache_at(cfg, batch, ctx, context - 1)
    last = {}

    def run(cache, tok):
        out = step(weights, cache, tok)
        last["logits"] = out[0]
        return out

    tokens = np.zeros((warmup + steps, batch), np.int32)
    out = bench.summarize(bench.time_steps(run, new_cache, tokens, warmup, ctx - context + 1))
    if not np.isfinite(np.asarray(last["logits"], np.float32)).all():
        raise NotebookError("non-finite logits")
    return out


def kernel_sweep(params: dict, cfg: K3Config, points, *, steps: int = 20, warmup: int = 3, mesh: int | None = None,
                 interpret=None) -> list[dict]:
    """The kernel's step time at each point, a dict with `depth`, `tile` (None: the plan's
    default), `batch` (default 1), `context` (tokens each row attends to; default 1) and
    `attention_heads` (`ScheduleOptions.attention_heads`; None: the default).

    Weights are packed once per (tile, batch) and shared by every depth whose plan packs them
    alike (`mk.kernel.aot.kernel_weight_shapes`), and dropped before the next are packed (two 6 GB
    copies do not fit a v5e beside the parameters). A point the plan refuses (VMEM) or the compiler
    or the chip fails is a row with `error` set, not an exception: the caller asserts on them.
    Rows: the point, median/min/max ms over `steps`, the plan's VMEM and HBM bytes per step, GB/s."""
    from mk.kernel.aot import kernel_weight_shapes
    from mk.kernel.step import _plan_for, kernel_weights
    from mk.kernel.decode import default_mesh as kernel_mesh, make_decode_step
    from mk.kernel.plan import MK
    from mk.model.layout import PlanError

    pts = [dict(depth=p.get("depth"), tile=p.get("tile"), batch=int(p.get("batch", 1)),
                context=int(p.get("context", 1)), attention_heads=p.get("attention_heads")) for p in points]
    groups: dict = {}
    for i, p in enumerate(pts):
        groups.setdefault((p["tile"], p["batch"]), []).append(i)
    rows: list = [None] * len(pts)
    for (tile, batch), idx in groups.items():
        weights = packed_for = None
        for i in idx:
            p = pts[i]
            row = dict(p, median_ms=np.nan, min_ms=np.nan, max_ms=np.nan, steps=0, vmem_mib=np.nan,
                       bytes_per_step=np.nan, gb_s=np.nan, error=None)
            rows[i] = row
            ctx = -(-(p["context"] + steps + warmup) // 128) * 128          # room for every timed step
            try:
                kw = {"tile": tile} if tile else {}
                if p["attention_heads"]:
                    kw["options"] = dataclasses.replace(MK, attention_heads=int(p["attention_heads"]))
                plan = _plan_for(params, cfg, batch, p["depth"], ctx, mesh, kw)
            except PlanError as e:
                row["error"] = f"plan refuses: {e}"
                continue
            row.update(depth=plan.prefetch_depth, attention_heads=plan.attention_heads, tile=plan.tile_k if plan.tile_k == plan.tile_n else
                       f"{plan.tile_k}x{plan.tile_n}", vmem_mib=plan.vmem_planned_bytes / 2**20,
                       bytes_per_step=plan_bytes(plan))
            try:
                if weights is None or kernel_weight_shapes(plan) != packed_for:
                    weights = None
                    free_device_memory()
                    weights = kernel_weights(plan, params, kernel_mesh(plan))
                    packed_for = kernel_weight_shapes(plan)
                row.update(_time_decode(make_decode_step(plan, interpret, kernel_mesh(plan)), weights, cfg, batch,
                                        ctx, p["context"], steps, warmup))
                row["gb_s"] = row["bytes_per_step"] / (row["median_ms"] * 1e-3) / 1e9
            except Exception as e:       # a compile or run failure is this point's result
                row["error"] = _first_line(e)
        weights = None
        free_device_memory()
    return rows


def verify_times(params: dict, cfg: K3Config, ks, *, steps: int = 20, warmup: int = 3, mesh: int | None = None,
                 interpret=None, prefetch_depth: int | None = None) -> list[dict]:
    """Step time of the kernel's speculative verify step (`mk.kernel.step.KernelVerifier`, one sequence,
    1 + k rows) for each k; k = 0 is the plain decode step through the same code. One verifier at a
    time (each packs its own weights). Rows: k, rows, median/min/max ms, HBM bytes per step, error."""
    import jax.numpy as jnp

    from mk.kernel.step import KernelVerifier

    rows = []
    for k in ks:
        row = dict(k=int(k), rows=1 + int(k), median_ms=np.nan, min_ms=np.nan, max_ms=np.nan, steps=0,
                   bytes_per_step=np.nan, error=None)
        rows.append(row)
        ctx = -(-((1 + k) * (steps + warmup + 1)) // 128) * 128
        v = None
        try:
            v = KernelVerifier(params, cfg, 1, int(k), prefetch_depth=prefetch_depth, ctx=ctx, interpret=interpret,
                               mesh=mesh)
            row["bytes_per_step"] = plan_bytes(v.plan)
            state = {"cache": v.init_cache(1, ctx)}
            toks = jnp.zeros((1, 1 + k), jnp.int32)
            def call():
                logits, block = v.verify(None, state["cache"], toks)
                # accept the anchor only; a fresh count array each step: it becomes the cache's
                # state_row, which the next verify donates
                state["cache"] = v.commit(state["cache"], block, np.zeros((1,), np.int32))
                return logits

            row.update(bench_summary(time_calls(call, steps, warmup)))
        except Exception as e:
            row["error"] = _first_line(e)
        finally:
            v = state = call = None
            free_device_memory()
    return rows


# ------------------------------------------------------------------------------------------------
# Reading an XProf trace (jax.profiler.trace's *.xplane.pb) back
# ------------------------------------------------------------------------------------------------
def kernel_ops(ev, kernel: str | None = None):
    """The kernel's executions on the device: the events named after the pallas_call
    (`mk.kernel.decode.KERNEL_NAME`, XLA appends '.N') on one line of the first device plane that has them
    (the line with the most; XLA Ops on a TPU). Raises NotebookError naming what the trace has."""
    if kernel is None:
        from mk.kernel.decode import KERNEL_NAME as kernel
    hit = ev[ev.name.map(lambda n: is_kernel_op(n, kernel))]
    if hit.empty:
        planes = sorted(set(ev.plane))
        top = ev.groupby("name").dur_ns.sum().sort_values(ascending=False).head(8).index.tolist() if len(ev) else []
        raise NotebookError(f"no event named {kernel!r}(.N) on any device plane of the trace (device planes "
                            f"{planes}; lines {sorted(set(ev.line))}; longest events {top})")
    plane = sorted(set(hit.plane))[0]
    hit = hit[hit.plane == plane]
    line = hit.line.value_counts().index[0]
    return hit[hit.line == line].sort_values("start_ns").reset_index(drop=True)


def kernel_regions(ev, ops):
    """The named regions inside the kernel's executions (`jax.named_scope` in the kernel body becomes
    a trace region when libtpu runs with --xla_enable_custom_call_region_trace=true): events of the
    kernel's plane that may be regions (`mk.perf.trace.is_region_event`: 'XLA TraceMe' and other lines,
    not the engines' busy lines of --xla_xprof_register_llo_debug_info) and not the kernel op itself,
    that lie within an execution. Columns: step (index of the execution), name, line, start_ns,
    dur_ns, top (not inside another region of the same step). Empty when the trace has none."""
    import pandas as pd
    plane = ops.plane.iloc[0]
    region = np.array([is_region_event(line, name) for line, name in zip(ev["line"], ev["name"])], bool)
    cand = ev[(ev.plane == plane) & region & ~ev.name.isin(set(ops.name)) & (ev.line != ops.line.iloc[0])]
    parts = []
    for i, op in enumerate(ops.itertuples()):
        end = op.start_ns + op.dur_ns
        r = cand[(cand.start_ns >= op.start_ns) & (cand.start_ns + cand.dur_ns <= end)].copy()
        if r.empty:
            continue
        r["top"] = outermost(r.start_ns.to_numpy(), (r.start_ns + r.dur_ns).to_numpy())
        r.insert(0, "step", i)
        parts.append(r)
    cols = ["step", "plane", "line", "name", "start_ns", "dur_ns", "top"]
    return pd.concat(parts, ignore_index=True)[cols] if parts else pd.DataFrame(columns=cols)


REGION_TRACE_FLAGS = ("--xla_enable_custom_call_region_trace=true", "--xla_xprof_register_llo_debug_info=true")


def enable_region_trace() -> str:
    """Make libtpu trace the kernel's `jax.named_scope` regions (Mosaic lowers each to
    tpu.trace_start / trace_stop; libtpu records them only with `REGION_TRACE_FLAGS`), by adding the
    flags to LIBTPU_INIT_ARGS. Must run before JAX opens its backend (the first jax.devices(), array
    or jit call in the process); raises NotebookError otherwise. The instrumentation costs time:
    step times measured with it on are not the kernel's plain speed. Returns LIBTPU_INIT_ARGS."""
    from jax._src import xla_bridge
    if xla_bridge.backends_are_initialized():
        raise NotebookError("region tracing must be enabled before JAX opens its backend: set it in the notebook's "
                            "first cell, before any jax.devices(), array or jit call")
    args = os.environ.get("LIBTPU_INIT_ARGS", "").split()
    os.environ["LIBTPU_INIT_ARGS"] = " ".join(args + [f for f in REGION_TRACE_FLAGS if f not in args])
    return os.environ["LIBTPU_INIT_ARGS"]


def run_output_dir(name: str, fallback: str) -> str:
    """A folder for a notebook's extra outputs (e.g. an XProf trace): <run folder>/name when the
    notebook runs under `mk notebooks --out DIR` (so it comes back with the run), else `fallback`."""
    from mk.notebooks.runner import FIGURES_ENV
    figs = os.environ.get(FIGURES_ENV)
    return os.path.join(os.path.dirname(os.path.abspath(figs)), name) if figs else fallback


# ---- the measured records as a figure (the README's headline, notebook 04) --------------------------
IMPL_LABELS = {"kernel": "mk megakernel", "xla": "fair XLA step", "peer": "fair XLA step + vLLM TPU fused MoE (peer)",
               "xla-ragged": "fair XLA step (ragged_dot MoE)"}
IMPL_STYLE = {"kernel": ("#1f77b4", "circle"), "xla": ("#ff7f0e", "square"), "peer": ("#2ca02c", "diamond"),
              "xla-ragged": ("#9467bd", "triangle-up")}


def records_figure(records, batches=None):
    """Decode tokens/s from device time (the step program alone, from a profiler trace) against depth:
    one panel per expert format and batch, one line per implementation, each point the newest bench
    row of its case on the kernel's defaults, for the cases where the kernel met a rival (`races`); the
    kernel's points carry its edge over the better rival. batches: the panels' batches (default: every
    batch measured). records: `mk.perf.results.find_records`."""
    from plotly.subplots import make_subplots

    cases = races(records)
    layers = {}
    for config in {c[0] for c in cases}:
        try:
            layers[config] = get_config(config).layers
        except Exception:                                 # a checkpoint's config: not on a depth axis
            pass
    times, edges = {}, {}                                 # (experts, batch) -> {impl: {layers: ms}}, {layers: edge}
    for (config, experts, b), impls in cases.items():
        if config in layers and (batches is None or b in batches):
            for impl, r in impls.items():
                times.setdefault((experts, b), {}).setdefault(impl, {})[layers[config]] = r["device_median_ms"]
            edges.setdefault((experts, b), {})[layers[config]] = edge(impls)
    if not times:
        raise UserError("no bench record races the kernel against another step (mk bench --impl kernel,xla[,peer] --json)")
    formats = sorted({e for e, _ in edges}, key=lambda e: e != "bf16")
    bs = sorted({b for _, b in edges})
    peer_fmt = {e: impls["peer"].get("peer_format") for (_, e, _), impls in cases.items() if "peer" in impls}
    title = lambda e, b: (f"{e} experts" + (f" (peer {peer_fmt[e]})" if peer_fmt.get(e) not in (None, e) else "")
                          + f", B = {b}")
    fig = make_subplots(rows=len(formats), cols=len(bs), shared_xaxes=True, horizontal_spacing=0.05,
                        vertical_spacing=0.14, subplot_titles=[title(e, b) for e in formats for b in bs])
    for i, e in enumerate(formats, 1):
        for j, b in enumerate(bs, 1):
            by, depths = times.get((e, b), {}), sorted(edges.get((e, b), ()))
            for impl in [k for k in IMPL_LABELS if k in by]:
                xs = [d for d in depths if d in by[impl]]
                ms = [by[impl][d] for d in xs]
                text = [f"{edges[e, b][d]:.2f}x" for d in xs] if impl == "kernel" else None   # over the better rival
                color, symbol = IMPL_STYLE.get(impl, ("#7f7f7f", "x"))
                fig.add_scatter(row=i, col=j, x=xs, y=[b / (t / 1e3) for t in ms], mode="lines+markers" + ("+text" if text else ""),
                                name=IMPL_LABELS[impl], legendgroup=impl, showlegend=impl not in {t.legendgroup for t in fig.data},
                                line=dict(color=color), marker=dict(symbol=symbol, size=8),
                                text=text, textposition="top center", textfont=dict(size=10, color=color))
    all_depths = sorted({d for v in edges.values() for d in v})
    fig.update_xaxes(tickvals=all_depths, type="log", title_text="layers (about the same bytes per step)", row=len(formats))
    fig.update_yaxes(title_text="tokens/s", col=1, rangemode="tozero")
    fig.update_yaxes(rangemode="tozero")
    fig.update_layout(title="Decode tokens/s on one TPU v5e against depth, from device time (the step program alone); "
                            "labels: mk's edge over the better rival", legend=dict(orientation="h", y=-0.18),
                      margin=dict(t=90, b=110), width=1250, height=300 + 260 * len(formats))
    return fig
