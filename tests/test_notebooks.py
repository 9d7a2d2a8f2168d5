"""The notebooks as committed (no stale outputs, a parameters cell) and the headless runner."""
import os

import numpy as np
import nbformat
import pytest

from mk.notebooks import runner as notebook_runner
from mk.notebooks.runner import notebooks, run_all, save_figure

NBS = notebooks()


def test_there_are_six_notebooks():
    assert [p.name[:2] for p in NBS] == ["00", "01", "02", "03", "04", "05"]


@pytest.mark.parametrize("path", NBS, ids=lambda p: p.name)
def test_every_notebook_ends_with_a_takeaway_and_lists_its_parameters(path):
    """A student reads the lesson last: the final cell is a markdown takeaway after a code cell that prints
    (and asserts) its numbers; every parameter says what values it takes (a comment on its line)."""
    nb = nbformat.read(str(path), as_version=4)
    assert nb.cells[-1].cell_type == "markdown" and "takeaway" in nb.cells[-1].source.lower(), \
        f"{path.name}: the last cell should be a markdown takeaway"
    assert nb.cells[-2].cell_type == "code" and "assert" in nb.cells[-2].source, \
        f"{path.name}: the takeaway's numbers should come from a code cell that asserts them"
    src = next(c.source for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    bare = [ln for ln in src.splitlines() if ln.strip() and not ln.startswith("#") and "#" not in ln]
    assert not bare, f"{path.name}: parameters without a comment naming their values: {bare}"


def test_notebooks_readme_names_every_notebook():
    text = (NBS[0].parent / "README.md").read_text()
    assert all(p.stem in text for p in NBS), "notebooks/README.md should give the reading order of every notebook"


@pytest.mark.parametrize("path", NBS, ids=lambda p: p.name)
def test_committed_without_outputs_and_with_parameters(path):
    nb = nbformat.read(str(path), as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.get("outputs") and c.get("execution_count") is None for c in code), \
        f"{path.name} carries stale outputs: clear them before committing"
    params = [c for c in code if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1, f"{path.name}: exactly one cell tagged 'parameters'"
    assert "checkpoint" in params[0].source, f"{path.name}: no `checkpoint` parameter"
    assert sum(c.cell_type == "markdown" for c in nb.cells) >= 3, f"{path.name}: too little prose"


def _tiny_notebook(path, body):
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    p = nbformat.v4.new_code_cell("x = 1")
    p.metadata["tags"] = ["parameters"]
    nb.cells = [p, nbformat.v4.new_code_cell(body)]
    nbformat.write(nb, str(path))


def test_runner_names_failing_notebook_and_cell(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    _tiny_notebook(src / "01_ok.ipynb", "print(x + 1)")
    _tiny_notebook(src / "02_bad.ipynb", "raise RuntimeError('boom ' + str(x))")
    res = run_all(tmp_path / "out", {"x": 41}, directory=src)
    ok, bad = res
    assert ok["ok"] and (tmp_path / "out" / "01_ok.ipynb").exists() and (tmp_path / "out" / "01_ok.html").exists()
    out = nbformat.read(str(tmp_path / "out" / "01_ok.ipynb"), as_version=4)
    assert any("42" in o.get("text", "") for c in out.cells for o in c.get("outputs", []))  # parameter injected
    assert not bad["ok"] and "02_bad.ipynb" in bad["error"] and "cell" in bad["error"]
    assert "RuntimeError: boom 41" in bad["error"]


def test_save_figure_falls_back_to_html_without_browser(tmp_path, monkeypatch):
    import plotly.graph_objects as go
    monkeypatch.setenv("BROWSER_PATH", str(tmp_path / "no-such-browser"))
    monkeypatch.setattr(notebook_runner, "BROWSER_CANDIDATES", ())
    fig = go.Figure(go.Scatter(x=[1, 2], y=[3, 4]))
    path = save_figure(fig, "fig", tmp_path / "figs")
    assert path.endswith("fig.html") and os.path.getsize(path) > 0
    monkeypatch.delenv(notebook_runner.FIGURES_ENV, raising=False)
    assert save_figure(fig, "fig") is None  # no folder: inline only


def test_notebook_model_defaults_to_mini_through_a_synthetic_checkpoint():
    import numpy as np

    from mk.io import synth
    from mk.notebooks.helpers import load_model, model_config, model_name

    assert model_config() == model_config("mini") and model_name() == "mini"   # CPU backend default
    m = load_model(seed=3)
    assert m.name == "mini" and "synthetic checkpoint" in m.source
    expect = synth.quantized_params(m.cfg, 3)          # what the synthetic checkpoint holds
    got = np.asarray(m.params["embed"]).view(np.uint16)
    assert np.array_equal(got, np.asarray(expect["embed"]).view(np.uint16))
    cfg, params = m                                     # unpacks like (cfg, params)
    assert cfg is m.cfg and params is m.params


def test_notebook_model_from_a_checkpoint_dir(tmp_path):
    from mk.io import synth
    from mk.io.schema import CheckpointError
    from mk.model.config import get_config
    from mk.notebooks.helpers import load_model, model_config, model_name

    cfg = get_config("mini").replace(layers=4, full_attention=(3,))
    synth.write_checkpoint(cfg, tmp_path / "tiny-k3", seed=1)
    assert model_config("k3", tmp_path / "tiny-k3") == cfg        # the checkpoint overrides `config`
    assert model_name(None, tmp_path / "tiny-k3") == "tiny-k3"
    m = load_model("k3", tmp_path / "tiny-k3")
    assert m.cfg == cfg and m.name == "tiny-k3" and str(tmp_path) in m.source
    with pytest.raises(CheckpointError, match="missing: checkpoint directory not found"):
        load_model(None, tmp_path / "missing")


@pytest.mark.parametrize("path", NBS, ids=lambda p: p.name)
def test_parameters_cell_parses_cleanly(path, caplog):
    """papermill reads every line of the parameters cell (no 'Unable to parse line N' warning)."""
    import logging

    import papermill as pm
    nb = nbformat.read(str(path), as_version=4)
    src = next(c.source for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    names = [line.split("=")[0].strip() for line in src.splitlines() if line.strip() and not line.startswith("#")]
    with caplog.at_level(logging.WARNING, logger="papermill"):
        params = pm.inspect_notebook(str(path))
    assert not [r.getMessage() for r in caplog.records if "Unable to parse" in r.getMessage()]
    assert list(params) == names


@pytest.mark.parametrize("path", NBS, ids=lambda p: p.name)
def test_no_inert_output_checks_and_claims_are_asserted(path):
    """Committed without outputs and run with --nbval-lax, `# NBVAL_CHECK_OUTPUT` compares nothing:
    the notebooks assert their claims in code instead."""
    nb = nbformat.read(str(path), as_version=4)
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    assert "NBVAL_CHECK_OUTPUT" not in code
    assert code.count("assert ") >= 3, f"{path.name}: its printed verdicts should be asserted"


def test_tpu_default_is_the_chip_sized_model(monkeypatch):
    """On a TPU backend the notebooks run k3-chip (6 GB bf16: fits a 15.7 GiB v5e twice), not k3-slice."""
    from mk.notebooks import helpers as notebook
    from mk.model.config import get_config
    monkeypatch.setattr(notebook, "_backend", lambda: "tpu")
    assert notebook.model_name() == "k3-chip" and notebook.model_config() == get_config("k3-chip")
    assert notebook.plan_config() == get_config("k3-chip")
    monkeypatch.setattr(notebook, "_backend", lambda: "cpu")
    assert notebook.plan_config() == get_config("k3-slice") and notebook.model_name() == "mini"
    import papermill as pm
    for path in NBS:
        defaults = {k: v["default"] for k, v in pm.inspect_notebook(str(path)).items()}
        assert not [k for k, v in defaults.items() if "k3-slice" in v], \
            f"{path.name}: a parameter defaults to k3-slice (16.7 GB: does not fit one v5e): {defaults}"


XSPACE = '''
planes { id: 1 name: "/device:TPU:0"
  lines { id: 1 name: "XLA Modules" timestamp_ns: 1000
    events { metadata_id: 10 offset_ps: 0 duration_ps: 500000 }
    events { metadata_id: 9 offset_ps: 600000 duration_ps: 9000000000 }
    events { metadata_id: 10 offset_ps: 9800000000 duration_ps: 500000 }
    events { metadata_id: 9 offset_ps: 9900000000 duration_ps: 9100000000 }
    events { metadata_id: 10 offset_ps: 19500000000 duration_ps: 500000 } }
  lines { id: 2 name: "XLA Ops" timestamp_ns: 1000
    events { metadata_id: 1 offset_ps: 1000000 duration_ps: 8000000000 }
    events { metadata_id: 1 offset_ps: 10000000000 duration_ps: 8100000000 } }
  lines { id: 3 name: "Custom Call Regions" timestamp_ns: 1000
    events { metadata_id: 2 offset_ps: 2000000 duration_ps: 3000000000 }
    events { metadata_id: 3 offset_ps: 3000000 duration_ps: 1000000000 }
    events { metadata_id: 4 offset_ps: 3100000000 duration_ps: 4000000000 }
    events { metadata_id: 2 offset_ps: 10002000000 duration_ps: 3000000000 } }
  event_metadata { key: 1 value { id: 1 name: "%k3_decode_step.3 = (f32[8,32768]{1,0}, bf16[8,7168]{1,0}) custom-call(%copy.22), custom_call_target=\\"tpu_custom_call\\"" } }
  event_metadata { key: 2 value { id: 2 name: "moe_experts" } }
  event_metadata { key: 3 value { id: 3 name: "collective_moe_routed" } }
  event_metadata { key: 4 value { id: 4 name: "lm_head" } }
  event_metadata { key: 9 value { id: 9 name: "jit_step" } }
  event_metadata { key: 10 value { id: 10 name: "jit_broadcast_in_dim" } }
}
planes { id: 2 name: "/host:CPU" lines { id: 1 name: "python" timestamp_ns: 0
    events { metadata_id: 1 offset_ps: 0 duration_ps: 5 } }
  event_metadata { key: 1 value { id: 1 name: "k3_decode_step" } } }
'''


def test_trace_readers_find_the_kernel_and_its_regions():
    from jax.profiler import ProfileData

    from mk.notebooks.helpers import NotebookError, device_events, kernel_ops, kernel_regions
    ev = device_events(ProfileData.from_text_proto(XSPACE))
    assert set(ev.plane) == {"/device:TPU:0"}                        # host planes are not device time
    ops = kernel_ops(ev)
    assert list(ops.dur_ns) == [8e6, 8.1e6] and set(ops.line) == {"XLA Ops"}
    reg = kernel_regions(ev, ops)
    assert list(reg.step) == [0, 0, 0, 1]
    top = reg[reg.top]
    assert list(top.name) == ["moe_experts", "lm_head", "moe_experts"]   # the nested collective is not summed twice
    assert top[top.step == 0].dur_ns.sum() <= ops.dur_ns[0]
    with pytest.raises(NotebookError, match="no event named 'other_kernel'"):
        kernel_ops(ev, "other_kernel")


def test_host_annotations_and_outermost_regions():
    """The traced steps are counted on the xplane's host planes (trace.json caps at 1e6 events); a
    region is outermost when no other span holds it, the same as the all-pairs definition."""
    from jax.profiler import ProfileData

    from mk.notebooks.helpers import host_annotation_count, outermost
    data = ProfileData.from_text_proto(XSPACE)
    assert host_annotation_count(data, "k3_decode_step") == 1 and host_annotation_count(data, "moe_experts") == 0
    rng = np.random.default_rng(0)
    for _ in range(300):
        n = int(rng.integers(1, 10))
        s = rng.integers(0, 8, n)
        e = s + rng.integers(0, 5, n)
        held = (s[None, :] <= s[:, None]) & (e[:, None] <= e[None, :]) & ~np.eye(n, dtype=bool)
        twin = (s[None, :] == s[:, None]) & (e[:, None] == e[None, :])
        earlier = np.tril(np.ones((n, n), bool), -1)
        assert (outermost(s, e) == ~(held & (~twin | earlier)).any(axis=1)).all(), (s, e)


def test_step_device_seconds_picks_the_step_program():
    """mk bench's device time: the program run at least `steps` times with the most time (a fresh
    cache's broadcasts are programs of their own, run as often), [] without a device plane; read
    with no pandas (the core install has none)."""
    from jax.profiler import ProfileData

    from mk.perf.trace import device_event_list, step_device_seconds
    ev = device_event_list(ProfileData.from_text_proto(XSPACE))
    assert step_device_seconds(ev, 2) == pytest.approx([9e-3, 9.1e-3])
    assert step_device_seconds(ev, 3) == pytest.approx([5e-7] * 3)          # only the helper ran 3 times
    assert step_device_seconds([e for e in ev if e.plane == "none"], 2) == []


def test_program_runs_seconds_counts_a_function_compiled_twice():
    """The speculative chunk compiles to two programs (the prefill's cache layout, then its own), each
    run once by the warm-up and once on the clock: its device time is the last runs of both, where
    `step_device_seconds` would take one program's warm-up and real run."""
    from mk.perf.trace import DeviceEvent, program_runs_seconds, step_device_seconds
    ev = [DeviceEvent("/device:TPU:0", "XLA Modules", name, start, dur) for name, start, dur in (
        ("jit_speculative_chunk(1)", 0, 1_000), ("jit_speculative_chunk(2)", 10_000, 1_000),
        ("jit_broadcast", 20_000, 500), ("jit_speculative_chunk(1)", 30_000, 100_000_000),
        ("jit_speculative_chunk(2)", 200_000_000, 101_000_000), ("jit_speculative_chunk(2)", 400_000_000, 2_000))]
    # the last execution is the dispatch after the last chunk (every row done, no step): not a run
    assert program_runs_seconds(ev, "speculative_chunk", 2) == pytest.approx([0.1, 0.101])
    assert sum(step_device_seconds(ev, 2)) == pytest.approx(0.101002)      # half the real runs
    assert program_runs_seconds(ev, "speculative_chunk", 6) == []


def test_device_time_reader_needs_no_pandas():
    """mk bench's device time with the core install: the trace reader runs with pandas unimportable."""
    import subprocess
    import sys
    code = ("import sys; sys.modules['pandas'] = None\n"
            "from jax.profiler import ProfileData\n"
            "from mk.perf.trace import device_event_list, step_device_seconds\n"
            "print(step_device_seconds(device_event_list(ProfileData.from_text_proto(sys.argv[1])), 2))")
    out = subprocess.run([sys.executable, "-c", code, XSPACE], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[0.009, 0.0091]"


def device_events_of(text):
    from jax.profiler import ProfileData

    from mk.perf.trace import device_events
    return device_events(ProfileData.from_text_proto(text))


@pytest.mark.extended
@pytest.mark.slow
def test_kernel_sweep_and_verify_times_run_in_interpret_mode():
    """The chip's measurement helpers, on mini in interpret mode (times meaningless, plumbing real):
    weights packed once for two depths, a refused point is a row with its reason."""
    from mk.notebooks.helpers import kernel_sweep, load_model, verify_times
    m = load_model(seed=0)
    rows = kernel_sweep(m.params, m.cfg, [{"depth": 0}, {"depth": 2}, {"depth": 1, "tile": 100}], steps=1, warmup=1)
    assert [r["depth"] for r in rows[:2]] == [0, 2] and all(r["error"] is None and r["median_ms"] > 0 for r in rows[:2])
    assert rows[0]["bytes_per_step"] > 0 and rows[0]["gb_s"] > 0
    assert rows[2]["error"].startswith("plan refuses") and "multiples of 128" in rows[2]["error"]
    v = verify_times(m.params, m.cfg, [0, 2], steps=1, warmup=1)
    assert [r["rows"] for r in v] == [1, 3] and all(r["error"] is None and r["median_ms"] > 0 for r in v), v
    assert v[1]["bytes_per_step"] >= v[0]["bytes_per_step"]


# asserts a review found true by construction (a figure checked against the formula that made it)
TAUTOLOGIES = {
    "01_roofline.ipynb": ['comp["MB"].sum() * 1e6, r1.total_bytes'],
    "02_prefetch_tuning.ipynb": ['assert best["VMEM planned MiB"] <= best["VMEM limit MiB"]'],
    "04_throughput_sweep.ipynb": ['pred["seed tok/s"] / pred["published tok/s"]', 'assert long["step ms"] > short["step ms"]'],
    "05_speculative.ipynb": ['np.allclose(tok / g["acceptance length"]', 'assert 1 <= res["mean_acceptance"] <= k + 1'],
}


@pytest.mark.parametrize("path", NBS, ids=lambda p: p.name)
def test_measures_on_a_tpu_and_checks_against_independent_figures(path):
    """Every notebook has a TPU branch (measured figures on the chip), says on CPU that its times are
    no speed claim (those that time anything), and none of the by-construction asserts came back."""
    nb = nbformat.read(str(path), as_version=4)
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    if path.name.startswith("00"):      # the walk-through times nothing: every time it shows is modelled
        assert "perf_counter" not in code and "time_calls" not in code and "measure(" not in code, \
            f"{path.name}: the walk-through should not time anything (its times are modelled)"
        return
    assert "on_tpu()" in code, f"{path.name}: no TPU branch"
    if not path.name.startswith("01"):
        assert "SPEED_CAVEAT" in code and "backend_label()" in code, f"{path.name}: CPU times must be labelled"
    for t in TAUTOLOGIES.get(path.name, []):
        assert t not in code, f"{path.name}: an assert true by construction is back: {t}"


def test_long_figure_titles_are_wrapped_to_the_export_width():
    """A title longer than a line of the exported PNG is broken at word boundaries (kaleido cuts it
    otherwise) and the top margin grows with its lines; a short title is kept as it is."""
    import plotly.graph_objects as go
    from mk.notebooks.runner import EXPORT_WIDTH, TITLE_CHARS_PER_PX, fit_title
    words = "k3-chip: step time vs prefetch depth, measured on TPU v5 lite (1 device) and modelled on tpu-v5e " * 2
    fig = fit_title(go.Figure(layout=dict(title=words.strip())))
    lines = fig.layout.title.text.split("<br>")
    assert len(lines) >= 2 and all(len(ln) <= EXPORT_WIDTH * TITLE_CHARS_PER_PX for ln in lines)
    assert " ".join(lines) == words.strip() and fig.layout.margin.t >= 40 + 24 * len(lines)
    short = fit_title(go.Figure(layout=dict(title="tokens/s vs batch")))
    assert short.layout.title.text == "tokens/s vs batch"


OPS_XSPACE = '''
planes { id: 1 name: "/device:TPU:0"
  lines { id: 1 name: "XLA Modules" timestamp_ns: 0
    events { metadata_id: 9 offset_ps: 0 duration_ps: 10000000 }
    events { metadata_id: 9 offset_ps: 20000000 duration_ps: 12000000 } }
  lines { id: 2 name: "XLA Ops" timestamp_ns: 0
    events { metadata_id: 1 offset_ps: 1000000 duration_ps: 3000000 stats { metadata_id: 7 str_value: "convolution fusion" } }
    events { metadata_id: 2 offset_ps: 5000000 duration_ps: 4000000 stats { metadata_id: 7 str_value: "custom-call" } }
    events { metadata_id: 1 offset_ps: 21000000 duration_ps: 3000000 stats { metadata_id: 7 str_value: "convolution fusion" } }
    events { metadata_id: 3 offset_ps: 23000000 duration_ps: 2000000 }
    events { metadata_id: 2 offset_ps: 26000000 duration_ps: 5000000 stats { metadata_id: 7 str_value: "custom-call" } } }
  event_metadata { key: 1 value { id: 1 name: "fusion.12" } }
  event_metadata { key: 2 value { id: 2 name: "%fused_moe.3 = bf16[8,3584]{1,0} custom-call(%p), custom_call_target=\\"tpu_custom_call\\"" } }
  event_metadata { key: 3 value { id: 3 name: "copy.4" } }
  event_metadata { key: 9 value { id: 9 name: "jit_step" } }
  stat_metadata { key: 7 value { id: 7 name: "hlo_category" } }
}
'''


def test_step_op_breakdown_splits_a_step_into_ops_and_idle():
    """`mk bench`'s per-op view of a rival's step: ops per step, their union (an overlap counted
    once), the idle rest of the program's time, time by op kind and by HLO category."""
    from jax.profiler import ProfileData

    from mk.perf.trace import step_op_breakdown
    b = step_op_breakdown(ProfileData.from_text_proto(OPS_XSPACE), 2)
    assert b["steps"] == 2 and b["ops"] == 2.5 and b["step_ms"] == pytest.approx(0.011)
    # step 1: 3 + 4 us busy of 10; step 2: [21, 25] + [26, 31] = 9 us of 12 (the copy overlaps the fusion)
    assert b["busy_ms"] == pytest.approx(0.008) and b["idle_ms"] == pytest.approx(0.003)
    assert b["by_kind"] == pytest.approx({"fused_moe": 0.0045, "fusion": 0.003, "copy": 0.001})
    assert [t["kind"] for t in b["top"]] == ["fused_moe", "fusion", "copy"] and b["top"][0]["count"] == 1
    assert b["categories"] == pytest.approx({"custom-call": 0.0045, "convolution fusion": 0.003})
    assert step_op_breakdown(ProfileData.from_text_proto(OPS_XSPACE), 3) is None     # no program ran 3 times


def test_kernel_regions_read_tracemes_not_the_engines():
    """A region-traced kernel's named scopes are on 'XLA TraceMe' (libtpu's TraceMeStart / TraceMeEnd
    vtraces); the LLO debug info's engine lines (busy spans named as the engine) and `bundle.N`
    markers are activity, not regions."""
    import pandas as pd

    from mk.notebooks.helpers import kernel_regions
    P = "/device:TPU:0"
    ev = pd.DataFrame([
        (P, "XLA Ops", "%k3_decode_step.1 = custom-call", 0, 100),
        (P, "XLA Modules", "jit_step", 0, 100),
        (P, "XLA TraceMe", "moe_experts", 10, 40),
        (P, "XLA TraceMe", "kda_projections", 60, 30),
        (P, "MXU", "MXU", 0, 95),
        (P, "Vector ALU", "Vector ALU", 5, 50),
        (P, "XLA TraceMe", "bundle.134217729", 20, 0),
    ], columns=["plane", "line", "name", "start_ns", "dur_ns"])
    ops = ev[ev.line == "XLA Ops"]
    reg = kernel_regions(ev, ops)
    assert sorted(reg.name) == ["kda_projections", "moe_experts"] and reg.top.all()


PHASES_XSPACE = '''
planes { id: 1 name: "/device:TPU:0"
  lines { id: 1 name: "XLA Modules" timestamp_ns: 0
    events { metadata_id: 9 offset_ps: 0 duration_ps: 100000 }
    events { metadata_id: 9 offset_ps: 200000 duration_ps: 100000 } }
  lines { id: 2 name: "XLA Ops" timestamp_ns: 0
    events { metadata_id: 1 offset_ps: 0 duration_ps: 100000 }
    events { metadata_id: 1 offset_ps: 200000 duration_ps: 100000 } }
  lines { id: 3 name: "XLA TraceMe" timestamp_ns: 0
    events { metadata_id: 2 offset_ps: 10000 duration_ps: 50000 }
    events { metadata_id: 3 offset_ps: 20000 duration_ps: 10000 }
    events { metadata_id: 4 offset_ps: 70000 duration_ps: 20000 }
    events { metadata_id: 5 offset_ps: 30000 duration_ps: 0 }
    events { metadata_id: 2 offset_ps: 210000 duration_ps: 70000 } }
  lines { id: 4 name: "MXU" timestamp_ns: 0
    events { metadata_id: 6 offset_ps: 0 duration_ps: 40000 }
    events { metadata_id: 6 offset_ps: 20000 duration_ps: 40000 }
    events { metadata_id: 6 offset_ps: 200000 duration_ps: 20000 } }
  lines { id: 5 name: "_counters_" timestamp_ns: 0
    events { metadata_id: 6 offset_ps: 0 duration_ps: 90000 }
    events { metadata_id: 7 offset_ps: 0 duration_ps: 90000 } }
  event_metadata { key: 7 value { id: 7 name: "VDD Core FW Throttle(%)" } }
  event_metadata { key: 1 value { id: 1 name: "%k3_decode_step.1 = f32[8,128] custom-call(%p)" } }
  event_metadata { key: 2 value { id: 2 name: "moe_experts" } }
  event_metadata { key: 3 value { id: 3 name: "collective_moe_routed" } }
  event_metadata { key: 4 value { id: 4 name: "lm_head" } }
  event_metadata { key: 5 value { id: 5 name: "bundle.134217729" } }
  event_metadata { key: 6 value { id: 6 name: "MXU" } }
  event_metadata { key: 9 value { id: 9 name: "jit_step" } }
}
'''


def test_kernel_phases_split_a_region_traced_kernel():
    """docs/tpu-v5e/phase_trace.py's reading of a region-traced step (`kernel_phases`): the
    outermost named regions per execution from 'XLA TraceMe' (a nested one counted once, the LLO
    debug info's markers left out), each engine line's busy union (not the '_counters_' samples),
    and what each line holds."""
    from jax.profiler import ProfileData

    from mk.perf.trace import device_event_list, kernel_phases
    ph = kernel_phases(device_event_list(ProfileData.from_text_proto(PHASES_XSPACE)), "k3_decode_step", 2)
    assert ph["line"] == "XLA Ops" and ph["kernel_ms"] == pytest.approx([1e-4, 1e-4])
    # per execution (2): moe_experts (50 + 70) / 2 ns, lm_head 20 / 2; the nested collective not in top
    assert ph["top_ms"] == pytest.approx({"moe_experts": 6e-5, "lm_head": 1e-5})
    assert ph["all_ms"]["collective_moe_routed"] == pytest.approx(5e-6) and "bundle.134217729" not in ph["all_ms"]
    assert ph["coverage"] == pytest.approx([0.7, 0.7])
    assert ph["busy_ms"] == pytest.approx({"MXU": 4e-5})           # (60 + 20) ns over two executions
    assert ph["lines"]["_counters_"]["events"] == 1.0              # counter samples: listed, not busy time
    assert ph["lines"]["XLA TraceMe"]["events"] == 2.5 and "MXU" in ph["lines"]
    assert kernel_phases(device_event_list(ProfileData.from_text_proto(PHASES_XSPACE)), "other", 2) is None
