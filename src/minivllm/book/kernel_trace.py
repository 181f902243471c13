"""Watch a kernel read memory: every element a simulated CUDA thread reads, and who read it (chapter
07).

In numba's CUDA simulator each CUDA thread is a Python thread and a kernel's arrays are numpy
arrays, so a numpy array that notes its own reads sees exactly what the kernel touches: which thread
block and which thread read which element, in each thread's own order. Chapter 07 draws these reads,
in the manner of GPU-Puzzles, to show how the paged-attention kernel walks a sequence's block table.

The simulator copies a numpy argument before a launch (it emulates a separate device memory), which
would leave the reads on the copy; `recorded` therefore hands the kernel a simulated *device* array,
which it uses as it is. Simulator only: on a GPU the reads happen in hardware, out of Python's
sight.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from minivllm.attention.cuda.simulator import SIMULATOR


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
