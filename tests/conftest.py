"""Test setup: CPU JAX with 8 virtual devices, libtpu quiet, repo root importable."""
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The commands' persistent compile cache (mk.model.compile_cache): a folder of this session, never the user's.
if "MK_CACHE_DIR" not in os.environ:
    import tempfile
    os.environ["MK_CACHE_DIR"] = tempfile.mkdtemp(prefix="mk-test-cache-")

import pytest  # noqa: E402


def pytest_addoption(parser):
    parser.addoption("--seeds", type=int, default=1, metavar="N",
                     help="run the tests that take `seed` (tolerances under a stated error model) with params "
                          "and prompts drawn from seeds 0..N-1 (default 1: seed 0); `make test-seeds` uses 10")


def pytest_generate_tests(metafunc):
    """A test (or a module fixture) that takes `seed` runs once per seed of --seeds."""
    if "seed" in metafunc.fixturenames:
        metafunc.parametrize("seed", range(metafunc.config.getoption("seeds")), scope="module",
                             ids=lambda s: f"seed{s}")


@pytest.hookimpl(tryfirst=True)              # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    """Modules with the most `slow` or `aot` tests first, the others after them in file order.

    `make test` hands whole files to two workers in this order (`--dist loadfile
    --no-loadscope-reorder`): the long files start first and the short ones fill in at the end.
    (xdist's default order, most tests first, left the long files of few tests for last, one worker
    running them while the other idled.) A sort by module keeps each module's own order. Tests that
    take `seed` are marked `seeded` (`make test-seeds`)."""
    for item in items:
        if "seed" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.seeded)
    heavy: dict[str, int] = {}
    for item in items:
        n = any(item.get_closest_marker(m) for m in ("slow", "aot"))
        heavy[item.nodeid.split("::")[0]] = heavy.get(item.nodeid.split("::")[0], 0) + n
    first = {m: i for i, m in enumerate(dict.fromkeys(i.nodeid.split("::")[0] for i in items))}
    items.sort(key=lambda i: (-heavy[i.nodeid.split("::")[0]], first[i.nodeid.split("::")[0]]))


@pytest.fixture(autouse=True)
def _program_store_of_its_own(request):
    """mk's program store (`mk.model.compile_cache.Program`) keys on mk's source, not on what a test
    monkeypatches (a planted fault): in a test that monkeypatches, a command run in-process stores its
    programs in that test's own folder, so it never loads what another test traced, nor leaves a
    patched program to one. The other tests share the session's (JAX's cache is shared by all)."""
    if "monkeypatch" in request.fixturenames:
        from mk.model import compile_cache
        folder = request.getfixturevalue("tmp_path") / "mk-programs"
        request.getfixturevalue("monkeypatch").setattr(compile_cache, "PROGRAMS", str(folder))


@pytest.fixture(autouse=True)
def _persistent_cache_off_after_each_test():
    """A command run in-process (`mk.__main__.main([...])`) turns JAX's persistent compile cache on for
    the whole worker process (`mk.model.compile_cache.enable`): every test after it would then write
    every program it compiles to disk (time spent serializing large interpret-mode programs, and
    JAX's serializer once crashed a worker there). It is turned off again after each test; the tests
    of the cache itself run their commands in subprocesses."""
    yield
    from mk.model import compile_cache
    compile_cache.disable()                 # JAX's cache and mk's program store
