"""Paged attention as a native CPU kernel, compiled by numba (chapter 07, first half; issue 16).

The torch reference (`torch_backend.py`) gathers every sequence's keys and values through its block
table into a padded copy, every layer, every step, and then attends over the copy. This kernel reads
them **in place**, block by block, through the block table, the way a GPU kernel does:

* one unit of parallel work per (sequence, K/V head): its whole query-head group rides along, so
  each cached K/V row is read once for the group (grouped-query attention), not once per query head;
* each query row attends its visible keys -- the cached prefix and, for a prefill chunk, its own
  chunk up to itself (causal) -- with an **online softmax** (running max and running sum, rescaled
  block by block, in float32; the idea of FlashAttention and of vLLM's paged-attention kernels);
* decodes (one query row) and prefill chunks (many) are the same loop, so a mixed step is one call.

`paged_attention_cpu` checks every argument before anything is computed and then calls the
compiled kernel; `NumbaPagedAttention` is the engine backend, registered as "numba".

Compilation happens once per machine: `cache=True` keeps the machine code next to this file, and
`warm_up()` compiles (or loads) it ahead of the first step. Threads: numba's parallel loop and
torch's matmuls never run at the same time, so each may use all the cores torch is allowed; the
layer is numba's **workqueue** (its threads sleep between kernels instead of spinning, so they do
not steal the cores from torch's threads the moment a kernel ends).
"""

from __future__ import annotations

import math
import os

import numba
import numpy as np
import torch
from numba import njit, prange

from minivllm.attention.batch import VarlenBatch
from minivllm.attention.storage import PagedKVStorage

# The workqueue layer's threads block between parallel regions (see the module docstring). Set in
# the environment as well, so a later `numba.config.reload_config()` keeps it.
os.environ.setdefault("NUMBA_THREADING_LAYER", "workqueue")
if numba.config.THREADING_LAYER == "default":
    numba.config.THREADING_LAYER = "workqueue"


# fastmath lets LLVM reorder the float32 sums of a dot product into SIMD lanes; the tests hold the
# result to 1e-5 of a float64 reference.
@njit(parallel=True, cache=True, fastmath={"reassoc", "contract", "nsz"})
def _paged_attention_kernel(
    out, q, key_cache, value_cache, block_tables, context_lens, query_start, scale
):
    num_seqs = context_lens.shape[0]
    num_heads, dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    for work in prange(num_seqs * num_kv_heads):
        seq = work // num_kv_heads
        kv_head = work - seq * num_kv_heads
        heads = slice(kv_head * group, (kv_head + 1) * group)
        first, last = query_start[seq], query_start[seq + 1]
        num_queries = last - first
        context = context_lens[seq]
        queries = np.empty((group, dim), dtype=np.float32)
        scores = np.empty((group, block_size), dtype=np.float32)
        running_max = np.empty(group, dtype=np.float32)
        running_sum = np.empty(group, dtype=np.float32)
        acc = np.empty((group, dim), dtype=np.float32)
        for t in range(num_queries):
            row = first + t
            visible = context - num_queries + t + 1  # keys 0 .. its own position
            queries[:, :] = q[row, heads, :] * scale  # the group's query rows, scaled once
            running_max[:] = -np.inf
            running_sum[:] = 0.0
            acc[:, :] = 0.0
            for logical in range((visible + block_size - 1) // block_size):
                block = block_tables[seq, logical]
                n = min(block_size, visible - logical * block_size)
                # Scores: each key row is read once, for every query head of the group.
                for j in range(n):
                    key = key_cache[block, j, kv_head]
                    for g in range(group):
                        s = np.float32(0.0)
                        for d in range(dim):
                            s += queries[g, d] * key[d]
                        scores[g, j] = s
                # Online softmax: rescale what was summed so far to the new running max.
                for g in range(group):
                    block_max = running_max[g]
                    for j in range(n):
                        block_max = max(block_max, scores[g, j])
                    correction = np.float32(math.exp(running_max[g] - block_max))
                    running_sum[g] *= correction
                    for d in range(dim):
                        acc[g, d] *= correction
                    running_max[g] = block_max
                    for j in range(n):
                        p = np.float32(math.exp(scores[g, j] - block_max))
                        scores[g, j] = p
                        running_sum[g] += p
                # Values: each value row is read once, for every query head of the group.
                for j in range(n):
                    value = value_cache[block, j, kv_head]
                    for g in range(group):
                        p = scores[g, j]
                        for d in range(dim):
                            acc[g, d] += p * value[d]
            for g in range(group):
                inverse = np.float32(1.0) / running_sum[g]
                for d in range(dim):
                    out[row, kv_head * group + g, d] = acc[g, d] * inverse


def _check(q, key_cache, value_cache, block_tables, context_lens, query_start) -> None:
    """Every shape, dtype and length the kernel relies on, before it runs: the compiled loop does
    no bounds checks, so a bad argument would read the wrong memory instead of raising."""
    for name, array in (("q", q), ("key_cache", key_cache), ("value_cache", value_cache)):
        if array.dtype != np.float32 or array.ndim not in (3, 4):
            raise ValueError(f"{name} must be float32, got {array.dtype} with {array.ndim} dims")
    if q.ndim != 3 or key_cache.ndim != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(
            f"q must be [tokens, heads, head_dim] and both caches [num_blocks, block_size, "
            f"kv_heads, head_dim]; got {q.shape}, {key_cache.shape}, {value_cache.shape}"
        )
    num_heads, dim = q.shape[1], q.shape[2]
    num_blocks, block_size, num_kv_heads, cache_dim = key_cache.shape
    if cache_dim != dim or num_heads % num_kv_heads:
        raise ValueError(
            f"{num_heads} query heads of {dim} cannot attend {num_kv_heads} K/V heads of "
            f"{cache_dim}: head_dim must match and kv_heads divide heads"
        )
    num_seqs = len(context_lens)
    if (
        block_tables.ndim != 2
        or block_tables.shape[0] != num_seqs
        or len(query_start) != num_seqs + 1
    ):
        raise ValueError(
            f"block_tables [{num_seqs}, max_blocks] and query_start [{num_seqs + 1}] expected for "
            f"{num_seqs} context lengths, got {block_tables.shape} and {query_start.shape}"
        )
    query_lens = np.diff(query_start)
    capacity = block_tables.shape[1] * block_size
    if query_start[0] != 0 or query_start[-1] != q.shape[0] or (query_lens < 1).any():
        raise ValueError(
            f"query_start must rise from 0 to the {q.shape[0]} query rows, at least one per "
            f"sequence; got {query_start.tolist()}"
        )
    if (context_lens < query_lens).any() or (context_lens > capacity).any():
        raise ValueError(
            f"each context must hold its own queries and fit its block table ({capacity} slots); "
            f"got context lengths {context_lens.tolist()} for query lengths {query_lens.tolist()}"
        )
    used = block_tables[:, : -(-int(context_lens.max()) // block_size)]
    needed = np.arange(used.shape[1])[None, :] < -(-context_lens[:, None] // block_size)
    if ((used < 0) | (used >= num_blocks))[needed].any():
        raise ValueError(f"a block table names a block outside the pool of {num_blocks} blocks")


def paged_attention_cpu(
    q: np.ndarray,
    key_cache: np.ndarray,
    value_cache: np.ndarray,
    block_tables: np.ndarray,
    context_lens: np.ndarray,
    query_start: np.ndarray,
    scale: float | None = None,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Attention of every query row over its own sequence's cached keys and values, read in place
    through the block tables. `q` `[tokens, heads, head_dim]` holds each sequence's new rows end to
    end (`query_start` `[seqs + 1]`); sequence i's rows are its last positions, so its context
    (`context_lens[i]`, the new rows included) ends at its last row. Caches `[num_blocks,
    block_size, kv_heads, head_dim]`; all float32. Returns `[tokens, heads, head_dim]`."""
    block_tables = np.ascontiguousarray(block_tables, dtype=np.int64)
    context_lens = np.ascontiguousarray(context_lens, dtype=np.int64)
    query_start = np.ascontiguousarray(query_start, dtype=np.int64)
    _check(q, key_cache, value_cache, block_tables, context_lens, query_start)
    scale = q.shape[2] ** -0.5 if scale is None else scale
    out = np.empty_like(q) if out is None else out
    _paged_attention_kernel(
        out, q, key_cache, value_cache, block_tables, context_lens, query_start, np.float32(scale)
    )
    return out


def warm_up() -> None:
    """Compile the kernel now (or load it from numba's cache): a few seconds the first time on a
    machine, milliseconds after; the engine calls it once, not the first step."""
    q = np.zeros((1, 1, 1), dtype=np.float32)
    cache = np.zeros((1, 1, 1, 1), dtype=np.float32)
    one = np.ones(1, dtype=np.int64)
    paged_attention_cpu(q, cache, cache, np.zeros((1, 1), dtype=np.int64), one, np.array([0, 1]))


class NumbaPagedAttention:
    """The engine's attention backend on the CPU kernel: K/V written through the slot mapping (as
    the reference does), then decodes and prefill chunks in one kernel call per layer."""

    def __init__(self, storage: PagedKVStorage, batch: VarlenBatch) -> None:
        if storage.kv.device.type != "cpu" or storage.dtype != torch.float32:
            raise ValueError(
                f"the numba backend runs on a float32 cache in CPU memory, got "
                f"{storage.dtype} on {storage.kv.device}: use attention_backend='torch'"
            )
        self.storage, self.batch = storage, batch
        # The batch's metadata as numpy, once per pass: the kernel reads it in every layer.
        self.block_tables = batch.block_tables.numpy().astype(np.int64, copy=False)
        self.context_lens = batch.context_lens.numpy().astype(np.int64, copy=False)
        self.query_start = batch.query_start.numpy().astype(np.int64, copy=False)
        self.scale = np.float32(storage.config.head_dim**-0.5)
        self.checked = False  # the arguments are checked in the first layer, the same in all
        numba.set_num_threads(min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        self.storage.write(layer, self.batch.slot_mapping, k, v)
        key_cache, value_cache = (cache.numpy() for cache in self.storage.kv[layer])
        q = q.contiguous().numpy()
        tables, lens, starts = self.block_tables, self.context_lens, self.query_start
        if not self.checked:
            _check(q, key_cache, value_cache, tables, lens, starts)
            self.checked = True
        out = np.empty_like(q)
        _paged_attention_kernel(out, q, key_cache, value_cache, tables, lens, starts, self.scale)
        return torch.from_numpy(out)
