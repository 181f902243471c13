"""An OpenAI-compatible HTTP server over the AsyncEngine (chapter 08).

    minivllm serve --model target --port 8000
    curl localhost:8000/v1/completions -H 'content-type: application/json' \\
         -d '{"model": "target", "prompt": "ROMEO:\\n", "max_tokens": 40}'

`build_app` makes a FastAPI app with OpenAI's endpoints -- `/v1/completions`,
`/v1/chat/completions`, `/v1/models` -- and `/health` and `/metrics`. A handler checks the request
(openai_protocol.py), puts it in the engine's inbox and awaits the verdict, then either collects the
whole answer or streams it: a `StreamingResponse` of Server-Sent Events, one chunk per delta of
text, as the steps produce them.

Every error leaves in OpenAI's error body, so the official client raises its usual exceptions:
malformed JSON and wrong fields are 400 (OpenAI's status for an invalid request, where FastAPI would
say 422), an unknown model 404, a dead engine 503. A client that goes away is not served further:
Starlette cancels a streaming response's generator when the connection drops (a non-streaming
handler watches for the disconnect itself), leaving `async with stream` aborts the requests, and the
engine thread frees their blocks before its next step.

`ServerThread` runs all of it in a background thread on a free loopback port, for notebooks and
tests; `serve` runs it in the foreground for the command line.
"""

from __future__ import annotations

import asyncio
import gc
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from minivllm.engine.llm_engine import LLMEngine
from minivllm.sched.sequence import SamplingParams
from minivllm.serving.async_engine import AsyncEngine, EngineDeadError, RequestStream
from minivllm.serving.openai_protocol import (
    DONE,
    END_OF_TURN,
    ChatCompletionRequest,
    CompletionRequest,
    ResponseHeader,
    chat_choice,
    chat_delta,
    completion_choice,
    error_body,
    finish_reason,
    model_card,
    render_chat,
    sse_event,
    usage,
)

T = TypeVar("T")
# OpenAI's default for /v1/completions; a chat answer may run to the context's end
COMPLETION_MAX_TOKENS = 16


class APIError(Exception):
    """An error response in OpenAI's shape: raise it in a handler, the app's handler sends it."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.body = status, error_body(message, type, param, code)


def engine_dead(error: BaseException | None) -> APIError:
    return APIError(
        503, str(error or "the engine thread has stopped"), "server_error", code="engine_dead"
    )


@dataclass
class Answer:
    """One choice of a non-streamed response, collected from its deltas."""

    text: str = ""
    num_tokens: int = 0
    finish_reason: str | None = None


class OpenAIServer:
    """The endpoints, over one AsyncEngine serving one model."""

    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.engine, self.model_name = engine, model_name
        self.context = engine.engine.model.config.max_seq_len
        self.tokenizer = engine.engine.tokenizer
        self.created = int(time.time())

    async def completions(self, body: CompletionRequest, request: Request):
        self._check_model(body.model)
        header = ResponseHeader.new("text_completion", self.model_name)
        stream = await self._add(body.prompts(), body.sampling_params(COMPLETION_MAX_TOKENS))
        if body.stream:
            return event_stream(sse_stream(stream, header, completion_choice, body.include_usage))
        answers = await self._collect(request, stream)
        choices = [
            completion_choice(i, a.text, finish_reason(a.finish_reason))
            for i, a in enumerate(answers)
        ]
        return JSONResponse(header.body(choices, usage=total_usage(stream, answers)))

    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        self._check_model(body.model)
        header = ResponseHeader.new(
            "chat.completion.chunk" if body.stream else "chat.completion", self.model_name
        )
        prompt = render_chat(body.messages)
        # the default: up to the context
        room = self.context - len(self.tokenizer.encode(prompt, add_bos=True))
        stream = await self._add(
            [prompt], body.sampling_params(max(1, room), extra_stop=[END_OF_TURN]), "messages"
        )
        if body.stream:
            first = header.body([chat_delta(0, {"role": "assistant", "content": ""}, None)])
            return event_stream(sse_stream(stream, header, chat_content, body.include_usage, first))
        answers = await self._collect(request, stream)
        choices = [chat_choice(0, answers[0].text, finish_reason(answers[0].finish_reason))]
        return JSONResponse(header.body(choices, usage=total_usage(stream, answers)))

    async def models(self):
        return {"object": "list", "data": [model_card(self.model_name, self.created, self.context)]}

    async def health(self):
        if not self.engine.is_alive:
            raise engine_dead(self.engine.error)
        return {"status": "ok"}

    async def metrics(self):
        return PlainTextResponse(
            await self.engine.render_metrics(), media_type="text/plain; version=0.0.4"
        )

    def _check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(
                404,
                f"The model `{model}` does not exist: this server serves `{self.model_name}` "
                f"(GET /v1/models lists it)",
                param="model",
                code="model_not_found",
            )

    async def _add(
        self, prompts: list[str], params: SamplingParams, param: str = "prompt"
    ) -> RequestStream:
        try:
            return await self.engine.add_request(prompts, params)
        except (
            ValueError,
            TypeError,
        ) as error:  # the engine's own check: e.g. a prompt that can never fit
            raise APIError(400, str(error), param=param) from None
        except EngineDeadError as error:
            raise engine_dead(error) from None

    async def _collect(self, request: Request, stream: RequestStream) -> list[Answer]:
        try:
            return await unless_disconnected(request, collect(stream))
        except EngineDeadError as error:
            raise engine_dead(error) from None


def chat_content(index: int, text: str, reason: str | None) -> dict:
    """A streamed chat choice: a content delta, or for the finish an empty delta with the reason."""
    return chat_delta(index, {"content": text} if text else {}, reason)


async def collect(stream: RequestStream) -> list[Answer]:
    """Every delta of the stream, joined into one answer per request (in the order of the
    prompts)."""
    answers = {request_id: Answer() for request_id in stream.request_ids}
    async with stream:
        async for delta in stream:
            answer = answers[delta.request_id]
            answer.text += delta.text
            answer.num_tokens += len(delta.token_ids)
            answer.finish_reason = delta.finish_reason
    return list(answers.values())


def total_usage(stream: RequestStream, answers: list[Answer]) -> dict:
    return usage(sum(stream.num_prompt_tokens.values()), sum(a.num_tokens for a in answers))


async def sse_stream(
    stream: RequestStream,
    header: ResponseHeader,
    choice: Callable[[int, str, str | None], dict],
    include_usage: bool,
    first: dict | None = None,
) -> AsyncIterator[str]:
    """A streamed response as Server-Sent Events: `first` (chat's role delta), a chunk per delta
    that carries text, a finish chunk per choice, the usage chunk (no choices) if the client asked,
    `[DONE]`."""
    if first is not None:
        yield sse_event(first)
    index = {request_id: i for i, request_id in enumerate(stream.request_ids)}
    completion_tokens = 0
    try:
        async with stream:
            async for delta in stream:
                completion_tokens += len(delta.token_ids)
                # a step may bring a token but no text yet: half a character, a possible stop
                if delta.text:
                    yield sse_event(
                        header.body([choice(index[delta.request_id], delta.text, None)])
                    )
                if delta.finish_reason is not None:
                    reason = finish_reason(delta.finish_reason)
                    yield sse_event(header.body([choice(index[delta.request_id], "", reason)]))
        if include_usage:
            yield sse_event(
                header.body(
                    [], usage=usage(sum(stream.num_prompt_tokens.values()), completion_tokens)
                )
            )
    except EngineDeadError as error:
        # The 200 status has gone out already: the error becomes an event.
        yield sse_event(engine_dead(error).body)
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


def build_app(engine: AsyncEngine, model_name: str = "target") -> FastAPI:
    server = OpenAIServer(engine, model_name)
    app = FastAPI(title="minivllm", summary="An OpenAI-compatible server over minivllm's engine")
    app.add_api_route("/v1/completions", server.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", server.chat_completions, methods=["POST"])
    app.add_api_route("/v1/models", server.models, methods=["GET"])
    app.add_api_route("/health", server.health, methods=["GET"])
    app.add_api_route("/metrics", server.metrics, methods=["GET"])
    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, internal_error)
    return app


async def api_error(request: Request, error: APIError) -> JSONResponse:
    return JSONResponse(error.body, status_code=error.status)


async def validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
    """FastAPI's 422 becomes OpenAI's 400, with every problem named: `field: what is wrong`."""
    problems, params = [], []
    for problem in error.errors():
        where = ".".join(str(part) for part in problem["loc"][1:])  # loc starts with "body"
        params.append(where.split(".")[0])
        if problem["type"] == "json_invalid":
            message = (
                f"the body is not valid JSON ({problem['ctx']['error']} at character {where}): "
                "send a JSON object"
            )
            return JSONResponse(error_body(message), status_code=400)
        # our validators' own messages, without pydantic's prefix
        if problem["type"] == "value_error":
            problems.append(f"{where or 'body'}: {problem['ctx']['error']}")
        else:
            problems.append(f"{where or 'body'}: {problem['msg']}")
    message = "invalid request: " + "; ".join(dict.fromkeys(problems))
    return JSONResponse(error_body(message, param=params[0] or None), status_code=400)


async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
    """Starlette's own errors (no such route, wrong method, an unreadable body) in OpenAI's
    shape."""
    code = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code)
    return JSONResponse(
        error_body(str(error.detail), param=None, code=code),
        status_code=error.status_code,
        headers=getattr(error, "headers", None),
    )


async def internal_error(request: Request, error: Exception) -> JSONResponse:
    return JSONResponse(error_body(f"internal error: {error!r}", "server_error"), status_code=500)


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
        self.engine = AsyncEngine(engine)
        config = uvicorn.Config(
            build_app(self.engine, model_name),
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
) -> None:
    """Serve in the foreground until Ctrl-C (the `minivllm serve` command)."""
    # Everything alive now (model, libraries) lives as long as the process: take it out of the
    # garbage collector's view, or each full collection walks it all while holding the GIL the
    # engine needs.
    gc.collect()
    gc.freeze()
    async_engine = AsyncEngine(engine)
    try:
        uvicorn.run(build_app(async_engine, model_name), host=host, port=port, log_level=log_level)
    finally:
        async_engine.close()
