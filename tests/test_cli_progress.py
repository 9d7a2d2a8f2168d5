"""Progress bars: on stderr only, never on stdout (JSON stays clean), off when stderr is not a
terminal; multi-token kernel runs advance one step per decode step."""
import io
import sys
import types

import pytest

import mk.cli.checkpoint as cli_ckpt
import mk.cli.common as common


def test_off_when_not_a_terminal(capsys):
    bar = common.progress(range(3), desc="x")
    assert bar.disable                                   # pytest captures stderr: not a TTY
    assert list(bar) == [0, 1, 2]
    assert common.progress(range(3), desc="x", enabled=False).disable
    out, err = capsys.readouterr()
    assert out == "" and err == ""


def test_counting_step_advances_and_passes_attributes():
    from tqdm import tqdm
    stream = io.StringIO()
    bar = tqdm(total=3, file=stream, disable=False)

    def step(p, cache, tokens):
        return tokens, cache
    step.plan = "the plan"
    wrapped = common.CountingStep(step, bar)
    assert wrapped(None, {}, 7) == (7, {}) and wrapped(None, {}, 8) == (8, {})
    assert bar.n == 2 and wrapped.plan == "the plan"


def test_kernel_teacher_forced_steps_are_counted(monkeypatch):
    """`mk logits --backend kernel` shows one bar step per token while mk.kernel's own
    teacher_forced_logits runs, and leaves mk.kernel as it found it."""
    from tqdm import tqdm
    stream = io.StringIO()
    bars = []

    def shown_progress(iterable=None, *, desc, total=None, enabled=True, **kw):
        bars.append(tqdm(iterable, desc=desc, total=total, file=stream, disable=False, **kw))
        return bars[-1]

    kernel = types.SimpleNamespace()

    def make_step_fn(params, cfg, batch, **kw):
        return lambda p, cache, tok: (tok, cache)

    def teacher_forced_logits(params, cfg, tokens):
        step = kernel.make_step_fn(params, cfg, 1)        # looked up at call time, as mk.kernel does
        return [step(None, None, t)[0] for t in tokens]

    kernel.make_step_fn, kernel.teacher_forced_logits = make_step_fn, teacher_forced_logits
    monkeypatch.setitem(sys.modules, "mk.kernel.step", kernel)
    monkeypatch.setattr(cli_ckpt, "progress", shown_progress)
    with cli_ckpt._kernel_steps_progress(4):
        assert kernel.teacher_forced_logits(None, None, [5, 6, 7, 8]) == [5, 6, 7, 8]
    assert bars[0].n == 4 and "logits (kernel)" in stream.getvalue()
    assert kernel.make_step_fn is make_step_fn


@pytest.mark.parametrize("json_flag", [True, False])
def test_generate_kernel_backend_keeps_stdout_clean(monkeypatch, capsys, tmp_path, json_flag):
    """The step counter wraps the kernel's step function; stdout holds only the result."""
    import json

    from mk.model import reference as ref
    from mk.__main__ import main
    from mk.model.config import get_config

    cfg = get_config("mini").replace(
        dim=128, latent=128, expert_hidden=128, dense_hidden=128, experts=4, top_k=2, layers=2, heads=1,
        q_rank=128, kv_rank=128, vocab=512, residual_block=1, full_attention=(1,))
    calls = []

    def make_step_fn(params, c, batch, *, ctx, options):
        def step(p, cache, tokens):
            calls.append(1)
            return ref.decode_step(p, cache, tokens, cfg=c)
        return step

    monkeypatch.setitem(sys.modules, "mk.kernel.step", types.SimpleNamespace(make_step_fn=make_step_fn))
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf()))
    argv = ["generate", "--config", str(tmp_path), "--ctx", "128", "--prompt-tokens", "1,2", "--max-new-tokens", "3",
            "--backend", "kernel", "--loop", "host"]         # the host loop calls the step once per token
    code = main(argv + (["--json"] if json_flag else []))
    out, err = capsys.readouterr()
    assert code == 0, err
    assert len(calls) == 2 + 3 - 1
    assert err.startswith("timeline: ") and err.count("\n") == 1, err   # stderr: the run's timeline alone
    if json_flag:
        assert len(json.loads(out)["tokens"][0]) == 3
    else:
        assert len(out.split()) == 3
