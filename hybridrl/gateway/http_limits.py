"""A read deadline for the gateway's HTTP connections: uvicorn's h11 protocol with a header and body timeout.

uvicorn bounds an idle keep-alive connection (`timeout_keep_alive`, armed only after a response) and the
number of connections (`limit_concurrency`, past which new requests get 503), but nothing bounds how long a
client may take to send a request: a connection that sends nothing, or its headers or body a byte at a time
(slowloris), is held forever, and enough of them take every slot of `limit_concurrency`. Here a request must
arrive whole, headers and body, within `read_timeout_s` of its first byte (or of the connection, for the
first request); otherwise the connection is closed. A request whose body was cut off this way reaches the
app as a disconnect (the server answers nothing and commits nothing: `server.body_of`).
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

_READ = (h11.IDLE, h11.SEND_BODY)         # the client's states while a request is still arriving


class ReadDeadlineProtocol(H11Protocol):
    """H11Protocol that closes a connection whose request has not arrived whole within `read_timeout_s`."""

    read_timeout_s: float = 10.0
    timed_out: int = 0                     # connections closed by the deadline (all instances of the class)

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        self._deadline: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._deadline is None and self.conn.their_state is h11.IDLE:     # the first bytes of a new request
            self._arm()
        super().data_received(data)
        if self.conn.their_state not in _READ:                                 # read whole (or the connection ended)
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.read_timeout_s, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if self.conn.their_state in _READ and not self.transport.is_closing():
            type(self).timed_out += 1
            self.transport.close()


def with_read_timeout(read_timeout_s: float) -> type[ReadDeadlineProtocol]:
    """A protocol class for `uvicorn.Config(http=...)` with this deadline (a class per server)."""
    return type("GatewayHttpProtocol", (ReadDeadlineProtocol,), {"read_timeout_s": float(read_timeout_s),
                                                                 "timed_out": 0})
