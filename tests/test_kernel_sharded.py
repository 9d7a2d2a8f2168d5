"""The sharded megakernel (one pallas_call per device, collectives inside) against the sharded
reference, in TPU interpret mode on virtual CPU devices (conftest: 8), race detector on.

Tolerances, and why. Kernel and sharded reference make the same bf16 roundings (the wire of every
reduction is bf16, summed in fp32 in rank order on both sides) and, inside a rank, the same fp32
summation orders (one head of one row at a time, 128-slot softmax blocks, 512-deep matmul chunks;
the routed experts expert by expert on all rows, on the kernel's gathered latent layout and tile
shapes: on one device the kernel equals `mk.model.reference` bit for bit, tests/test_kernel_paths.py).
The AttnRes mix runs over every snapshot slot (unused ones masked) on both sides: the same
expression, so XLA fuses and rounds it alike. Where XLA:CPU would round the same expression
differently depending on the graph around it, the expression is written in the one form both
sides compile alike: normalizers as `x * rsqrt(y)` (`mk.model.layers.common.rsqrt`; XLA rewrites
`x / sqrt(y)` only where the sqrt has one user, and the references' CSE of a snapshot's statistics
across layers kept a divide), MLA scores as a matmul (a sum of f32(k) * q is summed in another
order when the bf16 convert fuses into the reduction). So the claim (docs/numerics.md, `make
check-sharded`) is bit identity, and that is what is tested: `check(..., exact=True)`, every step's
logits, every cache array and every greedy token equal (`mk.kernel.check.exact_verdict`), for both
expert formats and both MXFP4 MXU paths, with the race detector on.
"""
import dataclasses
import functools

import pytest

from mk.model import params as params_mod
from mk.kernel.check import check
from mk.model.config import get_config
from mk.kernel.schedule import collective_sequence, collectives_per_step, layer_collectives, phases, remote_bytes_per_step


@functools.cache
def _tp8(latent: int = 256):
    """mini-tp8 (latent 256, or 448: see CASES) and its params, made once per module run."""
    cfg = get_config("mini-tp8").replace(latent=latent)
    return cfg, params_mod.init(cfg, 0)


def _assert_bit_exact(res):
    """An `exact=True` result: bit identity at every step, no race, no NaN, one pallas_call."""
    assert res["policy"] == "exact" and res["verdict"] == "pass", res["reasons"]
    assert res["races"] == 0 and not res["nan"], res
    for step in res["per_step"]:
        assert step["max_abs_logit_err"] == 0.0 and step["cache_max_abs_err"] == 0.0, step
        assert step["greedy_match"], step
    for n in ("kda_state", "conv_state", "mla_k", "mla_v"):
        assert res["cache_max_abs_err_by_array"][n] == 0.0, (n, res["cache_max_abs_err_by_array"])
    assert res["pallas_calls_per_step"] == 1
    # the residual stream p is replicated state: every device holds the same bits, every step
    assert res["replicated_bit_identical"] and not res["replicated_diff"], res["replicated_diff"]


# (devices, batch, steps, DMA mode, experts, all-reduce rounds, MXFP4 MXU path, latent; `make test` runs
# the 4-device case, `make test-extended` the others; `make check-sharded` the whole matrix): batch 1,
# 2, 4 and 8, both DMA modes, 8, 4 and 2 devices, one- and two-round all-reduces, two steps each
# (the second from a nonzero KDA state). Sized for interpret mode: every collective round is 7
# remote DMAs per device on 8 devices, ~4 ms each. On 8 devices the routed experts are MXFP4
# (packed, dequantized in VMEM; the reference runs on their dequantization), on 4 and 2 bf16 tiles;
# at B = 1 they meet the MXU as dequantized bf16 tiles, at B = 8 on the fp8 path (group partials:
# the sharded reference sums the expert matmuls by 32-row group).
# Latent 448 at B = 1: latent / devices = 56, not a multiple of the 32-row MXFP4 scale group, so
# rank r's latent slice sits at lane (r * 56) mod 32 of its block (latent_down columns, latent_norm
# lanes, latent_up rows and the experts' latent rows/columns packed there;
# `mk.model.layout.latent_offsets`); at B = 8 (latent 256) every slice sits at lane 0. (The sharded
# reference at latent 448 against `mk.model.reference`, 3 steps, B = 4: logits max |err| 0.036,
# mean 0.006, inside tests/test_reference_sharded.py's tolerances.)
CASES = [pytest.param(8, 1, 2, "on_wait", "mxfp4", "one_round", "bf16", 448, marks=pytest.mark.extended),
         pytest.param(8, 8, 2, "eager", "mxfp4", "one_round", "fp8", 256, marks=pytest.mark.extended),
         (4, 4, 2, "on_wait", "bf16", "two_round", "bf16", 256),
         pytest.param(2, 2, 2, "on_wait", "bf16", "one_round", "bf16", 256, marks=pytest.mark.extended)]
# collective rounds per step on mini-tp8 (4 layers): the embedding sum, then per layer the attention
# output, then layer 0's dense MLP or the MoE's latent gather, routed sum and output sum; a
# two-round all-reduce is two rounds
ROUNDS = {"one_round": 1 + 2 + 4 * 3, "two_round": 2 + 4 + 7 * 3}


@pytest.mark.slow
@pytest.mark.parametrize("devices,batch,steps,mode,experts,all_reduce,mxfp4_matmul,latent", CASES)
def test_sharded_kernel_matches_sharded_reference(devices, batch, steps, mode, experts, all_reduce, mxfp4_matmul,
                                                  latent):
    cfg, params = _tp8(latent)
    res = check(cfg, batch, steps, params=params, mesh=devices, detect_races=True,
                dma_execution_mode=mode, ctx=128, experts=experts, all_reduce=all_reduce, mxfp4_matmul=mxfp4_matmul,
                exact=True)
    assert res["devices"] == devices and res["experts"] == experts and res["all_reduce"] == all_reduce
    assert res["mxfp4_matmul"] == mxfp4_matmul
    assert res["collectives_per_step"] == ROUNDS[all_reduce]
    _assert_bit_exact(res)


def test_latent_448_slices_sit_at_lane_offsets():
    """The latent-448 case above really places rank slices off lane 0 (and latent 256 does not)."""
    from mk.kernel.plan import make_plan
    from mk.model.sharding import default_layout

    def offsets(latent):
        cfg = _tp8(latent)[0]
        return make_plan(cfg, 1, experts="mxfp4", layout=default_layout(cfg, 8)).latent_offsets

    assert set(offsets(256)) == {0}
    assert offsets(448) == tuple(r * 56 % 32 for r in range(8))            # 0, 24, 16, 8, ...


def test_plan_collectives_are_the_kernels():
    """The collectives the kernel executes are the plan's entries: per layer and per step."""
    from mk.kernel.plan import make_plan
    from mk.model.sharding import default_layout

    cfg = get_config("mini-tp8")
    plan = make_plan(cfg, 1, layout=default_layout(cfg, 8))
    assert layer_collectives(plan, 0) == ("attn_out", "dense_out")
    assert layer_collectives(plan, 1) == ("attn_out", "moe_latent", "moe_routed", "moe_out")
    assert collectives_per_step(plan) == 1 + 2 + 4 * (cfg.layers - 1)
    assert collective_sequence(plan) == ["embed", "attn_out", "dense_out"] + [
        "attn_out", "moe_latent", "moe_routed", "moe_out"] * (cfg.layers - 1)
    assert layer_collectives(plan, cfg.layers) == ()                   # the LM head: vocab-split logits
    assert remote_bytes_per_step(plan) == sum(p.collective_bytes for p in phases(plan) if p.kind == "collective")
    one = make_plan(cfg, 1)
    assert collectives_per_step(one) == 0 and not any(p.kind == "collective" for p in phases(one))


def test_two_round_all_reduces_are_plan_entries():
    """A two-round all-reduce is a reduce-scatter and an all-gather phase in the schedule, each
    sending N - 1 chunks of width / N lanes (128-aligned): for K3 on 32 cores, 16x fewer bytes."""
    from mk.kernel.plan import MK, make_plan
    from mk.model.sharding import default_layout

    cfg = get_config("mini-tp8")
    two = make_plan(cfg, 2, layout=default_layout(cfg, 8), options=dataclasses.replace(MK, all_reduce="two_round"))
    assert two.options.kernel
    assert layer_collectives(two, 1) == ("attn_out.scatter", "attn_out.gather", "moe_latent", "moe_routed.scatter",
                                        "moe_routed.gather", "moe_out.scatter", "moe_out.gather")
    x = two.collectives["attn_out"]
    assert (x.rounds, x.chunk) == (2, 128) and two.collectives["moe_latent"].rounds == 1
    assert x.remote_bytes == 2 * 7 * 2 * 128 * 2                      # 2 rounds x 7 peers x [2, 128] bf16
    assert two.exchange_width >= 8 * x.chunk                          # the send buffer holds N chunks
    k3 = get_config("k3")
    lay = default_layout(k3, 32)
    one_r, two_r = (make_plan(k3, 1, layout=lay, check=False, options=dataclasses.replace(MK, all_reduce=a))
                    for a in ("one_round", "two_round"))
    a1, a2 = one_r.collectives["attn_out"], two_r.collectives["attn_out"]
    assert a2.chunk == 256 and a1.remote_bytes == 31 * 2 * 7168 * 2 and a2.remote_bytes == 2 * 31 * 2 * 256 * 2


@pytest.mark.parametrize("batch,wire_rows", [(1, 2), (3, 4), (4, 4), (6, 8), (8, 8)])
def test_messages_carry_the_token_rows(batch, wire_rows):
    """A message is the step's B token rows in a [B, width] buffer (Mosaic's row tile: 2, 4 or 8
    rows), not the 8-row matmul tile; the plan counts the tile rows, the kernel's buffers are B rows."""
    from mk.kernel.plan import MK, make_plan
    from mk.model.sharding import default_layout

    cfg = get_config("mini-tp8")
    layout = default_layout(cfg, 8)
    plan = make_plan(cfg, batch, layout=layout)
    tile = make_plan(cfg, batch, layout=layout, options=dataclasses.replace(MK, message_rows="tile"))
    assert plan.options.kernel and tile.options.kernel                # the kernel runs either
    x = plan.collectives["attn_out"]
    assert (x.rows, x.message_bytes) == (batch, wire_rows * cfg.dim * 2)
    assert tile.collectives["attn_out"].message_bytes == 8 * cfg.dim * 2
    assert remote_bytes_per_step(plan) * 8 == remote_bytes_per_step(tile) * wire_rows
    buf = {b.name: b for b in plan.buffers}
    assert buf["landing"].shape == (2, 8, batch, plan.exchange_width) and buf["send"].shape == (2, batch, plan.exchange_width)


def test_layout_rule_and_bad_meshes():
    from mk.model.layout import PlanError
    from mk.model.sharding import default_layout

    k3 = default_layout(get_config("k3"), 32)
    assert (k3.tp_attn, k3.ep, k3.tp_expert) == (32, 8, 4)          # the seed's split (spec 3.2)
    with pytest.raises(PlanError, match="heads = 2 is not a multiple of 3"):
        default_layout(get_config("mini"), 3)
    with pytest.raises(PlanError, match="must be a multiple of 16"):
        default_layout(get_config("mini-tp8").replace(vocab=2048 + 64), 8)
