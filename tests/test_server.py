"""Chapter 09: the OpenAI-compatible server, end to end over loopback.

The official `openai` client works unchanged (completion and chat, streamed and not, and a streamed
answer is the non-streamed one); what vLLM's users send works as the offline engine does it (n
samples, logprobs and echo, vLLM's sampling fields, token-id prompts, /tokenize, /detokenize,
/version, /v1/models/{id}); forge-infer's /generate answers the offline engine's text, whole or
streamed, and a client that leaves it is aborted without disturbing the others; astrai's /stats
counts what ran and /health says the model is loaded; `model` may be left out of any request; an
API key guards /v1 and /generate but not /health, /metrics or /stats; 64 concurrent
streaming clients each get exactly what the offline engine gives for their request, and a seeded
request is the same alone or in a crowd; every block comes back; a client that disconnects is
aborted; a failed engine answers 503 and says so in /metrics. With speculative decoding, and with a
cache small enough to force preemptions, greedy answers do not change. Bad requests, one by one:
tests/test_hostile_requests.py.

The tests marked ch09.3 grade the streamed path (`sse_stream`) end to end: a streamed answer is the
whole one, chunk by chunk, and a client that leaves mid-stream is aborted.
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
    """A series' value; `name` without the model_name label every series carries."""
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        line = line.replace('{model_name="target"}', "").replace('model_name="target",', "")
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise KeyError(name)


# -- the official client ---------------------------------------------------------------------------


@pytest.mark.exercise("ch09.3")
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


@pytest.mark.exercise("ch09.3")
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
    assert httpx.get(server.url + "/health").json() == {"status": "ok", "model_loaded": True}
    phases = [
        f"minivllm:request_{phase}_time_seconds_count" for phase in ("queue", "prefill", "decode")
    ]
    before = [metric(server, name) for name in ["minivllm:generation_tokens_total", *phases]]
    client.completions.create(model="target", prompt="KING LEAR:\n", max_tokens=5, temperature=0)
    after = [metric(server, name) for name in ["minivllm:generation_tokens_total", *phases]]
    assert [b - a for a, b in zip(before, after)] == [5, 1, 1, 1]
    assert metric(server, "minivllm:engine_alive") == 1
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


# -- what vLLM's users send ------------------------------------------------------------------------


def test_n_samples_are_the_offline_engines_siblings(client, target) -> None:
    args = dict(model="target", prompt="ROMEO:\n", max_tokens=12, temperature=1.0, seed=5, n=3)
    whole = client.completions.create(**args)
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=5, n=3)
    offline = [s.text for s in LLMEngine(target).generate(["ROMEO:\n"], params)[0].samples]
    assert [c.index for c in whole.choices] == [0, 1, 2] and len(set(offline)) > 1
    assert [c.text for c in whole.choices] == offline
    assert whole.usage.completion_tokens == 36 and whole.usage.prompt_tokens == 8  # one prompt
    streamed = ["", "", ""]
    for chunk in client.completions.create(**args, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == offline
    chat = client.chat.completions.create(
        model="target",
        messages=[{"role": "user", "content": "Speak."}],
        max_tokens=10,
        seed=2,
        n=2,
    )
    assert [c.index for c in chat.choices] == [0, 1]


def test_logprobs_echo_and_their_streamed_form(client, target) -> None:
    args = dict(model="target", prompt="ROMEO:\n", max_tokens=6, temperature=0, logprobs=2)
    whole = client.completions.create(**args)
    offline = LLMEngine(target).generate(
        ["ROMEO:\n"], SamplingParams(max_tokens=6, temperature=0, logprobs=2)
    )[0]
    text, logprobs = whole.choices[0].text, whole.choices[0].logprobs
    assert logprobs.token_logprobs == [p[t] for p, t in zip(offline.logprobs, offline.token_ids)]
    assert "".join(logprobs.tokens) == text and logprobs.text_offset == list(range(len(text)))
    # greedy: each token is the likeliest of its top 2
    assert all(len(top) == 2 for top in logprobs.top_logprobs)
    assert all(max(t.values()) == p for t, p in zip(logprobs.top_logprobs, logprobs.token_logprobs))
    chunks = [c.choices[0] for c in client.completions.create(**args, stream=True) if c.choices]
    streamed = [lp for c in chunks if c.logprobs for lp in c.logprobs.token_logprobs]
    assert streamed == logprobs.token_logprobs
    assert [o for c in chunks if c.logprobs for o in c.logprobs.text_offset] == list(
        range(len(text))
    )
    echo = client.completions.create(**args, echo=True).choices[0]
    assert echo.text == "ROMEO:\n" + text
    assert echo.logprobs.tokens[:2] == ["<bos>", "R"] and echo.logprobs.token_logprobs[0] is None
    # BOS + 7 prompt bytes. Equal to float32 rounding, not bit for bit: the echo's prefill asks
    # the LM head for every prompt row, the plain request's for one, and a matmul's rounding
    # depends on its number of rows.
    assert echo.logprobs.token_logprobs[8:] == pytest.approx(logprobs.token_logprobs, rel=1e-5)
    assert all(isinstance(p, float) and p <= 0 for p in echo.logprobs.token_logprobs[1:8])
    chat_args = dict(
        model="target",
        messages=[{"role": "user", "content": "Speak."}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    chat = client.chat.completions.create(**chat_args)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].token == c.token for c in content)
    streamed_chat = [
        c.choices[0].logprobs.content
        for c in client.chat.completions.create(**chat_args, stream=True)
        if c.choices and c.choices[0].logprobs
    ]
    assert [e.logprob for part in streamed_chat for e in part] == [c.logprob for c in content]


VLLM_FIELDS = [  # a field, and a value strong enough to change the answer
    {"presence_penalty": 2.0},
    {"frequency_penalty": 2.0},
    {"repetition_penalty": 2.0},
    {"min_p": 0.3},
    {"logit_bias": {"101": 100}},
    {"stop_token_ids": [10]},
    {"stop_token_ids": [10], "min_tokens": 20},
    {"stop": "\n", "include_stop_str_in_output": True},
    {"bad_words": ["good"]},
    {"allowed_token_ids": list(range(65, 91))},
]


@pytest.mark.parametrize("fields", VLLM_FIELDS, ids=lambda f: "+".join(f))
def test_vllms_sampling_fields_are_honoured(server, target, fields: dict) -> None:
    """Each field gives the offline engine's answer with that parameter, which is not the answer
    without it: the field was used, not ignored."""
    base = {"model": "target", "prompt": "ROMEO:\n", "max_tokens": 30, "temperature": 1.0}
    body = {**base, "seed": 9, **fields}
    served = httpx.post(server.base_url + "/completions", json=body, timeout=60).json()
    params = dict(fields)
    if "logit_bias" in params:
        params["logit_bias"] = {int(k): v for k, v in params["logit_bias"].items()}
    engine = LLMEngine(target)
    offline = engine.generate(
        ["ROMEO:\n"], SamplingParams(max_tokens=30, temperature=1.0, seed=9, **params)
    )[0]
    plain = LLMEngine(target).generate(
        ["ROMEO:\n"], SamplingParams(max_tokens=30, temperature=1.0, seed=9)
    )[0]
    assert served["choices"][0]["text"] == offline.text != plain.text


def test_token_id_prompts_and_vllms_endpoints(client, server) -> None:
    tokenized = httpx.post(server.url + "/tokenize", json={"prompt": "ROMEO:\n"}).json()
    assert tokenized == {
        "count": 8,
        "max_model_len": 512,
        "tokens": [256, *b"ROMEO:\n"],
        "token_strs": None,
    }
    by_ids = client.completions.create(
        model="target", prompt=tokenized["tokens"], max_tokens=8, temperature=0
    )
    by_text = client.completions.create(
        model="target", prompt="ROMEO:\n", max_tokens=8, temperature=0
    )
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == 8
    two = client.completions.create(
        model="target", prompt=[[256, 72], [256, 74]], max_tokens=2, temperature=0
    )
    assert len(two.choices) == 2
    detokenized = httpx.post(server.url + "/detokenize", json={"tokens": tokenized["tokens"]})
    assert detokenized.json() == {"prompt": "ROMEO:\n"}  # BOS carries no text
    chat = [{"role": "user", "content": "Speak."}]
    count = httpx.post(server.url + "/tokenize", json={"messages": chat}).json()["count"]
    answer = client.chat.completions.create(model="target", messages=chat, max_tokens=2)
    assert count == answer.usage.prompt_tokens
    truncated = client.completions.create(
        model="target", prompt="x" * 600, max_tokens=2, extra_body={"truncate_prompt_tokens": 100}
    )
    assert truncated.usage.prompt_tokens == 100
    assert httpx.get(server.url + "/version").json()["version"]
    assert client.models.retrieve("target").id == "target"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def test_an_api_key_guards_v1_but_not_health_or_metrics(target) -> None:
    with ServerThread(LLMEngine(target), api_key="sesame") as server:
        for path in ("/v1/models", "/v1/models/target"):
            refused = httpx.get(server.url + path)
            assert refused.status_code == 401
            assert refused.json()["error"]["code"] == "invalid_api_key"
        wrong = httpx.get(server.url + "/v1/models", headers={"authorization": "Bearer nope"})
        assert wrong.status_code == 401
        for path in ("/tokenize", "/generate"):
            assert httpx.post(server.url + path, json={"prompt": "x"}).status_code == 401
        for path in ("/health", "/metrics", "/version", "/stats"):
            assert httpx.get(server.url + path).status_code == 200
        with openai.OpenAI(base_url=server.base_url, api_key="sesame", max_retries=0) as c:
            assert c.completions.create(model="target", prompt="A", max_tokens=2).choices
        with (
            openai.OpenAI(base_url=server.base_url, api_key="wrong", max_retries=0) as c,
            pytest.raises(openai.AuthenticationError),
        ):
            c.completions.create(model="target", prompt="A", max_tokens=2)


# -- forge-infer's /generate, astrai's /stats, an optional model ----------------------------------


def test_generate_whole_and_streamed_is_the_offline_engines_answer(server, target) -> None:
    body = {"prompt": "ROMEO:\n", "max_tokens": 12, "temperature": 0.8, "seed": 3, "stop": ["!"]}
    offline = LLMEngine(target).generate(
        ["ROMEO:\n"], SamplingParams(max_tokens=12, temperature=0.8, seed=3, stop=("!",))
    )[0]
    whole = httpx.post(server.url + "/generate", json=body).json()
    assert whole == {
        "text": offline.text,
        "token_ids": offline.token_ids,
        "finish_reason": offline.finish_reason,
        "prompt_tokens": 8,
        "completion_tokens": len(offline.token_ids),
    }
    by_ids = {**body, "prompt": [256, *b"ROMEO:\n"], "model": "target"}
    assert httpx.post(server.url + "/generate", json=by_ids).json() == whole
    with httpx.stream("POST", server.url + "/generate", json={**body, "stream": True}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_data(response.iter_lines())
    assert len(events) > 1 and all(e["finish_reason"] is None for e in events[:-1])
    assert "".join(e["text"] for e in events) == whole["text"]
    assert [t for e in events for t in e["token_ids"]] == whole["token_ids"]
    assert {k: events[-1][k] for k in ("finish_reason", "prompt_tokens", "completion_tokens")} == {
        k: whole[k] for k in ("finish_reason", "prompt_tokens", "completion_tokens")
    }
    assert engine_state(server)[1:] == (0, False)


def test_a_generate_client_that_leaves_is_aborted_and_the_others_go_on(server, target) -> None:
    greedy = {"prompt": "JULIET:\n", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    offline = LLMEngine(target).generate(
        ["JULIET:\n"], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    )[0]
    long = {"prompt": "ROMEO:\n", "max_tokens": 400, "ignore_eos": True, "stream": True}

    async def events(response: httpx.Response):
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line.removeprefix("data: "))

    async def main() -> str:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            async with http.stream("POST", "/generate", json=long) as leaving:
                leaving_events = events(leaving)
                await anext(leaving_events)
                async with http.stream("POST", "/generate", json={**greedy, "stream": True}) as b:
                    staying = events(b)
                    text = (await anext(staying))["text"]
                    assert server.engine.call(lambda e: len(e.scheduler.running)) == 2
                    await leaving.aclose()  # one client goes away while the other streams
                    return text + "".join([e["text"] async for e in staying])

    assert asyncio.run(main()) == offline.text
    wait_until_idle(server)


def test_stats_count_what_ran_and_health_says_the_model_is_loaded(server) -> None:
    wait_until_idle(server)
    before = httpx.get(server.url + "/stats").json()
    assert before["model"] == "target" and before["engine_alive"] is True
    assert (before["active_requests"], before["waiting_requests"], before["cache_usage"]) == (
        0,
        0,
        0,
    )
    reply = httpx.post(server.url + "/generate", json={"prompt": "A", "max_tokens": 5}).json()
    after = httpx.get(server.url + "/stats").json()
    assert after["total_requests"] == before["total_requests"] + 1
    assert after["tokens_generated"] == before["tokens_generated"] + reply["completion_tokens"]
    body = {"prompt": "ROMEO:\n", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/generate", json=body, timeout=60) as response:
        lines = response.iter_lines()  # held: dropping it would close the connection
        next(line for line in lines if line.startswith("data: "))
        running = httpx.get(server.url + "/stats").json()
    assert running["active_requests"] == 1 and 0 < running["cache_usage"] < 1
    assert running["blocks_used"] > 0 and running["num_blocks"] == 2048
    assert httpx.get(server.url + "/health").json()["model_loaded"] is True
    wait_until_idle(server)


def test_the_model_may_be_left_out(client, server) -> None:
    """vLLM's rule: no `model` means the served one; a wrong one is still a 404."""
    served = client.completions.create(model=None, prompt="A", max_tokens=2)  # "model": null
    assert served.model == "target" and served.usage.completion_tokens == 2
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    for path, body in (
        ("/v1/completions", {"prompt": "A", "max_tokens": 2, "model": None}),
        ("/v1/chat/completions", chat),
        ("/v1/messages", chat),
    ):
        response = httpx.post(server.url + path, json=body)  # (a wrong one: the hostile suite)
        assert response.status_code == 200 and response.json()["model"] == "target"


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


def test_a_seeded_request_is_the_same_alone_and_in_a_crowd(server) -> None:
    """Sampling randomness is a pure function of (seed, sample, position): 31 other requests, some
    with n > 1 siblings, change nothing, and sample 0 of n is the request alone."""
    body = {"model": "target", "prompt": "JULIET:\n", "max_tokens": 24, "seed": 42}
    alone = httpx.post(server.base_url + "/completions", json=body, timeout=60).json()
    others = [
        {**body, "prompt": p, "seed": i, "n": 1 + i % 3, "max_tokens": 8 + i % 20}
        for i, p in enumerate(speeches(30))
    ]

    async def crowd() -> list[dict]:
        async with httpx.AsyncClient(timeout=120) as http:
            replies = await asyncio.gather(
                *(
                    http.post(server.base_url + "/completions", json=b)
                    for b in [*others[:15], body, {**body, "n": 3}, *others[15:]]
                )
            )
        return [r.json() for r in replies]

    replies = asyncio.run(crowd())
    assert all("choices" in r for r in replies), [r for r in replies if "choices" not in r]
    expected = alone["choices"][0]["text"]
    assert replies[15]["choices"][0]["text"] == expected
    assert replies[16]["choices"][0]["text"] == expected  # sample 0 of 3
    assert engine_state(server)[1:] == (0, False)


# -- clients that go away --------------------------------------------------------------------------


def wait_until_idle(server: ServerThread, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while engine_state(server)[1:] != (0, False):
        assert time.monotonic() < deadline, "the engine is still running the abandoned request"
        time.sleep(0.01)


@pytest.mark.exercise("ch09.3")
def test_a_client_that_disconnects_mid_stream_is_aborted(server) -> None:
    aborted = metric(server, 'minivllm:request_success_total{finished_reason="abort"}')
    body = {
        "model": "target",
        "prompt": "ROMEO:\n",
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    events = []
    with httpx.stream("POST", server.base_url + "/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line)
            if len(events) == 3:
                assert engine_state(server)[1] > 0
                break  # leaving the block closes the connection
    assert len(events) == 3 and '"text"' in events[-1], f"the stream ended early: {events}"
    wait_until_idle(server)
    assert metric(server, 'minivllm:request_success_total{finished_reason="abort"}') == aborted + 1


def test_a_client_that_leaves_frees_every_sample_of_n(server) -> None:
    body = {**OK, "max_tokens": 400, "ignore_eos": True, "stream": True, "n": 3}
    with httpx.stream("POST", server.base_url + "/completions", json=body, timeout=60) as response:
        for count, _ in enumerate(line for line in response.iter_lines() if line):
            if count == 6:
                assert server.engine.call(lambda e: len(e.scheduler.running)) == 3
                break
    wait_until_idle(server)


@pytest.mark.parametrize("path", ["/v1/completions", "/generate"])
def test_a_non_streaming_client_that_gives_up_is_aborted(server, path: str) -> None:
    aborted = metric(server, 'minivllm:request_success_total{finished_reason="abort"}')
    body = {"model": "target", "prompt": "JULIET:\n", "max_tokens": 400, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + path, json=body, timeout=httpx.Timeout(60, read=0.3))
    wait_until_idle(server)
    assert metric(server, 'minivllm:request_success_total{finished_reason="abort"}') == aborted + 1


# -- bad requests ----------------------------------------------------------------------------------

# The hostile-input suite (tests/test_hostile_requests.py) covers bad requests one by one.
OK = {"model": "target", "prompt": "ROMEO:", "max_tokens": 4}
CHAT = {"model": "target", "messages": [{"role": "user", "content": "Hi"}]}


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
        assert metric(server, "minivllm:engine_alive") == 0
        assert httpx.get(server.url + "/stats").json()["engine_alive"] is False
        assert httpx.post(server.url + "/generate", json={"prompt": "x"}).status_code == 503
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
            proposed = sum(p for r in trace for _, p, _ in r.speculated)
            accepted = sum(a for r in trace for _, _, a in r.speculated)
            assert metric(server, "minivllm:spec_decode_num_draft_tokens_total") == proposed
            assert metric(server, "minivllm:spec_decode_num_accepted_tokens_total") == accepted
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
