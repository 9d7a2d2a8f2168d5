"""Measurement records (mk.perf.results): provenance, the newest record of each measurement, the README's table."""
import json
import subprocess
import sys

from mk.perf import results


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
    assert block == results.results_table(results.find_records(results.REPO / "docs"))
