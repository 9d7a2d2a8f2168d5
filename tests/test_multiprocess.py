"""Multi-process runs of the sharded reference (mk.cli.distributed, `mk logits --mesh`).

Two CPU processes x 4 virtual devices (gloo collectives, a free localhost port) load a synthetic
mini-tp8 checkpoint with `mk.io.checkpoint.load_sharded` (each process reading only its devices'
blocks) and run the sharded XLA reference together over the 8-device mesh; their logits must
equal a single-process run on 8 virtual devices BIT FOR BIT: both run the same per-device
programs (the mesh, the rank numbering and the rank-ordered bf16-wire sums do not depend on
which process hosts a device; gloo only moves bytes), so there is nothing that could round
differently. Launch errors (mismatched --num-processes, an unreachable coordinator, bad options)
are one line on stderr, exit 2, no traceback.

Every subprocess runs under a timeout and is killed on failure.
"""
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from mk.io import synth
from mk.__main__ import main
from mk.model.config import get_config

CFG = get_config("mini-tp8")
TOKENS = "5,17,3,1000"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    p = tmp_path_factory.mktemp("ckpt_mp") / "mini-tp8"
    synth.write_checkpoint(CFG, p, seed=0, shard_bytes=1 << 20, tokenizer=False)
    return str(p)


def free_port() -> int:
    """A localhost port that is free, with port + 1 free too (mk's launch check)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port < 65535:
            try:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue
    raise RuntimeError("no free port pair")


def env(devices: int) -> dict:
    e = dict(os.environ)
    flags = [f for f in e.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    e["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])
    e["JAX_PLATFORMS"] = "cpu"
    e["PYTHONPATH"] = ROOT + os.pathsep + e.get("PYTHONPATH", "")
    return e


def launch(argvs, devices: int = 4, timeout: float = 300):
    """Run `python -m mk ARGV` for each ARGV at once -> [(returncode, stdout, stderr)]."""
    procs = [subprocess.Popen([sys.executable, "-m", "mk", *a], env=env(devices), cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for a in argvs]
    try:
        return [_wait(p, timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _wait(p, timeout):
    out, err = p.communicate(timeout=timeout)
    return p.returncode, out, err


def logits_argv(ckpt, out, *extra):
    return ["logits", "--checkpoint", ckpt, "--tokens", TOKENS, "--out", str(out), "--no-progress", *extra]


def job(port, n, i, timeout=60):
    return ["--coordinator", f"127.0.0.1:{port}", "--num-processes", str(n), "--process-id", str(i),
            "--distributed-timeout", str(timeout)]


def one_error_line(err: str) -> str:
    lines = [l for l in err.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


def test_two_processes_equal_one_process(ckpt, tmp_path):
    port = free_port()
    outs = [tmp_path / f"p{i}.npy" for i in range(2)]
    res = launch([logits_argv(ckpt, outs[i], "--mesh", "8", *job(port, 2, i)) for i in range(2)])
    for i, (rc, out, err) in enumerate(res):
        assert rc == 0, f"process {i} exited {rc}:\n{out}\n{err[-3000:]}"
    assert outs[0].exists() and not outs[1].exists()          # process 0 writes the result
    single = tmp_path / "single.npy"
    assert main(logits_argv(ckpt, single, "--mesh", "8")) == 0  # this process: 8 virtual devices
    a, b = np.load(outs[0]), np.load(single)
    assert a.shape == (len(TOKENS.split(",")), CFG.vocab) and np.isfinite(a).all()
    assert a.tobytes() == b.tobytes(), f"max |diff| {np.abs(a - b).max()}"


def test_mismatched_process_counts(ckpt, tmp_path):
    port = free_port()
    res = launch([logits_argv(ckpt, tmp_path / "a.npy", "--mesh", "8", *job(port, 2, 0, 30)),
                  logits_argv(ckpt, tmp_path / "b.npy", "--mesh", "8", *job(port, 3, 1, 30))], timeout=120)
    for rc, out, err in res:
        assert rc == 2, err
        line = one_error_line(err)
        assert "--num-processes 3" in line and "with 2" in line, line


def test_unreachable_coordinator(ckpt, tmp_path):
    [(rc, out, err)] = launch([logits_argv(ckpt, tmp_path / "a.npy", *job(free_port(), 2, 1, 2))], timeout=60)
    assert rc == 2
    assert "did not answer" in one_error_line(err)


@pytest.mark.parametrize("extra,words", [
    (["--coordinator", "127.0.0.1:1234", "--num-processes", "2", "--process-id", "2"], "--process-id"),
    (["--coordinator", "127.0.0.1:1234", "--num-processes", "2"], "all of"),
    (["--coordinator", "localhost", "--num-processes", "2", "--process-id", "0"], "HOST:PORT"),
    (["--mesh", "16"], "only 8 devices"),
    (["--mesh", "3"], "does not divide"),
])
def test_bad_launch_options(ckpt, tmp_path, capsys, extra, words):
    assert main(logits_argv(ckpt, tmp_path / "x.npy", *extra)) == 2
    err = capsys.readouterr().err
    assert words in one_error_line(err), err
