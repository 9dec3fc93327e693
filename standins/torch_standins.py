"""Torch-native stand-ins, with the real meaning, for the few compiled SGLang functions the real server calls on the
GPU machine, where SGLang's compiled packages (sgl_kernel, built for another torch) cannot be installed.
standins/sglang_stubs.py routes calls of those names here; every other compiled function stays a stub that raises.

- `rmsnorm(x, weight, eps)`: sgl_kernel's RMSNorm, out = x / rms(x) * weight, computed in fp32 and returned in x's dtype
  (SGLang's RMSNorm.forward_native is the reference: tests/kernel_build/test_real_server_tools.py checks it against float64).
- `fused_add_rmsnorm(x, residual, weight, eps)`: in place, residual <- x + residual (rounded to its dtype), then
  x <- rmsnorm of the fp32 sum (as sgl_kernel's fused kernel: the norm reads the unrounded sum).
- `moe_align_block_size(...)`: sgl_kernel's MoE token alignment (the NEXTN draft layer is MoE); SGLang ships a JIT
  kernel with the same contract (sglang.kernels.ops.moe.moe_align), which this calls.
- `moe_sum_reduce(x, out, scale)`: sgl_kernel's sum of the top-k expert outputs, out = scale * x.sum(1), which SGLang
  calls for MoE batches past its small-batch path; SGLang ships a Triton kernel with the same contract
  (sglang.kernels.ops.moe.fused_moe_triton_kernels.moe_sum_reduce_triton), which this calls.
- `top_p_renorm_probs(probs, top_p)`, `top_k_renorm_probs(probs, top_k)`: FlashInfer's renormalisation of each row to
  its top-p mass / top-k tokens, which DFLASH's verify sampling calls (and rehearses at start-up, greedy traffic or
  not); SGLang ships Triton kernels with the same contract for the platforms without FlashInfer
  (sglang.kernels.ops.sampling.renorm_triton), which these call.
- `tree_speculative_sampling_target_only(...)`: SGLang's JIT rejection-sampling verify
  (sglang/kernels/jit/include/sgl_kernel/speculative/sampling.cuh, TreeSpeculativeSamplingTargetOnly), whose build
  needs FlashInfer's headers. DFLASH calls it on a chain for sampled requests and rehearses it at start-up
  (DFlashWorkerV2.prewarm_sampling). This is the kernel's walk, line for line, in Python on host copies: it
  synchronises, so it must not run inside a CUDA-graph capture (it raises there, as .cpu() does), and it is slow;
  the greedy requests the tests send never reach it after start-up. Installed over SGLang's name by
  standins/sglang_stubs.py (PATCHED below).

Apart from the tree sampling stand-in, nothing here synchronises with the host or allocates more than the result, so
the stand-ins run inside SGLang's CUDA-graph captures as the compiled kernels do.
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


def top_p_renorm_probs(probs, top_p):
    from sglang.kernels.ops.sampling.renorm_triton import top_p_renorm_probs_triton

    return top_p_renorm_probs_triton(probs, top_p)


def top_k_renorm_probs(probs, top_k):
    from sglang.kernels.ops.sampling.renorm_triton import top_k_renorm_probs_triton

    return top_k_renorm_probs_triton(probs, top_k)


def tree_speculative_sampling_target_only(
    predicts,  # mutable, [bs * num_draft] (indexed by retrive_index values)
    accept_index,  # mutable, [bs, num_spec]
    accept_token_num,  # mutable, [bs]
    candidates,  # [bs, num_draft]
    retrive_index,
    retrive_next_token,
    retrive_next_sibling,
    uniform_samples,  # [bs, num_draft]
    uniform_samples_for_final_sampling,  # [bs]
    target_probs,  # [bs * num_draft, d] (or [bs, num_draft, d])
    draft_probs,  # mutable, same shape
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
    deterministic: bool = True,
) -> None:
    bs, num_draft = candidates.shape
    num_spec = accept_index.shape[1]
    d = target_probs.shape[-1]
    cand, r_index, r_next, r_sib = (t.cpu() for t in (candidates, retrive_index, retrive_next_token,
                                                      retrive_next_sibling))  # fmt: skip
    coins, final_coins = uniform_samples.float().cpu(), uniform_samples_for_final_sampling.float().cpu()
    q_all = target_probs.reshape(bs, num_draft, d).cpu()
    p_all = draft_probs.reshape(bs, num_draft, d).cpu()
    pred, acc_index, acc_num = predicts.cpu(), accept_index.cpu(), accept_token_num.cpu()
    for b in range(bs):
        prob_acc, row, coin = 0.0, 0, float(coins[b, 0])
        last = int(r_index[b, 0])
        acc_index[b, 0] = last
        accepted, cur = 0, 0
        for _ in range(1, num_spec):
            cur = int(r_next[b, cur])
            while cur != -1:
                token = int(cand[b, cur])
                p = float(q_all[b, row, token])
                prob_acc += p
                if p > 0 and (coin < prob_acc / threshold_acc or p >= threshold_single):  # accept
                    prob_acc, row, coin = 0.0, cur, float(coins[b, cur])
                    pred[last] = token
                    accepted += 1
                    last = int(r_index[b, cur])
                    acc_index[b, accepted] = last
                    break
                p_all[b, row, token] = q_all[b, row, token]  # the kernel's "draft probs": rejected mass
                cur = int(r_sib[b, cur])
            if cur == -1:
                break
        acc_num[b] = accepted
        q = q_all[
            b, row
        ].float()  # sample the first rejected token from relu(q - p) (no p for the bonus token)
        relu = (q - p_all[b, row].float()).clamp_min(0) if accepted != num_spec - 1 else q.clamp_min(0)
        u = float(final_coins[b]) * float(relu.sum())
        hit = torch.nonzero((relu.cumsum(0) > u) & (relu > 0))
        valid = torch.nonzero(relu > 0)
        pred[last] = int(hit[0]) if len(hit) else (int(valid[-1]) if len(valid) else d - 1)
    predicts.copy_(pred)
    accept_index.copy_(acc_index)
    accept_token_num.copy_(acc_num)
    draft_probs.copy_(p_all.reshape(draft_probs.shape))


KNOWN = {
    "sgl_kernel.rmsnorm": rmsnorm,
    "sgl_kernel.fused_add_rmsnorm": fused_add_rmsnorm,
    "sgl_kernel.moe_align_block_size": moe_align_block_size,
    "sgl_kernel.moe_sum_reduce": moe_sum_reduce,
    "sgl_kernel.utils.is_arch_support_pdl": lambda *a, **k: False,  # no programmatic dependent launch
    "flashinfer.sampling.top_p_renorm_probs": top_p_renorm_probs,
    "flashinfer.sampling.top_k_renorm_probs": top_k_renorm_probs,
}
# SGLang's own Python names whose implementation cannot be built here (a JIT kernel needing FlashInfer's headers):
# module -> {name: stand-in}, set on the module as soon as it is imported (standins/sglang_stubs.py), before any
# `from module import name` copies it.
PATCHED = {
    "sglang.kernels.ops.speculative.sampling": {
        "tree_speculative_sampling_target_only": tree_speculative_sampling_target_only
    },
}
