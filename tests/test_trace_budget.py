"""The step trace is bounded in bytes as well as in records (issue 30).

`StepRecord.estimated_bytes` tells a record's memory from its lengths, close to what a walk over
the objects finds on a real trace; `TraceBudget` keeps a trace within its records and bytes,
dropping the oldest first and keeping the newest in order; the AsyncEngine of a server applies it
after every step.
"""

from __future__ import annotations

import asyncio
import sys

import pytest

from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.trace import StepRecord, TraceBudget
from minivllm.sched.sequence import SamplingParams
from minivllm.serving.async_engine import AsyncEngine

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def held_bytes(objects, seen: set[int]) -> int:
    """What `objects` hold, by sys.getsizeof, each object counted once (as memory holds it)."""
    total, stack = 0, list(objects)
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        total += sys.getsizeof(obj)
        if isinstance(obj, (tuple, list)):
            stack.extend(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif hasattr(obj, "__dict__"):
            stack.append(obj.__dict__)
    return total


def record(step: int, running: int = 0, waiting: int = 0) -> StepRecord:
    """A record of a step with `running` sequences decoding and `waiting` queued."""
    ids = tuple(range(1000, 1000 + running))
    queued = tuple(range(5000, 5000 + waiting))
    return StepRecord(
        step,
        (),
        ids,
        (),
        tuple((i, "length") for i in ids[:1]),
        (),
        (),
        (),
        ids,
        queued,
        running,
        0,
        0,
        running,
        100,
    )


def test_the_estimate_is_close_to_what_a_real_trace_holds(target) -> None:
    engine = LLMEngine(target)
    for i in range(80):  # more than max_num_seqs: a queue waits behind a full batch
        engine.add_request(
            f"ROMEO {i}:\n", SamplingParams(max_tokens=4, temperature=0.8, seed=i, ignore_eos=True)
        )
    while engine.has_unfinished():
        engine.step()
    assert max(len(r.waiting) for r in engine.trace) > 10
    held = held_bytes(engine.trace, {id(engine.trace)})
    estimated = sum(r.estimated_bytes() for r in engine.trace)
    # it errs high rather than low, and not by much: a budget in bytes means about what it says
    assert 0.9 * held <= estimated <= 2 * held, (estimated, held)


def test_a_record_grows_with_what_it_lists() -> None:
    idle, busy = record(0).estimated_bytes(), record(0, running=64, waiting=300).estimated_bytes()
    assert busy > idle > 0
    # 64 ids in decoded and running, 300 waiting, one (seq, reason) pair: per id a pointer
    assert busy - idle == (2 * 64 + 300) * 8 + 48 + 2 * 8


def test_the_budget_keeps_the_newest_within_records_and_bytes() -> None:
    size = record(0, running=10, waiting=10).estimated_bytes()
    budget = TraceBudget(max_records=1000, max_bytes=40 * size)
    trace: list[StepRecord] = []
    for step in range(500):
        trace.append(record(step, running=10, waiting=10))
        budget.keep(trace, 1)
        assert len(trace) <= 1000 and budget.bytes <= 40 * size
        assert budget.bytes == sum(r.estimated_bytes() for r in trace)
        # the newest, in order, with no gap
        assert [r.step for r in trace] == list(range(step + 1 - len(trace), step + 1))
    # past the bound it drops to 3/4 of it, so it trims once in a while, not every step
    assert 30 * size <= budget.bytes <= 40 * size

    by_count = TraceBudget(max_records=8, max_bytes=1 << 30)
    trace = []
    for step in range(50):
        trace.append(record(step))
        before = len(trace)
        by_count.keep(trace, 1)
        assert len(trace) == (before if before <= 8 else 6)  # 9 records: down to 3/4 of 8
    assert trace[-1].step == 49


def test_the_budget_counts_again_when_someone_else_changes_the_trace() -> None:
    budget, trace = TraceBudget(max_records=100, max_bytes=1 << 20), []
    for step in range(10):
        trace.append(record(step, running=3))
        budget.keep(trace, 1)
    trace.clear()  # e.g. a notebook that starts a new measurement
    trace += [record(step) for step in range(3)]
    budget.keep(trace, 3)
    assert len(budget.sizes) == 3 and budget.bytes == 3 * record(0).estimated_bytes()


@pytest.mark.parametrize("bounds", [(0, 100), (100, 0), (10, 1.5)])
def test_a_budget_must_be_a_positive_int(bounds) -> None:
    with pytest.raises(ValueError, match="must be an int >= 1"):
        TraceBudget(*bounds)


def test_the_async_engine_keeps_its_trace_within_the_byte_budget(target) -> None:
    max_bytes = 20_000
    with AsyncEngine(LLMEngine(target), max_trace_bytes=max_bytes) as engine:

        async def main():
            for _ in range(2):
                stream = await engine.add_request(
                    ["ROMEO:\n", "JULIET:\n"], SamplingParams(max_tokens=25, ignore_eos=True)
                )
                async with stream:
                    async for _ in stream:
                        pass

        asyncio.run(main())
        trace = engine.trace()
    kept = sum(r.estimated_bytes() for r in trace)
    assert kept <= max_bytes and engine.trace_budget.bytes == kept
    # ~50 steps ran, of over 1 KB each: the oldest went, the latest stayed, in order and unbroken
    assert trace[0].step > 0 and trace[-1].step >= 49
    assert [r.step for r in trace] == list(range(trace[0].step, trace[-1].step + 1))
