"""Microbenchmarks of the constants `mk simulate` rests on assumptions, for a TPU VM.

`data/microbench.csv` gives four TPU constants no measurement: the MXU's weight-push cost
(`mxu_push_rows`), the DMA descriptor latency, and the vector unit's two rates. The validation of
the seed's schedule at B = 1 hangs on the first (`mk simulate --sensitivity`: 0.79 .. 1.08 of the
published figure across its range). Each is one small Pallas kernel here. On a TPU, `mk microbench`
times them and writes a copy of `microbench.csv` with the rows of the chip it ran on (`DEVICE_KINDS`:
"TPU v5 lite" -> tpu-v5e) added or replaced, every other chip's kept; `mk simulate --microbench
FILE` then models with it. On CPU the kernels run in interpret mode, for correctness only: CPU
interpret mode is never a speed claim, so nothing is timed there.

Every time is a difference: the kernel at two repeat counts, t = (t(n2) - t(n1)) / (n2 - n1), so the
launch, the first DMA and the final write-back cancel.

  mxu     [R, K] @ [K, N] bf16, operands in VMEM, repeated; K x N is many MXU weight tiles, so each
          repeat pushes every weight again. The simulator costs a matmul 2 max(R, push_rows) K N /
          peak, hence push_rows = t(R) peak / (2 K N) at the smallest R (the push-bound end); the
          curve over R shows where the LHS rows start to cost.
  dma     S-byte HBM -> VMEM copies, one outstanding at a time: t(S) = latency + S / bw (least
          squares over S = 64 KiB .. 4 MiB) gives the descriptor latency; the same copies with
          `inflight` outstanding give the streaming bandwidth.
  vector  y = y * a + a over a [rows, 1024] f32 VMEM block, `FMAS` times per pass: 2 FMAS flops
          per element per pass (vector_flops); and one load-multiply-store pass over a VMEM block
          too large for the registers (vector_bw: bytes read + written).
  dequant the kernel's own product of an 8-row bf16 LHS with an MXFP4 [DEQ_K, DEQ_N] tile in
          VMEM, unpacked in registers straight into the MXU (`mk.kernel.ring.mxfp4_tile_product`),
          repeated, by each unpack every TPU lowers (`DEQUANT_UNPACKS`): weights per second. That
          of the chip's own unpack (`mk.kernel.plan.MXFP4_UNPACK`) times its vector ops per weight
          (`mk.kernel.schedule.DEQUANT_OPS`) is `dequant_op_rate`, the rate the simulator charges
          the MXFP4 unpack at (a dependent FMA chain, `vector_flops`, measures the VPU's latency
          more than its throughput).
"""
from __future__ import annotations

import csv
import datetime
import io
import time
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mk.kernel.plan import CHIP_OF_DEVICE_KIND, HARDWARE_CHIP
from mk.errors import UserError

MXU_ROWS = (16, 32, 64, 128, 256, 512)
# (x, w) dtypes timed at R = DTYPE_ROWS (fp8 rows come in 32-row tiles) besides bf16 x bf16: does a
# weight push of the fp8 path
# (spec 3.5: bf16 activations x fp8 weights) cost half a bf16 one, as `peak(fp8)` assumes?
MXU_DTYPES = {"bf16": ("bfloat16", "bfloat16"), "bf16xfp8": ("bfloat16", "float8_e4m3fn"),
              "fp8": ("float8_e4m3fn", "float8_e4m3fn")}
DTYPE_ROWS = 32
MXU_K, MXU_N = 4096, 512                  # 4 MiB of bf16 weights: 32 weight tiles of 256 x 256
DMA_SIZES = (64 << 10, 256 << 10, 1 << 20, 4 << 20)
DMA_INFLIGHT = 4
# The stream: (chunk bytes, copies in flight), each timed over 64 MiB against 1 GiB of copies, a
# difference of about 1.2 ms at the v5e's rate (the timer's noise is some microseconds). The fastest
# is `dma_stream_bw`, the bandwidth every "of stream" figure divides by.
# (chunk bytes, copies in flight): the kernel's own rings (128 KiB x 64: the depth family's 256 x 256
# bf16 tiles; 512 KiB x 16: k3-chip's 512 x 512), then larger chunks
STREAM_POINTS = ((128 << 10, 64), (256 << 10, 32), (512 << 10, 8), (512 << 10, 16), (512 << 10, 32), (1 << 20, 8),
                 (1 << 20, 16), (2 << 20, 8), (4 << 20, 2), (4 << 20, 4), (8 << 20, 4), (16 << 20, 2))
STREAM_BYTES = (64 << 20, 1 << 30)
VEC_ROWS, VEC_COLS, FMAS = 64, 1024, 16   # 256 KiB of f32: the vector registers' worth
BW_ROWS = 2048                            # 8 MiB of f32: streamed through VMEM
DEQ_K, DEQ_N = 512, 512                   # one expert tile of k3-chip's plan
DEQ_ROWS = 8                              # its LHS rows at B = 8 (the MXU's 8-row tile)
VMEM_LIMIT = 48 << 20


class MicrobenchError(UserError, ValueError):
    """A microbenchmark that cannot run here (no TPU for timing) or was given bad sizes."""


# ------------------------------------------------------------------------------------------------
# The kernels
# ------------------------------------------------------------------------------------------------
def _mxu_kernel(x_ref, w_ref, o_ref, *, reps: int, rows: int):
    # x_ref: [2 R, K] bf16 VMEM   w_ref: [K, N] bf16 VMEM   o_ref: [R, N] f32 VMEM
    def body(i, acc):
        # alternate the LHS half so the product is not loop-invariant (nothing to hoist)
        start = pl.multiple_of((i % 2) * rows, rows)
        x = x_ref[pl.ds(start, rows), :]
        return acc + jnp.dot(x, w_ref[...], preferred_element_type=jnp.float32)

    with jax.named_scope("mxu_repeats"):
        o_ref[...] = jax.lax.fori_loop(0, reps, body, jnp.zeros(o_ref.shape, jnp.float32))


def mxu_call(rows: int, reps: int, k: int = MXU_K, n: int = MXU_N, interpret=False):
    """`f(x [2 rows, k], w [k, n]) -> [rows, n] f32`: reps x (one half of x) @ w, summed; x and w
    bf16, or float8_e4m3fn (`MXU_DTYPES`: the seed's fp8 expert path)."""
    if rows % 16 or rows & (rows - 1) or k % 256 or n % 256:
        raise MicrobenchError(f"mxu: rows must be a power of two >= 16 and k, n multiples of 256; found "
                              f"{rows}, {k}, {n}")
    vmem = pl.BlockSpec(memory_space=pltpu.VMEM)
    return pl.pallas_call(
        partial(_mxu_kernel, reps=reps, rows=rows),
        out_shape=jax.ShapeDtypeStruct((rows, n), jnp.float32),
        in_specs=[vmem, vmem], out_specs=vmem,
        compiler_params=pltpu.CompilerParams(vmem_limit_bytes=VMEM_LIMIT),
        interpret=interpret, name="mk_microbench_mxu")


def _dma_kernel(src_hbm, o_ref, buf, sem, *, copies: int, inflight: int):
    # src_hbm: [copies, r, 128] f32 HBM   o_ref: [r, 128] f32 VMEM
    # buf: [inflight, r, 128] f32 VMEM    sem: DMA semaphores [inflight]
    def copy(j):
        return pltpu.make_async_copy(src_hbm.at[j], buf.at[j % inflight], sem.at[j % inflight])

    with jax.named_scope("dma_copies"):
        for j in range(min(inflight, copies)):
            copy(j).start()

        def body(j, carry):
            copy(j).wait()

            @pl.when(j + inflight < copies)
            def _():
                copy(j + inflight).start()
            return carry

        jax.lax.fori_loop(0, copies, body, 0)
    o_ref[...] = buf[(copies - 1) % inflight]


def dma_call(nbytes: int, copies: int, inflight: int = 1, interpret=False):
    """`f(src [copies, r, 128] f32) -> [r, 128] f32` (r = nbytes / 512): `copies` HBM -> VMEM copies
    of `nbytes`, `inflight` outstanding; returns the last chunk."""
    if nbytes % (8 * 128 * 4) or copies < 1 or inflight < 1:
        raise MicrobenchError(f"dma: nbytes must be a multiple of 4 KiB, copies and inflight >= 1; found "
                              f"{nbytes}, {copies}, {inflight}")
    r = nbytes // 512
    return pl.pallas_call(
        partial(_dma_kernel, copies=copies, inflight=inflight),
        out_shape=jax.ShapeDtypeStruct((r, 128), jnp.float32),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec(memory_space=pltpu.VMEM),
        scratch_shapes=[pltpu.VMEM((inflight, r, 128), jnp.float32), pltpu.SemaphoreType.DMA((inflight,))],
        compiler_params=pltpu.CompilerParams(vmem_limit_bytes=VMEM_LIMIT),
        interpret=interpret, name="mk_microbench_dma")


def _fma_kernel(a_ref, o_ref, *, reps: int):
    # a_ref, o_ref: [VEC_ROWS, VEC_COLS] f32 VMEM
    a = a_ref[...]

    def body(i, y):
        for _ in range(FMAS):
            y = y * a + a
        return y

    with jax.named_scope("vector_fmas"):
        o_ref[...] = jax.lax.fori_loop(0, reps, body, a)


def _pass_kernel(a_ref, o_ref, *, reps: int):
    # a_ref: [8, VEC_COLS] f32 VMEM   o_ref: [BW_ROWS, VEC_COLS] f32 VMEM (read and written each pass)
    o_ref[...] = jnp.broadcast_to(a_ref[0:1, :], o_ref.shape)
    scale = a_ref[1:2, :]

    def body(i, carry):
        o_ref[...] = o_ref[...] * scale
        return carry

    with jax.named_scope("vector_passes"):
        jax.lax.fori_loop(0, reps, body, 0)


def vector_call(kind: str, reps: int, interpret=False):
    """'fma': `f(a [VEC_ROWS, VEC_COLS] f32)`, FMAS x reps FMAs per element in registers; 'pass':
    `f(a [8, VEC_COLS] f32) -> [BW_ROWS, VEC_COLS]`, reps load-multiply-store passes over VMEM."""
    vmem = pl.BlockSpec(memory_space=pltpu.VMEM)
    rows = VEC_ROWS if kind == "fma" else BW_ROWS
    kern = {"fma": _fma_kernel, "pass": _pass_kernel}[kind]
    return pl.pallas_call(
        partial(kern, reps=reps),
        out_shape=jax.ShapeDtypeStruct((rows, VEC_COLS), jnp.float32),
        in_specs=[vmem], out_specs=vmem,
        compiler_params=pltpu.CompilerParams(vmem_limit_bytes=VMEM_LIMIT),
        interpret=interpret, name=f"mk_microbench_vector_{kind}")


def _dequant_kernel(x_ref, codes_ref, scales_ref, o_ref, *, reps: int, unpack: str):
    # x_ref: [DEQ_ROWS, DEQ_K] bf16   codes_ref: [2, DEQ_K / 8, DEQ_N] int32   scales_ref: [2, DEQ_K / 128, DEQ_N] int32
    # o_ref: [DEQ_ROWS, DEQ_N] f32 (VMEM)
    from mk.kernel.ring import mxfp4_tile_product

    def body(i, acc):                   # tile i % 2: a loop-carried index, so nothing is hoisted
        t = i % 2
        return mxfp4_tile_product(acc, x_ref[...], codes_ref.at[t], scales_ref.at[t], unpack, DEQ_K)

    with jax.named_scope("mxfp4_tile_products"):
        o_ref[...] = jax.lax.fori_loop(0, reps, body, jnp.zeros(o_ref.shape, jnp.float32))


def dequant_call(reps: int, interpret=False, unpack: str = "shift"):
    """`f(x [DEQ_ROWS, DEQ_K] bf16, codes [2, DEQ_K / 8, DEQ_N] int32, scales [2, DEQ_K / 128, DEQ_N] int32)
    -> [DEQ_ROWS, DEQ_N] f32`: the kernel's product of a B = 8 LHS with an MXFP4 tile
    (`mk.kernel.ring.mxfp4_tile_product`, layout `mk.kernel.packing.pack_mxfp4_tiles` for `unpack`),
    the two tiles alternating, reps times, summed."""
    vmem = pl.BlockSpec(memory_space=pltpu.VMEM)
    return pl.pallas_call(
        partial(_dequant_kernel, reps=reps, unpack=unpack),
        out_shape=jax.ShapeDtypeStruct((DEQ_ROWS, DEQ_N), jnp.float32),
        in_specs=[vmem, vmem, vmem], out_specs=vmem,
        compiler_params=pltpu.CompilerParams(vmem_limit_bytes=VMEM_LIMIT),
        interpret=interpret, name=f"mk_microbench_dequant_{unpack}")


DEQUANT_UNPACKS = ("pairs", "pairs_mul", "shift")      # the unpacks every TPU lowers (`mk.kernel.plan.MXFP4_UNPACK`)


def dequant_args(rng, unpack: str = "shift") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A bf16 LHS and two tiles of random E2M1 codes under E8M0 bytes 120..134, packed for `unpack`:
    (x, codes words, scales words)."""
    from mk.kernel.packing import pack_mxfp4_tiles
    x = rng.standard_normal((DEQ_ROWS, DEQ_K)).astype(jnp.bfloat16)
    codes = rng.integers(0, 16, (2, DEQ_K, DEQ_N), dtype=np.uint8)
    scales = rng.integers(120, 135, (2, DEQ_K // 32, DEQ_N), dtype=np.uint8)
    c, sc = pack_mxfp4_tiles(codes, scales, DEQ_K, DEQ_N, unpack)     # [2, 1, rows, DEQ_N] each
    return x, c[:, 0], sc[:, 0]


def dequant_values(codes_words: np.ndarray, scale_words: np.ndarray, unpack: str = "shift") -> np.ndarray:
    """numpy: the `unpack` layout's words [..., rows, DEQ_N] -> the tiles' values f32 [..., DEQ_K, DEQ_N]
    (code value x 2^(s - 127))."""
    from mk.kernel.packing import UNPACK_LAYOUT, pairs_nibble
    e2m1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)
    c, s = np.asarray(codes_words).view(np.uint32), np.asarray(scale_words).view(np.uint32)
    n = c.shape[-1]
    part = [(c >> np.uint32(4 * j)) & 15 for j in range(8)]                                # [..., DEQ_K / 8, n] each
    if UNPACK_LAYOUT[unpack] == "pairs":      # part j + 4h of word w: row j DEQ_K / 4 + 2w + h, re-encoded
        codes = pairs_nibble(np.concatenate([np.stack(part[j::4], axis=-2).reshape(*c.shape[:-2], -1, n)
                                             for j in range(4)], axis=-2))
    else:
        codes = np.concatenate(part, axis=-2)                                                # [..., DEQ_K, n]
    groups = np.concatenate([(s >> np.uint32(8 * j)) & 255 for j in range(4)], axis=-2)    # [..., DEQ_K / 32, n]
    return e2m1[codes] * np.exp2(np.repeat(groups.astype(np.float32) - 127, 32, axis=-2))


# ------------------------------------------------------------------------------------------------
# Inputs, expected outputs (the interpret-mode check), abstract shapes (the deviceless compile)
# ------------------------------------------------------------------------------------------------
# repeat counts (n1, n2) of the timing difference, per kernel family. dequant: a tile takes 0.4-0.7 us
# on the v5e, so 64 vs 512 repeats differed by 0.2-0.3 ms, inside the timer's noise (the same
# kernel read 0.61 then 0.80 us per tile); 256 vs 4096: three runs within 2.5%.
TIMED_REPS = {"mxu": (64, 512), "dma": (16, 64), "vector": (64, 512), "dequant": (256, 4096)}
CHECK_REPS = {"mxu": 3, "dma": 4, "vector.fma": 2, "vector.pass": 3, "dequant": 2}


DMA_REPEAT_BYTES = 256 << 20    # the larger repeat count of a DMA size copies at least this much


def dma_reps(nbytes: int) -> tuple[int, int]:
    """(n1, n2) copies of `nbytes` timed: TIMED_REPS["dma"], raised for small copies so that the
    difference moves DMA_REPEAT_BYTES / 4 or more (16 vs 64 copies of 64 KiB differ by 3 MiB, about
    4 us at the v5e's stream rate: below the timer noise of one call, and twice measured negative)."""
    n1, n2 = TIMED_REPS["dma"]
    n2 = max(n2, DMA_REPEAT_BYTES // nbytes)
    return max(n1, n2 // 4), n2


def _mxu_reps(rows, k, n, reps, interpret=False):
    return mxu_call(rows, reps, k, n, interpret=interpret)


def _dma_reps(nbytes, inflight, copies, interpret=False):
    return dma_call(nbytes, copies, inflight, interpret=interpret)


def cases(small: bool = False) -> list[tuple[str, object, tuple]]:
    """(name, make(reps, interpret=False) -> call, args) of every kernel; `small`: sizes for
    interpret mode (args then fit `CHECK_REPS`)."""
    rng = np.random.default_rng(0)
    k, n = (512, 256) if small else (MXU_K, MXU_N)
    out = []
    for rows in ((16, 32) if small else MXU_ROWS):
        x = rng.standard_normal((2 * rows, k)).astype(jnp.bfloat16)
        w = rng.standard_normal((k, n)).astype(jnp.bfloat16)
        out.append((f"mxu.r{rows}", partial(_mxu_reps, rows, k, n), (x, w)))
    for name, (xd, wd) in MXU_DTYPES.items():
        if name != "bf16":
            x = rng.standard_normal((2 * DTYPE_ROWS, k)).astype(xd)
            w = rng.standard_normal((k, n)).astype(wd)
            out.append((f"mxu.{name}.r{DTYPE_ROWS}", partial(_mxu_reps, DTYPE_ROWS, k, n), (x, w)))
    for nbytes in ((4096, 8192) if small else DMA_SIZES):
        src = rng.standard_normal((CHECK_REPS["dma"], nbytes // 512, 128)).astype(np.float32)
        for inflight in (1, DMA_INFLIGHT) if not small else (1, 2):
            out.append((f"dma.{nbytes}.x{inflight}", partial(_dma_reps, nbytes, inflight), (src,)))
    a = (1 + 0.01 * rng.standard_normal((VEC_ROWS, VEC_COLS))).astype(np.float32)
    out.append(("vector.fma", partial(vector_call, "fma"), (a,)))
    out.append(("vector.pass", partial(vector_call, "pass"), (a[:8],)))
    for unpack in DEQUANT_UNPACKS:
        out.append((f"dequant.{unpack}", partial(dequant_call, unpack=unpack), dequant_args(rng, unpack)))
    return out


def expected(name: str, args) -> np.ndarray:
    """What the kernel of `cases()` named `name` must return (numpy, f32)."""
    if name.startswith("mxu"):
        x, w = (np.asarray(a, np.float32) for a in args)
        rows = x.shape[0] // 2
        return sum(x[(i % 2) * rows:(i % 2 + 1) * rows] @ w for i in range(CHECK_REPS["mxu"]))
    if name.startswith("dma"):
        return np.asarray(args[0][-1])
    if name.startswith("dequant"):
        x, w = np.asarray(args[0], np.float32), dequant_values(*args[1:], unpack=name.split(".")[1])
        return sum(x @ w[i % 2] for i in range(CHECK_REPS["dequant"]))
    a = np.asarray(args[0], np.float32)
    if name == "vector.fma":
        y = a
        for _ in range(CHECK_REPS["vector.fma"] * FMAS):
            y = y * a + a
        return y
    return np.broadcast_to(a[0:1] * a[1:2] ** CHECK_REPS["vector.pass"], (BW_ROWS, VEC_COLS))


def check(small: bool = True) -> list[dict]:
    """Run every kernel once in TPU interpret mode and compare with numpy: [{name, ok, max_err}]."""
    interp = pltpu.InterpretParams(uninitialized_memory="nan")
    rows = []
    for name, make, args in cases(small):
        reps = CHECK_REPS.get(name, CHECK_REPS.get(name.split(".")[0]))
        got = np.asarray(make(reps, interpret=interp)(*args), np.float32)
        want = expected(name, args)
        err = float(np.max(np.abs(got - want) / (1 + np.abs(want))))
        rows.append({"name": name, "ok": bool(np.isfinite(err) and err < 1e-3), "max_err": err})
    return rows


# ------------------------------------------------------------------------------------------------
# Timing (a TPU only) and the fits
# ------------------------------------------------------------------------------------------------
def _time(fn, args, trials: int) -> float:
    fn = jax.jit(fn)
    jax.block_until_ready(fn(*args))                       # compile + warm
    best = float("inf")
    for _ in range(trials):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t0)
    return best


def per_repeat(make, args, n1: int, n2: int, trials: int = 5) -> float:
    """Seconds per repeat: (t(n2) - t(n1)) / (n2 - n1), each the best of `trials` runs."""
    return (_time(make(n2), args, trials) - _time(make(n1), args, trials)) / (n2 - n1)


def push_rows(seconds_per_matmul: float, k: int, n: int, peak_flops: float) -> float:
    """The `mxu_push_rows` a [R, k] @ [k, n] matmul of this duration implies when R is below it:
    the model's cost is 2 max(R, push_rows) k n / peak."""
    return seconds_per_matmul * peak_flops / (2 * k * n)


def line_fit(sizes, seconds) -> tuple[float, float]:
    """(intercept s, bandwidth bytes/s) of the least-squares line t = intercept + size / bandwidth."""
    slope, intercept = np.polyfit(np.asarray(sizes, float), np.asarray(seconds, float), 1)
    if slope <= 0:
        raise MicrobenchError(f"dma: copy time does not grow with size ({list(seconds)} s for {list(sizes)} B)")
    return float(intercept), float(1.0 / slope)


def _size(nbytes: int) -> str:
    """'128 KiB', '4 MiB': a chunk's size as the stream sweep names it."""
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def stream_rates(trials: int = 5, progress=None) -> dict:
    """The HBM -> VMEM stream alone, timed on this TPU: {"CHUNKxINFLIGHT": {"chunk_bytes", "inflight",
    "s_per_copy", "stream_bw"}} for each of STREAM_POINTS (copies of STREAM_BYTES[0] against [1])."""
    step = progress or (lambda what: None)
    out = {}
    src = jnp.zeros((STREAM_BYTES[1] // 512, 128), jnp.float32)       # 1 GiB, viewed as chunks below
    for chunk, inflight in STREAM_POINTS:
        step(f"stream {_size(chunk)} x{inflight}")
        n1, n2 = (b // chunk for b in STREAM_BYTES)
        chunks = src.reshape(n2, chunk // 512, 128)
        t = per_repeat(lambda c, chunk=chunk, inflight=inflight: dma_call(chunk, c, inflight), (chunks,), n1, n2, trials)
        out[f"{_size(chunk).replace(' ', '')}x{inflight}"] = {"chunk_bytes": chunk, "inflight": inflight, "s_per_copy": t,
                                               "stream_bw": chunk / t if t > 0 else None}
    return out


def dequant_rates(rng, trials: int = 5, progress=None) -> dict:
    """The dequant family alone, timed on this TPU: {unpack: {s_per_tile, weights_per_s,
    ops_per_weight}} for each of DEQUANT_UNPACKS (`measure` runs it beside the other families)."""
    from mk.kernel.schedule import dequant_ops
    step = progress or (lambda what: None)
    out = {}
    for unpack in DEQUANT_UNPACKS:
        step(f"dequant {unpack}")
        t = per_repeat(partial(dequant_call, unpack=unpack), tuple(jnp.asarray(x) for x in dequant_args(rng, unpack)),
                       *TIMED_REPS["dequant"], trials)
        out[unpack] = {"s_per_tile": t, "weights_per_s": DEQ_K * DEQ_N / t, "ops_per_weight": dequant_ops("bf16", unpack)}
    return out


def measure(trials: int = 5, progress=None) -> dict:
    """Time every kernel on this TPU; returns the curves and the constants (`out["constants"]`, the
    data/microbench.csv rows of `out["chip"]`, the chip `jax.devices()[0]` is)."""
    if jax.default_backend() != "tpu":
        raise MicrobenchError(f"mk microbench times kernels on a TPU; this backend is {jax.default_backend()!r} "
                              f"(CPU interpret mode is for correctness, never a speed claim: use --check)")
    from mk.perf.hardware import load_chips
    dev = jax.devices()[0]
    chip = chip_of_device_kind(dev.device_kind)
    peak = load_chips()[chip].per_core("bf16_flops")          # the measured chip's, per TensorCore
    rng = np.random.default_rng(0)
    step = progress or (lambda what: None)
    out = {"device_kind": dev.device_kind, "chip": chip, "peak_bf16_flops": peak, "mxu": {}, "dma": {},
           "vector": {}}
    for name, make, args in cases(small=False):
        if not name.startswith("mxu"):
            continue
        step(name)
        t = per_repeat(make, tuple(jnp.asarray(a) for a in args), *TIMED_REPS["mxu"], trials)
        if name.count(".") == 1:                                     # bf16 x bf16 at R rows
            out["mxu"][int(name[5:])] = {"s": t, "push_rows": push_rows(t, MXU_K, MXU_N, peak)}
        else:
            out.setdefault("mxu_dtypes", {})[name.split(".")[1]] = {"s": t}
    for name, r in out.get("mxu_dtypes", {}).items():
        r["vs_bf16"] = r["s"] / out["mxu"][DTYPE_ROWS]["s"]
    single = []
    for nbytes in DMA_SIZES:
        step(f"dma {nbytes >> 10} KiB")
        reps = dma_reps(nbytes)
        src = jnp.asarray(rng.standard_normal((reps[1], nbytes // 512, 128)), jnp.float32)
        t1 = per_repeat(lambda c: dma_call(nbytes, c, 1), (src,), *reps, trials)
        tq = per_repeat(lambda c: dma_call(nbytes, c, DMA_INFLIGHT), (src,), *reps, trials)
        single.append(t1)
        out["dma"][nbytes] = {"s_one_at_a_time": t1, f"s_{DMA_INFLIGHT}_inflight": tq, "stream_bw": nbytes / tq}
        del src
    latency, _ = line_fit(DMA_SIZES, single)
    out["latency_intercept"] = latency
    out["stream"] = stream_rates(trials, step)
    step("vector")
    a = jnp.asarray(1 + 0.01 * rng.standard_normal((VEC_ROWS, VEC_COLS)), jnp.float32)
    t_fma = per_repeat(lambda r: vector_call("fma", r), (a,), *TIMED_REPS["vector"], trials)
    t_pass = per_repeat(lambda r: vector_call("pass", r), (a[:8],), *TIMED_REPS["vector"], trials)
    out["vector"] = {"s_per_fma_pass": t_fma, "s_per_vmem_pass": t_pass}
    from mk.kernel.plan import CHIP_OF_DEVICE_KIND, chip_unpack
    out["dequant"] = dequant_rates(rng, trials, step)
    own = chip_unpack(CHIP_OF_DEVICE_KIND[dev.device_kind])       # a kind `chip_of_device_kind` took
    own = own if own in out["dequant"] else DEQUANT_UNPACKS[0]
    out["dequant_unpack"] = own
    out["constants"] = {
        "mxu_push_rows": out["mxu"][MXU_ROWS[0]]["push_rows"],
        "dma_descriptor_latency": max(latency, 0.0),
        "dma_stream_bw": max(v["stream_bw"] for v in out["stream"].values()),
        "vector_flops": 2 * FMAS * VEC_ROWS * VEC_COLS / t_fma,
        "vector_bw": 2 * BW_ROWS * VEC_COLS * 4 / t_pass,
        "mxu_bf16xfp8_vs_bf16": out["mxu_dtypes"]["bf16xfp8"]["vs_bf16"],
        "dequant_op_rate": out["dequant"][own]["weights_per_s"] * out["dequant"][own]["ops_per_weight"],
    }
    return out


# jax `device_kind` -> the chip's name in data/ (hardware.csv `chip`, microbench.csv `system`), for
# every kind jax knows (jax/_src/pallas/mosaic/tpu_info.py) that data/hardware.csv describes.
DEVICE_KINDS = {kind: HARDWARE_CHIP[chip] for kind, chip in CHIP_OF_DEVICE_KIND.items() if chip in HARDWARE_CHIP}
# Unit and how it is measured of each constant `measure` returns (the `unit` and `note` of a new row).
CONSTANTS = {
    "mxu_push_rows": ("count", f"[16, {MXU_K}] @ [{MXU_K}, {MXU_N}] bf16 from VMEM: time x the chip's bf16 peak / "
                               f"(2 K N)"),
    "dma_descriptor_latency": ("s", "intercept of the least-squares line through HBM -> VMEM copies of "
                                    "64 KiB .. 4 MiB, one at a time"),
    "dma_stream_bw": ("bytes/s", f"HBM -> VMEM copies of 256 KiB .. 16 MiB chunks, 2 .. 32 in flight, "
                                 f"{STREAM_BYTES[0] >> 20} MiB against {STREAM_BYTES[1] >> 20} MiB of them: the fastest"),
    "vector_flops": ("flop/s", f"{FMAS} dependent f32 multiply-adds per element of a [{VEC_ROWS}, {VEC_COLS}] "
                               f"block, 2 flops each"),
    "vector_bw": ("bytes/s", f"load-multiply-store passes over a [{BW_ROWS}, {VEC_COLS}] f32 VMEM block"),
    "dequant_op_rate": ("op/s", f"the kernel's product of a [{DEQ_ROWS}, {DEQ_K}] bf16 LHS with an MXFP4 [{DEQ_K}, "
                                f"{DEQ_N}] VMEM tile (the chip's unpack, in registers), repeated: weights/s x its "
                                f"vector ops per weight"),
    "mxu_bf16xfp8_vs_bf16": ("ratio", f"context: a [{DTYPE_ROWS}, K] bf16 x [K, N] float8_e4m3fn matmul's time "
                                      f"over the bf16 one's (the fp8 MXFP4 path's weight push)"),
}


def implausible_by_constant(res: dict) -> dict[str, list[str]]:
    """{constant: why its timings are not a measurement of the chip} for the constants of a `measure`
    result that fail: non-positive times (noise above the difference of two repeat counts), a stream
    faster than the datasheet's HBM, copies in flight slower each than one at a time (the queue was
    not what was timed), a negative latency intercept. `--write` writes only the other constants."""
    why: dict[str, list[str]] = {}
    dma = [f"dma {n >> 10} KiB: {k} {t:.3g} s <= 0" for n, r in res["dma"].items() for k, t in r.items()
           if k.startswith("s_") and not t > 0]
    dma += [f"dma {n >> 10} KiB: {DMA_INFLIGHT} copies in flight take {r[f's_{DMA_INFLIGHT}_inflight'] * 1e6:.3g} us "
            f"each, one at a time {r['s_one_at_a_time'] * 1e6:.3g} us" for n, r in res["dma"].items()
            if r[f"s_{DMA_INFLIGHT}_inflight"] > r["s_one_at_a_time"] > 0]
    if dma:
        why["dma_descriptor_latency"] = dma
    from mk.perf.hardware import load_chips
    hbm = load_chips()[res["chip"]].hbm_bw
    stream = [f"stream {name}: {r['s_per_copy']:.3g} s per copy <= 0" for name, r in res.get("stream", {}).items()
              if not r["s_per_copy"] > 0]
    if "stream" not in res:
        stream.append("no stream sweep (a run from before STREAM_POINTS: its stream was the 4 MiB copies' best)")
    bw = res["constants"]["dma_stream_bw"]
    if not bw <= 1.05 * hbm:
        stream.append(f"dma_stream_bw {bw:.3g} B/s above the datasheet HBM bandwidth {hbm:.3g}")
    if stream:
        why["dma_stream_bw"] = stream
    if res.get("latency_intercept", 0.0) < 0:
        why.setdefault("dma_descriptor_latency", []).append(
            f"dma_descriptor_latency intercept {res['latency_intercept']:.3g} s < 0")
    mxu = [f"mxu {r}-row matmul {v['s']:.3g} s <= 0" for r, v in res["mxu"].items() if not v["s"] > 0]
    if mxu:
        why["mxu_push_rows"], why["mxu_bf16xfp8_vs_bf16"] = mxu, list(mxu)
    deq = [f"dequant ({u}) {r['s_per_tile']:.3g} s per tile <= 0" for u, r in res.get("dequant", {}).items()
           if not r["s_per_tile"] > 0]
    if deq:
        why["dequant_op_rate"] = deq
    return why


def implausible(res: dict) -> list[str]:
    """Every reason of `implausible_by_constant`, once each. [] = the whole run is plausible."""
    return list(dict.fromkeys(w for ws in implausible_by_constant(res).values() for w in ws))


def chip_of_device_kind(kind: str) -> str:
    """The data/ chip name of a jax device kind ("TPU v5 lite" -> "tpu-v5e"); refuses others."""
    if kind not in DEVICE_KINDS:
        raise MicrobenchError(f"device kind {kind!r}: no chip of data/hardware.csv; mk microbench knows "
                              f"{sorted(DEVICE_KINDS)}")
    return DEVICE_KINDS[kind]


def write_microbench_csv(constants: dict, path, source: str, chip: str, base=None) -> Path:
    """A copy of data/microbench.csv (or `base`) with `chip`'s rows of `constants` set to the
    measured values (source: `source`): an existing row keeps its unit and its sweep range, widened to
    contain the value (note: what it was); a constant the chip has no row for is added after the
    chip's last row (or at the end), unit and note from `CONSTANTS`, no range. Other chips' rows
    are copied as they are."""
    from mk.perf.hardware import DATA_DIR
    unknown = sorted(set(constants) - set(CONSTANTS))
    if unknown:
        raise MicrobenchError(f"constants: unknown quantity {unknown}; expected some of {sorted(CONSTANTS)}")
    base = Path(base) if base else DATA_DIR / "microbench.csv"
    lines = base.read_text().splitlines(keepends=True)

    def row(*fields) -> str:
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerow(fields)
        return buf.getvalue()

    seen, out, last = set(), [], None
    for line in lines:
        if line.startswith("#") or not line.strip():
            out.append(line)
            continue
        r = next(csv.reader([line]))
        if r[0] == chip and r[1] in constants:
            v = float(constants[r[1]])
            lo, hi = r[4], r[5]
            if lo and hi:
                lo, hi = f"{min(float(lo), v):.6g}", f"{max(float(hi), v):.6g}"
            line = row(r[0], r[1], f"{v:.6g}", r[3], lo, hi, source, f"was: {r[2]} ({r[6]})")
            seen.add(r[1])
        out.append(line if line.endswith("\n") else line + "\n")
        if r[0] == chip:
            last = len(out)
    new = [row(chip, q, f"{float(v):.6g}", CONSTANTS[q][0], "", "", source, CONSTANTS[q][1])
           for q, v in constants.items() if q not in seen]
    at = len(out) if last is None else last
    out[at:at] = new
    path = Path(path)
    path.write_text("".join(out))
    return path


def source_label(device_kind: str, when: str | None = None) -> str:
    return f"measured: mk microbench on {device_kind}, {when or datetime.date.today().isoformat()}"


def compile_all(topology: str = "tpu7x:2x2x1") -> list[dict]:
    """Deviceless TPU compile of every kernel at the sizes and the largest repeat count `measure`
    times: [{name, compiled, error}]."""
    from mk.kernel.aot import _compile, _topology
    device = _topology(topology).devices[0]
    rows = []
    for name, make, args in cases(small=False):
        reps = TIMED_REPS[name.split(".")[0]][1]
        if name.startswith("dma"):                     # the source holds one chunk per copy
            reps = dma_reps(int(name.split(".")[1]))[1]
            args = (np.zeros((reps,) + args[0].shape[1:], np.float32),)
        r = _compile(make(reps), tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args), device)
        rows.append({"name": name, "compiled": r.compiled, "error": r.error})
    return rows
