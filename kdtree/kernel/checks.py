"""Argument checks on tensor metadata (shape, dtype, stride, device): every failure a ValueError in one form,
"arg: expected X, got Y"."""

from __future__ import annotations

import torch

from kdtree.kernel.abi import _I32, _I64


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
