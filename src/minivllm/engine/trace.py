"""Step traces: one plain record per engine step, what the chapters plot (chapters 04, 05, 08).

A `StepRecord` says what a step did (who was admitted, who decoded, who prefilled how many tokens,
who finished and why, who was stalled or preempted) and how the engine stood afterwards (who is
running and waiting, blocks used and free). Records are plain data: they export to JSON lines and
back, so a trace can be saved from a server and plotted in a notebook. The two timings are the only
fields that vary from run to run; `to_dict(timings=False)` leaves them out.

Each record also carries the step's **memory trace**, from the block manager (`KVMemory`): the
slots the sequences' block tables reserve, how many of them hold no token (internal
fragmentation: a paged sequence's unfilled last block, a contiguous one's unused context), and the
blocks that sharing (prefix-cache hits, n > 1 forks) saved. `kv_utilization`, `fragmentation`
and `saved_fraction` are the three series as fractions; the JSON export carries them too.

A server keeps its trace for as long as it runs, so the trace is bounded in bytes as well as in
records: a record's size grows with the batch (every running and waiting id is listed), from
about 1 KB for a step of one request to several KB for a full batch with hundreds waiting.
`estimated_bytes` tells a record's size from its lengths alone (no walk over the objects), and
`TraceBudget` drops the oldest records beyond a budget of records and bytes.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

# What a record adds to a trace's memory (sys.getsizeof, CPython 3.11, 64-bit): the object with its
# field dict, numbers and tuple headers; per id in a tuple, its pointer (the int objects are the
# sequences' ids, shared by every record that names them); per inner tuple (a pair or a triple),
# its header and its pointer. On a trace of 300 requests, 64 running at a time, the sum came to
# 1.18x what the records hold (tests/test_trace_budget.py checks it stays within bounds).
RECORD_BYTES = 1200
ITEM_BYTES = 8
INNER_TUPLE_BYTES = 48
FLAT_FIELDS = ("admitted", "decoded", "stalled", "preempted", "resumed", "running", "waiting")
# the tuples of tuples, and the width of their inner tuples
NESTED_FIELDS = {"prefilled": 2, "finished": 2, "speculated": 3}


@dataclass(frozen=True)
class StepRecord:
    step: int
    admitted: tuple[int, ...]
    decoded: tuple[int, ...]  # sequences that computed the token they sampled last step
    prefilled: tuple[tuple[int, int], ...]  # (sequence, prompt tokens computed this step)
    finished: tuple[tuple[int, str], ...]  # (sequence, finish reason)
    stalled: tuple[int, ...]
    preempted: tuple[int, ...]
    resumed: tuple[int, ...]  # admitted again after a preemption
    running: tuple[int, ...]  # after the step
    waiting: tuple[int, ...]  # after the step, in queue order
    num_batched_tokens: int
    prefix_hit_tokens: int
    recomputed_tokens: int  # computed again because a preemption had thrown their K/V away
    blocks_used: int  # after the step: finished sequences have let go
    blocks_free: int
    # The memory trace, after the step (KVMemory): token slots in the block tables, of them empty,
    # and blocks saved by sharing (listed by several tables, held once).
    slots_reserved: int = 0
    slots_empty: int = 0
    blocks_saved: int = 0
    # Speculative decoding (chapter 06): (sequence, draft tokens proposed, of them accepted) per
    # verify.
    speculated: tuple[tuple[int, int, int], ...] = ()
    forward_s: float = 0.0  # time in the target model's forward pass
    draft_s: float = 0.0  # time the drafter took to propose (0 without speculative decoding)
    # time of the whole step: schedule, build the batch, forward, sample, update
    step_s: float = 0.0

    @property
    def kv_utilization(self) -> float:
        """Blocks in use over all blocks of the pool."""
        total = self.blocks_used + self.blocks_free
        return self.blocks_used / total if total else 0.0

    @property
    def fragmentation(self) -> float:
        """Reserved slots holding no token, over all reserved slots."""
        return self.slots_empty / self.slots_reserved if self.slots_reserved else 0.0

    @property
    def saved_fraction(self) -> float:
        """Blocks saved by sharing over the blocks the tables list (used + saved)."""
        listed = self.blocks_used + self.blocks_saved
        return self.blocks_saved / listed if listed else 0.0

    def estimated_bytes(self) -> int:
        """About how much memory this record adds to a trace (CPython 3.11, 64-bit), from its
        tuples' lengths alone: a cheap estimate that a budget can add up step by step."""
        ids = sum(len(getattr(self, name)) for name in FLAT_FIELDS)
        nested = sum(
            len(getattr(self, name)) * (INNER_TUPLE_BYTES + width * ITEM_BYTES)
            for name, width in NESTED_FIELDS.items()
        )
        return RECORD_BYTES + ids * ITEM_BYTES + nested

    def to_dict(self, timings: bool = True) -> dict:
        record = asdict(self)
        if not timings:
            del record["forward_s"], record["draft_s"], record["step_s"]
        # the three memory series as fractions (read back from the counts, not from these)
        for name in ("kv_utilization", "fragmentation", "saved_fraction"):
            record[name] = round(getattr(self, name), 4)
        return record

    @classmethod
    def from_dict(cls, record: dict) -> StepRecord:
        tuples = {
            "prefilled",
            "finished",
            "speculated",
        }  # JSON turns tuples of pairs into lists of lists
        values = {}
        for f in fields(cls):
            if f.name not in record:
                continue
            value = record[f.name]
            if isinstance(value, list):
                value = tuple(tuple(v) for v in value) if f.name in tuples else tuple(value)
            values[f.name] = value
        return cls(**values)


class TraceBudget:
    """Keeps a growing trace within `max_records` records and `max_bytes` estimated bytes: the
    owner appends records to its list, then calls `keep` with how many it appended. Past either
    bound the oldest records go, down to 3/4 of both: dropping from the front of a list moves the
    rest, so the slack makes that happen once in a while rather than on every step."""

    def __init__(self, max_records: int, max_bytes: int) -> None:
        for name, value in (("max_records", max_records), ("max_bytes", max_bytes)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"TraceBudget: {name} must be an int >= 1, got {value!r}")
        self.max_records, self.max_bytes = max_records, max_bytes
        self.sizes: deque[int] = deque()  # estimated_bytes() of each record kept, oldest first
        self.bytes = 0  # their sum

    def keep(self, trace: list[StepRecord], appended: int) -> None:
        if len(self.sizes) + appended != len(trace):  # someone else changed the list: count again
            self.sizes.clear()
            self.bytes, appended = 0, len(trace)
        for record in trace[len(trace) - appended :]:
            size = record.estimated_bytes()
            self.sizes.append(size)
            self.bytes += size
        if len(trace) > self.max_records or self.bytes > self.max_bytes:
            self._drop_oldest(trace, self.max_records * 3 // 4, self.max_bytes * 3 // 4)

    def _drop_oldest(self, trace: list[StepRecord], max_records: int, max_bytes: int) -> None:
        drop = 0
        while self.sizes and (len(self.sizes) > max_records or self.bytes > max_bytes):
            self.bytes -= self.sizes.popleft()
            drop += 1
        del trace[:drop]


def write_jsonl(records: Iterable[StepRecord], path: str | Path, timings: bool = True) -> None:
    with open(path, "w", encoding="utf-8") as out:
        for record in records:
            out.write(json.dumps(record.to_dict(timings)) + "\n")


def read_jsonl(path: str | Path) -> list[StepRecord]:
    with open(path, encoding="utf-8") as source:
        return [StepRecord.from_dict(json.loads(line)) for line in source if line.strip()]


# What a request was doing in a step, for timelines.
STATES = ("waiting", "prefill", "decode", "unscheduled", "stalled", "preempted", "recompute")


def request_timeline(records: Iterable[StepRecord]) -> dict[int, dict[int, str]]:
    """Request -> {step: state} for every step it was in the engine, from arrival to finish.

    "preempted" covers the step it lost its blocks and the steps it then waits; "recompute" the
    prefill of its prompt and output after it is admitted again; "unscheduled" a running sequence
    the step had no token budget left for.
    """
    timeline: dict[int, dict[int, str]] = {}
    evicted: set[int] = set()  # preempted and not admitted again yet
    recomputing: set[int] = set()  # admitted again, not decoding yet
    for r in records:
        evicted |= set(r.preempted)
        evicted -= set(r.resumed)
        recomputing |= set(r.resumed)
        states = {s: "preempted" if s in evicted else "waiting" for s in r.waiting}
        states.update({s: "unscheduled" for s in r.running})
        states.update({s: "recompute" if s in recomputing else "prefill" for s, _ in r.prefilled})
        states.update({s: "decode" for s in r.decoded})
        recomputing -= set(r.decoded)
        states.update({s: "stalled" for s in r.stalled})
        states.update({s: "preempted" for s in r.preempted})
        for seq_id, state in states.items():
            timeline.setdefault(seq_id, {})[r.step] = state
    return timeline
