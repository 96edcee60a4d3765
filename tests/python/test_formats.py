"""quantize_nvfp4 / dequantize / MXFP4 / scale swizzling against an independent NumPy reference of the
formats (written here from the definitions, not from fp4moe's code): bit-exact codes, scales and values,
through DLPack round trips (NumPy; torch CPU tensors when torch is installed)."""
from __future__ import annotations

import numpy as np
import pytest

import fp4moe
from conftest import HAS_TORCH

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)


def e4m3_value(b: np.ndarray) -> np.ndarray:
    """float value of E4M3 (fn) bytes: bias 7, no infinities, S.1111.111 = NaN, subnormals m * 2^-9."""
    b = b.astype(np.int64)
    s, e, m = b >> 7, (b >> 3) & 15, b & 7
    mag = np.where(e == 0, m * 2.0**-9, (1 + m / 8.0) * 2.0 ** (e - 7))
    mag = np.where((e == 15) & (m == 7), np.nan, mag)
    return np.where(s == 1, -mag, mag).astype(np.float32)


POS_E4M3 = e4m3_value(np.arange(0, 127))  # every finite non-negative E4M3 value, ascending


def to_e4m3(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even onto E4M3, saturating at 448 (x >= 0 here: scales)."""
    x = np.asarray(x, dtype=np.float32)
    idx = np.searchsorted(POS_E4M3, x)  # first value >= x
    idx = np.clip(idx, 1, 126)
    lo, hi = POS_E4M3[idx - 1], POS_E4M3[idx]
    pick_hi = (x - lo > hi - x) | ((x - lo == hi - x) & ((idx & 1) == 0))  # tie -> even code
    code = np.where(pick_hi, idx, idx - 1)
    code = np.where(x >= POS_E4M3[126], 126, code)
    code = np.where(x <= 0, 0, code)
    return code.astype(np.uint8)


def to_e2m1(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even onto E2M1 {0, .5, 1, 1.5, 2, 3, 4, 6}, saturating at 6."""
    grid = E2M1[:8]
    a = np.abs(x).astype(np.float32)
    idx = np.clip(np.searchsorted(grid, a), 1, 7)
    lo, hi = grid[idx - 1], grid[idx]
    pick_hi = (a - lo > hi - a) | ((a - lo == hi - a) & ((idx & 1) == 0))
    code = np.where(pick_hi, idx, idx - 1)
    code = np.where(a >= 6, 7, code)
    return (code | np.where(np.signbit(x), 8, 0)).astype(np.uint8)


def reference_nvfp4(x: np.ndarray, global_scale=None):
    """ModelOpt's NVFP4 recipe, float32 arithmetic."""
    x = x.astype(np.float32)
    amax = np.float32(np.abs(x).max())
    g = np.float32(amax / np.float32(6 * 448)) if global_scale is None else np.float32(global_scale)
    if global_scale is None and amax == 0:
        g = np.float32(1)
    blocks = x.reshape(-1, 16)
    bamax = np.abs(blocks).max(axis=1).astype(np.float32)
    s = (bamax / (np.float32(6) * g)).astype(np.float32)
    s = np.where(bamax > 0, s, np.float32(1))
    s = np.clip(s, np.float32(2.0**-9), np.float32(448)).astype(np.float32)
    sc = to_e4m3(s)
    q = to_e2m1((blocks / (e4m3_value(sc)[:, None] * g)).astype(np.float32))
    packed = (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)
    lead = x.shape[:-1]
    return packed.reshape(*lead, -1), sc.reshape(*lead, -1), g


def reference_dequant(codes, scales, g):
    lo, hi = codes & 15, codes >> 4
    v = np.stack([E2M1[lo], E2M1[hi]], axis=-1).reshape(*codes.shape[:-1], -1)
    return v * np.repeat(e4m3_value(scales), 16, axis=-1) * np.float32(g)


def test_reference_tables_are_the_formats():
    assert to_e2m1(np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, 7, -0.3], np.float32)).tolist() == \
        [0, 2, 2, 4, 4, 6, 6, 7, 9]
    assert e4m3_value(np.array([0x7E, 0x01, 0x38, 0xB8], np.uint8)).tolist() == [448, 2.0**-9, 1.0, -1.0]
    assert to_e4m3(np.array([448.0, 500.0, 1.0, 2.0**-10], np.float32)).tolist() == [0x7E, 0x7E, 0x38, 0]


@pytest.mark.parametrize("shape", [(1, 16), (3, 64), (2, 5, 32), (128, 256)])
@pytest.mark.parametrize("seed", [0, 1])
def test_quantize_nvfp4_is_bit_exact(shape, seed):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * rng.choice([1e-3, 1.0, 50.0])).astype(np.float32)
    x.reshape(-1)[:16] = 0  # an all-zero block
    codes, scales, g = fp4moe.quantize_nvfp4(x)
    rc, rs, rg = reference_nvfp4(x)
    assert codes.dtype == np.uint8 and scales.dtype == np.uint8
    assert codes.shape == shape[:-1] + (shape[-1] // 2,) and scales.shape == shape[:-1] + (shape[-1] // 16,)
    assert np.float32(g) == rg
    np.testing.assert_array_equal(scales, rs)
    np.testing.assert_array_equal(codes, rc)
    # dequantize gives exactly e2m1 * e4m3 * global
    got = fp4moe.dequantize(codes, scales, g)
    np.testing.assert_array_equal(got, reference_dequant(codes, scales, g))


def test_quantize_with_a_given_global_scale():
    x = np.random.default_rng(3).standard_normal((4, 32)).astype(np.float32)
    codes, scales, g = fp4moe.quantize_nvfp4(x, global_scale=0.01)
    rc, rs, _ = reference_nvfp4(x, 0.01)
    assert g == np.float32(0.01)
    np.testing.assert_array_equal(codes, rc)
    np.testing.assert_array_equal(scales, rs)


def test_dequantize_per_expert_global_scales():
    rng = np.random.default_rng(4)
    E, N, K = 3, 4, 32
    codes = rng.integers(0, 256, (E, N, K // 2), dtype=np.uint8)
    scales = rng.integers(0x30, 0x48, (E, N, K // 16), dtype=np.uint8)
    g = np.array([0.5, 0.25, 2.0], np.float32)
    got = fp4moe.dequantize(codes, scales, g)
    for e in range(E):
        np.testing.assert_array_equal(got[e], reference_dequant(codes[e], scales[e], g[e]))
    with pytest.raises(ValueError, match="global_scale"):
        fp4moe.dequantize(codes, scales, np.ones(4, np.float32))


def test_every_code_and_scale_dequantizes_exactly():
    codes = np.arange(256, dtype=np.uint8).reshape(16, 16)  # every byte: all 16 x 16 code pairs
    scales = np.arange(0, 127, 8, dtype=np.uint8)[:16].reshape(16, 1).repeat(2, axis=1)
    got = fp4moe.dequantize(codes, scales, 1.0)
    np.testing.assert_array_equal(got, reference_dequant(codes, scales, 1.0))


def test_mxfp4_round_trip():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((6, 64)).astype(np.float32)
    codes, scales = fp4moe.quantize_mxfp4(x)
    assert codes.shape == (6, 32) and scales.shape == (6, 2)
    # reference: shared exponent floor(log2(amax)) - 2, biased by 127
    amax = np.abs(x.reshape(-1, 32)).max(axis=1)
    np.testing.assert_array_equal(scales.reshape(-1), (np.floor(np.log2(amax)).astype(int) - 2 + 127).astype(np.uint8))
    scale = 2.0 ** (scales.reshape(-1).astype(np.float64) - 127)
    ref_codes = to_e2m1((x.reshape(-1, 32) / scale[:, None]).astype(np.float32))
    np.testing.assert_array_equal(codes.reshape(-1, 16), (ref_codes[:, 0::2] | (ref_codes[:, 1::2] << 4)))
    vals = fp4moe.dequantize(codes, scales, format="mxfp4")
    lo, hi = codes & 15, codes >> 4
    ref = np.stack([E2M1[lo], E2M1[hi]], -1).reshape(6, 64) * np.repeat(scale.reshape(6, 2), 32, axis=1)
    np.testing.assert_array_equal(vals, ref.astype(np.float32))


def test_swizzle_round_trip_and_layout():
    rng = np.random.default_rng(6)
    rows, kb = 130, 6
    s = rng.integers(1, 255, (rows, kb), dtype=np.uint8)
    sw = fp4moe.swizzle_scales_128x4(s)
    assert sw.shape == (256, 8)
    flat = sw.reshape(-1)
    for m, k in [(0, 0), (1, 0), (33, 3), (129, 5)]:  # CUTLASS 128x4: 512-byte atoms, row m%32 outermost
        off = ((m // 128) * 2 + k // 4) * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4 + k % 4
        assert flat[off] == s[m, k]
    np.testing.assert_array_equal(fp4moe.unswizzle_scales_128x4(sw, rows, kb), s)


@pytest.mark.parametrize("call, exc, pattern", [
    (lambda: fp4moe.quantize_nvfp4(np.zeros((2, 24), np.float32)), ValueError, "multiple of 16"),
    (lambda: fp4moe.quantize_nvfp4(np.zeros((2, 32), np.float64)), TypeError, "x: dtype float64"),
    (lambda: fp4moe.quantize_nvfp4(np.zeros((32, 2), np.float32).T), ValueError, "x: strides"),
    (lambda: fp4moe.quantize_nvfp4(np.full((1, 16), np.inf, np.float32)), fp4moe.Error, "finite"),
    (lambda: fp4moe.quantize_nvfp4([1.0] * 16), TypeError, "x: a list is not a tensor"),
    (lambda: fp4moe.dequantize(np.zeros((2, 8), np.uint8), np.zeros((2, 2), np.uint8), 1.0), ValueError, "scales: shape"),
    (lambda: fp4moe.dequantize(np.zeros((2, 8), np.int8), np.zeros((2, 1), np.uint8), 1.0), TypeError, "codes: dtype int8"),
    (lambda: fp4moe.dequantize(np.zeros((2, 8), np.uint8), np.zeros((2, 1), np.uint8)), ValueError, "global_scale"),
    (lambda: fp4moe.dequantize(np.zeros((2, 8), np.uint8), np.zeros((2, 1), np.uint8), format="fp8"), ValueError, "format"),
    (lambda: fp4moe.quantize_mxfp4(np.zeros((2, 16), np.float32)), ValueError, "multiple of 32"),
    (lambda: fp4moe.unswizzle_scales_128x4(np.zeros(100, np.uint8), 3, 2), ValueError, "swizzled"),
])
def test_format_errors_name_the_argument(call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call()


@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")
def test_torch_cpu_tensors_through_dlpack():
    import torch

    g = torch.Generator().manual_seed(7)
    x = torch.randn(8, 64, generator=g)
    codes, scales, gs = fp4moe.quantize_nvfp4(x)  # float32 torch tensor in
    rc, rs, rg = reference_nvfp4(x.numpy())
    np.testing.assert_array_equal(codes, rc)
    np.testing.assert_array_equal(scales, rs)
    # bf16 input (numpy has no bf16): the same as quantizing its exact float32 values
    xb = x.to(torch.bfloat16)
    cb, sb, gb = fp4moe.quantize_nvfp4(xb)
    rcb, rsb, rgb = reference_nvfp4(xb.float().numpy())
    np.testing.assert_array_equal(cb, rcb)
    np.testing.assert_array_equal(sb, rsb)
    # torch tensors back in: codes uint8, scales as float8_e4m3fn, a [1] global as a tensor
    tc = torch.from_numpy(codes)
    ts = torch.from_numpy(scales).view(torch.float8_e4m3fn)
    got = fp4moe.dequantize(tc, ts, torch.tensor(gs))
    np.testing.assert_array_equal(got, reference_dequant(codes, scales, gs))
    # float8 decoding agrees with torch's own
    np.testing.assert_array_equal(e4m3_value(scales), ts.float().numpy())
