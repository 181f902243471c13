"""What one connection may take (chapter 09): a socket for a bounded time, a bounded share of the
server, and a bounded amount of the log.

uvicorn closes an idle connection only after a response (`timeout_keep_alive`): a socket that
never sends a whole request holds its file descriptor forever, and some thousands of them leave
none for anyone else. Nor does it bound how long a response may wait on a client that reads
nothing. `guarded_protocol` is uvicorn's HTTP/1.1 protocol (h11) with four guards:

- a deadline for each request: `read_timeout` seconds from the connection's opening, or from the
  end of its previous response, to the end of the request's body; then the connection is closed
  (with a 408 when part of a request came; the handler reading a body sees a disconnect);
- a cap: past `max_connections` a connection's request is answered 503, in the API's error body,
  and the connection closed; it gets at most `OVER_CAPACITY_GRACE` seconds to send its request;
- a write deadline: asyncio pauses a protocol when its transport holds more than 64 KiB the
  kernel would not take; if it stays paused `write_timeout` seconds the connection is reset (the
  kernel frees its buffers at once), which the app sees as the client leaving: the stream's
  requests are aborted and their blocks freed;
- `send_buffer_bytes`, when set, bounds the kernel's own buffer per connection.

It leans on uvicorn's H11Protocol hooks (`connection_made`, `on_response_complete`,
`connection_lost`, its `app`, `conn` and `connections` attributes) and on h11's public state
(`their_state`, `trailing_data`): the same from uvicorn 0.32 to 0.59, as pyproject pins it, and
tests/test_connections.py fails if they change. Two logging filters bound the log: asyncio logs
every failed accept() (out of file descriptors), and Python 3.11's loop retries a hundred times per
tick, so `RateLimitedAcceptErrors` lets one line through per interval, counting the rest;
`CappedAccessLog` cuts the path in uvicorn's access log.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import struct
import time
from dataclasses import dataclass

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from minivllm.serving import anthropic_protocol as anthropic
from minivllm.serving.limits import ConnectionLimits, cap
from minivllm.serving.openai_protocol import error_body

logger = logging.getLogger("minivllm.serving")
OVER_CAPACITY_GRACE = 1.0  # seconds a connection past the cap has to send the request we refuse
ACCEPT_ERROR = "socket.accept() out of system resource"  # asyncio's words (selector_events.py)


@dataclass
class ConnectionStats:
    """What the guards did, since the server started."""

    refused: int = 0  # connections past the cap
    read_timeouts: int = 0  # connections closed for not sending a whole request in time
    write_timeouts: int = 0  # connections dropped for not reading their response


def api_error_body(path: str, status: int, message: str, kind: str) -> dict:
    """The error in the shape of the endpoint's API (Anthropic's on /v1/messages), as app.py's."""
    if path.startswith("/v1/messages"):
        return anthropic.error_body(status, message)
    return error_body(message, kind)


def over_capacity_app(limit: int):
    """The ASGI app a connection past the cap gets instead of the server's: a 503 that says why."""
    message = f"the server has {limit} connections open, its limit: try again shortly"

    async def refuse(scope, receive, send) -> None:
        data = json.dumps(api_error_body(scope["path"], 503, message, "service_unavailable"))
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(data)).encode()),
            (b"retry-after", b"1"),
            (b"connection", b"close"),  # h11 then closes the connection after the answer
        ]
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": data.encode()})

    return refuse


def request_timeout_response(timeout: float) -> bytes:
    """A raw 408 (h11 sends a response only to a request it has parsed, and this one is not)."""
    message = f"no complete request within {timeout:g} s: the connection is closed"
    body = json.dumps(error_body(message, "invalid_request_error", code="request_timeout"))
    return (
        "HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n{body}"
    ).encode()


def guarded_protocol(limits: ConnectionLimits, stats: ConnectionStats) -> type[H11Protocol]:
    """uvicorn's h11 protocol class with the guards of `limits`, counting in `stats`: pass it to
    `uvicorn.Config(http=...)`."""

    class GuardedH11Protocol(H11Protocol):
        request_timer: asyncio.TimerHandle | None = None
        write_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if limits.send_buffer_bytes is not None:
                sock = transport.get_extra_info("socket")
                if sock is not None:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, limits.send_buffer_bytes)
            if len(self.connections) > limits.max_connections:  # this one included
                stats.refused += 1
                self.app = over_capacity_app(limits.max_connections)
                self.expect_request(min(limits.read_timeout, OVER_CAPACITY_GRACE))
            else:
                self.expect_request(limits.read_timeout)

        def expect_request(self, timeout: float) -> None:
            if self.request_timer is not None:
                self.request_timer.cancel()
            self.request_timer = self.loop.call_later(timeout, self.request_timed_out, timeout)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():  # kept alive: the next request has its deadline
                self.expect_request(limits.read_timeout)

        def request_timed_out(self, timeout: float) -> None:
            self.request_timer = None
            state = self.conn.their_state
            if self.transport.is_closing() or state not in (h11.IDLE, h11.SEND_BODY):
                return  # the request is in: the app has it, and its response re-arms the deadline
            stats.read_timeouts += 1
            if state is h11.IDLE and self.conn.trailing_data[0]:
                self.transport.write(request_timeout_response(timeout))  # half a request came
            # in SEND_BODY the handler reading the body sees a disconnect and answers nobody
            self.transport.close()

        def pause_writing(self) -> None:
            super().pause_writing()
            if self.write_timer is None:
                self.write_timer = self.loop.call_later(limits.write_timeout, self.write_timed_out)

        def resume_writing(self) -> None:
            super().resume_writing()
            self.cancel_write_timer()

        def cancel_write_timer(self) -> None:
            if self.write_timer is not None:
                self.write_timer.cancel()
                self.write_timer = None

        def write_timed_out(self) -> None:
            self.write_timer = None
            stats.write_timeouts += 1
            client = "{}:{}".format(*self.client) if self.client else "a client"
            logger.warning(
                "%s read none of its response for %g s: connection dropped, its request aborted",
                client,
                limits.write_timeout,
            )
            # A reset, not a close: close() would wait for the buffers to drain, and they never
            # would (nor would the kernel's, a close leaves them to it for minutes).
            sock = self.transport.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.transport.abort()

        def connection_lost(self, exc: Exception | None) -> None:
            if self.request_timer is not None:
                self.request_timer.cancel()
                self.request_timer = None
            self.cancel_write_timer()
            super().connection_lost(exc)

    return GuardedH11Protocol


class RateLimitedAcceptErrors(logging.Filter):
    """On asyncio's logger: one "socket.accept() out of system resource" line per `interval`
    seconds, without its traceback, saying how many were left out; other records pass."""

    def __init__(self, interval: float, clock=time.monotonic) -> None:
        super().__init__()
        self.interval, self.clock = interval, clock
        self.last: float | None = None
        self.left_out = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith(ACCEPT_ERROR):
            return True
        now = self.clock()
        if self.last is not None and now - self.last < self.interval:
            self.left_out += 1
            return False
        error = record.exc_info[1] if record.exc_info else None
        record.msg = (
            f"{ACCEPT_ERROR} ({error}): new connections wait until sockets close; "
            f"{self.left_out} more such errors since the last line (one line per "
            f"{self.interval:g} s)"
        )
        record.args, record.exc_info, record.exc_text = (), None, None
        self.last, self.left_out = now, 0
        return True


class CappedAccessLog(logging.Filter):
    """On uvicorn's access logger: each text argument (the path above all) cut to `limit`
    characters, saying how much was left out."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(
                cap(arg, self.limit) if isinstance(arg, str) else arg for arg in record.args
            )
        return True


def install_log_filters(limits: ConnectionLimits) -> None:
    """The two filters, once per process (a later server's limits replace an earlier one's)."""
    for name, filter_ in (
        ("asyncio", RateLimitedAcceptErrors(limits.accept_error_log_interval)),
        ("uvicorn.access", CappedAccessLog(limits.max_access_log_chars)),
    ):
        target = logging.getLogger(name)
        for old in [f for f in target.filters if type(f) is type(filter_)]:
            target.removeFilter(old)
        target.addFilter(filter_)
