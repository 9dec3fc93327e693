"""`python -m sidecar`: serve the sidecar with uvicorn on KDTREE_SIDECAR_HOST:KDTREE_SIDECAR_PORT.

A configuration it refuses (a bad KDTREE_ value, an unreadable state file) is printed, then by default ends it
with exit status 2: Kubernetes shows that exit and the log's last lines (kubectl describe). Under compose a
restart loop would show only a dependency that never turns healthy: with --on-config-error hold it stays up
instead, serving nothing, and its healthcheck (python -m sidecar.healthcheck) prints the refusal as the
container's health output (docker inspect) until the configuration is fixed and the container recreated.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys

import uvicorn

from kdtree.config import ConfigError

from .app import create_app
from .healthcheck import REFUSAL, clear_refusal, write_refusal
from .http_server import server_config
from .settings import SidecarSettings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sidecar", description="the kdtree sidecar")
    parser.add_argument(
        "--on-config-error",
        choices=("exit", "hold"),
        default="exit",
        help=f"exit with status 2 (default), or stay up with the refusal in {REFUSAL} for the healthcheck",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    clear_refusal()
    try:
        settings = SidecarSettings.load()
        app = create_app(settings)  # reads the state dir: a bad mode or state file stops here, named
    except ConfigError as e:
        message = f"kdtree sidecar: {e}"
        print(message, file=sys.stderr, flush=True)
        if args.on_config_error == "hold":
            write_refusal(message)
            print(
                "kdtree sidecar: holding, not serving: fix the configuration and recreate the container",
                file=sys.stderr,
                flush=True,
            )
            signal.signal(signal.SIGTERM, lambda *_: sys.exit(2))  # PID 1 ignores SIGTERM unless handled
            while True:
                signal.pause()
        return 2
    uvicorn.Server(server_config(app, settings.sidecar_host, settings.sidecar_port)).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
