"""The `StepPlan`: what one step computes, as a plain value (chapter 04).

`Scheduler.schedule()` returns it and the engine executes it: a tuple of `ScheduledChunk`s (a
sequence, the first position, how many tokens, whether its last row samples, how many lookahead
slots follow it), in the order of the flattened batch -- decodes, then prefill chunks -- and who was
admitted, stalled, preempted or ended this step. No tensors, no model: a plan can be printed,
compared and tested on its own.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ScheduledChunk:
    """Run `num_tokens` tokens of sequence `seq_id`, at positions `start, start+1, ...`."""

    seq_id: int
    start: int
    num_tokens: int
    # prompt (or recomputed) tokens; False for a decode: the one token sampled last step
    is_prefill: bool
    samples: bool  # this chunk reaches the sequence's last token: its logits pick the next token
    num_lookahead: int = 0  # slots reserved after it for draft tokens to verify (chapter 06)


@dataclass(frozen=True)
class StepPlan:
    """What one step computes. `chunks` is also the order of the flattened batch: decodes, then
    prefills."""

    step: int
    chunks: tuple[ScheduledChunk, ...]
    admitted: tuple[int, ...] = ()  # waiting -> running this step
    stalled: tuple[int, ...] = ()  # running, but skipped: no free block for their next token
    # running -> front of the waiting queue, blocks freed (chapter 05)
    preempted: tuple[int, ...] = ()
    resumed: tuple[int, ...] = ()  # admitted again after a preemption (a subset of `admitted`)
    # ended by the scheduler itself: too big for the whole cache, alone
    finished: tuple[int, ...] = ()
    prefix_hit_tokens: int = 0  # prompt tokens the admitted sequences found in the prefix cache
    recomputed_tokens: int = 0  # tokens computed again because a preemption threw their K/V away

    @property
    def num_batched_tokens(self) -> int:
        """Tokens the step may run: the chunks, plus the slots reserved for draft tokens."""
        return sum(c.num_tokens + c.num_lookahead for c in self.chunks)

    @property
    def decodes(self) -> tuple[ScheduledChunk, ...]:
        return tuple(c for c in self.chunks if not c.is_prefill)

    @property
    def prefills(self) -> tuple[ScheduledChunk, ...]:
        return tuple(c for c in self.chunks if c.is_prefill)

    @property
    def sampling_seq_ids(self) -> tuple[int, ...]:
        return tuple(c.seq_id for c in self.chunks if c.samples)
