"""fp4moe.MoeLayer: the whole MoE layer as one call on tensors from torch, CuPy, JAX, ..."""
from __future__ import annotations

import os
import sys
import weakref
from collections.abc import Mapping
from typing import Any, Optional

from ._loader import ext as _ext
from .config import ConfigLike, make_config

# Engine / checkpoint names accepted for the tensors of MoeLayer's `weights` (-> fp4moe's names).
WEIGHT_ALIASES = {
    "e_score_correction_bias": "router_bias",
    "gate_weight": "router_weight",
    "gate.weight": "router_weight",
    "gate.e_score_correction_bias": "router_bias",
}
# Activation scales of NVFP4 checkpoints: fp4moe keeps activations in bf16, so they are not needed.
IGNORED_SUFFIXES = ("_input_scale",)
_FLOAT32_KEYS = ("w13_bias", "w2_bias", "router_bias", "shared_w13_bias", "shared_w2_bias",
                 "w13_weight_scale_2", "w2_weight_scale_2", "shared_w13_weight_scale_2", "shared_w2_weight_scale_2")

_layers: "weakref.WeakValueDictionary[int, MoeLayer]" = weakref.WeakValueDictionary()
_next_id = 0


def _torch():
    return sys.modules.get("torch")


def stream_handle(stream: Any) -> int:
    """A cudaStream_t as an int from an int, an object with __cuda_stream__ (CUDA Python's protocol:
    (version, handle)), a torch.cuda.Stream (.cuda_stream) or a CuPy stream (.ptr)."""
    if isinstance(stream, int) and not isinstance(stream, bool):
        if stream < 0:
            raise ValueError(f"stream = {stream}: a cudaStream_t handle is >= 0 (0 is the legacy default stream)")
        return stream
    proto = getattr(stream, "__cuda_stream__", None)
    if proto is not None:
        v = proto() if callable(proto) else proto
        return int(v[1])
    for attr in ("cuda_stream", "ptr"):
        v = getattr(stream, attr, None)
        if isinstance(v, int):
            return v
    raise TypeError(
        f"stream: a {type(stream).__name__}; pass an int (cudaStream_t), an object with __cuda_stream__, a "
        "torch.cuda.Stream or a CuPy stream")


_exchange_types: dict = {}


def _default_stream(like: Any) -> int:
    """-1: the framework's current stream through the DLPack exchange table (torch has one); CuPy's
    current stream for CuPy arrays; else -1, which the C++ side turns into the legacy default stream."""
    tp = type(like)
    has = _exchange_types.get(tp)
    if has is None:
        has = _exchange_types[tp] = getattr(tp, "__dlpack_c_exchange_api__", None) is not None
    if has:
        return -1
    if tp.__module__.startswith("cupy"):
        import cupy  # noqa: PLC0415 (only for CuPy arrays)

        return int(cupy.cuda.get_current_stream().ptr)
    return -1


def _dlpack_device(t: Any) -> Optional[tuple[int, int]]:
    f = getattr(t, "__dlpack_device__", None)
    if f is None:
        return None
    dev = f()
    return int(dev[0]), int(dev[1])


def _resolve_device(device: Any, weights: Mapping) -> int:
    if device is None:
        for t in weights.values():
            d = _dlpack_device(t) if t is not None else None
            if d is not None and d[0] == 2:  # kDLCUDA
                return d[1]
        return _ext.current_device()
    if isinstance(device, int) and not isinstance(device, bool):
        return device
    s = str(device)
    if s == "cuda":
        index = getattr(device, "index", None)
        return _ext.current_device() if index is None else int(index)
    if s.startswith("cuda:"):
        return int(s[5:])
    raise ValueError(f"device = {device!r}: pass an int, 'cuda', 'cuda:N' or a torch.device of type cuda")


def _as_float32(key: str, t: Any) -> Any:
    torch = _torch()
    if torch is not None and isinstance(t, torch.Tensor):
        return t if t.dtype == torch.float32 else t.float()
    if isinstance(t, (float, int)):
        import numpy as np  # noqa: PLC0415

        return np.asarray([t], dtype=np.float32)
    dtype = getattr(t, "dtype", None)
    if dtype is not None and str(dtype) != "float32" and hasattr(t, "astype"):
        return t.astype("float32")
    return t


def _normalize_weights(weights: Mapping) -> dict:
    if not isinstance(weights, Mapping):
        raise TypeError(f"weights: a {type(weights).__name__}; pass a dict of tensors (w13_weight, ...)")
    torch = _torch()
    out: dict = {}
    for key, t in weights.items():
        if not isinstance(key, str):
            raise TypeError(f"weights: key {key!r} is not a string")
        if key.endswith(IGNORED_SUFFIXES) or t is None:
            continue
        name = WEIGHT_ALIASES.get(key, key)
        if name in out:
            raise ValueError(f"weights['{key}']: '{name}' was given twice (an alias of another key)")
        if name in _FLOAT32_KEYS:
            t = _as_float32(name, t)
        if torch is not None and isinstance(t, torch.Tensor):
            t = t.detach()
            if name == "router_weight" and t.dtype == torch.float32:
                t = t.to(torch.bfloat16)
            if not t.is_contiguous():  # construction may copy; forward never does
                t = t.contiguous()
        out[name] = t
    return out


class MoeLayer:
    """One MoE layer on one GPU: routing (or routing given), the NVFP4 expert GEMMs, the combine.

    MoeLayer(config, weights, max_tokens, device=None, *, stream=None)

    config: a preset name, a checkpoint's config.json path or dict, a dict of fp4moe fields, or a
        Config (see fp4moe.make_config).
    weights: the tensors as engines hold them (torch / CuPy / NumPy / any DLPack array; on the layer's
        GPU or on the host), E experts stacked, ModelOpt layout:
          w13_weight         uint8 [E, 2I, H/2]   packed E2M1, rows 0..I-1 gate (w1), I..2I-1 up (w3)
          w13_weight_scale   float8_e4m3fn (or its uint8 bits) [E, 2I, H/16], row-major (not swizzled)
          w13_weight_scale_2 float32 [E] (gate and up share it) or [E, 2] (gate, up); the dequant
                             multiplier as in the checkpoint (weight_scale_2 = amax / (6 * 448))
          w2_weight          uint8 [E, H, I/2];  w2_weight_scale [E, H, I/16];  w2_weight_scale_2 [E]
          router_bias        float32 [E] (e_score_correction_bias; sigmoid / gpt-oss routers), optional
          router_weight      bfloat16 [E, H] (gate.weight), optional: then forward() may omit routing
          w13_bias [E, 2I], w2_bias [E, H]     (gpt-oss: required; converted to float32 here)
          shared_w13_weight [2Is, H/2], shared_w13_weight_scale, shared_w13_weight_scale_2 [] / [1] / [2],
          shared_w2_weight [H, Is/2], shared_w2_weight_scale, shared_w2_weight_scale_2
                             (the shared expert when config.num_shared > 0, Is = I * num_shared)
        *_input_scale tensors are ignored (activations stay bf16). The layer repacks the weights once
        into memory it owns; the given tensors may be freed afterwards.
    max_tokens: the largest T a forward call takes; sizes the layer's one workspace (allocated here).
    device: CUDA device index, "cuda:N" or a torch.device; default: the weights' GPU, else the current one.
    stream: where construction's copies run (default: torch's current stream when torch tensors are
        given); construction synchronizes it once.

    One workspace per layer: calls on one layer must not run concurrently (two streams, or two
    replays of graphs holding the same layer at once).
    """

    def __init__(self, config: ConfigLike, weights: Mapping, max_tokens: int, device: Any = None, *,
                 stream: Any = None) -> None:
        cfg = make_config(config)
        if cfg.format == "mxfp4":
            raise ValueError("config: format 'mxfp4': MXFP4 weights (E8M0 scales per 32) are not taken from "
                             "tensors yet; load the checkpoint with fp4moe.load_moe_layer(dir, layer, max_tokens) "
                             "or pass NVFP4 weights with config format 'nvfp4'")
        w = _normalize_weights(weights)
        dev = _resolve_device(device, w)
        count = _ext.device_count()
        if not 0 <= dev < max(count, 1):
            raise ValueError(f"device = {dev}: this process sees {count} CUDA device(s)")
        if stream is not None:
            s = stream_handle(stream)
        else:
            torch = _torch()
            tensors = [t for t in w.values() if torch is not None and isinstance(t, torch.Tensor) and t.is_cuda]
            s = torch.cuda.current_stream(dev).cuda_stream if tensors else 0
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
            raise TypeError(f"max_tokens: a {type(max_tokens).__name__}; pass an int >= 1")
        self._adopt(_ext.Layer(cfg, w, max_tokens, dev, s))

    def _adopt(self, impl: Any) -> None:
        global _next_id
        self._impl = impl
        self._forward = self._impl.forward
        self.id = _next_id  # the handle torch.ops.fp4moe.* take
        _next_id += 1
        _layers[self.id] = self
        if "torch" in sys.modules:
            from . import torch_ops  # noqa: PLC0415

            torch_ops.register()

    # ---- properties ----
    @property
    def config(self):
        return self._impl.config

    @property
    def device(self) -> int:
        return self._impl.device

    @property
    def max_tokens(self) -> int:
        return self._impl.max_tokens

    @property
    def workspace_bytes(self) -> int:
        """Device memory this layer allocated for intermediates (besides its repacked weights)."""
        return self._impl.workspace_bytes

    @property
    def has_router_weight(self) -> bool:
        return self._impl.has_router_weight

    def forward(self, hidden: Any, *, router_logits: Any = None, topk_ids: Any = None, topk_weights: Any = None,
                out: Any = None, stream: Any = None) -> Any:
        """out[T, H] (bf16) = the MoE layer on hidden[T, H] (bf16, on the layer's GPU, row-major).

        Routing, one of:
          router_logits  float32 or bfloat16 [T, E]: fp4moe's router (softmax / sigmoid grouped with the
                         router bias / gpt-oss), which applies config.routed_scaling once, to the weights;
          topk_ids int32 [T, k] and topk_weights float32 [T, k]: the engine's routing, used AS GIVEN (no
                         routed_scaling, no renormalization here: include them in the weights if the model
                         needs them). An id of -1 skips the slot (expert not on this rank); any other id
                         outside [0, E) also contributes nothing and makes the next call raise
                         fp4moe.Error naming it (check_routing() asks without a call);
          neither: the layer's router weight computes the logits (weights['router_weight']).
        out: bf16 [T, H] to write (may be hidden itself); None allocates one with the input's framework
             (torch / CuPy). With out given, the call allocates nothing.
        stream: default: the framework's current stream (torch.cuda.current_stream(); CuPy's current
             stream); else an int cudaStream_t or an object with __cuda_stream__.
        Never synchronizes; capturable in a CUDA graph (torch.cuda.graph). Returns out.
        """
        if out is None:
            out = _empty_like(hidden)
        self._forward(hidden, router_logits, topk_ids, topk_weights, out,
                      _default_stream(hidden) if stream is None else stream_handle(stream))
        return out

    __call__ = forward

    def route(self, router_logits: Any, *, topk_ids: Any = None, topk_weights: Any = None,
              stream: Any = None) -> tuple[Any, Any]:
        """The layer's routing alone: (topk_ids int32 [T, k], topk_weights float32 [T, k]), written into the
        given tensors or new ones (torch / CuPy). forward(topk_ids=, topk_weights=) on them equals
        forward(router_logits=) bit for bit."""
        k = self.config.top_k
        if topk_ids is None:
            topk_ids = _empty_like(router_logits, (_shape0(router_logits), k), "int32")
        if topk_weights is None:
            topk_weights = _empty_like(router_logits, (_shape0(router_logits), k), "float32")
        self._impl.route(router_logits, topk_ids, topk_weights,
                         _default_stream(router_logits) if stream is None else stream_handle(stream))
        return topk_ids, topk_weights

    def check_routing(self) -> None:
        """Raises fp4moe.Error if an earlier forward got a top-k id outside [0, E) (other than -1), and
        clears the record. Reads host memory the GPU writes: no synchronization, so a call still queued
        on the GPU is not reflected yet."""
        e = self._impl.take_routing_error()
        if e:
            raise _ext.Error(e)

    def torch_op(self, hidden: Any, *, router_logits: Any = None, topk_ids: Any = None,
                 topk_weights: Any = None) -> Any:
        """forward() through the registered torch custom op torch.ops.fp4moe.moe_forward, which
        torch.compile traces as one opaque node (fp4moe.torch_ops)."""
        import torch  # noqa: PLC0415

        from . import torch_ops  # noqa: PLC0415

        torch_ops.register()
        return torch.ops.fp4moe.moe_forward(self.id, hidden, router_logits, topk_ids, topk_weights)

    def __repr__(self) -> str:
        c = self.config
        return (f"fp4moe.MoeLayer('{c.name}', H={c.hidden}, I={c.intermediate}, E={c.num_experts}, k={c.top_k}, "
                f"shared={c.num_shared}, router={c.router}, max_tokens={self.max_tokens}, device=cuda:{self.device})")


def load_moe_layer(checkpoint_dir: Any, layer: int, max_tokens: int, device: Any = None, *,
                   routed_only: bool = False) -> MoeLayer:
    """One MoE layer of a checkpoint as stored (ModelOpt NVFP4, compressed-tensors NVFP4 or gpt-oss
    MXFP4; sharded checkpoints through model.safetensors.index.json), uploaded and repacked once.

    layer: the decoder layer index (one whose MLP is an MoE block); routed_only: leave the shared expert
    out (the caller adds its own). The config (shapes, routing) comes from the checkpoint's config.json.
    """
    if isinstance(layer, bool) or not isinstance(layer, int):
        raise TypeError(f"layer: a {type(layer).__name__}; pass the decoder layer index as an int")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
        raise TypeError(f"max_tokens: a {type(max_tokens).__name__}; pass an int >= 1")
    if not _ext.gpu_available():
        raise ValueError("fp4moe.load_moe_layer needs a CUDA GPU and none is available to this process")
    dev = _resolve_device(device, {})
    obj = MoeLayer.__new__(MoeLayer)
    obj._adopt(_ext.Layer(os.fspath(checkpoint_dir), layer, max_tokens, dev, bool(routed_only)))
    return obj


def layer_by_id(layer_id: int) -> MoeLayer:
    layer = _layers.get(layer_id)
    if layer is None:
        raise ValueError(f"layer_id = {layer_id}: no live fp4moe.MoeLayer has this id")
    return layer


def _shape0(t: Any) -> int:
    shape = getattr(t, "shape", None)
    if shape is None or len(shape) < 1:
        raise TypeError(f"router_logits: a {type(t).__name__} without a shape; pass a [T, E] tensor")
    return int(shape[0])


def _empty_like(t: Any, shape: Optional[tuple] = None, dtype: Optional[str] = None) -> Any:
    torch = _torch()
    if torch is not None and isinstance(t, torch.Tensor):
        if shape is None:
            return torch.empty(t.shape, dtype=t.dtype, device=t.device)
        return torch.empty(shape, dtype=getattr(torch, dtype), device=t.device)
    if type(t).__module__.startswith("cupy"):
        import cupy  # noqa: PLC0415

        return cupy.empty(t.shape if shape is None else shape, dtype=t.dtype if dtype is None else dtype)
    raise TypeError(
        f"out: a {type(t).__name__} input; fp4moe allocates outputs only for torch and CuPy inputs, pass out=")
