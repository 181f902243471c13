"""Chapter 05: preemption by recompute -- victim policies, the scheduler's `preempt`, and what it
must never change.

The policies are checked on hand-made sequences, `preempt` on small schedules worked by hand (no
model). With the shipped target model: the chapter's worked example is pinned step by step for both
policies; a seeded workload gives every request exactly the same tokens (greedy and sampled, with
and without prefix caching) in a cache so small that it is preempted again and again as in one so
big that nobody is; a request that can never fit ends "cache_full" without hurting its neighbour;
without preemption (the book's `Stall`) the same kind of burst deadlocks. A hypothesis test drives
the pure scheduler through random workloads over tiny caches and checks the bookkeeping of every
preemption.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from minivllm.book.modes import Stall, StaticBatching
from minivllm.engine.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.processing import RequestOutput
from minivllm.engine.trace import StepRecord, request_timeline
from minivllm.kv.block_manager import BlockManager
from minivllm.sched.plan import ScheduledChunk, StepPlan
from minivllm.sched.preemption import (
    VICTIM_POLICIES,
    RecomputePreemption,
    least_progressed,
    newest_first,
)
from minivllm.sched.scheduler import Scheduler, SchedulerConfig, SchedulerStalled
from minivllm.sched.sequence import (
    CACHE_FULL,
    LENGTH,
    STOP,
    SamplingParams,
    Sequence,
    Status,
)
from minivllm.training.corpus import shipped_validation_text

EOS = 257
TOKEN = ord("a")  # what the fake sampler returns unless told otherwise

ch05_1 = pytest.mark.exercise("ch05.1")
ch05_2 = pytest.mark.exercise("ch05.2")
ch05_3 = pytest.mark.exercise("ch05.3")  # RecomputePreemption.make_room


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# -- helpers: the pure scheduler with a fake sampler -----------------------------------------------


def seq(
    seq_id: int, prompt: int | list[int], max_tokens: int = 4, outputs: int = 0, **params
) -> Sequence:
    """A sequence with a `prompt`-token prompt (or these ids) and `outputs` output tokens already
    sampled."""
    ids = prompt if isinstance(prompt, list) else [(seq_id * 31 + i) % 200 for i in range(prompt)]
    x = Sequence(
        seq_id,
        list(ids),
        SamplingParams(max_tokens=max_tokens, **params),
        seed=seq_id,
        eos_token_id=EOS,
    )
    x.token_ids += [TOKEN] * outputs
    return x


def scheduler(num_blocks: int, block_size: int, **config) -> Scheduler:
    config.setdefault("max_num_seqs", 4)
    config.setdefault("max_num_batched_tokens", 16)
    return Scheduler(SchedulerConfig(**config), BlockManager(num_blocks, block_size))


def step(s: Scheduler) -> tuple[StepPlan, list[Sequence]]:
    plan = s.schedule()
    return plan, s.update(plan, {i: TOKEN for i in plan.sampling_seq_ids})


# A capital C, so that a plan reads like a table.
def C(seq_id, start, num_tokens, is_prefill, samples) -> ScheduledChunk:  # noqa: N802
    return ScheduledChunk(seq_id, start, num_tokens, is_prefill, samples)


def ids(queue) -> list[int]:
    return [x.seq_id for x in queue]


def assert_refcounts_match_tables(manager: BlockManager) -> None:
    held = [0] * manager.allocator.num_blocks
    for table in manager.tables.values():
        for block in table.blocks:
            held[block] += 1
    assert held == manager.allocator.refcounts, (
        "a block's refcount is not the number of tables holding it"
    )
    assert manager.num_free == held.count(0)


# -- victim policies (ch05.1) ----------------------------------------------------------------------


def test_the_policies_are_registered_and_checked_by_the_config() -> None:
    assert VICTIM_POLICIES == {"newest": newest_first, "least_progressed": least_progressed}
    with pytest.raises(ValueError, match="preemption"):
        SchedulerConfig(preemption="oldest")
    with pytest.raises(ValueError, match="Stall"):  # no preemption is the book's Stall policy
        SchedulerConfig(preemption=None)
    stall = Stall()
    assert scheduler(4, 1, preemption=stall).preemption is stall
    chosen = scheduler(4, 1, preemption="least_progressed").preemption
    assert isinstance(chosen, RecomputePreemption) and chosen.victim_policy is least_progressed
    default = scheduler(4, 1).preemption  # preemption is on by default, newest first
    assert isinstance(default, RecomputePreemption) and default.victim_policy is newest_first


def test_newest_first_is_the_last_candidate_whatever_its_progress() -> None:
    a, b, c = seq(0, 3, outputs=9), seq(5, 3, outputs=0), seq(2, 3, outputs=4)
    assert newest_first([a, b, c]) is c
    assert newest_first([c, b, a]) is a
    assert newest_first([b]) is b


@ch05_1
def test_least_progressed_picks_the_fewest_output_tokens_in_any_order() -> None:
    # The fewest outputs wins against a higher id, a shorter prompt, and any place in the list.
    pool = [seq(7, 2, outputs=5), seq(3, 9, outputs=1), seq(1, 2, outputs=6), seq(9, 1, outputs=3)]
    for order in itertools.permutations(pool):
        assert least_progressed(list(order)) is pool[1], [x.seq_id for x in order]
    # any sequence of candidates, not only a list
    assert least_progressed(tuple(pool[2:])) is pool[3]


@ch05_1
def test_least_progressed_breaks_a_tie_towards_the_higher_seq_id() -> None:
    pool = [
        seq(4, 3, outputs=2),
        seq(11, 1, outputs=2),
        seq(8, 6, outputs=2),
        seq(20, 2, outputs=7),
    ]
    # nothing sampled yet (still prefilling): the least progress of all
    fresh = seq(0, 30, outputs=0)
    for order in itertools.permutations(pool):
        # 11: highest of the 2s
        assert least_progressed(list(order)) is pool[1], [x.seq_id for x in order]
        assert least_progressed([*order, fresh]) is fresh
    assert (
        least_progressed([pool[0], pool[2]]) is pool[2]
        and least_progressed([pool[2], pool[0]]) is pool[2]
    )
    assert least_progressed([pool[3]]) is pool[3]


# -- make_room (ch05.3): RecomputePreemption on its own, with a counted `allocate` -----------------


def three_running() -> tuple[Scheduler, list[Sequence]]:
    """Three running sequences of 2 prompt tokens (ids 0, 1, 2, admitted in that order), one block
    of 2 each: the cache of 3 blocks is full."""
    s = scheduler(3, 2)
    seqs = [seq(i, 2, max_tokens=8) for i in range(3)]
    for x in seqs:
        s.add(x)
    step(s)
    assert ids(s.running) == [0, 1, 2] and s.manager.num_free == 0
    return s, seqs


class Asks:
    """A stand-in for `_reserve`'s `allocate`: grants `tokens` once `free_needed` blocks are free,
    and counts how often it was asked."""

    def __init__(self, s: Scheduler, free_needed: int, tokens: int = 1) -> None:
        self.s, self.free_needed, self.tokens, self.calls = s, free_needed, tokens, 0

    def __call__(self) -> int:
        self.calls += 1
        return self.tokens if self.s.manager.num_free >= self.free_needed else 0


def recording(choose: Callable) -> tuple[Callable, list[list[int]]]:
    """A victim policy that records the candidates' ids it was offered, then calls `choose`."""
    offered: list[list[int]] = []

    def policy(candidates):
        offered.append(ids(candidates))
        return choose(candidates)

    return policy, offered


@ch05_3
def test_make_room_asks_first_and_preempts_nobody_when_the_sequence_fits() -> None:
    s, (a, _, _) = three_running()
    policy, offered = recording(newest_first)
    allocate = Asks(s, free_needed=0, tokens=3)
    result = RecomputePreemption(policy).make_room(s, a, allocate, [])
    assert result == (3, []), f"allocate() granted 3 at once: expected (3, []), got {result}"
    assert offered == [] and allocate.calls == 1, (
        f"the first allocate() succeeded, so no victim should be chosen: the policy was asked "
        f"{len(offered)} time(s), allocate() {allocate.calls} time(s)"
    )
    assert ids(s.running) == [0, 1, 2] and not s.waiting


@ch05_3
@pytest.mark.parametrize("free_needed, victims", [(1, [2]), (2, [2, 1])])
def test_make_room_preempts_victims_one_at_a_time_until_the_sequence_fits(
    free_needed: int, victims: list[int]
) -> None:
    s, (a, _, _) = three_running()
    policy, offered = recording(newest_first)
    allocate = Asks(s, free_needed, tokens=4)
    granted, preempted = RecomputePreemption(policy).make_room(s, a, allocate, [])
    assert (granted, ids(preempted)) == (4, victims), (
        f"with {free_needed} free block(s) needed and newest-first, expected to preempt "
        f"{victims} and then be granted 4 tokens, got {ids(preempted)} and {granted}: ask "
        f"allocate() again after each victim, and stop as soon as it grants"
    )
    expected_offers = [[0, 1, 2], [0, 1]][: len(victims)]
    assert offered == expected_offers, (
        f"the policy should be offered the running sequences in admission order, "
        f"{expected_offers}, got {offered}"
    )
    assert allocate.calls == 1 + len(victims), (
        f"allocate() should be asked once, then once after each victim: {1 + len(victims)} "
        f"calls, got {allocate.calls}"
    )
    assert ids(s.running) == [i for i in (0, 1, 2) if i not in victims]
    assert ids(s.waiting) == sorted(victims), "each victim must be preempted (scheduler.preempt)"


@ch05_3
def test_make_room_never_offers_a_served_sequence_and_stops_when_it_is_its_own_victim() -> None:
    s, (a, b, _) = three_running()
    policy, offered = recording(lambda candidates: candidates[0])  # oldest first
    allocate = Asks(s, free_needed=3)
    result = RecomputePreemption(policy).make_room(s, b, allocate, [a])
    assert offered == [[1, 2]], (
        f"seq 0 was served earlier in this step and must never be a candidate: expected the "
        f"policy to be offered [[1, 2]], got {offered}"
    )
    assert result == (0, [b]), (
        f"the policy chose seq 1, the sequence asking for room: it waits now, so make_room must "
        f"stop and return (0, [seq 1]), got ({result[0]}, {ids(result[1])})"
    )
    assert allocate.calls == 1, "after preempting the sequence itself, do not ask for its slots"
    assert ids(s.running) == [0, 2] and ids(s.waiting) == [1]


@ch05_3
def test_make_room_gives_up_when_the_sequence_is_alone() -> None:
    s, (a, _, _) = three_running()
    policy, offered = recording(newest_first)
    allocate = Asks(s, free_needed=4)  # more than the whole cache: it never fits
    result = RecomputePreemption(policy).make_room(s, a, allocate, [])
    assert (result[0], ids(result[1])) == (0, [2, 1]), (
        f"nothing ever fits: preempt the others one at a time, then give up when seq 0 is alone "
        f"(0 tokens, victims [2, 1]), got ({result[0]}, {ids(result[1])})"
    )
    assert ids(s.running) == [0] and allocate.calls == 3, (
        f"seq 0 must be left running alone (the scheduler ends it as too big), after 3 asks: "
        f"running {ids(s.running)}, {allocate.calls} asks"
    )
    offered.clear()
    assert RecomputePreemption(policy).make_room(s, a, Asks(s, free_needed=4), []) == (0, [])
    assert offered == [], "a sequence alone in the batch has nobody to preempt: no victim"


# -- preempt (ch05.2) on the pure scheduler, worked by hand ---------------------------------------


@ch05_3
@ch05_2
def test_a_preemption_worked_by_hand() -> None:
    # 4 blocks of 2 tokens; two sequences of 3 prompt tokens and 6 new ones each.
    s = scheduler(4, 2, preemption="newest")
    a, b = seq(0, 3, max_tokens=6), seq(1, 3, max_tokens=6)
    s.add(a)
    s.add(b)
    plan, _ = step(s)
    assert plan.admitted == (0, 1) and s.manager.num_free == 0  # 2 blocks each
    plan, _ = step(s)  # position 3 fits in each one's second block
    assert plan.chunks == (C(0, 3, 1, False, True), C(1, 3, 1, False, True)) and not plan.preempted

    # Step 3: A needs a block for position 4; none is free; B, the newest, gives its blocks back.
    b_tokens = list(b.token_ids)
    plan = s.schedule()
    assert (
        plan.preempted == (1,) and plan.admitted == () and plan.resumed == () and plan.stalled == ()
    )
    assert plan.chunks == (C(0, 4, 1, False, True),) and plan.recomputed_tokens == 0
    assert b.status is Status.WAITING and b.num_computed_tokens == 0 and b.num_preemptions == 1
    # its tokens are kept, only the K/V are gone
    assert b.token_ids == b_tokens and b.num_output_tokens == 2
    assert b.max_computed_tokens == 4  # what it had computed: the recompute will count against it
    assert 1 not in s.manager and ids(s.running) == [0] and ids(s.waiting) == [1]
    assert s.manager.num_free == 1 and s.manager.block_table(0) == [
        0,
        1,
        3,
    ]  # LIFO: B's last block first
    assert_refcounts_match_tables(s.manager)
    s.update(plan, {0: TOKEN})

    # A runs alone until it is done (positions 5..7 need one more block); B needs 3 blocks to come
    # back.
    while not a.is_finished:
        plan, _ = step(s)
        assert plan.admitted == () and ids(s.waiting) == [1]
    assert s.manager.num_free == 4

    # B is admitted again: prompt and both outputs recomputed in one prefill chunk; 4 of its 5
    # tokens were computed before the preemption (the 5th is the token it sampled last and never
    # ran).
    plan, _ = step(s)
    assert (
        plan.admitted == (1,) and plan.resumed == (1,) and plan.chunks == (C(1, 0, 5, True, True),)
    )
    assert plan.recomputed_tokens == 4 and b.num_output_tokens == 3 and b.max_computed_tokens == 5
    plans = [step(s)[0] for _ in range(3)]
    assert [p.chunks for p in plans] == [(C(1, p, 1, False, True),) for p in (5, 6, 7)]
    assert all(p.recomputed_tokens == 0 and not p.preempted for p in plans)
    assert (
        b.is_finished
        and b.finish_reason == LENGTH
        and b.num_output_tokens == 6
        and b.num_preemptions == 1
    )
    assert not s.has_unfinished() and s.manager.num_free == 4 and not s.manager.tables


@pytest.mark.parametrize(
    "policy, victim",
    [
        pytest.param("newest", 0, marks=[ch05_2, ch05_3]),
        pytest.param("least_progressed", 1, marks=[ch05_1, ch05_2, ch05_3]),
    ],
)
def test_a_sequence_can_be_its_own_victim(policy: str, victim: int) -> None:
    # Seq 1 is admitted before seq 0; after two steps both have 2 outputs. Seq 1 decodes first and
    # needs a block. Newest: seq 0 (admitted last) goes. Least progressed: a tie, so the higher id
    # -- seq 1 itself -- goes, and seq 0 runs on in the blocks it freed.
    s = scheduler(4, 2, preemption=policy)
    first, second = seq(1, 3, max_tokens=6), seq(0, 3, max_tokens=6)
    s.add(first)
    s.add(second)
    step(s)
    step(s)
    assert (first.num_output_tokens, second.num_output_tokens, s.manager.num_free) == (2, 2, 0)
    plan = s.schedule()
    survivor = 1 - victim
    assert plan.preempted == (victim,) and plan.admitted == ()
    assert plan.chunks == (C(survivor, 4, 1, False, True),)
    assert ids(s.running) == [survivor] and ids(s.waiting) == [victim] and victim not in s.manager
    assert s.sequences[victim].num_computed_tokens == 0 and s.sequences[victim].num_preemptions == 1
    s.update(plan, {survivor: TOKEN})
    while s.has_unfinished():
        step(s)
    assert first.finish_reason == second.finish_reason == LENGTH and s.manager.num_free == 4


@ch05_3
@ch05_2
def test_a_custom_policy_sees_the_unserved_running_sequences_in_admission_order() -> None:
    seen: list[list[int]] = []

    def oldest_first(candidates):
        seen.append([x.seq_id for x in candidates])
        return candidates[0]

    # Three sequences of 2 prompt tokens in 4 blocks of 2: after one step each holds one full block
    # and the fourth block is free; the first decode takes it, the second must preempt.
    s = scheduler(4, 2, preemption=oldest_first)
    for i in (5, 3, 8):
        s.add(seq(i, 2, max_tokens=4))
    plan, _ = step(s)
    assert plan.admitted == (5, 3, 8) and s.manager.num_free == 1
    plan = s.schedule()
    # Seq 5 got the last free block and is served; seq 3 needs one: candidates are 3 and 8 (never
    # 5), and the oldest of them is seq 3 itself. Then seq 8 takes a block seq 3 freed.
    assert seen == [[3, 8]]
    assert plan.preempted == (3,) and [c.seq_id for c in plan.chunks] == [5, 8]
    assert ids(s.waiting) == [3] and ids(s.running) == [5, 8]
    s.update(plan, {5: TOKEN, 8: TOKEN})
    while s.has_unfinished():
        plan, _ = step(s)
        assert not (plan.preempted and plan.admitted)
    assert all(seen) and s.manager.num_free == 4


@ch05_3
@ch05_2
def test_several_victims_in_one_step_queue_in_front_of_fresh_requests() -> None:
    # One long request and three short ones fill the cache; in the next step two of them must give
    # way.
    s = scheduler(6, 2, max_num_seqs=4, max_num_batched_tokens=16, preemption="newest")
    s.add(seq(0, 4, max_tokens=20))  # 2 blocks
    for i in (1, 2, 3):
        s.add(seq(i, 2, max_tokens=20))  # 1 block each, then 2 after one more token
    plan, _ = step(s)
    assert plan.admitted == (0, 1, 2, 3) and s.manager.num_free == 1
    s.add(seq(4, 1, max_tokens=1))  # a fresh request arrives: it must not overtake the victims
    plan, _ = step(s)
    # Position 4 of seq 0 takes the free block. Seq 1 needs one for position 2: the newest unserved,
    # seq 3, goes. Seq 2 needs one too: the only unserved candidate left is seq 2 itself. Each
    # victim went to the very front.
    assert plan.preempted == (3, 2) and plan.admitted == ()
    assert plan.chunks == (C(0, 4, 1, False, True), C(1, 2, 1, False, True))
    assert ids(s.waiting) == [2, 3, 4] and ids(s.running) == [0, 1]
    assert all(
        s.sequences[i].status is Status.WAITING and i not in s.manager for i in plan.preempted
    )
    assert_refcounts_match_tables(s.manager)
    while s.has_unfinished():
        plan, _ = step(s)
        assert not (plan.preempted and plan.admitted)
    assert s.manager.num_free == 6 and not s.manager.tables


# -- the chapter's worked example, with the real engine --------------------------------------------


WORKED = {  # request id: (name, arrival step, prompt ids, max_tokens) -- exactly chapter 05's
    0: ("A", 0, [256, 65, 66], 2),
    1: ("B", 2, [256], 3),
    2: ("C", 1, [256, 67, 68], 3),
}

# Per step: (admitted, preempted, resumed, finished) request ids.
WORKED_EVENTS = {
    "newest": [
        ((0,), (), (), ()),
        ((), (), (), (0,)),
        ((2, 1), (), (), ()),
        ((), (), (), ()),
        ((), (1,), (), (2,)),  # C needs a block to sample its 3rd token: B, the newest, goes
        (
            (1,),
            (),
            (1,),
            (1,),
        ),  # B recomputes its prompt and 2 outputs, samples its 3rd and is done
    ],
    "least_progressed": [
        ((0,), (), (), ()),
        ((), (), (), (0,)),
        ((2, 1), (), (), ()),
        ((), (), (), ()),
        ((), (2,), (), (1,)),  # C and B both have 2 outputs: the higher id, C itself, goes
        ((2,), (), (2,), ()),  # C's 5 tokens exceed the budget of 4: a chunk of 4 ...
        ((), (), (), (2,)),  # ... then its last one, which samples
    ],
}
WORKED_RECOMPUTED = {"newest": [0, 0, 0, 0, 0, 2], "least_progressed": [0, 0, 0, 0, 0, 4, 0]}
# Per step, after it: (running, waiting, free blocks of 6).
WORKED_QUEUES = {
    "newest": [
        ((0,), (), 3),
        ((), (2,), 6),
        ((2, 1), (), 2),
        ((2, 1), (), 0),
        ((), (1,), 6),
        ((), (), 6),
    ],
    "least_progressed": [
        ((0,), (), 3),
        ((), (2,), 6),
        ((2, 1), (), 2),
        ((2, 1), (), 0),
        ((), (2,), 6),
        ((2,), (), 2),
        ((), (), 6),
    ],
}
# C arrives before step 2 but waits (A still holds 4 blocks while it decodes); B is admitted at once
# in step 3.
WORKED_TIMELINES = {
    "newest": {
        0: {1: "prefill", 2: "decode"},
        2: {2: "waiting", 3: "prefill", 4: "decode", 5: "decode"},
        1: {3: "prefill", 4: "decode", 5: "preempted", 6: "recompute"},
    },
    "least_progressed": {
        0: {1: "prefill", 2: "decode"},
        2: {2: "waiting", 3: "prefill", 4: "decode", 5: "preempted", 6: "recompute", 7: "decode"},
        1: {3: "prefill", 4: "decode", 5: "decode"},
    },
}


def worked_engine(model, policy) -> LLMEngine:
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=4, preemption=policy)
    return LLMEngine(model, EngineConfig(num_blocks=6, block_size=1, scheduler=config))


def run_worked(model, policy) -> tuple[LLMEngine, dict[int, RequestOutput]]:
    engine, done = worked_engine(model, policy), {}
    for step_index in range(40):
        for request_id, (_, arrival, prompt, max_tokens) in WORKED.items():
            if arrival == step_index:
                params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
                engine.add_request(prompt, params, request_id=request_id)
        if not engine.has_unfinished():
            break
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return engine, done


@ch05_3
@pytest.mark.parametrize(
    "policy",
    [
        pytest.param("newest", marks=ch05_2),
        pytest.param("least_progressed", marks=[ch05_1, ch05_2]),
    ],
)
def test_the_worked_example_step_by_step(target, policy: str) -> None:
    engine, done = run_worked(target, policy)
    events = [
        (r.admitted, r.preempted, r.resumed, tuple(i for i, _ in r.finished)) for r in engine.trace
    ]
    assert events == WORKED_EVENTS[policy]
    assert [r.recomputed_tokens for r in engine.trace] == WORKED_RECOMPUTED[policy]
    assert [(r.running, r.waiting, r.blocks_free) for r in engine.trace] == WORKED_QUEUES[policy]
    assert all(reason == LENGTH for r in engine.trace for _, reason in r.finished)
    victim = 1 if policy == "newest" else 2
    assert {i: o.num_preemptions for i, o in done.items()} == {
        0: 0,
        1: int(victim == 1),
        2: int(victim == 2),
    }
    assert [len(done[i].token_ids) for i in (0, 1, 2)] == [2, 3, 3]
    assert request_timeline(engine.trace) == WORKED_TIMELINES[policy]
    assert (
        engine.manager.num_free == 6
        and not engine.manager.tables
        and not any(engine.manager.allocator.refcounts)
    )


def test_the_worked_example_gives_the_same_tokens_as_a_roomy_cache(target) -> None:
    roomy = LLMEngine(
        target,
        EngineConfig(
            num_blocks=64,
            block_size=1,
            scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=4),
        ),
    )
    expected = {
        i: o.token_ids
        for i, o in zip(
            WORKED,
            roomy.generate(
                [prompt for _, _, prompt, _ in WORKED.values()],
                [
                    SamplingParams(max_tokens=m, temperature=0, ignore_eos=True)
                    for *_, m in WORKED.values()
                ],
            ),
        )
    }
    assert not any(r.preempted for r in roomy.trace)
    for policy in ("newest", "least_progressed"):
        _, done = run_worked(target, policy)
        assert {i: o.token_ids for i, o in done.items()} == expected, policy


# -- output identity: preemption never changes a token ---------------------------------------------


# 44 bytes + BOS: two full blocks of 16 and more.
SHARED_PREFIX = "FIRST WITCH:\nWhen shall we three meet again\n"


def workload(
    seed: int, shared: str = "", new_tokens: tuple[int, int] = (30, 90), n: int = 12
) -> list[tuple]:
    """(request id, prompt, params): real text, 30-90 new tokens, every other request greedy, the
    rest sampled with a seed each. Request ids are a permutation, so a tie in output tokens (broken
    by id) and the admission order (newest first) point at different victims."""
    text = shipped_validation_text()
    rng = np.random.default_rng(seed)
    lengths = rng.integers(10, 60, size=n)
    starts = rng.integers(0, len(text) - 60, size=n)
    max_tokens = rng.integers(new_tokens[0], new_tokens[1] + 1, size=n)
    request_ids = [int(i) for i in rng.permutation(n)]
    out = []
    for k in range(n):
        if k % 2:
            params = SamplingParams(max_tokens=int(max_tokens[k]), temperature=0, ignore_eos=True)
        else:
            params = SamplingParams(
                max_tokens=int(max_tokens[k]),
                temperature=0.8,
                top_p=0.9,
                seed=1000 + k,
                ignore_eos=True,
            )
        out.append((request_ids[k], shared + text[starts[k] : starts[k] + lengths[k]], params))
    return out


WORKLOADS: dict[str, Callable[[], list[tuple]]] = {
    "plain": lambda: workload(0),
    "shared_prefix": lambda: workload(1, shared=SHARED_PREFIX, new_tokens=(30, 60)),
}
TIGHT = {
    "plain": dict(num_blocks=32, block_size=16),
    "shared_prefix": dict(num_blocks=24, block_size=16),
}


class Runs:
    """Engine runs shared by the tests of this module, each computed once."""

    def __init__(self, model) -> None:
        self.model, self.cache = model, {}

    def get(
        self, name: str, policy: str | None, tight: bool
    ) -> tuple[LLMEngine, dict[int, RequestOutput]]:
        key = (name, policy, tight)
        if key not in self.cache:
            size = TIGHT[name] if tight else dict(num_blocks=256, block_size=16)
            prefix_caching = tight and name == "shared_prefix"
            config = SchedulerConfig(
                max_num_seqs=16,
                max_num_batched_tokens=128,
                preemption=policy,
                enable_prefix_caching=prefix_caching,
            )
            engine = LLMEngine(self.model, EngineConfig(scheduler=config, **size))
            for request_id, prompt, params in WORKLOADS[name]():
                engine.add_request(prompt, params, request_id=request_id)
            done: dict[int, RequestOutput] = {}
            for _ in range(2000):
                if not engine.has_unfinished():
                    break
                done.update({o.request_id: o for o in engine.step() if o.finished})
            else:
                pytest.fail(f"{key}: the engine did not finish in 2000 steps")
            self.cache[key] = engine, done
        return self.cache[key]


@pytest.fixture(scope="module")
def runs(target) -> Runs:
    return Runs(target)


def preemptions(engine: LLMEngine) -> int:
    return sum(len(r.preempted) for r in engine.trace)


@pytest.mark.parametrize("name", ["plain", "shared_prefix"])
@pytest.mark.parametrize(
    "policy",
    [
        pytest.param("newest", marks=ch05_2),
        pytest.param("least_progressed", marks=[ch05_1, ch05_2]),
    ],
)
def test_preemption_never_changes_a_token(runs: Runs, name: str, policy: str) -> None:
    roomy, expected = runs.get(name, "newest", tight=False)
    assert preemptions(roomy) == 0 and not any(r.stalled for r in roomy.trace)
    tight, got = runs.get(name, policy, tight=True)
    assert preemptions(tight) > 5
    assert {i: o.token_ids for i, o in got.items()} == {i: o.token_ids for i, o in expected.items()}
    assert all(o.finish_reason == LENGTH for o in got.values()) and len(got) == 12
    # Both kinds of request were thrown out and recomputed, and recomputing cost real work.
    params = {request_id: p for request_id, _, p in WORKLOADS[name]()}
    preempted = {i for i, o in got.items() if o.num_preemptions}
    assert {params[i].greedy for i in preempted} == {True, False}
    assert sum(r.recomputed_tokens for r in tight.trace) > 0
    assert tight.manager.num_free == tight.config.num_blocks and not tight.manager.tables
    assert not any(tight.manager.allocator.refcounts) and not tight.has_unfinished()


@ch05_2
def test_a_resumed_sequence_finds_its_prefix_in_the_cache(runs: Runs) -> None:
    for policy in ("newest", "least_progressed"):
        engine, _ = runs.get("shared_prefix", policy, tight=True)
        # A step that admitted only resumed sequences and still hit the prefix cache: the hit is
        # theirs.
        hits = [
            r
            for r in engine.trace
            if r.resumed and set(r.admitted) == set(r.resumed) and r.prefix_hit_tokens
        ]
        assert hits, policy
        # at least the shared prefix's two full blocks, which the other requests still hold
        for r in hits:
            assert r.prefix_hit_tokens % 16 == 0 and r.prefix_hit_tokens >= 32


def test_the_two_policies_choose_different_victims(runs: Runs) -> None:
    # Otherwise the identity test above would say nothing new about least_progressed.
    victims = {
        policy: [i for r in runs.get("plain", policy, tight=True)[0].trace for i in r.preempted]
        for policy in ("newest", "least_progressed")
    }
    assert victims["newest"] != victims["least_progressed"]


# -- trace -----------------------------------------------------------------------------------------


def check_preemption_trace(trace: list[StepRecord]) -> None:
    timeline = request_timeline(trace)
    preempted_at = {}
    for r in trace:
        assert not (r.preempted and r.admitted), f"step {r.step} preempted and admitted"
        assert set(r.resumed) <= set(r.admitted)
        for i in r.preempted:
            preempted_at.setdefault(i, []).append(r.step)
            assert i in r.waiting and i not in r.running
        assert r.waiting[: len(r.preempted)] == tuple(reversed(r.preempted))
        if r.recomputed_tokens:
            assert r.prefilled
    assert preempted_at
    for i, steps in preempted_at.items():
        for when in steps:
            assert timeline[i][when] == "preempted"
            later = [r for r in trace if r.step > when and i in r.resumed]
            assert later, f"request {i} was preempted at step {when} and never resumed"
            assert timeline[i][later[0].step] == "recompute"
            waiting = range(when + 1, later[0].step)
            assert all(timeline[i][s] == "preempted" for s in waiting)
        states = list(timeline[i].values())
        assert states.index("recompute") > states.index("preempted")


@pytest.mark.parametrize("policy", ["newest", "least_progressed"])
def test_the_trace_shows_every_preemption_and_its_recompute(runs: Runs, policy: str) -> None:
    for name in WORKLOADS:
        check_preemption_trace(runs.get(name, policy, tight=True)[0].trace)


# -- a request that can never fit ------------------------------------------------------------------


def small_engine(
    model, preemption, num_blocks: int = 8, block_size: int = 16, **scheduler
) -> LLMEngine:
    scheduler.setdefault("max_num_seqs", 16)
    config = SchedulerConfig(preemption=preemption, **scheduler)
    return LLMEngine(
        model, EngineConfig(num_blocks=num_blocks, block_size=block_size, scheduler=config)
    )


TOO_LONG = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
NORMAL = SamplingParams(max_tokens=30, temperature=0)


@pytest.fixture(scope="module")
def normal_alone(target) -> RequestOutput:
    return small_engine(target, "newest", num_blocks=64).generate(["JULIET:\n"], NORMAL)[0]


def check_cache_full(
    engine: LLMEngine, too_long: RequestOutput, normal: RequestOutput, alone: RequestOutput
) -> None:
    # 8 blocks of 16 hold 128 tokens: the 8-token prompt and 120 outputs; the 121st output needs a
    # 129th slot.
    assert too_long.finished and too_long.finish_reason == CACHE_FULL
    assert len(too_long.token_ids) == 121
    assert too_long.finish_message.startswith(
        "sequence 0 needs 9 KV-cache blocks for its next token but the whole cache has 8"
    )
    assert normal.finish_reason == alone.finish_reason and normal.token_ids == alone.token_ids
    assert normal.finish_message is None
    ended = [r for r in engine.trace if (0, CACHE_FULL) in r.finished]
    assert (
        len(ended) == 1
        and 0 not in ended[0].running
        and 0 not in [c for c, _ in ended[0].prefilled]
    )
    assert (
        engine.manager.num_free == 8
        and not engine.manager.tables
        and not any(engine.manager.allocator.refcounts)
    )
    assert not engine.has_unfinished()


@pytest.mark.parametrize(
    "policy",
    [
        pytest.param("newest", marks=ch05_3),
        pytest.param("least_progressed", marks=ch05_3),
        Stall(),
    ],
)
def test_a_request_that_cannot_fit_alone_ends_cache_full(target, normal_alone, policy) -> None:
    engine = small_engine(target, policy)
    too_long, normal = engine.generate(["ROMEO:\n", "JULIET:\n"], [TOO_LONG, NORMAL])
    check_cache_full(engine, too_long, normal, normal_alone)
    assert preemptions(engine) == 0  # the normal request was done long before the cache filled up
    ended = engine.trace[-1]  # alone, it is ended by the scheduler in a step with nothing to run
    assert (
        ended.finished == ((0, CACHE_FULL),)
        and ended.num_batched_tokens == 0
        and ended.forward_s == 0.0
    )


@ch05_3
@ch05_2
def test_a_neighbour_preempted_for_a_hopeless_request_comes_back(target, normal_alone) -> None:
    # The normal request arrives when the long one holds 7 of the 8 blocks; when the long one needs
    # the 8th, the newcomer is preempted; then the long one ends cache_full and the newcomer
    # resumes.
    engine = small_engine(target, "newest")
    engine.add_request("ROMEO:\n", TOO_LONG, request_id=0)
    done = {}
    for index in itertools.count():
        if index == 100:
            engine.add_request("JULIET:\n", NORMAL, request_id=1)
        if not engine.has_unfinished():
            break
        done.update({o.request_id: o for o in engine.step() if o.finished})
    check_cache_full(engine, done[0], done[1], normal_alone)
    assert done[1].num_preemptions == 1 and done[0].num_preemptions == 0
    assert [r.preempted for r in engine.trace if r.preempted] == [(1,)]
    # The blocks the long one gives back are the newcomer's in the very same step: it resumes there.
    resumed = [r for r in engine.trace if r.resumed]
    assert (
        len(resumed) == 1
        and resumed[0].resumed == (1,)
        and resumed[0].finished == ((0, CACHE_FULL),)
    )
    assert resumed[0].recomputed_tokens > 0


def test_without_preemption_a_hopeless_request_with_a_neighbour_deadlocks(target) -> None:
    # The same late arrival with the Stall policy: two running sequences, both need a block, none
    # is free.
    engine = small_engine(target, Stall())
    engine.add_request("ROMEO:\n", TOO_LONG, request_id=0)
    with pytest.raises(SchedulerStalled, match="no sequence can make progress"):
        for index in range(300):
            if index == 100:
                engine.add_request("JULIET:\n", NORMAL, request_id=1)
            engine.step()
    assert set(engine.trace[-1].running) == {0, 1} and engine.manager.num_free == 0


# -- without preemption a burst deadlocks; with it, it finishes ------------------------------------


BURST = ["To be", "or not", "to be:", "that is"]
BURST_PARAMS = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


def test_without_preemption_a_burst_stalls(target) -> None:
    engine = small_engine(target, Stall(), num_blocks=12, block_size=4)
    with pytest.raises(SchedulerStalled, match="no sequence can make progress") as raised:
        engine.generate(BURST, BURST_PARAMS)
    assert "4 running sequence(s) need a new block" in str(raised.value)
    assert "0 of 12 blocks are free" in str(raised.value)
    last = engine.trace[-1]
    assert len(last.running) == 4 and last.blocks_free == 0
    # then all four wait
    assert set(last.stalled) | set(last.decoded) == set(last.running) and last.stalled
    assert len(engine.trace) == engine.scheduler.step - 1  # the step that raised left no record
    assert not any(r.preempted for r in engine.trace)


@ch05_3
@pytest.mark.parametrize(
    "policy",
    [
        pytest.param("newest", marks=ch05_2),
        pytest.param("least_progressed", marks=[ch05_1, ch05_2]),
    ],
)
def test_with_preemption_the_same_burst_finishes(target, policy: str) -> None:
    engine = small_engine(target, policy, num_blocks=12, block_size=4)
    outs = engine.generate(BURST, BURST_PARAMS)
    assert [o.finish_reason for o in outs] == [LENGTH] * 4 and all(
        len(o.token_ids) == 20 for o in outs
    )
    assert preemptions(engine) > 0 and not any(r.stalled for r in engine.trace)
    roomy = small_engine(target, Stall(), num_blocks=64, block_size=4).generate(BURST, BURST_PARAMS)
    assert [o.token_ids for o in outs] == [o.token_ids for o in roomy]
    assert engine.manager.num_free == 12 and not engine.manager.tables
    check_preemption_trace(engine.trace)


# -- the property test: random workloads over tiny caches, the pure scheduler ----------------------


def blocks_for(n: int, block_size: int) -> int:
    return -(-n // block_size)


@st.composite
def preempting_workloads(draw):
    block_size = draw(st.integers(1, 4))
    prefix_caching = draw(st.booleans())
    shared = draw(st.lists(st.integers(0, 3), max_size=10))
    requests = []  # (prompt, max_tokens, eos_at or None, arrival step)
    for _ in range(draw(st.integers(2, 7))):
        head = shared[: draw(st.integers(0, len(shared)))] if prefix_caching else []
        tail = draw(st.lists(st.integers(0, 3), min_size=0 if head else 1, max_size=10))
        requests.append(
            (
                head + tail,
                draw(st.integers(1, 12)),
                draw(st.none() | st.integers(1, 12)),
                draw(st.integers(0, 6)),
            )
        )
    max_num_seqs = draw(st.integers(2, 4))
    chunked = draw(st.booleans())
    longest = max(len(p) for p, *_ in requests)
    low = max(max_num_seqs, 1 if chunked else longest)
    budget = draw(st.integers(low, max(low, 20)))
    # What a request needs alone: slots for its prompt and every output but the last (never
    # computed).
    largest = max(blocks_for(len(p) + m - 1, block_size) for p, m, *_ in requests)
    # about the largest alone: the others must make room
    num_blocks = largest + draw(st.integers(0, 2))
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        chunked_prefill=chunked,
        enable_prefix_caching=prefix_caching,
        batching=draw(st.sampled_from(["continuous", "continuous", StaticBatching()])),
        preemption=draw(st.sampled_from(["newest", "least_progressed"])),
    )
    return config, num_blocks, block_size, requests


def fake_token(seq_id: int, position: int, eos_at: int | None, prompt_len: int) -> int:
    if eos_at is not None and position == prompt_len + eos_at - 1:
        return EOS
    # the prompts' tiny alphabet: outputs may extend a shared prefix
    return seq_id * 5 + position * 3 % 4


@ch05_3
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(preempting_workloads())
def test_random_preempting_workloads_finish_and_keep_the_books(workload) -> None:
    config, num_blocks, block_size, requests = workload
    manager = BlockManager(num_blocks, block_size)
    s = Scheduler(config, manager)
    seqs = [
        Sequence(i, list(p), SamplingParams(max_tokens=m), seed=i, eos_token_id=EOS)
        for i, (p, m, _, _) in enumerate(requests)
    ]
    # our own count of what each sequence ever had computed
    high_water = {x.seq_id: 0 for x in seqs}
    kv: dict[int, tuple[int, ...]] = {}  # slot -> the token prefix whose "K/V" sits there
    last_arrival = max(a for *_, a in requests)
    max_steps = last_arrival + 40 * (sum(len(p) + m for p, m, *_ in requests) + 1)
    for index in range(max_steps + 1):
        for x, (*_, arrival) in zip(seqs, requests):
            if arrival == index:
                s.add(x)
        if not s.has_unfinished():
            if index >= last_arrival:
                break
            continue
        tokens_before = {x.seq_id: list(x.token_ids) for x in s.running}
        # SchedulerStalled here fails the test: with preemption nothing may stall
        plan = s.schedule()
        assert_refcounts_match_tables(manager)
        chunk_ids = [c.seq_id for c in plan.chunks]
        assert plan.chunks and not plan.finished  # nobody is too big
        # Only a prompt chunk may wait for a block (rather than preempt for it); a decode never
        # does.
        assert all(not s.sequences[i].is_decoding for i in plan.stalled)
        assert len(set(chunk_ids)) == len(chunk_ids)
        if plan.preempted:
            event("preempted")
            assert plan.admitted == (), "a step that preempted must not admit"
            k = len(plan.preempted)
            assert ids(s.waiting)[:k] == list(reversed(plan.preempted)), (
                "victims go to the very front"
            )
            for i in plan.preempted:
                x = s.sequences[i]
                assert i not in chunk_ids and i not in manager and x not in s.running
                assert (
                    x.status is Status.WAITING
                    and x.num_computed_tokens == 0
                    and x.num_preemptions >= 1
                )
                assert x.token_ids == tokens_before[i], "a preemption must keep the tokens"
        if plan.resumed:
            event("resumed")
            if plan.prefix_hit_tokens:
                event("resumed with prefix hits")
        assert set(plan.resumed) == {i for i in plan.admitted if s.sequences[i].num_preemptions}
        expected_recompute = sum(
            max(0, min(c.start + c.num_tokens, high_water[c.seq_id]) - c.start) for c in plan.chunks
        )
        assert plan.recomputed_tokens == expected_recompute
        if expected_recompute:
            event("recomputed")
        # The fake forward pass: every chunk reads the right context, then writes its own tokens.
        slots = {
            c.seq_id: manager.slot_mapping(c.seq_id, range(c.start + c.num_tokens))
            for c in plan.chunks
        }
        for c in plan.chunks:
            x, where = s.sequences[c.seq_id], slots[c.seq_id]
            assert c.start == x.num_computed_tokens
            for p in range(c.start):
                assert kv.get(where[p]) == tuple(x.token_ids[: p + 1]), (
                    f"sequence {x.seq_id} reads a wrong K/V at {p}"
                )
        for c in plan.chunks:
            x, where = s.sequences[c.seq_id], slots[c.seq_id]
            for p in range(c.start, c.start + c.num_tokens):
                kv[where[p]] = tuple(x.token_ids[: p + 1])
            high_water[c.seq_id] = max(high_water[c.seq_id], c.start + c.num_tokens)
        sampled = {
            i: fake_token(i, s.sequences[i].num_tokens, requests[i][2], len(requests[i][0]))
            for i in plan.sampling_seq_ids
        }
        s.update(plan, sampled)
        assert_refcounts_match_tables(manager)
        assert set(manager.tables) == {x.seq_id for x in s.running}
        assert all(x.status is Status.WAITING and x.num_computed_tokens == 0 for x in s.waiting)
    else:
        pytest.fail(f"not finished after {max_steps} steps: a livelock")
    assert (
        manager.num_free == num_blocks
        and not manager.tables
        and not any(manager.allocator.refcounts)
    )
    assert not s.waiting and not s.running and not s.sequences
    for x, (prompt, max_tokens, eos_at, _) in zip(seqs, requests):
        assert x.is_finished and x.token_ids[: len(prompt)] == prompt
        if eos_at is not None and eos_at <= max_tokens:
            assert (x.finish_reason, x.num_output_tokens, x.token_ids[-1]) == (STOP, eos_at, EOS)
        else:
            assert (x.finish_reason, x.num_output_tokens) == (LENGTH, max_tokens)
