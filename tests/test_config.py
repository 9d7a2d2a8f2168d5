"""mk.model.config: the K3 contract (spec 1.1), its layer schedules (1.3, 1.4.2), presets and from_hf."""
import copy
import json

import pytest

from mk.model.config import PRESETS, REQUIRED_SETTINGS, ConfigError, K3Config, get_config
from mk.errors import UserError

K3 = K3Config()


# ---- full-size contract and schedules -------------------------------------------------------

def test_full_size_values():
    c = K3
    assert (c.dim, c.latent, c.expert_hidden, c.shared_hidden, c.dense_hidden) == (7168, 3584, 3072, 6144, 33792)
    assert (c.experts, c.top_k, c.layers, c.heads, c.head_dim) == (896, 16, 93, 96, 128)
    assert (c.q_rank, c.kv_rank, c.qk_extra, c.vocab, c.conv_size) == (1536, 512, 64, 163840, 4)
    assert (c.residual_block, c.eps, c.situ_beta, c.situ_linear_beta, c.gate_lower_bound) == (12, 1e-5, 4.0, 25.0, -5.0)
    assert c.qk_head_dim == 192 and c.k_cache_dim == 256 and c.attn_width == 12288
    assert c.mla_scale == pytest.approx(1 / 192 ** 0.5, rel=1e-15)


def test_kda_mla_index_maps():
    c = K3
    mla = [l for l in range(93) if l % 4 == 3] + [92]
    assert c.mla_layers == tuple(mla) and len(mla) == 24 and c.n_mla == 24
    assert c.is_mla(92) and not c.is_mla(0)
    kda = [l for l in range(93) if l not in mla]
    assert c.kda_layers == tuple(kda) and c.n_kda == 69
    for l in range(93):
        assert c.is_mla(l) == (l in mla)
        if c.is_mla(l):
            assert c.mla_index(l) == l // 4 == c.family_index(l)
        else:
            assert c.kda_index(l) == l - l // 4 == c.family_index(l)
    assert sorted(c.kda_index(l) for l in kda) == list(range(69))
    assert sorted(c.mla_index(l) for l in mla) == list(range(24))
    assert c.n_moe == 92  # layers 1..92, MoE family index l - 1


def _attn_res_schedule_by_hand(layers: int, block: int):
    """Spec 1.4.2 in words, as symbolic bookkeeping: which snapshots each mix reads.

    `p` is the set of contributions in the running partial sum; snapshots are appended when a new
    block starts (p is stored, then restarts from that layer's attention output)."""
    stored, p = [], {"embedding"}
    attn, mlp, starts = [], [], []
    for l in range(layers):
        attn.append(len(stored))                 # the mix reads stored snapshots + p
        start = l % block == 0
        starts.append(start)
        if start:
            stored.append(p)
            p = set()
        p = p | {(l, "attn")}
        mlp.append(len(stored))
        p = p | {(l, "mlp")}
    return attn, mlp, starts, stored, p


def test_attn_res_bookkeeping_k3():
    c = K3
    attn, mlp, starts, stored, last = _attn_res_schedule_by_hand(93, 12)
    for l in range(93):
        assert c.n_attn_blocks(l) == attn[l], l
        assert c.n_mlp_blocks(l) == mlp[l], l
        assert c.starts_block(l) == starts[l], l
    # exactly 8 stored snapshots; b_0 = embedding, b_n = all sublayer outputs of layers 12(n-1)..12n-1
    assert c.n_blocks == len(stored) == 8
    assert stored[0] == {"embedding"}
    for n in range(1, 8):
        assert stored[n] == {(l, k) for l in range(12 * (n - 1), 12 * n) for k in ("attn", "mlp")}
    # the final mix reads all 8 snapshots plus p = layers 84..92, which is never stored
    assert last == {(l, k) for l in range(84, 93) for k in ("attn", "mlp")}
    assert c.n_blocks == c.n_mlp_blocks(92) == 92 // 12 + 1
    # spot checks straight from the spec's formulas
    assert [c.n_attn_blocks(l) for l in (0, 1, 12, 13, 24, 92)] == [0, 1, 1, 2, 2, 8]
    assert [c.n_mlp_blocks(l) for l in (0, 11, 12, 92)] == [1, 1, 2, 8]


def test_attn_res_bookkeeping_presets():
    for name, c in PRESETS.items():
        attn, mlp, starts, stored, _ = _attn_res_schedule_by_hand(c.layers, c.residual_block)
        assert [c.n_attn_blocks(l) for l in range(c.layers)] == attn, name
        assert [c.n_mlp_blocks(l) for l in range(c.layers)] == mlp, name
        assert [c.starts_block(l) for l in range(c.layers)] == starts, name
        assert c.n_blocks == len(stored), name


# ---- presets -------------------------------------------------------------------------------

def test_mini_contract():
    c = get_config("mini")
    assert c.layers >= 8 and not c.is_mla(0)                 # dense layer 0 is KDA
    assert c.n_mla >= 2 and c.is_mla(c.layers - 1)
    assert c.n_kda >= 2
    assert c.n_blocks >= 3
    assert c.experts >= 16 and c.top_k >= 4
    assert c.head_dim == 128
    for w in (c.dim, c.latent, c.expert_hidden, c.shared_hidden, c.dense_hidden, c.attn_width,
              c.q_rank, c.kv_rank, c.k_cache_dim):
        assert w % 128 == 0, w
    assert 1000 <= c.vocab <= 10000 and c.vocab % 128 == 0
    assert c.qk_extra == K3.qk_extra and c.conv_size == K3.conv_size


def test_k3_slice_contract():
    c = get_config("k3-slice")
    full = K3
    for f in ("dim", "latent", "expert_hidden", "num_shared_experts", "dense_hidden", "top_k", "heads",
              "head_dim", "q_rank", "kv_rank", "qk_extra", "vocab", "conv_size", "eps"):
        assert getattr(c, f) == getattr(full, f), f
    assert c.layers == 4 and c.mla_layers == (3,) and c.kda_layers == (0, 1, 2)
    assert c.experts >= c.top_k


def test_get_config():
    assert get_config("k3") == K3
    assert get_config(K3) is K3
    with pytest.raises(ConfigError, match="unknown config 'nope'"):
        get_config("nope")
    assert issubclass(ConfigError, UserError)


# ---- from_hf / to_hf -----------------------------------------------------------------------

def test_to_hf_full_attn_layers_one_based():
    lin = K3.to_hf()["text_config"]["linear_attn_config"]
    assert lin["full_attn_layers"] == [l + 1 for l in range(3, 92, 4)] + [93]
    hf = K3.to_hf()
    hf["text_config"]["linear_attn_config"]["full_attn_layers"] = [4, 93]
    assert K3Config.from_hf(hf).full_attention == (3, 92)


def test_from_hf_roundtrip_dict():
    hf = K3.to_hf()
    assert K3Config.from_hf(hf) == K3Config()
    assert K3Config.from_hf(hf["text_config"]) == K3Config()      # without the wrapper
    for c in PRESETS.values():
        assert K3Config.from_hf(c.to_hf()) == c


def test_from_hf_roundtrip_file_and_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(K3.to_hf()))
    assert K3Config.from_hf(tmp_path / "config.json") == K3Config()
    assert K3Config.from_hf(str(tmp_path)) == K3Config()
    assert get_config(str(tmp_path)) == K3Config()
    flat = tmp_path / "flat"
    flat.mkdir()
    (flat / "config.json").write_text(json.dumps(K3.to_hf()["text_config"]))
    assert K3Config.from_hf(flat) == K3Config()


def _wrong(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, str):
        return "softmax"
    if isinstance(value, int):
        return value + 1
    return value * 2.5


@pytest.mark.parametrize("key", sorted(REQUIRED_SETTINGS))
def test_from_hf_rejects_unsupported_setting(key):
    hf = K3.to_hf()
    expected = REQUIRED_SETTINGS[key]
    found = _wrong(expected)
    hf["text_config"][key] = found
    with pytest.raises(ConfigError) as e:
        K3Config.from_hf(hf)
    msg = str(e.value)
    assert f"'{key}'" in msg and repr(expected) in msg and repr(found) in msg, msg
    assert "\n" not in msg


def test_from_hf_rejects_full_rank_gate_off():
    hf = K3.to_hf()
    hf["text_config"]["linear_attn_config"]["use_full_rank_gate"] = False
    with pytest.raises(ConfigError, match=r"'linear_attn_config.use_full_rank_gate': expected True, found False"):
        K3Config.from_hf(hf)


def test_from_hf_rejects_bool_for_int_setting():
    hf = K3.to_hf()
    hf["text_config"]["first_k_dense_replace"] = True      # True == 1 in Python, still not the setting
    with pytest.raises(ConfigError, match="first_k_dense_replace"):
        K3Config.from_hf(hf)


def test_from_hf_missing_keys():
    hf = K3.to_hf()
    del hf["text_config"]["hidden_size"]
    with pytest.raises(ConfigError, match="missing key 'hidden_size'"):
        K3Config.from_hf(hf)
    hf = K3.to_hf()
    del hf["text_config"]["linear_attn_config"]["gate_lower_bound"]
    with pytest.raises(ConfigError, match="missing key 'linear_attn_config.gate_lower_bound'"):
        K3Config.from_hf(hf)
    hf = K3.to_hf()
    del hf["text_config"]["moe_renormalize"]
    with pytest.raises(ConfigError, match="'moe_renormalize': expected True, found <missing>"):
        K3Config.from_hf(hf)


def test_from_hf_wrong_types(tmp_path):
    """Wrong JSON types are ConfigErrors naming the file once and the key, not AttributeErrors."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps([K3.to_hf()]))
    with pytest.raises(ConfigError, match="the top level must be a JSON object, found list"):
        K3Config.from_hf(tmp_path)
    hf = K3.to_hf()
    hf["text_config"]["linear_attn_config"] = "128"
    with pytest.raises(ConfigError, match="'linear_attn_config' must be an object, found str"):
        K3Config.from_hf(hf)
    hf = K3.to_hf()
    hf["text_config"]["rms_norm_eps"] = "small"
    with pytest.raises(ConfigError, match="'rms_norm_eps' must be a number, found 'small'"):
        K3Config.from_hf(hf)
    hf = K3.to_hf()
    del hf["text_config"]["vocab_size"]
    path.write_text(json.dumps(hf))
    with pytest.raises(ConfigError) as e:
        K3Config.from_hf(tmp_path)
    assert str(e.value) == f"{path}: missing key 'vocab_size'"


def test_from_hf_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="config.json not found"):
        K3Config.from_hf(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        K3Config.from_hf(tmp_path)


def test_from_hf_does_not_mutate_input():
    hf = K3.to_hf()
    before = copy.deepcopy(hf)
    K3Config.from_hf(hf)
    assert hf == before


def test_invalid_dataclass_values():
    with pytest.raises(ConfigError, match="top_k"):
        K3.replace(top_k=1000)
    with pytest.raises(ConfigError, match="layer 0"):
        K3.replace(full_attention=(0, 3))
    with pytest.raises(ConfigError, match="outside"):
        K3.replace(full_attention=(3, 93))
