"""`mk check`: NaN anywhere fails and is named, the verdict follows the stated tolerances, and the
CLI's exit code and JSON say which. The kernel is replaced by the reference step (optionally
poisoned with NaN) on a 2-layer config, so this runs in seconds; tests/test_kernel.py runs the
real kernel against the same tolerances.
"""
import json
import types

import jax.numpy as jnp
import numpy as np
import pytest

import mk.kernel.check as mc
import mk.kernel.step
from mk.model import reference as ref
from mk.__main__ import main
from mk.model.config import get_config

TINY = get_config("mini").replace(
    dim=128, latent=128, expert_hidden=128, dense_hidden=128, experts=4, top_k=2, layers=2, heads=1,
    q_rank=128, kv_rank=128, vocab=512, residual_block=1, full_attention=(1,))


def result(**over):
    """A passing `check` result; `over` replaces fields."""
    res = {"max_abs_logit_err": 0.02, "logit_scale": 1.0, "greedy_flips": [], "cache_max_abs_err": 0.03,
           "cache_max_abs_err_by_array": {"mla_k": 0.03, "pos": 0.0}, "races": 0, "nan": False,
           "nan_arrays": [], "pallas_calls_per_step": 1}
    res.update(over)
    return res


def test_verdict_passes_within_tolerances():
    assert mc.verdict(result()) == []
    assert mc.verdict(result(max_abs_logit_err=mc.LOGIT_TOL, cache_max_abs_err=mc.CACHE_TOL)) == []
    # one flip at a reference near-tie is within the stated tolerance (the README's own example)
    assert mc.verdict(result(greedy_flips=[{"step": 5, "row": 2, "ref_margin": 0.01}])) == []


@pytest.mark.parametrize("over, reason", [
    ({"nan": True, "nan_arrays": ["kernel.cache.mla_v (step 3)"]}, "NaN in kernel.cache.mla_v (step 3)"),
    ({"races": 2}, "race detector fired in 2 step(s)"),
    ({"max_abs_logit_err": 0.2}, "max |logit error| 0.2 > 0.1"),
    ({"max_abs_logit_err": None}, "max |logit error| None > 0.1"),
    ({"cache_max_abs_err": 0.5, "cache_max_abs_err_by_array": {"mla_k": 0.5, "pos": 0.0}},
     "max |cache error| 0.5 > 0.1 (worst: mla_k)"),
    ({"greedy_flips": [{"step": 1, "row": 0, "ref_margin": 0.3}]}, "1 greedy flip(s) away from a near-tie"),
    ({"greedy_flips": [{"step": 1, "row": 0, "ref_margin": 0.01}, {"step": 4, "row": 1, "ref_margin": 0.02}]},
     "2 greedy flips > 1"),
    ({"logit_scale": 9.0}, "reference logit std 9.0 outside (0.5, 5.0)"),
    ({"pallas_calls_per_step": 3}, "3 pallas_calls per step, expected 1"),
])
def test_verdict_fails_outside_tolerances(over, reason):
    reasons = mc.verdict(result(**over))
    assert any(reason in r for r in reasons), reasons


def test_max_abs_diff_never_hides_nan():
    a = np.zeros((2, 3), np.float32)
    b = a.copy()
    b[1, 2] = np.nan
    assert mc._max_abs_diff(a, a) == (0.0, False, False)
    assert mc._max_abs_diff(a, b) == (None, False, True)
    assert mc._max_abs_diff(b, a) == (None, True, False)
    assert mc._worst(0.0, None) is None and mc._worst(None, 0.5) is None and mc._worst(0.1, 0.5) == 0.5
    assert mc._max_abs_diff(np.array([3, 4]), np.array([3, 7])) == (3.0, False, False)   # int: exact


@pytest.fixture
def fake_kernel(monkeypatch):
    """mk.kernel.step.make_step_fn -> the reference step; `poison[name] = step` NaNs that array from then on."""
    poison = {}

    def make_step_fn(params, cfg, batch, *, ctx, interpret=None, **kw):
        from mk.io.convert import dequantize_experts
        calls = {"n": 0}
        params = dequantize_experts(params)          # `mk check` hands the kernel packed MXFP4 experts

        def step_fn(_params, cache, tokens):
            logits, cache = ref.decode_step(params, cache, tokens, cfg=cfg)
            step = calls["n"]
            calls["n"] += 1
            for name, at in poison.items():
                if step >= at:
                    if name == "logits":
                        logits = logits.at[0, 0].set(jnp.nan)
                    else:
                        cache = dict(cache, **{name: cache[name].at[(0,) * cache[name].ndim].set(jnp.nan)})
            return logits, cache

        step_fn.plan = types.SimpleNamespace(prefetch_depth=kw.get("prefetch_depth", 2), num_slots=3,
                                             config_name=lambda: "tiny", devices=1, options=kw["options"],
                                             experts=kw.get("experts") or "bf16")
        return step_fn

    monkeypatch.setattr(mk.kernel.step, "make_step_fn", make_step_fn)
    monkeypatch.setattr(mc, "collectives_per_step", lambda plan: 0)
    monkeypatch.setattr(mc, "remote_bytes_per_step", lambda plan: 0)
    monkeypatch.setattr(mc, "count_pallas_calls", lambda *a: 1)
    return poison


def test_check_passes_when_identical(fake_kernel):
    res = mc.check(TINY, 2, steps=3, ctx=128, detect_races=False)
    assert res["verdict"] == "pass" and res["reasons"] == [], res["reasons"]
    assert res["max_abs_logit_err"] == 0.0 and res["cache_max_abs_err"] == 0.0 and not res["nan"]
    assert set(res["cache_max_abs_err_by_array"]) == {"pos", "kda_state", "conv_state", "mla_k", "mla_v"}
    assert res["tolerances"]["logit_max_abs_err"] == mc.LOGIT_TOL


@pytest.mark.parametrize("array", ["mla_v", "kda_state", "conv_state", "logits"])
def test_nan_anywhere_fails_and_is_named(fake_kernel, array):
    fake_kernel[array] = 1
    res = mc.check(TINY, 1, steps=3, ctx=128, detect_races=False)
    name = "kernel.logits" if array == "logits" else f"kernel.cache.{array}"
    assert res["nan"] is True and res["nan_arrays"][0] == f"{name} (step 1)"   # (then it spreads)
    assert res["verdict"] == "fail" and any(f"NaN in {name}" in r for r in res["reasons"])
    if array == "logits":
        assert res["max_abs_logit_err"] is None
    else:
        assert res["cache_max_abs_err"] is None and res["cache_max_abs_err_by_array"][array] is None


def test_cli_exit_code_and_json_follow_the_verdict(fake_kernel, tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(TINY.to_hf()))
    argv = ["check", "--config", str(tmp_path), "--batch", "1", "--steps", "2", "--ctx", "128", "--no-races"]
    assert main(argv + ["--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["verdict"] == "pass" and res["reasons"] == [] and res["tolerances"] == mc.TOLERANCES

    fake_kernel["mla_k"] = 0
    assert main(argv + ["--json"]) == 1
    out = capsys.readouterr().out
    res = json.loads(out, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    assert res["verdict"] == "fail" and res["nan"] is True and res["nan_arrays"][0] == "kernel.cache.mla_k (step 0)"
    assert res["cache_max_abs_err"] is None

    assert main(argv) == 1                                   # the table says it too
    out = capsys.readouterr().out
    assert "verdict: fail" in out and "NaN in kernel.cache.mla_k (step 0)" in out
