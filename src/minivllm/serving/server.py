"""An OpenAI-compatible HTTP server over the AsyncEngine (chapter 08).

    minivllm serve --model target --port 8000
    curl localhost:8000/v1/completions -H 'content-type: application/json' \\
         -d '{"model": "target", "prompt": "ROMEO:\\n", "max_tokens": 40}'

`build_app` makes a FastAPI app with OpenAI's endpoints -- `/v1/completions`,
`/v1/chat/completions`, `/v1/models` (and `/v1/models/{id}`) --, Anthropic's `/v1/messages`, vLLM's
`/tokenize`, `/detokenize` and `/version`, forge-infer's native `/generate` (one prompt in, `{text,
token_ids, finish_reason}` out), and `/health` (with astrai's `model_loaded`), `/metrics`
(Prometheus) and astrai's `/stats` (the engine's counters as JSON: active, waiting and total
requests, cache usage, tokens generated). `model` may be left out of a request: it is then the
served model, as in vLLM. A handler reads the body within the server's limits (limits.py), checks
it (openai_protocol.py, anthropic_protocol.py, native_protocol.py), puts it in the engine's inbox
and awaits the verdict, then either collects the whole answer or streams it: a `StreamingResponse`
of Server-Sent Events, one chunk per delta of text, as the steps produce them.

No request can hurt another. Every field is checked with its bounds before anything reaches the
engine, and every error leaves in the API's own error body (OpenAI's, or Anthropic's on
/v1/messages), so the official clients raise their usual exceptions: malformed JSON and wrong fields
are 400 (where FastAPI would say 422), a body over the limit 413, a wrong key 401, an unknown model
404, a dead engine 503. `--api-key` guards everything but `/health`, `/metrics`, `/stats` and
`/version`.

A client that goes away is not served further: Starlette cancels a streaming response's generator
when the connection drops (a non-streaming handler watches for the disconnect itself), leaving
`async with stream` aborts the requests, and the engine thread frees their blocks before its next
step.

`ServerThread` runs all of it in a background thread on a free loopback port, for notebooks and
tests; `serve` runs it in the foreground for the command line, and returns 1 if the engine died.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import hmac
import json
import logging
import re
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, TypeVar

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from minivllm.engine.conversation import ChatTemplateError, has_chat_template, render_conversation
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.processing import TextDelta
from minivllm.sched.sequence import SamplingParams
from minivllm.serving import anthropic_protocol as anthropic
from minivllm.serving import native_protocol as native
from minivllm.serving.async_engine import (
    AsyncEngine,
    EngineDeadError,
    RequestFailedError,
    RequestStream,
    choice_of,
    stats_summary,
)
from minivllm.serving.limits import (
    RequestError,
    ServerLimits,
    cap,
    check_count,
    check_prompt_chars,
    check_stop_strings,
    off_the_loop_if_big,
    parse_json,
    read_body,
)
from minivllm.serving.metrics import ServingMetrics
from minivllm.serving.openai_protocol import (
    DONE,
    END_OF_TURN,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    ResponseHeader,
    SamplingFields,
    TokenId,
    chat_choice,
    chat_delta,
    chat_logprobs,
    completion_choice,
    completion_logprobs,
    error_body,
    finish_reason,
    model_card,
    render_chat,
    sse_event,
    usage,
)

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)
logger = logging.getLogger("minivllm.serving")
# OpenAI's default for /v1/completions; a chat answer may run to the context's end
COMPLETION_MAX_TOKENS = 16
MAX_LISTED_PROBLEMS = 5  # a validation error names this many problems, then counts the rest


class APIError(Exception):
    """An error response: raise it in a handler, the app's handler sends it in the shape of the
    endpoint's API (OpenAI's, or Anthropic's on /v1/messages)."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type,
            param,
            code,
        )

    @property
    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def engine_dead(error: BaseException | None) -> APIError:
    return APIError(
        503, str(error or "the engine thread has stopped"), "server_error", code="engine_dead"
    )


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


class OpenAIServer:
    """The endpoints, over one AsyncEngine serving one model."""

    def __init__(
        self,
        engine: AsyncEngine,
        model_name: str,
        limits: ServerLimits | None = None,
        api_key: str | None = None,
    ) -> None:
        self.engine, self.model_name = engine, model_name
        self.limits, self.api_key = limits or ServerLimits(), api_key
        self.context = engine.engine.config.max_model_len  # the engine's, not the model's
        self.vocab_size = engine.engine.model.config.vocab_size
        self.tokenizer = engine.engine.tokenizer
        # A chat is laid out by the model's chat template, whose turn ends with a token the EOS
        # ids stop on; a model without one (the shipped byte-level ones) reads it as a play, whose
        # turn ends at a blank line (END_OF_TURN).
        self.templated = has_chat_template(self.tokenizer)
        self.end_of_turn = None if self.templated else END_OF_TURN
        self.max_prompt_chars = self.limits.max_prompt_chars or self.context
        self.created = int(time.time())

    # -- OpenAI ------------------------------------------------------------------------------------
    async def completions(self, request: Request):
        """POST /v1/completions: every check first (the body, the limits, the token ids, the
        prompts tokenised), then the engine's verdict, then the answer, whole or streamed."""
        body = await self._request(request, CompletionRequest)
        prompts = body.prompts()
        check_count("prompt", len(prompts), self.limits.max_prompts, "prompts")
        check_stop_strings("stop", body.stops(), self.limits)
        check_stop_strings("bad_words", tuple(body.bad_words or ()), self.limits)
        self._check_token_ids(body)
        # within the context, text is tokenised in microseconds; only truncate_prompt_tokens lets
        # a long text through, and then it is tokenised off the event loop
        chars = sum(len(p) for p in prompts if isinstance(p, str))
        prompt_ids = await off_the_loop_if_big(
            chars, self._all_prompt_ids, prompts, body.truncate_prompt_tokens
        )
        params = sampling_params(lambda: body.sampling_params(COMPLETION_MAX_TOKENS))
        if body.echo and params.logprobs is not None:  # the prompt's logprobs come with it
            params = dataclasses.replace(params, prompt_logprobs=params.logprobs)
        header = ResponseHeader.new("text_completion", self.model_name)
        stream = await self._add(prompt_ids, params)
        echo = [self.tokenizer.decode(ids) if body.echo else None for ids in prompt_ids]
        pieces = CompletionPieces(stream, params.logprobs, echo, prompt_ids)
        if body.stream:
            return event_stream(sse_stream(stream, header, pieces, body.include_usage))
        answers = await self._collect(request, stream)
        choices = [pieces.whole(i, answer) for i, answer in enumerate(answers)]
        return SafeJSONResponse(header.body(choices, usage=total_usage(stream, answers)))

    async def chat_completions(self, request: Request):
        """POST /v1/chat/completions: the chat laid out by the model's chat template (or, for a
        model without one, as a play), answered by the assistant (the play's next speaker)."""
        body = await self._request(request, ChatCompletionRequest)
        check_count("messages", len(body.messages), self.limits.max_messages, "messages")
        check_stop_strings("stop", body.stops(), self.limits)
        check_stop_strings("bad_words", tuple(body.bad_words or ()), self.limits)
        self._check_token_ids(body)
        prompt_ids = await off_the_loop_if_big(
            sum(len(m.text) for m in body.messages),
            self._chat_prompt_ids,
            body.messages,
            body.truncate_prompt_tokens,
        )
        room = max(1, self.context - len(prompt_ids))  # the default: up to the context
        turn_end = [self.end_of_turn] if self.end_of_turn else []
        params = sampling_params(lambda: body.sampling_params(room, extra_stop=turn_end))
        header = ResponseHeader.new(
            "chat.completion.chunk" if body.stream else "chat.completion", self.model_name
        )
        stream = await self._add([prompt_ids], params, "messages")
        pieces = ChatPieces(params.logprobs)
        if body.stream:
            first = header.body(
                [
                    chat_delta(i, {"role": "assistant", "content": ""}, None)
                    for i in range(len(stream.choices))
                ]
            )
            return event_stream(sse_stream(stream, header, pieces, body.include_usage, first))
        answers = await self._collect(request, stream)
        choices = [pieces.whole(i, answer) for i, answer in enumerate(answers)]
        return SafeJSONResponse(header.body(choices, usage=total_usage(stream, answers)))

    async def models(self, request: Request):
        self._authorize(request)
        return {"object": "list", "data": [model_card(self.model_name, self.created, self.context)]}

    async def model(self, request: Request, model_id: str):
        self._authorize(request)
        self._check_model(model_id, param=None)
        return model_card(self.model_name, self.created, self.context)

    # -- Anthropic ---------------------------------------------------------------------------------
    async def messages(self, request: Request):
        """POST /v1/messages: Anthropic's view of the same chat and the same engine."""
        body = await self._request(request, anthropic.MessagesRequest)
        check_count("messages", len(body.messages), self.limits.max_messages, "messages")
        check_stop_strings("stop_sequences", body.stops(), self.limits)
        prompt_ids = self._chat_prompt_ids(body.chat(), None)
        params = sampling_params(lambda: body.sampling_params(self.end_of_turn))
        stream = await self._add([prompt_ids], params, "messages")
        message_id = anthropic.new_message_id()
        if body.stream:
            return event_stream(
                anthropic_stream(
                    stream, message_id, self.model_name, body.turn_end_stop(self.end_of_turn)
                )
            )
        (answer,) = await self._collect(request, stream)
        reason = anthropic.stop_reason(
            answer.finish_reason,
            stream.stop_reasons.get(stream.choices[0]),
            body.turn_end_stop(self.end_of_turn),
        )
        input_tokens = sum(stream.num_prompt_tokens.values())
        return SafeJSONResponse(
            anthropic.message_body(
                message_id,
                self.model_name,
                answer.text,
                reason,
                input_tokens,
                len(answer.token_ids),
            )
        )

    # -- vLLM's extras -----------------------------------------------------------------------------
    async def tokenize(self, request: Request):
        """vLLM's /tokenize: a `prompt` or chat `messages` as the engine would tokenise them."""
        body = await self._request(request, TokenizeRequest)
        if (body.prompt is None) == (body.messages is None):
            raise RequestError("give either prompt or messages", param="prompt")
        if body.messages is not None:
            check_count("messages", len(body.messages), self.limits.max_messages, "messages")
            chars = sum(len(m.text) for m in body.messages)
            check_prompt_chars("messages", chars, self.max_prompt_chars)
            prompt = self._chat_prompt(body.messages)
        else:
            prompt = body.prompt
        if isinstance(prompt, str):
            check_prompt_chars("prompt", len(prompt), self.max_prompt_chars)
            tokens = self.tokenizer.encode(prompt, add_bos=body.add_special_tokens)
        else:  # the chat template's own ids, special tokens and all: what the chat endpoint reads
            tokens = prompt
        strings = [self.tokenizer.token_repr(t) for t in tokens] if body.return_token_strs else None
        return {
            "count": len(tokens),
            "max_model_len": self.context,
            "tokens": tokens,
            "token_strs": strings,
        }

    async def detokenize(self, request: Request):
        """vLLM's /detokenize: token ids back to text (special tokens carry none)."""
        body = await self._request(request, DetokenizeRequest)
        if bad := [t for t in body.tokens if t >= self.vocab_size]:
            raise RequestError(
                f"token id {bad[0]} is outside the vocabulary 0..{self.vocab_size - 1}",
                param="tokens",
            )
        return SafeJSONResponse({"prompt": self.tokenizer.decode(body.tokens)})

    # -- forge-infer's native endpoint -------------------------------------------------------------
    async def generate(self, request: Request):
        """POST /generate: one prompt in, `{text, token_ids, finish_reason}` out, whole or
        streamed, after every check /v1/completions makes."""
        body = await self._request(request, native.GenerateRequest)
        check_stop_strings("stop", body.stops(), self.limits)
        check_stop_strings("bad_words", tuple(body.bad_words or ()), self.limits)
        self._check_token_ids(body)
        chars = len(body.prompt) if isinstance(body.prompt, str) else 0
        prompt_ids = await off_the_loop_if_big(
            chars, self._prompt_ids, body.prompt, "prompt", body.truncate_prompt_tokens
        )
        params = sampling_params(lambda: body.sampling_params(native.GENERATE_MAX_TOKENS))
        stream = await self._add([prompt_ids], params)
        if body.stream:
            return event_stream(native_stream(stream))
        (answer,) = await self._collect(request, stream)
        counts = (len(prompt_ids), len(answer.token_ids))
        return SafeJSONResponse(
            native.generate_body(answer.text, answer.token_ids, answer.finish_reason, counts)
        )

    # -- astrai's and vLLM's extras ----------------------------------------------------------------
    async def stats(self):
        """astrai's GET /stats: the engine's counters and gauges as JSON, read on the engine thread
        between two steps (a consistent snapshot; the event loop never reads a stepping engine)."""
        summary = stats_summary(await self.engine.stats())
        return {"model": self.model_name, "engine_alive": self.engine.is_alive, **summary}

    async def version(self):
        try:
            return {"version": metadata.version("minivllm")}
        except metadata.PackageNotFoundError:
            return {"version": "unknown"}

    async def health(self):
        if not self.engine.is_alive:
            raise engine_dead(self.engine.error)
        # astrai's field: the model was loaded before the app was built, and its engine serves
        return {"status": "ok", "model_loaded": True}

    async def metrics(self):
        return PlainTextResponse(
            await self.engine.render_metrics(), media_type="text/plain; version=0.0.4"
        )

    # -- the checks --------------------------------------------------------------------------------
    async def _request(self, request: Request, model: type[M]) -> M:
        """The body of a request, authorised, read within the limits, parsed and checked (off the
        event loop when it is big), for this server's model."""
        self._authorize(request)
        data = await read_body(request, self.limits)
        body = await off_the_loop_if_big(len(data), validate, data, model)
        if getattr(body, "model", None) is not None:  # optional on /tokenize and /detokenize
            self._check_model(body.model)
        with_model_defaults(body, self.engine.engine.default_params)
        return body

    def _authorize(self, request: Request) -> None:
        """With --api-key: `Authorization: Bearer <key>` (OpenAI, vLLM) or `x-api-key: <key>`
        (Anthropic)."""
        if self.api_key is None:
            return
        bearer = request.headers.get("authorization", "")
        given = bearer[7:] if bearer[:7].lower() == "bearer " else request.headers.get("x-api-key")
        if given is None or not hmac.compare_digest(given.encode(), self.api_key.encode()):
            raise APIError(
                401,
                "missing or wrong API key: send `Authorization: Bearer <key>` or `x-api-key`",
                code="invalid_api_key",
            )

    def _check_model(self, model: str, param: str | None = "model") -> None:
        if model != self.model_name:
            raise APIError(
                404,
                f"The model {json.dumps(model[:100])} does not exist: this server serves "
                f"`{self.model_name}` (GET /v1/models lists it)",
                param=param,
                code="model_not_found",
            )

    def _check_token_ids(self, body: SamplingFields) -> None:
        """Token ids in the sampling fields must be in the vocabulary (the prompt's are checked
        by the engine)."""
        for param, ids in (
            ("stop_token_ids", body.stop_token_ids or ()),
            ("allowed_token_ids", body.allowed_token_ids or ()),
            ("logit_bias", [int(key) for key in body.logit_bias or {}]),
        ):
            if bad := [t for t in ids if t >= self.vocab_size]:
                raise RequestError(
                    f"{param}: token id {bad[0]} is outside the vocabulary "
                    f"0..{self.vocab_size - 1}",
                    param=param,
                )

    def _prompt_ids(self, prompt: str | list[int], param: str, truncate: int | None) -> list[int]:
        """A prompt as the engine's token ids (BOS first for text), with vLLM's
        truncate_prompt_tokens: keep the last k. Text longer than the context is refused before it
        is tokenised, so a huge prompt costs nothing."""
        if isinstance(prompt, str):
            if truncate is None:
                check_prompt_chars(param, len(prompt), self.max_prompt_chars)
            ids = self.tokenizer.encode(prompt, add_bos=True)
        else:
            ids = list(prompt)
        return ids[-truncate:] if truncate is not None else ids

    def _all_prompt_ids(
        self, prompts: list[str | list[int]], truncate: int | None
    ) -> list[list[int]]:
        return [self._prompt_ids(p, "prompt", truncate) for p in prompts]

    def _chat_prompt_ids(self, messages: list[ChatMessage], truncate: int | None) -> list[int]:
        chars = sum(len(m.text) for m in messages)
        if truncate is None:
            check_prompt_chars("messages", chars, self.max_prompt_chars)
        return self._prompt_ids(self._chat_prompt(messages), "messages", truncate)

    def _chat_prompt(self, messages: list[ChatMessage]) -> str | list[int]:
        """The chat as the model reads it: the token ids of its chat template's layout (the same
        as `LLM.chat`'s, engine/conversation.py), or, without a template, the play's text. A
        template that refuses the conversation (its `raise_exception`) is the client's 400."""
        if not self.templated:
            return render_chat(messages)
        try:
            return render_conversation(
                self.tokenizer, [m.model_dump(exclude_none=True) for m in messages]
            )
        except ChatTemplateError as error:
            raise RequestError(
                f"the model's chat template refused the conversation: {error}", param="messages"
            ) from None

    async def _add(
        self, prompts: list[list[int]], params: SamplingParams, param: str = "prompt"
    ) -> RequestStream:
        try:
            return await self.engine.add_request(prompts, params)
        except (ValueError, TypeError) as error:  # the engine's own check: a prompt too long
            raise RequestError(str(error), param=param_of(error, param)) from None
        except EngineDeadError as error:
            raise engine_dead(error) from None

    async def _collect(self, request: Request, stream: RequestStream) -> list[Answer]:
        try:
            return await unless_disconnected(request, collect(stream))
        except EngineDeadError as error:
            raise engine_dead(error) from None
        except RequestFailedError as error:
            raise APIError(500, str(error), "server_error") from None


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize body: a prompt, or a chat (rendered as the chat endpoint renders it)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    """vLLM's /detokenize body."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    tokens: list[TokenId]


def validate(data: bytes, model: type[M]) -> M:
    """Parse and check a body; every problem becomes a RequestError naming the field."""
    payload = parse_json(data)
    if not isinstance(payload, dict):
        raise RequestError(
            f"the body must be a JSON object, got {type(payload).__name__}: send a valid dictionary"
        )
    try:
        body = model.model_validate(payload)
    except ValidationError as error:
        raise validation_problem(error) from None
    except RecursionError:
        raise RequestError("the body is nested too deeply") from None
    if hasattr(body, "check_extra_fields"):
        body.check_extra_fields()
    return body


def validation_problem(error: ValidationError) -> RequestError:
    """Pydantic's errors as one message, every problem named `field: what is wrong` (the first
    few, then how many more)."""
    problems, params = [], []
    for problem in error.errors(include_url=False, include_input=False):
        where = ".".join(str(part) for part in problem["loc"])
        params.append(str(problem["loc"][0]) if problem["loc"] else None)
        if problem["type"] == "value_error":  # our validators' own messages, without the prefix
            text = str(problem["ctx"]["error"])
        elif problem["type"] == "missing":
            text = "Field required"
        else:
            text = problem["msg"]
        problems.append(f"{where or 'body'}: {text}")
    problems = list(dict.fromkeys(problems))
    listed = "; ".join(problems[:MAX_LISTED_PROBLEMS])
    if len(problems) > MAX_LISTED_PROBLEMS:
        listed += f"; and {len(problems) - MAX_LISTED_PROBLEMS} more"
    return RequestError("invalid request: " + listed, param=params[0] if params else None)


# The sampling knobs a request may leave out, which then take the engine's default (vLLM's
# default_sampling_params: the checkpoint's generation_config.json, else SamplingParams' own)
MODEL_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def with_model_defaults(body: BaseModel, defaults: SamplingParams) -> None:
    """Fill each sampling knob the request left out (None) with the engine's default, as vLLM's
    servers do; fields the endpoint does not have are left alone. max_tokens is not one: each
    endpoint has its own default, and chat's depends on the room the prompt leaves."""
    for name in MODEL_DEFAULT_FIELDS:
        if name in type(body).model_fields and getattr(body, name) is None:
            setattr(body, name, getattr(defaults, name))


def sampling_params(make: Callable[[], SamplingParams]) -> SamplingParams:
    """`make()`, with the engine's check of a bad mix ("SamplingParams.min_tokens must ...") as
    a 400 naming the field."""
    try:
        return make()
    except ValueError as error:
        raise RequestError(str(error), param=param_of(error, None)) from None


def param_of(error: Exception, default: str | None) -> str | None:
    """The field the engine's ValueError names ("SamplingParams.n ..."), else `default`."""
    match = re.match(r"SamplingParams\.(\w+)", str(error))
    return match.group(1) if match else default


# -- the answers -----------------------------------------------------------------------------------


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
    number = {choice: i for i, choice in enumerate(stream.choices)}
    completion_tokens = 0
    try:
        async with stream:
            async for delta in stream:
                completion_tokens += len(delta.token_ids)
                i = number[choice_of(delta)]
                if (piece := pieces.piece(i, delta)) is not None:
                    yield sse_event(header.body([piece]))
                if delta.finish_reason is not None:
                    reason = finish_reason(delta.finish_reason)
                    yield sse_event(header.body([pieces.finish(i, reason)]))
        if include_usage:
            yield sse_event(
                header.body(
                    [], usage=usage(sum(stream.num_prompt_tokens.values()), completion_tokens)
                )
            )
    except EngineDeadError as error:
        # The 200 status has gone out already: the error becomes an event.
        yield sse_event(engine_dead(error).body)
    except Exception as error:  # this request alone failed; the engine goes on
        logger.exception("a streamed request failed")
        yield sse_event(error_body(f"the request failed: {error!r}", "server_error"))
    yield sse_event(DONE)


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
        yield sse_event(error_body(f"the request failed: {error!r}", "server_error"))
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


# -- the app ---------------------------------------------------------------------------------------


class SafeJSONResponse(JSONResponse):
    """JSON that always encodes: a lone surrogate a client sent (say in a model name) is written
    as a JSON escape instead of failing as UTF-8."""

    def render(self, content: Any) -> bytes:
        try:
            return super().render(content)
        except UnicodeEncodeError:
            return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode()


def build_app(
    engine: AsyncEngine,
    model_name: str = "target",
    limits: ServerLimits | None = None,
    api_key: str | None = None,
) -> FastAPI:
    server = OpenAIServer(engine, model_name, limits, api_key)
    app = FastAPI(
        title="minivllm",
        summary="An OpenAI- and Anthropic-compatible server over minivllm's engine",
        default_response_class=SafeJSONResponse,
    )
    app.state.limits = server.limits
    for path, handler, model in (
        ("/v1/completions", server.completions, CompletionRequest),
        ("/v1/chat/completions", server.chat_completions, ChatCompletionRequest),
        ("/v1/messages", server.messages, anthropic.MessagesRequest),
        ("/tokenize", server.tokenize, TokenizeRequest),
        ("/detokenize", server.detokenize, DetokenizeRequest),
        ("/generate", server.generate, native.GenerateRequest),
    ):
        # the body is read by the handler (within the limits); its schema still goes in the docs
        schema = {"content": {"application/json": {"schema": model.model_json_schema()}}}
        app.add_api_route(path, handler, methods=["POST"], openapi_extra={"requestBody": schema})
    app.add_api_route("/v1/models", server.models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", server.model, methods=["GET"])
    app.add_api_route("/version", server.version, methods=["GET"])
    app.add_api_route("/health", server.health, methods=["GET"])
    app.add_api_route("/metrics", server.metrics, methods=["GET"])
    app.add_api_route("/stats", server.stats, methods=["GET"])
    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestError, request_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, internal_error)
    return app


def error_response(request: Request, error: APIError) -> JSONResponse:
    """`error` in the shape of the endpoint's API, its message capped in length."""
    limits = getattr(request.app.state, "limits", ServerLimits())
    message = cap(error.message, limits.max_error_chars)
    if request.url.path.startswith("/v1/messages"):
        body = anthropic.error_body(error.status, message)
    else:
        body = error_body(message, error.type, error.param, error.code)
    return SafeJSONResponse(body, status_code=error.status)


async def api_error(request: Request, error: APIError) -> JSONResponse:
    return error_response(request, error)


async def request_error(request: Request, error: RequestError) -> JSONResponse:
    return error_response(request, APIError(error.status, str(error), param=error.param))


async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
    """Starlette's own errors (no such route, wrong method) in the API's shape."""
    code = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code)
    response = error_response(request, APIError(error.status_code, str(error.detail), code=code))
    response.headers.update(getattr(error, "headers", None) or {})
    return response


async def internal_error(request: Request, error: Exception) -> JSONResponse:
    """A bug of ours: the client still gets the API's error body (Starlette logs the traceback)."""
    return error_response(request, APIError(500, f"internal error: {error!r}", "server_error"))


# -- running it ------------------------------------------------------------------------------------


class ServerThread:
    """The server in a background thread, on a free loopback port (port 0: the OS picks one).

        with ServerThread(LLMEngine(load_model("target"))) as server:
            client = openai.OpenAI(base_url=server.base_url, api_key="unused")
            ...
            server.engine.blocks_in_use(), server.engine.trace()

    On exit uvicorn shuts down, then the AsyncEngine closes: no thread is left behind.
    """

    def __init__(
        self,
        engine: LLMEngine,
        model_name: str = "target",
        host: str = "127.0.0.1",
        port: int = 0,
        log_level: str = "warning",
        limits: ServerLimits | None = None,
        api_key: str | None = None,
    ) -> None:
        self.model_name, self.host = model_name, host
        self._socket = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._socket.bind((host, port))  # bound here, so the port is ours before uvicorn starts
        except OSError:
            self._socket.close()
            raise
        self.port = self._socket.getsockname()[1]
        self.engine = AsyncEngine(engine, ServingMetrics(model_name))
        config = uvicorn.Config(
            build_app(self.engine, model_name, limits, api_key),
            log_config=None,
            log_level=log_level,
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=5,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run,
            kwargs={"sockets": [self._socket]},
            name="minivllm-http",
            daemon=True,
        )

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        """What the openai client takes as `base_url`."""
        return f"{self.url}/v1"

    def start(self, timeout: float = 30) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:  # uvicorn sets it once it listens
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server did not start on {self.url} within {timeout} s")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join()
        self._socket.close()
        self.engine.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()


def serve(
    engine: LLMEngine,
    model_name: str = "target",
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
    limits: ServerLimits | None = None,
    api_key: str | None = None,
) -> int:
    """Serve in the foreground until Ctrl-C (the `minivllm serve` command). Returns 0, or 1 when
    the engine died: the server stops at once so that a supervisor restarts it (as vLLM V1)."""
    # Everything alive now (model, libraries) lives as long as the process: take it out of the
    # garbage collector's view, or each full collection walks it all while holding the GIL the
    # engine needs.
    gc.collect()
    gc.freeze()
    async_engine = AsyncEngine(engine, ServingMetrics(model_name))
    app = build_app(async_engine, model_name, limits, api_key)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level))

    def stop_serving(error: EngineDeadError) -> None:
        logger.critical("the engine died (%s): the server stops", error)
        server.should_exit = True  # uvicorn checks it a few times a second

    async_engine.on_death.append(stop_serving)
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn shuts down, then raises Ctrl-C again: the normal end
        pass
    finally:
        died = async_engine.error is not None  # before close(), only a failure sets it
        async_engine.close()
    return 1 if died else 0
