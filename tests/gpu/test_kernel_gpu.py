"""The kernel against an fp64 reference and SGLang's own Triton extend kernel, on fresh random inputs."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from kdtree import kernel  # noqa: E402
from kdtree.bench import capture_graph  # noqa: E402
from kdtree.reference import kdtree_call, make_batch, reference, rel_l2, triton_call  # noqa: E402

pytestmark = pytest.mark.gpu


def run_ours(b, out=None, v_ext="batch", q_live=None):
    T, H = b.q.shape[:2]
    if out is None:
        out = torch.full((T, H * 512), float("nan"), dtype=torch.bfloat16, device="cuda")  # poisoned
    ws = torch.empty(
        kernel.workspace_bytes(len(b.q_lens), H, b.max_q_len, "cuda"), dtype=torch.uint8, device="cuda"
    )
    kdtree_call(b, out, ws, v_ext=v_ext, q_live=q_live)
    return out.view(T, H, 512)


def run_triton(b):
    pytest.importorskip("sglang.kernels.ops.attention.extend_attention")
    T, H = b.q.shape[:2]
    o = torch.full((T, H, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    triton_call(b, o)
    return o


CASES = [
    # batch, heads, q_len, prefix, tree
    (1, 8, 16, 4096, True),
    (1, 8, 16, 32768, True),
    (1, 16, 64, 8192, True),
    (1, 1, 16, 1000, True),
    (1, 128, 16, 2048, True),  # 32 row tiles of 64: four splits
    (4, 8, 16, 0, True),  # no prefix
    (3, 16, 1, 777, True),  # one draft token
    (2, 8, 16, 3000, False),  # DFlash chain: mask None
    # ragged prefixes
    (8, 8, 32, [5, 300, 1024, 4097, 0, 77, 2048, 9000], True),
    (64, 8, 16, 513, True),
    (2, 8, 200, 1500, True),  # draft tokens past one tile of rows
    (1, 4, 1024, 64, True),  # the largest tree
    # 66 row tiles on a 132-SM H200: two splits (wide: a cluster of two CTAs merges them on chip; compact: the
    # combine, its partial rows staged in two rounds), some requests too short for the second one
    (33, 8, 16, [5, 4096, 0, 130, 2000, 700] * 5 + [77, 3000, 1], True),
]


# DDTree's tree sizes (N = budget + 1) at its prefixes: a request's H*N rows fill 64-row tiles, and N = 2^k + 1 leaves
# the last one nearly empty (8 heads: 8 rows); up to the kernel's largest tree, MAX_Q_LEN = 1024 draft tokens.
DDTREE_CASES = [
    (1, 8, 9, 32768, True),
    (1, 16, 65, 8192, True),
    (4, 8, 33, [32768, 8192, 100, 3000], True),  # ragged, one request's prefix shorter than its tree
    (2, 16, 129, [8192, 777], True),
    (4, 8, 129, [32768, 8192, 100, 3000], True),  # 68 row tiles on an H200: 5 splits in 3 waves, ragged
    (1, 8, 257, 32768, True),
    (1, 8, 1024, 8192, True),
]


def case_id(c) -> str:
    return "b{}-h{}-n{}-p{}-{}".format(*[str(x)[:12] for x in c])


@pytest.mark.parametrize("config", list(kernel.CONFIGS))
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_matches_fp64_and_triton(case, config):
    batch, heads, q_len, prefix, tree = case
    b = make_batch(batch, heads, q_len, prefix, tree=tree, seed=sum(map(ord, f"{case}{config}")))
    assert_matches_fp64_and_triton(b, config, f"{case} {config}")


@pytest.mark.parametrize("config", list(kernel.CONFIGS))
@pytest.mark.parametrize("case", DDTREE_CASES, ids=case_id)
def test_ddtree_sizes_match_fp64_and_triton(case, config):
    batch, heads, q_len, prefix, tree = case
    b = make_batch(batch, heads, q_len, prefix, tree=tree, seed=sum(map(ord, f"ddtree{case}{config}")))
    assert_matches_fp64_and_triton(b, config, f"ddtree {case} {config}")


def assert_matches_fp64_and_triton(b, config, label):
    """Within 1e-2 of fp64 (relative L2), and no further from it than SGLang's Triton kernel (+10%, or 1e-3)."""
    ref = reference(b)
    with kernel.forced(config):
        ours = run_ours(b)
    err = rel_l2(ours, ref)
    tri = rel_l2(run_triton(b), ref)
    print(f"{label}: ours {err:.2e} triton {tri:.2e}")
    assert err <= max(1.1 * tri, 1e-3), f"ours {err:.3e} vs triton {tri:.3e}"
    assert err < 1e-2


def rising_scores(b, period=256, rise=40.0):
    """Through the rope dims (no value reads them): every prefix key's score climbs by `rise` (log2 units) over
    each `period` keys of its request, then drops back."""
    rope = slice(512, 576)
    b.q[..., rope] = 0.125  # 64 dims x 1/8: each key's rope entry a adds 8 * a * sm_scale nats
    kv = b.kv_indptr.tolist()
    for r in range(len(b.prefix_lens)):
        ramp = (torch.arange(kv[r + 1] - kv[r], device=b.q.device) % period).double() / (period - 1) * rise
        a = (ramp * math.log(2) / (8 * b.sm_scale)).to(torch.bfloat16)
        b.k_buf[b.kv_indices[kv[r] : kv[r + 1]].long(), 0, rope] = a[:, None]


@pytest.mark.parametrize("config", list(kernel.CONFIGS))
@pytest.mark.parametrize(
    "case", [CASES[1], CASES[8], (1, 8, 64, 4096, True)], ids=["b1-p32k", "ragged", "b1-n64-p4k"]
)
def test_scores_that_rise_mid_split_move_the_softmax_reference(case, config):
    """The softmax rescales O only when a tile's max passes its reference by more than 8 (log2 units); on random
    inputs that happens at the first tile alone. Here the scores climb 40 log2 units over every 256 keys, so the
    reference moves 3-4 times within each split of b1-p32k (a CPU count with 16-key tiles), and each split holds
    sawtooth tops, so every partial row weighs in the merge (1-2% each at b1-p32k). On a 132-SM H200 the cases
    take the combine's three forms: 8 groups per row (b1-p32k: 65 splits), 4 (b1-n64-p4k: 16) and one (ragged)."""
    batch, heads, q_len, prefix, tree = case
    b = make_batch(batch, heads, q_len, prefix, tree=tree, seed=sum(map(ord, f"rising{case}{config}")))
    rising_scores(b)
    assert_matches_fp64_and_triton(b, config, f"rising {case} {config}")


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.uint8])
@pytest.mark.parametrize("indptr_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("indices_dtype", [torch.int32, torch.int64])
def test_index_and_mask_dtypes(mask_dtype, indptr_dtype, indices_dtype):
    b = make_batch(
        3,
        8,
        16,
        [100, 2000, 5000],
        mask_dtype=mask_dtype,
        indptr_dtype=indptr_dtype,
        indices_dtype=indices_dtype,
        seed=7,
    )
    assert rel_l2(run_ours(b), reference(b)) < 1e-2


@pytest.mark.parametrize("v_ext", ["batch", "view", None])
def test_draft_values_forms(v_ext):
    b = make_batch(2, 8, 16, 700, seed=11)
    assert rel_l2(run_ours(b, v_ext=v_ext), reference(b)) < 1e-2


def test_separate_draft_values_are_used():
    """Draft values that differ from the keys' first 512 dims must reach the output."""
    b = make_batch(1, 8, 16, 64, seed=12)
    b.v_ext.copy_(torch.randn_like(b.v_ext, dtype=torch.float32).to(torch.bfloat16))
    assert rel_l2(run_ours(b), reference(b)) < 1e-2


def test_random_trees_many_seeds():
    for seed in range(20):
        b = make_batch(2, 8, 16, int(torch.randint(0, 3000, (1,))), seed=100 + seed)
        assert rel_l2(run_ours(b), reference(b)) < 1e-2, seed


@pytest.mark.parametrize("exp", [20, -16])
@pytest.mark.parametrize(
    "config, case",
    [
        ("wide", CASES[-1]),  # on an H200: two splits, merged in a cluster (and single-split requests)
        ("compact", CASES[4]),  # on an H200: two splits
        ("wide", CASES[1]),  # batch 1: many splits and the combine
    ],
)
def test_output_scales_exactly_with_the_values(config, case, exp):
    """Keys and values times 2^exp, queries times 2^-exp: the same scores, so every path (one split, a pair
    merged in a cluster, many splits and the combine) must return the output times 2^exp exactly, far
    outside fp16's range too (2^20: plain fp16 overflows; 2^-16: its subnormals). A path that keeps partial
    rows in a narrower format must scale them (NOTES.md: the v12 fp16 tries, the v9 fp16 partials)."""
    batch, heads, q_len, prefix, tree = case
    b = make_batch(batch, heads, q_len, prefix, tree=tree, seed=41)
    with kernel.forced(config):
        plain = run_ours(b)
        for name, e in (("q", -exp), ("k_ext", exp), ("v_ext", exp), ("k_buf", exp)):
            getattr(b, name).mul_(2.0**e)  # exact in bf16: a power of two
        scaled = run_ours(b)
    assert torch.isfinite(scaled).all()
    assert torch.equal(scaled, plain * 2.0**exp)


def test_cuda_graph_replay_equals_eager():
    b = make_batch(4, 16, 16, 4096, seed=21)
    T, H = b.q.shape[:2]
    out = torch.full((T, H * 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    ws = torch.empty(kernel.workspace_bytes(4, H, 16, "cuda"), dtype=torch.uint8, device="cuda")
    counter = kernel.DeviceCounter("cuda")
    g, _, _ = capture_graph(lambda: kdtree_call(b, out, ws, counter))  # warmed up outside capture
    for seed in range(3):
        fresh = make_batch(4, 16, 16, 4096, seed=300 + seed)
        for name in ("q", "k_ext", "v_ext", "k_buf", "kv_indices", "custom_mask"):
            getattr(b, name).copy_(getattr(fresh, name))
        b.parents = fresh.parents
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        eager = run_ours(b)
        assert torch.equal(out.view_as(eager), eager)
        assert rel_l2(out.view_as(eager), reference(b)) < 1e-2
    torch.cuda.synchronize()
    assert counter.value() == 1 + 3  # the eager warm-up and three replays; capture itself runs nothing


def replay_after_the_prefix_grew(long, short, config, path=None):
    """One CUDA graph captured while the batch's prefixes are `short`'s, replayed after they grew to `long`'s (indptr
    and mask rewritten in place, as SGLang's graph runner does; the workspace depends on sizes only): (the replay's
    output, an eager call's on the long batch), both [T, H, 512]."""
    b = long  # the graph's buffers: the long batch's, with the short batch's values in them at capture
    saved = {name: getattr(b, name).clone() for name in ("kv_indptr", "mask_indptr", "custom_mask")}
    for name in ("kv_indptr", "mask_indptr"):
        getattr(b, name).copy_(getattr(short, name))
    b.custom_mask[: short.custom_mask.numel()].copy_(short.custom_mask)
    T, H = b.q.shape[:2]
    out = torch.full((T, H * 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    with kernel.forced(config, path):
        ws = torch.empty(
            kernel.workspace_bytes(len(b.q_lens), H, b.max_q_len, "cuda"), dtype=torch.uint8, device="cuda"
        )
        g, _, _ = capture_graph(lambda: kdtree_call(b, out, ws))  # warmed up at the short prefix
        for name, t in saved.items():
            getattr(b, name).copy_(t)
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        eager = run_ours(b)
    return out.view_as(eager), eager


@pytest.mark.parametrize("config", list(kernel.CONFIGS))
@pytest.mark.parametrize("n", [17, 257])
def test_graph_captured_at_a_short_prefix_replays_at_a_long_one(n, config):
    """DDTree's sizes under a graph captured at prefixes of 100 and 7, replayed at 32k and 12k: the replay equals an
    eager call and the fp64 (the split plan follows the prefixes on the device, not the capture)."""
    long = make_batch(2, 8, n, [32768, 12000], seed=63)
    short = make_batch(2, 8, n, [100, 7], seed=64)
    replayed, eager = replay_after_the_prefix_grew(long, short, config)
    assert torch.equal(replayed, eager)
    assert rel_l2(eager, reference(long)) < 1e-2


# q_live: a tree cut to fewer tokens inside a launch sized for more (DDTREE's auto budget). Every plan: the combine
# (many splits), two splits (wide: a pair merged on chip; compact: the combine), one split; cuts inside a row tile
# and whole dead tiles, a request cut to nothing, counts past the request's tokens (clamped).
Q_LIVE_CASES = [
    (1, 8, 129, 32768, [33]),
    (1, 8, 257, 32768, [5]),  # one live tile of 33: its CTAs take the idle tiles' splits (MAX_LIVE_SPLITS)
    (2, 16, 129, [8192, 777], [129, 100]),
    (2, 16, 129, [8192, 777], [17, 0]),
    (4, 8, 257, [32768, 8192, 100, 3000], [1, 65, 300, 256]),
    (64, 8, 16, 513, [(5 * i) % 21 for i in range(64)]),
    (33, 8, 16, [5, 4096, 0, 130, 2000, 700] * 5 + [77, 3000, 1], [(7 * i) % 17 for i in range(33)]),
]


def assert_cut(b, cut, full, live):
    """Each request's first `live` tokens equal the full call's (bitwise where its live row tiles keep the plan's
    splits; within rounding where the idle tiles' CTAs split them further: live_splits in cta.cuh); the rest are
    zeros."""
    qo = b.qo_indptr.tolist()
    for r, n in enumerate(live):
        qs, qe = qo[r], qo[r + 1]
        n = min(max(n, 0), qe - qs)
        if n:
            err = rel_l2(cut[qs : qs + n], full[qs : qs + n])
            assert err < 1e-2, f"request {r}: live rows differ by {err}"
        assert bool((cut[qs + n : qe] == 0).all()), (
            f"request {r}: rows past its {n} live tokens are not zeros"
        )


@pytest.mark.parametrize("config", list(kernel.CONFIGS))
@pytest.mark.parametrize("case", Q_LIVE_CASES, ids=lambda c: case_id((*c[:4], "live")))
def test_q_live_computes_the_live_tokens_and_zeros_the_rest(case, config):
    batch, heads, q_len, prefix, live = case
    b = make_batch(batch, heads, q_len, prefix, seed=sum(map(ord, f"live{case}{config}")))
    q_live = torch.tensor(live, dtype=torch.int32, device="cuda")
    with kernel.forced(config):
        full = run_ours(b)
        cut = run_ours(b, q_live=q_live)
    assert_cut(b, cut, full, live)


@pytest.mark.parametrize("config", list(kernel.CONFIGS))
def test_q_live_is_read_on_the_device_in_a_graph(config):
    """One graph captured with q_live, replayed after its values changed (as a drafter's graph rewrites them)."""
    b = make_batch(2, 16, 129, [8192, 777], seed=71)
    T, H = b.q.shape[:2]
    out = torch.full((T, H * 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    q_live = torch.tensor([129, 129], dtype=torch.int32, device="cuda")
    with kernel.forced(config):
        full = run_ours(b)
        ws = torch.empty(kernel.workspace_bytes(2, H, 129, "cuda"), dtype=torch.uint8, device="cuda")
        g, _, _ = capture_graph(lambda: kdtree_call(b, out, ws, q_live=q_live))
        for live in ([33, 129], [129, 1], [5, 64]):
            q_live.copy_(torch.tensor(live, dtype=torch.int32))
            out.fill_(float("nan"))
            g.replay()
            torch.cuda.synchronize()
            assert_cut(b, out.view_as(full), full, live)


def test_parity_stats_catch_a_wrong_output():
    b = make_batch(1, 8, 16, 1000, seed=31)
    good = run_ours(b).reshape(16, -1).contiguous()
    stats = kernel.ParityStats("cuda", rtol=1e-2)
    stats.update(good, good.clone())
    bad = good.clone()
    bad[3] *= 1.5
    stats.update(bad, good)
    nan = good.clone()
    nan[0, 0] = float("nan")
    stats.update(nan, good)
    torch.cuda.synchronize()
    snap = stats.snapshot()
    assert snap["calls_compared"] == 3
    assert snap["calls_over_tol"] == 2
    assert snap["nan_inf"] == 1
    assert snap["max_rel_l2"] > 0.05
    assert snap["max_abs_err"] > 0


def test_bad_arguments_name_the_argument():
    b = make_batch(1, 8, 16, 100, seed=41)
    out = torch.empty(16, 8, 512, dtype=torch.bfloat16, device="cuda")
    ws = torch.empty(kernel.workspace_bytes(1, 8, 16, "cuda"), dtype=torch.uint8, device="cuda")
    base = dict(
        q=b.q,
        k_ext=b.k_ext,
        v_ext=b.v_ext,
        k_buf=b.k_buf,
        v_buf=b.v_buf,
        qo_indptr=b.qo_indptr,
        kv_indptr=b.kv_indptr,
        kv_indices=b.kv_indices,
        custom_mask=b.custom_mask,
        mask_indptr=b.mask_indptr,
        sm_scale=b.sm_scale,
        max_q_len=16,
        out=out,
        workspace=ws,
    )
    bad = {
        "q": b.q.float(),
        "k_ext": b.k_ext[:, :, :512],
        "qo_indptr": b.qo_indptr.float(),
        "kv_indices": b.kv_indices.view(1, -1),
        "out": out[:, :, :256],
        "max_q_len": 2000,
        "custom_mask": b.custom_mask.float(),
        "workspace": ws.view(torch.int8),
        "q_live": torch.ones(1, dtype=torch.int64, device="cuda"),
    }
    for name, value in bad.items():
        with pytest.raises(ValueError, match=name):
            kernel.tree_verify(**{**base, name: value})
    with pytest.raises(ValueError, match="q_live"):  # one entry a request
        kernel.tree_verify(**{**base, "q_live": torch.ones(0, dtype=torch.int32, device="cuda")})
    # The kernel folds a positive scale into its exp2 argument.
    for scale in (0.0, -b.sm_scale, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="sm_scale"):
            kernel.tree_verify(**{**base, "sm_scale": scale})
    with pytest.raises(kernel.Unsupported, match="k_buf"):
        kernel.tree_verify(**{**base, "k_buf": b.k_buf.view(torch.uint8)[..., :576]})
    with pytest.raises(kernel.Unsupported, match="v_buf"):
        kernel.tree_verify(**{**base, "v_buf": b.k_buf[..., :512].clone()})
