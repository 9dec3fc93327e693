"""`python -m sidecar.healthcheck [PATH]`: the container's healthcheck. Exit 0 when the sidecar answers 200 on PATH
(default /live); else exit 1, printing why: the configuration the sidecar refused (python -m sidecar
--on-config-error hold), or the answer it gave. What it prints is the container's health output (docker inspect).
It sends the container's token when it has one: a group's worker's group token (KDTREE_GROUP_TOKEN_FILE or
KDTREE_GROUP_TOKEN), else the admin token (KDTREE_ADMIN_TOKEN_FILE or KDTREE_ADMIN_TOKEN): a group's worker answers
nothing but /live without it (the LeaderWorkerSet worker's readinessProbe runs this on /ready).
"""

from __future__ import annotations

import os
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

from .settings import SidecarSettings, read_secret_file

# Where a holding sidecar leaves its refusal: the container's own temporary folder, readable by its user only.
REFUSAL = Path(tempfile.gettempdir()) / "kdtree-sidecar-refusal"


def write_refusal(message: str) -> None:
    fd = os.open(REFUSAL, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(message + "\n")


def clear_refusal() -> None:
    REFUSAL.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    path = (argv if argv is not None else sys.argv[1:])[:1] or ["/live"]
    try:
        print(REFUSAL.read_text().strip())
        return 1
    except FileNotFoundError:
        pass
    port = os.environ.get("KDTREE_SIDECAR_PORT") or SidecarSettings.model_fields["sidecar_port"].default
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path[0]}")
    name = "KDTREE_GROUP_TOKEN" if os.environ.get("KDTREE_GROUP_ROLE") == "worker" else "KDTREE_ADMIN_TOKEN"
    try:
        token_file = os.environ.get(f"{name}_FILE")
        token = read_secret_file(Path(token_file), f"{name}_FILE") if token_file else None
    except ValueError as e:
        print(e)
        return 1
    token = token or os.environ.get(name)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=5) as r:
            return 0 if r.status == 200 else 1
    except urllib.error.HTTPError as e:
        print(f"GET {path[0]} answered {e.code}: {e.read(2000).decode(errors='replace')}")
    except (OSError, ValueError) as e:
        print(f"GET {path[0]} failed: {e}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
