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
# # Chapter 02 — Keep the keys and values: the contiguous KV cache
#
# :::{admonition} At a glance
# - **Builds:** a KV cache, checked against naive generation, and a memory arena that shows why one
#   contiguous cache per sequence fails a server.
# - **Needs:** chapters 00 and 01.
# - **Runs in:** about 40 s, start to end (`make book` on a quiet 2-core AMD EPYC).
# :::
#
# Chapter 00 ended with a plot that climbed: {term}`naive generation` re-runs the model over the
# whole sequence for every new token, so each token costs more than the last. Yet most of that work
# computes the same numbers again. This chapter keeps them — a *{term}`KV cache`*
# {cite}`pope2023efficiently` — and watches the time per token go flat. Then it asks what the cache
# costs in memory when a server holds many sequences at once, and finds the problem that chapter 03
# solves.

# %% tags=["remove-input"] mystnb={"image": {"alt": "The roadmap of the engine, chapter 02 highlighted: the chapters before it built, those after it to come"}}
from minivllm.book.figures.roadmap import roadmap

roadmap(2)

# %%
import time

import matplotlib.pyplot as plt
import torch

from minivllm.book import sequence_color, show, use_book_style
from minivllm.book.stats import within
from minivllm.model.checkpoint import load_model
from minivllm.model.tokenizer import ByteTokenizer
from minivllm.stages.contiguous import (
    ContiguousKVCache,
    cached_causal_mask,
    generate_cached,
    stream_cached,
)
from minivllm.stages.naive import generate_naive, next_token_logits

torch.manual_seed(0)
torch.set_num_threads(2)
use_book_style()
model, tokenizer = load_model("target"), ByteTokenizer()
config = model.config

# %% [markdown]
# ## Why: the same keys, computed again and again
#
# Token *i*'s key and value in a layer depend only on tokens 0..*i*: causal attention never lets an
# earlier token see a later one, and {term}`RoPE` rotates each key by its own position, which never
# changes. So when step *t* of naive generation recomputes the keys and values of tokens 0..*t*-1,
# it gets exactly the numbers step *t*-1 already had. Check it: the keys layer 0 hands to the seam
# for a prefix are the first rows of the keys it hands over for a longer sequence.


# %%
class KeepKeys:
    """An attention object that remembers layer 0's keys, then does ordinary causal attention."""

    def __init__(self) -> None:
        self.k0 = None

    def __call__(self, layer, q, k, v):
        if layer == 0:
            self.k0 = k.clone()
        return torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True
        ).transpose(0, 1)


ids = tokenizer.encode("ROMEO:\nBut soft, what light through yonder window breaks?", add_bos=True)
short, full = KeepKeys(), KeepKeys()
with torch.no_grad():
    model(torch.tensor(ids[:20]), attention=short)
    model(torch.tensor(ids), attention=full)
difference = (short.k0 - full.k0[:20]).abs().max()
print(f"the first 20 keys of both passes: max |difference| {within(difference, 1e-5)}")

# %% [markdown]
# The same numbers, up to float32 rounding (a matrix product of more rows may add in another
# order). The fix is to compute each token's keys and values once, keep them, and feed the model
# only the tokens it has not seen.
#
# ## Build: an attention object with a memory
#
# The model already has the seam for this (chapter 00): each layer hands `(layer, q, k, v)` to an
# attention object. A cache is an attention object that appends the new `k` and `v` to what it holds
# for that layer, then lets the new queries attend over *all* of it.

# %%
show(ContiguousKVCache.__call__)

# %% [markdown]
# A call can carry one new token (a {term}`decode step`) or many (the prompt, in one
# *{term}`prefill`* pass). Query *i* of the call sits at absolute position `start + i`: it may look
# at the whole history and at the new tokens up to itself. That is the mask — exercise ch02.2:

# %%
show(cached_causal_mask)

# %%
print(cached_causal_mask(start=3, new_tokens=2).int())

# %% [markdown]
# Two new queries at positions 3 and 4: the first sees keys 0–3, the second keys 0–4.
#
# Generation now runs the whole prompt through the model once, then feeds one token per step at its
# position. It picks tokens exactly as `stream_naive` does (same `pick_token`, same seeded
# generator), so the two must agree token for token.

# %%
show(stream_cached)

# %% [markdown]
# ### Where the history lives: two classic strategies
#
# A *contiguous* cache keeps each layer's keys (and values) as one `[length, n_kv_heads, head_dim]`
# tensor. A tensor cannot grow in place, so there are two ways to add rows:
#
# - **grow by concatenation** — `torch.cat` the history with the new rows. Memory is exactly what
#   the sequence holds, but every append copies the whole history into a new tensor (exercise
#   ch02.1);
# - **preallocate to the maximum length** — reserve `max_len` rows up front and write into slices.
#   No copies, but every sequence pays for `max_len` rows, however short it turns out to be.

# %%
show(ContiguousKVCache._append_concat)

# %%
show(ContiguousKVCache._append_preallocated)

# %% [markdown]
# ## Check: the same tokens, the same logits
#
# Greedy generation with either cache must produce exactly chapter 00's tokens, and every decode
# step's logits must match a full recompute.

# %%
prompts = ["ROMEO:\n", "KING HENRY V:\nOnce more unto the breach", "First Witch:\n"]
for prompt in prompts:
    prompt_ids = tokenizer.encode(prompt, add_bos=True)
    naive = generate_naive(model, prompt_ids, 60)
    for strategy in ("concat", "preallocate"):
        cached = generate_cached(model, prompt_ids, 60, ContiguousKVCache(config, strategy))
        assert cached == naive, (prompt, strategy)
    print(f"{prompt!r:45} 60 tokens identical for naive, concat and preallocate")

# %%
prompt_ids = tokenizer.encode("JULIET:\nO Romeo, Romeo!", add_bos=True)
cache = ContiguousKVCache(config, "concat")
worst, ids = 0.0, list(prompt_ids)
with torch.no_grad():
    logits = model(torch.tensor(ids), torch.arange(len(ids)), cache)[-1]
    for _ in range(40):
        worst = max(worst, (logits - next_token_logits(model, ids)).abs().max().item())
        ids.append(int(logits.argmax()))
        logits = model(torch.tensor([ids[-1]]), torch.tensor([cache.length]), cache)[-1]
print(f"largest |cached - recomputed| logit over 40 decode steps: {within(worst, 1e-4)}")

# %% [markdown]
# The differences are float32 rounding: the cached path adds the same numbers in a different order.
#
# ## Measure: time per token
#
# Generate 300 tokens both ways and time every step.


# %%
# NBVAL_IGNORE_OUTPUT
def time_steps(step_fn, n: int) -> list[float]:
    times = []
    for _ in range(n):
        started = time.perf_counter()
        step_fn()
        times.append(time.perf_counter() - started)
    return times


start_ids = tokenizer.encode("ROMEO:\n", add_bos=True)
naive_ids = list(start_ids)
naive_times = time_steps(
    lambda: naive_ids.append(int(next_token_logits(model, naive_ids).argmax())), 300
)

cache = ContiguousKVCache(config, "preallocate")
cached_ids = list(start_ids)
with torch.no_grad():
    model(torch.tensor(cached_ids[:-1]), torch.arange(len(cached_ids) - 1), cache)


def cached_step() -> None:
    with torch.no_grad():
        logits = model(torch.tensor(cached_ids[-1:]), torch.tensor([cache.length]), cache)[-1]
    cached_ids.append(int(logits.argmax()))


cached_times = time_steps(cached_step, 300)
assert cached_ids == naive_ids
for name, times in [("naive", naive_times), ("cached", cached_times)]:
    print(
        f"{name:6}: first 10 steps {1000 * sum(times[:10]) / 10:5.1f} ms/token, "
        f"last 10 steps {1000 * sum(times[-10:]) / 10:5.1f} ms/token, total {sum(times):5.2f} s"
    )

# %% tags=["hide-input"] mystnb={"figure": {"caption": "Time per generated token against its position: chapter 00's naive recompute against the KV cache; with the cache the time per token stops growing.", "name": "fig-02-step-time"}}
fig, ax = plt.subplots()
positions = range(len(start_ids), len(start_ids) + 300)
ax.plot(
    positions,
    [1000 * t for t in naive_times],
    ".",
    ms=3,
    color=sequence_color(3),
    label="naive (chapter 00)",
)
ax.plot(
    positions,
    [1000 * t for t in cached_times],
    ".",
    ms=3,
    color=sequence_color(0),
    label="KV cache",
)
ax.set_xlabel("position of the generated token")
ax.set_ylabel("time for that token (ms)")
ax.set_ylim(bottom=0)
ax.set_title("With a KV cache the time per token stops growing")
ax.legend()
plt.show()

# %% [markdown]
# The cached step still reads the whole history in attention, so it is not perfectly flat, but at
# this model's size attention over a few hundred keys is cheap next to the matrix multiplies of one
# token; the naive step redoes all of those for every earlier token.
#
# ## What the strategies cost in memory
#
# Each cached token holds a key and a value per layer. Follow both strategies through a 300-token
# generation: how many bytes they hold, and how many bytes concatenation copies.


# %%
def follow(strategy: str, tokens: int) -> list[tuple[int, int, int, int]]:
    """(length, used, reserved, copied) bytes after each step of a generation."""
    cache, rows = ContiguousKVCache(config, strategy, max_len=config.max_seq_len), []
    for _ in stream_cached(model, start_ids, tokens, cache):
        rows.append((cache.length, cache.used_bytes, cache.reserved_bytes, cache.bytes_copied))
    return rows


concat_rows, prealloc_rows = follow("concat", 300), follow("preallocate", 300)
cache = ContiguousKVCache(config, "concat")
print(f"one token's K and V in all {config.n_layers} layers: {cache.per_token_bytes:,} bytes")
for name, rows in [("concat", concat_rows), ("preallocate", prealloc_rows)]:
    length, used, reserved, copied = rows[-1]
    print(
        f"{name:11}: {length} tokens cached, {used / 1024:6.0f} KiB used, "
        f"{reserved / 1024:6.0f} KiB reserved, {copied / 2**20:6.1f} MiB copied"
    )

# %% tags=["hide-input"] mystnb={"figure": {"caption": "The two contiguous strategies through one 300-token generation. Left: bytes copied so far by concatenation and by preallocation; right: what preallocation reserves against what the cache actually holds.", "name": "fig-02-concat-prealloc"}}
fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4))
lengths = [r[0] for r in concat_rows]
left.plot(
    lengths,
    [r[3] / 2**20 for r in concat_rows],
    color=sequence_color(1),
    label="concat: bytes copied",
)
left.plot(
    lengths,
    [r[3] / 2**20 for r in prealloc_rows],
    color=sequence_color(0),
    label="preallocate: bytes copied",
)
left.set_xlabel("tokens cached")
left.set_ylabel("MiB")
left.set_title("Concatenation copies the history every step")
left.legend()
right.plot(
    lengths,
    [r[2] / 1024 for r in prealloc_rows],
    color=sequence_color(0),
    label="preallocate: reserved",
)
right.plot(
    lengths, [r[1] / 1024 for r in prealloc_rows], color=sequence_color(2), label="used (both)"
)
right.set_xlabel("tokens cached")
right.set_ylabel("KiB")
right.set_title("Preallocation reserves the maximum up front")
right.legend()
plt.show()

# %% [markdown]
# Concatenation's copies add up quadratically — the naive recompute's cost has moved from arithmetic
# to memory traffic. Preallocation copies nothing, but a sequence that stops early keeps its whole
# reservation. For one sequence either is fine. A server holds hundreds.

# %% [markdown]
# ## Why it fails a server
#
# A server keeps the caches of every running request in one fixed memory arena. With a contiguous
# cache, each request needs one unbroken range of slots, and since nobody knows in advance how long
# a reply will be, the range must cover the request's *maximum* length: prompt plus `max_tokens`.
#
# `minivllm.book.arena` simulates exactly that, with no model in the loop: a seeded stream of
# requests with mixed prompt and reply lengths arrives over time; each decode step every running
# request grows by one token and finishes when its reply is done; waiting requests are admitted
# first come, first served, into the first free range large enough (*first fit*).

# %%
from minivllm.book.arena import make_workload, simulate_contiguous

workload = make_workload(num_requests=200, seed=0)
prompts = [r.prompt_len for r in workload]
outputs = [r.output_len for r in workload]
reserved = [r.max_len for r in workload]
print(f"{len(workload)} requests arriving over {workload[-1].arrival} steps")
print(f"prompt tokens: mean {sum(prompts) / len(prompts):.0f}, max {max(prompts)}")
print(f"reply tokens:  mean {sum(outputs) / len(outputs):.0f}, max {max(outputs)}")
mean_reserved = sum(reserved) / len(reserved)
print(f"slots a contiguous cache must reserve (prompt + max_tokens): mean {mean_reserved:.0f}")

# %%
show(simulate_contiguous)

# %%
ARENA_SLOTS = 8192
contiguous = simulate_contiguous(workload, arena_slots=ARENA_SLOTS)
arena_mib = ARENA_SLOTS * cache.per_token_bytes / 2**20
print(f"arena: {ARENA_SLOTS:,} token slots = {arena_mib:.0f} MiB of KV for this model")
print(f"finished all {len(contiguous.completed)} requests in {contiguous.num_steps} steps")
print(f"KV utilisation (used / reserved, mean over steps): {contiguous.kv_utilisation:.1%}")
print(f"internal waste (reserved but unused):              {contiguous.internal_waste:.1%}")
print(
    f"external fragmentation: {contiguous.fragmentation_refusals} steps in which the next request "
    f"was refused although enough memory was free in total "
    f"({contiguous.fragmented_requests} distinct requests)"
)
print(f"running sequences: mean {contiguous.mean_running:.1f}, peak {contiguous.peak_running}")

# %% [markdown]
# Read the two losses separately:
#
# - **internal waste** — slots reserved for tokens a request will never produce. Most replies stop
#   far short of `max_tokens`, so most of each reservation stays empty;
# - **external fragmentation** — free memory exists, but in pieces: when short requests finish, they
#   leave holes between long-lived neighbours, and a new request needs one range big enough.
#
# See both in the arena's memory map: time runs left to right, the arena's slots bottom to top, one
# colour per request. The solid part of each band holds tokens; the pale part is reserved and empty.

# %% tags=["hide-input"] mystnb={"figure": {"caption": "Memory map of the contiguous arena: decode steps left to right, arena slots bottom to top, one colour per request. Solid: slots holding tokens; pale: reserved but empty (internal waste); grey: free, often in gaps too small for the next request (external fragmentation).", "name": "fig-02-arena-map"}}
import numpy as np
from matplotlib.colors import to_rgb

from minivllm.book import FREE_COLOR


def memory_map_image(result, steps: int, bin_slots: int = 16) -> np.ndarray:
    """RGB image: column = step, row = a bin of `bin_slots` slots; used, reserved-only or free."""
    image = np.tile(np.array(to_rgb(FREE_COLOR)), (result.capacity // bin_slots, steps, 1))
    for column, record in enumerate(result.steps[:steps]):
        for extent in record.memory_map:
            color = np.array(to_rgb(sequence_color(extent.seq_id)))
            first, reserved_end = (
                extent.start // bin_slots,
                (extent.start + extent.reserved) // bin_slots,
            )
            used_end = (extent.start + extent.used) // bin_slots
            image[first:reserved_end, column] = 0.3 * color + 0.7
            image[first:used_end, column] = color
    return image


fig, ax = plt.subplots(figsize=(9, 4))
shown_steps = 600
ax.imshow(
    memory_map_image(contiguous, shown_steps),
    aspect="auto",
    origin="lower",
    interpolation="nearest",
    extent=(0, shown_steps, 0, ARENA_SLOTS),
)
ax.set_xlabel("decode step")
ax.set_ylabel("arena slot")
ax.set_title("Contiguous arena: solid = tokens held, pale = reserved but empty, grey = free")
ax.grid(False)
plt.show()

# %% [markdown]
# The pale bands are internal waste; the grey gaps between bands, too small for the next request,
# are external fragmentation. Most of the arena holds nothing at any moment — yet requests wait.

# %% tags=["hide-input"] mystnb={"figure": {"caption": "Share of the contiguous arena reserved by requests and share actually holding tokens, step by step: the gap between the two lines is memory reserved for keys and values that never come.", "name": "fig-02-arena-share"}}
fig, ax = plt.subplots()
steps = [r.step for r in contiguous.steps]
ax.plot(
    steps,
    [r.reserved / ARENA_SLOTS for r in contiguous.steps],
    color=sequence_color(1),
    label="reserved",
)
ax.plot(
    steps,
    [r.used / ARENA_SLOTS for r in contiguous.steps],
    color=sequence_color(0),
    label="holding tokens",
)
ax.set_xlabel("decode step")
ax.set_ylabel("share of the arena")
ax.set_ylim(0, 1)
ax.set_title("A contiguous arena is full of reservations, not of keys and values")
ax.legend()
plt.show()

# %% [markdown]
# Chapter 03 runs this same workload through the same amount of memory, cut into small fixed-size
# blocks that a sequence takes one at a time as it grows — the {term}`paged KV cache`.
#
# ## Exercises
#
# Solutions live in `src/minivllm/stages/contiguous.py` between `### BEGIN SOLUTION` and
# `### END SOLUTION`; a student copy (`make student DEST=...`) replaces them with
# `raise NotImplementedError`. Run one exercise's tests with
# `pytest tests/test_kv_cache.py --exercise ch02.1`.
#
# 1. **ch02.1 — grow by concatenation.** Implement `ContiguousKVCache._append_concat`: `torch.cat`
#    the new rows onto this layer's K and V, store the results back in `self.k[layer]` and
#    `self.v[layer]` (`append` updates the lengths, not you), and add the bytes of the history you
#    copied to `self.bytes_copied`. The tests check what is stored and that the count equals the
#    exact sum over all appends.
#
#    *Hint:* Count before you concatenate: the copy that matters is the history already stored, K
#    and V of this layer, not the rows you append. `tensor_bytes` (imported at the top of the
#    module) gives a tensor's size.
# 2. **ch02.2 — the mask of a cached call.** Implement `cached_causal_mask(start, new_tokens)`: a
#    boolean `[new_tokens, start + new_tokens]` tensor, True where query *i* (at position
#    `start + i`) may look at key *j*. The tests check a decode step, a prefill, and a chunk in the
#    middle of a sequence.
#
#    *Hint:* Think in absolute positions, not row numbers: row *i* is position `start + i` and sees
#    key *j* exactly when $j \le$ `start + i`. A column of query positions compared against a row of
#    key positions builds the whole matrix in one broadcast.
# 3. *(Explore, no test.)* Change the workload's `max_tokens_choices` to reservations that match the
#    replies more tightly. How much of the waste comes back — and what does a server have to know in
#    advance for that to work?
#
#    *Hint:* `make_workload` takes `max_tokens_choices`, and it caps every reply at its
#    `max_tokens`: a reservation tighter than the reply cuts the reply short. Compare the reply
#    tokens served as well as the waste.

# %% [markdown]
# ## Summary
#
# A KV cache keeps every layer's keys and values, so each new token runs the model over one
# position instead of the whole sequence: the same logits, and a time per token that stays flat.
# But a server holding many sequences must decide where each sequence's cache lives; reserving the
# maximum length up front wastes most of the arena, and growing by copying wastes time. The memory
# figure above shows the arena turning requests away while mostly empty — chapter 03's problem.
#
# **The same idea in vLLM.** vLLM never keeps a contiguous per-sequence cache; it starts from
# chapter 03's blocks. Hugging Face `transformers` does keep one (`DynamicCache` grows by
# concatenation, `StaticCache` preallocates), which is why `generate` wastes memory on a batch of
# uneven sequences.
