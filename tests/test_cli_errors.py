"""Every command turns a bad path, id or value into one line on stderr and exit code 2: no
traceback, nothing on stdout, and the message names the culprit. Each case runs the command line's
own entry point (`mk.__main__.main`, what `python -m mk` calls) in this process, its file
descriptors captured; a case fails before any heavy work. One case of each command also runs as the
user runs it, `python -m mk ...` in a subprocess (a fresh interpreter: what the import of each
command module and the interpreter's exit add).

Also: a CLI run on CPU prints none of libtpu's missing-TPU chatter.
"""
import json
import os
import subprocess
import sys

import pytest

from mk.model.config import get_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = get_config("mini").replace(
    dim=128, latent=128, expert_hidden=128, dense_hidden=128, experts=4, top_k=2, layers=2, heads=1,
    q_rank=128, kv_rank=128, vocab=512, residual_block=1, full_attention=(1,))

# Environment variables through which a caller could have silenced libtpu (or the tests' conftest
# did): removed, so the CLI's own settings are what is tested.
_QUIETING = ("TPU_", "TF_CPP_", "GRPC_", "ALLOW_MULTIPLE_LIBTPU_LOAD")


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(_QUIETING)}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p))
    env.update(extra)
    return {k: v for k, v in env.items() if v is not None}


def run_mk(*argv, env=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "mk", *argv], capture_output=True, text=True,
                          env=env or _env(), cwd=REPO, timeout=timeout)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from mk.io import synth
    d = tmp_path_factory.mktemp("ckpt")
    synth.write_checkpoint(TINY, str(d), seed=1)
    return str(d)


@pytest.fixture(scope="module")
def paths(tmp_path_factory, ckpt):
    d = tmp_path_factory.mktemp("paths")
    afile = d / "a_file"
    afile.write_text("not a directory")
    no_config = d / "empty_dir"
    no_config.mkdir()
    from mk.model import drafter
    drafter.write(drafter.config_for(get_config("mini")), d / "draft_vocab")          # vocab 2048 != 512
    drafter.write(drafter.config_for(TINY.replace(layers=8)), d / "draft_aux")       # aux layers 2, 4, 6
    bad_configs = {"CFG_LIST": [TINY.to_hf()],                                       # top level not an object
                   "CFG_LIN": TINY.to_hf(), "CFG_NOKEY": TINY.to_hf()}
    bad_configs["CFG_LIN"]["text_config"]["linear_attn_config"] = [128, 4]
    del bad_configs["CFG_NOKEY"]["text_config"]["hidden_size"]
    for name, doc in bad_configs.items():
        (d / name.lower()).mkdir()
        (d / name.lower() / "config.json").write_text(json.dumps(doc))
    return {"CKPT": ckpt, "FILE": str(afile), "EMPTY": str(no_config), "OUT": str(d / "out"),
            "DRAFT_VOCAB": str(d / "draft_vocab"), "DRAFT_AUX": str(d / "draft_aux"),
            "MISSING": str(d / "missing"), "NOPARENT": str(d / "missing" / "deeper" / "x.npy"),
            **{name: str(d / name.lower()) for name in bad_configs}}


# (argv, text the one-line message must contain). Placeholders: CKPT (a tiny checkpoint), FILE (a
# regular file), EMPTY (a directory without config.json), MISSING (a path that does not exist),
# NOPARENT (a file in a directory that does not exist), OUT (a fresh path), CFG_LIST / CFG_LIN /
# CFG_NOKEY (checkpoint directories whose config.json is a list / has a list for linear_attn_config /
# lacks hidden_size).
CASES = [
    # top level (argparse)
    ([], "required: command"),
    (["bogus"], "invalid choice: 'bogus'"),
    # generate
    (["generate", "--config", "nope", "--prompt-tokens", "1"], "unknown config 'nope'"),
    (["generate", "--config", "EMPTY", "--prompt-tokens", "1"], "EMPTY"),
    (["generate", "--checkpoint", "MISSING", "--prompt-tokens", "1"], "MISSING"),
    (["generate", "--config", "CFG_LIST", "--prompt-tokens", "1"],
     "error: CFG_LIST/config.json: the top level must be a JSON object, found list"),
    (["generate", "--config", "CFG_LIN", "--prompt-tokens", "1"],
     "error: CFG_LIN/config.json: 'linear_attn_config' must be an object, found list"),
    (["load", "CFG_NOKEY"], "error: CFG_NOKEY/config.json: missing key 'hidden_size'"),   # the path once
    (["generate", "--prompt-tokens", "-1,5"], "--prompt-tokens: token id -1 outside the vocabulary"),
    (["generate", "--prompt-tokens=-1,5"], "--prompt-tokens: token id -1 outside the vocabulary"),
    (["generate", "--prompt-tokens", "1,x"], "--prompt-tokens: expected comma-separated integer token ids"),
    (["generate", "--prompt-tokens", "1", "--batch", "two"], "argument --batch: invalid int value: 'two'"),
    (["generate", "--prompt-tokens", "1", "--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
    (["generate", "--prompt-tokens", "1", "--seed", "-1"], "argument --seed: must be at least 0"),
    (["generate", "--prompt-tokens", "1", "--backend", "gpu"], "argument --backend: invalid choice"),
    (["generate", "--prompt-tokens", "1", "--speculative", "8"], "--speculative 8: a verify step of batch 1 x (1 + 8) = 9 rows exceeds"),
    (["generate", "--prompt-tokens", "1", "--speculative", "2", "--fixed-acceptance-length", "4"],
     "--fixed-acceptance-length must lie in 1..3"),
    (["generate", "--prompt-tokens", "1", "--speculative", "2", "--drafter", "MISSING"], "MISSING: drafter directory not found"),
    (["generate", "--prompt-tokens", "1", "--speculative", "2", "--mesh", "2"],
     "--speculative --mesh N runs on --backend kernel"),
    (["generate", "--checkpoint", "CKPT", "--prompt-tokens", "1", "--speculative", "2", "--drafter", "DRAFT_VOCAB"],
     "vocabulary 2048 does not match the target's 512"),
    (["generate", "--checkpoint", "CKPT", "--prompt-tokens", "1", "--speculative", "2", "--drafter", "DRAFT_AUX"],
     "aux layers [2, 4, 6] do not exist in the target"),
    # check
    (["check", "--config", "nope"], "unknown config 'nope'"),
    (["check", "--batch", "0"], "argument --batch: must be at least 1, found 0"),
    (["check", "--batch", "9"], "batch must be in 1..8, found 9"),
    (["check", "--steps", "0"], "argument --steps: must be at least 1"),
    (["check", "--speculative", "8"], "k = 8 drafts: a verify step of batch 1 x (1 + k) = 9 rows exceeds"),
    (["check", "--speculative", "2", "--batch", "3"], "k = 2 drafts: a verify step of batch 3 x (1 + k) = 9 rows exceeds"),
    (["check", "--speculative", "3", "--new-tokens", "200"], "--prompt-len 100 + --new-tokens 200 + k + 1 exceed --ctx 256"),
    (["check", "--speculative", "3", "--agree", "1.5"], "--agree must lie in [0, 1], found 1.5"),
    (["check", "--ctx", "100"], "argument --ctx: must be a positive multiple of 128"),
    (["check", "--steps", "300", "--ctx", "256"], "--steps (300) exceed --ctx 256"),
    (["check", "--prefetch-depth", "-1"], "argument --prefetch-depth: must be at least 0"),
    (["check", "--dma-mode", "lazy"], "argument --dma-mode: invalid choice"),
    (["check", "--mesh", "3"], "mesh of 3 devices (ep=1 x tp_expert=3) does not divide the config: heads = 2"),
    (["check", "--config", "mini-tp8", "--mesh", "0"], "argument --mesh: must be at least 1"),
    # logits: every id / path problem is reported before the weights are read
    (["logits", "--checkpoint", "MISSING", "--tokens", "1", "--out", "OUT.npy"], "MISSING"),
    (["logits", "--checkpoint", "CKPT", "--tokens", "-1,5", "--out", "OUT.npy"],
     "--tokens: token id -1 outside the vocabulary [0, 512)"),
    (["logits", "--checkpoint", "CKPT", "--tokens", "3,512,900", "--out", "OUT.npy"],
     "--tokens: token id 512 outside the vocabulary [0, 512) (2 ids out of range)"),
    (["logits", "--checkpoint", "CKPT", "--tokens", "1,b", "--out", "OUT.npy"], "--tokens: expected comma-separated"),
    (["logits", "--checkpoint", "CKPT", "--tokens", "1", "--out", "NOPARENT"], "--out: directory"),
    (["logits", "--checkpoint", "CKPT", "--tokens", "1", "--out", "EMPTY"], "--out: 'EMPTY' is a directory"),
    (["logits", "--checkpoint", "CKPT", "--out", "OUT.npy"], "give exactly one of --tokens or --text"),
    # load
    (["load", "MISSING"], "MISSING"),
    (["load", "EMPTY"], "EMPTY"),
    (["load", "CKPT", "--bench", "--repeat", "0"], "argument --repeat: must be at least 1"),
    (["load", "CKPT", "--threads", "0"], "argument --threads: must be at least 1"),
    (["load", "CKPT", "--experts", "fp8"], "argument --experts: invalid choice"),
    # synth
    (["synth", "--out", "FILE/sub"], "--out: cannot create directory"),
    (["synth", "--out", "FILE"], "--out: 'FILE' exists and is not a directory"),
    (["synth", "--config", "nope", "--out", "OUT"], "unknown config 'nope'"),
    (["synth", "--override", "layers=x", "--out", "OUT"], "--override: value of 'layers'"),
    (["synth", "--override", "colour=3", "--out", "OUT"], "--override: unknown K3Config field 'colour'"),
    (["synth", "--shard-mb", "0", "--out", "OUT"], "argument --shard-mb: must be a positive number"),
    (["synth"], "required: --out"),
    # aot
    (["aot", "--config", "nope"], "unknown config 'nope'"),
    (["aot", "--config", "mini-tp8", "--mesh", "16"], "mesh of 16 devices"),
    (["aot", "--config", "mini-tp8", "--mesh", "64", "--topology", "tpu7x:2x2x1"], "mesh of 64 devices"),
    (["aot", "--config", "k3-slice", "--mesh", "16", "--topology", "tpu7x:2x2x1"],
     "topology tpu7x:2x2x1 has 8 devices, the plan needs 16"),
    (["aot", "--topology", "tpu9:2x2"], "--topology: unknown topology 'tpu9:2x2'"),
    (["aot", "--tile", "512"], "--tile: expected TKxTN"),
    (["aot", "--tile", "axb"], "--tile: expected TKxTN"),
    (["aot", "--batch", "0"], "argument --batch: must be at least 1"),
    (["aot", "--ctx", "-128"], "argument --ctx: must be a positive multiple of 128"),
    (["aot", "--prefetch-depth", "4", "--num-slots", "2"], "num_slots (2) must be at least prefetch_depth + 1"),
    # compile-time
    (["compile-time", "--layers", "a,b"], "--layers: expected comma-separated integers, found 'a,b'"),
    (["compile-time", "--layers", "4,0"], "--layers: values must be at least 1, found 0"),
    (["compile-time", "--layers", "-4"], "--layers: values must be at least 1, found -4"),
    (["compile-time", "--topology", "zz"], "--topology: unknown topology 'zz'"),
    (["compile-time", "--config", "nope"], "unknown config 'nope'"),
    (["compile-time", "--num-experts", "0"], "argument --num-experts: must be at least 1"),
    # simulate
    (["simulate", "--system", "h100x8"], "--system: unknown system 'h100x8'"),
    (["simulate", "--batch", "one"], "--batch: expected comma-separated integers"),
    (["simulate", "--batch", "0"], "--batch: batch sizes must be in 1..8"),
    (["simulate", "--config", "nope"], "unknown config 'nope'"),
    (["simulate", "--context", "-3"], "argument --context: must be at least 1"),
    (["simulate", "--trace", "NOPARENT"], "--trace: directory"),            # before any step is modelled
    # microbench: --write is checked before the TPU is looked for (and before minutes of timing)
    (["microbench", "--write", "NOPARENT"], "--write: directory"),
    (["microbench", "--write", "EMPTY"], "--write: 'EMPTY' is a directory"),
    # notebooks (mk/cli/notebooks.py: tested here, owned elsewhere)
    (["notebooks"], "required: --out"),
    (["notebooks", "--out", "FILE/sub"], "FILE/sub"),
    (["notebooks", "--out", "OUT", "-p", "batch"], "argument -p/--parameter: expected 2 arguments"),
    (["notebooks", "--out", "OUT", "--only", "01", "--only", "99"], "--only '99' matches no notebook"),
    (["notebooks", "--out", "FILE", "--only", "01"], "--out: 'FILE' exists and is not a directory"),
]


def _ids(case):
    return " ".join(case[0])[:60] or "(no command)"


def _filled(paths, argv, message):
    def fill(text):
        for key in sorted(paths, key=len, reverse=True):
            text = text.replace(key, paths[key])
        return text
    return [fill(a) for a in argv], fill(message)


def _one_line_exit_2(returncode, out, err, message):
    assert "Traceback" not in err, err
    assert returncode == 2, (returncode, err)
    assert out == "", out
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert message in err, err


@pytest.mark.parametrize("argv, message", CASES, ids=[_ids(c) for c in CASES])
def test_bad_input_is_one_line_exit_2(paths, argv, message, capfd, monkeypatch):
    from mk.__main__ import main
    argv, message = _filled(paths, argv, message)
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))   # what `--mesh N` sets, for this case only
    returncode = main(argv)
    out, err = capfd.readouterr()
    _one_line_exit_2(returncode, out, err, message)


# The first case of each command (and the bare command line's), as the user runs them.
AS_RUN = [c for i, c in enumerate(CASES) if all(c[0][:1] != d[0][:1] for d in CASES[:i])]


@pytest.mark.parametrize("argv, message", AS_RUN, ids=[_ids(c) for c in AS_RUN])
def test_bad_input_is_one_line_exit_2_as_run(paths, argv, message):
    argv, message = _filled(paths, argv, message)
    proc = run_mk(*argv)
    _one_line_exit_2(proc.returncode, proc.stdout, proc.stderr, message)


def test_logits_checks_ids_before_loading_weights(paths, monkeypatch, capsys):
    """A bad id is reported without reading a single tensor (on K3 the load takes minutes)."""
    import mk.io.checkpoint
    from mk.__main__ import main

    def no_load(*a, **kw):
        raise AssertionError("weights loaded before the ids were checked")

    monkeypatch.setattr(mk.io.checkpoint, "load", no_load)
    monkeypatch.setattr(mk.io.checkpoint, "load_with_config", no_load)
    out = os.path.join(paths["OUT"] + "_logits.npy")
    assert main(["logits", "--checkpoint", paths["CKPT"], "--tokens", "1,99999", "--out", out]) == 2
    assert "token id 99999 outside the vocabulary" in capsys.readouterr().err
    assert not os.path.exists(out)


def test_simulate_checks_trace_path_before_modelling(paths, monkeypatch, capsys):
    """An unwritable --trace is reported before a single step is modelled."""
    import mk.perf.sim
    from mk.__main__ import main

    def no_predict(*a, **kw):
        raise AssertionError("a step was modelled before --trace was checked")

    monkeypatch.setattr(mk.perf.sim, "predict", no_predict)
    assert main(["simulate", "--trace", paths["NOPARENT"]]) == 2
    assert "--trace: directory" in capsys.readouterr().err


# ---- libtpu stays quiet on CPU --------------------------------------------------------------------
LIBTPU_NOISE = ("E0000", "unexpected worker hostname", "could not determine TPU", "Failed to find host bounds",
                "Logging before InitGoogle", "libtpu_lockfile")


def _tpu_attached():
    import mk
    return mk._tpu_attached()


@pytest.mark.parametrize("platforms", ["cpu", None], ids=["JAX_PLATFORMS=cpu", "JAX_PLATFORMS-unset"])
def test_cli_on_cpu_prints_no_libtpu_noise(platforms):
    """The deviceless TPU compile loads libtpu, which used to log that it found no TPU workers."""
    if platforms is None and _tpu_attached():
        pytest.skip("a TPU is attached: without JAX_PLATFORMS=cpu the run is a real TPU run")
    proc = run_mk("aot", "--config", "mini", "--topology", "tpu7x:2x2x1", "--json",
                  env=_env(JAX_PLATFORMS=platforms))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["compiled"] is True
    noise = [line for line in proc.stderr.splitlines() if any(n in line for n in LIBTPU_NOISE)]
    assert not noise, proc.stderr
