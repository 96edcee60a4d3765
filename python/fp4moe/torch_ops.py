"""torch custom ops around MoeLayer.forward, so that torch.compile traces through a layer call.

    torch.ops.fp4moe.moe_forward(layer_id, hidden, router_logits, topk_ids, topk_weights) -> Tensor
    torch.ops.fp4moe.moe_forward_out(layer_id, hidden, router_logits, topk_ids, topk_weights, out) -> ()

layer_id is MoeLayer.id (layer.torch_op(...) passes it). The fake (meta) implementations only
describe the output, [T, H] bf16 like hidden, so FakeTensor tracing never touches the GPU. Registered
on import of this module (fp4moe's __init__ imports it when torch is already imported, and MoeLayer
when torch is imported later); importing torch is this module's business only.
"""
from __future__ import annotations

from typing import Optional

import torch

from .layer import layer_by_id

_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    _registered = True

    @torch.library.custom_op("fp4moe::moe_forward", mutates_args=())
    def moe_forward(layer_id: int, hidden: torch.Tensor, router_logits: Optional[torch.Tensor],
                    topk_ids: Optional[torch.Tensor], topk_weights: Optional[torch.Tensor]) -> torch.Tensor:
        out = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device)
        layer_by_id(layer_id).forward(hidden, router_logits=router_logits, topk_ids=topk_ids,
                                      topk_weights=topk_weights, out=out)
        return out

    @moe_forward.register_fake
    def _moe_forward_fake(layer_id, hidden, router_logits, topk_ids, topk_weights):
        return torch.empty_like(hidden)

    @torch.library.custom_op("fp4moe::moe_forward_out", mutates_args=("out",))
    def moe_forward_out(layer_id: int, hidden: torch.Tensor, router_logits: Optional[torch.Tensor],
                        topk_ids: Optional[torch.Tensor], topk_weights: Optional[torch.Tensor],
                        out: torch.Tensor) -> None:
        layer_by_id(layer_id).forward(hidden, router_logits=router_logits, topk_ids=topk_ids,
                                      topk_weights=topk_weights, out=out)

    @moe_forward_out.register_fake
    def _moe_forward_out_fake(layer_id, hidden, router_logits, topk_ids, topk_weights, out):
        return None


register()
