"""Paged attention as a native CPU kernel, compiled by numba (chapter 07).

The torch reference (`torch_backend.py`) gathers every sequence's keys and values through its block
table into a padded copy, every layer, every step, and then attends over the copy. This kernel reads
them **in place**, block by block, through the block table, the way a GPU kernel does:

* one call per layer first writes the new rows' K/V to their slots, then attends decodes and
  prefill chunks alike (a decode is a chunk of one row);
* a unit of work is (sequence, a tile of up to QUERY_TILE of its new rows, K/V head): the query
  heads that share the K/V head ride along, so each cached K/V row is read once for the whole group
  (grouped-query attention), not once per query head;
* each query row attends the keys it sees -- the cached prefix and its chunk up to itself -- in
  two passes over its blocks: every score, then their softmax at once (float32), then the values
  weighted by it. A unit's scores fit a per-thread scratch (4 KiB per query vector at 1024 tokens),
  so the CPU needs no online softmax; chapter 08's GPU kernel, short of such memory, does;
* the dot products and the weighted sums are written with 8-lane vectors (`simd.py`): a query
  vector's dot products with eight keys are summed across their lanes together, by one `sum8x8`,
  not each on its own. Shapes the vector paths cannot take (head_dim not a multiple of 16, blocks
  not of 8) run the plain loops they replace, equal to float32 rounding;
* a bfloat16 cache (a bfloat16 model's) is read as it is stored, two bytes an element, each
  vector widened to float32 as it is loaded (`simd.load8`; numpy has no bfloat16, so the cache
  arrives as its bits, `kernel_array`): the kernel computes in float32 over either cache. Its
  queries and output are float32 or bfloat16 too: a bfloat16 model's queries are widened as they
  are read and its output rounded as it is written (`simd.as_element`), so the model's tensors
  go in and come out as they are, with no conversion around the call. A
  prefill tile, many query vectors over the same rows, copies a block's rows of its K/V head into
  float32 scratch once (`STAGE_MIN_VECTORS`) and reads them there -- its values, every block's,
  before one pass weighs them all. Where the CPU multiplies
  bfloat16s itself (AVX-512 BF16), a bfloat16 model's scores are made from the bfloat16 queries and
  keys as they are (`_scores_bfloat16`, `BFLOAT16_DOT_PRODUCTS`);
* the blocks' rows are prefetched ahead of their use -- the keys two blocks ahead, and, while the
  keys are scored, the values into the second-level cache: a block table scatters the blocks
  over the pool, where the hardware's stride prefetcher cannot follow;
* `plan_work` deals the units to the threads by cost, so a prefill chunk does not leave one thread
  working while the other waits; the exponentials use a polynomial exp that LLVM vectorises.

`paged_attention_cpu` checks every argument before anything is computed, then calls the compiled
kernel; `NumbaPagedAttention` is the engine backend, registered as "numba".

Compilation happens once per machine: `cache=True` keeps the machine code next to this file, and
`warm_up()` compiles (or loads) it ahead of the first step. Threads: numba's parallel loops and
torch's matmuls take turns, never overlap, so each may use every core torch is allowed. The layer is
numba's **OpenMP** one where its idle threads sleep (`OMP_WAIT_POLICY=PASSIVE`, part of minivllm's
default): a launch runs a share on the calling thread and wakes one thread per other core -- with
torch's pip build, torch's own OpenMP threads, which a short spin may still keep awake from the
matmul before (`model/numba_threads.py`). Where
they would spin instead, on the cores torch's threads need next, it is the **workqueue**, whose
launch wakes a worker for every share while the caller sleeps (slower on the book's machine:
`benchmarks/kernel_threads.py`). With one thread -- a forward worker (`runner/workers.py`), an
engine told to use one, or a pass too small to pay for waking another (`PARALLEL_MIN_COST`) --
`_paged_attention_serial` runs the same units on the calling thread.
"""

from __future__ import annotations

import os
import weakref

import numba
import numpy as np
import torch
from numba import njit, prange

from minivllm.attention.batch import VarlenBatch
from minivllm.attention.simd import (
    BFLOAT16_DOTS,
    as_element,
    as_float32,
    dot16,
    fma8,
    largest_lane,
    load8,
    load16,
    max8,
    mul8,
    prefetch,
    prefetch_l2,
    splat8,
    store8,
    sum8x8,
    zero8,
)
from minivllm.attention.storage import PagedKVStorage, cpu_kv_pool
from minivllm.model.numba_threads import (
    LAUNCH,
    default_threads,
    loop_threads,
    openmp_layer,
    start_thread_pool,
    use_threads,
)

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
# A unit of this many query vectors or more (a prefill tile) first copies each block's rows of its
# K/V head into float32 scratch (`_stage_rows`), once, and scores and weighs them there: every
# vector then reads contiguous float32 rows from the first-level cache instead of widening the
# same bfloat16 elements again for each vector. A decode's two to four vectors read the cache
# itself. Same arithmetic, same bits. Qwen3-0.6B's shape in bfloat16, the real-model workload's
# first 512-token prefill chunk (sequences of 277, 109, 53 and 73 new rows), one layer, two
# threads, AMD EPYC Zen 4, alternating: 4.0-4.4 ms against 5.1-5.7 ms; its second chunk (rows
# after a cached prefix) 4.8-6.0 against 6.0-8.5. A float32 cache (the book's model) only gains a
# copy: 0.97-1.03 ms against 0.97-1.02. The values are staged block after block into one array
# and weighed in one pass over all of them (`_weigh_blocks`), not block by block: a prefill of
# 512 rows, the kernel alone at that shape, one thread, took 0.93x the time (medians of 30 calls,
# alternating, the same bits).
STAGE_MIN_VECTORS = 8
# How many blocks ahead of the one being scored the keys are asked for into the second-level cache
# (the first-level prefetch stays two blocks ahead), and how many of the next unit's first blocks
# are asked for while a unit runs. A decode's units are short -- a sequence's few hundred keys of
# one K/V head -- and each began by waiting on memory for its first blocks. K/V out of cache
# (AMD EPYC Zen 4, the kernel alone, against the kernel without these, alternated, medians of 2
# runs): Qwen3-0.6B's shape in bfloat16, batch 8 at 100-350 tokens, 0.56-0.60x the time on one
# thread and 0.76-0.78x on two; the book's model at batch 64 0.75-0.76x and 0.78-0.86x; a
# prefill of 4 x 64 rows (compute-bound) 0.99-1.03x. Four blocks ahead did as well as three or
# five, better than six, eight, twelve or a unit's every block.
KEYS_L2_AHEAD = 4
# Whether the CPU has 32 vector registers (AVX-512's), room for `_values_simd`'s wide tile: eight
# query vectors' accumulators at once instead of four (or four vectors of 32 lanes, where head_dim
# allows: `_values_four`). A 512-token prefill chunk of Qwen3-0.6B's
# shape attended in 23.5 ms a layer with it against 32-34 ms, on one core of an AMD EPYC Zen 4.
WIDE_VALUES_TILE = "+avx512vl" in numba.core.codegen.get_host_cpu_features().split(",")
# The kernels' `simd` argument (`vector_paths`): the plain loops, the vector paths, those with
# `_values_simd`'s wide tile, and those with the wide tile and bfloat16 dot products for the scores
# (`_scores_bfloat16`: a bfloat16 model's queries over a bfloat16 cache, on a CPU with AVX-512
# BF16). Qwen3-0.6B's shape in bfloat16, a prefill of 2 x 256 rows, one layer: 0.82x the time with
# them, on one thread and on two (AMD EPYC Zen 4, the kernel alone, alternating, medians of 64
# calls); a decode of 8 or 64 sequences, whose K/V come from memory, 0.98-1.06x (within the noise).
PLAIN, VECTORS, WIDE_TILE, BFLOAT16_DOT_PRODUCTS = 0, 1, 2, 3


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
def _scores_plain(scores, queries, vectors, keys, kv_head, n, base):
    """`scores[v, base + j]` = query vector v . key j, for the first `n` keys of one block (`keys`
    `[block_size, kv_heads, head_dim]`): each key row is read once, for every query vector."""
    dim = queries.shape[1]
    for j in range(n):
        for v in range(vectors):
            s = np.float32(0.0)
            for d in range(dim):
                s += queries[v, d] * as_float32(keys[j, kv_head, d])
            scores[v, base + j] = s


@njit(cache=True, fastmath=FASTMATH, inline="always")
def _scores_simd(scores, queries, vectors, keys, kv_head, n, base):
    """`_scores_plain` eight keys at a time (block_size and head_dim multiples of 8). A query
    vector's eight dot products build up in eight registers of 8 lanes along head_dim, and one
    `sum8x8` turns them into its eight scores: no sum across lanes per (key, vector) pair. The last
    group may score up to 7 keys past `n`, still inside the block; nothing reads those scores."""
    dim = queries.shape[1]
    for j in range(0, n, 8):
        k0, k1, k2, k3, k4, k5, k6, k7 = _eight_rows(keys, j, kv_head)
        for v in range(vectors):
            query = queries[v]
            a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = zero8()
            for d in range(0, dim, 8):
                x = load8(query, d)
                a0, a1 = fma8(x, load8(k0, d), a0), fma8(x, load8(k1, d), a1)
                a2, a3 = fma8(x, load8(k2, d), a2), fma8(x, load8(k3, d), a3)
                a4, a5 = fma8(x, load8(k4, d), a4), fma8(x, load8(k5, d), a5)
                a6, a7 = fma8(x, load8(k6, d), a6), fma8(x, load8(k7, d), a7)
            store8(scores[v], base + j, sum8x8(a0, a1, a2, a3, a4, a5, a6, a7))


@njit(cache=True, inline="always")
def _eight_rows(keys, j, kv_head):
    """Rows j .. j + 8 of one K/V head of a block (`[block_size, kv_heads, head_dim]`)."""
    return (
        keys[j, kv_head],
        keys[j + 1, kv_head],
        keys[j + 2, kv_head],
        keys[j + 3, kv_head],
        keys[j + 4, kv_head],
        keys[j + 5, kv_head],
        keys[j + 6, kv_head],
        keys[j + 7, kv_head],
    )


@njit(cache=True, fastmath=FASTMATH, inline="always")
def _dot_both(a, b, x, y, row, d):
    """`dot16` of one key row's lanes d .. d + 16 with two query vectors' (x, y), into a and b."""
    lanes = load16(row, d)
    return dot16(a, x, lanes), dot16(b, y, lanes)


@njit(cache=True, fastmath=FASTMATH, inline="always")
def _scores_bfloat16(scores, query_bits, vectors, keys, kv_head, n, base, scale):
    """`_scores_simd` over bfloat16 queries and keys as they are (`query_bits` and `keys` their
    bits), for a CPU with AVX-512 BF16: `dot16` multiplies sixteen pairs of them and adds the
    products into eight float32 lanes in one instruction, twice the multiply-adds of an `fma8`,
    with no key widened to float32 on the way. Each product is exact and each sum float32's, as in
    `_scores_simd`; the queries are the model's own, unscaled, and each score is scaled as it is
    stored (`_scores_simd` scales the queries first): the scores differ by float32 rounding.
    Query vectors go two at a time: each key row's lanes, loaded once, feed both, and sixteen
    sums are in flight instead of eight (an instruction's result is ready for the next only after
    several cycles): a prefill of 512 rows at Qwen3-0.6B's shape, the kernel alone on one
    thread, took 0.95x the time (AMD EPYC Zen 4). Each score adds the same products in the same
    order either way; an odd vector left over goes alone. head_dim a multiple of 16."""
    dim = query_bits.shape[1]
    factor = splat8(scale)
    for j in range(0, n, 8):
        k0, k1, k2, k3, k4, k5, k6, k7 = _eight_rows(keys, j, kv_head)
        for v in range(0, vectors - 1, 2):  # two vectors at a time: each key row loaded once
            query, other = query_bits[v], query_bits[v + 1]
            a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = zero8()
            b0 = b1 = b2 = b3 = b4 = b5 = b6 = b7 = zero8()
            for d in range(0, dim, 16):
                x, y = load16(query, d), load16(other, d)
                a0, b0 = _dot_both(a0, b0, x, y, k0, d)
                a1, b1 = _dot_both(a1, b1, x, y, k1, d)
                a2, b2 = _dot_both(a2, b2, x, y, k2, d)
                a3, b3 = _dot_both(a3, b3, x, y, k3, d)
                a4, b4 = _dot_both(a4, b4, x, y, k4, d)
                a5, b5 = _dot_both(a5, b5, x, y, k5, d)
                a6, b6 = _dot_both(a6, b6, x, y, k6, d)
                a7, b7 = _dot_both(a7, b7, x, y, k7, d)
            store8(scores[v], base + j, mul8(sum8x8(a0, a1, a2, a3, a4, a5, a6, a7), factor))
            store8(scores[v + 1], base + j, mul8(sum8x8(b0, b1, b2, b3, b4, b5, b6, b7), factor))
        for v in range(vectors - vectors % 2, vectors):  # an odd one left over
            query = query_bits[v]
            a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = zero8()
            for d in range(0, dim, 16):
                x = load16(query, d)
                a0, a1 = dot16(a0, x, load16(k0, d)), dot16(a1, x, load16(k1, d))
                a2, a3 = dot16(a2, x, load16(k2, d)), dot16(a3, x, load16(k3, d))
                a4, a5 = dot16(a4, x, load16(k4, d)), dot16(a5, x, load16(k5, d))
                a6, a7 = dot16(a6, x, load16(k6, d)), dot16(a7, x, load16(k7, d))
            store8(scores[v], base + j, mul8(sum8x8(a0, a1, a2, a3, a4, a5, a6, a7), factor))


@njit(cache=True, fastmath=FASTMATH, inline="always")
def _values_plain(acc, scores, vectors, values, kv_head, n, base):
    """`acc[v] += scores[v, base + j] * value j` over the first `n` values of one block: each value
    row is read once, for every query vector."""
    dim = acc.shape[1]
    for j in range(n):
        for v in range(vectors):
            p = scores[v, base + j]
            for d in range(dim):
                acc[v, d] += p * as_float32(values[j, kv_head, d])


@njit(cache=True, fastmath=FASTMATH, inline="always")
def _load4(acc, v, d):
    """Lanes d .. d + 16 of accumulators v .. v + 4: eight registers, low and high halves."""
    o0, o1, o2, o3 = acc[v], acc[v + 1], acc[v + 2], acc[v + 3]
    return (
        (load8(o0, d), load8(o0, d + 8), load8(o1, d), load8(o1, d + 8)),
        (load8(o2, d), load8(o2, d + 8), load8(o3, d), load8(o3, d + 8)),
    )


@njit(cache=True, fastmath=FASTMATH, inline="always")
def _store4(acc, v, d, tile):
    """`_load4`'s registers back to their accumulators."""
    (lo0, hi0, lo1, hi1), (lo2, hi2, lo3, hi3) = tile
    o0, o1, o2, o3 = acc[v], acc[v + 1], acc[v + 2], acc[v + 3]
    store8(o0, d, lo0)
    store8(o0, d + 8, hi0)
    store8(o1, d, lo1)
    store8(o1, d + 8, hi1)
    store8(o2, d, lo2)
    store8(o2, d + 8, hi2)
    store8(o3, d, lo3)
    store8(o3, d + 8, hi3)


@njit(cache=True, fastmath=FASTMATH, inline="always")
def _add_row4(tile, scores, v, key, low, high):
    """Four query vectors' accumulators (`_load4`'s registers) plus value row `key`'s lanes (low,
    high), each times the vector's weight for that key."""
    (lo0, hi0, lo1, hi1), (lo2, hi2, lo3, hi3) = tile
    w = splat8(scores[v, key])
    lo0, hi0 = fma8(w, low, lo0), fma8(w, high, hi0)
    w = splat8(scores[v + 1, key])
    lo1, hi1 = fma8(w, low, lo1), fma8(w, high, hi1)
    w = splat8(scores[v + 2, key])
    lo2, hi2 = fma8(w, low, lo2), fma8(w, high, hi2)
    w = splat8(scores[v + 3, key])
    lo3, hi3 = fma8(w, low, lo3), fma8(w, high, hi3)
    return (lo0, hi0, lo1, hi1), (lo2, hi2, lo3, hi3)


@njit(cache=True, fastmath=FASTMATH, inline="always")
def _values_simd(acc, scores, vectors, values, kv_head, n, base, wide):
    """`_values_plain` 16 lanes of head_dim (two registers) at a time (head_dim a multiple of 16),
    turned around: each value row's lanes are loaded once and added into several query vectors at
    a time, whose accumulators stay in registers for the whole block -- a register tile, as in a
    fast matmul. Four vectors are eight accumulators: eight independent multiply-add chains, as
    many as two FMA units need while each result takes four cycles to be ready for the next.
    `wide`, for a CPU with 32 vector registers (AVX-512): eight vectors, sixteen accumulators, and
    each value row loaded feeds twice the multiply-adds; with 16 (AVX2) that tile would spill.
    Where head_dim is a multiple of 32 the wide tile is four vectors of 32 lanes instead
    (`_values_four`): sixteen accumulators still, but four weights broadcast per value row instead
    of eight -- a prefill of 512 rows at Qwen3-0.6B's shape, the kernel alone on one thread, took
    0.97x the time (AMD EPYC Zen 4). Each accumulator adds its terms in the same order either
    way: the results do not move by a bit. Vectors left over (a model with fewer than four query
    heads per K/V head) go in pairs, 32 lanes at a time, where head_dim allows (`_values_pair`);
    the last one alone: two chains, each add waiting for the one before."""
    dim = acc.shape[1]
    fours = vectors - vectors % 4
    wide_fours = wide and dim % 32 == 0  # every four vectors in `_values_four`'s tile
    eights = vectors - vectors % 8 if wide and not wide_fours else 0
    for d in range(0, dim if wide_fours else 0, 32):
        for v in range(0, fours, 4):
            _values_four(acc, scores, v, values, kv_head, n, base, d)
    # vectors left over, in pairs where head_dim is a multiple of 32 (`_values_pair`), after the
    # others: each accumulator still adds its terms in the same order
    pairs_from = fours
    pairs_to = vectors - (vectors - fours) % 2 if dim % 32 == 0 else fours
    for d in range(0, dim, 16):
        for v in range(0, eights, 8):
            tile, next_tile = _load4(acc, v, d), _load4(acc, v + 4, d)
            for j in range(n):
                row = values[j, kv_head]
                low, high = load8(row, d), load8(row, d + 8)
                tile = _add_row4(tile, scores, v, base + j, low, high)
                next_tile = _add_row4(next_tile, scores, v + 4, base + j, low, high)
            _store4(acc, v, d, tile)
            _store4(acc, v + 4, d, next_tile)
        for v in range(fours if wide_fours else eights, fours, 4):
            tile = _load4(acc, v, d)
            for j in range(n):
                row = values[j, kv_head]
                tile = _add_row4(tile, scores, v, base + j, load8(row, d), load8(row, d + 8))
            _store4(acc, v, d, tile)
        for v in range(pairs_to, vectors):
            weights, out = scores[v], acc[v]
            low, high = load8(out, d), load8(out, d + 8)
            for j in range(n):
                row, w = values[j, kv_head], splat8(weights[base + j])
                low, high = fma8(w, load8(row, d), low), fma8(w, load8(row, d + 8), high)
            store8(out, d, low)
            store8(out, d + 8, high)
    for d in range(0, dim if pairs_from < pairs_to else 0, 32):
        for v in range(pairs_from, pairs_to, 2):
            _values_pair(acc, scores, v, values, kv_head, n, base, d)


@njit(cache=True, fastmath=FASTMATH, inline="always")
def _values_four(acc, scores, v, values, kv_head, n, base, d):
    """Query vectors v .. v + 4, lanes d .. d + 32 of their accumulators over value rows :n:
    sixteen accumulators in registers (AVX-512's 32 registers hold them, the row's four loads and
    a weight); each value row's 32 lanes are loaded once for all four vectors."""
    o0, o1, o2, o3 = acc[v], acc[v + 1], acc[v + 2], acc[v + 3]
    a0, a1, a2, a3 = _load_lanes32(o0, d)
    b0, b1, b2, b3 = _load_lanes32(o1, d)
    c0, c1, c2, c3 = _load_lanes32(o2, d)
    e0, e1, e2, e3 = _load_lanes32(o3, d)
    w0, w1, w2, w3 = scores[v], scores[v + 1], scores[v + 2], scores[v + 3]
    for j in range(n):
        x0, x1, x2, x3 = _load_lanes32(values[j, kv_head], d)
        w = splat8(w0[base + j])
        a0, a1, a2, a3 = fma8(w, x0, a0), fma8(w, x1, a1), fma8(w, x2, a2), fma8(w, x3, a3)
        w = splat8(w1[base + j])
        b0, b1, b2, b3 = fma8(w, x0, b0), fma8(w, x1, b1), fma8(w, x2, b2), fma8(w, x3, b3)
        w = splat8(w2[base + j])
        c0, c1, c2, c3 = fma8(w, x0, c0), fma8(w, x1, c1), fma8(w, x2, c2), fma8(w, x3, c3)
        w = splat8(w3[base + j])
        e0, e1, e2, e3 = fma8(w, x0, e0), fma8(w, x1, e1), fma8(w, x2, e2), fma8(w, x3, e3)
    _store_lanes32(o0, d, a0, a1, a2, a3)
    _store_lanes32(o1, d, b0, b1, b2, b3)
    _store_lanes32(o2, d, c0, c1, c2, c3)
    _store_lanes32(o3, d, e0, e1, e2, e3)


@njit(cache=True, fastmath=FASTMATH, inline="always")
def _load_lanes32(row, d):
    """Lanes d .. d + 32 of a row: four registers."""
    return load8(row, d), load8(row, d + 8), load8(row, d + 16), load8(row, d + 24)


@njit(cache=True, fastmath=FASTMATH, inline="always")
def _store_lanes32(row, d, x0, x1, x2, x3):
    """`_load_lanes32`'s registers back to the row."""
    store8(row, d, x0)
    store8(row, d + 8, x1)
    store8(row, d + 16, x2)
    store8(row, d + 24, x3)


@njit(cache=True, fastmath=FASTMATH, inline="always")
def _values_pair(acc, scores, v, values, kv_head, n, base, d):
    """Query vectors v and v + 1, lanes d .. d + 32 of their accumulators over one block's value
    rows: eight accumulators in registers, eight multiply-add chains. A decode of a model with two
    query heads per K/V head (Qwen3-0.6B) has just these two vectors; one at a time, they were two
    chains, each add waiting four cycles for the one before."""
    first, second = acc[v], acc[v + 1]
    a0, a1, a2, a3 = _load_lanes32(first, d)
    b0, b1, b2, b3 = _load_lanes32(second, d)
    for j in range(n):
        x0, x1, x2, x3 = _load_lanes32(values[j, kv_head], d)
        w = splat8(scores[v, base + j])
        a0, a1, a2, a3 = fma8(w, x0, a0), fma8(w, x1, a1), fma8(w, x2, a2), fma8(w, x3, a3)
        w = splat8(scores[v + 1, base + j])
        b0, b1, b2, b3 = fma8(w, x0, b0), fma8(w, x1, b1), fma8(w, x2, b2), fma8(w, x3, b3)
    _store_lanes32(first, d, a0, a1, a2, a3)
    _store_lanes32(second, d, b0, b1, b2, b3)


@njit(cache=True, inline="always")
def _prefetch_block(cache, block, kv_head, second_level):
    """Ask for one K/V head's rows of a block before they are needed: the next block of a table is
    anywhere in the pool, where the hardware's own prefetcher, which follows strides, cannot
    guess it. `second_level`: into the second-level cache only (`prefetch_l2`), for rows wanted
    later than the next block's."""
    line = 64 // cache.itemsize  # elements per 64-byte cache line: one request each
    for j in range(cache.shape[1]):
        row = cache[block, j, kv_head]
        for d in range(0, row.shape[0], line):
            if second_level:
                prefetch_l2(row, d)
            else:
                prefetch(row, d)


@njit(cache=True, inline="always")
def _stage_rows(staged, block, kv_head, n):
    """staged[:n, 0] = rows :n of one K/V head of a block, in float32."""
    for j in range(n):
        row, out = block[j, kv_head], staged[j, 0]
        for d in range(row.shape[0]):
            out[d] = as_float32(row[d])


@njit(cache=True, fastmath=FASTMATH, inline="always")
def _attend(
    out,
    q,
    key_cache,
    value_cache,
    table,
    context,
    num_queries,
    first,
    t0,
    t1,
    kv_head,
    scale,
    simd,
    scratch,
):
    """Rows t0 .. t1 of one sequence's new rows (its row `first` onwards), one K/V head: every query
    head of the group, over the keys each row sees, in two passes over its blocks -- all the
    scores (`_score_blocks`), their softmax, then the values (`_weigh_blocks`). `scratch`: the
    thread's arrays for them (see the kernel)."""
    queries, query_bits, acc, scores, exponent_bits, staged = scratch
    num_heads, dim = q.shape[1], q.shape[2]
    group = num_heads // key_cache.shape[2]
    vectors = (t1 - t0) * group  # query vectors: row-major over (row, head of the group)
    dots = simd == BFLOAT16_DOT_PRODUCTS
    for r in range(t1 - t0):  # the queries, scaled once (in float32, where q is bfloat16) --
        for g in range(group):  # or as they are, for `_scores_bfloat16`
            query, v = q[first + t0 + r, kv_head * group + g], r * group + g
            if dots:
                query_bits[v] = query
            else:
                for d in range(dim):
                    queries[v, d] = as_float32(query[d]) * scale
            acc[v] = 0.0
    seen_before = context - num_queries  # keys cached before this sequence's new rows
    last_visible = seen_before + t1  # what the tile's last row sees: its own position and before
    blocks = table, last_visible, kv_head, simd, staged
    if dots:  # (two calls: numba gives a variable one type, and the two arrays' differ)
        _score_blocks(scores, query_bits, vectors, key_cache, value_cache, *blocks, scale)
    else:
        _score_blocks(scores, queries, vectors, key_cache, value_cache, *blocks, scale)
    _softmax_rows(scores, vectors, group, seen_before + t0 + 1, last_visible, exponent_bits)
    _weigh_blocks(acc, scores, vectors, value_cache, *blocks)
    for v in range(vectors):
        row, head = first + t0 + v // group, kv_head * group + v % group
        for d in range(dim):
            out[row, head, d] = as_element(out, acc[v, d])  # rounded where out is bfloat16


# Each pass over the blocks, and the softmax between them, is a function compiled on its own
# instead of inlined into `_attend`: LLVM makes faster code of each loop alone. The same bits; on
# two threads of an AMD EPYC Zen 4, alternating, K/V out of cache at every call: the book's
# model's decode (64 sequences of 100-350 tokens) 0.97x the time of the inlined kernel with the
# cache on huge pages, as the engine keeps it (0.88-0.90x on 4 KiB pages), Qwen3-0.6B's shape in
# bfloat16 0.97x at batch 8 and 0.98x for a 512-token prefill chunk.
@njit(cache=True, fastmath=FASTMATH)
def _score_blocks(
    scores,
    queries,
    vectors,
    key_cache,
    value_cache,
    table,
    last_visible,
    kv_head,
    simd,
    staged,
    scale,
):
    """Pass 1 of `_attend`: `scores[v, j]` for every key j < `last_visible` of the table's blocks,
    each key row read once. `value_cache` only to ask for each block's values ahead of pass 2.
    `queries`: scaled, in float32 -- or, with BFLOAT16_DOT_PRODUCTS, the bfloat16 queries as they
    are, each score then scaled by `scale`."""
    block_size = key_cache.shape[1]
    num_blocks = (last_visible + block_size - 1) // block_size
    dots = simd == BFLOAT16_DOT_PRODUCTS
    stage = simd and vectors >= STAGE_MIN_VECTORS and not dots
    # Prefetching, pass 1: the keys two blocks ahead into the first-level cache and KEYS_L2_AHEAD
    # blocks ahead into the second (`_attend_units` asked for the first ones before the unit
    # began), and each block's values into the second-level cache for pass 2 (at the book's shape
    # a unit's values are 2 KiB a block, 32 KiB for 256 keys: that cache holds them many times
    # over). Memory is the kernel's limit on a step of many sequences, whose K/V are in no cache:
    # the book's model, 64 sequences of 150-350 tokens, 6 layers, took 7.6-7.9 ms on one thread of
    # an AMD EPYC Zen 4 this way against 9.1-9.5 ms with the next key block alone prefetched, and
    # an engine's batch-64 decode pass 483-493 us a layer against 550.
    if num_blocks > 1:
        _prefetch_block(key_cache, table[1], kv_head, False)
    # asked for once more (`_attend_units` did, a unit ago): the kernel alone took 0.87-0.90x the
    # time on one thread with this than without (Qwen3-0.6B's shape, as at KEYS_L2_AHEAD) --
    # likely a prefetch finding no free slot among the misses in flight is dropped
    for ahead in range(2, min(KEYS_L2_AHEAD, num_blocks)):
        _prefetch_block(key_cache, table[ahead], kv_head, True)
    for logical in range(num_blocks):
        if logical + 2 < num_blocks:
            _prefetch_block(key_cache, table[logical + 2], kv_head, False)
        if logical + KEYS_L2_AHEAD < num_blocks:
            _prefetch_block(key_cache, table[logical + KEYS_L2_AHEAD], kv_head, True)
        _prefetch_block(value_cache, table[logical], kv_head, True)
        n, base = min(block_size, last_visible - logical * block_size), logical * block_size
        if dots:
            keys = key_cache[table[logical]]
            _scores_bfloat16(scores, queries, vectors, keys, kv_head, n, base, scale)
        elif stage:  # the head's keys once, contiguous, in float32, for every vector of the tile
            _stage_rows(staged, key_cache[table[logical]], kv_head, -(-n // 8) * 8)
            _scores_simd(scores, queries, vectors, staged, 0, n, base)
        elif simd:
            _scores_simd(scores, queries, vectors, key_cache[table[logical]], kv_head, n, base)
        else:
            _scores_plain(scores, queries, vectors, key_cache[table[logical]], kv_head, n, base)


@njit(cache=True, fastmath=FASTMATH)
def _weigh_blocks(acc, scores, vectors, value_cache, table, last_visible, kv_head, simd, staged):
    """Pass 2 of `_attend`: `acc[v]` += each value row j < `last_visible` times `scores[v, j]`,
    each value row read once. A prefill tile (STAGE_MIN_VECTORS vectors or more) copies every
    block's rows of the head into `staged` first, one block after another, then weighs them all
    in one `_values_simd` call: its register tiles are loaded and stored once a unit instead of
    once a block, and each runs through all the unit's keys. The same sums in the same order."""
    block_size = value_cache.shape[1]
    num_blocks = (last_visible + block_size - 1) // block_size
    stage = simd and vectors >= STAGE_MIN_VECTORS
    for logical in range(num_blocks):
        if logical + 1 < num_blocks:
            _prefetch_block(value_cache, table[logical + 1], kv_head, False)
        n, base = min(block_size, last_visible - logical * block_size), logical * block_size
        values = value_cache[table[logical]]
        if stage:
            _stage_rows(staged[base : base + block_size], values, kv_head, n)
        elif simd:
            _values_simd(acc, scores, vectors, values, kv_head, n, base, simd >= WIDE_TILE)
        else:
            _values_plain(acc, scores, vectors, values, kv_head, n, base)
    if stage:
        _values_simd(acc, scores, vectors, staged, 0, last_visible, 0, simd >= WIDE_TILE)


@njit(cache=True, inline="always")
def _write_new_rows(k_new, v_new, slot_mapping, key_cache, value_cache):
    """The new keys and values to their slots, before any attending: every unit may read them. A
    plain loop (a copy of a few KiB): a parallel region would cost more to start than it saves."""
    block_size = key_cache.shape[1]
    for row in range(k_new.shape[0]):
        block, offset = divmod(slot_mapping[row], block_size)
        key_cache[block, offset] = k_new[row]
        value_cache[block, offset] = v_new[row]


@njit(cache=True, inline="always")
def _last_visible(context_lens, query_start, seq, t1):
    """The keys the last row of sequence `seq`'s tile ending at its new row `t1` sees: those cached
    before its new rows, and its new rows up to that one."""
    return context_lens[seq] - (query_start[seq + 1] - query_start[seq]) + t1


@njit(cache=True, inline="always")
def _prefetch_first_keys(key_cache, block_tables, context_lens, query_start, work, i):
    """Unit `i`'s first KEYS_L2_AHEAD blocks of keys into the second-level cache (none past the
    end of `work`): `_score_blocks` asks for the rest as it goes."""
    if i >= work.shape[0]:
        return
    seq, t1, kv_head = work[i, 0], work[i, 2], work[i, 3]
    last_visible = _last_visible(context_lens, query_start, seq, t1)
    block_size = key_cache.shape[1]
    for logical in range(min(KEYS_L2_AHEAD, (last_visible + block_size - 1) // block_size)):
        _prefetch_block(key_cache, block_tables[seq, logical], kv_head, True)


@njit(cache=True, fastmath=FASTMATH)
def _attend_units(
    out, q, key_cache, value_cache, block_tables, context_lens, query_start, work, scale, simd
):
    """Every unit of `work` in turn (one thread's share): scratch arrays sized for the largest,
    allocated once, then `_attend` per unit."""
    block_size = key_cache.shape[1]
    group = q.shape[1] // key_cache.shape[2]
    # Scratch: the largest tile's query vectors, their accumulators, and a score for every key its
    # last row sees, rounded up to whole blocks.
    vectors, width = 1, block_size
    for i in range(work.shape[0]):
        seq, t0, t1 = work[i, 0], work[i, 1], work[i, 2]
        last_visible = _last_visible(context_lens, query_start, seq, t1)
        vectors = max(vectors, (t1 - t0) * group)
        width = max(width, -(-last_visible // block_size) * block_size)
    scratch = (
        np.empty((vectors, q.shape[2]), dtype=np.float32),  # the queries, scaled
        np.empty((vectors, q.shape[2]), dtype=q.dtype),  # or as they are (BFLOAT16_DOT_PRODUCTS)
        np.empty((vectors, q.shape[2]), dtype=np.float32),  # their accumulators
        np.empty((vectors, width), dtype=np.float32),  # their scores
        np.empty(width, dtype=np.int32),  # _exp_in_place's exponent bits
        # one head's rows of a block (the scores' pass) or of every block (the values'), in
        # float32, where a tile stages them (`STAGE_MIN_VECTORS`)
        np.empty((width if vectors >= STAGE_MIN_VECTORS else 0, 1, q.shape[2]), np.float32),
    )
    _prefetch_first_keys(key_cache, block_tables, context_lens, query_start, work, 0)
    for i in range(work.shape[0]):
        seq, t0, t1, kv_head = work[i, 0], work[i, 1], work[i, 2], work[i, 3]
        first = query_start[seq]
        # the next unit's first keys, asked for while this one runs: otherwise every unit would
        # begin by waiting on memory, and a decode's units are many and short
        _prefetch_first_keys(key_cache, block_tables, context_lens, query_start, work, i + 1)
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
            simd,
            scratch,
        )


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
    simd,
):
    """`work` rows are (sequence, first row, end row, K/V head) relative to the sequence's new
    rows; thread i does `work[work_start[i]:work_start[i + 1]]` (see `plan_work`). `simd`: which
    loops (`vector_paths`). Returns whether every thread finished its share: numba's worker
    threads drop an exception they raise (see `_launch`)."""
    _write_new_rows(k_new, v_new, slot_mapping, key_cache, value_cache)
    metadata = (block_tables, context_lens, query_start)
    finished = np.zeros(work_start.shape[0] - 1, dtype=np.bool_)
    for thread in prange(work_start.shape[0] - 1):
        share = work[work_start[thread] : work_start[thread + 1]]
        _attend_units(out, q, key_cache, value_cache, *metadata, share, scale, simd)
        finished[thread] = True  # not reached if the share raised
    return finished.all()


@njit(cache=True, fastmath=FASTMATH, nogil=True)
def _paged_attention_serial(
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
    simd,
):
    """The kernel on the calling thread alone: no parallel region to start (each wakes numba's
    sleeping threads, tens of microseconds on a VM), for a process that runs on one
    core -- a forward worker (`minivllm.runner.workers`) or a one-thread engine. Same arguments,
    same work, same results (and True: an exception here reaches the caller)."""
    _write_new_rows(k_new, v_new, slot_mapping, key_cache, value_cache)
    metadata = (block_tables, context_lens, query_start)
    _attend_units(out, q, key_cache, value_cache, *metadata, work, scale, simd)
    return True


# The last compiled function of the file, for the exercise in it: a copy that takes its markers
# out keeps every compiled function on its line, and numba names its cache files by that line
# (tools/student.py `seed_kernel_cache`).
@njit(cache=True, fastmath=FASTMATH)
def _softmax_rows(scores, vectors, group, first_seen, width, exponent_bits):
    """Row v of `scores` becomes the softmax of its first `first_seen + v // group` scores -- the
    tile's query row `v // group` sees one key more than the row before (causal) -- and zero for
    the rest of its `width`."""
    for v in range(vectors):
        row, seen = scores[v], first_seen + v // group
        # EXERCISE ch07.1: the kernel's softmax -- row[:seen] becomes its softmax, row[seen:width] 0
        ### BEGIN SOLUTION
        largest = _largest(row, seen)  # subtracted first, so no exponential overflows
        for j in range(seen):
            row[j] -= largest
        _exp_in_place(row, seen, exponent_bits)
        total = np.float32(0.0)
        for j in range(seen):
            total += row[j]
        inverse = np.float32(1.0) / total
        for j in range(seen):
            row[j] *= inverse
        for j in range(seen, width):
            row[j] = 0.0
        ### END SOLUTION


@njit(cache=True, fastmath=FASTMATH, inline="always")
def _largest(row, n):
    """The largest of `row[:n]` (n >= 1), eight lanes at a time. LLVM leaves a plain max loop
    scalar, each comparison waiting on the one before (without `nnan` it may not reorder a max):
    at the book's model's decode, 0.5 of the 4 us a unit of 256 keys took. A NaN score is passed
    over here (`max8`), and still reaches the output through its exponential."""
    largest = row[0]
    whole = n - n % 8
    if whole:
        lanes = load8(row, 0)
        for j in range(8, whole, 8):
            lanes = max8(lanes, load8(row, j))
        largest = largest_lane(lanes)
    for j in range(whole, n):
        largest = max(largest, row[j])
    return largest


def _kernel_for(num_threads: int):
    """The parallel kernel, or the serial one when there is one thread to run it on."""
    return _paged_attention_serial if num_threads == 1 else _paged_attention_kernel


def _launch(kernel, *args) -> None:
    """Run `kernel` (`_kernel_for`'s) on `args`, one launch at a time in the process. An exception
    raised in a parallel region is lost -- numba's worker threads cannot hand it to the caller
    (numba issue 2811); only the thread's unfinished share tells -- so the same work runs again on
    this thread, where it is raised. Writing the new rows twice writes the same values."""
    # KERNEL LAUNCH: where a probe copy (tools/student.py) records this file's compiled regions
    if kernel is _paged_attention_kernel:  # the first parallel launch would start the pool
        start_thread_pool()
    with LAUNCH:
        if kernel(*args):
            return
        _paged_attention_serial(*args)
    raise RuntimeError("a thread of the parallel kernel stopped early; on one thread it did not")


def vector_paths(
    fits: bool, wide_tile: bool | None = None, bfloat16: bool = False, dots: bool | None = None
) -> int:
    """The kernels' `simd` argument: PLAIN where the vector paths do not fit (or are not asked
    for), else VECTORS, or WIDE_TILE with `wide_tile` (default: where the CPU has the registers
    for it, `WIDE_VALUES_TILE`) -- or, with the wide tile, BFLOAT16_DOT_PRODUCTS for `bfloat16`
    queries and cache with `dots` (default: where the CPU has AVX-512 BF16, `simd.BFLOAT16_DOTS`;
    such a CPU has the wide tile's registers too)."""
    wide = WIDE_VALUES_TILE if wide_tile is None else wide_tile
    if not fits:
        return PLAIN
    if bfloat16 and wide and (BFLOAT16_DOTS if dots is None else dots):
        return BFLOAT16_DOT_PRODUCTS
    return WIDE_TILE if wide else VECTORS


def simd_fits(head_dim: int, block_size: int) -> bool:
    """Whether the vector paths can run: keys eight at a time inside a block, values sixteen lanes
    of head_dim at a time. Other shapes take the plain loops: equal to float32 rounding."""
    return head_dim % 16 == 0 and block_size % 8 == 0


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
    thread doing every prefill. In a pass of decodes alone, two or more for every thread, a
    sequence's K/V heads go to one thread together. Returns `work` `[units, 4]` grouped by thread
    and `work_start` `[threads + 1]`."""
    query_lens = np.diff(query_start)
    tiles = -(-query_lens // QUERY_TILE)
    seq = np.repeat(np.arange(len(query_lens)), tiles)
    tile = np.arange(len(seq)) - np.repeat(np.cumsum(tiles) - tiles, tiles)
    t0 = tile * QUERY_TILE
    t1 = np.minimum(t0 + QUERY_TILE, query_lens[seq])
    tiled = np.stack([seq, t0, t1], axis=1)
    tiled = tiled[np.argsort(-unit_cost(tiled, context_lens, query_start), kind="stable")]
    # every K/V head of a tile is a unit of the same cost, next to each other in the deal. In a
    # pass of decodes, dealt together: one thread reads a sequence's blocks for each of its heads
    # in turn (in a contiguous cache a head is a slice of every token row; the engine's pool keeps
    # each head's rows of a block together, `storage.cpu_kv_pool`) instead of two threads reading
    # the same blocks. Measured on contiguous caches: a batch-64 decode call on two threads of an
    # AMD EPYC Zen 4 took 3.9-4.9 ms against 5.4-5.5 at Qwen3-0.6B's shape (8 K/V heads, bfloat16),
    # 1.71-1.73 against 1.85-2.14 ms at the book's (2, float32). A prefill chunk's tiles stay
    # split by head: dealt whole, they would leave the threads less even.
    heads = np.tile(np.arange(num_kv_heads), len(tiled))
    units = np.column_stack([np.repeat(tiled, num_kv_heads, axis=0), heads])
    decodes = len(query_lens) >= 2 * num_threads and bool((query_lens == 1).all())
    together = num_kv_heads if decodes else 1
    lap = np.arange(len(units)) // together % (2 * num_threads)
    thread = np.where(lap < num_threads, lap, 2 * num_threads - 1 - lap)
    by_thread = np.argsort(thread, kind="stable")
    work_start = np.searchsorted(thread[by_thread], np.arange(num_threads + 1))
    return np.ascontiguousarray(units[by_thread], dtype=np.int64), work_start.astype(np.int64)


# What the kernel reads a cache as: float32, or bfloat16's bits (`kernel_array`).
CACHE_DTYPES = (np.dtype(np.float32), np.dtype(np.int16))
# The cache dtypes the engine's backend takes (torch's names for the two above).
BACKEND_DTYPES = (torch.float32, torch.bfloat16)


def kernel_array(tensor: torch.Tensor) -> np.ndarray:
    """A CPU tensor as the kernel takes it, sharing its memory: float32 as it is, bfloat16 as its
    bits (int16) -- numpy has no bfloat16, and `simd.load8` widens the bits to float32 itself."""
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy()
    return tensor.numpy()


def _check(
    q, key_cache, value_cache, block_tables, context_lens, query_start, k_new, v_new, slot_mapping
) -> None:
    """Every shape, dtype and length the kernel relies on, before it runs: the compiled loop does
    no bounds checks, so a bad argument would read or write the wrong memory instead of raising."""
    if q.dtype not in CACHE_DTYPES or key_cache.dtype not in CACHE_DTYPES:
        raise ValueError(
            f"q and the caches must be float32 or bfloat16 bits (int16), got {q.dtype} and "
            f"{key_cache.dtype}"
        )
    for name, array in (("value_cache", value_cache), ("k_new", k_new), ("v_new", v_new)):
        if array.dtype != key_cache.dtype:
            raise ValueError(f"{name} must be {key_cache.dtype} as key_cache is, got {array.dtype}")
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
    simd: bool | None = None,
    threads: int | None = None,
    wide_tile: bool | None = None,
    bfloat16_dots: bool | None = None,
) -> np.ndarray:
    """Attention of every query row over its own sequence's cached keys and values, read in place
    through the block tables. `q` `[tokens, heads, head_dim]` holds each sequence's new rows end to
    end (`query_start` `[seqs + 1]`); sequence i's rows are its last positions, so its context
    (`context_lens[i]`, the new rows included) ends at its last row. Caches `[num_blocks,
    block_size, kv_heads, head_dim]`. `q` and the caches are float32, or bfloat16 as their bits
    (`kernel_array`), which the kernel widens to float32 as it reads them; it computes in float32
    and writes `out` (default: a new array like `q`) in out's dtype, rounded where bfloat16. With
    `k_new`, `v_new` (`[tokens, kv_heads, head_dim]`, the caches' dtype) and `slot_mapping`
    (`[tokens]`) the new rows' keys and values are written to their slots first, in the same call.
    `simd`: the vector paths or the plain loops (default: the vector paths where `simd_fits`).
    `threads`: how many threads run it (default: numba's setting); with one, the serial kernel
    runs on the calling thread. `wide_tile`: `_values_simd`'s eight-vector tile (default: where
    the CPU has AVX-512's registers); either tile runs on any CPU, with the same results bit for
    bit. `bfloat16_dots`: bfloat16 `q` and caches scored by bfloat16 dot products
    (`_scores_bfloat16`; default: where the CPU has AVX-512 BF16, and the wide tile), to float32
    rounding of the float32 scores. Returns `[tokens, heads, head_dim]`."""
    block_tables = np.ascontiguousarray(block_tables, dtype=np.int64)
    context_lens = np.ascontiguousarray(context_lens, dtype=np.int64)
    query_start = np.ascontiguousarray(query_start, dtype=np.int64)
    if k_new is None:  # nothing to write: zero rows, which the kernel skips
        k_new = v_new = np.empty((0, key_cache.shape[2], q.shape[2]), dtype=key_cache.dtype)
        slot_mapping = np.empty(0, dtype=np.int64)
    slot_mapping = np.ascontiguousarray(slot_mapping, dtype=np.int64)
    args = (q, key_cache, value_cache, block_tables, context_lens, query_start)
    _check(*args, k_new, v_new, slot_mapping)
    fits = simd_fits(q.shape[2], key_cache.shape[1])
    if simd and not fits:
        raise ValueError(
            f"the vector paths need head_dim a multiple of 16 and block_size of 8, got "
            f"{q.shape[2]} and {key_cache.shape[1]}: pass simd=False"
        )
    scale = q.shape[2] ** -0.5 if scale is None else scale
    out = np.empty_like(q) if out is None else out
    if out.shape != q.shape or out.dtype not in CACHE_DTYPES:
        raise ValueError(
            f"out must be {list(q.shape)} as q is, float32 or bfloat16 bits (int16); got "
            f"{list(out.shape)} {out.dtype}"
        )
    threads = default_threads() if threads is None else threads
    work = plan_work(context_lens, query_start, key_cache.shape[2], threads)
    args = (key_cache, value_cache, block_tables, context_lens, query_start, *work)
    bfloat16 = q.dtype == key_cache.dtype == np.int16
    simd = vector_paths(fits and simd is not False, wide_tile, bfloat16, bfloat16_dots)
    _launch(
        _kernel_for(threads), out, q, k_new, v_new, slot_mapping, *args, np.float32(scale), simd
    )
    return out


# A pass costing less than this (query rows x the keys they see, summed over sequences and K/V
# heads) runs on one thread. Between two layers' kernels the engine runs torch's matmuls, so the
# kernel's second thread is asleep at each launch, and waking it has a cost; on the book's 2-core
# virtual machine (benchmarks/kernel_threads.py, a run per layer):
# * OpenMP: one thread was faster for a lone sequence (1 x 64 to 1 x 1024 tokens of context),
#   two from 16 x 175 on, and a batch-64 decode step took 13-19 % less;
# * the workqueue, whose launch wakes both worker threads and puts the caller to sleep: one thread
#   was faster at every decode batch of the target model (up to 64 x 700), two from 64 x 2000.
# The defaults sit between; a machine where waking a thread is cheaper or dearer can set
# MINIVLLM_PARALLEL_MIN_COST.
def _parallel_min_cost() -> int:
    setting = os.environ.get("MINIVLLM_PARALLEL_MIN_COST")
    if setting is None:
        return 4 * 1024 if openmp_layer() else 128 * 1024
    try:
        return int(setting)
    except ValueError:
        raise ValueError(
            f"MINIVLLM_PARALLEL_MIN_COST must be a whole number (query rows x keys), got "
            f"{setting!r}"
        ) from None


PARALLEL_MIN_COST = _parallel_min_cost()


def pass_cost(context_lens: np.ndarray, query_start: np.ndarray, num_kv_heads: int) -> int:
    """A pass's attention work: each sequence's new rows times the keys they see (`unit_cost`
    for its whole chunk), over its K/V heads."""
    if query_start[-1] == len(context_lens):  # decodes alone: a row sees its whole context
        return int(context_lens.sum()) * num_kv_heads
    rows = np.diff(query_start)
    chunks = np.column_stack([np.arange(len(rows)), np.zeros_like(rows), rows])
    return int(unit_cost(chunks, context_lens, query_start).sum()) * num_kv_heads


# The memory layouts `warm_up` compiles the kernel for: a caller's own contiguous arrays
# (`paged_attention_cpu`'s `[num_blocks, block_size, kv_heads, head_dim]`), and the engine's pool,
# whose heads lie outside the block's rows (`storage.cpu_kv_pool`). numba compiles a kernel per
# layout of its arrays: the same code, each its own machine code.
LAYOUTS = ("contiguous", "pool")


def warm_up(
    threads: int | None = None, dtype: torch.dtype = torch.float32, layouts=LAYOUTS
) -> None:
    """Compile the kernel for `threads` (default: `default_threads()`), a cache of `dtype` and
    each of `layouts` now, or load it from numba's cache: a few seconds a layout the first time on
    a machine, milliseconds after. The engine calls it when it starts (for its pool's layout), so
    that its first step does not."""
    new = kernel_array(torch.zeros((1, 2, 2), dtype=dtype))
    q = new.copy()  # the engine's queries are in its model's dtype, which its cache has
    for layout in layouts:
        # K and V of one block of two rows, two heads of two
        if layout == "pool":
            caches = cpu_kv_pool((2, 1, 2, 2, 2), dtype)
        else:
            caches = torch.zeros((2, 1, 2, 2, 2), dtype=dtype)
        paged_attention_cpu(
            q,
            kernel_array(caches[0]),
            kernel_array(caches[1]),
            np.zeros((1, 1), dtype=np.int64),
            np.ones(1, dtype=np.int64),
            np.array([0, 1]),
            k_new=new,
            v_new=new,
            slot_mapping=np.zeros(1, dtype=np.int64),
            threads=threads,
        )


class NumbaPagedAttention:
    """The engine's attention backend on the CPU kernel: one kernel call per layer writes the new
    K/V through the slot mapping and attends decodes and prefill chunks alike. A float32 or a
    bfloat16 cache; the kernel computes in float32 either way. A float32 or bfloat16 model's
    queries go in as they are and its output comes back in its dtype, from the kernel itself;
    another dtype's (float16) go through float32.

    Around each call nothing is converted or looked up that the last layer's call had already:
    in a decode step of Qwen3-0.6B's shape the call's own tensor work -- the caches' arrays, q to
    float32 and the output back, each a small torch op on a host whose caches the layer's weights
    just streamed through -- took 82 us a layer beside the kernel's 117 at batch 1, and 140
    beside 519 at batch 8 (AMD EPYC Zen 4)."""

    # The pool this kernel reads best: a block's rows of each head side by side
    # (`storage.cpu_kv_pool`); the engine makes its storage so.
    heads_outer = True
    # storage -> its last decode pass's (context lengths, threads, work plan), for `_plan`
    _plans: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
    # storage -> (its tensor's address and shape, each layer's (key cache, value cache) as the
    # kernel takes them): made once, as the caches do not move -- again if the storage was given a
    # new tensor. A weak key: the arrays go with their engine's storage.
    _caches: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __init__(self, storage: PagedKVStorage, batch: VarlenBatch) -> None:
        if storage.kv.device.type != "cpu" or storage.dtype not in BACKEND_DTYPES:
            raise ValueError(
                f"the numba backend runs on a float32 or bfloat16 cache in CPU memory, got "
                f"{storage.dtype} on {storage.kv.device}: use attention_backend='torch'"
            )
        self.storage = storage
        where = storage.kv.data_ptr(), storage.kv.shape
        made, caches = self._caches.get(storage, (None, None))
        if made != where:
            caches = [tuple(map(kernel_array, layer.unbind())) for layer in storage.kv.unbind()]
            self._caches[storage] = where, caches
        self.caches = caches
        # The batch's metadata as numpy, once per pass: the kernel reads it in every layer.
        self.slot_mapping = batch.slot_mapping.numpy().astype(np.int64, copy=False)
        self.block_tables = batch.block_tables.numpy().astype(np.int64, copy=False)
        self.context_lens = batch.context_lens.numpy().astype(np.int64, copy=False)
        self.query_start = batch.query_start.numpy().astype(np.int64, copy=False)
        self.scale = np.float32(storage.config.head_dim**-0.5)
        # bfloat16 dot products where the queries are bfloat16 too (a bfloat16 model's: `__call__`)
        bfloat16 = storage.dtype == torch.bfloat16
        self.simd = vector_paths(
            simd_fits(storage.config.head_dim, storage.block_size), None, bfloat16
        )
        self.checked = False  # the arguments are checked in the first layer, the same in all
        threads = loop_threads()
        kv_heads = storage.config.n_kv_heads
        if pass_cost(self.context_lens, self.query_start, kv_heads) < PARALLEL_MIN_COST:
            threads = 1  # too little work to pay for waking the other threads
        if threads > 1:  # a one-thread process never starts numba's thread pool
            use_threads(threads)
        self.kernel = _kernel_for(threads)
        self.work = self._plan(storage, threads)

    def _plan(self, storage: PagedKVStorage, threads: int) -> tuple[np.ndarray, np.ndarray]:
        """`plan_work` for this pass -- or the last pass's plan, where both are decodes of the
        same sequences, each a token further on: every unit then costs one more and they are dealt
        as before. A decode step plans its units in tens of microseconds of numpy calls, as long as
        a thread of its kernel takes for several sequences' attention."""
        lens = self.context_lens
        decodes = len(self.slot_mapping) == len(lens)  # one new row a sequence
        last_lens, last_threads, work = self._plans.pop(storage, (None, 0, None))
        same = last_lens is not None and len(last_lens) == len(lens) and last_threads == threads
        if not (decodes and same and (last_lens + 1 == lens).all()):
            work = plan_work(lens, self.query_start, storage.config.n_kv_heads, threads)
        if decodes:
            self._plans[storage] = (lens.copy(), threads, work)
        return work

    @staticmethod
    def warm_up(threads: int | None = None, dtype: torch.dtype = torch.float32) -> None:
        """Compile (or load) the kernels a pass on `threads` threads runs over a cache of `dtype`
        (default: torch's count, as `__init__` picks): the parallel one, and the serial one a small
        pass runs."""
        threads = loop_threads() if threads is None else threads
        threads = min(threads, numba.config.NUMBA_NUM_THREADS)
        warm_up(threads, dtype, ("pool",))
        if threads > 1:
            warm_up(1, dtype, ("pool",))

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        key_cache, value_cache = self.caches[layer]
        model_dtype, cache_dtype = q.dtype, self.storage.dtype
        # the queries as they are where the kernel reads their dtype (else in float32), the new
        # keys and values as the cache holds them; `to` and `contiguous` return the tensor itself
        # where it is so already
        if model_dtype not in BACKEND_DTYPES:
            q = q.to(torch.float32)
        q = q.contiguous()
        out = torch.empty_like(q)  # the kernel writes it in q's dtype
        k, v = (kernel_array(x.to(cache_dtype).contiguous()) for x in (k, v))
        q_array, out_array = kernel_array(q), kernel_array(out)
        metadata = (self.block_tables, self.context_lens, self.query_start)
        if not self.checked:
            _check(q_array, key_cache, value_cache, *metadata, k, v, self.slot_mapping)
            self.checked = True
        args = (out_array, q_array, k, v, self.slot_mapping, key_cache, value_cache, *metadata)
        simd = self.simd if q.dtype == torch.bfloat16 else min(self.simd, WIDE_TILE)
        _launch(self.kernel, *args, *self.work, self.scale, simd)
        return out if out.dtype == model_dtype else out.to(model_dtype)
