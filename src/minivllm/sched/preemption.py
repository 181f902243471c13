"""Victim policies: whom to preempt when the running batch cannot get its next blocks (chapter 05).

When a running sequence needs a block and none is free, the scheduler **preempts by recompute**: it
frees a victim's blocks entirely, keeps its tokens (prompt and output so far), and puts it back at
the front of the waiting queue. When it is admitted again it prefills prompt + output in one go and
carries on exactly where it was -- the same tokens, since sampling depends only on (seed, position).

A policy is a plain function: the running sequences that may still be preempted this step (never one
already scheduled in it), in the order they were admitted, in; the victim out. Two ship:

- **newest** (LIFO): the most recently admitted. vLLM's and nano-vllm's choice: the newest has
  waited
  least and usually computed least.
- **least progressed**: the fewest output tokens, ties to the higher id. It throws away the least
  generated work, and does not care when a sequence arrived.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as SequenceOf

from minivllm.sched.sequence import Sequence


def newest_first(candidates: SequenceOf[Sequence]) -> Sequence:
    """The most recently admitted sequence (the running list is kept in admission order)."""
    return candidates[-1]


def least_progressed(candidates: SequenceOf[Sequence]) -> Sequence:
    """Fewest output tokens; on a tie, the higher sequence id (a fixed, reproducible order)."""
    # EXERCISE ch05.1: least progressed -- the fewest output tokens, ties to the higher seq_id
    ### BEGIN SOLUTION
    return min(candidates, key=lambda s: (s.num_output_tokens, -s.seq_id))
    ### END SOLUTION


VICTIM_POLICIES: dict[str, Callable[[SequenceOf[Sequence]], Sequence]] = {
    "newest": newest_first,
    "least_progressed": least_progressed,
}


class CountingPolicy:
    """Wraps a victim policy: counts its preemptions, and how often newest-first and
    least-progressed would have chosen different victims (to see when the choice of policy matters at all)."""

    def __init__(self, policy: Callable[[SequenceOf[Sequence]], Sequence]) -> None:
        self.policy, self.calls, self.disagreements = policy, 0, 0

    def __call__(self, candidates: SequenceOf[Sequence]) -> Sequence:
        self.calls += 1
        self.disagreements += newest_first(candidates) is not least_progressed(candidates)
        return self.policy(candidates)
