"""`python -m mk generate`: output formats, sampling options, checkpoints, backends, user errors.

Runs on a 2-layer config written as a checkpoint config.json (so `--config DIR` is exercised and
compiling the step takes seconds), plus one run of the documented `--config mini` command.
"""
import json
import os
import subprocess
import sys
import types

import numpy as np
import pytest

from mk.model import params as mkparams
from mk.model import reference as ref
from mk.__main__ import main
from mk.model.config import get_config

TINY = get_config("mini").replace(
    dim=128, latent=128, expert_hidden=128, dense_hidden=128, experts=4, top_k=2, layers=2, heads=1,
    q_rank=128, kv_rank=128, vocab=512, residual_block=1, full_attention=(1,))
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    (d / "config.json").write_text(json.dumps(TINY.to_hf()))
    return str(d)


def cli(capsys, *argv):
    """Run in-process -> (exit code, stdout, stderr)."""
    code = main(["generate", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def gen(capsys, tiny_dir, *argv):
    code, out, err = cli(capsys, "--config", tiny_dir, "--ctx", "128", *argv)
    assert code == 0, err
    return out


def test_prints_token_ids(capsys, tiny_dir):
    out = gen(capsys, tiny_dir, "--seed", "0", "--prompt-tokens", "1,2,3", "--max-new-tokens", "6")
    lines = out.splitlines()
    assert len(lines) == 1
    toks = [int(t) for t in lines[0].split(" ")]
    assert len(toks) == 6 and all(0 <= t < TINY.vocab for t in toks)
    # exactly the library's greedy generation with mk.model.params.init(config, seed)
    want = ref.generate(mkparams.init(TINY, 0), TINY, [1, 2, 3], 6, ctx=128)["tokens"][0].tolist()
    assert toks == want
    # deterministic, and the prompt may use spaces too
    assert gen(capsys, tiny_dir, "--seed", "0", "--prompt-tokens", "1, 2, 3", "--max-new-tokens", "6") == out


def test_json_output(capsys, tiny_dir):
    out = gen(capsys, tiny_dir, "--prompt-tokens", "5,6", "--max-new-tokens", "4", "--json")
    res = json.loads(out)
    assert res["tokens"] == [res["tokens"][0]] and len(res["tokens"][0]) == 4
    assert res["prompt_tokens"] == [5, 6]
    assert res["backend"] == "reference" and res["config"] == tiny_dir
    assert res["ctx"] == 128 and res["batch"] == 1 and res["temperature"] == 0.0 and res["top_p"] == 1.0
    for k in ("prefill_s", "decode_s", "tokens_per_s", "ttft_s", "prefill_tokens_per_s"):
        assert isinstance(res[k], float) and res[k] > 0
    assert res["loop"] == "device" and res["chunk"] == 16 and res["prefill"] == "sequential"
    assert res["decode_steps"] == 3 and res["chunks"] == 1
    rec = res["record"]                           # a record, as every --json measurement (mk.perf.results)
    assert rec["kind"] == "generate_command" and rec["command"].startswith("python -m mk generate")
    assert rec["key"]["prompt_tokens"] == 2 and rec["key"]["max_new_tokens"] == 4 and rec["key"]["loop"] == "device"
    assert "tok/s" in rec["summary"] and rec["date"] and "commit" in rec
    plain = gen(capsys, tiny_dir, "--prompt-tokens", "5,6", "--max-new-tokens", "4")
    assert plain.split() == [str(t) for t in res["tokens"][0]]


def test_batch_rows(capsys, tiny_dir):
    out = gen(capsys, tiny_dir, "--prompt-tokens", "7,8,9", "--max-new-tokens", "3", "--batch", "3")
    lines = out.splitlines()
    assert len(lines) == 3 and len(set(lines)) == 1          # greedy copies of one prompt agree
    one = gen(capsys, tiny_dir, "--prompt-tokens", "7,8,9", "--max-new-tokens", "3")
    assert lines[0] == one.strip()


def test_sampling_options(capsys, tiny_dir):
    args = ("--prompt-tokens", "1,2", "--max-new-tokens", "6", "--temperature", "2.0")
    a = gen(capsys, tiny_dir, *args, "--seed", "3")
    assert gen(capsys, tiny_dir, *args, "--seed", "3") == a                 # reproducible
    greedy = gen(capsys, tiny_dir, "--prompt-tokens", "1,2", "--max-new-tokens", "6", "--seed", "3")
    assert gen(capsys, tiny_dir, *args, "--seed", "3", "--top-p", "1e-6") == greedy
    others = {gen(capsys, tiny_dir, *args, "--seed", str(s)) for s in (4, 5)}
    assert others | {greedy} != {a}                                          # sampling samples


def test_default_ctx_fits_the_run(capsys, tiny_dir):
    code, out, err = cli(capsys, "--config", tiny_dir, "--prompt-tokens", "1", "--max-new-tokens", "2", "--json")
    assert code == 0, err
    assert json.loads(out)["ctx"] == ref.DEFAULT_CTX


def test_speculative_json(capsys, tiny_dir, tmp_path):
    """--speculative with a drafter written by `mk synth --drafter`: greedy tokens equal plain
    greedy ones; --json reports acceptance lengths, tokens per step and measured tokens/s (CPU)."""
    assert main(["synth", "--drafter", "--config", tiny_dir, "--out", str(tmp_path / "d"), "--seed", "3"]) == 0
    capsys.readouterr()
    plain = json.loads(gen(capsys, tiny_dir, "--prompt-tokens", "1,2,3", "--max-new-tokens", "6", "--json"))
    out = json.loads(gen(capsys, tiny_dir, "--prompt-tokens", "1,2,3", "--max-new-tokens", "6", "--json",
                         "--speculative", "2", "--drafter", str(tmp_path / "d")))
    assert out["tokens"] == plain["tokens"] and out["device"] == "cpu" and out["tokens_per_s"] > 0
    assert out["record"]["kind"] == "generate_command" and out["record"]["key"]["speculative"] == 2
    lengths = out["acceptance_lengths"][0]
    assert out["steps"] == len(lengths) and all(1 <= a <= 3 for a in lengths)
    assert out["mean_acceptance_length"] == pytest.approx(np.mean(lengths))
    fixed = json.loads(gen(capsys, tiny_dir, "--prompt-tokens", "1,2,3", "--max-new-tokens", "7", "--json",
                           "--speculative", "2", "--fixed-acceptance-length", "3"))
    assert fixed["acceptance_lengths"] == [[3, 3]] and fixed["tokens_per_step"] == 3
    assert fixed["note"].startswith("tokens not meaningful")
    on_device = json.loads(gen(capsys, tiny_dir, "--prompt-tokens", "1,2,3", "--max-new-tokens", "7", "--json",
                               "--speculative", "2", "--fixed-acceptance-length", "3", "--loop", "device"))
    assert on_device["row_mean_acceptance_lengths"] == [3.0] and on_device["tokens_per_step"] == 3
    assert on_device["loop"] == "device" and on_device["note"] == fixed["note"]


@pytest.mark.parametrize("argv, message", [
    (["--prompt-tokens", "1,2,x"], "--prompt-tokens: expected comma-separated integer token ids"),
    (["--prompt-tokens", "1.5"], "--prompt-tokens: expected comma-separated integer token ids"),
    (["--prompt-tokens", ","], "--prompt-tokens: no token ids given"),
    (["--prompt-tokens", "1,512"], "--prompt-tokens: token id 512 outside the vocabulary [0, 512)"),
    (["--prompt-tokens", "-1"], "--prompt-tokens: token id -1 outside the vocabulary"),
    (["--prompt-tokens", "1", "--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
    (["--prompt-tokens", "1", "--batch", "0"], "--batch must be at least 1"),
    (["--prompt-tokens", "1", "--temperature", "-1"], "--temperature must be >= 0"),
    (["--prompt-tokens", "1", "--top-p", "0"], "--top-p must lie in (0, 1]"),
    (["--prompt-tokens", "1", "--ctx", "100"], "--ctx must be a positive multiple of 128"),
    (["--prompt-tokens", "1", "--ctx", "128", "--max-new-tokens", "128"], "exceed --ctx 128"),
    ([], "give exactly one of --prompt-tokens IDS or --prompt TEXT"),
    (["--prompt", "hi"], "--prompt needs --checkpoint DIR"),
    (["--prompt-tokens", "1", "--chunk", "0"], "--chunk must be at least 1 step, found 0"),
    (["--prompt-tokens", "1", "--prefill", "parallel", "--loop", "host"], "--prefill parallel needs the device loop"),
    (["--prompt-tokens", "1", "--speculative", "2", "--fixed-acceptance-length", "0", "--loop", "device"],
     "--fixed-acceptance-length must lie in 1..3 (1 + --speculative), found 0"),
    (["--prompt-tokens", "1", "--speculative", "3", "--batch", "4", "--loop", "device"],
     "--speculative 3: a verify step of batch 4 x (1 + 3) = 16 rows exceeds the 8 rows"),
    (["--prompt-tokens", ",".join(["1"] * 130), "--ctx", "128"], "exceed --ctx 128"),
    (["--prompt-tokens", "1", "--checkpoint", "/nonexistent"], "give --config or --checkpoint, not both"),
    (["--prompt-tokens", "1", "--experts", "mxfp4"], "--experts mxfp4 draws random MXFP4 experts for --backend kernel"),
])
def test_user_errors(capsys, tiny_dir, argv, message):
    code, out, err = cli(capsys, "--config", tiny_dir, *argv)
    assert code == 2 and out == ""
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err


def test_unknown_config_and_missing_checkpoint(capsys, tmp_path):
    code, out, err = cli(capsys, "--config", "nope", "--prompt-tokens", "1")
    assert code == 2 and out == "" and "unknown config 'nope'" in err and err.count("\n") == 1
    code, out, err = cli(capsys, "--checkpoint", str(tmp_path), "--prompt-tokens", "1")
    assert code == 2 and out == "" and "config.json" in err and err.count("\n") == 1


def test_kernel_backend_plumbing(capsys, tiny_dir, monkeypatch):
    """--backend kernel hands mk.kernel.step.make_step_fn(params, cfg, batch, ctx=...) to generate."""
    calls = []

    def make_step_fn(params, cfg, batch, *, ctx, options):
        calls.append((cfg, batch, ctx, options.all_reduce, options.mxfp4_matmul))
        return lambda p, cache, tokens: ref.decode_step(p, cache, tokens, cfg=cfg)

    monkeypatch.setitem(sys.modules, "mk.kernel.step", types.SimpleNamespace(make_step_fn=make_step_fn))
    out = gen(capsys, tiny_dir, "--prompt-tokens", "1,2", "--max-new-tokens", "3", "--batch", "2",
              "--backend", "kernel", "--json", "--all-reduce", "two_round", "--mxfp4-matmul", "fp8")
    res = json.loads(out)
    assert calls == [(TINY, 2, 128, "two_round", "fp8")] and res["backend"] == "kernel"
    ref_out = json.loads(gen(capsys, tiny_dir, "--prompt-tokens", "1,2", "--max-new-tokens", "3", "--json"))
    assert res["tokens"] == ref_out["tokens"] * 2


def test_kernel_backend_missing(capsys, tiny_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "mk.kernel.step", None)          # import mk.kernel fails
    code, out, err = cli(capsys, "--config", tiny_dir, "--prompt-tokens", "1", "--backend", "kernel")
    assert code == 2 and "--backend kernel needs mk.kernel" in err and err.count("\n") == 1
    monkeypatch.setitem(sys.modules, "mk.kernel.step", types.SimpleNamespace())
    code, out, err = cli(capsys, "--config", tiny_dir, "--prompt-tokens", "1", "--backend", "kernel")
    assert code == 2 and "make_step_fn" in err


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    from mk.io import synth
    d = tmp_path_factory.mktemp("ckpt")
    synth.write_checkpoint(TINY, str(d), seed=2)
    return str(d)


def test_checkpoint_prompt_tokens(capsys, tiny_checkpoint):
    from mk.io.checkpoint import load_with_config

    code, out, err = cli(capsys, "--checkpoint", tiny_checkpoint, "--prompt-tokens", "3,4", "--max-new-tokens", "4",
                         "--ctx", "128", "--json")
    assert code == 0, err
    res = json.loads(out)
    cfg, params = load_with_config(tiny_checkpoint, progress=False)
    assert cfg == TINY and res["config"] == tiny_checkpoint
    assert res["tokens"] == ref.generate(params, cfg, [3, 4], 4, ctx=128)["tokens"].tolist()


def test_checkpoint_prompt_text(capsys, tiny_checkpoint):
    from mk.io.tokenizer import Tokenizer

    code, out, err = cli(capsys, "--checkpoint", tiny_checkpoint, "--prompt", "hello world", "--max-new-tokens", "4",
                         "--ctx", "128", "--json")
    assert code == 0, err
    res = json.loads(out)
    tok = Tokenizer(tiny_checkpoint)
    assert res["prompt_tokens"] == tok.encode("hello world")
    assert res["text"] == [tok.decode(res["tokens"][0])]
    assert 1 <= len(res["tokens"][0]) <= 4                   # may stop early at an end token
    code, out, err = cli(capsys, "--checkpoint", tiny_checkpoint, "--prompt", "hello world", "--max-new-tokens", "4",
                         "--ctx", "128")
    assert code == 0 and out.splitlines() == [res["text"][0]]           # one row: the text, streamed
    code, out, err = cli(capsys, "--checkpoint", tiny_checkpoint, "--prompt", "hello world", "--max-new-tokens", "4",
                         "--ctx", "128", "--loop", "host")
    assert code == 0 and out.splitlines() == [" ".join(map(str, res["tokens"][0])), res["text"][0]]


def test_documented_command(capsys):
    code, out, err = cli(capsys, "--config", "mini", "--seed", "0", "--prompt-tokens", "1,2,3", "--max-new-tokens", "16")
    assert code == 0, err
    toks = out.split()
    assert len(toks) == 16 and all(0 <= int(t) < 2048 for t in toks)


def test_module_entry_point(tiny_dir, capsys):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, "-m", "mk", "generate", "--config", tiny_dir, "--ctx", "128",
                           "--prompt-tokens", "1,2,3", "--max-new-tokens", "4", "--json"],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout)
    assert res["backend"] == "reference" and set(res) >= {"tokens", "prefill_s", "decode_s", "tokens_per_s", "config"}
    assert res["tokens"] == json.loads(gen(capsys, tiny_dir, "--prompt-tokens", "1,2,3", "--max-new-tokens", "4",
                                           "--json"))["tokens"]
    bad = subprocess.run([sys.executable, "-m", "mk", "generate", "--config", tiny_dir, "--prompt-tokens", "a"],
                         capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert bad.returncode == 2 and bad.stdout == "" and bad.stderr.startswith("error: --prompt-tokens")



def test_speculative_kernel_plumbing(capsys, tiny_dir, monkeypatch):
    """--speculative K --backend kernel hands mk.kernel.step.KernelVerifier(params, cfg, batch, K,
    drafter aux layers, ctx=, mesh=) to speculative.generate (the kernel's verify step itself is
    tests/test_speculative_kernel.py's)."""
    from mk.model import drafter as mkdrafter
    from mk.kernel.speculative import ReferenceVerifier
    calls = []

    def KernelVerifier(params, cfg, batch, k, aux_layers, *, ctx, mesh, options):
        calls.append((cfg, batch, k, tuple(aux_layers), ctx, mesh))
        assert (options.all_reduce, options.mxfp4_matmul) == ("one_round", "bf16")    # MK's defaults
        return ReferenceVerifier(cfg)

    monkeypatch.setitem(sys.modules, "mk.kernel.step", types.SimpleNamespace(KernelVerifier=KernelVerifier))
    res = json.loads(gen(capsys, tiny_dir, "--prompt-tokens", "1,2", "--max-new-tokens", "3", "--json",
                         "--speculative", "2", "--backend", "kernel"))
    assert calls == [(TINY, 1, 2, mkdrafter.config_for(TINY).aux_layers, res["ctx"], None)] and res["backend"] == "kernel"
    plain = json.loads(gen(capsys, tiny_dir, "--prompt-tokens", "1,2", "--max-new-tokens", "3", "--json"))
    assert res["tokens"] == plain["tokens"]


def test_speculative_device_loop(capsys, tiny_dir):
    """--speculative K --loop device: drafts verified and accepted on the device, plain greedy's tokens."""
    plain = json.loads(gen(capsys, tiny_dir, "--prompt-tokens", "1,2,3", "--max-new-tokens", "5", "--json"))
    out = json.loads(gen(capsys, tiny_dir, "--prompt-tokens", "1,2,3", "--max-new-tokens", "5", "--json",
                         "--speculative", "2", "--loop", "device", "--chunk", "2"))
    assert out["tokens"] == plain["tokens"] and out["loop"] == "device" and out["chunk"] == 2
    assert len(out["row_mean_acceptance_lengths"]) == 1 and 1 <= out["mean_acceptance_length"] <= 3
    streamed = gen(capsys, tiny_dir, "--prompt-tokens", "1,2,3", "--max-new-tokens", "5", "--speculative", "2",
                   "--loop", "device")
    assert streamed.split() == [str(t) for t in plain["tokens"][0]]


def _generate_process(cache_dir, *extra):
    """`python -m mk generate --config mini ... --json` in a fresh process with MK_CACHE_DIR=cache_dir."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p), MK_CACHE_DIR=str(cache_dir))
    proc = subprocess.run([sys.executable, "-m", "mk", "generate", "--config", "mini", "--prompt-tokens", "1,2,3",
                           "--max-new-tokens", "4", "--chunk", "2", "--json", *extra],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout), proc.stderr


@pytest.mark.slow
def test_a_second_process_reuses_the_compile_cache(tmp_path):
    """Two processes of the same command on mini: the second loads its programs from the persistent
    compile cache (mk.model.compile_cache) and its compile_s is under 0.3 of the first's; the same
    tokens; nothing compiled on either's clock; the timeline (in --json, and one line on stderr)."""
    first, err = _generate_process(tmp_path / "jax")
    second, _ = _generate_process(tmp_path / "jax")
    assert second["tokens"] == first["tokens"]
    # What the second process loads (mini, --backend reference, host-drawn weights): nothing for the
    # weights (numpy draws cast on the host and device_put: no program), and 4 programs in the
    # rehearsal: the empty caches (one jitted init_cache), the step the sequential prefill
    # dispatches, the first token (its PRNG key made inside), the decode chunk; all from the cache.
    assert second["programs"]["weights"]["compiles"] == 0, second["programs"]
    assert second["programs"]["rehearsal"]["compiles"] <= 4, second["programs"]
    assert second["programs"]["rehearsal"]["cache_loads"] == second["programs"]["rehearsal"]["compiles"]
    # The step, the first token and the chunk come from mk's program store (`Program`), traced by
    # nothing: the empty caches' program alone is traced (JAX's cache traces before its lookup).
    assert second["programs"]["rehearsal"]["traces"] <= 1, second["programs"]
    assert first["cache"]["programs"] == second["cache"]["programs"] == 3
    assert first["cache"]["dir"] == str(tmp_path / "jax") and first["cache"]["entries"] > 0
    assert second["cache"]["entries"] == first["cache"]["entries"]           # nothing new to store
    assert second["compile_s"] < 0.3 * first["compile_s"], (first["compile_s"], second["compile_s"])
    assert first["in_clock"]["compiles"] == second["in_clock"]["compiles"] == 0
    phases = ["setup_s", "weights_s", "compile_s", "ttft_s", "decode_s", "total_s"]
    assert list(first["timeline"]) == phases and first["timeline"]["compile_s"] == first["compile_s"]
    assert sum(first["timeline"][k] for k in phases[:-1]) <= first["timeline"]["total_s"]
    line = [ln for ln in err.splitlines() if ln.startswith("timeline: ")]
    assert len(line) == 1 and "setup" in line[0] and str(tmp_path / "jax") in line[0]


def test_an_unwritable_cache_warns_and_runs_uncached(capsys, tiny_dir, tmp_path, monkeypatch):
    """MK_CACHE_DIR under a file (no folder can be made there): one warning line, the run goes on
    uncached (cache null in --json); --no-cache asks for neither."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("MK_CACHE_DIR", str(blocker / "jax"))
    code, out, err = cli(capsys, "--config", tiny_dir, "--prompt-tokens", "1,2", "--max-new-tokens", "2", "--json")
    assert code == 0 and json.loads(out)["cache"] is None
    warning = [ln for ln in err.splitlines() if ln.startswith("warning: compile cache")]
    assert len(warning) == 1 and "running uncached" in warning[0]
    code, out, err = cli(capsys, "--config", tiny_dir, "--prompt-tokens", "1,2", "--max-new-tokens", "2", "--json",
                         "--no-cache")
    assert code == 0 and json.loads(out)["cache"] is None and "warning" not in err
