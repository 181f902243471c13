"""The continuous-batching scheduler: who runs this step, and how many of their tokens (chapter 04).

Each engine step is `schedule()` -> one forward pass -> `update()`. `schedule()` decides and returns
a plain value, the `StepPlan`; it changes only the queues and the block tables, never a tensor. So
the whole policy runs, and is tested, with no model at all.

`schedule()` works in phases, in the order vLLM's scheduler uses:

1. **Decodes.** Every running sequence that has a sampled-but-uncomputed token gets one slot
   reserved for it *before* the forward pass (its K/V is written during the pass). They go first: a token for
   a user who is already waiting is worth more than starting someone new.
2. **Unfinished prefills.** A running sequence whose prompt did not fit in one step's token budget
   continues with its next chunk (**chunked prefill**).
3. **Admissions.** Waiting sequences join, first come first served, while the limits hold:
   `max_num_seqs` running, `max_num_batched_tokens` per step, and free blocks for what they compute
   this step. A prompt larger than what is left of the budget is admitted with a first chunk.

`update()` then records each sampled token and **retires** finished sequences on the spot, so their
blocks are free for the very next `schedule()`.

When the blocks run out, new admissions wait. A running sequence that cannot get its next block is
either *stalled* (skipped this step; `preemption=None`, chapter 04's engine) or makes room by
**preempting** a victim chosen by a policy from `preemption.py` (chapter 05, the default). A
sequence that cannot fit even alone in the whole cache is ended with finish reason "cache_full".
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from minivllm.kv.block_manager import BlockManager, OutOfBlocks
from minivllm.sched.plan import ScheduledChunk, StepPlan
from minivllm.sched.preemption import VICTIM_POLICIES
from minivllm.sched.sequence import ABORT, CACHE_FULL, Sequence, Status


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # sequences running at once (the batch size of a decode step)
    max_num_batched_tokens: int = (
        512  # tokens in one forward pass, decodes and prefill chunks together
    )
    chunked_prefill: bool = True  # may a prompt be split over several steps?
    batching: str = (
        "continuous"  # or "static": admit a new batch only once the whole last one is done
    )
    enable_prefix_caching: bool = False
    # Out of blocks while the batch runs: None stalls the sequence (chapter 04); a victim policy's
    # name ("newest", "least_progressed", see preemption.py) or a function preempts by recompute
    # (chapter 05).
    preemption: str | Callable | None = "newest"
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
        if isinstance(self.preemption, str) and self.preemption not in VICTIM_POLICIES:
            raise ValueError(
                f"SchedulerConfig.preemption must be None, a function or one of "
                f"{sorted(VICTIM_POLICIES)}, got {self.preemption!r}"
            )
        if self.batching not in ("continuous", "static"):
            raise ValueError(
                f"SchedulerConfig.batching must be 'continuous' or 'static', got {self.batching!r}"
            )


class SchedulerStalled(RuntimeError):
    """Nothing can run: every running sequence waits for a block that nobody will free."""


class Scheduler:
    def __init__(self, config: SchedulerConfig, manager: BlockManager) -> None:
        self.config, self.manager = config, manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.sequences: dict[int, Sequence] = {}  # every unfinished sequence, by id
        self.step = 0
        policy = config.preemption
        self.victim_policy: Callable[[list[Sequence]], Sequence] | None = (
            VICTIM_POLICIES[policy] if isinstance(policy, str) else policy
        )

    # -- requests in and out
    # -------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        if seq.seq_id in self.sequences:
            raise ValueError(f"sequence {seq.seq_id} is already scheduled")
        seq.status, seq.arrival_step = Status.WAITING, self.step
        self.waiting.append(seq)
        self.sequences[seq.seq_id] = seq

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

    def has_unfinished(self) -> bool:
        return bool(self.sequences)

    # -- the step
    # ------------------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        self.step += 1
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        stalled, preempted, finished = [], [], []
        # Phase 1 and 2: the running batch, decodes first, then prompts still being prefilled.
        decoding, prefilling = [], []
        for seq in self.running:
            (decoding if seq.is_decoding else prefilling).append(seq)
        num_decoding = len(decoding)
        served: list[Sequence] = []  # scheduled this step: never preempted by a later one
        for index, seq in enumerate(decoding + prefilling):
            if seq.status is not Status.RUNNING:
                continue  # preempted earlier in this step
            is_decode = index < num_decoding
            lookahead = self._lookahead(seq) if is_decode else 0
            todo = 1 + lookahead if is_decode else self._prefill_end(seq) - seq.num_computed_tokens
            wanted = min(todo, budget)  # the config makes decodes always fit
            if wanted == 0:
                break  # budget spent: the rest of the prefills wait for the next step
            # A decode (with its lookahead) gets all its slots or none, so how far a sequence
            # speculates never depends on who else is in the batch; a prompt chunk may shrink to
            # what is free.
            divisible = not is_decode and self._may_chunk(seq)
            # A prompt chunk waits rather than preempt once the step has other work: preempting for
            # it would throw away K/V (maybe its own) to run a few prompt tokens a step sooner.
            if is_decode or not chunks:
                granted = self._make_room(seq, wanted, divisible, served, preempted)
            else:
                granted = self._reserve(seq, wanted, divisible)
            if seq.status is not Status.RUNNING:
                continue  # it was its own victim
            if granted == 0 and len(self.running) == 1:
                self._finish_too_big(
                    seq
                )  # alone in the cache and still no room: it can never finish
                finished.append(seq.seq_id)
                continue
            if granted == 0:
                stalled.append(seq.seq_id)
                continue
            chunks.append(
                self._chunk(seq, granted - lookahead, is_prefill=not is_decode, lookahead=lookahead)
            )
            served.append(seq)
            budget -= granted
        # Phase 3: admissions, first come first served -- but not in a step that had to preempt.
        admitted, hit_tokens = self._admit(chunks, budget) if not preempted else ([], 0)
        if not chunks and not finished and self.sequences:
            raise SchedulerStalled(self._stall_message())
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

    def _make_room(
        self,
        seq: Sequence,
        wanted: int,
        divisible: bool,
        served: list[Sequence],
        preempted: list[int],
    ) -> int:
        """Reserve blocks for up to `wanted` tokens of `seq`. When none are free, preempt victims
        chosen by the policy (chapter 05) until it fits or is the victim itself. Returns the tokens granted."""
        granted = self._reserve(seq, wanted, divisible)
        while granted == 0 and self.victim_policy is not None and len(self.running) > 1:
            victim = self.victim_policy([s for s in self.running if s not in served])
            self._preempt(victim)
            preempted.append(victim.seq_id)
            if victim is seq:
                return 0
            granted = self._reserve(seq, wanted, divisible)
        return granted

    def _reserve(self, seq: Sequence, wanted: int, divisible: bool) -> int:
        """Grow a running sequence's blocks for up to `wanted` more tokens; returns how many fit.

        An indivisible request (a decode and its lookahead) gets all its slots or nothing; a
        divisible one (a prefill chunk) may shrink to what the free blocks hold.
        """
        manager = self.manager
        holds = manager.num_tokens(seq.seq_id)  # token slots its blocks cover now
        slack = -holds % manager.block_size  # unused slots in the last block
        fits = holds - seq.num_computed_tokens + slack + manager.num_free * manager.block_size
        granted = min(wanted, fits) if divisible else wanted
        if granted > fits:
            return 0
        extra = seq.num_computed_tokens + granted - holds
        try:
            if extra > 0:
                manager.append(seq.seq_id, extra)
        except OutOfBlocks:
            return 0
        return granted

    def _admit(self, chunks: list[ScheduledChunk], budget: int) -> tuple[list[int], int]:
        config, manager = self.config, self.manager
        if config.batching == "static" and self.running:
            return [], 0  # static batching: the next batch starts when the whole last one is done
        admitted, hit_tokens = [], 0
        while self.waiting and len(self.running) < config.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            end = self._prefill_end(seq)
            # Never take the prefill's last token from the cache: the prefill must compute
            # something.
            hits = (
                manager.cached_prefix(seq.token_ids[: end - 1])
                if config.enable_prefix_caching
                else []
            )
            cached = len(hits) * manager.block_size
            num_new = min(end - cached, budget)
            if num_new < end - cached and not self._may_chunk(seq):
                break  # without chunking the whole prompt must fit in what is left of the budget
            try:
                manager.allocate(seq.seq_id, cached + num_new, prefix_blocks=hits)
            except OutOfBlocks:
                break  # first come first served: nobody overtakes the head of the queue
            self.waiting.popleft()
            seq.status, seq.num_computed_tokens = Status.RUNNING, cached
            if seq.num_draft_computed_tokens is not None:
                seq.num_draft_computed_tokens = (
                    cached  # named blocks hold both models' K/V (see update)
                )
            if not seq.num_preemptions:
                seq.num_cached_tokens = cached  # what the prompt found cached on first admission
            self.running.append(seq)
            chunks.append(self._chunk(seq, num_new, is_prefill=True))
            admitted.append(seq.seq_id)
            hit_tokens += cached
            budget -= num_new
        return admitted, hit_tokens

    def _lookahead(self, seq: Sequence) -> int:
        """Draft tokens to verify after this decode: k, but never past max_tokens (a round emits up
        to lookahead + 1 tokens). It depends on the sequence alone, so its tokens do not depend on the batch."""
        return max(
            0,
            min(self.config.num_lookahead_slots, seq.params.max_tokens - seq.num_output_tokens - 1),
        )

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

    def _preempt(self, seq: Sequence) -> None:
        """Preemption by recompute: free every block, keep the tokens, queue at the very front."""
        # EXERCISE ch05.2: preempt -- free the victim's blocks, stop running it, forget its K/V, queue it first
        ### BEGIN SOLUTION
        self.manager.free(seq.seq_id)
        self.running.remove(seq)
        seq.status, seq.num_computed_tokens = (
            Status.WAITING,
            0,
        )  # its tokens stay; their K/V are gone
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
        self.running.remove(
            seq
        )  # leaves self.sequences in update(), so the engine still reports it

    def _recomputed(self, chunk: ScheduledChunk) -> int:
        """Tokens of the chunk this sequence had computed before, until a preemption threw them away."""
        done_before = self.sequences[chunk.seq_id].max_computed_tokens
        return max(0, min(chunk.start + chunk.num_tokens, done_before) - chunk.start)

    @staticmethod
    def _chunk(
        seq: Sequence, num_tokens: int, is_prefill: bool, lookahead: int = 0
    ) -> ScheduledChunk:
        start = seq.num_computed_tokens
        return ScheduledChunk(
            seq.seq_id,
            start,
            num_tokens,
            is_prefill,
            start + num_tokens == seq.num_tokens,
            lookahead,
        )

    def update(self, plan: StepPlan, sampled: Mapping[int, int | list[int]]) -> list[Sequence]:
        """After the forward pass: advance what was computed, append sampled tokens, retire finished
        sequences (freeing their blocks now). Returns the sequences that finished this step.

        A sampling chunk gets one token, or with speculative decoding a run of them: the accepted
        draft tokens, then the target's own token. The accepted drafts were computed in this very
        pass, so they count as computed; the slots of rejected ones are rolled back.
        """
        finished = [self.sequences.pop(i) for i in plan.finished if i in self.sequences]
        for chunk in plan.chunks:
            seq = self.sequences.get(chunk.seq_id)
            if seq is None:
                continue  # aborted while the step ran
            seq.num_computed_tokens = chunk.start + chunk.num_tokens
            if chunk.samples:
                run = sampled[seq.seq_id]
                appended = seq.append_tokens([run] if isinstance(run, int) else list(run))
                seq.num_computed_tokens += appended - 1  # accepted drafts: their K/V were written
            self._advance(seq, chunk)
            if seq.is_finished:
                self._retire(seq)
                finished.append(seq)
        return finished

    def _advance(self, seq: Sequence, chunk: ScheduledChunk) -> None:
        seq.max_computed_tokens = max(seq.max_computed_tokens, seq.num_computed_tokens)
        if chunk.num_lookahead:  # give back the slots of rejected (or never proposed) draft tokens
            self.manager.truncate(seq.seq_id, seq.num_computed_tokens)
        ready = seq.num_computed_tokens
        if (
            seq.num_draft_computed_tokens is not None
        ):  # the draft's K/V past the accepted run are wrong
            seq.num_draft_computed_tokens = min(seq.num_draft_computed_tokens, ready)
            ready = seq.num_draft_computed_tokens
        if (
            self.config.enable_prefix_caching
        ):  # name full blocks only once every model's K/V are in them
            self.manager.register_computed(seq.seq_id, seq.token_ids, ready)

    def _retire(self, seq: Sequence) -> None:
        if seq.status is not Status.FINISHED:
            raise AssertionError(f"retiring sequence {seq.seq_id}, which is {seq.status.value}")
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
            "block, "
            f"{len(self.waiting)} wait to be admitted, and only {self.manager.num_free} of "
            f"{self.manager.allocator.num_blocks} blocks are free. Without preemption (chapter 05) "
            "the cache is too small for this workload: give it more blocks or admit fewer "
            "sequences"
        )
