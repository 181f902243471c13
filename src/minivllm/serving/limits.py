"""What the server accepts before any work is done: body size, counts, lengths (chapter 09).

Every limit is checked at the edge, cheaply, before the body is parsed or a prompt tokenised, so
no request can take memory or time from the others: a body larger than `max_body_bytes` is refused
(413) from its Content-Length or as soon as it grows past the limit while being read; a body that
is bigger than `PARSE_INLINE_BYTES` is parsed on a worker thread, so the event loop keeps serving
streams meanwhile; counts (prompts, stop strings, messages) and lengths are checked right after
parsing. Error messages are capped too: a bad 3,000-element prompt gets a short answer, not 164 KB.

`minivllm serve` sets every field (`--max-body-bytes` and friends); the defaults fit this small
model (a 512-token context) with room for any request that could run.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:  # the command line reads ServerLimits without loading the web stack
    from starlette.requests import Request

    from minivllm.sched.sequence import SamplingParams

T = TypeVar("T")
logger = logging.getLogger("minivllm.serving")
PARSE_INLINE_BYTES = 64 * 1024  # bodies up to this are parsed on the event loop (~1 ms at most)


@dataclass(frozen=True)
class ServerLimits:
    """Bounds on one request. `None` for max_prompt_chars means "the model's context": this
    byte-level model reads at least one token per character, so a longer prompt could never fit."""

    max_body_bytes: int = 1 << 20  # 1 MiB
    max_prompts: int = 32  # prompts in one /v1/completions request
    max_stop_strings: int = 16  # stop strings (and stop_sequences, bad_words) per request
    max_stop_length: int = 256  # characters in one stop string
    max_messages: int = 256  # messages in one chat
    max_prompt_chars: int | None = None
    max_error_chars: int = 1000  # longer error messages are cut, saying how much was left out
    # what one answer may carry: prompts x n x (echoed prompt + max_tokens) x (logprobs + 1),
    # about 25 bytes of JSON each: 4,000,000 is ~100 MB at most
    max_output_units: int = 4_000_000
    # sequences (prompts x n samples) in one request; None: the engine's max_num_seqs, one full
    # batch (see check_sequences)
    max_seqs_per_request: int | None = None

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"ServerLimits.{name} must be an int >= 1, got {value!r}")


@dataclass(frozen=True)
class ConnectionLimits:
    """Bounds on one connection, so that no client can hold what the others need: sockets (a file
    descriptor each), and memory for a response nobody reads (`serving/connections.py`).

    - `max_connections`: connections served at once; past it a connection's request is answered
      503 (with `retry-after`) and the connection closed, and it gets at most a second to send it.
    - `read_timeout`: seconds a connection has to send a whole request (headers and body), counted
      from its opening or from the end of its previous response; then it is closed (408 when part
      of a request came). uvicorn alone closes an idle connection only after a response.
    - `write_timeout`: seconds a response may stall on a client that reads nothing (the socket's
      buffers full); then the connection is dropped and its requests aborted, their blocks freed.
    - `send_buffer_bytes`: the kernel's send buffer per connection (SO_SNDBUF, which Linux
      doubles); `None`: the kernel's own sizing, which grows to megabytes (4 MiB by default on
      Linux) for a client that reads nothing, so that the write timeout would only start once
      those are full. 256 KiB still streams at 2.5 MB/s over a 100 ms round trip.
    - `accept_error_log_interval`: seconds between two log lines saying that a connection could
      not be accepted (out of file descriptors); the line counts the ones left out.
    - `max_access_log_chars`: characters of a request's path in the access log.
    """

    max_connections: int = 512
    read_timeout: float = 30.0
    write_timeout: float = 30.0
    send_buffer_bytes: int | None = 256 * 1024
    accept_error_log_interval: float = 10.0
    max_access_log_chars: int = 1000

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if value is None and name == "send_buffer_bytes":
                continue
            if not is_number or not value > 0 or value == float("inf"):
                raise ValueError(f"ConnectionLimits.{name} must be a number > 0, got {value!r}")
            if name in ("max_connections", "send_buffer_bytes", "max_access_log_chars"):
                if not isinstance(value, int):
                    raise ValueError(f"ConnectionLimits.{name} must be an int, got {value!r}")


class RequestError(ValueError):
    """A request the server refuses: an HTTP status, the parameter at fault, what to change."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param, self.status = param, status


def cap(message: str, limit: int) -> str:
    """`message`, cut to at most `limit` characters, saying how much was left out."""
    if len(message) <= limit:
        return message
    note = f" ... ({len(message) - limit} more characters)"
    return message[: max(0, limit - len(note))] + note


def check_count(param: str, count: int, limit: int, what: str) -> None:
    if count > limit:
        raise RequestError(
            f"{param}: {count} {what}, but this server takes at most {limit} per request",
            param=param,
        )


def check_sequences(num_prompts: int, n: int, limit: int) -> None:
    """Refuse a request of more sequences (prompts x n samples) than `limit`, by default the
    engine's max_num_seqs: one request may fill the batch but not queue many batches' worth, which
    would hold the engine for minutes however fairly the waiting requests take turns."""
    if num_prompts * n > limit:
        raise RequestError(
            f"{num_prompts} prompt(s) x n={n} samples is {num_prompts * n} sequences, but this "
            f"server takes at most {limit} per request: send fewer prompts or a smaller n "
            f"(minivllm serve --max-seqs-per-request)",
            param="n" if n > 1 else "prompt",
        )


def max_seqs_per_request(limits: ServerLimits, max_num_seqs: int) -> int:
    """The limit `check_sequences` applies: the server's, else the engine's max_num_seqs."""
    return limits.max_seqs_per_request or max_num_seqs


def check_stop_strings(param: str, stops: tuple[str, ...], limits: ServerLimits) -> None:
    check_count(param, len(stops), limits.max_stop_strings, "strings")
    longest = max((len(s) for s in stops), default=0)
    if longest > limits.max_stop_length:
        raise RequestError(
            f"{param}: a string of {longest} characters, but this server takes at most "
            f"{limits.max_stop_length}",
            param=param,
        )


def check_prompt_chars(param: str, chars: int, limit: int) -> None:
    """Refuse, before tokenising, a prompt of more characters than the model has tokens."""
    if chars > limit:
        raise RequestError(
            f"the prompt ({chars} characters, so at least {chars} tokens) exceeds the model's "
            f"context of {limit} tokens: shorten it",
            param=param,
        )


def check_output_budget(echoed: list[int], params: SamplingParams, limits: ServerLimits) -> None:
    """Refuse, before any work, an answer that could be bigger than `limits.max_output_units`:
    for each prompt, n samples of (its echoed tokens + max_tokens) tokens, each token carrying
    (logprobs + 1) numbers. `echoed` holds each prompt's echoed length (0 when not echoed)."""
    per_token = (params.logprobs or 0) + 1
    units = params.n * sum(echo + params.max_tokens for echo in echoed) * per_token
    if units > limits.max_output_units:
        raise RequestError(
            f"the answer could carry {units:,} tokens x (logprobs + 1) (prompts x n x (echoed "
            f"prompt + max_tokens) x (logprobs + 1)), but this server sends at most "
            f"{limits.max_output_units:,} in one answer: lower n, max_tokens, logprobs, echo or "
            f"the number of prompts (minivllm serve --max-output-units)",
            param="max_tokens",
        )


def _no_constants(name: str) -> float:
    raise ValueError(f"{name} is not JSON (JSON has no NaN or Infinity)")


def parse_json(data: bytes) -> object:
    """The body as JSON, strictly: UTF-8, no NaN/Infinity, bounded nesting (RecursionError) and
    integers (Python's 4,300-digit limit); any failure is a RequestError saying what is wrong."""
    try:
        return json.loads(data.decode("utf-8"), parse_constant=_no_constants)
    except UnicodeDecodeError as error:
        raise RequestError(
            f"the body is not valid UTF-8 ({error.reason} at byte {error.start})"
        ) from None
    except json.JSONDecodeError as error:
        raise RequestError(
            f"the body is not valid JSON ({error.msg} at character {error.pos}): send a JSON object"
        ) from None
    except RecursionError:
        raise RequestError("the body is not valid JSON: it is nested too deeply") from None
    except ValueError as error:  # a huge integer, NaN
        raise RequestError(f"the body is not valid JSON: {error}") from None


async def read_body(request: Request, limits: ServerLimits) -> bytes:
    """The request's body, read no further than `limits.max_body_bytes` (413 past it); it must say
    it is JSON (or say nothing)."""
    content_type = request.headers.get("content-type", "application/json")
    media_type = content_type.split(";")[0].strip().lower()
    if media_type != "application/json" and not media_type.endswith("+json"):
        raise RequestError(
            f"the body must be JSON (content-type: application/json), got {content_type!r}",
            status=415,
        )
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limits.max_body_bytes:
        raise too_large(int(declared), limits)
    from starlette.requests import ClientDisconnect  # the web stack is loaded by now

    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limits.max_body_bytes:
                raise too_large(size, limits)
            chunks.append(chunk)
    except ClientDisconnect:
        # Nobody is left to answer, and nothing is wrong with the server: one line, no traceback.
        client = "{}:{}".format(*request.client) if request.client else "a client"
        logger.warning("%s closed the connection after %d bytes of its body", client, size)
        raise RequestError("the client closed the connection mid-body", status=499) from None
    if not size:
        raise RequestError("the body is empty: send a JSON object")
    return b"".join(chunks)


async def off_the_loop_if_big(size: int, fn: Callable[..., T], *args: object) -> T:
    """`fn(*args)`, on a worker thread when it works on more than PARSE_INLINE_BYTES (bytes or
    characters): the event loop serves the streams meanwhile."""
    if size > PARSE_INLINE_BYTES:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


def too_large(size: int, limits: ServerLimits) -> RequestError:
    return RequestError(
        f"the body has {size} bytes or more, but this server takes at most "
        f"{limits.max_body_bytes} (minivllm serve --max-body-bytes)",
        status=413,
    )
