"""Chapter 09: no request can hurt the server or anyone else on it.

Each hostile request -- wrong types, out-of-range and huge numbers, NaN, bad encodings, truncated or
deeply nested JSON, the wrong content type, bodies and lists past the limits, unknown fields --
gets a 4xx with a conforming error body (OpenAI's on the OpenAI endpoints and on forge-infer's
/generate, Anthropic's on /v1/messages), a message of bounded length, the engine left exactly as it
was, and the server then serves a normal request as before. The first cases are the ones that,
before, killed the engine, answered 500 or took seconds to refuse.
"""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest

from minivllm.engine.llm_engine import LLMEngine
from minivllm.serving.limits import PARSE_INLINE_BYTES, ServerLimits, cap, off_the_loop_if_big
from minivllm.serving.server import ServerThread

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Small limits, so each "too much" case is cheap to send.
LIMITS = ServerLimits(
    max_body_bytes=64 * 1024,
    max_prompts=8,
    max_stop_strings=4,
    max_stop_length=32,
    max_messages=16,
    max_error_chars=600,
)
OK = {"model": "target", "prompt": "ROMEO:", "max_tokens": 2}
CHAT = {"model": "target", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
ANTHROPIC = {"model": "target", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
GEN = {"prompt": "ROMEO:", "max_tokens": 2}  # forge-infer's /generate: no model needed
C, CC, M, G = "/v1/completions", "/v1/chat/completions", "/v1/messages", "/generate"
DEEP = "[" * 30_000 + "]" * 30_000  # past Python's recursion limit, within the body limit
NEARLY_DEEP = "[" * 900 + "]" * 900  # parses; must not break what reads it later (a repr)
HUGE_INT = "1" + "0" * 5000  # past Python's 4,300-digit limit for int()


def case(path, body, status, words, param=None, content_type="application/json", id=None):
    """A hostile request: `body` is sent as JSON unless it is str or bytes (sent as they are)."""
    return pytest.param(path, body, status, words, param, content_type, id=id)


CASES = [
    # -- the cases of the issue: before, these killed the engine, answered 500 or took seconds
    case(C, {**OK, "top_k": 2**63}, 400, "top_k: Input should be less than", "top_k", id="top_k"),
    case(C, {**OK, "model": "\ud800"}, 404, "does not exist", "model", id="lone-surrogate-model"),
    case(C, {**OK, "prompt": "x" * 100_000}, 413, "at most 65536", id="huge-prompt-body"),
    case(C, {**OK, "prompt": ["a"] * 3000}, 400, "3000 prompts", "prompt", id="3000-prompts"),
    case(C, {**OK, "stop": ["a"] * 1000}, 400, "1000 strings", "stop", id="1000-stops"),
    case(C, {**OK, "prompt": [*["x"] * 2999, 5]}, 400, "and ", "prompt", id="3000-bad-prompts"),
    # -- the body: encodings, JSON, content types
    case(C, "{", 400, "not valid JSON", id="truncated-json"),
    case(C, '{"model": "target", "prompt": "ab', 400, "not valid JSON", id="unterminated-string"),
    case(C, "", 400, "the body is empty", id="empty-body"),
    case(C, "   ", 400, "not valid JSON", id="whitespace-body"),
    case(C, "[1, 2]", 400, "must be a JSON object", id="array-body"),
    case(C, '"text"', 400, "must be a JSON object", id="string-body"),
    case(C, "null", 400, "must be a JSON object", id="null-body"),
    case(C, "42", 400, "must be a JSON object", id="number-body"),
    case(C, b"\xff\xfe{}", 400, "not valid UTF-8", id="not-utf8"),
    case(C, json.dumps(OK).encode("utf-16"), 400, "not valid UTF-8", id="utf16-body"),
    case(C, "\ufeff" + json.dumps(OK), 400, "not valid JSON", id="byte-order-mark"),
    case(C, DEEP, 400, "nested too deeply", id="deeply-nested-array"),
    case(C, '{"model": "target", "prompt": ' + DEEP + "}", 400, "nested", id="deep-prompt"),
    case(
        C,
        '{"model": "target", "prompt": "x", "seed": ' + HUGE_INT + "}",
        400,
        "not valid JSON",
        id="5000-digit-int",
    ),
    case(C, '{"model": "target", "prompt": "x", "temperature": NaN}', 400, "NaN", id="nan"),
    case(C, '{"model": "target", "prompt": "x", "top_p": Infinity}', 400, "Infinity", id="inf"),
    case(
        C, '{"model": "target", "prompt": "x", "min_p": -Infinity}', 400, "Infinity", id="minus-inf"
    ),
    case(C, json.dumps(OK), 415, "must be JSON", content_type="text/plain", id="text-plain"),
    case(
        C,
        "prompt=x",
        415,
        "must be JSON",
        content_type="application/x-www-form-urlencoded",
        id="form-body",
    ),
    case(
        C,
        json.dumps(OK),
        415,
        "must be JSON",
        content_type="multipart/form-data; boundary=x",
        id="multipart",
    ),
    # -- types
    case(C, {**OK, "model": ""}, 404, "does not exist", "model", id="model-empty"),
    case(C, {"model": "target"}, 400, "prompt: Field required", "prompt", id="no-prompt"),
    case(C, {**OK, "model": 5}, 400, "valid string", "model", id="model-int"),
    case(C, {**OK, "model": ["target"]}, 400, "valid string", "model", id="model-list"),
    case(
        C,
        {**OK, "prompt": 5},
        400,
        "prompt.str: Input should be a valid string",
        "prompt",
        id="prompt-int",
    ),
    case(C, {**OK, "prompt": {"a": 1}}, 400, "valid string", "prompt", id="prompt-object"),
    case(C, {**OK, "prompt": True}, 400, "valid string", "prompt", id="prompt-bool"),
    case(C, {**OK, "prompt": []}, 400, "at least 1 item", "prompt", id="prompt-empty-list"),
    case(C, {**OK, "prompt": [[]]}, 400, "at least 1 item", "prompt", id="prompt-empty-ids"),
    case(C, {**OK, "prompt": ["a", 1]}, 400, "valid string", "prompt", id="prompt-mixed"),
    case(C, {**OK, "prompt": [1.5]}, 400, "valid integer", "prompt", id="prompt-float-id"),
    case(
        C,
        {**OK, "prompt": [-1]},
        400,
        "greater than or equal to 0",
        "prompt",
        id="prompt-negative-id",
    ),
    case(
        C,
        {**OK, "prompt": [300]},
        400,
        "outside the vocabulary",
        "prompt",
        id="prompt-id-past-vocab",
    ),
    case(C, {**OK, "prompt": [2**40]}, 400, "less than or equal to", "prompt", id="prompt-id-2^40"),
    case(C, {**OK, "max_tokens": "8"}, 400, "valid integer", "max_tokens", id="max_tokens-str"),
    case(C, {**OK, "max_tokens": 8.5}, 400, "valid integer", "max_tokens", id="max_tokens-float"),
    case(C, {**OK, "max_tokens": True}, 400, "valid integer", "max_tokens", id="max_tokens-bool"),
    case(C, {**OK, "temperature": "hot"}, 400, "valid number", "temperature", id="temp-str"),
    case(C, {**OK, "temperature": [1]}, 400, "valid number", "temperature", id="temp-list"),
    case(C, {**OK, "stream": "yes"}, 400, "valid boolean", "stream", id="stream-str"),
    case(C, {**OK, "stream": 1}, 400, "valid boolean", "stream", id="stream-int"),
    case(C, {**OK, "echo": "yes"}, 400, "valid boolean", "echo", id="echo-str"),
    case(C, {**OK, "logprobs": True}, 400, "valid integer", "logprobs", id="logprobs-bool"),
    case(C, {**OK, "stop": 5}, 400, "valid string", "stop", id="stop-int"),
    case(C, {**OK, "stop": [["x"]]}, 400, "valid string", "stop", id="stop-nested"),
    case(
        C,
        {**OK, "stream_options": {"include_usage": "yes"}},
        400,
        "valid boolean",
        "stream_options",
        id="stream_options-str",
    ),
    case(
        C,
        {**OK, "stream_options": {"bogus": 1}},
        400,
        "Extra inputs",
        "stream_options",
        id="stream_options-unknown",
    ),
    case(C, {**OK, "logit_bias": [1]}, 400, "valid dictionary", "logit_bias", id="logit_bias-list"),
    # -- bounds and huge numbers
    case(C, {**OK, "max_tokens": 0}, 400, "greater than or equal to 1", "max_tokens", id="mt-0"),
    case(C, {**OK, "max_tokens": -5}, 400, "greater than or equal to 1", "max_tokens", id="mt-neg"),
    case(C, {**OK, "max_tokens": 2**31}, 400, "less than or equal to", "max_tokens", id="mt-2^31"),
    case(
        C, {**OK, "max_tokens": 10**30}, 400, "less than or equal to", "max_tokens", id="mt-10^30"
    ),
    case(C, {**OK, "max_tokens": 510}, 400, "lower max_tokens", "prompt", id="mt-past-context"),
    case(
        C,
        {**OK, "temperature": -1},
        400,
        "greater than or equal to 0",
        "temperature",
        id="temp-neg",
    ),
    case(
        C,
        {**OK, "temperature": 1e308},
        400,
        "less than or equal to 2",
        "temperature",
        id="temp-1e308",
    ),
    case(C, {**OK, "top_p": 0}, 400, "greater than 0", "top_p", id="top_p-0"),
    case(C, {**OK, "top_p": 1.5}, 400, "less than or equal to 1", "top_p", id="top_p-1.5"),
    case(C, {**OK, "top_k": -2}, 400, "greater than or equal to -1", "top_k", id="top_k-neg"),
    case(C, {**OK, "n": 0}, 400, "greater than or equal to 1", "n", id="n-0"),
    case(C, {**OK, "n": 10**6}, 400, "less than or equal to 16", "n", id="n-million"),
    case(C, {**OK, "seed": -1}, 400, "greater than or equal to 0", "seed", id="seed-neg"),
    case(C, {**OK, "seed": 2**64}, 400, "less than", "seed", id="seed-2^64"),
    case(
        C,
        {**OK, "presence_penalty": 3},
        400,
        "less than or equal to 2",
        "presence_penalty",
        id="presence-3",
    ),
    case(
        C,
        {**OK, "frequency_penalty": -3},
        400,
        "greater than or equal to -2",
        "frequency_penalty",
        id="frequency-neg3",
    ),
    case(
        C,
        {**OK, "repetition_penalty": 0},
        400,
        "greater than 0",
        "repetition_penalty",
        id="repetition-0",
    ),
    case(C, {**OK, "min_p": 2}, 400, "less than or equal to 1", "min_p", id="min_p-2"),
    case(
        C,
        {**OK, "min_tokens": 5},
        400,
        "min_tokens must be",
        "min_tokens",
        id="min_tokens-past-max",
    ),
    case(C, {**OK, "logprobs": 21}, 400, "less than or equal to 20", "logprobs", id="logprobs-21"),
    case(
        C,
        {**OK, "logit_bias": {"x": 1}},
        400,
        "keys must be token ids",
        "logit_bias",
        id="logit_bias-key",
    ),
    case(
        C,
        {**OK, "logit_bias": {"65": 1000}},
        400,
        "less than or equal to 100",
        "logit_bias",
        id="logit_bias-value",
    ),
    case(
        C,
        {**OK, "logit_bias": {"99999": 1}},
        400,
        "outside the vocabulary",
        "logit_bias",
        id="logit_bias-past-vocab",
    ),
    case(
        C,
        {**OK, "stop_token_ids": [300]},
        400,
        "outside the vocabulary",
        "stop_token_ids",
        id="stop_token_ids-past-vocab",
    ),
    case(
        C,
        {**OK, "allowed_token_ids": []},
        400,
        "at least 1 item",
        "allowed_token_ids",
        id="allowed-empty",
    ),
    case(
        C,
        {**OK, "truncate_prompt_tokens": 0},
        400,
        "greater than or equal to 1",
        "truncate_prompt_tokens",
        id="truncate-0",
    ),
    case(C, {**OK, "stop": [""]}, 400, "must not be empty", "stop", id="stop-empty"),
    # -- limits
    case(C, {**OK, "prompt": ["a"] * 9}, 400, "at most 8", "prompt", id="9-prompts"),
    case(C, {**OK, "stop": ["a", "b", "c", "d", "e"]}, 400, "at most 4", "stop", id="5-stops"),
    case(C, {**OK, "stop": "x" * 33}, 400, "at most 32", "stop", id="long-stop"),
    case(C, {**OK, "bad_words": ["w"] * 5}, 400, "at most 4", "bad_words", id="5-bad-words"),
    case(
        C,
        {**OK, "prompt": "x" * 600},
        400,
        "exceeds the model's context of 512",
        "prompt",
        id="prompt-past-context",
    ),
    case(
        C,
        {**OK, "prompt": ["ok", "x" * 600]},
        400,
        "exceeds the model's context",
        "prompt",
        id="second-prompt-past-context",
    ),
    case(
        C,
        {**OK, "prompt": "€" * 300},
        400,
        "exceeds the model's context",
        "prompt",
        id="multibyte-past-context",
    ),
    # -- fields refused rather than ignored
    case(C, {**OK, "suffix": "x"}, 400, "suffix is not supported", "suffix", id="suffix"),
    case(C, {**OK, "best_of": 2}, 400, "best_of is not supported", "best_of", id="best_of"),
    case(C, {**OK, "use_beam_search": True}, 400, "not supported", "use_beam_search", id="beam"),
    case(
        C,
        {**OK, "guided_json": {"type": "object"}},
        400,
        "not supported",
        "guided_json",
        id="guided_json",
    ),
    case(C, {**OK, "temprature": 0}, 400, "unknown field 'temprature'", "temprature", id="typo"),
    case(C, {**OK, "x" * 5000: 1}, 400, "unknown field", id="long-unknown-field"),
    case(
        C,
        json.dumps(OK)[:-1] + ', "x": ' + NEARLY_DEEP + "}",
        400,
        "unknown field 'x'",
        "x",
        id="nearly-deep-unknown-field",
    ),
    case(
        C,
        json.dumps(OK)[:-1] + ', "suffix": ' + NEARLY_DEEP + "}",
        400,
        "not supported",
        "suffix",
        id="nearly-deep-suffix",
    ),
    case(
        C,
        json.dumps(OK)[:-1] + ', "stop": ' + NEARLY_DEEP + "}",
        400,
        "valid string",
        "stop",
        id="nearly-deep-stop",
    ),
    case(
        CC,
        {**CHAT, "response_format": {"type": "json_object"}},
        400,
        "not supported",
        "response_format",
        id="response_format",
    ),
    case(
        CC,
        {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]},
        400,
        "tools is not supported",
        "tools",
        id="tools",
    ),
    case(
        CC, {**CHAT, "tool_choice": "auto"}, 400, "not supported", "tool_choice", id="tool_choice"
    ),
    case(
        C,
        {**OK, "prompt_logprobs": 1},
        400,
        "not supported",
        "prompt_logprobs",
        id="prompt_logprobs",
    ),
    case(
        C,
        {**OK, "add_special_tokens": False},
        400,
        "not supported",
        "add_special_tokens",
        id="add_special_tokens",
    ),
    case(CC, {**CHAT, "echo": True}, 400, "echo is not supported", "echo", id="chat-echo"),
    # -- chat
    case(CC, {**CHAT, "messages": []}, 400, "at least 1 item", "messages", id="no-messages"),
    case(CC, {**CHAT, "messages": "Hi"}, 400, "valid list", "messages", id="messages-str"),
    case(
        CC,
        {**CHAT, "messages": [{"role": "tool", "content": "x"}]},
        400,
        "messages.0.role: Input should be",
        "messages",
        id="role-tool",
    ),
    case(
        CC,
        {**CHAT, "messages": [{"role": "user"}]},
        400,
        "Field required",
        "messages",
        id="no-content",
    ),
    case(
        CC,
        {**CHAT, "messages": [{"role": "user", "content": ""}]},
        400,
        "empty content",
        "messages",
        id="empty-content",
    ),
    case(
        CC,
        {**CHAT, "messages": [{"role": "user", "content": 5}]},
        400,
        "valid string",
        "messages",
        id="content-int",
    ),
    case(
        CC,
        {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        "'text'",
        "messages",
        id="image-part",
    ),
    case(
        CC,
        {**CHAT, "messages": [{"role": "user", "content": "x", "name": "A:B"}]},
        400,
        "pattern",
        "messages",
        id="name-colon",
    ),
    case(
        CC,
        {**CHAT, "messages": [{"role": "user", "content": "x", "extra": 1}]},
        400,
        "Extra inputs",
        "messages",
        id="message-extra",
    ),
    case(
        CC,
        {**CHAT, "messages": [{"role": "user", "content": "x"}] * 17},
        400,
        "at most 16",
        "messages",
        id="17-messages",
    ),
    case(
        CC,
        {**CHAT, "messages": [{"role": "user", "content": "x" * 600}]},
        400,
        "exceeds the model's context",
        "messages",
        id="chat-past-context",
    ),
    case(
        CC,
        {**CHAT, "max_completion_tokens": 0},
        400,
        "greater than or equal to 1",
        "max_completion_tokens",
        id="mct-0",
    ),
    case(CC, {**CHAT, "top_logprobs": 3}, 400, "needs logprobs", id="top_logprobs-alone"),
    case(
        CC,
        {**CHAT, "logprobs": True, "top_logprobs": 21},
        400,
        "less than or equal to 20",
        "top_logprobs",
        id="top_logprobs-21",
    ),
    case(CC, {**CHAT, "model": "nope"}, 404, "does not exist", "model", id="chat-unknown-model"),
    # -- the Anthropic Messages API: the same checks, Anthropic's error body
    case(M, "{", 400, "not valid JSON", id="messages-truncated-json"),
    case(
        M,
        {k: v for k, v in ANTHROPIC.items() if k != "max_tokens"},
        400,
        "max_tokens: Field required",
        id="messages-no-max_tokens",
    ),
    case(
        M,
        {**ANTHROPIC, "temperature": 1.5},
        400,
        "less than or equal to 1",
        id="messages-temperature",
    ),
    case(M, {**ANTHROPIC, "messages": []}, 400, "at least 1 item", id="messages-empty"),
    case(
        M,
        {**ANTHROPIC, "messages": [{"role": "system", "content": "x"}]},
        400,
        "Input should be 'user' or 'assistant'",
        id="messages-system-role",
    ),
    case(
        M,
        {**ANTHROPIC, "messages": [{"role": "user", "content": []}]},
        400,
        "at least 1 item",
        id="messages-empty-blocks",
    ),
    case(
        M,
        {**ANTHROPIC, "messages": [{"role": "user", "content": " "}]},
        400,
        "empty content",
        id="messages-blank",
    ),
    case(
        M,
        {**ANTHROPIC, "stop_sequences": [""]},
        400,
        "at least 1 character",
        id="messages-empty-stop",
    ),
    case(M, {**ANTHROPIC, "stop_sequences": ["s"] * 5}, 400, "at most 4", id="messages-5-stops"),
    case(M, {**ANTHROPIC, "top_k": -1}, 400, "greater than or equal to 0", id="messages-top_k"),
    case(
        M,
        {**ANTHROPIC, "tools": [{"name": "f"}]},
        400,
        "tools is not supported",
        id="messages-tools",
    ),
    case(M, {**ANTHROPIC, "bogus": 1}, 400, "unknown field", id="messages-unknown-field"),
    case(M, {**ANTHROPIC, "model": "claude"}, 404, "does not exist", id="messages-unknown-model"),
    case(
        M,
        {**ANTHROPIC, "system": "x" * 600},
        400,
        "exceeds the model's context",
        id="messages-past-context",
    ),
    case(
        M,
        json.dumps(ANTHROPIC),
        415,
        "must be JSON",
        content_type="text/plain",
        id="messages-text-plain",
    ),
    case(M, {**ANTHROPIC, "pad": "x" * 70_000}, 413, "at most 65536", id="messages-too-large"),
    # -- forge-infer's native /generate: the same checks and limits (the same code as above: a
    # sample of each kind, and what is its own -- one prompt, text or ids, and n = 1)
    case(G, "{", 400, "not valid JSON", id="generate-truncated-json"),
    case(G, {"max_tokens": 2}, 400, "prompt: Field required", "prompt", id="generate-no-prompt"),
    case(G, {**GEN, "prompt": 5}, 400, "valid string", "prompt", id="generate-prompt-int"),
    case(G, {**GEN, "prompt": []}, 400, "at least 1 item", "prompt", id="generate-prompt-empty"),
    case(G, {**GEN, "prompt": ["a"]}, 400, "valid integer", "prompt", id="generate-prompt-list"),
    case(G, {**GEN, "prompt": [300]}, 400, "outside the vocabulary", "prompt", id="generate-id"),
    case(G, {**GEN, "prompt": "x" * 600}, 400, "context of 512", "prompt", id="generate-long"),
    case(G, {**GEN, "model": "gpt-4"}, 404, "does not exist", "model", id="generate-model"),
    case(G, {**GEN, "max_tokens": "8"}, 400, "valid integer", "max_tokens", id="generate-mt-str"),
    case(G, {**GEN, "max_tokens": 510}, 400, "lower max_tokens", "prompt", id="generate-mt-long"),
    case(G, {**GEN, "top_k": 2**63}, 400, "less than", "top_k", id="generate-top_k"),
    case(G, '{"prompt": "x", "temperature": NaN}', 400, "NaN", id="generate-nan"),
    case(G, {**GEN, "n": 2}, 400, "n must be 1", "n", id="generate-n"),
    case(G, {**GEN, "stop": ["s"] * 5}, 400, "at most 4", "stop", id="generate-5-stops"),
    case(G, {**GEN, "bad_words": ["w"] * 5}, 400, "at most 4", "bad_words", id="generate-bad"),
    case(
        G,
        {**GEN, "stop_token_ids": [300]},
        400,
        "outside the vocabulary",
        "stop_token_ids",
        id="generate-stop_token_ids",
    ),
    case(G, {**GEN, "echo": True}, 400, "unknown field 'echo'", "echo", id="generate-echo"),
    # -- astrai's /stats is GET only
    case("/stats", OK, 405, "Method Not Allowed", id="post-to-stats"),
    # -- vLLM's extras and the routes
    case("/tokenize", {"model": "target"}, 400, "either prompt or messages", id="tokenize-none"),
    case(
        "/detokenize",
        {"tokens": [300]},
        400,
        "outside the vocabulary",
        "tokens",
        id="detokenize-past-vocab",
    ),
    case(
        "/detokenize",
        {"tokens": [-1]},
        400,
        "greater than or equal to 0",
        "tokens",
        id="detokenize-negative",
    ),
    case("/v1/nothing-here", OK, 404, "Not Found", id="no-such-route"),
    case("/v1/models", OK, 405, "Method Not Allowed", id="post-to-get-route"),
]


@pytest.fixture(scope="module")
def server(target):
    with ServerThread(LLMEngine(target), limits=LIMITS) as running:
        yield running


def engine_state(server: ServerThread) -> tuple:
    return server.engine.call(
        lambda e: (len(e.trace), e.manager.allocator.num_used, e.has_unfinished())
    )


def assert_conforming(path: str, response: httpx.Response) -> str:
    """The error body has exactly the API's shape; returns its message."""
    body = response.json()
    if path == M:
        assert set(body) == {"type", "error"} and body["type"] == "error", body
        assert set(body["error"]) == {"type", "message"}, body
        error = body["error"]
    else:
        assert set(body) == {"error"}, body
        error = body["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert error["param"] is None or isinstance(error["param"], str)
    assert isinstance(error["type"], str) and isinstance(error["message"], str)
    assert len(error["message"]) <= LIMITS.max_error_chars
    return error["message"]


@pytest.mark.parametrize("path, body, status, words, param, content_type", CASES)
def test_a_hostile_request_is_refused_and_hurts_nobody(
    server, path, body, status, words, param, content_type
) -> None:
    before = engine_state(server)
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    response = httpx.post(
        server.url + path, content=content, headers={"content-type": content_type}, timeout=30
    )
    assert response.status_code == status, response.text[:500]
    message = assert_conforming(path, response)
    assert words in message, message
    if param is not None:
        assert response.json()["error"]["param"] == param
    assert engine_state(server) == before  # nothing reached the engine
    # ...and the next client is served as if nothing had happened
    served = httpx.post(server.base_url + "/completions", json={**OK, "temperature": 0}, timeout=30)
    assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 2
    assert engine_state(server)[1:] == (0, False)


def test_the_suite_covers_the_issue_and_fifty_more() -> None:
    assert len(CASES) >= 6 + 50


@pytest.mark.parametrize(
    "prompt",
    ["\ud800 a lone surrogate", "NUL \x00 inside", "emoji 🎭 and RTL שלום", "\u202e reversed"],
    ids=["surrogate", "nul", "emoji-rtl", "bidi-override"],
)
def test_strange_but_valid_text_is_served(server, prompt: str) -> None:
    """Text that is odd, not wrong: served, with a body that is valid JSON."""
    body = json.dumps({**OK, "prompt": prompt, "temperature": 0})  # ASCII: "\\ud800" escaped
    response = httpx.post(
        server.base_url + "/completions", content=body, headers={"content-type": "application/json"}
    )
    assert response.status_code == 200 and response.json()["choices"][0]["finish_reason"]


@pytest.mark.parametrize("path", [C, G])
def test_a_body_larger_than_it_says_is_cut_off_at_the_limit(server, path: str) -> None:
    """A chunked body (no Content-Length) is counted as it arrives."""

    def chunks():
        yield b'{"prompt": "'
        for _ in range(100):
            yield b"x" * 1024
        yield b'"}'

    response = httpx.post(
        server.url + path, content=chunks(), headers={"content-type": "application/json"}
    )
    assert response.status_code == 413 and "at most 65536" in assert_conforming(path, response)


def test_error_messages_are_capped() -> None:
    assert cap("short", 100) == "short"
    capped = cap("x" * 10_000, 100)
    assert len(capped) == 100 and capped.endswith("(9900 more characters)")


def test_big_bodies_are_parsed_off_the_event_loop() -> None:
    """A body past PARSE_INLINE_BYTES is parsed (and its prompts tokenised) on a worker thread, so
    the event loop goes on serving the streams; a small one is not worth the hand-over."""

    async def threads() -> tuple[int, int, int]:
        small = await off_the_loop_if_big(PARSE_INLINE_BYTES, threading.get_ident)
        big = await off_the_loop_if_big(PARSE_INLINE_BYTES + 1, threading.get_ident)
        return threading.get_ident(), small, big

    loop_thread, small, big = asyncio.run(threads())
    assert small == loop_thread != big
