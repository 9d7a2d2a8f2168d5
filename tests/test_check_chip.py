"""`mk.kernel.check.check_on_chip`, the policy `mk check` applies on a TPU, exercised on CPU: the kernel
(interpret mode) and XLA both against the oracle, resynchronised every step. Here all three are
bit-exact, so a correct kernel passes with factor 0 and a planted bug fails."""
import contextlib

import pytest

from mk.kernel import check as mc
from mk.model import params as params_mod
from mk.model.config import get_config
from mk.kernel.decode import interpret_params
from mk.kernel.step import make_step_fn
from mk.kernel.moe import negated_combine


def _run(fault: bool, steps: int):
    cfg = get_config("mini")
    params = params_mod.init(cfg, 0)
    kw = dict(ctx=256, interpret=interpret_params(False), experts="bf16")
    with negated_combine() if fault else contextlib.nullcontext():
        return mc.check_on_chip(cfg, make_step_fn(params, cfg, 2, **kw), params, 2, steps)


@pytest.mark.slow
def test_chip_policy_passes_a_correct_kernel_and_fails_a_planted_bug():
    good = _run(False, 2)
    assert good["verdict"] == "pass", good["reasons"]
    assert good["policy"] == "chip" and good["max_abs_logit_err"] == 0.0
    assert set(good["vs_xla"]) >= {"logits", "cache.kda_state", "cache.mla_k", "cache.conv_state"}
    assert all(s["rows_compared"] + sum(n["step"] == s["step"] for n in good["route_near_ties"]) >= 2
               for s in good["per_step"])
    bad = _run(True, 1)                   # the planted bug shows in the first step
    assert bad["verdict"] == "fail"
    assert any(r.startswith("logits: kernel") for r in bad["reasons"]), bad["reasons"]


def test_chip_verdict_rules():
    base = {"nan": False, "nan_arrays": [], "pallas_calls_per_step": 1, "greedy_flips": [],
            "vs_xla": {"logits": (0.05, 0.04, 0.03), "cache.kda_state": (1e-3, 1e-3, 0.0)}}
    assert mc.chip_verdict(base) == []
    worse = dict(base, vs_xla={"logits": (0.2, 0.04, 0.03)})          # 0.2 > 2 x 0.04 + 0.03
    assert mc.chip_verdict(worse) and "logits" in mc.chip_verdict(worse)[0]
    flip = dict(base, greedy_flips=[{"step": 1, "row": 0, "ref_margin": 0.3, "near_tie_below": 0.1}])
    assert "near tie" in mc.chip_verdict(flip)[0]
    tie = dict(base, greedy_flips=[{"step": 1, "row": 0, "ref_margin": 0.01, "near_tie_below": 0.1}])
    assert mc.chip_verdict(tie) == []
