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
# # Chapter 07 — Paged attention as a CPU kernel
#
# :::{admonition} At a glance
# - **Builds:** paged attention as a native CPU kernel (numba) that reads the K/V cache through the
#   block tables in place: the engine's default attention on a CPU from here on.
# - **Needs:** chapters 03 and 04.
# - **Runs in:** about 1 min, start to end (`make book` on a quiet 2-core AMD EPYC).
# :::
#
# Since chapter 03 the engine has read its K/V through block tables, but the reading itself is
# borrowed: `TorchPagedAttention` turns the tables into slot indices, *gathers* every sequence's
# keys and values into a fresh dense tensor, and hands that to a library attention. Decode attention
# is bound by memory traffic — each output token needs every cached byte of its sequence read once,
# and does almost no arithmetic per byte — so a copy of the whole context per layer per step is the
# expensive part. This chapter writes the kernel vLLM is named for {cite}`kwon2023pagedattention`:
# attention that reads the cache **through the block table, in place** — for the CPU you are
# reading this on, in Python compiled to machine code by numba. Chapter 08 writes the same
# algorithm for a GPU, in CUDA's execution model.

# %% tags=["remove-input"] mystnb={"image": {"alt": "The roadmap of the engine, chapter 07 highlighted: the chapters before it built, those after it to come"}}
from minivllm.book.figures.roadmap import roadmap

roadmap(7)

# %%
import json
import os

import matplotlib.pyplot as plt
import numpy as np
import torch

from minivllm import EngineConfig, LLMEngine, SamplingParams
from minivllm.attention.numba_cpu import (
    WIDE_VALUES_TILE,
    _add_row4,
    _attend,
    _attend_units,
    _exp_in_place,
    _paged_attention_kernel,
    _prefetch_block,
    _score_blocks,
    _scores_bfloat16,
    _scores_plain,
    _scores_simd,
    _softmax_rows,
    _values_plain,
    _values_simd,
    _weigh_blocks,
    kernel_array,
    paged_attention_cpu,
    plan_work,
    simd_fits,
    unit_cost,
    warm_up,
)
from minivllm.attention.simd import sum8x8
from minivllm.attention.torch_backend import DecodeAttention
from minivllm.book import show, use_book_style
from minivllm.book.figures.kernels import draw_work_plan
from minivllm.book.kernel_check import (
    alternating_ms,
    decode_call,
    prefill_call,
    random_inputs,
    reference_attention,
)
from minivllm.book.roofline import (
    attention_traffic,
    floor_seconds,
    floors,
    measure_limits,
    model_dims,
)
from minivllm.book.stats import speed_change, within
from minivllm.book.step_timing import decode_engine, time_decode_steps
from minivllm.model.checkpoint import load_model
from minivllm.model.fused import fuse_projections
from minivllm.model.tokenizer import ByteTokenizer
from minivllm.training.corpus import shipped_validation_text

torch.manual_seed(0)
torch.set_num_threads(2)
use_book_style()
target = load_model("target")
config = target.config
print(
    f"target model: {config.n_heads} query heads sharing {config.n_kv_heads} K/V heads, "
    f"head_dim {config.head_dim}, contexts up to {config.max_seq_len} tokens"
)

# %% [markdown]
# ## Why: the gather copies every context, every layer, every step
#
# Here is the reference backend's decode piece, `DecodeAttention` in `attention/torch_backend.py`,
# the one every engine step has used so far:

# %%
show(DecodeAttention)

# %% [markdown]
# `read_slots` is an `index_select`: it reads each sequence's K/V from its blocks and *writes* them
# into a new tensor padded to the longest context in the batch, which attention then reads again.
# Count the bytes for one decode step of a batch with uneven contexts, the kind
# {term}`continuous batching` produces — what attention needs against what the gather path moves:


# %%
def kv_bytes(tokens: int, cfg=config, element_bytes: int = 4) -> int:
    """K and V of `tokens` cached tokens of one layer."""
    return 2 * tokens * cfg.n_kv_heads * cfg.head_dim * element_bytes


def gather_bytes(contexts: list[int]) -> tuple[int, int, int]:
    """Per layer: K/V bytes attention needs, the padded copy, and what the gather path moves
    (read the blocks, write the padded copy, read the copy in attention)."""
    needed = sum(kv_bytes(n) for n in contexts)
    padded = len(contexts) * kv_bytes(max(contexts))
    return needed, padded, needed + 2 * padded


engine = LLMEngine(target, EngineConfig(num_blocks=256, block_size=16))
text = shipped_validation_text()
prompts = [
    text[start : start + length]
    for start, length in enumerate((20, 60, 180, 300, 420, 40, 120, 240))
]
for prompt in prompts:
    engine.add_request(prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
for _ in range(6):
    engine.step()
contexts = [seq.num_tokens for seq in engine.scheduler.running]
needed, padded, moved = gather_bytes(contexts)
print(f"contexts in the batch: {contexts}")
print(
    f"per layer per step: attention needs {needed / 1024:.0f} KiB of K/V; the gather path moves "
    f"{moved / 1024:.0f} KiB ({moved / needed:.1f}x): the padded copy alone is {padded / needed:.1f}x what is needed, "
    f"written once and read once"
)

# %% [markdown]
# And in time? Fill an engine with 64 requests, step it until every prompt is prefilled, and time
# decode steps with the {term}`attention backend`'s calls clocked (`book/step_timing.py`): the share
# of a step spent writing the new K/V and attending, every layer. First the bytes of one such step,
# which do not depend on the machine:

# %%
torch_engine = decode_engine(target, "torch")
contexts = [seq.num_tokens for seq in torch_engine.scheduler.running]
needed, _, moved = gather_bytes(contexts)
print(
    f"{len(contexts)} decodes, contexts {min(contexts)}..{max(contexts)}: per layer attention needs "
    f"{needed / 2**20:.1f} MiB of K/V, the gather path moves {moved / 2**20:.1f} MiB "
    f"({moved / needed:.1f}x); x {config.n_layers} layers per step"
)

# %% [markdown]
# and the time, which does (this machine, now; the median of three runs of ten steps):

# %%
# NBVAL_IGNORE_OUTPUT
reference_timing = time_decode_steps({"torch": torch_engine})["torch"]
print(
    f"torch backend, batch {reference_timing['batch']}: a decode step takes "
    f"{reference_timing['step_ms']:.1f} ms, attention {reference_timing['attention_ms']:.1f} ms "
    f"of it ({reference_timing['attention_share']:.0%})"
)

# %% [markdown]
# A kernel that reads K/V straight from the blocks moves the first number and nothing else.
#
# ## Build: a CPU kernel that reads the cache in place
#
# [numba](https://numba.readthedocs.io) compiles a Python function over numpy arrays to machine code
# through LLVM: `@njit` functions are plain loops, as fast as C's. `parallel=True` with `prange`
# splits a loop across the cores, and `cache=True` keeps the machine code on disk, so only the
# first process on a machine pays the compile. The kernel lives in `attention/numba_cpu.py`.
#
# ### The algorithm: scores, softmax, values
#
# A query vector $q$ attends keys $k_1 \dots k_n$ and values $v_1 \dots v_n$:
# $o = \sum_j p_j v_j$ with $p = \mathrm{softmax}(s)$, $s_j = q \cdot k_j / \sqrt{d}$. The kernel
# does exactly that, in two passes over the sequence's blocks: every score, read through the block
# table; the softmax of the whole row at once (the max subtracted first, so no exponential
# overflows); then the values, weighted. Each key and each value row is read once. The scores wait
# in between in a scratch row per query vector, a float32 per key the row sees, allocated once per
# thread per call. For the model's longest context:

# %%
score_row = config.max_seq_len * np.dtype(np.float32).itemsize
print(f"a score row at {config.max_seq_len} tokens: {score_row / 1024:g} KiB per query vector")

# %% [markdown]
# A CPU core's caches hold that easily. (A GPU cannot give every thread such a row; chapter 08
# meets the one-pass *online* softmax that avoids it.)
#
# `_attend` does it for one unit of work: up to `QUERY_TILE` query rows of one sequence and one K/V
# head. {term}`Grouped-query attention` rides along: the model's 8 query heads share 2 K/V heads, so
# the 4 query heads of a group are 4 query vectors per row, and **each K/V row is read once for all
# of them**. A prefill chunk's row sees the cached prefix and its own chunk up to itself (causal); a
# decode is a chunk of one row.

# %%
show(_attend)

# %% [markdown]
# Each pass is a function of its own, walking the unit's blocks through the block table. They
# could be written inline in `_attend`, and once were; compiled apart, each loop alone, LLVM makes
# faster code of them (the same bits; the comment above `_score_blocks` in the kernel's file gives
# the measurement):

# %%
show(_score_blocks)
show(_weigh_blocks)

# %% [markdown]
# Their pieces, first as plain loops. The scores are a dot product per (key, query vector), each key
# row read once for every vector of the unit; the values add each value row into every vector's
# accumulator. (Each K/V element passes through `as_float32`: for a float32 cache, the element
# itself. The bfloat16 cache it is there for comes below, with the bytes a step reads.)

# %%
show(_scores_plain)
show(_values_plain)

# %% [markdown]
# Between them, the softmax of each vector's row — a row sees one more key than the row before it in
# a prefill tile, and nothing past its own position:

# %%
show(_softmax_rows)

# %% [markdown]
# numba's `math.exp` is one library call per element, which no compiler vectorises, so the
# exponentials go through `_exp_in_place`: Cephes' single-precision exp written as plain arithmetic
# ($x = k \ln 2 + r$, a polynomial for $e^r$, $2^k$ written into the float's exponent bits), which
# LLVM turns into SIMD instructions like any other loop over an array. The largest score goes
# through `_largest`, eight lanes at a time (`max8`): LLVM leaves a plain max loop scalar, each
# comparison waiting on the one before, since without leave to ignore NaNs it may not reorder them.

# %%
show(_exp_in_place)

# %% [markdown]
# ### Faster: say where the SIMD lanes go
#
# LLVM vectorises the plain loops along `head_dim`, contiguous in memory: with AVX2, eight
# floats per instruction (`fastmath` allows it to reorder the float32 sums for that). But a dot
# product is a *reduction*. After four 8-lane multiply-adds over head_dim 32, the eight lanes of
# the result must still be added together — three additions and three shuffles, for every (key,
# query vector) pair, as much work as the multiply-adds. And the values loop loads and stores a
# vector's accumulator around every multiply-add (numba prints the machine code of any compiled
# function: `inspect_asm()`). Holding the accumulators in registers would take the loops
# reordered, which LLVM does not do when it cannot prove that accumulator and cache never overlap.
#
# A compiler cannot be told how to lay the work onto lanes; a kernel writer can. C++ kernels use
# intrinsics (vLLM's CPU build wraps them in `vec_op`); `attention/simd.py` gives numba a handful:
# `float32x8`, eight floats held in one register, with `load8`, `store8`, `splat8`, `fma8`, `add8`,
# each one or a few LLVM instructions. With them the scores take **eight keys at a time**: a query
# vector's eight dot products build up in eight registers, and one `sum8x8` adds all eight across
# their lanes together, in seven additions instead of twenty-four:

# %%
show(sum8x8)
show(_scores_simd)

# %% [markdown]
# The values turn the plain loop around. Each value row's sixteen lanes of head_dim are loaded
# once and added into four query vectors at a time, two registers each: eight accumulators that
# stay in registers for the whole block, and eight independent multiply-add chains — as many as
# two FMA units need while each result takes four cycles to be ready for the next. The same idea
# as the register tiles of a fast matmul {cite}`goto2008anatomy`, and sized like them to the
# register file: a CPU with AVX-512 has 32 vector registers, room for eight query vectors (sixteen
# accumulators), so each value row loaded feeds twice the multiply-adds (`WIDE_VALUES_TILE`, read
# from the CPU's features). A prefill chunk has vectors to spare — 16 rows times the group — a
# decode has only its group. With AVX2's 16 registers the wide tile would spill to memory. `_load4`
# and `_store4` move four vectors' accumulators between memory and registers; `_add_row4` is one
# value row's multiply-adds into them. A decode of a real checkpoint with two query heads per K/V
# head (Qwen3-0.6B) has two vectors: `_values_pair` takes them together, 32 lanes at a time, eight
# chains again where one vector alone is two:

# %%
show(_values_simd)
show(_add_row4)

# %% [markdown]
# Each accumulator adds the same terms in the same order whichever tile holds it, so both tiles
# give the same output; `wide_tile=` picks one on any CPU. One layer of a prefill chunk, for the
# book's model and for a real checkpoint's shapes (Qwen3-0.6B: 16 query heads on 8 K/V heads of
# 128 dimensions, chapter 10):

# %%
chunks = {
    # one sequence's chunk, its blocks scattered over a pool (book/kernel_check.py)
    "the book's model, 256 tokens": prefill_call(
        256, config.n_heads, config.n_kv_heads, config.head_dim
    ),
    "Qwen3-0.6B's shapes, 512 tokens": prefill_call(512, 16, 8, 128, seed=3),
}
for name, args in chunks.items():
    four, wide = (paged_attention_cpu(*args, wide_tile=w) for w in (False, True))
    print(f"{name}: four-vector and wide tiles identical bit for bit: {np.array_equal(four, wide)}")
    assert np.array_equal(four, wide)

# %% [markdown]
# And their times on this machine, alternating, the median of 10 calls each:

# %%
# NBVAL_IGNORE_OUTPUT
print(f"this CPU has AVX-512's 32 vector registers: {WIDE_VALUES_TILE}")
for name, args in chunks.items():
    four_ms, wide_ms = alternating_ms(
        {w: lambda w=w, a=args: paged_attention_cpu(*a, wide_tile=w) for w in (False, True)},
        rounds=10,
    ).values()
    print(
        f"{name}, one layer: four-vector tile {four_ms:.2f} ms, wide tile {wide_ms:.2f} ms: "
        f"{speed_change(four_ms / wide_ms)}"
    )

# %% [markdown]
# Where head_dim is 32 the block's sixteen keys are short work between loading and storing the
# tile, and the two tiles come out about even (the wide one a few percent slower, as often as
# not); at head_dim 128 each value row feeds twice the multiply-adds, and the wide tile pays where
# the CPU has it.

# %% [markdown]
# One more wait is the memory's. Within a block a head's rows lie at a fixed stride, which the
# hardware prefetcher follows -- in the engine's pool side by side: there a block keeps each head's
# rows together, as vLLM's CPU cache does (`storage.cpu_kv_pool`, where the measurement is), and
# the kernel reads that pool through a view indexed as the arrays here are. The next block is
# wherever the block table says, which the prefetcher cannot guess. So the passes ask for rows
# before they need them: while pass 1 scores one block, the keys of the block two ahead into the
# first-level cache, the keys `KEYS_L2_AHEAD` blocks ahead and the block's own values, for pass 2,
# into the second-level cache (where they wait without crowding out the rows the first level needs
# now); pass 2 asks for the next block's values. A decode's units are short, and each would begin
# by waiting on its first blocks, so a thread asks for the next unit's first keys while it runs
# one (`_attend_units` below):

# %%
show(_prefetch_block)

# %% [markdown]
# The vector paths need head_dim a multiple of 16 and blocks a multiple of 8 (`simd_fits`); other
# shapes take the plain loops. Both are compiled into the same kernel, and `simd=False` picks the
# plain loops anywhere, so the two can be timed on the same inputs — the model's shapes, 64 decodes
# with contexts of 200 to 300 tokens scattered over a pool of blocks, one layer, alternating, the
# median of 30 calls each (this machine, now):

# %%
# NBVAL_IGNORE_OUTPUT
warm_up()  # compile, or load the machine code cached by an earlier process
# 64 decodes of 200-300 tokens, their blocks scattered over a pool (book/kernel_check.py)
decode_args = decode_call(list(np.random.default_rng(1).integers(200, 300, 64)), config)
print("vector paths fit the model's shapes:", simd_fits(config.head_dim, 16))
plain, vector = alternating_ms(
    {simd: lambda simd=simd: paged_attention_cpu(*decode_args, simd=simd) for simd in (False, True)}
).values()
print(
    f"one layer, 64 decodes: plain loops {plain:.2f} ms, vector paths {vector:.2f} ms: "
    f"{speed_change(plain / vector)}"
)

# %% [markdown]
# The gap is smaller than the instruction counts suggest, and smaller in the engine than here: a
# decode step reads each layer's whole cache once, megabytes that come from memory rather than the
# caches, and once the arithmetic is fast that reading is most of what is left.
#
# A model that runs in bfloat16 (a real checkpoint in its own dtype) keeps its cache in bfloat16:
# half those bytes. numpy has no bfloat16, so such a cache reaches the kernel as its bits
# (`kernel_array`: int16), and the kernel widens each element as it reads it — `as_float32` in the
# plain loops, `load8` in the vector paths. A bfloat16 is the upper half of a float32, so widening
# moves the bits up sixteen places: exact, an instruction or two. numba compiles the kernel once
# for each cache dtype, and each computes in float32. So the output over a bfloat16 cache is the
# output over a float32 cache holding the same values, bit for bit:

# %%
keys16, values16 = (torch.from_numpy(cache).to(torch.bfloat16) for cache in decode_args[1:3])
queries, rest = decode_args[0], decode_args[3:]
over_bfloat16 = paged_attention_cpu(queries, kernel_array(keys16), kernel_array(values16), *rest)
over_float32 = paged_attention_cpu(queries, keys16.float().numpy(), values16.float().numpy(), *rest)
print(
    f"cache: {keys16.nbytes / 2**20:.1f} MiB a side in bfloat16, "
    f"{decode_args[1].nbytes / 2**20:.1f} MiB in float32"
)
print("same output, bit for bit:", np.array_equal(over_bfloat16, over_float32))

# %% [markdown]
# The queries and the output of a bfloat16 model are bfloat16 as well, and the kernel takes them
# as they are: `_attend` widens each query element as it scales it (`as_float32` again) and rounds
# each output element as it writes it (`as_element`: to nearest, ties to even, as torch rounds a
# float32), so the engine's backend converts nothing around the call: two small torch ops fewer
# in every layer of every step, each a fixed cost however few rows a decode has.
#
# A prefill tile would widen each element once for every query vector it holds (up to
# `QUERY_TILE` rows times the group). So a unit of `STAGE_MIN_VECTORS` vectors or more first copies
# each block's rows of its K/V head into float32 scratch, once (`_stage_rows`: the `staged` array
# the passes take), and scores and weighs them there, contiguous and already wide; a decode's few
# vectors read the cache itself. The values of every block go into the scratch one after another,
# and one `_values_simd` call weighs them all: its register tiles stay loaded across the unit's
# keys instead of being stored and loaded again at each block. The arithmetic is the same either
# way, so are the bits.
#
# Some CPUs multiply bfloat16s themselves (AVX-512 BF16: `simd.BFLOAT16_DOTS` says whether this one
# does). One instruction, `vdpbf16ps` (`simd.dot16`), takes sixteen pairs of bfloat16s and adds
# their products into eight float32 lanes: twice the multiply-adds of one `fma8`, with nothing
# widened on the way. There a bfloat16 model's scores come from its queries and the cache's keys
# as they are, no staging needed (`_scores_bfloat16`, picked by `vector_paths`). Each product is
# exact and each sum a float32 one, as before, but the queries are no longer scaled before the dot
# products — each score is, after — so the scores move by float32 rounding, and now and then an
# output element by one bfloat16 step. Two query vectors share each key row loaded, sixteen sums
# in flight at once. A float32 model, or a CPU without the instruction, keeps the float32 scores.

# %%
show(_scores_bfloat16)

# %% [markdown]
#
# ### The kernel: write, then attend, on every core
#
# A thread runs its list of units with its scratch allocated once, sized for the largest:

# %%
show(_attend_units)

# %% [markdown]
# The compiled entry point takes one layer's whole batch. It first writes the new rows' keys and
# values to their slots (the {term}`slot mapping` of chapter 04 — the same call, no separate
# scatter), then gives each thread its list. (Its twin `_paged_attention_serial` runs all the units
# on the calling thread, for a process that has one core — chapter 11 has such processes — and for
# a pass too small to pay for starting the other threads, which may have gone to sleep since the
# last op: the engine's backend runs a pass costing under `PARALLEL_MIN_COST` there, a crossover
# that `benchmarks/kernel_threads.py` measures.) It returns
# whether every thread finished its list: an exception raised on one of numba's worker threads
# never reaches the caller, so the Python side that launches it, `_launch`, runs an unfinished
# launch again on one thread, where the exception is raised.

# %%
show(_paged_attention_kernel)

# %% [markdown]
# Why lists per thread, rather than `prange` over the units? `prange` gives each thread an equal
# *count* of iterations. In a step of 60 decodes and two prefill chunks, one chunk's tile costs as
# much as dozens of decodes, and an even count puts both chunks on the last thread. `plan_work`
# deals the units by **cost** instead (query rows × keys they see), largest first, in snake order:

# %%
show(plan_work)

# %% [markdown]
# ### See: the work of two threads
#
# A mixed step — 60 decodes with contexts of 100 to 400 tokens and two prefill chunks of 48 tokens —
# split both ways. Each bar is one thread, each segment one unit of work, coloured by its sequence:

# %% tags=["hide-input"] mystnb={"figure": {"caption": "A mixed step of decodes and two prefill chunks split between two threads: each bar a thread, each segment a unit of work as long as its cost and coloured by its sequence. Top: an even count of units per thread; bottom: plan_work dealing them by cost.", "name": "fig-07-work-plan"}}
rng = np.random.default_rng(0)
query_lens = np.array([1] * 60 + [48, 48])
context_lens = np.concatenate([rng.integers(100, 400, 60), [48, 160]])
query_start = np.concatenate([[0], np.cumsum(query_lens)])
work, work_start = plan_work(context_lens, query_start, config.n_kv_heads, num_threads=2)
# numba's own split: the units in order (decodes first), half of them to each thread
in_order = work[np.lexsort((work[:, 3], work[:, 1], work[:, 0]))]
halves = np.array([0, len(in_order) // 2, len(in_order)])
fig, axes = plt.subplots(2, 1, figsize=(7.5, 3.6), sharex=True)
for ax, (units, starts, title) in zip(
    axes,
    [
        (in_order, halves, "an even count of units per thread"),
        (work, work_start, "plan_work: dealt by cost"),
    ],
):
    draw_work_plan(ax, units, starts, unit_cost(units, context_lens, query_start), title)
plt.tight_layout()
plt.show()
loads = {
    name: [unit_cost(u[a:b], context_lens, query_start).sum() for a, b in zip(st[:-1], st[1:])]
    for name, u, st in (("even count", in_order, halves), ("by cost", work, work_start))
}
for name, (first, second) in loads.items():
    print(
        f"{name:>10}: the busier thread has {max(first, second) / min(first, second):.2f}x the work"
    )

# %% [markdown]
# ### Check: the kernel against the reference
#
# The kernel is checked like every kernel in this book (chapter 08's CUDA ones too): fresh random
# inputs, blocks in shuffled order, an output poisoned with NaN first, and the model's plain softmax
# attention over K/V gathered through the tables as the reference (`book/kernel_check.py`, which
# chapter 08 shows). The target model's shapes — 8 query heads on 2 K/V heads, head_dim 32 — and
# contexts of one token, mid-block and on a block boundary:

# %%
q, key_cache, value_cache, tables, lens = random_inputs(
    [1, 16, 21, 200], config.n_heads, config.n_kv_heads, config.head_dim, 16, seed=3
)
expected = reference_attention(q, key_cache, value_cache, tables, lens)
for simd in (False, True):
    out = np.full(q.shape, np.nan, dtype=np.float32)
    paged_attention_cpu(
        q.numpy(),
        key_cache.numpy(),
        value_cache.numpy(),
        tables.numpy(),
        lens.numpy(),
        np.arange(len(lens) + 1),
        out=out,
        simd=simd,
    )
    cpu_error = float((torch.from_numpy(out) - expected).abs().max() / expected.abs().max())
    path = "vector paths" if simd else "plain loops"
    print(f"decodes, {path}: max relative error {within(cpu_error, 1e-5)}")

# %% [markdown]
# Prefill chunks, decodes mixed with them, block sizes 8 to 32, head_dim 32 to 128 and groups of 1
# to 4 — both paths each — are in `tests/test_numba_cpu_attention.py`, with NaN in the cache slots
# past every context, which the vector path's eight-key groups score and must never use. The check
# that matters most is the engine's: the same prompts, greedy, on both backends — prefill chunks
# and decodes both go through the kernel now.

# %%
text = shipped_validation_text()
prompts = [text[400 * i : 400 * i + 30 + 23 * i] for i in range(12)]
params = [SamplingParams(max_tokens=24 + 4 * i, temperature=0) for i in range(12)]
greedy = {}
for backend in ("torch", "numba"):
    engine = LLMEngine(
        target,
        EngineConfig(num_blocks=128, block_size=16, attention_backend=backend),
    )
    greedy[backend] = [o.token_ids for o in engine.generate(prompts, params)]
same = sum(a == b for a, b in zip(greedy["torch"], greedy["numba"]))
print(f"{same} of {len(prompts)} requests: identical greedy tokens on the torch and numba backends")
assert same == len(prompts)

# %% [markdown]
# ### Measure: the decode step on the kernel
#
# The 64-request {term}`decode step` again, both backends, alternating (this machine, now):

# %%
# NBVAL_IGNORE_OUTPUT
engines = {"torch": torch_engine, "numba": decode_engine(target, "numba")}
# each sequence's tokens as the timed steps begin: the roofline below needs them
contexts_before = {
    name: [seq.num_tokens for seq in engine.scheduler.running] for name, engine in engines.items()
}
STEPS, ROUNDS = 10, 3
timing = time_decode_steps(engines, steps=STEPS, rounds=ROUNDS)
for name, t in timing.items():
    print(
        f"{name:>5}: step {t['step_ms']:5.1f} ms, attention {t['attention_ms']:5.1f} ms "
        f"({t['attention_share']:.0%} of the step)"
    )
attention = speed_change(timing["torch"]["attention_ms"] / timing["numba"]["attention_ms"])
step = speed_change(timing["torch"]["step_ms"] / timing["numba"]["step_ms"])
print(f"on the kernel: attention {attention}, the step {step}")

# %% [markdown]
# ### Measure: against this machine's limits
#
# How close is either step to what the hardware allows? A decode step must read every weight once
# and every cached K/V row once, and do its matmuls' and attention's arithmetic. A part of it that
# must move $b$ bytes and do $f$ FLOPs cannot take less than $\max(b / B,\ f / P)$ on a machine
# that streams $B$ bytes and multiplies at $P$ FLOPs a second: its *roofline* floor
# {cite}`williams2009roofline`. `book/roofline.py` counts each part from the model's shapes;
# attention's share, over a paged cache with grouped-query heads, is exercise ch07.2:

# %%
show(attention_traffic)

# %% [markdown]
# The bytes and FLOPs of each engine's timed steps (every sequence at its context midway through
# them; they do not depend on the machine):

# %%
dims = model_dims(target)
element_bytes = torch_engine.config.dtype.itemsize
step_floors = {}
for name, before in contexts_before.items():
    midway = sum(before) + len(before) * (STEPS * ROUNDS - 1) / 2
    step_floors[name] = floors(dims, len(before), midway, element_bytes)
    step_bytes = sum(b for b, _ in step_floors[name].values())
    step_flops = sum(f for _, f in step_floors[name].values())
    attention_bytes, attention_flops = step_floors[name]["attention"]
    print(
        f"{name:>5} engine, {len(before)} decodes at {midway / len(before):.0f} tokens on average: "
        f"{step_bytes / 2**20:.1f} MiB and {step_flops / 1e9:.3f} GFLOP a step "
        f"({step_flops / step_bytes:.1f} FLOPs per byte); attention "
        f"{attention_bytes / 2**20:.1f} MiB, {attention_flops / 1e9:.3f} GFLOP"
    )

# %% [markdown]
# The limits, measured now in a few seconds (a float32 copy and add of 64 MiB arrays, larger than
# the caches; a float32 GEMM), and each step against its floor:

# %% tags=["hide-input"] mystnb={"figure": {"caption": "One decode step of 64 sequences on each backend, and its attention, against the roofline floor of the same work on this machine: the time the bytes and FLOPs of the step could take at the measured stream bandwidth and GEMM rate. Measured now, so the bars vary from run to run.", "name": "fig-07-roofline"}}
# NBVAL_IGNORE_OUTPUT
limits = measure_limits(elements=16 * 2**20, gemm_size=2048, repeats=3)
bandwidth, peak = limits["bandwidth_GBps"], limits["gemm_2048_GFLOPs"]
print(
    f"this machine, now: stream bandwidth {bandwidth:.1f} GB/s, GEMM {peak:.1f} GFLOP/s "
    f"(balance {peak / bandwidth:.1f} FLOPs per byte); load average {os.getloadavg()[0]:.1f}"
)
bars = {}
for name, floor in step_floors.items():
    roof_ms = {
        "step": 1e3 * sum(floor_seconds(b, f, bandwidth, peak) for b, f in floor.values()),
        "attention": 1e3 * floor_seconds(*floor["attention"], bandwidth, peak),
    }
    for part in ("step", "attention"):
        measured = timing[name][f"{part}_ms"]
        bars[f"{name}: {part}"] = (measured, roof_ms[part])
        print(
            f"{name:>5} {part:>9}: {measured:6.2f} ms measured, roofline {roof_ms[part]:.3f} ms: "
            f"{measured / roof_ms[part]:.1f}x the roofline"
        )
fig, ax = plt.subplots(figsize=(7.5, 2.4))
rows = np.arange(len(bars))
ax.barh(rows + 0.2, [m for m, _ in bars.values()], 0.4, color="#1f77b4", label="measured")
floor_bars = [r for _, r in bars.values()]
ax.barh(rows - 0.2, floor_bars, 0.4, color="white", edgecolor="black", hatch="//", label="floor")
ax.set_yticks(rows, list(bars))
ax.invert_yaxis()
ax.set_xlabel("ms per decode step")
ax.legend(loc="lower right", fontsize="small")
plt.tight_layout()
plt.show()

# %% [markdown]
# A bar's distance from its floor is the room a faster step could still win. The floor reads
# every byte once at full stream speed and does every FLOP at the big GEMM's rate, with nothing
# between operations: no Python, no per-call overhead, and no gather's extra copies — the part
# the kernel took out of the attention bars. `benchmarks/step_profile.py` splits the step
# component by component under torch.profiler, against the same floors, beside vLLM's CPU build.

# %% [markdown]
# The rest of the step is mostly the model's matmuls, which no attention kernel touches. The
# engine trims their number the way vLLM does when it loads a model (`QKVParallelLinear`): it runs
# a copy of the model whose q, k and v projections are one matmul, and gate and up another
# (`model/fused.py`; `EngineConfig(fuse_projections=False)` runs the model as chapter 00 wrote it).
# Five matmul calls per layer become two, and each output column is still the same dot product
# over the same input. The copy trims the small steps between the matmuls too, on the CPU in
# float32: each RMSNorm becomes torch's single `rms_norm` op (the same five steps in one call),
# and an engine's batch takes q and k through RoPE in one compiled loop each
# (`model/cpu_kernels.py`) instead of seven torch ops. Each computes what it replaces with the
# same roundings, so the logits do not move by a bit. A real checkpoint's weights are big enough
# to go through oneDNN in a packed layout, which sums in its own order: its logits already move by
# float32 rounding, so there each norm is one compiled loop as well (`cpu_kernels.rms_norm`; torch's
# `rms_norm` op is still five steps inside). (`EngineConfig(compile_forward=True)` goes
# further, as vLLM's default mode does: `torch.compile` fuses every small op between the matmuls
# and runs the forward without Python, with this kernel inside the graph as one opaque op —
# `runner/compiled.py`; there the logits move by float32 rounding.)

# %%
show(fuse_projections)
fused_target = fuse_projections(target)
prompt_ids = torch.tensor(ByteTokenizer().encode(text[:300], add_bos=True))
with torch.no_grad():
    same_logits = torch.equal(fused_target(prompt_ids), target(prompt_ids))
print(f"{len(prompt_ids)} tokens through both models: logits identical bit for bit: {same_logits}")
assert same_logits

# %% [markdown]
# The full comparison — the 64-request workload against Hugging Face `generate`, and the
# 256-request one against vLLM's own CPU build — is `benchmarks/throughput.py --backends torch
# numba` and `benchmarks/vllm_peer.py`.
#
# **Threads.** numba's parallel loops and torch's matmuls take turns, never overlap, so each may use
# every core torch is allowed (`NumbaPagedAttention` sets numba's thread count to torch's). numba
# runs them on its *OpenMP* threading layer: the calling thread takes a share itself and wakes one
# sleeping thread for each other core. Its idle threads sleep only under the passive wait policy
# below. Without it they would spin after each kernel, on the cores torch's threads need next, so
# the engine then picks numba's *workqueue* layer instead. A workqueue launch hands every share to
# a worker thread and puts the caller to sleep until they finish: more wake-ups, and on this
# machine a parallel pass lost to one thread at every decode batch (`benchmarks/kernel_threads.py`
# measures both layers).
#
# torch's own OpenMP threads spin too: by default libgomp keeps an idle thread busy-waiting for a
# while after every parallel region, in case another comes soon. In an engine step that is the core
# the attention kernel, the engine's Python or — on a shared machine — another process wants next.
# `OMP_WAIT_POLICY=PASSIVE` makes idle threads sleep at once; but then each of the few hundred
# parallel ops of a step must wake them again — a system call, and on a virtual machine a sleeping
# virtual CPU to rouse. Between the two lies a short spin: `GOMP_SPINCOUNT` (libgomp's spins before
# a thread sleeps, about 100,000 a millisecond by its own estimate) set to
# `minivllm.SHORT_SPIN_COUNT` — enough to bridge the gap between two ops, not to hold a core
# through a kernel of numba's or the engine's host work. numba's kernels run on these same threads:
# with torch's pip build, the dynamic linker binds numba's OpenMP calls to the libgomp torch loaded
# first — one pool, so no thread of numba's spins on a core torch's need (`model/numba_threads.py`
# says how that was found). libgomp reads these settings only when it loads, so minivllm sets its
# default — PASSIVE with the short spin — on import when torch has not loaded yet, and only where
# you set no wait policy (the Makefile exports PASSIVE alone, for the tests). The same small
# workload in fresh processes, alternating, under OpenMP's default, passive threads and the short
# spin — wall clock and the CPU time all threads of the process used; then two processes at once,
# sharing the cores: passive, the short spin, and the short spin with the engine's watch on its
# cores turned off (below):

# %%
# NBVAL_IGNORE_OUTPUT
import statistics
import subprocess
import sys

POLICY_RUN = """
import json, sys, time, torch  # torch first: libgomp reads its settings from the environment given
from minivllm import EngineConfig, LLMEngine, SamplingParams
from minivllm.model.checkpoint import load_model
from minivllm.training.corpus import shipped_validation_text
torch.set_num_threads(2)
text = shipped_validation_text()
prompts = [text[300 * i : 300 * i + 40 + 5 * i] for i in range(8)]
engine = LLMEngine(load_model(), EngineConfig(attention_backend="numba"))
engine.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0))  # warm-up
wall, cpu = time.perf_counter(), time.process_time()
tokens = SamplingParams(max_tokens=int(sys.argv[1]), temperature=0, ignore_eos=True)
outs = engine.generate(prompts, tokens)
print(json.dumps([time.perf_counter() - wall, time.process_time() - cpu,
                  [list(o.token_ids) for o in outs]]))
"""


from minivllm import SHORT_SPIN_COUNT

SHORT_SPIN = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": SHORT_SPIN_COUNT}
POLICIES = {  # libgomp's settings for torch's threads, which numba's kernels run on too
    "OpenMP's default": {},
    "PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"},
    "short spin": SHORT_SPIN,  # minivllm's default
}
UNWATCHED = {**SHORT_SPIN, "MINIVLLM_WATCH_CORES": "0"}  # the short spin, no watch on the cores
SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "MINIVLLM_WATCH_CORES")


def run_policy(
    settings: dict[str, str], at_once: int = 1, tokens: int = 32
) -> list[tuple[float, float, list]]:
    """`at_once` processes started together under `settings`, each generating `tokens` tokens for
    8 prompts; each one's wall, CPU and tokens."""
    env = {k: v for k, v in os.environ.items() if k not in SETTINGS}
    env.update(settings)
    command = [sys.executable, "-c", POLICY_RUN, str(tokens)]
    running = [
        subprocess.Popen(
            command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(at_once)
    ]
    results = []
    for process in running:
        stdout, stderr = process.communicate()
        if process.returncode != 0:
            raise RuntimeError(f"the run with {settings} failed:\n{stderr[-3000:]}")
        results.append(tuple(json.loads(stdout.splitlines()[-1])))
    return results


policy_runs = {name: [] for name in POLICIES}
for _ in range(2):
    for name, settings in POLICIES.items():
        policy_runs[name] += run_policy(settings)
SHARED_TOKENS = 160  # runs long enough for the watch (a reading every quarter second) to matter
shared_runs = {
    name: run_policy(settings, at_once=2, tokens=SHARED_TOKENS)
    for name, settings in [
        ("PASSIVE", POLICIES["PASSIVE"]),
        ("short spin", SHORT_SPIN),
        ("short spin, unwatched", UNWATCHED),
    ]
}
for name, runs in policy_runs.items():
    print(
        f"{name:>21}: wall {statistics.median(r[0] for r in runs):5.2f} s, CPU "
        f"{statistics.median(r[1] for r in runs):5.2f} s (medians of {len(runs)}; 8 requests x "
        f"32 tokens); load average {os.getloadavg()[0]:.1f}"
    )
print(f"two processes at once, sharing the cores (8 requests x {SHARED_TOKENS} tokens each):")
for name, runs in shared_runs.items():
    print(f"{name:>21}: wall {statistics.mean(r[0] for r in runs):5.2f} s each (mean of the two)")
alone = [r[2] for runs in policy_runs.values() for r in runs]
shared = [r[2] for runs in shared_runs.values() for r in runs]
same = all(t == alone[0] for t in alone) and all(t == shared[0] for t in shared)
prefix = all(long[:32] == short for long, short in zip(shared[0], alone[0]))  # greedy: it extends
print("identical tokens in every run:", same and prefix)

# %% [markdown]
# On a quiet machine the wall clocks are close and the difference is CPU time, burnt spinning. On a
# busy one the spinning threads hold cores the threads with work are waiting for, and the same run
# can take many times longer; run this cell while something else keeps the machine busy to see it.
# The short spin buys fewer wake-ups with a little spinning, bounded: a thread spins at most the
# short count after an op. Alone, a run this small moves by about as much as that saves
# (`benchmarks/vllm_peer.py` measures it on a whole workload; its `compiled-spin` mode gives vLLM
# the same setting). Two processes at once show the price of any spin: unwatched, each spinning
# thread holds a core the other process's thread with work is waiting for, at every op.
#
# So an engine whose threads spin watches its cores (`CoreWatch` in `runner/threads.py`). Every
# quarter second it reads how busy the process's CPUs were (`/proc/stat`) and takes away the
# process's own CPU time. While other processes keep a core's worth of them busy, a pass runs on
# the cores they leave — here one thread: torch starts no team, so nothing spins, and the
# attention kernel runs on one thread too. It reads only every quarter second, so each run's first
# window still spins against the other process. With the watch, the short spin is minivllm's
# default.
# The tokens never depend on it: the identical-tokens line above covers every run. Turn it off with
# `MINIVLLM_WATCH_CORES=0`, or run passive with `OMP_WAIT_POLICY=PASSIVE`, as the tests do: they
# run two workers on the two cores. The benchmarks record the setting and the load average beside
# every run.
# %% [markdown]
# ## Exercises
#
# The kernel's code is `src/minivllm/attention/numba_cpu.py`, the roofline's
# `src/minivllm/book/roofline.py`. The first two exercises are graded: each solution lives there
# between `### BEGIN SOLUTION` and `### END SOLUTION`; run their tests with
# `pytest tests --exercise ch07.1` (or `ch07.2`). The others explore the kernel on your machine and
# no test grades them; time any change with the cells of **Measure** above (alternate the
# versions, take medians). Each has a hint, and a worked answer folded below it.
#
# 1. **ch07.1 — the kernel's softmax** (this chapter's core). Write the loop body of
#    `_softmax_rows`: query vector `v`'s row of scores, `row`, sees its first `seen` keys (a row of
#    a prefill tile sees one more than the row before it). Turn `row[:seen]` into its softmax —
#    the largest score subtracted first, so that no exponential overflows, the exponentials taken
#    by `_exp_in_place` (it wants its arguments at most 0), each divided by their sum — and set
#    `row[seen:width]` to 0, so that the values pass adds nothing for the keys the row must not
#    see. The tests run the whole kernel, parallel and serial, plain and SIMD, against a float64
#    reference, with scores large enough to overflow an exponential taken without the max. The
#    kernel is compiled, so a change costs a minute of compiling on its first call. (numba's
#    threads cannot pass an exception on: `_launch` reruns on one thread a launch whose threads
#    stopped early, so an error in your code reaches you.) Three hints, from a nudge to nearly the
#    answer, are folded below the list.
# 2. **ch07.2 — what attention must move.** Write the body of `attention_traffic` in
#    `book/roofline.py`, the count the roofline above uses for attention: the bytes and FLOPs of
#    one decode step over a paged cache, every layer, each sequence's new token attending its
#    `contexts[i]` cached tokens. Per layer and sequence: each cached token's K and V rows are read
#    once, in `kv_heads` heads of `head_dim` elements of `element_bytes` bytes; the new token's K
#    and V are written once; its query is read and its output written, `heads` heads each; and
#    the scores and the weighted values are one multiply-add (two FLOPs) per element of every
#    query head, for every cached token. The tests count small cases by hand: one head per K/V
#    head against grouped-query heads, sequences of different contexts, bfloat16 against float32.
#
#    *Hint:* Under grouped-query attention the bytes follow `kv_heads` and the FLOPs follow
#    `heads`: the query heads of a group share every K/V row they read. Count one layer, one
#    sequence first, then add over `contexts` and multiply by `layers`.
#
# :::{admonition} A second hint for ch07.2
# :class: dropdown
# One token's K and V in one layer is two rows of `kv_heads * head_dim` elements; a query, or an
# output, is one row of `heads * head_dim`. A sequence at context $n$ costs $n + 1$ K/V rows
# (read, and its new one written) and two query-sized rows, and $4 n \cdot$ `heads` $\cdot$
# `head_dim` FLOPs. Return the pair as floats.
# :::
#
# 3. **One pass with an online softmax.** The kernel keeps every score of a unit in a scratch row
#    and walks the blocks twice. Rewrite `_attend` as one pass with the *online* softmax chapter 08
#    builds its GPU kernels on — per query vector a running max $m$ and sum $\ell$, the accumulator
#    rescaled by $e^{m - m'}$ whenever a block raises the max to $m'$ — keeping `_scores_simd` and
#    `_values_simd` for each block, and time both on the 64-decode layer measured above. Which wins
#    on this machine, and why?
#
#    *Hint:* The scratch shrinks to one block of scores, but the bookkeeping — a max, a rescale of
#    every accumulator, an `exp` for the correction — now runs once per block instead of once per
#    row. Count how many times per unit each happens at a context of 250 tokens and blocks of 16.
#
# :::{admonition} A worked answer to exercise 3
# :class: dropdown
# Per block: score the block into a 16-float row, take its max $b$, set $m' = \max(m, b)$, scale
# the accumulators and $\ell$ by $e^{m - m'}$ (once per query vector), exponentiate the row
# against $m'$, add it to $\ell$ and its weighted values to the accumulators; divide by $\ell$ at
# the end. At 250 tokens that is 16 blocks, so 16 maxima, 16 rescales of every accumulator and 16
# correction exponentials per query vector where the two-pass kernel has one of each. The K/V reads
# do not change — each row is read once either way — and a 1 KiB score row already sits in the
# core's L1 cache, so the one-pass kernel does more arithmetic for a saving the CPU did not need:
# expect it no faster, usually a little slower. On a GPU the balance turns, because a thread block
# has no room for a row per query (chapter 08).
# :::
#
# 4. **Dealt by count, not by cost.** Replace `plan_work`'s deal by cost with an even split by count
#    (the first bar of the work-plan figure) and time a decode step with two 128-token prefill
#    chunks in it, both ways. How much of the step does the uneven split cost?
#
#    *Hint:* `book/step_timing.time_decode_steps` alternates engines for you; give one engine
#    `EngineConfig(attention_backend="numba")` as it is and build the other after patching
#    `numba_cpu.plan_work`. Count the busier thread's cost with `unit_cost`, as the figure's cell
#    does, before you time anything.
#
# :::{admonition} A worked answer to exercise 4
# :class: dropdown
# Sort the units as numba's `prange` would see them (decodes first, then the chunks' tiles) and
# cut the list in half: `bounds = [0, len(work) // 2, len(work)]`. Both 128-token chunks, eight
# tiles of 16 query rows each, then land on the second thread, each tile costing as much as dozens
# of decodes; the first thread finishes its decodes and waits at the end of the kernel. The
# attention call takes about as long as the busier thread's share (the figure's printout gives the
# ratio), and the step loses that fraction of its attention time; the rest of the step, the
# matmuls, does not change.
# :::
#
# 5. **Where the SIMD lanes go.** Print the machine code of `_scores_plain` and `_scores_simd`
#    (`_scores_plain.inspect_asm()` gives one string per compiled signature) and count the
#    vector shuffles and additions that reduce a dot product's lanes, per key, in each.
#
#    *Hint:* With AVX2 look for `vhaddps`, `vpermilps`, `vshufps`, `vextractf128` and `vaddps`
#    inside the innermost loop; the plain loop reduces after every key, the vector path once per
#    eight keys (`sum8x8`).
#
# :::{admonition} A worked answer to exercise 5
# :class: dropdown
# The plain loop's dot product ends in a horizontal reduction of one 8-lane register — an
# `vextractf128`, then shuffles and adds down to one lane — after every key: about three additions
# and three shuffles per (key, query vector), as many instructions as the multiply-adds of a
# 32-float row. `_scores_simd` keeps eight keys' partial sums in eight registers and reduces all
# eight with `sum8x8`'s seven additions and its shuffles: under one addition per key. The exact
# instructions depend on your CPU (AVX-512 machines use 16 lanes and `zmm` registers), which is
# why the chapter measures the two rather than quoting an instruction count.
# :::

# %% [markdown]
# The hints for ch07.1, the chapter's core, are folded: open one at a time.
#
# :::{admonition} Hint 1 for ch07.1 — a nudge
# :class: dropdown
# Softmax is unchanged when the same number is subtracted from every score, and $e^x$ of a float32
# overflows past $x \approx 88$. Subtract the row's largest score and every exponent is at most 0,
# which is also what `_exp_in_place` needs. Only the first `seen` entries of the row are scores this
# vector may use; the rest, up to `width`, must come out as zero weights.
# :::
#
# :::{admonition} Hint 2 for ch07.1 — the approach
# :class: dropdown
# Four loops over `range(seen)` and one more: find the largest of `row[:seen]` (`_largest(row,
# seen)` does it eight lanes at a time; a plain loop from `row[0]` -- `seen` is at least 1 -- is as
# right, only slower), subtract it from each entry, call `_exp_in_place` on the row's
# first `seen` entries with the `exponent_bits` scratch, add them up in a float32, and multiply each
# by one over the total (one division, `seen` multiplications). Then a loop from `seen` to `width`
# writes zeros. Plain loops: numba compiles them to machine code, LLVM vectorises them.
# :::
#
# :::{admonition} Hint 3 for ch07.1 — nearly there
# :class: dropdown
# `largest` is `_largest(row, seen)` (or starts as the row's first score and takes `max` with each
# of the others up to `seen`); each of those entries then loses `largest`. `_exp_in_place`, given
# the row, `seen` and the scratch, turns them into exponentials in place. A `total` that starts at
# `np.float32(0.0)` sums them, `inverse` is `np.float32(1.0)` over it, and each of the `seen`
# entries is multiplied by `inverse`. Last, the entries from `seen` up to `width` are set to `0.0`.
# :::

# %% [markdown]
# ## Summary
#
# The engine now attends through its block tables in place on a CPU. A numba kernel writes each
# layer's new K/V to their slots and attends every decode and prefill chunk of the step in one
# call: all the scores, their softmax, then the values, each K/V row read once for its whole
# query-head group, the arithmetic laid onto 8-lane vectors by hand and the blocks prefetched,
# the work dealt to the cores by cost — and the greedy tokens are the reference's, token for token.
# The number that says why it matters is the first one measured above: the bytes the gather path
# moves per layer against the bytes attention needs, and, with it, the attention share of a decode
# step before and after.
#
# **Next.** Chapter 08 writes the same algorithm for a GPU, where thousands of threads share the
# work and the scores cannot wait in a scratch row. Chapter 11 takes the engine beyond one
# process: the second core as whole sequences, and more.
#
# **The same idea in vLLM.** The CPU build's attention: `csrc/cpu/attention.cpp`, its vector
# types in `csrc/cpu/cpu_types_x86.hpp` (`vec_op`); the fused q/k/v projection:
# `QKVParallelLinear` in `vllm/model_executor/layers/linear.py`.
