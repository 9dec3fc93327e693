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
    python kernel_build/bench/benchmarks/bench_modes.py --out modes.md
    python kernel_build/bench/benchmarks/bench_modes.py --shapes 1,8,8,512 4,8,8,512    # other (batch, H, N, prefix) shapes
Each shape's notes also give `on` against `off` (SGLang's Triton path alone): the verify call's whole cost in each,
which is where a short prefix shows whether kdtree's path is cheaper than the call it replaces.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(REPO / "kernel_build" / "bench" / "harness"), str(REPO / "standins")]
if importlib.util.find_spec("sgl_kernel") is None:
    import sglang_stubs  # noqa: F401  (stands in for SGLang's compiled packages the attention path never calls)
from sglang_fixture import forward, graph_setup  # noqa: E402
from source_id import checkout  # noqa: E402  (this script's folder is on sys.path)

from kdtree.bench import capture_graph, replay_us  # noqa: E402
from kdtree.verify import VerifyCall  # noqa: E402

SHAPES = [(1, 8, 16, 32768), (32, 8, 16, 4096)]  # (batch, heads, draft tokens, prefix)
LAYERS = 61  # DeepSeek-V3's and Kimi-K2's: the gate runs once per step, as in a server


def install(state_dir: str):
    """The override as a server installs it (the import hook's path), started in validate."""
    os.environ.update(KDTREE_VERIFY="validate", KDTREE_STATE_DIR=state_dir)
    import sglang.srt.layers.attention.triton_backend as tb

    from kdtree import install as inst

    inst.install_on_import(tb)
    return inst.current_override(), tb.TritonAttnBackend, tb.TritonAttnBackend.forward_extend.__wrapped__


def time_graph(g, calls: int, round_s: float = 0.4) -> float:
    """Median over 5 rounds of replays (about round_s each), microseconds per verify call."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    g.replay()
    start.record()
    g.replay()
    end.record()
    end.synchronize()
    return replay_us(g, max(3, int(round_s * 1e3 / start.elapsed_time(end))), calls)


def capture_step(s, step_fn) -> tuple[torch.cuda.CUDAGraph, float]:
    """Warm up eagerly, then capture one step (every layer); returns the graph and the capture's seconds."""
    g, _, seconds = capture_graph(step_fn)
    return g, seconds


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
    state = ov._devices[s.q.device.index]
    # What only the every-mode path holds: the step's gated extents (device) and the per-graph call counts (pinned
    # host memory); the workspace and validate_out buffers serve the single-mode paths too.
    static = {
        "qo_gated": state._buffers["qo_gated"][0].numel(),
        "step counts (host)": state.step_calls.host.numel(),
    }
    g_on, _ = capture_step(s, lambda: single_mode("on"))
    g_val, _ = capture_step(s, lambda: single_mode("validate"))
    row = dict(batch=bs, heads=heads, draft=n, prefix=prefix, layers=LAYERS, capture_s=capture_s)
    row["single"] = {
        "off": time_graph(g_orig, LAYERS),
        "on": time_graph(g_on, LAYERS),
        "validate": time_graph(g_val, LAYERS),
    }
    row["every_mode"] = {}
    for mode in ("on", "validate", "standby"):
        ov.mode.set(mode)  # a host store: the next replay's gate reads it
        row["every_mode"][mode] = time_graph(g_all, LAYERS)
    ov.mode.set("validate")
    row["single"]["off_again"] = time_graph(g_orig, LAYERS)  # the same graph later: the run's drift
    row["static_buffer_bytes"] = static
    row["graph_alloc_delta_bytes"] = mem_all
    del g_orig, g_all, g_on, g_val
    return row


def table(rows: list[dict]) -> list[str]:
    lines = [
        "| batch | H | N | prefix | mode | single-mode graph (us/call) | every-mode graph (us/call) | extra |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        for mode, single in (("on", "on"), ("validate", "validate"), ("standby", "off")):
            a, b = r["single"][single], r["every_mode"][mode]
            label = mode if single == mode else f"{mode} (vs off)"
            lines.append(
                f"| {r['batch']} | {r['heads']} | {r['draft']} | {r['prefix']} | {label} | {a:.1f} | {b:.1f} | "
                f"{b - a:+.1f} us ({100 * (b - a) / a:+.1f}%) |"
            )
    return lines


def _shape(text: str) -> tuple[int, int, int, int]:
    try:
        bs, h, n, p = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected batch,heads,draft,prefix, e.g. 1,8,16,32768"
        ) from None
    return bs, h, n, p


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--state-dir", default="/tmp/kdtree-bench-modes")
    ap.add_argument("--shapes", nargs="+", type=_shape, default=SHAPES, help="batch,heads,draft,prefix ...")
    args = ap.parse_args()
    ov, cls, original = install(args.state_dir)
    rows = []
    for shape in args.shapes:
        rows.append(measure(shape, ov, cls, original))
        torch.cuda.empty_cache()
    props = torch.cuda.get_device_properties(0)
    head = [
        f"GPU: {props.name} ({props.multi_processor_count} SMs), {datetime.date.today()}, commit {checkout()}",
        f"Graphs of one verify step, {LAYERS} calls (layers); command: {' '.join(sys.argv)}",
        "",
    ]
    notes = [""] + [
        f"b{r['batch']}/h{r['heads']}/n{r['draft']}/{r['prefix']}: capturing the every-mode step took "
        f"{r['capture_s'] * 1e3:.0f} ms; static buffers it adds per device: "
        + ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in r["static_buffer_bytes"].items())
        + f"; device memory allocated by its capture: {r['graph_alloc_delta_bytes'] / 2**20:.2f} MiB; "
        f"off measured again after the rest: {r['single']['off_again']:.1f} us/call; on (every-mode graph) / off: "
        f"{r['every_mode']['on'] / r['single']['off']:.2f}x, on alone / off: {r['single']['on'] / r['single']['off']:.2f}x"
        for r in rows
    ]
    text = "\n".join(head + table(rows) + notes)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
        Path(args.out).with_suffix(".json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
