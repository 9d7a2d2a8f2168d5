"""Kernel paths the short decode runs of test_kernel.py never reach, in TPU interpret mode with the
race detector on, each against the XLA reference from the same (reference-prefilled) caches:

* MLA past the first 128-position cache block (multi-block online softmax, later-block write-back);
* batch rows at different positions (per-row block counts and write-back blocks);
* weights written by `mk.io.synth` and read back through `mk.io.checkpoint` (MXFP4 experts dequantized);
* one decode step at full K3 widths (a trimmed k3-slice);
* the DMA issue order observed at runtime: the weight ring prefetches across layer boundaries and
  fetches each distinct routed expert once per step;
* bit-exactness on mini where the reference used to round a different product of the MoE
  weighted sum (XLA CPU's FMA contraction; see mk/model/layers/moe.py).

Sized for interpret mode (a few steps each, caches prefilled by the reference, not 130 kernel
steps). Tolerances are test_kernel.py's.
"""
from __future__ import annotations

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from mk.model import params as params_mod
from mk.model import reference
from mk.kernel.check import order_violations, races_found, route_ties
from mk.model.config import get_config
from mk.kernel.decode import interpret_params
from mk.kernel.step import make_step_fn
from mk.kernel.schedule import schedule

# On CPU the kernel equals the reference bit for bit (README, docs/numerics.md): no tolerance.
LOGIT_TOL = 0.0
CACHE_TOL = 0.0
NEAR_TIE = 0.05
CACHE_KEYS = ("kda_state", "conv_state", "mla_k", "mla_v")
CTX = 256          # two 128-position MLA cache blocks


# ---- helpers -----------------------------------------------------------------------------------
def kernel_step(step_fn, cache, tokens):
    """One kernel step with a fresh race detector; the cache passed in is copied (the kernel
    donates its cache, the reference keeps using its own)."""
    pltpu.reset_tpu_interpret_mode_state()
    cache = jax.tree.map(jnp.array, cache)
    logits, cache = step_fn(None, cache, jnp.asarray(tokens, jnp.int32))
    logits = np.asarray(logits)
    assert not races_found(), "race detector flagged the kernel"
    return logits, cache


def prefill_rows(params, cfg, rows, ctx=CTX):
    """Each row's tokens through the reference separately (B = 1), caches stacked: the rows end at
    different positions (cache['pos'] differs per row). A loop of the jitted decode step (one
    compile for every length, shared with the comparisons) costs a third of compiling
    `reference.prefill`'s scan here."""
    caches = []
    for toks in rows:
        c = reference.init_cache(cfg, 1, ctx)
        for t in toks:
            _, c = reference.decode_step(params, c, jnp.asarray([t], jnp.int32), cfg=cfg)
        caches.append(c)
    return jax.tree.map(lambda *xs: jnp.concatenate(xs), *caches)


def compare(k_logits, k_cache, r_logits, r_cache, what=""):
    """test_kernel.py's acceptance: finite, logits and caches within tolerance, greedy equal except
    at a reference near-tie. Returns the flips (row, reference top-2 margin)."""
    r_logits = np.asarray(r_logits)
    assert np.isfinite(k_logits).all(), f"{what}: NaN/inf in kernel logits"
    err = float(np.max(np.abs(k_logits - r_logits)))
    assert err <= LOGIT_TOL, f"{what}: max |logit err| {err}"
    assert np.array_equal(np.asarray(k_cache["pos"]), np.asarray(r_cache["pos"]))
    for n in CACHE_KEYS:
        a, b = np.asarray(k_cache[n], np.float32), np.asarray(r_cache[n], np.float32)
        assert a.shape == b.shape, (n, a.shape, b.shape)
        if a.size:
            assert np.isfinite(a).all(), f"{what}: NaN/inf in kernel {n}"
            c_err = float(np.max(np.abs(a - b)))
            assert c_err <= CACHE_TOL, f"{what}: {n} max abs err {c_err}"
    flips = []
    k_arg, r_arg = k_logits.argmax(-1), r_logits.argmax(-1)
    for row in np.flatnonzero(k_arg != r_arg):
        margin = float(r_logits[row, r_arg[row]] - r_logits[row, k_arg[row]])
        assert margin < NEAR_TIE, f"{what}: greedy token differs in row {row} (reference margin {margin})"
        flips.append((int(row), margin))
    return flips


def side_by_side(step_fn, params, cfg, cache, tokens, what):
    """Kernel and reference from the same cache over tokens [steps, B]; returns both final caches."""
    k_cache = r_cache = cache
    flips = []
    for s, tok in enumerate(tokens):
        k_logits, k_cache = kernel_step(step_fn, k_cache, tok)
        r_logits, r_cache = reference.decode_step(params, r_cache, jnp.asarray(tok, jnp.int32), cfg=cfg)
        flips += compare(k_logits, k_cache, r_logits, r_cache, f"{what} step {s}")
    assert len(flips) <= 1, flips                     # a near-tie is rare, not routine
    return k_cache, r_cache


@pytest.fixture(scope="module")
def mini():
    cfg = get_config("mini")
    return cfg, params_mod.init(cfg, 0)


@pytest.fixture(scope="module")
def mini_b1(mini):
    """The B = 1 kernel on mini."""
    cfg, params = mini
    return make_step_fn(params, cfg, 1, ctx=CTX, interpret=interpret_params(detect_races=True))


# ---- 1. MLA past the first cache block, 8 heads per loop step ---------------------------------------
@pytest.mark.extended
@pytest.mark.slow
def test_mla_crosses_cache_block():
    """mini with 8 heads: prefill 127 positions with the reference, then kernel and reference side by
    side at positions 127..129: the last slot of block 0, then block 1 (two-block online softmax,
    the new key/value merged into and written back to the second block), the kernel attending 8
    heads per loop step (`attention_heads`' default) where the reference attends one head at a time.
    (mini itself runs 2 heads per step, from empty caches in test_kernel.py; test_layers.py holds
    `attend_block` per head for any grouping.)"""
    cfg = get_config("mini").replace(heads=8)
    params = params_mod.init(cfg, 0)
    rng = np.random.default_rng(1)
    cache = prefill_rows(params, cfg, [rng.integers(0, cfg.vocab, 127)])
    assert int(cache["pos"][0]) == 127
    step_fn = make_step_fn(params, cfg, 1, ctx=CTX, interpret=interpret_params(detect_races=True))
    assert step_fn.plan.attention_heads == 8
    tokens = rng.integers(0, cfg.vocab, (3, 1), dtype=np.int32)
    k_cache, r_cache = side_by_side(step_fn, params, cfg, cache, tokens, "positions 127..129, 8 heads per step")
    assert int(k_cache["pos"][0]) == 130
    # the second block really holds the new keys/values (nonzero, as the reference wrote them)
    k_blk = np.asarray(k_cache["mla_k"][0, :, :, 128:130], np.float32)
    assert np.abs(k_blk).max() > 0
    np.testing.assert_allclose(k_blk, np.asarray(r_cache["mla_k"][0, :, :, 128:130], np.float32), atol=CACHE_TOL)
    assert not np.asarray(k_cache["mla_k"][0, :, :, 130:], np.float32).any()   # nothing past pos


# ---- 2 + 5. rows at different positions; DMA order observed at runtime ---------------------------
class DmaLog:
    """Records interpret mode's DMA starts and waits in execution order.

    TPU interpret mode runs every `.start()` / `.wait()` of the kernel as an ordered io_callback
    to `interpret_pallas_call.dma_start` / `dma_wait` (looked up when the kernel is traced), so
    wrapping those two functions observes the real runtime issue order without touching the
    kernel. Events: ("start", src_shape, src_index, dst_sem) and ("wait", sem, bytes).
    """

    def __init__(self):
        from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc
        self.ipc, self.events, self.recording = ipc, [], False
        self._start, self._wait = ipc.dma_start, ipc.dma_wait

    def __enter__(self):
        start, wait = self._start, self._wait

        def dma_start(token, device_id, core, src_ms, src_id, src_tr, dst_ms, dst_id, dst_tr, dst_sem,
                      src_sem, dst_dev, source_info=None):
            if self.recording:
                tr = jax.tree.map(int, src_tr)                  # (NDIndexer(indices, shape),)
                idx = tr[-1] if len(tr) else None
                shape = tuple(idx.shape) if idx is not None else ()
                ints = tuple(i for i in getattr(idx, "indices", ()) if isinstance(i, int))
                self.events.append(("start", shape, ints, int(dst_sem)))
            return start(token, device_id, core, src_ms, src_id, src_tr, dst_ms, dst_id, dst_tr, dst_sem,
                         src_sem, dst_dev, source_info=source_info)

        def dma_wait(token, device_id, core, sem, size, source_info=None):
            if self.recording:
                self.events.append(("wait", int(sem), int(size)))
            return wait(token, device_id, core, sem, size, source_info=source_info)

        self.ipc.dma_start, self.ipc.dma_wait = dma_start, dma_wait
        return self

    def __exit__(self, *exc):
        self.ipc.dma_start, self.ipc.dma_wait = self._start, self._wait


def reference_routing(params, cfg, cache, tokens):
    """{MoE layer: set of experts chosen by any row} of the reference step (its own jit, with
    `route` tapped)."""
    import mk.model.layers.moe as lmoe

    seen = []
    orig = lmoe.route

    def route(*a, **kw):
        ids, w = orig(*a, **kw)
        jax.debug.callback(lambda x: seen.append(np.asarray(x)), ids)
        return ids, w

    lmoe.route = route
    try:
        fn = jax.jit(functools.partial(reference.decode_step.__wrapped__, cfg=cfg))
        jax.block_until_ready(fn(params, cache, jnp.asarray(tokens, jnp.int32)))
        jax.effects_barrier()
    finally:
        lmoe.route = orig
    assert len(seen) == cfg.n_moe
    return {l + 1: set(int(e) for e in ids.reshape(-1)) for l, ids in enumerate(seen)}


MIXED_POSITIONS = (3, 127, 128, 60)


@pytest.fixture(scope="module")
def mixed_run(mini):
    """B = 4 rows at positions 3, 127, 128, 60 (each prefilled alone by the reference), two steps
    kernel vs reference; the first kernel step's DMAs are recorded. A ring of 8 tiles, fewer than a
    layer issues before its router (the default's 32 would reach past them into the next layer's
    routed experts, which wait for its router)."""
    cfg, params = mini
    rng = np.random.default_rng(2)
    cache = prefill_rows(params, cfg, [rng.integers(0, cfg.vocab, n) for n in MIXED_POSITIONS])
    tokens = rng.integers(0, cfg.vocab, (2, len(MIXED_POSITIONS)), dtype=np.int32)
    step_fn = make_step_fn(params, cfg, len(MIXED_POSITIONS), ctx=CTX, prefetch_depth=8,
                           interpret=interpret_params(detect_races=True))
    routing = reference_routing(params, cfg, cache, tokens[0])
    with DmaLog() as log:
        log.recording = True
        first = kernel_step(step_fn, cache, tokens[0])
        log.recording = False
    return dict(cfg=cfg, params=params, cache=cache, tokens=tokens, step_fn=step_fn, first=first,
                log=log.events, routing=routing)


@pytest.mark.extended
@pytest.mark.slow
def test_rows_at_different_positions(mixed_run):
    run = mixed_run
    cfg, params, cache, tokens = run["cfg"], run["params"], run["cache"], run["tokens"]
    assert list(np.asarray(cache["pos"])) == list(MIXED_POSITIONS)
    r_logits, r_cache = reference.decode_step(params, cache, jnp.asarray(tokens[0]), cfg=cfg)
    k_logits, k_cache = run["first"]
    flips = compare(k_logits, k_cache, r_logits, r_cache, "mixed positions step 0")
    k_logits, k_cache = kernel_step(run["step_fn"], k_cache, tokens[1])
    r_logits, r_cache = reference.decode_step(params, r_cache, jnp.asarray(tokens[1]), cfg=cfg)
    flips += compare(k_logits, k_cache, r_logits, r_cache, "mixed positions step 1")
    assert len(flips) <= 1, flips
    assert list(np.asarray(k_cache["pos"])) == [p + 2 for p in MIXED_POSITIONS]
    # each row wrote exactly its own two slots: rows never touch another row's positions
    for b, p in enumerate(MIXED_POSITIONS):
        written = np.flatnonzero(np.abs(np.asarray(k_cache["mla_k"][b], np.float32)).sum(axis=(0, 1, 3)))
        assert list(written) == list(range(p + 2)), (b, p, written[-4:])


def ring_events(run):
    """(issues, waits) of the weight ring: issues[i] = ('dense', tile) or ('expert', layer, id, tile)
    in issue order with their event positions; waits = event positions of the ring's waits (the
    ring consumes in issue order, so waits[i] is the consumption of issues[i])."""
    plan = run["step_fn"].plan
    tk, tn = plan.tile_k, plan.tile_n
    issues, ring_sems = [], set()
    for pos, ev in enumerate(run["log"]):
        if ev[0] != "start" or len(ev[1]) < 3 or ev[1][-2:] != (tk, tn):
            continue
        shape, ints, sem = ev[1], ev[2], ev[3]
        if len(shape) == 3:                                  # [dense_tiles, tk, tn]
            assert shape[0] == plan.dense_tiles
            issues.append((pos, ("dense", ints[0])))
        else:                                                # [n_moe, E, expert_tiles, tk, tn]
            assert len(shape) == 5 and len(ints) == 3, ev
            issues.append((pos, ("expert", ints[0] + 1, ints[1], ints[2])))
        ring_sems.add(sem)
    waits = [pos for pos, ev in enumerate(run["log"])
             if ev[0] == "wait" and ev[1] in ring_sems and ev[2] == plan.tile_bytes]
    return issues, waits


@pytest.mark.slow
def test_prefetch_crosses_layers_at_runtime(mixed_run):
    """At every layer boundary (and into the LM head), exactly `prefetch_depth` tiles of the next
    layer are issued before this layer's last tile is consumed: the ring's cursor runs ahead
    across layers, observed in the runtime DMA order."""
    plan = mixed_run["step_fn"].plan
    cfg = plan.config
    issues, waits = ring_events(mixed_run)
    assert len(waits) == len(issues) > plan.dense_tiles
    dense = [(pos, what[1]) for pos, what in issues if what[0] == "dense"]
    assert [t for _, t in dense] == list(range(plan.dense_tiles))          # stream order, once each
    layer_of = np.zeros(plan.dense_tiles, int)
    for s in plan.streams:
        layer_of[s.dense_base:s.dense_base + s.pre_tiles + s.post_tiles] = s.layer
    order = [layer_of[what[1]] if what[0] == "dense" else what[1] for _, what in issues]
    assert order == sorted(order)                                          # layer by layer
    assert plan.prefetch_depth >= 1
    for l in range(cfg.layers):
        last = max(i for i, lay in enumerate(order) if lay == l)           # layer l's last tile
        consumed_at = waits[last]
        ahead = [i for i, lay in enumerate(order) if lay == l + 1 and issues[i][0] < consumed_at]
        assert len(ahead) == plan.prefetch_depth, (l, len(ahead))


@pytest.mark.slow
def test_each_distinct_expert_fetched_once(mixed_run):
    """Per MoE layer, the expert tiles fetched are exactly the union of the rows' chosen experts
    (as the reference routes), each expert's tiles once, in ascending expert id."""
    plan = mixed_run["step_fn"].plan
    cfg = plan.config
    issues, _ = ring_events(mixed_run)
    fetched = collections.defaultdict(list)
    for _, what in issues:
        if what[0] == "expert":
            fetched[what[1]].append(what[2:])
    routing = mixed_run["routing"]
    assert sorted(fetched) == list(range(1, cfg.layers))
    saved = 0
    for layer, tiles in fetched.items():
        assert len(tiles) == len(set(tiles)), f"layer {layer}: an expert tile fetched twice"
        ids = sorted(routing[layer])
        assert tiles == [(e, t) for e in ids for t in range(plan.expert_tiles)], layer
        saved += len(MIXED_POSITIONS) * cfg.top_k - len(ids)
    assert saved > 0          # rows shared experts somewhere: fetched once for the batch, not per row


@pytest.mark.slow
def test_runtime_dma_order_is_the_plans_schedule(mixed_run):
    """The tiles the kernel issued, in its runtime order, are the DMA entries of `schedule(plan)`
    for the routing that happened: the list `mk.perf.sim` replays is the list the kernel executes."""
    plan = mixed_run["step_fn"].plan
    routing = mixed_run["routing"]
    dmas, _ = schedule(plan, [len(routing[l]) for l in range(1, plan.config.layers)])
    planned, dense = [], 0
    for d in dmas:
        if d.tensor.startswith("expert["):
            e, part = int(d.tensor[len("expert["):d.tensor.index("]")]), d.tensor.rsplit(".", 1)[1]
            tile = d.tile + (plan.expert_gu.tiles if part == "down" else 0)
            planned.append(("expert", d.layer, sorted(routing[d.layer])[e], tile))
        else:
            planned.append(("dense", dense))
            dense += 1
    issues, _ = ring_events(mixed_run)
    assert [what for _, what in issues] == planned


# ---- 3. weights from a checkpoint ----------------------------------------------------------------
@pytest.mark.extended
@pytest.mark.slow
def test_kernel_on_checkpoint_weights(tmp_path):
    """`mk.io.synth` writes a mini checkpoint (MXFP4 experts), `mk.io.checkpoint` loads it with the
    experts packed (`experts="mxfp4"`); the kernel streams them packed and dequantizes them in
    VMEM, the reference runs on the loader's bf16 dequantization of the same bytes."""
    from mk.io import checkpoint, convert, synth

    cfg = get_config("mini")
    written = synth.write_checkpoint(cfg, tmp_path, seed=3)
    loaded_cfg, packed = checkpoint.load_with_config(tmp_path, progress=False, experts="mxfp4")
    assert loaded_cfg == cfg and set(packed["moe"]["w1"]) == {"packed", "scale"}
    params = convert.dequantize_experts(packed)
    np.testing.assert_array_equal(np.asarray(params["moe"]["w1"], np.float32),
                                  np.asarray(written["moe"]["w1"], np.float32))
    step_fn = make_step_fn(packed, cfg, 2, ctx=CTX, interpret=interpret_params(detect_races=True))
    assert step_fn.plan.experts == "mxfp4"
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, cfg.vocab, (2, 2), dtype=np.int32)
    side_by_side(step_fn, params, cfg, reference.init_cache(cfg, 2, CTX), tokens, "checkpoint weights")


# ---- 4. full K3 widths -----------------------------------------------------------------------------
def k3_widths_config():
    """k3-slice's widths (d 7168, 96 heads x 128 = 12288, latent 3584, expert FFN 3072, shared
    6144, q_rank 1536, kv_rank 512) in two layers: KDA + dense MLP, then MLA + MoE.

    Trimmed so one interpret-mode step fits a test (1.3 G weights remain): vocab 512 (the LM head
    is one matrix like any other), 4 experts top-2 (each expert keeps K3's shapes; only how many
    are stored and fetched shrinks), dense_hidden 1024 (layer 0's MLP at 33792 adds 0.7 G weights
    and ~2.8k DMAs of 512x512 and exercises nothing the shared expert does not).
    """
    return get_config("k3-slice").replace(layers=2, full_attention=(1,), vocab=512, experts=4, top_k=2,
                                          dense_hidden=1024)


K3_TILE = (1024, 1024)


@pytest.mark.extended
@pytest.mark.slow
def test_k3_widths_step():
    """One decode step at K3 widths, kernel vs reference. Tiles of 1024 x 1024 (the plan's tile is
    a parameter; 512 x 512 is K3's default): ~1k weight DMAs instead of ~3.7k, which interpret
    mode would take minutes for. Still several row blocks per contraction (7168 = 7 x 1024) and
    ragged last column blocks (49280, 14464, 15872 columns). Measured on the shared 2-core VM
    (load ~3.5): params 38 s, packing 32 s, kernel step 71 s, reference 7 s."""
    cfg = k3_widths_config()
    assert (cfg.dim, cfg.attn_width, cfg.latent, cfg.expert_hidden) == (7168, 12288, 3584, 3072)
    params = params_mod.init(cfg, 0)
    step_fn = make_step_fn(params, cfg, 1, ctx=128, interpret=interpret_params(detect_races=True), tile=K3_TILE)
    assert step_fn.plan.k_max >= 12288 and step_fn.plan.tile_k == K3_TILE[0]
    tokens = np.array([[7]], np.int32)
    side_by_side(step_fn, params, cfg, reference.init_cache(cfg, 1, 128), tokens, "k3 widths")


# ---- 6. bit-exact where the MoE sum used to round differently ----------------------------------------
@pytest.mark.slow
def test_bit_exact_on_mini(mini, mini_b1):
    """`python -m mk check --config mini`'s first token (seed 0): before the reference's MoE
    weighted sum started from an opaque zero, layer 2's r_sum landed on a bf16 tie that the two
    sides broke differently (the reference had FMA-fused w0*e0, the kernel w1*e1). Now every
    logit and every cache entry is identical."""
    cfg, params = mini
    token = np.random.default_rng(0).integers(0, cfg.vocab, (1, 3), dtype=np.int32)[:, 0]
    cache = reference.init_cache(cfg, 1, CTX)
    k_logits, k_cache = kernel_step(mini_b1, cache, token)
    r_logits, r_cache = reference.decode_step(params, cache, jnp.asarray(token), cfg=cfg)
    np.testing.assert_array_equal(k_logits, np.asarray(r_logits))
    for n in CACHE_KEYS:
        np.testing.assert_array_equal(np.asarray(k_cache[n], np.float32), np.asarray(r_cache[n], np.float32), err_msg=n)


@pytest.mark.extended
@pytest.mark.slow
def test_bit_exact_on_mini_tp8_batch8():
    """8 heads, 8 rows, matrices deeper than one 512-row chunk, a later step with a non-zero KDA
    state and two MLA positions: every logit and cache entry equals the reference's. Guards the
    three places where the reference once summed in another order than the kernel: KDA's norms
    and delta rule batched over [8, H, D] (now one head of one row at a time, `kda_head`), MLA's
    softmax in one pass (now the online softmax over 128-slot blocks, `attend_block`), and one
    dot over all of K (now 512-deep chunks added in order, `common.mm`, as the kernel's tiles)."""
    from mk.kernel.check import check

    cfg = get_config("mini-tp8")
    res = check(cfg, batch=8, steps=2, detect_races=False, ctx=128)
    assert res["max_abs_logit_err"] == 0.0, res["per_step"]
    assert all(v == 0.0 for v in res["cache_max_abs_err_by_array"].values()), res["cache_max_abs_err_by_array"]


# ---- 4b. the depth presets' thin widths: 256 x 256 tiles, 16 in flight -------------------------------
def thin_widths_config():
    """k3-d48's widths in two layers (an MLA layer second), 4 experts top-2, vocab 512."""
    return get_config("k3-d48").replace(layers=2, full_attention=(1,), vocab=512, experts=4, top_k=2,
                                        dense_hidden=1024)


def step_outputs(step_fn, cfg, tokens) -> dict:
    """The kernel's logits and caches after one step from a new cache."""
    logits, cache = kernel_step(step_fn, reference.init_cache(cfg, len(tokens), 128), tokens)
    return {"logits": logits, **{n: cache[n] for n in CACHE_KEYS}}


def order_violations_vs_reference(got: dict, params, cfg, tokens) -> list[str]:
    """The kernel's one step (`step_outputs`) against the reference's under the summation-order rule
    (docs/numerics.md, "When the order differs"): 2 bf16 ulps per layer at each array's scale, a row
    at a routing near tie on the reference compared separately. [] = close."""
    cache = reference.init_cache(cfg, len(tokens), 128)
    logits, r_cache, margins = reference.decode_step(params, cache, jnp.asarray(tokens), cfg=cfg, route_margins=True)
    want = {"logits": logits, **{n: r_cache[n] for n in CACHE_KEYS}}
    return order_violations(cfg, got, want, route_ties(margins))


def transposed_tile(params, tile: int = 256) -> dict:
    """params with the dense MLP's first tile x tile block of `gate` transposed: a planted fault, what a
    kernel that read that weight tile transposed would compute."""
    gate = params["dense"]["gate"]
    return {**params, "dense": {**params["dense"], "gate": gate.at[:tile, :tile].set(gate[:tile, :tile].T)}}


@pytest.mark.slow
def test_thin_widths_step_on_the_default_small_tiles(seed):
    """k3-d48's widths (d 1792 = 3.5 x 512, 12 heads x 128, latent 1024, expert FFN 768 = 1.5 x 512)
    in two layers: `default_tile` picks 256 x 256 (512 x 512 would stream 16% padding at 48 layers)
    and `default_prefetch_depth` 64 tiles in flight. One step at B = 2, kernel vs reference, every
    matrix split into several row and column blocks of the small tile."""
    from mk.kernel.plan import default_prefetch_depth, default_tile, stream_bytes

    full = get_config("k3-d48")
    assert default_tile(full) == (256, 256) and default_prefetch_depth((256, 256)) == 64
    assert stream_bytes(full, (256, 256)) < 0.87 * stream_bytes(full, (512, 512))
    cfg = thin_widths_config()
    params = params_mod.init(cfg, seed)
    tokens = np.random.default_rng(seed).integers(0, cfg.vocab, 2).astype(np.int32)
    step_fn = make_step_fn(params, cfg, 2, ctx=128, interpret=interpret_params(detect_races=True))
    assert (step_fn.plan.tile_k, step_fn.plan.tile_n, step_fn.plan.prefetch_depth) == (256, 256, 64)
    got = step_outputs(step_fn, cfg, tokens)
    # Not bit-exact: a 256-row tile adds its fp32 partial product to the accumulator where the
    # reference sums 512 rows in one dot (the fp32 sum in another order), so the order rule.
    reasons = order_violations_vs_reference(got, params, cfg, tokens)
    assert not reasons, "; ".join(reasons)
    # The rule still sees a real bug: one weight tile read transposed fails it.
    assert order_violations_vs_reference(got, transposed_tile(params), cfg, tokens)


@pytest.mark.extended
@pytest.mark.slow
def test_thin_widths_mxfp4_step_on_padded_512_tiles():
    """The same thin widths with MXFP4 experts: `default_tile` picks 512 x 512 (the unpack's fewest
    bundles per weight), so every 1792-wide row block and every 768-deep expert matrix ends in a
    zero-padded partial tile, packed codes and scale bytes included. One step at B = 2, kernel vs
    the reference on the loader's bf16 dequantization of the same bytes."""
    from mk.io import convert
    from mk.kernel.plan import default_tile

    assert default_tile(get_config("k3-d48"), experts="mxfp4") == (512, 512)
    cfg = thin_widths_config()
    packed = jax.device_get(params_mod.init_fast(cfg, 1, "mxfp4"))
    params = convert.dequantize_experts(packed)
    step_fn = make_step_fn(packed, cfg, 2, ctx=128, interpret=interpret_params(detect_races=True))
    assert (step_fn.plan.experts, step_fn.plan.tile_k, step_fn.plan.tile_n) == ("mxfp4", 512, 512)
    tokens = np.array([7, 300], np.int32)
    reasons = order_violations_vs_reference(step_outputs(step_fn, cfg, tokens), params, cfg, tokens)
    assert not reasons, "; ".join(reasons)                                       # seen: 0 (bit-exact)
