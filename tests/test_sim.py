"""The schedule simulator (mk.sim): hand-computable cases, determinism, and the seed validation."""
import json

import pytest

from mk import hardware as hw
from mk import sim
from mk.config import K3Config, get_config
from mk.sim import Machine, Phase, SimPlan, WeightDMA

K3 = K3Config()
MS = 1e-3

# 1 GB/s DMA, 1 TFLOP/s MXU with no padding: 1e6 bytes = 1 ms, 1e9 flops = 1 ms.
M = Machine(dma_bw=1e9, dma_latency=0.0, flops={"bf16": 1e12}, mxu_dim=1, min_rows=1,
            vector_flops=1e12, vector_bw=1e12, collective_latency=0.0, link_bw={"ici": 1e9})


def plan(dmas, phases, depth=100):
    return SimPlan(config=K3, batch=1, prefetch_depth=depth, num_slots=len({d.slot for d in dmas}),
                   layout=None, dmas=dmas, phases=phases)


def mm(i, flops, dmas=(), **kw):
    return Phase(i, 0, f"mm{i}", "mxu", flops=int(flops), rows=1, dmas=tuple(dmas), **kw)


def dma(i, phase, slot, nbytes=1e6, **kw):
    return WeightDMA(i, 0, f"w{i}", 0, int(nbytes), slot, phase, **kw)


def test_one_dma_one_compute_phase():
    m = Machine(dma_bw=1e9, dma_latency=1e-6, flops={"bf16": 1e12})
    r = sim.simulate(plan([dma(0, 0, 0)], [mm(0, 2e6, [0])]), m)
    # latency + bytes / bw + flops / peak
    assert r.step_time == pytest.approx(1e-6 + 1e-3 + 2e-6)
    assert r.bytes_moved == 1e6
    assert r.tokens_per_s == pytest.approx(1 / r.step_time)
    assert r.timeline["descriptors"] == [(pytest.approx(1e-6), pytest.approx(1.001e-3), "L0:w0#0")]


def test_two_slot_ring():
    """3 weights (1 ms each alone), 2 slots, 2 ms of compute each. w0, w1 share the engine and both
    land at 2 ms; w2 waits for slot 0 (freed when mm0 ends at 4 ms) and lands at 5 ms."""
    dm = [dma(0, 0, 0), dma(1, 1, 1), dma(2, 2, 0)]
    ph = [mm(0, 2e9, [0]), mm(1, 2e9, [1]), mm(2, 2e9, [2])]
    r = sim.simulate(plan(dm, ph), M)
    compute = [(round(s / MS, 6), round(e / MS, 6)) for s, e, _ in r.timeline["compute"]]
    assert compute == [(2, 4), (4, 6), (6, 8)]
    # phase_times: from the moment a phase becomes current (waiting included) to its end
    assert [(round(s / MS, 6), round(e / MS, 6)) for *_, s, e in r.phase_times] == [(0, 4), (4, 6), (6, 8)]
    assert r.step_time == pytest.approx(8 * MS)
    desc = {lab: (s / MS, e / MS) for s, e, lab in r.timeline["descriptors"]}
    assert desc["L0:w2#0"] == (pytest.approx(4), pytest.approx(5))
    # three slots: all three share the engine from t = 0 and land together at 3 ms -> 9 ms:
    # more slots in flight make every weight land later (the round-robin effect of spec App. B.2)
    dm3 = [dma(0, 0, 0), dma(1, 1, 1), dma(2, 2, 2)]
    assert sim.simulate(plan(dm3, ph), M).step_time == pytest.approx(9 * MS)


def test_prefetch_depth_0_vs_2():
    """A 3 ms weight-free phase, then three phases each needing one 1 ms weight + 1 ms compute.
    Depth 0: nothing moves ahead of its consumer -> 3 + 3 x (1 + 1) = 9 ms.
    Depth 2: w0, w1 stream during the first phase (land at 2 ms), w2 is issued at 3 ms (lands at
    4 ms) -> phases at 3-4, 4-5, 5-6 ms."""
    dm = [dma(0, 1, 0), dma(1, 2, 1), dma(2, 3, 2)]
    ph = [mm(0, 3e9), mm(1, 1e9, [0]), mm(2, 1e9, [1]), mm(3, 1e9, [2])]
    r0 = sim.simulate(plan(dm, ph, depth=0), M)
    r2 = sim.simulate(plan(dm, ph, depth=2), M)
    assert r0.step_time == pytest.approx(9 * MS)
    assert r2.step_time == pytest.approx(6 * MS)
    assert [round(e / MS, 6) for *_, e in r2.phase_times] == [3, 4, 5, 6]


def test_round_robin_sharing():
    """Two descriptors issued together share the bandwidth: 1 MB and 3 MB land at 2 ms and 4 ms."""
    dm = [dma(0, 0, 0, 1e6), dma(1, 0, 1, 3e6)]
    r = sim.simulate(plan(dm, [mm(0, 0, [0, 1])]), M)
    ends = sorted(e / MS for _, e, _ in r.timeline["descriptors"])
    assert ends == [pytest.approx(2), pytest.approx(4)]
    assert r.busy("dma") == pytest.approx(4 * MS)


def test_phase_costs():
    m = Machine(dma_bw=1e9, flops={"bf16": 1e12, "fp8": 2e12}, mxu_dim=256, min_rows=16, vector_flops=1e10,
                vector_bw=1e11, collective_latency=2e-6, link_bw={"ici": 1e10, "sibling": 1e11},
                link_latency={"sibling": 1e-6})
    # MXU: 1 row is padded to the 256-row weight push: 2 * 256 * K * N / peak
    assert m.compute_time(mm(0, 2 * 1 * 1000 * 1000)) == pytest.approx(2 * 256 * 1e6 / 1e12)
    # above the MXU dim rows only round up to the 16-row tile: 1000 -> 1008
    tall = Phase(0, 0, "mm", "mxu", flops=2 * 1000 * 10 ** 6, rows=1000)
    assert m.compute_time(tall) == pytest.approx(2 * 1008 * 1e6 / 1e12)
    big = Phase(0, 0, "mm", "mxu", flops=2 * 512 * 10 ** 6, rows=512)
    assert m.compute_time(big) == pytest.approx(2 * 512 * 1e6 / 1e12)
    fp8 = Phase(0, 0, "mm", "mxu", flops=2 * 10 ** 6, rows=1, dtype="fp8")
    assert m.compute_time(fp8) == pytest.approx(2 * 256 * 1e6 / 2e12)
    vec = Phase(0, 0, "v", "vector", flops=10 ** 6, vector_bytes=10 ** 6)
    assert m.compute_time(vec) == pytest.approx(max(1e6 / 1e10, 1e6 / 1e11))
    col = Phase(0, 0, "c", "collective", collective_phases=3, collective_bytes=10 ** 5)
    assert m.compute_time(col) == pytest.approx(3 * 2e-6 + 1e5 / 1e10)
    sib = Phase(0, 0, "c", "collective", collective_phases=1, collective_bytes=10 ** 5, link="sibling")
    assert m.compute_time(sib) == pytest.approx(1e-6 + 1e5 / 1e11)


def test_hbm_stream_writeback_and_pipelined():
    # a vector phase streaming 1 MB of state lasts max(compute, 1 ms); its 2 MB write-back drains after
    ph = [Phase(0, 0, "state", "vector", flops=int(1e8), hbm_bytes=int(1e6), writeback_bytes=int(2e6))]
    r = sim.simulate(plan([], ph), M)
    assert r.phase_times[0][5] == pytest.approx(1 * MS)
    assert r.step_time == pytest.approx(3 * MS)
    # pipelined (a GPU kernel): compute overlaps its own weight stream -> max(2 ms DMA, 1 ms compute)
    dm = [dma(0, 0, 0, 2e6)]
    r = sim.simulate(plan(dm, [mm(0, 1e9, [0], pipelined=True)]), M)
    assert r.step_time == pytest.approx(2 * MS)


def test_routed_experts_through_slots():
    """3 MB of experts (3 chunks of 1 MB) through 2 slots, 1 ms compute each: chunks 0, 1 land at
    2 ms; chunk 2 is issued when chunk 0 is consumed (3 ms) and lands at 4 ms -> end at 5 ms."""
    ph = [Phase(0, 0, "experts", "mxu", flops=int(3e9), rows=1, expert_dmas=int(3e6), expert_count=3.0,
                expert_slots=(7, 8))]
    r = sim.simulate(plan([], ph), M)
    assert r.step_time == pytest.approx(5 * MS)
    assert r.bytes_moved == pytest.approx(3e6)
    # routing known after phase 0 (1 ms): released then, the chunks stream during phase 1 (3 ms) and
    # land at 4 ms -> units 4-5, 5-6, 6-7 ms. Without the early release they are issued at 4 ms -> 10 ms.
    ex = Phase(2, 0, "experts", "mxu", flops=int(3e9), rows=1, expert_dmas=int(3e6), expert_count=3.0,
               expert_slots=(7, 8, 9))
    ph2 = [mm(0, 1e9), mm(1, 3e9), ex]
    assert sim.simulate(plan([], ph2), M).step_time == pytest.approx(10 * MS)
    ph2[2] = dataclass_replace(ex, expert_issue_after=0)
    assert sim.simulate(plan([], ph2), M).step_time == pytest.approx(7 * MS)
    # fractional expected count: 2.5 experts -> chunks of 1, 1, 0.5 MB
    half = Phase(0, 0, "experts", "mxu", flops=int(2.5e9), rows=1, expert_dmas=int(2.5e6), expert_count=2.5,
                 expert_slots=(7, 8, 9))
    r = sim.simulate(plan([], [half]), M)
    assert sorted(round((e - s) / MS, 6) for s, e, _ in r.timeline["compute"]) == [0.5, 1, 1]
    # expert bytes already covered by the phase's own DMAs are not fetched twice (mk.plan style)
    own = [dma(0, 0, 0, 1e6)]
    r = sim.simulate(plan(own, [mm(0, 1e9, [0], expert_dmas=int(1e6))]), M)
    assert r.bytes_moved == pytest.approx(1e6)


def dataclass_replace(obj, **kw):
    import dataclasses
    return dataclasses.replace(obj, **kw)


def test_issue_after():
    dm = [dma(0, 1, 0, issue_after=0)]
    ph = [mm(0, 3e9), mm(1, 1e9, [0])]
    assert sim.simulate(plan(dm, ph), M).step_time == pytest.approx(5 * MS)      # 3 + 1 + 1
    assert sim.simulate(plan([dma(0, 1, 0)], ph), M).step_time == pytest.approx(4 * MS)


def test_conventional_launch_gaps_and_no_cross_kernel_prefetch():
    """Kernel A (1 ms compute), kernel B (1 ms weight + 1 ms compute), 0.5 ms launch gap.
    Megakernel: the weight streams during A -> 2 ms. Conventional: 0.5 + 1 + 0.5 + 1 + 1 = 4 ms."""
    ph = [Phase(0, 0, "a", "mxu", flops=int(1e9), rows=1, kernel="A"),
          Phase(1, 0, "b", "mxu", flops=int(1e9), rows=1, dmas=(0,), kernel="B")]
    p = plan([dma(0, 1, 0)], ph)
    m = dataclass_replace(M, launch_gap=0.5 * MS)
    assert sim.simulate(p, m, "megakernel").step_time == pytest.approx(2 * MS)
    conv = sim.simulate(p, m, "conventional")
    assert conv.step_time == pytest.approx(4 * MS)
    assert conv.busy("launch") == pytest.approx(1 * MS)


def test_step_overhead_and_determinism():
    p = sim.build_plan(K3, 2, system="tpu-v7x16")
    a = sim.simulate(p, "tpu-v7x16")
    b = sim.simulate(p, "tpu-v7x16")
    assert a.step_time == b.step_time and a.timeline == b.timeline and a.phase_times == b.phase_times
    assert a.overhead == pytest.approx(hw.load_microbench().get("tpu-v7", "step_fixed_overhead"))
    assert a.step_time == pytest.approx(a.kernel_time + a.overhead)


def test_validation_and_deadlock_messages():
    with pytest.raises(sim.SimError, match="index is 5"):
        sim.simulate(plan([dma(5, 0, 0)], [mm(0, 1, [5])]), M)
    with pytest.raises(sim.SimError, match="phase 3 is not a phase index"):
        sim.simulate(plan([dma(0, 3, 0)], [mm(0, 1)]), M)
    with pytest.raises(sim.SimError, match="lists dmas"):
        sim.simulate(plan([dma(0, 0, 0)], [mm(0, 1, [1])]), M)
    # w1 (for phase 0) targets the slot still held by w0, which phase 1 consumes: deadlock
    dm = [dma(0, 1, 0), dma(1, 0, 0)]
    with pytest.raises(sim.SimError, match="must come after|deadlock"):
        sim.simulate(plan(dm, [mm(0, 1, [1]), mm(1, 1, [0])]), M)
    dm = [dma(0, 0, 0), dma(1, 0, 0)]           # both for phase 0, same slot: the phase needs both
    with pytest.raises(sim.SimError, match="deadlock.*slot 0 held by"):
        sim.simulate(plan(dm, [Phase(0, 0, "x", "mxu", flops=1, rows=1, dmas=(0, 1), pipelined=True)]), M)
    with pytest.raises(sim.SimError, match="schedule must be"):
        sim.simulate(plan([], [mm(0, 1)]), M, "fast")


def test_seed_plan_structure():
    p = sim.build_plan(K3, 1, system="tpu-v7x16")
    assert p.layout.devices == 32
    names = {ph.name for ph in p.phases}
    assert {"attn_res", "kda.proj", "mla.in", "moe.router", "moe.experts", "moe.latent_up", "dense_mlp",
            "lm_head", "attn_reduce", "moe_reduce_local"} <= names
    weight = sum(d.bytes for d in p.dmas) + sum(ph.expert_dmas for ph in p.phases)
    roof = sim.rl.roofline(K3, 1, system="tpu-v7x16")
    cache_state = roof.bytes["kda_state"] + roof.bytes["mla_cache"]
    assert weight == pytest.approx(roof.total_bytes - cache_state, rel=0.02)
    g = sim.build_plan(K3, 1, system="gb200x16")
    kernels = {ph.kernel for ph in g.phases}
    assert len(kernels) == len(g.phases) > 20 * K3.layers


def test_megakernel_beats_conventional_on_the_tpu_plan():
    for b in (1, 8):
        p = sim.build_plan(K3, b, system="tpu-v7x16")
        mk = sim.simulate(p, "tpu-v7x16", "megakernel")
        cv = sim.simulate(p, "tpu-v7x16", "conventional")
        assert mk.step_time < cv.step_time
        assert 0 < mk.roofline_fraction <= 1


# ---- acceptance: the seed's table -------------------------------------------------------------
@pytest.fixture(scope="module")
def predictions():
    out = {}
    for system in ("tpu-v7x16", "gb200x16"):
        for b in (1, 2, 4, 8):
            out[system, b] = sim.predict(K3, b, system, record=False)
    return out


@pytest.mark.parametrize("b,published", [(1, 249), (2, 392), (4, 515), (8, 865)])
def test_tpu_megakernel_within_25_percent(predictions, b, published):
    r = predictions["tpu-v7x16", b]
    assert r["schedule"] == "megakernel" and r["published_tok_s"] == published
    assert 0.75 <= r["megakernel"]["tokens_per_s"] / published <= 1.25, r["megakernel"]


@pytest.mark.parametrize("b,published", [(1, 127), (2, 227), (4, 373), (8, 636)])
def test_gb200_conventional_within_25_percent(predictions, b, published):
    r = predictions["gb200x16", b]
    assert r["schedule"] == "conventional" and r["published_tok_s"] == published
    assert 0.75 <= r["conventional"]["tokens_per_s"] / published <= 1.25, r["conventional"]


def test_megakernel_advantage_shrinks_with_batch(predictions):
    adv = [predictions["tpu-v7x16", b]["predicted_tok_s"] / predictions["gb200x16", b]["predicted_tok_s"]
           for b in (1, 2, 4, 8)]
    assert all(x > y for x, y in zip(adv, adv[1:])), adv
    assert adv[0] > 1.3


def test_bytes_and_hbm_fraction_grow_with_batch(predictions):
    mk = [predictions["tpu-v7x16", b]["megakernel"] for b in (1, 2, 4, 8)]
    assert [r["bytes_moved"] for r in mk] == sorted(r["bytes_moved"] for r in mk)
    assert all(r["tokens_per_s"] <= predictions["tpu-v7x16", r["batch"]]["roofline"]["ceiling_tok_s"] for r in mk)


# ---- compatibility with mk.plan and the CLI ---------------------------------------------------
def test_replays_mk_plan_objects():
    from mk import plan as P
    pl = P.make_plan(get_config("mini"), 2, prefetch_depth=2, check=False)
    r0 = sim.simulate(pl, "tpu-v7x16")
    r1 = sim.simulate(pl, "tpu-v7x16")
    assert r0.step_time == r1.step_time > 0
    assert sim.simulate(pl, "tpu-v7x16", "conventional").step_time >= r0.step_time


def test_cli_json(capsys):
    from mk.__main__ import main
    assert main(["simulate", "--config", "k3", "--system", "tpu-v7x16", "--batch", "1,8", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["system"] == "tpu-v7x16" and [r["batch"] for r in rep["rows"]] == [1, 8]
    row = rep["rows"][0]
    for k in ("megakernel", "conventional", "roofline", "published_tok_s", "ratio"):
        assert k in row
    assert row["published_tok_s"] == 249
    assert row["ratio"] == pytest.approx(row["megakernel"]["tokens_per_s"] / 249)


def test_cli_table_and_errors(capsys):
    from mk.__main__ import main
    assert main(["simulate", "--system", "gb200x16", "--batch", "1"]) == 0
    out = capsys.readouterr().out
    assert "gb200x16" in out and "conventional" in out and "127" in out
    assert main(["simulate", "--system", "h100x8", "--batch", "1"]) == 2
    assert "unknown system" in capsys.readouterr().err
    assert main(["simulate", "--batch", "one"]) == 2
