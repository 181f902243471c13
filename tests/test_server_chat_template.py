"""Chapter 09's server on a real chat checkpoint: the conversation laid out by the model's template.

A tiny random Qwen3 checkpoint with a BPE tokenizer and a ChatML template (conftest's
`chat_checkpoint`). `/v1/chat/completions`, `/v1/messages` (its `system` the first message) and
`/tokenize` read the prompt ids transformers' `apply_chat_template(..., add_generation_prompt=True)`
gives, the same as `LLM.chat`'s, content given as text parts too; the answer is the offline
engine's, streamed or not, and ends on the template's end-of-turn token (no play's blank line); a
conversation the template refuses ("roles must alternate") is a 400 with the template's message,
in each API's error shape, and the server goes on serving.
"""

from __future__ import annotations

import json

import httpx
import pytest

from minivllm.engine.config import EngineConfig
from minivllm.engine.llm_engine import LLM, LLMEngine
from minivllm.engine.processing import EngineRequest
from minivllm.model.checkpoint import load_model
from minivllm.model.hf_tokenizer import load_tokenizer
from minivllm.sched.sequence import SamplingParams
from minivllm.serving.server import ServerThread

pytestmark = pytest.mark.usefixtures("one_torch_thread")
transformers = pytest.importorskip("transformers")

CONVERSATION = [
    {"role": "system", "content": "Answer in French."},
    {"role": "user", "content": "café? 日本"},
    {"role": "assistant", "content": "Oui 🙂"},
    {"role": "user", "content": [{"type": "text", "text": "naïve"}, {"type": "text", "text": "!"}]},
]
# what a template reads: text parts joined with newlines (vLLM's "string" content format)
AS_TEXT = [*CONVERSATION[:3], {"role": "user", "content": "naïve\n!"}]
GREEDY = {"temperature": 0, "max_tokens": 8}


def engine_config() -> EngineConfig:
    return EngineConfig(num_blocks=64, block_size=8, device="cpu")


@pytest.fixture(scope="module")
def served(chat_checkpoint):
    """The server, and every (prompt ids, SamplingParams) its engine is given."""
    model, tokenizer = load_model(chat_checkpoint), load_tokenizer(chat_checkpoint)
    engine = LLMEngine(model, engine_config(), tokenizer)
    given = []
    add_request = engine.add_request

    def recording(prompt, params=None, request_id=None, group=None):
        if isinstance(prompt, EngineRequest):  # what the server hands over: checked once
            given.append((list(prompt.prompt_ids), prompt.params))
        else:
            given.append((list(prompt), params))
        return add_request(prompt, params, request_id, group)

    engine.add_request = recording
    with ServerThread(engine, model_name="tiny-qwen3") as server:
        yield server, given


@pytest.fixture(scope="module")
def theirs(chat_checkpoint) -> list[int]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(chat_checkpoint))
    ids = tokenizer.apply_chat_template(AS_TEXT, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # transformers 5: an encoding


def test_every_door_reads_transformers_prompt_ids(served, theirs, chat_checkpoint) -> None:
    server, given = served
    del given[:]
    body = {"model": "tiny-qwen3", "messages": CONVERSATION, **GREEDY}
    whole = httpx.post(server.base_url + "/chat/completions", json=body, timeout=60).json()
    (prompt, params), *_ = given
    assert prompt == theirs and whole["usage"]["prompt_tokens"] == len(theirs)
    assert params.stop == ()  # the template's turn ends on its EOS token, not a blank line
    # Anthropic's system field is the first message; its blocks are text parts
    anthropic = {
        "system": [{"type": "text", "text": "Answer in French."}],
        "messages": [
            *CONVERSATION[1:3],
            {"role": "user", "content": [{"type": "text", "text": t} for t in ("naïve", "!")]},
        ],
        **GREEDY,
    }
    message = httpx.post(server.url + "/v1/messages", json=anthropic, timeout=60).json()
    assert given[-1][0] == theirs and message["usage"]["input_tokens"] == len(theirs)
    tokenized = httpx.post(server.url + "/tokenize", json={"messages": CONVERSATION}).json()
    assert tokenized["tokens"] == theirs
    # LLM.chat lays it out in the same place
    llm = LLM(str(chat_checkpoint), num_blocks=64, block_size=8, device="cpu")
    [offline] = llm.chat(CONVERSATION, SamplingParams(**GREEDY), use_tqdm=False)
    assert offline.prompt_token_ids == theirs
    assert whole["choices"][0]["message"]["content"] == offline.outputs[0].text
    assert message["content"][0]["text"] == offline.outputs[0].text


def test_a_streamed_chat_is_the_whole_one(served) -> None:
    server, _ = served
    body = {"messages": CONVERSATION, **GREEDY}
    whole = httpx.post(server.base_url + "/chat/completions", json=body, timeout=60).json()
    with httpx.stream(
        "POST", server.base_url + "/chat/completions", json={**body, "stream": True}, timeout=60
    ) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == whole["choices"][0]["message"]["content"]
    reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]]
    assert reasons == [whole["choices"][0]["finish_reason"]]


def test_a_conversation_the_template_refuses_is_a_400_with_its_message(served) -> None:
    server, given = served
    twice = [{"role": "user", "content": "Hello"}, {"role": "user", "content": "again"}]
    before = len(given)
    openai = httpx.post(server.base_url + "/chat/completions", json={"messages": twice})
    assert openai.status_code == 400
    error = openai.json()["error"]
    assert error["param"] == "messages" and error["type"] == "invalid_request_error"
    assert "Conversation roles must alternate user/assistant/user/assistant/..." in error["message"]
    anthropic = httpx.post(server.url + "/v1/messages", json={"max_tokens": 4, "messages": twice})
    assert anthropic.status_code == 400
    assert anthropic.json()["error"]["type"] == "invalid_request_error"
    assert "roles must alternate" in anthropic.json()["error"]["message"]
    late_system = [*twice[:1], {"role": "system", "content": "Be brief."}]
    tokenize = httpx.post(server.url + "/tokenize", json={"messages": late_system})
    assert tokenize.status_code == 400 and "A system message must come first" in tokenize.text
    assert len(given) == before  # nothing reached the engine
    alone = {"messages": twice[:1], "max_tokens": 2}
    healthy = httpx.post(server.base_url + "/chat/completions", json=alone)
    assert healthy.status_code == 200
