"""mk.plan: the schedule both the kernel and the simulator read."""
import pytest

from mk.config import get_config
from mk.plan import MiB, PlanError, make_plan, padded_bytes


def test_padding_rules():
    assert padded_bytes((1, 100), 4) == 1 * 128 * 4
    assert padded_bytes((8, 100), 2) == 8 * 128 * 2
    assert padded_bytes((3, 3, 128), 2) == 3 * 4 * 128 * 2
    assert padded_bytes((17, 129), 2) == 32 * 256 * 2
    assert padded_bytes((3, 8, 128), 4) == 3 * 8 * 128 * 4


def test_stream_covers_every_tile_once():
    plan = make_plan(get_config("mini"), 2, prefetch_depth=3)
    dense = [d for d in plan.dmas if not d.tensor.startswith("expert")]
    assert len(dense) == plan.dense_tiles
    assert [d.index for d in plan.dmas] == list(range(len(plan.dmas)))
    assert all(d.slot == d.index % plan.num_slots for d in plan.dmas)
    # the next layer's first tiles follow this layer's last ones: one stream across layers
    layers = [d.layer for d in plan.dmas]
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
    assert make_plan(get_config("k3-slice"), 1, prefetch_depth=40).vmem_planned_bytes < 64 * MiB
