"""Torch-native stand-ins, with the real meaning, for the few compiled SGLang functions the real server calls on the
GPU machine, where SGLang's compiled packages (sgl_kernel, built for another torch) cannot be installed.
tests/gpu/sglang_stubs.py routes calls of those names here; every other compiled function stays a stub that raises.

- `rmsnorm(x, weight, eps)`: sgl_kernel's RMSNorm, out = x / rms(x) * weight, computed in fp32 and returned in x's dtype
  (SGLang's RMSNorm.forward_native is the reference: tests/test_real_server_tools.py checks it against float64).
- `fused_add_rmsnorm(x, residual, weight, eps)`: in place, residual <- x + residual (rounded to its dtype), then
  x <- rmsnorm of the fp32 sum (as sgl_kernel's fused kernel: the norm reads the unrounded sum).
- `moe_align_block_size(...)`: sgl_kernel's MoE token alignment (the NEXTN draft layer is MoE); SGLang ships a JIT
  kernel with the same contract (sglang.kernels.ops.moe.moe_align), which this calls.
- `moe_sum_reduce(x, out, scale)`: sgl_kernel's sum of the top-k expert outputs, out = scale * x.sum(1), which SGLang
  calls for MoE batches past its small-batch path; SGLang ships a Triton kernel with the same contract
  (sglang.kernels.ops.moe.fused_moe_triton_kernels.moe_sum_reduce_triton), which this calls.

Nothing here synchronises with the host or allocates more than the result, so the stand-ins run inside SGLang's
CUDA-graph captures as the compiled kernels do.
"""

from __future__ import annotations

import torch


def rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, out=None, enable_pdl=None
) -> torch.Tensor:
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
    if out is not None:
        out.copy_(y)
        return out
    return y


def fused_add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, enable_pdl=None
) -> None:
    total = x.float() + residual.float()
    residual.copy_(total)
    x.copy_((total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype))


def moe_align_block_size(
    topk_ids,
    num_experts,
    block_size,
    sorted_token_ids,
    expert_ids,
    num_tokens_post_pad,
    cumsum_buffer,
    pad_sorted_token_ids=False,
    ignore_invalid_expert=False,
) -> None:
    if ignore_invalid_expert:
        raise NotImplementedError("moe_align_block_size stand-in: ignore_invalid_expert is not stood in for")
    from sglang.kernels.ops.moe.moe_align import moe_align_block_size as jit

    jit(topk_ids, num_experts, block_size, sorted_token_ids, expert_ids, num_tokens_post_pad, cumsum_buffer,
        pad_sorted_token_ids)  # fmt: skip


def moe_sum_reduce(x, out, routed_scaling_factor) -> None:
    from sglang.kernels.ops.moe.fused_moe_triton_kernels import moe_sum_reduce_triton

    moe_sum_reduce_triton(x, out, routed_scaling_factor)


KNOWN = {
    "sgl_kernel.rmsnorm": rmsnorm,
    "sgl_kernel.fused_add_rmsnorm": fused_add_rmsnorm,
    "sgl_kernel.moe_align_block_size": moe_align_block_size,
    "sgl_kernel.moe_sum_reduce": moe_sum_reduce,
    "sgl_kernel.utils.is_arch_support_pdl": lambda *a, **k: False,  # no programmatic dependent launch
}
