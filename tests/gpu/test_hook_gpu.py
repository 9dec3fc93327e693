"""GPU: the verify override inside SGLang's real TritonAttnBackend and MLATokenToKVPool, in each mode,
eager and inside real torch.cuda.CUDAGraph captures replayed with inputs changed in place.

Built with SGLang's own attention test kit (MockMLAModelRunner via build_mla_attention_fixture), at
production shapes: kv_lora_rank 512 + rope 64, bf16, one KV head, 8 and 16 heads, random topologically
ordered draft trees (EAGLE FULL-mask layout), shuffled prefix slots, k and v passed, save_kv_cache=True.

Where SGLang's compiled packages are absent, tests/gpu/conftest.py imports sglang_stubs before SGLang.
"""

from __future__ import annotations

import contextlib
import copy
from types import SimpleNamespace

import pytest
from sglang_fixture import build, capture, change_inputs_in_place, eager, forward, graph_setup, reference
from test_fp8_gpu import within_bounds  # the fp8 paths' error bounds, one definition

from kdtree.config import KernelSettings

pytestmark = [pytest.mark.gpu, pytest.mark.sglang]

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

    def wrong(kernel, c, out, workspace, counter, **kw):
        real(kernel, c, out, workspace, counter, **kw)
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


# ---- live mode switches ----------------------------------------------------------------------------------


@contextlib.contextmanager
def following_rank(installed, tmp_path, monkeypatch, start: str):
    """A fresh override started in `start`, behind the installed wrapper, with the heartbeat a rank runs: it
    follows the sidecar's mode file in tmp_path and confirms each switch in its rank record (default timing)."""
    from kdtree.config import VerifySettings
    from kdtree.state.heartbeat import Heartbeat
    from kdtree.state.mode_file import write_desired_mode
    from kdtree.verify import VerifyOverride

    write_desired_mode(tmp_path, start)
    override = VerifyOverride(VerifySettings(verify=start, state_dir=str(tmp_path)))
    evidence = Heartbeat(str(tmp_path), override.snapshot, installed.install.is_installed,
                        rank_source=lambda: (0, 1), follow=override.mode.follow)  # fmt: skip
    monkeypatch.setattr(installed.install, "_override", override)
    evidence.start(override.settings.heartbeat_s)
    try:
        yield override
    finally:
        evidence.stop()


def flip(tmp_path, mode: str, timeout: float = 10.0) -> float:
    """Write the mode file as the sidecar does; seconds until the rank record confirms the mode (the live-flip
    goal: within 10 s at the default heartbeat)."""
    import time

    from kdtree.state.mode_file import write_desired_mode
    from kdtree.state.rank_records import read_records

    start = time.monotonic()
    write_desired_mode(tmp_path, mode)
    while time.monotonic() - start < timeout:
        views = read_records(tmp_path)
        if views and views[0].record.mode == mode and views[0].record.mode_pending is None:
            return time.monotonic() - start
        time.sleep(0.05)
    raise AssertionError(
        f"the rank did not confirm mode {mode} within {timeout:g}s: {read_records(tmp_path)}"
    )


def test_live_flips_switch_the_captured_graph_without_recapture(torch, installed, needs_kernel, monkeypatch,
                                                                tmp_path):  # fmt: skip
    """validate -> on -> standby -> validate through the mode file, one graph captured once (two verify calls
    of one step, so one gate): after each flip the replay serves the new mode's path (device counters; kdtree's
    validate launch writes its scratch in validate only), the output equals the original's (bit for bit where the
    original serves), and the pool bytes are the same."""
    from kdtree import kernel as K

    s = graph_setup(torch, 8, (70, 150, 3), 16)
    with no_hook(installed):
        g_orig, out_orig = capture(torch, s, lambda: forward(s))
    captures, gates = [], []
    with following_rank(installed, tmp_path, monkeypatch, "validate") as ov:
        spy_captured, spy_gate = ov._captured, K.mode_gate
        monkeypatch.setattr(ov, "_captured", lambda *a, **kw: captures.append(1) or spy_captured(*a, **kw))
        monkeypatch.setattr(K, "mode_gate", lambda *a, **kw: gates.append(1) or spy_gate(*a, **kw))
        g_live, (out_a, out_b) = capture(torch, s, lambda: (forward(s), forward(s)))
        assert len(captures) == 2 and len(gates) == 1  # two verify calls in the step, one gate
        confirm = {}
        for step, mode in enumerate(["validate", "on", "standby", "validate"]):
            if step:
                confirm[mode] = flip(tmp_path, mode)
            change_inputs_in_place(torch, s, step)
            pool0 = s.kv.clone()
            g_orig.replay()
            pool_orig = s.kv.clone()
            s.kv.copy_(pool0)
            scratch = ov._devices[s.q.device.index]._buffers["validate_out"][0]
            scratch.fill_(0xAB)  # kdtree's validate launch writes here; in on and standby it returns at once
            before = snapshot(torch, ov)
            g_live.replay()
            after = snapshot(torch, ov)
            assert bool((scratch == 0xAB).all()) is (mode != "validate"), mode
            served = after["served_kdtree"] - before["served_kdtree"]
            compared = after["parity"]["calls_compared"] - before["parity"]["calls_compared"]
            assert (served, compared) == {"on": (2, 0), "validate": (0, 2), "standby": (0, 0)}[mode], mode
            for out in (out_a, out_b):
                if mode == "on":
                    assert rel_l2(out, out_orig) <= REL_L2_TOL, (mode, rel_l2(out, out_orig))
                else:
                    assert torch.equal(out, out_orig), mode  # the original served, bit for bit
            assert torch.equal(s.kv, pool_orig), mode
        assert len(captures) == 2 and len(gates) == 1  # nothing was recaptured
        parity = snapshot(torch, ov)["parity"]
        assert parity["calls_over_tol"] == 0 and parity["nan_inf"] == 0 and parity["max_rel_l2"] <= REL_L2_TOL
    print(f"live flip confirmed by the rank record after (s): {confirm}")
    assert max(confirm.values()) < 10.0


def test_a_rank_started_in_off_never_switches_live(torch, installed, monkeypatch, tmp_path):
    """off is the kill switch: nothing of kdtree's is captured, and a desired live mode stays pending until the
    server restarts."""
    import time

    from kdtree.state.mode_file import write_desired_mode
    from kdtree.state.rank_records import read_records

    with following_rank(installed, tmp_path, monkeypatch, "off") as ov:
        write_desired_mode(tmp_path, "on")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            views = read_records(tmp_path)
            if views and views[0].record.mode_pending:
                break
            time.sleep(0.05)
        (view,) = read_records(tmp_path)
        assert view.record.mode == "off" and view.record.mode_pending == "on" and view.record.live_modes == []
        assert ov.mode.mode.value == "off"


def test_a_graph_captured_in_standby_serves_on_after_a_live_flip(torch, installed, needs_kernel, monkeypatch):
    """A server started in standby runs nothing of kdtree's on the eager warm-ups before each capture, yet its graphs
    must hold the on path: the warm-ups size every buffer a capture needs, so the captured call is kdtree's (no
    buffer_grow_in_capture) and a flip to on serves from the graph (the real server showed 32 of 32 captures
    falling back before this was fixed)."""
    s = graph_setup(torch, 8, (70, 150, 3), 8)
    with no_hook(installed):
        g_orig, out_orig = capture(torch, s, lambda: forward(s))
    with own_override(installed, "standby", monkeypatch) as ov:
        g, out = capture(torch, s, lambda: forward(s))  # eager warm-up in standby, then the capture
        assert ov.snapshot()["fallbacks"] == {}, ov.snapshot()["fallbacks"]
        ov.mode.set("on")
        change_inputs_in_place(torch, s, 1)
        g_orig.replay()
        before = snapshot(torch, ov)["served_kdtree"]
        g.replay()
        assert snapshot(torch, ov)["served_kdtree"] == before + 1
        assert rel_l2(out, out_orig) <= REL_L2_TOL


def test_the_fixture_builds_the_calls_sglangs_runner_makes(torch, installed, needs_kernel, monkeypatch):
    """The eager and captured calls this suite builds are described (kdtree.verify.describe_call) exactly as
    sglang_fixture.EXPECTED_* say; test_engine_gpu checks the real server's against the same descriptions."""
    from sglang_fixture import EXPECTED_CAPTURED, EXPECTED_EAGER, EXPECTED_POOL, SCALE, described_dtypes

    s = graph_setup(torch, 8, (33, 90), 8)
    with own_override(installed, "validate", monkeypatch) as ov:
        capture(torch, s, lambda: forward(s))  # on the graph's static metadata, as SGLang's runner captures
    captured = ov.snapshot()["verify_inputs"]["captured"]
    assert described_dtypes(captured) == EXPECTED_CAPTURED, captured
    s = build(torch, 8, (33, 90), 8)
    with own_override(installed, "validate", monkeypatch) as ov:
        eager(s)
    seen = ov.snapshot()["verify_inputs"]["eager"]
    assert described_dtypes(seen) == EXPECTED_EAGER, seen
    assert seen["custom_mask"][1] == seen["full_mask_numel"]  # FULL layout
    for d in (captured, seen):
        assert (
            d["kv_pool"] == EXPECTED_POOL
            and d["scaling"] == pytest.approx(SCALE)
            and d["max_extend_len"] == 8
        )


# ---- fp8 KV pools -------------------------------------------------------------------------------------

FP8_POOLS = [  # (pool dtype, the checkpoint's k_scale / v_scale, or None: --kv-cache-dtype fp8 without scales)
    pytest.param("float8_e4m3fn", None, id="e4m3"),
    pytest.param("float8_e4m3fn", (0.05, 2.5), id="e4m3-scaled"),
    pytest.param("float8_e5m2", (1.5, 0.25), id="e5m2-scaled"),
]


def fp8_setup(torch, kv_dtype, kv_scales, graphs=False):
    args = dict(kv_dtype=getattr(torch, kv_dtype), kv_scales=kv_scales)
    return (
        graph_setup(torch, 8, (70, 150, 3), 16, **args)
        if graphs
        else build(torch, 16, (64, 1, 130), 16, **args)
    )


@pytest.mark.parametrize("kv_dtype,kv_scales", FP8_POOLS)
def test_fp8_pool_on_serves_and_validate_compares(
    torch, installed, needs_kernel, monkeypatch, kv_dtype, kv_scales
):
    """On an fp8 pool, eager: on serves (no fallback), writes the pool's bytes as the original does, and lands
    within the process's fp8 path's bound of the fp32 reference of the dequantised pool (widen: nearer than the
    original, whose Triton kernel quantises q and P to fp8; mma: quantises as it does, within 1.5x its error);
    validate serves the original bit for bit and its comparison stays within the fp8 bound."""
    s = fp8_setup(torch, kv_dtype, kv_scales)
    pool0 = s.kv.clone()
    with no_hook(installed):
        ref = eager(s)
    ref_pool = s.kv.clone()
    exact = reference(torch, s)
    s.kv.copy_(pool0)
    with own_override(installed, "on", monkeypatch) as ov:
        out = eager(s)
        snap = snapshot(torch, ov)
    assert snap["served_kdtree"] == 1 and snap["fallbacks"] == {}, snap
    assert torch.equal(s.kv.view(torch.uint8), ref_pool.view(torch.uint8))
    assert not torch.equal(ref_pool.view(torch.uint8), pool0.view(torch.uint8))  # the draft KV was written
    ours, theirs = rel_l2(out, exact), rel_l2(ref, exact)
    path = KernelSettings().fp8_path
    print(f"{kv_dtype} {kv_scales} {path}: ours {ours:.2e} original {theirs:.2e} from the fp32 reference")
    assert within_bounds(ours, theirs, path)
    s.kv.copy_(pool0)
    with own_override(installed, "validate", monkeypatch) as ov:
        out_v = eager(s)
        snap = snapshot(torch, ov)
    assert torch.equal(out_v, ref) and snap["fallbacks"] == {}
    parity = snap["parity"]
    assert parity["calls_compared"] == 1 and parity["calls_over_tol"] == 0 and parity["nan_inf"] == 0, parity


@pytest.mark.parametrize("kv_dtype,kv_scales", FP8_POOLS)
def test_fp8_pool_graph_serves_every_live_mode_without_recapture(
    torch, installed, needs_kernel, monkeypatch, kv_dtype, kv_scales
):
    """One graph captured once on an fp8 pool, replayed in validate, on, standby and validate again with new inputs
    each time: on serves kdtree's path (device counter), validate compares every replay within the fp8 bound, the
    original serves bit for bit elsewhere, and the pool's bytes are the original's in every mode."""
    s = fp8_setup(torch, kv_dtype, kv_scales, graphs=True)
    with no_hook(installed):
        g_orig, out_orig = capture(torch, s, lambda: forward(s))
    with own_override(installed, "validate", monkeypatch) as ov:
        g_live, out = capture(torch, s, lambda: forward(s))
        for step, mode in enumerate(["validate", "on", "standby", "validate"]):
            ov.mode.set(mode)
            change_inputs_in_place(torch, s, step)
            pool0 = s.kv.clone()
            g_orig.replay()
            pool_orig = s.kv.clone()
            s.kv.copy_(pool0)
            before = snapshot(torch, ov)
            g_live.replay()
            after = snapshot(torch, ov)
            served = after["served_kdtree"] - before["served_kdtree"]
            compared = after["parity"]["calls_compared"] - before["parity"]["calls_compared"]
            assert (served, compared) == {"on": (1, 0), "validate": (0, 1), "standby": (0, 0)}[mode], mode
            if mode == "on":
                exact = reference(torch, s)
                ours, theirs = rel_l2(out, exact), rel_l2(out_orig, exact)
                assert within_bounds(ours, theirs, KernelSettings().fp8_path), (ours, theirs)
            else:
                assert torch.equal(out, out_orig), mode
            assert torch.equal(s.kv.view(torch.uint8), pool_orig.view(torch.uint8)), mode
        snap = snapshot(torch, ov)
    assert snap["fallbacks"] == {} and snap["parity"]["calls_over_tol"] == 0, snap


# ---- DDTREE's cut (its auto budget) ------------------------------------------------------------------------------


def assert_cut(torch, got, full, live, n, heads):
    """Request b's first live[b] tokens equal the whole verify's (within rounding: a cut may split its live row
    tiles further); its other rows are zeros."""
    rows = got.view(-1, n, heads * 512)
    want = full.view(-1, n, heads * 512)
    for b, keep in enumerate(live):
        keep = min(keep, n)
        if keep:
            assert rel_l2(rows[b, :keep], want[b, :keep]) <= REL_L2_TOL, b
        assert not rows[b, keep:].any(), b


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph"])
def test_a_ddtree_verify_computes_its_cut_in_on_and_every_token_in_validate(
    torch, installed, needs_kernel, monkeypatch, graphs
):
    """The live-rows buffer DDTREE's worker writes (VerifyOverride.ddtree_live_rows) is read by the on launch of a
    verify whose spec algorithm is DDTREE (kdtree's own DDTreeSpec here), on the device: a graph captured once serves
    every cut. Another algorithm's verify and validate's comparison compute every token."""
    from kdtree.ddtree.spec import DDTreeSpec

    heads, prefix_lens, n = 8, (37, 200, 5), 8
    s = graph_setup(torch, heads, prefix_lens, n) if graphs else build(torch, heads, prefix_lens, n)
    pool0 = s.kv.clone()
    with own_override(installed, "on", monkeypatch) as override:
        live = override.ddtree_live_rows(s.q.device)
        assert live is not None and live.dtype == torch.int32
        live[:3].copy_(
            torch.tensor([3, 8, 1], dtype=torch.int32)
        )  # written before it is used: not DDTREE's yet
        # the fixture's spec algorithm (EAGLE's): every token; a graph set-up's metadata is the capture's, kept
        full = (forward(s) if graphs else eager(s)).clone()
        s.kv.copy_(pool0)
        s.fb.spec_algorithm = DDTreeSpec("DDTREE", None)
        cuts = ([3, 8, 1], [1, 5, 8], [0, 2, 100])  # 0: nothing; 100: clamped to the request's tokens
        if graphs:
            g, out = capture(torch, s, lambda: forward(s))
        for cut in cuts:
            live[:3].copy_(torch.tensor(cut, dtype=torch.int32))
            s.kv.copy_(pool0)
            if graphs:
                g.replay()
                got = out
            else:
                got = eager(s)
            assert_cut(torch, got, full, cut, n, heads)
        served = snapshot(torch, override)["served_kdtree"]
        assert served == len(cuts) + (
            1 if not graphs else 2
        )  # graphs: the warm-up run before the capture too
        assert override.serving()
        override.mode.set("validate")
        live[:3].copy_(torch.tensor([1, 1, 1], dtype=torch.int32))
        s.kv.copy_(pool0)
        if graphs:
            g.replay()
        else:
            s.fb = copy.copy(s.fb)  # a new step: an eager call reads the mode once a step (forward batch)
            got = eager(s)
            assert rel_l2(got, full) <= REL_L2_TOL  # the original's, every token
        parity = snapshot(torch, override)["parity"]
        assert parity["calls_compared"] == 1 and parity["calls_over_tol"] == 0, parity
        assert not override.serving()
