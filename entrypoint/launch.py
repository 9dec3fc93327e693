"""Server container entry: check the configuration, print it once, then run SGLang's launcher under supervision.

    python -m entrypoint.launch <sglang.launch_server arguments...>

Each check fails fast with one line naming the problem and the fix (exit code 2), so a misconfigured
pod dies in seconds with a reason instead of minutes later inside SGLang. On success
`python -m sglang.launch_server` runs as this process's child (entrypoint.supervise): its output goes on to
the container's stdout and stderr as it comes and into a size-capped log in KDTREE_STATE_DIR, stop signals
are passed on to it, and the container exits with its status (128+N when signal N killed it). The start,
the server's pid and the exit status are recorded in KDTREE_STATE_DIR/server-process.json, refused
configurations included: what the sidecar reads when it controls the server without the Docker socket.

The desired mode comes from the sidecar's file KDTREE_STATE_DIR/mode when present, else from
KDTREE_VERIFY; it is exported to SGLang as KDTREE_VERIFY.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import ClassVar

from pydantic import SecretStr, ValidationError

from entrypoint.supervise import DEFAULT_LOG_MAX_BYTES, StopRequested, Supervisor, SupervisorSettings
from kdtree.config import ConfigError, Mode, StateDirSettings, VerifySettings, warn_unknown_variables
from kdtree.ddtree.server_args import validate_server_args
from kdtree.state.mode_file import mode_path, read_desired_mode

EXIT_CONFIG = 2
USAGE = """usage: python -m entrypoint.launch SGLANG_LAUNCH_SERVER_ARGUMENTS...

Checks the configuration (verify mode, GPUs against --tp-size, the kernel library's architectures, the
model path, the attention backend, the speculative-decoding arguments), prints it once, then runs
`python -m sglang.launch_server` with the same arguments and supervises it (its output also goes to
KDTREE_STATE_DIR/server.log; its pid and exit status to KDTREE_STATE_DIR/server-process.json).
A failed check exits 2 with one line naming the problem and the fix. Settings: docs/configuration.md."""
# kdtree overrides the verify call of SGLang's Triton attention backend; no other backend reaches it.
VERIFY_BACKEND = "triton"
# Speculative algorithms that always draft with a separate model (SGLang 0.5.23). EAGLE and NEXTN may instead
# use the target's own MTP layers (SGLang then points the draft path at the model); NGRAM drafts from the
# token history and needs no model.
NEEDS_DRAFT_MODEL = frozenset({"EAGLE3", "STANDALONE", "DFLASH", "DDTREE"})
DFLASH_DRAFTED = frozenset({"DFLASH", "DDTREE"})  # a DFlash block drafter is their draft model
MTP_CAPABLE = frozenset({"EAGLE", "NEXTN"})
# The names --speculative-algorithm takes: SGLang 0.5.23's SpeculativeAlgorithm members and its alias NEXTN
# (tests/entrypoint holds this to SGLang's enum), and DDTREE, which kdtree's plugin registers. Another SGLang plugin
# may register more (SpeculativeAlgorithm.register): the launcher judges a name only where none would load.
SGLANG_PLUGIN_GROUP = "sglang.srt.plugins"
SPECULATIVE_ALGORITHMS = (
    "EAGLE", "EAGLE3", "NEXTN", "NGRAM", "DFLASH", "DDTREE", "STANDALONE", "FROZEN_KV_MTP", "UNO", "DSPARK"
)  # fmt: skip


class LauncherSettings(SupervisorSettings):
    """The launcher's own knobs (KDTREE_VERIFY is kdtree.config's); KDTREE_STATE_DIR and
    KDTREE_SERVER_LOG_MAX_BYTES (the server log's cap, 0: no log file) come from SupervisorSettings."""

    fixes: ClassVar[dict[str, str]] = {
        **SupervisorSettings.fixes,
        "KDTREE_ALLOW_OTHER_BACKEND": "set it to true or false",
        "KDTREE_RESTART_IN_PLACE": "set it to true or false",
    }

    allow_other_backend: bool = False  # serve with a non-Triton attention backend: kdtree then never runs
    # A restart request from the sidecar restarts SGLang in this container (a new start, the mode file read again)
    # instead of ending the container: under LeaderWorkerSet, whose RecreateGroupOnPodRestart recreates the whole
    # group (and its emptyDir state volumes) on any container restart, the sidecars restart the group themselves.
    restart_in_place: bool = False
    # SGLang's --api-key, passed on by the launcher: the one place the key is set, which the sidecar reads too.
    server_api_key: SecretStr | None = None


class LaunchError(Exception):
    def __init__(self, problem: str, fix: str):
        super().__init__(f"{problem}; fix: {fix}")


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    capability: tuple[int, int]

    @property
    def sm(self) -> int:
        return self.capability[0] * 10 + self.capability[1]


@dataclass(frozen=True)
class Plan:
    mode: Mode
    mode_source: str
    argv: list[str]
    summary: str
    warnings: tuple[str, ...] = ()  # printed and logged before the summary; the launch goes on


def visible_gpus() -> list[Gpu]:
    """The GPUs this process may use (CUDA_VISIBLE_DEVICES applies), from torch."""
    try:
        import torch  # the server image's torch; imported only here so CPU tests stay light
    except ImportError as e:
        raise LaunchError(
            f"torch does not import here ({e})", "run the launcher in the server image"
        ) from None

    count = torch.cuda.device_count()
    return [Gpu(i, torch.cuda.get_device_name(i), torch.cuda.get_device_capability(i)) for i in range(count)]


def compiled_archs() -> list[int]:
    """SM versions with code in the kernel library, e.g. [90, 100, 120]; [] when there is no library."""
    try:
        from kdtree.kernel import compiled_archs as library_archs
    except ImportError:  # no torch here: read the library's ELF sections instead
        return _cuobjdump_archs()
    return [int(a.removeprefix("sm_")) for a in library_archs()]


def _cuobjdump_archs() -> list[int]:
    lib = VerifySettings.load().kernel_lib or str(
        Path(__file__).resolve().parent.parent / "kdtree" / "lib" / "libkdtree_verify.so"
    )
    if not Path(lib).is_file() or shutil.which("cuobjdump") is None:
        return []
    out = subprocess.run(["cuobjdump", "--list-elf", lib], capture_output=True, text=True, check=False).stdout
    return sorted({int(m) for m in re.findall(r"\.sm_(\d+)a?\.cubin", out)})


# Where a stack sets the server's arguments, for the refusals that ask to change one.
SERVER_ARGS_WHERE = (
    "compose.yaml: KDTREE_SPECULATIVE_ARGS or KDTREE_SGLANG_EXTRA_ARGS; compose/kimi-ddtree.yaml or one-gpu.yaml: the "
    "server command in that file, or KDTREE_SGLANG_EXTRA_ARGS; Kubernetes: the server's args, a patch in your overlay"
)


class _ArgParser(argparse.ArgumentParser):
    def error(self, message: str):  # one line of ours instead of argparse's usage text and exit
        raise LaunchError(
            f"unreadable sglang.launch_server arguments: {message}",
            f"correct it where the server's arguments are set ({SERVER_ARGS_WHERE})",
        )


def _server_args(argv: Sequence[str]) -> argparse.Namespace:
    """The few launch_server arguments the checks read; SGLang parses (and rejects) the full set."""
    p = _ArgParser(add_help=False, allow_abbrev=False)
    p.add_argument("--model-path", "--model")
    p.add_argument("--tp-size", "--tensor-parallel-size", type=int, default=1)
    p.add_argument("--pp-size", "--pipeline-parallel-size", type=int, default=1)
    p.add_argument("--dp-size", "--data-parallel-size", type=int, default=1)
    p.add_argument("--enable-dp-attention", action="store_true")  # deprecated: --dp-size N is attention DP
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--dist-init-addr", "--nccl-init-addr")
    p.add_argument("--attention-backend")
    p.add_argument("--prefill-attention-backend")
    p.add_argument("--decode-attention-backend")
    p.add_argument("--speculative-algorithm")
    p.add_argument("--speculative-draft-model-path", "--speculative-draft-model")
    p.add_argument("--speculative-num-draft-tokens", type=int)
    p.add_argument("--speculative-dflash-block-size", type=int)
    # the rest of what DDTREE's check reads (kdtree.ddtree.server_args); None: left to SGLang's resolution
    p.add_argument("--page-size", type=int)
    p.add_argument("--attn-dp-size", "--attention-data-parallel-size", type=int, default=1)
    p.add_argument("--speculative-eagle-topk", type=int)
    p.add_argument("--speculative-num-steps", type=int)
    p.add_argument("--speculative-draft-window-size", type=int)
    p.add_argument("--grammar-backend")
    p.add_argument("--api-key")
    args, _ = p.parse_known_args(list(argv))
    return args


# huggingface_hub's own reading of HF_HUB_OFFLINE (constants._is_true), done here at call time: its module
# constant is fixed when it is first imported.
HF_TRUE = frozenset({"1", "ON", "YES", "TRUE"})


def hub_offline() -> str | None:
    """`HF_HUB_OFFLINE=1` (or `TRANSFORMERS_OFFLINE=...`) when it is set, as Hugging Face reads it: SGLang will not
    download (the stack sets it); else None."""
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if value := os.environ.get(var):  # the first one set decides, as in huggingface_hub
            return f"{var}={value}" if value.upper() in HF_TRUE else None
    return None


def _in_hub_cache(repo_id: str) -> bool:
    """The repo's config.json is in the local Hugging Face cache (HF_HOME), where offline SGLang finds it."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return False
    try:
        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except ValueError:  # not a valid repo id either (HFValidationError)
        return False


# Where compose names each checked folder (an override file such as compose/kimi-ddtree.yaml names both itself).
FOLDER_SETTING = {
    "--model-path": "KDTREE_MODEL names the model's folder in it; under compose/one-gpu.yaml or "
    "compose/kimi-ddtree.yaml, the server command's --model-path in that file",
    "--speculative-draft-model-path": "the server command names the drafter's folder, e.g. "
    "--speculative-draft-model-path /models/Kimi-K2.5-DFlash in compose/kimi-ddtree.yaml",
}


def _local_path(flag: str, path: str | None) -> Path | None:
    """The path when it names a local file or directory (checked), None for a Hugging Face repo id that SGLang
    may fetch (online, or offline from the local cache)."""
    if path is None:
        raise LaunchError(
            f"{flag} is missing", f"pass {flag} /models/<name> (compose mounts KDTREE_MODEL_DIR at /models)"
        )
    looks_local = path.startswith(("/", ".", "~")) or Path(path).exists()
    if not looks_local:
        offline = hub_offline()
        if offline and not _in_hub_cache(path):
            name = path.rstrip("/").rsplit("/", 1)[-1]
            raise LaunchError(
                f"{flag} {path} is no local folder, and as a Hugging Face repo id it cannot be downloaded: "
                f"{offline} and it is not in the local Hugging Face cache",
                f"download it where there is network (hf download {path} --local-dir models/{name}) and pass "
                f"the folder, /models/{name} in the container; the stack never downloads (compose: "
                f"KDTREE_MODEL_DIR=./models is mounted at /models, and {FOLDER_SETTING[flag]})",
            )
        return None  # SGLang downloads it, or reads it from the cache
    p = Path(path).expanduser()
    if not p.exists():
        raise LaunchError(
            f"{flag} {path} does not exist",
            f"check the path (compose: KDTREE_MODEL_DIR is mounted read-only at /models, and {FOLDER_SETTING[flag]})",
        )
    if not os.access(p, os.R_OK | (os.X_OK if p.is_dir() else 0)):
        raise LaunchError(
            f"{flag} {path} is not readable by uid {os.getuid()}",
            "make the model files world-readable (chmod -R a+rX) or run the server with a user that can read them",
        )
    if p.is_dir() and not (p / "config.json").is_file():
        raise LaunchError(
            f"{flag} {path} has no config.json",
            "point it at the folder that holds the Hugging Face checkpoint (config.json and the weights)",
        )
    return p


def _config(model: Path | None) -> dict | None:
    """A local checkpoint's config.json; None when the model is no local folder."""
    if model is None or not model.is_dir():
        return None
    try:
        config = json.loads((model / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise LaunchError(
            f"{model}/config.json is unreadable ({e})", "replace it with the checkpoint's config.json"
        ) from None
    if not isinstance(config, dict):
        raise LaunchError(
            f"{model}/config.json is no JSON object", "replace it with the checkpoint's config.json"
        )
    return config


def _mtp_layers(model: Path | None) -> int | None:
    """num_nextn_predict_layers of a local checkpoint (its bundled MTP draft layers); None when unknown."""
    config = _config(model)
    return None if config is None else int(config.get("num_nextn_predict_layers") or 0)


def _trained_block(config: dict | None) -> tuple[int, str] | None:
    """The block a local DFlash drafter (its config.json) was trained for and the key that holds it, read where
    SGLang reads it (dflash_config.block_size, else a top-level block_size); None when unknown."""
    if config is None:
        return None
    dflash = config.get("dflash_config")
    if isinstance(dflash, dict) and "block_size" in dflash:
        block, key = dflash["block_size"], "dflash_config.block_size"
    else:
        block, key = config.get("block_size"), "block_size"
    return (block, key) if isinstance(block, int) and block > 0 else None


def _drafter_warning(
    draft: str, draft_dir: Path | None, config: dict | None, model: Path | None
) -> str | None:
    """A local drafter (config: its config.json) that is the target model itself (its folder, or a config naming the
    target's architectures with no DFlash block): SGLang accepts the path and fails only once it has loaded it."""
    if not config or "dflash_config" in config or "block_size" in config:
        return None
    same_folder = model is not None and draft_dir is not None and draft_dir.resolve() == model.resolve()
    named = config.get("architectures")
    if not same_folder and not (named and named == (_config(model) or {}).get("architectures")):
        return None
    return (
        f"the drafter at {draft} looks like the target model (its config.json names the target's architectures and "
        "has no dflash_config): SGLang would fail only once it has loaded it; pass --speculative-draft-model-path a "
        "DFlash drafter's folder"
    )


def _block_warning(args: argparse.Namespace, algorithm: str, draft: str, config: dict | None) -> str | None:
    """A block above the one the drafter was trained for: SGLang runs it (lossless; its depths past the trained block
    are untrained guesses, so fewer are accepted) and only logs a mismatch among its start-up lines."""
    trained = _trained_block(config)
    if algorithm == "DFLASH":  # one number: B = N (SGLang refuses them unequal)
        block = args.speculative_dflash_block_size or args.speculative_num_draft_tokens
        flags = "--speculative-num-draft-tokens and --speculative-dflash-block-size"
    else:
        block, flags = args.speculative_dflash_block_size, "--speculative-dflash-block-size"
    if trained is None or block is None or block <= trained[0]:
        return None
    return (
        f"the block {block} is above the {trained[0]} the drafter at {draft} was trained for (its config.json's "
        f"{trained[1]}): its depths past {trained[0] - 1} are untrained guesses, lossless but rarely accepted; "
        f"for the drafter's own block pass {flags} {trained[0]} or less"
    )


def _other_plugins(allowed: set[str]) -> list[str]:
    """SGLang plugins other than kdtree's that SGLang would load (SGLANG_PLUGINS, when set, whitelists them): any of
    them may register a speculative algorithm."""
    found = entry_points(group=SGLANG_PLUGIN_GROUP)
    return [ep.name for ep in found if ep.name != "kdtree" and (not allowed or ep.name in allowed)]


def _resolve_mode() -> tuple[Mode, str]:
    settings = VerifySettings.load()  # validates KDTREE_VERIFY and every other KDTREE_* runtime value
    file_mode = read_desired_mode(settings.state_dir)
    if file_mode is not None:
        return file_mode, f"{mode_path(settings.state_dir)} (written by the sidecar)"
    return settings.verify, "KDTREE_VERIFY"


def _record_settings() -> tuple[StateDirSettings, int]:
    """Where this start is recorded: the state dir, and the log cap or its default when the launcher's settings
    are invalid (plan() then refuses them, and the refusal is recorded too)."""
    try:
        settings = LauncherSettings()
    except ValidationError:
        return StateDirSettings(), DEFAULT_LOG_MAX_BYTES  # a state dir is any non-empty string
    return settings, settings.server_log_max_bytes


def check_state_dir(state_dir: str, named: bool) -> None:
    """The state dir is a directory this user can write. It is never created here: in the image it exists, and
    compose and Kubernetes mount the state volume on it; anywhere else, making /var/run/kdtree would only hide
    that KDTREE_STATE_DIR is unset, and the sidecar would never read what lands there."""
    path = Path(state_dir)
    named = (  # named: KDTREE_STATE_DIR is set
        f"KDTREE_STATE_DIR={state_dir}"
        if named
        else f"KDTREE_STATE_DIR is not set and its default {state_dir}"
    )
    fix = (
        "set KDTREE_STATE_DIR to a folder this user can write and the sidecar reads as its own KDTREE_STATE_DIR "
        "(the server image and compose set /var/run/kdtree, the state volume)"
    )
    if not path.is_dir():
        raise LaunchError(f"{named} {'is not a directory' if path.exists() else 'does not exist'}", fix)
    if not os.access(path, os.W_OK | os.X_OK):
        raise LaunchError(
            f"{named} is not writable by uid {os.getuid()}",
            f"make it writable by uid {os.getuid()} (the state volume belongs to the server's user), or {fix}",
        )


def _check_nodes(args: argparse.Namespace, algorithm: str) -> str:
    """A tensor-parallel group over several nodes (LeaderWorkerSet passes --nnodes $(LWS_GROUP_SIZE) --node-rank
    $(LWS_WORKER_INDEX) --dist-init-addr $(LWS_LEADER_ADDRESS):20000): SGLang runs the global tp ranks
    node_rank*tp/nnodes .. +tp/nnodes-1 here, and they write their records into this node's state volume, which this
    node's sidecar reads (KDTREE_GROUP_ROLE, docs/operations.md). Returns the summary's text for it."""
    n, rank = args.nnodes, args.node_rank
    if n == 1:
        if rank != 0:
            raise LaunchError(
                f"--node-rank {rank} with --nnodes 1", "drop --node-rank, or set --nnodes to the group's size"
            )
        return ""
    if not 0 <= rank < n:
        raise LaunchError(
            f"--node-rank {rank} is outside 0 .. {n - 1} (--nnodes {n})",
            "pass this node's index in the group (LeaderWorkerSet: --node-rank $(LWS_WORKER_INDEX))",
        )
    if args.tp_size % n:
        raise LaunchError(
            f"--tp-size {args.tp_size} is not divisible by --nnodes {n}: every node runs the same number of ranks",
            f"set --tp-size to a multiple of {n} (KDTREE_EXPECTED_TP_SIZE on every sidecar to the same value)",
        )
    if args.pp_size > 1 or (args.dp_size > 1 and not args.enable_dp_attention):
        raise LaunchError(
            f"--nnodes {n} with --pp-size {args.pp_size} --dp-size {args.dp_size}: kdtree spreads tensor "
            "parallelism only over nodes, and its sidecars expect tp/nnodes ranks on each",
            "serve with --pp-size 1 --dp-size 1 across nodes"
            + ("" if algorithm == "DDTREE" else " (attention DP: --attn-dp-size)"),
        )
    addr = args.dist_init_addr
    if not addr:
        raise LaunchError(
            f"--nnodes {n} without --dist-init-addr: the nodes have nowhere to meet",
            "pass --dist-init-addr HOST:PORT of node 0 on every node (LeaderWorkerSet: "
            "--dist-init-addr $(LWS_LEADER_ADDRESS):20000)",
        )
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise LaunchError(
            f"--dist-init-addr {addr!r} is not HOST:PORT",
            "pass node 0's address and a free port, e.g. --dist-init-addr $(LWS_LEADER_ADDRESS):20000",
        )
    return f" node_rank={rank} ranks={rank * args.tp_size // n}..{(rank + 1) * args.tp_size // n - 1} dist_init={addr}"


def _check_ddtree(args: argparse.Namespace) -> None:
    """DDTREE's own check (the one SGLang runs once it has resolved the arguments), on the arguments as given and
    resolved as SGLang would where that is fixed: a refusal here costs no server start. What depends on more (the
    page size an attention backend sets) SGLang resolves, and its run of the same check judges."""
    view = argparse.Namespace(**vars(args))
    # as SGLang resolves them before its check: the deprecated --enable-dp-attention (parallel_hook.py: --dp-size N
    # is the attention-DP width unless --attn-dp-size is given), an unset grammar backend (serving_hook.py: xgrammar)
    if args.enable_dp_attention and args.attn_dp_size == 1:
        view.attn_dp_size, view.dp_size = args.dp_size, 1
    view.enable_dp_attention = False
    if view.grammar_backend is None:
        view.grammar_backend = "xgrammar"
    try:
        validate_server_args(view)
    except ValueError as e:
        raise LaunchError(
            f"DDTREE's server arguments: {e}",
            f"as each problem says, where the server's arguments are set ({SERVER_ARGS_WHERE}); DDTREE's settings: "
            "docs/configuration.md",
        ) from None


# Where a stack sets what the launcher's GPU-count refusals ask to change (compose, its -f files, Kubernetes).
GPU_COUNT_WHERE = (
    "compose: `count:` under the server's deploy.resources.reservations.devices, in compose/one-gpu.yaml with "
    "it, else compose.override.yaml; Kubernetes: the server container's nvidia.com/gpu limit, a group's per node"
)
TP_SIZE_WHERE = (
    "KDTREE_TP_SIZE; under compose/one-gpu.yaml, the server command's --tp-size and KDTREE_EXPECTED_TP_SIZE in that "
    "file; under compose/kimi-ddtree.yaml, its server command's --tp-size, and KDTREE_TP_SIZE to match; Kubernetes: "
    "the server's args and the sidecar's KDTREE_EXPECTED_TP_SIZE"
)


def plan(
    argv: Sequence[str],
    *,
    gpus: Callable[[], list[Gpu]] = visible_gpus,
    archs: Callable[[], list[int]] = compiled_archs,
) -> Plan:
    """Check everything; raise LaunchError (or ConfigError) naming the first problem and its fix."""
    launcher = LauncherSettings.load()
    mode, mode_source = _resolve_mode()
    args = _server_args(argv)
    if args.api_key is not None:
        raise LaunchError(
            "--api-key is in the server's arguments, where the sidecar's probe cannot read it (it would never "
            "become ready)",
            "set KDTREE_SERVER_API_KEY instead: the launcher passes it to SGLang as --api-key, and the sidecar's "
            "probe and kdtreectl check send it",
        )
    key = launcher.server_api_key.get_secret_value() if launcher.server_api_key else None

    model = _local_path("--model-path", args.model_path)

    algorithm = (args.speculative_algorithm or "").upper()
    backends = {
        flag: value
        for flag, value in (
            ("--attention-backend", args.attention_backend),
            ("--prefill-attention-backend", args.prefill_attention_backend),
            ("--decode-attention-backend", args.decode_attention_backend),
        )
        if value is not None
    }
    # DDTREE is kdtree's own algorithm: its tree verify runs in Triton's backend in every mode (kdtree's kernel or
    # Triton's reads its mask), so serving without kdtree (KDTREE_ALLOW_OTHER_BACKEND) is no way around it
    allow_other = launcher.allow_other_backend and algorithm != "DDTREE"
    or_else = (
        " (DDTREE's tree verify runs there in every mode, whatever KDTREE_ALLOW_OTHER_BACKEND says)"
        if algorithm == "DDTREE"
        else ", or set KDTREE_ALLOW_OTHER_BACKEND=true to serve without kdtree"
    )
    if args.attention_backend is None and not allow_other:
        raise LaunchError(
            "--attention-backend is not set (SGLang would pick one per GPU, e.g. trtllm_mla on B200)",
            f"pass --attention-backend {VERIFY_BACKEND}{or_else}",
        )
    other = {flag: v for flag, v in backends.items() if v != VERIFY_BACKEND}
    if other and not allow_other:
        flag, value = next(iter(other.items()))
        raise LaunchError(
            f"{flag} {value}: kdtree verifies only inside the {VERIFY_BACKEND} backend",
            f"pass {flag} {VERIFY_BACKEND}{or_else}",
        )

    if not algorithm:
        raise LaunchError(
            "--speculative-algorithm is not set: there are no draft trees to verify",
            "pass e.g. --speculative-algorithm EAGLE --speculative-draft-model-path /models/<draft>, "
            "NEXTN (the model's own MTP layers) or NGRAM (no draft model)",
        )
    plugins = os.environ.get("SGLANG_PLUGINS")
    # as SGLang reads it (plugins/__init__.py): names stripped of spaces; empty or unset loads every plugin
    allowed = {x.strip() for x in (plugins or "").split(",") if x.strip()}
    if algorithm not in SPECULATIVE_ALGORITHMS and not _other_plugins(allowed):
        raise LaunchError(
            f"--speculative-algorithm {args.speculative_algorithm} is no algorithm SGLang or kdtree knows, and no "
            "other SGLang plugin is installed to register it",
            f"pass one of {', '.join(SPECULATIVE_ALGORITHMS)}",
        )
    if algorithm == "DDTREE" and allowed and "kdtree" not in allowed:
        raise LaunchError(
            f"--speculative-algorithm DDTREE is registered by kdtree's SGLang plugin, and SGLANG_PLUGINS={plugins!r} "
            "leaves it out",
            "add kdtree to SGLANG_PLUGINS (comma-separated), or unset it",
        )
    draft = args.speculative_draft_model_path
    warnings: list[str] = []
    if draft is not None:
        draft_dir = _local_path("--speculative-draft-model-path", draft)
        drafter = _config(draft_dir) if algorithm in DFLASH_DRAFTED else None  # read once, for both warnings
        warnings += filter(
            None,
            [
                _drafter_warning(draft, draft_dir, drafter, model),
                _block_warning(args, algorithm, draft, drafter),
            ],
        )
    elif algorithm in NEEDS_DRAFT_MODEL:
        raise LaunchError(
            f"--speculative-algorithm {algorithm} needs a draft model and --speculative-draft-model-path is missing",
            "pass --speculative-draft-model-path /models/<a DFlash drafter's folder>"
            if algorithm in DFLASH_DRAFTED
            else "pass --speculative-draft-model-path /models/<draft>, or use NGRAM, which needs none",
        )
    elif algorithm in MTP_CAPABLE and _mtp_layers(model) == 0:
        raise LaunchError(
            f"--speculative-algorithm {algorithm} without a draft model drafts with the model's MTP layers, "
            f"and {args.model_path} has none (config.json num_nextn_predict_layers)",
            "pass --speculative-draft-model-path /models/<draft>, or use --speculative-algorithm NGRAM",
        )

    if algorithm == "DDTREE":
        _check_ddtree(args)
    if min(args.tp_size, args.pp_size, args.dp_size, args.nnodes) < 1:
        raise LaunchError(
            "--tp-size, --pp-size, --dp-size and --nnodes must be >= 1",
            f"correct it where the server's arguments are set ({SERVER_ARGS_WHERE})",
        )
    group = _check_nodes(args, algorithm)
    # Data-parallel replicas (not attention DP, which runs inside the TP group) each bring tp x pp GPUs.
    replicas = 1 if args.enable_dp_attention else args.dp_size
    if mode is not Mode.OFF and (replicas > 1 or args.pp_size > 1):
        layout = f"--dp-size {args.dp_size}" if replicas > 1 else f"--pp-size {args.pp_size}"
        raise LaunchError(
            f"{layout} runs several schedulers per tp rank, and kdtree's per-rank status records are keyed "
            "by tp rank: they would overwrite each other and the sidecar's gate would judge partial evidence",
            # (DDTREE never gets here: its own check, above, refuses both layouts in every mode)
            "serve one replica per pod with --pp-size 1 and --dp-size 1 (attention DP: --attn-dp-size), or set "
            "KDTREE_VERIFY=off",
        )
    per_node = replicas * (args.tp_size // args.nnodes) * args.pp_size  # this node's share
    found = gpus()
    if not found:
        raise LaunchError(
            "no CUDA GPU is visible to this process",
            "in a container, run it with the NVIDIA container runtime and a GPU reservation "
            "(compose: deploy.resources.reservations.devices, docker run --gpus); on a host, check the NVIDIA "
            "driver (nvidia-smi) and CUDA_VISIBLE_DEVICES",
        )
    if per_node > len(found):
        sizes = (
            ("--tp-size", args.tp_size // args.nnodes),
            ("--pp-size", args.pp_size),
            ("--dp-size", replicas),
        )
        raise LaunchError(
            f"--tp-size {args.tp_size}"
            + (f" x --pp-size {args.pp_size}" if args.pp_size > 1 else "")
            + (f" x --dp-size {replicas}" if replicas > 1 else "")
            + (f" over --nnodes {args.nnodes}" if args.nnodes > 1 else "")
            + f" needs {per_node} GPUs on this node, {len(found)} visible",
            f"reserve that many GPUs ({GPU_COUNT_WHERE}) "
            f"or lower {' or '.join(f for f, n in sizes if n > 1) or '--tp-size'} to match (--tp-size: {TP_SIZE_WHERE})",
        )
    if len(found) > per_node:  # the reservation and --tp-size are set apart (compose v1): name a mismatch
        others = replicas * args.pp_size
        fit = len(found) // others * args.nnodes if len(found) % others == 0 else None  # the whole group's
        raise LaunchError(
            f"{len(found)} GPUs are visible and --tp-size {args.tp_size}"
            + (f" over --nnodes {args.nnodes}" if args.nnodes > 1 else "")
            + f" uses {per_node} on this node",
            f"reserve {per_node} ({GPU_COUNT_WHERE}) or "
            + (f"set --tp-size {fit}" if fit else "set a --tp-size that uses them")
            + f" ({TP_SIZE_WHERE})",
        )

    have = archs()
    if mode is not Mode.OFF:
        if not have:
            raise LaunchError(
                f"KDTREE_VERIFY={mode.value} but the kdtree kernel library is missing",
                "use the server image (it builds the library), set KDTREE_KERNEL_LIB, or set KDTREE_VERIFY=off",
            )
        for gpu in found[:per_node]:
            # SASS runs on the same major architecture at an equal or newer minor version.
            if not any(a // 10 == gpu.sm // 10 and a <= gpu.sm for a in have):
                listed = ", ".join(f"sm_{a}" for a in have)
                raise LaunchError(
                    f"GPU {gpu.index} ({gpu.name}) is sm_{gpu.sm}; the kdtree library has code for {listed} only",
                    f'rebuild the image with --build-arg KDTREE_CUDA_ARCHS="{";".join(map(str, sorted({*have, gpu.sm})))}", '
                    "or set KDTREE_VERIFY=off",
                )

    gpu_text = ", ".join(sorted({f"{g.name} sm_{g.sm}" for g in found[:per_node]})) or "none"
    summary = (
        f"kdtree launcher: mode={mode.value} (from {mode_source}); model={args.model_path}; "
        f"tp={args.tp_size} pp={args.pp_size} dp={args.dp_size} nnodes={args.nnodes}{group}; "
        f"gpus={len(found)} visible [{gpu_text}]; "
        f"kernel archs={','.join(f'sm_{a}' for a in have) or 'none'}; "
        f"attention={'/'.join(f'{k}={v}' for k, v in backends.items()) or 'SGLang default'}; "
        f"speculative={algorithm}"
        + (f" draft={args.speculative_draft_model_path}" if args.speculative_draft_model_path else "")
        + (
            f" N={args.speculative_num_draft_tokens} B={args.speculative_dflash_block_size} "
            f"budget={VerifySettings.load().ddtree_budget} (KDTREE_DDTREE_BUDGET)"
            if algorithm == "DDTREE"
            else ""
        )
        + ("; api key: from KDTREE_SERVER_API_KEY" if key else "")
    )
    extra = ["--api-key", key] if key else []
    return Plan(
        mode,
        mode_source,
        [sys.executable, "-m", "sglang.launch_server", *argv, *extra],
        summary,
        tuple(warnings),
    )


def main(
    argv: Sequence[str] | None = None,
    *,
    environ: Mapping[str, str] = os.environ,
    serve: Callable[[Supervisor, list[str], dict[str, str]], int] = Supervisor.run,
    **probes,
) -> int:
    """Check, then serve: returns the server's exit status (serve is replaced by a double in tests)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] in (["-h"], ["--help"]):  # usage, without touching the GPU, torch or the state volume
        print(USAGE)
        return 0
    warn_unknown_variables(environ)  # first: a misspelt variable may be why what follows fails
    recorded, log_max_bytes = _record_settings()
    state_dir = recorded.state_dir
    try:
        check_state_dir(state_dir, named="state_dir" in recorded.model_fields_set)
    except LaunchError as e:  # nowhere to record it: this line is all
        print(f"kdtree launcher: error: {e}", file=sys.stderr, flush=True)
        return EXIT_CONFIG
    in_place = getattr(recorded, "restart_in_place", False)
    while True:
        # Recorded before the mode file is read: see entrypoint.supervise.
        sup = Supervisor(state_dir, log_max_bytes).begin()
        try:
            try:
                p = plan(argv, **probes)
            except (LaunchError, ConfigError) as e:
                line = f"kdtree launcher: error: {e}"
                print(line, file=sys.stderr, flush=True)
                sup.log_line(line)
                return sup.finish(EXIT_CONFIG)
            for line in [f"kdtree launcher: warning: {w}" for w in p.warnings] + [p.summary]:
                print(line, file=sys.stderr, flush=True)
                sup.log_line(line)
            env = {
                k: v for k, v in environ.items() if k != "KDTREE_SERVER_API_KEY"
            }  # SGLang has it as --api-key
            rc = serve(sup, p.argv, {**env, "KDTREE_VERIFY": p.mode.value})
        except StopRequested as e:
            return sup.stopped(e)
        if not (in_place and sup.record.restart_request):
            return rc
        # KDTREE_RESTART_IN_PLACE: the server stopped for the sidecar's restart request; start it again here, as
        # a new start (the sidecar waits for one) in the mode the sidecar wrote.
        print(
            "kdtree launcher: restarting the server in place (KDTREE_RESTART_IN_PLACE)",
            file=sys.stderr,
            flush=True,
        )


if __name__ == "__main__":
    sys.exit(main())
