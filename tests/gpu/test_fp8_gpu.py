"""The kernel on fp8 KV pools (e4m3, e5m2) with scales: against an fp64 reference of the dequantised pool (the same
fp8 inputs) and against SGLang's own Triton extend kernel on the same pool, on the cases of test_kernel_gpu.

Both of kdtree's fp8 paths (KDTREE_FP8_PATH) apply the scales in fp32. `widen` widens the pool to f16 exactly (q and the
draft rows to f16, P in f16, an f16 mma.sync), so it must land as close to the fp64 as on a bf16 pool, and no further
than Triton, which quantises q and P to the pool's fp8 dtype. `mma` quantises q as Triton does (and P to e4m3) for an
fp8 x fp8 mma.sync, so it must land no further than 1.5 times Triton's error (kernel_build/NOTES.md, "fp8 pools").
Validate compares kdtree with Triton against kdtree.verify.FP8_PARITY_RTOL, so that bound must hold here for both.
With KDTREE_FP8_ERRORS set, each case's errors are appended to that file as JSON lines (device_run.sh fp8 keeps them).
"""

from __future__ import annotations

import json
import os

import pytest

torch = pytest.importorskip("torch")

from test_kernel_gpu import (  # noqa: E402
    CASES,
    DDTREE_CASES,
    case_id,
    replay_after_the_prefix_grew,
    run_ours,
    run_triton,
)

from kdtree import kernel  # noqa: E402
from kdtree.reference import fp8_pool, make_batch, reference, rel_l2  # noqa: E402
from kdtree.verify import FP8_PARITY_RTOL  # noqa: E402

pytestmark = pytest.mark.gpu

DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
PATHS = list(kernel.FP8_PATHS)
# (k_scale, v_scale): none, SGLang's default, and checkpoint-like scales apart (the pool holds k / k_scale)
SCALES = [(1.0, 1.0), (0.05, 2.5), (2.5, 0.3), (0.4, 0.4)]
BOUND = 1e-2  # kdtree's relative L2 from fp64 on an fp8 pool: the bf16 suite's bound
# Both kernels round their fp32 result to bf16 (unit roundoff 2^-9): with no prefix (no fp8 read) the two are equally
# exact and their errors differ in the last bit.
BF16_ROUNDING = 2.0**-9
# The mma path quantises as Triton does: its error may be at most this many times Triton's.
MMA_VS_TRITON = 1.5
# test_kernel_gpu's DDTree sizes, four of six (each runs 8 times here: dtypes x configurations x paths)
FP8_DDTREE_CASES = [DDTREE_CASES[i] for i in (0, 2, 4, 5)]


def within_bounds(err: float, tri_err: float, path: str) -> bool:
    """kdtree's error from fp64 as its path allows, against Triton's on the same case."""
    if path == "mma":
        return err <= MMA_VS_TRITON * tri_err + BF16_ROUNDING
    return err < BOUND and err <= tri_err + BF16_ROUNDING


def record(**fields) -> None:
    path = os.environ.get("KDTREE_FP8_ERRORS")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(fields) + "\n")


def assert_fp8_exact(b, config, path, label):
    """kdtree within its path's bound of the fp64 of the dequantised pool (beyond the output's bf16 rounding); Triton
    within validate's bound of kdtree."""
    ref = reference(b)
    with kernel.forced(config, path):
        ours = run_ours(b)
    tri = run_triton(b)
    err, tri_err, apart = rel_l2(ours, ref), rel_l2(tri, ref), rel_l2(tri, ours)
    dtype = str(b.k_buf.dtype).removeprefix("torch.")
    record(label=label, config=config, path=path, dtype=dtype, k_scale=b.k_scale, v_scale=b.v_scale, ours=err,
           triton=tri_err, triton_vs_ours=apart)  # fmt: skip
    print(f"{label} {path}: ours {err:.2e} triton {tri_err:.2e} apart {apart:.2e}")
    assert within_bounds(err, tri_err, path), f"ours {err:.3e} from fp64, triton {tri_err:.3e} ({path})"
    assert apart <= FP8_PARITY_RTOL[b.k_buf.dtype], f"triton {apart:.3e} from ours: over validate's bound"


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("config", list(kernel.CONFIGS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_fp8_matches_fp64_and_triton(case, dtype, config, path):
    batch, heads, q_len, prefix, tree = case
    i = CASES.index(case)
    k_scale, v_scale = SCALES[i % len(SCALES)]
    b = make_batch(batch, heads, q_len, prefix, tree=tree, seed=sum(map(ord, f"fp8{case}{config}")))
    b = fp8_pool(b, DTYPES[dtype], k_scale, v_scale)
    assert_fp8_exact(b, config, path, f"{case} {dtype} scales {k_scale}/{v_scale}")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("config", list(kernel.CONFIGS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", FP8_DDTREE_CASES, ids=case_id)
def test_fp8_ddtree_sizes_match_fp64_and_triton(case, dtype, config, path):
    """DDTree's tree sizes on fp8 pools, by both paths: N 9 and 257 at 32k, ragged N 33, the largest tree (1024)."""
    batch, heads, q_len, prefix, tree = case
    k_scale, v_scale = SCALES[1 + FP8_DDTREE_CASES.index(case) % (len(SCALES) - 1)]  # scales other than 1
    b = make_batch(batch, heads, q_len, prefix, tree=tree, seed=sum(map(ord, f"fp8ddtree{case}{config}")))
    b = fp8_pool(b, DTYPES[dtype], k_scale, v_scale)
    assert_fp8_exact(b, config, path, f"ddtree {case} {dtype} scales {k_scale}/{v_scale}")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("config", list(kernel.CONFIGS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scales", SCALES[1:], ids=lambda s: f"{s[0]}-{s[1]}")
def test_fp8_scales_and_dag_masks(scales, dtype, config, path):
    """A DAG mask (a draft token may see tokens that are not its ancestors, as a FULL mask allows) and a causal
    chain given as a mask, at every scale: the kernel reads the mask as it is, whatever the tree."""
    b = make_batch(3, 16, 16, [900, 70, 2500], seed=sum(map(ord, f"dag{scales}{dtype}{config}")))
    gen = torch.Generator().manual_seed(5)
    off = 0
    for P, n in zip(b.prefix_lens, b.q_lens, strict=True):
        block = b.custom_mask[off : off + n * (P + n)].view(n, P + n)
        extra = torch.rand(n, n, generator=gen) < 0.3  # any extra edges: a DAG, not a tree
        block[:, P:] |= extra.to(block.device)
        off += n * (P + n)
    b.parents = None  # the reference reads the mask below
    b = fp8_pool(b, DTYPES[dtype], *scales)
    ref = reference(b, from_mask=True)
    with kernel.forced(config, path):
        ours = run_ours(b)
    tri = run_triton(b)
    record(label=f"dag {scales}", config=config, path=path, dtype=dtype, k_scale=scales[0], v_scale=scales[1],
           ours=rel_l2(ours, ref), triton=rel_l2(tri, ref), triton_vs_ours=rel_l2(tri, ours))  # fmt: skip
    assert within_bounds(rel_l2(ours, ref), rel_l2(tri, ref), path)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", list(kernel.CONFIGS))
@pytest.mark.parametrize("n", [16, 129])
def test_fp8_graph_captured_at_a_short_prefix_replays_at_a_long_one(n, dtype, config, path):
    """One CUDA graph captured while the batch's prefixes are short, replayed after they grew to 30k (indptr,
    indices and mask rewritten in place, as SGLang's graph runner does): the replay equals an eager call and the
    fp64; the workspace depends on sizes only, never on the prefix. At 16 draft tokens and at a DDTree size."""
    long = fp8_pool(make_batch(2, 8, n, [30000, 12000], seed=61), DTYPES[dtype], 0.05, 2.5)
    short = fp8_pool(make_batch(2, 8, n, [100, 7], seed=62), DTYPES[dtype], 0.05, 2.5)
    replayed, eager = replay_after_the_prefix_grew(long, short, config, path)
    assert torch.equal(replayed, eager)
    tri_err = rel_l2(run_triton(long), reference(long))
    assert within_bounds(rel_l2(eager, reference(long)), tri_err, path)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("config", list(kernel.CONFIGS))
def test_fp8_pool_values_are_read_exactly_for_every_byte(config, path):
    """Every e4m3 / e5m2 byte value (but NaN and inf) as a prefix row, with one draft token whose query is zero (both
    paths then compute exactly: q and P quantise to 0 and 1): the output is the pool's value times the scale, exactly
    as torch dequantises it."""
    for dtype in DTYPES.values():
        b = make_batch(1, 1, 1, 1, tree=False, seed=3)
        codes = torch.arange(256, dtype=torch.int32)
        vals = codes.to(torch.uint8).view(dtype).float()
        finite = codes[vals.isfinite()].to(torch.uint8)
        row = torch.zeros(576, dtype=torch.uint8)  # every finite byte once among the value dims
        row[: finite.numel()] = finite
        pool = fp8_pool(b, dtype, 1.0, 0.5)
        pool.k_buf[:, 0] = row.to("cuda").view(dtype)
        pool.q.zero_()  # every score 0: the prefix row and the draft row weigh 1/2 each
        pool.k_ext.zero_()
        pool.v_ext.zero_()
        with kernel.forced(config, path):
            out = run_ours(pool)[0, 0].float()  # 0.5 * value * v_scale + 0.5 * 0
        want = row[:512].cuda().view(dtype).float() * 0.5 / 2
        assert torch.equal(out, want), dtype
