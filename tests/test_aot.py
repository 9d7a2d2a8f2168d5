"""Deviceless TPU compilation with libtpu: the real Mosaic/XLA TPU compiler on this CPU."""
import pytest

from mk.aot import compile_kernel
from mk.cli.kernel import compile_times
from mk.config import get_config
from mk.plan import make_plan

pytestmark = pytest.mark.aot


@pytest.mark.parametrize("topology,chip", [("v5e:2x2", "v5e"), ("v6e:2x2", "v6e"), ("tpu7x:2x2x1", "tpu7x")])
@pytest.mark.parametrize("batch", [1, 8])
def test_mini_compiles(topology, chip, batch):
    r = compile_kernel(make_plan(get_config("mini"), batch, chip=chip), topology)
    assert r.compiled, r.error


def test_k3_slice_compiles_within_tpu7x_vmem():
    plan = make_plan(get_config("k3-slice"), 1, chip="tpu7x")
    assert plan.vmem_limit == 64 * 2**20
    r = compile_kernel(plan, "tpu7x:2x2x1")
    assert r.compiled, r.error


@pytest.mark.parametrize("depth,fits", [(40, True), (60, False)])
def test_plan_verdict_agrees_with_compiler(depth, fits):
    plan = make_plan(get_config("k3-slice"), 1, prefetch_depth=depth, check=False)
    assert (plan.vmem_planned_bytes <= plan.vmem_limit) == fits
    r = compile_kernel(plan, "tpu7x:2x2x1")
    assert r.compiled == fits, r.error
    if not fits:
        assert "vmem" in r.error.lower()


def test_compile_time_does_not_grow_with_depth():
    """Seed claim in miniature: the runtime layer loop keeps the program one layer long."""
    rows = compile_times("k3-slice", [4, 24], experts=16)
    assert all(r["compiled"] for r in rows), rows
    shallow, deep = rows[0]["total_s"], rows[1]["total_s"]
    print(f"megakernel compile: 4 layers {shallow:.1f} s, 24 layers {deep:.1f} s")
    assert deep < 1.5 * shallow
