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
# # Chapter 07 — Paged attention as a kernel: on the CPU, then in CUDA
#
# :::{admonition} At a glance
# - **Builds:** paged attention as a native CPU kernel (numba) and as CUDA kernels (numba-cuda,
#   checked in its simulator).
# - **Needs:** chapters 03 and 04; for Part 2, CUDA's grid/block/warp model in outline (the chapter
#   draws it).
# - **Runs in:** about 1–2 min on a 2-core laptop CPU, start to end.
# :::
#
# Since chapter 03 the engine has read its K/V through block tables, but the reading itself is
# borrowed: `TorchPagedAttention` turns the tables into slot indices, *gathers* every sequence's
# keys and values into a fresh dense tensor, and hands that to a library attention. Decode attention
# is bound by memory traffic — each output token needs every cached byte of its sequence read once,
# and does almost no arithmetic per byte — so a copy of the whole context per layer per step is the
# expensive part. This chapter writes the kernel vLLM is named for {cite}`kwon2023pagedattention`:
# attention that reads the cache **through the block table, in place**. Twice.
#
# **Part 1** writes it for the CPU you are reading this on, in Python compiled to machine code by
# numba: the engine's default attention on a CPU from here on. **Part 2** writes the same algorithm
# in CUDA's execution model, with numba-cuda. With an NVIDIA GPU that kernel is compiled and runs
# natively on the engine's torch tensors. Without one it runs in numba's CUDA **simulator**, which
# executes every CUDA thread as a Python thread: thousands of times slower, but the very same code,
# and every thread's every read can be watched.

# %%
import json
import math
import time
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import torch
from IPython.display import Markdown, display

import minivllm
from minivllm import EngineConfig, LLMEngine, SamplingParams
from minivllm.attention import backend as attention_backend
from minivllm.attention.backend import AttentionBackend, resolve_backend_name
from minivllm.attention.batch import split_sequences
from minivllm.attention.cuda.backend import CudaPagedAttention, KernelDecodeAttention
from minivllm.attention.cuda.grouped import (
    default_lanes_per_token,
    grouped_decode_kernel,
    shared_words,
)
from minivllm.attention.cuda.kernels import (
    attend_range,
    block_reduce,
    cache_slot,
    merge_partitions,
    paged_attention_v1,
    paged_attention_v2,
    warp_reduce,
)
from minivllm.attention.cuda.launch import paged_attention, shared_bytes, split_partition_size
from minivllm.attention.cuda.occupancy import H100_SXM, occupancy
from minivllm.attention.cuda.simulator import KERNEL_DEVICE, SIMULATOR, WARP_SIZE
from minivllm.attention.cuda.tiled import tiled_decode_kernel
from minivllm.attention.numba_cpu import (
    _attend,
    _attend_units,
    _exp_in_place,
    _paged_attention_kernel,
    _prefetch_block,
    _scores_plain,
    _scores_simd,
    _softmax_rows,
    _values_plain,
    _values_simd,
    paged_attention_cpu,
    plan_work,
    simd_fits,
    unit_cost,
    warm_up,
)
from minivllm.attention.simd import sum8x8
from minivllm.attention.torch_backend import DecodeAttention
from minivllm.book import kernel_check, show, source, use_book_style
from minivllm.book.figures.kernels import draw_cache_reads, draw_execution_model, draw_work_plan
from minivllm.book.kernel_check import kernel_error, random_inputs, reference_attention
from minivllm.book.kernel_trace import in_simulator, reads_by_thread, trace_group, trace_v1
from minivllm.book.stats import within
from minivllm.book.step_timing import decode_engine, time_decode_steps, time_thread_counts
from minivllm.model.checkpoint import load_model
from minivllm.model.fused import fuse_projections
from minivllm.model.tokenizer import ByteTokenizer
from minivllm.runner.workers import ForwardWorkers, balanced_bounds
from minivllm.training.corpus import shipped_validation_text

torch.manual_seed(0)
torch.set_num_threads(2)
use_book_style()
target = load_model("target")
config = target.config
if SIMULATOR:
    print(
        "kernels run in numba's CUDA simulator on the CPU (no CUDA GPU here): every CUDA thread is a "
        "Python thread, so cases stay small"
    )
else:
    print(f"kernels run natively on {torch.cuda.get_device_name()}")
print(
    f"target model: {config.n_heads} query heads sharing {config.n_kv_heads} K/V heads, head_dim {config.head_dim}"
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
# ## Part 1 — a CPU kernel that reads the cache in place
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
# in between in a scratch row per query vector — 4 KiB for the model's longest context of 1024
# tokens, allocated once per thread per call — which a CPU core's caches hold easily. (A GPU
# cannot give every thread such a row; Part 2 meets the one-pass *online* softmax that avoids it.)
#
# `_attend` does it for one unit of work: up to `QUERY_TILE` query rows of one sequence and one K/V
# head. {term}`Grouped-query attention` rides along: the model's 8 query heads share 2 K/V heads, so
# the 4 query heads of a group are 4 query vectors per row, and **each K/V row is read once for all
# of them**. A prefill chunk's row sees the cached prefix and its own chunk up to itself (causal); a
# decode is a chunk of one row.

# %%
show(_attend)

# %% [markdown]
# Its pieces, first as plain loops. The scores are a dot product per (key, query vector), each key
# row read once for every vector of the unit; the values add each value row into every vector's
# accumulator:

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
# LLVM turns into SIMD instructions like any other loop over an array.

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
# once and added into the four query vectors of a group, two registers each: eight accumulators
# that stay in registers for the whole block, and eight independent multiply-add chains — as many
# as two FMA units need while each result takes four cycles to be ready for the next. The same
# idea as the register tiles of a fast matmul {cite}`goto2008anatomy`:

# %%
show(_values_simd)

# %% [markdown]
# One more wait is the memory's. Within a block a head's rows lie at a fixed stride, which the
# hardware prefetcher follows; the next block is wherever the block table says, which it cannot
# guess. So while one block is computed, `_attend` asks for the next block's rows:

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
q, key_cache, value_cache, tables, lens = random_inputs(
    list(np.random.default_rng(1).integers(200, 300, 64)),
    config.n_heads,
    config.n_kv_heads,
    config.head_dim,
    16,
    seed=1,
    spare_blocks=2000,
)
decode_args = (q.numpy(), key_cache.numpy(), value_cache.numpy(), tables.numpy(), lens.numpy())
decode_args += (np.arange(len(lens) + 1),)
print("vector paths fit the model's shapes:", simd_fits(config.head_dim, 16))
call_ms = {False: [], True: []}
for _ in range(30):
    for simd in (False, True):
        started = time.perf_counter()
        paged_attention_cpu(*decode_args, simd=simd)
        call_ms[simd].append(1e3 * (time.perf_counter() - started))
plain, vector = (float(np.median(call_ms[simd])) for simd in (False, True))
print(
    f"one layer, 64 decodes: plain loops {plain:.2f} ms, vector paths {vector:.2f} ms "
    f"({plain / vector:.2f}x)"
)

# %% [markdown]
# The gap is smaller than the instruction counts suggest, and smaller in the engine than here: a
# decode step reads each layer's whole cache once, megabytes that come from memory rather than the
# caches, and once the arithmetic is fast that reading is most of what is left.
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
# on the calling thread, for a process that has one core; the end of Part 1 has such processes.)

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
fig, axes = plt.subplots(2, 1, figsize=(10, 3.2), sharex=True)
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
# The kernel is checked like every kernel in this chapter (the CUDA one below too): fresh random
# inputs, blocks in shuffled order, an output poisoned with NaN first, and the model's plain softmax
# attention over K/V gathered through the tables as the reference (`book/kernel_check.py`,
# shown in Part 2). The target model's shapes — 8 query heads on 2 K/V heads, head_dim 32 — and
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
timing = time_decode_steps({"torch": torch_engine, "numba": decode_engine(target, "numba")})
for name, t in timing.items():
    print(
        f"{name:>5}: step {t['step_ms']:5.1f} ms, attention {t['attention_ms']:5.1f} ms "
        f"({t['attention_share']:.0%} of the step)"
    )
print(
    f"attention {timing['torch']['attention_ms'] / timing['numba']['attention_ms']:.1f}x faster, "
    f"the step {timing['torch']['step_ms'] / timing['numba']['step_ms']:.2f}x"
)

# %% [markdown]
# The rest of the step is mostly the model's matmuls, which no attention kernel touches. The
# engine trims their number the way vLLM does when it loads a model (`QKVParallelLinear`): it runs
# a copy of the model whose q, k and v projections are one matmul, and gate and up another
# (`model/fused.py`; `EngineConfig(fuse_projections=False)` runs the model as chapter 00 wrote it).
# Five matmul calls per layer become two, and each output column is still the same dot product
# over the same input, so the logits do not move by a bit:

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
# runs on its *workqueue* threading layer, whose threads sleep between kernels; an OpenMP layer
# would keep spinning after each kernel, on the same cores torch's own OpenMP threads need.
#
# torch's own OpenMP threads spin too: by default libgomp keeps an idle thread busy-waiting for a
# while after every parallel region, in case another comes soon. In an engine step that is the core
# the attention kernel, the engine's Python or — on a shared machine — another process wants next.
# `OMP_WAIT_POLICY=PASSIVE` makes idle threads sleep at once. libgomp reads it only when torch
# loads, so minivllm sets it on import when torch has not loaded yet (and a value you set wins); the
# Makefile exports it as well. The same small workload in two fresh processes, alternating, torch's
# default against passive threads — wall clock and the CPU time all threads of the process used:

# %%
# NBVAL_IGNORE_OUTPUT
import os
import statistics
import subprocess
import sys

POLICY_RUN = """
import json, time, torch  # torch first: libgomp reads OMP_WAIT_POLICY from the environment given
from minivllm import EngineConfig, LLMEngine, SamplingParams
from minivllm.model.checkpoint import load_model
from minivllm.training.corpus import shipped_validation_text
torch.set_num_threads(2)
text = shipped_validation_text()
prompts = [text[300 * i : 300 * i + 40 + 5 * i] for i in range(32)]
engine = LLMEngine(load_model(), EngineConfig(attention_backend="numba"))
engine.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0))  # warm-up
wall, cpu = time.perf_counter(), time.process_time()
outs = engine.generate(prompts, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
print(json.dumps([time.perf_counter() - wall, time.process_time() - cpu,
                  [list(o.token_ids) for o in outs]]))
"""


def run_policy(policy: str | None) -> tuple[float, float, list]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if policy is not None:
        env["OMP_WAIT_POLICY"] = policy
    done = subprocess.run(
        [sys.executable, "-c", POLICY_RUN], env=env, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(f"the run with OMP_WAIT_POLICY={policy} failed:\n{done.stderr[-3000:]}")
    return tuple(json.loads(done.stdout.splitlines()[-1]))


policy_runs = {"default (spin)": [], "PASSIVE": []}
for _ in range(3):
    for name, policy in (("default (spin)", None), ("PASSIVE", "PASSIVE")):
        policy_runs[name].append(run_policy(policy))
for name, runs in policy_runs.items():
    print(
        f"{name:>14}: wall {statistics.median(r[0] for r in runs):5.2f} s, CPU "
        f"{statistics.median(r[1] for r in runs):5.2f} s (medians of {len(runs)}; 32 requests x "
        f"64 tokens); load average {os.getloadavg()[0]:.1f}"
    )
tokens = [r[2] for runs in policy_runs.values() for r in runs]
print("identical tokens in every run:", all(t == tokens[0] for t in tokens))

# %% [markdown]
# On a quiet machine the wall clocks are close and the difference is CPU time, burnt spinning. On a
# busy one the spinning threads hold cores the threads with work are waiting for, and the same run
# can take many times longer; run this cell while something else keeps the machine busy to see it.
# The benchmarks record the policy and the load average beside every run.
#
# ### The second core: whole sequences, not halves of operations
#
# Everything so far used the second core the usual way: each matmul and each kernel call splits
# its own work between two threads. What is that worth here? The 64-request decode step again, on
# one thread and on two, alternating:

# %%
# NBVAL_IGNORE_OUTPUT
by_threads = time_thread_counts(decode_engine(target, "numba"), counts=(1, 2))
for threads, ms in by_threads.items():
    print(f"{threads} thread{'s' * (threads > 1)}: step {ms:5.1f} ms")
print(f"the second thread saves {1 - by_threads[2] / by_threads[1]:.0%} of the step")

# %% [markdown]
# Little or nothing, on a small machine — run it on yours. A step is a few hundred small
# operations: 25 matmuls of a few million multiply-adds each, six attention calls, and elementwise
# work on 64 × 256 floats, which torch does not split at all below its grain size. Splitting a
# matmul that takes one core a fraction of a millisecond means waking the other core's thread,
# handing it half, and waiting for both at the end, for each of the 25; on a virtual machine a
# wake-up alone can eat much of what the split saves, and a half-size matmul is less efficient than
# a whole one.
#
# The split that needs no meeting inside the step is coarser: **by sequence**. Attention keeps
# sequences apart, and every other layer works on each token's row alone, so a batch cut between
# sequences gives parts that need nothing from each other until their logits come back. Each part
# runs the whole model, on one thread, on a core of its own. This is data parallelism inside one
# step: one scheduler, one block manager, one K/V pool. `split_sequences` cuts a `VarlenBatch`:

# %%
show(split_sequences)

# %% [markdown]
# Where to cut: each part should take as long as the other. A sequence's work is its new tokens
# times the keys each sees, plus its matmuls (counted in keys: a token's multiply-adds over a
# key's, and over how much slower the attention kernel does its multiply-adds). A prefill chunk is
# never cut in two — its later tokens attend to its earlier ones, layer by layer — so the cut goes
# at the sequence boundary nearest to half the work:

# %%
show(balanced_bounds)

# %% [markdown]
# The parts run in **processes**, not threads: a part is a few hundred small torch calls, and each
# call holds Python's interpreter lock while it is dispatched, so two threads would take turns at
# it. `ForwardWorkers` spawns the workers when the engine starts (`EngineConfig(forward_processes=2)`)
# and moves the weights and the K/V pool into shared memory, so every process reads and writes the
# same blocks; each step sends a worker only its part's metadata — token ids, positions, slots,
# block tables, a few KiB — and gets back its logits:

# %%
show(ForwardWorkers.forward)

# %% [markdown]
# The check, as for every change to the engine: the same prompts as above, greedy, on one process
# and on two.

# %%
split_greedy = {}
for processes in (1, 2):
    with LLMEngine(
        target,
        EngineConfig(
            num_blocks=128, block_size=16, attention_backend="numba", forward_processes=processes
        ),
    ) as engine:
        split_greedy[processes] = [o.token_ids for o in engine.generate(prompts, params)]
same = sum(a == b for a, b in zip(split_greedy[1], split_greedy[2]))
print(f"{same} of {len(prompts)} requests: identical greedy tokens on one process and on two")
assert same == len(prompts)

# %% [markdown]
# A row's logits are what a one-thread pass over its part gives. They can move in the last bits
# with the cut — a matmul's rounding depends on how many rows it has — as they do from one step to
# the next in any engine, whose batch changes every step; a greedy token could change only at a
# near-tie, and `tests/test_forward_workers.py` compares tokens on both. The decode step, one
# process on two threads against two processes on one thread each, alternating (two fresh engines,
# so both decode at the same context lengths):

# %%
# NBVAL_IGNORE_OUTPUT
with decode_engine(target, "numba", forward_processes=2) as split_engine:
    by_split = time_decode_steps(
        {"1 process, 2 threads": decode_engine(target, "numba"), "2 processes": split_engine}
    )
    part_ms = []  # each process's forward time for its part, over a few more steps
    for _ in range(5):
        split_engine.step()
        part_ms.append([1e3 * s for s in split_engine.runner.workers.part_seconds])
for name, t in by_split.items():
    print(f"{name:>20}: step {t['step_ms']:5.1f} ms")
print(
    f"two processes: the step "
    f"{by_split['1 process, 2 threads']['step_ms'] / by_split['2 processes']['step_ms']:.2f}x faster"
)
engine_part, worker_part = np.median(part_ms, axis=0)
print(
    f"the parts: {engine_part:.1f} ms in the engine's process, {worker_part:.1f} ms in the worker"
)

# %% [markdown]
# Why not twice as fast? Part of every pass does not shrink with its batch: a few hundred torch
# calls dispatched from Python, every weight read from memory once, six kernel calls. Two parts
# pay it twice. One thread, steps of 1, 32 and 64 decoding sequences:

# %%
# NBVAL_IGNORE_OUTPUT
one_thread = {
    n: time_thread_counts(decode_engine(target, "numba", num_seqs=n), counts=(1,))[1]
    for n in (1, 32, 64)
}
for n, ms in one_thread.items():
    print(f"{n:2d} sequences, one thread: step {ms:5.1f} ms")
print(
    f"a step of one sequence costs {one_thread[1] / one_thread[64]:.0%} of a step of 64; "
    f"half the batch costs {one_thread[32] / one_thread[64]:.0%} of it"
)

# %% [markdown]
# The one-sequence step is the cost that does not shrink with the batch, and each of two
# processes pays it for its half; the host work between passes (scheduling, building the batch,
# sampling) runs in the engine's process alone while the worker waits. vLLM's CPU build works on
# the fixed cost instead: it compiles the model with `torch.compile`, which fuses the elementwise
# calls into generated C++ loops.
#
# One condition: nothing else may keep the worker's core busy. torch's spinning OpenMP threads
# (the wait policy above) would: after each two-thread operation of the engine's own work — the
# sampler, between passes — an idle thread busy-waits on the very core the worker computes on, and
# the worker's part, not the engine's, comes back late. Without `OMP_WAIT_POLICY=PASSIVE` two
# processes can lose to one; `ForwardWorkers` warns when the policy is not passive.
#
# The whole workloads, against Hugging Face and vLLM, are the benchmarks' `--processes 2` rows
# (`benchmarks/throughput.py --processes 2`, `benchmarks/vllm_peer.py --processes 1 2`): the
# scheduler, the sampler and the output processing still run in the engine's process between
# passes, while the worker waits.
#
# ## Part 2 — the same algorithm in CUDA's execution model
#
# The CUDA kernel below computes the same thing — every K/V row read once, in place, through the
# block table, softmax in float32 — but a GPU runs thousands of threads, not two, so the work is cut
# much finer, and the threads of one unit cooperate. First the machine.
#
# ### The GPU in one figure
#
# A CUDA kernel is one function run by a **{term}`grid <grid (CUDA)>`** of
# **{term}`thread blocks <thread block>`**. Each block runs on one of the GPU's
# {term}`streaming multiprocessors <streaming multiprocessor (SM)>` (SMs; an H100 has 132), has its
# own fast **shared memory**, and its threads can wait for each other at a barrier
# (`cuda.syncthreads()`). A block's threads are executed in **warps** of 32 that move in lockstep;
# within a warp, threads exchange registers directly with **shuffles** (`cuda.shfl_xor_sync`), no
# memory involved. Global memory is fastest when the 32 lanes of a {term}`warp` read 32 neighbouring
# elements at once (a *coalesced* read: one transaction).
#
# Our kernel maps attention onto that hierarchy: one thread block per (sequence, query head); inside
# it, warps take the context's tokens in turn; inside a warp, the lanes split a key row's head_dim.

# %% tags=["hide-input"] mystnb={"figure": {"caption": "The kernel's launch as the GPU sees it: a grid of thread blocks, one per sequence and query head; a block's warps, taking the context's tokens in turn; and a warp's 32 lanes, splitting a key row's head_dim between them.", "name": "fig-08-execution-model"}}
fig, ax = plt.subplots(figsize=(10, 3.4))
draw_execution_model(
    ax, num_seqs=4, num_heads=config.n_heads, threads=128, head_dim=config.head_dim
)
plt.show()

# %% [markdown]
# ### Build: the CUDA kernel, in pieces
#
# **The address.** Where does token `position` of a sequence live? Its block table names the
# physical block, and the position within the block is the slot — chapter 03's arithmetic, now a
# *device function* every thread calls (exercise ch08.1):

# %%
show(cache_slot)

# %% [markdown]
# **Reductions without memory.** A dot product split over 32 lanes must be added up. A butterfly of
# five shuffles does it: at each step every lane adds the value of the lane whose index differs in
# one bit, so after log₂ 32 = 5 steps every lane holds the total. The same function takes the
# maximum. (The simulator has no shuffles; `simulator.py` gives it one, built on a block barrier —
# which is why the {term}`kernels <kernel (CUDA)>` always call reductions with the whole block.)

# %%
show(warp_reduce)

# %% [markdown]
# A whole block reduces in two levels: each warp with shuffles, then the warps' results through a
# few words of {term}`shared memory`.

# %%
show(block_reduce)

# %% [markdown]
# **The attention.** One thread block, one query row, one stretch of context, in three phases:
#
# 1. *Scores.* Warps take tokens round-robin; for its token a warp's lanes read the key row (lane ℓ
#    reads elements ℓ, ℓ + 32, …: coalesced), multiply by the query held in shared memory, and the
#    warp sums. Lane 0 stores the score in shared memory.
# 2. *Softmax.* A block max, then exp(score − max) in place, then a block sum — the numerically safe
#    softmax, with the division left for the end.
# 3. *Values.* Now the threads split head_dim instead: thread d walks the tokens and accumulates
#    weight × value[d] (neighbouring threads read neighbouring elements of a value row: coalesced
#    again).
#
# It returns the max and the sum of exponentials; v1 ignores them, the partitioned kernel below
# needs them.

# %%
show(attend_range)

# %% [markdown]
# The kernel itself is a few lines: which (sequence, head) this block is, from `cuda.blockIdx`, and
# grouped-query attention's K/V head, `head // group`. The launcher checks the shapes, sizes the
# dynamic shared memory (`shared_bytes`: the scaled query, a word per warp, a score per token) and
# launches `kernel[grid, threads_per_block, stream, shared_bytes](...)` with one block per
# (sequence, head); its v1 path is below (`_simulator_pace` only makes the simulator pass Python's
# GIL around more often; on a GPU it does nothing). The kernels live in `attention/cuda/kernels.py`,
# the launcher in `attention/cuda/launch.py`.

# %%
show(paged_attention_v1)

# %%
show(paged_attention, lines=(1, 33))

# %% [markdown]
# ### Check: the kernel against a plain softmax
#
# Fresh random inputs (never zeros — a kernel that reads the wrong slot of a zero cache still looks
# right), physical blocks in shuffled order, an output **poisoned with NaN** before the launch so an
# element the kernel forgets to write cannot pass. The target model's head_dim and block size, and
# its grouped-query attention in small: 2 query heads on 1 K/V head (the model has 8 on 2; the
# simulator pays for every head). The contexts include one token, one ending mid-block and one on a
# block boundary.

# %%
show(kernel_check.random_inputs)

# %% [markdown]
# The reference gathers each sequence's K/V through its table and runs the model's own softmax
# attention; `kernel_error` launches the kernel into a poisoned output and compares:

# %%
show(kernel_check.kernel_error)


# %%
def random_case(
    context_lens,
    num_heads=config.n_heads,
    num_kv_heads=config.n_kv_heads,
    dtype=torch.float32,
    seed=0,
):
    """Random inputs in the target model's head_dim and block size, where the kernels run."""
    return random_inputs(
        context_lens,
        num_heads,
        num_kv_heads,
        config.head_dim,
        16,
        dtype,
        seed,
        device=KERNEL_DEVICE,
    )


checks = {"float32": (torch.float32, 1e-5), "float16": (torch.float16, 2e-3)}
for name, (dtype, tolerance) in checks.items():
    case = random_case([1, 21, 32], num_heads=2, num_kv_heads=1, dtype=dtype, seed=1)
    error = kernel_error(case, threads=WARP_SIZE)
    print(f"v1, {name}: max relative error {within(error, tolerance)}")

# %% [markdown]
# ### See: which thread reads which block
#
# The simulator runs the kernel in Python, so we can watch it. `kernel_trace.recorded` wraps the key
# and value caches in arrays that note every element a CUDA thread reads, and by whom. One sequence
# of 40 tokens, its three blocks scattered over a pool of eight, one head, 64 threads (two warps),
# and the kernel launched by hand — grid, threads per block, stream, shared-memory bytes.
# `in_simulator` runs it where the simulator is on: in this process without a GPU, in a child
# process with one (a real GPU's reads happen in hardware, out of Python's sight).

# %%
show(trace_v1)

# %%
trace = in_simulator(trace_v1, config.head_dim)
key_reads, value_reads = trace.key_reads, trace.value_reads
print(
    f"{len(key_reads)} key reads = 40 tokens x {config.head_dim} elements; {len(value_reads)} value reads"
)

# %% tags=["hide-input"] mystnb={"figure": {"caption": "The key cache as one thread block reads it: one row per physical block, one cell per slot. A slot that was read is coloured by the warp that read it and numbered with that warp's round; slots of other sequences' blocks stay blank.", "name": "fig-08-cache-reads"}}
fig, ax = plt.subplots(figsize=(7.5, 4))
draw_cache_reads(
    ax, reads_by_thread(key_reads), trace.block_table, block_size=16, num_blocks=trace.num_blocks
)
ax.set_title("key reads of one thread block: colour = warp, number = the warp's round")
plt.show()

# %% [markdown]
# The warps alternate over the tokens (warp 0 the even ones, warp 1 the odd ones), block 5 first,
# then 2, then 7 — the order of the block table, not of the pool — and slots past the context's 40th
# token are never touched. In each round, a warp's 32 lanes read one key row together. Here is the
# program order of a few threads (as (block, slot, head, element) indices):

# %%
by_thread_keys, by_thread_values = reads_by_thread(key_reads), reads_by_thread(value_reads)
for thread in (0, 1, 32):
    keys, values = by_thread_keys[(0, 0, 0), thread], by_thread_values.get(((0, 0, 0), thread), [])
    print(
        f"thread {thread:2} (warp {thread // WARP_SIZE}, lane {thread % WARP_SIZE:2}): keys {keys[:3]} ... "
        f"({len(keys)} reads); values {values[:2]} ... ({len(values)} reads)"
    )
lanes = sorted(by_thread_keys)
first_row = [by_thread_keys[lane][0][3] for lane in lanes[:WARP_SIZE]]
print(
    f"warp 0's first key row, element read by each lane: {first_row[:8]} ... {first_row[-2:]} (coalesced)"
)

# %% [markdown]
# Lane ℓ of a warp reads element ℓ of the row; the 32 lanes read 32 neighbouring floats, one
# 128-byte transaction. In the value phase only the first 32 threads work (head_dim is 32 here):
# thread d reads element d of all 40 value rows, in token order.
#
# ### Build more: more thread blocks — the partitioned kernel
#
# v1 launches one thread block per (sequence, head). A decode batch of one sequence of our model is
# 8 blocks; a GPU has 132 SMs, each able to host several blocks. Long contexts make it worse, not
# better: the 8 blocks just take longer, while most of the GPU idles. vLLM's v2 kernel (the idea is
# also called *flash-decoding* {cite}`dao2023flashdecoding`) cuts the context into **partitions**,
# each its own thread block with its own max and sum, then a second, small kernel merges them.
#
# The merge is the log-sum-exp identity. Partition $p$ returns its output normalised by its own sum
# $\ell_p$ of $e^{s - m_p}$ over its scores $s$. On a common scale $m = \max_p m_p$ its weight is
# $\ell_p e^{m_p - m}$, so
#
# $$o = \frac{\sum_p \ell_p e^{m_p - m}\, o_p}{\sum_p \ell_p e^{m_p - m}}$$
#
# (exercise ch08.2). A partition past the end of a short sequence's context writes $m = -\infty$,
# $\ell = 0$ and weighs nothing.

# %%
show(paged_attention_v2)

# %%
show(merge_partitions)

# %%
case = random_case([1, 24, 40], num_heads=2, num_kv_heads=1, seed=6)
for partition in (16, 24):
    error = kernel_error(case, partition_size=partition, threads=WARP_SIZE)
    print(f"v2, partitions of {partition} tokens: max relative error {within(error, 1e-5)}")

# %% [markdown]
# ### Build more: one pass per K/V head — v3, grouped flash-decoding
#
# v1 and v2 are correct, and slow. Read v1's loop the way a GPU runs it. Per token a warp loads the
# block-table entry, and only then can it load the key row that entry points to; then five shuffles
# must finish before the next token starts. The value pass walks the tokens one at a time per
# thread. And the query heads of a GQA group are separate thread blocks that read the same K/V
# rows, each for itself. Every one of these is a wait with nothing else in flight: the kernel is
# *latency-bound*, nowhere near the memory bandwidth that should bound decode attention.
# `attention/cuda/grouped.py` builds v3, the shape of FlashInfer's and vLLM's current decode
# kernels {cite}`ye2025flashinfer,dao2023flashdecoding`:
#
# - **one thread block per (sequence, K/V head)**, serving the whole query-head group: each K/V row
#   is read once for all the heads that share it;
# - **the block table staged in shared memory** once, so a token's address is a shared-memory load;
# - **one pass** with an *online softmax* (below) — no scores array, no second walk for the values;
# - **several tokens in flight per warp**: the warp is split into teams of lanes, each team on its
#   own token, its lanes splitting head_dim; a team's dot product needs log₂(lanes) shuffles;
# - compiled per (head_dim, group, lanes, block size), as vLLM instantiates a C++ template, so the
#   per-lane arrays live in registers. Its partitions' partial results have v2's layout, so for
#   few, long sequences the same kernel runs split-KV and `merge_partitions` combines them.
#
# The online softmax is what lets one pass suffice. Part 1's kernel waits for every score before it
# takes the softmax, because the max is not known until the end — but it need not be. Keep a
# running max $m$, a running sum $\ell$ and an accumulator $a$; for each new block of scores,
#
# $$m' = \max\big(m, \max_j s_j\big), \qquad
# \ell' = \ell\, e^{m - m'} + \sum_j e^{s_j - m'}, \qquad
# a' = a\, e^{m - m'} + \sum_j e^{s_j - m'}\, v_j ,$$
#
# and at the end $o = a / \ell$. Everything already summed is rescaled to the new max, so each key
# and value row is read exactly once and no score outlives its block. This is the *online softmax*
# of {cite}`milakov2018online`, the heart of FlashAttention {cite}`dao2022flashattention` and of
# vLLM's paged-attention kernels. On a GPU it is what keeps a thread block's memory independent of
# the context: v1 keeps a score per token in shared memory, v3 keeps three numbers per query.

# %%
show(grouped_decode_kernel)

# %% [markdown]
# The same check as v1 and v2, on a GQA batch (8 query heads sharing 2 K/V heads), whole and split
# into partitions:

# %%
case = random_case([1, 24, 40], num_heads=8, num_kv_heads=2, seed=8)
for partition in (None, 16):
    error = kernel_error(case, partition_size=partition, threads=WARP_SIZE, grouped=True)
    print(
        f"v3, {'one pass' if partition is None else f'partitions of {partition}'}: "
        f"max relative error {within(error, 1e-5)}"
    )

# %% [markdown]
# And the reads, recorded as before: one sequence of 40 tokens, four query heads sharing one K/V
# head. v1 runs four thread blocks, one per head; v3 runs one for the group.

# %%
group = in_simulator(trace_group, config.head_dim, 4)
v1_reads, v3_reads, table_reads = group.v1_key_reads, group.v3_key_reads, group.v3_table_reads
elements = 40 * config.head_dim
print(f"key elements in the context: {elements}")
print(f"v1 reads {len(v1_reads)} ({len(v1_reads) / elements:.0f} per element, one per head)")
print(f"v3 reads {len(v3_reads)} ({len(v3_reads) / elements:.0f} per element, once for the group)")
print(f"v3 reads the block table {len(table_reads)} times: once per entry, into shared memory")

# %% [markdown]
# How full do these grids keep a GPU? A decode kernel is memory-bound, and the loads in flight come
# from resident warps, so the measure is **warp occupancy**: warps resident on the SMs over their
# warp slots. An SM holds as many blocks at once as its warp slots, registers, shared memory and
# block slots all allow (`attention/cuda/occupancy.py`, the arithmetic of NVIDIA's occupancy
# calculator); a grid then takes ⌈blocks / (SMs · blocks per SM)⌉ waves, and a last, partial wave
# leaves slots empty.

# %%
show(occupancy)

# %% [markdown]
# Registers per thread come from the compiler, on a GPU (`benchmarks/paged_attention.py` records
# them); the curves below *assume* 64 for every version, 128 threads per block, and the shared
# memory each launcher asks for. For a Llama-3-8B layer (32 query heads over 8 K/V heads) at head
# dim 128, batch 1 and 64:

# %% tags=["hide-input"] mystnb={"figure": {"caption": "Modelled warp occupancy of the three kernel versions against context length, for a Llama-3-8B layer at batch 1 (left) and batch 64 (right), with the same assumed registers per thread for all three.", "name": "fig-08-occupancy"}}
ASSUMED_REGISTERS, THREADS = 64, 128
llama = {"heads": 32, "kv_heads": 8, "head_dim": 128}


def grid_and_shared(version: str, batch: int, context: int) -> tuple[int, int]:
    """Thread blocks of one layer's call, and the shared bytes each asks for."""
    dim, heads, kv_heads = llama["head_dim"], llama["heads"], llama["kv_heads"]
    if version == "v1":
        return batch * heads, shared_bytes(dim, THREADS, context)
    if version == "v2 (512)":
        return batch * heads * math.ceil(context / 512), shared_bytes(dim, THREADS, 512)
    partition = split_partition_size(batch, kv_heads, context, 16, H100_SXM.sms)
    parts = 1 if partition is None else math.ceil(context / partition)
    tokens = context if partition is None else partition
    lanes = default_lanes_per_token(dim)
    words = shared_words(tokens // 16, dim, heads // kv_heads, THREADS, lanes)
    return batch * kv_heads * parts, 4 * words


contexts_model = [256, 512, 1024, 2048, 4096, 8192]
versions = {"v1": "#d62728", "v2 (512)": "#2ca02c", "v3": "#1f77b4"}
fig, axes = plt.subplots(1, 2, figsize=(9, 3.2), sharey=True)
for ax, batch in zip(axes, (1, 64)):
    for version, color in versions.items():
        shares = []
        for context in contexts_model:
            blocks, shared = grid_and_shared(version, batch, context)
            shares.append(occupancy(blocks, THREADS, ASSUMED_REGISTERS, shared).warp_occupancy)
        ax.plot(contexts_model, shares, color=color, label=version)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length")
    ax.set_title(f"batch {batch}, {H100_SXM.name} (model)")
axes[0].set_ylabel("warp occupancy")
axes[1].legend(fontsize=8)
plt.show()
for batch in (1, 64):
    for version in versions:
        blocks, shared = grid_and_shared(version, batch, 4096)
        fit = occupancy(blocks, THREADS, ASSUMED_REGISTERS, shared)
        print(
            f"batch {batch:2}, context 4096, {version:8}: {blocks:5} blocks, {fit.blocks_per_sm} "
            f"per SM ({fit.limiter}), {fit.waves} wave(s), warp occupancy {fit.warp_occupancy:.0%}"
        )

# %% [markdown]
# At batch 1 every grid is small next to 132 SMs: v1 has one block per query head and leaves almost
# every warp slot empty; v2 and v3 split the context into partitions and fill several times more
# (v3 picks its partition size from the grid, `split_partition_size`). At batch 64 v1 and v2 have
# blocks to spare, while v3 — one block per K/V head, a quarter of v1's blocks, each reading for the
# whole group — fills fewer warp slots; it keeps loads in flight *inside* each warp instead (several
# tokens per warp), the bet a GPU run has to settle. With the assumed register count, registers are
# what limit the blocks per SM — the printout names the limiter. This is a model with
# an assumed register count; on a GPU, `benchmarks/paged_attention.py` measures the kernels.
#
# ### The engine on the kernel
#
# What does the engine need of an attention backend? Very little: the runner builds one per forward
# pass from the K/V storage and the pass's `VarlenBatch`, and the model calls it once per layer.
# That is the `AttentionBackend` protocol in `attention/backend.py`:

# %%
show(AttentionBackend)

# %% [markdown]
# Backends are registered there by name, and `EngineConfig(attention_backend=...)` picks one. The
# kernel is registered by its module path, so importing the registry never imports numba (nor
# switches on its simulator). "auto", the default, takes the first backend registered for the
# engine's device, else the reference — the last line below says what that means on each device. A
# new kernel plugs in with one more `register_backend` line: Part 1's CPU kernel (`numba`) is the
# third, and "auto" picks it for a float32 cache on a CPU, where `benchmarks/throughput.py`
# measures it ahead of the reference (its decode steps, and the whole 64-request workload).

# %%
registry = source(attention_backend)
print(registry[registry.index("register_backend(REFERENCE") :].strip())
print({device: resolve_backend_name("auto", device) for device in ("cpu", "cuda")})

# %% [markdown]
# The backend copies nothing of the reference. `TorchPagedAttention` takes its decode piece as a
# parameter, so `CudaPagedAttention` is the reference with `KernelDecodeAttention` where
# `DecodeAttention` was: the K/V write and the {term}`prefill` chunks (`PrefillAttention`) stay the
# reference's — the kernel is a decode kernel, one query per sequence.

# %%
show(KernelDecodeAttention)

# %%
show(CudaPagedAttention)

# %% [markdown]
# The real model, greedy, both backends. The prompt's prefill runs on torch either way; the decode
# step that makes the second token runs each layer's attention on the kernel — in the simulator
# here, which is why this run is so short:

# %%
params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
outputs = {}
for backend in ("torch", "cuda"):
    engine = LLMEngine(
        target,
        EngineConfig(num_blocks=16, block_size=16, device=KERNEL_DEVICE, attention_backend=backend),
    )
    outputs[backend] = engine.generate(["JULIET:\nO Romeo"], params)[0]
    print(f"{backend:>5} backend ({engine.runner.backend.__name__}): {outputs[backend].text!r}")
decodes = sum(len(record.decoded) for record in engine.trace)
print(
    f"{decodes} decode step(s) on the kernel (v3): {config.n_layers} layers x "
    f"{config.n_kv_heads} K/V heads = {decodes * config.n_layers * config.n_kv_heads} thread blocks"
)
assert outputs["cuda"].token_ids == outputs["torch"].token_ids

# %% [markdown]
# ### Measure
#
# The simulator is a teaching instrument, not a performance model: it runs a thread block as Python
# threads that meet at barriers. What one launch costs it:

# %%
# NBVAL_IGNORE_OUTPUT
case = random_case([64], num_heads=1, num_kv_heads=1, seed=7)
started = time.perf_counter()
paged_attention(*case, threads=WARP_SIZE)
elapsed = time.perf_counter() - started
print(
    f"one thread block of 32 threads over 64 tokens: {elapsed * 1e3:.0f} ms "
    f"({'simulated' if SIMULATOR else 'native, including the first-call compile'})"
)

# %% [markdown]
# On a GPU, `benchmarks/paged_attention.py` times every version with CUDA events at batch × context
# 1 × 4096, 64 × 1024 and 64 × 4096 (float16, 32 query and 8 K/V heads, head_dim 128, block size
# 16). Against what? Decode attention reads each K/V row once and does a few multiply-adds per byte,
# so its limit is the memory: the benchmark measures the device's **copy bandwidth** (a plain
# device-to-device copy) in the same run and reports each kernel's bytes per second as a share of
# it. Two references run beside the kernels: the torch backend (gather the blocks, then attend),
# and `scaled_dot_product_attention` over K/V gathered *beforehand*: a contiguous read, the
# practical ceiling once the read is large. Nsight Compute then profiled every version
# (`benchmarks/ncu_summary.py`): registers per thread, achieved occupancy, DRAM throughput. A GPU
# number in this book comes from such a record in `benchmarks/results/gpu/`, never from the prose;
# this cell reads them, and each row of the table below is one step of the story: what changed in
# the code, what it should do, and what it did.

# %%
ROOT = Path(minivllm.__file__).resolve().parents[2]  # the repository (an editable install)
GPU_RESULTS = ROOT / "benchmarks" / "results" / "gpu"


def load_record(name: str) -> dict | None:
    """A recorded GPU run from benchmarks/results/gpu/, or None (said) when this checkout lacks it."""
    path = GPU_RESULTS / name
    if not path.exists():
        print(f"no recorded GPU run: {path.relative_to(ROOT)} is absent, skipping what needs it")
        return None
    return json.loads(path.read_text())


kernels, ncu = load_record("paged_attention.json"), load_record("ncu_versions.json")
# (version, what changed in the code, what it should do): prose about the code; numbers: the runs.
STEPS = [
    (
        "v1",
        "a block per (sequence, query head); scores, then values",
        "latency-bound: one load in flight per warp, each after its table lookup",
    ),
    (
        "v2",
        "v1 cut into 512-token partitions, merged after",
        "more blocks: helps batch 1, not batch 64, where blocks were plenty",
    ),
    (
        "v3",
        "a block per K/V head, online softmax, a token per team of lanes",
        "K/V read once per group, several loads in flight: bandwidth-bound",
    ),
    ("v3 split", "v3 with partitions sized to fill the SMs", "batch 1 fills the GPU"),
    (
        "v4",
        "tiles in three phases; 8-byte loads; L2 prefetch",
        "fewer registers, more warps resident, more bytes in flight",
    ),
    ("v4 split", "v4 with v3's split", "as v3 split"),
    (
        "v4 256 threads regs<=64",
        "v4 with 256 threads a block, at most 64 registers",
        "twice the warps per block, without spilling",
    ),
    ("torch paged", "reference: gather the blocks, then attend", "copies every context first"),
    ("SDPA (pre-gathered)", "contiguous K/V, gathered beforehand", "the ceiling for a read"),
]


def share(version: str, batch: int, context: int) -> str:
    row = next(r for r in kernels["rows"] if (r["batch"], r["context"]) == (batch, context))
    measured = row["systems"].get(version)
    return "—" if measured is None else f"{measured['share_of_copy_bandwidth']:.1%}"


def ncu_evidence(version: str) -> str:
    """Nsight Compute at 64 × 1024, or at 1 × 4096 for a split version."""
    shape = (1, 4096) if version.endswith("split") else (64, 1024)
    if ncu is None:
        return "—"
    found = [
        r for r in ncu["rows"] if (r["version"], r["batch"], r["context"]) == (version, *shape)
    ]
    if not found:
        return "—"
    r = found[0]
    return (
        f"{r['registers_per_thread']:.0f} registers, {r['achieved_occupancy_pct']:.1f}% "
        f"occupancy, {r['dram_throughput_pct']:.1f}% DRAM ({shape[0]} × {shape[1]})"
    )


if kernels:
    machine = kernels["machine"]
    print(
        f"recorded {machine['date'][:10]} on {machine['device']}, driver {machine['driver']}, "
        f"CUDA {machine['cuda_runtime']}, torch {machine['torch']}, numba {machine['numba']}, "
        f"numba-cuda {machine['numba-cuda']}, numpy {machine['numpy']}; copy bandwidth "
        f"{kernels['copy_bandwidth_bytes_per_second'] / 1e12:.2f} TB/s, {kernels['num_sms']} SMs"
    )
    table = [
        "| version | what changed | predicted effect | share at 64 × 1024 | at 1 × 4096 "
        "| Nsight Compute |",
        "|---|---|---|--:|--:|---|",
    ]
    for version, changed, predicted in STEPS:
        table.append(
            f"| {version} | {changed} | {predicted} | {share(version, 64, 1024)} "
            f"| {share(version, 1, 4096)} | {ncu_evidence(version)} |"
        )
    display(Markdown("\n".join(table)))

# %% [markdown]
# The goals this kernel was given, checked against the same record: 80 % of the copy bandwidth at
# 64 × 1024, and 60 % at 1 × 4096 with a split kernel. And one number Nsight Compute's occupancy
# column asks for: how many of the GPU's warp slots the *grid* can fill at all, before registers
# have any say — the grid's warps over the SMs' warp slots.

# %%
REFERENCES = ("torch paged", "SDPA (pre-gathered)")
GRID_CHECKED = ("v3", "v4", "v4 256 threads regs<=64")


def best(batch: int, context: int, only_split: bool = False) -> tuple[str, float]:
    row = next(r for r in kernels["rows"] if (r["batch"], r["context"]) == (batch, context))
    shares = {
        version: measured["share_of_copy_bandwidth"]
        for version, measured in row["systems"].items()
        if version not in REFERENCES and (version.endswith("split") or not only_split)
    }
    return max(shares.items(), key=lambda item: item[1])


if kernels:
    for (batch, context, only_split), goal in (((64, 1024, False), 0.8), ((1, 4096, True), 0.6)):
        version, reached = best(batch, context, only_split)
        ceiling = share("SDPA (pre-gathered)", batch, context)
        print(
            f"goal {goal:.0%} at {batch} x {context}: best {version} at {reached:.1%} "
            f"({'met' if reached >= goal else 'not met'}; the pre-gathered SDPA read: {ceiling})"
        )
    for r in ncu["rows"] if ncu else []:
        if (r["batch"], r["context"]) == (64, 1024) and r["version"] in GRID_CHECKED:
            blocks = math.prod(r["grid"])
            warps = blocks * r["block"][0] // WARP_SIZE
            slots = kernels["num_sms"] * H100_SXM.max_warps
            print(
                f"{r['version']:>23}, 64 x 1024: {blocks} blocks x {r['block'][0] // WARP_SIZE} "
                f"warps fill <= {min(1, warps / slots):.1%} of the warp slots; occupancy "
                f"theoretical {r['theoretical_occupancy_pct']:.1f}%, "
                f"achieved {r['achieved_occupancy_pct']:.1f}%"
            )

# %% [markdown]
# Read the table top to bottom. v1 and v2 sit near the floor, as their loops predicted: a warp has
# one load in flight and waits on it, and v2's extra blocks cannot help a batch that already had
# blocks to spare. v3 is the big step — each K/V row read once for its group, several tokens in
# flight per warp — and its split form is what batch 1 needs. Then Nsight Compute's evidence: v3
# holds the most registers a thread of all the versions, so few of its blocks fit on an SM (its
# theoretical occupancy, printed below the table) — registers, the limiter the occupancy model
# above named — and capping them made it spill and slow down (the `v3 regs<=` rows of the record).
#
# v4 (`attention/cuda/tiled.py`) attacks the registers, not the cap. v3's teams each keep a running
# output for every head of the group and rescale it on every token; v4 takes a *tile* of tokens in
# three phases separated by barriers — all the tile's scores (each key row one 8-byte load a lane),
# then the softmax once per (head, token) in shared memory, then the values — so that in the last
# phase each output element belongs to one thread, rescaled once a tile:

# %%
show(tiled_decode_kernel, lines=(240, 267))

# %% [markdown]
# It worked on the registers and not on the time: the theoretical occupancy rose, the achieved one
# did not. The grid is why — one block per (sequence, K/V head) at batch 64 is too few warps to
# fill the slots the registers freed (the lines above). Giving each block twice the warps
# (256 threads, registers capped where v4 does not spill) fills them, and is the best kernel at
# batch 64. It is still short of both goals, as printed above; at batch 1 even the contiguous,
# pre-gathered read stays far from the copy bandwidth, a single sequence's read being too short to
# fill the memory system. The next step is more bytes in flight per warp, and no run has measured
# it yet. The same record, drawn as a roofline — time per call against the bytes it must read, the
# measured copy bandwidth as the line a read can at best reach:

# %% tags=["hide-input"] mystnb={"figure": {"caption": "Decode attention on a recorded GPU run: device time per call against the K/V bytes the call reads, at the benchmark's three shapes (log scales). The grey line is the time at the copy bandwidth measured in the same run; a version's distance above it is its lost bandwidth.", "name": "fig-08-roofline"}}
ROOFLINE = {
    "v1": "#d62728",
    "v2": "#2ca02c",
    "v3": "#1f77b4",
    "v3 split": "#17becf",
    "v4": "#9467bd",
    "v4 256 threads regs<=64": "#e377c2",
    "torch paged": "#7f7f7f",
    "SDPA (pre-gathered)": "#000000",
}
if kernels:
    fig, ax = plt.subplots(figsize=(8, 4))
    reads = np.array(sorted(r["kv_bytes"] for r in kernels["rows"]), dtype=float)
    copy_rate = kernels["copy_bandwidth_bytes_per_second"]
    ax.plot(reads, reads / copy_rate * 1e6, color="0.6", lw=3, label="copy bandwidth")
    for version, color in ROOFLINE.items():
        points = sorted(
            (r["kv_bytes"], r["systems"][version]["device_seconds"] * 1e6)
            for r in kernels["rows"]
            if version in r["systems"]
        )
        marker = "s" if version in REFERENCES else "o"
        ax.plot(*zip(*points), marker=marker, color=color, lw=1, label=version)
    ax.set_xscale("log", base=2)
    ax.set_xticks(
        [r["kv_bytes"] for r in kernels["rows"]],
        [
            f"{r['kv_bytes'] / 2**20:.0f} MiB\n{r['batch']} × {r['context']}"
            for r in kernels["rows"]
        ],
    )
    ax.minorticks_off()
    ax.set_yscale("log")
    ax.set_xlabel("K/V bytes read per call")
    ax.set_ylabel("device time per call (µs)")
    ax.set_title(f"{kernels['machine']['device']}, {kernels['machine']['date'][:10]}")
    ax.legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.01, 1))
    plt.show()

# %% [markdown]
# ### The decode step in CUDA graphs
#
# The kernel is a fraction of a decode step. The small shipped model makes a step hundreds of tiny
# kernel launches, and Python launching them is slower than the GPU running them: the step is
# bound by the host, whichever attention it uses. A **CUDA graph** records a whole step's launches
# once and replays them with one call; the engine captures the decode step for a set of batch sizes
# and pads a batch up to the nearest, as nano-vllm does (`runner/cuda_graph.py`, on by default on a
# GPU; `EngineConfig(enforce_eager=True)` turns it off; the numba kernel joins the capture on
# torch's stream). `benchmarks/gpu_engine.py` ran the book's workload on the GPU, each backend with
# and without graphs, against Hugging Face `generate`, and profiled the decode steps:

# %%
engine_run = load_record("gpu_engine.json")
if engine_run:
    print(
        f"recorded on {engine_run['machine']['device']}, torch {engine_run['machine']['torch']}, "
        f"{engine_run['workload']['requests']} requests, {engine_run['workload']['dtype']}, "
        f"median of {engine_run['repeats']} runs; decode steps profiled at batch "
        f"{engine_run['decode_profiles'][0]['batch']}"
    )
    rate = {row["system"]: row["median_tokens_per_s"] for row in engine_run["rows"]}
    profile = {p["system"]: p for p in engine_run["decode_profiles"]}
    print(f"{'backend':>8} {'tokens/s':>17} {'ms per step':>14} {'launches':>12} {'GPU busy':>12}")
    for backend in ("torch", "cuda"):
        eager = f"minivllm {backend} backend"
        graphs = f"{eager} + CUDA graphs"
        print(
            f"{backend:>8} {rate[eager]:7,.0f} -> {rate[graphs]:6,.0f} "
            f"{profile[eager]['ms_per_step']:6.1f} -> {profile[graphs]['ms_per_step']:4.1f} "
            f"{profile[eager]['kernel_launches_per_step']:9.0f} -> "
            f"{profile[graphs]['kernel_launches_per_step']:<3.0f} "
            f"{profile[eager]['gpu_busy_share']:4.0%} -> {profile[graphs]['gpu_busy_share']:.0%}"
        )
    hf = rate["HF generate (one batch)"]
    print(f"HF generate: {hf:,.0f} tokens/s; the best minivllm row: {max(rate.values()) / hf:.1f}x")
    differing = sum(row["requests_differing_from_torch_backend"] for row in engine_run["rows"])
    print(f"requests whose tokens differ from the torch backend's, over all systems: {differing}")

# %% [markdown]
# Without graphs the kernel backend is *slower* than the torch backend although its attention is
# faster: numba's launches cost the host more than torch's, and the host is the bottleneck. With
# graphs both become a single launch a step, the host's cost falls away, and the two backends come
# out level: at this model's size attention is too small a share of the step for the kernel to
# show. The tokens are the same in every row.
#
# ## Exercises
#
# Solutions live between `### BEGIN SOLUTION` and `### END SOLUTION` in
# `src/minivllm/attention/cuda/kernels.py`; run one exercise's tests with
# `pytest tests --exercise ch08.1`.
# They run in the simulator, so no GPU is needed.
#
# 1. **ch08.1 — the block-table address.** In `cache_slot`, return `(block, offset)`: the physical
#    block that holds token `position`, read from the sequence's {term}`block table` row `table`,
#    and the offset of the token within that block. The tests run the whole v1 kernel, which calls
#    it for every token, against a float64 reference.
#
#    *Hint:* It is `BlockManager.slot_mapping`'s arithmetic (chapter 03) stopped one step early: the
#    logical block index picks the table entry and the remainder is the offset. Return the two; do
#    not fold them into one slot.
# 2. **ch08.2 — the {term}`log-sum-exp merge`.** In `merge_partitions`, for each element `d` the
#    loop gives your thread, write `out[seq, head, d]`: the partitions' normalised outputs
#    `partial_out[seq, head, p, d]` averaged with weights $\ell_p e^{m_p - m}$, where $\ell_p$ is
#    `exp_sums[seq, head, p]`, $m_p$ is `max_logits[seq, head, p]` and $m$ their maximum (already
#    computed above your code). Leave out the empty partitions ($\ell_p = 0$, past the end of a
#    short context): their `partial_out` was never written. The test splits a 9-token and a 2-token
#    context into partitions of 4 tokens, so the short one has two empty partitions.
#
#    *Hint:* Each partial output is already divided by its own $\ell_p$, so the merge is a weighted
#    average: accumulate the weighted outputs and the weights, and divide once at the end. Skip an
#    empty partition with an `if` rather than trust its zero weight: zero times a never-written
#    value is not always zero.
# 3. *(Explore, no test.)* v1 keeps one score per token in shared memory. How long a context fits in
#    an H100 block's 48 KiB of default dynamic shared memory? Rewrite `attend_range` with an
#    *online* softmax (a running max and sum, rescaling the accumulator when the max grows) so its
#    shared memory no longer grows with the context.
#
#    *Hint:* `shared_bytes(head_dim, threads, tokens)` gives the bytes; solve it for `tokens`. For
#    the rewrite, apply v3's $m'$, $\ell'$, $a'$ update after each round of `num_warps` scores,
#    so only one round's scores ever sit in shared memory.
# 4. *(Explore, no test.)* Every lane calls `cache_slot` for every token, reading the block table
#    over and over. Change the score loop so a warp takes a whole block of 16 tokens at a time and
#    looks the block up once; use `kernel_trace.recorded` on the block table to count the reads
#    before and after.
#
#    *Hint:* Deal *blocks* to the warps round-robin instead of tokens and loop over the offsets
#    inside; the range may start or end mid-block. Keep every warp running the same number of
#    rounds, as `attend_range` does, so the shuffles stay uniform.
# 5. *(Explore, no test.)* Part 1's kernel keeps every score of a unit in a scratch row and walks
#    the blocks twice. Rewrite `_attend` as one pass with v3's online softmax — per query vector a
#    running max and sum, the accumulator rescaled whenever a block raises the max — keeping
#    `_scores_simd` and `_values_simd` for the block, and time both on the 64-decode layer of the
#    measurement above (alternate them, take medians). Which wins on this machine, and why?
#
#    *Hint:* The scratch shrinks to one block of scores, but the bookkeeping — a max, a rescale of
#    every accumulator, an `exp` for the correction — now runs once per block instead of once per
#    row. Count how many times per unit each happens at a context of 250 tokens and blocks of 16.
# 6. *(Explore, no test.)* Replace `plan_work`'s deal by cost with an even split by count (the
#    figure's first bar) and time a decode step with two 128-token prefill chunks in it, both ways.
#    Hint: `book/step_timing.time_decode_steps` alternates engines for you.
# 7. *(Explore, no test.)* After each pass, `engine.runner.workers.part_seconds` holds each
#    process's forward time for its part. Step a `decode_engine(target, "numba",
#    forward_processes=2)` and collect them: are the parts even? Then add four requests with
#    300-token prompts to it, so that prefill chunks join the decodes, and collect them again. The
#    cut weighs a token's matmuls as `engine.runner.workers.per_token` keys: which value evens the
#    parts of the mixed steps on your machine, and what does it say about how fast the attention
#    kernel does a multiply-add compared with a matmul?
#
#    *Hint:* Compare the medians of the first part's time over the second's, per kind of step. A
#    chunk is never cut, so a step with one long chunk cannot be even whatever the weight: look at
#    steps with several.
#
# ## Summary
#
# The engine now attends through its block tables in place, on both kinds of machine. On a CPU, a
# numba kernel writes each layer's new K/V to their slots and attends every decode and prefill chunk
# of the step in one call: all the scores, their softmax, then the values, each K/V row read once
# for its whole query-head group, the arithmetic laid onto 8-lane vectors by hand and the next block
# prefetched, the work dealt to the cores by cost — and the greedy tokens are the reference's, token
# for token. Where a second thread inside each small operation hardly pays, the second core takes
# whole sequences instead: the batch is cut between sequences and each part runs the whole model in
# a process of its own, over the same K/V pool in shared memory. On a GPU the same algorithm becomes thread blocks, warps and shuffles: v1 and v2 as
# vLLM first wrote them, then v3, one block per K/V head reading each row once for its group in one
# pass with several tokens in flight, and v4, which tiles v3's pass to hold fewer registers — all
# checked in the simulator against the same reference (v4 by the tests). A recorded GPU run, loaded above, measured
# them: each version's share of the copy bandwidth beside Nsight Compute's evidence, v4 with twice
# the warps a block the best at batch 64 and still short of its goals, and CUDA graphs, not the
# kernel, what the engine's decode step needed there. The number that says why it matters is the
# one measured above: the bytes the gather path moves per layer against the bytes attention needs,
# and the attention share of a decode step before and after.
#
# **The same idea in vLLM.** The CPU build's attention: `csrc/cpu/attention.cpp`; the CUDA kernels
# v1 and v2: `csrc/attention/paged_attention_v1.cu`, `paged_attention_v2.cu` and
# `attention_kernels.cuh`; the decode attention V1 runs on GPUs today comes from FlashAttention and
# FlashInfer (`vllm/v1/attention/backends/flash_attn.py`, `flashinfer.py`).
