"""Pieces the commands share: argparse value types that reject bad values with a one-line message
naming the option (argparse adds it: `argument --batch: must be at least 1, found 0`), token-id
lists, output paths, and progress bars.

Options common to the decode-step commands (check, logits, generate, aot) are added by
`add_step_options`, so a new one (e.g. a device mesh) is added once for all of them.
"""
from __future__ import annotations

import argparse
import re

from mk.errors import UserError


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, found {text!r}") from None


def at_least(low: int):
    """argparse type: an integer >= low."""
    def parse(text: str) -> int:
        v = _int(text)
        if v < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, found {v}")
        return v
    parse.__name__ = f"integer >= {low}"
    return parse


positive_int = at_least(1)
nonnegative_int = at_least(0)


def ctx_int(text: str) -> int:
    """argparse type: a cache capacity, a positive multiple of 128."""
    v = _int(text)
    if v <= 0 or v % 128:
        raise argparse.ArgumentTypeError(f"must be a positive multiple of 128, found {v}")
    return v


def positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, found {text!r}") from None
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, found {text}")
    return v


def int_list(text: str, option: str, low: int = 1) -> list[int]:
    """'4,24' -> [4, 24]; each at least `low` (UserError naming `option` otherwise)."""
    parts = [t for t in re.split(r"[,\s]+", text.strip()) if t]
    try:
        out = [int(t) for t in parts]
    except ValueError:
        raise UserError(f"{option}: expected comma-separated integers, found {text!r}") from None
    if not out:
        raise UserError(f"{option}: no values given")
    bad = [v for v in out if v < low]
    if bad:
        raise UserError(f"{option}: values must be at least {low}, found {bad[0]}")
    return out


def token_ids(text: str, option: str) -> list[int]:
    """'1,2,3' (commas and/or spaces) -> [1, 2, 3]. The vocabulary bound (negative ids too) is
    checked by `check_vocab` once the config is known, before any weights are read."""
    parts = [t for t in re.split(r"[,\s]+", text.strip()) if t]
    try:
        tokens = [int(t) for t in parts]
    except ValueError:
        raise UserError(f"{option}: expected comma-separated integer token ids, found {text!r}") from None
    if not tokens:
        raise UserError(f"{option}: no token ids given")
    return tokens


def check_vocab(tokens, vocab: int, option: str) -> None:
    bad = [t for t in tokens if not 0 <= t < vocab]
    if bad:
        raise UserError(f"{option}: token id {bad[0]} outside the vocabulary [0, {vocab})"
                        + (f" ({len(bad)} ids out of range)" if len(bad) > 1 else ""))


def add_step_options(p) -> None:
    """Options every decode-step command (check, logits, generate, aot) takes."""
    p.add_argument("--mesh", type=positive_int, default=None, metavar="N",
                   help="split the step over N devices (mk.model.sharding's rule). On a TPU: the first N "
                        "devices, compiled; on CPU: N virtual devices in TPU interpret mode (set up "
                        "automatically); for aot: the first N cores of --topology. Default: one device "
                        "(all devices of a multi-process job)")
    p.add_argument("--all-reduce", choices=("one_round", "two_round"), default="one_round",
                   help="the kernel's all-reduces: one round (every rank sends its whole message to every "
                        "peer) or two (reduce-scatter, then all-gather of the sums: fewer bytes, two hops); "
                        "`mk simulate` names the faster for the seed's system")
    p.add_argument("--mxfp4-matmul", choices=("bf16", "fp8"), default="bf16",
                   help="how the kernel's MXFP4 experts meet the MXU: 'bf16' (unpacked to bf16 in registers) or "
                        "'fp8' (codes to e4m3, a block-diagonal LHS, 32-row group partials scaled and summed: "
                        "spec 3.5)")
    p.add_argument("--mxfp4-unpack", choices=("auto", "pairs", "pairs_mul", "shift", "bitcast"), default="auto",
                   help="how the kernel unpacks MXFP4 codes: 'pairs' (two bf16 patterns per 32-bit integer op, "
                        "every TPU), 'pairs_mul' (the same with integer multiplies, fewer ops), 'shift' (integer shifts and masks into f32, every TPU), "
                        "'bitcast' (the fp4 unpack, TPU v7 only), 'auto' (the chip's: bitcast on TPU v7 and in "
                        "interpret mode, pairs elsewhere)")


def step_options(args) -> dict:
    """The kernel's `make_plan` keywords from `add_step_options`' flags: {"options": ScheduleOptions}."""
    import dataclasses
    from mk.kernel.plan import MK
    return {"options": dataclasses.replace(MK, all_reduce=args.all_reduce, mxfp4_matmul=args.mxfp4_matmul,
                                           mxfp4_unpack=args.mxfp4_unpack)}


def use_virtual_devices(n: int | None) -> None:
    """On a CPU-only run, ask XLA for at least n virtual CPU devices (before JAX starts)."""
    import os
    if not n or n <= 1 or os.environ.get("JAX_PLATFORMS", "cpu") not in ("cpu", ""):
        return
    flags = os.environ.get("XLA_FLAGS", "")
    m = re.search(r"--xla_force_host_platform_device_count=(\d+)", flags)
    if m and int(m.group(1)) >= n:
        return
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", flags)
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def on_terminal(wanted: bool = True) -> bool:
    """Whether to draw progress for library calls that take a plain `progress=` flag: only when
    wanted and stderr is a terminal (a pipe or a log file gets no carriage-return spam)."""
    import sys
    return bool(wanted) and sys.stderr.isatty()


def progress(iterable=None, *, desc: str, total: int | None = None, enabled: bool = True, **kw):
    """A tqdm bar on stderr, shown only on a terminal (`disable=None`) and when `enabled`; stdout
    (and any JSON on it) stays clean."""
    from tqdm.auto import tqdm
    return tqdm(iterable, desc=desc, total=total, leave=False, disable=None if enabled else True, **kw)


class CountingStep:
    """Wraps a `step_fn(params, cache, tokens)` so each call advances a progress bar; attributes
    (e.g. `.plan`) pass through."""

    def __init__(self, step_fn, bar):
        self._fn, self._bar = step_fn, bar

    def __call__(self, *args, **kw):
        out = self._fn(*args, **kw)
        self._bar.update(1)
        return out

    def __getattr__(self, name):
        return getattr(self._fn, name)


def add_cache_option(p) -> None:
    """--no-cache, for the commands that keep compiled programs in mk's cache (`use_cache`)."""
    p.add_argument("--no-cache", action="store_true",
                   help="do not use the persistent compile cache (default: on, in $MK_CACHE_DIR, else "
                        "$XDG_CACHE_HOME/mk/jax or ~/.cache/mk/jax; docs/cli.md says what invalidates it)")


def use_cache(args) -> dict | None:
    """Turn JAX's persistent compilation cache on unless --no-cache (`mk.model.compile_cache.enable`:
    an unwritable directory warns in one line and runs uncached). Returns its info, or None (off)."""
    if getattr(args, "no_cache", False):
        return None
    from mk.model import compile_cache
    return compile_cache.enable()


class Timeline:
    """Where a command's seconds went, from mk's start (`mk.STARTED`): `mark(name)` closes a phase
    at now; `add(name, seconds)` records one timed inside a library call. `as_dict()` gives the
    phases in order and total_s (mk's start to now); `line()` the same in one line for stderr."""

    def __init__(self):
        import time
        import mk
        self._now, self._start, self._last, self.phases = time.perf_counter, mk.STARTED, mk.STARTED, {}

    def mark(self, name: str) -> None:
        now = self._now()
        self.phases[name], self._last = now - self._last, now

    def add(self, name: str, seconds: float) -> None:
        self.phases[name] = seconds

    def as_dict(self) -> dict:
        return {**self.phases, "total_s": self._now() - self._start}

    def line(self, cache: dict | None) -> str:
        from mk.model.compile_cache import describe
        parts = [f"{k.removesuffix('_s')} {v:.2f} s" for k, v in self.as_dict().items()]
        return "timeline: " + ", ".join(parts) + f"; {describe(cache)}"
