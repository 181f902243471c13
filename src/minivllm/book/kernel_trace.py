"""Watch a kernel read memory: every element a simulated CUDA thread reads, and who read it (chapter
07).

In numba's CUDA simulator each CUDA thread is a Python thread and a kernel's arrays are numpy
arrays, so a numpy array that notes its own reads sees exactly what the kernel touches: which thread
block and which thread read which element, in each thread's own order. Chapter 08 draws these reads,
in the manner of GPU-Puzzles, to show how the paged-attention kernel walks a sequence's block table.

The simulator copies a numpy argument before a launch (it emulates a separate device memory), which
would leave the reads on the copy; `recorded` therefore hands the kernel a simulated *device* array,
which it uses as it is. Simulator only: on a GPU the reads happen in hardware, out of Python's
sight; `in_simulator` runs a traced launch in a child process with the simulator switched on,
so the chapter draws the same figures on a GPU machine.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch

from minivllm.attention.cuda.grouped import (
    default_lanes_per_token,
    grouped_decode_kernel,
    shared_words,
)
from minivllm.attention.cuda.kernels import paged_attention_v1
from minivllm.attention.cuda.launch import shared_bytes
from minivllm.attention.cuda.simulator import SIMULATOR, WARP_SIZE
from minivllm.book.kernel_check import random_inputs, reference_attention

Result = TypeVar("Result")


@dataclass(frozen=True)
class Read:
    block: tuple[int, int, int]  # blockIdx (x, y, z) of the thread block that read
    thread: int  # threadIdx.x of the reading thread
    index: tuple[int, ...]  # the element it read


class RecordingArray(np.ndarray):
    """A numpy array that appends a `Read` to `self.reads` for every single element read from it by
    a simulated CUDA thread. Views of it (a row, say) record into the same list, with their own
    indices."""

    reads: list[Read] | None

    def __array_finalize__(self, obj) -> None:
        self.reads = getattr(obj, "reads", None)

    def __getitem__(self, index):
        value = super().__getitem__(index)
        index = index if isinstance(index, tuple) else (index,)  # a 1-D array's index is bare
        if self.reads is not None and _is_element(index, self.ndim):
            thread = threading.current_thread()
            if hasattr(thread, "threadIdx"):  # a simulated CUDA thread, not the host
                self.reads.append(
                    Read(tuple(thread.blockIdx), thread.threadIdx.x, tuple(int(i) for i in index))
                )
        return value


def _is_element(index: tuple, ndim: int) -> bool:
    return len(index) == ndim and all(isinstance(i, (int, np.integer)) for i in index)


def recorded(array: np.ndarray, reads: list[Read]):
    """`array` as a simulated device array that records every element a kernel reads into `reads`.
    Pass the result to a kernel launch in place of `array`."""
    if not SIMULATOR:
        raise RuntimeError(
            "recording reads needs numba's CUDA simulator; on a GPU the reads happen in hardware"
        )
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

    watched = np.ascontiguousarray(array).view(RecordingArray)
    watched.reads = reads
    return FakeCUDAArray(watched)


def reads_by_thread(
    reads: list[Read],
) -> dict[tuple[tuple[int, int, int], int], list[tuple[int, ...]]]:
    """(block, thread) -> the indices it read, in its own program order. Threads run concurrently,
    so only the order within one thread is defined; the interleaving of different threads is not."""
    grouped: dict[tuple[tuple[int, int, int], int], list[tuple[int, ...]]] = {}
    for read in reads:
        grouped.setdefault((read.block, read.thread), []).append(read.index)
    return dict(sorted(grouped.items()))


def in_simulator(trace: Callable[..., Result], *args) -> Result:
    """`trace(*args)` where numba's CUDA simulator runs: here when it does, else (a process with a
    real GPU) in a fresh child process started with NUMBA_ENABLE_CUDASIM=1 -- numba reads it once,
    at import, so this process cannot switch. `trace` must be importable (a module's function) and
    return something picklable, such as lists of `Read`."""
    if SIMULATOR:
        return trace(*args)
    before = os.environ.get("NUMBA_ENABLE_CUDASIM")
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"  # the child inherits the environment at its start
    try:
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            return pool.apply(trace, args)
    finally:
        if before is None:
            del os.environ["NUMBA_ENABLE_CUDASIM"]
        else:
            os.environ["NUMBA_ENABLE_CUDASIM"] = before


@dataclass(frozen=True)
class SequenceTrace:
    """The reads of one v1 launch over one sequence: its keys, its values, its block table."""

    key_reads: list[Read]
    value_reads: list[Read]
    block_table: list[int]
    num_blocks: int


def trace_v1(head_dim: int, block_size: int = 16) -> SequenceTrace:
    """One sequence of 40 tokens, its three blocks scattered over a pool of eight, one head, two
    warps: v1 launched by hand -- grid, threads per block, stream, shared-memory bytes -- on
    recording caches, checked against the reference."""
    q = random_inputs([40], 1, 1, head_dim, block_size, seed=3, device="cpu")[0]
    k_cache, v_cache = (
        torch.randn(8, block_size, 1, head_dim, generator=torch.Generator().manual_seed(seed))
        for seed in (4, 5)
    )
    table, lens = (
        torch.tensor([[5, 2, 7]], dtype=torch.int32),
        torch.tensor([40], dtype=torch.int32),
    )
    key_reads, value_reads = [], []
    out = torch.full_like(q, float("nan"))
    threads = 2 * WARP_SIZE
    paged_attention_v1[(1, 1), threads, 0, shared_bytes(head_dim, threads, 40)](
        out.numpy(),
        q.numpy(),
        recorded(k_cache.numpy(), key_reads),
        recorded(v_cache.numpy(), value_reads),
        table.numpy(),
        lens.numpy(),
        head_dim**-0.5,
        1,  # query heads per K/V head
    )
    expected = reference_attention(q, k_cache, v_cache, table, lens)
    assert torch.allclose(out, expected, rtol=1e-5, atol=1e-6), "the recorded launch is wrong"
    return SequenceTrace(key_reads, value_reads, table[0].tolist(), num_blocks=8)


@dataclass(frozen=True)
class GroupTrace:
    """The key reads of v1 and of v3 over one sequence whose query heads share one K/V head, and
    v3's reads of the block table."""

    v1_key_reads: list[Read]
    v3_key_reads: list[Read]
    v3_table_reads: list[Read]


def trace_group(head_dim: int, group: int = 4, block_size: int = 16) -> GroupTrace:
    """One sequence of 40 tokens, `group` query heads on one K/V head: v1 runs a thread block per
    query head, v3 one for the group. Both launched by hand on recording caches, v3 checked."""
    q = random_inputs([40], group, 1, head_dim, block_size, seed=9, device="cpu")[0]
    k_cache, v_cache = (
        torch.randn(8, block_size, 1, head_dim, generator=torch.Generator().manual_seed(seed))
        for seed in (10, 11)
    )
    table, lens = (
        torch.tensor([[5, 2, 7]], dtype=torch.int32),
        torch.tensor([40], dtype=torch.int32),
    )
    v1_reads, v3_reads, table_reads = [], [], []
    paged_attention_v1[(1, group), WARP_SIZE, 0, shared_bytes(head_dim, WARP_SIZE, 40)](
        torch.empty_like(q).numpy(),
        q.numpy(),
        recorded(k_cache.numpy(), v1_reads),
        v_cache.numpy(),
        table.numpy(),
        lens.numpy(),
        head_dim**-0.5,
        group,
    )
    lanes = default_lanes_per_token(head_dim)
    v3 = grouped_decode_kernel(head_dim, group, lanes, block_size)
    out = torch.full((1, group, 1, head_dim), float("nan"))
    words = shared_words(3, head_dim, group, WARP_SIZE, lanes)  # 3 table entries
    v3[(1, 1, 1), WARP_SIZE, 0, 4 * words](
        out.numpy(),
        torch.empty(1, group, 1).numpy(),  # partition maxima and sums: one partition, unused
        torch.empty(1, group, 1).numpy(),
        q.numpy(),
        recorded(k_cache.view(-1).numpy(), v3_reads),  # v3 takes the caches flattened
        v_cache.view(-1).numpy(),
        recorded(table.numpy(), table_reads),
        lens.numpy(),
        40,  # the longest context
        head_dim**-0.5,
        48,  # one partition: the whole table
    )
    expected = reference_attention(q, k_cache, v_cache, table, lens)
    assert torch.allclose(out[:, :, 0], expected, atol=1e-6), "the recorded v3 launch is wrong"
    return GroupTrace(v1_reads, v3_reads, table_reads)
