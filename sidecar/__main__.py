"""`python -m sidecar`: serve the sidecar with uvicorn on KDTREE_SIDECAR_HOST:KDTREE_SIDECAR_PORT."""

from __future__ import annotations

import logging
import sys

import uvicorn

from kdtree.config import ConfigError

from .app import create_app
from .settings import SidecarSettings


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = SidecarSettings.load()
        app = create_app(settings)  # reads the state dir: a bad mode or state file stops here, named
    except ConfigError as e:
        print(f"kdtree sidecar: {e}", file=sys.stderr)
        return 2
    uvicorn.run(app, host=settings.sidecar_host, port=settings.sidecar_port, log_level="info")
    return 0


if __name__ == "__main__":
    sys.exit(main())
