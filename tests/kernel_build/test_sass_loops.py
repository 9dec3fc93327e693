"""kernel_build/bench/tuning/sass_loops.py: the key loops of a kernel, read from cuobjdump's SASS listing.

The listings here are written in cuobjdump's format by hand. The end-to-end test runs the script against a
stand-in `cuobjdump` that prints such a listing; with the real cuobjdump and nvcc on PATH, a last test
also reads a kernel compiled here.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "kernel_build" / "bench" / "tuning" / "sass_loops.py"
sys.path.insert(0, str(SCRIPT.parent))
import sass_loops  # noqa: E402


def listing(functions: dict[str, list[str]]) -> str:
    """cuobjdump -sass text: a header per function, one instruction per 16 bytes."""
    out = ["", "Fatbin elf code:", "================", "arch = sm_90", ""]
    for name, body in functions.items():
        out += [f"\t\tFunction : {name}", '\t.headerflags\t@"EF_CUDA_SM90"']
        for i, text in enumerate(body):
            out.append(f"        /*{16 * i:04x}*/                   {text} ;   /* 0x000000000000000000 */")
        out.append("\t\t..........")
    return "\n".join(out) + "\n"


# An outer loop (instructions 1-9) around an mma loop (3-6), then an mma loop (10-14) holding a copy loop
# (11-12) without mma.
KERNEL = [
    "MOV R1, c[0x0][0x28]",
    "S2R R0, SR_TID.X",  # 0x10: outer loop target
    "LDL R2, [R1]",
    "HMMA.16816.F32.BF16 R4, R8, R12, R4",  # 0x30: inner mma loop target
    "LDSM.16.M88.4 R8, [R20]",
    "LDS R9, [R21]",
    "@P0 BRA 0x30",  # 0x60
    "STL [R1], R2",
    "BAR.SYNC.DEFER_BLOCKING 0x1, R3",
    "@P1 BRA 0x10",  # 0x90
    "HMMA.16816.F32.BF16 R4, R8, R12, R4",  # 0xa0: second mma loop target
    "STS [R22], R9",  # 0xb0: copy loop target
    "@!P2 BRA 0xb0",  # 0xc0
    "SHFL.IDX PT, R5, R6, R7, 0x1f",
    "@P3 BRA 0xa0",  # 0xe0
    "EXIT",
]


def test_only_the_innermost_loops_with_mma_are_key_loops():
    ((name, instructions),) = sass_loops.parse(listing({"k": KERNEL})).items()
    assert name == "k" and len(instructions) == len(KERNEL)
    loops = sass_loops.key_loops(instructions)
    assert [(lp.start, lp.end) for lp in loops] == [(0x30, 0x60), (0xA0, 0xE0)]
    first, second = loops
    assert len(first.body) == 4 and len(second.body) == 5


def test_counts_match_whole_opcodes_and_predicated_instructions():
    first, second = sass_loops.key_loops(sass_loops.parse(listing({"k": KERNEL}))["k"])
    assert [first.count(op) for op in ("HMMA", "LDSM", "LDS", "BRA")] == [1, 1, 1, 1]
    assert [second.count(op) for op in ("STS", "SHFL", "BRA", "LDL")] == [1, 1, 2, 0]


def _run(tmp_path: Path, *args: str, text: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if text is not None:  # a stand-in cuobjdump on PATH that prints `text`
        (tmp_path / "listing.txt").write_text(text)
        fake = tmp_path / "bin" / "cuobjdump"
        fake.parent.mkdir()
        fake.write_text(f"#!/bin/sh\ncat {tmp_path / 'listing.txt'}\n")
        fake.chmod(0o755)
        env["PATH"] = f"{fake.parent}{os.pathsep}{env['PATH']}"
    return subprocess.run([sys.executable, SCRIPT, *args], env=env, capture_output=True, text=True)


def test_cli_prints_each_matching_kernel_with_its_key_loops(tmp_path):
    text = listing({"_Z18tree_verify_kernelv": KERNEL, "_Z14combine_kernelv": ["EXIT"]})
    r = _run(tmp_path, "lib.so", text=text)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "_Z18tree_verify_kernelv: 16 instructions, 2 local loads/stores"
    assert lines[1].startswith(
        "  loop 0x00030-0x00060: 4 instructions; HMMA 1, QMMA 0, LDSM 1, LDS 1, STS 0, LDL 0"
    )
    assert len(lines) == 3 and "combine" not in r.stdout


def test_cli_says_what_is_missing(tmp_path):
    r = _run(tmp_path, "lib.so", "--kernel", "nothing_like_this", text=listing({"k": KERNEL}))
    assert r.returncode == 1 and "no sm_90 kernel matching 'nothing_like_this' in lib.so" in r.stderr
    env_path = os.environ.get("PATH", "")
    if shutil.which("cuobjdump", path=env_path) is None:
        r = _run(tmp_path, "lib.so")
        assert r.returncode == 2 and "cuobjdump not found" in r.stderr


@pytest.mark.skipif(
    shutil.which("cuobjdump") is None or shutil.which("nvcc") is None,
    reason="needs nvcc and cuobjdump on PATH",
)
def test_reads_a_kernel_compiled_here(tmp_path):
    src = tmp_path / "k.cu"
    src.write_text(
        "__global__ void tree_verify_kernel(float* c, const unsigned* a, const unsigned* b, int n) {\n"
        "  float d[4] = {0.f, 0.f, 0.f, 0.f};\n"
        "  for (int i = 0; i < n; ++i)\n"
        '    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7},'
        ' {%8,%9}, {%0,%1,%2,%3};" : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])'
        ' : "r"(a[i]), "r"(a[i + 1]), "r"(a[i + 2]), "r"(a[i + 3]), "r"(b[i]), "r"(b[i + 1]));\n'
        "  c[threadIdx.x] = d[0] + d[1] + d[2] + d[3];\n"
        "}\n"
    )
    cubin = tmp_path / "k.cubin"
    subprocess.run(["nvcc", "-arch=sm_90", "-cubin", "-O3", str(src), "-o", str(cubin)], check=True)
    r = _run(tmp_path, str(cubin))
    assert r.returncode == 0, r.stderr
    assert "tree_verify_kernel" in r.stdout and re.search(
        r"  loop 0x[0-9a-f]+-0x[0-9a-f]+: \d+ instructions; HMMA [1-9]", r.stdout
    )
