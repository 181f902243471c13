"""How many of torch's threads a forward pass on the CPU gets (issue 32).

A small pass -- a decode step of the book's model, whose biggest matmul is a few million
multiply-adds -- runs torch's operations on one thread; the attention backend, set up before the
switch, still splits its kernel over every thread. Splitting a matmul wakes the other core's
thread and waits for it at the end, and on the book's 2-core virtual machine (an AMD EPYC Zen 4,
passive threads) a wake-up cost about what the split saved below some 17 million multiply-adds:
`F.linear` at 64 rows, one thread against two, took 89 against 138 us for the 256 x 256 o_proj,
358 against 344 us for the 1024 x 256 gate/up; at 512 rows, 661 against 462 and 2,799 against
1,511 us. A step has 25 such matmuls. On the whole engine (vllm_peer's workload at 128 requests,
fresh processes alternating, 4 pairs), the step with this rule took 0.94x the time of every op on
two threads: 6.17-6.41 s against 6.66-6.72 s, the same tokens.

A pass whose biggest matmul (its rows times the largest weight's elements) reaches
`ONE_THREAD_BELOW_MACS` keeps every thread: a 512-row prefill chunk, or a real checkpoint's decode,
whose weights stream faster from two cores. The count is a pure function of the pass's rows, the
model and the threads' wait policy, never of the clock.

The rule is for threads that sleep as soon as an op ends (`OMP_WAIT_POLICY=PASSIVE`, minivllm's
default). Threads that spin first (the short-spin opt-in, `GOMP_SPINCOUNT`, or OpenMP's own
default) are awake for the next op, and there a split matmul pays: with the short spin, the
128-request workload took 5.47-6.62 s (median 5.96) with every op on two threads against 6.02-8.19
s (median 6.27) under the rule (4 alternating pairs), so a spinning process keeps every thread.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Iterator

import torch
from torch import nn

# The biggest matmul (rows x weight elements) from which a pass keeps every torch thread. One
# thread and two broke even at about 17 million on the book's machine; at 33 million two threads
# took the 1024 x 256 gate/up in 0.78x the time.
ONE_THREAD_BELOW_MACS = 32 << 20


def threads_sleep_at_once() -> bool:
    """Whether torch's idle OpenMP threads sleep as soon as an op ends, as libgomp reads the
    environment when torch loads: `OMP_WAIT_POLICY=PASSIVE` and no `GOMP_SPINCOUNT` spin."""
    passive = os.environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE"
    return passive and os.environ.get("GOMP_SPINCOUNT", "0").strip() in ("", "0")


# Read once, when the engine's runner is imported: libgomp read it once, when torch loaded.
THREADS_SLEEP = threads_sleep_at_once()
_LARGEST: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()


def largest_weight(model) -> int:
    """The elements of `model`'s largest matrix (a released weight counts by its shape); `model`
    is a module, or what holds one as `.model` (a `CompiledForward`)."""
    model = model if isinstance(model, nn.Module) else model.model
    if model not in _LARGEST:
        matrices = [t for t in (*model.parameters(), *model.buffers()) if t.dim() == 2]
        _LARGEST[model] = max((t.numel() for t in matrices), default=0)
    return _LARGEST[model]


def pass_threads(model, rows: int, device: torch.device) -> int:
    """torch's threads for a pass of `rows` rows through `model` on `device`: 1 for a small pass
    on the CPU whose threads sleep between ops, else torch's own count."""
    threads = torch.get_num_threads()
    if device.type != "cpu" or threads == 1 or not THREADS_SLEEP:
        return threads
    return 1 if rows * largest_weight(model) < ONE_THREAD_BELOW_MACS else threads


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """torch on `count` threads inside the block, its own count again after."""
    before = torch.get_num_threads()
    if count == before:
        yield
        return
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)
