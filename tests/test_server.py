"""Chapter 08: the OpenAI-compatible server, end to end over loopback.

The official `openai` client works unchanged (completion and chat, streamed and not, and a streamed
answer is the non-streamed one); 64 concurrent streaming clients each get exactly what the offline
engine gives for their request, and every block comes back; a client that disconnects is aborted;
bad requests get OpenAI's error body with the right status and leave the engine as it was; a failed
engine answers 503. With speculative decoding, and with a cache small enough to force preemptions,
greedy answers do not change.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest

from minivllm.engine.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.runner.speculative import SpeculativeConfig
from minivllm.sched.scheduler import SchedulerConfig
from minivllm.sched.sequence import SamplingParams
from minivllm.serving.client import run_clients, sse_payload
from minivllm.serving.openai_protocol import ChatMessage, render_chat
from minivllm.serving.server import ServerThread
from minivllm.training.corpus import shipped_validation_text

pytestmark = pytest.mark.usefixtures("one_torch_thread")
openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def server(target):
    with ServerThread(LLMEngine(target)) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0) as c:
        yield c


def speeches(count: int) -> list[str]:
    """`count` distinct prompts of 10-90 bytes: the openings of speeches of the held-out plays."""
    text = [s for s in shipped_validation_text().split("\n\n") if s.isascii() and len(s) > 100]
    return [s[: 10 + (7 * i) % 80] for i, s in enumerate(text[:count])]


def sse_data(lines) -> list:
    """The payloads of a Server-Sent Event stream, up to `[DONE]` (which must come last)."""
    payloads = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert payloads[-1] == "[DONE]" and "[DONE]" not in payloads[:-1]
    return [json.loads(p) for p in payloads[:-1]]


def engine_state(server: ServerThread) -> tuple:
    return server.engine.call(
        lambda e: (len(e.trace), e.manager.allocator.num_used, e.has_unfinished())
    )


def metric(server: ServerThread, name: str) -> float:
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise KeyError(name)


# -- the official client ---------------------------------------------------------------------------


def test_openai_completion_streamed_equals_non_streamed(client, server, target) -> None:
    args = dict(model="target", prompt="ROMEO:\n", max_tokens=24, temperature=0.8, seed=7)
    whole = client.completions.create(**args)
    assert (
        whole.id.startswith("cmpl-")
        and whole.object == "text_completion"
        and whole.model == "target"
    )
    assert abs(whole.created - time.time()) < 600
    choice = whole.choices[0]
    assert choice.finish_reason == "length" and whole.usage.completion_tokens == 24
    # + BOS
    assert whole.usage.prompt_tokens == len("ROMEO:\n") + 1 and whole.usage.total_tokens == 32
    offline = LLMEngine(target).generate(
        ["ROMEO:\n"], SamplingParams(max_tokens=24, temperature=0.8, seed=7)
    )[0]
    assert choice.text == offline.text
    chunks = list(
        client.completions.create(**args, stream=True, stream_options={"include_usage": True})
    )
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].id != whole.id
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_openai_chat_streamed_equals_non_streamed(client, target) -> None:
    messages = [{"role": "user", "content": "What say you?"}]
    whole = client.chat.completions.create(
        model="target", messages=messages, temperature=0, max_tokens=200
    )
    assert whole.id.startswith("chatcmpl-") and whole.object == "chat.completion"
    answer = whole.choices[0]
    # The answer ends where JULIET's speech does: at the blank line, which is not part of it.
    prompt = render_chat([ChatMessage(**m) for m in messages])
    offline = LLMEngine(target).generate(
        [prompt], SamplingParams(max_tokens=200, temperature=0, stop="\n\n")
    )[0]
    assert answer.finish_reason == "stop" and answer.message.role == "assistant"
    assert answer.message.content == offline.text and "\n\n" not in offline.text
    assert whole.usage.prompt_tokens == len(prompt) + 1 and whole.usage.completion_tokens == len(
        offline.token_ids
    )
    chunks = list(
        client.chat.completions.create(
            model="target", messages=messages, temperature=0, max_tokens=200, stream=True
        )
    )
    assert (
        chunks[0].object == "chat.completion.chunk"
        and chunks[0].choices[0].delta.role == "assistant"
    )
    assert all(c.choices[0].delta.role is None for c in chunks[1:])
    assert (
        chunks[-1].choices[0].finish_reason == "stop"
        and chunks[-1].choices[0].delta.content is None
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == answer.message.content


def test_sampled_chat_is_reproducible_from_its_seed(client) -> None:
    args = dict(
        model="target",
        messages=[
            {"role": "system", "content": "A hall in the castle."},
            {"role": "user", "content": "Who comes here?", "name": "HAMLET"},
            {"role": "assistant", "content": "My lord.", "name": "HORATIO"},
            {"role": "user", "content": "Speak.", "name": "HAMLET"},
        ],
        max_tokens=20,
        temperature=1.0,
        top_p=0.9,
        seed=123,
        stop=["."],
    )
    whole = client.chat.completions.create(**args).choices[0].message.content
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(**args, stream=True)
    )
    assert streamed == whole and "." not in whole


def test_models_health_and_metrics(client, server) -> None:
    assert [m.id for m in client.models.list().data] == ["target"]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    before = metric(server, "minivllm:generation_tokens_total")
    client.completions.create(model="target", prompt="KING LEAR:\n", max_tokens=5, temperature=0)
    assert metric(server, "minivllm:generation_tokens_total") == before + 5
    response = httpx.get(server.url + "/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    assert "# TYPE minivllm:time_to_first_token_seconds histogram" in response.text


def test_several_prompts_are_several_choices(server, target) -> None:
    prompts, params = (
        ["ROMEO:\n", "JULIET:\n", "HAMLET:\n"],
        SamplingParams(max_tokens=10, temperature=0),
    )
    offline = LLMEngine(target).generate(prompts, params)
    body = {"model": "target", "prompt": prompts, "max_tokens": 10, "temperature": 0}
    whole = httpx.post(server.base_url + "/completions", json=body, timeout=60).json()
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2]
    assert [c["text"] for c in whole["choices"]] == [o.text for o in offline]
    assert whole["usage"]["completion_tokens"] == 30
    with httpx.stream(
        "POST", server.base_url + "/completions", json={**body, "stream": True}, timeout=60
    ) as r:
        chunks = sse_data(r.iter_lines())
    streamed = ["", "", ""]
    for chunk in chunks:
        (choice,) = chunk["choices"]
        streamed[choice["index"]] += choice["text"]
    assert streamed == [o.text for o in offline]


# -- many clients at once --------------------------------------------------------------------------


def test_64_concurrent_streams_each_equal_the_offline_engine(server, target) -> None:
    prompts = speeches(64)
    budgets = [8 + i % 9 for i in range(64)]
    offline = LLMEngine(target).generate(
        prompts, [SamplingParams(max_tokens=m, temperature=0) for m in budgets]
    )
    steps_before = engine_state(server)[0]
    bodies = [
        {"model": "target", "prompt": p, "max_tokens": m, "temperature": 0}
        for p, m in zip(prompts, budgets)
    ]
    _, results = asyncio.run(run_clients(server.base_url, bodies, concurrency=64))
    assert [(r.text, r.finish_reason) for r in results] == [
        (o.text, o.finish_reason) for o in offline
    ]
    assert all(r.ttft > 0 and all(gap >= 0 for gap in r.itls) for r in results)
    assert engine_state(server)[1:] == (0, False)  # every block back in the pool
    trace = server.engine.trace()[steps_before:]
    assert max(len(r.running) for r in trace) > 1  # they shared the batch


# -- clients that go away --------------------------------------------------------------------------


def wait_until_idle(server: ServerThread, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while engine_state(server)[1:] != (0, False):
        assert time.monotonic() < deadline, "the engine is still running the abandoned request"
        time.sleep(0.01)


def test_a_client_that_disconnects_mid_stream_is_aborted(server) -> None:
    aborted = metric(server, 'minivllm:request_success_total{finished_reason="abort"}')
    body = {
        "model": "target",
        "prompt": "ROMEO:\n",
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", server.base_url + "/completions", json=body, timeout=60) as response:
        for count, _ in enumerate(
            line for line in response.iter_lines() if line.startswith("data: ")
        ):
            if count == 2:
                assert engine_state(server)[1] > 0
                break  # leaving the block closes the connection
    wait_until_idle(server)
    assert metric(server, 'minivllm:request_success_total{finished_reason="abort"}') == aborted + 1


def test_a_non_streaming_client_that_gives_up_is_aborted(server) -> None:
    aborted = metric(server, 'minivllm:request_success_total{finished_reason="abort"}')
    body = {"model": "target", "prompt": "JULIET:\n", "max_tokens": 400, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/completions", json=body, timeout=httpx.Timeout(60, read=0.3))
    wait_until_idle(server)
    assert metric(server, 'minivllm:request_success_total{finished_reason="abort"}') == aborted + 1


# -- bad requests ----------------------------------------------------------------------------------

OK = {"model": "target", "prompt": "ROMEO:", "max_tokens": 4}
CHAT = {"model": "target", "messages": [{"role": "user", "content": "Hi"}]}
BAD = [  # (path, body, status, param, code, words in the message)
    ("/v1/completions", "{", 400, None, None, "not valid JSON"),
    ("/v1/completions", "", 400, None, None, "body: Field required"),
    ("/v1/completions", "[1, 2]", 400, None, None, "valid dictionary"),
    ("/v1/completions", {"prompt": "x"}, 400, "model", None, "model: Field required"),
    ("/v1/completions", {"model": "target"}, 400, "prompt", None, "prompt: Field required"),
    (
        "/v1/completions",
        {**OK, "prompt": 5},
        400,
        "prompt",
        None,
        "prompt.str: Input should be a valid string",
    ),
    ("/v1/completions", {**OK, "prompt": []}, 400, "prompt", None, "at least 1 item"),
    (
        "/v1/completions",
        {**OK, "max_tokens": 0},
        400,
        "max_tokens",
        None,
        "greater than or equal to 1",
    ),
    (
        "/v1/completions",
        {**OK, "max_tokens": -5},
        400,
        "max_tokens",
        None,
        "greater than or equal to 1",
    ),
    ("/v1/completions", {**OK, "max_tokens": "8"}, 400, "max_tokens", None, "valid integer"),
    (
        "/v1/completions",
        {**OK, "temperature": -1},
        400,
        "temperature",
        None,
        "greater than or equal to 0",
    ),
    ("/v1/completions", {**OK, "temperature": "hot"}, 400, "temperature", None, "valid number"),
    ("/v1/completions", {**OK, "top_p": 1.5}, 400, "top_p", None, "less than or equal to 1"),
    ("/v1/completions", {**OK, "n": 2}, 400, "n", None, "n must be 1"),
    ("/v1/completions", {**OK, "stream": "yes"}, 400, "stream", None, "valid boolean"),
    ("/v1/completions", {**OK, "seed": -1}, 400, "seed", None, "greater than or equal to 0"),
    ("/v1/completions", {**OK, "stop": [""]}, 400, "stop", None, "must not be empty"),
    ("/v1/completions", {**OK, "logprobs": 3}, 400, None, None, "logprobs is not supported"),
    (
        "/v1/completions",
        {**OK, "model": "gpt-4o"},
        404,
        "model",
        "model_not_found",
        "`gpt-4o` does not exist",
    ),
    (
        "/v1/completions",
        {**OK, "prompt": "x" * 600},
        400,
        "prompt",
        None,
        "exceeds the model's context of 512",
    ),
    (
        "/v1/completions",
        {**OK, "prompt": ["ok", "x" * 600]},
        400,
        "prompt",
        None,
        "exceeds the model's context",
    ),
    ("/v1/completions", {**OK, "max_tokens": 510}, 400, "prompt", None, "lower max_tokens"),
    ("/v1/chat/completions", {**CHAT, "messages": []}, 400, "messages", None, "at least 1 item"),
    (
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "tool", "content": "x"}]},
        400,
        "messages",
        None,
        "messages.0.role: Input should be",
    ),
    (
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": ""}]},
        400,
        "messages",
        None,
        "empty content",
    ),
    (
        "/v1/chat/completions",
        {**CHAT, "max_completion_tokens": 0},
        400,
        "max_completion_tokens",
        None,
        "greater than or equal to 1",
    ),
    (
        "/v1/chat/completions",
        {**CHAT, "model": "nope"},
        404,
        "model",
        "model_not_found",
        "does not exist",
    ),
    (
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": "x" * 600}]},
        400,
        "messages",
        None,
        "exceeds the model's context",
    ),
    ("/v1/nothing-here", OK, 404, None, "not_found", "Not Found"),
]


@pytest.mark.parametrize(
    "path, body, status, param, code, words", BAD, ids=[f"{i}:{b[5]}" for i, b in enumerate(BAD)]
)
def test_bad_requests_get_openais_error_body_and_change_nothing(
    server, path, body, status, param, code, words
) -> None:
    before = engine_state(server)
    content = body if isinstance(body, str) else json.dumps(body)
    response = httpx.post(
        server.url + path, content=content, headers={"content-type": "application/json"}
    )
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and words in error["message"], error
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, code)
    assert engine_state(server) == before


def test_the_server_still_serves_after_bad_requests(client, server) -> None:
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="target", prompt="x", max_tokens=0)
    with pytest.raises(openai.NotFoundError, match="does not exist") as raised:
        client.completions.create(model="nope", prompt="x")
    assert raised.value.code == "model_not_found" and raised.value.param == "model"
    assert httpx.get(server.url + "/health").status_code == 200
    # a GET where only POST is served
    assert httpx.get(server.base_url + "/completions").status_code == 405
    assert (
        client.completions.create(
            model="target", prompt="ROMEO:\n", max_tokens=3
        ).usage.completion_tokens
        == 3
    )


# -- a failed engine -------------------------------------------------------------------------------


def test_a_failed_engine_answers_503_and_shuts_down_cleanly(target) -> None:
    threads = set(threading.enumerate())
    llm = LLMEngine(target)
    with ServerThread(llm) as server:
        llm.step = lambda: (_ for _ in ()).throw(RuntimeError("boom: the forward pass failed"))
        body = {**OK, "stream": True}
        with httpx.stream(
            "POST", server.base_url + "/completions", json=body, timeout=30
        ) as response:
            assert response.status_code == 200  # the status went out before the engine failed...
            (event,) = sse_data(response.iter_lines())  # ...so the error comes as an event
        assert event["error"]["code"] == "engine_dead" and "boom" in event["error"]["message"]
        health = httpx.get(server.url + "/health")
        assert health.status_code == 503 and "boom" in health.json()["error"]["message"]
        for path, payload in (("/completions", OK), ("/chat/completions", CHAT)):
            response = httpx.post(server.base_url + path, json=payload)
            assert response.status_code == 503
            assert response.json()["error"]["type"] == "server_error"
            assert response.json()["error"]["code"] == "engine_dead"
        assert httpx.get(server.url + "/metrics").status_code == 200
    assert set(threading.enumerate()) == threads  # uvicorn's thread and the engine thread are gone


# -- speculative decoding and preemption behind the server -----------------------------------------


def concurrent_greedy(server: ServerThread, prompts: list[str], max_tokens: int) -> list[str]:
    bodies = [
        {
            "model": "target",
            "prompt": p,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        for p in prompts
    ]
    return [
        r.text
        for r in asyncio.run(run_clients(server.base_url, bodies, concurrency=len(bodies)))[1]
    ]


@pytest.mark.parametrize(
    "config",
    [
        EngineConfig(speculative=SpeculativeConfig(method="draft", num_speculative_tokens=3)),
        EngineConfig(speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=3)),
        EngineConfig(
            num_blocks=12, scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64)
        ),
    ],
    ids=["draft", "ngram", "preemption"],
)
def test_greedy_answers_do_not_change_with_speculation_or_preemption(target, config) -> None:
    prompts, max_tokens = speeches(8), 24
    offline = LLMEngine(target).generate(
        prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    )
    with ServerThread(LLMEngine(target, config)) as server:
        assert concurrent_greedy(server, prompts, max_tokens) == [o.text for o in offline]
        trace = server.engine.trace()
        if config.speculative is not None:
            assert any(r.speculated for r in trace)
        else:
            preempted = sum(len(r.preempted) for r in trace)
            assert preempted > 0 and metric(server, "minivllm:num_preemptions_total") == preempted
            # 12 blocks of 16 tokens: a 200-token prompt can never run, whatever waits
            response = httpx.post(
                server.base_url + "/completions", json={**OK, "prompt": "x" * 200}
            )
            assert (
                response.status_code == 400
                and "it could never run" in response.json()["error"]["message"]
            )
        assert engine_state(server)[1:] == (0, False)


def test_the_client_reads_server_sent_events() -> None:
    assert sse_payload('data: {"a":1}') == {"a": 1}
    assert [sse_payload(line) for line in ("data: [DONE]", "", ": comment")] == [None, None, None]
