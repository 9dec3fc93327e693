"""The target-verify override that runs inside each SGLang scheduler (one per tensor-parallel rank).

`VerifyOverride` is the body of an AROUND hook on `TritonAttnBackend.forward_extend`. For each call it
decides whether the kdtree kernel can compute it (`fallback_reason`); if not, SGLang's original serves
and the reason is counted. Otherwise, by mode:

- off: the original serves, untouched; nothing of kdtree's runs or is captured.
- on: the draft KV is written into the pool exactly as the original writes it, then the kdtree kernel
  computes attention into the tensor the original would have returned (for a DDTREE verify, the tokens of its
  cut, `live_rows`; the rest are zeros, and its walk never reads them).
- validate: the original serves; the kdtree kernel computes the same call into a buffer of its own, and
  a device-side comparison accumulates parity statistics (no host sync, so CUDA graphs stay on).
- standby: the original serves; kdtree does no attention work.

Modes change while the server runs (validate, on and standby, between each other: `ModeHolder`). An eager call
reads the mode once per verify step on the host. A call captured into a CUDA graph captures every mode's path
at once, and the graph's replay picks one on the device (`_captured`), so a switch needs neither a restart nor
a recapture.

Nothing on the serving path syncs with the host. Buffers are allocated outside CUDA-graph capture and
never freed once a capture has used them (a captured graph keeps the addresses it recorded). Host-side
counts (fallbacks, calls answered by the original) count Python-level calls: eager calls and graph
captures, not replays of a captured graph. The kernel counts the calls it serves on the device, so
`served_kdtree` includes replays, and so does validate's `calls_compared`.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import sys
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
from sglang.srt.layers.radix_attention import AttentionType
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from kdtree.config import FP8_PARITY_RTOL as FP8_PARITY_RTOL_BY_NAME
from kdtree.config import Mode, VerifySettings
from kdtree.state.mode_file import ModeHolder

# Absorbed MLA (DeepSeek-V3, Kimi-K2): q/k = 512 latent + 64 rope dims, v = the 512 latent dims, one KV head.
QK_HEAD_DIM = 576
V_HEAD_DIM = 512
# Pool dtypes the kernel reads: SGLang's MLA pool for --kv-cache-dtype auto (bf16), fp8_e4m3 and fp8_e5m2.
KV_POOL_DTYPES = (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)
# Validate's bound on an fp8 pool, per dtype (kdtree.config.FP8_PARITY_RTOL, where it is measured and explained).
FP8_PARITY_RTOL = {getattr(torch, name): bound for name, bound in FP8_PARITY_RTOL_BY_NAME.items()}
# Captured graphs one process can switch between modes (SGLang captures one per batch size; a recapture, as after
# a weight update, takes new ones). Beyond it, a captured call falls back to the original ("no_step_slot").
STEP_SLOTS = 1024
# DDTREE's cut (kdtree.ddtree.budget): the verify of a DDTREE step computes each request's first live_rows[b] tokens in
# on (the kernel's q_live, read on the device, so a graph captured at the whole tree serves a cut of it). The DDTREE
# worker writes the entries of its batch before each step; the rest keep what they held (a graph's padding requests).
LIVE_ROWS = 1 << 16  # the most requests a cut verify can hold (a larger batch is verified whole)
LIVE_ALL = 1 << 30  # an entry no one wrote: every token (the kernel clamps to the request's tokens)


@dataclass(slots=True)
class VerifyCall:
    """forward_extend's arguments, named (the signature of SGLang 0.5.23)."""

    backend: Any
    q: torch.Tensor
    k: torch.Tensor | None
    v: torch.Tensor | None
    layer: Any
    forward_batch: Any
    save_kv_cache: bool = True
    sinks: Any = None
    score_mod: Any = None
    aux_tensors: Any = None


# Calls that are not the target's verify, passed through uncounted: any other forward mode, and a draft model's own
# forward in target-verify mode (DFLASH's drafter runs its block that way, on the draft runner's backend).
NOT_A_VERIFY = frozenset({"not_target_verify", "draft_runner"})


def fallback_reason(c: VerifyCall) -> str | None:
    """None when the kdtree kernel computes this call exactly as the original would; else a short, stable reason."""
    backend, layer, q, k, v = c.backend, c.layer, c.q, c.k, c.v
    if not c.forward_batch.forward_mode.is_target_verify():
        return "not_target_verify"
    if getattr(backend, "is_draft_runner", False):
        return "draft_runner"
    if layer.qk_head_dim != QK_HEAD_DIM or layer.v_head_dim != V_HEAD_DIM:
        return "head_dims"
    if layer.tp_k_head_num != 1:
        return "kv_heads"
    if k is None or v is None:
        return "kv_not_passed"
    if c.sinks is not None:
        return "sinks"
    if c.score_mod is not None or c.aux_tensors is not None:
        return "score_mod"
    if layer.sliding_window_size is not None and layer.sliding_window_size > -1:
        return "sliding_window"
    if getattr(backend, "dcp_size", 1) > 1:
        return "dcp"
    scales = kv_descales(layer)
    if scales is None:
        return "kv_scale"
    if layer.logit_cap:
        return "logit_cap"
    if layer.is_cross_attention or layer.attn_type != AttentionType.DECODER:
        return "not_causal"
    if getattr(layer, "xai_temperature_len", -1) not in (None, -1):
        return "xai_temperature"
    if getattr(backend, "enable_deterministic", False):
        return "deterministic"
    if getattr(backend, "dllm_attention", None) is not None:
        return "dllm"
    if getattr(c.forward_batch, "mha_one_shot", False):
        return "mha_one_shot"
    if q.dtype != torch.bfloat16 or k.dtype != torch.bfloat16 or v.dtype != torch.bfloat16:
        return "dtype"
    if k.shape[0] != q.shape[0] or v.shape[0] != q.shape[0]:
        return "kv_rows"
    pool_dtype = backend.token_to_kv_pool.get_key_buffer(layer.layer_id).dtype
    if pool_dtype not in KV_POOL_DTYPES:
        return "kv_dtype"
    if pool_dtype == torch.bfloat16 and scales != (1.0, 1.0):
        return "kv_scale"  # a bf16 pool is read unscaled: the kernel applies scales to fp8 pools only
    if layer.k_scale is not None and not getattr(backend, "use_mla", False):
        return "kv_scale"  # forward_extend quantises a non-MLA pool through its scaled write, not kdtree's
    mask = backend.forward_metadata.custom_mask
    if mask is not None and mask.dtype not in (torch.bool, torch.uint8):
        return "mask_dtype"
    if not q.is_cuda:
        return "not_cuda"
    return None


def kv_descales(layer) -> tuple[float, float] | None:
    """The (key, value) scales SGLang's Triton path multiplies the pool's prefix by: the layer's
    k_scale_float / v_scale_float (host floats: no device read) when both k_scale and v_scale are set, else 1.0
    (TritonAttnBackend.forward_extend). None when a scale it would use is not a positive finite float (weights
    not processed yet, a per-channel scale): the call falls back as "kv_scale"."""
    if layer.k_scale is None or getattr(layer, "v_scale", None) is None:
        return 1.0, 1.0
    scales = getattr(layer, "k_scale_float", None), getattr(layer, "v_scale_float", None)
    ok = all(
        isinstance(s, numbers.Real) and not isinstance(s, bool) and math.isfinite(s) and s > 0 for s in scales
    )
    return (float(scales[0]), float(scales[1])) if ok else None


def write_draft_kv(c: VerifyCall) -> None:
    """The draft KV into the pool exactly as TritonAttnBackend.forward_extend writes it before its kernel: plain,
    or for MLA with a key scale the keys divided by it and stored through the pool's set_kv_buffer (which casts
    to the pool's fp8 dtype)."""
    backend, layer, fb = c.backend, c.layer, c.forward_batch
    loc = KVWriteLoc.for_batch(fb, swa_loc=backend.forward_metadata.swa_out_cache_loc)
    if layer.k_scale is None:
        backend._set_kv_buffer(fb, layer, loc, c.k, c.v)
    else:  # MLA (fallback_reason): the clone keeps c.k unscaled for the draft rows the kernel reads
        backend.token_to_kv_pool.set_kv_buffer(layer, loc, c.k.clone().div_(layer.k_scale), c.v)


def parity_rtol(c: VerifyCall, rtol: float) -> float:
    """The bound validate compares this call's output against: the setting's, or for an fp8 pool its dtype's."""
    dtype = c.backend.token_to_kv_pool.get_key_buffer(c.layer.layer_id).dtype
    return max(rtol, FP8_PARITY_RTOL.get(dtype, rtol))


def describe_call(c: VerifyCall, capturing: bool) -> dict:
    """What a verify call hands kdtree, as metadata only (dtypes, shapes, strides, Python values: no device read),
    for the rank record (`verify_inputs`): the contract that kdtree.kernel and the GPU tests assume, as the real
    runner keeps it (tests/gpu/test_engine_gpu.py compares it with kernel_build/bench/harness/sglang_fixture.py's)."""
    md, layer = c.backend.forward_metadata, c.layer
    kbuf = c.backend.token_to_kv_pool.get_key_buffer(layer.layer_id)

    def t(x, numel=False):
        if x is None:
            return None
        return [str(x.dtype).removeprefix("torch."), x.numel() if numel else list(x.shape)]

    d = {
        "heads": layer.tp_q_head_num,
        "scaling": float(layer.scaling),
        "max_extend_len": md.max_extend_len,
        "batch": md.qo_indptr.numel() - 1,
        "q": t(c.q),
        "k": t(c.k),
        "v": t(c.v),
        "qo_indptr": t(md.qo_indptr, True),
        "kv_indptr": t(md.kv_indptr, True),
        "kv_indices": t(md.kv_indices, True),
        "custom_mask": t(md.custom_mask, True),
        "mask_indptr": t(md.mask_indptr, True),
        "kv_pool": [str(kbuf.dtype).removeprefix("torch."), list(kbuf.shape[1:]), kbuf.stride(0)],
        "page_size": getattr(c.backend, "page_size", None),
    }
    seq = getattr(c.forward_batch, "seq_lens_cpu", None)
    if not capturing and md.custom_mask is not None and seq is not None:  # a host tensor: no device read
        n = md.max_extend_len
        d["full_mask_numel"] = sum(n * (int(p) + n) for p in seq.tolist())  # SGLang's FULL layout
    return d


def _capturing() -> bool:
    return torch.cuda.is_current_stream_capturing()


def _sglang_capture_mode() -> bool:
    """SGLang's graph runner is capturing, or warming up eagerly on the graph's buffers before it (no import)."""
    mode = sys.modules.get("sglang.srt.model_executor.runner_utils.capture_mode")
    return bool(mode is not None and mode.get_is_capture_mode())


class DeviceState:
    """Per-device kdtree state: the kernel's device counter, parity accumulators and grow-only buffers, and what
    calls captured with every mode share: the mode latched for the step, the gated extents, a side stream.

    Created outside capture. A buffer that a captured graph has used is never freed: when a larger one
    is needed (outside capture) the old one is kept alive, because the graph replays into its address.
    """

    def __init__(self, kernel, device: torch.device, rtol: float):
        self.device = device
        self.counter = kernel.DeviceCounter(device)
        self.parity = kernel.ParityStats(device, rtol)
        self.mode = torch.zeros(1, dtype=torch.int32, device=device)  # latched once per captured step
        cuda = device.type == "cuda"  # made now: capture forbids making a stream or pinning memory
        self.side = torch.cuda.Stream(device) if cuda else None  # captured calls serve `on` from here
        self.step_calls = kernel.StepCalls(STEP_SLOTS) if cuda else None
        self.step: tuple[tuple[int, int, int], int] | None = None  # ((capture, qo address, entries), slot)
        self.reserved = (0, 0)  # (validate_out elements, qo_indptr entries) sized for a capture so far
        self.live_rows = torch.full((LIVE_ROWS,), LIVE_ALL, dtype=torch.int32, device=device)
        self._buffers: dict[str, tuple[torch.Tensor, bool]] = {}  # name -> (bytes, used in a capture)
        self._kept: list[torch.Tensor] = []

    def buffer(
        self, name: str, numel: int, dtype: torch.dtype, capturing: bool, reserve: int = 0
    ) -> torch.Tensor | None:
        """A [numel] `dtype` view of a buffer of at least max(numel * itemsize, reserve) bytes; None when it would
        need to grow during capture. `reserve` lets an eager call size a buffer for a capture's wider dtype."""
        nbytes = numel * dtype.itemsize
        buf, captured = self._buffers.get(name, (None, False))
        if buf is None or buf.numel() < max(nbytes, reserve):
            if capturing:
                return None
            if buf is not None and captured:
                self._kept.append(buf)
            size = 1 << max(max(nbytes, reserve) - 1, 0).bit_length()
            buf, captured = torch.empty(size, dtype=torch.uint8, device=self.device), False
        self._buffers[name] = (buf, captured or capturing)
        return buf[:nbytes].view(dtype)


class VerifyOverride:
    """The AROUND hook body: `override(original_fn, backend, q, k, v, layer, forward_batch, ...)`."""

    def __init__(self, settings: VerifySettings, mode: ModeHolder | None = None):
        self.settings = settings
        self.mode = mode or ModeHolder(settings.verify)
        self._lock = threading.Lock()  # guards the host counters against the heartbeat thread's copy
        self.served_kdtree_host = 0
        self.served_original = 0
        self.fallbacks: Counter[str] = Counter()
        self.last_error: str | None = None
        self.gpu: str | None = None
        self.compute_capability: str | None = None
        self.compiled_archs: list[str] = []
        self._kernel = None
        self._kernel_error: str | None = None
        self._kernel_loaded = False
        self._described = False
        self._devices: dict[int, DeviceState] = {}
        self._mode_word = None  # kernel.ModeWord, made with the first device state
        self._step: tuple[Any, Mode] | None = None  # (forward batch, its mode): one mode per eager step
        # "eager", "warmup" (SGLang's eager runs before a capture), "captured": the first such call, described
        self.inputs_seen: dict[str, dict] = {}
        # what else this process reports in its rank record, by field: DDTREE's auto budget (its worker adds itself)
        self.reporters: dict[str, Any] = {}

    # ---- the hook -------------------------------------------------------------------------------
    def __call__(self, original, *args, **kwargs):
        try:
            c = VerifyCall(*args, **kwargs)
        except TypeError:  # a forward_extend signature this version does not know: never guess
            self._count("unexpected_signature")
            return original(*args, **kwargs)
        if not self._described:
            self._describe(c.q)
        if self.mode.mode is Mode.OFF:
            if c.forward_batch.forward_mode.is_target_verify() and not getattr(
                c.backend, "is_draft_runner", False
            ):
                self._count(None)
            return original(*args, **kwargs)

        reason = fallback_reason(c)
        if reason in NOT_A_VERIFY:
            return original(*args, **kwargs)
        capturing = False
        state = None
        if reason is None:
            capturing = _capturing()
            state, reason = self._ready(c.q.device, capturing)
        if reason is not None:
            self._count(reason)
            return original(*args, **kwargs)
        if len(self.inputs_seen) < 3:
            kind = "captured" if capturing else "warmup" if _sglang_capture_mode() else "eager"
            self.inputs_seen.setdefault(kind, describe_call(c, capturing))
        if capturing:
            return self._captured(original, c, state, args, kwargs)
        self._reserve_for_capture(c, state)
        mode = self._step_mode(c.forward_batch)
        if mode is Mode.ON:
            return self._serve(original, c, state, False, args, kwargs)
        out = original(*args, **kwargs)
        self._count(None)
        if mode is Mode.VALIDATE:
            self._compare(c, out, state, False)
        return out

    def _step_mode(self, fb) -> Mode:
        """The mode for this eager call: read once per verify step (forward batch), so one step is one mode."""
        if self._step is None or self._step[0] is not fb:
            self._step = (fb, self.mode.mode)
        return self._step[1]

    def _captured(self, original, c: VerifyCall, state: DeviceState, args, kwargs):
        """A call captured into a CUDA graph holds every mode's path; each replay picks one on the device.

        Once per captured step the gate latches the host's mode and gives each launch below the step's extents
        or zeros (a kernel with no draft tokens returns at once). Per call, after the KV write:
          side stream: kdtree's kernel into `o`            (on)
          this stream: the original into `o`               (validate, standby)
                       kdtree's kernel into its scratch    (validate)
                       mode_post: compare the two          (validate)
        So in on the original's path is early exits beside kdtree's kernel, and in validate and standby it runs
        on the call's stream, as in a graph captured without kdtree. Only one launch writes `o` in any mode, and
        only one of kdtree's two uses the workspace.
        """
        backend, layer, fb = c.backend, c.layer, c.forward_batch
        md = backend.forward_metadata
        heads, rows = layer.tp_q_head_num, c.q.shape[0]
        qo, n = md.qo_indptr, md.qo_indptr.numel()
        workspace, reason = self._workspace(c, state, True)
        scratch = state.buffer("validate_out", rows * heads * V_HEAD_DIM, torch.bfloat16, True)
        qo_gated = state.buffer("qo_gated", 3 * n, qo.dtype, True)
        if reason is None and (scratch is None or qo_gated is None):
            reason = "buffer_grow_in_capture"
        main = torch.cuda.current_stream(c.q.device)
        key = (self._kernel.capture_id(main), qo.data_ptr(), n)
        if reason is None and (state.step is None or state.step[0] != key):  # this captured step's first call
            slot = state.step_calls.claim()
            if slot is None:
                reason = "no_step_slot"
            else:
                self._kernel.mode_gate(self._mode_word, state.mode, qo, qo_gated,
                                       state.step_calls.device_address(slot), state.counter)  # fmt: skip
                state.step = (key, slot)
        if reason is not None:
            self._count(reason)
            return original(*args, **kwargs)
        qo_on, qo_validate, qo_original = qo_gated[:n], qo_gated[n : 2 * n], qo_gated[2 * n :]
        o = getattr(fb, "_attn_output", None)
        if o is None:
            o = c.q.new_empty((rows, heads * V_HEAD_DIM))
        if c.save_kv_cache:
            write_draft_kv(c)
        state.side.wait_stream(main)  # fork after the KV write
        try:
            with torch.cuda.stream(state.side):
                run_kernel(self._kernel, c, o.view(-1, heads, V_HEAD_DIM), workspace, None, qo_indptr=qo_on,
                           q_live=live_rows(c, state))  # fmt: skip
            scratch = scratch.view(rows, heads, V_HEAD_DIM)
            run_kernel(self._kernel, c, scratch, workspace, None, qo_indptr=qo_validate)
        except (ValueError, RuntimeError) as e:  # raised before or at launch: the original serves this call
            main.wait_stream(state.side)
            self._count(self._failure_reason(e), e)
            return original(*args, **kwargs)
        self._original_into(original, c, o, qo_original)
        rtol = parity_rtol(c, self.settings.validate_rtol)
        self._kernel.mode_post(state.mode, scratch.view(o.shape), o, state.parity, rtol)
        main.wait_stream(state.side)  # join: `o` is complete in every mode
        state.step_calls.add(state.step[1])
        return o

    @staticmethod
    def _original_into(original, c: VerifyCall, out: torch.Tensor, qo_indptr: torch.Tensor) -> None:
        """The original on the call's inputs and the given extents, into `out`; the KV is already written."""
        backend, fb = c.backend, c.forward_batch
        md, shared = backend.forward_metadata, getattr(fb, "_attn_output", None)
        backend.forward_metadata = dataclasses.replace(md, qo_indptr=qo_indptr)
        fb._attn_output = out  # forward_extend writes into a tensor given here
        try:
            original(backend, c.q, c.k, c.v, c.layer, fb, save_kv_cache=False)
        finally:
            backend.forward_metadata, fb._attn_output = md, shared

    def _reserve_for_capture(self, c: VerifyCall, state: DeviceState) -> None:
        """Size the buffers a capture of this call needs, in every live mode (SGLang runs each batch size eagerly
        before capturing it, and a server started in standby runs nothing of kdtree's on those calls, so the
        workspace is sized here too, not only where a call is served or compared); qo_indptr is int32 in eager
        metadata and int64 in captured metadata, so reserve 8 bytes an entry. Only a larger call than any before
        does work here: this runs on every eager call."""
        out, n = (
            c.q.shape[0] * c.layer.tp_q_head_num * V_HEAD_DIM,
            c.backend.forward_metadata.qo_indptr.numel(),
        )
        if out <= state.reserved[0] and n <= state.reserved[1]:
            return
        state.buffer("validate_out", out, torch.bfloat16, False)
        state.buffer("qo_gated", 3 * n, torch.int32, False, reserve=24 * n)
        self._workspace(c, state, False)
        state.reserved = (max(out, state.reserved[0]), max(n, state.reserved[1]))

    def _serve(self, original, c: VerifyCall, state: DeviceState, capturing: bool, args, kwargs):
        layer, fb = c.layer, c.forward_batch
        heads = layer.tp_q_head_num
        workspace, reason = self._workspace(c, state, capturing)
        if reason is not None:
            self._count(reason)
            return original(*args, **kwargs)
        # The output tensor and the KV write, exactly as TritonAttnBackend.forward_extend makes them.
        o = getattr(fb, "_attn_output", None)
        if o is None:
            o = c.q.new_empty((c.q.shape[0], heads * V_HEAD_DIM))
        if c.save_kv_cache:
            write_draft_kv(c)
        try:
            run_kernel(
                self._kernel,
                c,
                o.view(-1, heads, V_HEAD_DIM),
                workspace,
                state.counter,
                q_live=live_rows(c, state),
            )
        except (ValueError, RuntimeError) as e:  # raised before or at launch: the original computes instead
            self._count(self._failure_reason(e), e)
            return original(*args, **kwargs)  # rewrites the same KV bytes, then computes
        with self._lock:
            self.served_kdtree_host += 1
        return o

    def _compare(self, c: VerifyCall, out: torch.Tensor, state: DeviceState, capturing: bool) -> None:
        heads = c.layer.tp_q_head_num
        tokens = c.q.shape[0]
        workspace, reason = self._workspace(c, state, capturing)
        ours = state.buffer("validate_out", tokens * heads * V_HEAD_DIM, torch.bfloat16, capturing)
        if reason is None and ours is None:
            reason = "buffer_grow_in_capture"
        if reason is not None:
            self._count_skip(reason)
            return
        ours = ours.view(tokens, heads, V_HEAD_DIM)
        try:
            run_kernel(self._kernel, c, ours, workspace, None)
            state.parity.update(
                ours, out.view(tokens, heads, V_HEAD_DIM), parity_rtol(c, self.settings.validate_rtol)
            )
        except (ValueError, RuntimeError) as e:
            self._count_skip(self._failure_reason(e), e)

    # ---- readiness: the kernel library, per-device state, workspace -----------------------------
    def _ready(self, device: torch.device, capturing: bool) -> tuple[DeviceState | None, str | None]:
        if not self._kernel_loaded:
            self._load_kernel()
        if self._kernel is None:
            return None, "kernel_unavailable"
        state = self._devices.get(device.index)
        if state is None:
            if capturing:  # allocating device state would need CUDA calls that capture forbids
                return None, "first_use_in_capture"
            try:
                state = DeviceState(self._kernel, device, self.settings.validate_rtol)
                if self._mode_word is None:
                    self._mode_word = self._kernel.ModeWord()
                    self.mode.attach(self._mode_word)
            except self._kernel.KernelUnavailable as e:
                self._kernel, self._kernel_error = None, str(e)
                self._note_error(f"kdtree kernel unavailable: {e}")
                return None, "kernel_unavailable"
            self._devices[device.index] = state
        return state, None

    def _workspace(
        self, c: VerifyCall, state: DeviceState, capturing: bool
    ) -> tuple[torch.Tensor | None, str | None]:
        md = c.backend.forward_metadata
        batch = md.qo_indptr.shape[0] - 1
        try:
            nbytes = self._kernel.workspace_bytes(batch, c.layer.tp_q_head_num, md.max_extend_len, c.q.device)
        except self._kernel.KernelUnavailable as e:
            self._note_error(f"kdtree kernel unavailable: {e}")
            return None, "kernel_unavailable"
        ws = state.buffer("workspace", max(nbytes, 1), torch.uint8, capturing)
        return ws, None if ws is not None else "buffer_grow_in_capture"

    def _load_kernel(self) -> None:
        self._kernel_loaded = True
        try:
            from kdtree import kernel
        except ImportError as e:
            self._kernel_error = f"kdtree.kernel does not import: {e}"
            self._note_error(self._kernel_error)
            return
        self._kernel = kernel
        try:
            self.compiled_archs = list(kernel.compiled_archs())
        except Exception as e:  # the record shows it; serving falls back
            self._note_error(f"compiled_archs() failed: {e}")

    def _describe(self, q: torch.Tensor) -> None:
        """Once per process, on the first call outside capture: GPU, compute capability, compiled archs."""
        if not q.is_cuda or _capturing():  # these are CUDA calls; a later call does it
            return
        self._described = True
        major, minor = torch.cuda.get_device_capability(q.device)
        self.gpu = torch.cuda.get_device_name(q.device)
        self.compute_capability = f"{major}.{minor}"
        if not self._kernel_loaded:
            self._load_kernel()

    def _failure_reason(self, e: BaseException) -> str:
        if isinstance(e, self._kernel.Unsupported):
            return "unsupported"  # valid inputs the kernel does not compute
        if isinstance(e, self._kernel.KernelUnavailable):
            return "kernel_unavailable"
        return "kernel_rejected" if isinstance(e, ValueError) else "kernel_error"

    # ---- counters -------------------------------------------------------------------------------
    def _count(self, reason: str | None, error: BaseException | None = None) -> None:
        """One target-verify call answered by the original; reason None means by choice of mode."""
        with self._lock:
            self.served_original += 1
            if reason is not None:
                self.fallbacks[reason] += 1
        if error is not None:
            self._note_error(f"{reason}: {error}")

    def _count_skip(self, reason: str, error: BaseException | None = None) -> None:
        """Validate mode: the original served, but kdtree could not be compared on this call."""
        with self._lock:
            self.fallbacks[reason] += 1
        if error is not None:
            self._note_error(f"{reason}: {error}")

    def _note_error(self, message: str) -> None:
        self.last_error = message

    def ddtree_live_rows(self, device: torch.device) -> torch.Tensor | None:
        """The buffer DDTREE's worker writes its cut into (see LIVE_ROWS), made now if need be (outside capture);
        None where kdtree's kernel is unavailable."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # the hook keys its state by the call's q.device
            device = torch.device("cuda", torch.cuda.current_device())
        state, _ = self._ready(device, False)
        return None if state is None else state.live_rows

    def serving(self) -> bool:
        """kdtree's kernel computes the verify now (mode on, kernel loaded): what a cut saves time in."""
        return self.mode.mode is Mode.ON and self._kernel is not None

    def device_state(self) -> DeviceState | None:
        states = list(self._devices.values())  # one atomic copy: the serving thread may be adding one
        return states[0] if states else None

    def snapshot(self) -> dict:
        """Host-side numbers only (no CUDA call): safe from any thread, at any time."""
        with self._lock:
            snap = {
                "mode": self.mode.mode.value,
                "mode_applied_at": self.mode.applied_at,
                "live_modes": sorted(m.value for m in self.mode.live_modes),
                "mode_pending": self.mode.pending.value if self.mode.pending else None,
                "served_kdtree": self.served_kdtree_host,
                "served_original": self.served_original,
                "fallbacks": dict(self.fallbacks),
                "last_error": self.last_error,
                "gpu": self.gpu,
                "compute_capability": self.compute_capability,
                "compiled_archs": list(self.compiled_archs),
                "verify_inputs": dict(self.inputs_seen),
            }
        for name, report in list(self.reporters.items()):
            snap[name] = report()
        state = self.device_state()
        if state is not None:
            snap["served_kdtree"] = state.counter.value()  # pinned host mirror, includes graph replays
            snap["parity"] = state.parity.snapshot()
        return snap


def live_rows(c: VerifyCall, state: DeviceState) -> torch.Tensor | None:
    """The cut an `on` launch of this call reads: DDTREE's tree verify only (its worker writes the buffer), and a batch
    the buffer holds. Auto's chain verify (no mask: every token live) takes none, so its kernel skips the load."""
    if getattr(getattr(c.forward_batch, "spec_algorithm", None), "name", None) != "DDTREE":
        return None
    if c.backend.forward_metadata.custom_mask is None:
        return None
    batch = c.backend.forward_metadata.qo_indptr.numel() - 1
    return state.live_rows if batch <= state.live_rows.numel() else None


def run_kernel(
    kernel,
    c: VerifyCall,
    out: torch.Tensor,
    workspace: torch.Tensor,
    counter,
    qo_indptr: torch.Tensor | None = None,
    q_live: torch.Tensor | None = None,
) -> None:
    """The one place the kdtree kernel API is called: the call's tensors, as SGLang's Triton path reads them
    (qo_indptr: the extents to compute instead of the metadata's, as in captured calls; q_live: DDTREE's cut)."""
    layer, md = c.layer, c.backend.forward_metadata
    pool = c.backend.token_to_kv_pool
    heads = layer.tp_q_head_num
    k = c.k if c.k.dim() == 3 else c.k.view(-1, 1, QK_HEAD_DIM)
    v = c.v if c.v.dim() == 3 else c.v.view(-1, 1, V_HEAD_DIM)
    kernel.tree_verify(
        c.q.view(-1, heads, QK_HEAD_DIM),
        k,
        v,
        pool.get_key_buffer(layer.layer_id),
        pool.get_value_buffer(layer.layer_id),
        md.qo_indptr if qo_indptr is None else qo_indptr,
        md.kv_indptr,
        md.kv_indices,
        md.custom_mask,
        md.mask_indptr,
        layer.scaling,
        md.max_extend_len,  # a Python int in SGLang 0.5.23: no device read
        out,
        workspace,
        counter=counter,
        kv_scales=kv_descales(layer),
        q_live=q_live,
    )
