"""The torch custom ops' registration and fake (meta) implementations: torch.compile-style tracing
through them needs no GPU (skips without torch)."""
from __future__ import annotations

import re

from conftest import need_torch


def test_ops_are_registered_with_fake_implementations():
    torch = need_torch()
    import fp4moe.torch_ops  # noqa: F401

    h = torch.empty(4, 256, dtype=torch.bfloat16, device="meta")
    ids = torch.empty(4, 2, dtype=torch.int32, device="meta")
    w = torch.empty(4, 2, dtype=torch.float32, device="meta")
    out = torch.ops.fp4moe.moe_forward(0, h, None, ids, w)
    assert out.shape == (4, 256) and out.dtype == torch.bfloat16 and out.device.type == "meta"
    schema = str(torch.ops.fp4moe.moe_forward_out.default._schema)
    assert re.search(r"Tensor\(a\d*!\) out", schema), schema  # declared as mutating its out argument


def test_tracing_with_fake_tensors_keeps_one_opaque_node():
    torch = need_torch()
    import fp4moe.torch_ops  # noqa: F401
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(h, ids, w):
        return torch.ops.fp4moe.moe_forward(7, h * 2, None, ids, w) + 1

    args = (torch.zeros(3, 256, dtype=torch.bfloat16), torch.zeros(3, 2, dtype=torch.int32), torch.zeros(3, 2))
    gm = make_fx(f, tracing_mode="fake")(*args)
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and "fp4moe" in str(n.target)]
    assert len(calls) == 1 and calls[0].args[0] == 7
