"""Numerics shared by every sublayer: bf16 rounding, RMSNorm, sigmoid, situ, matmul (spec 1.2)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

BF16 = jnp.bfloat16
F32 = jnp.float32
ROW_TILE = 8  # matmul LHS rows are padded to the 8-row sublane tile
K_CHUNK = 512  # matmuls accumulate fp32 partial products over K in chunks of this depth, in order


def bf(x: jax.Array) -> jax.Array:
    """Round to bfloat16 (one rounding, nearest-even)."""
    return x.astype(BF16)


def f32(x: jax.Array) -> jax.Array:
    return x.astype(F32)


def rms(x: jax.Array, gamma: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis in fp32, `x * rsqrt(mean(x^2) + eps) * gamma`, cast back to x.dtype."""
    xf = f32(x)
    y = xf * rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps) * f32(gamma)
    return y.astype(x.dtype)


def rsqrt(x: jax.Array) -> jax.Array:
    """1 / sqrt(x), fp32: normalizers are written `a * rsqrt(b)`, never `a / sqrt(b)`.

    XLA's algebraic simplifier rewrites `a / sqrt(b)` into `a * rsqrt(b)` (another rounding) only
    where the sqrt has a single user. Whether it does depends on the surrounding graph: in the
    XLA references common subexpressions merge across layers (an AttnRes snapshot's mean square is
    the same in every later layer's mix, so its sqrt gains several users and stays a divide),
    while the kernel reloads the snapshot from VMEM in each layer and gets the rsqrt. Written as
    rsqrt, the rounding is the same in every context (kernel, reference, sharded reference)."""
    return jax.lax.rsqrt(f32(x))


def sigmoid(x: jax.Array) -> jax.Array:
    """Logistic sigmoid evaluated in fp32 (callers round once where the spec says)."""
    return jax.nn.sigmoid(f32(x))


def situ(g: jax.Array, u: jax.Array, beta: float, linear_beta: float) -> jax.Array:
    """K3's gated activation (spec 1.4.6), in fp32, rounded once to bf16.

    `[beta * tanh(g / beta) * sigmoid(g)] * [linear_beta * tanh(u / linear_beta)]`: SiLU-like for
    small g, soft-capped at +-beta * sigmoid(g); the up branch soft-capped at +-linear_beta.
    """
    g, u = f32(g), f32(u)
    gate = beta * jnp.tanh(g / beta) * jax.nn.sigmoid(g)
    up = linear_beta * jnp.tanh(u / linear_beta)
    return bf(gate * up)


def pad_rows(x: jax.Array) -> jax.Array:
    """x zero-padded along axis 0 (the batch rows) to a multiple of ROW_TILE."""
    rows = x.shape[0]
    padded = -(-rows // ROW_TILE) * ROW_TILE
    if padded == rows:
        return x
    return jnp.pad(x, [(0, padded - rows)] + [(0, 0)] * (x.ndim - 1))


def rows_padded(fn, x: jax.Array, *args, **kw) -> jax.Array:
    """`fn(x, ...)` for a row-wise fn, evaluated on `pad_rows(x)` and sliced back to x's rows.

    XLA picks a reduction's summation order from the shape it reduces, so a row-wise reduction
    (RMSNorm, softmax, L2 norm) over a batch of 4 rows can round differently from the same row
    alone. With the rows padded to the fixed tile (as `mm` does for matmuls), every batch size up
    to ROW_TILE reduces the same shape: a row's bits never depend on how many rows share the step.
    fn must keep an all-zero row finite.
    """
    return fn(pad_rows(x), *args, **kw)[:x.shape[0]]


def mm(x: jax.Array, w: jax.Array, k_chunk: int = K_CHUNK) -> jax.Array:
    """`x @ w` for bf16 operands with fp32 accumulation; x [rows, K], w [K, N] -> [rows, N] f32.

    Rows are zero-padded to a multiple of ROW_TILE (as the kernel pads to the MXU tile), which also
    makes every row's result independent of how many rows share the call. K is taken in `k_chunk`
    slices, zero-padded, each slice's product added to the running fp32 sum in order: the kernel
    accumulates its weight tiles the same way, and one dot over all of K sums in another order.
    (`k_chunk` = MX_GROUP: an MXFP4 matrix on the kernel's fp8 path, whose 32-row group partials
    are scaled and summed in order; `mk.kernel.ring.WeightRing.matmul`.)
    """
    rows, K = x.shape
    x = pad_rows(x)
    if K <= k_chunk:
        return jnp.dot(x, w, preferred_element_type=F32)[:rows]
    pad = -K % k_chunk
    x, w = jnp.pad(x, ((0, 0), (0, pad))), jnp.pad(w, ((0, pad), (0, 0)))
    if k_chunk < K_CHUNK and (K + pad) // k_chunk > 16:   # many thin slices: one scanned dot, same sums in order
        xs = x.reshape(x.shape[0], -1, k_chunk).transpose(1, 0, 2)
        ws = w.reshape(-1, k_chunk, w.shape[1])
        acc, _ = jax.lax.scan(lambda a, xw: (a + jnp.dot(xw[0], xw[1], preferred_element_type=F32), None),
                              jnp.dot(xs[0], ws[0], preferred_element_type=F32), (xs[1:], ws[1:]))
        return acc[:rows]
    acc = None
    for c in range(0, K + pad, k_chunk):
        part = jnp.dot(x[:, c:c + k_chunk], w[c:c + k_chunk], preferred_element_type=F32)
        acc = part if acc is None else acc + part
    return acc[:rows]
