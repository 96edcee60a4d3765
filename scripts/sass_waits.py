#!/usr/bin/env python3
"""Where ptxas makes a kernel's hot loop wait for its global loads: a CPU-side check of a decode-kernel
change before any GPU time is spent on it (docs/kernel-design.md, "The stream kernel": the ring's loads
complete on one scoreboard, and where the wait sits decides the effective ring depth).

    python3 scripts/sass_waits.py OBJECT_OR_CUBIN KERNEL_SUBSTRING [--all] [--mix [OTHER_OBJECT]]

OBJECT_OR_CUBIN: a .cu.o of the build (e.g. build/CMakeFiles/fp4moe_core.dir/src/
sm80_nvfp4_grouped_gemm_plain.cu.o) or a .cubin. KERNEL_SUBSTRING picks the function by its mangled name,
e.g. 'stream_kernelILi8ELi24ELi4ELi1ELi0EE' (stream_bt8_w24_d4_c1, plain epilogue).

--mix also prints the instruction mix between the first and the last MMA (the unrolled turn of the ring),
and with OTHER_OBJECT the same function's mix there beside it: a change outside the loop can still make
ptxas compile the loop differently (bench/NOTES.md: 8 of 75 IMAD.SHL per turn became ALU-pipe LOP3 and
S2R appeared, 4% slower), so compare the mix of a candidate with the build it replaces before a GPU run.

Needs cuobjdump and nvdisasm: $CUDA_BIN, else PATH, else /usr/local/cuda/bin. The CUDA toolkit of
this project's CI machine ships neither; they install from PyPI into a throwaway venv:
    python3 -m venv /tmp/cuv && /tmp/cuv/bin/pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm
    export CUDA_BIN=$(echo /tmp/cuv/lib/python3*/site-packages/nvidia/cu13/bin)

How it reads the SASS: each sm_70+ instruction is 128 bits; bits 105..125 hold its control information:
stall cycles, the scoreboard its result completes on (write barrier, 3 bits, 7 = none), and the mask of
scoreboards it waits for (6 bits). A scoreboard wait is for *every* outstanding instruction on it. The
report lists, for the scoreboard(s) of the 64- and 128-bit global loads (the stream kernel's ring), every
instruction in the hot region (around the MMAs) that waits on them. The stream kernel's ring runs in two
halves: one wait per half (two per turn: at the loop's head, and at the second half's first scale word,
which orders that half's requests after the wait) is the good shape; one per slot means each chunk waits
for the load issued just before it (a one-deep ring).
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile


def tool(name):
    for d in (os.environ.get("CUDA_BIN"), None, "/usr/local/cuda/bin"):
        p = os.path.join(d, name) if d else shutil.which(name)
        if p and os.path.exists(p):
            return p
    sys.exit(f"sass_waits: {name} not found (set CUDA_BIN; see the header of this script)")


def disassemble(path):
    with tempfile.TemporaryDirectory() as tmp:
        if path.endswith(".cubin"):
            cubins = [path]
        else:
            subprocess.run([tool("cuobjdump"), "-xelf", "all", os.path.abspath(path)], cwd=tmp, check=True,
                           stdout=subprocess.DEVNULL)
            cubins = [os.path.join(tmp, f) for f in sorted(os.listdir(tmp)) if f.endswith(".cubin")]
        if not cubins:
            sys.exit(f"sass_waits: {path} holds no device code")
        return "\n".join(subprocess.run([tool("nvdisasm"), "-hex", c], check=True, capture_output=True,
                                        text=True).stdout for c in cubins)


def parse(sass, func_sub):
    """Instructions of the first function whose section name contains func_sub (with its callees'
    local code, which nvdisasm prints in the same section)."""
    out, inside, pending, name = [], False, None, None
    for ln in sass.split("\n"):
        if ln.startswith(".text."):
            if out:
                break
            inside = func_sub in ln
            name = ln[len(".text."):].rstrip(":") if inside else None
            continue
        if not inside:
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,6})\*/\s+(.*?);\s*/\* (0x[0-9a-f]+) \*/", ln)
        if m:
            pending = (int(m.group(1), 16), m.group(2).strip())
            continue
        m2 = re.match(r"\s*/\* (0x[0-9a-f]+) \*/", ln)
        if m2 and pending:
            hi = int(m2.group(1), 16)
            out.append({"addr": pending[0], "text": pending[1], "wb": (hi >> 46) & 7, "wait": (hi >> 52) & 0x3F})
            pending = None
    return name, out


def opcode(text):
    parts = text.split()
    return parts[1] if parts[0].startswith("@") and len(parts) > 1 else parts[0]


# Opcodes worth watching in a dequantizing loop: ALU-pipe integer ops (LOP3, SHF, PRMT, IADD3, LEA), the
# FMA-pipe ones ptxas may use instead (IMAD.*), local memory, and special-register reads.
MIX_KEYS = ("LOP3.LUT", "SHF.R.U32.HI", "SHF.L.U32", "PRMT", "IADD3", "LEA", "VIADD", "IMAD.SHL.U32", "IMAD",
            "IMAD.MOV.U32", "HMUL2.BF16_V2", "HMMA.16816.F32.BF16", "LDSM.16.M88.4", "LDG.E.NA.128.CONSTANT",
            "LDG.E.NA.64.CONSTANT", "LDL", "STL", "S2R", "BRA")


def loop_mix(ins):
    mma = [i["addr"] for i in ins if opcode(i["text"]).startswith(("HMMA", "HGMMA"))]
    body = [i for i in ins if min(mma) <= i["addr"] <= max(mma)]
    counts = {}
    for i in body:
        counts[opcode(i["text"])] = counts.get(opcode(i["text"]), 0) + 1
    return len(body), counts


def print_mix(columns):
    """columns: [(label, (total, counts))]"""
    print("  instruction mix between the first and the last MMA:")
    print("    " + f"{'opcode':<24}" + "".join(f"{label:>14}" for label, _ in columns))
    print("    " + f"{'(all)':<24}" + "".join(f"{total:>14}" for _, (total, _) in columns))
    for key in MIX_KEYS:
        if any(c.get(key, 0) for _, (_, c) in columns):
            print("    " + f"{key:<24}" + "".join(f"{c.get(key, 0):>14}" for _, (_, c) in columns))


def main(argv):
    if len(argv) < 3 or argv[1] in ("-h", "--help"):
        print(__doc__)
        return 0 if len(argv) > 1 else 2
    name, ins = parse(disassemble(argv[1]), argv[2])
    if not ins:
        sys.exit(f"sass_waits: no function matching '{argv[2]}' in {argv[1]}")
    mma = [i["addr"] for i in ins if opcode(i["text"]).startswith(("HMMA", "HGMMA"))]
    if not mma:
        sys.exit(f"sass_waits: {name} has no MMA instruction")
    lo, hi = min(mma) - 0xa00, max(mma) + 0x300
    ring = sorted({i["wb"] for i in ins if opcode(i["text"]).startswith("LDG") and i["wb"] != 7 and
                   (".128" in opcode(i["text"]) or ".64" in opcode(i["text"]))})
    print(f"{name}: {len(ins)} instructions, {len(mma)} MMAs in {lo:#x}..{hi:#x}")
    for sb in ring:
        loads = [i for i in ins if lo <= i["addr"] <= hi and i["wb"] == sb and opcode(i["text"]).startswith("LDG")]
        waits = [i for i in ins if lo <= i["addr"] <= hi and i["wait"] & (1 << sb)]
        calls = sum(1 for i in waits if opcode(i["text"]).startswith(("CALL", "RET")))  # a call waits for all
        print(f"  SB{sb}: {len(loads)} wide global loads and {len(waits) - calls} waits on it in the hot region "
              f"(+ {calls} at calls)")
        for i in (ins if "--all" in argv else waits):
            if not (lo <= i["addr"] <= hi):
                continue
            op = opcode(i["text"])
            waits_here = i["wait"] & (1 << sb)
            if waits_here or (op.startswith(("LDG", "HMMA", "HGMMA", "CALL")) and "--all" in argv):
                tag = "WAIT" if waits_here else "    "
                print(f"    {tag} {i['addr']:#07x} {i['text'][:90]}")
    if "--mix" in argv:
        columns = [(os.path.basename(argv[1])[:13], loop_mix(ins))]
        k = argv.index("--mix")
        if k + 1 < len(argv) and not argv[k + 1].startswith("--"):
            other_name, other = parse(disassemble(argv[k + 1]), argv[2])
            if not other:
                sys.exit(f"sass_waits: no function matching '{argv[2]}' in {argv[k + 1]}")
            columns.append((os.path.basename(argv[k + 1])[:13], loop_mix(other)))
        print_mix(columns)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
