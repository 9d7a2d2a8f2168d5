"""mk.io.checkpoint / mk.io.synth / `python -m mk synth|logits|load`: round trips and bad input.

One mini-config synthetic checkpoint is written per session; every bad-input case is a clone of
it (symlinks, with only the damaged file copied) so each test stays fast.
"""
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from mk.io import checkpoint as ck
from mk.io import schema, convert
from mk.io import synth
from mk.__main__ import main
from mk.model.config import ConfigError, get_config
from mk.model.params import shapes

CFG = get_config("mini")
SEED = 0
TOKENS = [5, 17, 3, 1000, 42, 7]
KDA_Q = "language_model.model.layers.1.self_attn.q_proj.weight"
NORM = "language_model.model.layers.2.input_layernorm.weight"
SCALE = "language_model.model.layers.2.block_sparse_moe.experts.5.w2.weight_scale"


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory):
    """(path, tree returned by write_checkpoint) of the session's mini checkpoint."""
    path = tmp_path_factory.mktemp("ckpt") / "mini"
    written = synth.write_checkpoint(CFG, path, seed=SEED, shard_bytes=4 << 20)
    return str(path), written


@pytest.fixture(scope="session")
def expected():
    return synth.quantized_params(CFG, SEED)


@pytest.fixture(scope="session")
def loaded(ckpt):
    return ck.load(ckpt[0], progress=False)


def _bits(x):
    x = np.asarray(x)
    return x.dtype, x.shape, x.view(np.uint8).tobytes()


def assert_same_tree(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
        assert _bits(x) == _bits(y), jax.tree_util.keystr(path)


# ---- round trips --------------------------------------------------------------------------------
def test_round_trip_equals_quantized_params(loaded, expected):
    assert_same_tree(loaded, expected)


def test_loaded_tree_has_params_layout(loaded):
    want = shapes(CFG)
    assert jax.tree.structure(loaded) == jax.tree.structure(want)
    for x, s in zip(jax.tree.leaves(loaded), jax.tree.leaves(want)):
        assert isinstance(x, jax.Array) and x.shape == s.shape and x.dtype == s.dtype


def test_write_checkpoint_returns_what_it_wrote(ckpt, expected):
    assert_same_tree(ckpt[1], expected)


def test_quantized_params_only_touch_experts(expected):
    init = __import__("mk.model.params", fromlist=["init"]).init(CFG, SEED)
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(init), jax.tree.leaves(expected)):
        key = jax.tree_util.keystr(path)
        if any(w in key for w in ("'w1'", "'w2'", "'w3'")):
            assert np.max(np.abs(np.asarray(x, np.float32) - np.asarray(y, np.float32))) > 0
        else:
            assert _bits(x) == _bits(y), key


def test_mxfp4_mode_dequantizes_to_the_same(ckpt, expected):
    tree = ck.load(ckpt[0], experts="mxfp4", progress=False, threads=1)
    abstract = ck.abstract_params(ckpt[0], experts="mxfp4")
    assert jax.tree.structure(tree) == jax.tree.structure(abstract)
    for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(abstract)):
        assert x.shape == s.shape and x.dtype == s.dtype
    for w in synth.EXPERT_FAMILIES:
        got = convert.dequantize_mxfp4(tree["moe"][w]["packed"], tree["moe"][w]["scale"])
        assert _bits(got) == _bits(expected["moe"][w]), w
    rest = {k: v for k, v in tree.items() if k != "moe"}
    assert_same_tree(rest, {k: v for k, v in expected.items() if k != "moe"})


@pytest.mark.parametrize("experts", ["mxfp4", "bf16"])
def test_lazy_params_read_the_bits_load_returns(ckpt, experts):
    """`Checkpoint.lazy_params`: same tree; every leaf, whole or one slot, has load's bits."""
    tree = ck.load(ckpt[0], experts=experts, progress=False, to_jax=False)
    with ck.Checkpoint(ckpt[0]) as c:
        lazy = c.lazy_params(experts)
        assert jax.tree.structure(lazy) == jax.tree.structure(tree)
        for (path, leaf), x in zip(jax.tree_util.tree_leaves_with_path(lazy), jax.tree.leaves(tree)):
            assert (leaf.shape, leaf.dtype) == (x.shape, x.dtype), jax.tree_util.keystr(path)
            assert _bits(leaf) == _bits(x), jax.tree_util.keystr(path)
        w2 = lazy["moe"]["w2"]["scale"] if experts == "mxfp4" else lazy["moe"]["w2"]
        x2 = tree["moe"]["w2"]["scale"] if experts == "mxfp4" else tree["moe"]["w2"]
        assert _bits(w2[1]) == _bits(x2[1]) and _bits(w2[1, 3]) == _bits(x2[1, 3])
        assert _bits(w2[1, 2:5]) == _bits(x2[1, 2:5]) and _bits(w2[:2, 7]) == _bits(x2[:2, 7])
        assert _bits(lazy["kda"]["conv"][0, 2]) == _bits(tree["kda"]["conv"][0, 2])
        with pytest.raises(IndexError, match="moe"):
            w2[CFG.n_moe]


def test_kernel_weights_packed_from_lazy_params_are_the_loaded_trees(ckpt):
    """pack_weights reads the same bits slot by slot (a lazy tree: piece by piece) as from the
    loaded tree (one program)."""
    from mk.kernel.plan import make_plan
    from mk.kernel.packing import pack_weights

    plan = make_plan(CFG, 1, experts="mxfp4")
    want = pack_weights(plan, ck.load(ckpt[0], experts="mxfp4", progress=False, to_jax=False))
    with ck.Checkpoint(ckpt[0]) as c:
        got = pack_weights(plan, c.lazy_params("mxfp4"))
    assert sorted(got) == sorted(want)
    for k in want:
        assert _bits(got[k]) == _bits(want[k]), k


@pytest.mark.parametrize("experts", ["mxfp4", "bf16"])
def test_weights_streamed_to_a_device_piece_by_piece_are_pack_weights(ckpt, experts, monkeypatch):
    """`device_share(..., stream=True)`, the path onto a TPU (each array allocated on the device,
    then filled piece by piece as packed), from lazy params, experts in chunks of 3 (16 = 5 x 3 + 1):
    pack_weights' bits (one chunk per layer), both expert formats."""
    from mk.kernel import packing
    from mk.kernel.plan import make_plan
    from mk.kernel.step import device_share

    plan = make_plan(CFG, 1, experts=experts)
    want = packing.pack_weights(plan, ck.load(ckpt[0], experts="mxfp4", progress=False, to_jax=False))
    kn = max(m.k_pad * m.n_pad for m in (plan.expert_gu, plan.expert_down))
    monkeypatch.setattr(packing, "EXPERT_CHUNK_BYTES", 3 * kn * (2 if experts == "bf16" else 1))
    assert [x.stop - x.start for x in packing._expert_chunks(plan, 2 if experts == "bf16" else 1)] == [3] * 5 + [1]
    with ck.Checkpoint(ckpt[0]) as c:
        got = device_share(plan, c.lazy_params("mxfp4"), 0, jax.devices()[0], stream=True)
    assert sorted(got) == sorted(want)
    for k in want:
        assert _bits(got[k]) == _bits(want[k]), k


def test_abstract_params_from_config_only(ckpt, tmp_path):
    only_config = tmp_path / "cfg"
    only_config.mkdir()
    (only_config / "config.json").write_text(open(os.path.join(ckpt[0], "config.json")).read())
    assert ck.abstract_params(only_config) == shapes(CFG)


def test_several_shards_and_spec_names(ckpt):
    path = ckpt[0]
    index = json.load(open(os.path.join(path, schema.INDEX_FILE)))
    shards = set(index["weight_map"].values())
    assert len(shards) > 1
    for s in shards:
        assert os.path.getsize(os.path.join(path, s)) <= (4 << 20) + (1 << 16)
    names = set(index["weight_map"])
    assert schema.LM_HEAD in names and "language_model.model.embed_tokens.weight" in names
    assert all(n == schema.LM_HEAD or n.startswith(schema.PREFIX) for n in names)
    assert names == {s.name for e in schema.layout(CFG) for s in e.sources}
    with ck.Checkpoint(path) as c:
        assert c.tensor_info(KDA_Q) == ((CFG.attn_width, CFG.dim), "BF16")
        assert c.tensor_info(KDA_Q.replace("q_proj", "q_conv1d"))[1] == "F32"
        assert c.tensor_info(SCALE) == ((CFG.latent, CFG.expert_hidden // 32), "U8")
        # partial reads only fetch the requested rows / columns
        full = c.read(KDA_Q)
        np.testing.assert_array_equal(c.read(KDA_Q, rows=slice(8, 24)), full[8:24])
        np.testing.assert_array_equal(c.read(KDA_Q, rows=slice(0, 4), cols=slice(16, 48)), full[:4, 16:48])


def test_orientation_matches_params(ckpt, expected):
    """PyTorch [out, in] on disk, [in, out] in the tree; conv [HD,1,C] -> [C,HD]; AttnRes fold."""
    with ck.Checkpoint(ckpt[0]) as c:
        q = c.read(KDA_Q)
        np.testing.assert_array_equal(q.T, np.asarray(expected["kda"]["q"][CFG.kda_index(1)]))
        conv = c.read(KDA_Q.replace("q_proj", "k_conv1d"))
        np.testing.assert_array_equal(conv[:, 0, :].T, np.asarray(expected["kda"]["conv"][CFG.kda_index(1), 1]))
        p = "language_model.model.layers.4."
        fold = c.read(p + "mlp_res_norm.weight") * c.read(p + "mlp_res_proj.weight")[0]
        np.testing.assert_array_equal(fold, np.asarray(expected["layer"]["mlp_res"][4]))


# ---- CLI ----------------------------------------------------------------------------------------------
def test_logits_cli_matches_reference_bit_for_bit(ckpt, expected, tmp_path):
    from mk.model import reference
    out = tmp_path / "logits.npy"
    toks = ",".join(map(str, TOKENS))
    assert main(["logits", "--checkpoint", ckpt[0], "--tokens", toks, "--out", str(out), "--no-progress"]) == 0
    got = np.load(out)
    want = np.asarray(reference.teacher_forced_logits(expected, CFG, TOKENS), np.float32)
    assert got.dtype == np.float32 and got.shape == (len(TOKENS), CFG.vocab)
    assert got.tobytes() == want.tobytes()


def test_synth_and_load_cli(tmp_path, capsys):
    out = tmp_path / "tiny"
    args = ["synth", "--config", "mini", "--override", "layers=4,full_attention=[3],experts=4,top_k=2",
            "--override", "vocab=640", "--out", str(out), "--seed", "3", "--shard-mb", "1", "--no-progress"]
    assert main(args) == 0
    cfg = ck.load_config(out)
    assert (cfg.layers, cfg.full_attention, cfg.experts, cfg.vocab) == (4, (3,), 4, 640)
    capsys.readouterr()
    assert main(["load", str(out), "--bench", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert {"bytes", "seconds", "gb_per_s", "raw_read_gb_per_s", "ratio_of_medians"} <= set(res)
    assert res["bytes"] == ck.checkpoint_bytes(out)
    assert res["experts"] == "mxfp4"                     # the default: experts stay packed
    assert res["output_bytes"] < res["bytes"] + 4096     # nothing expanded: the tree is the file's bytes
    assert 0 < res["rss_before_bytes"] <= res["peak_rss_bytes"]
    assert res["peak_rss_over_checkpoint"] == res["peak_rss_bytes"] / res["bytes"]
    assert_same_tree(ck.load(out, progress=False), synth.quantized_params(cfg, 3))


def test_fast_synth_writes_a_checkpoint_the_kernel_packs(ckpt, tmp_path):
    """`mk synth --fast` (random tensors in the checkpoint's layout, shards in parallel): the same files,
    tensors and bytes as `write_checkpoint`'s, weights that validate and load, E8M0 scales the kernel
    dequantizes exactly, every family near `init`'s scale; the same bits whatever the thread count."""
    from mk.kernel.plan import make_plan
    from mk.kernel.packing import pack_weights
    from mk.model.params import init

    outs = [tmp_path / f"fast{t}" for t in (1, 3)]
    for out, t in zip(outs, (1, 3)):
        assert main(["synth", "--config", "mini", "--fast", "--threads", str(t), "--out", str(out), "--seed", "3",
                     "--shard-mb", "4", "--no-progress"]) == 0
    assert sorted(os.listdir(outs[0])) == sorted(os.listdir(ckpt[0]))
    with open(os.path.join(outs[0], schema.INDEX_FILE)) as a, open(os.path.join(ckpt[0], schema.INDEX_FILE)) as b:
        assert a.read() == b.read()
    assert ck.checkpoint_bytes(outs[0]) == ck.checkpoint_bytes(ckpt[0])
    for f in os.listdir(outs[0]):
        with open(outs[0] / f, "rb") as a, open(outs[1] / f, "rb") as b:
            assert a.read() == b.read(), f
    tree = ck.load(outs[0], progress=False, to_jax=False)
    pack_weights(make_plan(CFG, 1, experts="mxfp4"), ck.load(outs[0], experts="mxfp4", progress=False))
    ref = init(CFG, 3)
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(tree), jax.tree.leaves(ref)):
        x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
        assert np.isfinite(x).all() and 0.6 < np.sqrt(np.mean(x ** 2) / np.mean(y ** 2)) < 1.6, jax.tree_util.keystr(path)


def test_bad_override_exits_2(tmp_path, capsys):
    assert main(["synth", "--override", "layers=2", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and err.count("\n") == 1 and "full_attention" in err


def test_kernel_backend_dispatches_to_mk_kernel(ckpt, tmp_path, monkeypatch):
    import types
    calls = []

    def fake(params, cfg, tokens, ctx=None, options=None):
        calls.append((cfg, list(tokens), sorted(params), options.mxfp4_matmul))
        return np.zeros((len(tokens), cfg.vocab), np.float32)

    monkeypatch.setitem(sys.modules, "mk.kernel.step", types.SimpleNamespace(teacher_forced_logits=fake))
    out = tmp_path / "l.npy"
    assert main(["logits", "--checkpoint", ckpt[0], "--tokens", "1,2", "--out", str(out),
                 "--backend", "kernel", "--no-progress", "--mxfp4-matmul", "fp8"]) == 0
    assert calls == [(CFG, [1, 2], sorted(shapes(CFG)), "fp8")] and np.load(out).shape == (2, CFG.vocab)


def test_logits_bench_prints_peak_rss_against_the_checkpoint(ckpt, tmp_path, monkeypatch, capsys):
    """`mk logits --bench --json`: the process's peak RSS and the checkpoint's bytes on disk."""
    import types
    monkeypatch.setitem(sys.modules, "mk.kernel.step", types.SimpleNamespace(
        teacher_forced_logits=lambda params, cfg, tokens, ctx=None, options=None: np.zeros((len(tokens), cfg.vocab),
                                                                                            np.float32)))
    capsys.readouterr()
    assert main(["logits", "--checkpoint", ckpt[0], "--tokens", "1,2", "--out", str(tmp_path / "l.npy"),
                 "--backend", "kernel", "--no-progress", "--bench", "--json"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["backend"] == "kernel" and res["checkpoint_bytes"] == ck.checkpoint_bytes(ckpt[0])
    assert 0 < res["rss_before_bytes"] <= res["peak_rss_bytes"]
    assert res["peak_rss_over_checkpoint"] == res["peak_rss_bytes"] / res["checkpoint_bytes"]
    kinds = res["peak_rss_by_kind"]                  # sampled from /proc/self/status: whose memory it is
    assert set(kinds) == {"VmRSS", "RssAnon", "RssFile", "RssShmem"}
    assert 0 < kinds["RssAnon"] <= kinds["VmRSS"] <= res["peak_rss_bytes"] * 1.01
    assert res["peak_rss_anon_over_checkpoint"] == kinds["RssAnon"] / res["checkpoint_bytes"]
    assert res["device_peak_bytes"] is None and res["device_limit_bytes"] is None   # a CPU has no device memory


def test_rss_sampler_sees_a_short_lived_peak():
    """An allocation made and freed inside the block still shows in the anonymous peak (the sampler's
    thread, not the test, takes the sample; on a loaded machine it may need more than one interval)."""
    import time

    from mk.cli.checkpoint import RssSampler
    with RssSampler(interval=0.01) as s:
        x = np.ones(64 << 20, np.uint8)                  # 64 MiB touched
        during = RssSampler.read()["RssAnon"]            # (a reading before it may be stale: other threads free)
        deadline = time.monotonic() + 5.0
        while s.peaks.get("RssAnon", 0) < during - (4 << 20) and time.monotonic() < deadline:
            time.sleep(0.01)
        del x
    assert s.peaks["RssAnon"] >= during - (4 << 20)


def test_kernel_backend_missing_is_a_clear_error(ckpt, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "mk.kernel.step", None)  # import mk.kernel -> ModuleNotFoundError
    rc = main(["logits", "--checkpoint", ckpt[0], "--tokens", "1,2", "--out", str(tmp_path / "l.npy"),
               "--backend", "kernel", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "mk.kernel" in err and err.count("\n") == 1


# ---- bad input --------------------------------------------------------------------------------------------
def clone(src, dst, copy=()):
    """A checkpoint directory of symlinks to `src`, with the files in `copy` copied (to damage)."""
    os.makedirs(dst)
    for f in os.listdir(src):
        if f in copy:
            with open(os.path.join(src, f), "rb") as a, open(os.path.join(dst, f), "wb") as b:
                b.write(a.read())
        else:
            os.symlink(os.path.join(src, f), os.path.join(dst, f))
    return str(dst)


def shard_of(path, name):
    return json.load(open(os.path.join(path, schema.INDEX_FILE)))["weight_map"][name]


def rewrite_shard(src, dst, name, fn):
    """Clone with the shard holding `name` rewritten: fn(tensors dict) mutates it."""
    shard = shard_of(src, name)
    path = clone(src, dst)
    tensors = load_file(os.path.join(src, shard))
    fn(tensors)
    os.remove(os.path.join(path, shard))
    save_file(tensors, os.path.join(path, shard), metadata={"format": "pt"})
    return path, shard


def edit_json(path, file, fn):
    f = os.path.join(path, file)
    data = json.load(open(f))
    fn(data)
    with open(f, "w") as fh:
        json.dump(data, fh)


def _no_config(src, dst):
    path = clone(src, dst)
    os.remove(os.path.join(path, "config.json"))
    return path, schema.MissingFileError, ["config.json"]


def _unsupported(src, dst):
    path = clone(src, dst, copy=["config.json"])
    edit_json(path, "config.json", lambda d: d["text_config"].update(hidden_act="gelu"))
    return path, schema.CheckpointConfigError, ["config.json", "hidden_act"]


def _no_index(src, dst):
    path = clone(src, dst)
    os.remove(os.path.join(path, schema.INDEX_FILE))
    return path, schema.MissingFileError, [schema.INDEX_FILE]


def _index_not_json(src, dst):
    path = clone(src, dst)
    os.remove(os.path.join(path, schema.INDEX_FILE))
    with open(os.path.join(path, schema.INDEX_FILE), "w") as f:
        f.write('{"weight_map": {')
    return path, schema.IndexFormatError, [schema.INDEX_FILE, "JSON"]


def _index_no_weight_map(src, dst):
    path = clone(src, dst, copy=[schema.INDEX_FILE])
    edit_json(path, schema.INDEX_FILE, lambda d: d.pop("weight_map"))
    return path, schema.IndexFormatError, [schema.INDEX_FILE, "weight_map"]


def _shard_missing(src, dst):
    shard = shard_of(src, KDA_Q)
    path = clone(src, dst)
    os.remove(os.path.join(path, shard))
    return path, schema.MissingShardError, [shard, "language_model.model."]


def _not_in_index(src, dst):
    path = clone(src, dst, copy=[schema.INDEX_FILE])
    edit_json(path, schema.INDEX_FILE, lambda d: d["weight_map"].pop(KDA_Q))
    return path, schema.MissingTensorError, [schema.INDEX_FILE, KDA_Q]


def _not_in_shard(src, dst):
    path, shard = rewrite_shard(src, dst, KDA_Q, lambda t: t.pop(KDA_Q))
    return path, schema.MissingTensorError, [shard, KDA_Q]


def _wrong_shape(src, dst):
    path, shard = rewrite_shard(src, dst, KDA_Q, lambda t: t.update({KDA_Q: np.ascontiguousarray(t[KDA_Q][:-1])}))
    return path, schema.TensorShapeError, [shard, KDA_Q, "shape"]


def _wrong_dtype(src, dst):
    path, shard = rewrite_shard(src, dst, NORM, lambda t: t.update({NORM: t[NORM].astype(np.float32)}))
    return path, schema.TensorDtypeError, [shard, NORM, "F32", "BF16"]


def _truncated(src, dst):
    shard = shard_of(src, KDA_Q)
    path = clone(src, dst, copy=[shard])
    f = os.path.join(path, shard)
    os.truncate(f, os.path.getsize(f) - 1000)
    return path, schema.TruncatedShardError, [shard, "truncated"]


def _bad_header(src, dst):
    shard = shard_of(src, KDA_Q)
    path = clone(src, dst, copy=[shard])
    with open(os.path.join(path, shard), "r+b") as f:
        f.seek(8)
        f.write(b"#garbage")  # the JSON header starts at byte 8
    return path, schema.CorruptHeaderError, [shard, "header"]


def _scale(value):
    def make(src, dst):
        def damage(t):
            s = t[SCALE].copy()
            s[3, 1] = value
            t[SCALE] = s
        path, shard = rewrite_shard(src, dst, SCALE, damage)
        return path, schema.ScaleByteError, [shard, SCALE, f"byte {value}", "[3, 1]"]
    make.__name__ = f"_scale_{value}"
    return make


BAD = [_no_config, _unsupported, _no_index, _index_not_json, _index_no_weight_map, _shard_missing,
       _not_in_index, _not_in_shard, _wrong_shape, _wrong_dtype, _truncated, _bad_header, _scale(0),
       _scale(255)]


@pytest.mark.parametrize("case", BAD, ids=lambda f: f.__name__.strip("_"))
def test_bad_input_raises_named_checkpoint_error(case, ckpt, tmp_path, capsys):
    path, err, words = case(ckpt[0], tmp_path / "bad")
    for experts in ("bf16", "mxfp4"):
        with pytest.raises(err) as info:
            ck.load(path, experts=experts, progress=False)
        assert isinstance(info.value, schema.CheckpointError)
        msg = str(info.value)
        for w in words:
            assert w in msg, (w, msg)
        with pytest.raises(err) as info:         # the kernel backend's slot-by-slot reads: same errors
            with ck.Checkpoint(path) as c:
                jax.tree.map(np.asarray, c.lazy_params(experts))
        for w in words:
            assert w in str(info.value), (w, str(info.value))
    assert main(["load", path, "--no-progress"]) == 2
    out = capsys.readouterr()
    assert out.err.startswith("error: ") and out.err.count("\n") == 1
    assert "Traceback" not in out.err + out.out


def test_unsupported_config_is_also_a_config_error(ckpt, tmp_path):
    path, _, _ = _unsupported(ckpt[0], tmp_path / "bad")
    with pytest.raises(ConfigError):
        ck.load_config(path)


def test_bad_checkpoint_in_a_real_process_prints_one_line(ckpt, tmp_path):
    path, _, _ = _wrong_shape(ckpt[0], tmp_path / "bad")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-m", "mk", "load", path, "--no-progress"], capture_output=True,
                       text=True, env=env, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr and KDA_Q in r.stderr


def test_shapes_and_dtypes_checked_before_any_read(ckpt, tmp_path, monkeypatch):
    """A bad tensor late in the file order is reported before any tensor data is read."""
    path, _ = rewrite_shard(ckpt[0], tmp_path / "bad", schema.LM_HEAD,
                            lambda t: t.update({schema.LM_HEAD: t[schema.LM_HEAD].astype(np.float32)}))
    reads = []
    orig = ck.Checkpoint.read
    monkeypatch.setattr(ck.Checkpoint, "read", lambda self, *a, **k: reads.append(a) or orig(self, *a, **k))
    with pytest.raises(schema.TensorDtypeError):
        ck.load(path, progress=False)
    assert reads == []


def test_shard_streamer_reads_in_order_and_stays_within_lookahead(tmp_path):
    import time
    from mk.io.checkpoint import ShardStreamer

    names = ["a.safetensors", "b.safetensors", "c.safetensors"]
    for n in names:
        (tmp_path / n).write_bytes(os.urandom(3 << 20))

    def wait_for(cond):
        t = time.time()
        while not cond() and time.time() - t < 10:
            time.sleep(0.01)
        return cond()

    st = ShardStreamer(str(tmp_path), names, lookahead=0)
    try:
        assert wait_for(lambda: len(st.streamed) == 1)
        time.sleep(0.2)
        assert st.streamed == [str(tmp_path / "a.safetensors")]       # waits for the loader
        st.consumer_at(["b.safetensors"])
        assert wait_for(lambda: len(st.streamed) == 2)
    finally:
        st.stop()
    assert not st._thread.is_alive() and [os.path.basename(f) for f in st.streamed] == names[:2]
