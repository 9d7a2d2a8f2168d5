"""mk bench without a TPU: the refusal, the byte accounting, the timing bookkeeping, the whole
measure() pipeline on mini with the TPU check bypassed (CPU timings: no claim, only plumbing)."""
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mk.perf import bench
from mk.model.config import get_config
from mk.kernel.plan import make_plan

MINI = get_config("mini")


def test_cli_refuses_on_cpu_in_one_line():
    p = subprocess.run([sys.executable, "-m", "mk", "bench", "--config", "k3-chip"], capture_output=True, text=True,
                       env={**__import__("os").environ, "JAX_PLATFORMS": "cpu"})
    assert p.returncode == 2
    lines = [l for l in p.stderr.splitlines() if l.startswith("error:")]
    assert len(lines) == 1 and "TPU" in lines[0] and "'cpu'" in lines[0], p.stderr
    assert p.stdout == ""


def test_measure_refuses_on_cpu():
    with pytest.raises(bench.BenchError, match="TPU"):
        bench.measure(MINI, batches=(1,))


def test_step_bytes_against_an_independent_count():
    """Every matrix of mini written out by hand (not from mk.model.params.shapes)."""
    c = MINI
    d, H, D, HD, V = c.dim, c.heads, c.head_dim, c.heads * c.head_dim, c.vocab
    kda = c.n_kda * (2 * (d * D + D * HD + 4 * d * HD + d * H + HD * d) + 4 * (3 * c.conv_size * HD + H + HD + D))
    mla = c.n_mla * 2 * (d * c.q_rank + c.q_rank + d * (c.kv_rank + c.qk_extra) + c.kv_rank
                         + c.q_rank * H * (D + c.qk_extra) + c.kv_rank * H * 2 * D + d * HD + HD * d)
    dense = 2 * 3 * d * c.dense_hidden
    S = c.shared_hidden
    moe = c.n_moe * (2 * d * c.experts + 4 * c.experts + 2 * 2 * d * c.latent + 4 * c.latent + 2 * 3 * d * S)
    glob = 2 * d * V + 2 * d + 4 * d + c.layers * (2 * 2 * d + 2 * 4 * d)      # lm_head, norms, AttnRes
    B = 3
    dense_total = kda + mla + dense + moe + glob + B * d * 2                      # + B embedding rows
    ids = np.array([[[0, 1, 2, 3], [1, 2, 3, 4], [0, 1, 2, 3]]] * c.n_moe)       # layer: 5 distinct experts
    distinct = [len(np.unique(ids[l])) for l in range(c.n_moe)]
    for fmt, per_weight in (("bf16", 2), ("mxfp4", 17 / 32)):
        got = bench.step_bytes(c, B, fmt, distinct)
        assert got["weight_bytes"] == dense_total
        assert got["expert_bytes"] == pytest.approx(c.n_moe * 5 * 3 * c.latent * c.expert_hidden * per_weight)
        assert got["hbm_bytes"] == got["weight_bytes"] + got["expert_bytes"] + got["state_bytes"]
        assert got["state_bytes"] > 0 and got["plan_weight_bytes"] >= got["weight_bytes"] - B * d * 2


def test_summary_and_ratios_with_a_fake_timer():
    ticks = iter([0.0, 9.0,   10.0, 10.004,   20.0, 20.001,   30.0, 30.002,   40.0, 40.010])  # warm-up 9 s
    seen = []

    def step(cache, tok):
        return jnp.zeros(2), {"n": cache["n"] + 1}

    made = []

    def new_cache():
        made.append(1)
        return {"n": 0}

    times = bench.time_steps(step, new_cache, np.zeros((5, 2), np.int32), warmup=1, ctx=3,
                             timer=lambda: next(ticks), on_output=lambda t, out: seen.append(t))
    assert times == pytest.approx([0.004, 0.001, 0.002, 0.010])     # the 9 s warm-up step is not timed
    assert seen == [0, 1, 2, 3, 4] and len(made) == 2                 # cache recreated after ctx = 3 steps
    s = bench.summarize(times)
    assert s == pytest.approx({"median_ms": 3.0, "min_ms": 1.0, "max_ms": 10.0, "steps": 4})
    rows = [{"impl": "kernel", "batch": 1, "median_ms": 2.0, "device_median_ms": 1.5},
            {"impl": "xla", "batch": 1, "median_ms": 5.0, "device_median_ms": 1.8},
            {"impl": "reference", "batch": 1, "median_ms": None}, {"impl": "xla", "batch": 2, "median_ms": 5.0}]
    bench.add_ratios(rows)
    assert [r["kernel_speedup"] for r in rows] == [None, 2.5, None, None]
    assert [r["device_speedup"] for r in rows] == [None, pytest.approx(1.2), None, None]
    row = bench.finish_row({"batch": 4, "median_ms": 2.0}, {"hbm_bytes": 1e9},
                           {"datasheet_bw": 800e9, "stream_bw": 625e9})
    assert row["gb_s"] == pytest.approx(500) and row["tok_s"] == pytest.approx(2000)
    assert row["frac_datasheet"] == pytest.approx(0.625) and row["frac_stream"] == pytest.approx(0.8)


def test_stream_bandwidth_missing_or_measured(tmp_path):
    assert bench.chip_of_device("TPU v5 lite") == ("v5e", "tpu-v5e")
    base = "".join(line for line in open(bench.__file__.replace("mk/perf/bench.py", "data/microbench.csv"))
                   if not line.startswith("tpu-v5e,dma_stream_bw,"))
    bw = bench.bandwidths("tpu-v5e", tmp_path / "none.csv")
    assert bw["stream_bw"] is None and bw["stream_source"].startswith("not measured") and bw["datasheet_bw"] == 819e9
    f = tmp_path / "mb.csv"
    f.write_text(base.rstrip("\n") + "\ntpu-v5e,dma_stream_bw,7.95e11,bytes/s,,,measured: test,\n")
    bw = bench.bandwidths("tpu-v5e", f)
    assert bw["stream_bw"] == 7.95e11 and bw["stream_source"] == "measured: test"


def test_a_config_that_does_not_fit_is_refused_in_one_line():
    class Device:
        def memory_stats(self):
            return {"bytes_limit": 15.7e9}
    need = bench.device_bytes_needed(get_config("k3-slice"), "bf16", ("kernel", "xla"), (1,), 256, "v5e")
    with pytest.raises(bench.BenchError) as e:
        bench.check_fits(get_config("k3-slice"), need, Device(), "tpu-v5e", "k3-slice")
    assert "--config k3-slice" in str(e.value) and "15.70 GB" in str(e.value) and "\n" not in str(e.value)
    need = bench.device_bytes_needed(get_config("k3-chip"), "bf16", ("kernel", "xla", "reference"), (1, 8), 256, "v5e")
    bench.check_fits(get_config("k3-chip"), need, Device(), "tpu-v5e", "k3-chip")        # fits


def test_kernel_weights_are_reused_only_for_an_equal_packing():
    from mk.model.params import init
    from mk.kernel.packing import pack_weights
    p1, p8 = make_plan(MINI, 1), make_plan(MINI, 8)
    assert bench.pack_key(p1) == bench.pack_key(p8)
    params = init(MINI, 0)
    a, b = pack_weights(p1, params), pack_weights(p8, params)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert bench.pack_key(p1) != bench.pack_key(make_plan(MINI, 1, tile=256))
    # MXFP4 words are laid out for their unpack (`pack_mxfp4_tiles`): another unpack is another packing
    from mk.kernel.plan import MK
    import dataclasses
    mx = {u: make_plan(MINI, 1, experts="mxfp4", options=dataclasses.replace(MK, mxfp4_unpack=u)) for u in ("pairs", "shift")}
    assert bench.pack_key(mx["pairs"]) != bench.pack_key(mx["shift"])


@pytest.mark.extended
@pytest.mark.slow
def test_measure_pipeline_on_mini(monkeypatch):
    """All impls at B = 2 (one batch: each interpret-mode case costs ~15 s here), the TPU check
    bypassed: every row complete, routing counted."""
    monkeypatch.setattr(bench, "require_tpu", lambda backend=None: None)
    rows = bench.measure(MINI, batches=(2,), steps=2, warmup=1, impls=("kernel", "xla", "reference"),
                         progress=False, device_steps=1)     # one traced step: the path runs (no device plane on CPU)
    assert [(r["impl"], r["batch"]) for r in rows] == [(i, 2) for i in ("kernel", "xla", "reference")]
    for r in rows:
        assert r["error"] is None and r["steps"] == 2 and r["min_ms"] <= r["median_ms"] <= r["max_ms"]
        assert r["distinct_source"].startswith("routed") and len(r["distinct_experts"]) == MINI.n_moe
        assert MINI.top_k <= min(r["distinct_experts"]) <= max(r["distinct_experts"]) <= r["batch"] * MINI.top_k
        assert r["hbm_bytes"] > 0 and r["tok_s"] == pytest.approx(r["batch"] / r["median_ms"] * 1e3)


def test_record_summary_names_the_best_other_step():
    """A bench record's summary: the kernel's device ms per batch, its fraction of stream, and its
    device and wall speedups over the better of xla and peer at each batch (the oracle is no rival)."""
    from mk.perf.bench import add_ratios, summary
    rows = [{"impl": "kernel", "batch": 1, "device_median_ms": 5.0, "device_frac_stream": 0.9},
            {"impl": "kernel", "batch": 8, "device_median_ms": 6.0, "device_frac_stream": 0.85},
            {"impl": "xla", "batch": 1, "device_median_ms": 10.0}, {"impl": "xla", "batch": 8, "device_median_ms": 6.6},
            {"impl": "peer", "batch": 1, "device_median_ms": 7.5}, {"impl": "peer", "batch": 8, "device_median_ms": 9.0},
            {"impl": "reference", "batch": 1, "device_median_ms": 1.0}, {"impl": "reference", "batch": 8, "device_median_ms": 1.0}]
    for r in rows:
        r["median_ms"] = r["device_median_ms"] + 1.0
    assert summary(add_ratios(rows)) == (
        "kernel device 5.00 / 6.00 ms at B = 1 / 8; 0.90 / 0.85 of stream; vs the better of xla and peer "
        "(peer/xla): 1.50 / 1.10x device, 1.42 / 1.09x wall")
    assert summary([{"impl": "kernel", "batch": 1, "error": "OOM"}]) == "not run: OOM"
    rivals = [r for r in rows if r["impl"] == "peer"] + [{"impl": "xla", "batch": 8, "error": "OOM"}]
    assert summary(rivals) == "peer device 7.50 / 9.00 ms at B = 1 / 8 (kernel not run); not run: OOM"


def test_generate_mode_refuses_on_cpu_in_one_line():
    p = subprocess.run([sys.executable, "-m", "mk", "bench", "--mode", "generate", "--json"], capture_output=True,
                       text=True, env={**__import__("os").environ, "JAX_PLATFORMS": "cpu"})
    assert p.returncode == 2 and p.stdout == ""
    lines = [l for l in p.stderr.splitlines() if l.startswith("error:")]
    assert len(lines) == 1 and "TPU" in lines[0], p.stderr
    with pytest.raises(bench.BenchError, match="TPU"):
        bench.measure_generate(MINI, batches=(1,))


@pytest.mark.extended
@pytest.mark.slow
def test_measure_generate_pipeline(monkeypatch):
    """The device loop of the kernel (interpret mode) and the XLA step at one batch, the TPU check
    bypassed: every row complete (CPU timings: plumbing only, no claim)."""
    from tests.test_loop import TINY
    monkeypatch.setattr(bench, "require_tpu", lambda backend=None: None)
    rows = bench.measure_generate(TINY, batches=(2,), steps=3, chunk=2, device_steps=1, host_steps=1)
    assert [(r["impl"], r["batch"]) for r in rows] == [("kernel", 2), ("xla", 2)]     # B = 1: tests/test_loop.py
    for r in rows:
        assert r["error"] is None, r
        assert r["decode_steps"] == 3 and r["chunk"] == 2
        assert r["loop_tok_s"] == pytest.approx(r["batch"] * 3 / r["decode_s"])
        assert r["host_step_ms"] > 0 and r["loop_speedup"] > 0
        assert r["device_step_ms"] is None and r["frac_of_device"] is None     # no device plane on CPU


def test_generate_summary():
    rows = [{"impl": "kernel", "batch": 1, "loop_tok_s": 164.0, "frac_of_device": 0.993},
            {"impl": "kernel", "batch": 8, "loop_tok_s": 1200.5, "frac_of_device": 0.98},
            {"impl": "xla", "batch": 1, "error": "RuntimeError: x"}, {"impl": "xla", "batch": 8, "error": "x"}]
    assert bench.generate_summary(rows) == ("B = 1 / 8: kernel loop 164.0 / 1200.5 tok/s, 0.99 / 0.98 of the device "
                                            "step rate; xla not run")
    mx = [{"impl": i, "batch": 1, "experts": "mxfp4", "loop_tok_s": t, "frac_of_device": 0.99} for i, t in (("kernel", 181.1), ("xla", 113.3))]
    assert "xla (a strawman with MXFP4" in bench.generate_summary(mx) and "kernel loop 181.1" in bench.generate_summary(mx)


def test_init_fast_draws_init_families():
    """The bench's weights (`init_fast`, a counter hash on the device): each family's mean and std as
    `init` draws it, deterministic in the seed, and MXFP4 experts with the family's scale byte."""
    from mk.model import params as P
    cfg = get_config("mini")
    a, b, c = P.init_fast(cfg, 0), P.init_fast(cfg, 0), P.init_fast(cfg, 1)
    flat = jax.tree_util.tree_flatten_with_path(a)[0]
    for (path, x), y, z in zip(flat, jax.tree.leaves(b), jax.tree.leaves(c)):
        key = tuple(p.key for p in path)
        x = np.asarray(x, np.float32)
        assert np.array_equal(x, np.asarray(y, np.float32)), key
        assert not np.array_equal(x, np.asarray(z, np.float32)), key
        kind, scale, offset = P._family(cfg, key, x.shape)
        if kind in ("normal", "matrix") and x.size >= 4096:
            assert abs(x.mean() - offset) < 0.02 * scale + 1e-6, key
            assert abs(x.std() / scale - 1) < 0.03, (key, x.std(), scale)
        elif kind == "a_log":
            assert 0 <= x.min() and x.max() < np.log(16) + 1e-3, key
    m = P.init_fast(cfg, 0, "mxfp4")["moe"]["w1"]
    byte = P.mxfp4_scale_byte(P._family(cfg, ("moe", "w1"), P.shapes(cfg)["moe"]["w1"].shape)[1])
    assert set(np.unique(np.asarray(m["scale"]))) == {byte - 1, byte}
    counts = np.bincount(np.asarray(m["packed"]).ravel(), minlength=256)
    assert counts.min() > 0.5 * counts.mean()


def test_tile_option_is_checked_before_the_tpu_and_reaches_the_plan(monkeypatch):
    """`mk bench --tile`: a malformed value is refused in one line before the TPU check; a tile the
    plan refuses is a BenchError naming --tile (the TPU check bypassed, nothing timed)."""
    p = subprocess.run([sys.executable, "-m", "mk", "bench", "--tile", "5x"], capture_output=True, text=True,
                       env={**__import__("os").environ, "JAX_PLATFORMS": "cpu"})
    lines = [l for l in p.stderr.splitlines() if l.startswith("error:")]
    assert p.returncode == 2 and len(lines) == 1 and "--tile" in lines[0], p.stderr
    monkeypatch.setattr(bench, "require_tpu", lambda backend=None: None)
    with pytest.raises(bench.BenchError, match="--tile"):
        bench.measure(MINI, batches=(1,), steps=1, warmup=1, impls=("kernel",), progress=False, tile=(100, 100))


def test_record_key_names_what_changes_the_measurement():
    """A step record's key (`mk.cli.bench.record_key`): config and experts; the options that change
    the kernel; the batches only where B = 1 and 8 are missing, so a B = 2, 4 record supersedes no
    B = 1, 8 record of the same model; the programs where they are no race, so a kernel-alone record
    supersedes no race."""
    import argparse

    from mk.cli.bench import record_key
    a = argparse.Namespace(experts="mxfp4", mxfp4_unpack="auto", prefetch_depth=None)
    assert record_key(a, "k3-d48", None, [1, 8]) == {"config": "k3-d48", "experts": "mxfp4"}
    assert record_key(a, "k3-d48", None, [1, 2, 4, 8]) == {"config": "k3-d48", "experts": "mxfp4"}
    assert record_key(a, "k3-d48", (512, 256), [2, 4]) == {"config": "k3-d48", "experts": "mxfp4",
                                                           "tile": "512x256", "batch": "2,4"}
    assert record_key(a, "k3-d48", None, [1, 8], ["kernel", "peer"]) == {"config": "k3-d48", "experts": "mxfp4"}
    assert record_key(a, "k3-d48", None, [1, 8], ["kernel"])["impl"] == "kernel"     # no race: its own key
    assert record_key(a, "k3-d48", None, [2, 4], ["xla", "peer"])["impl"] == "xla,peer"
    a = argparse.Namespace(experts="bf16", mxfp4_unpack="pairs", prefetch_depth=8)
    assert record_key(a, "k3-chip", None, [8]) == {"config": "k3-chip", "experts": "bf16", "mxfp4_unpack": "pairs",
                                                   "prefetch_depth": 8, "batch": "8"}


def test_prefetch_depth_sweep_is_the_kernel_alone(monkeypatch, capsys):
    """`mk bench --prefetch-depth 16,64`: a sweep of the kernel alone (refused beside a rival, before the
    TPU check); its record's key names the depths, its summary has one part per depth."""
    import argparse

    from mk.__main__ import main
    from mk.cli.bench import record_key
    assert main(["bench", "--prefetch-depth", "16,64", "--impl", "kernel,xla"]) == 2
    assert "several depths time the kernel alone" in capsys.readouterr().err
    assert main(["bench", "--prefetch-depth", "-1"]) == 2
    assert "--prefetch-depth: values must be at least 0" in capsys.readouterr().err
    a = argparse.Namespace(experts="bf16", mxfp4_unpack="auto", prefetch_depth=[16, 64])
    assert record_key(a, "k3-d48", None, [1, 8], ["kernel"])["prefetch_depth"] == "16,64"
    rows = [{"impl": "kernel", "batch": b, "prefetch_depth": d, "device_median_ms": ms, "device_frac_stream": f}
            for d, b, ms, f in ((16, 1, 6.2, 0.9), (16, 8, 8.5, 0.8), (64, 1, 6.1, 0.92), (64, 8, 7.9, 0.86))]
    assert bench.summary(rows) == ("depth 16: kernel device 6.20 / 8.50 ms at B = 1 / 8; 0.90 / 0.80 of stream | "
                                   "depth 64: kernel device 6.10 / 7.90 ms at B = 1 / 8; 0.92 / 0.86 of stream")
    uniform = [{**r, "distinct_source": "expected (uniform routing)"} for r in rows]   # the note once, at the end
    assert bench.summary(uniform) == bench.summary(rows) + bench.UNIFORM_NOTE


# ---- mk bench --mode speculative (mk.perf.spec_bench) -------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["--acceptance", "9"], "--acceptance: each length must lie in 1..8"),
    (["--speculative", "7", "--batch", "2"], "--speculative 7: no k fits the kernel's 8 rows at --batch 2"),
    (["--speculative", "0"], "--speculative: values must be at least 1"),
    ([], "TPU"),
])
def test_speculative_mode_refuses_in_one_line(argv, message):
    """Bad L or k are said before the TPU check; good options then meet it (CPU)."""
    p = subprocess.run([sys.executable, "-m", "mk", "bench", "--mode", "speculative", *argv], capture_output=True,
                       text=True, env={**__import__("os").environ, "JAX_PLATFORMS": "cpu"})
    assert p.returncode == 2 and p.stdout == "" and p.stderr.count("\n") == 1 and message in p.stderr, p.stderr


def test_speculative_cases_keep_what_fits_the_rows():
    from mk.perf.spec_bench import cases
    assert cases([1, 2], [3, 7], None) == [(1, 3, [1, 2, 3, 4]), (1, 7, list(range(1, 9))), (2, 3, [1, 2, 3, 4])]
    assert cases([1], [3, 7], [1, 6]) == [(1, 3, [1]), (1, 7, [1, 6])]


@pytest.mark.extended
@pytest.mark.slow
def test_measure_speculative_pipeline(monkeypatch):
    """Plain decoding and the speculative loop at L = 2 on the kernel (interpret mode) and on the
    fair XLA step's verify step, the TPU check bypassed: rows complete (CPU: plumbing only)."""
    from mk.perf import spec_bench
    from tests.test_loop import TINY
    monkeypatch.setattr(spec_bench, "require_tpu", lambda backend=None: None)
    rows = spec_bench.measure_speculative(TINY, batches=(1,), ks=(1,), lengths=(2,), steps=2, chunk=2, device_steps=1)
    assert [(r["impl"], r["k"], r["L"]) for r in rows] == [("kernel", 0, 1), ("kernel", 1, 2), ("xla", 0, 1),
                                                           ("xla", 1, 2)]
    plain, spec, _, xla = rows
    assert plain["error"] is None and spec["error"] is None and xla["error"] is None, rows
    assert spec["steps"] == 2 and spec["emitted"] == 4 and spec["tokens_per_step"] == 2
    assert spec["speedup_wall"] == pytest.approx(spec["wall_tok_s"] / plain["loop_tok_s"])
    assert spec["device_tok_s"] is None and spec["drafter_share"] is None          # no device plane on CPU
    assert spec_bench.summary(rows).startswith("kernel, at a fixed acceptance length (tokens not meaningful): "
                                               "B=1 k=1: L=2 - device / ")


@pytest.mark.extended
@pytest.mark.slow
def test_measure_speculative_xla_rows_run(monkeypatch):
    """`mk bench --mode speculative --impl xla` on a thinned mini (the TPU check bypassed; CPU:
    plumbing only): the XLA step's speculative rows run its verify step (no error), emit L tokens a
    step, and carry their ratios against its plain decoding."""
    from mk.perf import spec_bench
    from tests.test_loop import TINY
    monkeypatch.setattr(spec_bench, "require_tpu", lambda backend=None: None)
    monkeypatch.setattr(spec_bench, "program_device_seconds", lambda *a, **kw: None)   # no device plane on CPU
    rows = spec_bench.measure_speculative(TINY, batches=(1,), ks=(3,), lengths=(4,), impls=("xla",), steps=2,
                                          chunk=2, device_steps=1)
    assert [(r["impl"], r["k"], r["L"], r["error"]) for r in rows] == [("xla", 0, 1, None), ("xla", 3, 4, None)]
    plain, four = rows
    assert four["emitted"] == 8 and four["tokens_per_step"] == 4 and four["verify_ms"] is None   # no device plane
    assert four["speedup_wall"] == pytest.approx(four["wall_tok_s"] / plain["loop_tok_s"])
    assert "xla" in spec_bench.format_table(rows, dict(config="tiny", device_kind="cpu", experts="bf16", steps=2,
                                                       jax_version="", date=""))


def test_a_batch_draws_its_tokens_whatever_the_batch_list():
    """`--batch 8` and `--batch 1,8` time the same B = 8 tokens (a step's cost depends on them)."""
    from mk.perf.bench import bench_tokens
    from mk.model.config import get_config
    cfg = get_config("mini")
    alone, both = bench_tokens(cfg, [8], 5), bench_tokens(cfg, [1, 8], 5)
    assert np.array_equal(alone[8], both[8]) and both[1].shape == (5, 1)
    assert not np.array_equal(bench_tokens(cfg, [8], 5, seed=1)[8], alone[8])
