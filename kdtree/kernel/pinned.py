"""Pinned host memory mapped into the device: what kernels write for the host to read with no CUDA call (a launch
counter, the parity totals' mirror) or read from the host (the mode word, the step's call counts)."""

from __future__ import annotations

import ctypes

import torch

from kdtree.kernel.loader import KernelUnavailable, _check, library


def _pinned_mapped(nbytes: int) -> tuple[torch.Tensor, int]:
    """Zeroed pinned host memory and its address on the device (kernels read or write it there)."""
    host = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True)
    dptr = ctypes.c_void_p()
    rc = library().kdtree_host_device_pointer(host.data_ptr(), ctypes.byref(dptr))
    _check(rc, "kdtree_host_device_pointer (pinned host memory mapped into the device)", KernelUnavailable)
    return host, dptr.value


class _Mirrored:
    """Device memory the kernels update, plus a pinned host copy they write on the device."""

    def __init__(self, device, nbytes: int):
        library()
        self.device = torch.device(device)
        self.buffer = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
        self.host, self.mirror_ptr = _pinned_mapped(nbytes)
        self.device_ptr = self.buffer.data_ptr()


class DeviceCounter(_Mirrored):
    """A launch counter the kernel bumps on the device; value() reads host memory only (no CUDA call)."""

    def __init__(self, device):
        super().__init__(device, 8)

    def value(self) -> int:
        return ctypes.c_uint64.from_address(self.host.data_ptr()).value
