"""Chapter 09's wire format, with no server and no model: request checking with bounds, vLLM's
fields mapped onto the engine's SamplingParams, unsupported and unknown fields refused (never
ignored), the chat rendered as a play (ch09.2), response bodies and both logprobs shapes like
OpenAI's, the SSE formatter (ch09.1), and a streamed answer from deltas to `[DONE]` over a
stand-in engine (ch09.3: chunks in order, a finish chunk per choice, usage, an abort when the
client goes)."""

from __future__ import annotations

import asyncio
import json

import pytest
from pydantic import ValidationError

from minivllm.engine.processing import TextDelta
from minivllm.sched.sequence import SamplingParams
from minivllm.serving.async_engine import RequestStream
from minivllm.serving.limits import RequestError
from minivllm.serving.openai_protocol import (
    DONE,
    END_OF_TURN,
    SPEAKERS,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    ResponseHeader,
    chat_choice,
    chat_delta,
    chat_logprobs,
    completion_choice,
    completion_logprobs,
    error_body,
    finish_reason,
    render_chat,
    reply_speaker,
    sse_event,
    token_string,
    usage,
)
from minivllm.serving.responses import ChatPieces, sse_stream

# -- sse_event (ch09.1) ----------------------------------------------------------------------------


@pytest.mark.exercise("ch09.1")
def test_an_event_is_one_data_line_and_a_blank_line() -> None:
    event = sse_event({"text": "Hi", "n": 1})
    assert event == 'data: {"text":"Hi","n":1}\n\n'
    assert sse_event(DONE) == "data: [DONE]\n\n"


@pytest.mark.exercise("ch09.1")
def test_newlines_are_escaped_and_non_ascii_kept() -> None:
    payload = {"choices": [{"text": "O Romeo,\n\nwherefore — ❤"}], "usage": None}
    event = sse_event(payload)
    assert event.startswith("data: ") and event.endswith("\n\n") and event.count("\n") == 2
    assert "❤" in event and "\\u" not in event  # one line, the characters as they are
    assert json.loads(event[len("data: ") :]) == payload


@pytest.mark.exercise("ch09.1")
def test_events_concatenate_into_a_parseable_stream() -> None:
    chunks = [{"i": i, "text": t} for i, t in enumerate(["a", "\n", "data: x"])]
    stream = "".join(sse_event(c) for c in chunks) + sse_event(DONE)
    events = [e for e in stream.split("\n\n") if e]
    assert [e.removeprefix("data: ") for e in events][-1] == "[DONE]"
    assert [json.loads(e.removeprefix("data: ")) for e in events[:-1]] == chunks


# -- render_chat (ch09.2) --------------------------------------------------------------------------


def msg(role: str, content: str, name: str | None = None) -> ChatMessage:
    return ChatMessage(role=role, content=content, name=name)


@pytest.mark.exercise("ch09.2")
def test_a_chat_is_a_scene_of_a_play() -> None:
    chat = [msg("user", "What say you?"), msg("assistant", "I say nothing."), msg("user", "Speak!")]
    assert render_chat(chat) == (
        "ROMEO:\nWhat say you?\n\nJULIET:\nI say nothing.\n\nROMEO:\nSpeak!\n\nJULIET:\n"
    )


@pytest.mark.exercise("ch09.2")
def test_names_are_speakers_and_the_last_named_assistant_answers() -> None:
    chat = [
        msg("system", "Elsinore. A platform before the castle."),
        msg("user", "Who's there?", name="BERNARDO"),
        msg("assistant", "Nay, answer me.", name="FRANCISCO"),
        msg("user", "Long live the king!", name="BERNARDO"),
    ]
    assert render_chat(chat) == (
        "Chorus:\nElsinore. A platform before the castle.\n\n"
        "BERNARDO:\nWho's there?\n\nFRANCISCO:\nNay, answer me.\n\n"
        "BERNARDO:\nLong live the king!\n\nFRANCISCO:\n"
    )


@pytest.mark.exercise("ch09.2")
def test_blank_lines_inside_a_message_cannot_end_its_speech() -> None:
    chat = [
        msg("user", "  First line.\n\n\nSecond line.\n \nThird.\n\n"),
        msg("developer", "Night."),
    ]
    prompt = render_chat(chat)
    assert prompt == "ROMEO:\nFirst line.\nSecond line.\nThird.\n\nChorus:\nNight.\n\nJULIET:\n"
    assert prompt.count(END_OF_TURN) == 2  # exactly one blank line per turn


def test_reply_speaker_defaults_and_text_parts() -> None:
    assert reply_speaker([msg("user", "Hi")]) == SPEAKERS["assistant"]
    parts = ChatMessage(
        role="user", content=[{"type": "text", "text": "Good "}, {"type": "text", "text": "morrow"}]
    )
    assert parts.text == "Good morrow"


# -- requests --------------------------------------------------------------------------------------


def test_completion_request_to_sampling_params() -> None:
    request = CompletionRequest.model_validate(
        {
            "model": "target",
            "prompt": "ROMEO:",
            "max_tokens": 7,
            "temperature": 0,
            "top_p": 0.5,
            "top_k": 3,
            "seed": 11,
            "stop": "\n",
            "ignore_eos": True,
            "user": "someone",
        }
    )
    assert request.prompts() == ["ROMEO:"]
    assert request.sampling_params(16) == SamplingParams(
        max_tokens=7, temperature=0, top_p=0.5, top_k=3, seed=11, stop=("\n",), ignore_eos=True
    )
    assert request.model_extra == {"user": "someone"}  # unknown fields a client sends are allowed


def test_defaults_and_nulls_mean_openais_defaults() -> None:
    request = CompletionRequest.model_validate(
        {
            "model": "m",
            "prompt": ["a", "b"],
            "temperature": None,
            "top_p": None,
            "stop": None,
            "top_k": -1,
            "logprobs": None,
        }
    )
    assert request.prompts() == ["a", "b"]
    assert request.sampling_params(16) == SamplingParams(max_tokens=16, temperature=1.0, top_p=1.0)
    assert not request.include_usage


def test_chat_request_adds_the_end_of_turn_stop_and_takes_the_newer_limit_name() -> None:
    request = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "Hi"}],
            "stop": ["!"],
            "max_completion_tokens": 9,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    params = request.sampling_params(500, extra_stop=[END_OF_TURN])
    assert params.stop == ("!", END_OF_TURN) and params.max_tokens == 9 and request.include_usage


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("max_tokens", 0, "greater than or equal to 1"),
        ("max_tokens", "5", "valid integer"),  # strict: no string-to-number coercion
        ("max_tokens", 2.5, "valid integer"),
        ("temperature", -0.1, "greater than or equal to 0"),
        ("temperature", True, "valid number"),  # strict: a bool is not a number
        ("top_p", 0, "greater than 0"),
        ("n", 17, "less than or equal to 16"),
        ("n", 0, "greater than or equal to 1"),
        ("top_k", 2**63, "less than or equal to 2147483647"),  # the request that killed the engine
        ("temperature", float("nan"), "finite number"),
        ("presence_penalty", 2.5, "less than or equal to 2"),
        ("logit_bias", {"x": 1}, "logit_bias keys must be token ids"),
        ("logit_bias", {"65": 101}, "less than or equal to 100"),
        ("logprobs", 21, "less than or equal to 20"),
        ("stop_token_ids", [-1], "greater than or equal to 0"),
        ("allowed_token_ids", [], "at least 1 item"),
        ("stream_options", {"continuous_usage_stats": True}, "Input should be False"),
        ("prompt", [[]], "at least 1 item"),
        ("stop", [""], "must not be empty"),
        ("stop", [1], "valid string"),
        ("seed", -1, "greater than or equal to 0"),
        ("stream", "yes", "valid boolean"),
        ("prompt", [], "at least 1 item"),
    ],
)
def test_bad_fields_are_refused_naming_the_problem(field: str, value, words: str) -> None:
    with pytest.raises(ValidationError, match=words):
        CompletionRequest.model_validate({"model": "m", "prompt": "x", field: value})


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("suffix", "x", "suffix is not supported"),
        ("best_of", 2, "best_of is not supported"),
        ("response_format", {"type": "json_object"}, "response_format is not supported"),
        ("tools", [{"type": "function"}], "tools is not supported"),
        ("guided_json", {}, "guided_json is not supported"),
        ("temprature", 0.5, "unknown field 'temprature'"),  # a typo is not silently ignored
    ],
)
def test_unsupported_and_unknown_fields_are_refused(field: str, value, words: str) -> None:
    request = CompletionRequest.model_validate({"model": "m", "prompt": "x", field: value})
    with pytest.raises(RequestError, match=words) as raised:
        request.check_extra_fields()
    assert raised.value.param == field and raised.value.status == 400


def test_off_values_and_fields_with_no_effect_are_accepted() -> None:
    request = CompletionRequest.model_validate(
        {
            "model": "m",
            "prompt": "x",
            "best_of": 1,
            "suffix": None,
            "response_format": {"type": "text"},
            "tool_choice": "none",
            "user": "u",
            "metadata": {"a": "b"},
        }
    )
    request.check_extra_fields()  # nothing raised


def test_vllms_sampling_fields_reach_the_engine() -> None:
    request = CompletionRequest.model_validate(
        {
            "model": "m",
            "prompt": [[1, 2], [3]],
            "n": 3,
            "presence_penalty": 0.5,
            "frequency_penalty": -0.5,
            "repetition_penalty": 1.2,
            "min_p": 0.1,
            "logit_bias": {"65": 5.0},
            "min_tokens": 2,
            "stop_token_ids": [10],
            "include_stop_str_in_output": True,
            "logprobs": 2,
            "bad_words": ["sword"],
            "allowed_token_ids": [65, 66],
        }
    )
    assert request.prompts() == [[1, 2], [3]]
    params = request.sampling_params(16)
    assert (params.n, params.presence_penalty, params.frequency_penalty) == (3, 0.5, -0.5)
    assert (params.repetition_penalty, params.min_p, params.logit_bias) == (1.2, 0.1, ((65, 5.0),))
    assert (params.min_tokens, params.stop_token_ids, params.include_stop_str_in_output) == (
        2,
        (10,),
        True,
    )
    assert (params.logprobs, params.bad_words, params.allowed_token_ids) == (
        2,
        ("sword",),
        (65, 66),
    )
    assert CompletionRequest.model_validate({"model": "m", "prompt": [5, 6]}).prompts() == [[5, 6]]


def test_chat_logprobs_need_logprobs_true() -> None:
    chat = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}
    request = ChatCompletionRequest.model_validate({**chat, "logprobs": True, "top_logprobs": 3})
    assert request.sampling_params(16).logprobs == 3
    assert ChatCompletionRequest.model_validate(chat).sampling_params(16).logprobs is None
    with pytest.raises(ValidationError, match="top_logprobs needs logprobs"):
        ChatCompletionRequest.model_validate({**chat, "top_logprobs": 3})


@pytest.mark.parametrize(
    "message, words",
    [
        ({"role": "tool", "content": "x"}, "'assistant'"),
        ({"role": "user", "content": "   "}, "empty content"),
        ({"role": "user", "content": "x", "name": "A:B"}, "pattern"),
        ({"role": "user"}, "Field required"),
        ({"role": "user", "content": [{"type": "image_url", "image_url": {}}]}, "'text'"),
    ],
)
def test_bad_messages_are_refused(message: dict, words: str) -> None:
    with pytest.raises(ValidationError, match=words):
        ChatCompletionRequest.model_validate({"model": "m", "messages": [message]})


# -- responses -------------------------------------------------------------------------------------


def test_response_bodies_have_openais_shape() -> None:
    header = ResponseHeader.new("text_completion", "target")
    assert header.id.startswith("cmpl-") and ResponseHeader.new(
        "chat.completion", "t"
    ).id.startswith("chatcmpl-")
    body = header.body([completion_choice(0, "Hi", "stop")], usage=usage(3, 2))
    assert body == {
        "id": header.id,
        "object": "text_completion",
        "created": header.created,
        "model": "target",
        "choices": [{"index": 0, "text": "Hi", "logprobs": None, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    }
    assert chat_choice(0, "Hi", "length")["message"] == {"role": "assistant", "content": "Hi"}
    assert error_body("bad", param="n") == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": "n", "code": None}
    }


def test_finish_reasons_map_to_openais() -> None:
    assert [finish_reason(r) for r in ("stop", "length", "cache_full", None)] == [
        "stop",
        "length",
        "length",
        None,
    ]


def test_logprobs_in_openais_two_shapes() -> None:
    # "é" is two bytes (0xC3 0xA9): the second is no new character, so offsets count characters
    token_ids, positions = [72, 0xC3, 0xA9], [{72: -0.1, 73: -2.5}, {0xC3: -0.5}, {0xA9: 0.0}]
    legacy = completion_logprobs(token_ids, positions, count=1, text_offset=4)
    assert legacy == {
        "tokens": ["H", "bytes:\\xc3", "bytes:\\xa9"],
        "token_logprobs": [-0.1, -0.5, 0.0],
        "top_logprobs": [{"H": -0.1}, {"bytes:\\xc3": -0.5}, {"bytes:\\xa9": 0.0}],
        "text_offset": [4, 5, 5],
    }
    # the first prompt token has nothing before it: None
    assert completion_logprobs([256, 72], [None, {72: -1.0}], 0)["token_logprobs"] == [None, -1.0]
    chat = chat_logprobs([72], [{72: -0.1, 73: -2.5, 74: -3.0}], count=2)
    assert chat == {
        "content": [
            {
                "token": "H",
                "logprob": -0.1,
                "bytes": [72],
                "top_logprobs": [
                    {"token": "H", "logprob": -0.1, "bytes": [72]},
                    {"token": "I", "logprob": -2.5, "bytes": [73]},
                ],
            }
        ],
        "refusal": None,
    }
    assert [token_string(t) for t in (10, 256, 257)] == ["\n", "<bos>", "<eos>"]


# -- the streamed response: sse_stream (ch09.3) ----------------------------------------------------


class StubEngine:
    """Stands in for the AsyncEngine behind a RequestStream: it records the aborts it is asked
    for."""

    def __init__(self) -> None:
        self.aborted: list[tuple[int, ...]] = []

    def abort_stream(self, stream: RequestStream) -> None:
        self.aborted.append(stream.request_ids)


def chat_stream(
    deltas: list[TextDelta], include_usage: bool, take: int | None = None, samples: int = 2
) -> tuple[list[str], StubEngine]:
    """The events of a streamed chat answer of `samples` choices to one 9-token prompt, its deltas
    handed over as the engine would; with `take`, the client reads that many events and goes away
    (Starlette then closes the generator, as here)."""

    async def run() -> tuple[list[str], StubEngine]:
        engine = StubEngine()
        stream = RequestStream(engine)
        stream.added([7], samples)
        stream.num_prompt_tokens[7] = 9
        for delta in deltas:
            stream.put_nowait(delta)
        header = ResponseHeader("chatcmpl-1", "chat.completion.chunk", 0, "target")
        first = header.body([chat_delta(0, {"role": "assistant"}, None)])
        events = sse_stream(stream, header, ChatPieces(None), include_usage, first)
        received = []
        async for event in events:
            received.append(event)
            if take is not None and len(received) == take:
                await events.aclose()
                break
        return received, engine

    return asyncio.run(run())


def payloads(events: list[str]) -> list:
    """Each event's payload (`[DONE]` as the string); an error event fails the test with its
    message."""
    for event in events:
        assert event.startswith("data: ") and event.endswith("\n\n"), f"not an SSE event: {event!r}"
    data = [e[len("data: ") : -2] for e in events]
    parsed = [d if d == DONE else json.loads(d) for d in data]
    errors = [p["error"]["message"] for p in parsed if isinstance(p, dict) and "error" in p]
    assert not errors, f"the stream sent an error event: {errors[0]}"
    return parsed


def content(chunk: dict) -> tuple:
    """(choice index, text or None, finish reason) of a one-choice chunk."""
    (choice,) = chunk["choices"]
    return choice["index"], choice["delta"].get("content"), choice["finish_reason"]


# two samples of request 7, interleaved as the steps produce them; sample 1 has a step with a token
# but no text yet (half a character), and each ends with its finish reason on its last delta
TWO_SAMPLES = [
    TextDelta(7, "O ", (79, 32), None, index=0),
    TextDelta(7, "Ro", (82, 111), None, index=1),
    TextDelta(7, "", (226,), None, index=1),
    TextDelta(7, "me", (109, 101), None, index=0),
    TextDelta(7, "é", (169,), "length", index=1),
    TextDelta(7, "o", (111,), "stop", index=0),
]


@pytest.mark.exercise("ch09.3")
def test_a_stream_sends_its_chunks_in_order_then_usage_then_done() -> None:
    events, engine = chat_stream(TWO_SAMPLES, include_usage=True)
    sent = payloads(events)
    assert sent[-1] == DONE and DONE not in sent[:-1], "[DONE] must be the last event, once"
    chunks = sent[:-1]
    assert all(c["id"] == "chatcmpl-1" for c in chunks), "every chunk repeats the response's id"
    assert content(chunks[0])[:2] == (0, None) and chunks[0]["choices"][0]["delta"] == {
        "role": "assistant"
    }
    want = [
        (0, "O ", None),
        (1, "Ro", None),
        (0, "me", None),
        (1, "é", None),
        (1, None, "length"),
        (0, "o", None),
        (0, None, "stop"),
    ]
    got = [content(c) for c in chunks[1:-1]]
    assert got == want, (
        f"after the role: a chunk per delta with text (none for the empty one), in the order they "
        f"came, and a finish chunk right after a choice's last delta; want {want}, got {got}"
    )
    want_usage = {"prompt_tokens": 9, "completion_tokens": 9, "total_tokens": 18}
    assert chunks[-1]["choices"] == [] and chunks[-1].get("usage") == want_usage, (
        f"the usage chunk (no choices) counts every token, the text-less one too: want "
        f"{want_usage}, got {chunks[-1]}"
    )
    assert engine.aborted == [], "a stream read to its end has nothing left to abort"


@pytest.mark.exercise("ch09.3")
def test_without_include_usage_the_finish_chunks_come_last_before_done() -> None:
    sent = payloads(
        chat_stream(TWO_SAMPLES[:1] + [TextDelta(7, "", (), "stop")], False, None, 1)[0]
    )
    got = [content(c) for c in sent[1:-1]]
    assert got == [(0, "O ", None), (0, None, "stop")] and sent[-1] == DONE, (
        f"want the text chunk, the finish chunk, then [DONE] and no usage; got {sent[1:]}"
    )


@pytest.mark.exercise("ch09.3")
def test_a_client_that_goes_away_mid_stream_aborts_the_request() -> None:
    events, engine = chat_stream(TWO_SAMPLES, include_usage=True, take=3)
    assert len(payloads(events)) == 3
    assert engine.aborted == [(7,)], (
        f"closing the stream after 3 events must abort request 7 (a closed generator leaves "
        f"`async with stream`); aborts seen: {engine.aborted}"
    )
