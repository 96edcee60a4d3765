"""fp4moe: Mixture-of-Experts layers with NVFP4 expert weights on NVIDIA Hopper, as one call.

    import fp4moe
    layer = fp4moe.MoeLayer("glm-5", weights, max_tokens=4096)     # repacks the weights once
    out = layer.forward(hidden, topk_ids=ids, topk_weights=w)         # or router_logits=logits

Tensors are exchanged through DLPack (torch, CuPy, JAX, NumPy) without copies; torch is optional
and never imported by this package unless you use it (fp4moe.torch_ops registers the torch custom
op when torch is already imported, or when imported explicitly).
"""
from __future__ import annotations

import os as _os
import sys as _sys

from ._loader import ext as _ext

__version__: str = _ext.__version__
Error = _ext.Error
Config = _ext.Config
gpu_available = _ext.gpu_available
device_count = _ext.device_count

# The shipped tuner tables (tune/*.json, installed with the package): the layer looks tile configs up
# there unless FP4MOE_TUNE_CACHE says otherwise.
_tune = _os.path.join(_os.path.dirname(__file__), "tune")
if not _os.environ.get("FP4MOE_TUNE_CACHE") and _os.path.isdir(_tune):
    _os.environ["FP4MOE_TUNE_CACHE"] = _tune

from .config import config_from_hf, make_config, preset, preset_names  # noqa: E402
from .formats import (  # noqa: E402
    dequantize,
    quantize_mxfp4,
    quantize_nvfp4,
    swizzle_scales_128x4,
    unswizzle_scales_128x4,
)
from .explain import explain  # noqa: E402
from .layer import MoeLayer, load_moe_layer  # noqa: E402

__all__ = [
    "Config",
    "Error",
    "MoeLayer",
    "config_from_hf",
    "dequantize",
    "device_count",
    "explain",
    "gpu_available",
    "load_moe_layer",
    "make_config",
    "preset",
    "preset_names",
    "quantize_mxfp4",
    "quantize_nvfp4",
    "swizzle_scales_128x4",
    "unswizzle_scales_128x4",
]

if "torch" in _sys.modules:
    from . import torch_ops as _torch_ops

    _torch_ops.register()
