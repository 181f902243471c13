"""The Anthropic Messages API as plain data: a second view of the same engine (chapter 09).

`POST /v1/messages` takes a `system` prompt, `messages` of user and assistant turns, `max_tokens`
(required), `stop_sequences`, `temperature`, `top_p`, `top_k` and `stream`. The chat is laid out
as OpenAI's chat endpoint lays it out: with the model's chat template, the system prompt its first
message (engine/conversation.py); or, for a model without one, as the same play
(openai_protocol.render_chat): the system prompt is the Chorus, the user ROMEO, the assistant
JULIET. A whole answer is one `message` with one text block; a streamed one is
Anthropic's event sequence, each event an SSE `event:` line naming its type and a `data:` line:

    message_start, content_block_start, ping, content_block_delta (one per piece of text),
    content_block_stop, message_delta (stop_reason and the output tokens), message_stop

Errors have Anthropic's shape, `{"type": "error", "error": {"type": ..., "message": ...}}`, so
the official `anthropic` client raises its usual exceptions. Like openai_protocol, this module knows
no engine and imports no torch.
"""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from minivllm.sched.sequence import LENGTH, SamplingParams
from minivllm.serving.limits import RequestError
from minivllm.serving.openai_protocol import (
    END_OF_TURN,
    MAX_INT,
    ChatMessage,
    TextPart,
    check_extra_fields,
)

# Fields that change nothing here, and fields refused unless "off" (as openai_protocol does).
NO_EFFECT = {"metadata", "cache_control"}  # cache_control: a prompt-caching hint
UNSUPPORTED = {
    "tools": ([],),
    "tool_choice": ({"type": "none"},),
    "thinking": ({"type": "disabled"},),
    "service_tier": ("auto", "standard_only"),
    "container": (),
    "mcp_servers": ([],),
}


class TextBlock(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str
    cache_control: dict | None = None  # a prompt-caching hint: no effect here


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["user", "assistant"]
    content: str | Annotated[list[TextBlock], Field(min_length=1)]

    @property
    def text(self) -> str:
        return (
            self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)
        )


class MessagesRequest(BaseModel):
    """POST /v1/messages, with Anthropic's bounds (temperature 0..1)."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None  # absent: the served model (Anthropic requires it; we need not)
    max_tokens: int = Field(ge=1, le=MAX_INT)
    messages: Annotated[list[Message], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    stop_sequences: list[Annotated[str, Field(min_length=1)]] | None = None
    temperature: float | None = Field(default=None, ge=0, le=1, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0, le=1, allow_inf_nan=False)
    top_k: int | None = Field(default=None, ge=0, le=MAX_INT)
    stream: bool | None = False

    def check_extra_fields(self) -> None:
        check_extra_fields(self.model_extra, unsupported=UNSUPPORTED, no_effect=NO_EFFECT)

    def chat(self) -> list[ChatMessage]:
        """The conversation as OpenAI's chat messages, the system prompt first: for the play
        (render_chat) or the model's chat template. Content blocks stay separate parts."""
        chat = []
        system = self.system
        if system is not None and (system if isinstance(system, str) else text_of(system)).strip():
            chat.append(ChatMessage(role="system", content=content_of(system)))
        for number, message in enumerate(self.messages):
            if not message.text.strip():
                raise RequestError(
                    f"messages.{number}: a {message.role} message has empty content",
                    param="messages",
                )
            chat.append(ChatMessage(role=message.role, content=content_of(message.content)))
        return chat

    def stops(self) -> tuple[str, ...]:
        return tuple(self.stop_sequences or ())

    def turn_end_stop(self, end_of_turn: str | None = END_OF_TURN) -> str | None:
        """The stop string that reports as "end_turn" (see `stop_reason`): the turn's end, unless
        the user's stop_sequences name it too -- then a match is the user's "stop_sequence"."""
        return None if end_of_turn in self.stops() else end_of_turn

    def sampling_params(self, end_of_turn: str | None = END_OF_TURN) -> SamplingParams:
        """Anthropic's defaults: temperature 1, no top-p or top-k. In a play a turn ends at
        END_OF_TURN; a chat template ends it with a token (end_of_turn None: the EOS ends it)."""
        ends = [end_of_turn] if end_of_turn is not None else []
        return SamplingParams(
            max_tokens=self.max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            stop=tuple(dict.fromkeys([*self.stops(), *ends])),
        )


def text_of(blocks: list[TextBlock]) -> str:
    return "".join(block.text for block in blocks)


def content_of(content: str | list[TextBlock]) -> str | list[TextPart]:
    """Anthropic's content as OpenAI's: text, or its text blocks as text parts."""
    if isinstance(content, str):
        return content
    return [TextPart(type="text", text=block.text) for block in content]


# -- responses -------------------------------------------------------------------------------------


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def stop_reason(
    engine_reason: str | None, stop: int | str | None, end_of_turn: str | None = END_OF_TURN
) -> tuple[str | None, str | None]:
    """Anthropic's (stop_reason, stop_sequence): a user's stop sequence is named; the end of the
    turn (the play's blank line `end_of_turn`, or the EOS a chat template ends a turn with) or
    the end of the scene is "end_turn"; a limit is "max_tokens"."""
    if engine_reason is None:
        return None, None
    if engine_reason == LENGTH or engine_reason == "cache_full":
        return "max_tokens", None
    if isinstance(stop, str) and stop != end_of_turn:
        return "stop_sequence", stop
    return "end_turn", None


def usage(input_tokens: int, output_tokens: int) -> dict:
    return {"input_tokens": input_tokens, "output_tokens": output_tokens}


def message_body(
    message_id: str,
    model: str,
    text: str | None,
    reason: tuple[str | None, str | None],
    input_tokens: int,
    output_tokens: int,
) -> dict:
    """A whole answer; `text` None for the empty shell that `message_start` carries."""
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [] if text is None else [{"type": "text", "text": text}],
        "stop_reason": reason[0],
        "stop_sequence": reason[1],
        "usage": usage(input_tokens, output_tokens),
    }


def event(payload: dict) -> str:
    """One Server-Sent Event of Anthropic's stream: `event: <type>`, then its data."""
    data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"event: {payload['type']}\ndata: {data}\n\n"


ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    529: "overloaded_error",
}


def error_body(status: int, message: str) -> dict:
    """Anthropic's error body; a status with no type of its own is an "api_error"."""
    return {
        "type": "error",
        "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message},
    }
