"""Shared helpers of the Python tests. GPU tests skip (visibly) without torch or without a CUDA GPU."""
from __future__ import annotations

import importlib.util
import os

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
HAS_TORCH = importlib.util.find_spec("torch") is not None


def need_torch():
    """torch, or a skip (CI's venv has no torch; the GPU machine does)."""
    if not HAS_TORCH:
        pytest.skip("torch is not installed")
    import torch

    return torch


def need_gpu():
    """torch with a CUDA GPU that fp4moe can use, or a skip."""
    torch = need_torch()
    import fp4moe

    if not (torch.cuda.is_available() and fp4moe.gpu_available()):
        pytest.skip("no CUDA GPU")
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) != (9, 0):
        pytest.skip(f"fp4moe's kernels are built for sm_90a; this GPU is sm_{major}{minor}")
    return torch
