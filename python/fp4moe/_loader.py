"""Imports the compiled module fp4moe._ext.

The module links libcublas.so.13 dynamically (the router GEMM). Its RPATH covers torch's pip CUDA
wheels installed next to this package and the CUDA toolkit it was built against; when neither has
it, this preloads cuBLAS from $CUDA_HOME (or $CUDA_PATH) / the pip `nvidia` wheels /
/usr/local/cuda, then imports again.
"""
from __future__ import annotations

import ctypes
import importlib
import os
import sys


def _candidate_dirs() -> list[str]:
    dirs = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        root = os.environ.get(var)
        if root:
            dirs += [os.path.join(root, "lib64"), os.path.join(root, "lib")]
    for entry in sys.path:
        for sub in ("nvidia/cu13/lib", "nvidia/cublas/lib"):
            dirs.append(os.path.join(entry or ".", sub))
    dirs += ["/usr/local/cuda/lib64", "/usr/local/cuda/targets/x86_64-linux/lib"]
    return [d for d in dirs if os.path.isdir(d)]


def _preload_cublas() -> bool:
    for d in _candidate_dirs():
        lt, blas = os.path.join(d, "libcublasLt.so.13"), os.path.join(d, "libcublas.so.13")
        if os.path.exists(blas):
            try:
                if os.path.exists(lt):
                    ctypes.CDLL(lt, mode=ctypes.RTLD_GLOBAL)
                ctypes.CDLL(blas, mode=ctypes.RTLD_GLOBAL)
                return True
            except OSError:
                continue
    return False


def load():
    try:
        return importlib.import_module("fp4moe._ext")
    except ImportError as e:
        if isinstance(e, ModuleNotFoundError):
            raise ImportError(
                f"fp4moe: the compiled module fp4moe._ext is missing next to {__file__}: this is the package's "
                "source directory, not an installed fp4moe (pip install . first, and import it from elsewhere)"
            ) from e
        if "libcublas" not in str(e) or not _preload_cublas():
            raise ImportError(
                f"fp4moe: the compiled module could not be loaded ({e}). It needs the CUDA 13 runtime "
                "libraries (libcublas.so.13): install the CUDA 13 toolkit or torch's CUDA 13 wheels, or set "
                "CUDA_HOME") from e
        return importlib.import_module("fp4moe._ext")


ext = load()
