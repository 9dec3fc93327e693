"""Benchmark: what live mode switching costs per verify call, inside SGLang's TritonAttnBackend under CUDA graphs.

A server started in validate, on or standby captures its target-verify graphs with every mode's path
(kdtree.verify.VerifyOverride._captured) and picks one per replay on the device. This compares those graphs,
replayed in each mode, with the single-mode graphs a server captured before live switching:
  original  SGLang's path alone (what off captures)
  on        the KV write and kdtree's kernel
  validate  the original, then kdtree's kernel and the parity comparison
Each graph holds one verify step of LAYERS calls, one per pool layer (the pool is larger than the L2, as a
model's is), replayed as SGLang replays it: per call = replay time / LAYERS. It also reports the device memory
the every-mode path adds and how long capturing one step took (a design that recaptured on each switch would pay
that for every batch size's graph, and SGLang captures the whole model, not attention alone).

Run on a GPU with SGLang importable (see README, "GPU tests and benchmark"):
    python kernel_build/bench/bench_modes.py --out modes.md
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "gpu"))
if importlib.util.find_spec("sgl_kernel") is None:
    import sglang_stubs  # noqa: F401  (stands in for SGLang's compiled packages the attention path never calls)
from bench_verify import _commit  # noqa: E402  (this script's folder is on sys.path)
from sglang_fixture import forward, graph_setup  # noqa: E402

from kdtree.verify import VerifyCall  # noqa: E402

SHAPES = [(1, 8, 16, 32768), (32, 8, 16, 4096)]  # (batch, heads, draft tokens, prefix)
LAYERS = 4


def install(state_dir: str):
    """The override as a server installs it (the import hook's path), started in validate."""
    os.environ.update(KDTREE_VERIFY="validate", KDTREE_STATE_DIR=state_dir)
    import sglang.srt.layers.attention.triton_backend as tb

    from kdtree import install as inst

    inst.install_on_import(tb)
    return inst.current_override(), tb.TritonAttnBackend, tb.TritonAttnBackend.forward_extend.__wrapped__


def time_graph(g, calls: int, reps: int = 60) -> float:
    """Median over 5 rounds of `reps` replays, microseconds per verify call."""
    for _ in range(5):
        g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        for _ in range(reps):
            g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (reps * calls))
    return sorted(times)[2]


def capture_step(s, step_fn) -> tuple[torch.cuda.CUDAGraph, float]:
    """Warm up eagerly, then capture one step (every layer); returns the graph and the capture's seconds."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step_fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    t0 = time.perf_counter()
    with torch.cuda.graph(g):
        step_fn()
    torch.cuda.synchronize()
    return g, time.perf_counter() - t0


def measure(shape, ov, cls, original) -> dict:
    bs, heads, n, prefix = shape
    s = graph_setup(torch, heads, (prefix,) * bs, n, max_context_len=prefix + n, layers=LAYERS)
    calls = [lambda i=i: forward(s, i) for i in range(LAYERS)]

    def single_mode(mode):
        """Today's single-mode path of each layer's call, captured as such."""
        outs, capturing = [], torch.cuda.is_current_stream_capturing()
        state = ov._devices[s.q.device.index]
        for layer in s.layers:
            c = VerifyCall(s.backend, s.q, s.k, s.v, layer, s.fb)
            if mode == "on":
                outs.append(ov._serve(original, c, state, capturing, (), {}))
            else:
                out = original(s.backend, s.q, s.k, s.v, layer, s.fb, save_kv_cache=True)
                ov._compare(c, out, state, capturing)
                outs.append(out)
        return outs

    wrapped = cls.__dict__["forward_extend"]
    cls.forward_extend = original  # SGLang as shipped
    try:
        g_orig, _ = capture_step(s, lambda: [f() for f in calls])
    finally:
        cls.forward_extend = wrapped
    ov.mode.set("validate")
    torch.cuda.synchronize()
    mem0 = torch.cuda.memory_allocated()
    g_all, capture_s = capture_step(s, lambda: [f() for f in calls])  # through the hook: every mode
    torch.cuda.synchronize()
    mem_all = torch.cuda.memory_allocated() - mem0
    type(ov).original_beside = False
    try:
        g_seq, _ = capture_step(s, lambda: [f() for f in calls])  # the original after kdtree, one stream
    finally:
        type(ov).original_beside = True
    state = ov._devices[s.q.device.index]
    static = {name: buf.numel() for name, (buf, _) in state._buffers.items()}
    g_on, _ = capture_step(s, lambda: single_mode("on"))
    g_val, _ = capture_step(s, lambda: single_mode("validate"))
    row = dict(batch=bs, heads=heads, draft=n, prefix=prefix, layers=LAYERS, capture_s=capture_s)
    row["single"] = {
        "off": time_graph(g_orig, LAYERS),
        "on": time_graph(g_on, LAYERS),
        "validate": time_graph(g_val, LAYERS),
    }
    row["every_mode"], row["every_mode_one_stream"] = {}, {}
    for mode in ("on", "validate", "standby"):
        ov.mode.set(mode)  # a host store: the next replay's gate reads it
        row["every_mode"][mode] = time_graph(g_all, LAYERS)
        row["every_mode_one_stream"][mode] = time_graph(g_seq, LAYERS)
    ov.mode.set("validate")
    row["single"]["off_again"] = time_graph(g_orig, LAYERS)  # the same graph later: the run's drift
    row["static_buffer_bytes"] = static
    row["graph_alloc_delta_bytes"] = mem_all
    del g_orig, g_all, g_seq, g_on, g_val
    return row


def table(rows: list[dict]) -> list[str]:
    """Per mode: today's single-mode graph, the every-mode graph (original beside kdtree, as shipped), and the
    every-mode graph with the original after kdtree on one stream."""
    lines = [
        "| batch | H | N | prefix | mode | single-mode graph (us/call) | every-mode graph (us/call) | extra | "
        "every-mode, one stream (us/call) | extra |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        for mode, single in (("on", "on"), ("validate", "validate"), ("standby", "off")):
            a, b, c = r["single"][single], r["every_mode"][mode], r["every_mode_one_stream"][mode]
            label = mode if single == mode else f"{mode} (vs off)"
            lines.append(
                f"| {r['batch']} | {r['heads']} | {r['draft']} | {r['prefix']} | {label} | {a:.1f} | {b:.1f} | "
                f"{b - a:+.1f} us ({100 * (b - a) / a:+.1f}%) | {c:.1f} | {c - a:+.1f} us ({100 * (c - a) / a:+.1f}%) |"
            )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--state-dir", default="/tmp/kdtree-bench-modes")
    args = ap.parse_args()
    ov, cls, original = install(args.state_dir)
    rows = []
    for shape in SHAPES:
        rows.append(measure(shape, ov, cls, original))
        torch.cuda.empty_cache()
    props = torch.cuda.get_device_properties(0)
    head = [
        f"GPU: {props.name} ({props.multi_processor_count} SMs), {datetime.date.today()}, commit {_commit()}",
        f"Graphs of one verify step, {LAYERS} calls (layers); command: {' '.join(sys.argv)}",
        "",
    ]
    notes = [""] + [
        f"b{r['batch']}/h{r['heads']}/n{r['draft']}/{r['prefix']}: capturing the every-mode step took "
        f"{r['capture_s'] * 1e3:.0f} ms; static buffers it adds per device: "
        + ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in r["static_buffer_bytes"].items())
        + f"; device memory allocated by its capture: {r['graph_alloc_delta_bytes'] / 2**20:.2f} MiB; "
        f"off measured again after the rest: {r['single']['off_again']:.1f} us/call"
        for r in rows
    ]
    text = "\n".join(head + table(rows) + notes)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
        Path(args.out).with_suffix(".json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
