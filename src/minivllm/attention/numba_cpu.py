"""Paged attention as a native CPU kernel, compiled by numba (chapter 07, part 1).

The torch reference (`torch_backend.py`) gathers every sequence's keys and values through its block
table into a padded copy, every layer, every step, and then attends over the copy. This kernel reads
them **in place**, block by block, through the block table, the way a GPU kernel does:

* one call per layer first writes the new rows' K/V to their slots, then attends decodes and
  prefill chunks alike (a decode is a chunk of one row);
* a unit of work is (sequence, a tile of up to QUERY_TILE of its new rows, K/V head): the query
  heads that share the K/V head ride along, so each cached K/V row is read once for the whole group
  (grouped-query attention), not once per query head;
* each query row attends the keys it sees -- the cached prefix and its chunk up to itself -- with
  an **online softmax** (running max and sum, rescaled block by block, in float32; Milakov &
  Gimelshein 2018, the idea inside FlashAttention and vLLM's paged-attention kernels);
* `plan_work` deals the units to the threads by cost, so a prefill chunk does not leave one thread
  working while the other waits; the exponentials use a polynomial exp that LLVM vectorises.

`paged_attention_cpu` checks every argument before anything is computed, then calls the compiled
kernel; `NumbaPagedAttention` is the engine backend, registered as "numba".

Compilation happens once per machine: `cache=True` keeps the machine code next to this file, and
`warm_up()` compiles (or loads) it ahead of the first step. Threads: numba's parallel loops and
torch's matmuls take turns, never overlap, so each may use every core torch is allowed; the layer
is numba's **workqueue**, whose threads sleep between kernels (an OpenMP layer's would spin on, on
the cores torch's own OpenMP threads need next).
"""

from __future__ import annotations

import math
import os
import threading

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
# The workqueue layer runs one parallel kernel at a time in a process and aborts the process if two
# threads launch at once: engines stepping in different threads (a server each) take turns here.
_LAUNCH = threading.Lock()


# fastmath lets LLVM reorder float32 sums into SIMD lanes (and fuse multiply-adds); the tests hold
# the result to 1e-5 of a float64 reference. No "nnan"/"ninf": the running max starts at -inf.
FASTMATH = {"reassoc", "contract", "nsz", "arcp"}

# exp(x) for x <= 0, the way Cephes' expf does it: x = k ln2 + r with |r| <= ln2 / 2, exp(r) by a
# degree-6 polynomial, 2^k written straight into a float's exponent bits. Plain arithmetic over an
# array, so LLVM turns the loop into AVX lanes; numba's math.exp is one libm call per element, and
# it was a third of the kernel's time.
LOG2E = np.float32(1.4426950408889634)
LN2_HI, LN2_LO = np.float32(0.693359375), np.float32(-2.12194440e-4)  # ln 2, split for accuracy
EXP_FLOOR = np.float32(-87.0)  # exp(-87) is near float32's smallest normal; below it counts as 0


QUERY_TILE = 16  # query rows per unit of work: a long prefill chunk becomes several units


@njit(cache=True, fastmath=FASTMATH, inline="always")
def _exp_in_place(x, n, exponent_bits):
    """x[:n] = exp(x[:n]) for x <= 0; `exponent_bits`: int32 scratch as long as x."""
    two_to_k = exponent_bits.view(np.float32)
    for j in range(n):
        v = max(x[j], EXP_FLOOR)
        k = np.int32(v * LOG2E - np.float32(0.5))  # round(v / ln 2): truncation, as v <= 0
        kf = np.float32(k)
        r = v - kf * LN2_HI - kf * LN2_LO
        p = np.float32(1.9875691500e-4)
        p = p * r + np.float32(1.3981999507e-3)
        p = p * r + np.float32(8.3334519073e-3)
        p = p * r + np.float32(4.1665795894e-2)
        p = p * r + np.float32(1.6666665459e-1)
        p = p * r + np.float32(5.0000001201e-1)
        x[j] = p * r * r + r + np.float32(1.0)
        exponent_bits[j] = (k + np.int32(127)) << np.int32(23)  # the float 2^k
    for j in range(n):
        x[j] *= two_to_k[j]


@njit(cache=True, fastmath=FASTMATH, inline="always")
def _attend(
    out, q, key_cache, value_cache, table, context, num_queries, first, t0, t1, kv_head, scale
):
    """Rows t0 .. t1 of one sequence's new rows (its row `first` onwards), one K/V head: every query
    head of the group, over the keys each row sees, with an online softmax block by block."""
    num_heads, dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    vectors = (t1 - t0) * group  # query vectors: row-major over (row, head of the group)
    queries = np.empty((vectors, dim), dtype=np.float32)
    acc = np.zeros((vectors, dim), dtype=np.float32)
    running_max = np.full(vectors, -np.inf, dtype=np.float32)
    running_sum = np.zeros(vectors, dtype=np.float32)
    scores = np.empty((vectors, block_size), dtype=np.float32)
    exponent_bits = np.empty(block_size, dtype=np.int32)
    for r in range(t1 - t0):  # the queries, scaled once
        for g in range(group):
            for d in range(dim):
                queries[r * group + g, d] = q[first + t0 + r, kv_head * group + g, d] * scale
    seen_before = context - num_queries  # keys cached before this sequence's new rows
    last_visible = seen_before + t1  # what the tile's last row sees: its own position and before
    for logical in range((last_visible + block_size - 1) // block_size):
        block, base = table[logical], logical * block_size
        n = min(block_size, last_visible - base)
        # Scores: each key row is read once, for every query vector of the tile.
        for j in range(n):
            for v in range(vectors):
                s = np.float32(0.0)
                for d in range(dim):
                    s += queries[v, d] * key_cache[block, j, kv_head, d]
                scores[v, j] = s
        # Online softmax: the block's max joins each vector's running max, and what was summed so
        # far is rescaled to it. Causal: a row sees keys up to its own position.
        for v in range(vectors):
            seen = min(n, seen_before + t0 + v // group + 1 - base)
            if seen <= 0:  # a row earlier in the tile sees none of this block
                for j in range(n):
                    scores[v, j] = 0.0
                continue
            block_max = running_max[v]
            for j in range(seen):
                block_max = max(block_max, scores[v, j])
            for j in range(seen):
                scores[v, j] -= block_max
            correction = np.float32(math.exp(running_max[v] - block_max))
            running_max[v] = block_max
            running_sum[v] *= correction
            for d in range(dim):
                acc[v, d] *= correction
            _exp_in_place(scores[v], seen, exponent_bits)
            total = np.float32(0.0)
            for j in range(seen):
                total += scores[v, j]
            running_sum[v] += total
            for j in range(seen, n):
                scores[v, j] = 0.0
        # Values: each value row read once, for every query vector.
        for j in range(n):
            for v in range(vectors):
                p = scores[v, j]
                for d in range(dim):
                    acc[v, d] += p * value_cache[block, j, kv_head, d]
    for v in range(vectors):
        inverse = np.float32(1.0) / running_sum[v]
        row, head = first + t0 + v // group, kv_head * group + v % group
        for d in range(dim):
            out[row, head, d] = acc[v, d] * inverse


@njit(parallel=True, cache=True, fastmath=FASTMATH)
def _paged_attention_kernel(
    out,
    q,
    k_new,
    v_new,
    slot_mapping,
    key_cache,
    value_cache,
    block_tables,
    context_lens,
    query_start,
    work,
    work_start,
    scale,
):
    """`work` rows are (sequence, first row, end row, K/V head) relative to the sequence's new
    rows; thread i does `work[work_start[i]:work_start[i + 1]]` (see `plan_work`)."""
    block_size = key_cache.shape[1]
    # The new keys and values go to their slots first: every unit of work may read them. A plain
    # loop (a copy of a few KiB): a second parallel region would cost more to start than it saves.
    for row in range(k_new.shape[0]):
        block, offset = divmod(slot_mapping[row], block_size)
        key_cache[block, offset] = k_new[row]
        value_cache[block, offset] = v_new[row]
    for thread in prange(work_start.shape[0] - 1):
        for i in range(work_start[thread], work_start[thread + 1]):
            seq, t0, t1, kv_head = work[i, 0], work[i, 1], work[i, 2], work[i, 3]
            first = query_start[seq]
            _attend(
                out,
                q,
                key_cache,
                value_cache,
                block_tables[seq],
                context_lens[seq],
                query_start[seq + 1] - first,
                first,
                t0,
                t1,
                kv_head,
                scale,
            )


def unit_cost(units: np.ndarray, context_lens: np.ndarray, query_start: np.ndarray) -> np.ndarray:
    """The cost of units of work `[n, >= 3]` (sequence, first row, end row, ...): query rows x the
    keys they see, a row seeing the cached prefix and its chunk up to itself."""
    seq, t0, t1 = units[:, 0], units[:, 1], units[:, 2]
    seen_before = (context_lens - np.diff(query_start))[seq]
    return (t1 - t0) * (seen_before + (t0 + t1) // 2 + 1)


def plan_work(
    context_lens: np.ndarray, query_start: np.ndarray, num_kv_heads: int, num_threads: int
) -> tuple[np.ndarray, np.ndarray]:
    """Units of work -- (sequence, a tile of up to QUERY_TILE of its new rows, K/V head) -- dealt
    to the threads by cost, largest first, in snake order (0, 1, 1, 0, 0, 1, ...): a 64-token
    prefill chunk costs as much as dozens of decodes, and an even split by count would leave one
    thread doing every prefill. Returns `work` `[units, 4]` grouped by thread and `work_start`
    `[threads + 1]`."""
    query_lens = np.diff(query_start)
    tiles = -(-query_lens // QUERY_TILE)
    seq = np.repeat(np.arange(len(query_lens)), tiles)
    tile = np.arange(len(seq)) - np.repeat(np.cumsum(tiles) - tiles, tiles)
    t0 = tile * QUERY_TILE
    t1 = np.minimum(t0 + QUERY_TILE, query_lens[seq])
    tiled = np.stack([seq, t0, t1], axis=1)
    tiled = tiled[np.argsort(-unit_cost(tiled, context_lens, query_start), kind="stable")]
    # every K/V head of a tile is a unit of the same cost, next to each other in the deal
    heads = np.tile(np.arange(num_kv_heads), len(tiled))
    units = np.column_stack([np.repeat(tiled, num_kv_heads, axis=0), heads])
    lap = np.arange(len(units)) % (2 * num_threads)
    thread = np.where(lap < num_threads, lap, 2 * num_threads - 1 - lap)
    by_thread = np.argsort(thread, kind="stable")
    work_start = np.searchsorted(thread[by_thread], np.arange(num_threads + 1))
    return np.ascontiguousarray(units[by_thread], dtype=np.int64), work_start.astype(np.int64)


def _check(
    q, key_cache, value_cache, block_tables, context_lens, query_start, k_new, v_new, slot_mapping
) -> None:
    """Every shape, dtype and length the kernel relies on, before it runs: the compiled loop does
    no bounds checks, so a bad argument would read or write the wrong memory instead of raising."""
    arrays = (("q", q), ("key_cache", key_cache), ("value_cache", value_cache))
    for name, array in (*arrays, ("k_new", k_new), ("v_new", v_new)):
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
    if len(k_new):  # new keys and values to write first
        rows = (q.shape[0], num_kv_heads, dim)
        if k_new.shape != rows or v_new.shape != rows or slot_mapping.shape != rows[:1]:
            raise ValueError(
                f"k_new and v_new must be {list(rows)} and slot_mapping [{rows[0]}], got "
                f"{k_new.shape}, {v_new.shape} and {slot_mapping.shape}"
            )
        if ((slot_mapping < 0) | (slot_mapping >= num_blocks * block_size)).any():
            raise ValueError(f"a slot falls outside the {num_blocks * block_size} slots")


def paged_attention_cpu(
    q: np.ndarray,
    key_cache: np.ndarray,
    value_cache: np.ndarray,
    block_tables: np.ndarray,
    context_lens: np.ndarray,
    query_start: np.ndarray,
    scale: float | None = None,
    out: np.ndarray | None = None,
    *,
    k_new: np.ndarray | None = None,
    v_new: np.ndarray | None = None,
    slot_mapping: np.ndarray | None = None,
) -> np.ndarray:
    """Attention of every query row over its own sequence's cached keys and values, read in place
    through the block tables. `q` `[tokens, heads, head_dim]` holds each sequence's new rows end to
    end (`query_start` `[seqs + 1]`); sequence i's rows are its last positions, so its context
    (`context_lens[i]`, the new rows included) ends at its last row. Caches `[num_blocks,
    block_size, kv_heads, head_dim]`; all float32. With `k_new`, `v_new` (`[tokens, kv_heads,
    head_dim]`) and `slot_mapping` (`[tokens]`) the new rows' keys and values are written to their
    slots first, in the same call. Returns `[tokens, heads, head_dim]`."""
    block_tables = np.ascontiguousarray(block_tables, dtype=np.int64)
    context_lens = np.ascontiguousarray(context_lens, dtype=np.int64)
    query_start = np.ascontiguousarray(query_start, dtype=np.int64)
    if k_new is None:  # nothing to write: zero rows, which the kernel skips
        k_new = v_new = np.empty((0, key_cache.shape[2], q.shape[2]), dtype=np.float32)
        slot_mapping = np.empty(0, dtype=np.int64)
    slot_mapping = np.ascontiguousarray(slot_mapping, dtype=np.int64)
    args = (q, key_cache, value_cache, block_tables, context_lens, query_start)
    _check(*args, k_new, v_new, slot_mapping)
    scale = q.shape[2] ** -0.5 if scale is None else scale
    out = np.empty_like(q) if out is None else out
    work = plan_work(context_lens, query_start, key_cache.shape[2], numba.get_num_threads())
    args = (key_cache, value_cache, block_tables, context_lens, query_start, *work)
    with _LAUNCH:
        _paged_attention_kernel(out, q, k_new, v_new, slot_mapping, *args, np.float32(scale))
    return out


def warm_up() -> None:
    """Compile the kernel now (or load it from numba's cache): a few seconds the first time on a
    machine, milliseconds after; the engine calls it once, not the first step."""
    q = np.zeros((1, 1, 1), dtype=np.float32)
    cache = np.zeros((1, 1, 1, 1), dtype=np.float32)
    one = np.ones(1, dtype=np.int64)
    paged_attention_cpu(
        q,
        cache,
        cache.copy(),
        np.zeros((1, 1), dtype=np.int64),
        one,
        np.array([0, 1]),
        k_new=q,
        v_new=q,
        slot_mapping=np.zeros(1, dtype=np.int64),
    )


class NumbaPagedAttention:
    """The engine's attention backend on the CPU kernel: one kernel call per layer writes the new
    K/V through the slot mapping and attends decodes and prefill chunks alike."""

    def __init__(self, storage: PagedKVStorage, batch: VarlenBatch) -> None:
        if storage.kv.device.type != "cpu" or storage.dtype != torch.float32:
            raise ValueError(
                f"the numba backend runs on a float32 cache in CPU memory, got "
                f"{storage.dtype} on {storage.kv.device}: use attention_backend='torch'"
            )
        self.storage = storage
        # The batch's metadata as numpy, once per pass: the kernel reads it in every layer.
        self.slot_mapping = batch.slot_mapping.numpy().astype(np.int64, copy=False)
        self.block_tables = batch.block_tables.numpy().astype(np.int64, copy=False)
        self.context_lens = batch.context_lens.numpy().astype(np.int64, copy=False)
        self.query_start = batch.query_start.numpy().astype(np.int64, copy=False)
        self.scale = np.float32(storage.config.head_dim**-0.5)
        self.checked = False  # the arguments are checked in the first layer, the same in all
        numba.set_num_threads(min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))
        self.work = plan_work(
            self.context_lens,
            self.query_start,
            storage.config.n_kv_heads,
            numba.get_num_threads(),
        )

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        key_cache, value_cache = (cache.numpy() for cache in self.storage.kv[layer])
        q, k, v = (x.contiguous().numpy() for x in (q, k, v))
        metadata = (self.block_tables, self.context_lens, self.query_start)
        if not self.checked:
            _check(q, key_cache, value_cache, *metadata, k, v, self.slot_mapping)
            self.checked = True
        out = np.empty_like(q)
        with _LAUNCH:
            _paged_attention_kernel(
                out,
                q,
                k,
                v,
                self.slot_mapping,
                key_cache,
                value_cache,
                *metadata,
                *self.work,
                self.scale,
            )
        return torch.from_numpy(out)
