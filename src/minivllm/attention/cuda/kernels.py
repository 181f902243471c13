"""Decode paged attention as CUDA kernels, written with numba-cuda (chapter 08).

One thread block per (sequence, query head) reads that sequence's keys and values through its block
table (the cache layout of chapter 03: `[num_blocks, block_size, n_kv_heads, head_dim]` per layer),
with grouped-query attention (query head h reads K/V head h // group):

* `paged_attention_v1`: a block attends over the whole context. Warps take one token at a time and
  split head_dim between their lanes (coalesced reads of a key row); a warp shuffle adds the pieces.
  Scores sit in shared memory; the max and the sum are block reductions (shuffles, then shared
  memory). Then the threads split head_dim again and walk the tokens for the values.
* `paged_attention_v2` + `merge_partitions` (vLLM's v2, flash-decoding): the context is cut into
  partitions, each a thread block of its own with its own max and sum; a second kernel merges them
  by their log-sum-exp weights. With few sequences and long contexts, v1 has too few blocks to fill
  a GPU.

The same source runs natively on an NVIDIA GPU (on torch tensors, no copies: numba reads them
through `__cuda_array_interface__`) or on a CPU under numba's CUDA simulator, which `simulator.py`
switches on (NUMBA_ENABLE_CUDASIM=1, before numba is imported) when torch sees no GPU. The simulator
runs every CUDA thread as a Python thread: slow, but it executes the very same kernel code. It lacks
warp shuffles, so `simulator.py` adds `shfl_xor_sync` to it with a block barrier -- which needs
every thread of a block to call it together, as these kernels do. The launcher is `launch.py`.

These two are the first versions, kept for the chapter's story; the engine runs v3 (`grouped.py`:
one block per sequence and K/V head for the whole query group, one pass with an online softmax).
"""

from __future__ import annotations

import math

from numba import cuda, float32

from minivllm.attention.cuda.simulator import WARP_SIZE

FULL_MASK = 0xFFFFFFFF


@cuda.jit(device=True)
def combine(a, b, take_max):
    return max(a, b) if take_max else a + b


@cuda.jit(device=True)
def warp_reduce(value, take_max):
    """The sum (or max) over the 32 lanes of a warp, by butterfly shuffles: every lane ends with
    it."""
    offset = WARP_SIZE // 2
    while offset > 0:
        value = combine(value, cuda.shfl_xor_sync(FULL_MASK, value, offset), take_max)
        offset //= 2
    return value


@cuda.jit(device=True)
def block_reduce(value, scratch, take_max):
    """The sum (or max) over every thread of the block: warps reduce with shuffles, then each thread
    combines the warps' results from shared memory."""
    value = warp_reduce(value, take_max)
    if cuda.threadIdx.x % WARP_SIZE == 0:
        scratch[cuda.threadIdx.x // WARP_SIZE] = value
    cuda.syncthreads()
    result = scratch[0]
    for w in range(1, cuda.blockDim.x // WARP_SIZE):
        result = combine(result, scratch[w], take_max)
    cuda.syncthreads()
    return result


@cuda.jit(device=True)
def cache_slot(table, position, block_size):
    """Where token `position` of a sequence lives: (physical block, offset in it), via its block
    table."""
    # EXERCISE ch08.1: the block-table address -- the block holding `position`, the offset in it
    ### BEGIN SOLUTION
    return table[position // block_size], position % block_size
    ### END SOLUTION


@cuda.jit(device=True)
def attend_range(out_row, q_row, key_cache, value_cache, table, kv_head, start, end, scale, shared):
    """Attention of one query row over tokens start..end-1 of one sequence, read through its block
    table. Writes the softmax-weighted sum of values, normalised, to out_row; returns (max, sum of
    exp)."""
    tid, threads = cuda.threadIdx.x, cuda.blockDim.x
    warp, lane, num_warps = tid // WARP_SIZE, tid % WARP_SIZE, threads // WARP_SIZE
    dim, block_size = q_row.shape[0], key_cache.shape[1]
    q_s = shared[:dim]
    scratch = shared[dim : dim + num_warps]
    scores = shared[dim + num_warps :]
    for d in range(tid, dim, threads):
        q_s[d] = float32(q_row[d]) * scale
    cuda.syncthreads()
    # Scores: each warp takes one token at a time; its lanes split head_dim (coalesced reads of the
    # key row) and a shuffle reduction adds the pieces. Every warp runs the same number of rounds so
    # the shuffles stay uniform; a warp past the end computes a dummy 0.
    length = end - start
    local_max = -math.inf
    for base in range(0, length, num_warps):
        t = base + warp
        partial = float32(0.0)
        if t < length:
            block, offset = cache_slot(table, start + t, block_size)
            for d in range(lane, dim, WARP_SIZE):
                partial += q_s[d] * float32(key_cache[block, offset, kv_head, d])
        dot = warp_reduce(partial, False)
        if t < length:
            if lane == 0:
                scores[t] = dot
            local_max = max(local_max, dot)
    cuda.syncthreads()
    m = block_reduce(local_max, scratch, True)
    local_sum = float32(0.0)
    for t in range(tid, length, threads):
        e = math.exp(scores[t] - m)
        scores[t] = e
        local_sum += e
    cuda.syncthreads()
    total = block_reduce(local_sum, scratch, False)
    # Values: threads split head_dim; each walks the tokens (coalesced reads of the value rows).
    for d in range(tid, dim, threads):
        acc = float32(0.0)
        for t in range(length):
            block, offset = cache_slot(table, start + t, block_size)
            acc += scores[t] * float32(value_cache[block, offset, kv_head, d])
        out_row[d] = acc / total if total > 0 else float32(0.0)
    return m, total


@cuda.jit
def paged_attention_v1(out, q, key_cache, value_cache, block_tables, context_lens, scale, group):
    """Grid (sequences, heads): one thread block per (sequence, head), over its whole context."""
    seq, head = cuda.blockIdx.x, cuda.blockIdx.y
    shared = cuda.shared.array(0, dtype=float32)
    attend_range(
        out[seq, head],
        q[seq, head],
        key_cache,
        value_cache,
        block_tables[seq],
        head // group,
        0,
        context_lens[seq],
        scale,
        shared,
    )


@cuda.jit
def paged_attention_v2(
    partial_out,
    max_logits,
    exp_sums,
    q,
    key_cache,
    value_cache,
    block_tables,
    context_lens,
    scale,
    group,
    partition_size,
):
    """Grid (sequences, heads, partitions): each block attends over one slice of the context and
    keeps its own max and sum, for `merge_partitions` to combine."""
    seq, head, part = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
    start = part * partition_size
    end = min(start + partition_size, context_lens[seq])
    shared = cuda.shared.array(0, dtype=float32)
    if start >= end:  # the context is shorter than this partition: nothing to add
        if cuda.threadIdx.x == 0:
            max_logits[seq, head, part] = -math.inf
            exp_sums[seq, head, part] = 0.0
        return
    m, total = attend_range(
        partial_out[seq, head, part],
        q[seq, head],
        key_cache,
        value_cache,
        block_tables[seq],
        head // group,
        start,
        end,
        scale,
        shared,
    )
    if cuda.threadIdx.x == 0:
        max_logits[seq, head, part] = m
        exp_sums[seq, head, part] = total


@cuda.jit
def merge_partitions(out, partial_out, max_logits, exp_sums):
    """Grid (sequences, heads): combine the partitions' normalised outputs by log-sum-exp
    weights."""
    seq, head = cuda.blockIdx.x, cuda.blockIdx.y
    parts = max_logits.shape[2]
    m = -math.inf
    for p in range(parts):
        m = max(m, max_logits[seq, head, p])
    for d in range(cuda.threadIdx.x, out.shape[2], cuda.blockDim.x):
        # EXERCISE ch08.2: log-sum-exp merge -- weight partition p by exp_sum_p * exp(max_p - m)
        ### BEGIN SOLUTION
        # Partition p's output was normalised by its own sum l_p of exp(score - m_p). On the common
        # scale exp(score - m) its weight is l_p * exp(m_p - m); an empty partition (l_p = 0)
        # weighs nothing.
        acc, weight_total = float32(0.0), float32(0.0)
        for p in range(parts):
            if exp_sums[seq, head, p] > 0:
                w = exp_sums[seq, head, p] * math.exp(max_logits[seq, head, p] - m)
                acc += w * partial_out[seq, head, p, d]
                weight_total += w
        out[seq, head, d] = acc / weight_total
        ### END SOLUTION
