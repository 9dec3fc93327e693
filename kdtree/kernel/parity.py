"""Validate mode's parity totals on the device (src/parity.cu): kdtree's output compared with the served one."""

from __future__ import annotations

import torch

from kdtree.kernel.abi import ParityTotals
from kdtree.kernel.checks import _need
from kdtree.kernel.loader import _check, library
from kdtree.kernel.pinned import _Mirrored


@torch.library.custom_op("kdtree::parity_update", mutates_args=())
def _parity_update_op(
    ours: torch.Tensor, ref: torch.Tensor, stats_ptr: int, mirror_ptr: int, rtol: float
) -> None:
    rc = library().kdtree_parity_update(
        ours.data_ptr(),
        ref.data_ptr(),
        ours.numel(),
        stats_ptr,
        mirror_ptr,
        rtol,
        torch.cuda.current_stream(ours.device).cuda_stream,
    )
    _check(rc, "kdtree_parity_update")


class ParityStats(_Mirrored):
    """Validate-mode totals accumulated on the device; snapshot() reads the host mirror only."""

    def __init__(self, device, rtol: float):
        super().__init__(device, library().kdtree_parity_stats_bytes())
        self.rtol = float(rtol)

    def update(self, ours: torch.Tensor, ref: torch.Tensor, rtol: float | None = None) -> None:
        """Compare one call; `rtol` (default: the stats' own) is the bound it counts calls_over_tol against."""
        _need(
            ours.shape == ref.shape
            and ours.dtype == ref.dtype == torch.bfloat16
            and ours.is_contiguous()
            and ref.is_contiguous(),
            "ours/ref",
            "two contiguous bf16 tensors of one shape",
            f"{ours.dtype}{tuple(ours.shape)} / {ref.dtype}{tuple(ref.shape)}",
        )
        torch.ops.kdtree.parity_update(ours, ref, self.device_ptr, self.mirror_ptr, rtol or self.rtol)

    def snapshot(self) -> dict:
        t = ParityTotals.from_address(self.host.data_ptr())
        return {
            "calls_compared": t.calls_compared,
            "max_abs_err": t.max_abs_err,
            "max_rel_l2": t.max_rel_l2,
            "calls_over_tol": t.calls_over_tol,
            "nan_inf": t.nan_inf,
            "rtol": t.rtol
            if t.calls_compared
            else self.rtol,  # the bound the last compared call was counted by
        }
