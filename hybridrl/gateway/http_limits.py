"""A read deadline for the gateway's HTTP connections: uvicorn's h11 protocol with a header and body timeout.

uvicorn bounds an idle keep-alive connection (`timeout_keep_alive`, armed only after a response) and the
number of connections (`limit_concurrency`, past which new requests get 503), but nothing bounds how long a
client may take to send a request: a connection that sends nothing, or its headers or body a byte at a time
(slowloris), is held forever, and enough of them take every slot of `limit_concurrency`. Here a request must
arrive whole, headers and body, within `read_timeout_s` of its first byte (or of the connection, for the
first request); otherwise the connection is closed. A request whose body was cut off this way reaches the
app as a disconnect (the server answers nothing and commits nothing: `server.body_of`).

The protocol also tells the app when a request's connection closes before its response is complete,
through an ASGI scope extension (`scope["extensions"][CLIENT_LOST]`, a `ClientLost`): the app registers
a callback and the connection's `connection_lost` calls it. The standard way, an `http.disconnect` from
`receive()`, needs a task waiting on it for every request, at several times the CPU.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from hybridrl.gateway.server import CLIENT_LOST

_READ = (h11.IDLE, h11.SEND_BODY)         # the client's states while a request is still arriving


class ClientLost:
    """Callbacks of one request, called once when its connection closes before the response is complete."""

    __slots__ = ("callbacks", "lost")

    def __init__(self) -> None:
        self.callbacks: list[Callable[[], None]] = []
        self.lost = False

    def add(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call `callback` when the connection is lost (at once if it is already); returns its remover."""
        if self.lost:
            callback()
            return _nothing
        self.callbacks.append(callback)

        def remove() -> None:
            if callback in self.callbacks:
                self.callbacks.remove(callback)
        return remove

    def fire(self) -> None:
        self.lost = True
        callbacks, self.callbacks = self.callbacks, []
        for callback in callbacks:
            callback()


def _nothing() -> None:
    return None


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

    def handle_events(self) -> None:
        super().handle_events()
        cycle = self.cycle                    # a request read here gets its ClientLost before the app runs
        if cycle is not None and CLIENT_LOST not in cycle.scope.get("extensions", ()):
            cycle.scope.setdefault("extensions", {})[CLIENT_LOST] = ClientLost()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        cycle = self.cycle
        super().connection_lost(exc)
        if cycle is not None and not cycle.response_complete:
            hooks = cycle.scope.get("extensions", {}).get(CLIENT_LOST)
            if hooks is not None:
                hooks.fire()

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
