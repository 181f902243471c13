"""What the server tells its tools (issue 30): a valid OpenAPI document, metrics in one unit per
family, and a /health that notices an engine that is alive but stuck.

Every `$ref` of `/openapi.json` resolves from the document's root, and a validator reads the request
bodies through them; `/metrics` counts every sample of an `n > 1` request, finished or aborted;
`/health` answers 503 with the reason while the engine thread has work and makes no progress, and
200 again once it moves; an idle engine is not stuck. Traffic only to 127.0.0.1.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from minivllm.engine.llm_engine import LLMEngine
from minivllm.serving.server import ServerThread

pytestmark = pytest.mark.usefixtures("one_torch_thread")
BODY_ROUTES = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/messages",
    "/tokenize",
    "/detokenize",
    "/generate",
)


@pytest.fixture(scope="module")
def server(target):
    with ServerThread(LLMEngine(target)) as running:
        yield running


# -- /openapi.json ---------------------------------------------------------------------------------


def refs_in(node, path: str = "#"):
    """(where, $ref) for every $ref in a JSON document."""
    if isinstance(node, dict):
        if isinstance(node.get("$ref"), str):
            yield path, node["$ref"]
        for key, value in node.items():
            yield from refs_in(value, f"{path}/{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from refs_in(value, f"{path}/{i}")


def resolve(document: dict, ref: str):
    """The node a local `#/a/b` reference points at, from the document's root (JSON pointer)."""
    assert ref.startswith("#/"), ref
    node = document
    for part in ref[2:].split("/"):
        node = node[part.replace("~1", "/").replace("~0", "~")]
    return node


@pytest.fixture(scope="module")
def openapi(server) -> dict:
    response = httpx.get(server.url + "/openapi.json")
    assert response.status_code == 200
    return response.json()


def test_every_ref_of_the_openapi_document_resolves(openapi) -> None:
    refs = list(refs_in(openapi))
    # the six bodies, and the models inside them (messages, their parts, stream options)
    assert len(refs) > len(BODY_ROUTES)
    unresolved = []
    for where, ref in refs:
        try:
            resolve(openapi, ref)
        except (KeyError, AssertionError):
            unresolved.append((where, ref))
    assert unresolved == []
    assert not any("$defs" in where for where, _ in refs)  # nothing left in a model's own $defs
    for route in BODY_ROUTES:
        body = openapi["paths"][route]["post"]["requestBody"]
        schema = body["content"]["application/json"]["schema"]
        assert body["required"] is True
        assert schema["$ref"].startswith("#/components/schemas/")
        assert resolve(openapi, schema["$ref"])["type"] == "object"


def test_a_validator_reads_the_bodies_through_the_refs(openapi) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    referencing = pytest.importorskip("referencing")
    resource = referencing.Resource.from_contents(
        openapi, default_specification=referencing.jsonschema.DRAFT202012
    )
    registry = referencing.Registry().with_resource("urn:openapi", resource)

    def errors(route: str, body: dict) -> list[str]:
        schema = openapi["paths"][route]["post"]["requestBody"]["content"]["application/json"]
        ref = "urn:openapi" + schema["schema"]["$ref"]
        validator = jsonschema.Draft202012Validator({"$ref": ref}, registry=registry)
        return [e.message for e in validator.iter_errors(body)]

    chat = {"model": "target", "messages": [{"role": "user", "content": "Speak."}]}
    assert errors("/v1/chat/completions", chat) == []
    # the nested model (a message) is reached through its $ref and checked
    bad_message = {"model": "target", "messages": [{"role": "user", "content": 3}]}
    assert errors("/v1/chat/completions", bad_message)
    assert errors("/v1/completions", {"prompt": "ROMEO:", "max_tokens": 5}) == []
    assert errors("/v1/completions", {"prompt": "ROMEO:", "max_tokens": "five"})


def test_the_openapi_document_is_valid(openapi) -> None:
    validator = pytest.importorskip("openapi_spec_validator")
    validator.validate(openapi)


# -- /metrics: one unit per family, the sample -----------------------------------------------------


def scrape(server: ServerThread) -> dict[str, float]:
    """Every series of /metrics by name and labels, without the model_name label they all carry."""
    series = {}
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            name = name.replace('{model_name="target"}', "").replace('model_name="target",', "")
            series[name] = float(value)
    return series


PER_SAMPLE = [
    "minivllm:request_queue_time_seconds_count",
    "minivllm:request_prefill_time_seconds_count",
    "minivllm:time_to_first_token_seconds_count",
    "minivllm:request_prompt_tokens_count",
    "minivllm:e2e_request_latency_seconds_count",
]


def test_metrics_count_each_sample_of_an_n_request(server) -> None:
    before = scrape(server)
    body = {"prompt": "KING LEAR:\n", "max_tokens": 5, "n": 4, "seed": 3, "ignore_eos": True}
    answer = httpx.post(server.base_url + "/completions", json=body, timeout=60).json()
    assert len(answer["choices"]) == 4
    prompt_tokens = answer["usage"]["prompt_tokens"]
    after = scrape(server)
    change = {name: after[name] - before[name] for name in after}
    assert change['minivllm:request_success_total{finished_reason="length"}'] == 4
    for name in PER_SAMPLE:
        assert change[name] == 4, name
    assert change["minivllm:request_decode_time_seconds_count"] == 4
    assert change["minivllm:request_generation_tokens_count"] == 4
    assert change["minivllm:request_generation_tokens_sum"] == 4 * 5
    assert change["minivllm:generation_tokens_total"] == 4 * 5
    # the prompt once per sample, in the counter and in the histogram alike
    assert change["minivllm:prompt_tokens_total"] == 4 * prompt_tokens
    assert change["minivllm:request_prompt_tokens_sum"] == 4 * prompt_tokens
    # each sample's gaps are its own: 4 outputs after the first, per sample
    assert change["minivllm:inter_token_latency_seconds_count"] == 4 * 4


def test_an_aborted_request_counts_one_abort_per_sample(server) -> None:
    before = scrape(server)
    body = {
        "prompt": "ROMEO:\n",
        "max_tokens": 400,
        "n": 8,
        "seed": 1,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", server.base_url + "/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # it runs: leave it
    aborts = 'minivllm:request_success_total{finished_reason="abort"}'
    deadline = time.monotonic() + 30
    while scrape(server)[aborts] < before[aborts] + 8 and time.monotonic() < deadline:
        time.sleep(0.05)
    after = scrape(server)
    assert after[aborts] - before[aborts] == 8
    assert (
        after["minivllm:e2e_request_latency_seconds_count"]
        - before["minivllm:e2e_request_latency_seconds_count"]
        == 8
    )
    assert server.engine.blocks_in_use() == 0


def test_the_gauges_count_samples(server) -> None:
    """A waiting n=3 request is 3 in num_requests_waiting (its forks wait inside it)."""
    engine, gate, holding = server.engine, threading.Event(), threading.Event()
    answers: dict[str, httpx.Response] = {}

    def hold(_) -> None:
        holding.set()
        gate.wait(30)

    def inbox_holds(count: int) -> None:
        deadline = time.monotonic() + 10
        while len(engine._inbox) < count and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(engine._inbox) >= count

    def get(name: str, call) -> threading.Thread:
        thread = threading.Thread(target=lambda: answers.update({name: call()}))
        thread.start()
        return thread

    body = {"prompt": "ROMEO:\n", "max_tokens": 30, "n": 3, "seed": 1, "ignore_eos": True}
    engine.submit(hold)
    try:
        assert holding.wait(30)
        # behind the hold, in this order: the request is added, then the metrics are read
        post = get("post", lambda: httpx.post(server.base_url + "/completions", json=body))
        inbox_holds(1)
        scrape_ = get("metrics", lambda: httpx.get(server.url + "/metrics"))
        inbox_holds(2)
    finally:
        gate.set()
    post.join(60)
    scrape_.join(60)
    assert answers["post"].status_code == 200
    lines = answers["metrics"].text.splitlines()
    assert 'minivllm:num_requests_waiting{model_name="target"} 3' in lines
    assert 'minivllm:num_requests_running{model_name="target"} 0' in lines


# -- /health: alive is not enough ------------------------------------------------------------------


def test_health_fails_while_the_engine_makes_no_progress_with_work_waiting(server) -> None:
    engine, gate, holding = server.engine, threading.Event(), threading.Event()
    engine.stall_timeout = 0.3
    try:
        time.sleep(0.5)  # idle for longer than the limit: nothing waits, so nothing is stuck
        assert httpx.get(server.url + "/health").status_code == 200

        def stuck(_) -> None:  # a round of the engine thread that does not return
            holding.set()
            gate.wait(30)

        engine.submit(stuck)
        assert holding.wait(30)
        deadline, health = time.monotonic() + 10, None
        while time.monotonic() < deadline:
            health = httpx.get(server.url + "/health", timeout=10)
            if health.status_code != 200:
                break
            time.sleep(0.05)
        assert health.status_code == 503
        error = health.json()["error"]
        assert error["code"] == "engine_stalled" and "no progress" in error["message"]
        assert engine.is_alive  # alive, but stuck
    finally:
        gate.set()
    # it moves again: healthy again (within the next round)
    deadline = time.monotonic() + 10
    while httpx.get(server.url + "/health").status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        assert httpx.get(server.url + "/health").json() == {"status": "ok", "model_loaded": True}
    finally:
        engine.stall_timeout = 60.0
