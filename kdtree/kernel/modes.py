"""Live mode switching inside CUDA graphs (src/modes.cu): the mode word the host sets with a plain store, the
per-step gate and the validate-only comparison after a captured call."""

from __future__ import annotations

import ctypes

import torch

from kdtree.kernel.abi import _I32, _I64, MODE_CODES
from kdtree.kernel.checks import _index_type, _need
from kdtree.kernel.loader import _check, library
from kdtree.kernel.parity import ParityStats
from kdtree.kernel.pinned import DeviceCounter, _pinned_mapped


class ModeWord:
    """The process's verify mode in pinned host memory that the device reads: the host changes it with a plain
    store (no CUDA call, so any thread may, even while the serving thread captures a graph)."""

    def __init__(self):
        library()
        self.host, self.device_ptr = _pinned_mapped(4)
        self._word = ctypes.c_uint32.from_address(self.host.data_ptr())

    def set(self, mode: str) -> None:
        self._word.value = MODE_CODES[mode]

    def get(self) -> str:
        return next(m for m, c in MODE_CODES.items() if c == self._word.value)


def capture_id(stream: torch.cuda.Stream) -> int:
    """The id of the CUDA graph capture running on `stream`; 0 when none runs."""
    out = ctypes.c_ulonglong(0)
    _check(
        library().kdtree_capture_id(stream.cuda_stream, ctypes.byref(out)), f"kdtree_capture_id ({stream})"
    )
    return out.value


class StepCalls:
    """Pinned host memory counting the verify calls of each captured step, one slot per captured graph: the host
    counts while it captures (plain stores, allowed during capture); the step's gate reads the count at each replay
    (in on it adds it to the served counter). Allocated once, outside capture; a slot is never reused (a graph
    keeps its slot's address)."""

    def __init__(self, slots: int):
        self.host, self.device_ptr = _pinned_mapped(slots * 8)
        self._counts = (ctypes.c_ulonglong * slots).from_address(self.host.data_ptr())
        self.slots, self.used = slots, 0

    def claim(self) -> int | None:
        """A fresh slot's index (count 0), or None when every slot is taken."""
        if self.used == self.slots:
            return None
        self.used += 1
        self._counts[self.used - 1] = 0
        return self.used - 1

    def add(self, i: int) -> None:
        self._counts[i] += 1

    def device_address(self, i: int) -> int:
        return self.device_ptr + 8 * i


@torch.library.custom_op("kdtree::mode_gate", mutates_args=("mode", "qo_gated"))
def _mode_gate_op(
    host_mode_ptr: int,
    mode: torch.Tensor,
    qo_indptr: torch.Tensor,
    qo_gated: torch.Tensor,
    step_calls_ptr: int,
    counter_ptr: int,
    counter_mirror_ptr: int,
) -> None:
    rc = library().kdtree_mode_gate(
        host_mode_ptr,
        mode.data_ptr(),
        qo_indptr.data_ptr(),
        _I64 if qo_indptr.dtype == torch.int64 else _I32,
        qo_indptr.numel(),
        qo_gated.data_ptr(),
        step_calls_ptr,
        counter_ptr or None,
        counter_mirror_ptr or None,
        torch.cuda.current_stream(qo_indptr.device).cuda_stream,
    )
    _check(rc, "kdtree_mode_gate")


def mode_gate(
    word: ModeWord, mode: torch.Tensor, qo_indptr, qo_gated, step_calls_address: int, counter: DeviceCounter
) -> None:
    """Once per captured step: latch the host's mode into `mode` (int32 [1] on the device); write qo_indptr or
    zeros into qo_gated = [on | validate | original] (3 x qo_indptr's entries), the extents each launch computes;
    and, in on, add the step's captured calls (pinned count at `step_calls_address`) to the served counter."""
    n = qo_indptr.numel()
    _index_type(qo_indptr, "qo_indptr")
    _need(n >= 2, "qo_indptr", ">= 2 entries", n)
    _need(
        qo_gated.dtype == qo_indptr.dtype
        and qo_gated.numel() == 3 * n
        and qo_gated.is_contiguous()
        and qo_gated.device == qo_indptr.device,
        "qo_gated",
        f"{qo_indptr.dtype} [{3 * n}] on {qo_indptr.device} (three copies of qo_indptr)",
        f"{qo_gated.dtype} {tuple(qo_gated.shape)} on {qo_gated.device}",
    )
    _need(mode.dtype == torch.int32 and mode.numel() == 1, "mode", "an int32 [1] device tensor", mode.dtype)
    torch.ops.kdtree.mode_gate(
        word.device_ptr, mode, qo_indptr, qo_gated, step_calls_address, counter.device_ptr, counter.mirror_ptr
    )


@torch.library.custom_op("kdtree::mode_post", mutates_args=())
def _mode_post_op(
    mode: torch.Tensor, ours: torch.Tensor, orig: torch.Tensor, stats_ptr: int, mirror_ptr: int, rtol: float
) -> None:
    rc = library().kdtree_mode_post(
        mode.data_ptr(),
        ours.data_ptr(),
        orig.data_ptr(),
        ours.numel(),
        stats_ptr,
        mirror_ptr,
        rtol,
        torch.cuda.current_stream(ours.device).cuda_stream,
    )
    _check(rc, "kdtree_mode_post")


def mode_post(
    mode: torch.Tensor, ours: torch.Tensor, orig: torch.Tensor, parity: ParityStats, rtol: float | None = None
) -> None:
    """After a captured call's paths, in validate only (by the latched mode): compare `ours` with `orig`."""
    _need(
        ours.shape == orig.shape
        and ours.dtype == orig.dtype == torch.bfloat16
        and ours.is_contiguous()
        and orig.is_contiguous(),
        "ours/orig",
        "two contiguous bf16 tensors of one shape",
        lambda: f"{ours.dtype}{tuple(ours.shape)} / {orig.dtype}{tuple(orig.shape)}",
    )
    torch.ops.kdtree.mode_post(mode, ours, orig, parity.device_ptr, parity.mirror_ptr, rtol or parity.rtol)
