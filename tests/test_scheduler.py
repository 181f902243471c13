"""Chapter 04: the continuous-batching scheduler on its own -- no model, no torch.

Every test drives `schedule()` -> (a fake forward pass) -> `update()` with tokens from a fake
sampler, and checks the `StepPlan`s, the queues and the block pool. The property test at the end
also plays the part of the KV cache: it "writes" each computed token into the slot the block tables
give it and checks that every context a chunk reads (prefix-cache hits included) holds exactly that
sequence's tokens.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from minivllm.book.modes import Stall, StaticBatching
from minivllm.kv.block_manager import BlockManager
from minivllm.sched.plan import ScheduledChunk, StepPlan
from minivllm.sched.scheduler import Scheduler, SchedulerConfig, SchedulerStalled
from minivllm.sched.sequence import (
    ABORT,
    LENGTH,
    STOP,
    SamplingParams,
    Sequence,
    Status,
)

EOS = 257
TOKEN = ord("a")  # what the fake sampler returns unless told otherwise

ch04_4 = pytest.mark.exercise("ch04.4")  # the admission loop, Scheduler._admit


def seq(seq_id: int, prompt: int | list[int], max_tokens: int = 4, **params) -> Sequence:
    ids = prompt if isinstance(prompt, list) else [(seq_id * 31 + i) % 200 for i in range(prompt)]
    return Sequence(
        seq_id, ids, SamplingParams(max_tokens=max_tokens, **params), seed=seq_id, eos_token_id=EOS
    )


def scheduler(num_blocks: int = 64, block_size: int = 4, **config) -> Scheduler:
    config.setdefault("max_num_seqs", 4)
    return Scheduler(SchedulerConfig(**config), BlockManager(num_blocks, block_size))


def step(s: Scheduler, tokens: dict[int, int] | None = None) -> tuple[StepPlan, list[Sequence]]:
    plan = s.schedule()
    sampled = {i: (tokens or {}).get(i, TOKEN) for i in plan.sampling_seq_ids}
    return plan, s.update(plan, sampled)


# A capital C, so that a plan reads like a table.
def C(seq_id, start, num_tokens, is_prefill, samples) -> ScheduledChunk:  # noqa: N802
    return ScheduledChunk(seq_id, start, num_tokens, is_prefill, samples)


def run_to_end(s: Scheduler, max_steps: int = 1000) -> list[StepPlan]:
    plans = []
    while s.has_unfinished():
        assert len(plans) < max_steps, "the scheduler did not finish"
        plans.append(step(s)[0])
    return plans


# -- config ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
        ({"max_num_seqs": True}, "max_num_seqs"),
        ({"max_num_seqs": 8, "max_num_batched_tokens": 4}, ">= max_num_seqs"),
        ({"batching": "dynamic"}, "batching"),
    ],
)
def test_config_is_checked(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SchedulerConfig(**kwargs)


def test_a_sequence_id_is_scheduled_once() -> None:
    s = scheduler()
    s.add(seq(0, 3))
    with pytest.raises(ValueError, match="already scheduled"):
        s.add(seq(0, 3))


# -- chunked prefill, token budget, phase order: one small case worked by hand ---------------------


@ch04_4
def test_hand_worked_chunked_prefill() -> None:
    s = scheduler(num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=8)
    a, b, c = seq(0, 5, max_tokens=3), seq(1, 10, max_tokens=2), seq(2, 3, max_tokens=1)
    for x in (a, b, c):
        s.add(x)

    # Step 1: A's whole prompt (5), then B gets what is left of the budget (3 of 10). C waits:
    # budget spent.
    plan, finished = step(s)
    assert plan == StepPlan(1, (C(0, 0, 5, True, True), C(1, 0, 3, True, False)), admitted=(0, 1))
    assert plan.num_batched_tokens == 8 and plan.sampling_seq_ids == (0,) and finished == []
    assert [x.seq_id for x in s.waiting] == [2] and [x.seq_id for x in s.running] == [0, 1]
    assert (a.num_computed_tokens, a.num_tokens, b.num_computed_tokens) == (5, 6, 3)
    assert (
        s.manager.block_table(0) == [0, 1]
        and s.manager.block_table(1) == [2]
        and s.manager.num_free == 13
    )

    # Step 2: A decodes first (1), then B's next chunk takes the other 7 and reaches its end. Still
    # no room for C.
    plan, finished = step(s)
    assert plan == StepPlan(2, (C(0, 5, 1, False, True), C(1, 3, 7, True, True)))
    assert plan.decodes == (C(0, 5, 1, False, True),) and plan.prefills == (C(1, 3, 7, True, True),)
    assert s.manager.block_table(1) == [2, 3, 4] and s.manager.num_free == 11
    assert (a.num_output_tokens, b.num_output_tokens, b.num_computed_tokens) == (2, 1, 10)

    # Step 3: two decodes, then C is admitted with its whole prompt. All three finish in this
    # update.
    plan, finished = step(s)
    assert plan == StepPlan(
        3,
        (C(0, 6, 1, False, True), C(1, 10, 1, False, True), C(2, 0, 3, True, True)),
        admitted=(2,),
    )
    assert plan.num_batched_tokens == 5
    assert [x.seq_id for x in finished] == [0, 1, 2] and all(
        x.finish_reason == LENGTH for x in finished
    )
    assert (a.num_output_tokens, b.num_output_tokens, c.num_output_tokens) == (3, 2, 1)
    assert not s.has_unfinished() and s.manager.num_free == 16 and not s.manager.tables


@ch04_4
def test_budget_is_shared_by_decodes_and_prefill_chunks() -> None:
    s = scheduler(max_num_seqs=4, max_num_batched_tokens=6)
    s.add(seq(0, 2, max_tokens=20))
    s.add(seq(1, 2, max_tokens=20))
    step(s)  # both prompts
    s.add(seq(2, 30, max_tokens=2))
    for expected_start in (
        0,
        4,
        8,
    ):  # two decodes leave 4 tokens of the budget for the long prompt each step
        plan, _ = step(s)
        assert [(c.seq_id, c.is_prefill) for c in plan.chunks] == [
            (0, False),
            (1, False),
            (2, True),
        ]
        assert plan.chunks[2].start == expected_start and plan.chunks[2].num_tokens == 4
        assert plan.num_batched_tokens == 6


@ch04_4
def test_chunked_prefill_off_keeps_a_prompt_that_does_not_fit_the_rest_of_the_budget_waiting() -> (
    None
):
    chunked, whole = (
        scheduler(max_num_batched_tokens=8, chunked_prefill=flag) for flag in (True, False)
    )
    for s in (chunked, whole):
        s.add(seq(0, 5, max_tokens=3))
        s.add(seq(1, 6, max_tokens=3))
        s.add(seq(2, 1, max_tokens=3))
    assert step(chunked)[0].chunks == (C(0, 0, 5, True, True), C(1, 0, 3, True, False))
    plan, _ = step(whole)
    # B (6 tokens) does not fit the 3 left; FIFO: C (1 token, which would fit) does not overtake it
    # either.
    assert plan.chunks == (C(0, 0, 5, True, True),) and plan.admitted == (0,)
    assert [x.seq_id for x in whole.waiting] == [1, 2] and whole.manager.num_free == 62
    plan, _ = step(whole)  # one decode leaves 7: B's whole prompt fits, then C's
    assert plan.chunks == (C(0, 5, 1, False, True), C(1, 0, 6, True, True), C(2, 0, 1, True, True))
    assert all(c.num_tokens == s.sequences[c.seq_id].num_prompt_tokens for c in plan.prefills)


@ch04_4
def test_chunked_prefill_off_never_admits_a_prompt_larger_than_the_budget() -> None:
    s = scheduler(max_num_seqs=2, max_num_batched_tokens=8, chunked_prefill=False)
    s.add(seq(0, 9))
    with pytest.raises(SchedulerStalled):
        s.schedule()
    # nothing was half-done
    assert [x.seq_id for x in s.waiting] == [0] and s.manager.num_free == 64


# -- admission limits ------------------------------------------------------------------------------


@ch04_4
def test_admission_is_limited_by_max_num_seqs() -> None:
    s = scheduler(max_num_seqs=2, max_num_batched_tokens=64)
    s.add(seq(0, 3, max_tokens=1))
    for i in (1, 2, 3):
        s.add(seq(i, 3, max_tokens=3))
    plan, finished = step(s)
    assert plan.admitted == (0, 1) and [x.seq_id for x in s.waiting] == [2, 3]
    # done after one token: its slot is free for the next step
    assert [x.seq_id for x in finished] == [0]
    plan, _ = step(s)
    assert plan.admitted == (2,) and [c.seq_id for c in plan.chunks] == [1, 2]
    plans = run_to_end(s)
    assert all(len(p.decodes) + len(p.admitted) <= 2 for p in plans)


@ch04_4
def test_running_never_exceeds_max_num_seqs() -> None:
    s = scheduler(max_num_seqs=3, max_num_batched_tokens=64)
    for i in range(10):
        s.add(seq(i, 1 + i % 4, max_tokens=1 + i % 3))
    while s.has_unfinished():
        step(s)
        assert len(s.running) <= 3


@ch04_4
def test_fifo_head_of_line_blocks_later_requests_when_out_of_blocks() -> None:
    s = scheduler(num_blocks=4, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    s.add(seq(0, 8, max_tokens=1))  # 2 blocks
    s.add(seq(1, 12, max_tokens=1))  # 3 blocks: not while A holds 2
    s.add(seq(2, 2, max_tokens=1))  # 1 block would fit, but it must not overtake B
    plan, finished = step(s)
    assert plan.admitted == (0,) and [x.seq_id for x in s.waiting] == [1, 2]
    # retired in the same update
    assert [x.seq_id for x in finished] == [0] and s.manager.num_free == 4
    plan = s.schedule()
    # now B goes first, and C fits beside it
    assert plan.admitted == (1, 2) and s.manager.num_free == 0


@ch04_4
def test_admission_keeps_arrival_order() -> None:
    s = scheduler(max_num_seqs=8, max_num_batched_tokens=8)
    for i in range(5):
        s.add(seq(i, 3, max_tokens=2))
    admitted = [i for p in run_to_end(s) for i in p.admitted]
    assert admitted == [0, 1, 2, 3, 4]


# -- retirement and abort --------------------------------------------------------------------------


def test_finished_sequences_free_their_blocks_in_the_same_update() -> None:
    s = scheduler(num_blocks=8, block_size=4, max_num_batched_tokens=64)
    a, b = seq(0, 6, max_tokens=2), seq(1, 3, max_tokens=4, stop_token_ids=[EOS - 1])
    s.add(a)
    s.add(b)
    step(s)
    assert s.manager.num_free == 8 - 2 - 1
    plan, finished = step(s, {1: EOS - 1})  # B hits a stop token; A reaches max_tokens
    assert [x.seq_id for x in finished] == [0, 1]
    assert (a.finish_reason, b.finish_reason, b.stop_reason) == (LENGTH, STOP, EOS - 1)
    assert a.status is b.status is Status.FINISHED
    assert s.manager.num_free == 8 and 0 not in s.manager and 1 not in s.manager
    assert not s.running and not s.sequences and not s.has_unfinished()


def test_eos_finishes_unless_ignored() -> None:
    s = scheduler()
    s.add(seq(0, 2, max_tokens=5))
    s.add(seq(1, 2, max_tokens=2, ignore_eos=True))
    _, finished = step(s, {0: EOS, 1: EOS})
    assert [(x.seq_id, x.finish_reason) for x in finished] == [(0, STOP)]
    _, finished = step(s, {1: EOS})
    assert [(x.seq_id, x.finish_reason) for x in finished] == [(1, LENGTH)]


def test_abort_a_waiting_sequence() -> None:
    s = scheduler(max_num_seqs=1, max_num_batched_tokens=8)
    s.add(seq(0, 3))
    s.add(seq(1, 3))
    step(s)
    free = s.manager.num_free
    out = s.abort(1)
    assert (out.finish_reason, out.status) == (ABORT, Status.FINISHED)
    assert not s.waiting and 1 not in s.sequences and s.manager.num_free == free
    with pytest.raises(KeyError, match="not running or waiting"):
        s.abort(1)
    run_to_end(s)
    assert s.manager.num_free == 64


def test_abort_a_running_sequence_mid_prefill_frees_its_blocks() -> None:
    s = scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=8)
    s.add(seq(0, 20, max_tokens=2))
    step(s)
    assert s.manager.num_free == 14
    s.abort(0)
    assert (
        s.manager.num_free == 16
        and not s.running
        and not s.has_unfinished()
        and not s.manager.tables
    )


def test_abort_between_schedule_and_update() -> None:
    s = scheduler(num_blocks=16, block_size=4)
    s.add(seq(0, 5, max_tokens=3))
    s.add(seq(1, 5, max_tokens=3))
    plan = s.schedule()
    s.abort(0)  # e.g. the client went away while the forward pass ran
    finished = s.update(plan, {0: TOKEN, 1: TOKEN})
    assert finished == [] and 0 not in s.sequences and 0 not in s.manager
    assert s.sequences[1].num_output_tokens == 1
    run_to_end(s)
    assert s.manager.num_free == 16


# -- static batching -------------------------------------------------------------------------------


def admissions(batching) -> list[tuple[int, ...]]:
    s = scheduler(max_num_seqs=2, max_num_batched_tokens=64, batching=batching)
    for i, n in enumerate([1, 4, 2, 2]):
        s.add(seq(i, 3, max_tokens=n))
    return [p.admitted for p in run_to_end(s)]


@ch04_4
def test_static_batching_admits_only_when_the_whole_batch_is_done() -> None:
    # Request 0 finishes after step 1 but request 1 runs 4 steps: the static batch waits for it.
    assert admissions(StaticBatching()) == [(0, 1), (), (), (), (2, 3), ()]
    # Continuous: 2 joins the step after 0 left; 3 the step after 2 left (the batch was full in
    # between).
    assert admissions("continuous") == [(0, 1), (2,), (), (3,), ()]


# -- stalls ----------------------------------------------------------------------------------------


def test_a_sequence_stalls_when_blocks_run_out_and_resumes_later() -> None:
    s = scheduler(num_blocks=3, block_size=4, max_num_batched_tokens=64, preemption=Stall())
    a, b = seq(0, 4, max_tokens=4), seq(1, 4, max_tokens=4)
    s.add(a)
    s.add(b)
    step(s)
    assert s.manager.num_free == 1
    plan, _ = step(s)  # both need a second block for position 4; A (first) gets the last one
    assert plan.stalled == (1,) and plan.chunks == (C(0, 4, 1, False, True),)
    assert b.num_output_tokens == 1 and b.num_computed_tokens == 4  # untouched
    stalled_steps = 1
    while not a.is_finished:
        plan, _ = step(s)
        stalled_steps += plan.stalled == (1,)
    assert stalled_steps == 3 and s.manager.num_free == 2  # A's blocks came back when it finished
    run_to_end(s)
    assert b.finish_reason == LENGTH and b.num_output_tokens == 4 and s.manager.num_free == 3


def test_scheduler_stalled_when_nothing_can_progress() -> None:
    s = scheduler(num_blocks=3, block_size=4, max_num_batched_tokens=64, preemption=Stall())
    s.add(seq(0, 4, max_tokens=8))
    s.add(seq(1, 4, max_tokens=8))
    step(s)
    s.add(seq(2, 1, max_tokens=1))  # waits: no block for it either
    with pytest.raises(SchedulerStalled, match="no sequence can make progress"):
        for _ in range(20):
            step(s)
    assert len(s.running) == 2 and [x.seq_id for x in s.waiting] == [2]
    assert s.manager.num_free == 0


# -- prefix caching --------------------------------------------------------------------------------


@ch04_4
@pytest.mark.parametrize(
    "prompt_len, hit", [(10, 8), (8, 4), (12, 8), (9, 8), (4, 0), (3, 0), (1, 0)]
)
def test_a_repeated_prompt_hits_its_full_blocks_but_never_its_last_token(
    prompt_len: int, hit: int
) -> None:
    s = scheduler(
        num_blocks=16, block_size=4, max_num_batched_tokens=64, enable_prefix_caching=True
    )
    prompt = list(range(100, 100 + prompt_len))
    s.add(seq(0, prompt, max_tokens=3))
    plan = s.schedule()
    # Scheduled but not computed yet: nothing may be named (a hit now would read K/V nobody has
    # written).
    assert s.manager.cached_prefix(prompt) == [] and not s.manager.prefix_cache.cached
    s.update(plan, {0: TOKEN})
    assert len(s.manager.prefix_cache.cached) == prompt_len // 4
    s.add(seq(1, list(prompt), max_tokens=3))
    plan, _ = step(s)
    assert plan.admitted == (1,) and plan.prefix_hit_tokens == hit
    assert plan.chunks[-1] == C(1, hit, prompt_len - hit, True, True)
    assert s.sequences[1].num_cached_tokens == hit
    shared = hit // 4
    assert s.manager.block_table(1)[:shared] == s.manager.block_table(0)[:shared]
    assert all(s.manager.allocator.refcount(b) == 2 for b in s.manager.block_table(0)[:shared])
    run_to_end(s)
    assert s.manager.num_free == 16 and not any(s.manager.allocator.refcounts)


@ch04_4
def test_no_hits_between_prompts_admitted_in_the_same_step() -> None:
    s = scheduler(
        num_blocks=16, block_size=4, max_num_batched_tokens=64, enable_prefix_caching=True
    )
    s.add(seq(0, list(range(12)), max_tokens=1))
    s.add(seq(1, list(range(12)), max_tokens=1))
    plan, _ = step(s)
    assert plan.prefix_hit_tokens == 0 and plan.chunks == (
        C(0, 0, 12, True, True),
        C(1, 0, 12, True, True),
    )


@ch04_4
def test_a_freed_prompt_still_hits_and_its_blocks_are_taken_back() -> None:
    s = scheduler(num_blocks=8, block_size=4, max_num_batched_tokens=64, enable_prefix_caching=True)
    s.add(seq(0, list(range(10)), max_tokens=1))
    step(s)
    assert s.manager.num_free == 8  # finished and freed, but its two full blocks keep their names
    s.add(seq(1, list(range(10)) + [50, 51], max_tokens=1))
    plan, _ = step(s)
    assert plan.prefix_hit_tokens == 8 and plan.chunks == (C(1, 8, 4, True, True),)


def test_prefix_caching_off_never_hits() -> None:
    s = scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=64)
    s.add(seq(0, list(range(10)), max_tokens=1))
    step(s)
    s.add(seq(1, list(range(10)), max_tokens=1))
    plan, _ = step(s)
    assert plan.prefix_hit_tokens == 0 and not s.manager.prefix_cache.cached


def test_a_chunked_prompt_names_its_blocks_as_the_chunks_are_computed() -> None:
    s = scheduler(
        num_blocks=16,
        block_size=4,
        max_num_seqs=2,
        max_num_batched_tokens=6,
        enable_prefix_caching=True,
    )
    s.add(seq(0, list(range(20)), max_tokens=1))
    named = []
    while s.has_unfinished():
        step(s)
        named.append(len(s.manager.prefix_cache.cached))
    assert named == [1, 3, 4, 5]  # 6, 12, 18, 20 tokens computed: floor(n / 4) full blocks


# -- the admission loop (ch04.4), one rule a test ------------------------------------------------


def admitted_ids(plans: list[StepPlan]) -> list[int]:
    return [i for p in plans for i in p.admitted]


@ch04_4
def test_admission_fills_the_token_budget_and_never_exceeds_it() -> None:
    s = scheduler(max_num_seqs=8, max_num_batched_tokens=10)
    for i, prompt_len in enumerate([4, 3, 6, 2]):
        s.add(seq(i, prompt_len, max_tokens=3))
    plan, _ = step(s)
    # 4 + 3 whole prompts, then the 3 tokens left of the budget go to the third prompt's first
    # chunk; the fourth waits for the next step.
    expected = (C(0, 0, 4, True, True), C(1, 0, 3, True, True), C(2, 0, 3, True, False))
    assert plan.chunks == expected, (
        f"with a budget of 10 and prompts of 4, 3, 6 and 2 tokens the first step should run "
        f"{expected}, got {plan.chunks}"
    )
    assert plan.admitted == (0, 1, 2) and [x.seq_id for x in s.waiting] == [3], (
        f"admitted {plan.admitted}, still waiting {[x.seq_id for x in s.waiting]}: expected "
        f"(0, 1, 2) and [3]"
    )
    for plan in run_to_end(s):
        assert plan.num_batched_tokens <= 10, (
            f"step {plan.step} runs {plan.num_batched_tokens} tokens, over the budget of 10"
        )


@ch04_4
def test_admission_is_first_come_first_served_whatever_the_ids_and_sizes() -> None:
    s = scheduler(max_num_seqs=2, max_num_batched_tokens=8)
    arrival = [4, 1, 5, 0, 3, 2]
    for seq_id, prompt_len in zip(arrival, [7, 1, 5, 2, 6, 1]):
        s.add(seq(seq_id, prompt_len, max_tokens=2))
    order = admitted_ids(run_to_end(s))
    assert order == arrival, f"admitted in the order {order}, not in arrival order {arrival}"


@ch04_4
def test_a_refused_head_of_the_queue_stops_admission_and_holds_nothing() -> None:
    s = scheduler(num_blocks=5, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    s.add(seq(0, 8, max_tokens=8))  # 2 blocks
    step(s)
    head, small = seq(1, 16, max_tokens=1), seq(2, 1, max_tokens=1)
    s.add(head)  # 4 blocks: not while seq 0 holds 3 of the 5
    s.add(small)  # 1 block would fit, but it must not overtake the head
    plan = s.schedule()
    assert plan.admitted == (), (
        f"admitted {plan.admitted}: the head of the queue (seq 1) finds no blocks, so nobody may "
        f"be admitted this step (nobody overtakes it)"
    )
    assert [x.seq_id for x in s.waiting] == [1, 2], "the refused sequences must stay waiting"
    assert 1 not in s.manager and 2 not in s.manager and s.manager.num_free == 2, (
        "a refused admission must hold no blocks: allocate_slots answered 0 and changed nothing"
    )
    assert head.status is Status.WAITING and head.num_computed_tokens == 0


@ch04_4
def test_seats_count_the_forks_a_sequence_will_start() -> None:
    s = scheduler(max_num_seqs=4, max_num_batched_tokens=16)
    s.add(seq(0, 2, max_tokens=4))
    s.add(seq(1, 2, max_tokens=4))
    step(s)
    parent = seq(2, 3, max_tokens=4)
    parent.forks = [seq(10, 3, max_tokens=4), seq(11, 3, max_tokens=4)]  # n = 3: three seats
    s.add(parent)
    s.add(seq(3, 1, max_tokens=4))  # one seat would be free, but it must not overtake
    plan = s.schedule()
    assert plan.admitted == (), (
        f"admitted {plan.admitted}: seq 2 and its 2 forks need 3 seats and only 2 of "
        f"max_num_seqs=4 are free, so admission stops at the head of the queue"
    )


@ch04_4
def test_a_prompt_larger_than_the_budget_left_gets_a_first_chunk() -> None:
    s = scheduler(max_num_seqs=4, max_num_batched_tokens=8)
    s.add(seq(0, 2, max_tokens=10))
    step(s)
    long = seq(1, 20, max_tokens=2)
    s.add(long)
    plan, _ = step(s)  # seq 0's decode takes 1 token of the 8: a chunk of 7
    assert plan.admitted == (1,) and plan.chunks[-1] == C(1, 0, 7, True, False), (
        f"a 20-token prompt with 7 tokens of budget left should be admitted with a first chunk "
        f"C(1, 0, 7, True, False), got {plan.chunks}"
    )
    assert long.status is Status.RUNNING and long.num_computed_tokens == 7
    plan, _ = step(s)
    assert plan.chunks[-1] == C(1, 7, 7, True, False), (
        f"the next step continues the prompt where it stopped: expected C(1, 7, 7, True, False), "
        f"got {plan.chunks[-1]}"
    )


@ch04_4
def test_prefix_hits_are_counted_and_only_the_rest_spends_the_budget() -> None:
    s = scheduler(
        num_blocks=16,
        block_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=4,
        enable_prefix_caching=True,
    )
    s.add(seq(0, list(range(12)), max_tokens=1))
    run_to_end(s)  # its three full blocks stay in the prefix cache
    s.add(seq(1, list(range(12)) + [50, 51, 52], max_tokens=1))
    s.add(seq(2, list(range(8)) + [60], max_tokens=1))
    plan = s.schedule()
    # 12 + 8 tokens found cached; 3 + 1 computed: both fit a budget of 4.
    assert plan.chunks == (C(1, 12, 3, True, True), C(2, 8, 1, True, True)), (
        f"each admitted prompt starts after its cached tokens and only the rest counts against "
        f"the budget of 4: expected chunks of 3 (from 12) and 1 (from 8), got {plan.chunks}"
    )
    assert plan.prefix_hit_tokens == 20, (
        f"prefix_hit_tokens should add up both admissions' cached tokens (12 + 8), got "
        f"{plan.prefix_hit_tokens}"
    )
    assert (s.sequences[1].num_cached_tokens, s.sequences[2].num_cached_tokens) == (12, 8)


# -- the property test: random workloads -----------------------------------------------------------


def blocks_for(n: int, block_size: int) -> int:
    return -(-n // block_size)


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([1, 2, 4]))
    prefix_caching = draw(st.booleans())
    # a common prefix, from a tiny alphabet
    shared = draw(st.lists(st.integers(0, 3), min_size=0, max_size=12))
    requests = []
    for _ in range(draw(st.integers(1, 8))):
        head = shared[: draw(st.integers(0, len(shared)))] if prefix_caching else []
        tail = draw(st.lists(st.integers(0, 3), min_size=0 if head else 1, max_size=12))
        requests.append((head + tail, draw(st.integers(1, 8)), draw(st.none() | st.integers(1, 8))))
    max_num_seqs = draw(st.integers(1, 4))
    chunked = draw(st.booleans())
    longest = max(len(p) for p, _, _ in requests)
    # unchunked, each prompt must fit one step's budget
    low = max(max_num_seqs, 1 if chunked else longest)
    budget = draw(st.integers(low, max(low, 24)))
    # Tokens that ever need a slot: the prompt and every output but the last (which is never
    # computed).
    needs = [blocks_for(len(p) + m - 1, block_size) for p, m, _ in requests]
    room = draw(st.sampled_from(["all at once", "tight", "between"]))
    if room == "all at once":
        num_blocks = sum(needs)
    elif room == "tight":  # about the largest request alone: stalls are likely
        num_blocks = max(needs) + draw(st.integers(0, 2))
    else:
        num_blocks = draw(st.integers(max(needs), max(max(needs), sum(needs))))
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        chunked_prefill=chunked,
        batching=draw(st.sampled_from(["continuous", StaticBatching()])),
        enable_prefix_caching=prefix_caching,
        preemption=draw(st.sampled_from([Stall(), "newest", "least_progressed"])),
    )
    return config, num_blocks, block_size, requests, num_blocks >= sum(needs)


def fake_token(seq_id: int, position: int, eos_at: int | None, prompt_len: int) -> int:
    if eos_at is not None and position == prompt_len + eos_at - 1:
        return EOS
    # the same tiny alphabet: outputs may extend a shared prefix
    return seq_id * 7 + position * 3 % 4


# Three requests growing to 10 + 9 + 8 one-token blocks in a pool of 10: every run preempts, by
# least progress. Drawn examples reach each policy only by chance, and the exercise map
# (tools/exercise_deps.json) counts which exercises this test runs, so it must run them every time.
TIGHT_LEAST_PROGRESSED = (
    SchedulerConfig(
        max_num_seqs=4,
        max_num_batched_tokens=24,
        chunked_prefill=True,
        preemption="least_progressed",
    ),
    10,
    1,
    [([1, 2, 3], 8, None), ([2, 3], 8, None), ([3], 8, None)],
    False,
)


@ch04_4
@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
@example(TIGHT_LEAST_PROGRESSED)
def test_random_workloads_finish_with_every_block_back(workload) -> None:
    config, num_blocks, block_size, requests, fits_at_once = workload
    manager = BlockManager(num_blocks, block_size)
    s = Scheduler(config, manager)
    seqs = [
        Sequence(i, list(p), SamplingParams(max_tokens=m), seed=i, eos_token_id=EOS)
        for i, (p, m, _) in enumerate(requests)
    ]
    for x in seqs:
        s.add(x)
    kv: dict[int, tuple[int, ...]] = {}  # slot -> the token prefix whose "K/V" sits there
    # Every step computes at least one token; each preemption can add at most one sequence's worth
    # again.
    max_steps = 50 * (sum(len(p) + m for p, m, _ in requests) + 1)
    for _ in range(max_steps):
        if not s.has_unfinished():
            break
        running_before = len(s.running)
        try:
            plan = s.schedule()
        except SchedulerStalled:
            assert not fits_at_once, "stalled although the cache holds every request at once"
            assert isinstance(config.preemption, Stall), "stalled although it may preempt"
            event("stalled")
            break
        check_plan(s, plan, config, running_before)
        if plan.prefix_hit_tokens:
            event("prefix hit")
        if plan.stalled:
            event("a sequence stalled")
        if plan.preempted:
            event("preempted")
            assert not plan.admitted, "a step that preempted must not admit"
        # The fake forward pass. Every chunk's cached context must hold that sequence's tokens
        # *before* the pass (a prefix hit must be computed by an earlier step); then the pass writes
        # the new tokens.
        slots = {
            c.seq_id: manager.slot_mapping(c.seq_id, range(c.start + c.num_tokens))
            for c in plan.chunks
        }
        for chunk in plan.chunks:
            x, where = s.sequences[chunk.seq_id], slots[chunk.seq_id]
            for p in range(chunk.start):
                assert kv.get(where[p]) == tuple(x.token_ids[: p + 1]), (
                    f"sequence {x.seq_id} reads a wrong K/V at {p}"
                )
        written = [
            slots[c.seq_id][p] for c in plan.chunks for p in range(c.start, c.start + c.num_tokens)
        ]
        assert len(set(written)) == len(written), "two tokens of one step write the same slot"
        for chunk in plan.chunks:
            x, where = s.sequences[chunk.seq_id], slots[chunk.seq_id]
            for p in range(chunk.start, chunk.start + chunk.num_tokens):
                kv[where[p]] = tuple(x.token_ids[: p + 1])
        sampled = {
            i: fake_token(i, s.sequences[i].num_tokens, requests[i][2], len(requests[i][0]))
            for i in plan.sampling_seq_ids
        }
        s.update(plan, sampled)
        check_state(s, manager)
    else:
        pytest.fail("the scheduler neither finished nor raised SchedulerStalled")
    if s.has_unfinished():
        return  # stalled, as it may when the cache cannot hold everyone at once
    assert (
        manager.num_free == num_blocks
        and not manager.tables
        and not any(manager.allocator.refcounts)
    )
    assert not s.waiting and not s.running and not s.sequences
    for x, (prompt, max_tokens, eos_at) in zip(seqs, requests):
        assert x.is_finished and x.token_ids[: len(prompt)] == prompt
        if eos_at is not None and eos_at <= max_tokens:
            assert (x.finish_reason, x.num_output_tokens, x.token_ids[-1]) == (STOP, eos_at, EOS)
        else:
            assert (x.finish_reason, x.num_output_tokens) == (LENGTH, max_tokens)


def check_plan(s: Scheduler, plan: StepPlan, config: SchedulerConfig, running_before: int) -> None:
    assert plan.chunks, "a plan with nothing to run (it should have raised SchedulerStalled)"
    assert plan.num_batched_tokens <= config.max_num_batched_tokens
    assert len(s.running) <= config.max_num_seqs
    ids = [c.seq_id for c in plan.chunks]
    assert len(set(ids)) == len(ids) and not set(ids) & set(plan.stalled)
    kinds = [c.is_prefill for c in plan.chunks]
    assert kinds == sorted(kinds), f"a decode after a prefill chunk: {plan.chunks}"
    if isinstance(config.batching, StaticBatching) and running_before:
        assert plan.admitted == ()
    for c in plan.chunks:
        x = s.sequences[c.seq_id]
        assert c.start == x.num_computed_tokens and c.num_tokens >= 1
        assert c.samples == (c.start + c.num_tokens == x.num_tokens)
        if c.is_prefill:  # a prompt, or a preempted sequence recomputing its prompt and output
            assert c.start < x.num_prompt_tokens or x.num_preemptions
        else:  # a decode: the one token it sampled last step
            assert c.num_tokens == 1 and c.start >= x.num_prompt_tokens
        # slots reserved before the pass
        assert s.manager.num_tokens(c.seq_id) >= c.start + c.num_tokens
        if not config.chunked_prefill and c.is_prefill and not x.num_preemptions:
            # the whole rest of the prompt at once
            assert c.start == x.num_cached_tokens and c.samples
    if not config.enable_prefix_caching:
        assert plan.prefix_hit_tokens == 0


def check_state(s: Scheduler, manager: BlockManager) -> None:
    running = {x.seq_id for x in s.running}
    assert set(manager.tables) == running
    assert all(x.status is Status.WAITING and x.num_computed_tokens == 0 for x in s.waiting)
    assert set(s.sequences) == running | {x.seq_id for x in s.waiting}
    # Every holder is counted: refcounts are exactly the number of tables holding each block.
    held = [0] * manager.allocator.num_blocks
    for table in manager.tables.values():
        for b in table.blocks:
            held[b] += 1
    assert held == manager.allocator.refcounts
    assert manager.num_free == held.count(0)
