"""The endpoints (chapter 09), over one AsyncEngine serving one model.

A handler reads the body within the server's limits (limits.py), checks it (openai_protocol.py,
anthropic_protocol.py, native_protocol.py), puts it in the engine's inbox and awaits the verdict,
then either collects the whole answer or streams it (responses.py). `model` may be left out of a
request: it is then the served model, as in vLLM."""

from __future__ import annotations

import dataclasses
import hmac
import json
import re
import time
from collections.abc import Callable
from importlib import metadata
from typing import TypeVar

from fastapi import Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, ValidationError

from minivllm.engine.conversation import ChatTemplateError, has_chat_template, render_conversation
from minivllm.sched.sequence import SamplingParams
from minivllm.serving import anthropic_protocol as anthropic
from minivllm.serving import native_protocol as native
from minivllm.serving.async_engine import (
    AsyncEngine,
    EngineDeadError,
    RequestFailedError,
    RequestStream,
    stats_summary,
)
from minivllm.serving.errors import APIError, engine_dead
from minivllm.serving.limits import (
    RequestError,
    ServerLimits,
    check_count,
    check_output_budget,
    check_prompt_chars,
    check_sequences,
    check_stop_strings,
    max_seqs_per_request,
    off_the_loop_if_big,
    parse_json,
    read_body,
)
from minivllm.serving.openai_protocol import (
    END_OF_TURN,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    ResponseHeader,
    TokenId,
    chat_delta,
    model_card,
    render_chat,
)
from minivllm.serving.responses import (
    Answer,
    ChatPieces,
    CompletionPieces,
    SafeJSONResponse,
    anthropic_stream,
    collect,
    event_stream,
    native_stream,
    sse_stream,
    total_usage,
    unless_disconnected,
    whole_response,
)

M = TypeVar("M", bound=BaseModel)
# OpenAI's default for /v1/completions; a chat answer may run to the context's end
COMPLETION_MAX_TOKENS = 16
MAX_LISTED_PROBLEMS = 5  # a validation error names this many problems, then counts the rest


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
        scheduler = engine.engine.config.scheduler
        self.max_seqs = max_seqs_per_request(self.limits, scheduler.max_num_seqs)
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
        params = sampling_params(lambda: body.sampling_params(COMPLETION_MAX_TOKENS))
        if body.echo and params.logprobs is not None:  # the prompt's logprobs come with it
            params = dataclasses.replace(params, prompt_logprobs=params.logprobs)
        check_sequences(len(prompts), params.n, self.max_seqs)
        # within the context, text is tokenised in microseconds; only truncate_prompt_tokens lets
        # a long text through, and then it is tokenised off the event loop
        chars = sum(len(p) for p in prompts if isinstance(p, str))
        prompt_ids = await off_the_loop_if_big(
            chars, self._all_prompt_ids, prompts, body.truncate_prompt_tokens
        )
        echoed = [len(ids) if body.echo else 0 for ids in prompt_ids]
        check_output_budget(echoed, params, self.limits)
        header = ResponseHeader.new("text_completion", self.model_name)
        stream = await self._add(prompt_ids, params)
        echo = [self.tokenizer.decode(ids) if body.echo else None for ids in prompt_ids]
        pieces = CompletionPieces(stream, params.logprobs, echo, prompt_ids)
        if body.stream:
            return event_stream(sse_stream(stream, header, pieces, body.include_usage))
        answers = await self._collect(request, stream)
        return whole_response(header, pieces, answers, total_usage(stream, answers))

    async def chat_completions(self, request: Request):
        """POST /v1/chat/completions: the chat laid out by the model's chat template (or, for a
        model without one, as a play), answered by the assistant (the play's next speaker)."""
        body = await self._request(request, ChatCompletionRequest)
        check_count("messages", len(body.messages), self.limits.max_messages, "messages")
        check_stop_strings("stop", body.stops(), self.limits)
        check_stop_strings("bad_words", tuple(body.bad_words or ()), self.limits)
        prompt_ids = await off_the_loop_if_big(
            sum(len(m.text) for m in body.messages),
            self._chat_prompt_ids,
            body.messages,
            body.truncate_prompt_tokens,
        )
        room = max(1, self.context - len(prompt_ids))  # the default: up to the context
        turn_end = [self.end_of_turn] if self.end_of_turn else []
        params = sampling_params(lambda: body.sampling_params(room, extra_stop=turn_end))
        check_sequences(1, params.n, self.max_seqs)
        check_output_budget([0], params, self.limits)
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
        return whole_response(header, pieces, answers, total_usage(stream, answers))

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
        """200 while the engine serves; 503 with the reason when its thread is dead, or alive but
        stuck: work waiting and no progress for `AsyncEngine.stall_timeout` seconds (a supervisor
        restarts either). Never waits for the engine thread: a stuck engine gets its answer too."""
        if not self.engine.is_alive:
            raise engine_dead(self.engine.error)
        if (stall := self.engine.stalled()) is not None:
            raise APIError(503, stall, "server_error", code="engine_stalled")
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
