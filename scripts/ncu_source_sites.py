#!/usr/bin/env python3
"""Where a kernel's warps spend their time, per SASS instruction, from ncu's warp-state samples.

    ncu -o REP -k regex:sm90_nvfp4 --launch-count 2 --section WarpStateStats --section SourceCounters \
        --import-source no fp4moe bench --mode gemm --model M --tokens T --no-baseline --reps 1
    ncu -i REP.ncu-rep --page source --csv --print-source sass > SRC.csv
    python3 scripts/ncu_source_sites.py SRC.csv [TOP]

For each kernel in the export: the total of samples (proportional to its warps' time), the share inside the
wgmma K loops (the innermost backward-branch loops around an HGMMA) and outside them, the stall reasons
overall, and the TOP instructions outside the K loops with their main stall reasons. bench/NOTES.md,
twenty-eighth session: the tma kernel's per-tile decode and global-scale loads were found this way.
"""
import collections
import csv
import re
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"


def load(path):
    kernels, cur, hdr = [], None, None
    for row in csv.reader(open(path)):
        if not row:
            continue
        if row[0] == "Kernel Name":
            cur, hdr = {"name": row[1], "rows": []}, None
            kernels.append(cur)
        elif row[0] == "Address":
            hdr = row
        elif hdr and cur is not None:
            cur["rows"].append(dict(zip(hdr, row)))
    return kernels


def num(x):
    try:
        return float(x.replace(",", ""))
    except (ValueError, AttributeError):
        return 0.0


def k_loops(rows):
    """Index ranges of the innermost backward branches whose body holds an HGMMA."""
    srcs = [r["Source"] for r in rows]
    addr = {}
    for i, r in enumerate(rows):
        a = r["Address"]
        addr[int(a, 16) if a.startswith("0x") else int(a)] = i
    inside = set()
    for i, s in enumerate(srcs):
        m = re.search(r"BRA\s+(?:\S+\s+)?0x([0-9a-f]+)", s)
        if not m:
            continue
        j = addr.get(int(m.group(1), 16))
        if j is not None and j <= i and i - j < 600 and any("HGMMA" in x for x in srcs[j:i + 1]):
            inside.update(range(j, i + 1))
    return inside


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 15
    for k in load(sys.argv[1]):
        rows = k["rows"]
        if not rows:
            continue
        total = sum(num(r[SAMPLES]) for r in rows) or 1.0
        stalls = [c for c in rows[0] if c.startswith("stall_") and "Not Issued" not in c]
        inside = k_loops(rows)
        in_loops = sum(num(r[SAMPLES]) for i, r in enumerate(rows) if i in inside)
        agg = collections.Counter()
        for r in rows:
            for c in stalls:
                agg[c] += num(r[c])
        print(f"{k['name'][:140]}\n  samples {total:.0f}: K loops {100 * in_loops / total:.1f}%, "
              f"outside {100 * (total - in_loops) / total:.1f}%")
        print("  stalls: " + ", ".join(f"{c[6:]} {100 * v / total:.1f}%" for c, v in agg.most_common(8)))
        outside = sorted(((num(r[SAMPLES]), i) for i, r in enumerate(rows) if i not in inside), reverse=True)
        for s, i in outside[:top]:
            r = rows[i]
            why = sorted(((num(r[c]), c[6:]) for c in stalls), reverse=True)[:2]
            print(f"    {i:5d} {100 * s / total:5.2f}%  {r['Source'][:64]:64s} "
                  + " ".join(f"{n}:{v:.0f}" for v, n in why if v > 0))


if __name__ == "__main__":
    main()
