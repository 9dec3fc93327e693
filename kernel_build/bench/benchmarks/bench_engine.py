"""End-to-end benchmark: decode tokens/s of the real SGLang 0.5.23 server in off and in on, same prompts, greedy.

For each model depth (8 layers; 61, Kimi-K2's) and speculative algorithm (NGRAM 8 draft tokens; NEXTN topk 4, 3 steps,
8 draft tokens) it starts two real servers as production starts them (kernel_build/bench/harness/real_server.py: the launcher, the
supervised sglang.launch_server, CUDA graphs for batch 1-4, Triton attention) on a tiny DeepSeek-V3-architecture
model with random weights (kernel_build/bench/harness/tiny_model.py: MLA 576/512, 8 heads = one TP-8 rank's share of Kimi-K2, dense
1024-wide MLPs), one in off and one in on, all servers at once. Then, one server at a time, for each prompt length
and batch: the batch of prompts once to fill the prefix cache, then `--repeats` timed rounds in off and in on,
interleaved (off, on, off, on, ...), each decoding --max-tokens tokens per request with ignore_eos, streamed. Decode
tokens/s = each request's tokens after its first chunk over the time from its first chunk to its last, summed over the
batch: verify steps alone, without the prompt's handling (tokenizing, the prefix-cache match, the prefill of its last
token, which at a 32k prompt is one Triton extend call per layer in both modes), reported apart as the time to the
first token. A row is on "ahead" of or "behind" off beyond noise only where every round of one mode beats every round of
the other (`beyond_noise`, bench_oracle's rule too; with 2 rounds a mode, equal servers come apart 1 time in 3). Outputs are
compared token for token in every round; where off and on differ, the row gives the first diverging position and
both servers' top-2 logprobs there.

    python3 kernel_build/bench/benchmarks/bench_engine.py --out engine.md      # the table; engine.json beside it
    bash kernel_build/bench/device_run.sh engine                     # the same on the GPU machine, into $OUT

--algorithms takes the keys of kernel_build/bench/harness/real_server.py's SPECULATIVE: NGRAM, NEXTN, DFLASH-B8 / DFLASH-B16
(SGLang's DFlash worker, block 8 / 16, with a one-layer drafter of dummy weights) and DDTREE-B8 / DDTREE-B16 (kdtree's
DDTREE on the same drafter, trees of 16 / 32 nodes): device_run.sh engine-spec.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "kernel_build" / "bench" / "harness"))
from real_server import RealServer, ServerSpec, divergence, unavailable  # noqa: E402
from source_id import checkout  # noqa: E402  (this script's folder is on sys.path)
from tiny_model import config, prompt_of, write_model  # noqa: E402

from kdtree.config import Mode  # noqa: E402

DEFAULT_PROMPTS = (512, 2048, 32768)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def timed_round(server: RealServer, prompts: list[str], max_tokens: int) -> dict:
    """One batch, streamed: decode tokens/s (each request's tokens after its first chunk over the time from its first
    chunk to its last, summed over the batch: the prefill and the request's handling before it left out), the
    median time to the first token, the token ids per prompt and the mean accept length."""
    t0 = time.perf_counter()
    streamed, accept = server.stream(prompts, max_tokens)
    return {
        "decode_tokens_per_s": sum(s.decode_tokens_per_s for s in streamed),
        "ttft_s": statistics.median(s.first_s - t0 for s in streamed),
        "token_ids": [s.token_ids for s in streamed],
        "accept_length": statistics.mean(accept) if accept else float("nan"),
        # each request's decode chunks: (ms since its first chunk, tokens), where a slow step or a slow end shows
        "chunks": [[(round(1e3 * (t - s.first_s), 3), n) for t, n in s.chunks[1:]] for s in streamed],
    }


def beyond_noise(tps: list[float], base: list[float]) -> str:
    """Where tps stands against base beyond the run-to-run noise of both: every round of one faster than every round
    of the other. One server's median against the other's spread alone called a 0.99x row slower (236-358 tokens/s
    against 300-301)."""
    return "ahead" if min(tps) > max(base) else "behind" if max(tps) < min(base) else "within"


def row(layers, algo, plen, batch, off, on, repeats, max_tokens) -> dict:
    prompts = [prompt_of(plen, seed=1000 * plen + i) for i in range(batch)]
    for server in (off, on):  # fill the prefix cache; not timed
        server.complete(prompts, 2)
    rounds = {"off": [], "on": []}
    diff = None
    for _ in range(repeats):  # interleaved, so that a slow spell of the machine falls on both modes
        ids = {}
        for mode, server in (("off", off), ("on", on)):
            rounds[mode].append(timed_round(server, prompts, max_tokens))
            ids[mode] = rounds[mode][-1].pop("token_ids")
        diff = diff or divergence(ids["on"], ids["off"], on, off, prompts, max_tokens)
    r = {"layers": layers, "algorithm": algo, "prompt": plen, "batch": batch, "max_tokens": max_tokens}
    for mode in ("off", "on"):
        tps = [x["decode_tokens_per_s"] for x in rounds[mode]]
        r[mode] = {"tokens_per_s": tps, "median": statistics.median(tps),
                   "ttft_s": statistics.median(x["ttft_s"] for x in rounds[mode]),
                   "accept_length": statistics.mean(x["accept_length"] for x in rounds[mode])}  # fmt: skip
    r["ratio"] = r["on"]["median"] / r["off"]["median"]
    r["beyond_noise"] = beyond_noise(r["on"]["tokens_per_s"], r["off"]["tokens_per_s"])
    r["identical"] = diff is None
    r["divergence"] = diff
    return r


def markdown(rows: list[dict], head: list[str]) -> str:
    lines = head + [
        "",
        "| layers | algorithm | prompt | batch | off decode tokens/s (median; min-max) | on decode tokens/s (median; "
        "min-max) | on / off | on vs off beyond noise | time to first token off / on (ms) | accept length (off / on) "
        "| outputs |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        off, on = r["off"], r["on"]
        lines.append(
            f"| {r['layers']} | {r['algorithm']} | {r['prompt']} | {r['batch']} | {off['median']:.1f}; "
            f"{min(off['tokens_per_s']):.1f}-{max(off['tokens_per_s']):.1f} | {on['median']:.1f}; "
            f"{min(on['tokens_per_s']):.1f}-{max(on['tokens_per_s']):.1f} | {r['ratio']:.2f}x | "
            f"{beyond_noise(on['tokens_per_s'], off['tokens_per_s'])} | {1e3 * off['ttft_s']:.0f} / {1e3 * on['ttft_s']:.0f} | "
            f"{off['accept_length']:.2f} / {on['accept_length']:.2f} | "
            + ("identical" if r["identical"] else r["divergence"])
            + " |"
        )
    return "\n".join(lines)


def write(out: str | None, rows: list[dict], failed: dict[str, str], head: list[str], table=None) -> str:
    """The table (and, with out, its .md and .json) of the rows so far; table: the rows' markdown (this script's
    by default; bench_oracle.py passes its own)."""
    text = (table or markdown)(rows, head) + "".join(f"\n\nNot measured: {k}: {v}" for k, v in failed.items())
    if out:
        Path(out).write_text(text + "\n")
        Path(out).with_suffix(".json").write_text(
            json.dumps({"head": head, "rows": rows, "not_measured": failed}, indent=1)
        )
    return text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="write the table here (and .json beside it)")
    ap.add_argument("--layers", type=_ints, default=[8, 61])
    ap.add_argument("--algorithms", default="NGRAM,NEXTN")
    ap.add_argument("--prompts", type=_ints, default=list(DEFAULT_PROMPTS), help="prompt lengths in tokens")
    ap.add_argument("--batches", type=_ints, default=[1, 4])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "fp8_e4m3", "fp8_e5m2"],
        help="SGLang's --kv-cache-dtype for every server (auto: bf16 here)",
    )
    ap.add_argument("--root", default="/tmp/kdtree-bench-engine", help="model folders and server state")
    ap.add_argument(
        "--time-budget-s", type=float, default=None, help="start no new row after this many seconds"
    )
    args = ap.parse_args()
    reason = unavailable()
    if reason:
        print(f"bench_engine: {reason}", file=sys.stderr)
        return 2
    import torch

    root = Path(args.root)
    algos = [a.strip().upper() for a in args.algorithms.split(",") if a.strip()]
    tokens = max(args.batches) * (max(args.prompts) + args.max_tokens + 64) + 4096
    servers: dict[tuple, RealServer] = {}
    for layers in args.layers:
        model = write_model(root / f"model-{layers}l", layers=layers, nextn=True)
        for algo in algos:
            for mode in (Mode.OFF, Mode.ON):
                # --sleep-on-idle: the servers not being measured must not busy-poll the CPUs the measured one needs
                spec = ServerSpec(f"{algo.lower()}-{layers}l-{mode.value}", algo, mode, layers=layers,
                                  max_total_tokens=tokens, kv_cache_dtype=args.kv_cache_dtype,
                                  extra_args=("--sleep-on-idle",))  # fmt: skip
                servers[(layers, algo, mode.value)] = RealServer(spec, root / spec.name, model).start()
    props = torch.cuda.get_device_properties(0)
    cfg = config(layers=args.layers[0])
    head = [
        f"GPU: {props.name} ({props.multi_processor_count} SMs), {datetime.date.today()}, commit {checkout()}",
        f"Command: {' '.join(sys.argv)}",
        f"Model: tiny DeepSeek-V3 architecture, random weights (--load-format dummy), layers {args.layers}, hidden "
        f"{cfg['hidden_size']}, {cfg['num_attention_heads']} heads, MLA kv_lora_rank {cfg['kv_lora_rank']} + rope "
        f"{cfg['qk_rope_head_dim']}, dense MLP {cfg['intermediate_size']}; one MTP layer (MoE) for NEXTN; "
        + (
            "a one-layer DFlash drafter (dummy weights) for DFLASH and DDTREE; "
            if any(a.startswith(("DFLASH", "DDTREE")) for a in algos)
            else ""
        )
        + ("bf16 KV" if args.kv_cache_dtype == "auto" else f"KV cache {args.kv_cache_dtype} (scales 1.0)"),
        f"Server: tp 1, Triton attention, CUDA graphs for batch 1-4, greedy, ignore_eos, {args.max_tokens} tokens per "
        f"request, {args.repeats} rounds per mode (interleaved), prompt in the prefix cache, --sleep-on-idle; decode "
        "tokens/s from the streamed chunks (after each request's first token), time to first token apart",
    ]
    t0 = time.monotonic()
    failed: dict[str, str] = {}  # server or row -> why it has no numbers (the table says so)
    rows: list[dict] = []
    try:
        for s in servers.values():
            try:
                s.wait_ready(timeout=540)
            except (RuntimeError, TimeoutError) as e:
                failed[s.spec.name] = str(e).splitlines()[0]
        print(f"{len(servers) - len(failed)} servers ready after {time.monotonic() - t0:.0f} s", flush=True)
        for (layers, algo, mode), off in servers.items():
            if mode != "off":
                continue
            on = servers[(layers, algo, "on")]
            for plen in args.prompts:
                for batch in args.batches:
                    where = f"{layers} layers, {algo}, prompt {plen}, batch {batch}"
                    if off.spec.name in failed or on.spec.name in failed:
                        failed[where] = "a server did not start"
                        continue
                    if args.time_budget_s and time.monotonic() - t0 > args.time_budget_s:
                        failed[where] = f"not run: past --time-budget-s {args.time_budget_s:g}"
                        continue
                    try:
                        r = row(layers, algo, plen, batch, off, on, args.repeats, args.max_tokens)
                    except (RuntimeError, OSError, KeyError, httpx.HTTPError) as e:  # a server crashed
                        failed[where] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
                        continue
                    rows.append(r)
                    print(json.dumps(r), flush=True)
                    write(args.out, rows, failed, head)  # row by row: a run cut short keeps its table
            for s in (off, on):
                try:
                    rec = s.record(0)
                except KeyError:
                    continue
                print(f"{s.spec.name}: served_kdtree {rec.served_kdtree}, served_original {rec.served_original}, "
                      f"fallbacks {rec.fallbacks}", flush=True)  # fmt: skip
    finally:
        for s in servers.values():
            s.stop(timeout=30)
    text = write(args.out, rows, failed, head)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
