"""How the sidecar is served: uvicorn, its h11 protocol with a deadline on each request's arrival.

uvicorn bounds an idle keep-alive connection (timeout_keep_alive) but not one that sends its request slowly: a client
that trickles a header line, or a body, a byte at a time holds a connection, a file descriptor and (for the body) a
handler for as long as it likes. Here a request must arrive whole, head and body, within REQUEST_ARRIVAL_S of the
connection opening or of the previous response on it; a connection that has not done so is closed (a body cut off
this way is the handler's ClientDisconnect: a 400). A request that has arrived may take as long as its handler does
(POST /mode waits out a flip's bake)."""

from __future__ import annotations

import asyncio

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

# the sidecar's requests are a few hundred bytes: a generous bound for any real client
REQUEST_ARRIVAL_S = 10.0


class DeadlinedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, and a connection closed when a request has not arrived whole in REQUEST_ARRIVAL_S."""

    _arrival: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()  # the next request on this connection has its own time

    def connection_lost(self, exc: Exception | None) -> None:
        if self._arrival is not None:
            self._arrival.cancel()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._arrival is not None:
            self._arrival.cancel()
        self._arrival = self.loop.call_later(REQUEST_ARRIVAL_S, self._arrival_due)

    def _arrival_due(self) -> None:
        # their_state is DONE once a request has arrived whole (also while its handler runs); IDLE or SEND_BODY
        # means the client is still sending, or has sent nothing since the last response
        if self.conn.their_state is not h11.DONE and not self.transport.is_closing():
            self.transport.close()


def server_config(app, host: str, port: int, log_level: str = "info") -> uvicorn.Config:
    """The one uvicorn configuration the sidecar runs under (python -m sidecar, and the tests' sidecars)."""
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, http=DeadlinedH11Protocol)
