"""Chapter 03: the paged KV cache's policy half -- block pool (LRU free queue), block tables,
copy-on-write, prefix cache, and the scheduler's seams (allocate_slots, commit)."""

from __future__ import annotations

import copy

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from minivllm.kv.block_manager import BlockManager, SequenceTooLong
from minivllm.kv.block_pool import BlockPool, OutOfBlocks
from minivllm.kv.prefix_cache import block_hash


def snapshot(m: BlockManager) -> tuple:
    a, cache = m.allocator, m.prefix_cache
    return (
        a.free_blocks(),
        list(a.refcounts),
        copy.deepcopy(m.tables),
        list(cache.hashes),
        dict(cache.cached),
        list(m.pending_copies),
    )


# -- BlockPool ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, field", [((0, 4), "num_blocks"), ((8, 0), "block_size"), ((-1, 4), "num_blocks")]
)
def test_allocator_validates_its_sizes(args: tuple, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        BlockPool(*args)


def test_allocator_counts_and_refcounts() -> None:
    a = BlockPool(4, 2)
    assert [a.allocate() for _ in range(3)] == [0, 1, 2]
    assert (a.num_free, a.num_used, a.refcount(1), a.refcount(3)) == (1, 3, 1, 0)
    a.incref(1)
    a.decref(1)
    assert a.refcount(1) == 1 and a.num_free == 1
    a.decref(1)
    assert a.refcount(1) == 0 and a.num_free == 2


def test_the_free_queue_is_least_recently_used_first() -> None:
    a = BlockPool(4, 2)
    blk_a, blk_b = a.allocate(), a.allocate()
    a.decref(blk_a)
    a.decref(blk_b)  # both worth keeping (the default): to the back, in the order freed
    assert a.free_blocks() == [2, 3, blk_a, blk_b]  # never-used blocks go first
    assert [a.allocate() for _ in range(4)] == [2, 3, blk_a, blk_b]


def test_a_block_with_nothing_worth_keeping_is_reused_first() -> None:
    a = BlockPool(4, 2)
    blk_a, blk_b = a.allocate(), a.allocate()
    a.decref(blk_a, keep=False)
    a.decref(blk_b, keep=False)  # to the front: the last one freed is handed out first
    assert a.free_blocks() == [blk_b, blk_a, 2, 3]
    a.take(blk_a)  # a prefix-cache hit takes a block out of the middle of the queue
    assert a.free_blocks() == [blk_b, 2, 3] and a.refcount(blk_a) == 1
    assert [a.allocate() for _ in range(3)] == [blk_b, 2, 3]


def test_allocator_errors_are_loud() -> None:
    a = BlockPool(2, 2)
    b = a.allocate()
    a.decref(b)
    with pytest.raises(ValueError, match="double free"):
        a.decref(b)
    with pytest.raises(ValueError, match="free"):
        a.incref(b)
    with pytest.raises(IndexError, match="outside the pool"):
        a.refcount(2)
    a.allocate(), a.allocate()
    with pytest.raises(OutOfBlocks, match="needed 1, only 0 free") as err:
        a.allocate()
    assert (err.value.needed, err.value.free) == (1, 0)


# -- blocks_needed (exercise ch03.1) ---------------------------------------------------------------


@pytest.mark.exercise("ch03.1")
@pytest.mark.parametrize(
    "now, extra, want",
    [
        (5, 3, 0),
        (5, 4, 1),
        (0, 0, 0),
        (0, 1, 1),
        (0, 4, 1),
        (0, 5, 2),
        (4, 1, 1),
        (4, 0, 0),
        (3, 9, 2),
        (3, 10, 3),
        (8, 8, 2),
    ],
)
def test_blocks_needed_is_lazy(now: int, extra: int, want: int) -> None:
    assert BlockManager(16, 4).blocks_needed(now, extra) == want


@pytest.mark.exercise("ch03.1")
def test_append_grows_only_when_the_slack_runs_out() -> None:
    m = BlockManager(8, 4)
    m.allocate(0, 5)
    assert len(m.tables[0].blocks) == 2
    m.append(0, 3)
    assert len(m.tables[0].blocks) == 2 and m.num_free == 6
    m.append(0, 1)
    assert m.tables[0].blocks == [0, 1, 2] and m.tables[0].num_tokens == 9


# -- block tables ----------------------------------------------------------------------------------


def test_allocate_append_free_and_slot_mapping() -> None:
    m = BlockManager(8, 4)
    m.allocate(7, 6)
    assert m.tables[7].blocks == [0, 1]
    assert m.slot_mapping(7, range(6)) == [0, 1, 2, 3, 4, 5]
    m.allocate(8, 1)
    m.append(7, 3)  # 9 tokens: a third block, after sequence 8's
    assert m.tables[7].blocks == [0, 1, 3]
    assert m.slot_mapping(7, [3, 4, 8]) == [3, 4, 12]
    m.free(7)
    assert m.num_free == 7 and 7 not in m.tables
    with pytest.raises(KeyError, match="no block table"):
        m.free(7)
    with pytest.raises(ValueError, match="already has"):
        m.allocate(8, 1)
    with pytest.raises(IndexError, match="position 1 is outside"):
        m.slot_mapping(8, [1])


def test_out_of_blocks_is_transactional() -> None:
    m = BlockManager(4, 2)
    m.allocate(0, 3)
    m.allocate(1, 2)
    before = snapshot(m)
    with pytest.raises(OutOfBlocks, match="needed 2, only 1 free") as err:
        m.append(0, 4)  # 3 -> 7 tokens: 2 blocks held, 4 needed
    assert (err.value.needed, err.value.free) == (2, 1)
    assert snapshot(m) == before
    with pytest.raises(OutOfBlocks) as err:
        m.allocate(2, 3)
    assert (err.value.needed, err.value.free) == (2, 1) and 2 not in m.tables
    assert snapshot(m) == before


def test_a_sequence_bigger_than_the_pool_can_never_fit() -> None:
    m = BlockManager(4, 2)
    with pytest.raises(
        SequenceTooLong, match="needs 5 blocks but the pool only has 4: it can never fit"
    ):
        m.allocate(0, 9)
    m.allocate(0, 8)
    before = snapshot(m)
    with pytest.raises(SequenceTooLong):
        m.append(0, 1)
    assert snapshot(m) == before
    assert not issubclass(SequenceTooLong, OutOfBlocks)  # not retryable


def test_fork_shares_every_block() -> None:
    m = BlockManager(8, 2)
    m.allocate(0, 3)
    m.fork(0, 1)
    assert m.tables[1].blocks == m.tables[0].blocks == [0, 1] and m.tables[1].num_tokens == 3
    assert [m.allocator.refcount(b) for b in (0, 1)] == [2, 2]
    m.free(0)
    assert [m.allocator.refcount(b) for b in (0, 1)] == [1, 1] and m.num_free == 6
    with pytest.raises(ValueError, match="already has"):
        m.fork(1, 1)


# -- copy-on-write (exercise ch03.2) ---------------------------------------------------------------


@pytest.mark.exercise("ch03.2")
def test_copy_on_write_leaves_an_unshared_block_in_place() -> None:
    m = BlockManager(8, 2)
    m.allocate(0, 3)
    assert m.copy_on_write(0, 2) is False, "a block held by one sequence is written in place"
    assert m.block_table(0) == [0, 1] and m.num_free == 6 and m.take_copies() == []


@pytest.mark.exercise("ch03.2")
def test_copy_on_write_copies_a_shared_block_first() -> None:
    m = BlockManager(8, 2)
    m.allocate(0, 3)  # blocks [0, 1]
    m.fork(0, 1)
    assert m.copy_on_write(1, 2) is True, "block 1 is shared with the parent: it must be copied"
    assert m.tables[1].blocks == [0, 2] and m.tables[0].blocks == [0, 1], (
        "the child gets block 2 in place of block 1; the parent's table is untouched"
    )
    assert [m.allocator.refcount(b) for b in (0, 1, 2)] == [2, 1, 1], (
        "the child let go of block 1 (the parent still holds it) and holds block 2"
    )
    assert m.take_copies() == [(1, 2)], "the storage must copy block 1 into block 2"
    assert m.take_copies() == [], "each copy is handed out once"
    assert m.copy_on_write(0, 2) is False  # the parent holds block 1 alone now
    assert m.take_copies() == []
    assert m.slot_mapping(1, [2]) == [4] and m.slot_mapping(0, [2]) == [2]


@pytest.mark.exercise("ch03.2")
def test_copy_on_write_out_of_blocks_is_transactional() -> None:
    m = BlockManager(2, 2)
    m.allocate(0, 4)
    m.fork(0, 1)
    before = snapshot(m)
    with pytest.raises(OutOfBlocks, match="needed 1, only 0 free") as err:
        m.copy_on_write(1, 0)
    assert (err.value.needed, err.value.free) == (1, 0)
    assert snapshot(m) == before, "a refused copy-on-write must change nothing"
    m.free(0)
    assert m.copy_on_write(1, 0) is False and m.take_copies() == []


def test_copy_on_write_checks_the_position() -> None:
    m = BlockManager(4, 2)
    m.allocate(0, 3)  # two blocks: slots for positions 0..3
    with pytest.raises(IndexError, match=r"position 4 is outside the blocks of sequence 0 \(4"):
        m.copy_on_write(0, 4)


# -- prefix caching --------------------------------------------------------------------------------


def test_block_hash_is_deterministic_and_chained() -> None:
    assert (
        block_hash(None, [1, 2]) == block_hash(None, [1, 2]) and len(block_hash(None, [1, 2])) == 32
    )
    assert block_hash(None, [1, 2]) != block_hash(None, [2, 1])
    assert block_hash(block_hash(None, [1, 2]), [3, 4]) != block_hash(
        block_hash(None, [9, 9]), [3, 4]
    )


def test_prefix_cache_hits_shared_full_blocks() -> None:
    m = BlockManager(8, 2)
    assert m.allocate_cached(0, [1, 2, 3, 4, 5]) == 0  # blocks [0, 1, 2]; the first two are named
    assert m.allocate_cached(1, [1, 2, 3, 4, 9, 9]) == 4
    assert m.tables[1].blocks == [0, 1, 3]
    assert [m.allocator.refcount(b) for b in (0, 1, 2, 3)] == [2, 2, 1, 1]
    assert m.allocate_cached(2, [1, 2, 7, 7]) == 2  # a different second block: only the first hits
    assert m.allocate_cached(3, [7, 7]) == 0  # same tokens, different prefix: no hit


def test_freed_blocks_stay_hittable_until_reallocated() -> None:
    m = BlockManager(4, 2)
    m.allocate_cached(0, [1, 2, 3, 4])  # blocks [0, 1]
    m.free(0)
    assert m.num_free == 4
    assert m.allocate_cached(1, [1, 2, 3, 4, 5]) == 4  # both taken back off the free list
    assert m.tables[1].blocks == [0, 1, 2] and m.num_free == 1
    assert sorted(m.allocator.free_blocks()) == [3]
    m.free(1)
    m.allocate(2, 8)  # reallocates every block: every stale name is cleared
    assert m.prefix_cache.cached == {} and set(m.prefix_cache.hashes) == {None}
    m.free(2)
    assert m.allocate_cached(3, [1, 2, 3, 4]) == 0


def test_a_hash_hit_is_verified_against_the_tokens() -> None:
    m = BlockManager(4, 2)
    m.allocate_cached(0, [1, 2])
    m.prefix_cache.tokens[0] = (6, 6)  # pretend a collision: same name, other tokens
    assert m.allocate_cached(1, [1, 2]) == 0 and m.tables[1].blocks == [1]


def test_a_hot_prefix_outlives_blocks_that_were_never_used() -> None:
    # The bug a LIFO free list had: freeing a sequence put its prefix blocks on top of the stack,
    # so the very next request overwrote them while blocks that were never used sat idle.
    m, system_prompt = BlockManager(16, 4), list(range(100, 108))
    m.allocate_cached(0, system_prompt + [1, 2, 3, 4, 5])  # blocks 0, 1, 2 named; 3 a partial tail
    m.free(0)
    free = m.allocator.free_blocks()
    # The unnamed tail is reused first; the named blocks wait at the back, tail first, head last.
    assert free[0] == 3 and free[-3:] == [2, 1, 0]
    m.allocate_cached(1, [7] * 12)  # 3 blocks: 3, 4, 5
    m.free(1)
    assert m.cached_prefix(system_prompt + [9]) == [0, 1]  # the hot prefix kept both blocks


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.lists(st.integers(0, 2), max_size=14)), max_size=30))
def test_a_cached_block_is_never_handed_out_while_a_never_used_one_is_free(ops: list) -> None:
    m = BlockManager(12, 2)
    pool, cache = m.allocator, m.prefix_cache
    never_used, live = set(range(12)), []
    for seq_id, (free_one, tokens) in enumerate(ops):
        if free_one and live:
            m.free(live.pop(0))
            continue
        hittable = {b for b in pool.free_blocks() if cache.holds(b)}
        try:
            m.allocate_cached(seq_id, tokens)
        except OutOfBlocks:
            continue
        live.append(seq_id)
        # A hit keeps its name; a block handed out as a fresh one loses it.
        evicted = {b for b in hittable if pool.refcount(b) and not cache.holds(b)}
        never_used -= set(m.block_table(seq_id))
        assert not (evicted and never_used), f"evicted {evicted}, never used {never_used}"


def test_prefix_cache_out_of_blocks_is_transactional() -> None:
    m = BlockManager(3, 2)
    m.allocate_cached(0, [1, 2, 3, 4])
    m.free(0)  # blocks 0, 1 free but named
    m.allocate(1, 1)  # takes block 2, never used: the named ones are evicted last
    before = snapshot(m)
    # hits block 0, then needs 2 new blocks; 1 would be left
    with pytest.raises(OutOfBlocks) as err:
        m.allocate_cached(2, [1, 2, 5, 6, 7])
    assert (err.value.needed, err.value.free) == (2, 1)
    assert snapshot(m) == before
    with pytest.raises(SequenceTooLong):
        m.allocate_cached(2, list(range(7)))


# -- truncate: KV rollback for speculative decoding (exercise ch06.2) ------------------------------

ch06_2 = pytest.mark.exercise("ch06.2")


def grow(m: BlockManager, seq_id: int, extra_tokens: int) -> None:
    """What `append(seq_id, extra_tokens)` does to a table with no slack in its last block, without
    `append`: its block arithmetic is exercise ch03.1, and these tests grade ch06.2 alone. A
    scratch sequence takes the new blocks from the front of the free queue; they move over."""
    scratch = max(m.tables) + 1
    m.allocate(scratch, extra_tokens)
    table, taken = m.tables[seq_id], m.tables.pop(scratch)
    table.blocks += taken.blocks
    table.num_tokens += extra_tokens


def scrambled() -> BlockManager:
    """Sequence 0 holds 13 tokens in blocks [0, 1, 3, 4] (sequence 1 took block 2 in between), then
    sequence 2 takes block 5; 4 of 10 blocks free."""
    m = BlockManager(10, 4)
    m.allocate(0, 8)
    m.allocate(1, 3)
    grow(m, 0, 5)
    m.allocate(2, 1)
    assert (m.tables[0].blocks, m.tables[1].blocks, m.tables[2].blocks, m.num_free) == (
        [0, 1, 3, 4],
        [2],
        [5],
        4,
    )
    return m


@ch06_2
def test_truncate_frees_exactly_the_tail_blocks() -> None:
    m = scrambled()
    m.truncate(0, 5)  # 5 tokens need 2 blocks: 3 and 4 go back
    assert m.tables[0].blocks == [0, 1] and m.num_tokens(0) == 5 and m.num_free == 6
    assert [m.allocator.refcount(b) for b in range(6)] == [1, 1, 1, 0, 0, 1]
    assert sorted(m.allocator.free_blocks()) == [3, 4, 6, 7, 8, 9]
    assert (m.tables[1].blocks, m.num_tokens(1), m.tables[2].blocks, m.num_tokens(2)) == (
        [2],
        3,
        [5],
        1,
    )
    assert m.slot_mapping(0, [4]) == [4]
    with pytest.raises(IndexError, match="position 5 is outside"):
        m.slot_mapping(0, [5])
    m.truncate(0, 0)  # everything: an empty table that stays registered
    assert m.tables[0].blocks == [] and m.num_tokens(0) == 0 and m.num_free == 8 and 0 in m
    m.free(0)  # nothing left to free twice
    assert m.num_free == 8 and [m.allocator.refcount(b) for b in (2, 5)] == [1, 1]


@ch06_2
def test_truncate_inside_the_last_block_frees_nothing() -> None:
    m = scrambled()
    m.truncate(0, 13)  # the same length: a no-op
    assert m.tables[0].blocks == [0, 1, 3, 4] and m.num_tokens(0) == 13 and m.num_free == 4
    m.truncate(0, 12)  # 12 tokens still fill 3 blocks exactly; block 4 goes
    assert m.tables[0].blocks == [0, 1, 3] and m.num_tokens(0) == 12 and m.num_free == 5
    m.truncate(0, 9)  # 9 tokens still need 3 blocks
    assert m.tables[0].blocks == [0, 1, 3] and m.num_tokens(0) == 9 and m.num_free == 5
    assert m.slot_mapping(0, [8]) == [12]  # the last slot kept: block 3, offset 0


@ch06_2
def test_truncate_to_the_same_length_changes_nothing() -> None:
    m = scrambled()
    m.truncate(2, 1)
    before = snapshot(m)
    m.truncate(0, 13)
    m.truncate(1, 3)
    assert snapshot(m) == before


@ch06_2
def test_blocks_given_back_by_truncate_come_back_in_the_same_order() -> None:
    m = BlockManager(16, 4)
    m.allocate(0, 4)
    m.allocate(1, 3)
    grow(m, 0, 13)  # 17 tokens: blocks [0, 2, 3, 4, 5]
    table = m.block_table(0)
    assert table == [0, 2, 3, 4, 5]
    m.truncate(0, 4)  # a rejected speculative round: keep block 0 only
    # Unnamed blocks hold nothing worth keeping: they go to the front of the free queue, in
    # their table order, ahead of the never-used blocks.
    assert m.allocator.free_blocks()[:5] == [2, 3, 4, 5, 6]
    grow(m, 0, 13)  # the next round grows back into the very same blocks, in the same order
    assert m.block_table(0) == table and m.num_tokens(0) == 17 and m.num_free == 10


@ch06_2
def test_truncate_refuses_what_it_cannot_do_and_changes_nothing() -> None:
    m = scrambled()
    m.truncate(0, 9)  # a good one first
    before = snapshot(m)
    for bad in (-1, 10, 14):  # below 0, beyond what it holds now, beyond what it ever held
        with pytest.raises(
            ValueError, match=f"cannot truncate sequence 0 to {bad} tokens: it holds 9"
        ):
            m.truncate(0, bad)
        assert snapshot(m) == before
    with pytest.raises(KeyError, match="no block table"):
        m.truncate(7, 0)
    assert snapshot(m) == before


@ch06_2
def test_truncate_never_cuts_into_named_prefix_cache_blocks() -> None:
    m = BlockManager(8, 4)
    m.allocate_cached(0, list(range(10)))  # blocks [0, 1, 2]; the full ones, 0 and 1, are named
    # shares 0 and 1 through the prefix cache, its own block 3
    m.allocate_cached(1, list(range(10)))
    assert m.tables[1].blocks == [0, 1, 3]
    before = snapshot(m)
    for bad in (0, 4, 7):
        with pytest.raises(ValueError, match="named prefix-cache blocks"):
            m.truncate(1, bad)
        assert snapshot(m) == before
    m.truncate(1, 8)  # exactly the named blocks: the unnamed tail goes
    assert m.tables[1].blocks == [0, 1] and m.num_tokens(1) == 8
    assert m.tables[1].block_hashes == m.tables[0].block_hashes
    assert [m.allocator.refcount(b) for b in range(4)] == [2, 2, 1, 0] and m.num_free == 5
    assert m.cached_prefix(list(range(8))) == [0, 1]  # still hittable


@ch06_2
def test_truncate_of_shared_blocks_only_drops_a_reference() -> None:
    m = BlockManager(8, 4)
    m.allocate(0, 10)  # [0, 1, 2]
    m.fork(0, 1)
    m.truncate(1, 4)
    assert m.tables[1].blocks == [0] and m.num_tokens(1) == 4
    assert m.tables[0].blocks == [0, 1, 2] and m.num_tokens(0) == 10  # the parent keeps its tokens
    assert [m.allocator.refcount(b) for b in range(3)] == [
        2,
        1,
        1,
    ] and m.num_free == 5  # nothing freed
    m.truncate(0, 4)  # now the last holder lets go
    assert [m.allocator.refcount(b) for b in range(3)] == [2, 0, 0] and m.num_free == 7
    # 5 tokens: a block of its own (block 1, at the front of the queue); 0 stays shared
    grow(m, 1, 1)
    assert m.tables[1].blocks == [0, 1] and [m.allocator.refcount(b) for b in (0, 1)] == [2, 1]


# -- property test: long random sequences of operations on a tiny pool -----------------------------


class CacheMachine(RuleBasedStateMachine):
    """Random allocate / append / fork / copy-on-write / engine steps (`allocate_slots`) /
    truncate / free / prefix hits on 8 blocks, against a toy storage.

    The storage holds a value per physical slot and makes the copies that copy-on-write queues; the
    model remembers what each sequence wrote, so copy-on-write mistakes show up as wrong values.
    """

    def __init__(self) -> None:
        super().__init__()
        self.m = BlockManager(8, 3)
        self.storage: dict[int, list] = {b: [None] * 3 for b in range(8)}
        self.written: dict[int, dict[int, int]] = {}  # seq -> position -> value
        self.next_id = 0

    def _new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def _guarded(self, action) -> bool:
        before = snapshot(self.m)
        try:
            action()
            return True
        except (OutOfBlocks, SequenceTooLong):
            assert snapshot(self.m) == before
            return False

    @rule(n=st.integers(0, 30))
    def allocate(self, n: int) -> None:
        seq = self._new_id()
        if self._guarded(lambda: self.m.allocate(seq, n)):
            self.written[seq] = {}

    @rule(tokens=st.lists(st.integers(0, 2), max_size=12))
    def allocate_cached(self, tokens: list) -> None:
        seq = self._new_id()
        if self._guarded(lambda: self.m.allocate_cached(seq, tokens)):
            self.written[seq] = {}  # the toy storage does not model cached contents

    @precondition(lambda self: self.written)
    @rule(data=st.data(), extra=st.integers(0, 7))
    def append(self, data, extra: int) -> None:
        seq = data.draw(st.sampled_from(sorted(self.written)))
        self._guarded(lambda: self.m.append(seq, extra))

    @precondition(lambda self: self.written)
    @rule(data=st.data())
    def fork(self, data) -> None:
        parent, child = data.draw(st.sampled_from(sorted(self.written))), self._new_id()
        self.m.fork(parent, child)
        self.written[child] = dict(self.written[parent])

    def _make_copies(self) -> None:
        """What the storage does before a forward pass: the copies copy-on-write queued."""
        for source, destination in self.m.take_copies():
            self.storage[destination] = list(self.storage[source])

    @precondition(lambda self: any(self.m.tables[s].num_tokens for s in self.written))
    @rule(data=st.data(), value=st.integers())
    def write(self, data, value: int) -> None:
        seq = data.draw(
            st.sampled_from([s for s in sorted(self.written) if self.m.tables[s].num_tokens])
        )
        pos = data.draw(st.integers(0, self.m.tables[seq].num_tokens - 1))
        if self._guarded(lambda: self.m.copy_on_write(seq, pos)):
            self._make_copies()
            (slot,) = self.m.slot_mapping(seq, [pos])
            self.storage[slot // 3][slot % 3] = value
            self.written[seq][pos] = value

    @precondition(lambda self: self.written)
    @rule(
        data=st.data(),
        new=st.integers(1, 7),
        lookahead=st.integers(0, 3),
        shrink=st.booleans(),
        value=st.integers(),
    )
    def step(self, data, new: int, lookahead: int, shrink: bool, value: int) -> None:
        """An engine step for one sequence: `allocate_slots`, the copies, the writes, `commit`."""
        seq = data.draw(st.sampled_from(sorted(self.written)))
        computed = self.m.num_tokens(seq)
        before = snapshot(self.m)
        granted = self.m.allocate_slots(seq, computed, new, lookahead, shrink=shrink)
        if not granted:
            assert snapshot(self.m) == before, "a refused allocate_slots changed something"
            return
        assert granted == new or (shrink and 0 < granted < new)
        assert self.m.num_tokens(seq) == computed + granted + lookahead
        self._make_copies()
        slots = self.m.slot_mapping(seq, range(computed, computed + granted))
        for pos, slot in zip(range(computed, computed + granted), slots):
            self.storage[slot // 3][slot % 3] = value
            self.written[seq][pos] = value
        self.m.commit(seq, [], computed + granted)  # the lookahead slots are rolled back

    @precondition(lambda self: self.written)
    @rule(data=st.data())
    def truncate(self, data) -> None:
        seq = data.draw(st.sampled_from(sorted(self.written)))
        table = self.m.tables[seq]
        num_tokens = data.draw(st.integers(-1, table.num_tokens + 1))
        if len(table.block_hashes) * 3 <= num_tokens <= table.num_tokens:
            self.m.truncate(seq, num_tokens)
            self.written[seq] = {p: v for p, v in self.written[seq].items() if p < num_tokens}
        else:
            before = snapshot(self.m)
            with pytest.raises(ValueError, match="cannot truncate"):
                self.m.truncate(seq, num_tokens)
            assert snapshot(self.m) == before

    @precondition(lambda self: self.written)
    @rule(data=st.data())
    def free(self, data) -> None:
        seq = data.draw(st.sampled_from(sorted(self.written)))
        self.m.free(seq)
        del self.written[seq]

    @invariant()
    def refcounts_match_the_tables(self) -> None:
        a, holders = self.m.allocator, [0] * 8
        for table in self.m.tables.values():
            assert len(table.blocks) == -(-table.num_tokens // 3)
            for b in table.blocks:
                holders[b] += 1
        assert a.refcounts == holders
        memory = self.m.memory()  # the step trace's memory series: held once, listed per table
        assert memory.blocks_used == a.num_used and memory.blocks_saved == sum(holders) - a.num_used
        assert 0 <= memory.slots_empty <= 2 * len(self.m.tables)  # a last block's tail at most
        free, cache = a.free_blocks(), self.m.prefix_cache
        assert len(set(free)) == len(free)  # no double free
        assert set(free) == {b for b in range(8) if holders[b] == 0}  # no leak
        assert a.num_free + a.num_used == 8
        assert all(cache.hashes[b] == h for h, b in cache.cached.items())
        # LRU: every free block the prefix cache can hit is queued behind every one it cannot.
        hittable = [cache.holds(b) for b in free]
        assert hittable == sorted(hittable), f"a cached block before an empty one: {free}"

    @invariant()
    def every_sequence_reads_what_it_wrote(self) -> None:
        for seq, values in self.written.items():
            for pos, value in values.items():
                (slot,) = self.m.slot_mapping(seq, [pos])
                assert self.storage[slot // 3][slot % 3] == value


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


# -- the scheduler's seam: allocate_slots (exercise ch03.4, this chapter's core) -------------------

ch03_4 = pytest.mark.exercise("ch03.4")


@ch03_4
def test_allocate_slots_creates_the_table_and_grows_it_lazily() -> None:
    m = BlockManager(4, 4)
    assert m.allocate_slots(0, 0, 6) == 6 and m.block_table(0) == [0, 1] and m.num_tokens(0) == 6
    assert m.allocate_slots(0, 6, 1) == 1 and m.num_tokens(0) == 7 and m.num_free == 2  # slack
    assert m.allocate_slots(0, 7, 1, 4) == 1  # a decode and 4 lookahead slots: one more block
    assert m.num_tokens(0) == 12 and m.block_table(0) == [0, 1, 2]


@ch03_4
def test_allocate_slots_fills_the_slack_of_the_last_block_first() -> None:
    m = BlockManager(8, 4)
    m.allocate(0, 5)  # blocks [0, 1]: positions 5, 6, 7 are the slack of block 1
    assert m.allocate_slots(0, 5, 3) == 3, "3 new tokens fit the slack: all granted"
    assert m.block_table(0) == [0, 1] and m.num_free == 6, (
        f"the slack of the last block held them: no new block, got table {m.block_table(0)}"
    )
    assert m.num_tokens(0) == 8, f"the table holds 5 + 3 tokens, got {m.num_tokens(0)}"
    assert m.allocate_slots(0, 8, 1) == 1 and m.block_table(0) == [0, 1, 2], (
        "the last block is full: the next token takes exactly one new block"
    )
    assert m.allocate_slots(0, 9, 7) == 7 and m.block_table(0) == [0, 1, 2, 3], (
        "3 slots of slack and one new block for 7 tokens, not two new blocks"
    )
    assert m.num_tokens(0) == 16 and m.num_free == 4


@ch03_4
def test_allocate_slots_keeps_slots_the_table_already_holds() -> None:
    m = BlockManager(8, 4)
    m.allocate(0, 10)  # 10 slots held, only 6 computed: a chunk after a rolled-back draft, say
    assert m.allocate_slots(0, 6, 2) == 2
    assert m.num_tokens(0) == 10 and m.block_table(0) == [0, 1, 2], (
        f"positions 6..7 lie in slots it holds: nothing taken, nothing given back, got "
        f"{m.num_tokens(0)} tokens in {m.block_table(0)}"
    )


@ch03_4
def test_allocate_slots_grows_into_a_contiguous_reservation_without_new_blocks() -> None:
    m = BlockManager(8, 4, layout="contiguous", max_model_len=16)
    assert m.allocate_slots(0, 0, 3) == 3 and m.block_table(0) == [0, 1, 2, 3]  # 16 slots reserved
    assert m.allocate_slots(0, 3, 5) == 5 and m.num_tokens(0) == 8
    assert m.block_table(0) == [0, 1, 2, 3] and m.num_free == 4, (
        f"positions 3..7 lie in the reservation's slots: no new block, got {m.block_table(0)}"
    )


@ch03_4
def test_allocate_slots_refuses_without_changing_anything() -> None:
    m = BlockManager(4, 4)
    m.allocate(0, 9)  # blocks [0, 1, 2]: 3 slots of slack, one block free
    before = snapshot(m)
    assert m.allocate_slots(0, 9, 8) == 0, "8 tokens need 3 slack slots + 2 blocks; 1 is free"
    assert snapshot(m) == before, "a refusal must leave tables, counts and the pool as they were"
    assert m.allocate_slots(0, 9, 3, 5) == 0, "3 tokens and 5 lookahead slots need 2 blocks"
    assert snapshot(m) == before, "a refusal must leave tables, counts and the pool as they were"
    assert m.allocate_slots(1, 0, 5) == 0 and 1 not in m, "a new table of 2 blocks: 1 is free"
    assert snapshot(m) == before
    assert m.allocate_slots(0, 9, 7) == 7 and m.num_tokens(0) == 16 and m.num_free == 0, (
        "7 tokens fit exactly: 3 slack slots and the last free block"
    )


@ch03_4
def test_allocate_slots_shrinks_a_prefill_chunk_to_what_fits() -> None:
    m = BlockManager(4, 4)
    m.allocate(0, 9)  # 3 slots of slack, one block free: room for 7 more tokens
    assert m.allocate_slots(0, 9, 20, shrink=True) == 7, "shrink grants what fits: 3 + 4"
    assert m.num_tokens(0) == 16 and m.block_table(0) == [0, 1, 2, 3]
    before = snapshot(m)
    assert m.allocate_slots(0, 16, 1, shrink=True) == 0, "nothing fits: refused, not 0 granted"
    assert snapshot(m) == before


@ch03_4
def test_allocate_slots_never_shrinks_lookahead() -> None:
    m = BlockManager(4, 4)
    m.allocate(0, 9)  # room for 7 more tokens
    assert m.allocate_slots(0, 9, 10, 2, shrink=True) == 5, (
        "the 2 lookahead slots come first; the chunk shrinks to the 5 that remain"
    )
    assert m.num_tokens(0) == 16, "slots up to 9 + 5 + 2: the lookahead slots are reserved too"
    m = BlockManager(4, 4)
    m.allocate(0, 14)  # every block taken: 2 slots of slack left
    before = snapshot(m)
    assert m.allocate_slots(0, 14, 4, 3, shrink=True) == 0, (
        "2 slots left, 3 lookahead slots needed: the lookahead never shrinks, so it is refused"
    )
    assert snapshot(m) == before


@ch03_4
def test_allocate_slots_copies_a_forks_shared_block_before_writing() -> None:
    m = BlockManager(4, 4)
    m.allocate(0, 6)  # blocks [0, 1]; block 1 is half full
    m.fork(0, 1)  # parallel sampling: the child shares both
    assert m.allocate_slots(1, 6, 1) == 1
    assert m.block_table(1) == [0, 2] and m.block_table(0) == [0, 1], (
        f"position 6 lies in shared block 1: the child must get a copy of it, got child "
        f"{m.block_table(1)}, parent {m.block_table(0)}"
    )
    assert m.take_copies() == [(1, 2)], "the storage must copy block 1 into block 2 first"
    assert [m.allocator.refcount(b) for b in (0, 1, 2)] == [2, 1, 1]
    assert m.allocate_slots(0, 6, 1) == 1 and m.block_table(0) == [0, 1], (
        "the parent holds block 1 alone now: it writes in place"
    )
    assert m.take_copies() == [] and m.num_free == 1


@ch03_4
def test_allocate_slots_counts_the_copy_of_a_shared_block() -> None:
    m = BlockManager(3, 4)
    m.allocate(0, 6)  # blocks [0, 1]; one block free
    m.fork(0, 1)
    before = snapshot(m)
    assert m.allocate_slots(1, 6, 3) == 0, (
        "positions 6..8 need a copy of block 1 and a new block for position 8: 2 blocks, 1 free"
    )
    assert snapshot(m) == before, "refused: no copy taken, nothing queued for the storage"
    assert m.allocate_slots(1, 6, 3, shrink=True) == 2, (
        "shrunk: the copy takes the free block, whose slots 6 and 7 are all that fit"
    )
    assert m.block_table(1) == [0, 2] and m.take_copies() == [(1, 2)] and m.num_free == 0


# -- the scheduler's other seam: commit ------------------------------------------------------------


def test_allocate_slots_shares_prefix_blocks() -> None:
    m = BlockManager(8, 2)
    m.allocate_cached(0, [1, 2, 3, 4, 5])
    hits, cached = m.computed_prefix([1, 2, 3, 4])  # never the last token: only [1, 2] counts
    assert (hits, cached) == ([0], 2)
    assert m.allocate_slots(1, cached, 2, prefix_blocks=hits) == 2
    assert m.block_table(1) == [0, 3] and m.allocator.refcount(0) == 2
    with pytest.raises(ValueError, match="not num_computed_tokens=0"):
        m.allocate_slots(2, 0, 2, prefix_blocks=hits)


def test_commit_rolls_back_rejected_drafts_and_names_written_blocks() -> None:
    m, tokens = BlockManager(8, 2), [1, 2, 3, 4, 5, 6, 7]
    m.allocate_slots(0, 0, 3)
    m.commit(0, tokens, 3)  # prefix caching off: nothing named
    assert m.tables[0].block_hashes == [] and m.num_tokens(0) == 3
    m.allocate_slots(0, 3, 1, 3)  # a decode at position 3 and 3 draft tokens: slots up to 7
    assert m.num_tokens(0) == 7 and m.block_table(0) == [0, 1, 2, 3]
    m.commit(0, tokens, 5, num_cacheable_tokens=5)  # one draft accepted, two rejected
    assert m.num_tokens(0) == 5 and m.block_table(0) == [0, 1, 2] and m.num_free == 5
    assert len(m.tables[0].block_hashes) == 2 and m.cached_prefix(tokens[:4]) == [0, 1]
