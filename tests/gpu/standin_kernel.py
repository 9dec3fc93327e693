"""A STAND-IN for kdtree.kernel, for checking the override's plumbing on a GPU before the kernel exists.

It speaks kdtree.kernel's contract (names, arguments, exceptions) but computes with SGLang's own Triton
extend kernel, so "on matches the original" is trivially exact with it; only the real kernel makes that
comparison meaningful. Its counters are plain device tensors and snapshot()/value() read them with a sync,
which the real library avoids with pinned host mirrors: call them only outside capture, after a sync.
Selected by KDTREE_TEST_KERNEL=standin in tests/gpu/test_hook_gpu.py; never used in production.
"""

from __future__ import annotations

import torch
from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd


class KernelUnavailable(RuntimeError):
    pass


class Unsupported(ValueError):
    pass


def compiled_archs() -> list[str]:
    return ["stand-in"]


def workspace_bytes(batch: int, num_heads: int, max_q_len: int, device) -> int:
    return 0


class DeviceCounter:
    def __init__(self, device):
        self.t = torch.zeros(1, dtype=torch.int64, device=device)

    def value(self) -> int:
        return int(self.t.item())


class ParityStats:
    def __init__(self, device, rtol: float):
        self.rtol = rtol
        self.t = torch.zeros(5, dtype=torch.float32, device=device)  # calls, max_abs, max_rel_l2, over_tol, nan_inf

    def update(self, ours: torch.Tensor, ref: torch.Tensor) -> None:
        d = ours.float() - ref.float()
        finite = torch.isfinite(ours).all()
        abs_err = torch.nan_to_num(d.abs().amax(), nan=float("inf"))
        rel = torch.nan_to_num(d.norm() / ref.float().norm().clamp_min(1e-30), nan=float("inf"))
        self.t[0] += 1
        self.t[1] = torch.maximum(self.t[1], abs_err)
        self.t[2] = torch.maximum(self.t[2], rel)
        self.t[3] += (rel > self.rtol).float()
        self.t[4] += (~finite).float()

    def snapshot(self) -> dict:
        calls, max_abs, max_rel, over, nan_inf = self.t.tolist()
        return {"calls_compared": int(calls), "max_abs_err": max_abs, "max_rel_l2": max_rel,
                "calls_over_tol": int(over), "nan_inf": int(nan_inf), "rtol": self.rtol}  # fmt: skip


def tree_verify(q, k_ext, v_ext, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, custom_mask, mask_indptr,
                sm_scale, max_q_len, out, workspace, counter=None) -> None:  # fmt: skip
    extend_attention_fwd(q, k_ext.contiguous(), v_ext.contiguous(), out, k_buf, v_buf, qo_indptr, kv_indptr,
                         kv_indices, custom_mask, True, mask_indptr, max_q_len, 1.0, 1.0, sm_scale)  # fmt: skip
    if counter is not None:
        counter.t.add_(1)
