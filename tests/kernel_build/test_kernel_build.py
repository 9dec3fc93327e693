"""The kernel library as built: architectures, shared memory per block, register spills.

Needs nvcc (CI has it); runs no GPU code. The sm_120 variant must fit the 99 KB of shared memory an
RTX PRO 6000 Blackwell block may have, and no sm_120 kernel may spill registers to local memory. On
sm_90 the `wide` configuration runs at its 168-register cap (384 threads) and ptxas keeps a few scalars
in local memory (the output warps read them about twice per key tile, from L1); that build measured
faster than the spill-free one before it (kernel_build/NOTES.md, v8), so a small allowance, and no more.
An fp8 pool's `mma` path (fp8 x fp8 mma.sync) is a native instruction on sm_120 only: ptxas builds it on sm_90 from
f16 conversions and f16 mma, with more registers live, a path the H200 runs to test its numerics, never by default.
"""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "kernel_build"
SM120_SMEM_LIMIT = 101376  # 99 KB: sm_120's per-block opt-in maximum
SM90_SMEM_LIMIT = 232448  # 227 KB
# Spill stores or loads allowed for the verify kernels on sm_90, where both configurations run at the 168-register
# cap (sm_90 runs `compact` only as the sm_120 configuration's test vehicle); none anywhere else.
SM90_SPILL_BYTES = 64
# The mma path on sm_90, emulated by ptxas (see above): its count moves with the code it shares with the widen path
# (168 / 200 bytes since the widen path's tiles are widened in shared memory, 144 / 156 before).
SM90_EMULATED_FP8_SPILL_BYTES = 224

pytestmark = pytest.mark.skipif(
    shutil.which("nvcc") is None or shutil.which("cmake") is None,
    reason="needs nvcc and cmake to build kernel_build/",
)


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    out = tmp_path_factory.mktemp("kernel")
    cfg = subprocess.run(
        ["cmake", "-S", SRC, "-B", out, "-DCMAKE_CUDA_ARCHITECTURES=90-real;120"],
        capture_output=True,
        text=True,
    )
    assert cfg.returncode == 0, cfg.stdout + cfg.stderr
    b = subprocess.run(["cmake", "--build", out, "-j2"], capture_output=True, text=True)
    assert b.returncode == 0, b.stdout + b.stderr
    return out, b.stdout + b.stderr


def _ptxas_report(log: str) -> dict[tuple[str, str], str]:
    """(kernel, arch) -> the ptxas lines that follow its 'Compiling entry function' line."""
    report, key = {}, None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '(\w+)' for '(sm_\d+)'", line)
        if m:
            key = (m.group(1), m.group(2))
            report[key] = ""
        elif key is not None and ("spill" in line or "Used" in line):
            report[key] += line + "\n"
    return report


def _spill_bytes(text: str) -> tuple[int, int]:
    m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    assert m, f"no spill line in the ptxas report:\n{text}"
    return int(m.group(1)), int(m.group(2))


def test_no_spills_on_sm120_and_at_most_a_few_scalars_on_sm90(build):
    report = _ptxas_report(build[1])
    archs = {arch for _, arch in report}
    assert {"sm_90", "sm_120"} <= archs
    verify = [k for k in report if "tree_verify_kernel" in k[0]]
    # two tile configurations x (bf16, and e4m3 and e5m2 by both fp8 paths) x two architectures
    assert len(verify) == 20 and sum(_mma_path(k) for k, _ in verify) == 8
    for (kernel, arch), text in report.items():
        stores, loads = _spill_bytes(text)
        verify_on_sm90 = arch == "sm_90" and "tree_verify_kernel" in kernel
        limit = SM90_SPILL_BYTES if verify_on_sm90 else 0
        if verify_on_sm90 and _mma_path(kernel):
            limit = SM90_EMULATED_FP8_SPILL_BYTES
        assert stores <= limit and loads <= limit, (
            f"{kernel} on {arch} spills (allowed: {limit} bytes):\n{text}"
        )


def _mma_path(kernel: str) -> bool:
    """tree_verify_kernel<Cfg, Kv, MMA8>'s last template argument, as mangled: true for the fp8 mma path."""
    return kernel.endswith("ELb1EEEvNS_6ParamsE")


def _cuobjdump() -> str | None:
    """The CUDA toolkit's on PATH, else the one Triton ships (the server extra's)."""
    if found := shutil.which("cuobjdump"):
        return found
    try:
        import triton
    except ImportError:
        return None
    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return str(bundled) if bundled.is_file() else None


def test_the_fp8_mma_path_is_native_on_sm120_and_emulated_on_sm90(build):
    """The mma path's m16n8k32 fp8 mma.sync is one QMMA on sm_120; on sm_90 ptxas widens its operands and issues f16
    HMMA (no QMMA): what the path is for (sm_120's fp8 tensor rate) and why the H200 never runs it by default."""
    tool = _cuobjdump()
    if tool is None:
        pytest.skip("needs cuobjdump (the CUDA toolkit's, or Triton's)")
    for arch, native in (("sm_120", True), ("sm_90", False)):
        sass = subprocess.run(
            [tool, "-sass", "-arch", arch, str(build[0] / "libkdtree_verify.so")],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        bodies = re.split(r"\n\s*Function : ", sass)[1:]
        verify = {b.split("\n", 1)[0]: b for b in bodies if "tree_verify_kernel" in b.split("\n", 1)[0]}
        for name, body in verify.items():
            if "ILi64ELi32E" in name and arch == "sm_120":
                continue  # wide does not fit sm_120's shared memory: no code there
            qmma = len(re.findall(r"\bQMMA\.16832\.F32\.E[45]M[23]\.E[45]M[23]\b", body))
            assert (qmma > 0) == (native and _mma_path(name)), (arch, name, qmma)


def test_shared_memory_fits_each_target(build):

    lib = ctypes.CDLL(str(build[0] / "libkdtree_verify.so"))  # loads without a GPU: static cudart
    # The library, its header and the binding agree on the ABI (the binding refuses any other library).
    header = int(
        re.search(r"#define KDTREE_ABI_VERSION (\d+)", (SRC / "include" / "kdtree_verify.h").read_text())[1]
    )
    binding = int(
        re.search(r"^ABI_VERSION = (\d+)", (ROOT / "kdtree" / "kernel" / "abi.py").read_text(), re.M)[1]
    )
    assert lib.kdtree_abi_version() == header == binding
    lib.kdtree_compiled_archs.restype = ctypes.c_char_p
    assert lib.kdtree_compiled_archs().decode().split(",") == ["90", "120"]
    wide, compact = lib.kdtree_verify_smem_bytes(1), lib.kdtree_verify_smem_bytes(2)
    assert 0 < compact <= SM120_SMEM_LIMIT
    assert compact < wide <= SM90_SMEM_LIMIT
    assert lib.kdtree_verify_smem_bytes(7) == 0


def test_workspace_depends_on_sizes_only(build):
    lib = ctypes.CDLL(str(build[0] / "libkdtree_verify.so"))
    size = ctypes.c_size_t()
    # batch 1, 8 heads, 16 draft tokens on 132 slots: the prefix is split, partial results need room
    assert lib.kdtree_verify_workspace_bytes(1, 8, 16, 132, 1, ctypes.byref(size)) == 0
    assert size.value > 0
    # two splits (66 row tiles on 132 slots): room for the partial rows too, which a device that cannot hold
    # all 66 clusters of two CTAs at once merges through the combine instead of on chip
    assert lib.kdtree_verify_workspace_bytes(33, 8, 16, 132, 1, ctypes.byref(size)) == 0
    assert size.value == 66 * 2 * 64 * 513 * 4
    # a batch that fills the device on its own needs no split and no workspace
    assert lib.kdtree_verify_workspace_bytes(256, 16, 64, 132, 1, ctypes.byref(size)) == 0
    assert size.value == 0
    assert lib.kdtree_verify_workspace_bytes(0, 8, 16, 132, 1, ctypes.byref(size)) != 0


@pytest.mark.parametrize(
    "batch, heads, q_len, splits",
    [
        (1, 8, 16, 66),  # 2 row tiles: 66 splits fill one wave
        (4, 8, 257, 1),  # 4 x 33 = 132 row tiles fill the device: no split
        (4, 8, 65, 7),  # 36 row tiles: 3 splits fill 108 slots in one wave; 7 (2 waves of 1/7) beat it
        (4, 8, 129, 5),  # 68 row tiles: one split would idle 64 slots; 5 splits, 3 waves of a fifth each
        (70, 8, 16, 2),  # 140 row tiles: a second wave of 8 CTAs; 2 splits are 3 waves of halves
        (256, 16, 64, 1),
    ],
)
def test_split_rule(build, batch, heads, q_len, splits):
    # plan() (src/tree_verify.cu) minimises waves * (1/s + SPLIT_CTA_COST), at most 3 waves: the workspace holds
    # each split CTA's partial rows (64 rows x (512 + 1) floats), so it shows the split count
    lib = ctypes.CDLL(str(build[0] / "libkdtree_verify.so"))
    size = ctypes.c_size_t()
    assert lib.kdtree_verify_workspace_bytes(batch, heads, q_len, 132, 1, ctypes.byref(size)) == 0
    base = batch * -(-heads * q_len // 64)
    assert size.value == (0 if splits == 1 else base * splits * 64 * 513 * 4)
    assert size.value <= 3 * 132 * 64 * 513 * 4


def test_timeline_stamps_only_in_timeline_builds(build, tmp_path):
    # The release library has no timeline entry points (and its SASS none of the stamps); a tuning build
    # with -DKDTREE_TIMELINE compiles for both targets and exports them for bench/tuning/timeline.py.
    lib = ctypes.CDLL(str(build[0] / "libkdtree_verify.so"))
    assert not hasattr(lib, "kdtree_timeline")
    out = tmp_path / "timeline"
    cfg = subprocess.run(
        [
            "cmake",
            "-S",
            SRC,
            "-B",
            out,
            "-DCMAKE_CUDA_ARCHITECTURES=90-real;120",
            "-DCMAKE_CUDA_FLAGS=-DKDTREE_TIMELINE",
        ],
        capture_output=True,
        text=True,
    )
    assert cfg.returncode == 0, cfg.stdout + cfg.stderr
    b = subprocess.run(
        ["cmake", "--build", out, "-j2", "--target", "kdtree_verify"], capture_output=True, text=True
    )
    assert b.returncode == 0, b.stdout + b.stderr
    tl = ctypes.CDLL(str(out / "libkdtree_verify.so"))
    assert hasattr(tl, "kdtree_timeline") and hasattr(tl, "kdtree_timeline_reset")


@pytest.mark.parametrize("probe", ["dsmem_probe.cu"])
def test_bench_probes_compile(probe, tmp_path):
    # The standalone microbenchmarks the GPU machine compiles by hand (the mma.sync rate is the library's).
    for arch in ("sm_90", "sm_120"):
        b = subprocess.run(
            [
                "nvcc",
                "-O3",
                f"-arch={arch}",
                "-std=c++17",
                SRC / "bench" / "tuning" / probe,
                "-o",
                tmp_path / f"{probe}-{arch}",
            ],
            capture_output=True,
            text=True,
        )
        assert b.returncode == 0, b.stdout + b.stderr


def test_live_mode_entry_points_refuse_bad_arguments_before_any_cuda_call(build):
    """kdtree_mode_gate / kdtree_mode_post (src/modes.cu) check their pointers and sizes first (no GPU here):
    each case below is valid but for one argument."""
    lib = ctypes.CDLL(str(build[0] / "libkdtree_verify.so"))
    p = ctypes.c_void_p
    lib.kdtree_mode_gate.argtypes = [p, p, p, ctypes.c_int, ctypes.c_int, p, p, p, p, p]
    lib.kdtree_mode_post.argtypes = [p, p, p, ctypes.c_int64, p, p, ctypes.c_float, p]
    m = ctypes.cast(ctypes.create_string_buffer(64), p)
    gate_cases = {
        "no host mode word": (None, m, m, 1, 3, m, m),
        "no step count": (m, m, m, 1, 3, m, None),
        "qo_indptr of one entry": (m, m, m, 1, 1, m, m),
        "unknown index type": (m, m, m, 7, 3, m, m),
    }
    for why, args in gate_cases.items():
        assert lib.kdtree_mode_gate(*args, None, None, None) == 1, why
    assert lib.kdtree_mode_post(m, m, m, 0, m, None, 0.02, None) == 1  # nothing to compare
    assert lib.kdtree_mode_post(m, None, m, 8, m, None, 0.02, None) == 1  # no output
