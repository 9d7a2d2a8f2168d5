"""Measurement records (mk.perf.results): provenance, the newest record of each measurement, the README's table."""
import json
import subprocess
import sys

from mk.perf import results
from mk.perf.cases import readme_block


def _rec(path, kind, key, date, summary, commit="a" * 40, **extra):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"record": {"kind": kind, "key": key, "summary": summary, "commit": commit,
                                           "dirty": False, "date": date, "chip": "tpu-v5e",
                                           "command": f"python -m mk {kind}"}, **extra}))


def test_newest_record_of_each_measurement_is_current(tmp_path):
    _rec(tmp_path / "d1/bench.json", "bench", {"config": "k3-chip", "experts": "bf16"}, "2026-12-05T10:00:00", "old")
    _rec(tmp_path / "d2/bench.json", "bench", {"config": "k3-chip", "experts": "bf16"}, "2026-12-06T10:00:00", "new")
    _rec(tmp_path / "d1/mx.json", "bench", {"config": "k3-chip", "experts": "mxfp4"}, "2026-12-04T10:00:00", "mx")
    (tmp_path / "d1/legacy.json").write_text(json.dumps({"metadata": {}, "rows": []}))   # before records: history
    (tmp_path / "d1/broken.json").write_text("{")
    recs = results.find_records(tmp_path)
    assert len(recs) == 3
    cur = results.current(recs)
    assert sorted(r["summary"] for _, r in cur) == ["mx", "new"]
    table = results.results_table(recs, tmp_path)
    assert "| bench k3-chip bf16 | new | tpu-v5e | 2026-12-06 | aaaaaaa |" in table
    assert "old" not in table and "[json](d2/bench.json)" in table
    _rec(tmp_path / "d2/llo.json", "llo", {"chip": "v5e"}, "2026-12-06T11:00:00", "bundles")
    _rec(tmp_path / "d2/check.json", "check", {"config": "mini", "batch": 8}, "2026-12-06T11:00:00", "older check")
    _rec(tmp_path / "d3/check.json", "check", {"config": "k3-chip", "batch": 8}, "2026-12-07T11:00:00", "pass")
    _rec(tmp_path / "d3/gen.json", "generate", {"config": "k3-chip", "chunk": 16}, "2026-12-06T11:00:00", "tok/s")
    recs = results.find_records(tmp_path)
    assert [r["summary"] for _, r in results.headline(recs)] == ["tok/s", "pass"]   # the newest of each kind, in order
    for d, cfg, date, summary in [("d4", "k3-d48", "2026-12-07T12:00:00", "d48"),
                                  ("d4", "k3-chip", "2026-12-07T11:00:00", "chip old"),
                                  ("d5", "k3-chip", "2026-12-07T13:00:00", "chip")]:
        _rec(tmp_path / d / f"spec-{cfg}.json", "bench_speculative", {"config": cfg}, date, summary)
    recs = results.find_records(tmp_path)   # the speculative bench: the newest of each config, by name
    assert [r["summary"] for _, r in results.headline(recs)] == ["tok/s", "pass", "chip", "d48"]
    cmd = [sys.executable, "-m", "mk", "results", "--root", str(tmp_path)]
    block = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    assert "| `k3-chip` | bf16 | not run |" in block and "| check k3-chip B=8 | pass |" in block
    assert "bundles" not in block and "older check" not in block and "| bench k3-chip" not in block
    listed = subprocess.run(cmd + ["--all"], capture_output=True, text=True, check=True).stdout
    assert all(f"| {m} |" in listed for m in ("bench k3-chip bf16 | new", "llo chip=v5e | bundles", "check mini B=8 | older check"))


def test_readme_block_written_and_checked(tmp_path):
    _rec(tmp_path / "docs/r.json", "check", {"config": "mini"}, "2026-12-06T10:00:00", "pass | 0.05")
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n{results.RESULTS_BEGIN}\nstale\n{results.RESULTS_END}\nafter\n")
    cmd = [sys.executable, "-m", "mk", "results", "--root", str(tmp_path / "docs")]
    assert subprocess.run(cmd + ["--check", str(readme)], capture_output=True).returncode == 1
    subprocess.run(cmd + ["--write", str(readme)], check=True, capture_output=True)
    text = readme.read_text()
    assert text.startswith("# x\n") and text.endswith("after\n") and "pass \\| 0.05" in text
    assert subprocess.run(cmd + ["--check", str(readme)], capture_output=True).returncode == 0
    bad = subprocess.run(cmd + ["--write", str(tmp_path / "none.md")], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "none.md" in bad.stderr


def test_commit_from_git_or_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("MK_COMMIT", raising=False)
    head, _ = results.commit()
    if (results.REPO / ".git").exists():
        assert head and len(head) == 40
        monkeypatch.setenv("MK_COMMIT", "c" * 40)             # set where the copy was made: wins over a stale .git
        assert results.commit() == ("c" * 40, None)
    monkeypatch.setattr(results, "REPO", tmp_path)            # a copy of the tree without .git
    monkeypatch.setenv("MK_COMMIT", "b" * 40)
    monkeypatch.setenv("MK_DIRTY", "0")
    assert results.commit() == ("b" * 40, False)
    monkeypatch.delenv("MK_COMMIT")
    assert results.commit() == (None, None)


def test_readme_results_block_is_current():
    """The README's results table is what the records under docs/ give (`mk results --write README.md`)."""
    readme = results.REPO / "README.md"
    block = results.read_block(readme)
    assert block is not None, "README.md has no results block"
    assert block == readme_block(results.find_records(results.REPO / "docs"))
    assert len(readme.read_text().splitlines()) <= 150


def test_records_figure_draws_each_impl_against_depth(tmp_path):
    """The headline figure: tokens/s from device time against depth, a panel per (format, batch), one line
    per impl, each point the newest row of its case on the kernel's defaults, the kernel's edge as text."""
    from mk.notebooks.helpers import records_figure
    kernel = lambda fig, b: next(t for t in fig.data if t.name == "mk megakernel" and t.xaxis == ("x" if b == 1 else "x2"))
    rows = [{"impl": i, "batch": b, "device_median_ms": ms} for i, b, ms in
            (("kernel", 1, 5.0), ("xla", 1, 6.0), ("peer", 1, 8.0), ("reference", 1, 1.0), ("kernel", 8, 8.0), ("xla", 8, 12.0))]
    _rec(tmp_path / "b.json", "bench", {"config": "k3-chip", "experts": "bf16"}, "2026-12-06T10:00:00", "s", rows=rows)
    _rec(tmp_path / "d.json", "bench", {"config": "k3-d12", "experts": "bf16"}, "2026-12-06T11:00:00", "s", rows=rows[:2])
    _rec(tmp_path / "k.json", "bench", {"config": "k3-chip", "experts": "mxfp4"}, "2026-12-06T10:00:00", "s",
         rows=rows[:2])                                         # the kernel and the MXFP4 strawman: no panel
    fig = records_figure(results.find_records(tmp_path))
    assert [a.text for a in fig.layout.annotations] == ["bf16 experts, B = 1", "bf16 experts, B = 8"]
    assert [t.name for t in fig.data] == ["mk megakernel", "fair XLA step", "fair XLA step + vLLM TPU fused MoE (peer)",
                                          "mk megakernel", "fair XLA step"]
    assert list(kernel(fig, 1).x) == [3, 12] and list(kernel(fig, 1).y) == [200.0, 200.0]
    assert list(kernel(fig, 1).text) == ["1.20x", "1.20x"] and list(kernel(fig, 8).text) == ["1.50x"]
    assert "device time" in fig.layout.title.text
    _rec(tmp_path / "t.json", "bench", {"config": "k3-chip", "experts": "bf16", "tile": "512x256"},
         "2026-12-07T10:00:00", "s", rows=[{"impl": "kernel", "batch": 8, "device_median_ms": 4.0}])
    fig = records_figure(results.find_records(tmp_path))   # a later run at another tile than the plan's: a tuning run
    assert list(kernel(fig, 8).y) == [1000.0]
    _rec(tmp_path / "t2.json", "bench", {"config": "k3-chip", "experts": "bf16", "tile": "512x512"},
         "2026-12-07T11:00:00", "s", rows=[{"impl": "kernel", "batch": 8, "device_median_ms": 4.0}])
    fig = records_figure(results.find_records(tmp_path))   # at the plan's own tile: the kernel's newest step
    assert list(kernel(fig, 8).y) == [2000.0] and list(kernel(fig, 8).text) == ["3.00x"]
    _rec(tmp_path / "s.json", "bench", {"config": "k3-chip", "experts": "bf16", "prefetch_depth": "4,16", "impl": "kernel"},
         "2026-12-08T11:00:00", "s", rows=[{"impl": "kernel", "batch": 1, "device_median_ms": ms, "prefetch_depth": d}
                                           for d, ms in ((4, 2.0), (16, 4.0))])
    fig = records_figure(results.find_records(tmp_path))   # a depth sweep: its row at today's default depth (16)
    assert list(kernel(fig, 1).y) == [250.0, 200.0]
    _rec(tmp_path / "l.json", "bench_log", {"config": "k3-d12", "experts": "bf16"}, "2026-12-09T10:00:00", "s",
         rows=[{"impl": "kernel", "batch": 1, "device_median_ms": 2.0}])
    fig = records_figure(results.find_records(tmp_path))   # the cases a stopped call logged count too
    assert list(kernel(fig, 1).y) == [250.0, 500.0] and list(kernel(fig, 1).text) == ["1.50x", "3.00x"]
