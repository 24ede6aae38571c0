"""How long a connection may keep the server waiting for a request's head.

uvicorn times out a connection that sits idle after a response (``timeout_keep_alive``),
but not one that never finishes a request: a client that opens connections and sends
nothing, or a few bytes of a head and then nothing, holds each one open for as long as it
likes, and enough of them hold the server's file descriptors. ``HeadDeadline`` is uvicorn's
h11 protocol with a deadline: a request's head (its request line and headers) must arrive
within ``HEAD_TIMEOUT_S`` of the connection opening, or of the first byte after the
previous response; past it the connection is closed. The deadline is not moved by bytes
trickling in (an idle timer would be: one byte every few seconds would keep it open)."""
import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol

HEAD_TIMEOUT_S = 10.0  # a browser or client sends its head in one write, in milliseconds
KEEP_ALIVE_S = 5.0  # idle after a response (uvicorn's default, said here beside the other)


class HeadDeadline(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request head is late (see the module)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.head_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._start_deadline()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.cycle is None or self.cycle.response_complete:  # a head begun and not finished
            self._start_deadline()
        elif self.head_deadline is not None:  # the head is in: the request is the app's now
            self.head_deadline.cancel()
            self.head_deadline = None

    def connection_lost(self, exc) -> None:
        if self.head_deadline is not None:
            self.head_deadline.cancel()
            self.head_deadline = None
        super().connection_lost(exc)

    def _start_deadline(self) -> None:
        if self.head_deadline is None:
            self.head_deadline = self.loop.call_later(HEAD_TIMEOUT_S, self._head_late)

    def _head_late(self) -> None:
        self.head_deadline = None
        if self.cycle is None or self.cycle.response_complete:
            self.transport.close()


def uvicorn_config(app, **kwargs):
    """uvicorn's Config for ``app`` with the deadlines above."""
    import uvicorn

    return uvicorn.Config(app, http=HeadDeadline, timeout_keep_alive=KEEP_ALIVE_S, **kwargs)
