#!/usr/bin/env python3
"""The wgmma K loops of the tma and wgmma kernels in SASS: a CPU-side check of any change to them before
GPU time is spent (bench/NOTES.md, twenty-first and twenty-second sessions).

    python3 scripts/sass_wgmma_loops.py check OBJECT...      (the ctest sass_no_r2ur_in_wgmma_loops)
    python3 scripts/sass_wgmma_loops.py diff BASE_OBJECT NEW_OBJECT

A K loop here is the innermost loop (a backward branch) around an HGMMA. `check` fails when such a loop
holds an R2UR. A wgmma reads its shared-memory descriptors from uniform registers. Kept there, a
descriptor's per-step update is two or three uniform-datapath instructions (UMOV, ULOP3). Where ptxas
cannot keep the descriptor base uniform, it holds it in a vector register and moves it over at every
step: two R2UR, a LOP3 and a MOV per HGMMA, on the ALU and FMA pipes that the dequantization already
saturates. A change outside the loop can cause that. The first form of the twenty-second session's
movmatrix tile end (bench/NOTES.md) put 40 and 64 R2UR into the two wide SwiGLU loops,
and the twenty-first session measured such reallocations at 4-6%. No kernel of the build has one.

`diff` prints, for every kernel of BASE that has a wgmma loop, whether NEW's code is identical, else
the opcode counts that differ inside its wgmma loops, and whether the rest of the kernel changed. Use it
on a translation unit compiled before and after a change. Note that a producer-side change can cost time
with an identical K loop: the twenty-first session's did. So for a change meant to leave a kernel alone,
identical code is the test.

Needs cuobjdump: $CUDA_BIN, else .deps/cuobjdump-*/ (scripts/setup.sh fetches the pinned PyPI
nvidia-cuda-cuobjdump there), else PATH, else /usr/local/cuda/bin. `check` exits 77 without one (ctest
reports the test as skipped).
"""
import collections
import glob
import os
import re
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def find_cuobjdump():
    cands = []
    if os.environ.get("CUDA_BIN"):
        cands.append(os.path.join(os.environ["CUDA_BIN"], "cuobjdump"))
    cands += sorted(glob.glob(os.path.join(ROOT, ".deps", "cuobjdump-*", "cuobjdump")), reverse=True)
    on_path = shutil.which("cuobjdump")
    if on_path:
        cands.append(on_path)
    cands.append("/usr/local/cuda/bin/cuobjdump")
    for c in cands:
        if os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


def functions(path, cuobjdump):
    """{mangled name: [(address, instruction text)]} of every function's SASS in path."""
    out = subprocess.run([cuobjdump, "-sass", path], capture_output=True, text=True, check=True).stdout
    funcs, cur = {}, None
    for line in out.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            cur = m.group(1)
            funcs[cur] = []
            continue
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if cur is not None and m:
            funcs[cur].append((int(m.group(1), 16), m.group(2)))
    return funcs


def wgmma_loops(ins):
    """The innermost backward-branch span [target, branch] around each HGMMA."""
    back = []
    for addr, text in ins:
        m = re.search(r"\bBRA\b.*?0x([0-9a-f]+)\s*$", text)
        if m and int(m.group(1), 16) <= addr:
            back.append((int(m.group(1), 16), addr))
    spans = set()
    for addr, text in ins:
        if "HGMMA" not in text:
            continue
        around = [s for s in back if s[0] <= addr <= s[1]]
        if around:
            spans.add(min(around, key=lambda s: s[1] - s[0]))
    return sorted(spans)


def in_loops(ins, spans):
    return [(a, t) for a, t in ins if any(lo <= a <= hi for lo, hi in spans)]


def opcode(text):
    words = text.split()
    return words[1] if words[0].startswith("@") else words[0]


def demangle(names):
    try:
        out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True)
        pretty = out.stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        pretty = names
    return {n: re.sub(r"fp4moe::kernels::|\(fp4moe::.*", "", p) for n, p in zip(names, pretty)}


def check(objects, cuobjdump):
    bad, kernels = [], 0
    for obj in objects:
        funcs = functions(obj, cuobjdump)
        names = demangle(list(funcs))
        for name, ins in funcs.items():
            spans = wgmma_loops(ins)
            if not spans:
                continue
            kernels += 1
            n = sum(1 for _, t in in_loops(ins, spans) if opcode(t) == "R2UR")
            if n:
                bad.append(f"{os.path.basename(obj)}: {names[name]}: {n} R2UR in its wgmma loops")
    if kernels == 0:
        print("sass_wgmma_loops: no kernel with a wgmma loop in " + ", ".join(objects), file=sys.stderr)
        return 2
    for b in bad:
        print(b)
    if bad:
        print(f"sass_wgmma_loops: {len(bad)} of {kernels} kernels hold a wgmma descriptor in a vector register "
              "inside the K loop (R2UR per step); see this script's header", file=sys.stderr)
        return 1
    print(f"sass_wgmma_loops: {kernels} kernels with wgmma loops, none with an R2UR in them")
    return 0


def diff(base, new, cuobjdump):
    fb, fn = functions(base, cuobjdump), functions(new, cuobjdump)
    names = demangle(list(fb))
    for name, ins in fb.items():
        spans = wgmma_loops(ins)
        if not spans:
            continue
        other = fn.get(name)
        if other is None:
            print(f"{names[name]}: not in {new}")
            continue
        if [t for _, t in ins] == [t for _, t in other]:
            print(f"{names[name]}: identical")
            continue
        cb = collections.Counter(opcode(t) for _, t in in_loops(ins, spans))
        cn = collections.Counter(opcode(t) for _, t in in_loops(other, wgmma_loops(other)))
        d = {o: cn[o] - cb[o] for o in sorted(set(cb) | set(cn)) if cn[o] != cb[o]}
        loops = ", ".join(f"{o} {v:+d}" for o, v in d.items()) if d else "the same opcode counts"
        print(f"{names[name]}: changed; wgmma loops: {sum(cb.values())} -> {sum(cn.values())} instructions, "
              f"{loops}; whole kernel {len(ins)} -> {len(other)}")
    return 0


def main(argv):
    if len(argv) < 3 or argv[1] not in ("check", "diff") or (argv[1] == "diff" and len(argv) != 4):
        print(__doc__, file=sys.stderr)
        return 2
    cuobjdump = find_cuobjdump()
    if cuobjdump is None:
        print("sass_wgmma_loops: no cuobjdump ($CUDA_BIN, .deps/ from scripts/setup.sh, PATH, "
              "/usr/local/cuda/bin): skipped", file=sys.stderr)
        return 77
    for obj in argv[2:]:
        if not os.path.isfile(obj):
            print(f"sass_wgmma_loops: no such object file: {os.path.basename(obj)}", file=sys.stderr)
            return 2
    if argv[1] == "check":
        return check(argv[2:], cuobjdump)
    return diff(argv[2], argv[3], cuobjdump)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
