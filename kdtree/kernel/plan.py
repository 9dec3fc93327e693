"""The device plan (src/tree_verify.cu's host side as the binding asks it): a tile configuration's shared memory,
which configuration and fp8 path a device runs, the CTA slots that size the prefix split, and the workspace."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os

import torch

from kdtree.config import KernelSettings
from kdtree.kernel.abi import CONFIGS, FP8_PATHS
from kdtree.kernel.loader import KernelUnavailable, _check, compiled_archs, library


def smem_bytes(config: str) -> int:
    return library().kdtree_verify_smem_bytes(CONFIGS[config])


@functools.cache
def _device_plan(index: int) -> tuple[int, int, int]:
    """(resident CTA slots, tile config, fp8 path) for a device; raises KernelUnavailable if no code runs there."""
    props = torch.cuda.get_device_properties(index)
    cc = props.major * 10 + props.minor
    archs = [int(a.removeprefix("sm_")) for a in compiled_archs()]
    if not any(a // 10 == cc // 10 and a <= cc for a in archs):
        raise KernelUnavailable(
            f"the kdtree library has no code for sm_{cc} ({props.name}); it has {compiled_archs()}: "
            f"rebuild with -DCMAKE_CUDA_ARCHITECTURES including {cc} (image build arg KDTREE_CUDA_ARCHS)"
        )
    settings = KernelSettings.load()
    config = settings.kernel_config
    if (
        config is None
    ):  # the first configuration the GPU's shared memory allows, else the last (refused below)
        fits = [c for c in CONFIGS if smem_bytes(c) <= props.shared_memory_per_block_optin]
        config = fits[0] if fits else list(CONFIGS)[-1]
    need = smem_bytes(config)
    if need > props.shared_memory_per_block_optin:
        raise KernelUnavailable(
            f"config {config} needs {need} B of shared memory per block; "
            f"{props.name} allows {props.shared_memory_per_block_optin}"
        )
    per_sm = ctypes.c_int(0)
    with torch.cuda.device(index):
        rc = library().kdtree_verify_ctas_per_sm(CONFIGS[config], ctypes.byref(per_sm))
    _check(rc, f"kdtree_verify_ctas_per_sm (config {config})", KernelUnavailable)
    return props.multi_processor_count * per_sm.value, CONFIGS[config], FP8_PATHS[settings.fp8_path]


@contextlib.contextmanager
def forced(config: str | None = None, fp8_path: str | None = None):
    """Within the block, tree_verify plans in tile configuration `config` (a key of CONFIGS) and reads fp8 pools
    by `fp8_path` ('widen' or 'mma'), as KDTREE_KERNEL_CONFIG and KDTREE_FP8_PATH do for a whole process; None leaves
    that choice as it is. For benchmarks and tests that compare them in one process (a captured graph keeps what it
    was captured with)."""
    names = {"KDTREE_KERNEL_CONFIG": config, "KDTREE_FP8_PATH": fp8_path}
    old = {var: os.environ.get(var) for var in names}
    for var, value in names.items():
        if value is not None:
            os.environ[var] = value
    _device_plan.cache_clear()
    try:
        yield
    finally:
        for var, value in old.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value
        _device_plan.cache_clear()


def _device_index(device) -> int:
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"device must be a CUDA device, got {device}")
    return device.index if device.index is not None else torch.cuda.current_device()


def workspace_bytes(batch: int, num_heads: int, max_q_len: int, device) -> int:
    """Bytes of workspace tree_verify needs for these sizes on `device` (0 is possible)."""
    cta_slots, config, _ = _device_plan(_device_index(device))
    out = ctypes.c_size_t()
    rc = library().kdtree_verify_workspace_bytes(
        batch, num_heads, max_q_len, cta_slots, config, ctypes.byref(out)
    )
    _check(rc, "kdtree_verify_workspace_bytes", ValueError)
    return out.value
