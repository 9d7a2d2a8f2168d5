"""`mk microbench`: the kernels that measure the simulator's assumed TPU constants compute what they
time (interpret mode), compile for TPU v7 at their timed sizes, the fits invert the model's cost
formulas, and a CSV they write is what `mk simulate --microbench` models with."""
import json

import numpy as np
import pytest

from mk import hardware as hw
from mk import microbench as mb
from mk import sim
from mk.__main__ import main
from mk.config import get_config


def test_kernels_compute_what_they_time():
    rows = mb.check()
    assert {r["name"].split(".")[0] for r in rows} == {"mxu", "dma", "vector"}
    assert all(r["ok"] for r in rows), rows


def test_expected_values_catch_a_wrong_kernel():
    name, make, args = next(c for c in mb.cases(small=True) if c[0].startswith("mxu"))
    want = mb.expected(name, args)
    x, w = (np.asarray(a, np.float32) for a in args)
    assert not np.allclose(want, 3 * x[:x.shape[0] // 2] @ w, rtol=1e-3)   # the LHS halves alternate


def test_kernels_compile_for_tpu7x_at_their_timed_sizes():
    rows = mb.compile_all("tpu7x:2x2x1")
    assert len(rows) == len(mb.MXU_ROWS) + len(mb.MXU_DTYPES) - 1 + 2 * len(mb.DMA_SIZES) + 2
    assert {"mxu.bf16xfp8.r32", "mxu.fp8.r32"} <= {r["name"] for r in rows}   # the seed's fp8 expert path
    assert all(r["compiled"] for r in rows), [r for r in rows if not r["compiled"]]


def test_fits_invert_the_model():
    peak, k, n = 1.15e15, 4096, 512
    for rows in (16, 256):                      # a push-bound matmul of 2 rows k n / peak seconds
        assert mb.push_rows(2 * rows * k * n / peak, k, n, peak) == pytest.approx(rows)
    sizes = [1 << 16, 1 << 18, 1 << 20]
    lat, bw = mb.line_fit(sizes, [0.7e-6 + s / 2.5e12 for s in sizes])
    assert lat == pytest.approx(0.7e-6) and bw == pytest.approx(2.5e12)
    with pytest.raises(mb.MicrobenchError, match="does not grow"):
        mb.line_fit(sizes, [3e-6, 2e-6, 1e-6])


def test_a_written_csv_is_what_simulate_models_with(tmp_path, capsys):
    measured = {"mxu_push_rows": 16, "dma_descriptor_latency": 0.4e-6, "vector_flops": 20e12, "vector_bw": 9e12}
    path = mb.write_microbench_csv(measured, tmp_path / "mb.csv", mb.source_label("TPU7x (test)"))
    table = hw.load_microbench(path)
    assert table.get("tpu-v7", "mxu_push_rows") == 16
    assert table.measurement("tpu-v7", "mxu_push_rows").source.startswith("measured: mk microbench on TPU7x")
    assert table.get("tpu-v7", "dma_stream_bw") == hw.load_microbench().get("tpu-v7", "dma_stream_bw")
    s = hw.get_system("tpu-v7x16", microbench_csv=path)
    assert "mxu_push_rows" not in s.assumptions() and "mxu_push_rows" in hw.get_system("tpu-v7x16").assumptions()
    cfg = get_config("k3")
    default, measured_step = (sim.model(cfg, 1, sys_, "seed").step_time for sys_ in ("tpu-v7x16", s))
    assert measured_step < 0.8 * default        # 16 push rows: the matmuls cost a sixteenth
    assert main(["simulate", "--batch", "1", "--plan", "seed", "--microbench", str(path), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["microbench"] == str(path)
    assert rep["rows"][0]["seed"]["step_time_s"] == pytest.approx(measured_step)


def test_a_row_the_csv_lacks_is_an_error(tmp_path):
    with pytest.raises(mb.MicrobenchError, match="no tpu-v7 row for \\['mxu_pull_rows'\\]"):
        mb.write_microbench_csv({"mxu_pull_rows": 1}, tmp_path / "x.csv", "measured")


def test_timing_off_a_tpu_is_refused(capsys):
    assert main(["microbench"]) == 2
    assert "times kernels on a TPU" in capsys.readouterr().err


def test_measure_turns_timings_into_the_constants(monkeypatch, tmp_path):
    """`measure`'s bookkeeping on a fake TPU whose per-repeat times follow the model's formulas
    (push 128 rows; 0.8 us + S / 2.5 TB/s per copy): the fits give those constants back."""
    peak = hw.get_system("tpu-v7x16").peak_flops("bf16")

    def fake_per_repeat(make, args, n1, n2, trials=5):
        if len(args) == 2:                                   # mxu: x [2 R, K], w [K, N]
            rows, (k, n) = args[0].shape[0] // 2, args[1].shape
            return 2 * max(rows, 128) * k * n / peak / (2 if args[1].dtype.itemsize == 1 else 1)
        if args[0].ndim == 3:                                # dma: src [copies, S / 512, 128]
            return 0.8e-6 + args[0].shape[1] * 512 / 2.5e12
        return 1e-6                                          # vector

    monkeypatch.setattr(mb.jax, "default_backend", lambda: "tpu")
    monkeypatch.setattr(mb, "per_repeat", fake_per_repeat)
    res = mb.measure(trials=1)
    c = res["constants"]
    assert c["mxu_push_rows"] == pytest.approx(128)
    assert res["mxu"][512]["push_rows"] == pytest.approx(512)          # rows cost past the push
    assert res["mxu_dtypes"]["bf16xfp8"]["vs_bf16"] == pytest.approx(0.5)
    assert c["dma_descriptor_latency"] == pytest.approx(0.8e-6)
    assert c["vector_flops"] == pytest.approx(2 * mb.FMAS * mb.VEC_ROWS * mb.VEC_COLS / 1e-6)
    path = mb.write_microbench_csv(c, tmp_path / "mb.csv", mb.source_label(res["device_kind"]))
    assert hw.load_microbench(path).get("tpu-v7", "mxu_push_rows") == pytest.approx(128)
