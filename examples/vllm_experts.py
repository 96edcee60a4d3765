"""fp4moe in place of vLLM's expert kernel: the "experts" step of vLLM's modular fused-MoE kernel.

vLLM splits a fused MoE into [router] -> [prepare: quantize / dispatch] -> [experts: permute, GEMMs,
unpermute] -> [finalize: weight and reduce]. The experts step is a class (FusedMoEExpertsModular in
current vLLM, FusedMoEPermuteExpertsUnpermute before) whose

    apply(output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
          expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
          apply_router_weight_on_input)

writes the layer's output. Fp4moeExperts below implements it with one fp4moe call: the routing
(topk_ids, topk_weights) comes from vLLM's router and is used as given (vLLM's grouped top-k already
applied routed_scaling_factor where the model wants it: fp4moe does not apply it again), the weights
are multiplied and the top-k reduced inside fp4moe, so finalize has nothing left to do
(TopKWeightAndReduceNoOP). The fp4moe layer is built once from the FusedMoE layer's NVFP4 tensors as
loaded (w13_weight [E, 2I, H/2] = gate rows then up, w13_weight_scale [E, 2I, H/16] float8_e4m3fn
row-major, w13_weight_scale_2 [E, 2] or [E], w2_*), i.e. before a backend's process_weights_after_loading
swizzles scales or reorders rows for its own kernels. Shared experts stay outside (vLLM runs them apart).

The other methods vLLM asks of an experts class (the _supports_* checks, the activation format, the
workspace shapes) are shown for the current API; their exact set moves between vLLM releases, so this
class does not subclass vLLM's, and `python examples/vllm_experts.py` runs without vLLM: it builds a
layer on random NVFP4 weights laid out as vLLM holds them and calls apply() as vLLM's kernel would.
"""
from __future__ import annotations

import math

import torch

import fp4moe

try:  # only for the return values vLLM expects; the example runs without vLLM
    from vllm.model_executor.layers.fused_moe import modular_kernel as _mk
    from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import TopKWeightAndReduceNoOP
except ImportError:
    _mk = None
    TopKWeightAndReduceNoOP = None


class Fp4moeExperts:
    """vLLM's modular-kernel experts step on fp4moe (NVFP4 weights, bf16 activations, Hopper)."""

    def __init__(self, layer: fp4moe.MoeLayer):
        self.layer = layer

    @classmethod
    def from_vllm_layer(cls, fused_moe_layer: torch.nn.Module, hf_config: dict, max_num_tokens: int):
        """Builds the fp4moe layer from a vLLM FusedMoE layer's NVFP4 parameters (as loaded)."""
        cfg = fp4moe.config_from_hf(hf_config)
        cfg.num_shared = 0  # vLLM runs shared experts outside the fused-MoE kernel
        names = ("w13_weight", "w13_weight_scale", "w13_weight_scale_2", "w2_weight", "w2_weight_scale",
                 "w2_weight_scale_2", "w13_bias", "w2_bias")
        weights = {n: getattr(fused_moe_layer, n) for n in names if getattr(fused_moe_layer, n, None) is not None}
        bias = getattr(fused_moe_layer, "e_score_correction_bias", None)
        if bias is not None and cfg.router != "softmax":
            weights["router_bias"] = bias
        return cls(fp4moe.MoeLayer(cfg, weights, max_tokens=max_num_tokens))

    # ---- what vLLM's kernel selection asks ----
    @staticmethod
    def activation_format():
        return _mk.FusedMoEActivationFormat.Standard if _mk else "standard"  # [M, K] activations, not batched

    @staticmethod
    def _supports_current_device() -> bool:
        return fp4moe.gpu_available() and torch.cuda.get_device_capability() == (9, 0)

    @staticmethod
    def supports_expert_map() -> bool:
        return True  # remote experts become id -1, which fp4moe skips

    @staticmethod
    def supports_chunking() -> bool:
        return True  # any M <= max_tokens per call

    def workspace_shapes(self, M, N, K, topk, global_num_experts, local_num_experts, expert_tokens_meta,
                         activation=None):
        # fp4moe owns its workspace (one per layer, allocated at construction): none from vLLM.
        return (0,), (0,), (M, K)

    def finalize_weight_and_reduce_impl(self):
        return TopKWeightAndReduceNoOP() if TopKWeightAndReduceNoOP else None  # already weighted and reduced

    # ---- the call ----
    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
              expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
              apply_router_weight_on_input):
        if apply_router_weight_on_input:
            raise ValueError("fp4moe applies the routing weight after the down projection; "
                             "apply_router_weight_on_input=True is not supported")
        if a1q_scale is not None:
            raise ValueError("fp4moe takes bf16 activations; configure vLLM not to quantize them for this kernel")
        act = str(getattr(activation, "value", activation)).lower()
        if "silu" not in act and "swiglu" not in act:
            raise ValueError(f"activation {activation}: fp4moe computes SwiGLU")
        if expert_map is not None:  # expert parallel: global ids -> this rank's experts, -1 = elsewhere
            topk_ids = expert_map[topk_ids.long()]
        if topk_ids.dtype != torch.int32:  # vLLM's routers emit int32 by default; this is a fallback
            topk_ids = topk_ids.to(torch.int32)
        if topk_weights.dtype != torch.float32:
            topk_weights = topk_weights.float()
        self.layer.forward(hidden_states, topk_ids=topk_ids, topk_weights=topk_weights, out=output)
        return None


def _random_vllm_nvfp4_weights(E, H, I, device="cuda"):
    """Random NVFP4 tensors with vLLM's ModelOpt names, shapes and dtypes."""
    g = torch.Generator(device=device).manual_seed(0)

    def fp4(n, k):
        codes = torch.randint(0, 256, (E, n, k // 2), generator=g, device=device, dtype=torch.uint8)
        scales = torch.randint(0x30, 0x40, (E, n, k // 16), generator=g, device=device, dtype=torch.uint8)
        return codes, scales.view(torch.float8_e4m3fn)

    w13, s13 = fp4(2 * I, H)
    w2, s2 = fp4(H, I)
    return dict(w13_weight=w13, w13_weight_scale=s13,
                w13_weight_scale_2=torch.full((E, 2), 1 / (6 * math.sqrt(H)), device=device),  # w1, w3 shards
                w2_weight=w2, w2_weight_scale=s2, w2_weight_scale_2=torch.full((E,), 1 / (6 * math.sqrt(I)), device=device))


if __name__ == "__main__":
    hf_config = {"model_type": "qwen3_moe", "hidden_size": 2048, "moe_intermediate_size": 768, "num_experts": 128,
                 "num_experts_per_tok": 8, "norm_topk_prob": True}
    module = torch.nn.Module()  # stands in for vLLM's FusedMoE layer: the same parameter names
    for name, t in _random_vllm_nvfp4_weights(128, 2048, 768).items():
        module.register_parameter(name, torch.nn.Parameter(t, requires_grad=False))
    experts = Fp4moeExperts.from_vllm_layer(module, hf_config, max_num_tokens=256)

    M = 16
    hidden_states = torch.randn(M, 2048, device="cuda").bfloat16()
    router_logits = torch.randn(M, 128, device="cuda")
    topk_weights, topk_ids = torch.softmax(router_logits, -1).topk(8, dim=-1)   # vLLM's fused_topk
    topk_weights = topk_weights / topk_weights.sum(-1, keepdim=True)
    topk_ids = topk_ids.to(torch.int32)
    output = torch.empty_like(hidden_states)
    experts.apply(output, hidden_states, module.w13_weight, module.w2_weight, topk_weights, topk_ids, "silu", 128,
                  None, None, None, None, None, None, False)
    same = experts.layer.forward(hidden_states, router_logits=router_logits)
    torch.cuda.synchronize()
    print("apply() == fp4moe's own router:", torch.allclose(output.float(), same.float(), rtol=1e-2, atol=1e-2))
