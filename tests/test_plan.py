"""mk.kernel.plan: the schedule both the kernel and the simulator read."""
import pytest

from mk.model.config import get_config
from mk.kernel.plan import MiB, make_plan, padded_bytes
from mk.kernel.schedule import dmas, phases, schedule
from mk.model.layout import PlanError


def test_padding_rules():
    assert padded_bytes((1, 100), 4) == 1 * 128 * 4
    assert padded_bytes((8, 100), 2) == 8 * 128 * 2
    assert padded_bytes((3, 3, 128), 2) == 3 * 4 * 128 * 2
    assert padded_bytes((17, 129), 2) == 32 * 256 * 2
    assert padded_bytes((3, 8, 128), 4) == 3 * 8 * 128 * 4


def test_stream_covers_every_tile_once():
    plan = make_plan(get_config("mini"), 2, prefetch_depth=3)
    dense = [d for d in dmas(plan) if not d.tensor.startswith("expert")]
    assert len(dense) == plan.dense_tiles
    assert [d.index for d in dmas(plan)] == list(range(len(dmas(plan))))
    assert all(d.slot == d.index % plan.num_slots for d in dmas(plan))
    # the next layer's first tiles follow this layer's last ones: one stream across layers
    layers = [d.layer for d in dmas(plan)]
    assert layers == sorted(layers)
    tables = plan.tables()
    assert tables["next_base"][-1] == plan.dense_tiles


def test_depth_and_slots_validated():
    cfg = get_config("mini")
    with pytest.raises(PlanError, match="num_slots"):
        make_plan(cfg, 1, prefetch_depth=4, num_slots=3)
    with pytest.raises(PlanError, match="batch"):
        make_plan(cfg, 9)
    with pytest.raises(PlanError, match="tile"):
        make_plan(cfg, 1, tile=(100, 128))


def test_vmem_overflow_refused_with_clear_message():
    with pytest.raises(PlanError, match=r"MiB of VMEM but the limit is 64.0 MiB.*slots bfloat16\[61, 512, 512\]"):
        make_plan(get_config("k3-slice"), 1, prefetch_depth=60)
    assert make_plan(get_config("k3-slice"), 1, prefetch_depth=30).vmem_planned_bytes < 64 * MiB


def test_schedule_options_are_points_of_one_space():
    from mk.kernel.plan import CONVENTIONAL, MK, SEED, ScheduleOptions
    assert MK.kernel and not SEED.kernel and not CONVENTIONAL.kernel
    assert ScheduleOptions("other").kernel                     # the name is a label
    diff = SEED.differences(MK)
    assert diff["prefetch"] == ("lookahead", "ring") and diff["expert_slots"] == (4, 0)
    assert diff["expert_gate_up"] == ("fp8", None) and diff["collectives"] == ("seed", "merged")
    with pytest.raises(PlanError, match="ScheduleOptions.prefetch must be one of"):
        ScheduleOptions(prefetch="psychic")
    with pytest.raises(PlanError, match="whole matrices"):
        ScheduleOptions(prefetch="lookahead")                    # the lookahead moves whole matrices
    with pytest.raises(PlanError, match="expert_slots"):
        ScheduleOptions(expert_slots=-1)
    with pytest.raises(PlanError, match="options must be a ScheduleOptions"):
        make_plan(get_config("mini"), 1, options="seed")


def test_attention_heads_default_and_validation():
    """The MLA loops' heads per step: by default the largest divisor of the device's heads up to
    ATTENTION_HEADS (mini's 2 heads: 2; k3-chip's 32: 8); an explicit G must divide them."""
    import dataclasses

    from mk.kernel.plan import ATTENTION_HEADS, MK, ScheduleOptions
    assert MK.attention_heads == 0 and ATTENTION_HEADS == 8
    assert make_plan(get_config("mini"), 1).attention_heads == 2
    assert make_plan(get_config("k3-chip"), 1, check=False).attention_heads == 8
    assert make_plan(get_config("k3-chip"), 1, check=False,
                     options=dataclasses.replace(MK, attention_heads=32)).attention_heads == 32
    with pytest.raises(PlanError, match="attention_heads = 3 must divide the 32 attention heads"):
        make_plan(get_config("k3-chip"), 1, check=False, options=dataclasses.replace(MK, attention_heads=3))
    with pytest.raises(PlanError, match="attention_heads must be an integer >= 0"):
        ScheduleOptions(attention_heads=-1)
    assert dataclasses.replace(MK, attention_heads=4).kernel      # the kernel runs any grouping


def test_options_shape_the_matrices_and_the_schedule():
    """The same make_plan, two points: mk's tiles through one ring, the seed's whole matrices in
    named buffers, its FP8 gate/up, its collectives; the kernel's plan is unchanged by the default."""
    from mk.kernel.plan import MK, SEED
    cfg = get_config("mini")
    mk, seed = (make_plan(cfg, 2, options=o, check=False) for o in (MK, SEED))
    assert mk == make_plan(cfg, 2, check=False)
    assert seed.stream(1).matrix("moe.router").tiles == 1 and seed.expert_gu.format == "fp8"
    k3 = {o.name: make_plan(get_config("k3"), 1, options=o, check=False) for o in (MK, SEED)}
    assert k3["seed"].stream(1).matrix("moe.router").n == 512               # the seed streams half the router
    assert k3["mk"].stream(1).matrix("moe.router").n == 896
    dm, ph = schedule(seed)
    assert {d.slot for d in dm}.isdisjoint(range(3 * seed.num_slots))   # named buffers, not ring slots
    assert any(d.issue_after >= 0 for d in dm)
    assert all(d.issue_after == -1 for d in dmas(mk) if not d.tensor.startswith("expert["))
    routing = [p.index for p in phases(mk) if p.name == "routing"]
    assert all(d.issue_after in routing for d in dmas(mk) if d.tensor.startswith("expert["))
    assert "kda.f_a" in {p.name for p in ph} and "routing" in {p.name for p in ph}


def test_default_tile_streams_the_least_padding():
    """The per-model tile (`default_tile`): K3's widths keep 512 x 512 (1% of padding at most), the
    depth presets' thin layers take 256 x 256 with bf16 experts (512 x 512 would stream 6-16%
    padding) and 512 x 512 with MXFP4 experts (the unpack's fewest bundles per weight), and the ring
    keeps `INFLIGHT_BYTES` of bf16 slots in flight whatever their shape (8 MiB with bf16 experts, 16
    MiB with MXFP4), halved while the plan overflows VMEM."""
    from mk.kernel.plan import (DEFAULT_PREFETCH_DEPTH, INFLIGHT_BYTES, TILE_CHOICES, default_prefetch_depth,
                                default_tile, stream_bytes)
    from mk.model.config import DEPTH_PRESETS
    assert default_tile(get_config("mini")) == (512, 256)               # bit-exact interpret-mode tests
    for name in ("k3", "k3-chip"):
        for experts in ("bf16", "mxfp4"):
            assert default_tile(get_config(name), experts=experts) == (512, 512), (name, experts)
    for name in DEPTH_PRESETS[1:]:
        cfg = get_config(name)
        sizes = {t: stream_bytes(cfg, t) for t in TILE_CHOICES}
        assert default_tile(cfg) == (256, 256) == min(sizes, key=sizes.get), name
        assert sizes[(512, 512)] > 1.06 * sizes[(256, 256)], name
        plan = make_plan(cfg, 1, chip="v5e")
        assert (plan.tile_k, plan.tile_n, plan.prefetch_depth) == (256, 256, 64)
        plan = make_plan(cfg, 8, chip="v5e", experts="mxfp4")
        assert (plan.tile_k, plan.tile_n, plan.prefetch_depth) == (512, 512, 32), name
    assert default_prefetch_depth((512, 512)) == 16 and default_prefetch_depth((512, 512), "mxfp4") == 32
    for experts, inflight in INFLIGHT_BYTES.items():
        for t in TILE_CHOICES:
            assert default_prefetch_depth(t, experts) * t[0] * t[1] * 2 == inflight
    assert default_prefetch_depth((4096, 4096)) == DEFAULT_PREFETCH_DEPTH
    with pytest.raises(PlanError, match="experts must be one of"):
        default_prefetch_depth((512, 512), "int4")
    assert make_plan(get_config("k3-d48"), 1, chip="v5e", tile=(512, 512)).prefetch_depth == 16
    assert make_plan(get_config("k3-d48"), 1, chip="v5e", prefetch_depth=2).prefetch_depth == 2
    # The default ring is halved until the plan fits; a depth asked for is not: it overflows.
    k3c = get_config("k3-chip")
    small = make_plan(k3c, 8, chip="v5e", experts="mxfp4", vmem_limit=40 * MiB)
    assert small.prefetch_depth == 8 and small.num_slots == 9 and small.vmem_planned_bytes <= small.vmem_limit
    assert make_plan(k3c, 8, chip="v5e", experts="mxfp4", vmem_limit=40 * MiB, check=False).prefetch_depth == 8
    with pytest.raises(PlanError, match="VMEM"):
        make_plan(k3c, 8, chip="v5e", experts="mxfp4", vmem_limit=40 * MiB, prefetch_depth=32)
