"""Teaching-only scheduler modes: the baselines the book measures the real policies against.

The core scheduler (minivllm.sched) batches continuously and preempts by recompute. The book also
runs it in two weaker modes, to show what those ideas buy; they plug into the scheduler's seams
through `SchedulerConfig` and are never used in production:

- `StaticBatching` (chapter 04's baseline): a new batch is admitted only when the whole last one
  is done, so a finished sequence's slot sits idle until the slowest one ends.
- `Stall` (chapter 04's engine; chapter 05 opens with it): no preemption. A sequence that cannot
  get its next block is skipped this step and waits for someone to finish. When every running
  sequence waits like that, nothing can progress and the scheduler raises `SchedulerStalled`.

    SchedulerConfig(batching=StaticBatching(), preemption=Stall())
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from minivllm.sched.scheduler import Scheduler
    from minivllm.sched.sequence import Sequence


class StaticBatching:
    """Admission rule: admit a new batch only once the whole last one is done."""

    def may_admit(self, scheduler: Scheduler) -> bool:
        return not scheduler.running

    def __repr__(self) -> str:
        return "StaticBatching()"


class Stall:
    """Preemption policy that never preempts: out of blocks, a sequence skips the step."""

    def make_room(
        self,
        scheduler: Scheduler,
        seq: Sequence,
        allocate: Callable[[], int],
        served: list[Sequence],
    ) -> tuple[int, list[Sequence]]:
        return allocate(), []

    def __repr__(self) -> str:
        return "Stall()"
