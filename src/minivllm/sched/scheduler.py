"""The continuous-batching scheduler: who runs this step, and how many of their tokens (chapter 04).

Each engine step is `schedule()` -> one forward pass -> `update()`. `schedule()` decides and returns
a plain value, the `StepPlan`; it changes only the queues and the block tables, never a tensor. So
the whole policy runs, and is tested, with no model at all.

`schedule()` works in phases, in the order vLLM's scheduler uses:

1. **Decodes.** Every running sequence that has a sampled-but-uncomputed token gets one slot
   reserved for it *before* the forward pass (its K/V is written during the pass). They go first:
   a token for a user who is already waiting is worth more than starting someone new.
2. **Unfinished prefills.** A running sequence whose prompt did not fit in one step's token budget
   continues with its next chunk (**chunked prefill**).
3. **Admissions.** Waiting sequences join in the waiting queue's order while the limits hold:
   `max_num_seqs` running, `max_num_batched_tokens` per step, and free blocks for what they compute
   this step. A prompt larger than what is left of the budget is admitted with a first chunk.

`update()` then records each sampled token and **retires** finished sequences on the spot, so their
blocks are free for the very next `schedule()`. The scheduler knows tokens, not text: EOS, stop
token ids and max_tokens end a sequence in `update()`; a stop string is found in the decoded text by
the engine's output processor, which ends its sequence with `stop()`.

Everything else is behind a seam, so this file holds only the ideas above:

- **Block space**: the block manager's `allocate_slots` ("may this sequence have n more slots?")
  and `commit` (after the pass). The scheduler never counts blocks.
- **No room**: the preemption policy's `make_room` (preemption.py, chapter 05: preempt a victim by
  recompute). A sequence that cannot fit even alone in the whole cache is ended with finish reason
  "cache_full".
- **Speculative decoding** (chapter 06) is only a number per decode: the lookahead slots reserved
  after it for draft tokens.
- **Admission**: continuous batching, or a rule such as the book's `StaticBatching`.
- **Queue order**: the waiting queue (waiting.py) takes client requests in turns, so a small
  request behind a big one is not served after all of it; preempted sequences come back first.
  With each request alone in its group (the default) that is first come first served.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Protocol

from minivllm.kv.block_manager import BlockManager
from minivllm.sched.plan import ScheduledChunk, StepPlan
from minivllm.sched.preemption import VICTIM_POLICIES, Preemption, preemption_policy
from minivllm.sched.sequence import ABORT, CACHE_FULL, Sequence, Status
from minivllm.sched.waiting import WaitingQueue


class Admission(Protocol):
    """The seam for batching: may waiting sequences join the running batch this step?"""

    def may_admit(self, scheduler: Scheduler) -> bool: ...


class ContinuousBatching:
    """Admit whenever the limits allow: a finished sequence's place is taken the next step."""

    def may_admit(self, scheduler: Scheduler) -> bool:
        return True


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # sequences running at once (the batch size of a decode step)
    max_num_batched_tokens: int = 512  # tokens in one forward pass, decodes and prefill chunks
    chunked_prefill: bool = True  # may a prompt be split over several steps?
    # "continuous", or an admission rule (an object with `may_admit`, e.g. the book's
    # StaticBatching: admit a new batch only once the whole last one is done).
    batching: str | Admission = "continuous"
    enable_prefix_caching: bool = False
    # Out of blocks while the batch runs: a victim policy's name ("newest", "least_progressed", see
    # preemption.py) or a victim function preempts by recompute (chapter 05); an object with
    # `make_room` is used as it is (the book's Stall never preempts, chapter 04's engine).
    preemption: str | Callable | Preemption = "newest"
    # Speculative decoding (chapter 06): extra slots reserved after each decode for draft tokens
    # that the target verifies in the same pass (k, the number of speculative tokens). 0 = plain
    # decoding.
    num_lookahead_slots: int = 0

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"SchedulerConfig.{name} must be an int >= 1, got {value!r}")
        lookahead = self.num_lookahead_slots
        if not isinstance(lookahead, int) or isinstance(lookahead, bool) or lookahead < 0:
            raise ValueError(
                f"SchedulerConfig.num_lookahead_slots must be an int >= 0, got {lookahead!r}"
            )
        per_decode = 1 + lookahead  # a decode runs its last token plus its draft tokens
        if self.max_num_batched_tokens < self.max_num_seqs * per_decode:
            raise ValueError(
                f"SchedulerConfig.max_num_batched_tokens ({self.max_num_batched_tokens}) must be "
                f">= max_num_seqs ({self.max_num_seqs}) x {per_decode} tokens per decode "
                f"(1 + {lookahead} lookahead slots), or a full batch could not all decode: "
                f"raise the budget or lower max_num_seqs"
            )
        self._check_preemption()
        if self.batching != "continuous" and not hasattr(self.batching, "may_admit"):
            raise ValueError(
                f"SchedulerConfig.batching must be 'continuous' or an admission rule with "
                f"may_admit (static batching: minivllm.book.modes.StaticBatching()), "
                f"got {self.batching!r}"
            )

    def _check_preemption(self) -> None:
        policy = self.preemption
        if isinstance(policy, str) and policy in VICTIM_POLICIES:
            return
        if not isinstance(policy, str) and (callable(policy) or hasattr(policy, "make_room")):
            return
        raise ValueError(
            f"SchedulerConfig.preemption must be one of {sorted(VICTIM_POLICIES)}, a victim "
            f"function or an object with make_room (no preemption: "
            f"minivllm.book.modes.Stall()), got {policy!r}"
        )


class SchedulerStalled(RuntimeError):
    """Nothing can run: every running sequence waits for a block that nobody will free."""


class Scheduler:
    def __init__(self, config: SchedulerConfig, manager: BlockManager) -> None:
        self.config, self.manager = config, manager
        self.waiting = WaitingQueue()  # requests in turns, preempted sequences first
        self.running: list[Sequence] = []
        self.sequences: dict[int, Sequence] = {}  # every unfinished sequence, by id
        self.step = 0
        self.preemption: Preemption = preemption_policy(config.preemption)
        batching = config.batching
        self.admission: Admission = ContinuousBatching() if batching == "continuous" else batching

    # -- requests in and out -----------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a sequence. Its `forks` (the other samples of a request with n > 1) are
        registered too but not queued: they join when its prompt is computed (`_fork`)."""
        samples = [seq, *seq.forks]
        if taken := [s.seq_id for s in samples if s.seq_id in self.sequences]:
            raise ValueError(f"sequence {taken[0]} is already scheduled")
        for member in samples:
            member.status, member.arrival_step = Status.WAITING, self.step
            self.sequences[member.seq_id] = member
        self.waiting.append(seq)

    def abort(self, seq_id: int) -> Sequence:
        """Stop a request now, wherever it is, and give its blocks back."""
        seq = self.sequences.get(seq_id)
        if seq is None:
            raise KeyError(
                f"sequence {seq_id} is not running or waiting (never added, or already finished)"
            )
        seq.finish(ABORT)
        self._retire(seq)
        return seq

    def stop(self, seq: Sequence, stop: str, num_output_tokens: int) -> bool:
        """The engine's output processor found stop string `stop` in the text, completed by output
        token `num_output_tokens`: the sequence ends there, finish reason "stop" (vLLM's
        `finish_requests`). Returns whether this ended it now; False if it had already finished
        this step by length (the stop string wins: the reason changes, nothing else)."""
        seq.stop_at(num_output_tokens, stop)
        if self.sequences.get(seq.seq_id) is not seq:
            return False
        self._retire(seq)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.sequences)

    # -- the step ----------------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        self.step += 1
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        stalled, preempted, finished = [], [], []
        # Phase 1 and 2: the running batch, decodes first, then prompts still being prefilled.
        decoding = [s for s in self.running if s.is_decoding]
        batch = decoding + [s for s in self.running if not s.is_decoding]
        served: list[Sequence] = []  # scheduled this step: never preempted by a later one
        for index, seq in enumerate(batch):
            if seq.status is not Status.RUNNING:
                continue  # preempted earlier in this step
            is_decode = index < len(decoding)
            if is_decode:  # the token sampled last step, and slots for draft tokens after it
                num_new, lookahead = 1, self._lookahead(seq)
            else:  # the next chunk of its prompt, as much as the budget allows
                todo = self._prefill_end(seq) - seq.num_computed_tokens
                num_new, lookahead = min(todo, budget), 0
            if num_new == 0:
                break  # budget spent: the rest of the prefills wait for the next step
            # A prompt chunk waits rather than preempt once the step has other work: preempting for
            # it would throw away K/V (maybe its own) to run a few prompt tokens a step sooner.
            may_preempt = is_decode or not chunks
            granted = self._reserve(seq, num_new, lookahead, may_preempt, served, preempted)
            if seq.status is not Status.RUNNING:
                continue  # it was its own victim
            if granted == 0 and len(self.running) == 1:
                self._finish_too_big(seq)  # alone in the cache and still no room: it never fits
                finished.append(seq.seq_id)
            elif granted == 0:
                stalled.append(seq.seq_id)
            else:
                chunks.append(self._chunk(seq, granted, not is_decode, lookahead))
                served.append(seq)
                budget -= granted + lookahead
        # Phase 3: admissions, in the waiting queue's order -- not in a step that had to preempt.
        admitted, hit_tokens = self._admit(chunks, budget) if not preempted else ([], 0)
        if not chunks and not finished and self.sequences:
            raise SchedulerStalled(self._stall_message())
        return self._plan(chunks, admitted, stalled, preempted, finished, hit_tokens)

    def _reserve(
        self,
        seq: Sequence,
        num_new: int,
        lookahead: int,
        may_preempt: bool,
        served: list[Sequence],
        preempted: list[int],
    ) -> int:
        """Slots for up to `num_new` more tokens of a running sequence (and its lookahead); returns
        the tokens granted, 0 if none. With `may_preempt`, the preemption policy makes room.

        A decode and its lookahead get all their slots or none, so how far a sequence speculates
        never depends on who else is in the batch; a prompt chunk may shrink to what is free.
        """
        allocate = partial(
            self.manager.allocate_slots,
            seq.seq_id,
            seq.num_computed_tokens,
            num_new,
            lookahead,
            shrink=not seq.is_decoding and self._may_chunk(seq),
        )
        granted = allocate()
        if granted or not may_preempt:
            return granted
        granted, victims = self.preemption.make_room(self, seq, allocate, served)
        preempted += [victim.seq_id for victim in victims]
        return granted

    def _admit(self, chunks: list[ScheduledChunk], budget: int) -> tuple[list[int], int]:
        """Phase 3: take waiting sequences into the running batch, head of the queue first, while
        a seat, the token budget and the blocks allow. Appends each one's first chunk to `chunks`;
        returns the ids admitted and the prompt tokens found in the prefix cache."""
        config, manager = self.config, self.manager
        if not self.admission.may_admit(self):
            return [], 0
        admitted, hit_tokens = [], 0
        seats = sum(self._seats(s) for s in self.running)
        # EXERCISE ch04.4: admission loop -- seats, budget, prefix hits, chunk, allocate_slots, FCFS
        ### BEGIN SOLUTION
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if seats + self._seats(seq) > config.max_num_seqs:
                break
            end = self._prefill_end(seq)
            hits, cached = self._prefix_hits(seq, end)
            num_new = min(end - cached, budget)
            if num_new < end - cached and not self._may_chunk(seq):
                break  # without chunking the whole prompt must fit in what is left of the budget
            if not manager.allocate_slots(seq.seq_id, cached, num_new, prefix_blocks=hits):
                break  # nobody overtakes the head of the queue
            self.waiting.popleft()
            self._start_running(seq, cached)
            seats += self._seats(seq)
            chunks.append(self._chunk(seq, num_new, is_prefill=True))
            admitted.append(seq.seq_id)
            hit_tokens += cached
            budget -= num_new
        ### END SOLUTION
        return admitted, hit_tokens

    @staticmethod
    def _seats(seq: Sequence) -> int:
        """Seats a sequence takes in the batch. Parallel sampling: a sequence's waiting forks join
        when its prompt is computed, so each keeps a seat from the start."""
        return 1 + len(seq.forks)

    def _prefix_hits(self, seq: Sequence, end: int) -> tuple[list[int], int]:
        """The prefix cache's computed blocks for the first `end` tokens of a waiting sequence, and
        the tokens they hold: ([], 0) when prefix caching is off."""
        # Prompt logprobs need the logits of every prompt token: no prefix-cache hits (vLLM).
        if self.config.enable_prefix_caching and seq.prompt_logprobs_done:
            return self.manager.computed_prefix(seq.token_ids[:end])
        return [], 0

    def _start_running(self, seq: Sequence, cached: int) -> None:
        """An admitted sequence joins the running batch with its first `cached` tokens computed."""
        seq.status, seq.num_computed_tokens = Status.RUNNING, cached
        if seq.num_draft_computed_tokens is not None:
            seq.num_draft_computed_tokens = cached  # named blocks hold both models' K/V
        if not seq.num_preemptions:
            seq.num_cached_tokens = cached  # what the prompt found cached on first admission
        self.running.append(seq)

    def _lookahead(self, seq: Sequence) -> int:
        """Draft tokens to verify after this decode: k, but never past max_tokens (a round emits up
        to lookahead + 1 tokens). It depends on the sequence alone, so its tokens do not depend on
        the batch."""
        left = seq.params.max_tokens - seq.num_output_tokens - 1
        return max(0, min(self.config.num_lookahead_slots, left))

    def _prefill_end(self, seq: Sequence) -> int:
        """Where a sequence's prefill stops: after its last token, whose logits pick the next one.

        With speculative decoding a *resumed* sequence (it has output already) stops one token short
        and goes on as a decode. Its next tokens then come from a speculative round starting exactly
        where the interrupted one would have, so a preemption cannot change them (a prefill's own
        draw is an ordinary draw, a round's is not: the same distribution, not the same token).
        """
        if self.config.num_lookahead_slots and seq.num_output_tokens:
            return seq.num_tokens - 1
        return seq.num_tokens

    def _may_chunk(self, seq: Sequence) -> bool:
        """A prompt is chunked only if the config says so; a preempted sequence's recompute always
        may be, or a long one could never be admitted again."""
        return self.config.chunked_prefill or seq.num_preemptions > 0

    def preempt(self, seq: Sequence) -> None:
        """Preemption by recompute: free every block, keep the tokens, queue at the very front.
        The preemption policy calls it (preemption.py)."""
        # EXERCISE ch05.2: preempt -- free its blocks, stop running it, forget its K/V, queue first
        ### BEGIN SOLUTION
        self.manager.free(seq.seq_id)
        self.running.remove(seq)
        seq.status, seq.num_computed_tokens = Status.WAITING, 0  # its tokens stay; their K/V go
        self.waiting.appendleft(seq)  # before every fresh request: it has a user waiting mid-answer
        ### END SOLUTION
        seq.num_preemptions += 1
        if seq.num_draft_computed_tokens is not None:
            seq.num_draft_computed_tokens = 0  # the draft model's K/V lived in the same blocks

    def _finish_too_big(self, seq: Sequence) -> None:
        blocks = self.manager.blocks_needed(0, seq.num_tokens)
        seq.finish(CACHE_FULL)
        seq.finish_message = (
            f"sequence {seq.seq_id} needs {blocks} KV-cache blocks for its next token but the "
            f"whole cache has {self.manager.allocator.num_blocks}: ended early, give the "
            f"engine a bigger cache or ask for fewer tokens"
        )
        self.manager.free(seq.seq_id)
        self.running.remove(seq)  # it leaves self.sequences in update(): the engine reports it

    def _plan(self, chunks, admitted, stalled, preempted, finished, hit_tokens) -> StepPlan:
        resumed = tuple(i for i in admitted if self.sequences[i].num_preemptions)
        recomputed = sum(self._recomputed(c) for c in chunks)
        return StepPlan(
            self.step,
            tuple(chunks),
            tuple(admitted),
            tuple(stalled),
            tuple(preempted),
            resumed,
            tuple(finished),
            hit_tokens,
            recomputed,
        )

    def _recomputed(self, chunk: ScheduledChunk) -> int:
        """Tokens of the chunk this sequence had computed before a preemption threw them away."""
        done_before = self.sequences[chunk.seq_id].max_computed_tokens
        return max(0, min(chunk.start + chunk.num_tokens, done_before) - chunk.start)

    @staticmethod
    def _chunk(
        seq: Sequence, num_tokens: int, is_prefill: bool, lookahead: int = 0
    ) -> ScheduledChunk:
        start = seq.num_computed_tokens
        samples = start + num_tokens == seq.num_tokens
        return ScheduledChunk(seq.seq_id, start, num_tokens, is_prefill, samples, lookahead)

    # -- after the forward pass --------------------------------------------------------------------
    def update(self, plan: StepPlan, sampled: Mapping[int, int | list[int]]) -> list[Sequence]:
        """After the forward pass: advance what was computed, append sampled tokens, retire finished
        sequences (freeing their blocks now). Returns the sequences that finished this step.

        A sampling chunk gets one token, or with speculative decoding a run of them: the accepted
        draft tokens, then the target's own token. The accepted drafts were computed in this very
        pass, so they count as computed; the slots of rejected ones are rolled back.
        """
        finished = [self.sequences.pop(i) for i in plan.finished if i in self.sequences]
        for seq in list(finished):
            finished += self._end_pending_forks(seq)
        for chunk in plan.chunks:
            seq = self.sequences.get(chunk.seq_id)
            if seq is None:
                continue  # aborted while the step ran
            seq.num_computed_tokens = chunk.start + chunk.num_tokens
            if chunk.samples:
                run = sampled[seq.seq_id]
                appended = seq.append_tokens([run] if isinstance(run, int) else list(run))
                seq.num_computed_tokens += appended - 1  # accepted drafts: their K/V were written
            self._advance(seq)
            if chunk.samples and seq.forks:
                finished += self._fork(seq, sampled)
            if seq.is_finished:
                self._retire(seq)
                finished.append(seq)
        return finished

    def _advance(self, seq: Sequence) -> None:
        seq.max_computed_tokens = max(seq.max_computed_tokens, seq.num_computed_tokens)
        ready = seq.num_computed_tokens
        if seq.num_draft_computed_tokens is not None:
            # The draft model's K/V past the accepted run are wrong: it drafted rejected tokens.
            seq.num_draft_computed_tokens = min(seq.num_draft_computed_tokens, ready)
            ready = seq.num_draft_computed_tokens
        # Roll back the slots of rejected draft tokens; name full blocks only once every model's
        # K/V are in them.
        cacheable = ready if self.config.enable_prefix_caching else None
        self.manager.commit(
            seq.seq_id, seq.token_ids, seq.num_computed_tokens, num_cacheable_tokens=cacheable
        )

    def _fork(self, parent: Sequence, sampled: Mapping[int, int | list[int]]) -> list[Sequence]:
        """Parallel sampling: the parent's prompt is computed, so each waiting sibling forks its
        block table (sharing every prompt block; copy-on-write separates the last, partly filled
        one at the next write) and appends the first token the runner drew for it from the same
        logits. Returns the siblings that finished at once."""
        finished = []
        for child in parent.forks:
            if child.is_finished:
                continue  # aborted while it waited
            self.manager.fork(parent.seq_id, child.seq_id)
            child.status = Status.RUNNING
            child.num_computed_tokens = child.max_computed_tokens = parent.num_prompt_tokens
            child.num_cached_tokens = parent.num_cached_tokens
            child.prompt_logprobs = parent.prompt_logprobs
            self.running.append(child)
            child.append_tokens([sampled[child.seq_id]])
            self._advance(child)
            if child.is_finished:
                self._retire(child)
                finished.append(child)
        parent.forks = []
        return finished

    def _end_pending_forks(self, seq: Sequence) -> list[Sequence]:
        """A parent that ends before its prompt was computed (aborted, cache_full) ends the
        siblings waiting for it the same way."""
        ended = []
        for child in seq.forks:
            if not child.is_finished:
                child.finish(seq.finish_reason)
                child.finish_message = seq.finish_message
                self.sequences.pop(child.seq_id, None)
                ended.append(child)
        seq.forks = []
        return ended

    def _retire(self, seq: Sequence) -> None:
        if seq.status is not Status.FINISHED:
            raise AssertionError(f"retiring sequence {seq.seq_id}, which is {seq.status.value}")
        self._end_pending_forks(seq)
        if seq.seq_id in self.manager:
            self.manager.free(seq.seq_id)
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        del self.sequences[seq.seq_id]

    def _stall_message(self) -> str:
        return (
            f"no sequence can make progress: {len(self.running)} running sequence(s) need a new "
            f"block, {len(self.waiting)} wait to be admitted, and only {self.manager.num_free} of "
            f"{self.manager.allocator.num_blocks} blocks are free. Without preemption (chapter 05) "
            "the cache is too small for this workload: give it more blocks or admit fewer "
            "sequences"
        )
