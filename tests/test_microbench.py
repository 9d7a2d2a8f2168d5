"""`mk microbench`: the kernels that measure the simulator's assumed TPU constants compute what they
time (interpret mode), compile for TPU v7 at their timed sizes, the fits invert the model's cost
formulas, and a CSV they write is what `mk simulate --microbench` models with."""
import csv
import json

import numpy as np
import pytest

from mk.perf import hardware as hw
from mk.perf import microbench as mb
from mk.perf import sim
from mk.__main__ import main
from mk.model.config import get_config


def test_kernels_compute_what_they_time():
    rows = mb.check()
    assert {r["name"].split(".")[0] for r in rows} == {"mxu", "dma", "vector", "dequant"}
    assert all(r["ok"] for r in rows), rows


def test_expected_values_catch_a_wrong_kernel():
    name, make, args = next(c for c in mb.cases(small=True) if c[0].startswith("mxu"))
    want = mb.expected(name, args)
    x, w = (np.asarray(a, np.float32) for a in args)
    assert not np.allclose(want, 3 * x[:x.shape[0] // 2] @ w, rtol=1e-3)   # the LHS halves alternate


@pytest.mark.aot
@pytest.mark.parametrize("topology", ["tpu7x:2x2x1", "v5e:2x2"])
def test_kernels_compile_at_their_timed_sizes(topology):
    rows = mb.compile_all(topology)
    assert len(rows) == len(mb.MXU_ROWS) + len(mb.MXU_DTYPES) - 1 + 2 * len(mb.DMA_SIZES) + 2 + len(mb.DEQUANT_UNPACKS)
    assert {"dequant.pairs", "dequant.shift"} <= {r["name"] for r in rows}
    assert {"mxu.bf16xfp8.r32", "mxu.fp8.r32"} <= {r["name"] for r in rows}   # the seed's fp8 expert path
    fp8 = {"mxu.bf16xfp8.r32", "mxu.fp8.r32"} if topology.startswith("v5e") else set()   # no fp8 MXU on v5e
    assert all(r["compiled"] for r in rows if r["name"] not in fp8), [r for r in rows if not r["compiled"]]


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
    path = mb.write_microbench_csv(measured, tmp_path / "mb.csv", mb.source_label("TPU7x (test)"), "tpu-v7")
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


def _data_rows(path):
    return [ln for ln in open(path).read().splitlines() if ln.strip() and not ln.startswith("#")]


def test_writing_one_chip_keeps_every_other_chips_rows(tmp_path):
    """A v5e measurement replaces tpu-v5e rows and adds the ones the chip lacks; every other row
    (tpu-v7's included) is copied byte for byte; writing again replaces, never duplicates."""
    base = hw.DATA_DIR / "microbench.csv"
    v5e = {"mxu_push_rows": 50, "dma_descriptor_latency": 1e-6, "dma_stream_bw": 8e11, "vector_flops": 1.4e12,
           "vector_bw": 5e12, "mxu_bf16xfp8_vs_bf16": 0.8}
    a = mb.write_microbench_csv(v5e, tmp_path / "a.csv", mb.source_label("TPU v5 lite", "2027-01-01"), "tpu-v5e")
    old, new = _data_rows(base), _data_rows(a)
    assert [r for r in new if not r.startswith("tpu-v5e,")] == [r for r in old if not r.startswith("tpu-v5e,")]
    t = hw.load_microbench(a)
    for q, v in v5e.items():
        m = t.measurement("tpu-v5e", q)
        assert m.value == pytest.approx(v) and m.source == "measured: mk microbench on TPU v5 lite, 2027-01-01"
    assert t.measurement("tpu-v5e", "vector_bw").note.startswith("was: ")   # replaced (the note keeps the old row), not added
    kept = [r for r in old if r.startswith(("tpu-v5e,step_fixed_overhead,", "tpu-v5e,routing_per_layer,"))]
    assert len(kept) == 2 and set(kept) <= set(new)                     # the chip's unmeasured rows as they were
    b = mb.write_microbench_csv({"mxu_push_rows": 60}, tmp_path / "b.csv", "measured: again", "tpu-v5e", base=a)
    assert len(_data_rows(b)) == len(new) and hw.load_microbench(b).get("tpu-v5e", "mxu_push_rows") == 60
    # a chip with no rows yet: its rows are appended, the file's other rows untouched
    c = mb.write_microbench_csv({"mxu_push_rows": 70}, tmp_path / "c.csv", "measured: v6e", "tpu-v6e")
    assert _data_rows(c)[:-1] == old and hw.load_microbench(c).measurement("tpu-v6e", "mxu_push_rows").unit == "count"
    with pytest.raises(mb.MicrobenchError, match="unknown quantity \\['mxu_pull_rows'\\]"):
        mb.write_microbench_csv({"mxu_pull_rows": 1}, tmp_path / "x.csv", "measured", "tpu-v5e")


def test_device_kinds_map_to_chips_of_the_hardware_table():
    chips = hw.load_chips()
    assert mb.chip_of_device_kind("TPU v5 lite") == "tpu-v5e" and mb.chip_of_device_kind("TPU7x") == "tpu-v7"
    assert set(mb.DEVICE_KINDS.values()) == {c for c in chips if c.startswith("tpu-")}
    with pytest.raises(mb.MicrobenchError, match="device kind 'TPU v4': no chip of data/hardware.csv") as e:
        mb.chip_of_device_kind("TPU v4")
    assert "\n" not in str(e.value)


def test_the_seeded_v5e_rows_are_what_the_write_path_writes(tmp_path):
    """data/microbench.csv's measured tpu-v5e rows are what `write_microbench_csv` writes for those
    values and sources (three runs: the DMA rows, the MXU and vector rows, the dequant row): the
    format a re-run produces, every other chip's rows untouched. (The values themselves are checked
    against their runs by test_the_measured_v5e_rows_come_from_their_runs.)"""
    import json
    table = hw.load_microbench()
    rows = [m for (chip, _), m in table.rows.items() if chip == "tpu-v5e" and m.source.startswith("measured")]
    assert {m.quantity for m in rows} == {"dma_stream_bw", "dma_descriptor_latency", "mxu_push_rows", "vector_flops",
                                         "vector_bw", "mxu_bf16xfp8_vs_bf16", "dequant_op_rate"}
    by_source = {}
    for m in rows:
        by_source.setdefault(m.source, {})[m.quantity] = m.value
    assert sorted(len(v) for v in by_source.values()) == [1, 2, 4]
    assert {"dma_stream_bw", "dma_descriptor_latency"} == set(next(v for s, v in by_source.items() if "2026-12-04" in s))
    base = _data_rows(hw.DATA_DIR / "microbench.csv")
    stripped = tmp_path / "base.csv"
    stripped.write_text("\n".join(r for r in open(hw.DATA_DIR / "microbench.csv").read().splitlines()
                                  if not any(r.startswith(f"tpu-v5e,{m.quantity},") for m in rows)) + "\n")
    out = stripped
    for i, (source, values) in enumerate(by_source.items()):
        out = mb.write_microbench_csv(values, tmp_path / f"o{i}.csv", source, "tpu-v5e", base=out)
    cut = lambda r: tuple(next(csv.reader([r]))[i] for i in (0, 1, 2, 3, 6))   # a replaced row keeps its range and says so
    assert sorted(map(cut, _data_rows(out))) == sorted(map(cut, base))
    assert [r for r in _data_rows(out) if not r.startswith("tpu-v5e,")] == [r for r in base if not r.startswith("tpu-v5e,")]


def test_the_measured_v5e_rows_come_from_their_runs():
    """Each measured tpu-v5e value of data/microbench.csv against its run, not against the CSV: the
    MXU and vector rows re-derived from the raw timings of docs/tpu-v5e/2026-12-05/microbench-pairs.json
    (by `measure`'s formulas at the module's sizes), the dequant row from the three runs of
    docs/tpu-v5e/2026-12-06d/dequant-rate-4096.jsonl, and the DMA rows pinned to what the 2026-12-04
    run printed (`mk microbench` on TPU v5 lite at 855d326: 795 GB/s streaming, 4 MiB copies 4 in
    flight; a 1.16 us descriptor latency; that run's JSON was not kept)."""
    from mk.kernel.schedule import dequant_ops
    table = hw.load_microbench()
    v5e = lambda q: table.get("tpu-v5e", q)
    run = json.loads((hw.DATA_DIR.parent / "docs/tpu-v5e/2026-12-05/microbench-pairs.json").read_text())
    peak = hw.load_chips()["tpu-v5e"].per_core("bf16_flops")
    assert run["device_kind"] == "TPU v5 lite" and run["peak_bf16_flops"] == peak
    t_bf16 = run["mxu"][str(mb.MXU_ROWS[0])]["s"]
    assert v5e("mxu_push_rows") == pytest.approx(mb.push_rows(t_bf16, mb.MXU_K, mb.MXU_N, peak), rel=1e-5)
    assert v5e("vector_flops") == pytest.approx(2 * mb.FMAS * mb.VEC_ROWS * mb.VEC_COLS / run["vector"]["s_per_fma_pass"],
                                                rel=1e-5)
    assert v5e("vector_bw") == pytest.approx(2 * mb.BW_ROWS * mb.VEC_COLS * 4 / run["vector"]["s_per_vmem_pass"], rel=1e-5)
    assert v5e("mxu_bf16xfp8_vs_bf16") == pytest.approx(
        run["mxu_dtypes"]["bf16xfp8"]["s"] / run["mxu"][str(mb.DTYPE_ROWS)]["s"], rel=1e-5)
    assert v5e("dma_stream_bw") == 795e9 and v5e("dma_descriptor_latency") == 1.16e-6
    for q in ("dma_stream_bw", "dma_descriptor_latency"):          # not the 2026-12-05 run's refused values
        assert v5e(q) != pytest.approx(run["constants"][q], rel=0.1), q
    runs = (hw.DATA_DIR.parent / "docs/tpu-v5e/2026-12-06d/dequant-rate-4096.jsonl").read_text().splitlines()
    rates = sorted(json.loads(r)["pairs"]["weights_per_s"] * dequant_ops("bf16", "pairs") for r in runs)
    m = table.measurement("tpu-v5e", "dequant_op_rate")
    assert len(rates) == 3 and (m.low, m.value, m.high) == pytest.approx(tuple(rates), rel=1e-5)


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
    monkeypatch.setattr(mb.jax, "devices", lambda: [type("D", (), {"device_kind": "TPU7x"})()])
    monkeypatch.setattr(mb, "per_repeat", fake_per_repeat)
    monkeypatch.setattr(mb, "STREAM_BYTES", (64 << 20, 128 << 20))   # nothing is timed: no 1 GiB source
    res = mb.measure(trials=1)
    assert res["chip"] == "tpu-v7" and res["peak_bf16_flops"] == peak
    c = res["constants"]
    assert c["mxu_push_rows"] == pytest.approx(128)
    assert res["mxu"][512]["push_rows"] == pytest.approx(512)          # rows cost past the push
    assert res["mxu_dtypes"]["bf16xfp8"]["vs_bf16"] == pytest.approx(0.5)
    assert c["dma_descriptor_latency"] == pytest.approx(0.8e-6)
    assert c["vector_flops"] == pytest.approx(2 * mb.FMAS * mb.VEC_ROWS * mb.VEC_COLS / 1e-6)
    assert c["mxu_bf16xfp8_vs_bf16"] == pytest.approx(0.5)
    path = mb.write_microbench_csv(c, tmp_path / "mb.csv", mb.source_label(res["device_kind"]), res["chip"])
    assert hw.load_microbench(path).get("tpu-v7", "mxu_push_rows") == pytest.approx(128)


def test_measure_on_a_v5e_uses_the_v5e_peak(monkeypatch):
    """The same matmul time is fewer push rows at v5e's 197 TFLOP/s than at TPU v7's per-core peak
    (the 2026-12-04 run's 280 was computed at the latter); an unknown chip is refused before timing."""
    def fake_per_repeat(make, args, n1, n2, trials=5):
        return 1e-6 if len(args) == 2 else (0.8e-6 + args[0].shape[1] * 512 / 8e11 if args[0].ndim == 3 else 1e-6)

    monkeypatch.setattr(mb.jax, "default_backend", lambda: "tpu")
    monkeypatch.setattr(mb, "per_repeat", fake_per_repeat)
    monkeypatch.setattr(mb, "STREAM_BYTES", (64 << 20, 128 << 20))   # nothing is timed: no 1 GiB source
    monkeypatch.setattr(mb.jax, "devices", lambda: [type("D", (), {"device_kind": "TPU v5 lite"})()])
    res = mb.measure(trials=1)
    assert res["chip"] == "tpu-v5e" and res["peak_bf16_flops"] == 197e12
    assert res["constants"]["mxu_push_rows"] == pytest.approx(1e-6 * 197e12 / (2 * mb.MXU_K * mb.MXU_N))
    monkeypatch.setattr(mb.jax, "devices", lambda: [type("D", (), {"device_kind": "TPU v3"})()])
    with pytest.raises(mb.MicrobenchError, match="device kind 'TPU v3'"):
        mb.measure(trials=1)


def test_implausible_timings_are_not_written():
    """The 2026-12-05 v5e run (docs/tpu-v5e/2026-12-05/microbench-rejected.json): negative
    differences of repeat counts and a 45 TB/s "stream" are flagged, so `--write` refuses them."""
    import json
    from pathlib import Path
    res = json.loads((Path(__file__).parent.parent / "docs/tpu-v5e/2026-12-05/microbench-rejected.json").read_text())
    res["dma"] = {int(k): v for k, v in res["dma"].items()}
    res["mxu"] = {int(k): v for k, v in res["mxu"].items()}
    why = mb.implausible(res)
    assert any("above the datasheet HBM bandwidth" in w for w in why) and any("<= 0" in w for w in why)
    res["dma"] = {n: {"s_one_at_a_time": 1e-6 + n / 7e11, "s_4_inflight": n / 7.9e11, "stream_bw": 7.9e11} for n in res["dma"]}
    res["constants"] = dict(res["constants"], dma_stream_bw=7.9e11)
    res["latency_intercept"] = 1e-6
    assert mb.implausible(res) == ["no stream sweep (a run from before STREAM_POINTS: its stream was the 4 MiB "
                                   "copies' best)"]
    res["stream"] = {"4MiBx4": {"chunk_bytes": 4 << 20, "inflight": 4, "s_per_copy": (4 << 20) / 7.9e11,
                                "stream_bw": 7.9e11}}
    assert mb.implausible(res) == []
    res["stream"]["1MiBx4"] = {"chunk_bytes": 1 << 20, "inflight": 4, "s_per_copy": -1e-7, "stream_bw": None}
    assert mb.implausible_by_constant(res) == {"dma_stream_bw": ["stream 1MiBx4: -1e-07 s per copy <= 0"]}


def test_only_the_plausible_constants_are_written(tmp_path):
    """The second 2026-12-05 v5e run (docs/tpu-v5e/2026-12-05/microbench-pairs.json): its copies in
    flight were slower each than one at a time at 4 MiB, so its DMA constants are refused, while
    its MXU, vector and dequantization constants stand."""
    import json
    from pathlib import Path
    res = json.loads((Path(__file__).parent.parent / "docs/tpu-v5e/2026-12-05/microbench-pairs.json").read_text())
    res["dma"] = {int(k): v for k, v in res["dma"].items()}
    res["mxu"] = {int(k): v for k, v in res["mxu"].items()}
    why = mb.implausible_by_constant(res)
    assert set(why) == {"dma_stream_bw", "dma_descriptor_latency"}
    assert any("4096 KiB: 4 copies in flight take" in w for w in why["dma_descriptor_latency"])
    assert any("no stream sweep" in w for w in why["dma_stream_bw"])
    assert res["dequant"]["pairs"]["weights_per_s"] > res["dequant"]["shift"]["weights_per_s"] > 0
