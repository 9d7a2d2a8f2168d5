"""mk.io.checkpoint.load_sharded on 8 virtual CPU devices (mesh ep 4 x tp 2, mini-tp8).

Every leaf equals the unsharded `load` bit for bit and carries `mk.model.sharding`'s spec; every
device's shard holds its block; the process reads each checkpoint element once (no whole tensor
where a block suffices); bad input gives a `CheckpointError` naming the file and the process.
"""
import os

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from mk.io import checkpoint as ck
from mk.io import schema
from mk.model import reference_sharded as rs
from mk.io import synth
from mk.model.config import get_config
from mk.model.sharding import param_spec

CFG = get_config("mini-tp8")


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    p = tmp_path_factory.mktemp("ckpt_sharded") / "mini-tp8"
    synth.write_checkpoint(CFG, p, seed=0, shard_bytes=1 << 20, tokenizer=False)
    return str(p)


@pytest.fixture(scope="module")
def mesh():
    return rs.mesh_for(CFG, 8)


def leaves(tree):
    return [(tuple(getattr(k, "key", k) for k in p), x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]


def same_bits(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("experts", ["bf16", "mxfp4"])
def test_sharded_load_equals_load(path, mesh, experts, monkeypatch):
    reads = []
    orig = ck.ShardedCheckpoint.read

    def read(self, name, rows=None, cols=None):
        x = orig(self, name, rows, cols)
        reads.append((name, x.nbytes))
        return x
    monkeypatch.setattr(ck.ShardedCheckpoint, "read", read)
    tree = ck.load_sharded(path, mesh, experts=experts)
    monkeypatch.undo()
    want = dict(leaves(ck.load(path, experts=experts, progress=False, to_jax=False)))
    got = leaves(tree)
    assert [k for k, _ in got] == list(want)
    split = 0
    for keys, x in got:
        spec = param_spec(keys, x.ndim)
        assert x.sharding.mesh == mesh and x.sharding.spec == P(*spec), keys
        assert same_bits(x, want[keys]), keys
        for shard in x.addressable_shards:                     # each device holds its own block
            assert same_bits(shard.data, want[keys][shard.index]), (keys, shard.device)
        split += any(s is not None for s in spec)
    assert split >= 28                                         # every family the rule splits
    # Each element of the checkpoint was read once (blocks, not whole tensors, for split leaves):
    # bytes read == bytes of all tensors (AttnRes folds read their [1, d] projection row too).
    with ck.Checkpoint(path) as c:
        total = 0
        for name in c.weight_map:
            shape, dtype = c.tensor_info(name)
            total += int(np.prod(shape)) * np.dtype(schema._NP_DTYPES[dtype]).itemsize
    assert sum(n for _, n in reads) == total
    q_name = "language_model.model.layers.1.self_attn.q_proj.weight"
    assert sorted(n for name, n in reads if name == q_name) == [CFG.attn_width * CFG.dim * 2 // 8] * 8


def clone(path, tmp_path, drop=()):
    out = tmp_path / "clone"
    out.mkdir()
    for f in os.listdir(path):
        if f not in drop:
            os.symlink(os.path.join(path, f), out / f)
    return str(out)


def test_missing_shard_names_file_and_process(path, mesh, tmp_path):
    with ck.Checkpoint(path) as c:
        shard = c.weight_map["language_model.model.layers.2.block_sparse_moe.experts.3.w1.weight_packed"]
    bad = clone(path, tmp_path, drop=(shard,))
    with pytest.raises(schema.MissingShardError) as e:
        ck.load_sharded(bad, mesh)
    msg = str(e.value)
    assert msg.startswith("process 0 of 1: ") and shard in msg and "\n" not in msg, msg


def test_failed_block_read_names_shard_and_process(path, mesh, monkeypatch):
    """A block read that fails after validation (a shard vanishing, an I/O error) is a
    CheckpointError naming the process, the shard file and the tensor."""
    name = "language_model.model.layers.3.self_attn.kv_b_proj.weight"
    orig = ck.ShardedCheckpoint.read

    def read(self, n, rows=None, cols=None):
        if n == name:
            raise FileNotFoundError(2, "No such file or directory", self.file_of(n))
        return orig(self, n, rows, cols)
    monkeypatch.setattr(ck.ShardedCheckpoint, "read", read)
    with pytest.raises(schema.CheckpointError) as e:
        ck.load_sharded(path, mesh)
    msg = str(e.value)
    with ck.Checkpoint(path) as c:
        file = c.file_of(name)
    assert msg.startswith("process 0 of 1: ") and file in msg and name in msg, msg
