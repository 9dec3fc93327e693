"""Host time per eager tree_verify call, by layer of the binding.

Under CUDA graphs (how SGLang runs target-verify) none of this is paid; in eager mode it is paid once per
attention layer per verify step. Run on a GPU machine:
    python kernel_build/bench/tuning/host_overhead.py [--profile]
--profile adds where kernel.tree_verify's host time goes (cProfile, top functions by own time).
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import time

import torch

from kdtree import kernel
from kdtree.reference import make_batch

CALLS = 200


def per_call_us(fn) -> float:
    """Host time of one call: the calls queue behind a GPU spin, so the GPU's own time does not count."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU spin, longer than the loop below
        t0 = time.perf_counter()
        for _ in range(CALLS):
            fn()
        best = min(best, (time.perf_counter() - t0) / CALLS * 1e6)
        torch.cuda.synchronize()
    return best


def main() -> None:
    b = make_batch(1, 8, 16, 1024, seed=0)
    T, H = b.q.shape[:2]
    out = torch.empty(T, H * 512, dtype=torch.bfloat16, device="cuda")
    ws = torch.empty(kernel.workspace_bytes(1, H, b.max_q_len, "cuda"), dtype=torch.uint8, device="cuda")
    args = (b.q, b.k_ext, b.v_ext, b.k_buf, b.v_buf, b.qo_indptr, b.kv_indptr, b.kv_indices, b.custom_mask,
            b.mask_indptr, b.sm_scale, b.max_q_len, out, ws)  # fmt: skip
    op_args = (b.q, b.k_ext, b.v_ext, b.k_buf[:, 0], b.qo_indptr, b.kv_indptr, b.kv_indices,
               b.custom_mask.view(torch.uint8), b.mask_indptr, b.sm_scale, b.max_q_len, out.view(T, H, 512),
               ws, 0, 0, 1.0, 1.0, None)  # fmt: skip
    kernel.verify_op._tree_verify_op(*op_args)  # warm the plan cache
    rows = [
        ("kernel.tree_verify (checks + custom op + launch)", per_call_us(lambda: kernel.tree_verify(*args))),
        ("torch.ops.kdtree.tree_verify (dispatch + launch)", per_call_us(lambda: torch.ops.kdtree.tree_verify(*op_args))),
        ("op body called directly (argument block + launch)", per_call_us(lambda: kernel.verify_op._tree_verify_op(*op_args))),
        ("kernel.workspace_bytes", per_call_us(lambda: kernel.workspace_bytes(1, H, b.max_q_len, "cuda"))),
    ]  # fmt: skip
    try:  # for scale: the Triton kernel this replaces, same batch
        from kdtree.reference import triton_call

        o = torch.empty(T, H, 512, dtype=torch.bfloat16, device="cuda")
        rows.append(("SGLang's extend_attention_fwd (Triton launch)", per_call_us(lambda: triton_call(b, o))))
    except ImportError:
        pass
    gpu = torch.cuda.get_device_name()
    print(f"GPU: {gpu}, torch {torch.__version__}; host us per call, best of 5 x {CALLS}")
    print("| layer | us |\n|---|---|")
    for name, us in rows:
        print(f"| {name} | {us:.1f} |")
    if "--profile" in sys.argv:
        prof = cProfile.Profile()
        prof.runcall(lambda: [kernel.tree_verify(*args) for _ in range(CALLS)])
        torch.cuda.synchronize()
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
