"""`generate`: decode new tokens from a prompt with random weights or a checkpoint.

    python -m mk generate --config mini --seed 0 --prompt-tokens 1,2,3 --max-new-tokens 16
    python -m mk generate --checkpoint DIR --prompt "Hello" [--temperature 0.7 --top-p 0.9] [--json]

Decoding runs on the device (`mk.model.loop`, `--loop device`, the default): one dispatch runs
`--chunk N` decode steps (default 16) with sampling, stop ids and the length limit checked on the
device, and the host reads each chunk while the next one runs. With one row the tokens stream to
the terminal as each chunk arrives (the token ids on one line, or with `--prompt` the decoded text);
`--batch` rows print one line each (ids, then with `--prompt` the text) when all are done. A row
ends at [EOS] / <|end_of_msg|> (with `--prompt`) or after --max-new-tokens. `--json` prints one
JSON object instead: record (kind generate_command, with commit, date, chip and command, as every
measurement's: `mk.perf.results`), tokens (one list per row), prompt_tokens, compile_s (prefill and chunk
programs, before the clock starts), ttft_s (time to first token on the host), prefill_s,
prefill_tokens_per_s, decode_s, tokens_per_s (decode tokens/s: tokens after each row's first /
decode_s), chunk, chunks, decode_steps, backend, config, the sampling settings, in_clock (what JAX
compiled or traced while the clock ran: 0), programs (the same for the weights and for the
rehearsal before the clock: {"weights", "rehearsal"}, each compiles (cache loads included),
cache_loads and traces; `mk.model.compile_cache.Counts`), timeline (seconds from mk's start: setup_s (imports,
the devices found), weights_s, compile_s, ttft_s, decode_s, total_s; one line on stderr either way)
and cache (the persistent compile cache: dir, entries, bytes; null with --no-cache). `--prefill
sequential` (default) runs the prompt through the decode step token by token (no host sync); `parallel` calls
`mk.perf.prefill` (all positions at once). `--loop host` is the per-token host loop
(`mk.model.reference.generate`: prefill_s there includes compiling the step); multi-process runs
and `--speculative` use it by default. `--speculative K --loop device` drafts, verifies, accepts
and rolls back on the device (`mk.kernel.speculative.device_generate`); its --json reports
row_mean_acceptance_lengths instead of every step's.

Weights: `mk.model.params.init(config, seed)` for `--config` (a preset name or a checkpoint directory's
config), or the tensors of `--checkpoint DIR`. `--backend kernel` runs the megakernel
(`mk.kernel.step.make_step_fn`) with the reference's caches; `reference` (default) the pure-JAX step.
`--speculative K` decodes speculatively (`mk.kernel.speculative`, spec 4.3): K drafts per step from
`--drafter DIR` (a drafter checkpoint, see `mk synth --drafter`; default: a random drafter from
`mk.model.drafter.config_for(config)` and --seed), verified as 1 + K rows of one step, on the reference
or, with `--backend kernel [--mesh N]`, in the megakernel (`mk.kernel.step.KernelVerifier`: per-row
KDA states, rollback by state_row, the drafter's aux rows copied out by the kernel);
`--json` adds acceptance lengths, tokens per step and the measured tokens/s (on this host's
device, named in `device`). `--fixed-acceptance-length L` forces L - 1 accepted drafts per step
(speed at a chosen acceptance length, on either loop; the tokens are then not meaningful, and the
output's "note" says so: on stderr, or in the --json object).
Bad input exits 2 with a one-line message.
"""
from __future__ import annotations

import importlib
import json
import math
import sys

from mk.cli.common import (CountingStep, Timeline, add_cache_option, add_step_options, check_vocab, nonnegative_int,
                           on_terminal, progress, step_options, token_ids, use_cache)
from mk.errors import UserError

DEFAULT_CONFIG = "mini"
DEFAULT_CHUNK = 16                 # mk.model.loop.DEFAULT_CHUNK (not imported: the parser loads no JAX)
PREFILL_MODES = ("sequential", "parallel")


class GenerateError(UserError):
    """A `generate` option that cannot be run; the message names the option."""


class PromptError(GenerateError):
    """A prompt that is not a list of token ids of the model's vocabulary."""


class BackendError(GenerateError):
    """A backend or optional module that this build does not provide."""


def parse_token_list(text: str, option: str = "--prompt-tokens") -> list[int]:
    """'1,2,3' (commas and/or spaces) -> [1, 2, 3]."""
    try:
        return token_ids(text, option)
    except UserError as e:
        raise PromptError(str(e)) from None


def _optional_module(name: str, why: str):
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name == name:
            raise BackendError(f"{why} needs {name}, which this build does not have yet") from None
        raise


def _loop(args) -> str:
    """The loop a run uses: --loop, else host for --speculative and multi-process runs, else device."""
    if args.loop is not None:
        return args.loop
    return "host" if args.speculative is not None or args.coordinator is not None else "device"


def _check_options(args):
    if args.chunk < 1:
        raise GenerateError(f"--chunk must be at least 1 step, found {args.chunk}")
    loop = _loop(args)
    if loop == "device" and args.coordinator is not None:
        raise GenerateError("--coordinator (multi-process) runs on the host loop; drop --loop device")
    if loop == "host" and args.prefill != "sequential":
        raise GenerateError(f"--prefill {args.prefill} needs the device loop (drop --loop host)")
    if args.max_new_tokens < 1:
        raise GenerateError(f"--max-new-tokens must be at least 1, found {args.max_new_tokens}")
    if args.batch < 1:
        raise GenerateError(f"--batch must be at least 1, found {args.batch}")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise GenerateError(f"--temperature must be >= 0 (0 = greedy), found {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise GenerateError(f"--top-p must lie in (0, 1], found {args.top_p}")
    if args.ctx is not None and (args.ctx <= 0 or args.ctx % 128):
        raise GenerateError(f"--ctx must be a positive multiple of 128, found {args.ctx}")
    if args.experts == "mxfp4" and (args.backend != "kernel" or args.checkpoint is not None):
        raise GenerateError("--experts mxfp4 draws random MXFP4 experts for --backend kernel (a checkpoint brings "
                            "its own format)")
    if args.checkpoint is not None and args.config is not None:
        raise GenerateError("give --config or --checkpoint, not both (a checkpoint brings its own config)")
    if args.prompt is not None and args.checkpoint is None:
        raise GenerateError("--prompt needs --checkpoint DIR (the tokenizer lives in the checkpoint); "
                            "use --prompt-tokens with random weights")
    if (args.prompt is None) == (args.prompt_tokens is None):
        raise GenerateError("give exactly one of --prompt-tokens IDS or --prompt TEXT")
    if args.speculative is None:
        for option, value in (("--drafter", args.drafter), ("--fixed-acceptance-length", args.fixed_acceptance_length)):
            if value is not None:
                raise GenerateError(f"{option} needs --speculative K")
    else:
        from mk.kernel.speculative import check_k
        check_k(args.speculative, args.batch)
        if args.coordinator is not None:
            raise GenerateError("--speculative runs in one process (no --coordinator yet)")
        if args.mesh is not None and args.backend != "kernel":
            raise GenerateError("--speculative --mesh N runs on --backend kernel (the sharded reference has no "
                                "verify step)")
        from mk.kernel.speculative import check_fixed_acceptance
        check_fixed_acceptance(args.fixed_acceptance_length, args.speculative)


def _model_config(args):
    if args.checkpoint is None:
        from mk.model.config import get_config
        return get_config(args.config or DEFAULT_CONFIG)
    return _optional_module("mk.io.checkpoint", "--checkpoint").load_config(args.checkpoint)


def _prompt(args, cfg, tokenizer) -> list[int]:
    if args.prompt is not None:
        tokens = tokenizer.encode(args.prompt, allow_special=True)
        if not tokens:
            raise PromptError("--prompt: the text encodes to no tokens")
        option = "--prompt"
    else:
        tokens = parse_token_list(args.prompt_tokens)
        option = "--prompt-tokens"
    try:
        check_vocab(tokens, cfg.vocab, option)
    except UserError as e:
        raise PromptError(str(e)) from None
    return tokens


def _step_fn(args, params, cfg, ctx, mesh=None):
    if args.backend == "reference":
        return None
    kernel = _optional_module("mk.kernel.step", "--backend kernel")
    make = getattr(kernel, "make_step_fn", None)
    if make is None:
        raise BackendError("--backend kernel needs mk.kernel.step.make_step_fn, which this build does not have yet")
    return make(params, cfg, args.batch, ctx=ctx, **({} if mesh is None else {"mesh": mesh}), **step_options(args))


def _weights(args, cfg, ctx, mesh):
    """(params, step_fn): the weights (random, or the checkpoint's) on the device, and for --backend
    kernel packed for the kernel (`_step_fn`); returns once they are there."""
    import jax
    if args.checkpoint is not None:
        ckpt = _optional_module("mk.io.checkpoint", "--checkpoint")
        # the kernel streams the checkpoint's MXFP4 experts packed; the reference computes in bf16
        experts = "mxfp4" if args.backend == "kernel" else "bf16"
        params = (ckpt.load(args.checkpoint, progress=on_terminal(not args.json), experts=experts) if mesh is None
                  else ckpt.load_sharded(args.checkpoint, mesh, progress=on_terminal(not args.json), experts=experts))
    else:
        from mk.model.params import init, init_fast
        params = init(cfg, args.seed) if args.experts == "bf16" else init_fast(cfg, args.seed, "mxfp4")
        if mesh is not None:
            from mk.model.reference_sharded import shard_params
            params = shard_params(params, mesh)
    if mesh is None or args.backend == "kernel":
        step_fn = _step_fn(args, params, cfg, ctx, None if mesh is None else mesh.size)
    else:                                                   # the sharded reference over the mesh
        from mk.model.reference_sharded import step_fn_for
        step_fn = step_fn_for(cfg, mesh)
    jax.block_until_ready(params)
    return params, step_fn


def run(args) -> int:
    _check_options(args)
    cfg = _model_config(args)
    tokenizer = None
    if args.prompt is not None:                          # text in, text out
        tokenizer = _optional_module("mk.io.tokenizer", "--prompt").Tokenizer(args.checkpoint)
    prompt = _prompt(args, cfg, tokenizer)
    total = len(prompt) + args.max_new_tokens

    import numpy as np
    from mk.model import reference

    ctx = args.ctx or max(reference.DEFAULT_CTX, -(-total // 128) * 128)
    if total > ctx:
        raise GenerateError(f"prompt ({len(prompt)} tokens) + --max-new-tokens ({args.max_new_tokens}) "
                            f"= {total} exceed --ctx {ctx}")
    clock = Timeline()
    args.clock, args.cache = clock, use_cache(args)
    import jax
    jax.devices()
    if args.speculative is not None:
        clock.mark("setup_s")
        return _run_speculative(args, cfg, prompt, tokenizer)
    from mk.cli.distributed import is_main_process, mesh_from_args
    mesh = mesh_from_args(args, cfg, args.backend)          # None: one device
    clock.mark("setup_s")
    from mk.model import compile_cache
    with compile_cache.counting() as args.weights_programs:        # --json: programs.weights
        params, step_fn = _weights(args, cfg, ctx, mesh)
    clock.mark("weights_s")
    stop_ids = tuple(tokenizer.eos_ids) if tokenizer is not None else ()
    fields = {"backend": args.backend, "config": args.checkpoint or args.config or DEFAULT_CONFIG,
              "mesh": None if mesh is None else mesh.size, "batch": args.batch, "ctx": ctx,
              "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_p": args.top_p,
              "seed": args.seed, "loop": _loop(args)}
    if _loop(args) == "device":
        return _run_device_loop(args, cfg, params, step_fn, prompt, tokenizer, stop_ids, ctx, fields)
    bar = None
    if step_fn is not None:       # the kernel (interpret mode on CPU) takes seconds per token
        bar = progress(desc=f"generate ({args.backend})", total=total - 1, unit="step",
                       enabled=not args.json)
        step_fn = CountingStep(step_fn, bar)
    try:
        res = reference.generate(params, cfg, np.tile(np.asarray(prompt, np.int32), (args.batch, 1)),
                                 args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                                 seed=args.seed, ctx=ctx, step_fn=step_fn, stop_ids=stop_ids)
    finally:
        if bar is not None:
            bar.close()
    if not is_main_process():                               # multi-process: process 0 reports
        return 0
    return _print_result(args, res, prompt, tokenizer, fields)


class _Stream:
    """Prints one row's tokens as chunks arrive: ids space separated, or with a tokenizer the text
    (each chunk prints what the row's decoded text gained), then a newline at `close`."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.text = tokenizer, [], ""

    def __call__(self, chunk):
        new = [int(t) for t in chunk[0] if t >= 0]
        if not new:
            return
        if self.tokenizer is None:
            sys.stdout.write(("" if not self.ids else " ") + " ".join(map(str, new)))
        self.ids += new
        if self.tokenizer is not None:
            text = self.tokenizer.decode(self.ids)
            sys.stdout.write(text[len(self.text):] if text.startswith(self.text) else "\n" + text)
            self.text = text
        sys.stdout.flush()

    def close(self):
        sys.stdout.write("\n")
        sys.stdout.flush()


def _run_device_loop(args, cfg, params, step_fn, prompt, tokenizer, stop_ids, ctx, fields) -> int:
    """Decode with mk.model.loop; one row streams to stdout, more print when done."""
    import numpy as np
    from mk.cli.distributed import is_main_process
    from mk.model import loop

    try:
        step = loop.loop_step_of(step_fn, params, cfg)
        stream = _Stream(tokenizer) if args.batch == 1 and not args.json and is_main_process() else None
        res = loop.generate(step, cfg, np.tile(np.asarray(prompt, np.int32), (args.batch, 1)), args.max_new_tokens,
                            sampling=loop.Sampling(args.temperature, args.top_p, stop_ids), seed=args.seed, ctx=ctx,
                            chunk=args.chunk, prefill=_prefill(args.prefill), params=params, on_tokens=stream)
    except loop.LoopError as e:
        raise GenerateError(str(e)) from None
    if stream is not None:
        stream.close()
    if not is_main_process():
        return 0
    extra = {k: res[k] for k in ("compile_s", "ttft_s", "prefill_tokens_per_s", "chunk", "chunks", "decode_steps",
                                 "in_clock")}
    extra["programs"] = {"weights": args.weights_programs.as_dict(), "rehearsal": res["rehearsal"]}
    return _print_result(args, dict(res, tokens=loop.rows(res)), prompt, tokenizer,
                         dict(fields, prefill=args.prefill, **extra), printed=stream is not None)


def _timeline(args, res: dict) -> dict:
    """The run's timeline (`Timeline`: setup_s, weights_s, then compile_s, ttft_s and decode_s as the
    loop timed them, total_s) and the compile cache's info (None: off); its line goes to stderr."""
    from mk.model import compile_cache
    for name in ("compile_s", "ttft_s", "decode_s"):
        if res.get(name) is not None:
            args.clock.add(name, res[name])
    cache = args.cache and compile_cache.info(args.cache["dir"])          # as the run left it
    print(args.clock.line(cache), file=sys.stderr)
    return {"timeline": args.clock.as_dict(), "cache": cache}


def _record(args, res: dict, prompt, fields: dict) -> dict:
    """The --json output's "record" (`mk.perf.results.provenance`: commit, date, chip, command), kind
    "generate_command": what the command measured, keyed by what changes it."""
    from mk.perf.results import provenance
    key = {"config": fields.get("config"), "backend": args.backend, "experts": args.experts, "batch": args.batch,
           "prompt_tokens": len(prompt), "max_new_tokens": args.max_new_tokens, "loop": fields.get("loop"),
           "prefill": args.prefill, "speculative": args.speculative,
           "fixed_acceptance_length": args.fixed_acceptance_length, "mesh": fields.get("mesh")}
    t = fields["timeline"]
    after = t["total_s"] - t.get("setup_s", 0.0)
    summary = (f"{res['tokens_per_s']:.1f} tok/s decoding, ttft {res.get('ttft_s', res['prefill_s']):.3f} s; "
               f"{after:.1f} s after setup (weights {t.get('weights_s', 0):.1f} s, compile {t.get('compile_s', 0):.1f} s)")
    return provenance("generate_command", key, summary, argv=getattr(args, "argv", None))


def _print_result(args, res: dict, prompt, tokenizer, fields: dict, printed: bool = False) -> int:
    """Print the generated rows (and their text), or with --json one object: tokens, prompt,
    timings from `res`, then `fields`, the timeline and the cache (`_timeline`, whose line goes to
    stderr either way). printed: the rows were streamed already."""
    rows = [[int(t) for t in row] for row in res["tokens"]]
    texts = [tokenizer.decode(row) for row in rows] if tokenizer is not None else None
    fields = dict(fields, **_timeline(args, res))
    if args.json:
        out = {"record": _record(args, res, prompt, fields), "tokens": rows, "prompt_tokens": prompt,
               "prefill_s": res["prefill_s"], "decode_s": res["decode_s"], "tokens_per_s": res["tokens_per_s"],
               **fields}
        if texts is not None:
            out["text"] = texts
        print(json.dumps(out))
    elif not printed:
        for i, row in enumerate(rows):
            print(" ".join(map(str, row)))
            if texts is not None:
                print(texts[i])
    sys.stdout.flush()
    return 0


def _run_speculative(args, cfg, prompt, tokenizer) -> int:
    import jax
    import numpy as np
    from mk.model import drafter as mkdrafter
    from mk.kernel import speculative

    if args.drafter is not None:                            # validated before the target's weights load
        dcfg, weights = mkdrafter.load(args.drafter, cfg)
    else:
        dcfg = mkdrafter.config_for(cfg)
        weights = mkdrafter.init(dcfg, args.seed)
    if args.checkpoint is not None:
        # the kernel streams the checkpoint's MXFP4 experts packed; the reference computes in bf16
        experts = "mxfp4" if args.backend == "kernel" else "bf16"
        params = _optional_module("mk.io.checkpoint", "--checkpoint").load(
            args.checkpoint, progress=on_terminal(not args.json), experts=experts)
    else:
        from mk.model.params import init
        params = init(cfg, args.seed)
    ctx = speculative.context_for(len(prompt), args.max_new_tokens, args.speculative, args.ctx)
    verifier = None
    if args.backend == "kernel":
        kernel = _optional_module("mk.kernel.step", "--backend kernel")
        verifier = kernel.KernelVerifier(params, cfg, args.batch, args.speculative, dcfg.aux_layers, ctx=ctx,
                                         mesh=args.mesh, **step_options(args))
    args.clock.mark("weights_s")
    rows = np.tile(np.asarray(prompt, np.int32), (args.batch, 1))
    drafter = mkdrafter.DSparkDrafter(dcfg, weights)
    stream = None
    if _loop(args) == "device":
        stream = _Stream(tokenizer) if args.batch == 1 and not args.json else None
        res = speculative.device_generate(params, cfg, rows, args.max_new_tokens, drafter, args.speculative,
                                          temperature=args.temperature, top_p=args.top_p, seed=args.seed, ctx=ctx,
                                          verifier=verifier, chunk=args.chunk, on_tokens=stream,
                                          stop_ids=tuple(tokenizer.eos_ids) if tokenizer is not None else (),
                                          fixed_acceptance=args.fixed_acceptance_length)
        if stream is not None:
            stream.close()
        res = dict(res, tokens=[[int(t) for t in r[:n]] for r, n in zip(res["tokens"], res["lengths"])])
        extra = {"chunk": res["chunk"], "chunks": res["chunks"], "row_mean_acceptance_lengths": res["acceptance"],
                 "compile_s": res["compile_s"], "in_clock": res["in_clock"]}
    else:
        res = speculative.generate(params, cfg, rows, args.max_new_tokens, drafter, args.speculative,
                                   temperature=args.temperature, top_p=args.top_p, seed=args.seed, ctx=ctx,
                                   fixed_acceptance=args.fixed_acceptance_length, verifier=verifier)
        extra = {"acceptance_lengths": res["acceptance"], "compile_s": res["compile_s"],
                 "prefill_in_clock": res["prefill_in_clock"]}
    if args.fixed_acceptance_length is not None and not args.json:
        print(f"note: {speculative.FIXED_NOTE}", file=sys.stderr)
    return _print_result(args, res, prompt, tokenizer, {
        **({"note": speculative.FIXED_NOTE} if args.fixed_acceptance_length is not None else {}),
        "device": jax.devices()[0].platform,
        "speculative": args.speculative, "drafter": args.drafter,
        "fixed_acceptance_length": args.fixed_acceptance_length,
        "loop": _loop(args), **extra, "mean_acceptance_length": res["mean_acceptance"],
        "tokens_per_step": res["tokens_per_step"], "steps": res["steps"],
        "backend": args.backend, "config": args.checkpoint or args.config or DEFAULT_CONFIG,
        "mesh": args.mesh, "batch": args.batch, "ctx": res["ctx"], "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature, "top_p": args.top_p, "seed": args.seed}, printed=stream is not None)



def _prefill(mode: str):
    """The device loop's prefill: "sequential", or the parallel prefill's module (`mk.perf.prefill`)."""
    if mode == "parallel":
        from mk.perf import prefill
        return prefill
    return mode

def add_parser(subparsers):
    p = subparsers.add_parser("generate", help="generate tokens (random weights or a checkpoint)",
                              description=__doc__.splitlines()[0])
    p.add_argument("--config", default=None,
                   help=f"preset name or checkpoint directory whose config to use with random weights "
                        f"(default {DEFAULT_CONFIG})")
    p.add_argument("--checkpoint", metavar="DIR", help="load weights (and tokenizer) from a checkpoint")
    p.add_argument("--seed", type=nonnegative_int, default=0, help="random-weight and sampling seed (default 0)")
    p.add_argument("--prompt-tokens", metavar="IDS", help="prompt as comma-separated token ids, e.g. 1,2,3")
    p.add_argument("--prompt", metavar="TEXT", help="prompt text (needs --checkpoint for the tokenizer)")
    p.add_argument("--max-new-tokens", type=int, default=16, help="tokens to generate per row (default 16)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass kept when sampling (default 1)")
    p.add_argument("--batch", type=int, default=1, help="rows, each a copy of the prompt (default 1)")
    p.add_argument("--ctx", type=int, default=None,
                   help="cache capacity, a multiple of 128 (default: >= 256, enough for the run)")
    p.add_argument("--backend", choices=("reference", "kernel"), default="reference")
    p.add_argument("--experts", choices=("bf16", "mxfp4"), default="bf16",
                   help="random weights' routed experts: bf16, or packed MXFP4 (--backend kernel; "
                        "mk.model.params.init_fast, drawn on the device)")
    p.add_argument("--json", action="store_true", help="print tokens and timings as one JSON object")
    p.add_argument("--speculative", type=int, default=None, metavar="K",
                   help="speculative decoding with K drafts per step (either backend)")
    p.add_argument("--drafter", metavar="DIR", default=None,
                   help="drafter checkpoint for --speculative (default: random drafter weights from --seed)")
    p.add_argument("--fixed-acceptance-length", type=int, default=None, metavar="L",
                   help="--speculative: accept L - 1 drafts every step (speed only; tokens not meaningful)")
    p.add_argument("--chunk", type=int, default=DEFAULT_CHUNK, metavar="N",
                   help=f"decode steps per device dispatch (default {DEFAULT_CHUNK}); the host reads a chunk's "
                        "tokens while the next runs")
    p.add_argument("--loop", choices=("device", "host"), default=None,
                   help="device: chunks of --chunk steps on the device (default); host: one dispatch and one "
                        "sync per token (the default for --speculative and multi-process runs; "
                        "--speculative K --loop device verifies on the device)")
    p.add_argument("--prefill", choices=PREFILL_MODES, default="sequential",
                   help="sequential: the prompt through the decode step, token by token, without a host sync "
                        "(default); parallel: mk.perf.prefill, all positions at once")
    add_step_options(p)
    add_cache_option(p)
    from mk.cli.distributed import add_distributed_args
    add_distributed_args(p, mesh=False)
    p.set_defaults(func=run)
    return p
