"""The one SGLang server container, seen and restarted through the Docker SDK (KDTREE_SERVER_CONTROL=docker)."""

from __future__ import annotations

import re
from datetime import datetime

from .protocol import ServerControlError, ServerMissing, ServerState


class DockerError(ServerControlError):
    """Docker could not answer or act; the message says what was attempted."""


_DOCKER_TIME = re.compile(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)$")


def _docker_time(value: str | None) -> float | None:
    """Docker's RFC 3339 timestamps carry nanoseconds; the zero time means never."""
    m = _DOCKER_TIME.match(value or "")
    if not m or value.startswith("0001-"):
        return None
    head, frac, tz = m.groups()
    stamp = head + (f".{frac[:6]}" if frac else "") + ("+00:00" if tz == "Z" else tz)
    return datetime.fromisoformat(stamp).timestamp()


class ServerContainer:
    """Inspect, read the logs of, and restart one container by name, through the Docker SDK."""

    def __init__(self, name: str, client=None):
        self.name = name
        self._client = client

    def _container(self):
        import docker  # imported lazily: the sidecar starts and serves /live without a Docker socket
        from docker.errors import DockerException, NotFound

        try:
            if self._client is None:
                self._client = docker.from_env()
            return self._client.containers.get(self.name)
        except NotFound:
            raise ServerMissing(f"no container named {self.name!r} (check KDTREE_SERVER_CONTAINER)") from None
        except DockerException as e:
            raise DockerError(
                f"Docker is unreachable ({e}); mount /var/run/docker.sock into the sidecar"
            ) from None

    def inspect(self) -> ServerState:
        attrs = self._container().attrs
        state = attrs.get("State", {})
        return ServerState(
            name=self.name,
            status=state.get("Status", "unknown"),
            running=bool(state.get("Running")),
            exit_code=state.get("ExitCode"),
            oom_killed=bool(state.get("OOMKilled")),
            restart_count=int(attrs.get("RestartCount", 0)),
            started_at=_docker_time(state.get("StartedAt")),
            finished_at=_docker_time(state.get("FinishedAt")),
            error=state.get("Error") or None,
            health=(state.get("Health") or {}).get("Status"),
        )

    def logs(self, tail: int, since: float | None = None) -> str:
        from docker.errors import DockerException

        kwargs = {"stdout": True, "stderr": True, "tail": tail}
        if since is not None:
            kwargs["since"] = int(since)  # whole seconds: a few lines before the start are harmless
        try:
            return self._container().logs(**kwargs).decode("utf-8", errors="replace")
        except DockerException as e:
            raise DockerError(f"reading the logs of {self.name!r} failed: {e}") from None

    def restart(self, stop_timeout_s: int) -> None:
        """`docker restart`: SIGTERM, SIGKILL after stop_timeout_s, start again (same container, same config)."""
        from docker.errors import DockerException

        try:
            self._container().restart(timeout=stop_timeout_s)
        except DockerException as e:
            raise DockerError(f"restarting {self.name!r} failed: {e}") from None
