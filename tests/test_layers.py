"""Every K3 sublayer (spec 1.4) against an independent straightforward formulation.

The independent versions below are plain numpy in float64, with the spec's bf16 rounding points
applied explicitly (`rb`: round to bf16 via float32, like the fp32-then-cast of the code). They
share nothing with mk.model.layers but the parameter layout.

Tolerances. bf16 keeps 8 significant bits, so one rounding moves a value by at most half an ulp
(2^-8 relative, ulp = 2^(floor(log2|x|) - 7)). The code accumulates in fp32 where the oracle uses
float64; the two agree to ~1e-7 relative before the cast, so a bf16-rounded output either agrees
bit for bit or (when the exact value sits within ~1e-7 of a rounding midpoint) differs by one ulp.
Single-rounding outputs are therefore checked to <= 1 ulp. Outputs behind a chain of roundings
(a whole sublayer) also admit a rare 1-ulp flip of an intermediate, which perturbs the result by
about 2^-8 of one term's contribution; those get 1 ulp + 2^-8 * rms(output). Pure fp32 results
(delta-rule state, scores) use rtol 2e-5 (fp32 sums of ~100 terms vs float64). Where the math
leaves no freedom (data movement, masking, routing choices, n = 0 mixes) the checks are bit-exact.
"""
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from mk.model import params as mkparams
from mk.model.config import get_config
from mk.model.layers import attn_res, common, dense_mlp, kda, mla, moe

BF16 = ml_dtypes.bfloat16
F64 = np.float64

# A tiny but complete config: every family present (layer 0 KDA + dense, layer 1 MLA + MoE).
TINY = get_config("mini").replace(
    dim=64, latent=32, expert_hidden=16, dense_hidden=48, experts=8, top_k=3, layers=2, heads=2,
    head_dim=16, q_rank=32, kv_rank=32, qk_extra=8, vocab=64, residual_block=1, full_attention=(1,))


# ---- the independent formulation ------------------------------------------------------------

def rb(x):
    """Round to bf16 (via float32, nearest-even), returned as float64."""
    return np.asarray(x, F64).astype(np.float32).astype(BF16).astype(F64)


def f64(x):
    return np.asarray(x, dtype=np.float32).astype(F64) if not isinstance(x, np.ndarray) or x.dtype != F64 else x


def sig(x):
    x = np.asarray(x, F64)
    with np.errstate(over="ignore"):
        e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1 / (1 + e), e / (1 + e))


def np_rms(x, gamma, eps):
    x = np.asarray(x, F64)
    return rb(x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * np.asarray(gamma, F64))


def np_situ(g, u, beta=4.0, lbeta=25.0):
    g, u = np.asarray(g, F64), np.asarray(u, F64)
    return rb(beta * np.tanh(g / beta) * sig(g) * (lbeta * np.tanh(u / lbeta)))


def np_mix(p, blocks, w, eps):
    cands = [np.asarray(b, F64) for b in blocks] + [np.asarray(p, F64)]
    s = np.stack([(v @ w) / np.sqrt(np.mean(v * v, -1) + eps) for v in cands], -1)
    a = np.exp(s - s.max(-1, keepdims=True))
    a /= a.sum(-1, keepdims=True)
    return rb(sum(a[:, j:j + 1] * cands[j] for j in range(len(cands))))


def np_kda(a, w, S, conv_state, cfg):
    B, H, D = a.shape[0], cfg.heads, cfg.head_dim
    f = rb(a @ w["f_a"])
    g_raw = rb(f @ w["f_b"]).reshape(B, H, D)
    qkv = np.stack([rb(a @ w[n]) for n in "qkv"], 1)                   # [B, 3, HD]
    g_o = rb(a @ w["g"]).reshape(B, H, D)
    beta = sig(rb(a @ w["b"]))                                          # [B, H]
    window = np.concatenate([conv_state, qkv[:, :, None]], 2)          # [B, 3, C, HD], tap 0 oldest
    acc = sum(w["conv"][None, :, t] * window[:, :, t] for t in range(cfg.conv_size))
    c = rb(acc * sig(acc)).reshape(B, 3, H, D)
    q = c[:, 0] / np.sqrt(np.sum(c[:, 0] ** 2, -1, keepdims=True) + 1e-6) / math.sqrt(D)
    k = c[:, 1] / np.sqrt(np.sum(c[:, 1] ** 2, -1, keepdims=True) + 1e-6)
    v = c[:, 2]
    g = cfg.gate_lower_bound * sig(np.exp(w["a_log"])[:, None] * (g_raw + w["dt_bias"].reshape(H, D)))
    S = S.copy()
    o = np.zeros((B, H, D))
    for b in range(B):
        for h in range(H):
            s = np.exp(g[b, h])[:, None] * S[b, h]                      # decay key rows
            u = beta[b, h] * (v[b, h] - s.T @ k[b, h])
            s = s + np.outer(k[b, h], u)
            S[b, h] = s
            o[b, h] = s.T @ q[b, h]
    out = rb(np_rms(rb(o), w["o_norm"], cfg.eps) * rb(sig(g_o))).reshape(B, H * D)
    return rb(out @ w["o"]), S, window[:, :, 1:]


def np_mla(a, w, kc, vc, pos, cfg):
    B, H, D, X, R = a.shape[0], cfg.heads, cfg.head_dim, cfg.qk_extra, cfg.kv_rank
    Dq = D + X
    c_q = np_rms(rb(a @ w["q_a"]), w["q_a_norm"], cfg.eps)
    kva = rb(a @ w["kv_a"])
    c_kv = np_rms(kva[:, :R], w["kv_a_norm"], cfg.eps)
    k_r = kva[:, R:]
    q = rb(c_q @ w["q_b"]).reshape(B, H, Dq)
    kv = rb(c_kv @ w["kv_b"]).reshape(B, H, 2 * D)
    kc, vc = kc.copy(), vc.copy()
    o = np.zeros((B, H, D))
    for b in range(B):
        t = pos[b]
        for h in range(H):
            kc[b, h, t] = 0
            kc[b, h, t, :D], kc[b, h, t, D:Dq] = kv[b, h, :D], k_r[b]
            vc[b, h, t] = kv[b, h, D:]
            s = kc[b, h, :t + 1, :Dq] @ q[b, h] / math.sqrt(Dq)
            p = np.exp(s - s.max())
            o[b, h] = (p / p.sum()) @ vc[b, h, :t + 1]
    gate = rb(sig(rb(a @ w["g"]))).reshape(B, H, D)
    out = rb(rb(o) * gate).reshape(B, H * D)
    return rb(out @ w["o"]), kc, vc


def np_route(m, router, bias, k):
    s = sig(m @ router)                                                 # [B, E]
    ids = np.stack([sorted(np.lexsort((np.arange(len(r)), -r))[:k]) for r in s + bias])
    chosen = np.take_along_axis(s, ids, -1)
    return ids, chosen / chosen.sum(-1, keepdims=True)


def np_moe(m, w, cfg, norm_before_sum=False):
    ids, wts = np_route(m, w["router"], w["router_bias"], cfg.top_k)
    lat = rb(m @ w["latent_down"])
    rows = []
    for b in range(m.shape[0]):
        acc = 0
        for e, we in zip(ids[b], wts[b]):                               # ascending expert id
            h = np_situ(rb(lat[b] @ w["w1"][e]), rb(lat[b] @ w["w3"][e]), cfg.situ_beta, cfg.situ_linear_beta)
            out = rb(h @ w["w2"][e])
            acc = acc + we * (np_rms(out, w["latent_norm"], cfg.eps) if norm_before_sum else out)
        rows.append(acc)
    r_sum = rb(np.stack(rows))
    r_n = r_sum if norm_before_sum else np_rms(r_sum, w["latent_norm"], cfg.eps)
    z_routed = r_n @ w["latent_up"]
    hs = np_situ(rb(m @ w["shared_gate"]), rb(m @ w["shared_up"]), cfg.situ_beta, cfg.situ_linear_beta)
    return rb(z_routed + hs @ w["shared_down"])


# ---- helpers ----------------------------------------------------------------------------------

def ulp(x):
    ax = np.abs(np.asarray(x, F64))
    return 2.0 ** (np.floor(np.log2(np.maximum(ax, 2.0 ** -126))) - 7)


def assert_ulps(actual, expected, n=1, atol=0.0):
    a, e = np.asarray(actual, F64), np.asarray(expected, F64)
    assert a.shape == e.shape, (a.shape, e.shape)
    err = np.abs(a - e)
    bad = err > n * ulp(e) + atol
    assert not bad.any(), (f"{bad.sum()} of {bad.size} elements off by more than {n} ulp + {atol:.3g}; "
                           f"worst {err.max():.4g} at {np.unravel_index(err.argmax(), err.shape)}")


def assert_chain(actual, expected):
    """Output behind several bf16 roundings: 1 ulp + 2^-8 * rms (see module docstring)."""
    e = np.asarray(expected, F64)
    assert_ulps(actual, e, 1, 2.0 ** -8 * float(np.sqrt(np.mean(e * e))))


def rand_bf16(rng, shape, scale=1.0):
    x = rb(scale * rng.standard_normal(shape))
    return jnp.asarray(x, jnp.bfloat16), x


@pytest.fixture(scope="module")
def tiny_params():
    p = mkparams.init(TINY, seed=3)
    as64 = lambda t: {k: np.asarray(v).astype(F64) for k, v in t.items()}
    one = lambda t: {k: v[0] for k, v in t.items()}
    return {
        "kda": (one(p["kda"]), as64(one(p["kda"]))),
        "mla": (one(p["mla"]), as64(one(p["mla"]))),
        "moe": (one(p["moe"]), as64(one(p["moe"]))),
        "dense": (p["dense"], as64(p["dense"])),
    }


# ---- common numerics -------------------------------------------------------------------------

def test_bf_rounds_nearest_even():
    x = jnp.asarray([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 1 + 2 ** -8 + 2 ** -20], jnp.float32)
    assert np.asarray(common.bf(x), F64).tolist() == [1.0, 1 + 2 ** -6, -1.0, 1 + 2 ** -7]


def test_rms():
    rng = np.random.default_rng(0)
    x, x64 = rand_bf16(rng, (4, 256), 3.0)
    g64 = rb(1 + 0.1 * rng.standard_normal(256))
    g = jnp.asarray(g64, jnp.bfloat16)
    out = common.rms(x, g, 1e-5)
    assert out.dtype == jnp.bfloat16
    assert_ulps(out, np_rms(x64, g64, 1e-5), 1)
    # fp32 in -> fp32 out (cast back to the input dtype), no bf16 rounding
    out32 = common.rms(jnp.asarray(x64, jnp.float32), g, 1e-5)
    assert out32.dtype == jnp.float32
    want = x64 / np.sqrt(np.mean(x64 ** 2, -1, keepdims=True) + 1e-5) * g64
    np.testing.assert_allclose(np.asarray(out32), want, rtol=2e-6)
    # eps matters for tiny inputs: an all-zero row stays zero, no NaN
    assert not np.asarray(common.rms(jnp.zeros((1, 8), jnp.bfloat16), jnp.ones(8), 1e-5), F64).any()


def test_sigmoid_rounds_once():
    x = jnp.asarray(np.linspace(-8, 8, 257), jnp.bfloat16)
    s = common.sigmoid(x)
    assert s.dtype == jnp.float32                       # evaluated in fp32, not rounded yet
    x64 = np.asarray(x, F64)
    np.testing.assert_allclose(np.asarray(s, F64), sig(x64), rtol=1e-6)
    # one rounding of the (fp32-accurate) value: bit-exact against round(exact sigmoid)
    np.testing.assert_array_equal(np.asarray(common.bf(s), F64), rb(sig(x64)))


def test_situ_matches_formula():
    rng = np.random.default_rng(1)
    g, g64 = rand_bf16(rng, (8, 128), 4.0)
    u, u64 = rand_bf16(rng, (8, 128), 20.0)
    out = common.situ(g, u, 4.0, 25.0)
    assert out.dtype == jnp.bfloat16
    assert_ulps(out, np_situ(g64, u64), 1)


def test_situ_limits():
    rng = np.random.default_rng(2)
    # small g, small u: gate factor -> SiLU(g) = g * sigmoid(g), up factor -> u.
    # tanh(x) = x (1 - x^2/3 + ...): relative deviation <= g^2/48 + u^2/1875 < 2.2e-4 for |g|, |u| <= 0.1
    g, g64 = rand_bf16(rng, (512,), 0.03)
    u, u64 = rand_bf16(rng, (512,), 0.03)
    g, g64, u, u64 = jnp.clip(g, -0.1, 0.1), np.clip(g64, -0.1, 0.1), jnp.clip(u, -0.1, 0.1), np.clip(u64, -0.1, 0.1)
    silu_u = g64 * sig(g64) * u64
    assert_ulps(common.situ(g, u, 4.0, 25.0), silu_u, 1, 0.0 + 2.2e-4 * np.abs(silu_u).max())
    # bounds for inputs over the whole bf16 range: |gate| <= beta * sigmoid(g) and <= |SiLU(g)|,
    # |up| <= linear_beta and <= |u|; hence |situ| <= 4 * 25 (+ the final half-ulp rounding)
    mag = 10.0 ** rng.uniform(-3, 38, (2, 4096))
    sign = rng.choice([-1.0, 1.0], (2, 4096))
    g64, u64 = rb(np.minimum(mag[0], 3.3e38) * sign[0]), rb(np.minimum(mag[1], 3.3e38) * sign[1])
    out = np.asarray(common.situ(jnp.asarray(g64, jnp.bfloat16), jnp.asarray(u64, jnp.bfloat16), 4.0, 25.0), F64)
    assert np.isfinite(out).all()
    half = 1 + 2.0 ** -8
    assert (np.abs(out) <= 4.0 * sig(g64) * 25.0 * half).all()
    assert (np.abs(out) <= 4.0 * sig(g64) * np.abs(u64) * half).all()
    assert (np.abs(out) <= np.abs(g64) * sig(g64) * 25.0 * half).all()
    assert (np.abs(out) <= 4 * 25).all()
    # the caps are reached: huge positive g and u -> 4 * 25 exactly; huge negative g -> 0
    big = jnp.asarray([3e38, 1e4, 100.0], jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(common.situ(big, big, 4.0, 25.0), F64), [100.0, 100.0, 100.0])
    assert np.asarray(common.situ(-big, big, 4.0, 25.0), F64)[:2].tolist() == [0.0, 0.0]
    # the constants are parameters, not hard-coded
    assert_ulps(common.situ(big[2:], big[2:], 2.0, 3.0), [6.0], 0)


# ---- attention residuals -------------------------------------------------------------------------

def test_mix_matches_formula():
    rng = np.random.default_rng(3)
    d, B = 256, 3
    w = 2.0 / np.sqrt(d) * rng.standard_normal(d)
    w32 = jnp.asarray(w, jnp.float32)
    w64 = np.asarray(w32, F64)
    scales = [1.0, 0.1, 10.0, 0.003]      # the last one's mean square (~1e-5) makes eps matter
    blocks = [rand_bf16(rng, (B, d), s) for s in scales]
    p, p64 = rand_bf16(rng, (B, d), 0.5)
    for n in range(1, len(blocks) + 1):
        out = attn_res.mix(p, [b for b, _ in blocks[:n]], w32, 1e-5)
        assert out.dtype == jnp.bfloat16
        assert_ulps(out, np_mix(p64, [b for _, b in blocks[:n]], w64, 1e-5), 1)


def test_mix_exact_cases():
    rng = np.random.default_rng(4)
    p, _ = rand_bf16(rng, (2, 128))
    w = jnp.asarray(rng.standard_normal(128), jnp.float32)
    # no snapshots (layer 0's attention): x = p exactly
    np.testing.assert_array_equal(np.asarray(attn_res.mix(p, [], w, 1e-5)), np.asarray(p))
    # a convex mixture of identical bf16 candidates rounds back to them exactly
    np.testing.assert_array_equal(np.asarray(attn_res.mix(p, [p, p, p], w, 1e-5)), np.asarray(p))
    # a dominant score selects its candidate: w aligned with b_0, b_0 = 8 * p-direction
    b0 = common.bf(jnp.asarray(np.sign(np.asarray(w)), jnp.float32)[None].repeat(2, 0))
    out = attn_res.mix(p, [b0], w * 100, 1e-5)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(b0))


# ---- KDA ------------------------------------------------------------------------------------------

def _kda_inputs(rng, B, cfg):
    H, D, C = cfg.heads, cfg.head_dim, cfg.conv_size
    a, a64 = rand_bf16(rng, (B, cfg.dim))
    S64 = 0.3 * rng.standard_normal((B, H, D, D)).astype(np.float32).astype(F64)
    conv, conv64 = rand_bf16(rng, (B, 3, C - 1, H * D))
    return a, a64, jnp.asarray(S64, jnp.float32), S64, conv, conv64


def test_kda_matches_direct_formulation(tiny_params):
    w, w64 = tiny_params["kda"]
    rng = np.random.default_rng(5)
    a, a64, S, S64, conv, conv64 = _kda_inputs(rng, 3, TINY)
    y, S_new, conv_new = kda.kda(a, w, S, conv, TINY)
    y64, S_want, conv_want = np_kda(a64, w64, S64, conv64, TINY)
    assert y.dtype == jnp.bfloat16 and S_new.dtype == jnp.float32 and conv_new.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(S_new, F64), S_want, rtol=2e-5, atol=2e-6)
    assert_ulps(conv_new, conv_want, 1)
    assert_chain(y, y64)


def test_kda_conv_state_shift_exact(tiny_params):
    w, w64 = tiny_params["kda"]
    rng = np.random.default_rng(6)
    a, a64, S, _, conv, _ = _kda_inputs(rng, 2, TINY)
    _, _, conv_new = kda.kda(a, w, S, conv, TINY)
    conv_new = np.asarray(conv_new)
    # new conv state = last C-1 window entries: the old entries shift by one, bit for bit ...
    np.testing.assert_array_equal(conv_new[:, :, :-1], np.asarray(conv)[:, :, 1:])
    # ... and the newest entry is this token's bf16 q/k/v projection (pre-conv)
    for i, n in enumerate("qkv"):
        assert_ulps(conv_new[:, i, -1], rb(a64 @ w64[n]), 1)


def test_short_conv_taps():
    rng = np.random.default_rng(7)
    HD, C = 32, 4
    win, win64 = rand_bf16(rng, (2, 3, C, HD))
    taps = jnp.asarray(rng.standard_normal((3, C, HD)), jnp.float32)
    acc = sum(np.asarray(taps, F64)[None, :, t] * win64[:, :, t] for t in range(C))
    assert_ulps(kda.short_conv(win, taps), rb(acc * sig(acc)), 1)
    # the current token (last window slot) pairs with the last tap, the oldest with tap 0
    onehot = np.zeros((3, C, HD), np.float32)
    onehot[:, C - 1] = 1.0
    np.testing.assert_array_equal(np.asarray(kda.short_conv(win, jnp.asarray(onehot)), F64),
                                  rb(win64[:, :, -1] * sig(win64[:, :, -1])))


def test_delta_rule():
    rng = np.random.default_rng(8)
    B, H, D = 2, 3, 8
    S = rng.standard_normal((B, H, D, D)).astype(np.float32)
    q, k, v = (rng.standard_normal((B, H, D)).astype(np.float32) for _ in range(3))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    g = -rng.uniform(0, 5, (B, H, D)).astype(np.float32)
    beta = rng.uniform(0, 1, (B, H)).astype(np.float32)

    def delta_rule(S, q, k, v, g, beta):   # kda.delta_rule_head on every (row, head)
        out = [[kda.delta_rule_head(*(jnp.asarray(x) for x in (
            S[b, h], q[b, h][None], k[b, h][None], v[b, h][None], np.exp(g[b, h])[None],
            np.full((1, D), beta[b, h], np.float32)))) for h in range(H)] for b in range(B)]
        return (np.array([[o[0] for o, _ in r] for r in out]), np.array([[s for _, s in r] for r in out]))

    o, S_new = delta_rule(S, q, k, v, g, beta)
    for b in range(B):
        for h in range(H):
            s = np.exp(g[b, h].astype(F64))[:, None] * S[b, h]
            s = s + np.outer(k[b, h], beta[b, h] * (v[b, h] - s.T @ k[b, h]))
            np.testing.assert_allclose(np.asarray(S_new[b, h], F64), s, rtol=2e-5, atol=2e-6)
            np.testing.assert_allclose(np.asarray(o[b, h], F64), s.T @ q[b, h], rtol=2e-5, atol=2e-5)
    # with beta = 1 and no decay the delta rule stores v at unit key k: S_new^T k == v
    _, S1 = delta_rule(S, q, k, v, 0 * g, np.ones_like(beta))
    np.testing.assert_allclose(np.einsum("bhkv,bhk->bhv", np.asarray(S1, F64), k), v, rtol=1e-4, atol=1e-5)
    # beta = 0: state only decays
    _, S0 = delta_rule(S, q, k, v, g, 0 * beta)
    np.testing.assert_allclose(np.asarray(S0), np.exp(g)[..., None] * S, rtol=1e-6)


def test_kda_gate_range():
    lb = -5.0
    H, D = 4, 16
    rng = np.random.default_rng(9)
    # moderate inputs (sigmoid argument within +-15, where fp32 sigmoid is not yet 0 or 1):
    # strictly inside (lb, 0), i.e. exp(g) in (e^-5, 1)
    g_raw = jnp.asarray(rng.uniform(-2, 2, (2, H, D)), jnp.bfloat16)
    a_log = jnp.asarray(np.log(rng.uniform(1, 5, H)), jnp.float32)
    dt = jnp.asarray(rng.uniform(-1, 1, (H, D)), jnp.float32)
    g = np.asarray(kda.decay(g_raw, a_log, dt, lb), F64)
    assert ((g > lb) & (g < 0)).all()
    want = lb * sig(np.exp(np.asarray(a_log, F64))[:, None] * (np.asarray(g_raw, F64) + np.asarray(dt, F64)))
    np.testing.assert_allclose(g, want, rtol=1e-6, atol=1e-6)
    # extreme inputs over the whole bf16 range (and +-inf): never outside [lb, 0], never NaN; in
    # fp32 sigmoid saturates to exactly 0 or 1, so the bounds themselves are reached
    ext = np.array([-np.inf, -3.38e38, -1e4, -30, -1, 0, 1, 30, 1e4, 3.38e38, np.inf])
    g_raw = jnp.asarray(np.broadcast_to(ext[:, None, None], (len(ext), H, D)), jnp.bfloat16)
    a_log = jnp.asarray([-20.0, 0.0, np.log(16.0), 20.0], jnp.float32)
    dt = jnp.asarray(rng.uniform(-3, 3, (H, D)), jnp.float32)
    g = np.asarray(kda.decay(g_raw, a_log, dt, lb), F64)
    assert np.isfinite(g).all() and (g >= lb).all() and (g <= 0).all()
    decay = np.exp(g)
    assert (decay >= np.exp(lb) * (1 - 1e-6)).all() and (decay <= 1).all()
    assert (g[-1] == lb).all() and (g[0] == 0).all()


def test_kda_output_gate():
    rng = np.random.default_rng(10)
    o = jnp.asarray(rng.standard_normal((2, 3, 16)), jnp.float32)
    g_o, g64 = rand_bf16(rng, (2, 3, 16), 3.0)
    gamma = jnp.asarray(1 + 0.1 * rng.standard_normal(16), jnp.float32)
    out = kda.output_gate(o, g_o, gamma, 1e-5)
    want = rb(np_rms(rb(np.asarray(o, F64)), np.asarray(gamma, F64), 1e-5) * rb(sig(g64)))
    assert out.dtype == jnp.bfloat16
    assert_chain(out, want)


# ---- MLA ------------------------------------------------------------------------------------------

def _mla_inputs(rng, cfg, B=3, ctx=16):
    H, D, Kc = cfg.heads, cfg.head_dim, cfg.k_cache_dim
    a, a64 = rand_bf16(rng, (B, cfg.dim))
    kc64 = np.zeros((B, H, ctx, Kc))
    kc64[..., :cfg.qk_head_dim] = rb(rng.standard_normal((B, H, ctx, cfg.qk_head_dim)))
    vc64 = rb(rng.standard_normal((B, H, ctx, D)))
    pos = np.array([0, 5, ctx - 1][:B], np.int32)
    return a, a64, kc64, vc64, pos


def test_mla_matches_direct_formulation(tiny_params):
    w, w64 = tiny_params["mla"]
    rng = np.random.default_rng(11)
    a, a64, kc64, vc64, pos = _mla_inputs(rng, TINY)
    y, kc, vc = mla.mla(a, w, jnp.asarray(kc64, jnp.bfloat16), jnp.asarray(vc64, jnp.bfloat16),
                        jnp.asarray(pos), TINY)
    y64, kc_want, vc_want = np_mla(a64, w64, kc64, vc64, pos, TINY)
    assert y.dtype == kc.dtype == vc.dtype == jnp.bfloat16
    assert_ulps(kc, kc_want, 1)
    assert_ulps(vc, vc_want, 1)
    assert_chain(y, y64)
    # only slot pos[b] of row b was written
    for b, t in enumerate(pos):
        keep = np.arange(kc64.shape[2]) != t
        np.testing.assert_array_equal(np.asarray(kc, F64)[b][:, keep], kc64[b][:, keep])
        np.testing.assert_array_equal(np.asarray(vc, F64)[b][:, keep], vc64[b][:, keep])


def test_mla_causal_future_slots_never_matter(tiny_params):
    w, _ = tiny_params["mla"]
    rng = np.random.default_rng(12)
    a, _, kc64, vc64, pos = _mla_inputs(rng, TINY, ctx=16)
    clean = mla.mla(a, w, jnp.asarray(kc64, jnp.bfloat16), jnp.asarray(vc64, jnp.bfloat16), jnp.asarray(pos), TINY)
    junk = np.array([np.nan, np.inf, -np.inf, 3e38, -3e38, 1e20])
    kg, vg = kc64.copy(), vc64.copy()
    for b, t in enumerate(pos):                  # slot pos is overwritten first, so it is junk too
        kg[b, :, t:] = rng.choice(junk, kg[b, :, t:].shape)
        vg[b, :, t:] = rng.choice(junk, vg[b, :, t:].shape)
    dirty = mla.mla(a, w, jnp.asarray(kg, jnp.bfloat16), jnp.asarray(vg, jnp.bfloat16), jnp.asarray(pos), TINY)
    np.testing.assert_array_equal(np.asarray(dirty[0]), np.asarray(clean[0]))
    assert np.isfinite(np.asarray(clean[0], F64)).all()
    for b, t in enumerate(pos):
        np.testing.assert_array_equal(np.asarray(dirty[1])[b, :, :t + 1], np.asarray(clean[1])[b, :, :t + 1])
        np.testing.assert_array_equal(np.asarray(dirty[2])[b, :, :t + 1], np.asarray(clean[2])[b, :, :t + 1])


def test_mla_shared_raw_k_r(tiny_params):
    w, w64 = tiny_params["mla"]
    cfg = TINY
    rng = np.random.default_rng(13)
    a, a64 = rand_bf16(rng, (2, cfg.dim))
    q, k, v = (np.asarray(x, F64) for x in mla.project_qkv(a, w, cfg))
    D, Dq, R = cfg.head_dim, cfg.qk_head_dim, cfg.kv_rank
    assert q.shape == k.shape == (2, cfg.heads, cfg.k_cache_dim) and v.shape == (2, cfg.heads, D)
    # the extra key part is the same raw (un-normalised, un-rotated) projection in every head
    k_r = rb(a64 @ w64["kv_a"])[:, R:]
    for h in range(cfg.heads):
        np.testing.assert_array_equal(k[:, h, D:Dq], k[:, 0, D:Dq])
    assert_ulps(k[:, 0, D:Dq], k_r, 1)
    # zero padding from qk_head_dim to the cache width
    assert not q[..., Dq:].any() and not k[..., Dq:].any()


def test_mla_softmax_scale():
    cfg = TINY
    assert cfg.mla_scale == 1 / math.sqrt(cfg.head_dim + cfg.qk_extra)
    assert get_config("k3").mla_scale == 1 / math.sqrt(192)
    rng = np.random.default_rng(14)
    Kc, D, ctx, Dq = cfg.k_cache_dim, cfg.head_dim, 6, cfg.qk_head_dim
    q = np.zeros((1, 1, Kc)); q[..., :Dq] = rb(rng.standard_normal((1, 1, Dq)))
    kc = np.zeros((1, 1, ctx, Kc)); kc[..., :Dq] = rb(rng.standard_normal((1, 1, ctx, Dq)))
    vc = rb(rng.standard_normal((1, 1, ctx, D)))

    def direct(scale):
        s = kc[0, 0] @ q[0, 0] * scale
        p = np.exp(s - s.max())
        return (p / p.sum()) @ vc[0, 0]

    o = np.asarray(mla.attend(*(jnp.asarray(x, jnp.bfloat16) for x in (q, kc, vc)),
                              jnp.asarray([ctx - 1]), cfg.mla_scale), F64)[0, 0]
    np.testing.assert_allclose(o, direct(1 / math.sqrt(Dq)), rtol=2e-5, atol=2e-6)
    assert np.abs(o - direct(1 / math.sqrt(D))).max() > 1e-3      # the test tells the scales apart


def test_attend_block_is_per_head_whatever_the_grouping():
    """`attend_block` over G heads at once gives each head exactly what it gives that head alone
    (the kernel attends `attention_heads` at a time, the reference one), jitted, bit for bit: the
    running max, the denominator and the accumulator, from a nonzero state, with NaN in the
    invalid slots."""
    rng = np.random.default_rng(15)
    G, Kc, D = 8, 256, 128
    q = jnp.asarray(rb(rng.standard_normal((G, 1, Kc))), jnp.float32)
    kb, vb = (jnp.asarray(rng.standard_normal((G, mla.BLOCK, w)), jnp.bfloat16) for w in (Kc, D))
    vb = vb.at[:, 100:].set(jnp.nan)
    valid = jnp.arange(mla.BLOCK)[:, None] < 100
    state = (jnp.asarray(rng.standard_normal((G, 1, 1)), jnp.float32) * jnp.ones((1, 1, 128)),
             jnp.asarray(rng.random((G, 1, 1)), jnp.float32) * jnp.ones((1, 1, 128)),
             jnp.asarray(rng.standard_normal((G, 1, D)), jnp.float32))
    attend = jax.jit(mla.attend_block, static_argnums=7)
    together = attend(q, kb, vb, valid, *state, 0.1)
    for h in range(G):
        alone = attend(q[h:h + 1], kb[h:h + 1], vb[h:h + 1], valid, *(x[h:h + 1] for x in state), 0.1)
        for a, b in zip(together, alone):
            assert np.isfinite(np.asarray(b)).all()
            np.testing.assert_array_equal(np.asarray(a[h:h + 1]), np.asarray(b))


# ---- MoE ------------------------------------------------------------------------------------------

def _route(logits, bias, k):
    m = jnp.ones((1, 1), jnp.bfloat16)
    router = jnp.asarray([logits], jnp.bfloat16)
    ids, w = moe.route(m, router, jnp.asarray(bias, jnp.float32), k)
    return np.asarray(ids)[0].tolist(), np.asarray(w, F64)[0]


def test_router_bias_chooses_but_does_not_weigh():
    logits = [-2.0, 0.0, 2.0, 3.0]
    s = sig(np.array(logits))
    ids, w = _route(logits, [0, 0, 0, 0], 2)
    assert ids == [2, 3]
    np.testing.assert_allclose(w, s[[2, 3]] / s[[2, 3]].sum(), rtol=1e-6)
    ids, w = _route(logits, [2, 1, 0, 0], 2)          # the bias flips the choice to (0, 1) ...
    assert ids == [0, 1]
    np.testing.assert_allclose(w, s[[0, 1]] / s[[0, 1]].sum(), rtol=1e-6)   # ... weights stay unbiased
    # a different bias choosing the same experts gives bit-identical weights
    ids2, w2 = _route(logits, [7.0, 5.0, -1.0, -3.0], 2)
    assert ids2 == ids
    np.testing.assert_array_equal(w2, w)
    assert abs(w.sum() - 1) < 1e-6                     # renormalised, no extra scale


def test_router_ties_go_to_lowest_id():
    ids, w = _route([0.0] * 8, [0.0] * 8, 3)
    assert ids == [0, 1, 2]
    np.testing.assert_allclose(w, [1 / 3] * 3, rtol=1e-6)
    ids, _ = _route([0.0] * 8, [0, 1, 0, 1, 0, 1, 0, 2], 2)   # 7 first, then a tie of 1, 3, 5
    assert ids == [1, 7]


def test_route_matches_direct(tiny_params):
    w, w64 = tiny_params["moe"]
    rng = np.random.default_rng(15)
    m, m64 = rand_bf16(rng, (5, TINY.dim))
    ids, wts = moe.route(m, w["router"], w["router_bias"], TINY.top_k)
    ids_want, wts_want = np_route(m64, w64["router"], w64["router_bias"], TINY.top_k)
    np.testing.assert_array_equal(np.asarray(ids), ids_want)
    np.testing.assert_allclose(np.asarray(wts, F64), wts_want, rtol=2e-6)


def test_moe_matches_direct_formulation(tiny_params):
    w, w64 = tiny_params["moe"]
    rng = np.random.default_rng(16)
    m, m64 = rand_bf16(rng, (3, TINY.dim))
    z = moe.moe(m, w, TINY)
    want = np_moe(m64, w64, TINY)
    assert z.dtype == jnp.bfloat16
    assert_chain(z, want)
    # the latent norm sits after the weighted sum; normalising each expert first is far off
    other = np_moe(m64, w64, TINY, norm_before_sum=True)
    assert np.abs(other - want).max() > 20 * np.abs(np.asarray(z, F64) - want).max() + 1e-3


def test_moe_expert_matches_direct(tiny_params):
    w, w64 = tiny_params["moe"]
    rng = np.random.default_rng(17)
    lat, lat64 = rand_bf16(rng, (2, TINY.latent))
    e = 5
    out = moe.expert(lat, w["w1"][e], w["w3"][e], w["w2"][e], TINY)
    h = np_situ(rb(lat64 @ w64["w1"][e]), rb(lat64 @ w64["w3"][e]))
    assert_chain(out, rb(h @ w64["w2"][e]))


# ---- dense MLP ------------------------------------------------------------------------------------

def test_dense_mlp_matches_direct_formulation(tiny_params):
    w, w64 = tiny_params["dense"]
    rng = np.random.default_rng(18)
    m, m64 = rand_bf16(rng, (3, TINY.dim))
    z = dense_mlp.dense_mlp(m, w, TINY)
    want = rb(np_situ(rb(m64 @ w64["gate"]), rb(m64 @ w64["up"])) @ w64["down"])
    assert z.dtype == jnp.bfloat16
    assert_chain(z, want)


def test_matmul_rows_independent():
    """mm pads rows to the 8-row tile: a row's result never depends on the rows beside it."""
    rng = np.random.default_rng(19)
    x, x64 = rand_bf16(rng, (5, 64))
    wm, w64 = rand_bf16(rng, (64, 32))
    full = np.asarray(common.mm(x, wm))
    for r in range(5):
        np.testing.assert_array_equal(np.asarray(common.mm(x[r:r + 1], wm))[0], full[r])
    np.testing.assert_allclose(full, x64 @ w64, rtol=1e-5, atol=1e-5)
