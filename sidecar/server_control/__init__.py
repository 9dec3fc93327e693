"""How the sidecar observes and restarts the server: the protocol, and its docker and process implementations."""

from .protocol import ContainerMissing, ContainerState, ServerControl, ServerControlError

__all__ = ["ContainerMissing", "ContainerState", "ServerControl", "ServerControlError"]
