"""MXFP4 (spec 2.3): the spec test vector, the loader's fast table path vs the plain ml_dtypes
path, and quantization (mk.io.synth) that dequantizes exactly to what the checkpoint holds."""
import ml_dtypes
import numpy as np
import pytest

from mk.io.convert import dequantize_mxfp4
from mk.io.synth import dequantize_reference, quantize_mxfp4

BF16 = ml_dtypes.bfloat16
CODE_VALUES = [0.0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]


def bits(x):
    return np.asarray(x).view(np.uint16)


def test_spec_test_vector():
    """8 words alternating 0x76543210 / 0xFEDCBA98 (element 8w + j in bits 4j..4j+3), one column,
    scales 127 (first 32 rows) and 128 (next 32): codes 0..15 in order, second group doubled."""
    words = np.array([0x76543210, 0xFEDCBA98] * 4, dtype="<u4")
    packed = words.view(np.uint8)[None, :]  # checkpoint row: [N=1, K/2=32], low nibble first
    assert packed.shape == (1, 32) and packed[0, 0] == 0x10 and packed[0, 4] == 0x98
    scale = np.array([[127, 128]], np.uint8)
    want = np.array(CODE_VALUES * 2 + [2 * v for v in CODE_VALUES] * 2, np.float32).astype(BF16)
    for got in (dequantize_mxfp4(packed, scale, transpose=False)[0], dequantize_mxfp4(packed, scale)[:, 0],
                dequantize_reference(packed, scale)[:, 0]):
        assert got.dtype == BF16 and got.shape == (64,)
        np.testing.assert_array_equal(bits(got), bits(want))  # bit for bit, -0 included
    assert np.signbit(np.asarray(dequantize_mxfp4(packed, scale)[8, 0], np.float32))


def test_fast_path_equals_reference_on_every_byte_and_scale():
    rng = np.random.default_rng(0)
    # every packed byte value in every row, every valid scale byte (1..254) somewhere
    packed = np.tile(np.arange(256, dtype=np.uint8), (254, 1)).reshape(254, 256)  # K = 512
    scale = np.empty((254, 16), np.uint8)
    scale[:, 0] = np.arange(1, 255)
    scale[:, 1:] = rng.integers(1, 255, (254, 15))
    a, b = dequantize_mxfp4(packed, scale), dequantize_reference(packed, scale)
    assert a.shape == (512, 254)
    np.testing.assert_array_equal(bits(a), bits(b))


def test_leading_axes_and_orientation():
    rng = np.random.default_rng(1)
    packed = rng.integers(0, 256, (2, 3, 8, 32), dtype=np.uint8)
    scale = rng.integers(100, 140, (2, 3, 8, 2), dtype=np.uint8)
    w = dequantize_mxfp4(packed, scale)
    assert w.shape == (2, 3, 64, 8)
    np.testing.assert_array_equal(bits(w[1, 2]), bits(dequantize_mxfp4(packed[1, 2], scale[1, 2])))
    np.testing.assert_array_equal(bits(np.swapaxes(w, -1, -2)),
                                  bits(dequantize_mxfp4(packed, scale, transpose=False)))


@pytest.mark.parametrize("bad", [0, 255])
def test_rejects_scale_bytes_0_and_255(bad):
    packed = np.zeros((4, 16), np.uint8)
    scale = np.full((4, 1), 127, np.uint8)
    scale[2, 0] = bad
    with pytest.raises(ValueError, match=f"byte {bad}"):
        dequantize_mxfp4(packed, scale)


def test_quantize_round_trip_is_exact_on_representable_values():
    rng = np.random.default_rng(2)
    K, N = 64, 6
    codes = rng.choice(np.array(CODE_VALUES, np.float32), (N, K))
    exps = rng.integers(-10, 5, (N, K // 32))
    codes[:, ::32] = 6.0  # each group reaches max magnitude: the scale is then exactly 2^exp
    w = (codes * np.repeat(2.0 ** exps, 32, axis=1)).astype(np.float32).T.astype(BF16)  # [K, N]
    packed, scale = quantize_mxfp4(w)
    assert packed.shape == (N, K // 2) and scale.shape == (N, K // 32)
    np.testing.assert_array_equal(scale, exps + 127)
    np.testing.assert_array_equal(bits(dequantize_mxfp4(packed, scale)), bits(w))


def test_quantize_random_weights():
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((5, 128, 96)) * 0.02).astype(BF16)  # [E, K, N]
    packed, scale = quantize_mxfp4(w)
    assert packed.shape == (5, 96, 64) and scale.shape == (5, 96, 4)
    assert scale.min() >= 1 and scale.max() <= 254
    deq = np.asarray(dequantize_mxfp4(packed, scale), np.float32)
    np.testing.assert_array_equal(bits(dequantize_mxfp4(packed, scale)), bits(dequantize_reference(packed, scale)))
    # group max is representable to within one scale step; error at most half the largest gap (1)
    step = np.repeat(2.0 ** (scale.astype(np.float64) - 127), 32, axis=-1).swapaxes(-1, -2)
    assert np.all(np.abs(deq - np.asarray(w, np.float32)) <= step + 1e-30)
    # re-quantizing the dequantized weights is lossless
    p2, s2 = quantize_mxfp4(dequantize_mxfp4(packed, scale))
    np.testing.assert_array_equal(bits(dequantize_mxfp4(p2, s2)), bits(dequantize_mxfp4(packed, scale)))


def test_zero_group_gets_valid_scale():
    packed, scale = quantize_mxfp4(np.zeros((32, 2), BF16))
    assert np.all(scale == 127) and np.all(packed == 0)


def test_loader_fast_path_for_big_matrices_is_exact():
    """The loader's XLA path (matrices >= 256 KiB packed) agrees with the plain path bit for bit."""
    from mk.io.convert import _dequant_into, _JAX_MIN_BYTES
    rng = np.random.default_rng(4)
    n, half = 512, 512  # K = 1024
    assert n * half >= _JAX_MIN_BYTES // 4
    packed = rng.integers(0, 256, (n, half), dtype=np.uint8)
    packed[:256] = np.arange(256, dtype=np.uint8)[:, None]  # every byte value
    scale = rng.integers(1, 255, (n, 2 * half // 32), dtype=np.uint8)
    scale[:254, 0] = np.arange(1, 255)  # every valid scale byte, extremes included
    dst = np.empty((2 * half, n), BF16)
    _dequant_into(dst, packed, scale)
    np.testing.assert_array_equal(bits(dst), bits(dequantize_reference(packed, scale)))
