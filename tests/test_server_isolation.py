"""Chapter 08: one big answer does not stall anyone else's stream (issue 30, item 2).

A non-streamed answer of many prompts, `n` samples each, echoed, with logprobs, is tens of MB of
JSON. Built and encoded in one go on the event loop it froze every other client's stream for
seconds; now it is written a choice at a time (`responses.json_in_pieces`), and an answer that
could exceed the output budget is refused before any work with a 400 saying what to lower.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from minivllm.engine.llm_engine import LLMEngine
from minivllm.serving import responses
from minivllm.serving.client import streams_beside
from minivllm.serving.limits import ServerLimits
from minivllm.serving.openai_protocol import ResponseHeader
from minivllm.serving.responses import Answer, ChatPieces, encode_json, json_in_pieces
from minivllm.serving.server import ServerThread

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = [65 + i % 26 for i in range(480)]  # 480 tokens: most of the shipped model's context


async def joined(chunks) -> bytes:
    return b"".join([chunk async for chunk in chunks])


def test_pieces_are_the_same_bytes_as_the_whole_body():
    """The piecewise writer's output is exactly the body encoded at once (logprobs, a surrogate the
    client sent, unicode text and all)."""
    header = ResponseHeader.new("chat.completion", "target")
    answers = [
        Answer("Ro\u00e9meo \ud800", [65, 66], [{65: -0.5, 66: -1.5}, {66: -0.25}], None, "stop"),
        Answer("", [], [], None, "length"),
        Answer("x", [70], [{70: -0.0}], None, "length"),
    ]
    pieces = ChatPieces(num_logprobs=1)
    usage = {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    whole = header.body([pieces.whole(i, a) for i, a in enumerate(answers)], usage=usage)
    written = asyncio.run(joined(json_in_pieces(header.body([], usage=usage), pieces, answers)))
    assert written == encode_json(whole)
    assert json.loads(written)["choices"][2]["logprobs"]["content"][0]["token"]


def test_an_answer_past_the_output_budget_is_refused_before_any_work(target):
    limits = ServerLimits(max_output_units=50_000)
    big = {"prompt": [PROMPT] * 8, "n": 4, "logprobs": 5, "echo": True, "max_tokens": 16}
    with ServerThread(LLMEngine(target), limits=limits) as server:
        response = httpx.post(f"{server.base_url}/completions", json=big, timeout=60)
        assert response.status_code == 400, response.text
        message = response.json()["error"]["message"]
        # 8 prompts x 4 samples x (480 echoed + 16) tokens x (5 + 1)
        assert f"{8 * 4 * 496 * 6:,}" in message and "lower n, max_tokens, logprobs" in message
        assert server.engine.engine.manager.allocator.num_used == 0
        assert server.engine.engine.stats().num_requests == 0
        within = {**big, "n": 1, "logprobs": 1}  # 8 x 496 x 2 = 7,936 units: served
        assert httpx.post(f"{server.base_url}/completions", json=within, timeout=120).is_success


def test_streams_beside_the_biggest_allowed_answer_never_stall(target, monkeypatch):
    """24 streams, and beside them the biggest answer the default limits allow (32 prompts of 480
    tokens, echoed with 20 logprobs, two samples each: about 15 MB of JSON): no stream waits more
    than 0.5 s for its next token. The answer is written in pieces (more than
    INLINE_ANSWER_UNITS), and arrives whole."""
    streams = [
        {"prompt": "ROMEO:\n", "max_tokens": 48, "ignore_eos": True, "seed": i, "temperature": 0.8}
        for i in range(24)
    ]
    big = {"prompt": [PROMPT] * 32, "n": 2, "logprobs": 20, "echo": True, "max_tokens": 16}
    assert 64 * 496 * 21 > responses.INLINE_ANSWER_UNITS
    with ServerThread(LLMEngine(target)) as server:
        run = asyncio.run(streams_beside(server.base_url, streams, big, big_after=0.3))
        assert server.engine.engine.manager.allocator.num_used == 0
    assert run.big_status == 200 and run.big_bytes > 10_000_000
    assert all(len(stream.chunk_times) >= 40 for stream in run.streams)
    assert run.max_gap < 0.5, f"a stream waited {run.max_gap:.2f} s for a token"
