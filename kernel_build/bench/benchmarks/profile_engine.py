"""Where a decode step of the real SGLang server spends its time, in off and in on: GPU kernels by name, GPU idle.

For each speculative algorithm it starts the real servers as bench_engine.py does (kernel_build/bench/harness/real_server.py), one
in off and one in on, and for each prompt length (batch 1, the prompt in the prefix cache) records `--steps`
scheduler steps with SGLang's own profiler (POST /start_profile: torch.profiler, GPU activity only, so that the host runs at its own pace; kernels
replayed from CUDA graphs included) while one greedy request decodes, from its first token on (the prefill of the
prompt's last token is not in the window). From each trace: the wall time of a step
(the span of the profiled kernels / steps), the GPU's busy time in a step (the union of its kernel intervals),
and the kernels that take the most GPU time per step, grouped by name. A step whose GPU busy time is far below its
wall time is bound by the host (the scheduler, the drafter's launches), not by attention: the GPU's waits on the host
(idle gaps over 20 us, charged to the kernel that ends each) and the launches a step are in the JSON, and each row's
kernels (name, start, duration) in kernels/<row>.kernels.json.gz beside --out, for a timeline read offline
(kernel_build/bench/tuning/profile_steps.py cuts them into steps: a chain step's cost beside a tree step's).

    python3 kernel_build/bench/benchmarks/profile_engine.py --out profile.md          # profile.json beside it
    # a DDTREE step's own cost against DFlash's chain at the same verified width (16 tokens), and auto's, in on only
    python3 kernel_build/bench/benchmarks/profile_engine.py --layers 61 --prompts 2048,32768 --modes on \
        --algorithms DFLASH-B16,DDTREE-B16-T15,DDTREE-B16-AUTO
    # the same with the steps accepting what the oracle's paper profile says (about 6 tokens a step, not 1)
    python3 kernel_build/bench/benchmarks/profile_engine.py --layers 61 --prompts 32768 --modes on \
        --algorithms DFLASH-B16,DDTREE-B16-T15 --oracle paper
    bash kernel_build/bench/device_run.sh engine-profile [args]            # the same on the GPU machine, into $OUT
"""

from __future__ import annotations

import argparse
import collections
import datetime
import gzip
import json
import re
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "kernel_build" / "bench" / "harness"))
from ddtree_oracle import PROFILE_ENV, PROFILES, write_profile  # noqa: E402
from real_server import (  # noqa: E402
    DFLASH_BLOCK,
    SPECULATIVE,
    RealServer,
    ServerSpec,
    server_env,
    server_key,
    unavailable,
)
from source_id import checkout  # noqa: E402  (this script's folder is on sys.path)
from tiny_model import prompt_of, write_model  # noqa: E402

from kdtree.config import Mode  # noqa: E402

# Kernel names, grouped by what they are for (first match wins; the rest keep their own, shortened name).
GROUPS = [
    ("kdtree verify", re.compile(r"tree_verify|combine_kernel|mode_gate|mode_post|parity")),
    ("triton extend (prefix + draft)", re.compile(r"^_fwd_kernel$|extend_attention|_fwd_kernel_unified")),
    ("triton decode", re.compile(r"_fwd_grouped_kernel_stage1|_fwd_kernel_stage[12]|decode_attention")),
    ("gemm", re.compile(r"gemm|sm90_xmma|cutlass|nvjet|cublas", re.I)),
]


def group_of(name: str) -> str:
    for label, pattern in GROUPS:
        if pattern.search(name):
            return label
    return name[:60]


def union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def summarize(trace: dict, steps: int) -> dict:
    """Per step: wall, GPU busy, and GPU time by kernel group (microseconds)."""
    kernels = [
        e for e in trace.get("traceEvents", []) if e.get("cat") == "kernel" and e.get("dur") is not None
    ]
    if not kernels:
        return {"error": "the trace has no kernel events"}
    spans = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in kernels]
    wall = max(e for _, e in spans) - min(s for s, _ in spans)
    by_group: collections.Counter = collections.Counter()
    by_name: collections.Counter = collections.Counter()
    for e in kernels:
        by_group[group_of(e["name"])] += float(e["dur"])
        by_name[e["name"][:80]] += float(e["dur"])
    busy = union_us(spans)
    # Where the GPU waits on the host: each idle gap of over 20 us, charged to the kernel that ends it (the launch
    # the host was late with), and how many kernels a step launches of each name.
    ordered = sorted(kernels, key=lambda e: float(e["ts"]))
    waits: collections.Counter = collections.Counter()
    end = float("-inf")
    for e in ordered:
        gap = float(e["ts"]) - end
        if gap > 20.0 and end != float("-inf"):
            waits[e["name"][:80]] += gap
        end = max(end, float(e["ts"]) + float(e["dur"]))
    counts = collections.Counter(e["name"][:80] for e in kernels)
    return {
        "steps": steps,
        "kernels": len(kernels),
        "wall_us_per_step": wall / steps,
        "gpu_busy_us_per_step": busy / steps,
        "gpu_idle_share": 1 - busy / wall if wall else 0.0,
        # the named groups always (0 where none ran), then the largest of the rest
        "groups_us_per_step": {
            **{label: by_group[label] / steps for label, _ in GROUPS},
            **{k: v / steps for k, v in by_group.most_common(8) if k not in dict(GROUPS)},
        },
        "top_kernels_us_per_step": {k: v / steps for k, v in by_name.most_common(30)},
        "kernels_us_per_step": {
            k: v / steps for k, v in by_name.items()
        },  # every name: what beyond() compares
        "launches_per_step": len(kernels) / steps,
        "launch_counts_per_step": {k: v / steps for k, v in counts.items()},
        "host_waits_us_per_step": {k: v / steps for k, v in waits.most_common(15)},
    }


def profile(
    server: RealServer, prompt: str, steps: int, out_dir: Path, keep_dir: Path, warm: int = 0
) -> dict:
    server.complete(prompt, 2)  # the prompt into the prefix cache
    server.complete(prompt, 32)  # warm: every graph this row replays
    for _ in range(warm):  # whole requests first, as a benchmark's timed rounds follow its untimed one
        server.complete(prompt, 8 * steps + 64)
    out_dir.mkdir(parents=True, exist_ok=True)
    before = set(out_dir.glob("*.trace.json*"))
    body = {"output_dir": str(out_dir), "num_steps": steps, "activities": ["GPU"], "with_stack": False,
            "record_shapes": False, "profile_id": f"{server.spec.name}-{len(prompt)}"}  # fmt: skip

    def start():  # once the request decodes: the profiled steps are verify steps, not the prompt's prefill
        httpx.post(f"{server.url}/start_profile", json=body, timeout=60).raise_for_status()

    t0 = time.monotonic()
    # Enough tokens that the profiled steps all decode this request (an NGRAM step accepts up to 8).
    server.stream([prompt], 8 * steps + 64, timeout=300, on_first=start)
    while time.monotonic() - t0 < 120:  # the trace is written when the last profiled step ends
        new = set(out_dir.glob("*.trace.json*")) - before
        if new:
            path = max(new, key=lambda p: p.stat().st_mtime)
            time.sleep(1.0)  # let the writer finish
            opener = gzip.open if path.suffix == ".gz" else open
            with opener(path, "rt") as f:
                trace = json.load(f)
            path.unlink()  # traces are large; the summary and the kernels' (name, start, duration) are what this keeps
            kept = [
                [e["name"], e["ts"], e["dur"]]
                for e in trace.get("traceEvents", [])
                if e.get("cat") == "kernel"
            ]
            keep_dir.mkdir(parents=True, exist_ok=True)
            with gzip.open(keep_dir / f"{body['profile_id']}.kernels.json.gz", "wt") as f:
                json.dump(kept, f)
            return summarize(trace, steps)
        time.sleep(0.5)
    return {"error": "no trace written in 120 s"}


def markdown(rows: list[dict]) -> str:
    lines = [
        "| algorithm | prompt | mode | step wall (us) | GPU busy (us) | GPU idle | GPU time per step by kernel group (us) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        s = r["summary"]
        if "error" in s:
            lines.append(f"| {r['algorithm']} | {r['prompt']} | {r['mode']} | {s['error']} | | | |")
            continue
        groups = "; ".join(f"{k} {v:.0f}" for k, v in s["groups_us_per_step"].items())
        lines.append(f"| {r['algorithm']} | {r['prompt']} | {r['mode']} | {s['wall_us_per_step']:.0f} | "
                     f"{s['gpu_busy_us_per_step']:.0f} | {100 * s['gpu_idle_share']:.0f}% | {groups} |")  # fmt: skip
    return "\n".join(lines)


def beyond(rows: list[dict], base: str = "DFLASH-B16", top: int = 15) -> str:
    """What each other algorithm's step adds to `base`'s at the same prompt and mode, kernel by kernel: GPU time and
    launches a step (where a DDTREE step's own cost is, against DFlash's chain)."""
    ok = [r for r in rows if "error" not in r["summary"]]
    out = []
    for b in (r for r in ok if r["algorithm"] == base):
        for r in (
            r for r in ok if r["algorithm"] != base and (r["prompt"], r["mode"]) == (b["prompt"], b["mode"])
        ):
            mine, theirs = r["summary"], b["summary"]
            us = collections.Counter(mine["kernels_us_per_step"])
            us.subtract(theirs["kernels_us_per_step"])
            wall = mine["wall_us_per_step"] - theirs["wall_us_per_step"]
            busy = mine["gpu_busy_us_per_step"] - theirs["gpu_busy_us_per_step"]
            launches = mine["launches_per_step"] - theirs["launches_per_step"]
            out += [
                f"\n{r['algorithm']} beyond {base}, prompt {r['prompt']}, {r['mode']}: step wall {wall:+.0f} us, GPU "
                f"busy {busy:+.0f} us, launches {launches:+.1f} a step; the kernels that differ most (us a step):",
                "",
                "| kernel | us a step | launches a step |",
                "|---|---|---|",
            ]
            count = collections.Counter(mine["launch_counts_per_step"])
            count.subtract(theirs["launch_counts_per_step"])
            for name, d in sorted(us.items(), key=lambda kv: -abs(kv[1]))[:top]:
                out.append(f"| {name} | {d:+.1f} | {count.get(name, 0):+.1f} |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="write the table here (and .json beside it)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument(
        "--algorithms",
        default="NEXTN,NGRAM",
        help="keys of real_server.SPECULATIVE; a DDTREE key runs its whole tree each step, with -AUTO kdtree's auto "
        "budget (KDTREE_DDTREE_BUDGET)",
    )
    ap.add_argument(
        "--modes", default="off,on", help="kdtree's modes to profile each algorithm in: off, on or both"
    )
    ap.add_argument("--prompts", default="512,32768", help="prompt lengths in tokens")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument(
        "--warm", type=int, default=0, help="whole requests of the row's prompt before the profiled one"
    )
    ap.add_argument("--root", default="/tmp/kdtree-profile-engine")
    ap.add_argument(
        "--oracle",
        default=None,
        help=f"a profile of ddtree_oracle.PROFILES ({list(PROFILES)}): every server runs the oracle's bigram target "
        "and scripted drafter, so its steps accept what the profile says (DFlash-drafted algorithms only)",
    )
    args = ap.parse_args()
    algos = [a.strip().upper() for a in args.algorithms.split(",") if a.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    wrong = [
        a for a in algos if server_key(a) not in SPECULATIVE or (a != server_key(a) and "DDTREE" not in a)
    ]
    wrong += [m for m in modes if m not in (Mode.OFF.value, Mode.ON.value)]
    if wrong or not algos or not modes:
        print(f"profile_engine: unknown {wrong or 'empty --algorithms or --modes'}: algorithms are keys of "
              f"real_server.SPECULATIVE ({list(SPECULATIVE)}; DDTREE ones may end in -AUTO), modes off and on",
              file=sys.stderr)  # fmt: skip
        return 2
    undrafted = [a for a in algos if server_key(a) not in DFLASH_BLOCK]
    if args.oracle is not None and args.oracle not in PROFILES:
        print(f"profile_engine: --oracle {args.oracle}: not a profile of the oracle; use one of {list(PROFILES)}",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.oracle is not None and undrafted:
        print(f"profile_engine: --oracle scripts DFlash's drafter, which {undrafted} do not run: profile them "
              f"without --oracle, or choose among {list(DFLASH_BLOCK)}", file=sys.stderr)  # fmt: skip
        return 2
    reason = unavailable()
    if reason:
        print(f"profile_engine: {reason}", file=sys.stderr)
        return 2
    root = Path(args.root)
    prompts = [int(x) for x in args.prompts.split(",") if x]
    model = write_model(root / f"model-{args.layers}l", layers=args.layers, nextn=True)
    oracle_env = {}
    if args.oracle is not None:
        root.mkdir(parents=True, exist_ok=True)
        write_profile(root / "oracle-profile", PROFILES[args.oracle])
        oracle_env = {PROFILE_ENV: str(root / "oracle-profile")}
    servers = {}
    for algo in algos:
        for mode in map(Mode, modes):
            spec = ServerSpec(f"{algo.lower()}-{args.layers}l-{mode.value}", server_key(algo), mode,
                              layers=args.layers, max_total_tokens=max(prompts) + 8 * args.steps + 8192,
                              extra_args=("--sleep-on-idle",), env={**server_env(algo), **oracle_env})  # fmt: skip
            servers[(algo, mode.value)] = RealServer(spec, root / spec.name, model).start()
    rows = []
    keep = Path(args.out).parent / "kernels" if args.out else root / "kernels"  # each row's kernels, gzipped
    try:
        for s in servers.values():
            s.wait_ready(timeout=540)
        for (algo, mode), s in servers.items():
            for plen in prompts:
                summary = profile(s, prompt_of(plen, seed=plen), args.steps, root / "traces", keep, args.warm)
                rows.append({"algorithm": algo, "prompt": plen, "mode": mode, "layers": args.layers,
                             "summary": summary})  # fmt: skip
                print(json.dumps(rows[-1]), flush=True)
    finally:
        for s in servers.values():
            s.stop(timeout=30)
    import torch

    props = torch.cuda.get_device_properties(0)
    head = [
        f"GPU: {props.name} ({props.multi_processor_count} SMs), {datetime.date.today()}, commit {checkout()}",
        f"Command: {' '.join(sys.argv)}",
        f"{args.layers} layers (kernel_build/bench/harness/tiny_model.py), batch 1, {args.steps} decode steps a row, SGLang's profiler "
        "(GPU activity) from the request's first token on; CUDA graphs for batch 1-4, Triton attention"
        + (
            f"; the oracle's bigram target and scripted drafter at the {args.oracle} profile "
            f"{PROFILES[args.oracle]} (kernel_build/bench/harness/ddtree_oracle.py)"
            if args.oracle
            else ""
        ),
    ]
    text = "\n".join(head) + "\n\n" + markdown(rows) + "\n" + beyond(rows)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
        Path(args.out).with_suffix(".json").write_text(json.dumps({"head": head, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
