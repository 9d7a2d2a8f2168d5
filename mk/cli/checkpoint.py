"""Checkpoint commands: `synth` (write a synthetic checkpoint), `logits` (teacher-forced logits of a
checkpoint), `load` (load it, optionally benchmarking against a raw sequential read).

    python -m mk synth --config mini [--override dim=1024,layers=16] --out DIR [--seed N] [--shard-mb M] [--fast]
    python -m mk logits --checkpoint DIR --tokens 5,17,3 --out FILE.npy [--backend reference|kernel]
    python -m mk load DIR [--experts bf16|mxfp4] [--bench] [--json]

`--config` is a preset name or a checkpoint directory; `--override KEY=VALUE[,KEY=VALUE...]`
(repeatable) replaces K3Config fields, values parsed as JSON (`full_attention=[3,7,15]`).
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import statistics
import time

from mk.cli.common import (CountingStep, add_step_options, check_vocab, nonnegative_int, on_terminal, step_options,
                           positive_float, positive_int, progress, token_ids)
from mk.model.config import ConfigError
from mk.errors import UserError, creatable_dir, writable_path


def parse_overrides(items) -> dict:
    """["dim=1024,layers=16", "full_attention=[3,7]"] -> {"dim": 1024, "layers": 16, ...}."""
    from mk.model.config import K3Config

    fields = {f.name for f in dataclasses.fields(K3Config)}
    out = {}
    for item in items or ():
        for part in re.split(r",(?![^\[\(]*[\]\)])", item):
            if not part.strip():
                continue
            key, sep, value = part.partition("=")
            key = key.strip()
            if not sep:
                raise ConfigError(f"--override: expected KEY=VALUE, found {part!r}")
            if key not in fields:
                raise ConfigError(f"--override: unknown K3Config field '{key}' (fields: {', '.join(sorted(fields))})")
            try:
                v = json.loads(value.replace("(", "[").replace(")", "]"))
            except json.JSONDecodeError:
                raise ConfigError(f"--override: value of '{key}' is not a number or list: {value!r}") from None
            out[key] = tuple(v) if isinstance(v, list) else v
    return out


def resolve_config(name: str, overrides=()):
    from mk.model.config import get_config

    cfg = get_config(name)
    kw = parse_overrides(overrides)
    return cfg.replace(**kw) if kw else cfg


def _synth(args) -> int:
    from mk.io.checkpoint import checkpoint_bytes
    from mk.io.synth import write_checkpoint, write_random_checkpoint

    cfg = resolve_config(args.config, args.override)
    creatable_dir(args.out, "--out")
    t = time.perf_counter()
    if args.drafter:
        from mk.model import drafter
        dcfg = drafter.config_for(cfg)
        drafter.write(dcfg, args.out, seed=args.seed)
        print(f"wrote drafter {args.out} in {time.perf_counter() - t:.1f} s (hidden={dcfg.hidden}, "
              f"layers={dcfg.layers}, aux layers={list(dcfg.aux_layers)}, vocab={dcfg.vocab})")
        return 0
    shard_bytes, show = int(args.shard_mb * (1 << 20)), on_terminal(not args.no_progress)
    if args.fast:
        write_random_checkpoint(cfg, args.out, seed=args.seed, shard_bytes=shard_bytes, threads=args.threads,
                                progress=show)
    else:
        write_checkpoint(cfg, args.out, seed=args.seed, shard_bytes=shard_bytes, progress=show)
    n = checkpoint_bytes(args.out)
    print(f"wrote {args.out}: {n / 1e9:.3f} GB in {time.perf_counter() - t:.1f} s "
          f"(dim={cfg.dim}, layers={cfg.layers}, experts={cfg.experts}, vocab={cfg.vocab})")
    return 0


def teacher_forced_fn(backend: str):
    """`teacher_forced_logits(params, cfg, tokens)` of the reference or the kernel backend."""
    import importlib

    module = "mk.model.reference" if backend == "reference" else "mk.kernel.step"
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        raise UserError(f"--backend {backend}: {module} is not available ({e})") from None
    fn = getattr(mod, "teacher_forced_logits", None)
    if fn is None:
        raise UserError(f"--backend {backend}: {module} has no teacher_forced_logits yet")
    return fn


def _logits(args) -> int:
    t0, rss0 = time.perf_counter(), rss_bytes()
    with RssSampler(enabled=args.bench) as sampler:
        rc = _logits_run(args)
    if args.bench and rc == 0:
        from mk.io.checkpoint import checkpoint_bytes
        n, peak = checkpoint_bytes(args.checkpoint), peak_rss_bytes()
        anon = sampler.peaks.get("RssAnon")
        device = device_memory()
        res = {"checkpoint": args.checkpoint, "backend": args.backend, "checkpoint_bytes": n,
               "peak_rss_bytes": peak, "peak_rss_over_checkpoint": peak / n, "rss_before_bytes": rss0,
               "peak_rss_by_kind": sampler.peaks, "peak_rss_anon_over_checkpoint": anon / n if anon else None,
               "device_peak_bytes": device.get("peak_bytes_in_use"), "device_limit_bytes": device.get("bytes_limit"),
               "seconds": time.perf_counter() - t0,
               "measured": "getrusage ru_maxrss of this process (load + pack + run), this host; by kind: "
                           f"/proc/self/status sampled every {sampler.interval * 1e3:.0f} ms (anonymous: the "
                           "process's own heap and maps; file and shmem: mapped files and shared memory, "
                           "e.g. a TPU runtime's); device: memory_stats() of the first device (none on a CPU)"}
        print(json.dumps(res) if args.json else
              f"peak RSS {peak / 1e9:.3f} GB = {peak / n:.2f}x the checkpoint's {n / 1e9:.3f} GB on disk "
              f"({args.backend} backend, {res['seconds']:.1f} s)")
    return rc


def _logits_run(args) -> int:
    import numpy as np
    from mk.io.checkpoint import load, load_config

    if (args.tokens is None) == (args.text is None):
        raise UserError("logits: give exactly one of --tokens or --text")
    # everything that can be wrong with the request is checked before the weights are read
    writable_path(args.out, "--out")
    tokens = token_ids(args.tokens, "--tokens") if args.tokens is not None else None
    fn = teacher_forced_fn(args.backend)
    cfg = load_config(args.checkpoint)
    if args.text is not None:
        from mk.io.tokenizer import Tokenizer
        tokens = Tokenizer(args.checkpoint).encode(args.text, allow_special=True)
        if not tokens:
            raise UserError("--text: the text encodes to no tokens")
    check_vocab(tokens, cfg.vocab, "--tokens" if args.text is None else "--text")
    from mk.cli.distributed import is_main_process, mesh_from_args
    mesh = mesh_from_args(args, cfg, args.backend)
    if mesh is not None and args.backend == "kernel":      # the sharded kernel on the mesh's devices
        params = load(args.checkpoint, progress=on_terminal(not args.no_progress), experts="mxfp4")
        with _kernel_steps_progress(len(tokens), enabled=not args.no_progress):
            logits = np.asarray(fn(params, cfg, tokens, mesh=mesh.size, **step_options(args)), np.float32)
        np.save(args.out, logits)
        print(f"wrote {args.out}: float32 logits {list(logits.shape)} (kernel on {mesh.size} devices)")
        return 0
    if mesh is not None:                                   # the sharded reference over the mesh
        from mk.model import reference_sharded
        from mk.io.checkpoint import load_sharded
        params = load_sharded(args.checkpoint, mesh, progress=on_terminal(not args.no_progress))
        logits = reference_sharded.teacher_forced_logits(params, cfg, tokens, mesh)
        if is_main_process():
            np.save(args.out, np.asarray(logits, np.float32))
            print(f"wrote {args.out}: float32 logits {list(logits.shape)} (reference on {mesh.size} devices)")
        return 0
    if args.backend == "kernel":
        # the kernel packs its tiles slot by slot as they are read (the loaded tree never exists);
        # MXFP4 experts stay packed (dequantized in VMEM)
        from mk.io.checkpoint import Checkpoint
        with Checkpoint(args.checkpoint) as ck, _kernel_steps_progress(len(tokens), enabled=not args.no_progress):
            logits = fn(ck.lazy_params(experts="mxfp4"), cfg, tokens, **step_options(args))
    else:                                                  # the reference reads bf16 experts
        params = load(args.checkpoint, progress=on_terminal(not args.no_progress), experts="bf16")
        logits = fn(params, cfg, tokens)
    logits = np.asarray(logits, np.float32)
    np.save(args.out, logits)
    print(f"wrote {args.out}: float32 logits {list(logits.shape)} ({args.backend})")
    return 0


class _kernel_steps_progress:
    """A progress bar over the kernel's decode steps while `mk.kernel.step.teacher_forced_logits` runs
    (interpret mode on CPU takes seconds per token): for the duration, `mk.kernel.step.make_step_fn`
    returns step functions that advance the bar. Without a `make_step_fn` (or off a terminal)
    nothing is wrapped."""

    def __init__(self, total: int, enabled: bool = True):
        self.total, self.enabled = total, enabled
        self.bar = self.module = self.original = None

    def __enter__(self):
        import sys as _sys
        module = _sys.modules.get("mk.kernel.step")
        original = getattr(module, "make_step_fn", None)
        if original is None:
            return self
        self.bar = progress(desc="logits (kernel)", total=self.total, unit="token", enabled=self.enabled)
        if self.bar.disable:
            return self
        bar = self.bar

        def make_step_fn(*a, **kw):
            return CountingStep(original(*a, **kw), bar)

        self.module, self.original = module, original
        module.make_step_fn = make_step_fn
        return self

    def __exit__(self, *exc):
        if self.module is not None:
            self.module.make_step_fn = self.original
        if self.bar is not None:
            self.bar.close()
        return False


def raw_read(files, chunk: int = 16 << 20) -> int:
    """Plain sequential read of the files into one reused buffer; returns the bytes read."""
    buf = bytearray(chunk)
    view = memoryview(buf)
    total = 0
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while True:
                n = fh.readinto(view)
                if not n:
                    break
                total += n
    return total


def drop_page_cache(files):
    """Evict the files from the page cache (all clean pages: needs write access to
    /proc/sys/vm/drop_caches, i.e. root)."""
    for f in files:
        with open(f, "rb") as fh:
            os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("1\n")
    except OSError as e:
        raise UserError(f"--cold: cannot drop the page cache ({e}); run as root or without --cold") from None


class RssSampler:
    """Peaks of this process's resident set by kind (/proc/self/status VmRSS, RssAnon, RssFile,
    RssShmem, in bytes), sampled by a thread every `interval` s while the block runs. A peak of
    the total says how much memory the process held; the kinds say whose: anonymous memory is the
    process's own (arrays, heap), file and shmem maps may be a runtime's (libtpu's on a TPU VM).
    `peaks` is {} where /proc is not there or `enabled` is false."""
    KINDS = ("VmRSS", "RssAnon", "RssFile", "RssShmem")

    def __init__(self, interval: float = 0.05, enabled: bool = True):
        self.interval, self.enabled, self.peaks = interval, enabled, {}

    @classmethod
    def read(cls) -> dict:
        out = {}
        try:
            with open("/proc/self/status") as fh:
                for line in fh:
                    key, _, rest = line.partition(":")
                    if key in cls.KINDS:
                        out[key] = int(rest.split()[0]) * 1024        # kB
        except OSError:
            pass
        return out

    def sample(self):
        for k, v in self.read().items():
            self.peaks[k] = max(self.peaks.get(k, 0), v)

    def _run(self):
        while not self._stop.wait(self.interval):
            self.sample()

    def __enter__(self):
        import threading
        if self.enabled:
            self.sample()
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        if self.enabled:
            self._stop.set()
            self._thread.join()
            self.sample()
        return False


def device_memory() -> dict:
    """The first device's memory statistics (`memory_stats()`: peak_bytes_in_use, bytes_limit, ...; {}
    where there are none, e.g. on a CPU)."""
    import jax
    return jax.devices()[0].memory_stats() or {}


def peak_rss_bytes() -> int:
    """This process's peak resident set so far (getrusage ru_maxrss; Linux counts KiB)."""
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rss_bytes() -> int:
    """This process's resident set now (/proc/self/statm; 0 where there is none)."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def bench_load(path, experts: str = "mxfp4", threads: int = 2, repeat: int = 1, cold: bool = False,
               show_progress: bool = False) -> dict:
    """Load time vs raw read time of the same shard files, page cache in the same (warm) state.

    Procedure (warm, the default): one untimed raw read of every shard (warms the page cache; the files must fit in
    RAM), then `repeat` x (timed raw read, timed load incl. validation, allocation and the
    hand-off to JAX, then release the tree). Reports the best of each (and all timings).
    The raw read reuses one 16 MiB buffer, so with a warm cache it runs at memcpy speed; the load
    must also write `output_bytes` of freshly allocated memory (page faults) and transpose /
    dequantize, so the ratio is a host-memory figure, not an I/O one. `cold=True` instead drops
    the page cache before each timed raw read and each timed load (storage-bound comparison).
    `ratio` compares the best of each; `ratio_per_repeat` pairs each raw read with the load that
    follows it (on a noisy VM the spread is the honest figure); `ratio_of_medians` is the median
    raw-read time over the median load time. `peak_rss_bytes`: the process's peak resident set
    (getrusage), against the checkpoint's bytes on disk (`peak_rss_over_checkpoint`);
    `rss_before_bytes` is what the process held before the first load (Python, JAX).
    """
    import gc

    import jax
    from mk.io.checkpoint import Checkpoint, abstract_params, load
    from mk.model.params import nbytes

    with Checkpoint(path) as ck:
        files = ck.shard_files
    total = raw_read(files)  # warm-up
    rss_before = rss_bytes()
    raw_s, load_s = [], []
    for _ in progress(range(repeat), desc="bench (raw read + load)", enabled=show_progress and repeat > 1,
                      unit="repeat"):
        if cold:
            drop_page_cache(files)
        t = time.perf_counter()
        raw_read(files)
        raw_s.append(time.perf_counter() - t)
        if cold:
            drop_page_cache(files)
        t = time.perf_counter()
        tree = load(path, experts=experts, progress=False, threads=threads)
        jax.block_until_ready(tree)
        load_s.append(time.perf_counter() - t)
        del tree
        gc.collect()
    r, s = min(raw_s), min(load_s)
    ratios = [a / b for a, b in zip(raw_s, load_s)]
    out_bytes = nbytes(abstract_params(path, experts=experts))
    peak = peak_rss_bytes()
    return {"path": os.fspath(path), "bytes": total, "shards": len(files), "experts": experts,
            "threads": threads, "seconds": s, "gb_per_s": total / s / 1e9,
            "raw_read_seconds": r, "raw_read_gb_per_s": total / r / 1e9,
            "ratio": (total / s) / (total / r), "output_bytes": out_bytes, "repeat": repeat,
            "seconds_all": load_s, "raw_read_seconds_all": raw_s,
            "ratio_per_repeat": ratios, "ratio_median": statistics.median(ratios),
            "ratio_of_medians": statistics.median(raw_s) / statistics.median(load_s),
            "peak_rss_bytes": peak, "rss_before_bytes": rss_before, "peak_rss_over_checkpoint": peak / total,
            "cache": ("cold: page cache dropped before each timed raw read and each timed load" if cold else
                      "warm: untimed raw read first, then per repeat a timed raw read and a timed load")}


def _load(args) -> int:
    import jax
    from mk.io.checkpoint import checkpoint_bytes, load

    if args.bench:
        res = bench_load(args.path, experts=args.experts, threads=args.threads, repeat=args.repeat,
                         cold=args.cold, show_progress=not args.no_progress)
    else:
        t = time.perf_counter()
        tree = load(args.path, experts=args.experts, threads=args.threads,
                    progress=on_terminal(not args.no_progress and not args.json))
        jax.block_until_ready(tree)
        s = time.perf_counter() - t
        n = checkpoint_bytes(args.path)
        res = {"path": args.path, "bytes": n, "seconds": s, "gb_per_s": n / s / 1e9,
               "experts": args.experts, "leaves": len(jax.tree.leaves(tree)),
               "peak_rss_bytes": peak_rss_bytes(), "peak_rss_over_checkpoint": peak_rss_bytes() / n}
    if args.json:
        print(json.dumps(res))
    else:
        line = f"loaded {res['path']}: {res['bytes'] / 1e9:.3f} GB in {res['seconds']:.2f} s ({res['gb_per_s']:.2f} GB/s)"
        if args.bench:
            line += (f"; raw sequential read {res['raw_read_gb_per_s']:.2f} GB/s; ratio {res['ratio']:.2f} "
                     f"(best of {res['repeat']}), median of per-repeat ratios {res['ratio_median']:.2f} "
                     f"({'cold' if args.cold else 'warm'} page cache)")
        print(line)
        print(f"peak RSS {res['peak_rss_bytes'] / 1e9:.3f} GB = {res['peak_rss_over_checkpoint']:.2f}x the "
              f"checkpoint's bytes on disk")
    return 0


def add_parser(subparsers):
    p = subparsers.add_parser("synth", help="write a synthetic checkpoint (random well-behaved weights)")
    p.add_argument("--config", default="mini", help="preset name or checkpoint directory (default mini)")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE[,KEY=VALUE]",
                   help="replace K3Config fields, e.g. dim=1024,layers=16 (repeatable)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--seed", type=nonnegative_int, default=0)
    p.add_argument("--drafter", action="store_true",
                   help="write a random drafter checkpoint for the config (mk.model.drafter) instead of the model")
    p.add_argument("--shard-mb", type=positive_float, default=256.0, help="maximum shard size in MiB")
    p.add_argument("--fast", action="store_true",
                   help="random weights drawn tensor by tensor in the checkpoint's layout, shards in parallel "
                        "(mk.io.synth.write_random_checkpoint): seconds per GB instead of minutes, for big "
                        "checkpoints; not the weights of mk.model.params.init")
    p.add_argument("--threads", type=positive_int, default=None, help="--fast: threads (default: one per CPU)")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=_synth)

    p = subparsers.add_parser("logits", help="teacher-forced logits [T, vocab] of a checkpoint")
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--tokens", help="comma-separated token ids, e.g. 5,17,3")
    p.add_argument("--text", help="text to encode with the checkpoint's tokenizer (instead of --tokens)")
    p.add_argument("--out", required=True, help=".npy file for the float32 logits")
    p.add_argument("--backend", choices=("reference", "kernel"), default="reference")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--bench", action="store_true",
                   help="then print the process's peak host RSS against the checkpoint's bytes on disk")
    p.add_argument("--json", action="store_true", help="--bench: print it as one JSON object (last line)")
    add_step_options(p)
    from mk.cli.distributed import add_distributed_args
    add_distributed_args(p, mesh=False)
    p.set_defaults(func=_logits)

    p = subparsers.add_parser("load", help="load a checkpoint (optionally benchmark the load)")
    p.add_argument("path", help="checkpoint directory")
    p.add_argument("--experts", choices=("bf16", "mxfp4"), default="mxfp4",
                   help="mxfp4 (default): routed experts stay packed, as the kernel reads them; bf16: "
                        "dequantized at load time (what the XLA reference reads)")
    p.add_argument("--bench", action="store_true", help="compare with a raw sequential read of the shards; "
                   "print the peak RSS")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--threads", type=positive_int, default=2)
    p.add_argument("--repeat", type=positive_int, default=1, help="--bench: report the best of N")
    p.add_argument("--cold", action="store_true",
                   help="--bench: evict the files from the page cache (fadvise DONTNEED + drop_caches) "
                        "before each timed read and each timed load (needs root)")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=_load)
