"""Chapter 09: the Anthropic Messages API, a second view of the same engine.

The official `anthropic` client, unchanged but for its base_url, gets the engine's answer to the
same play OpenAI's chat endpoint renders; a streamed message is Anthropic's exact event sequence
and joins to the whole one; stop reasons, usage and errors have Anthropic's shapes; with an API
key the client's `x-api-key` header is checked.
"""

from __future__ import annotations

import json

import httpx
import pytest

from minivllm.engine.llm_engine import LLMEngine
from minivllm.sched.sequence import SamplingParams
from minivllm.serving.openai_protocol import END_OF_TURN, ChatMessage, render_chat
from minivllm.serving.server import ServerThread

pytestmark = pytest.mark.usefixtures("one_torch_thread")
anthropic = pytest.importorskip("anthropic")

KEY = "sk-test-key"
CHAT = [
    ChatMessage(role="system", content="A hall in the castle."),
    ChatMessage(role="user", content="What say you?"),
]


@pytest.fixture(scope="module")
def server(target):
    with ServerThread(LLMEngine(target), api_key=KEY) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    with anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0) as c:
        yield c


SAMPLING = ("temperature", "top_p", "top_k")


def ask(client, **rest):
    """The castle scene; temperature, top_p and top_k go in `extra_body`: the 2.x client dropped
    them from its signature (the API still takes them), and every version sends extra_body."""
    sampling = {k: rest.pop(k) for k in SAMPLING if k in rest}
    return client.messages.create(
        model="target",
        system="A hall in the castle.",
        messages=[{"role": "user", "content": "What say you?"}],
        extra_body=sampling,
        **rest,
    )


def test_a_message_is_the_engines_answer_to_the_play(client, target) -> None:
    message = ask(client, max_tokens=200, temperature=0)
    prompt = render_chat(CHAT)
    offline = LLMEngine(target).generate(
        [prompt], SamplingParams(max_tokens=200, temperature=0, stop=END_OF_TURN)
    )[0]
    assert message.id.startswith("msg_") and message.type == "message"
    assert message.role == "assistant" and message.model == "target"
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == offline.text
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    assert message.usage.input_tokens == len(prompt) + 1  # + BOS
    assert message.usage.output_tokens == len(offline.token_ids)


def test_stop_reasons_max_tokens_and_stop_sequence(client) -> None:
    cut = ask(client, max_tokens=3, temperature=0)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3
    whole = ask(client, max_tokens=200, temperature=0).content[0].text
    letter = next(c for c in whole[1:] if c.isalpha())  # a letter the answer holds
    stopped = ask(client, max_tokens=200, temperature=0, stop_sequences=[letter])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == letter
    assert letter not in stopped.content[0].text and whole.startswith(stopped.content[0].text)


def test_the_users_own_blank_line_stop_is_a_stop_sequence(client) -> None:
    """A blank line also ends the play's turn; asked for by the user, its match is the user's."""
    turn = ask(client, max_tokens=200, temperature=0)
    assert turn.stop_reason == "end_turn"  # the greedy answer ends at a blank line
    asked = dict(max_tokens=200, temperature=0, stop_sequences=["\n\n"])
    whole = ask(client, **asked)
    assert (whole.stop_reason, whole.stop_sequence) == ("stop_sequence", "\n\n")
    assert whole.content[0].text == turn.content[0].text
    with client.messages.stream(
        model="target",
        system="A hall in the castle.",
        messages=[{"role": "user", "content": "What say you?"}],
        max_tokens=200,
        stop_sequences=["\n\n"],
        extra_body={"temperature": 0},
    ) as stream:
        streamed = stream.get_final_message()
    assert (streamed.stop_reason, streamed.stop_sequence) == ("stop_sequence", "\n\n")
    assert streamed.content[0].text == turn.content[0].text


def test_a_streamed_message_is_anthropics_event_sequence(client) -> None:
    with client.messages.stream(
        model="target",
        system="A hall in the castle.",
        messages=[{"role": "user", "content": "What say you?"}],
        max_tokens=60,
        extra_body={"temperature": 0.8, "top_p": 0.9, "top_k": 40},
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    types = [e.type for e in events]
    assert types[:3] == ["message_start", "content_block_start", "ping"] or types[:2] == [
        "message_start",
        "content_block_start",
    ]
    assert types[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    deltas = [e for e in events if e.type == "content_block_delta"]
    assert deltas and all(e.delta.type == "text_delta" and e.index == 0 for e in deltas)
    assert "".join(e.delta.text for e in deltas) == final.content[0].text
    assert final.stop_reason in ("end_turn", "max_tokens")
    # sampled, but without a seed Anthropic has no reproducibility: the shape is what holds
    assert final.usage.output_tokens >= 1


def test_the_raw_stream_has_event_lines(server) -> None:
    body = {
        "model": "target",
        "max_tokens": 5,
        "temperature": 0,
        "stream": True,
        "messages": [{"role": "user", "content": "Hi"}],
    }
    with httpx.stream(
        "POST", server.url + "/v1/messages", json=body, headers={"x-api-key": KEY}
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    datas = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
    assert names == [d["type"] for d in datas]  # each event names the type its data has
    assert names[0] == "message_start" and names[-1] == "message_stop"
    start = datas[0]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert datas[-2]["delta"]["stop_reason"] == "max_tokens"
    assert datas[-2]["usage"]["output_tokens"] == 5


def test_errors_are_anthropics(client, server) -> None:
    with pytest.raises(anthropic.BadRequestError) as raised:
        ask(client, max_tokens=10, temperature=1.5)
    assert raised.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(
            model="claude", max_tokens=5, messages=[{"role": "user", "content": "Hi"}]
        )
    with (
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0) as stranger,
        pytest.raises(anthropic.AuthenticationError) as raised,
    ):
        ask(stranger, max_tokens=5)
    assert raised.value.body == {
        "type": "error",
        "error": {
            "type": "authentication_error",
            "message": raised.value.body["error"]["message"],
        },
    }
    assert ask(client, max_tokens=2).usage.output_tokens == 2  # and it still serves


def test_openai_and_anthropic_give_one_engines_answer(server, client) -> None:
    """The same play through both APIs: the same greedy text."""
    openai = pytest.importorskip("openai")
    with openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0) as other:
        chat = other.chat.completions.create(
            model="target",
            messages=[m.model_dump(exclude_none=True) for m in CHAT],
            max_tokens=40,
            temperature=0,
        )
    message = ask(client, max_tokens=40, temperature=0)
    assert chat.choices[0].message.content == message.content[0].text
