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
    """MXFP4 experts: packed tiles in their own slots, the in-VMEM dequant lowers with Mosaic."""
    plan = make_plan(get_config("k3-slice"), 1, chip="tpu7x", experts="mxfp4")
    assert plan.vmem_limit == 64 * 2**20
    r = compile_kernel(plan, "tpu7x:2x2x1")
    assert r.compiled, r.error


# MXFP4 experts: at depth 44 the plan counts 63.94 MiB and it compiles; at 45, 64.57 MiB and the
# compiler reports "Used 64.04M of 64.00M vmem" (the dequant's temporaries fit the allowance).
@pytest.mark.parametrize("depth,fits", [(44, True), (45, False)])
def test_plan_verdict_agrees_with_compiler(depth, fits):
    plan = make_plan(get_config("k3-slice"), 1, prefetch_depth=depth, check=False, experts="mxfp4")
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


def _sharded_plan(config, devices, batch=1, layers=None, **kw):
    from mk.sharding import default_layout
    cfg = get_config(config)
    if layers is not None:
        cfg = cfg.replace(layers=layers, full_attention=tuple(l for l in cfg.full_attention if l < layers - 1)
                          + (layers - 1,))
    return make_plan(cfg, batch, chip="tpu7x", layout=default_layout(cfg, devices), **kw)


@pytest.mark.parametrize("batch,experts", [(1, "bf16"), (8, "mxfp4")])
def test_sharded_k3_slice_compiles_for_8_cores(batch, experts):
    """The sharded step at full K3 widths, one pallas_call per core of tpu7x:2x2x1, collectives inside."""
    plan = _sharded_plan("k3-slice", 8, batch, experts=experts)
    assert plan.devices == 8 and plan.collectives_per_step == 1 + 2 + 4 * 3
    r = compile_kernel(plan, "tpu7x:2x2x1")
    assert r.compiled, r.error


def test_sharded_k3_compiles_for_the_seed_topology():
    """Full-size K3 widths and experts (896, bf16) on all 32 cores of tpu7x:4x4x1 (the seed's
    16 chips); 4 layers here (the CLI compiles deeper stacks: README)."""
    plan = _sharded_plan("k3", 32, layers=4)
    assert (plan.layout.ep, plan.layout.tp_expert, plan.heads) == (8, 4, 3)
    r = compile_kernel(plan, "tpu7x:4x4x1")
    assert r.compiled, r.error


@pytest.mark.parametrize("depth,fits", [(90, True), (120, False)])
def test_sharded_plan_verdict_agrees_with_compiler(depth, fits):
    plan = _sharded_plan("k3-slice", 8, prefetch_depth=depth, check=False)
    assert (plan.vmem_planned_bytes <= plan.vmem_limit) == fits, plan.vmem_planned_bytes
    r = compile_kernel(plan, "tpu7x:2x2x1")
    assert r.compiled == fits, r.error
