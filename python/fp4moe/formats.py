"""NVFP4 / MXFP4 tensors on the CPU, through the C++ format library (include/fp4moe/format.hpp).

Inputs are host arrays of any DLPack framework (NumPy, torch CPU tensors, ...); outputs are NumPy
arrays (torch.from_numpy takes them without a copy). Results are the C++ library's, bit for bit:
ModelOpt's NVFP4 recipe (global = amax / (6 * 448), E4M3 block scales of 16 elements, E2M1 codes,
two per byte, element 2i in the low nibble) and OCP MXFP4 (32-element blocks, E8M0 scales).
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from ._loader import ext as _ext


def quantize_nvfp4(x: Any, global_scale: Optional[float] = None) -> tuple[np.ndarray, np.ndarray, float]:
    """x [..., K] (float32 or bfloat16, K % 16 == 0) -> (codes uint8 [..., K/2], scales uint8 [..., K/16]
    (E4M3 bits; .view(torch.float8_e4m3fn) in torch), global_scale). One global scale for the whole
    tensor: ModelOpt's per-tensor weight_scale_2, or the one given (an expert's gate and up share one).
    The scales are row-major, as checkpoints store them (swizzle_scales_128x4 for the swizzled layout)."""
    return _ext.quantize_nvfp4(x, None if global_scale is None else float(global_scale))


def quantize_mxfp4(x: Any) -> tuple[np.ndarray, np.ndarray]:
    """x [..., K] float32 (K % 32 == 0) -> (codes uint8 [..., K/2], E8M0 scales uint8 [..., K/32])."""
    return _ext.quantize_mxfp4(x)


def _row_globals(global_scale: Any, lead: tuple) -> np.ndarray:
    g = np.asarray(_host(global_scale), dtype=np.float32)
    if g.ndim > len(lead) or g.shape != lead[: g.ndim]:
        raise ValueError(
            f"global_scale: shape {g.shape} must be a scalar or match the leading dimensions of codes "
            f"{lead} (e.g. [E] for stacked experts [E, N, K/2])")
    g = g.reshape(g.shape + (1,) * (len(lead) - g.ndim))
    return np.ascontiguousarray(np.broadcast_to(g, lead), dtype=np.float32).reshape(-1)


def _host(a: Any) -> Any:
    if isinstance(a, (int, float, np.ndarray)):
        return a
    if hasattr(a, "__dlpack__"):
        dev = a.__dlpack_device__() if hasattr(a, "__dlpack_device__") else (1, 0)
        if int(dev[0]) != 1:
            raise ValueError("global_scale: on a GPU; the format helpers run on the CPU (pass a host array)")
        return np.from_dlpack(a)
    return a


def dequantize(codes: Any, scales: Any, global_scale: Any = None, *, format: str = "nvfp4") -> np.ndarray:
    """Exact float32 values of NVFP4 (default) or MXFP4 codes.

    nvfp4: codes uint8 [..., K/2], scales float8_e4m3fn / uint8 [..., K/16], global_scale a float or one
           value per leading index of codes (e.g. [E] for [E, N, K/2]); value = e2m1 * e4m3 * global.
    mxfp4: codes uint8 [..., K/2], scales E8M0 uint8 [..., K/32]; no global scale.
    """
    if format == "nvfp4":
        if global_scale is None:
            raise ValueError("global_scale: required for NVFP4 (the tensor's weight_scale_2)")
        shape = getattr(codes, "shape", None)
        if shape is None or len(shape) < 1:
            raise TypeError(f"codes: a {type(codes).__name__}; pass an array [..., K/2]")
        lead = tuple(int(s) for s in shape[:-1])
        return _ext.dequantize_nvfp4(codes, scales, _row_globals(global_scale, lead))
    if format == "mxfp4":
        if global_scale is not None:
            raise ValueError("global_scale: MXFP4 has none (its E8M0 block scales are the whole scale)")
        return _ext.dequantize_mxfp4(codes, scales)
    raise ValueError(f"format = '{format}': 'nvfp4' or 'mxfp4'")


def swizzle_scales_128x4(scales: Any) -> np.ndarray:
    """Row-major scales [rows, K/16] -> CUTLASS's 128x4 swizzled layout [pad128(rows), pad4(K/16)] (the
    byte order that block-scaled tensor-core kernels read; padding zero)."""
    return _ext.swizzle_scales_128x4(scales)


def unswizzle_scales_128x4(swizzled: Any, rows: int, kblocks: int) -> np.ndarray:
    """The inverse of swizzle_scales_128x4: [rows, kblocks] row-major (fp4moe's layers take this layout)."""
    return _ext.unswizzle_scales_128x4(swizzled, rows, kblocks)
