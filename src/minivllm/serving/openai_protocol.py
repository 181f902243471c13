"""The OpenAI API as plain data: what a client sends, what it gets back (chapter 09).

A server is only "OpenAI-compatible" if the official client can talk to it unchanged, so this module
copies the wire format exactly and nothing else: the request bodies of `/v1/completions` and
`/v1/chat/completions` as pydantic models (checked field by field, so a bad request is refused with
a message naming the field), and the bodies that go back -- whole responses, streamed chunks,
errors -- as plain dicts shaped like OpenAI's. It knows no engine and imports no torch: the server
(endpoints.py) joins it to the engine.

Two translations live here. `CompletionRequest.sampling_params` turns OpenAI's knobs into the
engine's `SamplingParams`. `render_chat` turns a chat -- a list of messages with roles -- into the
only kind of text the shipped model has ever read: a play. Each message is a turn, `SPEAKER:` on
its own line, the speech, a blank line; the prompt ends with the header of the speaker who answers,
and the answer ends at the blank line that closes its speech. (A checkpoint whose tokenizer has a
chat template reads the chat in its own layout instead: engine/conversation.py.)

Every field a client sends is honoured, or refused with a 400 that names it -- never silently
ignored. Known fields are checked with their bounds (a `top_k` of 2**63 never reaches a tensor);
vLLM's sampling extras (`min_p`, penalties, `logit_bias`, `min_tokens`, `stop_token_ids`,
`bad_words`, `allowed_token_ids`, ...) go to the engine; features this server lacks
(`response_format`, tools, `best_of`, `suffix`, guided decoding, ...) are refused unless they are
sent with their "off" value; fields that cannot change the text (`user`, `metadata`) are accepted;
and an unknown field is refused too, since it is most often a typo (`temprature`) whose silent
loss would change the answer without a word.

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
from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from minivllm.model.tokenizer import SPECIAL_TOKENS
from minivllm.sched.sequence import (
    CACHE_FULL,
    LENGTH,
    MAX_LOGPROBS,
    MAX_N,
    STOP,
    SamplingParams,
)
from minivllm.serving.limits import RequestError

# -- requests --------------------------------------------------------------------------------------

MAX_INT = 2**31 - 1  # bound for counts a client sends: no 2**63 reaches a tensor

# Every field is honoured, accepted as having no effect on the text, or refused -- never silently
# ignored. Fields that change nothing here (who the end user is, tags for the caller's own records):
NO_EFFECT = {"user", "metadata", "request_id", "parallel_tool_calls"}
# Fields an OpenAI or vLLM client may send that this server cannot honour. Their "off" values are
# accepted (a client library often sends them explicitly); anything else is refused with a 400.
UNSUPPORTED = {
    "best_of": (1,),
    "suffix": ("",),
    "response_format": ({"type": "text"},),
    "tools": ([],),
    "tool_choice": ("none",),
    "functions": ([],),
    "function_call": ("none",),
    "use_beam_search": (False,),
    "length_penalty": (1,),
    "structured_outputs": (),
    "guided_json": (),
    "guided_regex": (),
    "guided_choice": (),
    "guided_grammar": (),
    "guided_decoding_backend": (),
    "logits_processors": (),
    "prompt_embeds": (),
    "priority": (0,),
    "skip_special_tokens": (True,),
    "add_special_tokens": (True,),
    "prompt_logprobs": (),  # echo with logprobs gives the prompt's logprobs
    "spaces_between_special_tokens": (True,),
    "return_tokens_as_token_ids": (False,),
    "store": (False,),
    "service_tier": ("auto", "default"),
    "modalities": (["text"],),
    "audio": (),
    "prediction": (),
    "reasoning_effort": (),
    "web_search_options": (),
    "chat_template": (),
    "chat_template_kwargs": (),
    "documents": (),
    "continue_final_message": (False,),
    "add_generation_prompt": (True,),
}


def check_extra_fields(
    extra: dict[str, object] | None,
    refused_here: dict[str, tuple] | None = None,
    unsupported: dict[str, tuple] = UNSUPPORTED,
    no_effect: set[str] = NO_EFFECT,
) -> None:
    """Refuse each field of `extra` (what the model did not declare) that would change the answer:
    an unsupported feature asked for (`unsupported`, and the endpoint's own `refused_here`), or a
    field this server does not know at all. Another protocol (Anthropic's) passes its own tables."""
    refused = {**unsupported, **(refused_here or {})}
    for name, value in (extra or {}).items():
        if name in no_effect or value is None:
            continue
        if name in refused:
            if value in refused[name]:
                continue
            raise RequestError(
                f"{name} is not supported by this server (got {short(value)}): leave it out",
                param=name,
            )
        raise RequestError(
            f"unknown field {short(name)}: this server refuses fields it does not know rather "
            "than ignore them; leave it out",
            param=name,
        )


def short(value: object, limit: int = 60) -> str:
    """A value for an error message: its repr, cut to `limit` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    # one more chunk before [DONE]: no choices, the whole request's usage
    include_usage: bool = False
    continuous_usage_stats: Literal[False] | None = None  # vLLM's usage in every chunk: not here


TokenId = Annotated[int, Field(ge=0, le=MAX_INT)]
Penalty = Annotated[float, Field(ge=-2, le=2, allow_inf_nan=False)]


class SamplingFields(BaseModel):
    """What the endpoints share (both of OpenAI's, and the native /generate of native_protocol.py):
    OpenAI's fields and vLLM's sampling extras, with their bounds. A known field of the wrong type
    is refused (strict mode refuses "5" for an int and 1 for a bool); an unknown one is refused by
    `check_extra_fields`, which the server calls."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None  # absent (or null): the served model, as vLLM; a wrong one is a 404
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_INT)
    # OpenAI's range; 0 is greedy
    temperature: float | None = Field(default=None, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0, le=1, allow_inf_nan=False)
    n: int | None = Field(default=None, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100, allow_inf_nan=False)]] | None = (
        None
    )
    # vLLM's extras. top_k 0 (or vLLM's -1) is off; ignore_eos runs past the end of a scene.
    top_k: int | None = Field(default=None, ge=-1, le=MAX_INT)
    ignore_eos: bool | None = False
    min_p: float | None = Field(default=None, ge=0, le=1, allow_inf_nan=False)
    repetition_penalty: float | None = Field(default=None, gt=0, le=100, allow_inf_nan=False)
    min_tokens: int | None = Field(default=None, ge=0, le=MAX_INT)
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool | None = False
    bad_words: list[str] | None = None
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1)] | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=1, le=MAX_INT)
    # this endpoint's own refusals, beside UNSUPPORTED
    refused_here: ClassVar[dict[str, tuple]] = {}

    @field_validator("stop")
    @classmethod
    def _non_empty_stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if stop is not None and not all([stop] if isinstance(stop, str) else stop):
            raise ValueError(
                "stop strings must not be empty: an empty string would match everywhere"
            )
        return stop

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key in bias or {}:
            if not (key.isascii() and key.isdigit() and len(key) <= 10):
                raise ValueError(f'logit_bias keys must be token ids ("65"), got {short(key)}')
        return bias

    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def check_extra_fields(self) -> None:
        check_extra_fields(self.model_extra, self.refused_here)

    def num_logprobs(self) -> int | None:
        """Top logprobs per generated token, or None for none (each endpoint spells it its way)."""
        return None

    def sampling_params(self, max_tokens: int, extra_stop: SequenceOf[str] = ()) -> SamplingParams:
        """The engine's parameters; `max_tokens` is the endpoint's default when the request gives
        none. Raises the engine's ValueError ("SamplingParams.<field> ...") for a bad mix."""
        return SamplingParams(
            max_tokens=self.max_tokens or max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=max(0, self.top_k or 0),
            seed=self.seed,
            ignore_eos=bool(self.ignore_eos),
            stop=tuple(dict.fromkeys([*self.stops(), *extra_stop])),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            n=self.n or 1,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=self.repetition_penalty or 1.0,
            min_p=self.min_p or 0.0,
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},
            min_tokens=self.min_tokens or 0,
            include_stop_str_in_output=bool(self.include_stop_str_in_output),
            logprobs=self.num_logprobs(),
            bad_words=tuple(self.bad_words or ()),
            allowed_token_ids=self.allowed_token_ids,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


Prompt = str | list[int]


class CompletionRequest(SamplingFields):
    """POST /v1/completions: continue one prompt, or each of a list of prompts (n choices each). A
    prompt is text, or token ids (a list of ints; several: a list of such lists)."""

    prompt: (
        str
        | Annotated[list[str], Field(min_length=1)]
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
    )
    echo: bool | None = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    def prompts(self) -> list[Prompt]:
        prompt = self.prompt
        return [prompt] if isinstance(prompt, str) or isinstance(prompt[0], int) else list(prompt)

    def num_logprobs(self) -> int | None:
        return self.logprobs


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message. `name`, which OpenAI allows on any message, is the speaker's name in the
    play."""

    model_config = ConfigDict(extra="forbid", strict=True)

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


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions: the messages laid out by the model's chat template, or as a
    play for a model without one; the model answers as the assistant (the next speaker)."""

    refused_here: ClassVar[dict[str, tuple]] = {"echo": (False,)}  # vLLM's: repeat the last turn

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    # OpenAI's newer name for max_tokens
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_INT)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _one_limit(self):
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


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
    # EXERCISE ch09.2: chat -> play: "SPEAKER:\n<speech>\n\n" per message, then the reply's header
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


def completion_choice(
    index: int, text: str, reason: str | None, logprobs: dict | None = None
) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}


def chat_choice(index: int, text: str, reason: str | None, logprobs: dict | None = None) -> dict:
    return {
        "index": index,
        "message": {"role": "assistant", "content": text},
        "logprobs": logprobs,
        "finish_reason": reason,
    }


def chat_delta(index: int, delta: dict, reason: str | None, logprobs: dict | None = None) -> dict:
    """A streamed chat choice: `delta` is {"role": ...} first, then {"content": ...}, then {} with
    the reason."""
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}


# -- logprobs --------------------------------------------------------------------------------------

TokenLogprobs = dict[int, float]  # one position: token id -> logprob (the sampled one and top k)
SPECIAL_NAMES = {token_id: name for name, token_id in SPECIAL_TOKENS.items()}


def token_string(token_id: int) -> str:
    """A token as logprobs name it: its character for an ASCII byte; for a byte of a longer UTF-8
    character OpenAI's `bytes:\\xe2` (the `bytes` field has the value); a special token's name."""
    if token_id in SPECIAL_NAMES:
        return SPECIAL_NAMES[token_id]
    return chr(token_id) if token_id < 128 else f"bytes:\\x{token_id:02x}"


def token_bytes(token_id: int) -> list[int]:
    return [token_id] if token_id < 256 else list(SPECIAL_NAMES[token_id].encode())


def top_entries(position: TokenLogprobs, count: int) -> list[tuple[int, float]]:
    """The `count` likeliest of one position's entries, likeliest first (ties: lower id first)."""
    return sorted(position.items(), key=lambda item: (-item[1], item[0]))[:count]


def completion_logprobs(
    token_ids: SequenceOf[int],
    logprobs: SequenceOf[TokenLogprobs | None],
    count: int,
    text_offset: int = 0,
) -> dict:
    """The legacy completions shape: per token its string, its logprob, the `count` likeliest
    {string: logprob}, and the character offset where it starts (from `text_offset`). A position
    with no logprobs (a prompt's first token) has None."""
    result = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, position in zip(token_ids, logprobs):
        # a character starts at every byte that is not a UTF-8 continuation byte (0x80-0xBF); a
        # continuation byte is inside the character before
        continuation = 0x80 <= token_id < 0xC0
        result["tokens"].append(token_string(token_id))
        result["text_offset"].append(max(0, text_offset - continuation))
        if position is None:
            result["token_logprobs"].append(None)
            result["top_logprobs"].append(None)
        else:
            result["token_logprobs"].append(position[token_id])
            top = top_entries(position, count)
            result["top_logprobs"].append({token_string(t): lp for t, lp in top})
        text_offset += token_id < 256 and not continuation
    return result


def chat_logprobs(
    token_ids: SequenceOf[int], logprobs: SequenceOf[TokenLogprobs], count: int
) -> dict:
    """Chat's shape: `content`, per token its string, logprob, bytes and the `count` likeliest."""

    def entry(token_id: int, logprob: float) -> dict:
        return {"token": token_string(token_id), "logprob": logprob, "bytes": token_bytes(token_id)}

    content = [
        {**entry(t, position[t]), "top_logprobs": [entry(*e) for e in top_entries(position, count)]}
        for t, position in zip(token_ids, logprobs)
    ]
    return {"content": content, "refusal": None}


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
    # EXERCISE ch09.1: one SSE -- "data: " + the payload as compact JSON (a str as is) + "\n\n"
    ### BEGIN SOLUTION
    data = (
        payload
        if isinstance(payload, str)
        else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    )
    return f"data: {data}\n\n"
    ### END SOLUTION
