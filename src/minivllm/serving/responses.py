"""The answers (chapter 09): a non-streamed response collected from its deltas, or a stream of
Server-Sent Events, one chunk per delta of text as the steps produce them, in OpenAI's,
Anthropic's or forge-infer's shape.

A client that goes away is not served further: Starlette cancels a streaming response's generator
when the connection drops (a non-streamed handler watches for the disconnect itself,
`unless_disconnected`), leaving `async with stream` aborts the requests, and the engine thread frees
their blocks before its next step."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from minivllm.engine.processing import TextDelta
from minivllm.serving import anthropic_protocol as anthropic
from minivllm.serving import native_protocol as native
from minivllm.serving.async_engine import EngineDeadError, RequestStream, choice_of
from minivllm.serving.errors import APIError, engine_dead
from minivllm.serving.openai_protocol import (
    DONE,
    END_OF_TURN,
    ResponseHeader,
    chat_choice,
    chat_delta,
    chat_logprobs,
    completion_choice,
    completion_logprobs,
    error_body,
    finish_reason,
    sse_event,
    usage,
)

T = TypeVar("T")
logger = logging.getLogger("minivllm.serving")


@dataclass
class Answer:
    """One choice of a non-streamed response, collected from its deltas."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: list | None = None
    finish_reason: str | None = None

    def add(self, delta: TextDelta) -> None:
        self.text += delta.text
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs or ()
        self.finish_reason = delta.finish_reason


class CompletionPieces:
    """The choices of /v1/completions, whole or piece by piece: the text, with the prompt first
    when it is echoed, and the legacy logprobs when asked (their text offsets run on)."""

    def __init__(
        self,
        stream: RequestStream,
        num_logprobs: int | None,
        echo: list[str | None],
        prompt_ids: list[list[int]],
    ) -> None:
        self.stream = stream
        prompt_of = {request_id: i for i, request_id in enumerate(stream.request_ids)}
        self.prompt = [prompt_of[request_id] for request_id, _ in stream.choices]
        self.num_logprobs, self.echo, self.prompt_ids = num_logprobs, echo, prompt_ids
        self.offsets: dict[int, int] = {}  # choice -> characters streamed so far

    def _echo(self, i: int, prompt_logprobs: list | None) -> tuple[str, dict | None]:
        """The echoed prompt of choice i, and its logprobs when asked."""
        p = self.prompt[i]
        text = self.echo[p] or ""
        if not text or self.num_logprobs is None:
            return text, None
        positions = prompt_logprobs or [None] * len(self.prompt_ids[p])
        return text, completion_logprobs(self.prompt_ids[p], positions, self.num_logprobs)

    def whole(self, i: int, answer: Answer) -> dict:
        text, logprobs = self._echo(i, answer.prompt_logprobs)
        if self.num_logprobs is not None:
            generated = completion_logprobs(
                answer.token_ids, answer.logprobs, self.num_logprobs, len(text)
            )
            logprobs = join_logprobs(logprobs, generated)
        return completion_choice(
            i, text + answer.text, finish_reason(answer.finish_reason), logprobs
        )

    def piece(self, i: int, delta: TextDelta) -> dict | None:
        text, logprobs = ("", None)
        if i not in self.offsets:
            text, logprobs = self._echo(i, self.stream.prompt_logprobs.get(delta.request_id))
            self.offsets[i] = len(text)
        if self.num_logprobs is not None and delta.token_ids:
            generated = completion_logprobs(
                delta.token_ids, delta.logprobs or (), self.num_logprobs, self.offsets[i]
            )
            logprobs = join_logprobs(logprobs, generated)
        self.offsets[i] += len(delta.text)
        if not (text + delta.text or logprobs):
            return None  # a step may bring a token but no text yet: half a character, a stop
        return completion_choice(i, text + delta.text, None, logprobs)

    def finish(self, i: int, reason: str | None) -> dict:
        return completion_choice(i, "", reason)

    def units(self, answers: list[Answer]) -> int:
        """The answer's size in tokens x (logprobs + 1), echoed prompts included."""
        echoed = sum(
            len(self.prompt_ids[self.prompt[i]])
            for i in range(len(answers))
            if self.echo[self.prompt[i]]
        )
        tokens = sum(len(answer.token_ids) for answer in answers) + echoed
        return tokens * ((self.num_logprobs or 0) + 1)


def join_logprobs(first: dict | None, second: dict) -> dict:
    return second if first is None else {k: first[k] + second[k] for k in first}


class ChatPieces:
    """The choices of /v1/chat/completions, whole or piece by piece, with chat's logprobs."""

    def __init__(self, num_logprobs: int | None) -> None:
        self.num_logprobs = num_logprobs

    def _logprobs(self, token_ids, logprobs) -> dict | None:
        if self.num_logprobs is None:
            return None
        return chat_logprobs(token_ids, logprobs or (), self.num_logprobs)

    def whole(self, i: int, answer: Answer) -> dict:
        logprobs = self._logprobs(answer.token_ids, answer.logprobs)
        return chat_choice(i, answer.text, finish_reason(answer.finish_reason), logprobs)

    def piece(self, i: int, delta: TextDelta) -> dict | None:
        logprobs = self._logprobs(delta.token_ids, delta.logprobs) if delta.token_ids else None
        if not (delta.text or logprobs):
            return None
        return chat_delta(i, {"content": delta.text} if delta.text else {}, None, logprobs)

    def finish(self, i: int, reason: str | None) -> dict:
        return chat_delta(i, {}, reason)

    def units(self, answers: list[Answer]) -> int:
        """The answer's size in tokens x (logprobs + 1)."""
        return sum(len(answer.token_ids) for answer in answers) * ((self.num_logprobs or 0) + 1)


async def collect(stream: RequestStream) -> list[Answer]:
    """Every delta of the stream, joined into one answer per choice (in the order of the
    prompts, then of the samples)."""
    answers = {choice: Answer() for choice in stream.choices}
    async with stream:
        async for delta in stream:
            answers[choice_of(delta)].add(delta)
    for (request_id, _), answer in answers.items():
        answer.prompt_logprobs = stream.prompt_logprobs.get(request_id)
    return list(answers.values())


def total_usage(stream: RequestStream, answers: list[Answer]) -> dict:
    return usage(sum(stream.num_prompt_tokens.values()), sum(len(a.token_ids) for a in answers))


async def sse_stream(
    stream: RequestStream,
    header: ResponseHeader,
    pieces: CompletionPieces | ChatPieces,
    include_usage: bool,
    first: dict | None = None,
) -> AsyncIterator[str]:
    """A streamed response as Server-Sent Events: `first` (chat's role delta), a chunk per delta
    that carries text, a finish chunk per choice, the usage chunk (no choices) if the client asked,
    `[DONE]`."""
    if first is not None:
        yield sse_event(first)
    try:
        # Leaving this block for any reason -- the end, an error, the client gone (Starlette
        # cancels the generator) -- aborts whatever is still running.
        async with stream:
            # EXERCISE ch09.3: the SSE stream -- a chunk per delta, a finish chunk per choice, usage
            ### BEGIN SOLUTION
            number = {choice: i for i, choice in enumerate(stream.choices)}  # choice -> its index
            completion_tokens = 0
            async for delta in stream:
                completion_tokens += len(delta.token_ids)
                i = number[choice_of(delta)]
                if (piece := pieces.piece(i, delta)) is not None:  # None: no text this step
                    yield sse_event(header.body([piece]))
                if delta.finish_reason is not None:
                    reason = finish_reason(delta.finish_reason)
                    yield sse_event(header.body([pieces.finish(i, reason)]))
            if include_usage:
                prompt_tokens = sum(stream.num_prompt_tokens.values())
                yield sse_event(header.body([], usage=usage(prompt_tokens, completion_tokens)))
            ### END SOLUTION
    except EngineDeadError as error:
        # The 200 status has gone out already: the error becomes an event.
        yield sse_event(engine_dead(error).body)
    except Exception as error:  # this request alone failed; the engine goes on
        logger.exception("a streamed request failed")
        yield sse_event(error_body(failure(error), "server_error"))
    yield sse_event(DONE)


def failure(error: Exception) -> str:
    """An error event's message, with the exception's type as Python prints it last in a
    traceback."""
    return f"the request failed: {type(error).__name__}: {error}"


async def anthropic_stream(
    stream: RequestStream, message_id: str, model: str, end_of_turn: str | None = END_OF_TURN
) -> AsyncIterator[str]:
    """Anthropic's event sequence for one streamed message; an error after the start is an
    `error` event, as Anthropic sends it."""
    input_tokens = sum(stream.num_prompt_tokens.values())
    start = anthropic.message_body(message_id, model, None, (None, None), input_tokens, 0)
    yield anthropic.event({"type": "message_start", "message": start})
    yield anthropic.event(
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    )
    yield anthropic.event({"type": "ping"})
    output_tokens, reason = 0, None
    try:
        async with stream:
            async for delta in stream:
                output_tokens += len(delta.token_ids)
                if delta.text:
                    text = {"type": "text_delta", "text": delta.text}
                    yield anthropic.event(
                        {"type": "content_block_delta", "index": 0, "delta": text}
                    )
                if delta.finish_reason is not None:
                    reason = anthropic.stop_reason(
                        delta.finish_reason, stream.stop_reasons.get(choice_of(delta)), end_of_turn
                    )
    except Exception as error:
        if not isinstance(error, EngineDeadError):
            logger.exception("a streamed message failed")
        yield anthropic.event(anthropic.error_body(500, f"the request failed: {error}"))
        return
    yield anthropic.event({"type": "content_block_stop", "index": 0})
    yield anthropic.event(
        {
            "type": "message_delta",
            "delta": {"stop_reason": reason[0], "stop_sequence": reason[1]},
            "usage": {"output_tokens": output_tokens},
        }
    )
    yield anthropic.event({"type": "message_stop"})


async def native_stream(stream: RequestStream) -> AsyncIterator[str]:
    """/generate's stream: an event per delta in the shape of the whole answer (the new piece), the
    last with the finish reason and the token counts, then `[DONE]`; an error after the 200 is an
    error event, as in sse_stream."""
    prompt_tokens, completion_tokens = sum(stream.num_prompt_tokens.values()), 0
    try:
        async with stream:
            async for delta in stream:
                completion_tokens += len(delta.token_ids)
                finished = delta.finish_reason is not None
                if delta.text or delta.token_ids or finished:
                    counts = (prompt_tokens, completion_tokens) if finished else None
                    body = native.generate_body(
                        delta.text, delta.token_ids, delta.finish_reason, counts
                    )
                    yield sse_event(body)
    except EngineDeadError as error:
        yield sse_event(engine_dead(error).body)
    except Exception as error:  # this request alone failed; the engine goes on
        logger.exception("a streamed /generate failed")
        yield sse_event(error_body(failure(error), "server_error"))
    yield sse_event(DONE)


def event_stream(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(
        events, media_type="text/event-stream", headers={"cache-control": "no-cache"}
    )


async def unless_disconnected(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """Await `work`, but cancel it if the client goes away first (its `async with stream` then
    aborts)."""
    task, gone = asyncio.ensure_future(work), asyncio.ensure_future(disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        task.cancel()  # no-op when it is done
        gone.cancel()
    if not task.done() or task.cancelled():
        raise APIError(499, "the client closed the connection")  # nobody will read it
    return task.result()


async def disconnected(request: Request) -> None:
    """Returns when the client has gone (the body has been read: the next message is the
    disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def encode_json(content: Any) -> bytes:
    """JSON as Starlette's JSONResponse writes it, except that it always encodes: a lone surrogate
    a client sent (say in a model name) is written as a JSON escape instead of failing as UTF-8."""
    try:
        return json.dumps(
            content, ensure_ascii=False, allow_nan=False, separators=(",", ":")
        ).encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode()


class SafeJSONResponse(JSONResponse):
    """A JSON response that always encodes (`encode_json`)."""

    def render(self, content: Any) -> bytes:
        return encode_json(content)


# An answer of up to this many tokens x (logprobs + 1) is encoded in one go (about 0.5 MB of JSON,
# a few milliseconds); a bigger one choice by choice, so the event loop serves the streams between.
INLINE_ANSWER_UNITS = 20_000


def whole_response(
    header: ResponseHeader,
    pieces: CompletionPieces | ChatPieces,
    answers: list[Answer],
    usage: dict,
) -> Response:
    """A non-streamed answer: small ones as one JSON response; big ones (`n` samples of many
    prompts, echoed, with logprobs: up to tens of MB) built and written a choice at a time, with
    the event loop free between choices, so one big answer never stalls another client's stream."""
    if pieces.units(answers) <= INLINE_ANSWER_UNITS:
        choices = [pieces.whole(i, answer) for i, answer in enumerate(answers)]
        return SafeJSONResponse(header.body(choices, usage=usage))
    return StreamingResponse(
        json_in_pieces(header.body([], usage=usage), pieces, answers),
        media_type="application/json",
    )


async def json_in_pieces(
    body: dict, pieces: CompletionPieces | ChatPieces, answers: list[Answer]
) -> AsyncIterator[bytes]:
    """`body` as JSON, its `choices` made and encoded one at a time (the same bytes as encoding
    the whole body at once)."""
    marker = "\x00choices\x00"  # a string no header field can hold: the choices go there
    head, tail = encode_json({**body, "choices": marker}).split(encode_json(marker), 1)
    yield head + b"["
    for i, answer in enumerate(answers):
        started = time.perf_counter()
        choice = encode_json(pieces.whole(i, answer))
        yield (b"," if i else b"") + choice
        # Then as long again with the GIL free. Yielding to the loop alone is not enough: the
        # engine thread takes the GIL back once per torch op, and a loop thread that computes
        # without pause hands it over only every 5 ms (sys.getswitchinterval), so a step of a few
        # hundred ops would stretch to a second and every stream would stop meanwhile.
        await asyncio.sleep(time.perf_counter() - started)
    yield b"]" + tail
