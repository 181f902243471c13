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
# # Chapter 03 — Pages for keys and values: the paged KV cache
#
# :::{admonition} At a glance
# - **Builds:** a block manager (block tables, reference counts, prefix caching, copy-on-write) and
#   a paged K/V storage.
# - **Needs:** chapter 02.
# - **Runs in:** about 30 s, start to end (`make book` on a quiet 2-core AMD EPYC).
# :::
#
# Chapter 02's arena was mostly empty and still turned requests away: every sequence reserved its
# maximum length up front (internal waste), and the holes finished sequences left behind were too
# small for the next one (external fragmentation). Operating systems met the same problem with
# process memory and answered it with *paging*. vLLM's PagedAttention {cite}`kwon2023pagedattention`
# gives the {term}`KV cache` the same answer: cut the memory into small fixed-size **blocks**, give
# each sequence blocks one at a time as it grows, and keep a **{term}`block table`** that maps the
# sequence's logical blocks to physical ones, wherever they are.

# %% tags=["remove-input"] mystnb={"image": {"alt": "The roadmap of the engine, chapter 03 highlighted: the chapters before it built, those after it to come"}}
from minivllm.book.figures.roadmap import roadmap

roadmap(3)

# %%

import matplotlib.pyplot as plt
import torch

from minivllm.attention.storage import PagedKVStorage
from minivllm.book import sequence_color, show, use_book_style
from minivllm.book.arena import make_workload, simulate_contiguous, simulate_paged
from minivllm.book.figures.blocks import block_legend, draw_block_pool, draw_block_tables
from minivllm.book.stats import within
from minivllm.book.stepper import Stepper
from minivllm.kv.block_manager import BlockManager
from minivllm.kv.block_pool import BlockPool, OutOfBlocks
from minivllm.kv.prefix_cache import PrefixCache, block_hash
from minivllm.model.checkpoint import load_model
from minivllm.model.tokenizer import ByteTokenizer
from minivllm.stages.contiguous import ContiguousKVCache, generate_cached
from minivllm.stages.paged import (
    PagedAttention,
    generate_paged,
    paged_attention_reference,
)

torch.manual_seed(0)
torch.set_num_threads(2)
use_book_style()
model, tokenizer = load_model("target"), ByteTokenizer()
config = model.config

# %% [markdown]
# ## Why: the arena of chapter 02
#
# The same seeded workload as chapter 02, in the same memory:

# %%
workload = make_workload(num_requests=200, seed=0)
ARENA_SLOTS, BLOCK_SIZE = 8192, 16
contiguous = simulate_contiguous(workload, arena_slots=ARENA_SLOTS)
print(
    f"contiguous: KV utilisation {contiguous.kv_utilisation:.1%}, "
    f"{contiguous.fragmentation_refusals} steps refused with enough memory free, "
    f"{contiguous.mean_running_saturated:.1f} sequences running on average while requests queued"
)

# %% [markdown]
# ## Build: the policy — blocks, block tables, reference counts
#
# The paged cache has one boundary running through it. On one side is the *policy*, the package
# `minivllm.kv`: plain Python, no torch, testable without a model. `kv/block_pool.py` (`BlockPool`)
# counts who holds each block and hands out free blocks from a *free queue*; `kv/prefix_cache.py`
# names blocks so that a later prompt can reuse them (the prefix-caching section below);
# `kv/block_manager.py` (`BlockManager`) keeps a block table per sequence on top of both. On the
# other side is the *storage*, `attention/storage.py` (`PagedKVStorage`): one tensor, written and
# read only through what the policy decides.
#
# A sequence takes a new block only when the last one is full — *lazy growth*. How many new blocks
# does a sequence need to hold `extra_tokens` more? That is exercise ch03.1:

# %%
show(BlockManager.blocks_needed)

# %%
manager = BlockManager(num_blocks=12, block_size=4)
for held, extra in [(0, 1), (0, 4), (0, 5), (5, 3), (5, 4), (8, 1)]:
    print(
        f"holding {held} tokens, {extra} more -> {manager.blocks_needed(held, extra)} new block(s)"
    )

# %% [markdown]
# Growing is **transactional**: `append` checks that every block it needs is free *before* it takes
# any. Either the sequence grows, or `OutOfBlocks` says how many blocks were needed and how many
# were free — and nothing changed, so the caller (the {term}`scheduler` of chapter 04) can wait, or
# preempt someone (chapter 05), and simply retry.

# %%
show(BlockManager.append)

# %%
manager = BlockManager(num_blocks=12, block_size=4)
manager.allocate(0, 14)  # 4 blocks
manager.allocate(1, 21)  # 6 blocks
before = ({s: list(t.blocks) for s, t in manager.tables.items()}, manager.num_free)
try:
    manager.append(1, 12)  # needs 3 more, only 2 free
except OutOfBlocks as error:
    print("OutOfBlocks:", error, f"(needed={error.needed}, free={error.free})")
after = ({s: list(t.blocks) for s, t in manager.tables.items()}, manager.num_free)
assert before == after
print("state unchanged:", before == after)

# %% [markdown]
# ## See: block tables and the pool
#
# Which free block does a sequence get? `BlockPool` keeps the free blocks in a **free queue** and
# always hands out the one at the front. Blocks never used yet start at the front, in order 0, 1,
# 2, …. A block whose last holder lets go returns to the queue in `decref`, and that is where the
# order is decided: a block that holds nothing worth keeping goes to the *front*, to be reused
# first; a block the prefix cache can still hit (`keep`) goes to the *back*, to be evicted last. A
# prefix-cache hit can also take a free block back out of the middle of the queue, so all three
# moves must be O(1): an `OrderedDict` is the doubly linked list. vLLM's is `FreeKVCacheBlockQueue`
# in `vllm/v1/core/kv_cache_utils.py`.

# %%
show(BlockPool.decref)

# %% [markdown]
# Three sequences of different lengths in a pool of 16 blocks of 4 slots. Each sequence's block
# table (left) points into the pool (right); the blocks of one sequence need not be next to each
# other, which is exactly why there is no external fragmentation: any free block will do.


# %% tags=["hide-input"] mystnb={"figure": {"caption": "Block tables (left) and the block pool (right), an arrow from each logical block to its physical block: sequence 1 has finished, and sequence 3 took its freed blocks first, from the front of the free queue.", "name": "fig-03-free-queue"}}
def show_state(manager: BlockManager, title: str) -> None:
    # The page's width to the cells: tables and pool side by side, each as wide as its cells (the
    # widest table and its labels, 8 pool columns), little margin between.
    widest = max(len(table.blocks) for table in manager.tables.values())
    layout = {"width_ratios": [widest + 1.6, 8.1], "wspace": 0.05, "left": 0.01, "right": 0.99}
    fig, (tables_ax, pool_ax) = plt.subplots(1, 2, figsize=(7.5, 3.2), gridspec_kw=layout)
    centres = draw_block_pool(pool_ax, manager, columns=8)
    draw_block_tables(tables_ax, manager, pool_ax, centres)
    fig.suptitle(title, fontsize=10)
    plt.show()


manager = BlockManager(num_blocks=16, block_size=4)
manager.allocate(0, 10)
manager.allocate(1, 5)
manager.allocate(2, 13)
print("free queue, front first:  ", manager.allocator.free_blocks())
manager.free(1)  # sequence 1 finishes: its blocks hold nothing reusable, so they go to the front
print("after sequence 1 finishes:", manager.allocator.free_blocks())
manager.allocate(3, 7)  # ...and are the first to be reused
manager.append(0, 3)
show_state(manager, "sequence 1 finished; sequence 3 reuses its blocks first (front of the queue)")

# %% [markdown]
# ## Build: the storage, and attention through the block table
#
# `PagedKVStorage` (`attention/storage.py`) keeps all layers' keys and values in **one** tensor,
# `[num_layers, 2, num_blocks, block_size, n_kv_heads, head_dim]`. Each layer's slice,
# `[2, num_blocks, block_size, n_kv_heads, head_dim]`, is the shape vLLM's FlashAttention backend
# gives a layer's cache (nano-vllm stacks the layers inside the K/V axis instead, `[2, num_layers,
# ...]`). A token's place in it is its **slot**: `block * block_size + offset`. The
# model writes the new tokens' k and v through the {term}`slot mapping` the policy computed;
# attention reads a sequence's history back by *gathering* its blocks in table order (exercise
# ch03.3). That shape is how the tensor is indexed, not always how its memory is laid out: for the
# CPU kernel of chapter 07 a block keeps each head's rows together (it says why), and `storage.kv`
# is then a view that indexes the same way.

# %%
show(PagedKVStorage.gather)

# %%
show(paged_attention_reference)

# %% [markdown]
# `PagedAttention` (`stages/paged.py`) is the attention object that ties them together at the
# model's seam, for one sequence at a time. Before each pass it asks the block manager one question,
# `allocate_slots`: *may this sequence have slots for these new tokens?* The manager grows the
# block table (or refuses, changing nothing), and the pass maps the new tokens to slots; in each
# layer it writes k and v there and attends through the block table. `allocate_slots` is the same
# question chapter 04's scheduler asks for every sequence of every step, and this chapter's core
# exercise; its section comes after copy-on-write, which it also does.

# %%
show(PagedAttention.prepare)

# %% [markdown]
# ## Check: the same tokens as chapter 02
#
# Greedy generation through the paged cache must equal the contiguous cache's, whatever the block
# size — including block size 1, where every token has its own block.

# %%
prompts = ["ROMEO:\n", "KING HENRY V:\nOnce more unto the breach", "First Witch:\n"]
for prompt in prompts:
    prompt_ids = tokenizer.encode(prompt, add_bos=True)
    contiguous_tokens = generate_cached(model, prompt_ids, 60, ContiguousKVCache(config, "concat"))
    for block_size in (1, 4, 16):
        manager = BlockManager(num_blocks=512 // block_size + 8, block_size=block_size)
        storage = PagedKVStorage(config, manager.allocator.num_blocks, block_size)
        assert (
            generate_paged(model, prompt_ids, 60, manager, storage, seq_id=0) == contiguous_tokens
        )
        assert manager.num_free == manager.allocator.num_blocks  # every block returned
    print(f"{prompt!r:45} identical at block sizes 1, 4 and 16")
print(tokenizer.decode(contiguous_tokens))

# %% [markdown]
# ## Prefix caching: compute a shared prompt once
#
# Many requests start the same way — a system prompt, a few-shot preamble, the same play's opening.
# A full block's keys and values depend only on its tokens and every token before it, so a block can
# be *named* by a chained hash: the hash of the previous block's name and this block's token ids. A
# new prompt walks its full blocks, and every name already in the pool is a hit: reuse the block,
# skip the compute. A hit is verified against the stored token ids, never trusted on the hash alone.

# %%
show(block_hash)

# %% mystnb={"figure": {"caption": "Prefix caching: two sequences whose prompts start with the same system prompt. The system prompt's blocks are shared (hatched, labelled with how many tables hold them); each sequence owns its tail.", "name": "fig-03-prefix-sharing"}}
system = "SYSTEM:\nYou are a player in a company of actors. Answer in verse.\n\n"
questions = [
    "ROMEO:\nWhat light is this?\n\nJULIET:\n",
    "KING LEAR:\nWho is it that can tell me who I am?\n\nFOOL:\n",
]
manager = BlockManager(num_blocks=32, block_size=16)
storage = PagedKVStorage(config, 32, 16)
prompt_a, prompt_b = (tokenizer.encode(system + q, add_bos=True) for q in questions)

# Sequence A computes everything and keeps its blocks, named, in the pool.
attention_a = PagedAttention(manager, storage, seq_id=0)
print("A: cached prefix tokens:", manager.allocate_cached(0, prompt_a), "of", len(prompt_a))
with torch.no_grad():
    attention_a.forward(model, prompt_a, 0)

# Sequence B shares the system prompt: its full blocks hit, only the rest is computed.
attention_b = PagedAttention(manager, storage, seq_id=1)
hit = manager.allocate_cached(1, prompt_b)
print("B: cached prefix tokens:", hit, "of", len(prompt_b))
with torch.no_grad():
    logits_hit = attention_b.forward(model, prompt_b[hit:], hit)[-1]
    logits_scratch = model(torch.tensor(prompt_b))[-1]
difference = (logits_hit - logits_scratch).abs().max()
print(f"max |logits with the prefix hit - logits from scratch| {within(difference, 1e-4)}")
show_state(
    manager, "the system prompt's blocks are shared (hatched, ×2); each sequence owns its tail"
)

# %% [markdown]
# Shared blocks are reference-counted. A freed block keeps its name and contents until it is handed
# out again, so a later request can still hit it; when it *is* reallocated, its old name is
# forgotten so a stale hash can never match new contents.
#
# That is why the free queue has two ends. A block the prefix cache can still hit goes to the *back*
# when it is freed, so the cache evicts its least recently used blocks first (an LRU queue), and a
# finished sequence is released tail first, so its head — the part other prompts are most likely to
# share — is evicted last. Blocks that hold nothing reusable, and blocks never used at all, are
# handed out before any of them. A stack would do the opposite: the blocks freed last, the hottest
# entries of the cache, would be the first overwritten.
#
# Watch a "system prompt" of whole blocks survive an unrelated request that comes after it:

# %%
m = BlockManager(num_blocks=16, block_size=4)
sp = list(range(100, 108))  # two full blocks of 4
m.allocate_cached(0, sp + [1, 2, 3, 4, 5])  # the system prompt, then a question of its own
m.free(0)
print("sequence 0 finished; free queue, front first:", m.allocator.free_blocks())
m.allocate_cached(1, [7] * 12)  # an unrelated prompt of three blocks
print("sequence 1, unrelated, gets blocks:", m.block_table(1))
m.free(1)
hits = m.cached_prefix(sp + [9])
print("a new request with the same system prompt hits blocks:", hits)
assert len(hits) * m.block_size == len(sp)

# %% [markdown]
# Sequence 0's last block was only partly filled, and the cache names full blocks only, so it went
# to the front and was the first one reused; sequence 1 took never-used blocks after it; the named
# blocks waited at the back, the head of the prompt last, and the whole system prompt still hits.
#
# The block manager asks the prefix cache only five questions, written down as a `Protocol`:

# %%
show(PrefixCache)

# %% [markdown]
# `HashPrefixCache`, the chained hash above, is the one that ships. A radix tree over token ids —
# SGLang's RadixAttention {cite}`zheng2024sglang` — answers the same five questions with a tree walk
# instead of a dict, and plugs in at the same place: `BlockManager(num_blocks, block_size,
# prefix_cache=...)`.
#
# ### Copy-on-write
#
# What if a sequence must write into a block it shares? Two samples of one prompt (chapter 09's
# parallel sampling) **fork** it: the second sample's block table lists every block of the first,
# and each block's reference count goes up. Both will write their next token into the last,
# partly filled block, so before either does, `copy_on_write` gives the writer its own: it takes a
# fresh block, lets go of the old one, swaps the new one into the table, and queues the copy (old,
# new) for the storage, which makes it before the next forward pass (`take_copies`) — exercise
# ch03.2. The order is not what makes this safe: the old block is shared (reference count above 1),
# so letting go of it never frees it, and nobody can be handed it as a "fresh" block while another
# sequence still holds it. What does matter: the fresh block is taken *first*, so a pool with no
# free block raises `OutOfBlocks` before anything has changed; and the storage copies the old
# block's rows into the new one before the pass writes its new token there. The property test
# checks the outcome — reference counts, tables, the copies — not an order.

# %%
show(BlockManager.copy_on_write)

# %% mystnb={"figure": {"caption": "After a fork and one copy-on-write: sequence 2 still shares sequence 1's blocks (hatched), except its last block, which it was given fresh, with a copy of the old contents, before writing into it.", "name": "fig-03-copy-on-write"}}
# sequence 2 shares every block of sequence 1 (a second sample of the same prompt)
manager.fork(1, 2)
position = manager.num_tokens(2)  # where its first sampled token goes: the last block's slack
copied = manager.copy_on_write(2, position)
copies = manager.take_copies()
for source, destination in copies:
    storage.copy_block(source, destination)
print(f"sequence 2 writes position {position}: copied {copied}, block copies {copies}")
show_state(manager, "after fork and one copy-on-write: sequence 2's tail block is its own")

# %% [markdown]
# ## Build: the scheduler's question, `allocate_slots`
#
# Everything so far meets in one call. Before every forward pass, `PagedAttention.prepare` asks
# `allocate_slots(seq_id, num_computed_tokens, num_new_tokens)`: may this sequence have slots for
# `num_new_tokens` more tokens after the `num_computed_tokens` whose K/V are written? Chapter 04's
# scheduler asks the same for every sequence it schedules, and only ever sees the answer: the
# number of new tokens granted, all of them or 0.
#
# - A sequence's first call creates its block table (sharing its prefix-cache hits).
# - After that the table grows lazily: into the slack of its last block first, then by whole new
#   blocks (`append`, which counts them with ch03.1's `blocks_needed`).
# - If the block it writes first is shared — a fork's last block — that block is copied first
#   (`copy_on_write`, ch03.2), and the block the copy takes counts against what fits.
# - It is all or nothing: it checks that everything fits *before* it changes anything, and a
#   refusal (0) leaves every table, count and block as it was, so the scheduler can preempt someone
#   (chapter 05) and ask again.
# - Two knobs for later chapters: `shrink` lets a prompt chunk (chapter 04 splits long prompts) be
#   granted fewer tokens, as many as fit; `num_lookahead_tokens` reserves slots past the new tokens
#   for draft tokens (chapter 06), and those never shrink.
#
# Its body, for a sequence that has a table, is this chapter's core exercise, ch03.4:

# %%
show(BlockManager.allocate_slots)

# %% [markdown]
# A pool of 5 blocks of 4 slots, a sequence, a fork of it, and the answers:

# %%
m = BlockManager(num_blocks=5, block_size=4)


def ask(what: str, seq_id: int, computed: int, new: int, lookahead: int = 0, shrink=False) -> None:
    granted = m.allocate_slots(seq_id, computed, new, lookahead, shrink=shrink)
    print(
        f"{what:44} granted {granted:2}; table {m.block_table(seq_id)}, "
        f"{m.num_free} free, copies {m.take_copies()}"
    )


ask("seq 0: a new table for a 6-token prompt", 0, 0, 6)
m.fork(0, 1)
ask("seq 1 (a fork of 0): its first token", 1, 6, 1)
ask("seq 0: its first token, in its own block now", 0, 6, 1)
ask("seq 0: 12 more tokens (needs 3 blocks)", 0, 7, 12)
ask("seq 0: the same, as a chunk that may shrink", 0, 7, 12, shrink=True)
ask("seq 1: a token and 2 lookahead slots", 1, 7, 1, lookahead=2)

# %% [markdown]
# ## Step through the workload
#
# Back to the server. Run chapter 02's workload through a paged pool of the same size and step
# through it: the slider picks a {term}`decode step` and shows which sequence holds each block.

# %%
paged = simulate_paged(workload, num_blocks=ARENA_SLOTS // BLOCK_SIZE, block_size=BLOCK_SIZE)


def pool_grid(record, columns: int = 32):
    """A (rows, columns) array of sequence ids per block, -1 for a free block."""
    owner = [-1] * (ARENA_SLOTS // BLOCK_SIZE)
    for extent in record.memory_map:
        owner[extent.start // BLOCK_SIZE] = extent.seq_id
    return [owner[r * columns : (r + 1) * columns] for r in range(len(owner) // columns)]


def draw_pool_step(ax, record, fontsize: float = 11) -> None:
    from matplotlib.colors import ListedColormap, to_rgb

    grid = pool_grid(record)
    colors = ListedColormap([to_rgb("#f0f0f0")] + [to_rgb(sequence_color(i)) for i in range(20)])
    ax.imshow(
        [[0 if s < 0 else 1 + s % 20 for s in row] for row in grid],
        cmap=colors,
        vmin=0,
        vmax=20,
        interpolation="nearest",
    )
    ax.set_title(
        f"step {record.step}: {len(record.running)} running, {record.waiting} waiting\n"
        f"{record.used / max(record.reserved, 1):.0%} of held slots used",
        fontsize=fontsize,
    )
    ax.axis("off")


def pool_figure(step: int):
    fig, ax = plt.subplots(figsize=(7.5, 3.4), layout="constrained")
    draw_pool_step(ax, paged.steps[step])
    block_legend(fig, loc="outside lower center")
    return fig


# %% mystnb={"figure": {"caption": "Step through chapter 02's workload in the paged pool, every 25th decode step: one cell per block (32 to a row), coloured by the sequence that holds it, grey when free. Drag the slider, or step with the buttons or the arrow keys.", "name": "fig-03-pool-stepper"}}
Stepper(pool_figure, steps=range(0, paged.num_steps, 25), start=300)

# %% [markdown]
# The slider's frames are drawn in advance and embedded, so it works in the HTML book without a
# {term}`kernel <kernel (CUDA)>` or a network. Six moments side by side:

# %% tags=["hide-input"] mystnb={"figure": {"caption": "The paged pool at six moments of chapter 02's workload: one cell per block, one colour per sequence, grey free; each panel's title gives the step, the sequences running and waiting, and how much of the held slots hold tokens.", "name": "fig-03-pool-over-time"}}
fig, axes = plt.subplots(3, 2, figsize=(7.5, 6.6), layout="constrained")
for ax, step in zip(axes.flat, [20, 100, 200, 400, 700, 1000]):
    draw_pool_step(ax, paged.steps[step], fontsize=10)
fig.suptitle("The paged pool over time", fontsize=11)
block_legend(fig, loc="outside lower center")
plt.show()

# %% [markdown]
# ## Measure: the same memory, the same workload
#
# Contiguous first-fit (chapter 02) against paging with blocks of 16 slots, on the identical seeded
# workload and arena size:

# %%
rows = [
    (
        "KV utilisation (used / held, mean over steps)",
        f"{contiguous.kv_utilisation:.1%}",
        f"{paged.kv_utilisation:.1%}",
    ),
    ("internal waste", f"{contiguous.internal_waste:.1%}", f"{paged.internal_waste:.1%}"),
    (
        "steps refused with enough memory free",
        contiguous.fragmentation_refusals,
        paged.fragmentation_refusals,
    ),
    (
        "mean running sequences while requests queue",
        f"{contiguous.mean_running_saturated:.1f}",
        f"{paged.mean_running_saturated:.1f}",
    ),
    (
        "mean running sequences, whole run",
        f"{contiguous.mean_running:.1f}",
        f"{paged.mean_running:.1f}",
    ),
    ("peak running sequences", contiguous.peak_running, paged.peak_running),
    ("steps to serve all requests", contiguous.num_steps, paged.num_steps),
    ("preemptions (all running sequences stalled)", contiguous.preemptions, paged.preemptions),
]
print(f"{'':48} {'contiguous':>11} {'paged':>8}")
for name, a, b in rows:
    print(f"{name:48} {a!s:>11} {b!s:>8}")
saturated = paged.mean_running_saturated / contiguous.mean_running_saturated
print(
    f"\nconcurrency while requests queue: {saturated:.2f}x; "
    f"peak: {paged.peak_running / contiguous.peak_running:.2f}x"
)

# %% [markdown]
# Paging holds almost only tokens: the waste left is the unused tail of each sequence's last block.
# In the same memory it runs several times as many sequences at once while requests are queueing;
# averaged over the whole run the ratio is smaller, because the last steps — an empty queue and a
# few long stragglers — look alike for both. When every running sequence needs a block and none is
# free, the simulation preempts the youngest (counted above); chapter 05 makes that a real policy.

# %% tags=["hide-input"] mystnb={"figure": {"caption": "KV utilisation (tokens held over slots held) at every decode step, contiguous arena against paged pool, on the same workload in the same memory.", "name": "fig-03-utilisation"}}
fig, ax = plt.subplots()
for result, color in [(contiguous, sequence_color(1)), (paged, sequence_color(0))]:
    ax.plot(
        [r.step for r in result.steps],
        [r.used / max(r.reserved, 1) for r in result.steps],
        color=color,
        lw=1,
        label=f"{result.kind}: tokens / slots held",
    )
ax.set_xlabel("decode step")
ax.set_ylabel("KV utilisation")
ax.set_ylim(0, 1.02)
ax.set_title("Utilisation over time, same workload, same memory")
ax.legend()
plt.show()

# %% [markdown]
# And the prefix cache on a workload with a shared system prompt: 32 requests, each the system
# prompt above plus its own question, admitted one after another.

# %%
import random

rng = random.Random(0)
words = [
    "Speak",
    "What",
    "thou",
    "love",
    "night",
    "lord",
    "blood",
    "crown",
    "sweet",
    "death",
    "fair",
    "king",
]
manager = BlockManager(num_blocks=512, block_size=16)
cached = total = 0
for seq_id in range(32):
    question = " ".join(rng.choice(words) for _ in range(rng.randrange(4, 12)))
    ids = tokenizer.encode(system + f"HAMLET:\n{question}?\n\nHORATIO:\n", add_bos=True)
    cached += manager.allocate_cached(seq_id, ids)
    total += len(ids)
print(
    f"prefix-cache hit rate: {cached / total:.1%} of prompt tokens "
    f"({cached:,} of {total:,}); blocks in use: {manager.allocator.num_used} instead of "
    f"{sum(len(t.blocks) for t in manager.tables.values())} without sharing"
)

# %% [markdown]
# Every request after the first finds the system prompt's full blocks in the pool and computes only
# its own question. The full benchmark (`benchmarks/kv_memory.py`) repeats these measurements over
# seeds and block sizes and writes JSON.
#
# ## Exercises
#
# Solutions live between `### BEGIN SOLUTION` and `### END SOLUTION` in
# `src/minivllm/kv/block_manager.py` (ch03.4, ch03.1, ch03.2) and
# `src/minivllm/attention/storage.py` (ch03.3); run one exercise's tests with
# `pytest tests/test_block_allocator.py --exercise ch03.4` (ch03.3's are in
# `tests/test_paged_cache.py`).
#
# 1. **ch03.4 — `allocate_slots`, the scheduler's question** (this chapter's core). Write the body
#    of `BlockManager.allocate_slots` for a sequence that has its block table already (the first
#    call, which creates one, is given): grant `num_new_tokens` slots after `num_computed_tokens`
#    and `num_lookahead_tokens` more, and return how many new tokens it granted, or 0 with nothing
#    changed. Grow lazily (the slack of the last block first, then new blocks through `append`);
#    with `shrink`, grant as many new tokens as fit, but never fewer lookahead slots; and when the
#    block that holds position `num_computed_tokens` is shared (a fork's), copy it first with
#    `copy_on_write`, counting the block the copy takes. `append` (which counts with ch03.1's
#    `blocks_needed`) and `copy_on_write` (ch03.2) are there to call. The tests check each rule on
#    a pool of a few blocks, and that a refusal changes nothing; this chapter's `generate_paged`
#    and every engine after it ask this question before every forward pass. Three hints, from a
#    nudge to nearly the answer, are folded below the list.
# 2. **ch03.1 — `blocks_needed`.** How many new blocks does a sequence holding `num_tokens_now`
#    tokens need for `extra_tokens` more? None while its last block has room. The tests check the
#    boundary cases (an empty sequence, a block exactly full, one token over, zero extra) and that
#    `append` then grows a table only when its last block's slack runs out.
#
#    *Hint:* A sequence of $n$ tokens holds $\lceil n / b \rceil$ blocks of size $b$; the answer is
#    how much that count grows. Do the ceiling in integers; 0 tokens hold no block.
# 3. **ch03.2 — {term}`copy-on-write`.** In `BlockManager.copy_on_write`, when the block that holds
#    `position` is shared (reference count above 1), take a fresh block, let go of the old one,
#    swap the new one into the table, queue the copy `(old, new)` in `pending_copies` for the
#    storage, and return True; a block the sequence holds alone is written in place (False, nothing
#    changes). With no free block it must raise `OutOfBlocks` and change nothing. `allocate_slots`
#    calls it for this chapter's stage and for the engine alike: every fork's first write goes
#    through it (`tests/test_parallel_sampling.py`). `--exercise ch03.2` runs three hand-made
#    cases; the file's property test (`TestCacheMachine`, not marked: run the whole
#    `tests/test_block_allocator.py`) then tries thousands of random fork / write / engine-step /
#    free sequences on it.
#
#    *Hint:* A block you hold alone needs nothing. For a shared one, take the fresh block
#    (`_new_block`) *before* you drop your reference to the old one: on an empty pool it raises
#    `OutOfBlocks` while nothing has changed yet, which the all-or-nothing test checks. The copy
#    goes from the old block to the new one.
# 4. **ch03.3 — gather.** Implement `PagedKVStorage.gather`: read the first `length` K and V rows of
#    a sequence through its block table and return them as `(keys, values)`, each
#    `[length, n_kv_heads, head_dim]`. The table may hold more blocks than `length` needs. The tests
#    fill the storage slot by slot, with the blocks out of order and contexts that end mid-block.
#
#    *Hint:* Index this layer's `[2, num_blocks, block_size, heads, dim]` slice of `self.kv` with a
#    long tensor of the block ids the first `length` tokens use: that lays the blocks out in logical
#    order. Then merge the block and slot axes into one token axis and cut it at `length`.
# 5. *(Explore, no test.)* Rerun the measurement with `BLOCK_SIZE` 4 and 64. Which way does the
#    utilisation move, and what would a GPU kernel that reads the blocks prefer?
#
#    *Hint:* Paging wastes only the unfilled end of each sequence's last block, about half a block
#    per running sequence: how does that scale with the block size? For the kernel, count
#    block-table lookups and the length of each contiguous read.

# %% [markdown]
# The hints for ch03.4, the chapter's core, are folded: open one at a time.
#
# :::{admonition} Hint 1 for ch03.4 — a nudge
# :class: dropdown
# Decide before you change anything. All the sequence could still get is one number of slots:
# those of the blocks it holds that lie past `num_computed_tokens` (the slack), plus a whole
# block's worth for every free block, less one block if the block it writes first must be copied.
# Compare what is asked against that number; only when it fits do you copy and grow.
# :::
#
# :::{admonition} Hint 2 for ch03.4 — the approach
# :class: dropdown
# `_shared_block_at` tells you whether a copy is needed (a bool counts as 0 or 1 in arithmetic).
# Call the number of slots from hint 1 `fits`. The grant is `num_new_tokens`, or, with `shrink`,
# the smaller of that and what the lookahead slots leave of `fits`. Refuse with 0 when the grant is
# not positive or when grant plus lookahead exceeds `fits`. Otherwise copy the shared block, then
# make the table hold every position up to the end of the lookahead slots, and return the grant.
# :::
#
# :::{admonition} Hint 3 for ch03.4 — nearly there
# :class: dropdown
# The slots held are the table's block count times the block size. The table grows only when the
# end (computed + granted + lookahead) passes its `num_tokens`, in two moves: first raise
# `num_tokens` to the end or to the slots held, whichever is smaller (those slots cost no block);
# then, if the end lies past the slots held, `append` the tokens beyond them. `append` counts
# blocks from `num_tokens` as if the table held just the blocks those tokens need; a contiguous
# reservation holds more, which is why `num_tokens` goes up first.
# `copy_on_write` takes the position, not the block index.
# :::

# %% [markdown]
# ## Summary
#
# The cache is now paged: fixed-size blocks handed out one at a time, a block table per sequence,
# reference counts so sequences can share blocks (prefix caching, copy-on-write), and a free queue
# whose two ends keep reusable blocks longest. One call, `allocate_slots`, grants a sequence its
# slots before every pass — growing it lazily, copying a fork's shared block, all or nothing — and
# it is the question chapter 04's scheduler asks for every sequence it runs. The policy (`kv/`) is
# plain Python with no torch; the storage (`attention/storage.py`) writes through slot mappings and
# reads through block tables. On chapter 02's workload the same memory now holds several times as
# many sequences — the measurement above.
#
# **The same idea in vLLM.** The pool and its free queue: `vllm/v1/core/block_pool.py` and
# `FreeKVCacheBlockQueue` in `vllm/v1/core/kv_cache_utils.py`; the per-request block lists, the
# prefix-cache hits and `allocate_slots`: `vllm/v1/core/kv_cache_manager.py`; the block table and
# slot mapping on the device: `vllm/v1/worker/block_table.py`. nano-vllm does all of it in one
# file, `nanovllm/engine/block_manager.py`.
