"""A memory-arena simulator: why a contiguous KV cache fails a server (chapter 02), and the paged
fix (chapter 03).

A server holds the KV cache of every running sequence in one fixed arena of token slots. This module
replays a seeded stream of requests against two ways of carving that arena up, with no model and no
torch:

- **contiguous** (`simulate_contiguous`): each request reserves one unbroken extent of `max_len`
  slots, first-fit, at admission. It must reserve the most it *may* need (prompt + max_tokens),
  because nobody knows in advance when a sequence will stop. Two kinds of loss follow: **internal
  waste** (slots reserved but not yet, or never, used) and **external fragmentation** (a request
  refused although enough memory is free in total, because no single hole is big enough).
- **paged** (`simulate_paged`): the same workload over `BlockManager`; a sequence holds only the
  blocks its tokens fill and grows one token at a time, so the only waste is the unfilled tail of
  its last block.

One step is one decode step. In each step, in this order:

1. every running sequence (oldest first) stores one more generated token; a sequence that has now
   produced `output_len` tokens finishes and frees its memory at once;
2. arrived requests are admitted **FIFO** while memory allows; admission stores the prompt
   (prefill); a request that cannot be admitted blocks every request behind it (head-of-line
   blocking: what a simple first-come-first-served server does, and what keeps a long request from
   starving);
3. the step's memory is recorded (`StepRecord`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from minivllm.kv.block_manager import BlockManager, OutOfBlocks


@dataclass(frozen=True)
class Request:
    """One client request. `max_len` = prompt_len + max_tokens: the most it may need, which a
    contiguous cache must reserve; `output_len` (<= max_tokens) is how many tokens it really
    generates."""

    id: int
    arrival: int
    prompt_len: int
    output_len: int
    max_len: int

    @property
    def max_tokens(self) -> int:
        return self.max_len - self.prompt_len


def make_workload(
    num_requests: int = 200,
    seed: int = 0,
    arrival_rate: float = 1.0,
    max_tokens_choices: tuple[int, ...] = (128, 256, 512),
) -> list[Request]:
    """A seeded stream of requests with mixed, skewed lengths (most short, a few long).

    Prompt and output lengths are log-normal (median ~64 tokens; prompts capped at 1024). Each
    client asks for a round `max_tokens` from `max_tokens_choices`; the real output is capped by it.
    Arrivals are a Poisson process of `arrival_rate` requests per step. Same seed, same list; no
    global random state.
    """
    if num_requests < 0 or arrival_rate <= 0:
        raise ValueError(
            f"need num_requests >= 0 and arrival_rate > 0, got {num_requests}, {arrival_rate}"
        )
    rng = random.Random(seed)
    requests, clock = [], 0.0
    for i in range(num_requests):
        clock += rng.expovariate(arrival_rate)
        prompt_len = min(1024, max(4, round(rng.lognormvariate(4.2, 0.9))))
        max_tokens = rng.choice(max_tokens_choices)
        output_len = min(max_tokens, max(1, round(rng.lognormvariate(4.2, 0.9))))
        requests.append(Request(i, int(clock), prompt_len, output_len, prompt_len + max_tokens))
    return requests


@dataclass(slots=True)
class Extent:
    """One sequence's piece of the arena: `reserved` slots from `start`, of which `used` hold
    tokens."""

    seq_id: int
    start: int
    reserved: int
    used: int


@dataclass(frozen=True)
class StepRecord:
    """The arena after one step. Paged: `largest_free` == `free` (any free block will do),
    `memory_map` has one extent per block (start = block * block_size), `stalled` lists sequences
    that could not get a block this step and `preempted` those evicted to break a deadlock.
    `waiting`: arrived requests still queued. `fragmented` is the id of a request refused although
    `free` >= its need."""

    step: int
    running: tuple[int, ...]
    waiting: int
    used: int
    reserved: int
    free: int
    largest_free: int
    fragmented: int | None
    stalled: tuple[int, ...]
    preempted: tuple[int, ...]
    memory_map: tuple[Extent, ...]


@dataclass
class SimResult:
    """Per-step records and summary metrics of one simulation.

    Definitions (over the recorded steps; a step "reserves" if any slot is reserved in it):
    - `kv_utilisation`: mean over reserving steps of used / reserved (tokens held / slots set
      aside).
    - `internal_waste`: the same mean of (reserved - used) / reserved, so the two sum to 1.
    - `fragmentation_refusals`: steps in which the head request was refused although the total free
      memory was >= its need (external fragmentation); `fragmented_requests`: distinct such
      requests.
    - `mean_running` / `peak_running`: sequences running per step (mean over all steps / maximum).
    - `mean_running_saturated`: mean sequences running over the steps in which an arrived request
      was left waiting, i.e. while memory (not demand) was the limit: "how many fit in this memory".
    - `preemptions`: sequences the paged run had to evict to break a deadlock (see
      `simulate_paged`).
    """

    kind: str
    capacity: int
    steps: list[StepRecord] = field(default_factory=list)
    completed: list[int] = field(default_factory=list)

    @property
    def num_steps(self) -> int:
        return len(self.steps)

    @property
    def kv_utilisation(self) -> float:
        ratios = [s.used / s.reserved for s in self.steps if s.reserved]
        return sum(ratios) / len(ratios) if ratios else 0.0

    @property
    def internal_waste(self) -> float:
        return 1.0 - self.kv_utilisation if any(s.reserved for s in self.steps) else 0.0

    @property
    def mean_running(self) -> float:
        return sum(len(s.running) for s in self.steps) / len(self.steps) if self.steps else 0.0

    @property
    def mean_running_saturated(self) -> float:
        busy = [len(s.running) for s in self.steps if s.waiting]
        return sum(busy) / len(busy) if busy else 0.0

    @property
    def peak_running(self) -> int:
        return max((len(s.running) for s in self.steps), default=0)

    @property
    def fragmentation_refusals(self) -> int:
        return sum(s.fragmented is not None for s in self.steps)

    @property
    def fragmented_requests(self) -> int:
        return len({s.fragmented for s in self.steps if s.fragmented is not None})

    @property
    def preemptions(self) -> int:
        return sum(len(s.preempted) for s in self.steps)

    def summary(self) -> dict[str, float | int | str]:
        return {
            "kind": self.kind,
            "capacity_slots": self.capacity,
            "steps": self.num_steps,
            "completed": len(self.completed),
            "kv_utilisation": round(self.kv_utilisation, 4),
            "internal_waste": round(self.internal_waste, 4),
            "mean_running": round(self.mean_running, 2),
            "mean_running_saturated": round(self.mean_running_saturated, 2),
            "peak_running": self.peak_running,
            "fragmentation_refusals": self.fragmentation_refusals,
            "fragmented_requests": self.fragmented_requests,
            "preemptions": self.preemptions,
        }


# -- the contiguous arena --------------------------------------------------------------------------


class ContiguousArena:
    """One arena of `num_slots` slots; free memory is a sorted list of (start, length) holes."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.holes: list[tuple[int, int]] = [(0, num_slots)]
        self.extents: dict[int, Extent] = {}  # seq_id -> its extent, in admission order

    @property
    def free(self) -> int:
        return sum(length for _, length in self.holes)

    @property
    def largest_free(self) -> int:
        return max((length for _, length in self.holes), default=0)

    def admit(self, req: Request) -> bool:
        """First fit: the lowest hole with room for `max_len` slots; False if there is none."""
        for i, (start, length) in enumerate(self.holes):
            if length >= req.max_len:
                rest = (start + req.max_len, length - req.max_len)
                self.holes[i : i + 1] = [rest] if rest[1] else []
                self.extents[req.id] = Extent(req.id, start, req.max_len, req.prompt_len)
                return True
        return False

    def fragmented(self, req: Request) -> bool:
        return self.free >= req.max_len

    def grow(self, seq_id: int) -> bool:
        """One more token, inside the reservation: always fits."""
        e = self.extents[seq_id]
        self.extents[seq_id] = Extent(e.seq_id, e.start, e.reserved, e.used + 1)
        return True

    def release(self, seq_id: int) -> None:
        """Give the extent back and merge it with the holes on either side."""
        e = self.extents.pop(seq_id)
        holes = sorted(self.holes + [(e.start, e.reserved)])
        merged = [holes[0]]
        for start, length in holes[1:]:
            last_start, last_length = merged[-1]
            if last_start + last_length == start:
                merged[-1] = (last_start, last_length + length)
            else:
                merged.append((start, length))
        self.holes = merged

    def memory_map(self) -> tuple[Extent, ...]:
        return tuple(self.extents.values())


# -- the paged pool --------------------------------------------------------------------------------


class PagedPool:
    """The same interface over `BlockManager`: admit the prompt's blocks, grow lazily, never
    fragment."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.manager = BlockManager(num_blocks, block_size)
        self.block_size = block_size
        self.num_slots = num_blocks * block_size

    @property
    def free(self) -> int:
        return self.manager.num_free * self.block_size

    @property
    def largest_free(self) -> int:
        return self.free  # any free block is as good as any other

    def admit(self, req: Request) -> bool:
        if self.manager.blocks_needed(0, req.prompt_len) > self.manager.num_free:
            return False
        self.manager.allocate(req.id, req.prompt_len)
        return True

    def fragmented(self, req: Request) -> bool:
        return False  # refused only when the blocks really are not there

    def grow(self, seq_id: int) -> bool:
        """One more token; False (a stall, nothing changed) if it needs a block and none is free."""
        try:
            self.manager.append(seq_id, 1)
        except OutOfBlocks:
            return False
        return True

    def release(self, seq_id: int) -> None:
        self.manager.free(seq_id)

    def memory_map(self) -> tuple[Extent, ...]:
        """One extent per block held; only a sequence's last block can be partly used."""
        bs, extents = self.block_size, []
        for seq_id, table in self.manager.tables.items():
            *full, last = table.blocks
            extents.extend(Extent(seq_id, block * bs, bs, bs) for block in full)
            extents.append(Extent(seq_id, last * bs, bs, table.num_tokens - len(full) * bs))
        return tuple(extents)


# -- the simulation loop ---------------------------------------------------------------------------


def simulate_contiguous(workload: list[Request], arena_slots: int = 8192) -> SimResult:
    """Serve `workload` from one arena of `arena_slots` slots, reserving `max_len` contiguous slots
    each."""
    _check_fits(workload, arena_slots, "arena")
    return _simulate(workload, ContiguousArena(arena_slots), "contiguous")


def simulate_paged(
    workload: list[Request], num_blocks: int = 512, block_size: int = 16
) -> SimResult:
    """Serve `workload` from a paged pool of `num_blocks` x `block_size` slots.

    Admission needs only the prompt's blocks; growth is lazy, one token at a time. A sequence that
    needs a new block when none is free simply **stalls** for that step and retries the next (oldest
    first, so the oldest gets the next free block). Stalling alone can deadlock: if *every* running
    sequence stalls, no one finishes and no block is ever freed. Only then, as a last resort, the
    youngest sequence is **preempted**: its blocks are freed and it goes back to the head of the
    queue to start over (recompute). Chapter 05 turns this into a real scheduling policy; here it is
    only the smallest thing that keeps the simulation honest and finite (the oldest sequence always
    makes progress).
    """
    _check_fits(workload, num_blocks * block_size, "pool")
    return _simulate(workload, PagedPool(num_blocks, block_size), "paged")


def _check_fits(workload: list[Request], capacity: int, name: str) -> None:
    """Refuse up front a request that could never fit: otherwise it would wait at the head
    forever."""
    if len({req.id for req in workload}) != len(workload):
        raise ValueError("request ids must be unique")
    for req in workload:
        if req.max_len > capacity:
            raise ValueError(
                f"request {req.id} may need {req.max_len} slots (max_len) but the whole {name} "
                f"has only {capacity}: it can never be admitted"
            )
        if req.prompt_len < 1 or req.output_len < 1 or req.output_len > req.max_tokens:
            raise ValueError(
                f"request {req.id} needs prompt_len >= 1 and 1 <= output_len <= max_tokens: {req}"
            )


def _simulate(workload: list[Request], memory: ContiguousArena | PagedPool, kind: str) -> SimResult:
    """The step loop shared by both layouts: decode, (break a deadlock), admit, record."""
    result = SimResult(kind, memory.num_slots)
    pending = sorted(workload, key=lambda r: (r.arrival, r.id))
    generated: dict[int, int] = {}  # running seq id -> tokens generated so far (admission order)
    by_id = {r.id: r for r in workload}
    step = 0
    while pending or generated:
        running = len(generated)
        stalled = _decode(memory, generated, by_id, result.completed)
        preempted = []
        while stalled and len(stalled) == running:  # nobody moved: only preemption can free a block
            # the youngest; the oldest is never the victim while others run
            victim = next(reversed(generated))
            memory.release(victim)
            del generated[victim]
            # back to the head of the queue, to start over (recompute)
            pending.insert(0, by_id[victim])
            preempted.append(victim)
            running = len(generated)
            stalled = _decode(memory, generated, by_id, result.completed)
        fragmented = _admit(memory, pending, generated, step)
        waiting = sum(r.arrival <= step for r in pending)
        result.steps.append(
            _record(memory, step, generated, waiting, stalled, tuple(preempted), fragmented)
        )
        step += 1
    return result


def _decode(
    memory: ContiguousArena | PagedPool,
    generated: dict[int, int],
    by_id: dict[int, Request],
    completed: list[int],
) -> tuple[int, ...]:
    """Step 1: each running sequence stores one more token; finished ones free their memory at
    once."""
    stalled = []
    for seq_id in list(generated):
        if not memory.grow(seq_id):
            stalled.append(seq_id)
            continue
        generated[seq_id] += 1
        if generated[seq_id] == by_id[seq_id].output_len:
            memory.release(seq_id)
            del generated[seq_id]
            completed.append(seq_id)
    return tuple(stalled)


def _admit(
    memory: ContiguousArena | PagedPool,
    pending: list[Request],
    generated: dict[int, int],
    step: int,
) -> int | None:
    """Step 2: admit arrived requests FIFO; the first that does not fit blocks the rest.

    Returns the id of that blocked head request if it was refused by fragmentation alone, else None.
    """
    while pending and pending[0].arrival <= step:
        req = pending[0]
        if not memory.admit(req):
            return req.id if memory.fragmented(req) else None
        pending.pop(0)
        generated[req.id] = 0
    return None


def _record(
    memory: ContiguousArena | PagedPool,
    step: int,
    generated: dict[int, int],
    waiting: int,
    stalled: tuple[int, ...],
    preempted: tuple[int, ...],
    fragmented: int | None,
) -> StepRecord:
    """Step 3: what the arena holds now."""
    extents = memory.memory_map()
    return StepRecord(
        step,
        tuple(generated),
        waiting,
        sum(e.used for e in extents),
        sum(e.reserved for e in extents),
        memory.free,
        memory.largest_free,
        fragmented,
        stalled,
        preempted,
        extents,
    )
