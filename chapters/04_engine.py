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
# # Chapter 04 — The engine: continuous batching
#
# :::{admonition} At a glance
# - **Builds:** the scheduler, one flat forward pass per step, per-request sampling: an engine with
#   continuous batching.
# - **Needs:** chapters 01–03.
# - **Runs in:** about 1 min, start to end (`make book` on a quiet 2-core AMD EPYC).
# :::
#
# Chapter 03 gave every sequence its own pages in one shared pool, but still ran them one at a time.
# A decode step of one sequence reads every weight of the model to produce one token. Run many
# sequences in the same forward pass and those weights are read once for all of them. That is
# **batching**, and this chapter builds the part of an inference engine that decides *who* runs in
# each pass: the **scheduler**. After it, minivllm is an engine: requests come in at any time, join
# the running batch at the next step, and leave the moment they are done — Orca's iteration-level
# scheduling {cite}`yu2022orca`, over vLLM's paged cache {cite}`kwon2023pagedattention`, with long
# prompts cut into chunks that share a step with decodes {cite}`agrawal2023sarathi`.

# %% tags=["remove-input"] mystnb={"image": {"alt": "The roadmap of the engine, chapter 04 highlighted: the chapters before it built, those after it to come"}}
from minivllm.book.figures.roadmap import roadmap

roadmap(4)

# %%
import time

import matplotlib.pyplot as plt
import numpy as np
import torch

from minivllm import EngineConfig, LLMEngine, SamplingParams, SchedulerConfig
from minivllm.attention.storage import PagedKVStorage
from minivllm.attention.torch_backend import TorchPagedAttention
from minivllm.book import sequence_color, show, use_book_style
from minivllm.book.figures.sampling import draw_next_token_probs, token_label
from minivllm.book.figures.timelines import draw_batch_places, draw_flat_batch, draw_gantt
from minivllm.book.modes import StaticBatching
from minivllm.engine.trace import read_jsonl, write_jsonl
from minivllm.kv.block_manager import BlockManager
from minivllm.model.checkpoint import load_model
from minivllm.model.tokenizer import ByteTokenizer
from minivllm.runner.batch import build_batch, pack_batch
from minivllm.runner.model_runner import ModelRunner
from minivllm.runner.sampler import position_uniforms, token_probs
from minivllm.sched.scheduler import Scheduler
from minivllm.sched.sequence import Sequence
from minivllm.stages.contiguous import ContiguousKVCache, generate_cached
from minivllm.stages.paged import generate_paged
from minivllm.training.corpus import shipped_validation_text

torch.manual_seed(0)
torch.set_num_threads(2)
use_book_style()
model, tokenizer = load_model("target"), ByteTokenizer()
EOS = model.config.eos_token_id

# %% [markdown]
# ## Why: one request at a time, then a batch that waits for its longest member
#
# Chapter 03 left us with a paged cache that serves **one request at a time**: `generate_paged`
# runs a request to its end, then the next one starts. Here are 16 requests — a few lines of the
# held-out plays as the prompt, between 8 and 120 new tokens each (`ignore_eos`, so every request
# produces exactly what it asked for) — through that path:

# %%
rng = np.random.default_rng(0)
text = shipped_validation_text()
starts = rng.integers(0, len(text) - 200, size=16)
prompts = [text[s : s + int(n)] for s, n in zip(starts, rng.integers(16, 80, size=16))]
lengths = [int(n) for n in rng.integers(8, 121, size=16)]
params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
prompt_tokens = [len(tokenizer.encode(p, add_bos=True)) for p in prompts]
print(f"prompts of {min(prompt_tokens)}-{max(prompt_tokens)} tokens (with the BOS)")
print("tokens wanted per request:", lengths)

manager = BlockManager(num_blocks=64, block_size=16)
storage = PagedKVStorage(model.config, 64, 16)
started = time.perf_counter()
one_at_a_time = [
    generate_paged(model, tokenizer.encode(p, add_bos=True), n, manager, storage, seq_id=i)
    for i, (p, n) in enumerate(zip(prompts, lengths))
]
alone_s = time.perf_counter() - started
print(
    f"one at a time: {sum(lengths)} forward passes of a single sequence "
    f"({sum(lengths) / alone_s:.0f} tokens/s on this machine)"
)

# %% [markdown]
# Every pass reads every weight of the model to produce one token for one sequence. The obvious
# improvement is to run several requests in the same pass. The simplest way to batch is
# **{term}`static batching`**: take the next four requests, run them together until *all four* are
# done, then take the next four. Requests want different numbers of tokens, so a batch that started
# full empties out one request at a time, and its freed places stay idle until the last, longest
# member finishes.
#
# minivllm's engine never batches this way, so the book keeps static batching on its own side, as a
# baseline: `StaticBatching` (in `minivllm.book.modes`) is an *admission rule* that lets new
# requests in only when nothing is running. The engine runs with it as with any other rule.


# %%
def run(prompts, params, **scheduler):
    engine = LLMEngine(model, EngineConfig(num_blocks=512, scheduler=SchedulerConfig(**scheduler)))
    return engine, engine.generate(prompts, params)


def slot_use(trace, slots):
    """Share of batch places (slots x steps) that did work: a sequence prefilling or decoding."""
    busy = sum(len(r.decoded) + len(r.prefilled) for r in trace)
    return busy / (slots * len(trace))


static, static_out = run(prompts, params, max_num_seqs=4, batching=StaticBatching())
assert [o.token_ids for o in static_out] == one_at_a_time  # batching changes no token
busy_share = slot_use(static.trace, 4)
print(f"static batching: {len(static.trace)} steps, {busy_share:.0%} of the 4 batch places busy")

# %% [markdown]
# The rest of the batch did nothing. Each row below is one batch place; each colour a request.

# %% tags=["hide-input"] mystnb={"figure": {"caption": "Static batching: each row a batch place, each colour the request holding it; grey where a place sits idle until the whole batch has drained.", "name": "fig-04-static-places"}}
fig, ax = plt.subplots(figsize=(7.5, 2.2))
draw_batch_places(ax, static.trace, 4, "static batching: grey = an idle batch place")
plt.show()

# %% [markdown]
# The grey is throughput thrown away: the hardware ran a smaller batch than it could, while requests
# sat in the queue. The fix is to decide who runs **at every step** instead of once per batch: when
# a request finishes, the next one takes its place in the very next step. That is **continuous
# batching** ({cite}`yu2022orca`; vLLM's default). It needs three things this chapter builds: a
# scheduler that replans every step, a model runner that can run *different* sequences at
# *different* stages in one forward pass, and sampling that does not care who else is in the batch.
#
# ## Build: the request
#
# A request brings a prompt and a `SamplingParams`; the engine keeps a `Sequence` for it. Everything
# a caller can get wrong is checked when the request arrives, naming the field:

# %%
for bad in [dict(max_tokens=0), dict(temperature=-1.0), dict(top_p=1.5), dict(top_k=-3)]:
    try:
        SamplingParams(**bad)
    except ValueError as error:
        print(error)

# %% [markdown]
# The one number the scheduler looks at is `num_uncomputed_tokens`: how many of the sequence's
# tokens have no K/V in the cache yet. For a fresh prompt that is the whole prompt; after that it is
# exactly one each step, the token sampled last step.

# %%
show(Sequence.num_uncomputed_tokens.fget)

# %% [markdown]
# ## Build: the scheduler and its StepPlan
#
# `Scheduler.schedule()` runs once per step. It does not touch a tensor: it returns a plain value,
# the `StepPlan`, and changes only its queues and the {term}`block tables <block table>`. The
# phases, in order: the running batch — decodes first (each reserves the slot for its next token
# *before* the forward pass), then prompts still being prefilled — and then admissions from the
# waiting queue, first come first served (the sequences of one client request take turns with
# another's: `sched/waiting.py`), while three limits hold: `max_num_seqs`, the per-step
# {term}`token budget` `max_num_batched_tokens`, and free blocks. Two names point ahead: `_reserve`
# asks for a running sequence's slots and, when there are none, hands the sequence to the
# **{term}`preemption <preemption (by recompute)>` policy** (chapter 05; `may_preempt`, `served`,
# `preempted` and `_finish_too_big` are its part), and `_lookahead` is the number of slots chapter
# 06 reserves after a decode for draft tokens (0 in this chapter).

# %%
show(Scheduler.schedule)

# %% [markdown]
# Admission is where the limits bite. A prompt longer than what is left of the token budget is not
# turned away: it is admitted with a first **chunk**, and continues next step
# (**{term}`chunked prefill`**). That keeps every step's size bounded, so one long prompt cannot
# freeze everyone else's decoding. With {term}`prefix caching` on, a prompt starts with the blocks
# it finds in chapter 03's prefix cache (`computed_prefix`) and computes only the rest. The head of
# the queue that does not fit ends the admissions for this step: nobody overtakes it. The loop is
# this chapter's core exercise, ch04.4, so its solution is folded; three small helpers keep the
# bookkeeping out of it: `_seats` (a request sampling $n$ answers takes $n$ seats from the start),
# `_prefix_hits` (the cached blocks, none when prefix caching is off) and `_start_running`.

# %%
show(Scheduler._admit)

# %% [markdown]
# The first line of `_admit` is the batching rule, a seam of its own: `ContinuousBatching` may
# always admit; the `StaticBatching` of the "Why" section only when the last batch is gone.

# %%
show(StaticBatching.may_admit)

# %% [markdown]
# Neither method counts blocks. Both ask the block manager one question, `allocate_slots`: *may this
# sequence have `num_new_tokens` more slots after its `num_computed_tokens`?* The block layer does
# the arithmetic — the slack in the last block, the free blocks, a new block table on a sequence's
# first call — and grows the table, or answers 0 and changes nothing. A prompt chunk may `shrink` to
# what is free; a decode gets all its slots or none. This is vLLM's split too: its {term}`scheduler`
# asks `KVCacheManager.allocate_slots` (`vllm/v1/core/kv_cache_manager.py`) and only sees the
# answer, so a smarter block layer (several cache groups, sliding windows) changes nothing in the
# scheduler.

# %%
show(BlockManager.allocate_slots)

# %% [markdown]
# Let us run the scheduler with no model at all: three requests, a budget of 8 tokens per step, and
# a fake token source that always answers `ord("a")`. Request 0 has a 12-token prompt, so it needs
# two steps of {term}`prefill`; watch request 1 and 2 get the budget it leaves.

# %%
manager = BlockManager(num_blocks=16, block_size=4)
toy = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8), manager)
for seq_id, (prompt_len, max_tokens) in enumerate([(12, 3), (3, 2), (5, 2)]):
    toy.add(
        Sequence(
            seq_id, list(range(65, 65 + prompt_len)), SamplingParams(max_tokens=max_tokens), 0, EOS
        )
    )
while toy.has_unfinished():
    plan = toy.schedule()
    chunks = ", ".join(
        f"{'P' if c.is_prefill else 'D'}{c.seq_id}[{c.start}:{c.start + c.num_tokens}]"
        + ("*" if c.samples else "")
        for c in plan.chunks
    )
    finished = toy.update(plan, {s: ord("a") for s in plan.sampling_seq_ids})
    print(
        f"step {plan.step}: {plan.num_batched_tokens} tokens  {chunks:44s} "
        f"admitted {list(plan.admitted)}  finished {[s.seq_id for s in finished]}  "
        f"free blocks {manager.num_free}"
    )

# %% [markdown]
# `P0[0:8]` is a prefill chunk of sequence 0 covering positions 0–7; `D1[3:4]` a decode; a `*` marks
# a chunk whose last row picks a token. In step 1 request 0 takes the whole budget; in step 2 its
# last four prompt tokens leave room for request 1 (all 3 tokens) and one token of request 2. From
# step 3 the decodes come first. Finished sequences give their blocks back in the same step, so the
# pool is full again at the end.
#
# ## Build: one forward pass for the whole step
#
# The `StepPlan` is a list of chunks of different sequences, at different positions, of different
# lengths. The model runner lays their tokens **end to end** — no padding in the matmuls — and keeps
# the metadata that says which token belongs to whom: the varlen layout of FlashAttention and vLLM.
# `build_batch` turns each chunk into a `BatchPiece` (its tokens, where they start, how many rows of
# logits it wants; the `drafts` are chapter 06's) and `pack_batch` lays the pieces end to end. Its
# loop is per piece; every token's position and cache slot then come out of a few array
# operations, so a step of 64 decodes runs no Python loop over tokens.

# %%
show(build_batch)

# %%
show(pack_batch)

# %% [markdown]
# Here is a real step from the middle of a run: three sequences decoding and one new prompt being
# prefilled, all in one batch of tokens. Above each token, its position in its own sequence; below,
# the cache slot its K/V is written to.

# %% tags=["hide-input"] mystnb={"figure": {"caption": "One engine step flattened into a single batch of tokens: three sequences decoding and a new prompt being prefilled, each token a cell coloured by its sequence, its position above and its cache slot below; brackets mark each sequence's query range.", "name": "fig-04-flat-batch"}}
engine = LLMEngine(model, EngineConfig(num_blocks=64, block_size=4))
for prompt in ["ROMEO:\n", "JULIET:\n", "HAMLET:\nTo be"]:
    engine.add_request(prompt, SamplingParams(max_tokens=20, temperature=0))
for _ in range(3):
    engine.step()
engine.add_request("MACBETH:\n", SamplingParams(max_tokens=20, temperature=0))
plan = engine.scheduler.schedule()
batch = build_batch(plan, engine.scheduler.sequences, engine.manager)
token_text = [token_label(tokenizer.token_repr(int(t))) for t in batch.input_ids]
fig, ax = plt.subplots(figsize=(7.5, 2.2))
draw_flat_batch(ax, batch, token_text, [c.seq_id for c in plan.chunks])
plt.show()
print("query_start ", batch.query_start.tolist(), "  context_lens", batch.context_lens.tolist())
print("block_tables", batch.block_tables.tolist())
print("num_decodes ", batch.num_decodes, "          logits_indices", batch.logits_indices.tolist())

# %% [markdown]
# Inside the model nothing changes: embeddings, projections and the MLP see `N` rows and do not care
# whose they are. Only attention must keep sequences apart, and the model reaches it through one
# seam: an **{term}`attention backend`**, built once per forward pass from the cache storage and the
# `VarlenBatch` (so the gathers and masks are prepared once, not per layer), and called by every
# layer. `TorchPagedAttention`, the reference backend, first writes the new K/V of all sequences
# through the {term}`slot mapping`, then attends in two groups: `DecodeAttention`, all decodes as
# one `[decodes, kv_heads, group, context]` call, and `PrefillAttention`, the prefill chunks padded
# to the longest chunk — so a long prompt never pads every decode to its length. Backends are
# registered by name and `EngineConfig(attention_backend=...)` picks one; its default, "auto", takes
# the {term}`kernel <kernel (CUDA)>` registered for the device. Chapters 07 and 08
# write those kernels, which read the cache in place — a CPU one and a CUDA one — and check that
# they give the reference's tokens, token for token.

# %%
show(TorchPagedAttention.__call__)

# %% [markdown]
# ## Build: sampling that belongs to the request
#
# The runner samples all rows in one call. Each row has its own temperature, top-k and top-p,
# gathered once per step into a `SamplingMetadata` (`SamplingMetadata.from_sequences`, one row per
# sequence that picks a token); `token_probs` turns the logits into the distribution each request
# asked for, and `sample_from_probs` draws from it by inverse CDF with one uniform number per row.

# %%
show(token_probs)

# %% [markdown]
# Where does the uniform number come from? If it came from one random generator that every draw
# advances, a request's tokens would depend on how many other requests drew before it: on the batch,
# on chunking, on arrival order. So the number is *computed* from the request's seed and the
# position of the token being drawn, by a counter-based hash. Token 17 of the request with seed 5
# sees the same number in any batch, in any run:

# %%
print(position_uniforms(seeds=[5, 5, 6], positions=[17, 18, 17]))
print(position_uniforms(seeds=[6, 5], positions=[17, 17]), "<- same (seed, position), same number")

# %% tags=["hide-input"] mystnb={"figure": {"caption": "The probabilities of the eight most likely next tokens (at temperature 1, no top-k or top-p) after the prompt 'ROMEO:' and a new line starting with 'I', under four combinations of temperature, top-k and top-p, side by side: each setting reshapes the same logits.", "name": "fig-04-sampling-params"}}
logits = model(torch.tensor(tokenizer.encode("ROMEO:\nI", add_bos=True)))[-1:].detach()
settings = [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 0, 0.8), (1.0, 5, 1.0)]
probs = {
    f"T={t}, top_k={k}, top_p={p}": token_probs(
        logits, torch.tensor([t]), torch.tensor([k]), torch.tensor([p])
    )[0]
    for t, k, p in settings
}
top = probs["T=1.0, top_k=0, top_p=1.0"].argsort(descending=True)[:8]  # the plain distribution's
fig, ax = plt.subplots(figsize=(7.5, 3))
draw_next_token_probs(
    ax,
    [tokenizer.token_repr(int(i)) for i in top],
    {name: setting[top].tolist() for name, setting in probs.items()},
)
ax.set_title("the next token after 'ROMEO:\\nI', by sampling parameters")
plt.show()

# %% [markdown]
# ## The model runner and the engine
#
# The model runner turns a `StepPlan` into tokens, and holds no policy: it builds the sampling
# metadata and the batch once, runs one forward pass and samples. (The {term}`drafter`'s proposals
# are chapter 06's {term}`speculative decoding`; without a drafter `propose` returns nothing and
# `sample` draws one token per row.) A row of logits no token can be drawn from (NaN or +inf from
# an overflow, or nothing finite) is set aside first: its sequence gets no token and the engine
# ends it, "abort" with the reason, while the rest of the batch samples as usual.

# %%
show(ModelRunner.execute)

# %% [markdown]
# `LLMEngine` connects the pieces and adds no policy of its own either: schedule, execute, update
# the sequences (append the tokens, check for stops, free the finished ones' blocks), record one
# trace entry, and hand back a `RequestOutput` for every request that got a token or finished.

# %%
show(LLMEngine.step)

# %% [markdown]
# ## Check: the same tokens as chapter 02, alone or in a crowd
#
# Greedy decoding in the engine must give exactly the tokens of chapter 02's contiguous cache, and a
# request's tokens must not depend on what else is in the batch — greedy or sampled.

# %%
engine = LLMEngine(model)
greedy = SamplingParams(max_tokens=40, temperature=0)
for prompt, out in zip(prompts[:4], engine.generate(prompts[:4], greedy)):
    ids = tokenizer.encode(prompt, add_bos=True)
    expected = generate_cached(
        model, ids, 40, ContiguousKVCache(model.config, "preallocate", 512), eos_id=EOS
    )
    assert out.token_ids == expected
print("engine == chapter 02's cache, token for token")

sampled = [SamplingParams(max_tokens=40, temperature=0.8, top_p=0.95, seed=i) for i in range(16)]
together = LLMEngine(
    model, EngineConfig(scheduler=SchedulerConfig(max_num_batched_tokens=64))
).generate(prompts, sampled)
for i in [0, 7, 15]:
    alone = LLMEngine(model).generate([prompts[i]], sampled[i])[0]
    assert alone.token_ids == together[i].token_ids
print("seeded sampling: the same tokens alone and in a chunked batch of 16")
print(repr(together[0].text))

# %% [markdown]
# Text can also stream out as it is made. `stream` yields each request's new text every step, whole
# UTF-8 characters only (chapter 01's {term}`streaming decoder`), and never a piece of a stop string
# that might still have to be cut:

# %%
engine = LLMEngine(model)
pieces = {}
for delta in engine.stream(
    ["ROMEO:\n", "JULIET:\n"], SamplingParams(max_tokens=60, temperature=0.8, seed=1, stop="\n\n")
):
    pieces.setdefault(delta.request_id, []).append(delta.text)
    if delta.finish_reason:
        print(
            f"request {delta.request_id}: {len(pieces[delta.request_id])} deltas, finish_reason "
            f"{delta.finish_reason!r}, text {''.join(pieces[delta.request_id])!r}"
        )

# %% [markdown]
# ## See: continuous against static
#
# The same 16 requests, the same four places, now with {term}`continuous batching`. Each row is a
# request: grey while it waits, hatched while its prompt is prefilled, solid while it decodes.

# %% tags=["hide-input"] mystnb={"figure": {"caption": "Static (top) against continuous (bottom) batching: the same 16 requests, four places; each row a request (grey: waiting, hatched: prefill, solid: decode).", "name": "fig-04-gantt"}}
continuous, continuous_out = run(prompts, params, max_num_seqs=4)
assert [o.token_ids for o in continuous_out] == [o.token_ids for o in static_out]
fig, axes = plt.subplots(2, 1, figsize=(7.5, 6.5), sharex=True)
draw_gantt(axes[0], static.trace, f"static batching: {len(static.trace)} steps")
draw_gantt(axes[1], continuous.trace, f"continuous batching: {len(continuous.trace)} steps")
plt.tight_layout()
plt.show()
saved_steps = len(static.trace) - len(continuous.trace)
print(
    f"same tokens; static {len(static.trace)} steps, continuous {len(continuous.trace)} steps "
    f"({abs(saved_steps) / len(static.trace):.0%} {'fewer' if saved_steps >= 0 else 'more'})"
)

# %% [markdown]
# Under static batching a request waits until a whole batch has drained; under continuous batching
# it takes the first free place. Batch occupancy tells the same story per step:

# %% tags=["hide-input"] mystnb={"figure": {"caption": "Batch occupancy: how many sequences each engine step ran, out of four places, under static and continuous batching; the legend gives the share of places kept busy.", "name": "fig-04-occupancy"}}
fig, ax = plt.subplots(figsize=(7.5, 2.8))
for engine_run, name, color in [(static, "static", 1), (continuous, "continuous", 0)]:
    busy = [len(r.decoded) + len(r.prefilled) for r in engine_run.trace]
    ax.step(
        range(1, len(busy) + 1),
        busy,
        where="mid",
        color=sequence_color(color),
        label=f"{name}: {slot_use(engine_run.trace, 4):.0%} of places busy",
    )
ax.set_xlabel("engine step")
ax.set_ylabel("sequences in the step")
ax.set_ylim(0, 4.5)
ax.legend()
ax.set_title("batch occupancy")
plt.show()

# %% [markdown]
# ## Traces
#
# Every step left a `StepRecord`: who was admitted, who decoded, who prefilled how many tokens, who
# finished and why, who is running and waiting, how many blocks are used. The figures above were
# drawn from nothing else (chapter 05's timelines will be too). Records export as JSON lines and
# read back, so a trace saved from a run, or from chapter 09's server, can be plotted later:

# %%
import tempfile
from pathlib import Path

record = continuous.trace[20]
print(record.to_dict(timings=False))
with tempfile.TemporaryDirectory() as folder:
    path = Path(folder) / "trace.jsonl"
    write_jsonl(continuous.trace, path)
    assert [r.to_dict(False) for r in read_jsonl(path)] == [
        r.to_dict(False) for r in continuous.trace
    ]
print(f"{len(continuous.trace)} records written and read back")

# %% [markdown]
# ## Measure: the paged layout against the basic one
#
# Everything so far ran on chapter 03's paged pool. Servers before vLLM kept K/V as chapter 02's
# preallocating cache does: one region per request, reserved when the request is admitted for the
# longest it may ever grow — the model's whole context, `max_model_len` — and released when it
# finishes {cite}`kwon2023pagedattention`. The engine runs that way too, and only the block manager
# changes: with `EngineConfig(kv_layout="contiguous")` (`minivllm serve --kv basic` on the command
# line) a sequence's first `allocate_slots` takes the blocks of the whole context at once
# (`reserved_blocks`, below), and every later call finds its slots already held. The scheduler, the
# runner and the kernels do not know; they still see block tables.

# %%
show(BlockManager.allocate)

# %% [markdown]
# The basic layout shares nothing, as the servers before paging did not: a prompt cannot point at
# another prompt's blocks (no prefix caching), and a request's n samples each compute the prompt in
# regions of their own. Every `StepRecord` now also carries what the block tables hold after the
# step, from `BlockManager.memory()`: the pool in use, the reserved slots that hold no token (the
# tail of a last block when paged, the unused context when basic), and the blocks that sharing
# saved. It is one pass over the sequences' tables, never over blocks, so it costs the engine's
# step next to nothing.

# %%
show(BlockManager.memory)

# %% [markdown]
# The 16 requests from the start of the chapter, each now opening with the same preamble (the role
# of a system prompt), run three ways in one small pool: basic, paged, and paged with
# {term}`prefix caching`.

# %%
from minivllm.book.figures.timelines import draw_memory_trace

preamble = text[1000:1063]
shared_prompts = [preamble + p for p in prompts]
layouts = {  # name: (EngineConfig.kv_layout, prefix caching)
    "basic": ("contiguous", False),
    "paged": ("paged", False),
    "paged + prefix cache": ("paged", True),
}
layout_runs = {}
for name, (kv_layout, caching) in layouts.items():
    scheduler = SchedulerConfig(max_num_seqs=16, enable_prefix_caching=caching)
    config = EngineConfig(num_blocks=64, kv_layout=kv_layout, scheduler=scheduler)
    engine = LLMEngine(model, config)
    started = time.perf_counter()
    outs = engine.generate(shared_prompts, params)
    layout_runs[name] = (engine, [o.token_ids for o in outs], time.perf_counter() - started)
basic_engine = layout_runs["basic"][0]
print(
    f"preamble: {len(preamble)} characters; pool: {basic_engine.config.num_blocks} blocks of "
    f"16 slots; the basic layout reserves {basic_engine.manager.reserved_blocks} blocks "
    f"({model.config.max_seq_len} tokens) per request"
)
rows = {
    "engine steps": lambda t: len(t),
    "running sequences per step, mean": lambda t: f"{np.mean([len(r.running) for r in t]):.1f}",
    "running sequences, most at once": lambda t: max(len(r.running) for r in t),
    "preemptions": lambda t: sum(len(r.preempted) for r in t),
    "pool in use (blocks), mean": lambda t: f"{np.mean([r.kv_utilization for r in t]):.0%}",
    "reserved slots empty, mean": lambda t: f"{np.mean([r.fragmentation for r in t]):.0%}",
    "blocks saved by sharing, mean": lambda t: f"{np.mean([r.saved_fraction for r in t]):.0%}",
}
print(f"\n{'':33}" + "".join(f"{name:>21}" for name in layout_runs))
for label, measure in rows.items():
    cells = "".join(f"{measure(run[0].trace)!s:>21}" for run in layout_runs.values())
    print(f"{label:33}{cells}")
tokens = [run[1] for run in layout_runs.values()]
assert tokens[0] == tokens[1] == tokens[2]
print("\nthe same greedy tokens under all three:", tokens[0] == tokens[1] == tokens[2])

# %% [markdown]
# The basic layout keeps most of the pool reserved and most of what it reserves empty: no request
# here comes near the model's context, yet each holds all of it from its first step to its last. So
# it runs only as many requests at once as whole contexts fit, and it never preempts anyone, since
# nobody ever needs another block. Paging reserves what the tokens fill, up to the tail of each last
# block, so the same memory runs several times as many requests at once; when the pool does run
# out, it preempts (chapter 05) and recomputes. Prefix caching then holds the preamble's blocks once
# for every request that starts with them: the third series, and room for more requests still.

# %% tags=["hide-input"] mystnb={"figure": {"caption": "The step trace's memory series for the same 16 requests in the same 64-block pool: the pool's blocks in use, the reserved slots holding no token, and the blocks saved by sharing, under the basic layout, the paged one, and the paged one with prefix caching.", "name": "fig-04-kv-layouts"}}
fig, axes = plt.subplots(3, 1, figsize=(7.5, 6.5), sharex=True, sharey=True)
for ax, (name, (engine, _, _)) in zip(axes, layout_runs.items()):
    draw_memory_trace(ax, engine.trace, f"{name}: {len(engine.trace)} steps")
for ax in axes[:-1]:
    ax.set_xlabel("")
axes[-1].legend(loc="center right", fontsize=9)
plt.tight_layout()
plt.show()

# %%
# NBVAL_IGNORE_OUTPUT
for name, (_, outs, seconds) in layout_runs.items():
    made = sum(len(o) for o in outs)
    print(f"{name:22} {made / seconds:6.0f} tokens/s on this machine ({seconds:.1f} s)")

# %% [markdown]
# ## Measure: throughput against concurrency
#
# 16 requests of 32 new tokens each, with at most 1, 2, 4, 8 or 16 of them running at once. The
# number of steps halves with each doubling; the time per step grows far more slowly than the batch,
# because a {term}`decode step` is dominated by reading the weights, not by the number of rows.

# %%
bench_prompts = [text[s : s + 48] for s in rng.integers(0, len(text) - 48, size=16)]
bench_params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
results = {}
for concurrency in [1, 2, 4, 8, 16]:
    engine = LLMEngine(model, EngineConfig(scheduler=SchedulerConfig(max_num_seqs=concurrency)))
    started = time.perf_counter()
    outs = engine.generate(bench_prompts, bench_params)
    seconds = time.perf_counter() - started
    results[concurrency] = (len(engine.trace), sum(len(o.token_ids) for o in outs), seconds)
print("concurrency  steps  tokens/step")
for concurrency, (steps, tokens, _) in results.items():
    print(f"{concurrency:11d}  {steps:5d}  {tokens / steps:11.1f}")

# %% mystnb={"figure": {"caption": "Throughput in tokens per second against the number of requests allowed to run at once (log scale), measured on the machine that built this page.", "name": "fig-04-throughput"}}
# NBVAL_IGNORE_OUTPUT
for concurrency, (steps, tokens, seconds) in results.items():
    print(
        f"concurrency {concurrency:2d}: {tokens / seconds:7.0f} tokens/s, "
        f"{1000 * seconds / steps:5.1f} ms per step"
    )
fig, ax = plt.subplots(figsize=(6, 3))
ax.plot(list(results), [t / s for _, t, s in results.values()], "o-", color=sequence_color(0))
ax.set_xscale("log", base=2)
ax.set_xlabel("max_num_seqs (requests running at once)")
ax.set_ylabel("tokens / s")
ax.set_title("throughput against concurrency (this machine)")
plt.show()

# %% [markdown]
# The full benchmark, `benchmarks/throughput.py`, runs 64 requests with prompts of 16–200 bytes and
# 32–256 new tokens through continuous batching, static batching, naive sequential generation and
# Hugging Face `transformers` (batched with padding, and one by one), and measures how much of each
# step is engine overhead rather than model.
#
# ## Exercises
#
# Solutions live between `### BEGIN SOLUTION` and `### END SOLUTION` in
# `src/minivllm/sched/scheduler.py` (ch04.4), `src/minivllm/runner/sampler.py` (ch04.1, ch04.2) and
# `src/minivllm/runner/batch.py` (ch04.3); run one exercise's tests with
# `pytest tests --exercise ch04.4`.
#
# 1. **ch04.4 — the admission loop** (this chapter's core). Write the loop in `Scheduler._admit`
#    that takes waiting sequences into the running batch, head of `self.waiting` first, while
#    budget is left. Stop at the first sequence that does not fit, so that nobody overtakes it: it
#    needs more seats than `max_num_seqs` leaves (`_seats` counts one, plus its forks), or its
#    prompt does not fit what is left of the budget and it may not be chunked (`_may_chunk`), or
#    `allocate_slots` answers 0. A sequence that fits starts after what the prefix cache holds of
#    its first `_prefill_end` tokens (`_prefix_hits`: the blocks and their token count), computes
#    as much of the rest as the budget allows, and leaves the queue: `_start_running`, its first
#    chunk from `_chunk`, and the running totals `admitted`, `hit_tokens`, `seats` and `budget`.
#    The tests check the budget, first come first served, a refused head that stops admission and
#    holds no block, seats for forks, the first chunk of a prompt larger than the budget left, and
#    prefix hits that spend no budget; a hypothesis test replays random workloads against a fake
#    KV cache. Every later chapter's engine admits through this loop. Three hints, from a nudge to
#    nearly the answer, are folded below the list.
# 2. **ch04.1 — top-k and top-p.** In `token_probs`, turn `scaled` (the temperature-scaled logits,
#    `[B, V]` float64, $-\infty$ where a token is already ruled out) into `probs`, the `[B, V]`
#    distribution the lines after yours return. For each row, in this order: keep its `top_k` most
#    likely tokens (0, or any k of at least V, keeps all) and renormalise them; then, on *that*
#    renormalised head, keep the smallest run of tokens, likeliest first, whose mass reaches
#    `top_p` — a run whose mass equals p is enough, and the top token always stays — and
#    renormalise again. The order matters, and the tests check it: top-k 2 turns
#    [0.4, 0.3, 0.2, 0.1] into [4/7, 3/7, 0, 0], so top-p 0.5 then keeps only the first token,
#    where top-p on the original distribution would have kept two. Equal probabilities keep their
#    vocabulary order. Rows have different settings: do it for the whole batch at once (sort, mask,
#    scatter back), no loop over rows.
#
#    *Hint:* Sort each row once (descending, and `stable=True` for the ties). Mask by rank in the
#    sorted *logits* before the softmax, and the softmax does the first renormalisation for you.
#    For top-p, decide each token by the mass strictly *before* it: that keeps the token that
#    crosses p, and the top token, whose mass before is 0.
# 3. **ch04.2 — inverse CDF.** In `sample_from_probs`, return a `[B]` long tensor: for each row, the
#    first token whose running total of probability *exceeds* `u` times the row's total (its last
#    running total; rows need not sum to exactly 1). `u` is already a `[B, 1]` float64 column of
#    uniforms in [0, 1). A zero-probability token must never be picked, and no u may take you past
#    the last token. The tests check the boundaries (u = 0, u just below and at a running total,
#    the largest u), rows that do not sum to 1, and random rows with zeros in them.
#
#    *Hint:* `torch.searchsorted` on the row-wise cumulative sum does every row at once. Read what
#    its `right` argument does with a running total *equal* to the target: a zero-probability token
#    has the same running total as the token before it.
# 4. **ch04.3 — flatten a chunk.** In `pack_batch`, append one piece's token ids to `input_ids`, the
#    offset where it ends in the flat batch to `query_start`, and its context length to
#    `context_lens` (positions and slots follow for every token at once, below the loop). The tests
#    compare hand-worked steps token by token.
#
#    *Hint:* `query_start` holds cumulative offsets (it starts as `[0]`), and the code below yours
#    reads its last entry. A piece's context length counts everything its queries attend to: the
#    cached history *and* the piece's own tokens, a number the loop has already computed.
# 5. *(Explore, no test.)* Rerun the static/continuous comparison with `max_num_batched_tokens=16`.
#    Which requests' {term}`time to first token <time to first token (TTFT)>` grows, and why do
#    decodes not slow down?
#
#    *Hint:* Each step the scheduler gives the budget to the running decodes first, one token each;
#    prefills get what is left, in chunks. Count how many steps the chapter's prompts (their
#    lengths are printed where the workload is built, at the top) need to prefill when up to four
#    decodes come first.

# %% [markdown]
# The hints for ch04.4, the chapter's core, are folded: open one at a time.
#
# :::{admonition} Hint 1 for ch04.4 — a nudge
# :class: dropdown
# Look at the head of the queue without taking it off (`self.waiting[0]`): only once every check
# has passed — seats, budget, blocks — may it leave the queue. Each check that fails ends the loop
# with `break`, never `continue`: a sequence further back must not overtake the head.
# :::
#
# :::{admonition} Hint 2 for ch04.4 — the approach
# :class: dropdown
# For the head: count its seats against `config.max_num_seqs`; find where its prefill ends and how
# many of those tokens the prefix cache already holds; the tokens to compute now are the uncached
# rest, capped by the budget. Fewer than the rest is a chunk, allowed only if `_may_chunk` says
# so. Then ask `manager.allocate_slots` for that many slots after the cached tokens, passing the
# hit blocks as `prefix_blocks`. Only on a yes: take it off the queue, start it, append its chunk,
# and update the four totals.
# :::
#
# :::{admonition} Hint 3 for ch04.4 — nearly there
# :class: dropdown
# The loop runs `while` the queue is not empty and `budget` is positive. Inside it, in order:
# `break` if `seats` plus the head's `_seats` exceeds the limit; `end` from `_prefill_end`; the
# pair `(hits, cached)` from `_prefix_hits(seq, end)`; `num_new` is the smaller of `end - cached`
# and `budget`; `break` if that is short of `end - cached` and the sequence may not be chunked;
# `break` if `allocate_slots(seq.seq_id, cached, num_new, prefix_blocks=hits)` grants nothing.
# Then `popleft()`, `_start_running(seq, cached)`, `seats` grows by its seats, a prefill chunk of
# `num_new` tokens (`is_prefill=True`) joins `chunks`, its id joins `admitted`, `cached` is added to
# `hit_tokens` and `num_new` taken from `budget`.
# :::

# %% [markdown]
# ## Summary
#
# minivllm is an engine: requests arrive at any time, the scheduler plans each step under a token
# budget (decodes first, then prefill chunks), one forward pass runs every scheduled token of every
# sequence as one flat batch over the paged cache, and each request's sampling is a pure function of
# its seed and position, so its tokens do not depend on what else is in the batch. The Gantt chart
# above is the point: no slot waits for the longest member of a static batch.
#
# **The same idea in vLLM.** The scheduler: `vllm/v1/core/sched/scheduler.py` (`Scheduler.schedule`
# returns a `SchedulerOutput`, our `StepPlan`); the flat batch and its metadata:
# `vllm/v1/worker/gpu_model_runner.py` (`_prepare_inputs`); the sampler: `vllm/v1/sample/sampler.py`;
# the engine loop: `vllm/v1/engine/core.py`. nano-vllm: `nanovllm/engine/scheduler.py`,
# `model_runner.py` and `llm_engine.py`.
