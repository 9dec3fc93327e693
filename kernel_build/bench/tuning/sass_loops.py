"""The key loops of each kernel in a build, from its SASS: instructions, tensor-core and shared-memory ops,
spills and barriers per loop body.

Small source changes move ptxas's register allocation of the key loops (a spill store per tile can cost a
few percent), so compare two builds here before spending GPU time on them:

    python3 kernel_build/bench/tuning/sass_loops.py kernel_build/build/libkdtree_verify.so --arch sm_90

A loop is a backward branch and its target; the ones shown hold mma (HMMA, or QMMA: fp8 on sm_120) and contain no
other loop that does, i.e. the loops the kernel spends its time in. Needs `cuobjdump` (CUDA toolkit, or the pip package
nvidia-cuda-cuobjdump) on PATH.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from dataclasses import dataclass

_FUNCTION = re.compile(r"^\s*Function : (\S+)")
_INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_BRANCH = re.compile(r"\bBRA\b.*?0x([0-9a-f]+)")
COUNTED = ("HMMA", "QMMA", "LDSM", "LDS", "STS", "LDL", "STL", "BAR", "SHFL")


@dataclass
class Loop:
    start: int  # address of the branch target
    end: int  # address of the backward branch
    body: list[str]

    def count(self, op: str) -> int:
        return sum(1 for t in self.body if _opcode(t) == op)


def _opcode(text: str) -> str:
    """The base opcode of an instruction ("@P0 LDS.U.128 R4, [R2]" -> "LDS"), so that LDS does not count LDSM."""
    words = text.split()
    word = words[1] if words and words[0].startswith("@") else (words[0] if words else "")
    return word.split(".")[0]


def parse(sass: str) -> dict[str, list[tuple[int, str]]]:
    """cuobjdump -sass text -> {function name: [(address, instruction text)]}."""
    functions: dict[str, list[tuple[int, str]]] = {}
    current = None
    for line in sass.splitlines():
        if m := _FUNCTION.match(line):
            current = functions.setdefault(m.group(1), [])
        elif current is not None and (m := _INSTRUCTION.match(line)):
            current.append((int(m.group(1), 16), m.group(2)))
    return functions


def key_loops(instructions: list[tuple[int, str]]) -> list[Loop]:
    index = {addr: i for i, (addr, _) in enumerate(instructions)}
    loops = []
    for i, (addr, text) in enumerate(instructions):
        m = _BRANCH.search(text)
        if m and int(m.group(1), 16) < addr and int(m.group(1), 16) in index:
            s = index[int(m.group(1), 16)]
            loops.append(Loop(instructions[s][0], addr, [t for _, t in instructions[s : i + 1]]))
    with_mma = [lp for lp in loops if lp.count("HMMA") or lp.count("QMMA")]  # QMMA: fp8 (sm_120)
    inner = [
        lp
        for lp in with_mma
        if not any(o is not lp and lp.start <= o.start and o.end <= lp.end for o in with_mma)
    ]
    return sorted(inner, key=lambda lp: lp.start)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("binary", help="a cubin, object or shared library with device code")
    ap.add_argument("--arch", default="sm_90", help="which architecture's code (default sm_90)")
    ap.add_argument("--kernel", default="tree_verify_kernel", help="regex on the (mangled) kernel names")
    args = ap.parse_args(argv)
    try:
        sass = subprocess.run(
            ["cuobjdump", "-sass", "-arch", args.arch, args.binary],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except FileNotFoundError:
        print(
            "cuobjdump not found: put the CUDA toolkit's bin (or pip's nvidia-cuda-cuobjdump) on PATH",
            file=sys.stderr,
        )
        return 2
    except subprocess.CalledProcessError as e:
        print(f"cuobjdump failed on {args.binary}: {e.stderr.strip()}", file=sys.stderr)
        return 2
    functions = {n: ins for n, ins in parse(sass).items() if re.search(args.kernel, n)}
    if not functions:
        print(f"no {args.arch} kernel matching '{args.kernel}' in {args.binary}", file=sys.stderr)
        return 1
    for name, instructions in functions.items():
        spills = sum(1 for _, t in instructions if _opcode(t) in ("LDL", "STL"))
        print(f"{name}: {len(instructions)} instructions, {spills} local loads/stores")
        for lp in key_loops(instructions):
            counts = ", ".join(f"{op} {lp.count(op)}" for op in COUNTED)
            print(f"  loop {lp.start:#07x}-{lp.end:#07x}: {len(lp.body)} instructions; {counts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
