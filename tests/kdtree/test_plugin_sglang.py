"""The override's install paths and dispatch, against the real sglang 0.5.23 (CPU: no kernel runs here).

Install tests run in fresh interpreters (a spawned child or a subprocess), as SGLang's own processes are.
Dispatch tests drive VerifyOverride with stand-in backend/layer/batch objects that carry the attributes
SGLang's TritonAttnBackend.forward_extend reads; the forward mode is SGLang's real ForwardMode.
"""

from __future__ import annotations

import contextlib
import io
import json
import multiprocessing as mp
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

# The dispatch cases below build torch tensors as the module is collected.
pytest.importorskip(
    "torch", reason="torch is not installed (the server extra: pip install -e '.[server,dev]')"
)

# SGLang imports flashinfer/cutlass modules that warn about deprecations and missing GPUs on a CPU machine.
pytestmark = [
    pytest.mark.sglang,
    pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning"),
]

ROOT = Path(__file__).resolve().parents[2]
ENTRYPOINT_DIR = ROOT / "entrypoint"
INSTALL_LINE = re.compile(
    r"^\[kdtree\] installed verify override \(mode=(\w+), pid=(\d+), tp_rank=(\?|\d+), via=(entry-point|import-hook)\)$",
    re.M,
)

# Prints, as JSON on the last line: who installed, how many kdtree wrappers forward_extend carries.
REPORT = """
import json, sys
from kdtree import install
tb = sys.modules.get(install.TARGET_MODULE)
layers = install.override_layers(tb.TritonAttnBackend.forward_extend) if tb else None
print(json.dumps({"by": install.installed_by(), "layers": layers,
                  "torch": "torch" in sys.modules, "sglang": "sglang" in sys.modules}))
"""
IMPORT_BACKEND = "import sglang.srt.layers.attention.triton_backend\n"
LOAD_PLUGINS = "from sglang.srt.plugins import load_plugins\nload_plugins()\n"


def _env(tmp_path, mode="validate", sitecustomize=False, **extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("KDTREE_") and k != "PYTHONPATH"}
    env.update(KDTREE_VERIFY=mode, KDTREE_STATE_DIR=str(tmp_path / "state"), PYTHONWARNINGS="ignore", **extra)
    if sitecustomize:
        env["PYTHONPATH"] = str(ENTRYPOINT_DIR)
    return env


def _python(code: str, env: dict, cwd) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=cwd, capture_output=True, text=True, timeout=300
    )


def _report(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---- entry point, found by SGLang's own load_plugins in a spawned child ---------------------------------


def _child_load_plugins(conn) -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        from importlib.metadata import entry_points

        from sglang.srt.plugins import load_plugins

        from kdtree import install

        load_plugins()
        from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

        eps = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    conn.send(
        {
            "entry_points": eps,
            "by": install.installed_by(),
            "layers": install.override_layers(TritonAttnBackend.forward_extend),
            "stdout": out.getvalue(),
            "sitecustomize": "sitecustomize" in sys.modules and "kdtree" in str(sys.modules["sitecustomize"]),
        }
    )


def test_entry_point_is_loaded_by_sglang_load_plugins_in_a_spawned_child(tmp_path, monkeypatch):
    for k, v in _env(tmp_path).items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    ctx = mp.get_context("spawn")  # SGLang starts its schedulers this way
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_child_load_plugins, args=(child,))
    proc.start()
    try:
        assert parent.poll(240), "the spawned child reported nothing"
        got = parent.recv()
    finally:
        proc.join(60)
    assert proc.exitcode == 0
    assert got["entry_points"].get("kdtree") == "kdtree.plugin:register"
    assert got["by"] == "entry-point" and not got["sitecustomize"]
    assert got["layers"] == 1
    lines = INSTALL_LINE.findall(got["stdout"])
    assert lines == [("validate", str(proc.pid), "?", "entry-point")]


# ---- sitecustomize -------------------------------------------------------------------------------------


def test_sitecustomize_does_nothing_in_a_process_that_never_imports_sglang(tmp_path):
    code = (
        "import sys, json, sitecustomize\n"
        "print(json.dumps({'file': sitecustomize.__file__, 'torch': 'torch' in sys.modules,"
        " 'sglang': 'sglang' in sys.modules, 'kdtree': 'kdtree' in sys.modules,"
        " 'hook': [type(f).__name__ for f in sys.meta_path].count('_BackendImportHook')}))\n"
    )
    proc = _python(code, _env(tmp_path, sitecustomize=True), tmp_path)
    got = _report(proc)
    assert Path(got["file"]) == ENTRYPOINT_DIR / "sitecustomize.py"
    assert got == {**got, "torch": False, "sglang": False, "kdtree": False, "hook": 1}
    assert "[kdtree]" not in proc.stdout
    assert not (tmp_path / "state").exists()


def test_sitecustomize_still_runs_the_sitecustomize_it_shadows(tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import builtins\nbuiltins.OTHER_SITECUSTOMIZE = True\n")
    env = _env(tmp_path, sitecustomize=True)
    env["PYTHONPATH"] += os.pathsep + str(other)
    proc = _python("import builtins; print(getattr(builtins, 'OTHER_SITECUSTOMIZE', False))", env, tmp_path)
    assert proc.stdout.strip() == "True", proc.stderr


def test_sitecustomize_wraps_forward_extend_when_the_triton_backend_is_imported(tmp_path):
    proc = _python(IMPORT_BACKEND + REPORT, _env(tmp_path, mode="on", sitecustomize=True), tmp_path)
    got = _report(proc)
    assert got["by"] == "import-hook" and got["layers"] == 1
    assert [(m[0], m[3]) for m in INSTALL_LINE.findall(proc.stdout)] == [("on", "import-hook")]


@pytest.mark.parametrize("order", ["plugins-then-backend", "backend-then-plugins"])
def test_entry_point_and_sitecustomize_together_wrap_once(tmp_path, order):
    code = LOAD_PLUGINS + IMPORT_BACKEND if order == "plugins-then-backend" else IMPORT_BACKEND + LOAD_PLUGINS
    proc = _python(code + REPORT, _env(tmp_path, sitecustomize=True), tmp_path)
    got = _report(proc)
    assert got["layers"] == 1
    assert got["by"] == ("entry-point" if order == "plugins-then-backend" else "import-hook")
    assert [m[3] for m in INSTALL_LINE.findall(proc.stdout)] == [got["by"]], proc.stdout


@pytest.mark.parametrize("path", ["entry-point", "sitecustomize"])
def test_a_bad_kdtree_verify_fails_loudly(tmp_path, path):
    code = LOAD_PLUGINS if path == "entry-point" else IMPORT_BACKEND
    proc = _python(
        code + "print('still running')",
        _env(tmp_path, mode="fast", sitecustomize=path == "sitecustomize"),
        tmp_path,
    )
    assert proc.returncode != 0
    assert "still running" not in proc.stdout
    assert "KDTREE_VERIFY='fast' is invalid: set it to one of: off, validate, on" in proc.stderr


# ---- dispatch ------------------------------------------------------------------------------------------


class StandInPool:
    """Stands in for MLATokenToKVPool: only the dtype of a layer's key buffer is read by the predicate."""

    def __init__(self, dtype):
        import torch

        self.buf = torch.zeros(4, 1, 576, dtype=dtype)

    def get_key_buffer(self, layer_id):
        return self.buf


def _call(**changes):
    """A target-verify call that only the CPU device keeps from the kernel; `changes` edit one part."""
    import torch
    from sglang.srt.layers.radix_attention import AttentionType
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from kdtree.verify import VerifyCall

    layer = SimpleNamespace(
        layer_id=0, qk_head_dim=576, v_head_dim=512, tp_q_head_num=8, tp_k_head_num=1, sliding_window_size=-1,
        k_scale=None, v_scale=None, logit_cap=0.0, is_cross_attention=False, attn_type=AttentionType.DECODER,
        xai_temperature_len=-1, scaling=0.1,
    )  # fmt: skip
    backend = SimpleNamespace(
        is_draft_runner=False, dcp_size=1, enable_deterministic=False, dllm_attention=None, use_mla=True,
        token_to_kv_pool=StandInPool(torch.bfloat16),
        forward_metadata=SimpleNamespace(custom_mask=torch.ones(16, dtype=torch.bool)),
    )  # fmt: skip
    fb = SimpleNamespace(forward_mode=ForwardMode.TARGET_VERIFY, mha_one_shot=False)
    parts = dict(
        backend=backend, q=torch.zeros(4, 8, 576, dtype=torch.bfloat16), k=torch.zeros(4, 1, 576, dtype=torch.bfloat16),
        v=torch.zeros(4, 1, 512, dtype=torch.bfloat16), layer=layer, forward_batch=fb,
    )  # fmt: skip
    for key, value in changes.items():
        obj, _, attr = key.partition(".")
        if attr:
            setattr(parts[obj], attr, value(parts[obj]) if callable(value) else value)
        else:
            parts[key] = value(parts) if callable(value) else value
    return VerifyCall(**parts)


def _tensor(shape, dtype_name):
    import torch

    return lambda _: torch.zeros(*shape, dtype=getattr(torch, dtype_name))


def _mode(name):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    return getattr(ForwardMode, name)


FALLBACKS = [
    ({"forward_batch.forward_mode": lambda _: _mode("EXTEND")}, "not_target_verify"),
    ({"forward_batch.forward_mode": lambda _: _mode("DECODE")}, "not_target_verify"),
    ({"backend.is_draft_runner": True}, "draft_runner"),
    ({"layer.qk_head_dim": 192}, "head_dims"),
    ({"layer.v_head_dim": 128}, "head_dims"),
    ({"layer.tp_k_head_num": 8}, "kv_heads"),
    ({"k": None, "v": None}, "kv_not_passed"),
    ({"sinks": object()}, "sinks"),
    ({"score_mod": object()}, "score_mod"),
    ({"layer.sliding_window_size": 4096}, "sliding_window"),
    ({"backend.dcp_size": 2}, "dcp"),
    ({"layer.k_scale": 0.5, "layer.v_scale": 0.5}, "kv_scale"),  # no k_scale_float: weights not processed
    ({"backend.token_to_kv_pool": lambda _: StandInPool(__import__("torch").float16)}, "kv_dtype"),
    ({"backend.token_to_kv_pool": lambda _: StandInPool(__import__("torch").float8_e4m3fn)}, "not_cuda"),
    ({"layer.logit_cap": 30.0}, "logit_cap"),
    ({"layer.is_cross_attention": True}, "not_causal"),
    ({"backend.enable_deterministic": True}, "deterministic"),
    ({"q": _tensor((4, 8, 576), "float16")}, "dtype"),
    ({"k": _tensor((3, 1, 576), "bfloat16")}, "kv_rows"),
    (
        {"backend.forward_metadata": lambda _: SimpleNamespace(custom_mask=__import__("torch").zeros(4))},
        "mask_dtype",
    ),
    ({}, "not_cuda"),  # everything else eligible: only a CUDA device is missing here
    (
        {"backend.forward_metadata": lambda _: SimpleNamespace(custom_mask=None)},
        "not_cuda",
    ),  # a chain: no mask
]


@pytest.mark.parametrize("changes,reason", FALLBACKS, ids=[r + ":" + ",".join(c) for c, r in FALLBACKS])
def test_dispatch_picks_the_fallback_reason(changes, reason):
    from kdtree.verify import fallback_reason

    assert fallback_reason(_call(**changes)) == reason


def _override(mode):
    from kdtree.config import VerifySettings
    from kdtree.verify import VerifyOverride

    return VerifyOverride(VerifySettings(verify=mode))


class RecordingOriginal:
    def __init__(self):
        self.calls = []
        self.result = object()

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return self.result


@pytest.mark.parametrize("mode", ["off", "validate", "on"])
def test_the_original_gets_identical_arguments_when_it_serves(mode):
    c = _call()
    args = (c.backend, c.q, c.k, c.v, c.layer, c.forward_batch)
    kwargs = {"save_kv_cache": False, "sinks": None}
    original = RecordingOriginal()
    override = _override(mode)
    assert override(original, *args, **kwargs) is original.result
    (got_args, got_kwargs), = original.calls  # fmt: skip
    assert len(got_args) == len(args) and all(a is b for a, b in zip(got_args, args, strict=True))
    assert got_kwargs == kwargs and all(got_kwargs[k] is kwargs[k] for k in kwargs)
    snap = override.snapshot()
    assert snap["served_original"] == 1 and snap["served_kdtree"] == 0
    assert snap["fallbacks"] == ({} if mode == "off" else {"not_cuda": 1})


@pytest.mark.parametrize("mode", ["on", "off"])
@pytest.mark.parametrize(
    "changes",
    [{"forward_batch.forward_mode": lambda _: _mode("EXTEND")}, {"backend.is_draft_runner": True}],
    ids=["extend", "draft-runner-in-target-verify"],
)
def test_calls_that_are_not_target_verify_are_passed_through_uncounted(changes, mode):
    """Any other forward mode, and a drafter's own forward in target-verify mode (DFLASH's block drafter)."""
    c = _call(**changes)
    original = RecordingOriginal()
    override = _override(mode)
    assert override(original, c.backend, c.q, c.k, c.v, c.layer, c.forward_batch) is original.result
    assert override.snapshot()["served_original"] == 0 and override.snapshot()["fallbacks"] == {}


def test_a_missing_kernel_library_is_a_counted_fallback(monkeypatch):
    import torch

    import kdtree

    monkeypatch.setitem(sys.modules, "kdtree.kernel", None)  # `from kdtree import kernel` raises ImportError
    monkeypatch.delattr(kdtree, "kernel", raising=False)  # ...also when an earlier test imported it
    override = _override("on")
    assert override._ready(torch.device("cuda", 0), capturing=False) == (None, "kernel_unavailable")
    assert "kdtree.kernel does not import" in override.snapshot()["last_error"]


class StandInKernel:
    """Stands in for kdtree.kernel's device-state classes; buffer handling is plain torch on the CPU."""

    class KernelUnavailable(RuntimeError):
        pass

    class DeviceCounter:
        def __init__(self, device):
            pass

        def value(self):
            return 7

    class ParityStats:
        def __init__(self, device, rtol):
            self.rtol = rtol

        def snapshot(self):
            return {"calls_compared": 3, "max_abs_err": 0.0, "max_rel_l2": 0.001, "calls_over_tol": 0, "nan_inf": 0,
                    "rtol": self.rtol}  # fmt: skip


def test_device_buffers_grow_outside_capture_only_and_captured_ones_stay_alive():
    import torch

    from kdtree.verify import DeviceState

    state = DeviceState(StandInKernel, torch.device("cpu"), 0.02)
    first = state.buffer("ws", 100, torch.uint8, capturing=False)
    assert first.numel() == 100 and first.untyped_storage().nbytes() == 128
    assert state.buffer("ws", 128, torch.uint8, capturing=True).data_ptr() == first.data_ptr()  # fits: reused
    assert state.buffer("ws", 129, torch.uint8, capturing=True) is None  # would grow during capture
    grown = state.buffer("ws", 129, torch.uint8, capturing=False)
    assert grown.numel() == 129 and grown.data_ptr() != first.data_ptr()
    assert any(
        kept.data_ptr() == first.data_ptr() for kept in state._kept
    )  # a captured graph still writes there


def test_snapshot_reads_the_kernel_host_mirrors():
    import torch

    from kdtree.verify import DeviceState

    override = _override("validate")
    override._devices[0] = DeviceState(StandInKernel, torch.device("cpu"), 0.02)
    snap = override.snapshot()
    assert snap["served_kdtree"] == 7 and snap["parity"]["calls_compared"] == 3 and snap["mode"] == "validate"


def test_the_mode_lives_in_one_holder_per_override():
    c = _call()
    original = RecordingOriginal()
    override = _override("validate")
    override.mode.set("off")
    override(original, c.backend, c.q, c.k, c.v, c.layer, c.forward_batch)
    assert override.snapshot()["fallbacks"] == {}  # off: no dispatch at all
    with pytest.raises(ValueError):
        override.mode.set("fast")


def test_tp_rank_lookup_reads_sglang_runtime_context_without_publish():
    from sglang.srt import runtime_context

    from kdtree.state.heartbeat import scheduler_tp_rank

    assert callable(runtime_context.publish_role) and callable(runtime_context.get_parallel)
    assert runtime_context.publish_role() is None
    assert scheduler_tp_rank() is None  # not a published scheduler: no record, no guess


# ---- fp8 KV pools, with SGLang's real MLATokenToKVPool, RadixAttention, kv-scale loading and forward_extend ------

# (pool dtype, the checkpoint's k_scale and v_scale as loaded, or None: no kv-cache quantisation method) ->
# the fallback reason on this CPU machine (not_cuda: everything but the device is served).
KV_CASES = [
    ("bfloat16", None, "not_cuda"),
    ("bfloat16", (-1.0, -1.0), "not_cuda"),  # no scales in the checkpoint: SGLang loads 1.0
    ("bfloat16", (0.5, 0.5), "kv_scale"),  # kdtree reads a bf16 pool unscaled
    ("float8_e4m3fn", None, "not_cuda"),
    ("float8_e4m3fn", (-1.0, -1.0), "not_cuda"),
    ("float8_e4m3fn", (0.05, 2.5), "not_cuda"),
    ("float8_e4m3fn", (0.75, -1.0), "not_cuda"),  # one scale: SGLang uses it for both
    ("float8_e5m2", (1.5, 0.25), "not_cuda"),
    ("float8_e4m3fn", (1.0, 1000.0), "not_cuda"),  # any positive finite v_scale: applied to O in fp32
    ("float16", None, "kv_dtype"),
    ("float32", None, "kv_dtype"),
]


def _real_call(pool_dtype: str, scales):
    """A target-verify call on SGLang's own MLA pool (CPU) and RadixAttention, its kv scales loaded by SGLang's
    BaseKVCacheMethod as from a checkpoint; the backend is the stand-in of _call with that pool."""
    import torch
    from sglang.srt.layers.quantization.kv_cache import BaseKVCacheMethod
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    pool = MLATokenToKVPool(size=32, page_size=1, dtype=getattr(torch, pool_dtype), kv_lora_rank=512,
                            qk_rope_head_dim=64, layer_num=1, device="cpu", enable_memory_saver=False)  # fmt: skip
    layer = RadixAttention(8, 576, scaling=0.1, num_kv_heads=1, layer_id=0, v_head_dim=512)
    if scales is not None:
        method = BaseKVCacheMethod(quant_config=None)
        method.create_weights(layer)
        layer.k_scale.data.fill_(scales[0])
        layer.v_scale.data.fill_(scales[1])
        method.process_weights_after_loading(layer)
    c = _call(**{"backend.token_to_kv_pool": pool})
    c.layer = layer
    return c


@pytest.mark.parametrize("pool_dtype,scales,reason", KV_CASES, ids=[f"{d}-{s}" for d, s, _ in KV_CASES])
def test_dispatch_on_each_kv_pool_dtype_and_scale(pool_dtype, scales, reason):
    from kdtree.verify import fallback_reason, kv_descales

    c = _real_call(pool_dtype, scales)
    assert fallback_reason(c) == reason
    if reason == "not_cuda":
        loaded = (c.layer.k_scale_float, c.layer.v_scale_float) if scales is not None else (1.0, 1.0)
        assert kv_descales(c.layer) == loaded


def test_a_scale_that_is_not_a_positive_float_falls_back_by_name():
    import torch

    from kdtree.verify import fallback_reason

    c = _real_call("float8_e4m3fn", (0.5, 0.5))
    c.layer.v_scale_float = torch.tensor(0.5)  # a tensor where SGLang keeps a float: never read from a device
    assert fallback_reason(c) == "kv_scale"
    c.layer.v_scale_float = float("nan")
    assert fallback_reason(c) == "kv_scale"
    c = _real_call("float8_e4m3fn", (0.5, 0.5))
    c.backend.use_mla = False  # a non-MLA pool quantises through the scaled write kdtree does not make
    assert fallback_reason(c) == "kv_scale"


class TritonBackendOnCpu:
    """SGLang's own TritonAttnBackend.forward_extend and _set_kv_buffer on a CPU pool; the kernel launch at its end
    is recorded instead of run (no Triton on a CPU), so a test reads what it wrote into the pool and the scales it
    hands its kernel."""

    def __init__(self, pool, forward_metadata):
        from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

        from kdtree import install

        assert install.override_layers(TritonAttnBackend.forward_extend) == 0  # the original, unwrapped
        self.forward_extend = TritonAttnBackend.forward_extend.__get__(self)
        self._set_kv_buffer = TritonAttnBackend._set_kv_buffer.__get__(self)
        self._can_run_dense_fp8_chunked_mha = TritonAttnBackend._can_run_dense_fp8_chunked_mha.__get__(self)
        self.token_to_kv_pool, self.forward_metadata = pool, forward_metadata
        self.use_dense_fp8_chunked_prefill = False
        self.use_mla, self.dcp_size, self.enable_deterministic, self.dllm_attention = True, 1, False, None
        self.use_verify_shared_kv = self.use_verify_splitkv = False
        self.allow_bidirectional_attention_in_extend = False
        self.page_size, self.is_draft_runner = 1, False
        self.kernel_args = None

    def _forward_extend_kernel(self, *args, **kwargs):
        self.kernel_args = args


@pytest.mark.parametrize("pool_dtype,scales", [
    ("float8_e4m3fn", None), ("float8_e4m3fn", (0.05, 2.5)), ("float8_e5m2", (1.5, 0.25)),
    ("float8_e4m3fn", (0.75, -1.0)), ("bfloat16", None), ("bfloat16", (-1.0, -1.0)),
])  # fmt: skip
def test_the_draft_kv_goes_into_the_pool_as_forward_extend_writes_it(pool_dtype, scales):
    """kdtree's write (write_draft_kv) against SGLang's forward_extend on the same call: the same bytes in the pool,
    and kdtree reads the prefix with the scales forward_extend hands its kernel."""
    import torch
    from sglang.srt.runtime_context import get_parallel

    from kdtree.verify import kv_descales, write_draft_kv

    c = _real_call(pool_dtype, scales)
    gen = torch.Generator().manual_seed(0)
    c.k = (torch.randn(4, 1, 576, generator=gen) * 3).to(torch.bfloat16)
    c.v = c.k[..., :512].clone()
    md = SimpleNamespace(
        swa_out_cache_loc=None, qo_indptr=torch.tensor([0, 4]), kv_indptr=torch.tensor([0, 3]),
        kv_indices=torch.tensor([1, 2, 9]), custom_mask=torch.ones(28, dtype=torch.bool),
        mask_indptr=torch.tensor([0, 28]), max_extend_len=4,
    )  # fmt: skip
    c.forward_batch.out_cache_loc = torch.tensor([11, 5, 20, 7])
    c.forward_batch.out_cache_loc_is_physical = True
    c.forward_batch.attn_attend_prefix_cache = None
    c.forward_batch.extend_seq_lens_cpu = [4]
    sglang = TritonBackendOnCpu(c.backend.token_to_kv_pool, md)
    with get_parallel().override(dcp_enabled=False):
        sglang.forward_extend(c.q.view(4, -1), c.k, c.v, c.layer, c.forward_batch)
        theirs = sglang.token_to_kv_pool.kv_buffer[0].clone()
        sglang.token_to_kv_pool.kv_buffer[0].zero_()
        c.backend = sglang
        write_draft_kv(c)
        ours = sglang.token_to_kv_pool.kv_buffer[0]
    assert theirs[[11, 5, 20, 7]].any()  # the draft rows were written
    assert torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8))
    k_descale, v_descale = sglang.kernel_args[14:16]
    assert kv_descales(c.layer) == (k_descale, v_descale)


@pytest.mark.parametrize("pool_dtype,setting,bound", [
    ("bfloat16", 0.02, 0.02), ("float8_e4m3fn", 0.02, "fp8"), ("float8_e5m2", 0.02, "fp8"), ("float8_e4m3fn", 0.9, 0.9),
])  # fmt: skip
def test_validate_compares_an_fp8_pool_against_its_dtype_bound(pool_dtype, setting, bound):
    import torch

    from kdtree.verify import FP8_PARITY_RTOL, parity_rtol

    c = _real_call(pool_dtype, None)
    want = FP8_PARITY_RTOL[getattr(torch, pool_dtype)] if bound == "fp8" else bound
    assert parity_rtol(c, setting) == want
    assert bound != "fp8" or want > setting


@pytest.mark.parametrize(
    "algorithm,mask,batch,reads",
    [
        ("DDTREE", True, 2, True),  # a tree verify: the cut
        ("DDTREE", False, 2, False),  # auto's chain verify: causal, every token live
        ("DFLASH", True, 2, False),  # another algorithm's verify writes no cut
        ("DDTREE", True, 5, False),  # a batch past the buffer: every token
    ],
)
def test_only_a_ddtree_tree_verify_reads_the_cut(algorithm, mask, batch, reads):
    import torch

    from kdtree.verify import live_rows

    state = SimpleNamespace(live_rows=torch.zeros(4, dtype=torch.int32))
    metadata = SimpleNamespace(
        custom_mask=torch.ones(16, dtype=torch.bool) if mask else None, qo_indptr=torch.zeros(batch + 1)
    )
    c = _call(
        **{
            "backend.forward_metadata": metadata,
            "forward_batch.spec_algorithm": SimpleNamespace(name=algorithm),
        }
    )
    assert (
        live_rows(c, state) is state.live_rows
    ) == reads  # tests/gpu/test_hook_gpu.py runs the kernel on it
