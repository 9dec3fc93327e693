"""How the sidecar observes and restarts the server: the protocol, and its docker and process implementations."""

from .protocol import ServerControl, ServerControlError, ServerMissing, ServerState

__all__ = ["ServerControl", "ServerControlError", "ServerMissing", "ServerState"]
