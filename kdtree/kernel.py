"""Binding of the CUDA library (kernel_build/) as torch custom ops.

The library has a C ABI and no libtorch link; this module loads it with ctypes and exposes
`torch.ops.kdtree.tree_verify`, `parity_update`, `mode_gate` and `mode_post`. Launches go to the current
stream, use a caller-owned workspace, never allocate and never synchronise with the host, so they
can be captured in a CUDA graph. Argument checks read metadata only (shape, dtype, stride, device).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import math
import numbers
import os
from pathlib import Path

import torch

from kdtree.config import KernelSettings

LIB_NAME = "libkdtree_verify.so"
QK_DIM, V_DIM = 576, 512
MAX_HEADS, MAX_Q_LEN = 128, 1024
ABI_VERSION = 7  # kernel_build/include/kdtree_verify.h
CONFIGS = {"wide": 1, "compact": 2}  # wide: sm_90/sm_100 shared memory; compact: sm_120's 99 KB
# Pool dtypes (enum kdtree_kv_dtype): SGLang's MLA pool for --kv-cache-dtype auto, fp8_e4m3 and fp8_e5m2.
KV_DTYPES = {torch.bfloat16: 0, torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}
# How an fp8 pool's prefix is computed (enum kdtree_fp8_path, KDTREE_FP8_PATH): widened exactly to f16, or fp8 x fp8.
FP8_PATHS = {"widen": 0, "mma": 1}
_I32, _I64 = 0, 1


class KernelUnavailable(RuntimeError):
    """The library is missing, or has no code for this GPU."""


class Unsupported(ValueError):
    """Valid inputs that the kernel does not compute (e.g. an fp16 KV pool); the caller falls back."""


class _Args(ctypes.Structure):
    _fields_ = [
        ("q", ctypes.c_void_p),
        ("q_stride_t", ctypes.c_int64),
        ("q_stride_h", ctypes.c_int64),
        ("k_ext", ctypes.c_void_p),
        ("k_ext_stride", ctypes.c_int64),
        ("v_ext", ctypes.c_void_p),
        ("v_ext_stride", ctypes.c_int64),
        ("k_buf", ctypes.c_void_p),
        ("k_buf_stride", ctypes.c_int64),
        ("qo_indptr", ctypes.c_void_p),
        ("qo_indptr_type", ctypes.c_int),
        ("kv_indptr", ctypes.c_void_p),
        ("kv_indptr_type", ctypes.c_int),
        ("kv_indices", ctypes.c_void_p),
        ("kv_indices_type", ctypes.c_int),
        ("mask", ctypes.c_void_p),
        ("mask_indptr", ctypes.c_void_p),
        ("mask_indptr_type", ctypes.c_int),
        ("out", ctypes.c_void_p),
        ("out_stride_t", ctypes.c_int64),
        ("out_stride_h", ctypes.c_int64),
        ("workspace", ctypes.c_void_p),
        ("workspace_bytes", ctypes.c_size_t),
        ("counter", ctypes.c_void_p),
        ("counter_mirror", ctypes.c_void_p),
        ("sm_scale", ctypes.c_float),
        ("batch", ctypes.c_int),
        ("num_heads", ctypes.c_int),
        ("max_q_len", ctypes.c_int),
        ("cta_slots", ctypes.c_int),
        ("config", ctypes.c_int),
        ("kv_dtype", ctypes.c_int),
        ("k_scale", ctypes.c_float),
        ("v_scale", ctypes.c_float),
        ("fp8_path", ctypes.c_int),
    ]


class ParityTotals(ctypes.Structure):
    _fields_ = [
        ("calls_compared", ctypes.c_uint64),
        ("calls_over_tol", ctypes.c_uint64),
        ("nan_inf", ctypes.c_uint64),
        ("max_abs_err", ctypes.c_float),
        ("max_rel_l2", ctypes.c_float),
        ("last_rel_l2", ctypes.c_float),
        ("rtol", ctypes.c_float),
    ]


def _lib_candidates() -> list[Path]:
    explicit = KernelSettings.load().kernel_lib
    if explicit:
        return [Path(explicit)]  # an explicit path is the only one tried: no surprise fallbacks
    here = Path(__file__).resolve().parent
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


# enum kdtree_status of kernel_build/include/kdtree_verify.h (tests/test_kernel_abi.py holds them to it)
STATUS = {0: "KDTREE_OK", 1: "KDTREE_ERR_ARGUMENT", 2: "KDTREE_ERR_WORKSPACE", 3: "KDTREE_ERR_CUDA"}


def _check(rc: int, name: str, error: type[Exception] = RuntimeError) -> None:
    """The binding's one error path: unless `rc` is KDTREE_OK, raise `error` naming the entry point, its status and
    the message the library recorded (kdtree_last_error)."""
    if rc != 0:
        raise error(f"{name} failed ({STATUS.get(rc, rc)}): {library().kdtree_last_error().decode()}")


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
    if config is None:
        config = "wide" if props.shared_memory_per_block_optin >= smem_bytes("wide") else "compact"
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
    """Within the block, tree_verify plans in tile configuration `config` ('wide' or 'compact') and reads fp8 pools
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


def _need(cond: bool, arg: str, expected, got) -> None:
    """Raise ValueError naming `arg` unless `cond`. `expected` and `got` may be callables, formatted only on
    failure: the checks run on every eager call (once per attention layer), so the passing path stays cheap."""
    if not cond:
        expected = expected() if callable(expected) else expected
        got = got() if callable(got) else got
        raise ValueError(f"{arg}: expected {expected}, got {got}")


def _index_type(t: torch.Tensor, arg: str, allowed=(torch.int32, torch.int64)) -> int:
    _need(t.dtype in allowed, arg, "int32 or int64" if len(allowed) == 2 else str(allowed[0]), t.dtype)
    _need(
        t.dim() == 1 and t.stride(0) == 1,
        arg,
        "a contiguous 1-D tensor",
        lambda: f"shape {tuple(t.shape)} stride {t.stride()}",
    )
    return _I64 if t.dtype == torch.int64 else _I32


def _aligned(t: torch.Tensor, arg: str, *strides: int) -> None:
    per16 = 16 // t.element_size()  # elements in 16 bytes: 8 bf16, 16 fp8
    _need(
        t.data_ptr() % 16 == 0 and all(s % per16 == 0 for s in strides),
        arg,
        f"16-byte aligned rows (pointer and row strides multiples of {per16} elements)",
        lambda: f"strides {t.stride()}",
    )


def _as_rows(t: torch.Tensor, arg: str, width: int) -> torch.Tensor:
    """[T, 1, width] or [T, width] with a contiguous last dim -> [T, width] view."""
    if t.dim() == 3:
        _need(t.shape[1] == 1, arg, lambda: f"[T, 1, {width}] (one latent KV head)", lambda: tuple(t.shape))
        t = t[:, 0]
    _need(
        t.dim() == 2 and t.shape[1] == width and t.stride(1) == 1,
        arg,
        lambda: f"[T, 1, {width}] with a contiguous last dim",
        lambda: f"shape {tuple(t.shape)} stride {t.stride()}",
    )
    return t


@torch.library.custom_op("kdtree::tree_verify", mutates_args=("out", "workspace"))
def _tree_verify_op(
    q: torch.Tensor,
    k_ext: torch.Tensor,
    v_ext: torch.Tensor | None,
    k_buf: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    custom_mask: torch.Tensor | None,
    mask_indptr: torch.Tensor | None,
    sm_scale: float,
    max_q_len: int,
    out: torch.Tensor,
    workspace: torch.Tensor,
    counter_ptr: int,
    counter_mirror_ptr: int,
    k_scale: float,
    v_scale: float,
) -> None:
    lib = library()
    cta_slots, config, fp8_path = _device_plan(q.device.index)
    a = _Args(
        q=q.data_ptr(),
        q_stride_t=q.stride(0),
        q_stride_h=q.stride(1),
        k_ext=k_ext.data_ptr(),
        k_ext_stride=k_ext.stride(0),
        v_ext=v_ext.data_ptr() if v_ext is not None else None,
        v_ext_stride=v_ext.stride(0) if v_ext is not None else 0,
        k_buf=k_buf.data_ptr(),
        k_buf_stride=k_buf.stride(0),
        qo_indptr=qo_indptr.data_ptr(),
        qo_indptr_type=_I64 if qo_indptr.dtype == torch.int64 else _I32,
        kv_indptr=kv_indptr.data_ptr(),
        kv_indptr_type=_I64 if kv_indptr.dtype == torch.int64 else _I32,
        kv_indices=kv_indices.data_ptr(),
        kv_indices_type=_I64 if kv_indices.dtype == torch.int64 else _I32,
        mask=custom_mask.data_ptr() if custom_mask is not None else None,
        mask_indptr=mask_indptr.data_ptr() if mask_indptr is not None else None,
        mask_indptr_type=_I64 if mask_indptr is not None and mask_indptr.dtype == torch.int64 else _I32,
        out=out.data_ptr(),
        out_stride_t=out.stride(0),
        out_stride_h=out.stride(1),
        workspace=workspace.data_ptr() if workspace.numel() else None,
        workspace_bytes=workspace.numel(),
        counter=counter_ptr or None,
        counter_mirror=counter_mirror_ptr or None,
        sm_scale=sm_scale,
        batch=qo_indptr.numel() - 1,
        num_heads=q.shape[1],
        max_q_len=max_q_len,
        cta_slots=cta_slots,
        config=config,
        kv_dtype=KV_DTYPES[k_buf.dtype],
        k_scale=k_scale,
        v_scale=v_scale,
        fp8_path=fp8_path,
    )
    rc = lib.kdtree_verify_launch(ctypes.byref(a), torch.cuda.current_stream(q.device).cuda_stream)
    _check(rc, "kdtree_verify_launch")


def tree_verify(
    q,
    k_ext,
    v_ext,
    k_buf,
    v_buf,
    qo_indptr,
    kv_indptr,
    kv_indices,
    custom_mask,
    mask_indptr,
    sm_scale: float,
    max_q_len: int,
    out,
    workspace,
    counter: DeviceCounter | None = None,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> None:
    """MLA tree-verify attention into `out` ([T, H, 512] bf16, or a [T, H*512] buffer).

    Same function as SGLang 0.5.23's extend_attention_fwd for absorbed-MLA target-verify: every draft
    token sees its request's whole prefix (pool slots kv_indices[kv_indptr[b]:kv_indptr[b+1]]) and the
    draft tokens its mask row allows (custom_mask, FULL layout at mask_indptr[b]; None = causal chain).
    An fp8 pool (float8_e4m3fn, float8_e5m2) is read as its values times kv_scales = (k_descale, v_descale),
    the scales SGLang passes its kernel; a bf16 pool is read unscaled.
    """
    if k_buf.dtype not in KV_DTYPES:
        raise Unsupported(
            f"k_buf: KV cache dtype {k_buf.dtype} is not supported (bf16, float8_e4m3fn or float8_e5m2)"
        )
    k_scale, v_scale = kv_scales
    for name, x in (("k_scale", k_scale), ("v_scale", v_scale)):
        _need(isinstance(x, numbers.Real) and math.isfinite(x) and x > 0, name, "a positive finite float", x)
    if k_buf.dtype == torch.bfloat16 and (k_scale, v_scale) != (1.0, 1.0):
        raise Unsupported(f"kv_scales {kv_scales} on a bf16 pool: kdtree reads a bf16 pool unscaled")
    _need(q.dtype == torch.bfloat16, "q", "bfloat16", q.dtype)
    _need(q.is_cuda, "q", "a CUDA tensor", q.device)
    dev = q.device
    if q.dim() == 2:
        _need(q.shape[1] % QK_DIM == 0, "q", f"[T, H*{QK_DIM}]", lambda: tuple(q.shape))
        q = q.view(q.shape[0], -1, QK_DIM)
    _need(
        q.dim() == 3 and q.shape[2] == QK_DIM and q.stride(2) == 1,
        "q",
        f"[T, H, {QK_DIM}] with a contiguous last dim",
        lambda: f"shape {tuple(q.shape)} stride {q.stride()}",
    )
    T, H = q.shape[0], q.shape[1]
    _need(1 <= H <= MAX_HEADS, "q", f"1..{MAX_HEADS} heads", H)
    _need(
        isinstance(max_q_len, int) and 1 <= max_q_len <= MAX_Q_LEN,
        "max_q_len",
        f"an int in 1..{MAX_Q_LEN}",
        max_q_len,
    )
    _aligned(q, "q", q.stride(0), q.stride(1))
    _need(
        isinstance(sm_scale, numbers.Real) and math.isfinite(sm_scale) and sm_scale > 0,
        "sm_scale",
        "a positive finite float",
        sm_scale,
    )
    for name, t in (
        ("k_ext", k_ext),
        ("k_buf", k_buf),
        ("out", out),
        ("qo_indptr", qo_indptr),
        ("kv_indptr", kv_indptr),
        ("kv_indices", kv_indices),
        ("workspace", workspace),
    ):
        _need(t.device == dev, name, lambda: f"on {dev} like q", t.device)
    k_ext = _as_rows(k_ext, "k_ext", QK_DIM)
    _need(
        k_ext.dtype == torch.bfloat16 and k_ext.shape[0] == T,
        "k_ext",
        lambda: f"bfloat16 with {T} rows",
        lambda: f"{k_ext.dtype} {tuple(k_ext.shape)}",
    )
    _aligned(k_ext, "k_ext", k_ext.stride(0))
    k_rows = _as_rows(k_buf, "k_buf", QK_DIM)
    _aligned(k_rows, "k_buf", k_rows.stride(0))
    _need(k_rows.stride(0) < 2**31, "k_buf", "a row stride below 2^31 elements", k_rows.stride(0))
    v_rows = _as_rows(v_buf, "v_buf", V_DIM)
    if (
        v_rows.data_ptr() != k_rows.data_ptr()
        or v_rows.stride(0) != k_rows.stride(0)
        or v_rows.dtype != k_rows.dtype
    ):
        raise Unsupported("v_buf must be the first 512 dims of k_buf (MLATokenToKVPool's layout)")
    if v_ext is not None:
        v_ext = _as_rows(v_ext, "v_ext", V_DIM)
        _need(
            v_ext.device == dev and v_ext.dtype == torch.bfloat16 and v_ext.shape[0] == T,
            "v_ext",
            lambda: f"bfloat16 [T={T}, 1, 512] on {dev}",
            lambda: f"{v_ext.dtype} {tuple(v_ext.shape)} {v_ext.device}",
        )
        _aligned(v_ext, "v_ext", v_ext.stride(0))
        if v_ext.data_ptr() == k_ext.data_ptr() and v_ext.stride(0) == k_ext.stride(0):
            v_ext = None  # values already are the keys' first 512 dims
    if out.dim() == 2:
        _need(out.shape == (T, H * V_DIM), "out", lambda: f"[{T}, {H * V_DIM}]", lambda: tuple(out.shape))
        out = out.view(T, H, V_DIM)
    _need(
        out.dim() == 3
        and tuple(out.shape) == (T, H, V_DIM)
        and out.stride(2) == 1
        and out.dtype == torch.bfloat16,
        "out",
        lambda: f"bfloat16 [{T}, {H}, {V_DIM}] with a contiguous last dim",
        lambda: f"{out.dtype} {tuple(out.shape)}",
    )
    _aligned(out, "out", out.stride(0), out.stride(1))
    _index_type(qo_indptr, "qo_indptr")
    _index_type(kv_indptr, "kv_indptr")
    _index_type(kv_indices, "kv_indices")
    batch = qo_indptr.numel() - 1
    _need(
        batch >= 1 and kv_indptr.numel() == batch + 1,
        "kv_indptr",
        lambda: f"{batch + 1} entries like qo_indptr",
        kv_indptr.numel(),
    )
    if custom_mask is not None:
        _need(
            custom_mask.dtype in (torch.bool, torch.uint8)
            and custom_mask.dim() == 1
            and custom_mask.stride(0) == 1,
            "custom_mask",
            "a contiguous 1-D bool or uint8 tensor (SGLang's FULL layout) or None",
            lambda: f"{custom_mask.dtype} shape {tuple(custom_mask.shape)}",
        )
        _need(custom_mask.device == dev, "custom_mask", lambda: f"on {dev}", custom_mask.device)
        _need(mask_indptr is not None, "mask_indptr", "a tensor when custom_mask is given", None)
        _index_type(mask_indptr, "mask_indptr")
        _need(
            mask_indptr.numel() >= batch + 1 and mask_indptr.device == dev,
            "mask_indptr",
            lambda: f">= {batch + 1} entries on {dev}",
            lambda: f"{mask_indptr.numel()} on {mask_indptr.device}",
        )
        custom_mask = custom_mask.view(torch.uint8) if custom_mask.dtype == torch.bool else custom_mask
    else:
        mask_indptr = None
    _need(
        workspace.dtype == torch.uint8 and workspace.is_contiguous(),
        "workspace",
        "a contiguous uint8 tensor",
        workspace.dtype,
    )
    need = workspace_bytes(batch, H, max_q_len, dev)
    _need(
        workspace.numel() >= need,
        "workspace",
        lambda: f">= {need} bytes (kdtree.kernel.workspace_bytes)",
        workspace.numel(),
    )
    torch.ops.kdtree.tree_verify(
        q,
        k_ext,
        v_ext,
        k_rows,
        qo_indptr,
        kv_indptr,
        kv_indices,
        custom_mask,
        mask_indptr,
        float(sm_scale),
        max_q_len,
        out,
        workspace,
        counter.device_ptr if counter else 0,
        counter.mirror_ptr if counter else 0,
        float(k_scale),
        float(v_scale),
    )


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


# ---- live mode switching inside CUDA graphs (kernel_build/src/modes.cu) ----------------------------------
MODE_CODES = {"off": 0, "validate": 1, "on": 2, "standby": 3}  # enum kdtree_mode


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
