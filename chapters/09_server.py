# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Chapter 09 — Serving: an OpenAI-compatible HTTP server
#
# :::{admonition} At a glance
# - **Builds:** an OpenAI- and Anthropic-compatible HTTP server over the engine: streaming,
#   isolation and limits, parallel sampling, metrics.
# - **Needs:** chapter 04; HTTP and asyncio in outline.
# - **Runs in:** about 1 min, start to end (`make book` on a quiet 2-core AMD EPYC).
# :::
#
# The engine of chapters 04–06 batches whatever requests it holds, but only a Python program in the
# same process can hand it any. Real clients arrive over HTTP, one connection each, at moments of
# their own choosing, and most of them speak one dialect: OpenAI's API. This chapter puts the engine
# behind that API — `POST /v1/completions`, `POST /v1/chat/completions`, streaming as
# {term}`Server-Sent Events <Server-Sent Events (SSE)>` — so that the official `openai` client works
# against it unchanged, and so that a thousand clients share one continuously batched engine
# {cite}`yu2022orca,kwon2023pagedattention` instead of queueing for it.

# %% tags=["remove-input"] mystnb={"image": {"alt": "The roadmap of the engine, chapter 09 highlighted: the chapters before it built, those after it to come"}}
from minivllm.book.figures.roadmap import roadmap

roadmap(9)

# %%
import asyncio
import json
import random
import threading
import time
from textwrap import shorten

import anthropic
import httpx
import matplotlib.pyplot as plt
import numpy as np
import openai
import torch

from minivllm import EngineConfig, LLMEngine, SamplingParams
from minivllm.book import show, use_book_style
from minivllm.book.figures.blocks import (
    block_legend,
    block_owners,
    draw_block_pool,
    draw_block_tables,
)
from minivllm.book.figures.timelines import draw_gantt
from minivllm.book.stats import speed_change
from minivllm.engine import processing
from minivllm.model.checkpoint import load_model
from minivllm.runner.sampler import derive_seed
from minivllm.serving import async_engine, endpoints, openai_protocol, responses
from minivllm.serving.client import (
    StreamedCompletion,
    run_clients,
    stream_completion,
    streams_beside,
)
from minivllm.serving.openai_protocol import ChatMessage, render_chat, sse_event
from minivllm.serving.server import ServerThread
from minivllm.training.corpus import shipped_validation_text

torch.manual_seed(0)
torch.set_num_threads(2)
use_book_style()
target = load_model("target")
speeches = [s for s in shipped_validation_text().split("\n\n") if s.isascii() and len(s) > 120]
print(f"{len(speeches)} speeches from the held-out plays to use as prompts")

# %% [markdown]
# ## Why: one engine, reached one request at a time
#
# The simplest server is a handler that calls the engine: `engine.generate([prompt])`, return the
# text. But `generate` runs until that request is done, so the handler serves one client at a time,
# and the engine — built to batch — never sees more than one sequence. Eight clients that arrive
# together, served that way, against the same eight handed to the engine at once. Latency is counted
# two ways: in engine steps (each step is one forward pass; deterministic) and in seconds on this
# machine's clock (they vary from run to run, so the stored outputs hide them):

# %%
prompts = [s[: 40 + 20 * i] for i, s in enumerate(speeches[:8])]
params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)


def serve_all(engine: LLMEngine) -> tuple[dict, dict]:
    """Run the engine until every request is done: each request's finishing step and second."""
    started, steps, seconds = time.perf_counter(), {}, {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                steps[out.request_id] = len(engine.trace)
                seconds[out.request_id] = time.perf_counter() - started
    return steps, seconds


alone = LLMEngine(target)
one_at_a_time, waited, clock = [], [], 0.0
for prompt in prompts:  # a handler that serves one client, then the next
    request = alone.add_request(prompt, params)
    steps, seconds = serve_all(alone)
    clock += seconds[request]
    one_at_a_time.append(steps[request])  # this client waited for every client before it
    waited.append(clock)

engine = LLMEngine(target)
ids = [engine.add_request(prompt, params) for prompt in prompts]
steps, seconds = serve_all(engine)
batched = [steps[i] for i in ids]
print(f"{'client':>6} {'one at a time':>22} {'batched':>22}   (until its answer is complete)")
for i, request in enumerate(ids):
    print(
        f"{i:6} {one_at_a_time[i]:7} steps {waited[i]:6.2f} s {batched[i]:7} steps "
        f"{seconds[request]:6.2f} s"
    )
print(f"total forward passes: {one_at_a_time[-1]} one at a time, {len(engine.trace)} batched")
last_done = max(seconds.values())
print(f"last answer complete after {waited[-1]:.2f} s one at a time, {last_done:.2f} s batched")

# %% [markdown]
# Served one at a time, the last client waits for everyone before it; batched, everyone is done in
# roughly the time of the longest request. A batched step costs somewhat more than a one-sequence
# step, so the seconds fall less steeply than the steps — run the cell and compare the two columns. So the server's whole job is to get concurrent requests
# *into one engine while it runs*, and their tokens back out as they appear — without ever blocking
# the code that talks to the network.
#
# ## Build 1: the engine on a thread of its own
#
# A web server (FastAPI on uvicorn here) answers every client from one asyncio
# {term}`event loop <event loop (asyncio)>`. The engine's `step()` is synchronous, computes for
# milliseconds, and is not thread-safe. `AsyncEngine` (`serving/async_engine.py`; the whole server
# lives in `src/minivllm/serving/`) keeps the two apart: one **engine thread** owns the engine; the
# event loop only sends it functions through an **inbox**, and gets text back through one queue per
# request.

# %%
show(async_engine.AsyncEngine._run)

# %% [markdown]
# The loop sleeps on a condition variable when there is nothing to do, runs its whole inbox before
# every step — so a request added or aborted between two steps takes effect at the next one — and
# steps while anything is unfinished. The engine thread never reads the engine's sequences: each
# `RequestOutput` a step returns already carries what is new since that request's last output, and
# `out.delta()` packs it into a `TextDelta`. A step's deltas go back to the event loop in one
# hand-over, not one per token: a single `call_soon_threadsafe` wakes the loop, which puts each
# delta on the queue of the request that waits for it.

# %%
show(async_engine.AsyncEngine._deliver)

# %% [markdown]
# The new text comes from the engine's `OutputProcessor` (`engine/processing.py`), which keeps a
# {term}`stream cursor` per request — the same one `LLMEngine.stream` uses. It is chapter 01's
# streaming decoder at work (whole UTF-8 characters only), and while the request runs the cursor
# holds back a tail that might still turn out to be the start of a stop string, so streamed text
# never has to be taken back:

# %%
show(processing._take_text)

# %% [markdown]
# On the event loop's side, a request is a `RequestStream`: iterate it for the deltas; leave its
# `async with` early — an error, a cancelled task, a client that went away — and whatever is still
# running is aborted, its blocks back in the pool before the next step.

# %%
show(async_engine.RequestStream.__aexit__)

# %% [markdown]
# ## Build 2: the wire format
#
# `serving/openai_protocol.py` knows no engine and imports no torch: it is OpenAI's API as plain
# data. Request bodies are pydantic models, checked field by field (strictly: `"5"` is not an
# integer), and turned into the engine's `SamplingParams`:

# %%
show(openai_protocol.CompletionRequest.sampling_params)

# %% [markdown]
# A chat model is trained on conversations; ours was trained on plays. So a chat *is* a play: each
# message a turn, `SPEAKER:` on its own line, the speech, a blank line — the only format the model
# has ever read. A message's `name` is its speaker; without one, the user is ROMEO and the assistant
# JULIET, and a system message is spoken by the Chorus, who sets the scene. The prompt ends with the
# header of the speaker who answers, and the answer ends at the blank line that closes that speech
# (exercise ch09.2):

# %%
show(render_chat)

# %%
chat = [
    ChatMessage(role="system", content="A street in Verona."),
    ChatMessage(role="user", content="What light through yonder window breaks?"),
    ChatMessage(role="assistant", content="It is the east.", name="JULIET"),
    ChatMessage(role="user", content="Speak again, bright angel!"),
]
print(render_chat(chat))

# %% [markdown]
# Streaming uses **Server-Sent Events**: the response stays open, each chunk is one `data: <json>`
# line followed by a blank line, and the stream ends with `data: [DONE]` (exercise ch09.1):

# %%
show(sse_event)

# %%
print(
    repr(sse_event({"choices": [{"index": 0, "text": "O Romeo,\nRomeo"}]}))
    + "\n"
    + repr(sse_event("[DONE]"))
)

# %% [markdown]
# ## Build 3: the endpoints
#
# `endpoints.py` joins the two. A handler validates the body, puts the request in the engine's inbox
# and awaits the verdict — a prompt that can never fit the cache fails right there, in the engine's
# `InputProcessor` (the checks `LLMEngine.add_request` makes), while the server can still answer 400
# — then either collects the whole answer or streams it (`responses.py`; `app.py` puts the handlers
# on their routes and every error in the API's own body, `server.py` runs the process, and
# `connections.py` times out a connection that sends nothing or reads nothing):

# %%
show(endpoints.OpenAIServer.completions)

# %% [markdown]
# A streamed answer is an async generator of events, which Starlette sends as it yields them. It
# reads the request's `RequestStream` inside `async with stream`, so that leaving early for any
# reason aborts what still runs: a client that goes away makes Starlette cancel the generator, and
# the engine frees that request's blocks before its next step. Each delta that carries text becomes
# a chunk — the same `id` throughout, one choice in it, found by the delta's (request, sample) — and
# a choice's last delta is followed by a chunk with its finish reason and no text. After the last
# delta comes the usage chunk, if the client asked for one, with no choices; then `data: [DONE]`.
# Once the 200 status has gone out an error cannot change it, so an error becomes an event of its
# own, for this request only. The loop in the middle is this chapter's core exercise (ch09.3),
# folded here:

# %%
show(responses.sse_stream)

# %% [markdown]
# ## Run it
#
# `ServerThread` runs uvicorn in a background thread on a free loopback port (the OS picks it), and
# on exit shuts it down and stops the engine thread. First, plain HTTP with `httpx`. Ids and
# timestamps differ on every run, so the cells print them masked:


# %%
def masked(body: dict) -> dict:
    """A response body with its run-dependent fields (id, created) replaced by their shape."""
    return {**body, "id": body["id"].split("-")[0] + "-…", "created": "<unix time>"}


threads_before = {t.name for t in threading.enumerate()}
server = ServerThread(LLMEngine(target)).start()
print(f"serving on 127.0.0.1, port chosen by the OS: {server.url.startswith('http://127.0.0.1:')}")

response = httpx.post(
    f"{server.url}/v1/completions",
    json={"model": "target", "prompt": "ROMEO:\n", "max_tokens": 24, "temperature": 0},
)
print(response.status_code)
print(json.dumps(masked(response.json()), indent=1))

# %% [markdown]
# The same request, streamed: each event is a chunk with the same id, carrying the text of one
# engine step; the last names the finish reason; `[DONE]` closes the stream.

# %%
request = {
    "model": "target",
    "prompt": "ROMEO:\n",
    "max_tokens": 24,
    "temperature": 0,
    "stream": True,
}
with httpx.stream("POST", f"{server.url}/v1/completions", json=request) as events:
    lines = [line for line in events.iter_lines() if line]  # a blank line ends each event
chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
for chunk in chunks[:3]:
    print("data:", json.dumps(masked(chunk), ensure_ascii=False))
print(f"... {len(lines) - 5} more ...")
for chunk in chunks[-1:]:
    print("data:", json.dumps(masked(chunk), ensure_ascii=False))
print(lines[-1])
streamed = "".join(chunk["choices"][0]["text"] for chunk in chunks)
one_id = len({c["id"] for c in chunks}) == 1
print(f"{len(chunks)} chunks, all with the same id: {one_id}; text {streamed!r}")
assert streamed == response.json()["choices"][0]["text"]

# %% [markdown]
# Now the official client, pointed at our server with `base_url` and nothing else changed — a chat,
# whole and streamed, sampled with a seed. The seed makes the sampled answer reproducible (chapter
# 04's randomness is a pure function of seed and position), so the streamed text must equal the
# whole one:

# %%
client = openai.OpenAI(base_url=server.base_url, api_key="not needed", max_retries=0)
messages = [m.model_dump(exclude_none=True) for m in chat]
whole = client.chat.completions.create(
    model="target", messages=messages, temperature=0.8, seed=3, max_tokens=120
)
print(
    f"{whole.object}, finish_reason={whole.choices[0].finish_reason!r}, "
    f"usage: {whole.usage.prompt_tokens} prompt + {whole.usage.completion_tokens} completion tokens"
)
print(f"JULIET:\n{whole.choices[0].message.content}")

chunks = list(
    client.chat.completions.create(
        model="target", messages=messages, temperature=0.8, seed=3, max_tokens=120, stream=True
    )
)
first_delta = chunks[0].choices[0].delta.model_dump(exclude_none=True)
print(
    f"\n{len(chunks)} chunks: first delta {first_delta}, "
    f"last finish_reason {chunks[-1].choices[0].finish_reason!r}"
)
assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content

# %% [markdown]
# `GET /metrics` speaks Prometheus's text format (`serving/metrics.py`): counters the engine thread
# updates as outputs go by, and gauges read from `LLMEngine.stats()` when the page is asked for.

# %%
print([m.id for m in client.models.list().data], httpx.get(f"{server.url}/health").json())
metrics_text = httpx.get(f"{server.url}/metrics").text
wanted = {
    "minivllm:engine_alive",
    "minivllm:num_requests_running",
    "minivllm:generation_tokens_total",
    "minivllm:request_success_total",
}


def metric_name(line: str) -> str:
    """The series' name: what comes before its labels (`{...}`) or its value."""
    return line.split("{")[0].split(" ")[0]


print("\n".join(line for line in metrics_text.splitlines() if metric_name(line) in wanted))

# %% [markdown]
# Two smaller surfaces sit beside OpenAI's and Anthropic's, each from a system this engine was
# designed from. forge-infer's native `POST /generate` drops the envelope: one prompt in,
# `{"text", "token_ids", "finish_reason"}` out (or, with `"stream": true`, Server-Sent Events of
# that shape), through the same checks and limits as `/v1/completions`
# (`serving/native_protocol.py`). astrai's `GET /stats` gives the engine's counters as JSON, read
# like `/metrics` on the engine thread between two steps. A request may leave out `model`: as in
# vLLM, it then means the served model.

# %%
native = httpx.post(
    f"{server.url}/generate", json={"prompt": "ROMEO:\n", "max_tokens": 8, "temperature": 0}
).json()
print({key: native[key] for key in ("text", "token_ids", "finish_reason")})
stats = httpx.get(f"{server.url}/stats").json()
print({key: stats[key] for key in ("active_requests", "waiting_requests", "cache_usage")})
assert stats["total_requests"] > 0 and stats["tokens_generated"] >= len(native["token_ids"])

# %% [markdown]
# ## Check: bad requests, and clients that leave
#
# Every mistake gets a 4xx with OpenAI's error body — the official client raises its usual
# exceptions from it — and leaves the engine exactly as it was:

# %%
blocks_before = server.engine.blocks_in_use()
bad_requests = {
    "not JSON": b"{'prompt': 'ROMEO'",
    "max_tokens 0": {"model": "target", "prompt": "ROMEO:", "max_tokens": 0},
    "max_tokens a string": {"model": "target", "prompt": "ROMEO:", "max_tokens": "20"},
    "unknown model": {"model": "gpt-4", "prompt": "ROMEO:"},
    "no prompt": {"model": "target"},
    "top_k past int64": {"model": "target", "prompt": "ROMEO:", "top_k": 2**63},
    "a misspelt field": {"model": "target", "prompt": "ROMEO:", "temprature": 0.5},
    "response_format": {"model": "target", "prompt": "ROMEO:", "response_format": {"type": "x"}},
    "a prompt that can never fit": {"model": "target", "prompt": "O" * 2000},
}
for name, body in bad_requests.items():
    if isinstance(body, bytes):
        reply = httpx.post(
            f"{server.url}/v1/completions",
            content=body,
            headers={"content-type": "application/json"},
        )
    else:
        reply = httpx.post(f"{server.url}/v1/completions", json=body)
    error = reply.json()["error"]
    shown = shorten(error["message"], 100, placeholder="…")  # cut at a word, marked
    print(f"{name:>27}: {reply.status_code} {error['type']}: {shown}")
assert server.engine.blocks_in_use() == blocks_before

# %% [markdown]
# A client that disconnects mid-stream must not keep a sequence — and its blocks — alive. Starlette
# cancels a streaming response when its connection drops; leaving the `async with stream` aborts the
# request; the {term}`engine thread` frees its blocks before its next step:

# %%
request = {
    "model": "target",
    "prompt": "HAMLET:\n",
    "max_tokens": 400,
    "temperature": 0,
    "ignore_eos": True,
    "stream": True,
}
with httpx.stream("POST", f"{server.url}/v1/completions", json=request) as events:
    lines = events.iter_lines()
    for _ in range(4):
        next(lines)  # a few chunks of a 400-token answer
    during = server.engine.blocks_in_use()
# leaving the `with` closed the connection
deadline = time.monotonic() + 10
while server.engine.blocks_in_use() and time.monotonic() < deadline:
    time.sleep(0.01)
left = server.engine.blocks_in_use()
print(f"blocks in use while streaming: {during > 0}; after the client left: {left}")
aborted = [
    line
    for line in httpx.get(f"{server.url}/metrics").text.splitlines()
    if metric_name(line) == "minivllm:request_success_total" and '"abort"' in line
]
print(aborted[0])

# %% [markdown]
# ## Isolation: no request can hurt another
#
# A server is shared: one client's mistake must never cost another client anything. Before this
# chapter's checks, `{"top_k": 9223372036854775808}` (2⁶³) went past the edge and into the engine
# thread, where packing it into an int64 tensor raised — and killed the engine for everyone: every
# later request got 503 until a restart. Now every field is checked with bounds at the edge
# (`serving/openai_protocol.py`), sizes are capped (`serving/limits.py`: body size, prompts per
# request, stop strings, messages, prompt length — each a `minivllm serve` option), and the request
# that used to kill the server is one more 400, with the server still serving:

# %%
killer = {"model": "target", "prompt": "x", "max_tokens": 4, "top_k": 2**63}
reply = httpx.post(f"{server.url}/v1/completions", json=killer)
print(reply.status_code, shorten(reply.json()["error"]["message"], 90, placeholder="…"))
after = httpx.post(
    f"{server.url}/v1/completions",
    json={"model": "target", "prompt": "ROMEO:\n", "max_tokens": 8, "temperature": 0},
)
print(
    after.status_code, repr(after.json()["choices"][0]["text"]), httpx.get(f"{server.url}/health")
)
huge = httpx.post(
    f"{server.url}/v1/completions",
    content=b'{"model": "target", "prompt": "' + b"O" * 2_000_000 + b'"}',
    headers={"content-type": "application/json"},
)
print(huge.status_code, shorten(huge.json()["error"]["message"], 90, placeholder="…"))

# %% [markdown]
# And if the engine thread itself fails — a bug, not a request — the server says so instead of
# pretending: the cause goes to the log, `/health` answers 503, the gauge
# `minivllm:engine_alive` drops to 0, and `minivllm serve` exits non-zero so a supervisor restarts
# it, as vLLM's V1 server does (`tests/test_cli.py` kills one on purpose).
#
# ## Parallel sampling: n answers from one prompt's blocks
#
# `n` asks for several samples of one prompt. Sent as n separate requests, the prompt would be
# prefilled n times and its K/V stored n times. The engine prefills it once; then the samples
# **fork** the parent's block table — chapter 03's reference counts — and share every prompt block;
# the last, partly filled block is copied on the first write ({term}`copy-on-write`), and from there
# each sample grows blocks of its own. Four samples of one prompt, seeded, through the official
# client:

# %%
poem = client.completions.create(
    model="target", prompt=speeches[3][:120], n=4, max_tokens=24, temperature=0.9, seed=5
)
for choice in poem.choices:
    print(choice.index, repr(choice.text))

# %% [markdown]
# Inside the engine, two steps after the prompt was prefilled: the pool and the four samples' block
# tables. Hatched blocks are shared, labelled with how many tables hold them.

# %% tags=["hide-input"] mystnb={"figure": {"caption": "One request with four samples, two steps after its prompt was prefilled: the block pool (top) and the four samples' block tables (bottom), each table cell naming the physical block it maps to; hatched blocks are shared, labelled with how many tables hold them (×4).", "name": "fig-09-forked-samples"}}
forked = LLMEngine(target, EngineConfig(num_blocks=48, block_size=16))
forked.add_request(speeches[3][:120], SamplingParams(n=4, max_tokens=40, temperature=0.9, seed=5))
for _ in range(3):
    forked.step()
# The pool above the tables, each the page's width, so a shared cell has room for its "×4" at a
# readable size; each table cell names its physical block, so no arrows need cross the tables.
fig, (pool_ax, table_ax) = plt.subplots(2, 1, figsize=(7.5, 5.4), layout="constrained")
draw_block_pool(pool_ax, forked.manager, columns=12)
draw_block_tables(table_ax, forked.manager)
block_legend(fig, tables=True, loc="outside lower center")
plt.show()
shared = sum(1 for block, owners in block_owners(forked.manager).items() if len(owners) > 1)
print(f"{len(forked.manager.tables)} samples, {shared} blocks shared by all of them")

# %% [markdown]
# What that saves, counted in blocks (deterministic: the peak number of blocks in use while the
# requests run), for prompts of several lengths and n = 4 — forked samples against n independent
# requests with the same seeds, whose tokens must be the same:


# %%
def peak_blocks(prompt: str, n: int, forked: bool) -> tuple[int, list[list[int]]]:
    """The peak KV blocks in use, and every sample's tokens: n samples of one request, or n
    independent requests seeded as the samples are."""
    engine = LLMEngine(target, EngineConfig(num_blocks=256, block_size=16))
    if forked:
        samples = engine.generate([prompt], SamplingParams(n=n, max_tokens=32, seed=11))[0].samples
    else:  # sample i of a request with seed s draws with derive_seed(s, i); sample 0 with s
        seeds = [11] + [derive_seed(11, i) for i in range(1, n)]
        params = [SamplingParams(max_tokens=32, seed=seed) for seed in seeds]
        samples = engine.generate([prompt] * n, params)
    return engine.peak_blocks_used, [list(s.token_ids) for s in samples]


plays = shipped_validation_text()
print(f"{'prompt chars':>12} {'forked':>7} {'independent':>12} {'saved':>6}")
for length in (64, 256, 448):
    prompt = plays[5000 : 5000 + length]
    (shared_peak, shared_tokens), (alone_peak, alone_tokens) = (
        peak_blocks(prompt, 4, forked) for forked in (True, False)
    )
    assert shared_tokens == alone_tokens
    print(f"{length:12} {shared_peak:7} {alone_peak:12} {1 - shared_peak / alone_peak:6.0%}")

# %% [markdown]
# The longer the prompt next to the answers, the larger the share of memory the samples share —
# the saving vLLM's paper measures for parallel sampling (and, larger still, for beam search, whose
# candidates share more than the prompt) {cite}`kwon2023pagedattention`;
# `benchmarks/parallel_sampling.py` runs the sweep. And the tokens are the same either way: sample
# i's randomness is a pure function of its seed and position, whoever it shares blocks with.
#
# ## A second protocol: Anthropic's Messages API
#
# The engine does not know which API a request came through. The server also speaks Anthropic's
# Messages API (`POST /v1/messages`, `serving/anthropic_protocol.py`): the same chat rendered as the
# same play, Anthropic's request and response shapes, and its own event sequence when streamed. The
# official `anthropic` client, pointed at our server:

# %%
anthropic_client = anthropic.Anthropic(base_url=server.url, api_key="not needed", max_retries=0)
turns = [{"role": m.role, "content": m.content} for m in chat[1:]]  # Anthropic's have no names
message = anthropic_client.messages.create(
    model="target",
    system=chat[0].content,
    messages=turns,
    max_tokens=60,
    extra_body={"temperature": 0},  # the 2.x client takes sampling fields through extra_body
)
print(
    f"type {message.type}, role {message.role}, stop_reason {message.stop_reason}, "
    f"input_tokens {message.usage.input_tokens}"
)
greedy_openai = client.chat.completions.create(
    model="target",
    messages=[{"role": "system", "content": chat[0].content}, *turns],
    temperature=0,
    max_tokens=60,
)
print(repr(message.content[0].text[:80]))
assert message.content[0].text == greedy_openai.choices[0].message.content
events = anthropic_client.messages.create(  # the raw server-sent events, in order
    model="target",
    system=chat[0].content,
    messages=turns,
    max_tokens=60,
    stream=True,
    extra_body={"temperature": 0},
)
kinds = [event.type for event in events]
print(kinds[:3], f"... {kinds.count('content_block_delta')} deltas ...", kinds[-3:])

# %% [markdown]
# Two wire formats, one engine: the greedy answer is the same text either way.

# %% [markdown]
# ## See: many clients, one batch
#
# Now 32 clients, each streaming its own request, arriving over about a second (seeded random gaps),
# with prompts and answer lengths of all sizes. `minivllm.serving.client.stream_completion` is one
# such client: it sends a streaming request with `httpx` and notes when each piece of text arrives.

# %%
show(stream_completion)


# %%
async def arrive_later(http: httpx.AsyncClient, delay: float, body: dict) -> StreamedCompletion:
    await asyncio.sleep(delay)
    return await stream_completion(http, server.base_url, body)


async def many_clients(bodies: list[dict], delays: list[float]) -> list[StreamedCompletion]:
    async with httpx.AsyncClient(
        timeout=120, limits=httpx.Limits(max_connections=len(bodies))
    ) as http:
        return await asyncio.gather(*(arrive_later(http, d, b) for d, b in zip(delays, bodies)))


rng = random.Random(8)
bodies = [
    {
        "model": "target",
        "prompt": speech[: rng.randint(10, 200)],
        "max_tokens": rng.randint(8, 64),
        "temperature": 0,
    }
    for speech in speeches[8:40]
]
delays = [rng.uniform(0, 1.0) for _ in bodies]
steps_before = len(server.engine.trace())
results = await many_clients(bodies, delays)  # a cell may await: Jupyter runs an event loop
trace = server.engine.trace()[steps_before:]

offline = LLMEngine(target).generate(
    [b["prompt"] for b in bodies],
    [SamplingParams(max_tokens=b["max_tokens"], temperature=0) for b in bodies],
)
assert [r.text for r in results] == [o.text for o in offline]
print(
    f"{len(results)} clients served, every answer identical to the offline engine's; "
    f"blocks in use afterwards: {server.engine.blocks_in_use()}"
)

# %% [markdown]
# Every client got exactly what the offline engine gives its request: batching with strangers, in
# whatever order they arrived, changes nothing (greedy here; a seed does the same for sampling). The
# trace shows them joining the running batch step by step — a request is admitted at the next step
# after it arrives, not when a batch is "full":

# %% mystnb={"figure": {"caption": "32 streaming clients through the server. Top: each row a request over engine steps (hatched: prefill, solid: decode); bottom: how many requests were running at each step.", "name": "fig-09-server-gantt"}}
# NBVAL_IGNORE_OUTPUT
fig, (top, bottom) = plt.subplots(2, 1, figsize=(7.5, 6), height_ratios=[3, 1], sharex=True)
first_step = trace[0].step - 1
shifted = [type(r).from_dict({**r.to_dict(), "step": r.step - first_step}) for r in trace]
draw_gantt(
    top,
    shifted,
    title="32 streaming clients: each row a request (hatched: prefill, solid: decode)",
    label_every=4,
)
bottom.bar(
    [r.step - first_step for r in trace],
    [len(r.running) for r in trace],
    width=1.0,
    color="#1f77b4",
)
bottom.set_ylabel("running")
bottom.set_xlabel("engine step")
plt.show()

# %% [markdown]
# What the clients felt: **{term}`time to first token <time to first token (TTFT)>`** (TTFT:
# queueing, then the prefill) and **inter-token latency** (ITL: the gaps between streamed pieces,
# one engine step each while the batch runs). Wall clock, so these vary from run to run:

# %% mystnb={"figure": {"caption": "What the clients felt: histograms of time to first token (left) and inter-token latency (right), wall clock on the machine that built this page.", "name": "fig-09-latency"}}
# NBVAL_IGNORE_OUTPUT
ttft = np.array([r.ttft for r in results]) * 1e3
itl = np.concatenate([r.itls for r in results]) * 1e3
fig, (left, right) = plt.subplots(1, 2, figsize=(7.5, 3))
left.hist(ttft, bins=20, color="#ff7f0e")
left.set_xlabel("time to first token (ms)")
right.hist(itl, bins=40, color="#2ca02c")
right.set_xlabel("inter-token latency (ms)")
plt.show()
print(
    f"TTFT p50 {np.percentile(ttft, 50):.0f} ms, p99 {np.percentile(ttft, 99):.0f} ms; "
    f"ITL p50 {np.percentile(itl, 50):.1f} ms, p99 {np.percentile(itl, 99):.1f} ms"
)

# %% [markdown]
# ### Isolation under load: one huge answer beside 24 streams
#
# Checked fields protect the engine; they do not protect *time*. One legal request can still take
# it from everyone: 32 prompts of 480 tokens, two samples each, echoed, with 20 logprobs per token,
# not streamed, is an answer of about 15 MB of JSON. Built and encoded in one go, that work runs
# on the event loop — the same thread that writes every other client's stream — and each stream
# stops until it is done. So the server writes a big answer a choice at a time
# (`responses.json_in_pieces`), yielding the loop between choices; and it refuses, before any work,
# an answer that could pass its output budget (prompts × n × (echoed prompt + max_tokens) ×
# (logprobs + 1), `minivllm serve --max-output-units`) with a 400 saying what to lower.
# `streams_beside` runs 24 streaming clients, each streaming again as soon as its answer ends, and,
# half a second in, the big request, until it is answered; below it runs twice, the second time
# with the old one-go writer put back:

# %%
show(responses.whole_response)

# %%
# NBVAL_IGNORE_OUTPUT
long_prompt = [65 + i % 26 for i in range(480)]
big = {"prompt": [long_prompt] * 32, "n": 2, "logprobs": 20, "echo": True, "max_tokens": 16}
beside = [
    {"prompt": "ROMEO:\n", "max_tokens": 48, "ignore_eos": True, "seed": i, "temperature": 0.8}
    for i in range(24)
]
isolation = {"in pieces": await streams_beside(server.base_url, beside, big, big_after=0.5)}
inline_units, responses.INLINE_ANSWER_UNITS = responses.INLINE_ANSWER_UNITS, float("inf")
try:  # the writer before: every choice built and the whole body encoded in one go
    isolation["in one go"] = await streams_beside(server.base_url, beside, big, big_after=0.5)
finally:
    responses.INLINE_ANSWER_UNITS = inline_units
for name, run in isolation.items():
    print(
        f"answer {name:9s}: {run.big_status}, {run.big_bytes / 1e6:.1f} MB in "
        f"{run.big_seconds:.1f} s; the 24 streams' longest wait for a token {run.max_gap:.2f} s"
    )

# %% mystnb={"figure": {"caption": "24 streams beside one 15 MB answer: each dot a token reaching its client (a row per stream); shaded, the big request from sent to read. Left: the answer written a choice at a time; right: encoded in one go, as before. Wall clock on the machine that built this page.", "name": "fig-09-isolation"}}
# NBVAL_IGNORE_OUTPUT
fig, axes = plt.subplots(1, 2, figsize=(7.5, 3.4), sharey=True)
for ax, (name, run) in zip(axes, isolation.items()):
    start = min(client[0].sent for client in run.streams)
    for row, stream in ((row, s) for row, client in enumerate(run.streams) for s in client):
        ax.plot(
            [t - start for t in stream.chunk_times],
            [row] * len(stream.chunk_times),
            "|",
            color="#1f77b4",
            markersize=4,
        )
    ax.axvspan(0.5, 0.5 + run.big_seconds, color="#ff7f0e", alpha=0.15, label="big request")
    ax.set_title(f"answer {name}: longest wait {run.max_gap:.2f} s")
    ax.set_xlabel("seconds since the streams started")
axes[0].set_ylabel("stream")
fig.legend(*axes[0].get_legend_handles_labels(), loc="upper right", frameon=False)
fig.tight_layout(rect=(0, 0, 1, 0.93))
plt.show()

# %% [markdown]
# Both times the big answer arrives whole and every stream gets its tokens; what changes is how
# long the streams stop while the answer is written (the white gap on the right). The stall grows
# with the answer: `benchmarks/server_isolation.py` measures the full-size request
# (125 MB), alternating the two writers, and `tests/test_server_isolation.py` holds the server to
# no wait over 0.5 s beside the biggest answer its default limits allow.

# %% [markdown]
# ## Measure: what the server costs
#
# The same workload, all at once, through the server and straight through the offline engine:
# the share of the offline throughput the server keeps is what HTTP, JSON and the thread hand-offs
# cost. `benchmarks/serving.py` runs the full sweep (1 to 64 clients, p50 and p99 latencies).

# %%
# NBVAL_IGNORE_OUTPUT
seconds, _ = await run_clients(server.base_url, bodies, concurrency=len(bodies))
started = time.perf_counter()
LLMEngine(target).generate(
    [b["prompt"] for b in bodies],
    [SamplingParams(max_tokens=b["max_tokens"], temperature=0) for b in bodies],
)
offline_s = time.perf_counter() - started
tokens = sum(len(o.token_ids) for o in offline)
print(
    f"{tokens} tokens: server {tokens / seconds:.0f} tok/s, "
    f"offline engine {tokens / offline_s:.0f} tok/s -> the server runs at "
    f"{speed_change(offline_s / seconds, than='the offline engine')}"
)

# %% [markdown]
# ## Shut down cleanly
#
# Leaving the server stops uvicorn, then the engine thread; nothing is left running:

# %%
client.close()
anthropic_client.close()
server.stop()


def ours(thread: threading.Thread) -> bool:
    """A thread this notebook's code started (Jupyter's messaging library starts its own
    garbage-collector thread the first time a large output goes out)."""
    return thread.name not in threads_before and not type(thread).__module__.startswith("zmq")


deadline = time.monotonic() + 10  # a worker finishing its last task may take a moment to exit
while (
    left_behind := [t for t in threading.enumerate() if ours(t)]
) and time.monotonic() < deadline:
    time.sleep(0.05)
print(f"threads left behind: {sorted(t.name for t in left_behind) or 'none'}")
assert not left_behind, [(t.name, getattr(t, "_target", None)) for t in left_behind]

# %% [markdown]
# From a shell the same server is `minivllm serve --model target --port 8000` (with
# `--speculative draft` for chapter 06's {term}`speculative decoding`).
#
# ## Exercises
#
# Solutions live between `### BEGIN SOLUTION` and `### END SOLUTION` in
# `src/minivllm/serving/responses.py` and `src/minivllm/serving/openai_protocol.py`; run one
# exercise's tests with `pytest tests --exercise ch09.3`.
#
# 1. **ch09.3 — the streamed answer** (this chapter's core). In `sse_stream`, inside the `try`
#    that turns a failure into an error event and the `async with stream` that aborts the request
#    when the client leaves, send the answer's chunks as its deltas arrive: read the deltas with
#    `async for` over the stream. For each one, count its tokens, find its choice's index
#    (`stream.choices` lists them in order; `choice_of(delta)` is its own), and send
#    `pieces.piece(i, delta)` as a chunk (`header.body([...])` through `sse_event`) unless it is
#    `None`; after a delta with a `finish_reason`, send `pieces.finish(i, ...)` with OpenAI's name
#    for the reason (`finish_reason`). After the loop, send the usage chunk — no choices,
#    `usage=` the counts through `usage`, the prompt tokens summed over `stream.num_prompt_tokens`
#    — when `include_usage` is set. The role chunk before and `[DONE]` after are already there. The
#    tests drive it with a stand-in engine (chunks in order, finish chunks, usage, `[DONE]` last,
#    and an abort when the client closes the stream after three events) and then through the server
#    with the `openai` client. Three hints, from a nudge to nearly the answer, are folded below the
#    list.
# 2. **ch09.1 — the SSE chunk formatter.** In `sse_event`, return one Server-Sent Event: `data: `,
#    the payload, and the blank line that ends the event (`"\n\n"`). A `str` payload such as
#    `[DONE]` goes in as it is; a `dict` as compact JSON — no space after `,` or `:` — with
#    non-ASCII text written as itself (`❤`, not `\u2764`), as the tests compare the exact string.
#
#    *Hint:* `json.dumps` has a keyword argument for each of those two JSON requirements (see
#    `help(json.dumps)`); its defaults put a space after each separator and escape every non-ASCII
#    character. It already escapes newlines, so the event stays one `data:` line.
# 3. **ch09.2 — a chat as a play.** In `render_chat`, render each message as `SPEAKER:` (its
#    `name`, or the default for its role), a newline, its speech, and a blank line; end with the
#    header (`SPEAKER:` and a newline) of the speaker who answers. The speech is the message's text
#    with leading and trailing whitespace stripped and every blank line inside it removed (a line of
#    only spaces counts as blank), so no speech can end early.
#
#    *Hint:* The module has the pieces: `SPEAKERS`, `END_OF_TURN` and `reply_speaker`;
#    `message.text` joins content parts. After the strip, a single `re.sub` turns every run of
#    newlines that holds a blank line into one newline.
# 4. *(Explore, no test.)* Back-pressure: make the server answer 429 (OpenAI's "rate limit" status,
#    with a `retry-after` header) when the engine already has more than N requests waiting. Where
#    should the check live so that it never races with the engine thread?
#
#    *Hint:* Look at how `AsyncEngine.add_request` reaches the engine: what it submits runs on the
#    engine thread, between two steps. A count read anywhere else can be stale by the time the
#    request is added.
# 5. *(Explore, no test.)* Re-run the "many clients" cell with a long prompt (400 tokens) arriving
#    in the middle. What happens to the other clients'
#    {term}`inter-token latency <inter-token latency (ITL)>` during its prefill, and how does
#    `SchedulerConfig.max_num_batched_tokens` ({term}`chunked prefill`, chapter 04) change it?
#
#    *Hint:* Compare the prompt with the token budget: at the default of 512 the whole 400-token
#    prefill fits in one step, which every running decode waits for. Record each client's gaps
#    between tokens over time, and watch the long request's TTFT as you lower the budget.

# %% [markdown]
# The hints for ch09.3, the chapter's core, are folded: open one at a time.
#
# :::{admonition} Hint 1 for ch09.3 — a nudge
# :class: dropdown
# A generator sends an event by yielding it, so the body is one loop over the request's deltas
# with a yield or two inside it. The helpers that shape a chunk already exist (`pieces`, `header`,
# `sse_event`): your part is the order, the counting, and where the loop lives.
# :::
#
# :::{admonition} Hint 2 for ch09.3 — the approach
# :class: dropdown
# Before the loop, map each choice in `stream.choices` to its position with a dict, and start a
# token count at zero. Per delta: add its `token_ids` to the count, look up its index, yield the
# piece's chunk when there is one, then the finish chunk when the delta has a reason. Only after
# the loop has ended, yield the usage chunk if it was asked for: the count is complete only then.
# :::
#
# :::{admonition} Hint 3 for ch09.3 — nearly there
# :class: dropdown
# A chunk is `sse_event(header.body([choice]))`, with `choice` from `pieces.piece(i, delta)` or
# `pieces.finish(i, finish_reason(delta.finish_reason))`; the walrus operator lets you test the
# piece for `None` as you take it. The usage chunk is `header.body` of an empty list with a
# keyword `usage=`, the sum of `stream.num_prompt_tokens.values()` and your count going into
# `usage`. The text-less delta still counts its tokens.
# :::

# %% [markdown]
# ## Summary
#
# The engine is behind OpenAI's API — and Anthropic's, a second view of the same engine: an engine
# thread owns the engine, the asyncio event loop owns the sockets, and an inbox and one queue per
# request connect them, so a thousand clients share one continuously batched engine and none of
# them blocks another. Every field is checked with bounds at the edge and every size is capped, so
# a bad request is a 4xx and never reaches the engine; a client that leaves frees its blocks at the
# next step; a dead engine is reported and the process exits for a supervisor. `n` samples share
# their prompt's blocks by forking. Measured above: the blocks parallel sampling saves, and what the
# HTTP layer costs against the engine alone.
#
# **The same idea in vLLM.** The HTTP front: `vllm/entrypoints/openai/api_server.py` with
# `serving_completion.py` and `serving_chat.py` beside it; the engine on its own loop:
# `vllm/v1/engine/async_llm.py` (`AsyncLLM`) over `vllm/v1/engine/core.py` (in a separate process,
# where minivllm uses a thread); streamed deltas: `vllm/v1/engine/output_processor.py`.
