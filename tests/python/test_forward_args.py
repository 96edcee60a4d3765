"""MoeLayer.forward's argument checks (fp4moe._ext._check_forward_args runs the same checks without a
layer or a GPU; device checks are left to the GPU tests). Every error names the argument."""
from __future__ import annotations

import numpy as np
import pytest

import fp4moe
from conftest import need_torch

check = fp4moe._ext._check_forward_args


def test_numpy_hidden_must_be_bf16():
    cfg = fp4moe.preset("tiny")
    with pytest.raises(TypeError, match="hidden: dtype float32"):
        check(cfg, 16, False, np.zeros((4, 256), np.float32), None, None, None, np.zeros((4, 256), np.float32))
    with pytest.raises(TypeError, match="hidden: a list is not a tensor"):
        check(cfg, 16, False, [[0.0]], None, None, None, None)
    with pytest.raises(ValueError, match="hidden is None"):
        check(cfg, 16, False, None, None, None, None, None)


def test_layer_and_stream_arguments_without_a_gpu():
    if fp4moe.gpu_available():
        pytest.skip("this process has a GPU; the no-GPU message is not reachable")
    with pytest.raises(ValueError, match="CUDA GPU"):
        fp4moe.MoeLayer("tiny", {"w13_weight": np.zeros((8, 256, 128), np.uint8)}, 16, device=0)


def test_python_side_errors():
    with pytest.raises(TypeError, match="weights: a list"):
        fp4moe.MoeLayer("tiny", [], 16, device=0)
    with pytest.raises(ValueError, match="device = 'cpu'"):
        fp4moe.MoeLayer("tiny", {}, 16, device="cpu")
    from fp4moe.layer import stream_handle

    assert stream_handle(0) == 0 and stream_handle(12345) == 12345

    class S:
        def __cuda_stream__(self):
            return (0, 777)

    class T:
        cuda_stream = 99

    assert stream_handle(S()) == 777 and stream_handle(T()) == 99
    with pytest.raises(ValueError, match="stream = -3"):
        stream_handle(-3)
    with pytest.raises(TypeError, match="stream: a str"):
        stream_handle("default")


def _t(torch, shape, dtype, **kw):
    return torch.zeros(shape, dtype=dtype, **kw)


def test_every_forward_check_with_torch_cpu_tensors():
    torch = need_torch()
    cfg = fp4moe.preset("tiny")  # H = 256, E = 8, k = 2
    bf, f32, i32 = torch.bfloat16, torch.float32, torch.int32
    h, out = _t(torch, (4, 256), bf), _t(torch, (4, 256), bf)
    logits, ids, w = _t(torch, (4, 8), f32), _t(torch, (4, 2), i32), _t(torch, (4, 2), f32)
    assert check(cfg, 16, False, h, logits, None, None, out) == 4
    assert check(cfg, 16, False, h, logits.to(bf), None, None, out) == 4
    assert check(cfg, 16, False, h, None, ids, w, out) == 4
    assert check(cfg, 16, True, h, None, None, None, out) == 4  # the router weight computes the logits
    assert check(cfg, 16, False, _t(torch, (0, 256), bf), logits[:0], None, None, out[:0]) == 0
    cases = [
        ((h.float(), logits, None, None, out), TypeError, "hidden: dtype float32"),
        ((h[:, :128], logits, None, None, out), ValueError, r"hidden: shape \(4, 128\) must be \(\*, 256\)"),
        ((_t(torch, (17, 256), bf), logits, None, None, out), ValueError, "hidden: T = 17 tokens exceeds max_tokens = 16"),
        ((_t(torch, (256, 4), bf).T, logits, None, None, out), ValueError, "hidden: strides"),
        ((h, logits, None, None, out.float()), TypeError, "out: dtype float32"),
        ((h, logits, None, None, out[:3]), ValueError, r"out: shape \(3, 256\) must be \(4, 256\)"),
        ((h, logits, None, None, _t(torch, (256, 4), bf).T), ValueError, "out: strides"),
        ((h, logits, None, None, None), ValueError, "out is None"),
        ((h, logits.double(), None, None, out), TypeError, "router_logits: dtype float64"),
        ((h, logits[:, :7], None, None, out), ValueError, r"router_logits: shape \(4, 7\) must be \(4, 8\)"),
        ((h, logits[:3], None, None, out), ValueError, "router_logits: shape"),
        ((h, _t(torch, (8, 4), f32).T, None, None, out), ValueError, "router_logits: strides"),
        ((h, None, None, None, out), ValueError, "router_logits is None and the layer has no router weight"),
        ((h, logits, ids, w, out), ValueError, "both given"),
        ((h, None, ids, None, out), ValueError, "topk_weights is None"),
        ((h, None, None, w, out), ValueError, "topk_ids is None"),
        ((h, None, ids.long(), w, out), TypeError, "topk_ids: dtype int64"),
        ((h, None, ids, w.to(bf), out), TypeError, "topk_weights: dtype bfloat16"),
        ((h, None, ids[:, :1], w, out), ValueError, r"topk_ids: shape \(4, 1\) must be \(4, 2\)"),
        ((h, None, ids, w[:2], out), ValueError, "topk_weights: shape"),
        ((h, None, _t(torch, (2, 4), i32).T, w, out), ValueError, "topk_ids: strides"),
        ((h, None, ids, "weights", out), TypeError, "topk_weights: a str is not a tensor"),
    ]
    for args, exc, pattern in cases:
        with pytest.raises(exc, match=pattern):
            check(cfg, 16, False, *args)
