"""Hardware tables, per-device byte accounting and the roofline (mk.perf.hardware, mk.perf.roofline)."""
import math
from pathlib import Path

import pytest

from mk.perf import hardware as hw
from mk.perf import roofline as rl, routing
from mk.model.config import K3Config, get_config
from mk.model.layout import SEED_TPU7X16, Layout, PlanError

MiB = 1 << 20
K3 = K3Config()


# ---- hardware tables ---------------------------------------------------------------------------
def test_every_chip_loads_with_sources():
    chips = hw.load_chips()
    assert set(chips) >= {"tpu-v5e", "tpu-v5p", "tpu-v6e", "tpu-v7", "h100", "h200", "b200", "gb200"}
    for c in chips.values():
        for q in hw.REQUIRED:
            assert c.get(q) is not None and c.source(q), (c.name, q)


def test_seed_chip_figures_are_the_used_values():
    chips = hw.load_chips()
    v7, gb = chips["tpu-v7"], chips["gb200"]
    assert v7.bf16_flops == pytest.approx(2.31e15) and v7.fp8_flops == pytest.approx(4.61e15)
    assert v7.hbm_bytes == pytest.approx(206e9) and v7.hbm_bw == pytest.approx(7380e9)
    assert gb.bf16_flops == pytest.approx(2.5e15) and gb.fp8_flops == pytest.approx(5e15)
    assert gb.hbm_bytes == pytest.approx(186e9) and gb.hbm_bw == pytest.approx(8000e9)
    assert "seed" in v7.source("hbm_bw") and "seed" in gb.source("bf16_flops")
    assert v7.cores_per_chip == 2 and v7.per_core("hbm_bw") == pytest.approx(3690e9)


def test_jax_tpu_info_rows_are_recorded():
    """The table keeps what jax 0.10.2's get_tpu_info_for_chip reports (per logical device)."""
    v7 = hw.load_chips()["tpu-v7"]
    jax_rows = {q: [f for f in fs if "get_tpu_info_for_chip" in f.source] for q, fs in v7.alternatives.items()}
    assert jax_rows["hbm_bw"][0].value == pytest.approx(3.7e12)
    assert jax_rows["bf16_flops"][0].value == pytest.approx(1.155e15)
    assert jax_rows["onchip_bytes"][0].value == 64 * MiB
    assert jax_rows["mxu_dim"][0].value == 256


def test_jax_reports_what_the_table_says():
    from jax.experimental.pallas import tpu as pltpu     # jax is pinned (0.10.2): this must import
    info = pltpu.get_tpu_info_for_chip(pltpu.ChipVersion.TPU_7X, 1)
    v7 = hw.load_chips()["tpu-v7"]
    assert info.vmem_capacity_bytes == v7.get("onchip_bytes")
    assert info.mxu_column_size == v7.mxu_dim
    assert info.mem_bw_bytes_per_second == pytest.approx(3.7e12)
    assert info.bf16_ops_per_second == pytest.approx(1.155e15)


def test_microbench_and_published_tables():
    mb = hw.load_microbench()
    assert mb.get("tpu-v7", "dma_stream_bw") == pytest.approx(3.0e12)
    assert mb.get("tpu-v7", "collective_phase_latency_min") == pytest.approx(3.5e-6)
    assert mb.get("tpu-v7", "collective_phase_latency_max") == pytest.approx(4.7e-6)
    assert mb.get("tpu-v7", "cross_chip_link_bw") == pytest.approx(45e9)
    assert "spec" in mb.measurement("tpu-v7", "sibling_copy_bw_256k").source
    pub = hw.load_published()
    tpu = [hw.published_value("tpu-v7x16", "plain", b, table=pub) for b in (1, 2, 4, 8)]
    gpu = [hw.published_value("gb200x16", "plain", b, table=pub) for b in (1, 2, 4, 8)]
    assert tpu == [249, 392, 515, 865] and gpu == [127, 227, 373, 636]
    assert hw.published_value("tpu-v7x16", "dspark_al6", 1, table=pub) == 709
    assert hw.published_value("gb200x16", "dspark_al3", 1, table=pub) == 229
    assert all(p.role in ("validation", "reference") and p.source for p in pub)


def test_sibling_fit_from_the_two_measured_points():
    t0, bw = hw.sibling_link_fit(hw.load_microbench())
    assert t0 + 256 * 1024 / bw == pytest.approx(256 * 1024 / 101e9)
    assert t0 + 16 * MiB / bw == pytest.approx(16 * MiB / 610e9)
    assert 2.0e-6 < t0 < 2.4e-6


def _write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


HEADER = "chip,quantity,value,unit,scope,source,use\n"


def test_bad_number_names_file_line_and_column(tmp_path):
    p = _write(tmp_path, "hw.csv", HEADER + "x,hbm_bw,fast,bytes/s,chip,src,1\n")
    with pytest.raises(hw.HardwareDataError, match=r"hw\.csv: line 2: column 'value': 'fast' is not a number"):
        hw.load_chips(p)


def test_bad_unit_scope_use_and_quantity(tmp_path):
    cases = [
        ("x,hbm_bw,1,GB/s,chip,src,1\n", "column 'unit'"),
        ("x,hbm_bw,1,bytes/s,board,src,1\n", "column 'scope'"),
        ("x,hbm_bw,1,bytes/s,chip,src,yes\n", "column 'use'"),
        ("x,hbm_speed,1,bytes/s,chip,src,1\n", "column 'quantity'"),
        ("x,hbm_bw,1,bytes/s,chip,,1\n", "column 'source' is empty"),
        ("x,hbm_bw,1,bytes/s\n", "expected 7 columns"),
    ]
    for row, msg in cases:
        p = _write(tmp_path, "hw.csv", HEADER + row)
        with pytest.raises(hw.HardwareDataError, match=msg):
            hw.load_chips(p)


def test_missing_and_duplicate_used_values(tmp_path):
    p = _write(tmp_path, "hw.csv", HEADER + "x,hbm_bw,1,bytes/s,chip,a,1\n")
    with pytest.raises(hw.HardwareDataError, match="chip 'x' has no row with quantity 'hbm_bytes' and use=1"):
        hw.load_chips(p)
    p = _write(tmp_path, "hw.csv", HEADER + "x,hbm_bw,1,bytes/s,chip,a,1\nx,hbm_bw,2,bytes/s,chip,b,1\n")
    with pytest.raises(hw.HardwareDataError, match="line 3.*already has a used value \\(line 2\\)"):
        hw.load_chips(p)
    p = _write(tmp_path, "mb.csv", "system,quantity,value,unit,source,note\ns,q,1,s,a,\ns,q,2,s,b,\n")
    with pytest.raises(hw.HardwareDataError, match="line 3.*duplicate"):
        hw.load_microbench(p)
    p = _write(tmp_path, "pub.csv", "system,setting,batch,metric,value,unit,source,role\ns,x,1.5,m,1,u,src,validation\n")
    with pytest.raises(hw.HardwareDataError, match="column 'batch'"):
        hw.load_published(p)


def test_systems():
    tpu, gpu = hw.get_system("tpu-v7x16"), hw.get_system("gb200x16")
    assert tpu.devices == 32 and gpu.devices == 16
    assert tpu.dma_bw == pytest.approx(3.0e12) and tpu.hbm_bw == pytest.approx(3.69e12)
    assert tpu.peak_flops("bf16") == pytest.approx(1.155e15) and tpu.peak_flops("fp8") == pytest.approx(2.305e15)
    assert gpu.hbm_bw == pytest.approx(8e12) and gpu.schedule == "conventional"
    with pytest.raises(hw.HardwareDataError, match="unknown system"):
        hw.get_system("tpu-v9")


# ---- byte accounting ----------------------------------------------------------------------------
def _mib(plan, layer, name):
    return plan.stream(layer).matrix(name).bytes / MiB


def test_seed_per_rank_matrices_match_spec():
    """Spec 3.3 / 6.2: KDA projections 29.84 MiB, MLA 43.25 MiB (incl. scoped), MoE non-expert
    23.6 MiB (router half 7, latent 8.75, shared 7.9), dense slabs 31.5 + 15.75 MiB: the seed's
    schedule is mk.kernel.plan's matrices shaped by the SEED options (one list of matrices)."""
    from mk.perf import sim
    p = sim.seed_plan(K3, 1, "tpu-v7x16")
    kda = sum(m.bytes for m in p.stream(1).pre if m.name.startswith("kda.")) / MiB
    mla = sum(m.bytes for m in p.stream(3).pre if m.name.startswith("mla.")) / MiB
    assert kda == pytest.approx(29.84, abs=0.01)
    assert mla == pytest.approx(43.25, abs=0.01)
    assert _mib(p, 1, "kda.in") == pytest.approx(22.75)
    assert _mib(p, 1, "moe.router") == pytest.approx(7.0)
    assert _mib(p, 1, "moe.latent_down") + _mib(p, 1, "moe.latent_up") == pytest.approx(8.75)
    assert _mib(p, 1, "moe.shared_gu") + _mib(p, 1, "moe.shared_down") == pytest.approx(7.875)
    assert _mib(p, 0, "dense.gate_up") == pytest.approx(31.5) and p.stream(0).matrix("dense.gate_up").tiles == 7
    assert _mib(p, 0, "dense.down") == pytest.approx(15.75) and p.stream(0).matrix("dense.down").tiles == 3
    assert _mib(p, K3.layers, "lm_head") == pytest.approx(70.0)
    # one expert: gate/up fp8 [3584, 1536] + bf16 scales [14, 1536]; down MXFP4 [768, 3584] + E8M0 [24, 3584]
    assert p.expert_gu.bytes == 3584 * 1536 + 14 * 1536 * 2
    assert p.expert_down.bytes == 768 * 3584 // 2 + 24 * 3584


def test_expert_slice_bytes_by_format():
    ex = rl.expert_slice_bytes(K3, SEED_TPU7X16, rl.WeightFormats("bf16", "fp8", "mxfp4"))
    assert ex["gate_up"] == pytest.approx(3584 * 1536 + 14 * 1536 * 2)
    assert ex["down"] == pytest.approx(768 * 3584 / 2 + 24 * 3584)
    assert rl.bytes_per_param("bf16") == 2 and rl.bytes_per_param("fp8") == pytest.approx(1 + 2 / 256)
    assert rl.bytes_per_param("mxfp4") == pytest.approx(0.53125)
    gpu = rl.expert_slice_bytes(K3, hw.get_system("gb200x16").layout, rl.WeightFormats("bf16", "mxfp4", "mxfp4"))
    assert gpu["total"] == pytest.approx(3 * 3584 * 3072 * 0.53125)
    with pytest.raises(rl.RooflineError, match="unknown format"):
        rl.WeightFormats(expert_down="nf4")


def test_distinct_experts_expectation():
    lay = SEED_TPU7X16
    for b in (1, 2, 4, 8):
        ec = rl.distinct_experts(K3, b, lay)
        assert ec.mean == pytest.approx(112 * (1 - (1 - 16 / 896) ** b))
        assert ec.straggler > ec.mean
    assert rl.distinct_experts(K3, 1, lay).mean == pytest.approx(2.0)   # spec 3.5: 16 x 112/896
    # more rows -> more distinct experts, never more than local
    vals = [rl.distinct_experts(K3, b, lay).straggler for b in (1, 2, 4, 8, 64)]
    assert vals == sorted(vals) and vals[-1] <= 112


def test_expected_max_binomial_by_enumeration():
    n, p, g = 3, 0.3, 2
    pmf = [math.comb(n, k) * p ** k * (1 - p) ** (n - k) for k in range(n + 1)]
    brute = sum(max(a, b) * pmf[a] * pmf[b] for a in range(n + 1) for b in range(n + 1))
    assert routing.expected_max_binomial(n, p, g) == pytest.approx(brute)
    assert routing.expected_max_binomial(n, p, 1) == pytest.approx(n * p)


def test_layout_checks():
    """One Layout type (mk.model.layout.Layout) for the kernel, the plans of the seed's systems and the roofline."""
    with pytest.raises(PlanError, match="tp_attn=5 does not divide heads"):
        Layout(16, 2, 5, 8, 4).check(K3)
    with pytest.raises(PlanError, match="positive integer"):
        Layout(0, 2, 32, 8, 4)
    with pytest.raises(PlanError, match="style"):
        Layout(style="fpga")
    assert hw.get_system("tpu-v7x16").layout == SEED_TPU7X16            # data/systems.csv = spec 3.2
    assert Layout(16, 2, 32, 8, 4, name="a") == Layout(16, 2, 32, 8, 4, name="b")   # the name is a label

    class PlanLayout:          # duck-typed layout
        chips, cores_per_chip, tp_attn, ep, tp_expert = 16, 2, 32, 8, 4
    assert rl.as_layout(PlanLayout()).devices == 32 and isinstance(rl.as_layout(PlanLayout()), Layout)


# ---- roofline ----------------------------------------------------------------------------------
def test_roofline_floors_and_intensity():
    r = rl.roofline(K3, 1, 512, system="tpu-v7x16")
    sys_ = hw.get_system("tpu-v7x16")
    assert r.schedule == "seed" and r.t_hbm == pytest.approx(r.total_bytes / sys_.hbm_bw)
    assert r.ridge == pytest.approx(sys_.peak_flops("bf16") / sys_.hbm_bw)
    assert r.intensity == pytest.approx(r.total_flops / r.total_bytes)
    assert r.intensity < r.ridge                     # decode is far below the ridge point
    assert r.bound in ("hbm", "collective")
    assert r.ceiling_tok_s == pytest.approx(1 / max(r.t_hbm, r.t_compute, r.t_collective))
    cats = {row["category"] for row in r.breakdown}
    assert {"kda", "mla", "moe_router", "moe_latent", "moe_shared", "moe_experts", "dense_mlp", "lm_head",
            "kda_state", "mla_cache", "collective"} <= cats
    assert r.collectives["phases"] == 8 * K3.n_moe + 5       # 8 per MoE layer, 3 + 2 in layer 0 (spec 3.8)
    # B = 1, mean experts: the spec's ~6.9 GB of weights per token per rank
    m = rl.roofline(K3, 1, 512, system="tpu-v7x16", straggler=False)
    weights = m.total_bytes - m.bytes["kda_state"] - m.bytes["mla_cache"]
    assert weights == pytest.approx(6.9e9, rel=0.03)


def test_roofline_is_the_plans_entries():
    """The roofline's bytes are the DMAs and cache streams the simulator replays, no second list."""
    from mk.perf import sim
    r = rl.roofline(K3, 2, 512, system="tpu-v7x16")
    res = sim.model(K3, 2, "tpu-v7x16")
    assert r.total_bytes == pytest.approx(res.bytes_moved, rel=1e-9)
    assert r.bytes["moe_experts"] == pytest.approx(sum(d.bytes for d in res.dmas if d.tensor.startswith("expert[")))


def test_roofline_bytes_grow_with_batch_through_experts():
    r1, r8 = (rl.roofline(K3, b, system="tpu-v7x16") for b in (1, 8))
    assert r8.bytes["moe_experts"] > 4 * r1.bytes["moe_experts"]
    assert r8.bytes["kda"] == r1.bytes["kda"]
    assert r8.total_flops > 5 * r1.total_flops                      # ~linear in B (experts: their routed rows)
    g = rl.roofline(K3, 1, system="gb200x16")
    assert g.layout.style == "gpu" and g.schedule == "conventional" and g.bytes["moe_experts"] > 0


def test_seed_efficiency_ratio_is_about_1_7():
    r = rl.seed_efficiency_ratio()
    assert r["throughput_ratio"] == pytest.approx(709 / 452)
    assert r["peak_compute_ratio"] == pytest.approx(2.31 / 2.5)
    assert r["bandwidth_ratio"] == pytest.approx(7380 / 8000)
    assert r["per_peak_compute"] == pytest.approx(1.7, abs=0.01)
    assert r["per_bandwidth"] == pytest.approx(1.7, abs=0.01)


def test_mini_config_accounting_runs():
    cfg = get_config("mini")
    r = rl.roofline(cfg, 2, 256, layout=Layout(), system="tpu-v7x16")
    assert r.total_bytes > 0 and r.experts_per_layer <= cfg.experts and r.collectives["phases"] == 0


def test_fit_layout_shrinks_the_seed_layout_to_a_small_model():
    assert SEED_TPU7X16.fit(K3) is SEED_TPU7X16                          # K3 fits as is
    mini = get_config("mini")                                               # 2 heads, 16 experts
    with pytest.raises(PlanError, match="tp_attn=32 does not divide heads=2"):
        rl.roofline(mini, 1, 256, layout=SEED_TPU7X16, system="tpu-v7x16")
    lay = SEED_TPU7X16.fit(mini)
    assert (lay.devices, lay.tp_attn, lay.ep, lay.tp_expert) == (32, 2, 8, 4) and "fitted" in lay.name
    assert rl.roofline(mini, 1, 256, system="tpu-v7x16").layout == lay      # the system's layout, fitted


def test_microbench_ranges_and_systems_table(tmp_path):
    """Every constant a system reads has a source and a range around its value; assumptions say so;
    bad range or layout rows name the file, the line and the column."""
    for name in hw.system_names():
        s = hw.get_system(name)
        for k, c in s.constants.items():
            assert c.source and c.low <= c.value <= c.high, (name, k)
        assert s.setup.use and all(not a.use for a in s.alternatives)
    tpu, gpu = hw.get_system("tpu-v7x16"), hw.get_system("gb200x16")
    assert tpu.constants["mxu_min_rows"].value == 16 and "spec 3.5" in tpu.constants["mxu_min_rows"].source
    assert tpu.constants["mxu_push_rows"].assumption and not tpu.constants["dma_bw"].assumption
    assert gpu.setup.assumption and gpu.constants["step_overhead"].assumption and len(gpu.alternatives) >= 2
    t0, bw = hw.allreduce_phase_fit(hw.load_microbench())
    assert 2 * (t0 + 7 / 8 * 8 * 8192 * 2 / bw) == pytest.approx(7.3e-6)     # reproduces the bf16 measurement
    head = "system,quantity,value,unit,low,high,source,note\n"
    p = _write(tmp_path, "mb.csv", head + "s,q,5,s,6,7,src,\n")
    with pytest.raises(hw.HardwareDataError, match=r"mb\.csv: line 2: columns 'low'/'high'.*does not contain"):
        hw.load_microbench(p)
    p = _write(tmp_path, "mb.csv", head + "s,q,5,s,4,,src,\n")
    with pytest.raises(hw.HardwareDataError, match="give both or neither"):
        hw.load_microbench(p)
    cols = "system,chip,chips,cores_per_chip,tp_attn,ep,tp_expert,style,program,expert_gate_up,expert_down,published_system,use,source\n"
    p = _write(tmp_path, "sys.csv", cols + "x,gb200,16,1,16,16,1,gpu,batched,mxfp4,mxfp4,x,1,src\n")
    with pytest.raises(hw.HardwareDataError, match=r"sys\.csv: line 2: column 'program'"):
        hw.load_systems(p)
    p = _write(tmp_path, "sys.csv", cols + "x,gb200,16,1,32,16,1,gpu,per_op,mxfp4,mxfp4,x,1,src\n")
    with pytest.raises(hw.HardwareDataError, match=r"line 2: .*cannot exceed the 16 devices"):
        hw.load_systems(p)
    p = _write(tmp_path, "sys.csv", cols + "x,gb200,16,1,16,16,1,gpu,per_op,mxfp4,mxfp4,x,0,src\n")
    with pytest.raises(hw.HardwareDataError, match="exactly one row with use=1"):
        hw.load_systems(p)
