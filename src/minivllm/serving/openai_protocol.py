"""The OpenAI API as plain data: what a client sends, what it gets back (chapter 08).

A server is only "OpenAI-compatible" if the official client can talk to it unchanged, so this module
copies the wire format exactly and nothing else: the request bodies of `/v1/completions` and
`/v1/chat/completions` as pydantic models (checked field by field, so a bad request is refused with
a message naming the field), and the bodies that go back -- whole responses, streamed chunks,
errors -- as plain dicts shaped like OpenAI's. It knows no engine and imports no torch: the server
(server.py) joins it to the engine.

Two translations live here. `CompletionRequest.sampling_params` turns OpenAI's knobs into the
engine's `SamplingParams`. `render_chat` turns a chat -- a list of messages with roles -- into the
only kind of text the model has ever read: a play. Each message is a turn, `SPEAKER:` on its own
line, the speech, a blank line; the prompt ends with the header of the speaker who answers, and the
answer ends at the blank line that closes its speech.

Streaming uses Server-Sent Events: each chunk is one `data: <json>` line and a blank line, and the
stream ends with `data: [DONE]`.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from minivllm.sched.sequence import CACHE_FULL, LENGTH, STOP, SamplingParams

# -- requests --------------------------------------------------------------------------------------

# Fields an OpenAI client may send that this server cannot honour. Their "off" values are accepted
# (a client library often sends them explicitly); anything else is refused rather than silently
# ignored.
UNSUPPORTED = {
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "functions": (None, []),
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    # one more chunk before [DONE]: no choices, the whole request's usage
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """What both endpoints share. Unknown fields are allowed (clients send `user` and friends); a
    known field of the wrong type is not: strict mode refuses "5" for an int and 1 for a bool."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)  # OpenAI's range; 0 is greedy
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # Extras, as vLLM names them: top_k 0 (or vLLM's -1) is off; ignore_eos runs past the end of a
    # scene.
    top_k: int | None = Field(default=None, ge=-1)
    ignore_eos: bool | None = False

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int | None) -> int | None:
        if n not in (None, 1):
            raise ValueError(
                f"n must be 1 (got {n}): this server returns one choice per prompt; "
                f"send the request again with another seed for another sample"
            )
        return n

    @field_validator("stop")
    @classmethod
    def _non_empty_stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if stop is not None and not all([stop] if isinstance(stop, str) else stop):
            raise ValueError(
                "stop strings must not be empty: an empty string would match everywhere"
            )
        return stop

    @model_validator(mode="after")
    def _nothing_unsupported(self):
        for name, value in (self.model_extra or {}).items():
            if name in UNSUPPORTED and value not in UNSUPPORTED[name]:
                raise ValueError(
                    f"{name} is not supported by this server (got {value!r}): leave it out"
                )
        return self

    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def sampling_params(self, max_tokens: int, extra_stop: SequenceOf[str] = ()) -> SamplingParams:
        """The engine's parameters; `max_tokens` is the endpoint's default when the request gives
        none."""
        return SamplingParams(
            max_tokens=self.max_tokens or max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=max(0, self.top_k or 0),
            seed=self.seed,
            ignore_eos=bool(self.ignore_eos),
            stop=tuple(dict.fromkeys([*self.stops(), *extra_stop])),
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    """POST /v1/completions: continue one prompt, or each of a list of prompts (one choice each)."""

    prompt: str | Annotated[list[str], Field(min_length=1)]

    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message. `name`, which OpenAI allows on any message, is the speaker's name in the
    play."""

    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = Field(default=None, min_length=1, max_length=64, pattern=r"^[^:\n]+$")

    @property
    def text(self) -> str:
        return (
            self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        )

    @model_validator(mode="after")
    def _has_a_speech(self):
        if not self.text.strip():
            raise ValueError(
                f"a {self.role} message has empty content: every turn of a play needs a speech"
            )
        return self


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions: the messages become a play; the model answers as the next
    speaker."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    # OpenAI's newer name for max_tokens
    max_completion_tokens: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _one_limit(self):
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self


# -- chat as a play --------------------------------------------------------------------------------

# Who speaks when a message has no `name`. Both are among the training plays' speakers, so the model
# knows how they talk. The system message (or "developer", its newer name) is the Chorus: in the
# plays the Chorus is the voice that sets the scene before the characters speak.
SPEAKERS = {"system": "Chorus", "developer": "Chorus", "user": "ROMEO", "assistant": "JULIET"}
END_OF_TURN = "\n\n"  # a blank line ends a speech: the chat endpoint's default stop


def reply_speaker(messages: SequenceOf[ChatMessage]) -> str:
    """Who answers: the name of the latest assistant message that has one, else the default."""
    named = [m.name for m in messages if m.role == "assistant" and m.name]
    return named[-1] if named else SPEAKERS["assistant"]


def render_chat(messages: SequenceOf[ChatMessage]) -> str:
    """The messages as a scene of a play, ending with the header of the speaker who answers.

    Each message is `SPEAKER:` (its `name`, or the default for its role), a newline, its text, and a
    blank line. A blank line inside a message would end the speech early, so runs of newlines become
    one; leading and trailing whitespace is dropped.
    """
    # EXERCISE ch08.2: chat -> play: "SPEAKER:\n<speech>\n\n" per message, then the reply's header
    ### BEGIN SOLUTION
    turns = []
    for message in messages:
        speaker = message.name or SPEAKERS[message.role]
        speech = re.sub(r"\n\s*\n", "\n", message.text.strip())
        turns.append(f"{speaker}:\n{speech}{END_OF_TURN}")
    return "".join(turns) + f"{reply_speaker(messages)}:\n"
    ### END SOLUTION


# -- responses -------------------------------------------------------------------------------------


def finish_reason(engine_reason: str | None) -> str | None:
    """OpenAI's name for why a choice ended. A sequence that outgrew the KV cache was cut short:
    to a client that is "length", like running into max_tokens."""
    return {STOP: "stop", LENGTH: "length", CACHE_FULL: "length"}.get(engine_reason, engine_reason)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


@dataclass(frozen=True)
class ResponseHeader:
    """The fields every body and chunk of one response repeats: the same id and `created`
    throughout."""

    id: str
    object: str
    created: int
    model: str

    @classmethod
    def new(cls, object_name: str, model: str) -> ResponseHeader:
        prefix = "chatcmpl" if object_name.startswith("chat.") else "cmpl"
        return cls(f"{prefix}-{uuid.uuid4().hex}", object_name, int(time.time()), model)

    def body(self, choices: list[dict], **rest) -> dict:
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **rest,
        }


def completion_choice(index: int, text: str, reason: str | None) -> dict:
    return {"index": index, "text": text, "logprobs": None, "finish_reason": reason}


def chat_choice(index: int, text: str, reason: str | None) -> dict:
    return {
        "index": index,
        "message": {"role": "assistant", "content": text},
        "logprobs": None,
        "finish_reason": reason,
    }


def chat_delta(index: int, delta: dict, reason: str | None) -> dict:
    """A streamed chat choice: `delta` is {"role": ...} first, then {"content": ...}, then {} with
    the reason."""
    return {"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}


def model_card(model: str, created: int, max_model_len: int) -> dict:
    return {
        "id": model,
        "object": "model",
        "created": created,
        "owned_by": "minivllm",
        "max_model_len": max_model_len,
    }


def error_body(
    message: str,
    type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> dict:
    """OpenAI's error body; the official client raises it as `openai.BadRequestError` and
    friends."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# -- Server-Sent Events ----------------------------------------------------------------------------

DONE = "[DONE]"  # the sentinel that ends every OpenAI stream


def sse_event(payload: dict | str) -> str:
    """One Server-Sent Event: `data: ` + the payload as compact JSON (a str, like DONE, as is) + a
    blank line.

    JSON escapes newlines, so one event is always one `data:` line; non-ASCII text stays as it is.
    """
    # EXERCISE ch08.1: one SSE -- "data: " + the payload as compact JSON (a str as is) + "\n\n"
    ### BEGIN SOLUTION
    data = (
        payload
        if isinstance(payload, str)
        else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    )
    return f"data: {data}\n\n"
    ### END SOLUTION
