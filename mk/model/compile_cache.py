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

JAX's cache still traces and lowers a program before it can look it up (its key is the lowered
module): for the kernel that is about a second of Python per program, every run. mk's own programs
(the weights' drawing and packing, the decode step, the loop's chunk and first token) are therefore
also `Program`s, kept by what they are rather than by their HLO:

    program = Program(fn, name="decode_step", identity=repr(plan), donate_argnums=(1,))
    program(weights, cache, tokens)        # like jax.jit(fn, donate_argnums=(1,))(...)

With the cache on, the first call for each kind of arguments (their tree, shapes, dtypes, weak types
and shardings) loads the executable that an earlier process stored under `programs/` in the cache
directory, traced by nothing; or lowers and compiles it (JAX's cache may still serve the compile) and
stores it. The file's key is the SHA-256 of the name, the identity (the `repr` of everything the
function closes over: config, plan, sampling, options), the arguments' kinds, and `fingerprint()`:
jax, jaxlib and the backend's versions (libtpu's on a TPU), the devices, XLA_FLAGS / LIBTPU_INIT_ARGS,
the jax options that change a lowering, and a hash of mk's own source. Any of those changing makes a
new entry; an entry that cannot be read is deleted and compiled again. A program that cannot be
serialized (interpret mode's host callbacks) is kept in memory for the process only. Traced (called
inside another jitted function), or in a run of several processes, a Program is its jitted function.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import pickle
import sys
import tempfile
from pathlib import Path

import numpy as np

ENV = "MK_CACHE_DIR"

# JAX's flags for the cache, and mk's values: every compile, every entry size (-1: no floor).
SETTINGS = {"jax_persistent_cache_min_compile_time_secs": 0, "jax_persistent_cache_min_entry_size_bytes": -1}

# jax.monitoring events: BACKEND_COMPILE fires for every jit-cache miss that reaches XLA (a compile,
# or a load from the persistent cache, which CACHE_HIT marks too); TRACE for every trace to a jaxpr.
BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
CACHE_HIT = "/jax/compilation_cache/cache_hits"
TRACE = "/jax/core/compile/jaxpr_trace_duration"

PROGRAMS = "programs"          # the `Program` store's subdirectory of the cache directory
_STORE: Path | None = None     # where `Program`s persist: set by `enable`, None while the cache is off


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
    global _STORE
    _STORE = path / PROGRAMS
    _STORE.mkdir(exist_ok=True)
    return info(path)


def disable() -> None:
    """Turn the persistent caches off again (JAX's and the `Program` store) for the rest of the process."""
    global _STORE
    import jax
    from jax._src import compilation_cache
    _STORE = None
    if jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", None)
        compilation_cache.reset_cache()


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
    programs = list((path / PROGRAMS).glob("*.exe")) if (path / PROGRAMS).is_dir() else []
    return {"dir": str(path), "entries": len(files), "bytes": sum(f.stat().st_size for f in files),
            "programs": len(programs), "program_bytes": sum(f.stat().st_size for f in programs)}


def describe(cache: dict | None) -> str:
    """'cache ~/.cache/mk/jax (12 entries, 3.4 MB)' or 'cache off', for a one-line summary."""
    if cache is None:
        return "cache off"
    size = (cache["bytes"] + cache.get("program_bytes", 0)) / 1e6
    return f"cache {cache['dir']} ({cache['entries']} entries, {cache.get('programs', 0)} programs, {size:.1f} MB)"


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


def _note_load() -> None:
    """A `Program` loaded from the store: a compile and a cache load for every `counting` block."""
    for c in _ACTIVE:
        c.compiles += 1
        c.cache_loads += 1


# ---- mk's own programs, kept across processes ----------------------------------------------------

# jax options that change what a function lowers to
_LOWERING_OPTIONS = ("jax_enable_x64", "jax_default_matmul_precision", "jax_default_prng_impl",
                     "jax_threefry_partitionable", "jax_numpy_rank_promotion")


@functools.lru_cache(maxsize=None)
def _source_hash() -> str:
    """SHA-256 of mk's Python source (every .py file under the package, by relative path)."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.py")):
        h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


@functools.lru_cache(maxsize=None)
def fingerprint() -> str:
    """What besides a program's own description decides its executable: versions (jax, jaxlib, the
    backend's platform version: libtpu's on a TPU), the devices, compiler flags, lowering options,
    mk's source (`_source_hash`)."""
    import jax
    import jaxlib
    dev = jax.devices()
    parts = [jax.__version__, jaxlib.__version__, dev[0].client.platform, dev[0].client.platform_version,
             repr([(d.id, d.device_kind, d.process_index) for d in dev]), jax.process_count(), jax.process_index(),
             os.environ.get("XLA_FLAGS", ""), os.environ.get("LIBTPU_INIT_ARGS", ""),
             repr([(o, getattr(jax.config, o, None)) for o in _LOWERING_OPTIONS]), _source_hash()]
    return repr(parts)


def _kind(x):
    """What of an argument leaf an executable is specialised to: shape, dtype, weak type, sharding."""
    import jax
    if isinstance(x, jax.Array):
        return (x.shape, str(x.dtype), bool(x.weak_type), x.sharding)
    if isinstance(x, (bool, int, float, complex)):            # Python scalars: weakly typed
        return ((), type(x).__name__, True, None)
    a = np.asarray(x)
    return (a.shape, str(a.dtype), False, None)


class Program:
    """`jax.jit(fn, donate_argnums=...)` whose executables persist across processes (module docstring).

    name: a readable prefix of the stored files; identity: a string that determines `fn` given mk's
    source (the `repr` of what it closes over). Call it as the jitted function; `.jitted` is that
    function (for tracing, `.lower`)."""

    def __init__(self, fn, *, name: str, identity: str, donate_argnums=()):
        import jax
        self.jitted = jax.jit(fn, donate_argnums=donate_argnums)
        self.name, self.identity = name, identity
        self._loaded: dict = {}

    def __repr__(self) -> str:
        return f"Program({self.name}: {self.identity})"

    def lower(self, *args):
        return self.jitted.lower(*args)

    def __call__(self, *args):
        import jax
        leaves, tree = jax.tree_util.tree_flatten(args)
        if _STORE is None or jax.process_count() > 1 or any(isinstance(x, jax.core.Tracer) for x in leaves):
            return self.jitted(*args)      # off, several processes (one program across hosts), or traced
        kinds = (tree, tuple(_kind(x) for x in leaves))
        exe = self._loaded.get(kinds)
        if exe is None:
            exe = self._loaded[kinds] = self._load_or_compile(args, kinds)
        return exe(*args)

    def _path(self, kinds) -> Path:
        tree, leaves = kinds
        desc = repr((self.name, self.identity, str(tree), [(s, d, w, repr(sh)) for s, d, w, sh in leaves],
                     fingerprint()))
        return _STORE / f"{self.name}-{hashlib.sha256(desc.encode()).hexdigest()[:32]}.exe"

    def _load_or_compile(self, args, kinds):
        import jax
        from jax.experimental import serialize_executable as se
        path = self._path(kinds)
        if path.is_file():
            try:
                with open(path, "rb") as f:
                    payload, in_tree, out_tree, device_ids = pickle.load(f)
                by_id = {d.id: d for d in jax.devices()}
                exe = se.deserialize_and_load(payload, in_tree, out_tree,
                                              execution_devices=[by_id[i] for i in device_ids])
                _note_load()
                return exe
            except Exception as e:                 # a torn or foreign file: compile it again
                print(f"warning: stored program {path.name} unreadable ({type(e).__name__}); compiling it again",
                      file=sys.stderr)
                path.unlink(missing_ok=True)
        compiled = self.jitted.lower(*args).compile()
        try:
            device_ids = [d.id for d in compiled.runtime_executable().local_devices()]   # where it runs
            blob = pickle.dumps((*se.serialize(compiled), device_ids))
        except Exception:                          # host callbacks (interpret mode): this process only
            return compiled
        try:
            with tempfile.NamedTemporaryFile(dir=path.parent, prefix=".tmp-", delete=False) as f:
                f.write(blob)
            os.replace(f.name, path)               # whole or absent: never a torn entry
        except OSError:
            pass
        return compiled
