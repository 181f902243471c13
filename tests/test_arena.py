"""Chapters 02-03: the memory-arena simulator -- contiguous first-fit vs the paged cache, same
workload."""

from __future__ import annotations

import pytest

from minivllm.book.arena import (
    Request,
    SimResult,
    make_workload,
    simulate_contiguous,
    simulate_paged,
)


def req(id: int, prompt: int, output: int, max_len: int, arrival: int = 0) -> Request:
    return Request(id, arrival, prompt, output, max_len)


# A fills [0,3), B [3,7), C [7,10) of a 10-slot arena. A and C finish at step 1, leaving two holes
# of 3: 6 slots free, but D needs 5 in one piece. It waits (fragmentation) until B finishes at step
# 3.
FRAGMENTING = [req(0, 1, 1, 3), req(1, 1, 3, 4), req(2, 1, 1, 3), req(3, 1, 1, 5)]


def check_memory_maps(result: SimResult) -> None:
    """Every step: extents inside the arena, never overlapping, used <= reserved, and the books
    balance."""
    for s in result.steps:
        extents = sorted(s.memory_map, key=lambda e: e.start)
        for e in extents:
            assert 0 <= e.start and e.start + e.reserved <= result.capacity
            assert 0 <= e.used <= e.reserved
        for a, b in zip(extents, extents[1:]):
            assert a.start + a.reserved <= b.start, f"step {s.step}: {a} overlaps {b}"
        assert s.used <= s.reserved <= result.capacity
        assert s.reserved + s.free == result.capacity
        assert s.largest_free <= s.free
        assert set(s.running) == {e.seq_id for e in s.memory_map}
    last = result.steps[-1]
    assert (last.running, last.reserved, last.free, last.largest_free) == (
        (),
        0,
        result.capacity,
        result.capacity,
    )


def test_workload_is_seeded_and_sane() -> None:
    a, b = make_workload(60, seed=1), make_workload(60, seed=1)
    assert a == b and a != make_workload(60, seed=2)
    assert [r.id for r in a] == list(range(60))
    assert all(1 <= r.output_len <= r.max_tokens and r.prompt_len >= 4 for r in a)
    assert [r.arrival for r in a] == sorted(r.arrival for r in a)
    # mixed lengths
    assert len({r.prompt_len for r in a}) > 20 and len({r.max_tokens for r in a}) > 1


def test_same_seed_same_results() -> None:
    w = make_workload(40, seed=3)
    for run in (lambda: simulate_contiguous(w, 4096), lambda: simulate_paged(w, 256, 16)):
        first, second = run(), run()
        assert first.steps == second.steps and first.summary() == second.summary()


def test_contiguous_counts_external_fragmentation_exactly() -> None:
    r = simulate_contiguous(FRAGMENTING, arena_slots=10)
    assert [s.fragmented for s in r.steps] == [
        None,
        3,
        3,
        None,
        None,
    ]  # step 0: free 0 < 5, not fragmentation
    assert [(s.free, s.largest_free) for s in r.steps[:3]] == [(0, 0), (6, 3), (6, 3)]
    assert (r.fragmentation_refusals, r.fragmented_requests) == (2, 1)
    assert r.completed == [0, 2, 1, 3] and r.num_steps == 5
    check_memory_maps(r)


def test_contiguous_internal_waste_is_exact() -> None:
    # 8 slots reserved for a request that only ever holds 2, then 3 tokens: (6/8 + 5/8) / 2 wasted.
    r = simulate_contiguous([req(0, 2, 2, 8)], arena_slots=10)
    assert [(s.used, s.reserved) for s in r.steps] == [(2, 8), (3, 8), (0, 0)]
    assert r.internal_waste == pytest.approx(11 / 16) and r.kv_utilisation == pytest.approx(5 / 16)
    check_memory_maps(r)


def test_first_fit_reuses_the_lowest_hole_and_coalesces() -> None:
    r = simulate_contiguous(FRAGMENTING, arena_slots=10)
    assert [(e.seq_id, e.start) for e in r.steps[0].memory_map] == [(0, 0), (1, 3), (2, 7)]
    # holes merged back into one
    assert [(e.seq_id, e.start) for e in r.steps[3].memory_map] == [(3, 0)]


def test_paged_same_workload_completes_with_better_utilisation() -> None:
    contiguous = simulate_contiguous(FRAGMENTING, arena_slots=10)
    paged = simulate_paged(FRAGMENTING, num_blocks=5, block_size=2)
    assert sorted(paged.completed) == [0, 1, 2, 3] and paged.fragmentation_refusals == 0
    assert paged.kv_utilisation > contiguous.kv_utilisation
    assert paged.num_steps <= contiguous.num_steps
    check_memory_maps(paged)
    for s in paged.steps:
        assert all(e.start % 2 == 0 and e.reserved == 2 for e in s.memory_map)  # whole blocks


def test_paged_utilisation_is_exact_on_one_request() -> None:
    r = simulate_paged([req(0, 2, 2, 8)], num_blocks=5, block_size=2)
    assert [(s.used, s.reserved) for s in r.steps] == [(2, 2), (3, 4), (0, 0)]
    assert r.kv_utilisation == pytest.approx((1 + 3 / 4) / 2)


def test_paged_deadlock_is_broken_by_preempting_the_youngest() -> None:
    # Two blocks of 2; both prompts fill one block each, then both need a second one: nobody can
    # move.
    w = [req(0, 2, 2, 4), req(1, 2, 2, 4)]
    r = simulate_paged(w, num_blocks=2, block_size=2)
    assert [s.preempted for s in r.steps] == [(), (1,), (), (), ()]
    assert r.completed == [0, 1] and r.preemptions == 1
    check_memory_maps(r)
    # one at a time either way
    assert simulate_contiguous(w, arena_slots=4).num_steps == r.num_steps


def test_stalls_when_a_block_is_missing() -> None:
    # Three blocks of 2: A (prompt 2) takes one, B (prompt 3) two. At step 1 A needs a block and
    # none is free: it stalls, while B fills its slack slot and finishes; A moves on at step 2.
    r = simulate_paged([req(0, 2, 3, 6), req(1, 3, 1, 6)], num_blocks=3, block_size=2)
    assert [s.stalled for s in r.steps[:3]] == [(), (0,), ()] and r.preemptions == 0
    assert sorted(r.completed) == [0, 1]
    check_memory_maps(r)


@pytest.mark.parametrize(
    "simulate", [lambda w: simulate_contiguous(w, 64), lambda w: simulate_paged(w, 4, 16)]
)
def test_a_request_that_can_never_fit_is_refused_up_front(simulate) -> None:
    with pytest.raises(ValueError, match="request 7 may need 65 slots"):
        simulate([req(0, 1, 1, 8), req(7, 1, 1, 65)])


def test_a_malformed_request_is_refused() -> None:
    with pytest.raises(ValueError, match="request 0"):
        simulate_contiguous([req(0, 2, 7, 8)], 64)  # output 7 > max_tokens 6


def test_default_workload_meets_the_chapter_goals() -> None:
    w = make_workload()
    contiguous, paged = simulate_contiguous(w, 8192), simulate_paged(w, 512, 16)
    assert len(contiguous.completed) == len(paged.completed) == len(w) == 200
    assert contiguous.internal_waste > 0.4 and contiguous.fragmentation_refusals > 0
    assert paged.kv_utilisation >= 0.96
    assert paged.mean_running_saturated >= 2.5 * contiguous.mean_running_saturated
    assert paged.peak_running >= 2.5 * contiguous.peak_running
    assert paged.num_steps < contiguous.num_steps
    check_memory_maps(contiguous)
    check_memory_maps(paged)
