"""JAX's persistent compilation cache, set up in one place, and a count of what JAX compiles.

    info = compile_cache.enable()          # before the first compile; None: the run is uncached
    with compile_cache.counting() as n:    # n.compiles, n.traces: what happened inside the block
        ...

`enable` points `jax_compilation_cache_dir` at `default_dir()` (`$MK_CACHE_DIR`, else
`$XDG_CACHE_HOME/mk/jax`, else `~/.cache/mk/jax`) and stores every executable, however quick its
compile or small its entry (JAX's defaults skip compiles under 1 s, and mk's small programs add up).
A second process that compiles the same program (same HLO, compile options, devices, and jax and
libtpu versions: JAX's cache key) loads it from disk instead. A directory that cannot be written is
one warning line on stderr, and the run goes on uncached. `mk generate`, `mk bench`, `mk check` and
the notebooks' runner (through `environment`, for the papermill kernels) call it; `--no-cache` skips it.
"""
from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from pathlib import Path

ENV = "MK_CACHE_DIR"

# JAX's flags for the cache, and mk's values: every compile, every entry size (-1: no floor).
SETTINGS = {"jax_persistent_cache_min_compile_time_secs": 0, "jax_persistent_cache_min_entry_size_bytes": -1}

# jax.monitoring events: BACKEND_COMPILE fires for every jit-cache miss that reaches XLA (a compile,
# or a load from the persistent cache, which CACHE_HIT marks too); TRACE for every trace to a jaxpr.
BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
CACHE_HIT = "/jax/compilation_cache/cache_hits"
TRACE = "/jax/core/compile/jaxpr_trace_duration"


def default_dir() -> Path:
    """Where mk keeps compiled programs: $MK_CACHE_DIR, else $XDG_CACHE_HOME/mk/jax, else ~/.cache/mk/jax."""
    if os.environ.get(ENV):
        return Path(os.environ[ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "mk" / "jax"


def writable(path: Path) -> str | None:
    """None if `path` (created if missing) takes a file, else why not."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".probe-"):
            pass
    except OSError as e:
        return e.strerror or str(e)
    return None


def usable(path: str | os.PathLike | None = None) -> Path | None:
    """`path` (default `default_dir()`) if it can hold the cache, else None after one warning line on
    stderr (the run goes on uncached)."""
    path = Path(path).expanduser() if path is not None else default_dir()
    why = writable(path)
    if why is not None:
        print(f"warning: compile cache {path} not writable ({why}); running uncached", file=sys.stderr)
        return None
    return path


def enable(path: str | os.PathLike | None = None) -> dict | None:
    """Turn JAX's persistent compilation cache on at `path` (default `default_dir()`), before the
    first compile. Returns `info(path)`, or None where it is not `usable` (uncached)."""
    import jax

    path = usable(path)
    if path is None:
        return None
    jax.config.update("jax_compilation_cache_dir", str(path))
    for name, value in SETTINGS.items():
        jax.config.update(name, value)
    return info(path)


def environment(path: str | os.PathLike | None = None) -> dict[str, str]:
    """The environment variables that turn the same cache on in a child process (a notebook kernel);
    {} where it is not `usable`."""
    path = usable(path)
    if path is None:
        return {}
    return {"JAX_COMPILATION_CACHE_DIR": str(path), **{k.upper(): str(v) for k, v in SETTINGS.items()}}


def info(path: str | os.PathLike | None = None) -> dict:
    """{"dir", "entries", "bytes"} of the cache at `path` (default `default_dir()`) as it is now."""
    path = Path(path).expanduser() if path is not None else default_dir()
    files = [f for f in path.glob("*") if f.is_file() and not f.name.startswith(".")] if path.is_dir() else []
    return {"dir": str(path), "entries": len(files), "bytes": sum(f.stat().st_size for f in files)}


def describe(cache: dict | None) -> str:
    """'cache ~/.cache/mk/jax (12 entries, 3.4 MB)' or 'cache off', for a one-line summary."""
    if cache is None:
        return "cache off"
    return f"cache {cache['dir']} ({cache['entries']} entries, {cache['bytes'] / 1e6:.1f} MB)"


class Counts:
    """What JAX did inside a `counting` block: compiles (jit-cache misses that reached XLA: real
    compiles plus persistent-cache loads), cache_loads (those of them loaded from disk), traces."""

    def __init__(self):
        self.compiles = self.cache_loads = self.traces = 0

    def as_dict(self) -> dict:
        return {"compiles": self.compiles, "cache_loads": self.cache_loads, "traces": self.traces}


_ACTIVE: list[Counts] = []
_LISTENING = False


def _on_duration(event: str, _duration: float, **_kw):
    for c in _ACTIVE:
        if event == BACKEND_COMPILE:
            c.compiles += 1
        elif event == TRACE:
            c.traces += 1


def _on_event(event: str, **_kw):
    if event == CACHE_HIT:
        for c in _ACTIVE:
            c.cache_loads += 1


@contextlib.contextmanager
def counting():
    """Count JAX's compiles, cache loads and traces inside the block (jax.monitoring listeners,
    registered once per process); yields the `Counts`, final when the block ends."""
    global _LISTENING
    import jax

    if not _LISTENING:
        jax.monitoring.register_event_duration_secs_listener(_on_duration)
        jax.monitoring.register_event_listener(_on_event)
        _LISTENING = True
    counts = Counts()
    _ACTIVE.append(counts)
    try:
        yield counts
    finally:
        _ACTIVE.remove(counts)
