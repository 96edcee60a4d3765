"""End to end with torch: a bf16 MoE layer's expert weights quantized to NVFP4, then run by fp4moe.

    python examples/torch_moe_layer.py          # needs an sm_90 GPU (H100 / H200) and torch

1. dense bf16 experts (here random; in practice a model's weights) -> fp4moe.quantize_nvfp4 on the CPU,
   ModelOpt's recipe, gate and up sharing one global scale per expert -> the tensors an engine holds;
2. fp4moe.MoeLayer repacks them once on the GPU;
3. forward with the engine's routing (top-k ids and weights) or with router logits, on torch's current
   stream, inside a CUDA graph, through torch.compile;
4. compared with the bf16 layer computed by torch.
"""
import torch

import fp4moe
import fp4moe.torch_ops  # noqa: F401  (registers torch.ops.fp4moe.*)

torch.manual_seed(0)
dev = "cuda"
cfg = fp4moe.make_config({"hidden": 1024, "intermediate": 512, "num_experts": 16, "top_k": 4,
                          "router": "softmax", "name": "example"})
E, H, I, k = cfg.num_experts, cfg.hidden, cfg.intermediate, cfg.top_k

# ---- 1. dense experts -> NVFP4 (checkpoint layout: w13 = [gate; up], scales row-major) ----
gate = torch.randn(E, I, H) / H**0.5
up = torch.randn(E, I, H) / H**0.5
down = torch.randn(E, H, I) / I**0.5
w13, s13, g13, w2, s2, g2 = [], [], [], [], [], []
for e in range(E):
    gate_up = torch.cat([gate[e], up[e]])                        # [2I, H]
    codes, scales, g = fp4moe.quantize_nvfp4(gate_up)             # one global scale for gate and up
    w13.append(torch.from_numpy(codes)), s13.append(torch.from_numpy(scales)), g13.append(g)
    codes, scales, g = fp4moe.quantize_nvfp4(down[e])
    w2.append(torch.from_numpy(codes)), s2.append(torch.from_numpy(scales)), g2.append(g)
weights = {
    "w13_weight": torch.stack(w13).to(dev),                                          # uint8 [E, 2I, H/2]
    "w13_weight_scale": torch.stack(s13).view(torch.float8_e4m3fn).to(dev),          # [E, 2I, H/16]
    "w13_weight_scale_2": torch.tensor(g13, device=dev),                             # float32 [E]
    "w2_weight": torch.stack(w2).to(dev),                                            # uint8 [E, H, I/2]
    "w2_weight_scale": torch.stack(s2).view(torch.float8_e4m3fn).to(dev),            # [E, H, I/16]
    "w2_weight_scale_2": torch.tensor(g2, device=dev),                               # float32 [E]
}

# ---- 2. the layer (repacks once; the dict may be dropped afterwards) ----
T = 32
layer = fp4moe.MoeLayer(cfg, weights, max_tokens=T)
print(layer)

# ---- 3. forward ----
hidden = torch.randn(T, H, device=dev).bfloat16()
router_logits = torch.randn(T, E, device=dev)
# the engine's routing: softmax top-k, renormalized (as vLLM's fused_topk computes it)
topk_weights, topk_ids = torch.softmax(router_logits, -1).topk(k, dim=-1)
topk_weights = topk_weights / topk_weights.sum(-1, keepdim=True)
topk_ids = topk_ids.to(torch.int32)

out = layer.forward(hidden, topk_ids=topk_ids, topk_weights=topk_weights)    # routing given, used as is
out_logits = layer.forward(hidden, router_logits=router_logits)              # fp4moe's router

static_out = torch.empty_like(hidden)
layer.forward(hidden, topk_ids=topk_ids, topk_weights=topk_weights, out=static_out)   # warm-up
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):                                                # nothing allocated, no sync
    layer.forward(hidden, topk_ids=topk_ids, topk_weights=topk_weights, out=static_out)
graph.replay()

layer_id = layer.id  # torch.ops.fp4moe.* name the layer by this id
compiled = torch.compile(lambda x, i, w: torch.ops.fp4moe.moe_forward(layer_id, x, None, i, w), fullgraph=True)
out_compiled = compiled(hidden, topk_ids, topk_weights)

# ---- 4. the bf16 layer in torch ----
def bf16_layer(x):
    y = torch.zeros(T, H, device=dev)
    for t in range(T):
        for s in range(k):
            e = topk_ids[t, s].item()
            g = x[t].float() @ gate[e].to(dev).T
            u = x[t].float() @ up[e].to(dev).T
            y[t] += topk_weights[t, s] * ((torch.nn.functional.silu(g) * u) @ down[e].to(dev).T)
    return y

ref = bf16_layer(hidden)
rel = lambda a: ((a.float() - ref).norm() / ref.norm()).item()  # noqa: E731
torch.cuda.synchronize()
print(f"NVFP4 vs bf16 weights, relative L2 error: {rel(out):.4f} (4-bit weights: ~0.1 expected)")
print("routing given == logits given:", torch.allclose(out.float(), out_logits.float(), rtol=0.02, atol=0.02))
print("graph replay == eager:", torch.equal(static_out, out), "| compiled == eager:", torch.equal(out_compiled, out))
