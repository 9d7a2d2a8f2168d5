"""mk's program store (`mk.model.compile_cache.Program`): executables kept across processes by what they
are (name, identity, the arguments' kinds, versions and mk's source), loaded without a trace. Two
processes of `mk generate`: tests/test_cli_generate.py::test_a_second_process_reuses_the_compile_cache."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mk.model import compile_cache
from mk.model.compile_cache import Program, counting


def _twice(x, state):
    return x * 2 + state["n"], dict(state, n=state["n"] + 1)


@pytest.fixture
def store(tmp_path):
    compile_cache.enable(tmp_path / "jax")
    yield tmp_path / "jax" / compile_cache.PROGRAMS
    compile_cache.disable()


def test_a_program_is_its_jitted_function_and_donates(store):
    p = Program(_twice, name="twice", identity="v1", donate_argnums=(1,))
    state = {"n": jnp.ones(3)}
    y, new = p(jnp.arange(3.0), state)
    assert np.array_equal(y, [1, 3, 5]) and np.array_equal(new["n"], [2, 2, 2])
    assert state["n"].is_deleted()                            # donated, as jax.jit(donate_argnums=(1,))
    assert len(list(store.glob("twice-*.exe"))) == 1
    with jax.disable_jit(False):                               # traced inside another program: inlined
        z = jax.jit(lambda x: p(x, {"n": jnp.zeros(3)})[0])(jnp.ones(3))
    assert np.array_equal(z, [2, 2, 2]) and len(list(store.glob("twice-*.exe"))) == 1


def test_the_store_loads_without_a_trace_and_keys_on_everything(store):
    x = jnp.arange(4.0)
    Program(_twice, name="twice", identity="v1")(x, {"n": jnp.ones(4)})
    with counting() as n:                                      # a new process's Program: the stored exe
        y, _ = Program(_twice, name="twice", identity="v1")(x, {"n": jnp.ones(4)})
    assert n.as_dict() == {"compiles": 1, "cache_loads": 1, "traces": 0} and np.array_equal(y, [1, 3, 5, 7])
    # another identity, another shape, a weakly typed scalar: each its own entry, traced once
    for identity, args in (("v2", (x, {"n": jnp.ones(4)})), ("v1", (x[:3], {"n": jnp.ones(3)})),
                           ("v1", (x, {"n": 1.0}))):
        with counting() as n:
            Program(_twice, name="twice", identity=identity)(*args)
        assert n.traces >= 1 and n.cache_loads == 0, (identity, n.as_dict())
    assert len(list(store.glob("twice-*.exe"))) == 4


def test_an_unreadable_entry_is_compiled_again(store, capsys):
    x = jnp.arange(4.0)
    Program(_twice, name="twice", identity="v1")(x, {"n": jnp.ones(4)})
    (entry,) = store.glob("twice-*.exe")
    entry.write_bytes(entry.read_bytes()[:100])                # torn
    y, _ = Program(_twice, name="twice", identity="v1")(x, {"n": jnp.ones(4)})
    assert np.array_equal(y, [1, 3, 5, 7])
    assert "unreadable" in capsys.readouterr().err and entry.stat().st_size > 100     # stored whole again


def test_off_without_the_cache(tmp_path):
    compile_cache.disable()
    p = Program(_twice, name="twice", identity="v1")
    assert np.array_equal(p(jnp.ones(2), {"n": jnp.ones(2)})[0], [3, 3]) and not p._loaded


def test_the_fingerprint_holds_versions_and_the_source():
    f = compile_cache.fingerprint()
    assert jax.__version__ in f and compile_cache._source_hash() in f and jax.devices()[0].client.platform_version in f
