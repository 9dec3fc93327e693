"""The tensor pipe's measured rate (src/peak.cu): the compute ceiling of the benchmarks' roofline."""

from __future__ import annotations

import ctypes

import torch

from kdtree.kernel.loader import _check, library


def mma_peak_tflops(warps_per_sm: int = 0) -> float:
    """The measured rate of mma.sync m16n8k16 bf16 (fp32 accumulate), the kernel's tensor instruction, on the
    current device in TFLOP/s: the compute ceiling of the benchmarks' roofline (src/peak.cu). warps_per_sm 0: every
    scheduler busy with several warps; 4: one warp per scheduler. Waits for the current stream: not for graphs."""
    if not 0 <= warps_per_sm <= 32:
        raise ValueError(f"warps_per_sm: expected 0..32, got {warps_per_sm}")
    out = ctypes.c_float()
    rc = library().kdtree_mma_peak(warps_per_sm, ctypes.byref(out), torch.cuda.current_stream().cuda_stream)
    _check(rc, "kdtree_mma_peak")
    return out.value
