"""mk.model.reference_sharded: the sharded XLA reference on 1, 2, 4 and 8 virtual CPU devices.

* On a 1-device mesh it is bit-identical to `mk.model.reference.decode_step` (logits and caches): the
  sharded rounding points (bf16 wire, fp32 sum in rank order) collapse to bf(f32(bf(x))) == bf(x).
* On N > 1 devices it differs from the single-device reference only by the specified extra
  roundings (spec 3.9 a-c): every split matmul's fp32 partial is rounded to bf16 before the
  cross-rank sum. Each such rounding moves a partial by <= 2^-9 relative, which flips the last
  bf16 bit of some elements of the residual stream p; through 4-8 layers that shows up in the
  logits (std ~1) as max |err| ~0.05 over these runs (mean <= 0.01) -- measured (batch 4, 4
  steps): mini/2 0.056 (mean 0.0096; one greedy flip at a top-2 gap of 0.0009), mini-tp8/8
  0.051 (0.0064), mini-tp8/2 0.051 (0.0064), mini-tp8/4 0.047 (0.0068). The same step with an
  fp32 wire instead gives a mean error 3-4x smaller, i.e. the difference is the wire rounding, not a wrong split (which gives O(1) errors).
  Tolerances: max |err| <= TOL_MAX = 0.1, mean |err| <= TOL_MEAN = 0.02, greedy tokens equal except
  at a reference near-tie (top-2 gap < mk.kernel.check.NEAR_TIE = 0.05), at most one flip per run; caches
  relative (Frobenius) error <= TOL_CACHE = 0.05 (measured <= 0.015, kda_state on mini/2).
  A router near-tie (k-th vs (k+1)-th biased score closer than ROUTER_TIE = 0.005, which the
  router's input noise can cross) may pick another expert, a legitimate O(1) change for that row:
  such a row is exempt from the step it happens on (at most one per run). Seen: mini-tp8 (batch
  2) row 0, step 3, margin 0.0004 -> logits err 0.7 there, 0.04 elsewhere; at batch 4 one such
  row per run (mini row 1 from step 2, mini-tp8 row 3 from step 2).
  Meshes: mini on 2 (ep 2 x tp 1), mini-tp8 on 8 (ep 4 x tp 2); 1 device on mini-tp8
  (bit-identical). mini-tp8 on 2 (ep 2 x tp 1) and 4 (ep 4 x tp 1) run with MK_SHARDED_FULL=1
  (each compile costs 20-40 s here).
* Replicated values are bit-identical on every rank: each rank's own copy of the final residual
  p and of its routing decisions (the step's trace output) agree bit for bit.

Decode is teacher-forced (fixed random tokens, batch 4, ctx 128, 4 steps), so one near-tie flip
does not change later inputs. One compile per (config, mesh): ~10-20 s each on this CPU.
"""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from mk.model import params as mkparams
from mk.model import reference as ref
from mk.model import reference_sharded as rs
from mk.kernel.check import MAX_FLIPS, NEAR_TIE
from mk.model.config import get_config
from mk.model.sharding import ALL

B, CTX, STEPS = 4, 128, 4     # batch 4, ctx 128: the mini reference compile is shared with test_reference
FULL = os.environ.get("MK_SHARDED_FULL") == "1"   # also mini-tp8 on 2 and 4 devices
TOL_MAX, TOL_MEAN, TOL_CACHE = 0.1, 0.02, 0.05


def tokens_for(cfg, seed=1):
    return np.random.default_rng(seed).integers(0, cfg.vocab, (STEPS, B)).astype(np.int32)


_PARAMS: dict = {}
_REF: dict = {}


def params_of(name):
    if name not in _PARAMS:
        _PARAMS[name] = mkparams.init(get_config(name), seed=0)
    return _PARAMS[name]


def reference_run(name):
    """Single-device reference: (list of logits [B, V], final cache)."""
    if name not in _REF:
        cfg, params = get_config(name), params_of(name)
        cache, out = ref.init_cache(cfg, B, CTX), []
        for t in tokens_for(cfg):
            logits, cache = ref.decode_step(params, cache, jnp.asarray(t), cfg=cfg)
            out.append(np.asarray(logits))
        _REF[name] = (out, jax.tree.map(np.asarray, cache))
    return _REF[name]


def sharded_run(name, n):
    """Sharded reference on n devices: (logits per step, final cache, traces per step)."""
    cfg = get_config(name)
    mesh = rs.mesh_for(cfg, n)
    step = rs.make_sharded_step(cfg, mesh, trace=True)
    params = rs.shard_params(params_of(name), mesh)
    cache = rs.init_cache_sharded(cfg, B, CTX, mesh)
    out, traces = [], []
    for t in tokens_for(cfg):
        logits, cache, tr = step(params, cache, jnp.asarray(t))
        assert logits.sharding.spec == P(None, ALL)
        out.append(np.asarray(logits))
        traces.append(jax.tree.map(np.asarray, tr))
    return out, jax.tree.map(np.asarray, cache), traces


def bits(x):
    x = np.asarray(x)
    return x.view(np.uint16 if x.dtype.itemsize == 2 else np.uint32) if x.dtype.kind == "f" or \
        x.dtype.name == "bfloat16" else x


def test_reduce_bf16_rank_order_and_wire():
    """reduce_bf16 = bf16-rounded partials summed in fp32 in rank order r = ep*tp + tp_index,
    the same bits on every rank (values chosen so that another order or an fp32 wire differ)."""
    mesh = rs.mesh_for(get_config("mini-tp8"), 8)            # ep 4 x tp 2
    vals = np.array([[3e7, 1.0 + 2 ** -12, -3e7, 0.7, 1e-3, -0.25, 5.0, 2 ** -9],
                     [1.0, 1e8, 3.0, -1e8, 0.1, 0.2, 0.3, 0.4]], np.float32).T   # [8 ranks, 2]

    def body(x):
        return rs.reduce_bf16(x[0])[None]
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(ALL), out_specs=P(ALL), check_vma=False))
    x = jax.device_put(vals[:, None, :], NamedSharding(mesh, P(ALL)))   # rank r holds vals[r]
    got = np.asarray(f(x))[:, 0]                               # [8 ranks, 2]
    wire = vals.astype(jnp.bfloat16).astype(np.float32)
    want = wire[0].copy()
    for r in range(1, 8):
        want = want + wire[r]
    assert (bits(got) == bits(want)[None]).all(), (got, want)
    assert not (bits(want) == bits(vals.sum(0))).all()         # the rounding points matter here
    # rank r of the mesh is ep index r // tp, tp index r % tp (mk.model.sharding's numbering)
    idx = jax.jit(jax.shard_map(lambda: jax.lax.axis_index(ALL)[None], mesh=mesh, in_specs=(),
                                out_specs=P(ALL), check_vma=False))()
    assert list(np.asarray(idx)) == list(range(8))
    assert [d.id for d in mesh.devices.reshape(-1)] == [d.id for d in jax.devices()[:8]]


def test_one_device_bit_identical():
    name = "mini-tp8"
    want, want_cache = reference_run(name)
    got, got_cache, traces = sharded_run(name, 1)
    for s, (a, b) in enumerate(zip(want, got)):
        assert (bits(a) == bits(b)).all(), f"step {s}: max |err| {np.abs(a - b).max()}"
    for k in want_cache:
        assert (bits(want_cache[k]) == bits(got_cache[k])).all(), k


ROUTER_TIE = 0.005   # router margin (k-th minus (k+1)-th biased score) below which routing may flip


# mini-tp8 on 2 and 4 devices as well with MK_SHARDED_FULL=1 (left out of make test for time; the
# sharded kernel tests cover 2 and 4 devices against this reference).
@pytest.mark.parametrize("name,n", [pytest.param("mini", 2, marks=pytest.mark.extended), pytest.param("mini-tp8", 8, marks=pytest.mark.extended)]
                         + ([("mini-tp8", 2), ("mini-tp8", 4)] if FULL else []))
def test_sharded_matches_reference(name, n):
    cfg = get_config(name)
    want, want_cache = reference_run(name)
    got, got_cache, traces = sharded_run(name, n)
    # A router near-tie (margin ~ the bf16 noise of its input) may legitimately choose another
    # expert: that row is exempt from the tolerance from that step on (its caches carry it on).
    exempt = {}
    for s, tr in enumerate(traces):
        for row in np.flatnonzero(tr["margin"][0].min(axis=0) < ROUTER_TIE):
            exempt.setdefault(int(row), s)
    assert len(exempt) <= 1, f"router near-ties in rows {exempt}: too many for a rare event"
    errs, flips = [], []
    for s, (a, b) in enumerate(zip(want, got)):
        assert b.shape == (B, cfg.vocab) and np.isfinite(b).all()
        keep = [r for r in range(B) if exempt.get(r, STEPS) > s]
        a, b = a[keep], b[keep]
        errs.append((np.abs(a - b).max(initial=0), np.abs(a - b).mean() if a.size else 0))
        top2 = np.sort(a, axis=-1)[:, -2:]
        for i in np.flatnonzero(a.argmax(-1) != b.argmax(-1)):
            flips.append((s, keep[i], float(top2[i, 1] - top2[i, 0])))
    err_max, err_mean = max(e[0] for e in errs), max(e[1] for e in errs)
    keep = [r for r in range(B) if r not in exempt]
    cache_err = {k: float(np.linalg.norm(want_cache[k][keep].astype(np.float32) - got_cache[k][keep].astype(np.float32))
                          / np.linalg.norm(want_cache[k][keep].astype(np.float32)))
                 for k in ("kda_state", "conv_state", "mla_k", "mla_v")}
    print(f"{name} on {n}: logits max |err| {err_max:.4f}, mean {err_mean:.4f}, flips {flips}, "
          f"router near-ties {exempt}, cache rel. err {cache_err}")
    assert err_max <= TOL_MAX and err_mean <= TOL_MEAN, errs
    assert all(gap < NEAR_TIE for *_, gap in flips) and len(flips) <= MAX_FLIPS, flips
    assert (got_cache["pos"] == STEPS).all()
    assert all(e <= TOL_CACHE for e in cache_err.values()), cache_err
    # every rank's replicated values are the same bits
    for s, tr in enumerate(traces):
        assert tr["p"].shape == (n, B, cfg.dim) and tr["ids"].shape == (n, cfg.n_moe, B, cfg.top_k)
        for r in range(1, n):
            assert (bits(tr["p"][r]) == bits(tr["p"][0])).all(), f"step {s}: rank {r}'s p differs"
            assert (tr["ids"][r] == tr["ids"][0]).all(), f"step {s}: rank {r}'s routing differs"
