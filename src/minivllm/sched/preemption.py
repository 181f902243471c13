"""Preemption: what the scheduler does when a running sequence cannot get its blocks (chapter 05).

When a running sequence needs a block and none is free, the scheduler asks its preemption policy
to **make room**. The policy that ships preempts **by recompute**: it frees a victim's blocks
entirely, keeps its tokens (prompt and output so far), and puts it back at the front of the waiting
queue. When it is admitted again it prefills prompt + output in one go and carries on exactly where
it was -- the same tokens, since sampling depends only on (seed, position).

Whom to preempt is a **victim policy**, a plain function: the running sequences that may still be
preempted this step (never one already scheduled in it), in the order they were admitted, in; the
victim out. Two ship:

- **newest** (LIFO): the most recently admitted. vLLM's and nano-vllm's choice: the newest has
  waited least and usually computed least.
- **least progressed**: the fewest output tokens, ties to the higher id. It throws away the least
  generated work, and does not care when a sequence arrived.

Other ways to make room plug in at the same seam, `make_room`: swapping K/V out to CPU memory
(vLLM v0), or not preempting at all (the book's `Stall`, in minivllm.book.modes).
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as SequenceOf
from typing import TYPE_CHECKING, Protocol

from minivllm.sched.sequence import Sequence

if TYPE_CHECKING:
    from minivllm.sched.scheduler import Scheduler

VictimPolicy = Callable[[SequenceOf[Sequence]], Sequence]


def newest_first(candidates: SequenceOf[Sequence]) -> Sequence:
    """The most recently admitted sequence (the running list is kept in admission order)."""
    return candidates[-1]


def least_progressed(candidates: SequenceOf[Sequence]) -> Sequence:
    """Fewest output tokens; on a tie, the higher sequence id (a fixed, reproducible order)."""
    # EXERCISE ch05.1: least progressed -- the fewest output tokens, ties to the higher seq_id
    ### BEGIN SOLUTION
    return min(candidates, key=lambda s: (s.num_output_tokens, -s.seq_id))
    ### END SOLUTION


VICTIM_POLICIES: dict[str, VictimPolicy] = {
    "newest": newest_first,
    "least_progressed": least_progressed,
}


class Preemption(Protocol):
    """The seam: how the scheduler gets room for a sequence when the blocks run out."""

    def make_room(
        self,
        scheduler: Scheduler,
        seq: Sequence,
        allocate: Callable[[], int],
        served: list[Sequence],
    ) -> tuple[int, list[Sequence]]:
        """Get `seq` its slots: `allocate()` asks the block manager (it returns the tokens
        granted, 0 = refused). `served` were scheduled earlier this step and must not be touched.
        Returns (tokens granted, the sequences preempted for it, `seq` itself maybe among them)."""
        ...


class RecomputePreemption:
    """Preempt victims chosen by `victim_policy` until the sequence fits (chapter 05)."""

    def __init__(self, victim_policy: VictimPolicy) -> None:
        self.victim_policy = victim_policy

    def make_room(
        self,
        scheduler: Scheduler,
        seq: Sequence,
        allocate: Callable[[], int],
        served: list[Sequence],
    ) -> tuple[int, list[Sequence]]:
        # EXERCISE ch05.3: make room -- preempt the policy's victims until seq fits, or give up
        ### BEGIN SOLUTION
        granted, victims = allocate(), []
        # Alone in the batch there is nobody to preempt: the scheduler ends it as too big.
        while granted == 0 and len(scheduler.running) > 1:
            victim = self.victim_policy([s for s in scheduler.running if s not in served])
            scheduler.preempt(victim)
            victims.append(victim)
            if victim is seq:
                break  # it was its own victim: it waits now, with the rest of its work
            granted = allocate()
        return granted, victims
        ### END SOLUTION


def preemption_policy(spec: str | VictimPolicy | Preemption) -> Preemption:
    """The config's `preemption` as a policy object: a victim policy's name, a victim function,
    or an object with `make_room` (used as it is)."""
    if isinstance(spec, str):
        return RecomputePreemption(VICTIM_POLICIES[spec])
    if hasattr(spec, "make_room"):
        return spec
    return RecomputePreemption(spec)


class CountingPolicy:
    """Wraps a victim policy: counts its preemptions, and how often newest-first and
    least-progressed would have chosen different victims (does the choice of policy matter?)."""

    def __init__(self, policy: VictimPolicy) -> None:
        self.policy, self.calls, self.disagreements = policy, 0, 0

    def __call__(self, candidates: SequenceOf[Sequence]) -> Sequence:
        self.calls += 1
        self.disagreements += newest_first(candidates) is not least_progressed(candidates)
        return self.policy(candidates)
