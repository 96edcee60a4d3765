"""fp4moe.MoeLayer on the GPU against an independent oracle written in torch.

The oracle shares no code with fp4moe: it dequantizes the NVFP4 weights with a 16-entry E2M1 table and
torch's own float8_e4m3fn conversion, routes with torch ops (softmax top-k, sigmoid + bias with grouped
top-k, gpt-oss), and runs the experts as float32 matmuls. It rounds to bf16 where the layer stores bf16
(the activation, each (token, slot) output, the final sum), so the two differ only where a float32
accumulation order lands an intermediate on the other side of a bf16 rounding boundary: the bound
below, relative L2 error < 5e-3, is ~20x what that costs and still catches a dropped slot (>= 1/k of
the signal), a wrong scale, a swapped gate/up or a wrong expert.

Weights are synthetic and seeded: random E2M1 bytes, random E4M3 block scales in [0.5, 3.75], global
scales that keep every GEMM output O(1); logits are drawn so that no token has a near-tie in its
selection (the oracle resamples such tokens), so the oracle's experts are the layer's.
Every test skips (visibly) without torch or a CUDA GPU.
"""
from __future__ import annotations

import math
import os

import pytest

import fp4moe
from conftest import need_gpu

REL_L2 = 5e-3
PRESETS = sorted(fp4moe.preset_names())


# ------------------------------------------------------------------------------------------------
# synthetic weights
# ------------------------------------------------------------------------------------------------

def _e4m3_bytes(torch, shape, gen, device):
    # exponent field 6..8 (2^-1 .. 2^1) with any mantissa: scales 0.5 .. 3.75
    e = torch.randint(6, 9, shape, generator=gen, device=device, dtype=torch.int32)
    m = torch.randint(0, 8, shape, generator=gen, device=device, dtype=torch.int32)
    return ((e << 3) | m).to(torch.uint8).view(torch.float8_e4m3fn)


def _nvfp4(torch, rows, k, experts, gen, device):
    codes = torch.randint(0, 256, (*experts, rows, k // 2), generator=gen, device=device, dtype=torch.uint8)
    scales = _e4m3_bytes(torch, (*experts, rows, k // 16), gen, device)
    # |e2m1| rms ~2.9, scale rms ~2 -> weight rms ~6 * global; aim at 1 / sqrt(k)
    g = 1.0 / (6.0 * math.sqrt(k))
    return codes, scales, g


def make_weights(torch, cfg, seed, device="cuda", separate_up_scale=False, router_weight=False):
    gen = torch.Generator(device=device).manual_seed(seed)
    E, H, I, Is = cfg.num_experts, cfg.hidden, cfg.intermediate, cfg.intermediate * cfg.num_shared
    w = {}
    c13, s13, g13 = _nvfp4(torch, 2 * I, H, (E,), gen, device)
    c2, s2, g2 = _nvfp4(torch, H, I, (E,), gen, device)
    jitter = lambda n: 1.0 + 0.25 * torch.rand(n, generator=gen, device=device)  # noqa: E731
    w["w13_weight"], w["w13_weight_scale"] = c13, s13
    if separate_up_scale:
        w["w13_weight_scale_2"] = torch.stack([g13 * jitter(E), 0.8 * g13 * jitter(E)], dim=1)  # [E, 2]
    else:
        w["w13_weight_scale_2"] = g13 * jitter(E)
    w["w2_weight"], w["w2_weight_scale"], w["w2_weight_scale_2"] = c2, s2, g2 * jitter(E)
    if cfg.router != "softmax":
        w["router_bias"] = 0.1 * torch.randn(E, generator=gen, device=device)
    if cfg.expert_bias:
        w["w13_bias"] = (0.1 * torch.randn(E, 2 * I, generator=gen, device=device)).bfloat16()  # as checkpoints
        w["w2_bias"] = (0.1 * torch.randn(E, H, generator=gen, device=device)).bfloat16()
    if cfg.num_shared:
        a, b, ga = _nvfp4(torch, 2 * Is, H, (), gen, device)
        c, d, gc = _nvfp4(torch, H, Is, (), gen, device)
        w.update(shared_w13_weight=a, shared_w13_weight_scale=b, shared_w13_weight_scale_2=torch.tensor(ga, device=device),
                 shared_w2_weight=c, shared_w2_weight_scale=d, shared_w2_weight_scale_2=torch.tensor([gc], device=device))
        if cfg.expert_bias:
            w["shared_w13_bias"] = 0.1 * torch.randn(2 * Is, generator=gen, device=device)
            w["shared_w2_bias"] = 0.1 * torch.randn(H, generator=gen, device=device)
    if router_weight:
        w["router_weight"] = (torch.randn(E, H, generator=gen, device=device) / math.sqrt(H)).bfloat16()
    return w


# ------------------------------------------------------------------------------------------------
# the oracle
# ------------------------------------------------------------------------------------------------

def dequant(torch, codes, scales, g):
    """codes uint8 [..., N, K/2], scales float8_e4m3fn [..., N, K/16], g: scalar or [...] -> float32 [..., N, K]"""
    lut = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], device=codes.device)
    lo, hi = (codes & 15).long(), (codes >> 4).long()
    v = torch.stack([lut[lo], lut[hi]], dim=-1).flatten(-2)
    s = scales.float().repeat_interleave(16, dim=-1)
    g = torch.as_tensor(g, dtype=torch.float32, device=codes.device)
    return v * s * g.reshape(g.shape + (1, 1))


def route_oracle(torch, cfg, logits, bias):
    """ids [T, k] int32, weights [T, k] fp32, and the selection margin of each token (the gap between its
    k-th and (k+1)-th selection scores, and between kept and dropped groups)."""
    k, E = cfg.top_k, cfg.num_experts
    if cfg.router == "softmax":
        sel = logits
        val = torch.softmax(logits, dim=-1)
    elif cfg.router == "sigmoid_grouped":
        val = torch.sigmoid(logits)
        sel = val + bias
    else:
        sel = logits + bias
        val = sel
    margin = torch.full((logits.shape[0],), float("inf"), device=logits.device)
    masked = sel
    if cfg.router == "sigmoid_grouped" and cfg.n_group > 1:
        gs = sel.view(-1, cfg.n_group, E // cfg.n_group).topk(2, dim=-1).values.sum(-1)  # [T, G]
        top = gs.topk(cfg.topk_group + 1, dim=-1).values
        margin = torch.minimum(margin, top[:, cfg.topk_group - 1] - top[:, cfg.topk_group])
        keep = torch.zeros_like(gs, dtype=torch.bool).scatter_(1, gs.topk(cfg.topk_group, dim=-1).indices, True)
        masked = sel.masked_fill(~keep.repeat_interleave(E // cfg.n_group, dim=1), float("-inf"))
    top = masked.topk(k + 1 if k < E else k, dim=-1)
    ids = top.indices[:, :k]
    if k < E:
        margin = torch.minimum(margin, top.values[:, k - 1] - top.values[:, k])
    w = val.gather(1, ids)
    if cfg.router == "gpt_oss":
        w = torch.softmax(w, dim=-1)
    elif cfg.renormalize:
        w = w / w.sum(-1, keepdim=True)
    w = w * cfg.routed_scaling
    return ids.int(), w.float(), margin


def expert_oracle(torch, cfg, x, codes13, scales13, g13, g13_up, b13, codes2, scales2, g2, b2):
    """x [n, H] float32 (bf16-valued) -> [n, H] float32 before the routing weight."""
    w13 = dequant(torch, codes13, scales13, g13)
    n_half = w13.shape[0] // 2
    if g13_up is not None:
        w13[n_half:] *= g13_up / g13
    h = x @ w13.T
    if b13 is not None:
        h = h + b13.float()
    gate, up = h[:, :n_half], h[:, n_half:]
    if cfg.activation == "swiglu":
        a = torch.nn.functional.silu(gate) * up
    else:
        lim = cfg.swiglu_limit
        gate = gate.clamp(max=lim)
        up = up.clamp(-lim, lim)
        a = (up + 1) * gate * torch.sigmoid(cfg.swiglu_alpha * gate)
    a = a.bfloat16().float()  # the layer stores the activation in bf16
    y = a @ dequant(torch, codes2, scales2, g2).T
    if b2 is not None:
        y = y + b2.float()
    return y


def moe_oracle(torch, cfg, w, hidden, ids, weights):
    T, H = hidden.shape
    x = hidden.float()
    out = torch.zeros(T, H, device=hidden.device)
    g13 = w["w13_weight_scale_2"]
    g13_gate = g13[:, 0] if g13.dim() == 2 else g13
    g13_up = g13[:, 1] if g13.dim() == 2 else None
    contrib = torch.zeros(T, cfg.top_k, H, device=hidden.device)
    for e in ids.unique().tolist():
        if e < 0 or e >= cfg.num_experts:
            continue
        t, s = (ids == e).nonzero(as_tuple=True)
        y = expert_oracle(torch, cfg, x[t], w["w13_weight"][e], w["w13_weight_scale"][e], g13_gate[e],
                          None if g13_up is None else g13_up[e], w["w13_bias"][e] if cfg.expert_bias else None,
                          w["w2_weight"][e], w["w2_weight_scale"][e], w["w2_weight_scale_2"][e],
                          w["w2_bias"][e] if cfg.expert_bias else None)
        contrib[t, s] = (y * weights[t, s, None]).bfloat16().float()  # bf16 per (token, slot)
    for s in range(cfg.top_k):  # fp32 sum in slot order
        out += contrib[:, s]
    if cfg.num_shared:
        gs = w["shared_w13_weight_scale_2"].reshape(-1)
        y = expert_oracle(torch, cfg, x, w["shared_w13_weight"], w["shared_w13_weight_scale"], gs[0],
                          gs[1] if gs.numel() == 2 else None, w.get("shared_w13_bias"), w["shared_w2_weight"],
                          w["shared_w2_weight_scale"], w["shared_w2_weight_scale_2"].reshape(()),
                          w.get("shared_w2_bias"))
        out += y.bfloat16().float()
    return out.bfloat16()


def inputs(torch, cfg, w, T, seed, min_margin=1e-4):
    """hidden [T, H] bf16 and logits [T, E] fp32 whose oracle routing has no near-tie."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    bias = w.get("router_bias")
    keep_h, keep_l = [], []
    n = 0
    while n < T:
        logits = 2.0 * torch.randn(4 * T + 16, cfg.num_experts, generator=gen, device="cuda")
        _, _, margin = route_oracle(torch, cfg, logits, bias)
        good = logits[margin > min_margin][: T - n]
        keep_l.append(good)
        n += good.shape[0]
    logits = torch.cat(keep_l)
    hidden = torch.randn(T, cfg.hidden, generator=gen, device="cuda").bfloat16()
    return hidden, logits


def rel_l2(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def free(torch):
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------
# tests
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_matches_the_torch_oracle(name):
    torch = need_gpu()
    # gpt-oss's preset is MXFP4 (its checkpoints are); the tensor API takes NVFP4 weights, so its shapes
    # and activation run here as NVFP4.
    cfg = fp4moe.make_config({"preset": name, "format": "nvfp4"}) if fp4moe.preset(name).format == "mxfp4" \
        else fp4moe.preset(name)
    w = make_weights(torch, cfg, seed=1 + PRESETS.index(name), separate_up_scale=(name == "gpt-oss-120b"))
    layer = fp4moe.MoeLayer(cfg, w, max_tokens=64)
    for T in (1, 5, 64):
        hidden, logits = inputs(torch, cfg, w, T, seed=T)
        ids, weights, _ = route_oracle(torch, cfg, logits, w.get("router_bias"))
        ref = moe_oracle(torch, cfg, w, hidden, ids, weights)
        assert ref.float().abs().mean() > 0.05, "the oracle output is degenerate"
        out = layer.forward(hidden, router_logits=logits)
        assert out.dtype == torch.bfloat16 and out.shape == hidden.shape
        assert rel_l2(out, ref) < REL_L2, (name, T, "logits path", rel_l2(out, ref))
        out2 = layer.forward(hidden, topk_ids=ids, topk_weights=weights)
        assert rel_l2(out2, ref) < REL_L2, (name, T, "routing given", rel_l2(out2, ref))
        # the layer's own routing: the oracle's experts, weights within float rounding
        lids, lw = layer.route(logits)
        assert torch.equal(lids, ids), (name, T)
        torch.testing.assert_close(lw, weights, rtol=2e-6, atol=1e-7)
        # routing given == logits given, bit for bit, for the same ids and weights
        assert torch.equal(layer.forward(hidden, topk_ids=lids, topk_weights=lw), out)
        # bf16 logits: the router on their float32 values
        out_bf = layer.forward(hidden, router_logits=logits.bfloat16())
        assert torch.equal(out_bf, layer.forward(hidden, router_logits=logits.bfloat16().float()))
    layer.check_routing()
    del layer, w
    free(torch)


@pytest.mark.parametrize("intermediate,num_shared", [(96, 0), (80, 1), (720, 1)])
def test_tensor_parallel_widths_match_the_torch_oracle(intermediate, num_shared):
    """An intermediate size that is a multiple of 16 but not of 64 (a tensor-parallel slice): the layer
    zero-pads the experts to the next multiple of 64 and must still equal the oracle on the given width."""
    torch = need_gpu()
    cfg = fp4moe.make_config({"preset": "tiny", "intermediate": intermediate, "num_shared": num_shared})
    w = make_weights(torch, cfg, seed=intermediate)
    layer = fp4moe.MoeLayer(cfg, w, max_tokens=64)
    for T in (1, 7, 64):
        hidden, logits = inputs(torch, cfg, w, T, seed=T)
        ids, weights, _ = route_oracle(torch, cfg, logits, w.get("router_bias"))
        ref = moe_oracle(torch, cfg, w, hidden, ids, weights)
        assert ref.float().abs().mean() > 0.05, "the oracle output is degenerate"
        out = layer.forward(hidden, topk_ids=ids, topk_weights=weights)
        assert rel_l2(out, ref) < REL_L2, (intermediate, num_shared, T, rel_l2(out, ref))
    del layer, w
    free(torch)


@pytest.mark.parametrize("T", [300, 2100])
def test_large_batches_match_the_oracle(T):
    """T * k > 4096 takes the multi-kernel permutation; T = 300 the one-launch one with many blocks."""
    torch = need_gpu()
    cfg = fp4moe.preset("tiny")
    w = make_weights(torch, cfg, seed=11)
    layer = fp4moe.MoeLayer("tiny", w, max_tokens=T)
    hidden, logits = inputs(torch, cfg, w, T, seed=12)
    ids, weights, _ = route_oracle(torch, cfg, logits, w["router_bias"])
    ref = moe_oracle(torch, cfg, w, hidden, ids, weights)
    assert rel_l2(layer.forward(hidden, router_logits=logits), ref) < REL_L2
    assert rel_l2(layer.forward(hidden, topk_ids=ids, topk_weights=weights), ref) < REL_L2


def test_engine_routing_with_skewed_and_empty_experts():
    """All tokens on two experts (every other expert empty), weights not normalized: used as given."""
    torch = need_gpu()
    cfg = fp4moe.make_config({"preset": "qwen3-30b"})
    w = make_weights(torch, cfg, seed=5)
    layer = fp4moe.MoeLayer(cfg, w, max_tokens=40)
    hidden = torch.randn(40, cfg.hidden, device="cuda").bfloat16()
    ids = torch.tensor([[3, 77] + [3 + s for s in range(1, 7)]] * 40, device="cuda", dtype=torch.int32)
    ids[:, 1] = 77
    weights = torch.rand(40, 8, device="cuda") * 3  # used as given: no renormalization, no scaling
    ref = moe_oracle(torch, cfg, w, hidden, ids, weights)
    assert rel_l2(layer.forward(hidden, topk_ids=ids, topk_weights=weights), ref) < REL_L2


def test_routed_scaling_is_applied_once():
    """The layer's router multiplies by routed_scaling (2.5 for GLM-5); given weights are used as-is."""
    torch = need_gpu()
    cfg = fp4moe.preset("tiny")  # routed_scaling 2.5
    w = make_weights(torch, cfg, seed=8)
    layer = fp4moe.MoeLayer("tiny", w, max_tokens=8)
    hidden, logits = inputs(torch, cfg, w, 8, seed=9)
    ids, weights = layer.route(logits)
    assert torch.allclose(weights.sum(-1), torch.full((8,), 2.5, device="cuda"), rtol=1e-5)
    a = layer.forward(hidden, router_logits=logits)
    b = layer.forward(hidden, topk_ids=ids, topk_weights=weights)
    c = layer.forward(hidden, topk_ids=ids, topk_weights=weights / 2.5)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_router_weight_computes_the_logits():
    torch = need_gpu()
    cfg = fp4moe.preset("tiny")
    w = make_weights(torch, cfg, seed=21, router_weight=True)
    layer = fp4moe.MoeLayer("tiny", w, max_tokens=16)
    assert layer.has_router_weight
    hidden = torch.randn(16, cfg.hidden, device="cuda").bfloat16()
    logits = hidden.float() @ w["router_weight"].float().T
    out = layer.forward(hidden)
    ids, weights, margin = route_oracle(torch, cfg, logits, w["router_bias"])
    ok = margin > 1e-3  # tokens whose routing is unambiguous
    ref = moe_oracle(torch, cfg, w, hidden, ids, weights)
    assert ok.sum() >= 4
    assert rel_l2(out[ok], ref[ok]) < REL_L2


def test_cuda_graph_replay_equals_eager():
    torch = need_gpu()
    cfg = fp4moe.preset("glm-5")
    w = make_weights(torch, cfg, seed=31)
    layer = fp4moe.MoeLayer("glm-5", w, max_tokens=32)
    del w
    hidden, logits = inputs(torch, cfg, {"router_bias": torch.zeros(cfg.num_experts, device="cuda")}, 32, seed=32)
    ids, weights = layer.route(logits)
    static = {"h": hidden.clone(), "l": logits.clone(), "i": ids.clone(), "w": weights.clone()}
    out_logits = torch.empty_like(hidden)
    out_routed = torch.empty_like(hidden)
    layer.forward(static["h"], router_logits=static["l"], out=out_logits)  # warm-up outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        layer.forward(static["h"], router_logits=static["l"], out=out_logits)
        layer.forward(static["h"], topk_ids=static["i"], topk_weights=static["w"], out=out_routed)
    for rep in range(3):
        h2, l2 = inputs(torch, cfg, {"router_bias": torch.zeros(cfg.num_experts, device="cuda")}, 32, seed=40 + rep)
        i2, w2 = layer.route(l2)
        static["h"].copy_(h2), static["l"].copy_(l2), static["i"].copy_(i2), static["w"].copy_(w2)
        out_logits.fill_(float("nan")), out_routed.fill_(float("nan"))
        g.replay()
        eager = layer.forward(h2, router_logits=l2)
        assert torch.equal(out_logits, eager), rep
        assert torch.equal(out_routed, eager), rep


def test_torch_stream_is_used_and_nothing_synchronizes():
    torch = need_gpu()
    cfg = fp4moe.preset("tiny")
    w = make_weights(torch, cfg, seed=51)
    layer = fp4moe.MoeLayer("tiny", w, max_tokens=64)
    hidden, logits = inputs(torch, cfg, w, 64, seed=52)
    ids, weights = layer.route(logits)
    expect = layer.forward(hidden, router_logits=logits)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.stream(side):
            torch.cuda._sleep(50_000_000)  # ~tens of ms of GPU time queued ahead on the side stream
            h = hidden * 1  # produced on the side stream: a kernel on another stream would race with it
            a = layer.forward(h, router_logits=logits)
            b = layer.forward(h, topk_ids=ids, topk_weights=weights)
            i2, w2 = layer.route(logits)
            c = torch.empty_like(h)
            layer.forward(h, router_logits=logits.bfloat16(), out=c)
            ev = torch.cuda.Event()
            ev.record(side)
        # The default stream did not wait for the side stream: the work is still queued there.
        assert not ev.query(), "forward ran (or waited) outside the side stream"
    finally:
        torch.cuda.set_sync_debug_mode(0)
    side.synchronize()
    assert torch.equal(a, expect) and torch.equal(b, expect)
    assert torch.equal(i2, ids) and torch.equal(w2, weights)
    # an explicit stream argument: int, __cuda_stream__ objects, torch streams
    s2 = torch.cuda.Stream()
    for st in (s2, s2.cuda_stream):
        out = torch.full_like(hidden, float("nan"))
        s2.wait_stream(torch.cuda.current_stream())
        layer.forward(hidden, router_logits=logits, out=out, stream=st)
        s2.synchronize()
        assert torch.equal(out, expect)


def test_graph_captured_on_a_side_stream_with_an_explicit_stream():
    torch = need_gpu()
    cfg = fp4moe.preset("tiny")
    w = make_weights(torch, cfg, seed=61)
    layer = fp4moe.MoeLayer("tiny", w, max_tokens=16)
    hidden, logits = inputs(torch, cfg, w, 16, seed=62)
    expect = layer.forward(hidden, router_logits=logits)
    out = torch.empty_like(hidden)
    s = torch.cuda.Stream()
    g = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(g, stream=s):
        layer.forward(hidden, router_logits=logits, out=out, stream=s)
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expect)


def test_bad_ids_never_crash_and_are_reported():
    torch = need_gpu()
    cfg = fp4moe.preset("tiny")  # E = 8, k = 2
    w = make_weights(torch, cfg, seed=71)
    layer = fp4moe.MoeLayer("tiny", w, max_tokens=8)
    hidden, logits = inputs(torch, cfg, w, 8, seed=72)
    ids, weights = layer.route(logits)
    skip = ids.clone()
    skip[2, 0] = -1  # expert-parallel "not on this rank": skipped silently
    dropped = weights.clone()
    dropped[2, 0] = 0
    expect = moe_oracle(torch, cfg, w, hidden, ids, dropped)
    out = layer.forward(hidden, topk_ids=skip, topk_weights=weights)
    assert rel_l2(out, expect) < REL_L2
    torch.cuda.synchronize()
    layer.check_routing()  # -1 is not an error
    bad = skip.clone()
    bad[5, 1] = 8
    bad[6, 0] = 1 << 30
    out = layer.forward(hidden, topk_ids=bad, topk_weights=weights)
    torch.cuda.synchronize()
    dropped[5, 1] = dropped[6, 0] = 0
    assert rel_l2(out, moe_oracle(torch, cfg, w, hidden, ids, dropped)) < REL_L2
    with pytest.raises(fp4moe.Error, match=r"topk_ids\[(5, 1\] = 8|6, 0\] = 1073741824)"):
        layer.forward(hidden, router_logits=logits)
    layer.forward(hidden, router_logits=logits)  # reported once
    layer.forward(hidden, topk_ids=bad, topk_weights=weights)
    torch.cuda.synchronize()
    with pytest.raises(fp4moe.Error, match="outside"):
        layer.check_routing()
    layer.check_routing()


def test_bad_arguments_raise_naming_them():
    torch = need_gpu()
    cfg = fp4moe.preset("tiny")
    w = make_weights(torch, cfg, seed=81)
    layer = fp4moe.MoeLayer("tiny", w, max_tokens=8)
    h = torch.randn(4, 256, device="cuda").bfloat16()
    logits = torch.randn(4, 8, device="cuda")
    cases = [
        (lambda: layer.forward(h.cpu(), router_logits=logits), ValueError, "hidden: on cpu, but the layer runs on cuda"),
        (lambda: layer.forward(h, router_logits=logits.cpu()), ValueError, "router_logits: on cpu"),
        (lambda: layer.forward(h, router_logits=logits, out=torch.empty(4, 256, dtype=torch.bfloat16)), ValueError, "out: on cpu"),
        (lambda: layer.forward(h.float(), router_logits=logits), TypeError, "hidden: dtype float32"),
        (lambda: layer.forward(torch.randn(256, 4, device="cuda").bfloat16().T, router_logits=logits), ValueError, "hidden: strides"),
        (lambda: layer.forward(torch.randn(9, 256, device="cuda").bfloat16(), router_logits=torch.randn(9, 8, device="cuda")), ValueError, "max_tokens = 8"),
        (lambda: layer.forward(h, topk_ids=torch.zeros(4, 2, dtype=torch.int64, device="cuda"), topk_weights=torch.zeros(4, 2, device="cuda")), TypeError, "topk_ids: dtype int64"),
        (lambda: layer.forward(h), ValueError, "router_logits is None"),
        (lambda: layer.forward(h, router_logits=logits, topk_ids=torch.zeros(4, 2, dtype=torch.int32, device="cuda")), ValueError, "both given"),
        (lambda: layer.forward([1, 2], router_logits=logits, out=h), TypeError, "hidden: a list"),
        (lambda: layer.forward(h, router_logits=logits, stream="s"), TypeError, "stream"),
    ]
    for call, exc, pattern in cases:
        with pytest.raises(exc, match=pattern):
            call()
    # construction: missing, misshapen and mistyped weights
    bad = dict(w)
    bad.pop("w2_weight_scale")
    with pytest.raises(ValueError, match=r"weights\['w2_weight_scale'\] is missing"):
        fp4moe.MoeLayer("tiny", bad, 8)
    with pytest.raises(ValueError, match=r"weights\['w13_weight'\]: shape"):
        fp4moe.MoeLayer("tiny", dict(w, w13_weight=w["w13_weight"][:, :-16]), 8)
    with pytest.raises(TypeError, match=r"weights\['w13_weight'\]: dtype int32"):
        fp4moe.MoeLayer("tiny", dict(w, w13_weight=w["w13_weight"].int()), 8)
    with pytest.raises(ValueError, match=r"weights\['w13_bias'\] was given"):
        fp4moe.MoeLayer("tiny", dict(w, w13_bias=torch.zeros(8, 256, device="cuda")), 8)
    with pytest.raises(ValueError, match=r"weights\['colour'\]: not a weight"):
        fp4moe.MoeLayer("tiny", dict(w, colour=torch.zeros(1, device="cuda")), 8)
    with pytest.raises(ValueError, match="device = 99"):
        fp4moe.MoeLayer("tiny", w, 8, device=99)
    with pytest.raises(TypeError, match="max_tokens"):
        fp4moe.MoeLayer("tiny", w, 8.0)


def test_host_weights_and_engine_names():
    """Weights on the host (numpy / CPU torch) are staged once; vLLM / checkpoint names are accepted."""
    torch = need_gpu()
    cfg = fp4moe.preset("tiny")
    w = make_weights(torch, cfg, seed=91)
    ref_layer = fp4moe.MoeLayer("tiny", w, max_tokens=8)
    host = {k: v.cpu() for k, v in w.items()}
    host["e_score_correction_bias"] = host.pop("router_bias")
    host["w13_input_scale"] = torch.ones(8)  # ignored: activations stay bf16
    host["w13_weight_scale"] = host["w13_weight_scale"].view(torch.uint8).numpy()  # uint8 bits, numpy
    layer = fp4moe.MoeLayer("tiny", host, max_tokens=8, device="cuda:0")
    hidden, logits = inputs(torch, cfg, w, 8, seed=92)
    assert torch.equal(layer.forward(hidden, router_logits=logits), ref_layer.forward(hidden, router_logits=logits))


def test_torch_custom_op_and_compile():
    torch = need_gpu()
    import fp4moe.torch_ops  # noqa: F401

    cfg = fp4moe.preset("tiny")
    w = make_weights(torch, cfg, seed=101)
    layer = fp4moe.MoeLayer("tiny", w, max_tokens=16)
    hidden, logits = inputs(torch, cfg, w, 16, seed=102)
    ids, weights = layer.route(logits)
    expect = layer.forward(hidden, router_logits=logits)
    assert torch.equal(layer.torch_op(hidden, router_logits=logits), expect)
    out = torch.empty_like(hidden)
    torch.ops.fp4moe.moe_forward_out(layer.id, hidden, None, ids, weights, out)
    assert torch.equal(out, expect)
    torch.library.opcheck(torch.ops.fp4moe.moe_forward.default, (layer.id, hidden, logits, None, None),
                          test_utils=("test_schema", "test_faketensor"))

    layer_id = layer.id

    def f(x, i, wt):
        return torch.ops.fp4moe.moe_forward(layer_id, x * 1, None, i, wt) + 0

    for backend in ("aot_eager", "inductor"):
        torch._dynamo.reset()
        compiled = torch.compile(f, backend=backend, fullgraph=True)
        assert torch.equal(compiled(hidden, ids, weights), expect), backend


# ------------------------------------------------------------------------------------------------
# a checkpoint as stored: fp4moe.load_moe_layer against the oracle over the file's own tensors
# ------------------------------------------------------------------------------------------------

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "modelopt-qwen3-moe-nvfp4")


def test_load_moe_layer_matches_the_oracle_on_a_modelopt_checkpoint():
    torch = need_gpu()
    safetensors_torch = pytest.importorskip("safetensors.torch")
    cfg = fp4moe.make_config(FIXTURE)  # the checkpoint's config.json
    t = safetensors_torch.load_file(os.path.join(FIXTURE, "model.safetensors"), device="cuda")
    p = "model.layers.1.mlp."
    E = cfg.num_experts

    def stack(proj, field):
        return torch.stack([t[f"{p}experts.{e}.{proj}.{field}"] for e in range(E)])

    w = {"w13_weight": torch.cat([stack("gate_proj", "weight"), stack("up_proj", "weight")], dim=1),
         "w13_weight_scale": torch.cat([stack("gate_proj", "weight_scale"), stack("up_proj", "weight_scale")], dim=1),
         "w13_weight_scale_2": stack("gate_proj", "weight_scale_2").reshape(E),
         "w2_weight": stack("down_proj", "weight"), "w2_weight_scale": stack("down_proj", "weight_scale"),
         "w2_weight_scale_2": stack("down_proj", "weight_scale_2").reshape(E)}
    assert torch.equal(stack("gate_proj", "weight_scale_2"), stack("up_proj", "weight_scale_2")), \
        "the fixture shares gate/up global scales (what ModelOpt writes)"
    layer = fp4moe.load_moe_layer(FIXTURE, 1, max_tokens=64)
    assert layer.config.num_experts == E and layer.config.hidden == cfg.hidden
    router = t[p + "gate.weight"].float()
    for T in (1, 7, 64):
        gen = torch.Generator(device="cuda").manual_seed(T)
        hidden = torch.randn(T, cfg.hidden, generator=gen, device="cuda").bfloat16()
        logits = hidden.float() @ router.t()
        ids, weights, _ = route_oracle(torch, cfg, logits, None)
        ref = moe_oracle(torch, cfg, w, hidden, ids, weights)
        out = layer.forward(hidden, router_logits=logits)
        assert rel_l2(out, ref) < REL_L2, (T, rel_l2(out, ref))
    with pytest.raises(fp4moe.Error, match="model.safetensors|config.json|no such|not"):
        fp4moe.load_moe_layer(os.path.join(FIXTURE, "missing"), 1, max_tokens=8)
