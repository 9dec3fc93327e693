"""Random tree-verify batches and an fp64 reference, for tests and benchmarks.

Batches are laid out exactly as SGLang 0.5.23's TritonAttnBackend hands them to target-verify:
a pool of [S, 1, 576] rows (values = first 512 dims), prefix slots in kv_indices (shuffled),
draft rows in k_ext/v_ext, and a FULL-layout mask ([q_len, prefix + q_len] per request).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

QK_DIM, V_DIM = 576, 512


@dataclass
class VerifyBatch:
    q: torch.Tensor  # [T, H, 576] bf16
    k_ext: torch.Tensor  # [T, 1, 576]
    v_ext: torch.Tensor  # [T, 1, 512], a separate tensor holding k_ext[..., :512] (as SGLang passes it)
    k_buf: torch.Tensor  # [S, 1, 576]: bf16, or an fp8 pool (fp8_pool)
    v_buf: torch.Tensor  # view k_buf[..., :512]
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    custom_mask: torch.Tensor | None
    mask_indptr: torch.Tensor
    prefix_lens: list[int]
    q_lens: list[int]
    parents: list[list[int]]  # parents[b][i] (-1 for the root); chains when the mask is None
    sm_scale: float
    k_scale: float = (
        1.0  # the pool's scales (k_descale, v_descale): an fp8 pool reads as its values times these
    )
    v_scale: float = 1.0

    @property
    def max_q_len(self) -> int:
        return max(self.q_lens)


def random_parents(n: int, gen: torch.Generator) -> list[int]:
    """A random tree in topological order: each node's parent comes before it."""
    return [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]


def tree_mask_rows(parents: list[int]) -> torch.Tensor:
    """[n, n] bool: row i marks i and its ancestors (what draft token i may attend to)."""
    n = len(parents)
    m = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            m[i, j] = True
            j = parents[j]
    return m


def full_layout_mask(prefix_lens: list[int], draft_masks: list[torch.Tensor]) -> torch.Tensor:
    """SGLang's FULL mask layout, flat: per request a row-major [n, prefix + n] block whose prefix columns
    are all visible and whose draft columns are that request's [n, n] draft mask."""
    blocks = []
    for P, m in zip(prefix_lens, draft_masks, strict=True):
        full = torch.ones(m.shape[0], P + m.shape[0], dtype=torch.bool)
        full[:, P:] = m
        blocks.append(full.flatten())
    return torch.cat(blocks)


def make_batch(
    batch: int,
    heads: int,
    q_len: int | list[int],
    prefix: int | list[int],
    *,
    tree: bool = True,
    mask_dtype: torch.dtype = torch.bool,
    indptr_dtype: torch.dtype = torch.int32,
    indices_dtype: torch.dtype = torch.int64,
    seed: int = 0,
    device: str = "cuda",
    spare_slots: int = 64,
) -> VerifyBatch:
    gen = torch.Generator().manual_seed(seed)  # small things (trees, slots) on the CPU
    dgen = torch.Generator(device=device).manual_seed(seed)  # bulk data where it lives
    q_lens = [q_len] * batch if isinstance(q_len, int) else list(q_len)
    prefix_lens = [prefix] * batch if isinstance(prefix, int) else list(prefix)
    T, total_prefix = sum(q_lens), sum(prefix_lens)
    S = total_prefix + T + spare_slots + 1  # slot 0 stays SGLang's dummy slot

    def randn(*shape):  # never zeros: zeros hide unwritten outputs and wrong indexing
        return (torch.randn(*shape, generator=dgen, device=device) * 0.5 + 0.05).to(torch.bfloat16)

    k_buf = randn(S, 1, QK_DIM)
    q = randn(T, heads, QK_DIM)
    k_ext = randn(T, 1, QK_DIM)
    v_ext = k_ext[..., :V_DIM].clone()
    slots = (torch.randperm(S - 1, generator=gen)[:total_prefix] + 1).to(indices_dtype).to(device)
    qo = torch.tensor([0] + q_lens).cumsum(0).to(indptr_dtype).to(device)
    kv = torch.tensor([0] + prefix_lens).cumsum(0).to(indptr_dtype).to(device)
    parents, mask_ptr = [], [0]
    for P, n in zip(prefix_lens, q_lens, strict=True):
        parents.append(random_parents(n, gen) if tree else [i - 1 for i in range(n)])
        mask_ptr.append(mask_ptr[-1] + n * (P + n))
    mask = None
    if tree:
        drafts = [tree_mask_rows(par) for par in parents]
        mask = full_layout_mask(prefix_lens, drafts).to(mask_dtype).to(device)
    return VerifyBatch(
        q,
        k_ext,
        v_ext,
        k_buf,
        k_buf[..., :V_DIM],
        qo,
        kv,
        slots,
        mask,
        torch.tensor(mask_ptr, dtype=torch.int64, device=device),
        prefix_lens,
        q_lens,
        parents,
        sm_scale=float(torch.empty(1).uniform_(0.05, 0.15, generator=gen)),
    )


def fp8_pool(b: VerifyBatch, dtype: torch.dtype, k_scale: float = 1.0, v_scale: float = 1.0) -> VerifyBatch:
    """The batch with its pool quantised as SGLang's MLA path writes it (`k / k_scale`, cast to the pool's fp8
    dtype) and read back with (k_scale, v_scale); the draft rows stay bf16."""
    k_buf = (b.k_buf / k_scale).to(dtype)
    return dataclasses.replace(b, k_buf=k_buf, v_buf=k_buf[..., :V_DIM], k_scale=k_scale, v_scale=v_scale)


def reference(b: VerifyBatch, from_mask: bool = False) -> torch.Tensor:
    """fp64 attention, independent of any kernel: [T, H, 512] float64. An fp8 pool is dequantised exactly
    (its values times the batch's scales), so this is the reference of the same fp8 inputs. The draft columns'
    visibility comes from the batch's trees, or with `from_mask` from its FULL mask (any DAG written there)."""
    H = b.q.shape[1]
    out = torch.empty(b.q.shape[0], H, V_DIM, dtype=torch.float64, device=b.q.device)
    qo, kv = b.qo_indptr.tolist(), b.kv_indptr.tolist()
    mp = b.mask_indptr.tolist() if from_mask else None
    for r in range(len(b.q_lens)):
        qs, qe, ks, ke = qo[r], qo[r + 1], kv[r], kv[r + 1]
        n, P = qe - qs, ke - ks
        idx = b.kv_indices[ks:ke].long()
        K = torch.cat([b.k_buf[idx, 0].double() * b.k_scale, b.k_ext[qs:qe, 0].double()])
        V = torch.cat([b.v_buf[idx, 0].double() * b.v_scale, b.v_ext[qs:qe, 0].double()])
        s = torch.einsum("ihd,nd->hin", b.q[qs:qe].double(), K) * b.sm_scale
        if from_mask:
            allow = b.custom_mask[mp[r] : mp[r] + n * (P + n)].view(n, P + n).bool()
        else:
            allow = torch.ones(n, P + n, dtype=torch.bool, device=s.device)
            allow[:, P:] = tree_mask_rows(b.parents[r]).to(s.device)
        s = s.masked_fill(~allow, float("-inf"))
        out[qs:qe] = torch.einsum("hin,nd->ihd", torch.softmax(s, -1), V)
    return out


def rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    if not torch.isfinite(x).all():
        return float("inf")  # NaN never passes
    return float((x - ref).norm() / ref.norm())


def kdtree_call(
    b: VerifyBatch, out: torch.Tensor, workspace: torch.Tensor, counter=None, v_ext="batch", q_live=None
) -> None:
    """kdtree's kernel on a batch: out [T, H*512] or [T, H, 512]. v_ext: "batch" (a separate tensor, as
    SGLang passes it), "view" (k_ext[..., :512]) or None (values taken from the keys); q_live: the tokens of each
    request computed (int32 [batch] on the device, or None: all)."""
    from kdtree import kernel

    values = {"batch": b.v_ext, "view": b.k_ext[..., :V_DIM], None: None}[v_ext]
    kernel.tree_verify(
        b.q,
        b.k_ext,
        values,
        b.k_buf,
        b.v_buf,
        b.qo_indptr,
        b.kv_indptr,
        b.kv_indices,
        b.custom_mask,
        b.mask_indptr,
        b.sm_scale,
        b.max_q_len,
        out,
        workspace,
        counter,
        kv_scales=(b.k_scale, b.v_scale),
        q_live=q_live,
    )


def triton_call(b: VerifyBatch, out: torch.Tensor) -> None:
    """SGLang 0.5.23's Triton extend kernel on a batch, as TritonAttnBackend calls it for target-verify."""
    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd

    extend_attention_fwd(
        b.q,
        b.k_ext,
        b.v_ext,
        out,
        b.k_buf,
        b.v_buf,
        b.qo_indptr,
        b.kv_indptr,
        b.kv_indices,
        b.custom_mask,
        True,
        b.mask_indptr,
        b.max_q_len,
        b.k_scale,
        b.v_scale,
        sm_scale=b.sm_scale,
    )
