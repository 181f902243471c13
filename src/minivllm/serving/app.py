"""The HTTP app (chapter 09): the endpoints on their routes, and every error in the API's own body.

No request can hurt another. Every field is checked with its bounds before anything reaches the
engine, and every error leaves in the API's own error body (OpenAI's, or Anthropic's on
/v1/messages), so the official clients raise their usual exceptions: malformed JSON and wrong fields
are 400 (where FastAPI would say 422), a body over the limit 413, a wrong key 401, an unknown model
404, a dead engine 503. `--api-key` guards everything but `/health`, `/metrics`, `/stats` and
`/version`."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException

from minivllm.serving import anthropic_protocol as anthropic
from minivllm.serving import native_protocol as native
from minivllm.serving.async_engine import AsyncEngine
from minivllm.serving.endpoints import DetokenizeRequest, OpenAIServer, TokenizeRequest
from minivllm.serving.errors import APIError
from minivllm.serving.limits import RequestError, ServerLimits, cap
from minivllm.serving.openai_protocol import ChatCompletionRequest, CompletionRequest, error_body
from minivllm.serving.responses import SafeJSONResponse


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
    bodies = {
        "/v1/completions": (server.completions, CompletionRequest),
        "/v1/chat/completions": (server.chat_completions, ChatCompletionRequest),
        "/v1/messages": (server.messages, anthropic.MessagesRequest),
        "/tokenize": (server.tokenize, TokenizeRequest),
        "/detokenize": (server.detokenize, DetokenizeRequest),
        "/generate": (server.generate, native.GenerateRequest),
    }
    refs = add_body_schemas(app, [model for _, model in bodies.values()])
    for path, (handler, model) in bodies.items():
        # the body is read by the handler (within the limits); its schema still goes in the docs
        body = {"required": True, "content": {"application/json": {"schema": refs[model]}}}
        app.add_api_route(path, handler, methods=["POST"], openapi_extra={"requestBody": body})
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


def add_body_schemas(app: FastAPI, models: list[type[BaseModel]]) -> dict[type[BaseModel], dict]:
    """Put the request bodies' JSON schemas in `/openapi.json` as OpenAPI wants them: every model
    (and every model inside one) under `components/schemas`, referred to as
    `#/components/schemas/Name`, a path that resolves from the document's root. (A model's own
    `model_json_schema()` keeps its parts under `$defs` with `#/$defs/...` refs, which resolve only
    inside that schema: pasted into the document, they point nowhere.) Returns each model's `$ref`.
    """
    refs, definitions = models_json_schema(
        [(model, "validation") for model in models], ref_template="#/components/schemas/{model}"
    )
    schemas = definitions.get("$defs", {})

    def openapi() -> dict:
        if app.openapi_schema is None:
            document = FastAPI.openapi(app)  # FastAPI's own document (cached in openapi_schema)
            components = document.setdefault("components", {}).setdefault("schemas", {})
            clash = components.keys() & schemas.keys()
            if clash:
                raise RuntimeError(f"two OpenAPI schemas share the names {sorted(clash)}")
            components.update(schemas)
        return app.openapi_schema

    app.openapi = openapi
    return {model: refs[(model, "validation")] for model in models}


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
