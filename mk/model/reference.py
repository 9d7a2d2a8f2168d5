"""The pure-JAX K3 decode step: the oracle for every kernel, and the conventional XLA baseline.

One decode step takes one new token per row (each row with its own position and caches) through
embedding -> L x [AttnRes mix, KDA or MLA, AttnRes mix, dense MLP or MoE] -> final mix, norm, LM
head. The Python layer loop is unrolled under `jit`, the way a conventional framework hands XLA
one program of many per-layer kernels.

Caches are an explicit pytree (see `init_cache`):
    pos         [B]                       int32  position of the token this step consumes
    kda_state   [B, n_kda, H, D, D]       f32
    conv_state  [B, n_kda, 3, C-1, HD]    bf16
    mla_k       [B, n_mla, H, ctx, Kc]    bf16
    mla_v       [B, n_mla, H, ctx, D]     bf16
"""
from __future__ import annotations

import functools
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mk.model.config import K3Config
from mk.model.layers.attn_res import mix
from mk.model.layers.common import BF16, F32, K_CHUNK, bf, mm, rms, rows_padded
from mk.model.layers.dense_mlp import dense_mlp
from mk.model.layers.kda import kda_tokens
from mk.model.layers.mla import mla_tokens
from mk.model.layers.moe import moe, route_margin

DEFAULT_CTX = 256


def init_cache(cfg: K3Config, batch: int, ctx: int = DEFAULT_CTX) -> dict:
    """Empty caches for `batch` rows at position 0; ctx = MLA cache capacity (a multiple of 128).
    One jitted program (`_empty_cache`: eager `jnp.zeros` compiled, or loaded from the persistent
    cache, one small program per leaf shape and dtype)."""
    if ctx % 128 or ctx <= 0:
        raise ValueError(f"ctx must be a positive multiple of 128, found {ctx}")
    return _empty_cache(cfg, batch, ctx)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _empty_cache(cfg: K3Config, batch: int, ctx: int) -> dict:
    H, D, HD = cfg.heads, cfg.head_dim, cfg.attn_width
    return {
        "pos": jnp.zeros((batch,), jnp.int32),
        "kda_state": jnp.zeros((batch, cfg.n_kda, H, D, D), F32),
        "conv_state": jnp.zeros((batch, cfg.n_kda, 3, cfg.conv_size - 1, HD), BF16),
        "mla_k": jnp.zeros((batch, cfg.n_mla, H, ctx, cfg.k_cache_dim), BF16),
        "mla_v": jnp.zeros((batch, cfg.n_mla, H, ctx, D), BF16),
    }


def layer_slice(tree: dict, i: int) -> dict:
    return {k: v[i] for k, v in tree.items()}


@functools.partial(jax.jit, static_argnames=("cfg", "expert_k_chunk", "route_margins"))
def decode_step(params: dict, cache: dict, tokens: jax.Array, *, cfg: K3Config, expert_k_chunk: int = K_CHUNK,
                route_margins: bool = False):
    """tokens [B] int32 -> (logits [B, V] f32, cache advanced by one position).

    The one-token case of `verify_step` (T = 1, the only row accepted). expert_k_chunk: the routed
    experts' matmul slice depth, the kernel's (`mk.kernel.step.expert_k_chunk`). route_margins: also
    return each row's routing margin in every MoE layer, [B, n_moe] f32 (`mk.model.layers.moe.route_margin`:
    how near the expert choice was to a tie), as a third output."""
    logits, block = run_block(params, cache, tokens[:, None], cfg, expert_k_chunk=expert_k_chunk,
                              route_margins=route_margins)
    out = logits[:, 0], commit(cache, block, jnp.zeros_like(cache["pos"]))
    return out + (block["route_margin"][:, 0],) if route_margins else out


@functools.partial(jax.jit, static_argnames=("cfg", "aux_layers"))
def verify_step(params: dict, cache: dict, tokens: jax.Array, *, cfg: K3Config, aux_layers: tuple[int, ...] = ()):
    """A speculative verify step: tokens [B, T] int32 (anchor + T-1 drafts per row, at positions
    pos[b]..pos[b]+T-1) -> (logits [B, T, V] f32, block).

    Row t's logits are what `decode_step` returns after consuming tokens[:, :t+1]: bit for bit the
    same, since every token runs the one-token step's functions on the same shapes (matmuls pad
    rows to the 8-row tile; T*B <= 8 keeps the tile) and KDA chains its state token to token.
    `block` holds what rollback needs (see `run_block`); `commit(cache, block, count)` continues
    from the state after token count[b] of each row (state_row = count). The cache is not changed
    in place: MLA slots past the committed position are masked until the next step overwrites them.
    """
    return run_block(params, cache, tokens, cfg, aux_layers)


def commit(cache: dict, block: dict, count: jax.Array) -> dict:
    """The cache after accepting rows 0..count[b] of a verify block (count [B] int32 in [0, T-1]):
    pos advances by count + 1, KDA and conv states are the post-states of row count[b], the MLA
    caches keep every written slot (the ones past the new position are masked, then overwritten)."""
    pick = lambda x: jnp.take_along_axis(x, count.reshape((-1,) + (1,) * (x.ndim - 1)), axis=1)[:, 0]
    return {"pos": cache["pos"] + count + 1, "kda_state": pick(block["kda_state"]),
            "conv_state": pick(block["conv_state"]), "mla_k": block["mla_k"], "mla_v": block["mla_v"]}


def run_block(params: dict, cache: dict, tokens: jax.Array, cfg: K3Config, aux_layers: Sequence[int] = (),
              expert_k_chunk: int = K_CHUNK, route_margins: bool = False):
    """T consecutive tokens per row through the model: tokens [B, T] -> (logits [B, T, V] f32, block).

    block: kda_state [B, T, n_kda, H, D, D] and conv_state [B, T, n_kda, 3, C-1, HD] (the states
    after each token), mla_k / mla_v (all T slots written), aux [B, T, len(aux_layers), d] bf16 (the
    running prefix p with which each layer in aux_layers starts, spec 4.1: the drafter's context);
    with route_margins, route_margin [B, T, n_moe] f32 (`mk.model.layers.moe.route_margin`).
    """
    B, T = tokens.shape
    bad = [l for l in aux_layers if not 0 < l < cfg.layers]
    if bad:
        raise ValueError(f"aux layers {bad} outside 1..{cfg.layers - 1}")
    pos = cache["pos"]
    kda_state, conv_state = cache["kda_state"], cache["conv_state"]
    kda_states, conv_states = [None] * cfg.n_kda, [None] * cfg.n_kda
    mla_k, mla_v = cache["mla_k"], cache["mla_v"]
    rows = lambda x: x.reshape(B, T, -1)
    p = params["embed"][tokens.reshape(B * T)]                     # [B*T, d] bf16, b_0 = p
    blocks: list[jax.Array] = []
    aux, margins = [], []
    for l in range(cfg.layers):
        if l in aux_layers:
            aux.append(p)
        lw = layer_slice(params["layer"], l)
        x = mix(p, blocks[:cfg.n_attn_blocks(l)], lw["attn_res"], cfg.eps, cfg.n_blocks)
        if cfg.starts_block(l):
            blocks.append(p)
        a = rows(rows_padded(rms, x, lw["attn_norm"], cfg.eps))
        i = cfg.family_index(l)
        if cfg.is_mla(l):
            y, k_i, v_i = mla_tokens(a, layer_slice(params["mla"], i), mla_k[:, i], mla_v[:, i], pos, cfg)
            mla_k, mla_v = mla_k.at[:, i].set(k_i), mla_v.at[:, i].set(v_i)
        else:
            y, kda_states[i], conv_states[i] = kda_tokens(a, layer_slice(params["kda"], i), kda_state[:, i],
                                                          conv_state[:, i], cfg)
        y = y.reshape(B * T, -1)
        p = y if cfg.starts_block(l) else bf(p + y)
        x = mix(p, blocks[:cfg.n_mlp_blocks(l)], lw["mlp_res"], cfg.eps, cfg.n_blocks)
        m = rows_padded(rms, x, lw["ffn_norm"], cfg.eps)
        z = dense_mlp(m, params["dense"], cfg) if l == 0 else moe(m, layer_slice(params["moe"], l - 1), cfg,
                                                                  expert_k_chunk)
        if route_margins and l > 0:
            w = layer_slice(params["moe"], l - 1)
            margins.append(route_margin(m, w["router"], w["router_bias"], cfg.top_k))
        p = bf(p + z)
    logits = final_logits(params, p, blocks, cfg).reshape(B, T, -1)
    order = [sorted(aux_layers).index(l) for l in aux_layers]      # aux in the caller's order
    block = {"kda_state": jnp.stack(kda_states, axis=2), "conv_state": jnp.stack(conv_states, axis=2),
             "mla_k": mla_k, "mla_v": mla_v,
             "aux": (jnp.stack([rows(aux[j]) for j in order], axis=2) if aux else
                     jnp.zeros((B, T, 0, cfg.dim), BF16))}
    if route_margins:
        block["route_margin"] = jnp.stack(margins, axis=-1).reshape(B, T, -1)
    return logits, block


def final_logits(params: dict, p, blocks: Sequence[jax.Array], cfg: K3Config):
    """Final AttnRes mix over all snapshots, RMSNorm, LM head in fp32: [B, d] -> [B, V] f32."""
    h = mix(p, blocks, params["output_res"], cfg.eps)
    return mm(rows_padded(rms, h, params["final_norm"], cfg.eps), params["lm_head"])


@functools.partial(jax.jit, static_argnames="cfg")
def forward_tokens(params: dict, cache: dict, tokens: jax.Array, *, cfg: K3Config):
    """Teacher-forced decode: tokens [B, T] -> (logits [B, T, V] f32, cache after T positions)."""
    def step(c, tok):
        logits, c = decode_step(params, c, tok, cfg=cfg)
        return c, logits
    cache, logits = jax.lax.scan(step, cache, tokens.T)
    return jnp.swapaxes(logits, 0, 1), cache


def prefill(params: dict, cfg: K3Config, tokens, ctx: int = DEFAULT_CTX):
    """Run prompts tokens [B, T] (equal lengths) from empty caches -> (last logits [B, V], cache).
    Token by token (T decode steps); `mk.perf.prefill.prefill` runs a prompt in parallel."""
    tokens = jnp.asarray(tokens, jnp.int32)
    if tokens.ndim == 1:
        tokens = tokens[None]
    _check_tokens(tokens, cfg, ctx)
    logits, cache = forward_tokens(params, init_cache(cfg, tokens.shape[0], ctx), tokens, cfg=cfg)
    return logits[:, -1], cache


def teacher_forced_logits(params: dict, cfg: K3Config, tokens, ctx: int | None = None) -> np.ndarray:
    """One row from position 0: tokens [T] -> float32 logits [T, V] (row t = after token t)."""
    tokens = np.asarray(tokens, np.int32).reshape(1, -1)
    ctx = ctx or max(DEFAULT_CTX, -(-tokens.shape[1] // 128) * 128)
    _check_tokens(tokens, cfg, ctx)
    logits, _ = forward_tokens(params, init_cache(cfg, 1, ctx), jnp.asarray(tokens), cfg=cfg)
    return np.asarray(logits[0], np.float32)


def _check_tokens(tokens, cfg: K3Config, ctx: int):
    t = np.asarray(tokens)
    if t.size and (t.min() < 0 or t.max() >= cfg.vocab):
        raise ValueError(f"token ids must lie in [0, {cfg.vocab}), found {int(t.min())}..{int(t.max())}")
    if t.shape[-1] > ctx:
        raise ValueError(f"{t.shape[-1]} tokens exceed the cache capacity ctx={ctx}")


def sample(logits: jax.Array, key, temperature: float = 0.0, top_p: float = 1.0) -> jax.Array:
    """Next tokens [B] from logits [B, V]: greedy at temperature 0, else temperature + nucleus."""
    if temperature <= 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = logits / temperature
    order = jnp.argsort(-scaled, axis=-1)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs                   # mass strictly before each token
    keep = before < top_p                                         # always keeps the top token
    masked = jnp.where(keep, sorted_logits, -jnp.inf)
    choice = jax.random.categorical(key, masked, axis=-1)
    return jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)


def generate(params: dict, cfg: K3Config, prompt, max_new_tokens: int, *, temperature: float = 0.0,
             top_p: float = 1.0, seed: int = 0, ctx: int | None = None, step_fn=None,
             stop_ids: Sequence[int] = ()) -> dict:
    """Generate from prompts [B, T] (or one prompt [T]). Returns a dict with `tokens` [B, n] (new
    tokens only), `prefill_s`, `decode_s`, `tokens_per_s` (rows x steps / decode time).

    `step_fn(params, cache, tokens) -> (logits, cache)` defaults to the reference decode step; the
    kernel backend passes its own (same caches, same signature).
    """
    prompt = np.asarray(prompt, np.int32)
    if prompt.ndim == 1:
        prompt = prompt[None]
    if prompt.shape[1] == 0:
        raise ValueError("the prompt must hold at least one token")
    total = prompt.shape[1] + max_new_tokens
    ctx = ctx or max(DEFAULT_CTX, -(-total // 128) * 128)
    _check_tokens(prompt, cfg, ctx)
    if total > ctx:
        raise ValueError(f"prompt + max_new_tokens = {total} exceed ctx={ctx}")
    step_fn = step_fn or functools.partial(decode_step, cfg=cfg)
    key = jax.random.PRNGKey(seed)
    t0 = time.perf_counter()
    cache = init_cache(cfg, prompt.shape[0], ctx)
    logits = None
    for t in range(prompt.shape[1]):
        logits, cache = step_fn(params, cache, jnp.asarray(prompt[:, t]))
    jax.block_until_ready(logits)
    t1 = time.perf_counter()
    out = []
    done = np.zeros(prompt.shape[0], bool)
    for i in range(max_new_tokens):
        key, sub = jax.random.split(key)
        tok = sample(logits, sub, temperature, top_p)
        out.append(np.asarray(tok))
        done |= np.isin(out[-1], list(stop_ids))
        if done.all() or i == max_new_tokens - 1:
            break
        logits, cache = step_fn(params, cache, tok)
    jax.block_until_ready(logits)
    t2 = time.perf_counter()
    tokens = np.stack(out, axis=1) if out else np.zeros((prompt.shape[0], 0), np.int32)
    steps = max(len(out) - 1, 1)
    return {"tokens": tokens, "prefill_s": t1 - t0, "decode_s": t2 - t1,
            "tokens_per_s": prompt.shape[0] * steps / max(t2 - t1, 1e-9)}
