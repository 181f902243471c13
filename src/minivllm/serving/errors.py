"""Errors a handler raises, sent by the app in the shape of the endpoint's API (chapter 09)."""

from __future__ import annotations

from minivllm.serving.openai_protocol import error_body


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
