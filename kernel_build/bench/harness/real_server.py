"""The real SGLang 0.5.23 server on this GPU, started the way the server container starts it.

`RealServer` runs `python -m entrypoint.launch <sglang.launch_server arguments>`: kdtree's validating launcher, which
runs `python -m sglang.launch_server` as its supervised child (output into KDTREE_STATE_DIR/server.log, starts and
exit status into server-process.json), with the real scheduler process, the CUDA-graph runner and tree speculation
(NGRAM: 8 draft tokens; NEXTN: topk 4, 3 steps, 8 draft tokens; DFLASH-B8 / DFLASH-B16: SGLang's DFlash worker,
block 8 / 16, a one-layer drafter with dummy weights) on a tiny DeepSeek-V3-architecture model
(kernel_build/bench/harness/tiny_model.py, random weights), Triton attention, CUDA graphs on. It runs under a stand-in orchestrator
(standins/process_harness.Orchestrated: started again when it exits, as compose's restart policy), so the sidecar
controls it through its real process control.

kdtree reaches the SGLang processes one of two ways, as the tests choose (`install`):
- "plugin": the kdtree package installed into a site folder (KDTREE_ENGINE_SITE, default /tmp/site, where
  kernel_build/bench/device_run.sh installs it with the built library) and found by SGLang's own load_plugins()
  through its `sglang.srt.plugins` entry point; no kdtree sitecustomize;
- "sitecustomize": entrypoint/sitecustomize.py first on PYTHONPATH, as in the server image, with the entry point
  switched off (SGLANG_PLUGINS names another plugin), so only the import hook installs.
The repository itself is never on the server's path: what runs is the installed package.

What the GPU machine lacks is stood in for in every server process by standins/engine_site/sitecustomize.py
(SGLang's compiled packages, setproctitle, xgrammar: standins/sglang_stubs.py), and these settings
(ENGINE_ENV) keep SGLang off the compiled parts that cannot load there.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "standins"))

from process_harness import Orchestrated  # noqa: E402
from tiny_model import write_dflash_drafter  # noqa: E402  (this folder is on sys.path wherever this module is)

from kdtree.config import Mode  # noqa: E402
from kdtree.state.mode_file import write_desired_mode  # noqa: E402
from kdtree.state.rank_records import read_records  # noqa: E402
from kdtreectl.check import first_divergence  # noqa: E402

HARNESS_DIR = Path(__file__).resolve().parent
ENGINE_SITE = REPO / "standins" / "engine_site"
ENGINE_ENV = {
    "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND": "python",  # the Rust radix core is built for another torch's ABI
    "SGLANG_IS_FLASHINFER_AVAILABLE": "false",
    "SGLANG_ENABLE_JIT_DEEPGEMM": "0",
    "SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK": "1",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
NONE = "NONE"
# DDTREE-B16-T<t>'s tree sizes: 2^k - 1 fill whole row tiles of kdtree's kernel (2^k tokens), 2^k pad one
TREE_SIZES = (15, 16, 31, 64, 128)
SPECULATIVE = {
    # no speculation: plain SGLang (`python -m sglang.launch_server`, not kdtree's launcher, which refuses a server
    # with nothing to verify): the reference that greedy outputs under speculation must equal
    NONE: (),
    "NGRAM": ("--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "8"),
    "NEXTN": (
        "--speculative-algorithm", "NEXTN", "--speculative-num-steps", "3", "--speculative-eagle-topk", "4",
        "--speculative-num-draft-tokens", "8",
    ),
    # SGLang's own DFlash worker with a tiny drafter of dummy weights (RealServer writes it: tiny_model.py); its
    # verify is a causal chain of block-size tokens (no custom mask)
    **{
        f"DFLASH-B{b}": (
            "--speculative-algorithm", "DFLASH", "--speculative-num-draft-tokens", str(b),
            "--speculative-dflash-block-size", str(b), "--speculative-draft-load-format", "dummy",
            "--speculative-draft-attention-backend", "triton",
        )
        for b in (8, 16)
    },
    # kdtree's DDTREE (kdtree.ddtree): the same drafter's block, a best-first tree of N - 1 nodes verified as N
    # tokens with the ancestor mask (block 8: 16 nodes; block 16: 32, the budget); page size 1, overlap
    # scheduling on (SGLang's default, as DFLASH runs)
    **{
        f"DDTREE-B{b}": (
            "--speculative-algorithm", "DDTREE", "--speculative-num-draft-tokens", str(n),
            "--speculative-dflash-block-size", str(b), "--speculative-draft-load-format", "dummy",
            "--speculative-draft-attention-backend", "triton", "--page-size", "1",
        )
        for b, n in ((8, 17), (16, 33))
    },
    # the same on block 16 with trees of T nodes (the oracle benchmark's fixed budgets; DDTREE-B16 is T32)
    **{
        f"DDTREE-B16-T{t}": (
            "--speculative-algorithm", "DDTREE", "--speculative-num-draft-tokens", str(t + 1),
            "--speculative-dflash-block-size", "16", "--speculative-draft-load-format", "dummy",
            "--speculative-draft-attention-backend", "triton", "--page-size", "1",
        )
        for t in TREE_SIZES
    },
}  # fmt: skip
# the algorithms above that need a DFlash drafter, and its block
DFLASH_BLOCK = {
    "DFLASH-B8": 8, "DFLASH-B16": 16, "DDTREE-B8": 8, "DDTREE-B16": 16,
    **{f"DDTREE-B16-T{t}": 16 for t in TREE_SIZES},
}  # fmt: skip
AUTO = "-AUTO"  # a DDTREE key with this suffix runs KDTREE_DDTREE_BUDGET=auto, that key's budget as the cap


def server_key(algo: str) -> str:
    """The SPECULATIVE key a benchmark's algorithm runs (its name without AUTO)."""
    return algo.removesuffix(AUTO)


def server_env(algo: str) -> dict:
    """DDTREE at a fixed budget verifies its whole tree; with AUTO, kdtree's auto budget cuts it each step."""
    if not algo.startswith("DDTREE"):
        return {}
    return {"KDTREE_DDTREE_BUDGET": "auto" if algo.endswith(AUTO) else "fixed"}


CAPTURED_BS = (1, 2, 3, 4)  # verify graphs captured per server; larger batches run eagerly
INSTALL_LINE = re.compile(
    r"\[kdtree\] installed verify override \(mode=(\w+), pid=(\d+), tp_rank=([\w?]+), via=([\w-]+)\)"
)


def site_dir() -> Path:
    return Path(os.environ.get("KDTREE_ENGINE_SITE", "/tmp/site"))


def cuda_home() -> str | None:
    """CUDA_HOME for SGLang's JIT kernels (compiled with nvcc at first use, linked against $CUDA_HOME/lib64): the
    environment's, else the toolkit holding the nvcc on PATH, else /usr/local/cuda."""
    nvcc = shutil.which("nvcc")
    candidates = [
        os.environ.get("CUDA_HOME"),
        nvcc and str(Path(nvcc).resolve().parents[1]),
        "/usr/local/cuda",
    ]
    for home in filter(None, candidates):
        if (Path(home) / "bin" / "nvcc").exists() and (Path(home) / "lib64").exists():
            return home
    return None


def unavailable() -> str | None:
    """Why the real server cannot run here, or None."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU on this machine (run: bash kernel_build/bench/device_run.sh engine-tests)"
    if cuda_home() is None:
        return "no nvcc (SGLang compiles its JIT kernels at first use): set CUDA_HOME"
    installed = site_dir() / "kdtree" / "lib" / "libkdtree_verify.so"
    if not installed.is_file() or not list(site_dir().glob("kdtree-*.dist-info")):
        return (
            f"kdtree is not installed with its kernel library in {site_dir()} (KDTREE_ENGINE_SITE): "
            "kernel_build/bench/device_run.sh engine-tests installs it there"
        )
    if not list(site_dir().glob("sglang-0.5.23*.dist-info")) and not _importable("sglang"):
        return "SGLang 0.5.23's Python side is not importable (copy its wheels to .whl: docs/development.md, GPU tests)"
    return None


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


_GIVEN_PORTS: set[int] = set()
_PORTS_LOCK = threading.Lock()


def free_port() -> int:
    """A port free now and handed to no other server of this process: servers start in parallel and bind only later."""
    with _PORTS_LOCK:
        while True:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            if port not in _GIVEN_PORTS:
                _GIVEN_PORTS.add(port)
                return port


def rendezvous_port() -> int:
    """A port for a server's rendezvous (--nccl-port), drawn as SGLang draws it (below the kernel's ephemeral range,
    where no outgoing connection takes it before the server binds it; free on every address) but never one handed
    to another server of this process."""
    try:
        ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    with _PORTS_LOCK:
        for port in random.sample(range(22000, min(29999, ephemeral_low - 1) + 1), 256):
            if port in _GIVEN_PORTS:
                continue
            with socket.socket() as s:
                try:
                    s.bind(("0.0.0.0", port))
                except OSError:
                    continue
            _GIVEN_PORTS.add(port)
            return port
    raise RuntimeError("no free rendezvous port below the ephemeral range (22000-29999) after 256 draws")


@dataclass(frozen=True)
class ServerSpec:
    """One server: speculative algorithm, the mode it starts in, how kdtree is installed, the model's depth."""

    name: str
    algorithm: (
        str  # a key of SPECULATIVE: NGRAM | NEXTN | DFLASH-B8 | DFLASH-B16 | DDTREE-B8 | DDTREE-B16[-T<n>]
    )
    mode: Mode
    install: str = "plugin"  # plugin | sitecustomize
    layers: int = 8
    max_total_tokens: int = 65536
    kv_cache_dtype: str = "auto"  # SGLang's --kv-cache-dtype: auto (bf16 here), fp8_e4m3, fp8_e5m2
    # SGLang's --mem-fraction-static. Servers sharing the GPU with large pools want more: SGLang sizes a pool from the
    # memory free when the pool is made less (1 - fraction) x the memory free at the server's start.
    mem_fraction: float = 0.5
    extra_args: tuple[str, ...] = ()
    env: dict = field(default_factory=dict)
    own_library: bool = False  # a copy of the kernel library of its own (KDTREE_KERNEL_LIB), for fault tests


@dataclass
class Streamed:
    """One streamed completion: its tokens, when its first and last chunk of tokens came (time.perf_counter
    seconds), how many tokens the first chunk held (the prefill's), and each chunk's (arrival, tokens): a decode
    chunk is one verify step's tokens, so the arrivals' gaps are the steps' wall times."""

    token_ids: list[int] = field(default_factory=list)
    first_s: float = 0.0
    last_s: float = 0.0
    first_tokens: int = 0
    chunks: list[tuple[float, int]] = field(default_factory=list)

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first chunk over the time from the first chunk to the last: decode alone, the prompt's
        prefill (and the request's handling before it) left out."""
        span = self.last_s - self.first_s
        return (len(self.token_ids) - self.first_tokens) / span if span > 0 else float("nan")


def read_stream(lines, n: int, on_first=None) -> tuple[list[Streamed], list[float]]:
    """SGLang's server-sent events of a streamed /v1/completions batch of n prompts, read as they arrive: each
    prompt's `Streamed`, and the spec_accept_length values of the closing sglext chunk. on_first, if given, is
    called once, when every prompt has its first token (decode has begun)."""
    out, accept = [Streamed() for _ in range(n)], []
    for line in lines:
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk, now = json.loads(line[len("data: ") :]), time.perf_counter()
        details = (chunk.get("sglext") or {}).get("spec_tokens_details")
        accept += [
            d.get("spec_accept_length") or 0.0
            for d in ([details] if isinstance(details, dict) else details or [])
        ]
        for c in chunk.get("choices") or []:
            ids = c.get("token_ids") or []
            if ids:
                s = out[c["index"]]
                if not s.token_ids:
                    s.first_s, s.first_tokens = now, len(ids)
                s.last_s = now
                s.token_ids.extend(ids)
                s.chunks.append((now, len(ids)))
                if on_first is not None and all(x.token_ids for x in out):
                    on_first()
                    on_first = None
    return out, accept


class RealServer(Orchestrated):
    name = "SGLang server (process control)"

    def __init__(self, spec: ServerSpec, root: Path, model_dir: Path, *, port: int | None = None):
        self.spec = spec
        self.root = root
        self.port = port or free_port()
        # SGLang draws its rendezvous port at random in each server (22000-29999), so servers starting together can
        # draw the same one (EADDRINUSE at init_process_group): each gets one of its own.
        self.nccl_port = rendezvous_port()
        self.model_dir = model_dir
        state = root / "state"
        state.mkdir(parents=True, exist_ok=True)
        write_desired_mode(state, spec.mode)  # as the sidecar leaves it: the launcher reads it at start
        paths = [str(site_dir()), str(ENGINE_SITE), str(ENGINE_SITE.parent), str(HARNESS_DIR)]
        env = {**ENGINE_ENV, "CUDA_HOME": cuda_home() or "", "KDTREE_VERIFY": spec.mode.value,
               "KDTREE_HEARTBEAT_S": "1", **spec.env}  # fmt: skip
        if spec.own_library:
            self.library = root / "lib" / "libkdtree_verify.so"
            self.library.parent.mkdir(exist_ok=True)
            shutil.copy(site_dir() / "kdtree" / "lib" / "libkdtree_verify.so", self.library)
            env["KDTREE_KERNEL_LIB"] = str(self.library)
        if spec.install == "sitecustomize":
            kdtree_site = root / "kdtree-site"  # the server image's /opt/kdtree/site: sitecustomize alone
            kdtree_site.mkdir(exist_ok=True)
            shutil.copy(REPO / "entrypoint" / "sitecustomize.py", kdtree_site / "sitecustomize.py")
            paths.insert(0, str(kdtree_site))
            env["SGLANG_PLUGINS"] = "no-such-plugin"  # SGLang's whitelist: kdtree's entry point is skipped
        env["PYTHONPATH"] = os.pathsep.join(paths)
        # A crashed server is started again after 8 s (Docker's backoff is 0.1-1 s at first; 8 s lets a fault test
        # act between a crash and the next start).
        super().__init__(state, env=env, console=root / "console.log", restart_wait_s=120.0,
                         crash_restart_delay_s=8.0)  # fmt: skip
        self.cwd = root  # not the repository: `python -m` would put it first on sys.path
        self.drafter = None
        if spec.algorithm in DFLASH_BLOCK:
            target_layers = json.loads((Path(model_dir) / "config.json").read_text())["num_hidden_layers"]
            self.drafter = write_dflash_drafter(
                root / "dflash-drafter", target_layers, DFLASH_BLOCK[spec.algorithm]
            )

    def args(self) -> list[str]:
        s = self.spec
        return [
            "--model-path", str(self.model_dir), "--tp-size", "1", "--host", "127.0.0.1", "--port", str(self.port),
            "--nccl-port", str(self.nccl_port),
            "--attention-backend", "triton", "--trust-remote-code", "--load-format", "dummy",
            "--sampling-backend", "pytorch", "--grammar-backend", "none",
            "--mem-fraction-static", str(s.mem_fraction), "--max-total-tokens", str(s.max_total_tokens),
            "--cuda-graph-bs-decode", *map(str, CAPTURED_BS), "--log-level", "info",
            # SGLang's piecewise prefill graph (breakable) calls sgl_kernel.weak_ref_tensor, a compiled function
            # with no torch-native equivalent here; prefill is not target-verify, so kdtree never serves it.
            "--disable-prefill-cuda-graph", "--kv-cache-dtype", s.kv_cache_dtype,
            *SPECULATIVE[s.algorithm],
            *(("--speculative-draft-model-path", str(self.drafter)) if self.drafter else ()), *s.extra_args,
        ]  # fmt: skip

    def command(self) -> list[str]:
        if self.spec.algorithm == NONE:
            return [sys.executable, "-m", "sglang.launch_server", *self.args()]
        return [sys.executable, "-m", "entrypoint.launch", *self.args()]

    # ---- waiting ---------------------------------------------------------------------------------

    def wait_ready(self, timeout: float = 480.0) -> None:
        """Until the server answers a completion; fails at once with the log's tail when it exits."""
        deadline = time.monotonic() + timeout
        starts = None
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                starts = starts or self.starts
                raise RuntimeError(
                    f"{self.spec.name} exited with {self.proc.returncode}; its output:\n{self.console_tail()}"
                )
            try:
                r = httpx.get(f"{self.url}/v1/models", timeout=5)
                if r.status_code == 200 and self.complete("w1 w2 w3", max_tokens=2)["choices"]:
                    return
            except (httpx.HTTPError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{self.spec.name} not ready in {timeout:g}s; its output:\n{self.console_tail()}"
                )
            time.sleep(1.0)

    def console_tail(self, lines: int = 80) -> str:
        try:
            return "\n".join(self.console.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no output)"

    # ---- requests --------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _body(self, prompt, max_tokens: int, **extra) -> dict:
        """A /v1/completions request: greedy, ignore_eos, token ids and speculative details returned."""
        return {"model": str(self.model_dir), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True, "return_spec_tokens_details": True, **extra}  # fmt: skip

    def complete(self, prompt, max_tokens: int = 32, timeout: float = 600, **extra) -> dict:
        """POST /v1/completions, greedy, ignore_eos; prompt may be a list (one batch). Raises on a non-200."""
        r = httpx.post(
            f"{self.url}/v1/completions", json=self._body(prompt, max_tokens, **extra), timeout=timeout
        )
        if r.status_code != 200:
            raise RuntimeError(
                f"{self.spec.name}: POST /v1/completions answered {r.status_code}: {r.text[:500]}"
            )
        return r.json()

    def stream(
        self, prompts: list[str], max_tokens: int, timeout: float = 600, on_first=None, **extra
    ) -> tuple[list[Streamed], list[float]]:
        """The prompts as one batch, greedy, streamed (POST /v1/completions, stream): a `Streamed` per prompt, in
        prompt order (its first chunk is the token the prefill produced; what follows is decode, verify steps), and
        the spec_accept_length SGLang reports for each request at the end. on_first: as read_stream's. extra: more
        of the request's fields (sampling: temperature, top_p, top_k)."""
        body = self._body(prompts, max_tokens, stream=True, **extra)
        with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=timeout) as r:
            if r.status_code != 200:
                raise RuntimeError(f"{self.spec.name}: POST /v1/completions (stream) answered {r.status_code}: "
                                   f"{r.read()[:500]!r}")  # fmt: skip
            return read_stream(r.iter_lines(), len(prompts), on_first)

    def top2(self, prompt: str, position: int, max_tokens: int) -> str:
        """The two likeliest tokens and their logprobs at `position` of the greedy completion of `prompt`, and their
        margin: where two servers' greedy outputs part, a near-tie there is rounding order, a wide margin is not."""
        body = self.complete(prompt, max_tokens, logprobs=2)
        top = body["choices"][0]["logprobs"]["top_logprobs"][position]
        (t1, l1), (t2, l2) = sorted(top.items(), key=lambda kv: -kv[1])[:2]
        return f"{t1!r} {l1:.3f} / {t2!r} {l2:.3f} (margin {l1 - l2:.3f})"

    def token_ids(self, prompts: list[str], max_tokens: int = 32) -> list[list[int]]:
        """Greedy completions of the prompts, sent as one batch, in prompt order."""
        choices = sorted(self.complete(prompts, max_tokens)["choices"], key=lambda c: c["index"])
        return [c["token_ids"] for c in choices]

    # ---- what kdtree and the launcher left in the state volume -----------------------------------

    def records(self):
        return [v.record for v in read_records(self.state_dir, max_age_s=60)]

    def record(self, rank: int = 0):
        recs = {r.tp_rank: r for r in self.records()}
        return recs[rank]

    def server_log(self) -> str:
        """The server's output: the launcher's copy in the state folder, or (NONE, no launcher) the console."""
        path = Path(self.state_dir) / "server.log"
        if not path.exists() and self.spec.algorithm == NONE:
            path = self.console
        return path.read_text(errors="replace") if path.exists() else ""

    def process_record(self) -> dict:
        return json.loads((Path(self.state_dir) / "server-process.json").read_text())

    def install_lines(self) -> list[tuple[str, int, str, str]]:
        """(mode, pid, tp_rank, via) of each `[kdtree] installed verify override` line this start printed."""
        return [(m[1], int(m[2]), m[3], m[4]) for m in INSTALL_LINE.finditer(self.server_log())]

    def switch(self, mode: Mode, timeout: float = 30.0) -> float:
        """A live switch as the sidecar makes it: write the mode file, wait until every rank's record reports it.
        Returns the seconds that took."""
        t0 = time.monotonic()
        write_desired_mode(self.state_dir, mode)
        while time.monotonic() - t0 < timeout:
            recs = self.records()
            if recs and all(r.mode == mode.value for r in recs):
                return time.monotonic() - t0
            time.sleep(0.1)
        raise TimeoutError(f"{self.spec.name}: ranks did not confirm mode {mode} in {timeout:g}s: "
                           f"{[(r.tp_rank, r.mode, r.mode_pending) for r in self.records()]}")  # fmt: skip


def divergence(got, want, server: RealServer, reference: RealServer, prompts, max_tokens) -> str | None:
    """None when every request's tokens agree; else the first request that differs, where, and both servers' top-2
    logprobs there."""
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        at = first_divergence(a, b)
        if at is not None:
            return (
                f"request {i}: first differs at token {at} of {len(b)}; top-2 there: "
                f"{server.spec.name} {server.top2(prompts[i], at, max_tokens)}, "
                f"{reference.spec.name} {reference.top2(prompts[i], at, max_tokens)}"
            )
    return None
