#!/usr/bin/env python3
"""Two `fp4moe bench --json` files side by side: per preset and token count, the layer time and its ratio to
each run's own read ceiling, and the time ratio B / A.

    scripts/compare_status.py A.json B.json [--models glm-5,qwen3-30b]

Made for the same build on two GPUs (bench/NOTES.md, twenty-ninth session): an H100 and an H200 have the same
SMs, clocks and power limit and 1.40x apart in read bandwidth, so a point whose time scales with that factor is
bound by the bytes, and one whose time does not change is bound by the SMs (instructions, latency, tensor pipe,
power). It also compares two builds on one GPU, or two runs of one build.
"""
import argparse
import json
import sys


def load(path):
    with open(path) as f:
        d = json.load(f)
    rows = {}
    for m in d.get("models", []):
        for r in m.get("layer", []):
            rows[(m["model"], r["tokens"])] = r
    return d, rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--models", default="", help="comma-separated presets (default: every preset in both files)")
    args = ap.parse_args()
    da, ra = load(args.a)
    db, rb = load(args.b)
    for name, d in (("A", da), ("B", db)):
        c = d.get("ceilings", {})
        print(f"{name}: {d.get('gpu', '?')}, commit {d.get('commit', '?')}, read ceiling "
              f"{c.get('stream_read_tbps', float('nan')):.2f} TB/s, bf16 {c.get('bf16_gemm_tflops', float('nan')):.0f} TFLOP/s")
    ca = da.get("ceilings", {}).get("stream_read_tbps")
    cb = db.get("ceilings", {}).get("stream_read_tbps")
    if ca and cb:
        print(f"read ceilings A / B: {ca / cb:.2f} (a point bound by the bytes takes about that much longer on B "
              f"than on A; one bound by the SMs takes as long)")
    want = [m for m in args.models.split(",") if m]
    keys = [k for k in ra if k in rb and (not want or k[0] in want)]
    if not keys:
        print("no (preset, tokens) point is in both files", file=sys.stderr)
        return 1
    order = {m: i for i, m in enumerate(dict.fromkeys(k[0] for k in ra))}
    keys.sort(key=lambda k: (order[k[0]], k[1]))
    print(f"{'preset':<14}{'T':>6}{'A us':>11}{'A xread':>9}{'B us':>11}{'B xread':>9}{'B/A time':>10}")
    for k in keys:
        a, b = ra[k], rb[k]
        print(f"{k[0]:<14}{k[1]:>6}{a['layer_us']:>11.1f}{a['ratio_stream_read']:>9.3f}"
              f"{b['layer_us']:>11.1f}{b['ratio_stream_read']:>9.3f}{b['layer_us'] / a['layer_us']:>10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
