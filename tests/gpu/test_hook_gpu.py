"""GPU: the verify override inside SGLang's real TritonAttnBackend and MLATokenToKVPool, in each mode,
eager and inside real torch.cuda.CUDAGraph captures replayed with inputs changed in place.

Built with SGLang's own attention test kit (MockMLAModelRunner via build_mla_attention_fixture), at
production shapes: kv_lora_rank 512 + rope 64, bf16, one KV head, 8 and 16 heads, random topologically
ordered draft trees (EAGLE FULL-mask layout), shuffled prefix slots, k and v passed, save_kv_cache=True.

Where SGLang's compiled packages are absent, tests/gpu/conftest.py imports sglang_stubs before SGLang.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.sglang]

MAX_CONTEXT_LEN = 256
SCALE = 192**-0.5  # DeepSeek-V3's softmax scale: qk_nope + qk_rope = 192, not 576
REL_L2_TOL = 1e-2
REPLAYS = 3
CASES = [  # (heads, prefix lengths, draft tokens per request)
    pytest.param(8, (37, 200, 5), 8, id="h8-bs3-n8"),
    pytest.param(16, (64, 1, 130), 16, id="h16-bs3-n16"),
]


# ---- fixtures -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def torch():
    import torch

    return torch


@pytest.fixture(scope="module")
def kernel():
    """kdtree.kernel, or a note of why no usable kernel library is present."""
    import torch

    try:
        from kdtree import kernel as module

        module.DeviceCounter(torch.device("cuda"))
    except (ImportError, RuntimeError) as e:  # KernelUnavailable is a RuntimeError
        module = SimpleNamespace(unavailable=f"{type(e).__name__}: {e}")
    return module


@pytest.fixture
def needs_kernel(kernel):
    if getattr(kernel, "unavailable", None):
        pytest.skip(
            f"kdtree kernel library not usable here ({kernel.unavailable}); build kernel_build/ first"
        )
    return kernel


@pytest.fixture(scope="module")
def installed(kernel, tmp_path_factory):
    """The process's override, installed exactly as sitecustomize installs it; the module's SGLang pieces."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KDTREE_VERIFY", "off")
        mp.setenv("KDTREE_STATE_DIR", str(tmp_path_factory.mktemp("state")))
        import sglang.srt.layers.attention.triton_backend as tb

        from kdtree import install

        if install.current_override() is None:
            install.install_on_import(tb)
        assert install.is_installed() and install.override_layers(tb.TritonAttnBackend.forward_extend) == 1
        override = install.current_override()
        yield SimpleNamespace(override=override, install=install, cls=tb.TritonAttnBackend,
                              original=tb.TritonAttnBackend.forward_extend.__wrapped__)  # fmt: skip
        override.mode.set("off")


@contextlib.contextmanager
def no_hook(installed):
    """SGLang as it ships: forward_extend without the override."""
    wrapped = installed.cls.__dict__["forward_extend"]
    installed.cls.forward_extend = installed.original
    try:
        yield
    finally:
        installed.cls.forward_extend = wrapped


@contextlib.contextmanager
def own_override(installed, mode, monkeypatch):
    """A fresh VerifyOverride (fresh device state and parity stats) behind the installed wrapper."""
    from kdtree.config import VerifySettings
    from kdtree.verify import VerifyOverride

    fresh = VerifyOverride(VerifySettings(verify=mode))
    monkeypatch.setattr(installed.install, "_override", fresh)
    yield fresh


# ---- batches ------------------------------------------------------------------------------------------


@dataclass
class Setup:
    backend: object
    runner: object
    fb: object
    layer: object
    q: object
    k: object
    v: object
    prefix_lens: tuple
    n: int
    ancestors: list

    @property
    def kv(self):
        return self.runner.token_to_kv_pool.get_key_buffer(0)


def random_trees(count, n, gen):
    """Draft masks [n, n] of `count` random trees whose parents precede their children."""
    from kdtree.reference import random_parents, tree_mask_rows

    return [tree_mask_rows(random_parents(n, gen)) for _ in range(count)]


def full_mask(prefix_lens, ancestors):
    from kdtree.reference import full_layout_mask

    return full_layout_mask(prefix_lens, ancestors).cuda()


def build(torch, heads, prefix_lens, n, *, graphs=False, seed=0) -> Setup:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
    from sglang.srt.speculative.eagle_info import EagleVerifyInput
    from sglang.test.kits.attention_unittest.attention_methods.mla_attention import (
        MLAAttentionCase,
        build_mla_attention_fixture,
    )
    from sglang.test.kits.attention_unittest.runner_modes.speculative_target_verify_runner import (
        _prepare_target_verify_batch,
    )

    bs = len(prefix_lens)
    case = MLAAttentionCase(name=f"kdtree_h{heads}_n{n}", backend="triton", forward_mode=ForwardMode.TARGET_VERIFY,
                            num_heads=heads, page_size=1, prefix_lens=tuple(prefix_lens), extend_lens=(n,) * bs)  # fmt: skip
    kit = SimpleNamespace(skipTest=pytest.skip)
    fx = build_mla_attention_fixture(kit, case, kv_lora_rank=512, qk_rope_head_dim=64, dtype=torch.bfloat16,
                                     max_context_len=MAX_CONTEXT_LEN, disable_cuda_graph=not graphs,
                                     runner_batch_size=bs, loc_layout="shuffled_pages")  # fmt: skip
    fb = fx.forward_batch
    _prepare_target_verify_batch(fb, case, "cuda")  # seq_lens = committed prefix, as production
    gen = torch.Generator().manual_seed(seed)
    ancestors = random_trees(len(prefix_lens), n, gen)
    t = bs * n
    fb.spec_info = EagleVerifyInput(
        draft_token=fb.input_ids, custom_mask=full_mask(prefix_lens, ancestors), positions=fb.positions,
        retrieve_index=torch.arange(t, device="cuda").view(bs, n),
        retrieve_next_token=torch.full((bs, n), -1, device="cuda"),
        retrieve_next_sibling=torch.full((bs, n), -1, device="cuda"),
        retrieve_cum_len=torch.arange(bs + 1, dtype=torch.int32, device="cuda") * n,
        spec_steps=n - 1, topk=2, draft_token_num=n, capture_hidden_mode=CaptureHiddenMode.FULL,
        seq_lens_sum=fb.seq_lens_sum, seq_lens_cpu=fb.seq_lens_cpu,
    )  # fmt: skip
    layer = RadixAttention(heads, 576, scaling=SCALE, num_kv_heads=1, layer_id=0, v_head_dim=512)
    k = torch.randn(t, 1, 576, dtype=torch.bfloat16, device="cuda")
    s = Setup(fx.backend, fx.runner, fb, layer, torch.randn(t, heads, 576, dtype=torch.bfloat16, device="cuda"),
              k, k[..., :512].clone(), tuple(prefix_lens), n, ancestors)  # fmt: skip
    return s


def forward(s):
    """The production call chain: RadixAttention.forward -> backend.forward -> forward_extend (k, v, save)."""
    import torch
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    with torch.no_grad(), forward_context(ForwardContext(attn_backend=s.backend)):
        return s.layer(s.q, s.k, s.v, s.fb, save_kv_cache=True)


def eager(s):
    s.backend.init_forward_metadata(s.fb)
    return forward(s)


def reference(torch, s):
    """fp32 PyTorch attention over the pool's prefix rows and the passed draft rows, with the tree mask."""
    req_to_token = s.runner.req_to_token_pool.req_to_token
    outs = []
    for b, (p, anc) in enumerate(zip(s.prefix_lens, s.ancestors, strict=True)):
        rows = slice(b * s.n, (b + 1) * s.n)
        keys = torch.cat([s.kv[req_to_token[b, :p].long(), 0], s.k[rows, 0]]).float()
        scores = torch.einsum("ihd,nd->hin", s.q[rows].float(), keys) * SCALE
        allow = torch.ones(s.n, p + s.n, dtype=torch.bool, device="cuda")
        allow[:, p:] = anc.cuda()
        probs = torch.softmax(scores.masked_fill(~allow, float("-inf")), dim=-1)
        outs.append(torch.einsum("hin,nd->ihd", probs, keys[:, :512]))
    return torch.cat(outs).to(torch.bfloat16).view(-1, s.q.shape[1] * 512)


def rel_l2(a, b):
    from kdtree.reference import rel_l2 as rel_l2_fp64  # NaN never passes

    return rel_l2_fp64(a, b)


def snapshot(torch, override):
    torch.cuda.synchronize()  # the test reads device-side numbers once the stream is idle
    return override.snapshot()


# ---- eager --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("heads,prefix_lens,n", CASES)
def test_off_is_bit_identical_to_no_hook(torch, installed, heads, prefix_lens, n):
    s = build(torch, heads, prefix_lens, n)
    pool0 = s.kv.clone()
    with no_hook(installed):
        ref = eager(s)
    ref_pool = s.kv.clone()
    s.kv.copy_(pool0)
    installed.override.mode.set("off")
    out = eager(s)
    assert torch.equal(out, ref) and torch.equal(s.kv, ref_pool)
    assert not torch.equal(ref_pool, pool0)  # the call did write the draft KV


@pytest.mark.parametrize("heads,prefix_lens,n", CASES)
def test_on_matches_the_original_and_writes_the_same_kv_bytes(
    torch, installed, needs_kernel, heads, prefix_lens, n
):
    s = build(torch, heads, prefix_lens, n)
    pool0 = s.kv.clone()
    with no_hook(installed):
        ref = eager(s)
    ref_pool = s.kv.clone()
    assert rel_l2(ref, reference(torch, s)) <= REL_L2_TOL  # the setup itself is sound
    s.kv.copy_(pool0)
    installed.override.mode.set("on")
    before = snapshot(torch, installed.override)
    out = eager(s)
    after = snapshot(torch, installed.override)
    assert out.shape == ref.shape and out.dtype == torch.bfloat16
    assert rel_l2(out, ref) <= REL_L2_TOL, rel_l2(out, ref)
    assert torch.equal(s.kv, ref_pool)
    assert after["served_kdtree"] - before["served_kdtree"] == 1
    assert after["fallbacks"] == before["fallbacks"], after

    s.fb._attn_output = torch.empty_like(
        ref
    )  # SGLang's shared-output buffer is honoured, as the original does
    try:
        assert eager(s) is s.fb._attn_output
    finally:
        s.fb._attn_output = None


@pytest.mark.parametrize("heads,prefix_lens,n", CASES)
def test_validate_serves_the_original_and_accumulates_parity(
    torch, installed, needs_kernel, monkeypatch, heads, prefix_lens, n
):
    s = build(torch, heads, prefix_lens, n)
    pool0 = s.kv.clone()
    with no_hook(installed):
        ref = eager(s)
    ref_pool = s.kv.clone()
    s.kv.copy_(pool0)
    with own_override(installed, "validate", monkeypatch) as ov:
        out = eager(s)
        snap = snapshot(torch, ov)
    assert torch.equal(out, ref) and torch.equal(s.kv, ref_pool)
    parity = snap["parity"]
    assert parity["calls_compared"] == 1 and parity["calls_over_tol"] == 0 and parity["nan_inf"] == 0
    assert parity["max_rel_l2"] <= REL_L2_TOL and parity["max_abs_err"] < 0.1
    assert snap["served_kdtree"] == 0 and snap["fallbacks"] == {}


def _corrupting(monkeypatch, how):
    """Make every kdtree result wrong after the real kernel call (the kind of bug validate exists to catch)."""
    import kdtree.verify as verify

    real = verify.run_kernel

    def wrong(kernel, c, out, workspace, counter):
        real(kernel, c, out, workspace, counter)
        out.mul_(1.5) if how == "scaled" else out.fill_(float("nan"))

    monkeypatch.setattr(verify, "run_kernel", wrong)


@pytest.mark.parametrize("how", ["scaled", "nan"])
def test_validate_catches_a_wrong_kdtree_output(torch, installed, needs_kernel, monkeypatch, how):
    s = build(torch, 8, (50, 3), 8, seed=1)
    with no_hook(installed):
        ref = eager(s)
    _corrupting(monkeypatch, how)
    with own_override(installed, "validate", monkeypatch) as ov:
        out = eager(s)
        eager(s)
        parity = snapshot(torch, ov)["parity"]
    assert torch.equal(out, ref)  # the original still served
    assert parity["calls_compared"] == 2
    if how == "scaled":
        assert parity["calls_over_tol"] == 2 and parity["max_rel_l2"] >= 0.4 and parity["nan_inf"] == 0
    else:
        assert parity["nan_inf"] == 2


# ---- CUDA graphs --------------------------------------------------------------------------------------


def capture(torch, s, call):
    """Warm up eagerly (as SGLang does before capture), then capture `call` into a real CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    return graph, out


def graph_setup(torch, heads, prefix_lens, n):
    from sglang.test.kits.attention_unittest.runner_modes.cuda_graph_decode_runner import (
        _init_cuda_graph_capture_metadata,
    )

    s = build(torch, heads, prefix_lens, n, graphs=True)
    _init_cuda_graph_capture_metadata(
        s.backend, len(prefix_lens), s.fb
    )  # static buffers, as the graph runner
    return s


def change_inputs_in_place(torch, s, step):
    """New q/k/v, new trees and new prefix KV, written into the captured tensors; then replay metadata."""
    from sglang.test.kits.attention_unittest.runner_modes.cuda_graph_decode_runner import (
        _init_cuda_graph_replay_metadata,
    )

    gen = torch.Generator().manual_seed(100 + step)
    s.q.copy_(torch.randn(s.q.shape, generator=gen).to(s.q))
    s.k.copy_(torch.randn(s.k.shape, generator=gen).to(s.k))
    s.v.copy_(s.k[..., :512])
    s.ancestors = random_trees(len(s.prefix_lens), s.n, gen)
    s.fb.spec_info.custom_mask = full_mask(s.prefix_lens, s.ancestors)
    req_to_token = s.runner.req_to_token_pool.req_to_token
    for b, p in enumerate(s.prefix_lens):
        slots = req_to_token[b, :p].long()
        s.kv[slots] = torch.randn(p, 1, 576, generator=gen).to(s.kv)
    _init_cuda_graph_replay_metadata(s.backend, len(s.prefix_lens), s.fb)


@pytest.mark.parametrize("heads,prefix_lens,n", CASES)
def test_graphs_on_and_off_match_the_original_graph_on_every_replay(
    torch, installed, needs_kernel, heads, prefix_lens, n
):
    s = graph_setup(torch, heads, prefix_lens, n)
    with no_hook(installed):
        g_orig, out_orig = capture(torch, s, lambda: forward(s))
    installed.override.mode.set("off")
    g_off, out_off = capture(torch, s, lambda: forward(s))
    installed.override.mode.set("on")
    g_on, out_on = capture(torch, s, lambda: forward(s))
    before = snapshot(torch, installed.override)
    for step in range(REPLAYS):
        change_inputs_in_place(torch, s, step)
        g_orig.replay()
        pool_orig = s.kv.clone()
        assert rel_l2(out_orig, reference(torch, s)) <= REL_L2_TOL  # the replay saw the new inputs
        g_off.replay()
        assert torch.equal(out_off, out_orig) and torch.equal(s.kv, pool_orig)
        s.kv.copy_(pool_orig)
        g_on.replay()
        assert rel_l2(out_on, out_orig) <= REL_L2_TOL, (step, rel_l2(out_on, out_orig))
        assert torch.equal(s.kv, pool_orig)
        assert torch.equal(s.kv[s.fb.out_cache_loc], s.k)  # the draft KV went where the original puts it
    after = snapshot(torch, installed.override)
    assert (
        after["served_kdtree"] - before["served_kdtree"] == REPLAYS
    )  # the kernel counts replays on the device


def test_graph_validate_compares_every_replay_and_catches_a_wrong_output(
    torch, installed, needs_kernel, monkeypatch
):
    s = graph_setup(torch, 16, (90, 17), 8)
    with no_hook(installed):
        g_orig, out_orig = capture(torch, s, lambda: forward(s))
    with own_override(installed, "validate", monkeypatch) as good:
        g_val, out_val = capture(torch, s, lambda: forward(s))
    _corrupting(monkeypatch, "scaled")
    with own_override(installed, "validate", monkeypatch) as bad:
        g_bad, out_bad = capture(torch, s, lambda: forward(s))
    warm_good, warm_bad = snapshot(torch, good)["parity"], snapshot(torch, bad)["parity"]
    for step in range(REPLAYS):
        change_inputs_in_place(torch, s, step)
        g_orig.replay()
        g_val.replay()
        assert torch.equal(out_val, out_orig)  # validate never changes what is served
        g_bad.replay()
        assert torch.equal(out_bad, out_orig)
    p_good, p_bad = snapshot(torch, good)["parity"], snapshot(torch, bad)["parity"]
    assert p_good["calls_compared"] - warm_good["calls_compared"] == REPLAYS
    assert p_good["calls_over_tol"] == 0 and p_good["max_rel_l2"] <= REL_L2_TOL
    assert p_bad["calls_compared"] - warm_bad["calls_compared"] == REPLAYS
    assert p_bad["calls_over_tol"] - warm_bad["calls_over_tol"] == REPLAYS


def test_first_use_inside_a_capture_falls_back_to_the_original(torch, installed, kernel, monkeypatch):
    s = graph_setup(torch, 8, (40, 9), 8)
    with no_hook(installed):
        g_orig, out_orig = capture(torch, s, lambda: forward(s))  # its warm-up also compiles SGLang's kernel
    with own_override(installed, "on", monkeypatch) as fresh:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # no eager warm-up: kdtree's device state does not exist yet
            out = forward(s)
    reason = "kernel_unavailable" if getattr(kernel, "unavailable", None) else "first_use_in_capture"
    assert fresh.snapshot()["fallbacks"] == {reason: 1} and fresh.device_state() is None
    change_inputs_in_place(torch, s, 0)
    g_orig.replay()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, out_orig)
