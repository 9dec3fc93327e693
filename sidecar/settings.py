"""Sidecar settings, read from KDTREE_* environment variables (one table in the README); SidecarSettings.load()
refuses a bad or missing value with a ConfigError naming the fix."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, ClassVar, Literal

from pydantic import AliasChoices, Field, SecretStr, field_validator, model_validator
from pydantic_settings import NoDecode

from kdtree.config import Mode, StateDirSettings, http_url

GROUP_MAX_NODES = 64


class SidecarSettings(StateDirSettings):
    fixes: ClassVar[dict[str, str]] = {
        "KDTREE_EXPECTED_TP_SIZE": "set it to the server's --tp-size (every node's ranks); 0 skips the rank check"
    }

    # Where the sidecar itself listens.
    sidecar_host: str = "0.0.0.0"
    sidecar_port: int = Field(8080, ge=1, le=65535)

    # The SGLang server and the completion probe.
    server_url: str = "http://127.0.0.1:30000"
    served_model_name: str | None = Field(
        None, description="model name for the probe; unset: ask GET /v1/models"
    )
    probe_prompt: str = Field("The capital of France is", min_length=1, max_length=4096)
    probe_max_tokens: int = Field(
        32,
        ge=2,
        le=4096,
        description="tokens the probe decodes (ignore_eos): enough for several speculative verify steps",
    )
    probe_deadline_s: float = Field(
        10.0, gt=0, description="no probe and no GET /ready takes longer than this"
    )
    probe_interval_s: float = Field(
        5.0,
        gt=0,
        description="seconds between the background completion probes; GET /ready answers from the latest verdicts",
    )
    probe_failure_threshold: int = Field(
        3,
        ge=1,
        description="consecutive failed probes, after the server has served since its start, before the probe counts "
        "against readiness (a probe that queued behind load only while SGLang's /health fails too)",
    )
    server_api_key: SecretStr | None = Field(
        None, description="SGLang's --api-key: the probe sends it as 'Authorization: Bearer'"
    )

    # The tensor-parallel ranks and their records (in state_dir, StateDirSettings').
    verify: Mode = Field(
        Mode.OFF, description="the server's mode when no mode file and no sidecar state exist yet"
    )
    expected_tp_size: int = Field(1, ge=0, description="ranks that must report; 0 skips the rank check")
    heartbeat_stale_s: float = Field(30.0, gt=0)

    # How the sidecar observes and restarts the server: `process` (its entrypoint's state file and log in
    # state_dir, a restart request there) or `docker` (the container named server_container, through the Docker
    # socket).
    server_control: Literal["process", "docker"] = "process"
    server_container: str | None = None
    restart_stop_timeout_s: int = Field(30, ge=0, description="SIGTERM grace before the server is killed")
    drain_s: float = Field(
        25.0,
        ge=0,
        description="before a flip or a rollback stops the server: seconds /ready answers 503 first, so that load "
        "balancers stop routing to it (the readinessProbe's periodSeconds x failureThreshold, and some)",
    )
    restart_wait_s: float = Field(
        300.0, gt=0, description="process control: seconds the orchestrator has to start the stopped server"
    )
    log_tail_lines: int = Field(2000, ge=10)
    # When a server that is not ready is `broken` (someone must act) rather than `not_ready_yet`.
    start_grace_s: float = Field(
        300.0,
        gt=0,
        description="seconds from the sidecar's start in which no server start at all (no process record, no "
        "container) is still not_ready_yet",
    )
    answering_budget_s: float = Field(
        300.0,
        gt=0,
        description="seconds a server that answers HTTP but fails every probe since its latest start has, counted "
        "from its first answer, before it is broken",
    )

    # Who may change the mode.
    admin_token: str | None = None
    admin_token_file: Path | None = Field(
        None,
        description="a file holding the admin token (a Kubernetes Secret volume), instead of KDTREE_ADMIN_TOKEN",
    )
    allow_open_admin: bool = False
    # A group's own token: the leader's sidecar sends it to its workers', which take nothing else (sidecar/group_*.py).
    group_token: str | None = None
    group_token_file: Path | None = Field(
        None,
        description="a file holding the group token (a Kubernetes Secret volume), instead of KDTREE_GROUP_TOKEN",
    )

    # The gate to `on`: evidence collected in validate mode.
    gate_min_calls: int = Field(1000, ge=0, description="compared verify calls each rank must have")
    gate_max_rel_err: float = Field(2e-2, ge=0, description="largest relative L2 error allowed on any rank")
    gate_max_nan_inf: int = Field(0, ge=0)
    gate_max_calls_over_tol: int = Field(0, ge=0)

    # The flip: restart, wait for readiness, bake.
    ready_timeout_s: float = Field(
        1800.0,
        gt=0,
        description="seconds the server has to get ready after a restart",
        # Read as KDTREE_READY_TIMEOUT_S (like every duration here) or KDTREE_READY_TIMEOUT.
        validation_alias=AliasChoices("KDTREE_READY_TIMEOUT_S", "KDTREE_READY_TIMEOUT"),
    )
    ready_poll_min_s: float = Field(2.0, gt=0)
    ready_poll_max_s: float = Field(30.0, gt=0)
    bake_probes: int = Field(
        5, ge=1, description="consecutive good probes after the restart before the flip counts"
    )
    bake_interval_s: float = Field(10.0, ge=0)
    live_flip_timeout_s: float = Field(
        60.0,
        gt=0,
        description="seconds every rank has to confirm a live mode switch before it is rolled back",
    )
    history_limit: int = Field(
        50, ge=1, description="transitions kept in the state file (the audit log keeps all)"
    )

    # A tensor-parallel group over several nodes (LeaderWorkerSet: one pod per node, a sidecar in each). The
    # leader's sidecar speaks for the group; a worker's reports its own node's ranks to the leader only.
    group_role: Literal["single", "leader", "worker"] = "single"
    group_workers: Annotated[list[str], NoDecode] = Field(
        [],
        description="leader only: the workers' sidecar base URLs, comma-separated, node 1 first (at most 64)",
    )
    nnodes: int = Field(
        1,
        ge=1,
        le=GROUP_MAX_NODES,
        description="nodes in the group (= the server's --nnodes; LeaderWorkerSet's LWS_GROUP_SIZE)",
        validation_alias=AliasChoices("KDTREE_NNODES", "LWS_GROUP_SIZE"),
    )
    node_rank: int = Field(
        0,
        ge=0,
        description="this node's index in the group (= the server's --node-rank; LWS_WORKER_INDEX)",
        validation_alias=AliasChoices("KDTREE_NODE_RANK", "LWS_WORKER_INDEX"),
    )

    @field_validator("server_url")
    @classmethod
    def _server_url(cls, v: str) -> str:
        return http_url(v, "http://HOST:30000, the SGLang server's base URL")

    @field_validator("group_workers", mode="before")
    @classmethod
    def _worker_urls(cls, v):
        if isinstance(v, str):
            v = [u.strip() for u in v.split(",") if u.strip()]
        if len(v) > GROUP_MAX_NODES - 1:
            raise ValueError(
                f"at most {GROUP_MAX_NODES - 1} worker URLs (a group of {GROUP_MAX_NODES} nodes)"
            )
        for url in v:
            try:
                http_url(url, "http://HOST:8080, one a worker's sidecar, comma-separated")
            except ValueError as e:
                raise ValueError(f"{str(url)[:100]!r}: {e}") from None
        return [u.rstrip("/") for u in v]

    @model_validator(mode="after")
    def _group_is_consistent(self) -> SidecarSettings:
        role, n, workers = self.group_role, self.nnodes, self.group_workers
        if role != "leader" and workers:
            raise ValueError(
                f"KDTREE_GROUP_WORKERS is set on a sidecar whose KDTREE_GROUP_ROLE is {role}: only the leader's "
                "sidecar reads the workers; unset it, or set KDTREE_GROUP_ROLE=leader"
            )
        if role == "single" and (n != 1 or self.node_rank != 0):
            raise ValueError(
                f"KDTREE_NNODES={n} KDTREE_NODE_RANK={self.node_rank} with KDTREE_GROUP_ROLE=single: a server "
                "spread over several nodes needs KDTREE_GROUP_ROLE=leader on node 0 and worker on the others"
            )
        if role == "leader" and (self.node_rank != 0 or len(workers) != n - 1 or n < 2):
            raise ValueError(
                f"KDTREE_GROUP_ROLE=leader with KDTREE_NODE_RANK={self.node_rank}, KDTREE_NNODES={n} and "
                f"{len(workers)} KDTREE_GROUP_WORKERS: the leader is node 0 of at least 2, and lists one sidecar URL "
                "for each other node"
            )
        if role == "worker" and self.desired_mode_file is not None:
            raise ValueError(
                "KDTREE_DESIRED_MODE_FILE is set on a sidecar whose KDTREE_GROUP_ROLE is worker: a worker's mode is "
                "its leader's to set; unset it here (the leader's pod holds the group's desired mode)"
            )
        if role == "worker" and not (n >= 2 and 1 <= self.node_rank < n):
            raise ValueError(
                f"KDTREE_GROUP_ROLE=worker with KDTREE_NODE_RANK={self.node_rank} of KDTREE_NNODES={n}: a worker is "
                "node 1 .. nnodes-1 of a group of at least 2 (LeaderWorkerSet sets LWS_WORKER_INDEX, LWS_GROUP_SIZE)"
            )
        if self.expected_tp_size % n:
            raise ValueError(
                f"KDTREE_EXPECTED_TP_SIZE={self.expected_tp_size} is not divisible by KDTREE_NNODES={n}: set it to "
                "the server's --tp-size, which spreads evenly over the nodes"
            )
        return self

    @property
    def ranks_per_node(self) -> int:
        return self.expected_tp_size // self.nnodes

    def node_of(self, rank: int) -> int:
        """The node a (global) tensor-parallel rank runs on: SGLang gives node n ranks n*per_node .. +per_node-1."""
        return rank // self.ranks_per_node if self.ranks_per_node else 0

    def node_ranks(self, node: int) -> range:
        return range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node)

    def rank_name(self, rank: int) -> str:
        """How a problem names a rank: "rank 3", or "node 1 rank 3" in a group."""
        return f"node {self.node_of(rank)} rank {rank}" if self.nnodes > 1 else f"rank {rank}"

    # The desired mode held by the cluster: a file the sidecar converges to (sidecar/desired_mode.py). Under
    # Kubernetes the downward API's projection of the pod annotation kdtree.dev/desired-mode; under compose a file an
    # operator writes. Unset: the feature is off, and only POST /mode changes the mode.
    desired_mode_file: Path | None = Field(
        None,
        description="a file holding the desired verify mode (the pod annotation kdtree.dev/desired-mode through the "
        "downward API); the sidecar converges to it through the gate, the bake and the rollback",
    )

    @field_validator("server_control", mode="before")
    @classmethod
    def _known_control(cls, v):
        if v not in ("process", "docker"):
            raise ValueError(
                "set it to process (a restart request in the state volume, no Docker socket: "
                "compose.yaml's default) or docker (restart the container KDTREE_SERVER_CONTAINER through the "
                "Docker socket: add compose/docker.yaml)"
            )
        return v

    @model_validator(mode="after")
    def _tokens_are_decided(self) -> SidecarSettings:
        """The admin token (POST /mode) and, in a group, the group token (the leader's calls to its workers' sidecars):
        each from its variable or its file, never both; a worker holds the group token only (its mode is the
        leader's to set, so a worker's pod that is taken over cannot flip the group)."""
        self.admin_token = token_from(self.admin_token, self.admin_token_file, "KDTREE_ADMIN_TOKEN")
        self.group_token = token_from(self.group_token, self.group_token_file, "KDTREE_GROUP_TOKEN")
        role = self.group_role
        if role == "worker" and self.admin_token:
            raise ValueError(
                "KDTREE_GROUP_ROLE=worker with an admin token: a worker's sidecar answers its leader, which sends "
                "KDTREE_GROUP_TOKEN, and takes no mode change of its own; unset KDTREE_ADMIN_TOKEN (and _FILE) there, "
                "and set KDTREE_GROUP_TOKEN (or _FILE) to the group's token, as on the leader"
            )
        if role == "single" and self.group_token:
            raise ValueError(
                "KDTREE_GROUP_TOKEN is set with KDTREE_GROUP_ROLE=single: only a group's sidecars use it; unset it"
            )
        if role != "single" and not self.group_token:
            raise ValueError(
                f"KDTREE_GROUP_ROLE={role} without a group token: the leader's sidecar and its workers' authenticate "
                "each other with KDTREE_GROUP_TOKEN (or KDTREE_GROUP_TOKEN_FILE), the same secret in every pod of "
                "the group and not the admin token: openssl rand -hex 24"
            )
        if role == "leader" and self.group_token == self.admin_token:
            raise ValueError(
                "KDTREE_GROUP_TOKEN equals KDTREE_ADMIN_TOKEN: the workers hold the group token, so it must not also "
                "change the group's mode; make another (openssl rand -hex 24)"
            )
        if role != "worker" and not self.admin_token and not self.allow_open_admin:
            raise ValueError(
                "no admin token: set KDTREE_ADMIN_TOKEN to a secret (clients send 'Authorization: Bearer <secret>'), "
                "or set KDTREE_ALLOW_OPEN_ADMIN=true to let anyone who reaches the sidecar change the mode"
            )
        return self


def token_from(value: str | None, file: Path | None, name: str) -> str | None:
    """A token from its variable or its file (one of them), checked to be one an HTTP header can carry."""
    if file is not None:
        if value:
            raise ValueError(
                f"both {name} and {name}_FILE are set: set one (the file keeps the token out of the process environment)"
            )
        value = read_secret_file(file, f"{name}_FILE")
    if value and not (value.isascii() and value.isprintable() and not any(c.isspace() for c in value)):
        # an HTTP header carries it: no client could send another, and a group's leader could not either
        where = f"{name}_FILE's secret" if file else name
        raise ValueError(
            f"{where} must be printable ASCII without spaces (it travels in an HTTP header): make one with "
            "openssl rand -hex 24"
        )
    return value or None


SECRET_MAX = 4096  # bytes: a token is a line; a larger file is refused unread


def read_secret_file(path: Path, setting: str) -> str:
    """The secret in `path` (one line; the trailing newline is dropped); ValueError naming the setting and the fix."""
    try:
        with path.open("rb") as f:
            data = f.read(SECRET_MAX + 1)
    except OSError as e:
        raise ValueError(f"{setting}={str(path)!r} cannot be read ({e.strerror}): mount the secret there, "
                         f"readable by uid {os.getuid()}") from None  # fmt: skip
    text = data.decode("utf-8", errors="replace").strip()
    if len(data) > SECRET_MAX or not text or "\n" in text:
        raise ValueError(
            f"{setting}={str(path)!r} must hold the secret alone, on one line of at most {SECRET_MAX} bytes"
        )
    return text
