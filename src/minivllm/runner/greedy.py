"""A greedy step's pick on the CPU: each row's first largest logit, in vector lanes (issue 32).

torch's `argmax` on the CPU compares one element at a time, each comparison waiting on the one
before: over a real vocabulary (Qwen3's 151,936 tokens) a batch-8 decode step's float32 logits took
0.50 ms, batch 64 5.8 ms, where `amax` -- the same pass, vectorised -- took 0.03 and 0.4 (AMD EPYC
Zen 4, two threads). `first_largest` finds the largest eight lanes at a time, block by block,
remembering the first block that holds it, then looks for the first element equal to it in that
block alone: the index torch's `argmax` gives (its first occurrence), bit for bit, for any row
without a NaN -- the sampler never hands it one (`sampler.undrawable_rows` sets such rows aside
first).

numba compiles it on first use, where the sampler asks for it: only for float32 CPU logits of
`MIN_VOCAB` columns or more. A small vocabulary (the book's 259 bytes) and a GPU keep torch's.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit

from minivllm.attention.simd import largest_lane, load8, max8

BLOCK = 64  # elements a block: eight vectors of eight lanes, reduced to one maximum
# Below this many columns torch's own argmax is as fast as the call into compiled code.
MIN_VOCAB = 4096


@njit(cache=True, nogil=True, inline="always")
def _block_largest(row, start):
    """The largest of row[start : start + BLOCK]: eight vectors, reduced in a tree."""
    a = max8(load8(row, start), load8(row, start + 8))
    b = max8(load8(row, start + 16), load8(row, start + 24))
    c = max8(load8(row, start + 32), load8(row, start + 40))
    d = max8(load8(row, start + 48), load8(row, start + 56))
    return largest_lane(max8(max8(a, b), max8(c, d)))


@njit(cache=True, nogil=True)
def _first_largest(rows, out):
    """out[r] = the index of the first largest element of rows[r] (float32 `[R, V]`, C-contiguous,
    no NaN). A block's maximum replaces the best only where it is larger, so the block remembered
    is the first that holds the row's maximum; its first element equal to that is the answer."""
    width = rows.shape[1]
    whole = width - width % BLOCK
    for r in range(rows.shape[0]):
        row = rows[r]
        best, best_start = row[0], 0
        for start in range(0, whole, BLOCK):
            largest = _block_largest(row, start)
            if largest > best:
                best, best_start = largest, start
        for j in range(whole, width):  # the tail, past the last whole block
            if row[j] > best:
                best, best_start = row[j], j
        j = best_start
        while row[j] != best and j + 1 < width:  # the largest is in this block (no NaN)
            j += 1
        out[r] = j


def first_largest(logits: torch.Tensor) -> list[int]:
    """Each row's argmax of float32 CPU `logits` `[R, V]`, as `logits.argmax(-1)` gives it: the
    first index of the row's largest value. A row holding a NaN gets an index inside the row, not
    necessarily torch's (the NaN's)."""
    rows = logits.detach().contiguous().numpy()
    out = np.empty(rows.shape[0], dtype=np.int64)
    if rows.shape[1]:
        _first_largest(rows, out)
    return out.tolist()


def takes(logits: torch.Tensor) -> bool:
    """Whether `first_largest` is the faster way to these logits' argmax."""
    return (
        logits.device.type == "cpu"
        and logits.dtype == torch.float32
        and logits.dim() == 2
        and logits.shape[1] >= MIN_VOCAB
    )
