"""Decode paged attention as CUDA kernels, written with numba-cuda (chapter 07).

One thread block per (sequence, query head) reads that sequence's keys and values through its block
table (the cache layout of chapter 03: `[num_blocks, block_size, n_kv_heads, head_dim]` per layer), with
grouped-query attention (query head h reads K/V head h // group):

* `paged_attention_v1`: a block attends over the whole context. Warps take one token at a time and
  split head_dim between their lanes (coalesced reads of a key row); a warp shuffle adds the pieces.
  Scores sit in shared memory; the max and the sum are block reductions (shuffles, then shared memory).
  Then the threads split head_dim again and walk the tokens for the values.
* `paged_attention_v2` + `merge_partitions` (vLLM's v2, flash-decoding): the context is cut into
  partitions, each a thread block of its own with its own max and sum; a second kernel merges them by
  their log-sum-exp weights. With few sequences and long contexts, v1 has too few blocks to fill a GPU.

The same source runs natively on an NVIDIA GPU (on torch tensors, no copies: numba reads them through
`__cuda_array_interface__`) or on a CPU under numba's CUDA simulator, which this module switches on
(NUMBA_ENABLE_CUDASIM=1, before numba is imported) when torch sees no GPU. The simulator runs every
CUDA thread as a Python thread: slow, but it executes the very same kernel code. It lacks warp
shuffles, so `_install_simulator_shuffle` adds `shfl_xor_sync` to it with a block barrier -- which
needs every thread of a block to call it together, as these kernels do.
"""

from __future__ import annotations

import math
import os
import sys
import threading
from contextlib import contextmanager

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

from numba import config as numba_config, cuda, float32  # noqa: E402  (the variable must be set first)

from .varlen_attention import TorchPagedAttention  # noqa: E402

# What numba itself decided when numba.cuda was first imported, not what the environment says now.
SIMULATOR = bool(numba_config.ENABLE_CUDASIM)
if not SIMULATOR and not cuda.is_available():
    raise ImportError("numba sees no CUDA GPU and its simulator is off: numba was imported before "
                      "minivllm.cuda_paged_attention could set NUMBA_ENABLE_CUDASIM=1. Set that variable in "
                      "the environment, or import this module before anything else imports numba")
WARP_SIZE = 32
FULL_MASK = 0xFFFFFFFF


def _install_simulator_shuffle() -> None:
    """Give the simulator `cuda.shfl_xor_sync`: every thread posts its value, the block meets at a
    barrier, and each reads its partner's (lane ^ lane_mask, in its own warp). Consecutive shuffles
    alternate between two exchange tables, so a thread that races ahead to the next shuffle cannot
    overwrite a value still to be read: one barrier per shuffle. So the whole *block* must call it
    together (the real instruction needs only the warp); these kernels always do."""
    from numba.cuda.simulator.kernelapi import FakeCUDAModule

    def shfl_xor_sync(self, mask, value, lane_mask):
        thread = threading.current_thread()
        calls = getattr(thread, "_shuffles", 0)
        thread._shuffles = calls + 1
        exchange = thread._manager.__dict__.setdefault("_shuffle_exchange", ({}, {}))[calls % 2]
        tid = thread.threadIdx.x
        exchange[tid] = value
        thread.syncthreads()
        return exchange[tid - tid % WARP_SIZE + (tid % WARP_SIZE ^ lane_mask)]

    FakeCUDAModule.shfl_xor_sync = shfl_xor_sync


if SIMULATOR:
    _install_simulator_shuffle()


@cuda.jit(device=True)
def combine(a, b, take_max):
    return max(a, b) if take_max else a + b


@cuda.jit(device=True)
def warp_reduce(value, take_max):
    """The sum (or max) over the 32 lanes of a warp, by butterfly shuffles: every lane ends with it."""
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
    """Where token `position` of a sequence lives: (physical block, offset in it), via its block table."""
    # EXERCISE ch07.1: the block-table address -- the physical block holding `position`, and the offset in it
    ### BEGIN SOLUTION
    return table[position // block_size], position % block_size
    ### END SOLUTION


@cuda.jit(device=True)
def attend_range(out_row, q_row, key_cache, value_cache, table, kv_head, start, end, scale, shared):
    """Attention of one query row over tokens start..end-1 of one sequence, read through its block
    table. Writes the softmax-weighted sum of values, normalised, to out_row; returns (max, sum of exp)."""
    tid, threads = cuda.threadIdx.x, cuda.blockDim.x
    warp, lane, num_warps = tid // WARP_SIZE, tid % WARP_SIZE, threads // WARP_SIZE
    dim, block_size = q_row.shape[0], key_cache.shape[1]
    q_s = shared[:dim]
    scratch = shared[dim:dim + num_warps]
    scores = shared[dim + num_warps:]
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
    attend_range(out[seq, head], q[seq, head], key_cache, value_cache, block_tables[seq], head // group,
                 0, context_lens[seq], scale, shared)


@cuda.jit
def paged_attention_v2(partial_out, max_logits, exp_sums, q, key_cache, value_cache, block_tables, context_lens,
                       scale, group, partition_size):
    """Grid (sequences, heads, partitions): each block attends over one slice of the context and keeps
    its own max and sum, for `merge_partitions` to combine."""
    seq, head, part = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
    start = part * partition_size
    end = min(start + partition_size, context_lens[seq])
    shared = cuda.shared.array(0, dtype=float32)
    if start >= end:  # the context is shorter than this partition: nothing to add
        if cuda.threadIdx.x == 0:
            max_logits[seq, head, part] = -math.inf
            exp_sums[seq, head, part] = 0.0
        return
    m, total = attend_range(partial_out[seq, head, part], q[seq, head], key_cache, value_cache, block_tables[seq],
                            head // group, start, end, scale, shared)
    if cuda.threadIdx.x == 0:
        max_logits[seq, head, part] = m
        exp_sums[seq, head, part] = total


@cuda.jit
def merge_partitions(out, partial_out, max_logits, exp_sums):
    """Grid (sequences, heads): combine the partitions' normalised outputs by log-sum-exp weights."""
    seq, head = cuda.blockIdx.x, cuda.blockIdx.y
    parts = max_logits.shape[2]
    m = -math.inf
    for p in range(parts):
        m = max(m, max_logits[seq, head, p])
    for d in range(cuda.threadIdx.x, out.shape[2], cuda.blockDim.x):
        # EXERCISE ch07.2: the log-sum-exp merge -- weight partition p by exp_sum_p * exp(max_p - m), normalise
        ### BEGIN SOLUTION
        # Partition p's output was normalised by its own sum l_p of exp(score - m_p). On the common scale
        # exp(score - m) its weight is l_p * exp(m_p - m); an empty partition (l_p = 0) weighs nothing.
        acc, weight_total = float32(0.0), float32(0.0)
        for p in range(parts):
            if exp_sums[seq, head, p] > 0:
                w = exp_sums[seq, head, p] * math.exp(max_logits[seq, head, p] - m)
                acc += w * partial_out[seq, head, p, d]
                weight_total += w
        out[seq, head, d] = acc / weight_total
        ### END SOLUTION


@contextmanager
def _simulator_pace():
    """The simulator's block manager polls its threads, holding the GIL, to see who waits at a barrier;
    handing the GIL on every 0.5 ms instead of Python's default 5 ms makes a simulated launch about 3x
    faster. Nothing changes on a GPU."""
    interval = sys.getswitchinterval()
    if SIMULATOR:
        sys.setswitchinterval(5e-4)
    try:
        yield
    finally:
        sys.setswitchinterval(interval)


# -- launchers ------------------------------------------------------------------------------------------
DEFAULT_THREADS = 128  # 4 warps per block


def shared_bytes(head_dim: int, threads: int, tokens: int) -> int:
    """Dynamic shared memory one thread block needs (float32): the scaled query, one reduction slot per
    warp, and a score for each of the `tokens` it attends to."""
    return (head_dim + threads // WARP_SIZE + tokens) * 4


def _kernel_arg(tensor: torch.Tensor):
    """What a kernel takes: the CUDA tensor itself (numba reads it in place, no copy), or on the
    simulator the CPU tensor's numpy view (the simulator copies it in and back out, as it emulates
    device memory)."""
    if not tensor.is_contiguous():
        raise ValueError(f"kernel arguments must be contiguous, got strides {tensor.stride()}")
    return tensor if tensor.is_cuda else tensor.numpy()


def _check(q, key_cache, value_cache, block_tables, context_lens, threads) -> int:
    num_seqs, num_heads, head_dim = q.shape
    if key_cache.shape != value_cache.shape or key_cache.dim() != 4 or key_cache.shape[3] != head_dim:
        raise ValueError(f"caches must both be [num_blocks, block_size, n_kv_heads, {head_dim}], got "
                         f"{tuple(key_cache.shape)} and {tuple(value_cache.shape)}")
    if num_heads % key_cache.shape[2]:
        raise ValueError(f"{num_heads} query heads cannot share {key_cache.shape[2]} K/V heads evenly")
    if block_tables.shape[0] != num_seqs or context_lens.shape != (num_seqs,):
        raise ValueError(f"block_tables [{num_seqs}, max_blocks] and context_lens [{num_seqs}] expected, got "
                         f"{tuple(block_tables.shape)} and {tuple(context_lens.shape)}")
    if int(context_lens.min()) < 1 or int(context_lens.max()) > block_tables.shape[1] * key_cache.shape[1]:
        raise ValueError(f"context lengths must be in 1..{block_tables.shape[1] * key_cache.shape[1]} "
                         f"(the block tables' capacity), got {context_lens.tolist()}")
    if threads % WARP_SIZE or threads < WARP_SIZE:
        raise ValueError(f"threads per block must be a multiple of {WARP_SIZE}, got {threads}")
    return num_heads // key_cache.shape[2]


def paged_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float | None = None,
                    partition_size: int | None = None, threads: int = DEFAULT_THREADS,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """One query per sequence, `q` `[num_seqs, num_heads, head_dim]`, against its cached keys and values:
    `key_cache`, `value_cache` `[num_blocks, block_size, n_kv_heads, head_dim]`, `block_tables`
    `[num_seqs, max_blocks]` and `context_lens` `[num_seqs]` (int32). `partition_size=None` runs v1; a
    number of tokens runs v2 with that partition size, then the merge. Returns `[num_seqs, num_heads, head_dim]`."""
    group = _check(q, key_cache, value_cache, block_tables, context_lens, threads)
    num_seqs, num_heads, head_dim = q.shape
    scale = head_dim ** -0.5 if scale is None else scale
    out = torch.empty_like(q) if out is None else out
    tables, lens = block_tables.to(torch.int32).contiguous(), context_lens.to(torch.int32).contiguous()
    longest = int(context_lens.max())
    args = [_kernel_arg(t) for t in (q, key_cache, value_cache, tables, lens)]
    if partition_size is None:
        shared = shared_bytes(head_dim, threads, longest)
        with _simulator_pace():
            paged_attention_v1[(num_seqs, num_heads), threads, 0, shared](_kernel_arg(out), *args, scale, group)
        return out
    parts = -(-longest // partition_size)
    partial = torch.empty(num_seqs, num_heads, parts, head_dim, dtype=torch.float32, device=q.device)
    max_logits = torch.empty(num_seqs, num_heads, parts, dtype=torch.float32, device=q.device)
    exp_sums = torch.empty_like(max_logits)
    shared = shared_bytes(head_dim, threads, partition_size)
    with _simulator_pace():
        paged_attention_v2[(num_seqs, num_heads, parts), threads, 0, shared](
            _kernel_arg(partial), _kernel_arg(max_logits), _kernel_arg(exp_sums), *args, scale, group, partition_size)
        merge_partitions[(num_seqs, num_heads), min(threads, 128)](
            _kernel_arg(out), _kernel_arg(partial), _kernel_arg(max_logits), _kernel_arg(exp_sums))
    return out


class CudaPagedAttention(TorchPagedAttention):
    """The engine's attention backend with its decodes on the kernel above (v1). Writing the new K/V and
    attending prefill chunks stay the torch reference's: the kernel is a decode kernel, one query per
    sequence. `EngineConfig(attention_backend="cuda")` picks it; on a CPU it runs in the simulator,
    which is only fast enough for small checks."""

    def _attend_decodes(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        kv, nd = self.storage.kv[layer], self.batch.num_decodes
        return paged_attention(q.contiguous(), kv[0], kv[1], self.batch.block_tables[:nd].to(torch.int32),
                               self.batch.context_lens[:nd].to(torch.int32), threads=_ENGINE_THREADS)


# One warp per block in the simulator (each CUDA thread is a Python thread there); four on a GPU.
_ENGINE_THREADS = WARP_SIZE if SIMULATOR else DEFAULT_THREADS
