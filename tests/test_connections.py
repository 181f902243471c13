"""Chapter 09: no connection can starve the others (issue 30, item 4).

A socket that never sends a whole request is closed after `read_timeout`; past `max_connections`
a request is answered 503 and its connection closed; a client that reads nothing of its response is
dropped after `write_timeout`, its requests aborted and their blocks freed; the log stays bounded
(one line per interval for failed accepts, one line for a client leaving mid-body, the path cut in
the access log). Every test talks to 127.0.0.1 only, with small caps and timeouts of a fraction of
a second, so each takes seconds.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time

import httpx
import pytest

from minivllm.engine.llm_engine import LLMEngine
from minivllm.serving.connections import (
    ACCEPT_ERROR,
    OVER_CAPACITY_GRACE,
    CappedAccessLog,
    RateLimitedAcceptErrors,
)
from minivllm.serving.limits import ConnectionLimits
from minivllm.serving.server import ServerThread

pytestmark = pytest.mark.usefixtures("one_torch_thread")

READ_TIMEOUT = 0.5
CAP = 8
OK = {"model": "target", "prompt": "ROMEO:", "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def server(target):
    limits = ConnectionLimits(max_connections=CAP, read_timeout=READ_TIMEOUT, write_timeout=0.5)
    with ServerThread(LLMEngine(target), connections=limits) as running:
        yield running


def connect(server: ServerThread, receive_buffer: int | None = None) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if receive_buffer is not None:  # before connect(), so the window is small from the start
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.settimeout(10)
    sock.connect((server.host, server.port))
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def read_response(sock: socket.socket) -> bytes:
    """One response with a content-length, read to its end (the connection stays open)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    while len(body) < length:
        body += sock.recv(65536)
    return data


def open_connections(server: ServerThread) -> int:
    return len(server._server.server_state.connections)


def wait_for(condition, seconds: float = 10, what: str = "the condition") -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not hold within {seconds} s"
        time.sleep(0.01)


def served(server: ServerThread) -> bool:
    response = httpx.post(server.base_url + "/completions", json=OK, timeout=30)
    return response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 2


def request_head(path: str, length: int) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        f"content-length: {length}\r\n\r\n"
    ).encode()


def test_connections_that_never_finish_a_request_are_closed(server, caplog) -> None:
    """Nothing, half a header, half a body, half a second request after a response: each is
    closed within the read timeout (plus a margin), half a header with a 408; no traceback."""
    before = server.connection_stats.read_timeouts
    opened = time.monotonic()
    silent = connect(server)
    half_header = connect(server)
    half_header.sendall(b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\nx-slow: ")
    half_body = connect(server)
    half_body.sendall(request_head("/v1/completions", 100) + b'{"model": ')
    kept_alive = connect(server)
    kept_alive.sendall(b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
    assert read_response(kept_alive).startswith(b"HTTP/1.1 200")
    kept_alive.sendall(b"GET /health HTTP/1.1\r\n")  # the next request, never finished
    with caplog.at_level(logging.INFO, logger="minivllm.serving"):
        answers = [read_until_closed(s) for s in (silent, half_header, half_body, kept_alive)]
        elapsed = time.monotonic() - opened
        wait_for(lambda: server.connection_stats.read_timeouts == before + 4, what="4 timeouts")
    assert READ_TIMEOUT <= elapsed < READ_TIMEOUT + 10
    assert answers[0] == answers[2] == b""  # nothing to answer; the handler answers nobody
    for answer in answers[1], answers[3]:
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408") and b"connection: close" in head
        assert json.loads(body)["error"]["code"] == "request_timeout"
    # the client that left mid-body is one line, not a traceback
    lines = [r.getMessage() for r in caplog.records if "bytes of its body" in r.getMessage()]
    assert len(lines) == 1 and "after 10 bytes" in lines[0], lines
    assert not [r for r in caplog.records if r.exc_info or "Exception" in r.getMessage()]
    for sock in silent, half_header, half_body, kept_alive:
        sock.close()
    assert served(server)


def test_a_slow_response_is_not_cut_by_the_read_timeout(server, monkeypatch) -> None:
    """The deadline covers the request, not the answer: a stream longer than it runs to its end,
    and a kept-alive connection's next request gets a fresh deadline."""
    engine = server.engine.engine
    step = engine.step

    def slow_step():  # 80 steps outlast the deadline on any device (a GPU's are ~1 ms each)
        time.sleep(READ_TIMEOUT / 40)
        return step()

    monkeypatch.setattr(engine, "step", slow_step)
    body = {**OK, "max_tokens": 80, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        for _ in range(2):  # the same connection, twice
            start = time.monotonic()
            with client.stream("POST", "/completions", json=body) as response:
                events = [line for line in response.iter_lines() if line.startswith("data: {")]
            elapsed = time.monotonic() - start
            finish = json.loads(events[-1][len("data: ") :])["choices"][0]["finish_reason"]
            assert finish == "length"  # and the second request comes after the first deadline
    assert elapsed > READ_TIMEOUT  # or this test would not test anything


def test_connections_past_the_cap_get_a_503_and_are_closed(target) -> None:
    """With CAP connections open and idle, the next request gets a clean 503 at once (not a hang),
    an idle one past the cap is closed within OVER_CAPACITY_GRACE, and when the idle ones go, the
    server serves again. Its own server: a read timeout long enough that the idle connections stay
    open however loaded the machine."""
    limits = ConnectionLimits(max_connections=CAP, read_timeout=60)
    with ServerThread(LLMEngine(target), connections=limits) as server:
        check_the_cap(server)


def check_the_cap(server: ServerThread) -> None:
    idle = [connect(server) for _ in range(CAP)]
    wait_for(lambda: open_connections(server) == CAP, what=f"{CAP} connections")
    refused_before = server.connection_stats.refused
    start = time.monotonic()
    response = httpx.post(server.base_url + "/completions", json=OK, timeout=10)
    assert response.status_code == 503 and time.monotonic() - start < 5
    assert response.headers["retry-after"] == "1" and response.headers["connection"] == "close"
    assert f"{CAP} connections open" in response.json()["error"]["message"]
    anthropic = httpx.post(server.base_url + "/messages", json={}, timeout=10)
    assert anthropic.status_code == 503 and anthropic.json()["type"] == "error"
    idle_past_cap = connect(server)
    start = time.monotonic()
    assert read_until_closed(idle_past_cap) == b""
    assert time.monotonic() - start < OVER_CAPACITY_GRACE + 5
    assert server.connection_stats.refused == refused_before + 3
    for sock in [*idle, idle_past_cap]:
        sock.close()
    wait_for(lambda: open_connections(server) == 0, what="the idle connections to go")
    assert served(server)


def test_a_client_that_reads_nothing_is_dropped_and_its_blocks_freed(target, caplog) -> None:
    """n=16, logprobs, echo, streamed to a client that never reads: once the buffers are full for
    write_timeout, the connection is dropped, the request aborted and every block freed, long before
    the 16 x 400 tokens it asked for."""
    limits = ConnectionLimits(write_timeout=0.5, send_buffer_bytes=4096)
    body = {
        "model": "target",
        "prompt": "ROMEO:",
        "max_tokens": 400,
        "ignore_eos": True,
        "n": 16,
        "logprobs": 5,
        "echo": True,
        "stream": True,
    }
    data = json.dumps(body).encode()
    with ServerThread(LLMEngine(target), connections=limits) as server:
        sock = connect(server, receive_buffer=4096)
        with caplog.at_level(logging.WARNING, logger="minivllm.serving"):
            sock.sendall(request_head("/v1/completions", len(data)) + data)
            wait_for(lambda: server.engine.blocks_in_use() > 0, what="the request to start")
            wait_for(lambda: server.connection_stats.write_timeouts == 1, 60, "a write timeout")
            wait_for(lambda: server.engine.blocks_in_use() == 0, 30, "the blocks to come back")
        generated = server.engine.call(lambda e: e.stats().num_generated_tokens)
        assert generated < 16 * 400  # aborted, not run to its end
        lines = [r.getMessage() for r in caplog.records if "read none of its response" in r.msg]
        assert len(lines) == 1 and not caplog.records[-1].exc_info
        with pytest.raises(ConnectionResetError):  # reset: no kernel buffer left behind either
            while sock.recv(65536):
                pass
        sock.close()
        assert served(server)


def test_failed_accepts_are_logged_once_per_interval(caplog) -> None:
    """asyncio logs each failed accept() through its exception handler, traceback and all, and on
    Python 3.11 retries a hundred times per tick: the filter lets one line per interval through,
    without the traceback, with the count of the ones left out."""
    now = [0.0]
    rate_limit = RateLimitedAcceptErrors(interval=10, clock=lambda: now[0])
    asyncio_logger = logging.getLogger("asyncio")
    installed = asyncio_logger.filters[:]  # a server's own, on the real clock: set aside
    asyncio_logger.filters[:] = [rate_limit]
    loop = asyncio.new_event_loop()
    error = OSError(24, "Too many open files")
    try:
        with caplog.at_level(logging.ERROR, logger="asyncio"):
            for second in (0.0, 1.0, 9.9, 10.0, 25.0):
                now[0] = second
                for _ in range(1000):
                    loop.call_exception_handler({"message": ACCEPT_ERROR, "exception": error})
            loop.call_exception_handler({"message": "something else"})
    finally:
        loop.close()
        asyncio_logger.filters[:] = installed
    lines = [r for r in caplog.records if r.name == "asyncio"]
    assert len(lines) == 4 and lines[-1].getMessage().startswith("something else")
    assert all(r.exc_info is None and "\n" not in r.getMessage() for r in lines[:3])
    assert "0 more" in lines[0].getMessage() and "Too many open files" in lines[0].getMessage()
    assert "2999 more" in lines[1].getMessage()  # 999 + 1000 + 1000 before t = 10 s
    assert "999 more" in lines[2].getMessage()


def test_the_access_log_line_is_capped() -> None:
    record = logging.LogRecord(
        "uvicorn.access",
        logging.INFO,
        __file__,
        1,
        '%s - "%s %s HTTP/%s" %d',
        ("127.0.0.1:5000", "GET", "/v1/" + "x" * 100_000, "1.1", 404),
        None,
    )
    assert CappedAccessLog(200).filter(record)
    line = record.getMessage()
    assert len(line) < 300 and line.endswith('more characters) HTTP/1.1" 404'), line


def test_serve_and_server_thread_install_the_log_filters(target) -> None:
    limits = ConnectionLimits(max_access_log_chars=123, accept_error_log_interval=7)
    with ServerThread(LLMEngine(target), connections=limits):
        (access,) = [f for f in logging.getLogger("uvicorn.access").filters]
        (accepts,) = [f for f in logging.getLogger("asyncio").filters]
    assert access.limit == 123 and accepts.interval == 7


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_connections", 0),
        ("max_connections", 1.5),
        ("read_timeout", 0),
        ("write_timeout", -1),
        ("read_timeout", float("inf")),
        ("send_buffer_bytes", 0),
        ("accept_error_log_interval", "10"),
    ],
)
def test_connection_limits_are_checked(field: str, value) -> None:
    with pytest.raises(ValueError, match=field):
        ConnectionLimits(**{field: value})


def test_serve_options_reach_the_connection_limits() -> None:
    from minivllm.cli import build_parser, connection_limits

    args = build_parser().parse_args(
        ["serve", "--max-connections", "8", "--read-timeout", "0.5", "--send-buffer-bytes", "4096"]
    )
    assert connection_limits(args) == ConnectionLimits(
        max_connections=8, read_timeout=0.5, send_buffer_bytes=4096
    )
    assert connection_limits(build_parser().parse_args(["serve"])) == ConnectionLimits()
    kernel_sized = build_parser().parse_args(["serve", "--send-buffer-bytes", "0"])
    assert connection_limits(kernel_sized).send_buffer_bytes is None
