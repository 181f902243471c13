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
# # Chapter 08 — Paged attention in CUDA
#
# :::{admonition} At a glance
# - **Builds:** decode paged attention as CUDA kernels (numba-cuda), v1 to v4, each checked in
#   numba's CUDA simulator; the engine's `cuda` backend; the decode step as a CUDA graph.
# - **Needs:** chapter 07; CUDA's grid/block/warp model in outline (the chapter draws it).
# - **Runs in:** about 1 min 10 s, start to end (`make book` on a quiet 2-core AMD EPYC).
# :::
#
# Chapter 07's kernel reads the paged cache in place, on a CPU's few cores. This chapter writes the
# same algorithm in CUDA's execution model, with numba-cuda, as an optimisation story: v1 and v2 as
# vLLM first wrote them, v3 as the decode kernels of FlashInfer and vLLM today are shaped, and v4,
# which tiles v3 to hold fewer registers. With an NVIDIA GPU the kernels are compiled and run
# natively on the engine's torch tensors. Without one they run in numba's CUDA **simulator**, which
# executes every CUDA thread as a Python thread: thousands of times slower, but the very same code,
# and every thread's every read can be watched. What they do on a GPU comes from recorded runs.

# %% tags=["remove-input"] mystnb={"image": {"alt": "The roadmap of the engine, chapter 08 highlighted: the chapters before it built, those after it to come"}}
from minivllm.book.figures.roadmap import roadmap

roadmap(8)

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
from minivllm.attention.cuda.backend import KernelDecodeAttention
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
from minivllm.attention.numba_cpu import paged_attention_cpu, warm_up
from minivllm.book import kernel_check, show, source, use_book_style
from minivllm.book.figures.kernels import draw_cache_reads, draw_execution_model
from minivllm.book.kernel_check import decode_call, kernel_error, random_inputs
from minivllm.book.kernel_trace import in_simulator, reads_by_thread, trace_group, trace_v1
from minivllm.book.stats import speed_change, within
from minivllm.model.checkpoint import load_model

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
    f"target model: {config.n_heads} query heads sharing {config.n_kv_heads} K/V heads, "
    f"head_dim {config.head_dim}"
)

# %% [markdown]
# ## Why: what the CPU kernel leaves
#
# Decode attention's limit is the memory: each K/V row is read once and used for a few
# multiply-adds. So measure chapter 07's kernel the way a memory-bound kernel is measured, in bytes
# read per second: one layer of 64 decodes with contexts of 200 to 300 tokens, the median of 30
# calls (this machine, now):

# %%
# NBVAL_IGNORE_OUTPUT
warm_up()  # compile, or load the machine code cached by an earlier process
# 64 decodes of 200-300 tokens, their blocks scattered over a pool (book/kernel_check.py)
layer_args = decode_call(list(np.random.default_rng(1).integers(200, 300, 64)), config)
lens = layer_args[4]
call_s = []
for _ in range(30):
    started = time.perf_counter()
    paged_attention_cpu(*layer_args)
    call_s.append(time.perf_counter() - started)
kv_read = 2 * int(lens.sum()) * config.n_kv_heads * config.head_dim * 4  # K and V, float32
cpu_rate = kv_read / float(np.median(call_s))
print(
    f"{kv_read / 2**20:.1f} MiB of K/V in {1e3 * np.median(call_s):.2f} ms: "
    f"{cpu_rate / 1e9:.1f} GB/s, on {torch.get_num_threads()} threads"
)

# %% [markdown]
# Set that beside a GPU's memory. A number for one comes from a recorded run
# (`benchmarks/results/gpu/`, written by `benchmarks/paged_attention.py` on a named GPU), never from
# the prose; the same record gives the Measure section below its table:

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
if kernels:
    copy_rate = kernels["copy_bandwidth_bytes_per_second"]
    print(
        f"{kernels['machine']['device']} (recorded {kernels['machine']['date'][:10]}): copy "
        f"bandwidth {copy_rate / 1e12:.2f} TB/s, over {kernels['num_sms']} SMs"
    )
resident = H100_SXM.sms * H100_SXM.max_warps * WARP_SIZE
print(
    f"an {H100_SXM.name} holds {H100_SXM.max_warps} warps of {WARP_SIZE} threads on each of its "
    f"{H100_SXM.sms} SMs: {resident:,} threads resident at once (the occupancy model's numbers)"
)
units = len(lens) * config.n_kv_heads
print(
    f"the layer above is {units} units of work (sequence, K/V head) for chapter 07's "
    f"{torch.get_num_threads()} threads"
)

# %% [markdown]
# That bandwidth is there only for a kernel that keeps enough reads in flight, and a GPU's reads
# come from its threads: tens of thousands resident at once, each with a load or two outstanding.
# Chapter 07's unit of work — a sequence and a K/V head, one thread's loop over its blocks — is far
# too coarse to give them that: a batch of 64 decodes is a hundred-odd units for a machine that
# wants hundreds of warps busy. The work has to be cut much finer, and the threads of one unit
# have to cooperate. This chapter cuts it, four times.
#
# ## Build: the same algorithm in CUDA's execution model
#
# The kernels compute what chapter 07's does — every K/V row read once, in place, through the block
# table, softmax in float32. First the machine.
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
fig, ax = plt.subplots(figsize=(7.5, 3.4))
draw_execution_model(
    ax, num_seqs=4, num_heads=config.n_heads, threads=128, head_dim=config.head_dim
)
plt.show()

# %% [markdown]
# ### v1: the CUDA kernel, in pieces
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
# (sequence, head); its v1 path is folded below (`_simulator_pace` only makes the simulator pass
# Python's GIL around more often; on a GPU it does nothing). The kernels live in `attention/cuda/kernels.py`,
# the launcher in `attention/cuda/launch.py`.

# %%
show(paged_attention_v1)

# %% tags=["hide-output"]
launcher = source(paged_attention).splitlines()
v1_path = (  # from the defaults to v1's launch and return
    next(n for n, line in enumerate(launcher, 1) if "scale = head_dim**-0.5" in line),
    next(n for n, line in enumerate(launcher, 1) if line.strip() == "return out"),
)
show(paged_attention, lines=v1_path)

# %% [markdown]
# ### Check: the kernel against a plain softmax
#
# As for chapter 07's kernel (`book/kernel_check.py`): fresh random inputs (never zeros — a kernel
# that reads the wrong slot of a zero cache still looks right) from `random_inputs`, physical
# blocks in shuffled order with spare blocks nobody owns, an output **poisoned with NaN** before
# the launch so an element the kernel forgets to write cannot pass. The target model's head_dim
# and block size, and its grouped-query attention in small: 2 query heads on 1 K/V head (the model
# has 8 on 2; the simulator pays for every head). The contexts include one token, one ending
# mid-block and one on a block boundary. The reference gathers each sequence's K/V through its
# table and runs the model's own softmax attention; `kernel_error` (folded: open it to read)
# launches the kernel into a poisoned output and compares:

# %% tags=["hide-output"]
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
# process with one (a real GPU's reads happen in hardware, out of Python's sight). `trace_v1` is
# folded below; open it to see a launch written out by hand.

# %% tags=["hide-output"]
show(trace_v1)

# %%
trace = in_simulator(trace_v1, config.head_dim)
key_reads, value_reads = trace.key_reads, trace.value_reads
print(
    f"{len(key_reads)} key reads = 40 tokens x {config.head_dim} elements; {len(value_reads)} value reads"
)

# %% tags=["hide-input"] mystnb={"figure": {"caption": "The key cache as one thread block reads it: one row per physical block, one cell per slot. A slot that was read is coloured by the warp that read it and numbered with that warp's round; slots of other sequences' blocks stay blank.", "name": "fig-08-cache-reads"}}
fig, ax = plt.subplots(figsize=(7.5, 3.4))
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
# ### v2: more thread blocks — the partitioned kernel
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
# $\ell = 0$ and weighs nothing. The v2 kernel is v1's pass over one partition, with its max and
# sum written out (folded: open it to read); the merge follows it.

# %% tags=["hide-output"]
show(paged_attention_v2)

# %%
show(merge_partitions)

# %%
case = random_case([1, 24, 40], num_heads=2, num_kv_heads=1, seed=6)
for partition in (16, 24):
    error = kernel_error(case, partition_size=partition, threads=WARP_SIZE)
    print(f"v2, partitions of {partition} tokens: max relative error {within(error, 1e-5)}")

# %% [markdown]
# ### v3: one pass per K/V head — grouped flash-decoding
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
# The online softmax is what lets one pass suffice. Chapter 07's kernel waits for every score
# before it takes the softmax, because the max is not known until the end — but it need not be. Keep a
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
#
# Here is v3's pass (`grouped_decode_kernel` compiles the kernel for one shape; before the pass it
# stages the partition's table entries in shared memory and loads its lanes' queries, after it the
# teams' states are merged by the same log-sum-exp rule as v2's partitions):

# %%
v3_lines = source(grouped_decode_kernel).splitlines()
one_pass = (  # from the pass's comment to the online-softmax update's last line (exercise ch08.3)
    next(n for n, line in enumerate(v3_lines, 1) if "# One pass: each round" in line),
    next(n for n, line in enumerate(v3_lines, 1) if "# Merge the teams" in line) - 2,
)
show(grouped_decode_kernel, lines=one_pass)

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
# leaves slots empty. (The function is folded below.)

# %% tags=["hide-output"]
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
fig, axes = plt.subplots(1, 2, figsize=(7.5, 3.2), sharey=True)
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
axes[1].legend(fontsize=9)
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
# engine's device, else the reference — the last line of the folded output below says what that
# means on each device. A new kernel plugs in with one more `register_backend` line: chapter 07's
# CPU kernel (`numba`) is the third, and "auto" picks it for a float32 or bfloat16 cache on a CPU,
# where `benchmarks/throughput.py` measures it ahead of the reference (its decode steps, and the
# whole 64-request workload), and `benchmarks/real_model.py` a real checkpoint's shapes.

# %% tags=["hide-output"]
registry = source(attention_backend)
print(registry[registry.index("register_backend(REFERENCE") :].strip())
print({device: resolve_backend_name("auto", device) for device in ("cpu", "cuda")})

# %% [markdown]
# The backend copies nothing of the reference. `TorchPagedAttention` takes its decode piece as a
# parameter, so `CudaPagedAttention` is the reference with `KernelDecodeAttention` where
# `DecodeAttention` was: the K/V write and the {term}`prefill` chunks (`PrefillAttention`) stay the
# reference's — the kernel is a decode kernel, one query per sequence (`attention/cuda/backend.py`;
# the decode piece is folded below).

# %% tags=["hide-output"]
show(KernelDecodeAttention)

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
# the cell below reads the records loaded above, and each row of the table below is one step of the story: what changed in
# the code, what it should do, and what it did.

# %%
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
# ### v4: fewer registers, then more warps
#
# v4 (`attention/cuda/tiled.py`) attacks the registers, not the cap. v3's teams each keep a running
# output for every head of the group and rescale it on every token; v4 takes a *tile* of tokens in
# three phases separated by barriers — all the tile's scores (each key row one 8-byte load a lane),
# then the softmax once per (head, token) in shared memory, then the values — so that in the last
# phase each output element belongs to one thread, rescaled once a tile:

# %%
tiled_lines = source(tiled_decode_kernel).splitlines()
values_phase = (  # the third phase, from its comment to the end of the tile loop
    next(n for n, line in enumerate(tiled_lines, 1) if "# 3. Values:" in line),
    next(n for n, line in enumerate(tiled_lines, 1) if line.strip() == "buffer = 1 - buffer"),
)
show(tiled_decode_kernel, lines=values_phase)

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
    fig, ax = plt.subplots(figsize=(7.5, 3.6))
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
    ax.legend(fontsize=9, loc="upper center", bbox_to_anchor=(0.5, -0.32), ncol=3)
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
    best = max(r for system, r in rate.items() if system.startswith("minivllm"))
    print(f"HF generate: {hf:,.0f} tokens/s; the best minivllm row: {speed_change(best / hf)}")
    differing = sum(row["requests_differing_from_torch_backend"] for row in engine_run["rows"])
    print(f"requests whose tokens differ from the torch backend's, over all systems: {differing}")

# %% [markdown]
# Without graphs the kernel backend is *slower* than the torch backend although its attention is
# faster: numba's launches cost the host more than torch's, and the host is the bottleneck. With
# graphs both become a single launch a step, the host's cost falls away, and the two backends come
# out level: at this model's size attention is too small a share of the step for the kernel to
# show. The tokens are the same in every row.
#
# A checkpoint of a real model's shape changes that: a random Qwen3-0.6B (28 layers, a vocabulary of
# 151,936 tokens, float16), run with graphs. Its first run found a cost the small model hides: each
# step copied 64 rows of logits, the whole vocabulary each, to the host for an argmax there. The
# runner now leaves the logits on the GPU, and a greedy batch without logit rules takes its argmax
# there; every other draw is still made on the host in float64, so a request's tokens never depend
# on the device (`runner/sampler.py`'s `sample`). Both runs are recorded:

# %%
real_run = load_record("gpu_engine_real.json")
real_before = load_record("gpu_engine_real_logits_to_host.json")
if real_run and real_before:
    print(f"{real_run['workload']['model']}, recorded on {real_run['machine']['device']}")
    rate = {row["system"]: row["median_tokens_per_s"] for row in real_run["rows"]}
    profile = {p["system"]: p for p in real_run["decode_profiles"]}
    old = {p["system"]: p for p in real_before["decode_profiles"]}
    old_rate = {row["system"]: row["median_tokens_per_s"] for row in real_before["rows"]}
    print(f"{'backend':>8} {'tokens/s':>17} {'ms per step':>16} {'GPU busy':>13}")
    for backend in ("torch", "cuda", "cuda-v4"):
        name = f"minivllm {backend} backend + CUDA graphs"
        print(
            f"{backend:>8} {old_rate[name]:7,.0f} -> {rate[name]:6,.0f} "
            f"{old[name]['ms_per_step']:7.1f} -> {profile[name]['ms_per_step']:5.1f} "
            f"{old[name]['gpu_busy_share']:6.0%} -> {profile[name]['gpu_busy_share']:.0%}"
        )
    hf, old_hf = rate["HF generate (one batch)"], old_rate["HF generate (one batch)"]
    kernel = rate["minivllm cuda backend + CUDA graphs"]
    print(f"HF generate, unchanged code: {old_hf:,.0f} -> {hf:,.0f} tokens/s (the calls' spread)")
    print(f"the kernel backend against HF generate: {speed_change(kernel / hf)}")
    differing = sum(row["requests_differing_from_torch_backend"] for row in real_run["rows"][:-1])
    print(f"requests whose tokens differ between minivllm's backends: {differing}")
    for request, token in real_run["rows"][-1]["first_differing_token"].items():
        print(f"HF generate against the torch backend: request {request} from output token {token}")

# %% [markdown]
# With the logits kept on the GPU the step is the GPU's again, and here the kernel shows: the torch
# backend gathers every sequence's K/V into a padded copy before attending, the kernel reads the
# blocks in place. Hugging Face's tokens part from minivllm's late in one request: float16 sums
# taken in another order can flip a close pair of logits (the record keeps no logits to show how
# close).
#
# ## Exercises
#
# Solutions live between `### BEGIN SOLUTION` and `### END SOLUTION` in
# `src/minivllm/attention/cuda/grouped.py` (ch08.3) and `src/minivllm/attention/cuda/kernels.py`
# (ch08.1, ch08.2); run one exercise's tests with `pytest tests --exercise ch08.3`.
# They run in the simulator, so no GPU is needed.
#
# 1. **ch08.3 — v3's online softmax** (this chapter's core). In `grouped_decode_kernel`'s pass,
#    after each round's scores, fold every live team's token into its running state: for each
#    query head `g` of the group, `score[g]` joins the running max `run_max[g]` and the running sum
#    `run_sum[g]`, and the team's lanes add the token's `value_part`, weighted, into their slice of
#    the head's output `out_part[g * per_lane : (g + 1) * per_lane]` — the $m'$, $\ell'$, $a'$
#    update of the v3 section, one token at a time. A team past the end of the partition (`live`
#    false) adds nothing. The tests run v3 in the simulator against a float64 reference over block
#    sizes, head sizes, groups and dtypes, with teams and warps that merge their states, and split
#    into partitions. Three hints, from a nudge to nearly the answer, are folded below the list.
# 2. **ch08.1 — the block-table address.** In `cache_slot`, return `(block, offset)`: the physical
#    block that holds token `position`, read from the sequence's {term}`block table` row `table`,
#    and the offset of the token within that block. The tests run the whole v1 kernel, which calls
#    it for every token, against a float64 reference.
#
#    *Hint:* It is `BlockManager.slot_mapping`'s arithmetic (chapter 03) stopped one step early: the
#    logical block index picks the table entry and the remainder is the offset. Return the two; do
#    not fold them into one slot.
# 3. **ch08.2 — the {term}`log-sum-exp merge`.** In `merge_partitions`, for each element `d` the
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
# 4. *(Explore, no test.)* v1 keeps one score per token in shared memory. How long a context fits in
#    an H100 block's 48 KiB of default dynamic shared memory? Rewrite `attend_range` with an
#    *online* softmax (a running max and sum, rescaling the accumulator when the max grows) so its
#    shared memory no longer grows with the context.
#
#    *Hint:* `shared_bytes(head_dim, threads, tokens)` gives the bytes; solve it for `tokens`. For
#    the rewrite, apply v3's $m'$, $\ell'$, $a'$ update after each round of `num_warps` scores,
#    so only one round's scores ever sit in shared memory.
# 5. *(Explore, no test.)* Every lane calls `cache_slot` for every token, reading the block table
#    over and over. Change the score loop so a warp takes a whole block of 16 tokens at a time and
#    looks the block up once; use `kernel_trace.recorded` on the block table to count the reads
#    before and after.
#
#    *Hint:* Deal *blocks* to the warps round-robin and loop over the offsets inside (the range may
#    start or end mid-block); keep every warp running the same number of rounds.

# %% [markdown]
# The hints for ch08.3, the chapter's core, are folded: open one at a time.
#
# :::{admonition} Hint 1 for ch08.3 — a nudge
# :class: dropdown
# The state starts at $m = -\infty$, $\ell = 0$, $a = 0$, so the first token needs no special case:
# $e^{-\infty} = 0$ wipes the empty state. Each new score can only raise the max, and whatever was
# summed against the old max must be brought to the new one before the token is added.
# :::
#
# :::{admonition} Hint 2 for ch08.3 — the approach
# :class: dropdown
# Only when `live`: per head `g`, take the larger of the running max and `score[g]`, then two
# exponentials of differences from it — one of the old max (the factor that rescales what is
# already summed), one of the score (this token's weight). Scale the running sum and every element
# of the head's slice of `out_part` by the first, add the weight to the sum and weight times
# `value_part[i]` to element `i`, and store the new max last: the factor needs the old one.
# :::
#
# :::{admonition} Hint 3 for ch08.3 — nearly there
# :class: dropdown
# Per head: `new_max` is `max(run_max[g], score[g])`; `rescale` is `math.exp` of the old max minus
# it and `weight` is `math.exp` of the score minus it. The sum becomes sum times `rescale` plus
# `weight`; for `i` in `range(per_lane)`, element `g * per_lane + i` of `out_part` becomes itself
# times `rescale` plus `weight * value_part[i]`. Then `run_max[g]` takes `new_max`.
# :::

# %% [markdown]
# ## Summary
#
# On a GPU the algorithm of chapter 07 becomes thread blocks, warps and shuffles. v1 and v2 are
# vLLM's first kernels: a thread block per (sequence, query head), then partitions merged by the
# log-sum-exp identity for more blocks. v3 gives each K/V head one thread block that reads each row
# once for its whole query-head group, in one pass with an online softmax and several tokens in
# flight per warp; v4 tiles v3's pass to hold fewer registers. All are checked in the simulator
# against the same reference as chapter 07's kernel (v4 by the tests), and the engine runs v3 as
# its `cuda` backend with the reference's greedy tokens. The recorded GPU run, loaded above, gives
# each version's share of the copy bandwidth beside Nsight Compute's evidence — the one number per
# version that says whether the change paid — and shows that for this small model's decode step
# CUDA graphs, not the kernel, were what the engine needed.
#
# **Next.** Chapter 09 puts the engine behind an HTTP server; chapter 11 takes it beyond one device.
#
# **The same idea in vLLM.** The CUDA kernels v1 and v2: `csrc/attention/paged_attention_v1.cu`,
# `paged_attention_v2.cu` and `attention_kernels.cuh`; the decode attention V1 runs on GPUs today
# comes from FlashAttention and FlashInfer (`vllm/v1/attention/backends/flash_attn.py`,
# `flashinfer.py`); CUDA graphs: `vllm/v1/worker/gpu_model_runner.py` (`capture_model`).
