"""Binding of the CUDA library (kernel_build/) as torch custom ops.

The library has a C ABI and no libtorch link; this package loads it with ctypes and exposes
`torch.ops.kdtree.tree_verify`, `parity_update`, `mode_gate` and `mode_post`. Launches go to the current
stream, use a caller-owned workspace, never allocate and never synchronise with the host, so they
can be captured in a CUDA graph. Argument checks read metadata only (shape, dtype, stride, device).

The package mirrors the C sources: abi (include/kdtree_verify.h), loader (loading, and src/status.cu's error path),
plan (the device plan: tile configuration, CTA slots, workspace), checks (argument checks), verify_op (tree_verify,
src/tree_verify.cu), pinned (pinned host memory the device maps), parity (src/parity.cu), modes (src/modes.cu) and
peak (src/peak.cu).
"""

from kdtree.kernel.abi import (
    ABI_VERSION,
    CONFIGS,
    FP8_PATHS,
    KV_DTYPES,
    LIB_NAME,
    MAX_HEADS,
    MAX_Q_LEN,
    MODE_CODES,
    QK_DIM,
    STATUS,
    V_DIM,
    ParityTotals,
)
from kdtree.kernel.loader import KernelUnavailable, compiled_archs, library
from kdtree.kernel.modes import ModeWord, StepCalls, capture_id, mode_gate, mode_post
from kdtree.kernel.parity import ParityStats
from kdtree.kernel.peak import mma_peak_tflops
from kdtree.kernel.pinned import DeviceCounter
from kdtree.kernel.plan import forced, smem_bytes, workspace_bytes
from kdtree.kernel.verify_op import Unsupported, tree_verify

__all__ = [
    "ABI_VERSION",
    "CONFIGS",
    "FP8_PATHS",
    "KV_DTYPES",
    "LIB_NAME",
    "MAX_HEADS",
    "MAX_Q_LEN",
    "MODE_CODES",
    "QK_DIM",
    "STATUS",
    "V_DIM",
    "DeviceCounter",
    "KernelUnavailable",
    "ModeWord",
    "ParityStats",
    "ParityTotals",
    "StepCalls",
    "Unsupported",
    "capture_id",
    "compiled_archs",
    "forced",
    "library",
    "mma_peak_tflops",
    "mode_gate",
    "mode_post",
    "smem_bytes",
    "tree_verify",
    "workspace_bytes",
]
