"""Chapter 09: one big answer does not stall anyone else's stream (issue 30, item 2).

A non-streamed answer of many prompts, `n` samples each, echoed, with logprobs, is tens of MB of
JSON. Built and encoded in one go on the event loop it froze every other client's stream for
seconds; now it is written a choice at a time (`responses.json_in_pieces`), and an answer that
could exceed the output budget is refused before any work with a 400 saying what to lower.
"""

from __future__ import annotations

import asyncio
import gc
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


def test_the_writer_lets_the_event_loop_run_between_choices():
    """While a big answer is written, other tasks on the loop (every other client's stream) run
    between its choices: a ticker task ticks once per choice written. Encoded in one go, it would
    tick not at all until the whole body was done."""
    header = ResponseHeader.new("chat.completion", "target")
    answer = Answer("word " * 200, list(range(200)), [{t: -1.0, t + 1: -2.0} for t in range(200)])
    answers = [answer] * 64
    pieces = ChatPieces(num_logprobs=1)
    ticks_while_writing = []

    async def write_beside_a_ticker() -> None:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        task = asyncio.ensure_future(ticker())
        await asyncio.sleep(0)
        async for _ in json_in_pieces(header.body([], usage={}), pieces, answers):
            ticks_while_writing.append(ticks)
        task.cancel()

    asyncio.run(write_beside_a_ticker())
    # one chunk per choice (plus the head and the tail); the ticker ran between each two
    assert len(ticks_while_writing) == len(answers) + 2
    steps = [b - a for a, b in zip(ticks_while_writing[1:], ticks_while_writing[2:-1])]
    assert min(steps) >= 1


def test_streams_beside_the_biggest_allowed_answer_never_stall(target):
    """24 streams, and beside them the biggest answer the default limits allow (32 prompts of 480
    tokens, echoed with 20 logprobs, two samples each: about 15 MB of JSON): no stream waits more
    than 0.5 s for its next token. On a loaded machine a stream's gaps are long even with no big
    answer beside it (an engine step takes longer), so the bound is 0.5 s or three times the
    longest gap the same streams see alone, whichever is larger."""
    streams = [
        {"prompt": "ROMEO:\n", "max_tokens": 48, "ignore_eos": True, "seed": i, "temperature": 0.8}
        for i in range(24)
    ]
    big = {"prompt": [PROMPT] * 32, "n": 2, "logprobs": 20, "echo": True, "max_tokens": 16}
    assert 64 * 496 * 21 > responses.INLINE_ANSWER_UNITS  # written in pieces
    with ServerThread(LLMEngine(target)) as server:
        alone = asyncio.run(streams_beside(server.base_url, streams))
        run = asyncio.run(streams_beside(server.base_url, streams, big, big_after=0.3))
        assert server.engine.engine.manager.allocator.num_used == 0
    assert run.big_status == 200 and run.big_bytes > 10_000_000
    # seeded: every stream's text is its text alone, however often it ran beside the big answer
    assert [[s.text for s in client] for client in run.streams] == [
        [alone_client[0].text] * len(client)
        for alone_client, client in zip(alone.streams, run.streams)
    ]
    bound = max(0.5, 3 * alone.max_gap)
    assert run.max_gap < bound, (
        f"a stream waited {run.max_gap:.2f} s for a token (alone: {alone.max_gap:.2f} s)"
    )


def test_a_running_server_keeps_the_heap_out_of_full_collections(target):
    """What was alive when a server started is frozen out of the garbage collector's full
    collections while any server runs (beside a million live objects one took 0.41 s, a stall
    of every stream), and given back when the last one stops."""
    assert gc.get_freeze_count() == 0
    alive_at_start = [[i] for i in range(100_000)]  # tracked objects, as a notebook's heap holds
    with ServerThread(LLMEngine(target)):
        assert gc.get_freeze_count() >= len(alive_at_start)
        with ServerThread(LLMEngine(target)):
            pass
        assert gc.get_freeze_count() >= len(alive_at_start)  # the first server still runs
    assert gc.get_freeze_count() == 0


def test_the_issues_293_byte_request_is_refused_at_the_door(target):
    """32 prompts x n=16 is 512 sequences, eight batches' worth: a 400 naming n, before any work
    (issue 30's repro queued them all ahead of everyone else)."""
    body = {"prompt": ["ROMEO:"] * 32, "n": 16, "max_tokens": 200}
    with ServerThread(LLMEngine(target)) as server:
        response = httpx.post(f"{server.base_url}/completions", json=body, timeout=60)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "n" and "512 sequences" in error["message"]
        assert "at most 64 per request" in error["message"]
        assert server.engine.engine.stats().num_requests == 0
