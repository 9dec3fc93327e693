"""tree_verify: its arguments checked, then the torch op `kdtree::tree_verify` around kdtree_verify_launch
(src/tree_verify.cu) on the current stream."""

from __future__ import annotations

import ctypes
import math
import numbers

import torch

from kdtree.kernel.abi import _I32, _I64, KV_DTYPES, MAX_HEADS, MAX_Q_LEN, QK_DIM, V_DIM, _Args
from kdtree.kernel.checks import _aligned, _as_rows, _index_type, _need
from kdtree.kernel.loader import _check, library
from kdtree.kernel.pinned import DeviceCounter
from kdtree.kernel.plan import _device_plan, workspace_bytes


class Unsupported(ValueError):
    """Valid inputs that the kernel does not compute (e.g. an fp16 KV pool); the caller falls back."""


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
    q_live: torch.Tensor | None,
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
        q_live=q_live.data_ptr() if q_live is not None else None,
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
    q_live: torch.Tensor | None = None,
) -> None:
    """MLA tree-verify attention into `out` ([T, H, 512] bf16, or a [T, H*512] buffer).

    Same function as SGLang 0.5.23's extend_attention_fwd for absorbed-MLA target-verify: every draft
    token sees its request's whole prefix (pool slots kv_indices[kv_indptr[b]:kv_indptr[b+1]]) and the
    draft tokens its mask row allows (custom_mask, FULL layout at mask_indptr[b]; None = causal chain).
    An fp8 pool (float8_e4m3fn, float8_e5m2) is read as its values times kv_scales = (k_descale, v_descale),
    the scales SGLang passes its kernel; a bf16 pool is read unscaled.
    q_live (int32 [batch] on the device, or None): request b's first q_live[b] tokens are computed (clamped to
    [0, its tokens]) and its other rows of `out` written as zeros, read on the device (a tree cut inside a graph).
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
    if q_live is not None:
        _index_type(q_live, "q_live", (torch.int32,))
        _need(
            q_live.numel() >= batch and q_live.device == dev,
            "q_live",
            lambda: f">= {batch} entries (one a request) on {dev}",
            lambda: f"{q_live.numel()} on {q_live.device}",
        )
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
        q_live,
    )
