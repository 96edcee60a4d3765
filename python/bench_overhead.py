"""The Python call's host overhead over the C++ call, at T = 1 (target: < 5 us per call).

Both sides issue the same MoeLayer forward on the same tensors and stream: the C++ side in a loop inside
the extension (fp4moe._ext.Layer.bench_cpp_forward, arguments imported once), the Python side through
fp4moe.MoeLayer.forward (argument import through DLPack's C exchange table, checks, stream lookup every
call). Host time per call is measured over bursts of calls with the GPU synchronized between bursts,
so the launch queue never backs up into the measurement; bursts of the variants are interleaved so
that clock drift hits all alike. Prints one JSON document (and writes it to --json).

    python python/bench_overhead.py [--preset qwen3-30b] [--tokens 1] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

# Run as `python python/bench_overhead.py`, Python would put python/ (the package's sources, without the
# compiled module) ahead of the installed fp4moe.
_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]

import torch  # noqa: E402

import fp4moe  # noqa: E402
import fp4moe.torch_ops  # noqa: E402, F401  (registers torch.ops.fp4moe.*)


def random_weights(cfg, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    E, H, I, Is = cfg.num_experts, cfg.hidden, cfg.intermediate, cfg.intermediate * cfg.num_shared

    def fp4(*shape):
        codes = torch.randint(0, 256, (*shape[:-1], shape[-1] // 2), generator=g, device="cuda", dtype=torch.uint8)
        scales = torch.randint(0x30, 0x40, (*shape[:-1], shape[-1] // 16), generator=g, device="cuda",
                               dtype=torch.uint8).view(torch.float8_e4m3fn)
        return codes, scales

    w = {}
    w["w13_weight"], w["w13_weight_scale"] = fp4(E, 2 * I, H)
    w["w2_weight"], w["w2_weight_scale"] = fp4(E, H, I)
    w["w13_weight_scale_2"] = torch.full((E,), 1 / (6 * math.sqrt(H)), device="cuda")
    w["w2_weight_scale_2"] = torch.full((E,), 1 / (6 * math.sqrt(I)), device="cuda")
    if cfg.router != "softmax":
        w["router_bias"] = 0.1 * torch.randn(E, generator=g, device="cuda")
    if cfg.expert_bias:
        w["w13_bias"] = torch.zeros(E, 2 * I, device="cuda")
        w["w2_bias"] = torch.zeros(E, H, device="cuda")
    if cfg.num_shared:
        w["shared_w13_weight"], w["shared_w13_weight_scale"] = fp4(2 * Is, H)
        w["shared_w2_weight"], w["shared_w2_weight_scale"] = fp4(H, Is)
        w["shared_w13_weight_scale_2"] = torch.tensor(1 / (6 * math.sqrt(H)), device="cuda")
        w["shared_w2_weight_scale_2"] = torch.tensor(1 / (6 * math.sqrt(Is)), device="cuda")
    return w


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="qwen3-30b")
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--burst", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    if not (torch.cuda.is_available() and fp4moe.gpu_available()):
        raise SystemExit("bench_overhead: needs a CUDA GPU (sm_90a) and torch with CUDA")

    cfg = fp4moe.preset(a.preset)
    layer = fp4moe.MoeLayer(cfg, random_weights(cfg), max_tokens=a.tokens)
    T = a.tokens
    hidden = torch.randn(T, cfg.hidden, device="cuda").bfloat16()
    logits = 2 * torch.randn(T, cfg.num_experts, device="cuda")
    ids, weights = layer.route(logits)
    out = torch.empty_like(hidden)
    impl, burst = layer._impl, a.burst

    def timed(fn):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) / burst * 1e6

    def variants(routed: bool):
        li, ii, wi = (None, ids, weights) if routed else (logits, None, None)
        fwd, op = layer.forward, torch.ops.fp4moe.moe_forward_out

        def cpp():
            impl.bench_cpp_forward(hidden, li, ii, wi, out, -1, burst)

        def python():
            for _ in range(burst):
                fwd(hidden, router_logits=li, topk_ids=ii, topk_weights=wi, out=out)

        def python_alloc():
            for _ in range(burst):
                fwd(hidden, router_logits=li, topk_ids=ii, topk_weights=wi)

        def torch_op():
            for _ in range(burst):
                op(layer.id, hidden, li, ii, wi, out)

        return {"cpp_us": cpp, "python_us": python, "python_alloc_us": python_alloc, "torch_op_us": torch_op}

    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "fp4moe": fp4moe.__version__,
              "preset": a.preset, "tokens": T, "burst": burst, "rounds": a.rounds, "modes": {}}
    for mode in ("routed", "logits"):
        v = variants(mode == "routed")
        for f in v.values():  # warm-up
            for _ in range(5):
                f()
        samples = {k: [] for k in v}
        for _ in range(a.rounds):
            for k, f in v.items():
                samples[k].append(timed(f))
        r = {k: round(statistics.median(s), 3) for k, s in samples.items()}
        r.update({k.replace("_us", "_p10_us"): round(sorted(s)[len(s) // 10], 3) for k, s in samples.items()})
        r["overhead_us"] = round(r["python_us"] - r["cpp_us"], 3)
        result["modes"][mode] = r
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(100):
        layer.forward(hidden, topk_ids=ids, topk_weights=weights, out=out)
    end.record()
    end.synchronize()
    result["gpu_us_per_forward"] = round(start.elapsed_time(end) * 10, 3)
    result["target_overhead_us"] = 5.0
    result["meets_target"] = all(m["overhead_us"] < 5.0 for m in result["modes"].values())
    text = json.dumps(result, indent=2)
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
