"""Loading the library (kdtree/lib/ in the image, kernel_build/build/ in a checkout, or KDTREE_KERNEL_LIB) and the
binding's one error path, over the library's own (src/status.cu: kdtree_last_error)."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

from kdtree.config import KernelSettings
from kdtree.kernel.abi import ABI_VERSION, LIB_NAME, STATUS, _Args


class KernelUnavailable(RuntimeError):
    """The library is missing, or has no code for this GPU."""


def _lib_candidates() -> list[Path]:
    explicit = KernelSettings.load().kernel_lib
    if explicit:
        return [Path(explicit)]  # an explicit path is the only one tried: no surprise fallbacks
    here = Path(__file__).resolve().parents[1]  # kdtree/
    return [here / "lib" / LIB_NAME, here.parent / "kernel_build" / "build" / LIB_NAME]


@functools.cache
def library() -> ctypes.CDLL:
    tried = []
    for path in _lib_candidates():
        if not path.is_file():
            tried.append(f"{path} (missing)")
            continue
        lib = ctypes.CDLL(str(path))
        lib.kdtree_abi_version.restype = ctypes.c_int
        if lib.kdtree_abi_version() != ABI_VERSION:
            raise KernelUnavailable(
                f"{path} has ABI {lib.kdtree_abi_version()}, this binding needs {ABI_VERSION}: "
                "rebuild kernel_build"
            )
        lib.kdtree_compiled_archs.restype = ctypes.c_char_p
        lib.kdtree_last_error.restype = ctypes.c_char_p
        lib.kdtree_verify_smem_bytes.argtypes = [ctypes.c_int]
        lib.kdtree_verify_ctas_per_sm.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
        lib.kdtree_verify_workspace_bytes.argtypes = [ctypes.c_int] * 5 + [ctypes.POINTER(ctypes.c_size_t)]
        lib.kdtree_verify_launch.argtypes = [ctypes.POINTER(_Args), ctypes.c_void_p]
        lib.kdtree_parity_stats_bytes.restype = ctypes.c_size_t
        lib.kdtree_parity_update.argtypes = [
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_int64,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_float,
            ctypes.c_void_p,
        ]
        lib.kdtree_host_device_pointer.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)]
        lib.kdtree_mode_gate.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 2 + [ctypes.c_void_p] * 5
        lib.kdtree_mode_post.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] + [ctypes.c_void_p] * 2
        lib.kdtree_mode_post.argtypes += [ctypes.c_float, ctypes.c_void_p]
        lib.kdtree_capture_id.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_ulonglong)]
        lib.kdtree_mma_peak.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_float), ctypes.c_void_p]
        return lib
    raise KernelUnavailable(
        "kdtree kernel library not found; tried: "
        + ", ".join(tried)
        + ". Build it (cmake -S kernel_build -B kernel_build/build && cmake --build kernel_build/build) "
        "or set KDTREE_KERNEL_LIB to its path"
    )


def compiled_archs() -> list[str]:
    """SASS architectures in the library, e.g. ['sm_90', 'sm_120']; [] when there is no library."""
    try:
        raw = library().kdtree_compiled_archs().decode()
    except KernelUnavailable:
        return []
    return [f"sm_{a}" for a in raw.split(",") if a]


def _check(rc: int, name: str, error: type[Exception] = RuntimeError) -> None:
    """The binding's one error path: unless `rc` is KDTREE_OK, raise `error` naming the entry point, its status and
    the message the library recorded (kdtree_last_error)."""
    if rc != 0:
        raise error(f"{name} failed ({STATUS.get(rc, rc)}): {library().kdtree_last_error().decode()}")
