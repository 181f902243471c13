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
# # Chapter 11 — Beyond one device
#
# :::{admonition} At a glance
# - **Builds:** tensor parallelism on `torch.distributed`: each layer split by heads and hidden
#   units across ranks (processes), two all-reduces a layer, rank 0 scheduling and sampling for
#   all; engine replicas that share out the requests (data parallelism); then the hand-off to
#   vLLM.
# - **Needs:** chapters 03 and 04 (the paged cache, the engine step), chapter 07 (the CPU kernel,
#   its threads and their wait policy), chapter 10 (real configs, the K/V arithmetic).
# - **Runs in:** about 30 s, start to end (`make book` on a quiet 2-core AMD EPYC).
# :::
#
# Chapter 10 loaded real checkpoints, and its table of K/V sizes ended where every serving engine
# meets its next wall: the model you want, with the batch you want, does not fit one device, or
# one device reads its weights too slowly. This chapter first measures that wall, then looks at
# the one multi-process mechanism the engine had so far — whole sequences given to processes
# that share one machine's memory — and why it stops there. Then it builds what every engine the
# book stands beside answers with, **{term}`tensor parallelism`**: every layer split across devices, so
# each holds a share of the weights and of the K/V cache. For throughput on one machine there is
# a third way, whole engine replicas that never meet (data parallelism), and the chapter measures
# all three. It ends where this book hands you over:
# the weights folder the engine serves is served by vLLM, token for token, with
# `--tensor-parallel-size` and many machines.

# %% tags=["remove-input"] mystnb={"image": {"alt": "The roadmap of the engine, chapter 11 highlighted: the chapters before it built, those after it to come"}}
from minivllm.book.figures.roadmap import roadmap

roadmap(11)

# %%
import json
import time
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import torch

import minivllm
from minivllm import EngineConfig, LLMEngine, SamplingParams
from minivllm.attention.batch import split_sequences
from minivllm.book import show, use_book_style
from minivllm.book.figures.parallel import draw_rank_layout
from minivllm.book.stats import speed_change, within
from minivllm.book.step_timing import decode_engine, time_decode_steps, time_thread_counts
from minivllm.book.tiny_checkpoint import shipped_config
from minivllm.engine.data_parallel import DataParallelEngine
from minivllm.kv.block_manager import BlockManager
from minivllm.kv.sizing import kv_bytes_per_token
from minivllm.model.checkpoint import config_from_hf, load_model
from minivllm.model.families import model_class
from minivllm.model.parallel import (
    COMM,
    RowParallelLinear,
    Shard,
    VocabParallelEmbedding,
    local_config,
    shard_slices,
)
from minivllm.runner.tensor_parallel import serve_rank
from minivllm.runner.workers import ForwardWorkers, balanced_bounds
from minivllm.training.corpus import shipped_validation_text

torch.manual_seed(0)
torch.set_num_threads(2)
use_book_style()
target = load_model("target")
config = target.config
RESULTS = Path(minivllm.__file__).resolve().parents[2] / "benchmarks" / "results"
print(
    f"target model: {config.n_layers} layers, {config.n_heads} query heads sharing "
    f"{config.n_kv_heads} K/V heads of {config.head_dim}, MLP {config.d_ff} units"
)

# %% [markdown]
# ## Why: what one decode step asks of one device
#
# A decode step of a batch of $B$ sequences reads every weight once and every sequence's cached
# K/V once, and does about two floating-point operations per weight per sequence (a multiply and
# an add), plus attention's four per cached element per query head. Take the shipped Qwen3-0.6B
# and Llama 3 8B configs of chapter 10, and Llama 3 70B — the 8B config with the 70B's published
# shape (80 layers, 8192 wide, 64 query heads, 28672 MLP units) — in bfloat16, a batch of 64 at
# 2048 tokens of context each, against one H100 SXM as NVIDIA's datasheet gives it:

# %%
H100 = {"memory": 80 * 2**30, "bandwidth": 3.35e12, "flops": 989e12}  # bytes, bytes/s, bf16 FLOP/s
BATCH, CONTEXT, UTILIZATION = 64, 2048, 0.9  # vLLM's default gpu_memory_utilization
llama8b = shipped_config("Meta-Llama-3-8B")
real = {
    "Qwen3-0.6B": config_from_hf(shipped_config("Qwen3-0.6B")),
    "Llama-3-8B": config_from_hf(llama8b),
    "Llama-3-70B": config_from_hf(
        dict(
            llama8b,
            hidden_size=8192,
            intermediate_size=28672,
            num_hidden_layers=80,
            num_attention_heads=64,
        )
    ),
}
shapes = {}  # name -> {parameter name: shape}, counted on the meta device (no memory)
for name, c in real.items():
    with torch.device("meta"):
        shapes[name] = {n: p.shape for n, p in model_class(c, torch.bfloat16)(c).named_parameters()}


def kv_per_token(c, kv_heads=None) -> int:
    return kv_bytes_per_token(c.n_layers, kv_heads or c.n_kv_heads, c.head_dim, "bfloat16")


print(f"{'':<12}{'weights':>9}{'K/V read':>10}{'TFLOP':>7}{'ms (bytes)':>12}{'ms (FLOPs)':>12}")
for name, c in real.items():
    params = sum(s.numel() for s in shapes[name].values())
    weight_bytes, kv_bytes = 2 * params, BATCH * CONTEXT * kv_per_token(c)
    flops = 2 * params * BATCH + 4 * c.n_layers * c.n_heads * c.head_dim * CONTEXT * BATCH
    print(
        f"{name:<12}{weight_bytes / 2**30:6.1f} GiB{kv_bytes / 2**30:6.1f} GiB{flops / 1e12:7.2f}"
        f"{1e3 * (weight_bytes + kv_bytes) / H100['bandwidth']:12.2f}"
        f"{1e3 * flops / H100['flops']:12.2f}"
    )

# %% [markdown]
# Two walls. The step is bound by **bytes**, not arithmetic: reading the weights and the cache
# takes many times longer than the multiply-adds, so a second device that reads half of each halves
# the step. And **capacity**: 70 B parameters in bfloat16 do not fit one 80 GiB device at all, and
# on the 8 B model the weights take their share before the cache gets any. Split every layer over
# $W$ devices and each holds $1/W$ of the weights and $1/W$ of every token's K/V (its own K/V
# heads) — until there are fewer K/V heads than devices, when each head is held by the devices
# whose query heads read it. The bytes each rank holds, from `shard_slices` (which slice of each
# checkpoint tensor a rank holds, the function every rank loads its weights with), and the tokens
# of K/V that fit beside them:


# %%
def rank_weight_bytes(name: str, world: int) -> int:
    """Rank 0's bytes of weights in bfloat16: each split tensor's slice, the rest whole."""
    slices = shard_slices(real[name], Shard(0, world))
    total = 0
    for param, shape in shapes[name].items():
        cut = slices.get(param)
        total += shape.numel() if cut is None else shape.numel() // shape[cut.dim] * cut.size
    return 2 * total


print(f"{'K/V tokens per rank':<20}" + "".join(f"{f'TP {w}':>11}" for w in (1, 2, 4, 8, 16)))
for name, c in real.items():
    cells = []
    for world in (1, 2, 4, 8, 16):
        held = Shard(0, world).kv_heads(c)[1]
        room = UTILIZATION * H100["memory"] - rank_weight_bytes(name, world)
        cells.append(f"{room / kv_per_token(c, held) / 1e3:9,.0f}k" if room > 0 else "no room")
    print(f"{name:<20}" + "".join(f"{cell:>11}" for cell in cells))

# %% [markdown]
# Each doubling of $W$ halves the weights a rank holds and the K/V each token costs it, so the
# tokens a rank caches more than double — while the K/V heads divide. Past them (Llama's 8 K/V
# heads at TP 16, Qwen3-0.6B's at TP 16), a rank's K/V per token stops shrinking: replicated heads
# are memory spent twice. This is why real deployments pick $W$ no larger than the K/V heads.
#
# ## The engine's first way to use more processes: whole sequences
#
# The engine already has one way to use more processes, `runner/workers.py`, built for the 2-core
# machine this book was written on. First, what is a second core worth the usual way — threads
# inside the step? A decode step of 32 requests, on one thread and on two, alternating (the second
# engine, started here too, comes in below). On two, the engine splits the attention kernel and
# leaves a pass this small's matmuls on one thread; the reason follows.

# %%
# NBVAL_IGNORE_OUTPUT
BATCH_HERE = 32
steady = decode_engine(target, "numba", num_seqs=BATCH_HERE)
split_engine = decode_engine(target, "numba", num_seqs=BATCH_HERE, forward_processes=2)
by_threads = time_thread_counts(steady, counts=(1, 2), steps=5)
for threads, ms in by_threads.items():
    print(f"{threads} thread{'s' * (threads > 1)}: step {ms:5.1f} ms")
print(f"the second thread: the step {speed_change(by_threads[1] / by_threads[2])}")

# %% [markdown]
# Little or nothing, on a small machine — run it on yours. A step is a few hundred small
# operations: 25 matmuls of a few million multiply-adds each, six attention calls, and elementwise
# work on 32 × 256 floats, which torch does not split at all below its grain size. Splitting a
# matmul that takes one core a fraction of a millisecond means waking the other core's thread,
# handing it half, and waiting for both at the end, 25 times a step; on a virtual machine a
# wake-up alone can eat much of what the split saves. So `run_model` gives a pass whose biggest
# matmul is under `ONE_THREAD_BELOW_MACS` multiply-adds one torch thread, and only the attention
# kernel, set up before, both (`runner/threads.py` has the measurements); a 512-token prefill
# chunk, or a real checkpoint's decode, keeps both threads for everything.
#
# The split that needs no meeting inside the step is coarser: **by sequence**. Attention keeps
# sequences apart, and every other layer works on each token's row alone, so a batch cut between
# sequences gives parts that need nothing from each other until their logits come back. Each part
# runs the whole model, on one thread, on a core of its own: data parallelism inside one step,
# with one scheduler, one block manager, one K/V pool. `split_sequences` cuts a `VarlenBatch`:

# %%
show(split_sequences)

# %% [markdown]
# Where to cut: each part should take as long as the other. A sequence's work is its new tokens
# times the keys each sees, plus its matmuls (counted in keys). A prefill chunk is never cut in
# two — its later tokens attend to its earlier ones, layer by layer — so the cut goes at the
# sequence boundary nearest to an even share of the work:

# %%
show(balanced_bounds)

# %% [markdown]
# The parts run in **processes**, not threads: a part is a few hundred small torch calls, and each
# call holds Python's interpreter lock while it is dispatched, so two threads would take turns at
# it. `ForwardWorkers` spawns the workers when the engine starts
# (`EngineConfig(forward_processes=2)`) and moves the weights and the K/V pool into **shared
# memory**, so every process reads and writes the same blocks; each step broadcasts the parts'
# metadata to the workers over a process group (gloo, on 127.0.0.1) and gets back their logits:

# %%
show(ForwardWorkers.forward)

# %% [markdown]
# The decode step, one process on two threads against two processes on one thread each,
# alternating, once the split engine has caught up with the steps the first one took above (so
# both decode at the same context lengths):

# %%
# NBVAL_IGNORE_OUTPUT
while len(split_engine.trace) < len(steady.trace):
    split_engine.step()
by_split = time_decode_steps({"1 process, 2 threads": steady, "2 processes": split_engine}, steps=5)
part_ms = []  # each process's forward time for its part, over a few more steps
for _ in range(3):
    split_engine.step()
    part_ms.append([1e3 * s for s in split_engine.runner.workers.part_seconds])
split_engine.close()
for name, t in by_split.items():
    print(f"{name:>20}: step {t['step_ms']:5.1f} ms")
one_ms, two_ms = (by_split[name]["step_ms"] for name in ("1 process, 2 threads", "2 processes"))
print(f"two processes: the step {speed_change(one_ms / two_ms)}")
engine_part, worker_part = np.median(part_ms, axis=0)
print(
    f"the parts: {engine_part:.1f} ms in the engine's process, {worker_part:.1f} ms in the worker"
)

# %% [markdown]
# The check, as for every change to the engine: the greedy tokens both engines have generated so
# far, sequence by sequence (the same requests, seeded), on one process and on two:


# %%
def generated(engine: LLMEngine) -> dict[int, list[int]]:
    return {seq.seq_id: list(seq.output_token_ids) for seq in engine.scheduler.running}


def same_tokens(reference: dict, other: dict) -> tuple[int, int]:
    """Sequences whose tokens agree with the reference's over their common length; tokens
    compared."""
    common = {i: min(len(reference[i]), len(other[i])) for i in other}
    same = sum(reference[i][: common[i]] == other[i][: common[i]] for i in other)
    return same, sum(common.values())


one_process = generated(steady)
same, compared = same_tokens(one_process, generated(split_engine))
print(f"{same} of {len(one_process)} sequences: identical greedy tokens on one process and on two")
print(f"({compared} generated tokens compared)")
assert same == len(one_process) == BATCH_HERE

# %% [markdown]
# A row's logits are what a one-thread pass over its part gives. They can move in the last bits
# with the cut — a matmul's rounding depends on how many rows it has — as they do from one step to
# the next in any engine; a greedy token could change only at a near-tie.
#
# On a loaded machine the worker waits for a core and two processes lose outright; but even on a
# quiet one they are not twice as fast. Why? Part of every pass does not shrink with its batch: a
# few hundred torch calls dispatched from Python, every weight read once, six kernel calls. Two
# parts pay it twice. One thread, steps of 1, 16 and 32 decoding sequences (the 32 from the first
# measurement):

# %%
# NBVAL_IGNORE_OUTPUT
half = BATCH_HERE // 2
one_thread = {
    n: time_thread_counts(decode_engine(target, "numba", num_seqs=n), counts=(1,), steps=5)[1]
    for n in (1, half)
}
one_thread[BATCH_HERE] = by_threads[1]
for n, ms in one_thread.items():
    print(f"{n:2d} sequences, one thread: step {ms:5.1f} ms")
print(
    f"a step of one sequence costs {one_thread[1] / one_thread[BATCH_HERE]:.0%} of a step of "
    f"{BATCH_HERE}; half the batch costs {one_thread[half] / one_thread[BATCH_HERE]:.0%} of it"
)

# %% [markdown]
# The one-sequence step is the cost that does not shrink with the batch, and each process pays it
# for its half; the host work between passes (scheduling, sampling) runs in the engine's process
# alone while the worker waits. One more condition: nothing else may keep the worker's core busy
# — torch's spinning OpenMP threads would (chapter 07's wait policy), so `ForwardWorkers` warns
# when `OMP_WAIT_POLICY` is not passive.
#
# **Why this cannot go past one machine.** Every worker runs the *whole* model, and every worker
# reads the *same* K/V pool, through shared memory. Both halves of that sentence are the limit. A
# second machine shares no memory with the first, so its processes cannot read the blocks the
# first one wrote. And no split by sequence makes the weights smaller: each process needs all of
# them, so a model that does not fit one device (the 70 B above) does not fit any of them. To go
# further, the model itself must be cut.
#
# ## Build: cut every layer, not the batch
#
# Shoeybi et al. {cite}`shoeybi2019megatron` (Megatron-LM) split a transformer layer between
# devices so that it needs only two collective operations. Write the MLP as
#
# $$
# Y = \big(\operatorname{SiLU}(X G) \odot X U\big)\, D ,
# $$
#
# with $X$ the normed tokens ($T \times d$), $G$ and $U$ the gate and up projections
# ($d \times f$), $D$ the down projection ($f \times d$). Cut $G$ and $U$ by **columns** into $W$
# pieces $G_r, U_r$ ($d \times f/W$), and $D$ by **rows** into the matching $D_r$ ($f/W \times d$).
# SiLU and $\odot$ act element by element, so rank $r$ computes its hidden units
# $H_r = \operatorname{SiLU}(X G_r) \odot X U_r$ with nothing from the others, and
#
# $$
# Y = [H_1 \;\cdots\; H_W] \begin{bmatrix} D_1 \\ \vdots \\ D_W \end{bmatrix}
#   = \sum_{r=1}^{W} H_r D_r ,
# $$
#
# a sum of one partial product per rank: one **{term}`all-reduce`**, after which every rank holds all of
# $Y$. Attention is cut the same way. Its heads are independent by construction, so q, k and v
# are column-parallel — rank $r$ computes its query heads and the K/V heads they read, attends over
# its own K/V cache — and the output projection $O$ is row-parallel: rows of $O$ matching rank
# $r$'s heads, partial sums, one all-reduce. Everything between — the residual additions, the
# RMSNorms, RoPE — works on whole $d$-wide rows, which every rank holds after each all-reduce, so
# it runs on every rank, identically. **Two all-reduces per layer**, whatever $W$ is, plus one for
# the vocabulary-parallel embedding and a gather of the logits at the end.
#
# The identity, on the target model's first MLP, in this process: two halves, summed, against the
# whole layer:

# %%
mlp = target.model.layers[0].mlp
x = torch.randn(5, config.d_model, generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    whole = mlp(x)
    halves = []
    for rank in range(2):
        units = slice(rank * config.d_ff // 2, (rank + 1) * config.d_ff // 2)
        hidden = torch.nn.functional.silu(x @ mlp.gate_proj.weight[units].T)
        hidden = hidden * (x @ mlp.up_proj.weight[units].T)
        halves.append(hidden @ mlp.down_proj.weight[:, units].T)
error = (sum(halves) - whole).abs().max()
print(f"rank 0's partial sum + rank 1's = the whole MLP: {within(error, 1e-5)}")
print(f"either half alone is far off: {(halves[0] - whole).abs().max() > 1e-2}")

# %% [markdown]
# In the package, `model/parallel.py`. A `Shard` says which heads, hidden units and vocabulary rows
# a rank holds; with fewer K/V heads than ranks, a rank holds the one head its query heads read.
# This and its companion `Shard.query_heads` are exercise ch11.2:

# %%
show(Shard.kv_heads)

# %% [markdown]
# The row-parallel layer holds the columns of its weight that match its share of the input, and
# sums over the ranks; a bias, held whole, is added once, after the sum (added on every rank
# before it, it would count $W$ times). This is exercise ch11.1:

# %%
show(RowParallelLinear)

# %% [markdown]
# Column-parallel layers need no class of their own: rank $r$'s q, k, v, gate and up are ordinary
# `nn.Linear`s with fewer output features — its slices of the checkpoint, which it reads from the
# files without loading the rest. The embedding is split by vocabulary rows: a rank looks up the
# ids that fall in its rows, zeros elsewhere, and the all-reduce adds one real row to $W-1$ rows of
# zeros (exact):

# %%
show(VocabParallelEmbedding)

# %% [markdown]
# What rank 0 of two holds of the target model, and of Llama 3 8B — each rank's model is the
# book's own transformer with these smaller shapes, so its K/V pool is built from this config too:

# %%
for name, c in {"target": config, "Llama-3-8B": real["Llama-3-8B"]}.items():
    mine = local_config(c, Shard(0, 2))
    print(
        f"{name:<11} rank 0 of 2: {mine.n_heads} of {c.n_heads} query heads, {mine.n_kv_heads} of "
        f"{c.n_kv_heads} K/V heads, {mine.d_ff} of {c.d_ff} MLP units, "
        f"{Shard(0, 2).vocab_rows(c)[2]:,} of {c.vocab_size:,} vocabulary rows"
    )

# %% [markdown]
# ## See: which rank holds what
#
# The K/V cache follows the heads. The scheduler and the block manager run once, on rank 0, so
# there is one block table per sequence, the same on every rank: block 3 holds the same tokens
# everywhere, and each rank keeps in it the K/V of its own heads. A rank's pool has as many blocks
# as one device's would, each $1/W$ the size. Two sequences in a pool of 8 blocks, at TP 2 and at
# TP 4, where the target's two K/V heads are fewer than the ranks:

# %% mystnb={"figure": {"caption": "Which rank holds which heads and blocks: each rank's query heads (coloured by the K/V head they read) and K/V heads, and its K/V pool — the same block table on every rank, blocks coloured by sequence, each rank keeping its own heads' K/V in each block. At TP 4 each K/V head is held by the two ranks whose query heads read it.", "name": "fig-11-rank-layout"}}
pool = BlockManager(num_blocks=8, block_size=16)
pool.allocate(0, 40)
pool.allocate(1, 20)
fig, (two, four) = plt.subplots(2, 1, figsize=(7.5, 4.2), gridspec_kw={"height_ratios": [3.6, 5.6]})
draw_rank_layout(two, config, 2, pool, "tensor parallel 2")
draw_rank_layout(four, config, 4, pool, "tensor parallel 4: K/V heads replicated")
plt.show()

# %% [markdown]
# ## Run it: rank 0 drives, every rank computes
#
# `EngineConfig(tensor_parallel_size=2)` spawns rank 1 as a process on this machine, with the
# forward workers' launcher (`runner/launcher.py`: spawn, wait until ready, join the group, stop
# with no process left behind); `torchrun` can start the same ranks on several machines. The
# engine's process is rank 0: it schedules, builds the step's batch — token ids, positions, slots,
# block tables — and broadcasts it **once per step**; then every rank runs the same forward pass
# over its own heads and its own K/V pool, meeting the others in the all-reduces, and rank 0 gathers
# the logits and samples. A rank other than 0 is this loop:

# %%
show(serve_rank)

# %% [markdown]
# Gloo carries the collectives between CPU processes, NCCL between GPUs; the code is the same.
#
# ## Measure: what the ranks send each other
#
# Every all-reduce carries one $[T, d]$ tensor, $T$ the step's tokens; the gather carries each
# sampling row's share of the vocabulary. So a decode step of $B$ sequences costs
# $2L + 2$ collectives and
#
# $$
# (2L + 1)\, B\, d \cdot 4 \;+\; B \left\lceil V / W \right\rceil \cdot 4
# $$
#
# bytes in float32, whatever the context. `model/parallel.py` counts every collective in `COMM`.
# A decode engine at TP 2 — the same 32 requests as above — one step, against the formula:

# %%
tp_engine = decode_engine(target, "numba", num_seqs=BATCH_HERE, tensor_parallel_size=2)
batch = len(tp_engine.scheduler.running)
COMM.reset()
tp_engine.step()
calls = 2 * config.n_layers + 2
sent = (2 * config.n_layers + 1) * batch * config.d_model * 4
sent += batch * Shard(0, 2).vocab_rows(config)[2] * 4
print(f"a decode step of {batch}: {COMM.calls} collectives (2 x {config.n_layers} layers + 2)")
print(f"bytes: {COMM.bytes:,} measured, {sent:,} from the formula: same {COMM.bytes == sent}")
assert (COMM.calls, COMM.bytes) == (calls, sent)

# %% [markdown]
# The time it takes — gloo over the loopback interface, inside one machine — is what a CPU pays;
# rank 0's time in the collectives includes waiting for the slower rank:

# %%
# NBVAL_IGNORE_OUTPUT
COMM.reset()
broadcast_before, started = tp_engine.parallel.broadcast_s, time.perf_counter()
for _ in range(10):
    tp_engine.step()
wall = time.perf_counter() - started
broadcast = tp_engine.parallel.broadcast_s - broadcast_before
print(f"10 decode steps of {batch} at TP 2: {1e3 * wall / 10:.1f} ms a step")
print(
    f"in all-reduces and the gather: {1e3 * COMM.seconds / 10:.1f} ms a step "
    f"({COMM.seconds / wall:.0%}), {COMM.bytes / 10 / 2**10:.0f} KiB; "
    f"the batch's broadcast: {1e3 * broadcast / 10:.2f} ms a step"
)

# %% [markdown]
# On two CPU cores the collectives are a large share of the step: each all-reduce is a few
# microseconds of data but a round trip between processes, $2L + 2$ times a step, and a rank that
# arrives first waits for the other. On GPUs the same bytes cross NVLink (an H100's: 450 GB/s each
# way). Llama 3 8B in bfloat16, the decode batch of the first table, at TP 8 — what a rank sends,
# against what it reads from its own memory in the same step:

# %%
NVLINK = 450e9  # bytes/s each way, an H100 SXM's NVLink (NVIDIA's datasheet: 900 GB/s both ways)
c8, world = real["Llama-3-8B"], 8
reduced = (2 * c8.n_layers + 1) * BATCH * c8.d_model * 2  # the step's all-reduced tensors
sends = reduced * 2 * (world - 1) / world  # a ring all-reduce: 2(W-1)/W of the tensor per rank
reads = rank_weight_bytes("Llama-3-8B", world) + BATCH * CONTEXT * kv_per_token(c8) / world
print(
    f"each rank sends {sends / 2**20:.0f} MiB a step ({1e3 * sends / NVLINK:.2f} ms on NVLink) "
    f"and reads {reads / 2**30:.1f} GiB ({1e3 * reads / H100['bandwidth']:.2f} ms)"
)
print(f"communication: {sends / NVLINK / (reads / H100['bandwidth']):.0%} of the memory time")

# %% [markdown]
# Tens of megabytes sent against gigabytes read: on NVLink the all-reduces cost a small share of a
# step whose weights and cache each rank reads an eighth of. That is why tensor parallelism is the
# default inside a GPU server — and why, between servers, where the links are an order of magnitude
# slower, engines switch to pipeline parallelism (layers, not heads, per machine).

# %% [markdown]
# ## Check: the same tokens at TP 1 and TP 2
#
# The tokens the TP 2 engine has generated so far, against one process's for the same requests:

# %%
same, compared = same_tokens(one_process, generated(tp_engine))
tp_engine.close()
print(f"{same} of {len(one_process)} sequences: TP 2's greedy tokens are one process's")
print(f"({compared} generated tokens compared)")
assert same == len(one_process)

# %% [markdown]
# The row-parallel layers add their partial sums in another order than one matmul does, so a logit
# can move in its last bits; `tests/test_tensor_parallel.py` holds the logits of TP 2 (and TP 4)
# within $10^{-4}$ of one process's, on every model family and every CPU attention backend, and
# whole engines' greedy and seeded tokens identical.
#
# ## Which multi-process mechanism the engine keeps
#
# Two ways to use a second process, now side by side, on the shipped target model and on a
# real-shaped 100 M-parameter Qwen3 (`benchmarks/tensor_parallel.py`, alternating runs, medians;
# recorded, not run here):

# %%
for shape in ("tensor_parallel.json", "tensor_parallel_100m.json"):
    bench = json.loads((RESULTS / shape).read_text())
    loads = sorted({r["load_before"] for s in bench["systems"] for r in s["runs"]})
    print(
        f"{bench['model']}, {bench['workload']['requests']} requests, "
        f"{bench['workload']['output_tokens']} tokens ({bench['machine']['cpu_model']}, "
        f"{bench['machine']['cpus']} CPUs, load {loads[0].split()[0]} to {loads[-1].split()[0]})"
    )
    base = bench["systems"][0]["tokens_per_s"]
    for s in bench["systems"]:
        print(
            f"  {s['system']:<36}{s['tokens_per_s']:8.1f} tokens/s {s['tokens_per_s'] / base:5.2f}x"
            f"  comm {s['comm_share']:4.0%}  CPU {s['cpu_seconds']:5.1f} s  "
            f"same tokens: {s['same_tokens_as_one_process']}"
        )
    rate = {s["system"].split(" (")[0]: s["tokens_per_s"] for s in bench["systems"]}
    for name in ("tensor parallel 2", "forward workers 2"):
        print(f"  {name} against one process on 2 threads: {speed_change(rate[name] / base)}")

# %% [markdown]
# Read it as the recording says: one 2-core machine, its load printed beside each model, every
# system giving the same greedy tokens; the last two lines of each model say which way each
# mechanism went against one process on torch's two threads. The costs behind them do not depend
# on the machine. Tensor parallelism pays two all-reduces a layer (its `comm` share): on the small
# target model, whose matmuls are tiny, that latency is most of a step; on the real-shaped model
# the matmuls are large enough to hide much of it, and each rank reads only half of the weights.
# The split by sequence pays one exchange a step, the logits, but every forward worker reads every
# weight, so it cannot shrink what a process must hold.
#
# Neither has to win here: on two cores, one process on torch's two threads is a strong
# baseline, and a gloo round trip a step (the split by sequence) or two all-reduces a layer
# (tensor parallelism) is a real cost against a step of a few milliseconds. The engine keeps both
# splits on one mechanism — the same launcher and the same kind of gloo group carry both, each
# step one broadcast from rank 0 — for different jobs. `forward_processes` is the cheaper exchange
# for a model that fits one process, worth measuring against one process on the machine at hand
# (it cannot shrink what a process must hold); `tensor_parallel_size` is the way past one
# device's memory and past one machine — the one that carries over to GPUs and to vLLM. They are
# not combined (`EngineConfig` refuses both at once).
#
# ## A third way: replicas that never meet
#
# Both mechanisms meet inside every step, and both pay for it: a gloo round trip, or two
# all-reduces a layer, and each process the fixed cost of a whole pass. Where the model fits every
# process's memory, as the target model does many times over, there is a way that never meets:
# **data parallelism**. Each process runs a whole engine — its own scheduler, block manager, K/V
# pool and steps, on one core — and the requests are shared out between them. Nothing crosses
# between the replicas but requests going in and outputs coming back. A request is no faster —
# its step is one replica's, on fewer threads — but the machine can do up to twice the work: each
# core steps a full batch of its own, and most of a step's cost does not shrink with its batch.
# It is vLLM's `data_parallel_size`, and what a fleet of servers does with machines.
#
# `EngineConfig(data_parallel_size=2)` (or `LLM(..., data_parallel_size=2)`) builds a
# `DataParallelEngine`: replica 0 in this process, the others spawned by the same launcher as the
# ranks above, each on its share of torch's threads. A request goes to the replica with the least
# work outstanding — prompt and output tokens still to compute — and keeps its request id, from
# which its seed comes, so where it runs does not change its tokens:

# %%
show(DataParallelEngine.add_request)

# %% [markdown]
# A step runs one step of replica 0 and gathers what the others sent meanwhile; with nothing for
# replica 0 to do, it waits for theirs. Two replicas of one thread against one engine on two
# threads, the same 64 requests, each warmed up first:

# %%
# NBVAL_IGNORE_OUTPUT
text = shipped_validation_text()
replica_prompts = [text[4000 + 97 * i : 4000 + 97 * i + 60] for i in range(64)]
replica_params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
one_engine = LLMEngine(target, EngineConfig(device="cpu"))
replicas = DataParallelEngine(target, EngineConfig(device="cpu", data_parallel_size=2))
by_system = {}
for name, engine in (
    ("one engine, 2 threads", one_engine),
    ("2 replicas, 1 thread each", replicas),
):
    engine.generate(replica_prompts[:8], SamplingParams(max_tokens=4))  # warm-up
    started = time.perf_counter()
    outputs = engine.generate(replica_prompts, replica_params)
    seconds = time.perf_counter() - started
    by_system[name] = (outputs, sum(len(o.token_ids) for o in outputs) / seconds)
    print(f"{name:>26}: {by_system[name][1]:7.0f} tokens/s")
(single, one_rate), (shared, two_rate) = by_system.values()
print(f"two replicas: {speed_change(two_rate / one_rate, than='one engine')}")

# %% [markdown]
# The check: every request's greedy tokens, from one engine and from two replicas.

# %%
same = sum(a.token_ids == b.token_ids for a, b in zip(single, shared))
print(f"{same} of {len(single)} requests: identical greedy tokens from one engine and two replicas")
assert same == len(single)
replicas.close()

# %% [markdown]
# Why it wins where the split by sequence did not: each replica's step carries a batch of its
# own, so the cost that does not shrink with the batch — measured above — is paid once per batch
# of work, not twice per batch; and no step waits for another process. What it costs is memory:
# each replica holds its own copy of the weights and its own K/V pool, so $N$ replicas hold $N$
# times one engine's bytes — the opposite of tensor parallelism, and no help for a model that does
# not fit. `benchmarks/vllm_peer.py --data-parallel 1 2` runs the whole 256-request workload both
# ways, beside vLLM's CPU build as it ships and run as replicas too (`compiled-dp2`: two
# `vllm.LLM` of one thread each, the requests split by the same rule, as vLLM's offline
# data-parallel example runs them; `-1proc`: each with its engine core inside its own process, one
# process per replica as here). Two recordings, each alternating its systems round by round:

# %%
for recording in ("vllm_peer.json", "vllm_peer_data_parallel.json"):
    if not (RESULTS / recording).exists():
        continue
    peer = json.loads((RESULTS / recording).read_text())
    rates = {key: r["tokens_per_second_median"] for key, r in peer["results"].items()}
    print(
        f"{recording}: {peer['machine']['cpu_model']}, {peer['machine']['cpus']} CPUs; median of "
        f"{peer['config']['repeats']} runs, load average {peer['load_average']['start']} at the "
        "start"
    )
    for key, rate in rates.items():
        print(f"  {peer['results'][key]['system']:<56} {rate:7.0f} tokens/s")
    mine = "minivllm/numba/dp2"  # recorded with --data-parallel 2
    for theirs in [key for key in rates if key.startswith("vllm/") and mine in rates]:
        ratio = rates[mine] / rates[theirs]
        print(f"  minivllm's 2 replicas against {theirs}: {speed_change(ratio, than='vLLM')}")

# %% [markdown]
# Read the two together. The first says what replicas buy each engine against its own single
# process, on this machine; the second is the like-for-like comparison, replicas against
# replicas, one process each. What is left between those two is each engine's work per core —
# the step that chapter 07's roofline measures, which no way of adding processes changes.

# %% [markdown]
# ## The hand-off: the same folder, served by vLLM
#
# Everything this engine loads is a Hugging Face folder, and so is what vLLM loads.
# `benchmarks/vllm_peer.py` served the book's `target` folder with vLLM's CPU build and with
# minivllm, the same seeded workload, greedy, and compared every request's tokens. The recording
# committed with the book:

# %%
peer = json.loads((RESULTS / "vllm_peer.json").read_text())
work = peer["workload"]
print(
    f"vLLM {peer['machine']['vllm']} (torch {peer['machine']['vllm_torch']}) against minivllm at "
    f"commit {peer['machine']['source']['commit'][:10]}, on {work['model']}"
)
print(
    f"{work['requests']} requests, {work['prompt_tokens_total']:,} prompt tokens, "
    f"{work['output_tokens_total']:,} generated, {work['sampling']}"
)
for pair, agreement in peer["greedy_agreement"].items():
    if "requests" in agreement and pair.startswith("minivllm"):
        print(f"  {pair}: {agreement['identical']} of {agreement['requests']} requests identical")

# %% [markdown]
# Token for token. What you would run next, on a machine with GPUs (vLLM's own documentation has
# the details; the flags are vLLM's):
#
# ```bash
# # one server, N GPUs: every layer split N ways, as in this chapter (NCCL instead of gloo)
# vllm serve DIR --tensor-parallel-size N
#
# # two servers of 8 GPUs: tensor parallel inside a server, pipeline parallel between them,
# # on a Ray cluster (`ray start --head` on one, `ray start --address HEAD:6379` on the other)
# vllm serve DIR --tensor-parallel-size 8 --pipeline-parallel-size 2
#
# # minivllm's own ranks across two machines: torchrun on each, the same command
# torchrun --nnodes 2 --node-rank R --nproc-per-node 8 --master-addr HEAD --master-port 29500 \
#     -m minivllm.cli serve --model DIR --tensor-parallel-size 16
# ```
#
# The client does not change: chapter 09's OpenAI-compatible endpoints are vLLM's. What vLLM adds
# beyond this book:
#
# | | this book | vLLM |
# |---|---|---|
# | splitting the model | tensor parallel (heads, MLP units, vocabulary) | tensor, pipeline, data and expert parallel (MoE), their combinations |
# | collectives | `torch.distributed` all-reduce, pickled batch broadcast | custom all-reduce kernels over NVLink, NCCL, shared-memory broadcast of the batch |
# | launch | spawned ranks, or `torchrun` | multiprocessing, Ray across nodes |
# | kernels | torch ops, a numba CPU kernel, numba-cuda kernels | FlashAttention, FlashInfer, fused MoE, Triton and CUTLASS kernels |
# | the step | eager, or `torch.compile` on a CPU; CUDA graphs for decode | `torch.compile` plus CUDA graphs, piecewise |
# | memory | the K/V cache in the model's dtype | FP8 K/V cache, quantized weights (FP8, AWQ, GPTQ, ...), K/V offload |
# | scheduling | continuous batching, chunked prefill, prefix cache, speculative decoding | the same, plus disaggregated prefill, EAGLE drafts, structured output, LoRA adapters |
# | models | four Llama-like families | hundreds of architectures, multimodal inputs |
#
# Every row is the same idea as the book's, with years of engineering on top; the files named at
# the end of each chapter are where to start reading.
#
# ## Exercises
#
# The solutions live between `### BEGIN SOLUTION` and `### END SOLUTION` in
# `src/minivllm/model/parallel.py`; run an exercise's tests with `pytest tests --exercise ch11.1`
# (or `ch11.2`).
#
# 1. **ch11.1 — the row-parallel all-reduce** (this chapter's core). Write
#    `RowParallelLinear.forward`: this rank's partial product of its columns of the weight and its
#    share of the input, summed over the ranks with `all_reduce` (the package's, which counts what
#    it sends), then the bias. The test runs two gloo ranks, each holding half the columns of a
#    layer, and checks that both end with the whole layer's output, the bias added once, after
#    exactly one all-reduce; the whole model at TP 2 (`tests/test_tensor_parallel.py`) rests on it.
#    Three hints, from a nudge to nearly the answer, are folded below the list.
# 2. *(Explore, no test.)* Each step rank 0 pickles the batch (`Messages.broadcast` in
#    `runner/launcher.py`: two broadcasts, the size and the bytes). `benchmarks/tensor_parallel.py`
#    measures what packing every integer field into one int64 tensor would save (`message_costs`).
#    Make `TensorParallelGroup.forward` send that tensor, and measure the broadcast's share again.
#
#    *Hint:* The receiver must know how much to receive: send a fixed-size header of lengths
#    first (one small broadcast), then the tensor. `pack_int64` in the benchmark is the sender.
# 3. **ch11.2 — the rank layout.** Write `Shard.query_heads` and `Shard.kv_heads`, the
#    `(first, count)` of the heads rank `rank` of `world` holds. Query heads split into equal,
#    contiguous shares, in rank order. K/V heads do too while there are at least as many as ranks;
#    with fewer, a rank holds the one K/V head its query heads read, so each is replicated on
#    $W$ / `n_kv_heads` ranks. Heads that cannot be laid out so — query heads that do not divide
#    by $W$, K/V heads that are neither a multiple of $W$ nor a divisor of it — raise a
#    `ValueError` naming the ranks. The tests lay out 8 query heads and 2 K/V heads at TP 1, 2, 4
#    and 8 rank by rank, check on other shapes (Llama 3 8B's at TP 16, one K/V head for all) that
#    every rank holds exactly the K/V heads its queries read, and that every rank's slices of the
#    tiny checkpoints tile each tensor. Then, with your layout: how many bytes of K/V per token
#    does the whole group hold at TP 16 for Llama 3 8B, against TP 8?
#
#    *Hint:* Query head $h$ reads K/V head $h$ // (`n_heads` / `n_kv_heads`). With fewer K/V heads
#    than ranks, find the K/V head of the rank's first query head — or, the same number, scale the
#    rank by `n_kv_heads` / $W$, multiplying before dividing so it stays an integer.
# 4. *(Explore, no test.)* Megatron's sequence parallelism replaces each all-reduce by a
#    reduce-scatter (each rank gets $T/W$ rows of the sum) and an all-gather before the next
#    column-parallel layer, so the norms run on $T/W$ rows only. Count the bytes per rank of both
#    schemes for a ring, and say which work it saves. Then reduce the vocabulary gather: rank 0
#    needs only the argmax for greedy requests. What could each rank send instead of its logits,
#    and what breaks for sampled requests?
#
#    *Hint:* A ring all-reduce *is* a reduce-scatter followed by an all-gather: $2(W-1)/W$ of the
#    tensor per rank either way. For the gather: each rank's best id and its logit, two numbers
#    per row; a temperature needs the whole distribution's normaliser.
# 5. *(Explore, no test.)* After each pass, `engine.runner.workers.part_seconds` holds each
#    forward worker's time for its part. Step a `decode_engine(target, "numba",
#    forward_processes=2)` and collect them: are the parts even? Then add four requests with
#    300-token prompts to it, so that prefill chunks join the decodes, and collect them again. The
#    cut weighs a token's matmuls as `engine.runner.workers.per_token` keys: which value evens the
#    parts of the mixed steps on your machine, and what does it say about how fast the attention
#    kernel does a multiply-add compared with a matmul?
#
#    *Hint:* Compare the medians of the first part's time over the second's, per kind of step. A
#    chunk is never cut, so a step with one long chunk cannot be even whatever the weight: look at
#    steps with several.

# %% [markdown]
# The hints for ch11.1, the chapter's core, are folded: open one at a time.
#
# :::{admonition} Hint 1 for ch11.1 — a nudge
# :class: dropdown
# A row-parallel layer's input is already this rank's share (its heads, its hidden units), and
# its weight is the matching columns. Multiply them as any linear layer does, without the bias:
# the result has the full output width, but it is only one rank's part of the sum.
# :::
#
# :::{admonition} Hint 2 for ch11.1 — the approach
# :class: dropdown
# `F.linear(x, self.weight)` gives the partial product. `all_reduce` (in the same module, not
# `dist.all_reduce` directly: it counts calls and bytes) sums it over the ranks in place and
# returns it. Only then add `self.bias`, when there is one.
# :::
#
# :::{admonition} Hint 3 for ch11.1 — nearly there
# :class: dropdown
# Pass the partial product, `F.linear` of `x` with `self.weight` and no bias, to `all_reduce`; the
# sum it returns is the layer's output, plus `self.bias` when there is one. Adding the bias inside
# `F.linear` would add it on every rank before the sum: $W$ times.
# :::

# %% [markdown]
# ## Summary
#
# A decode step is bound by the bytes it reads — weights and K/V — and a real model's bytes
# outgrow one device. Splitting the batch between processes, as the engine's forward workers do,
# keeps every weight in every process and every block in one machine's shared memory, so it ends
# at one machine. Tensor parallelism cuts each layer instead: q, k, v, gate and up by columns,
# o_proj and down_proj by rows, each of those followed by an all-reduce — two a layer, because
# everything between them works on whole rows that every rank holds. Each rank keeps its own heads'
# K/V in blocks that are the same on every rank, one scheduler and one sampler on rank 0, one
# broadcast of the batch a step; the greedy tokens are one process's. The number that says why it
# matters is the table at the top: at TP $W$ a rank holds $1/W$ of the weights and of each token's
# K/V, so a model that does not fit one device fits $W$, and the tokens each can cache grow faster
# than $W$ — until the K/V heads run out. Where the model fits every core's memory and the goal
# is throughput, whole replicas that share out the requests and never meet do better still on a
# small machine: each step carries a full batch of its own, and none waits for another process.
#
# **The same ideas in vLLM.** `vllm/model_executor/layers/linear.py` (`QKVParallelLinear`,
# `MergedColumnParallelLinear`, `RowParallelLinear`),
# `vllm/model_executor/layers/vocab_parallel_embedding.py`, the collectives in
# `vllm/distributed/parallel_state.py` and `vllm/distributed/communication_op.py`, the workers in
# `vllm/v1/executor/multiproc_executor.py` (one process per rank, the scheduler's output broadcast
# through shared memory).
