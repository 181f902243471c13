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

The rule is for threads that sleep as soon as an op ends (`OMP_WAIT_POLICY=PASSIVE` alone, as the
Makefile runs the tests). Threads that spin first (minivllm's default short spin, `GOMP_SPINCOUNT`,
or OpenMP's own default) are awake for the next op, and there a split matmul pays: with the short
spin, the 128-request workload took 5.47-6.62 s (median 5.96) with every op on two threads against
6.02-8.19 s (median 6.27) under the rule (4 alternating pairs), so a spinning process keeps every
thread.

Spinning threads have a price where another process needs the same cores: each spins on a core the
other's thread with work is waiting for, at every op. Two engines with the short spin, started
together on the book's two cores, each took 43 s for the 128-request workload, against 8.5-9.1 s for
two passive ones. So a process whose threads spin watches its cores (`CoreWatch`): every quarter
second it reads how busy its CPUs were (`/proc/stat`) less its own CPU time, and while other
processes keep a core's worth of them busy, a pass gets only the cores left -- one thread on two
cores: no team, so nothing spins, and the attention kernel one thread too. The two engines then took
9.2-10.2 s each, as passive ones do (8.5-12.4 s in three pairs of runs: the machine is shared). The
count then follows the machine's load, not only the pass; the tokens never do
(`tests/test_pass_threads.py` runs passes on one thread and on two: the same tokens).
"""

from __future__ import annotations

import contextlib
import os
import time
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


def _busy_ticks(cpus: frozenset[int]) -> int | None:
    """Clock ticks the CPUs `cpus` have spent busy since boot -- user, nice, system, irq and
    softirq time in `/proc/stat`; idle, iowait and steal (the hypervisor's) are not busy -- or None
    where there is no `/proc/stat` to read (not Linux)."""
    try:
        with open("/proc/stat", "rb") as stat:
            lines = stat.read().split(b"\n")
    except OSError:
        return None
    busy = 0
    for line in lines:
        name, _, fields = line.partition(b" ")
        if not name.startswith(b"cpu") or name == b"cpu":
            continue
        if int(name[3:]) in cpus:
            user, nice, system, _idle, _iowait, irq, softirq = map(int, fields.split()[:7])
            busy += user + nice + system + irq + softirq
    return busy


class CoreWatch:
    """How many of this process's CPUs other processes leave it, measured every `window` seconds
    (issue 32; the module docstring says why). `cores(wanted)` is the threads a pass should take:
    `wanted`, or fewer while other processes keep some of the CPUs busy -- their busy time being
    the CPUs' (`/proc/stat`, counted in ticks) less this process's own (`time.process_time`,
    every thread). Reading them costs a few tens of microseconds, once a window; between readings
    the last answer stands. Before the first window, and where nothing can be read, every core is
    free. `busy_ticks`, `own_seconds` and `clock` are there for tests."""

    def __init__(
        self,
        window: float = 0.25,
        cpus: frozenset[int] | None = None,
        busy_ticks=_busy_ticks,
        own_seconds=time.process_time,
        clock=time.monotonic,
    ) -> None:
        self.window = window
        if cpus is None:  # the CPUs this process may run on (every one where the OS cannot say)
            affinity = getattr(os, "sched_getaffinity", None)
            cpus = affinity(0) if affinity else range(os.cpu_count() or 1)
        self.cpus = frozenset(cpus)
        self._busy_ticks, self._own_seconds, self._clock = busy_ticks, own_seconds, clock
        self._tick = 1.0 / os.sysconf("SC_CLK_TCK")
        self.others_busy = 0.0  # cores' worth of other processes' work in the last window
        self.asked = self.narrowed = 0  # calls of `cores`, and those that gave fewer than asked
        self._last = self._read()

    def _read(self) -> tuple[float, int | None, float]:
        return self._clock(), self._busy_ticks(self.cpus), self._own_seconds()

    def cores(self, wanted: int) -> int:
        """`wanted` threads, or the cores other processes leave free (rounded, at least 1): never
        more threads than the CPUs this process may run on, where spinning threads would take
        turns on them."""
        now = self._clock()
        if now - self._last[0] >= self.window:
            reading = self._read()
            (then, busy_then, own_then), (_, busy, own) = self._last, reading
            if busy is not None and busy_then is not None:
                others = (busy - busy_then) * self._tick - (own - own_then)
                self.others_busy = max(0.0, others / (now - then))
            self._last = reading
        free = len(self.cpus) - self.others_busy
        cores = max(1, min(wanted, int(free + 0.5)))
        self.asked, self.narrowed = self.asked + 1, self.narrowed + (cores < wanted)
        return cores


# Where torch's threads spin, a pass takes the cores other processes leave it
# (`MINIVLLM_WATCH_CORES=0` turns the watch off: every pass then keeps torch's count).
WATCH_CORES = os.environ.get("MINIVLLM_WATCH_CORES", "1").strip() != "0"
_WATCH: CoreWatch | None = None


def free_threads(device: torch.device) -> int:
    """torch's threads, or fewer while other processes busy this process's CPUs and torch's
    threads spin (`CoreWatch`); threads that sleep at once need no watch."""
    threads = torch.get_num_threads()
    if device.type != "cpu" or threads == 1 or THREADS_SLEEP or not WATCH_CORES:
        return threads
    return core_watch().cores(threads)


def core_watch() -> CoreWatch:
    """The process's watch on its cores (one for every engine in it: they share the cores)."""
    global _WATCH
    if _WATCH is None:
        _WATCH = CoreWatch()
    return _WATCH


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
