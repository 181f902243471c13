"""Switches numba's CUDA simulator on when torch sees no GPU (before anything imports
`numba.cuda`), and gives the simulator what it lacks for chapter 08's kernels.

`MINIVLLM_CUDA_COMPILE_ONLY=1` keeps the simulator off on a machine without a GPU: numba's real CUDA
target then compiles the kernels to PTX (`tools/kernel_registers.py` counts their registers with
ptxas), and nothing can be launched."""

from __future__ import annotations

import os
import sys
import threading
from contextlib import contextmanager

import torch

COMPILE_ONLY = os.environ.get("MINIVLLM_CUDA_COMPILE_ONLY") == "1"
if not torch.cuda.is_available() and not COMPILE_ONLY:
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
    if "numba" in sys.modules:  # imported already (by the CPU kernel, say): it must read it again
        sys.modules["numba"].config.reload_config()

from numba import config as numba_config  # noqa: E402  (the variable must be set first)
from numba import cuda  # noqa: E402

# What numba itself decided when numba.cuda was first imported, not what the environment says now.
SIMULATOR = bool(numba_config.ENABLE_CUDASIM)
if not SIMULATOR and not COMPILE_ONLY and not cuda.is_available():
    raise ImportError(
        "numba sees no CUDA GPU and its simulator is off: numba was imported before "
        "minivllm.attention.cuda could set NUMBA_ENABLE_CUDASIM=1. Set that variable in "
        "the environment, or import this module before anything else imports numba"
    )
WARP_SIZE = 32
# Where the kernels take their tensors: the GPU's memory, or the simulator's (the CPU's).
KERNEL_DEVICE = "cpu" if SIMULATOR else "cuda"


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


@contextmanager
def _simulator_pace():
    """The simulator's block manager polls its threads, holding the GIL, to see who waits at a
    barrier; handing the GIL on every 0.5 ms instead of Python's default 5 ms makes a simulated
    launch about 3x faster. Nothing changes on a GPU."""
    interval = sys.getswitchinterval()
    if SIMULATOR:
        sys.setswitchinterval(5e-4)
    try:
        yield
    except BaseException:
        if SIMULATOR:
            _join_aborted_threads()
        raise
    finally:
        sys.setswitchinterval(interval)


def _join_aborted_threads(timeout: float = 10.0) -> None:
    """When a simulated thread raises, the simulator aborts the block's other threads and raises at
    once, without joining them. Still running, they can meet the next launch's threads (the
    simulator swaps `cuda` in the kernel's globals per launch), and a test of an exercise's stub
    then failed with a sibling's IndexError instead of the stub's message. Wait for them first."""
    from numba.cuda.simulator.kernel import BlockThread

    for thread in threading.enumerate():
        if isinstance(thread, BlockThread) and thread is not threading.current_thread():
            thread.join(timeout)
