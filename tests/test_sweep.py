"""`mk sweep` on CPU: its plan, its refusals, and a whole sweep on `mini` with a fake runner in place of
the chip (each case's process writes made-up rows through `mk.perf.sweep.save`), which resumes where a
time limit cut it, skips what is measured at this commit with these options, and prints the table."""
import datetime
import os
import subprocess
import sys

import pytest

from mk.__main__ import build_parser, main
from mk.cli import sweep as cli
from mk.perf import sweep

DEVICE_MS = {"kernel": 2.0, "xla": 3.0}


class FakeRunner:
    """The chip, faked: each case's process writes one record per batch (a kernel twice as fast as
    the XLA step at B = 1), or stops after `cut_after` batches as a time limit would."""
    pause_s = 0

    def __init__(self, cut_after: int | None = None):
        self.calls, self.cut_after = [], cut_after

    def probe(self):
        return "tpu", "TPU v5 lite"

    def run(self, argv, log, timeout_s):
        a = build_parser().parse_args(argv)
        assert a.case and a.configs == "mini"
        case = sweep.Case(a.configs, a.experts, a.impl, tuple(int(b) for b in a.batch.split(",")))
        self.calls.append((case.impl, case.batches))
        opts = sweep.options(a.steps, a.warmup, a.seed)
        for i, b in enumerate(case.batches):
            if self.cut_after is not None and i >= self.cut_after:
                return None
            row = {"impl": case.impl, "batch": b, "experts": case.experts, "wall_s": 1.0,
                   "device_median_ms": DEVICE_MS[case.impl] * (1 + b / 8), "device_frac_stream": 0.5,
                   "distinct_experts": [4.0] * 7, "distinct_source": "routed (xla step)" if case.impl == "xla" else
                   "expected (uniform routing)"}
            record = {"kind": "bench", "key": sweep.bench_key(case, b), "summary": "made up", "commit": "f" * 40,
                      "date": datetime.datetime.now().isoformat(timespec="seconds"), "chip": "tpu-v5e",
                      "command": sweep.bench_command(case, b, opts), "options": opts}
            sweep.save(a.out, case, b, record, {"rows": [row]})
        return 0


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setenv("MK_COMMIT", "f" * 40)
    from mk.perf import peer
    monkeypatch.setattr(peer, "available", lambda: True)      # the peer is refused for mini's widths, not its package
    runner = FakeRunner()
    monkeypatch.setattr(cli, "RUNNER", runner)
    return runner


SWEEP = ["sweep", "--configs", "mini", "--experts", "bf16", "--impl", "kernel,xla,peer", "--batch", "1,2", "--no-figure"]


def test_plan_lists_cases_their_time_and_what_is_left_out(fake, capsys):
    assert main(["sweep", "--configs", "mini", "--experts", "bf16,mxfp4", "--impl", "kernel,xla,peer", "--batch",
                 "1,8", "--plan", "--max-minutes", "9"]) == 0
    out = capsys.readouterr().out
    assert fake.calls == []                                      # runs nothing
    lines = {ln.split("  ")[0].strip(): ln for ln in out.splitlines()}
    assert lines["mini bf16 kernel"].split()[-2] == "1,8" and lines["mini bf16 kernel"].endswith("s")
    assert "mini mxfp4 kernel" in lines
    assert "strawman" in lines["mini mxfp4 xla"] and "left out" in lines["mini mxfp4 xla"]
    assert "latent width a multiple of 256" in lines["mini bf16 peer"]
    assert "command(s) of --max-minutes 9" in out


def test_sweep_resumes_skips_and_prints_the_table(fake, tmp_path, capsys):
    out = str(tmp_path / "sweep")
    fake.cut_after = 1                                           # a limit cuts the first case after B = 1
    assert main(SWEEP + ["--out", out]) == 0
    first = capsys.readouterr()
    assert fake.calls == [("kernel", (1, 2))] and "stopped at the time limit" in first.err
    assert "| `mini` | bf16 | 2.25 ms, no rival, 0.50* | not run |" in first.out
    assert "peer left out at mini bf16: the peer kernel needs the latent width a multiple of 256" in first.err

    fake.cut_after, fake.calls = None, []
    assert main(SWEEP + ["--out", out]) == 0                      # goes on where it stopped
    second = capsys.readouterr()
    assert fake.calls == [("kernel", (2,)), ("xla", (1, 2))]
    row = next(ln for ln in second.out.splitlines() if ln.startswith("| `mini` | bf16"))
    cells = [c.strip() for c in row.strip("|").split("|")][2:]
    assert [c.split(", ")[:2] for c in cells] == [["2.25 ms", "1.50x xla"], ["2.50 ms", "1.50x xla"]]
    assert not any(c.endswith("*") for c in cells)                 # the XLA step counted the routed experts
    assert "from 4 records" in second.out

    fake.calls = []
    assert main(SWEEP + ["--out", out]) == 0                      # all done at this commit, these options
    assert fake.calls == [] and "2 of 2 cases already measured" in capsys.readouterr().err
    assert main(SWEEP + ["--out", out, "--steps", "4"]) == 0      # other options: measured anew
    assert fake.calls == [("kernel", (1, 2)), ("xla", (1, 2))]


def test_max_minutes_starts_no_case_that_does_not_fit(fake, tmp_path, capsys):
    assert main(SWEEP + ["--out", str(tmp_path), "--max-minutes", "0.2"]) == 0
    err = capsys.readouterr().err
    assert fake.calls == [] and "stopped before mini bf16 kernel" in err and "run the same command again" in err


@pytest.mark.parametrize("args, culprit", [(["--configs", "no-such-config"], "--configs"),
                                          (["--impl", "kernel,vllm"], "--impl"),
                                          (["--batch", "1,16"], "--batch")])
def test_bad_input_is_one_line_naming_the_option(fake, capsys, args, culprit):
    assert main(["sweep", "--plan"] + args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and culprit in err


def test_refuses_off_a_tpu_in_one_line(tmp_path):
    """The real runner asks a fresh process for jax's backend: on CPU the sweep refuses before any case."""
    res = subprocess.run([sys.executable, "-m", "mk", "sweep", "--configs", "mini", "--experts", "bf16", "--impl",
                          "kernel", "--batch", "1", "--out", str(tmp_path / "out")],
                         capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "on a TPU" in res.stderr
    assert not (tmp_path / "out").exists()
