"""The paged KV cache, policy half: which physical block holds which tokens (chapter 03).

A paged KV cache splits one big tensor into `num_blocks` fixed-size blocks of `block_size` token
slots. This module is the *policy*: it keeps one **block table** per sequence (its logical blocks
-> physical block ids) on top of a `BlockPool` (block_pool.py: reference counts and the free queue)
and a `PrefixCache` (prefix_cache.py). It never touches a tensor and imports no torch. The
*storage* (a separate torch module) owns the tensor and only reads what this module decides: the
**slot mapping** (physical slot = block * block_size + offset) and the copies that copy-on-write
asks for. One module knows the layout; the other knows the bytes.

Four ideas carry the whole file:

- **Lazy growth.** A sequence holds just enough blocks for its tokens; a new block is taken only
  when the last one is full.
- **Reference counts.** `fork` lets a child share every block of its parent (beam search, parallel
  sampling); a block returns to the pool only when its last holder lets go. Writing into a shared
  block first copies it (**copy-on-write**), so a sequence never sees another's tokens change.
- **Transactional growth.** `allocate`, `append`, `copy_on_write` and `allocate_slots` check
  everything *before* they change anything: they either fully succeed or refuse (raise
  `OutOfBlocks(needed, free)`, or return 0) with every structure exactly as it was, so the
  scheduler can preempt someone and simply retry.
- **Prefix caching.** A full block whose K/V are written gets a name from the prefix cache; a new
  prompt that starts the same way reuses those blocks instead of recomputing them. A freed block
  keeps its name until the pool hands it out again, so a later request can still hit it.

The scheduler talks to this module through two calls, as vLLM's scheduler talks to its
`KVCacheManager`: `allocate_slots` ("can this sequence have n more slots?") before the forward
pass, and `commit` (roll back what was not used, name what was written) after it.

**Two layouts** sit behind those calls. `layout="paged"` is everything above. `layout="contiguous"`
is how servers kept K/V before paging: a sequence reserves the slots of `max_model_len` tokens
(as whole blocks) when it is admitted and keeps them until it is freed. It never grows, so it is
never short of a block mid-run (never preempted), and it shares nothing: no prefix-cache hits, no
forks (the engine runs a request's n samples as n sequences, each computing its own prompt). Its
blocks need not be neighbours in the pool: every reservation has the same size, so a freed one
always fits the next sequence. What it wastes is inside the reservations -- slots no token will
ever fill -- which is what `memory()` measures, for either layout, each engine step.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from minivllm.kv.block_pool import BlockPool, OutOfBlocks
from minivllm.kv.prefix_cache import HashPrefixCache, PrefixCache, block_hash

# OutOfBlocks and block_hash live next door; they are re-exported for callers that import them here.
__all__ = [
    "KV_LAYOUTS",
    "BlockManager",
    "BlockTable",
    "KVMemory",
    "OutOfBlocks",
    "SequenceTooLong",
    "block_hash",
]

KV_LAYOUTS = ("paged", "contiguous")


class SequenceTooLong(ValueError):
    """The sequence needs more blocks than the whole pool holds: retrying can never help."""

    def __init__(self, needed: int, num_blocks: int) -> None:
        self.needed, self.num_blocks = needed, num_blocks
        super().__init__(
            f"sequence needs {needed} blocks but the pool only has {num_blocks}: it can never "
            f"fit; shorten it or build a bigger cache"
        )


@dataclass
class BlockTable:
    """One sequence's logical blocks, in order, and how many token slots of them it uses."""

    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0
    # Prefix-cache names of its leading computed blocks.
    block_hashes: list[Hashable] = field(default_factory=list)


@dataclass(frozen=True)
class KVMemory:
    """How the pool is used at one moment (`BlockManager.memory()`, one per engine step).

    Per sequence, a block table reserves `len(blocks) * block_size` slots and fills `num_tokens`
    of them; a block shared by k tables (prefix-cache hits, forks) is reserved k times but held
    once, and the difference is what sharing saved."""

    num_blocks: int
    blocks_used: int  # physical blocks held by at least one sequence
    table_blocks: int  # blocks in all block tables: a block shared by k tables counts k times
    slots_reserved: int  # table_blocks * block_size
    slots_filled: int  # token slots the tables hold tokens in

    @property
    def slots_empty(self) -> int:
        """Internal fragmentation: reserved slots holding no token (the tail of each sequence's
        last block when paged; the rest of max_model_len when contiguous)."""
        return self.slots_reserved - self.slots_filled

    @property
    def blocks_saved(self) -> int:
        """Blocks that sharing saved: held once, listed by several tables."""
        return self.table_blocks - self.blocks_used

    @property
    def utilization(self) -> float:
        return self.blocks_used / self.num_blocks

    @property
    def fragmentation(self) -> float:
        return self.slots_empty / self.slots_reserved if self.slots_reserved else 0.0

    @property
    def saved_fraction(self) -> float:
        """Of the blocks the tables list, the share sharing saved."""
        return self.blocks_saved / self.table_blocks if self.table_blocks else 0.0


class BlockManager:
    """Block tables for every running sequence, on top of one BlockPool and one PrefixCache.

    `layout` is "paged" (lazy growth, sharing) or "contiguous" (each sequence reserves the
    blocks of `max_model_len` tokens up front and shares none; see the module docstring)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        prefix_cache: PrefixCache | None = None,
        *,
        layout: str = "paged",
        max_model_len: int | None = None,
    ) -> None:
        self.allocator = BlockPool(num_blocks, block_size)
        self.prefix_cache = prefix_cache or HashPrefixCache(num_blocks, block_size)
        self.block_size = block_size
        self.tables: dict[int, BlockTable] = {}
        self.layout = layout
        # Blocks every new table takes at once: 0 when paged (it grows lazily).
        self.reserved_blocks = _reserved_blocks(layout, max_model_len, num_blocks, block_size)
        # (source, destination) block copies that copy-on-write in `allocate_slots` decided and
        # the storage has not made yet: the model runner makes them before the forward pass.
        self.pending_copies: list[tuple[int, int]] = []

    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    def blocks_needed(self, num_tokens_now: int, extra_tokens: int) -> int:
        """New blocks to hold `extra_tokens` more: none while the last block still has slack."""
        if num_tokens_now < 0 or extra_tokens < 0:
            raise ValueError(f"token counts must be >= 0, got {num_tokens_now} and {extra_tokens}")
        # EXERCISE ch03.1: blocks_needed -- ceil(total / block_size) minus the blocks already held
        ### BEGIN SOLUTION
        bs = self.block_size
        held = -(-num_tokens_now // bs)
        return -(-(num_tokens_now + extra_tokens) // bs) - held
        ### END SOLUTION

    # -- block tables ------------------------------------------------------------------------------
    def allocate(self, seq_id: int, num_tokens: int, prefix_blocks: Sequence[int] = ()) -> None:
        """A block table for a new sequence of `num_tokens` tokens (all or nothing).

        `prefix_blocks` are prefix-cache hits (from `cached_prefix`) that become its first blocks,
        shared, not copied."""
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id} already has a block table")
        pool, hits = self.allocator, list(prefix_blocks)
        if hits and not self.shares_blocks:
            raise ValueError("the contiguous layout shares no blocks: no prefix blocks")
        total = max(-(-num_tokens // self.block_size), self.reserved_blocks)
        if total > pool.num_blocks:
            raise SequenceTooLong(total, pool.num_blocks)
        if len(hits) > total:
            raise ValueError(
                f"{len(hits)} prefix blocks for a sequence of {num_tokens} tokens ({total} blocks)"
            )
        # A hit that sits free (refcount 0) leaves the free queue when taken: count it first.
        free_after_hits = pool.num_free - sum(pool.refcount(b) == 0 for b in hits)
        if total - len(hits) > free_after_hits:  # check first: never allocate some, then roll back
            raise OutOfBlocks(total - len(hits), free_after_hits)
        for block in hits:
            pool.take(block)
        blocks = hits + [self._new_block() for _ in range(total - len(hits))]
        names = [self.prefix_cache.name_of(b) for b in hits]
        self.tables[seq_id] = BlockTable(blocks, num_tokens, names)

    def append(self, seq_id: int, extra_tokens: int) -> None:
        """Grow a sequence by `extra_tokens`; if they do not fit, raise OutOfBlocks, changing
        nothing."""
        table = self._table(seq_id)
        needed = self.blocks_needed(table.num_tokens, extra_tokens)
        if len(table.blocks) + needed > self.allocator.num_blocks:
            raise SequenceTooLong(len(table.blocks) + needed, self.allocator.num_blocks)
        if needed > self.num_free:  # check first: never allocate some and then roll back
            raise OutOfBlocks(needed, self.num_free)
        table.blocks.extend(self._new_block() for _ in range(needed))
        table.num_tokens += extra_tokens

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Roll the sequence back to its first `num_tokens` token slots and free the blocks past
        them (speculative decoding: the slots of rejected draft tokens, chapter 06).

        All or nothing: it refuses, changing nothing, to cut into a block the prefix cache has
        named (others may share it)."""
        table = self._table(seq_id)
        if not 0 <= num_tokens <= table.num_tokens:
            raise ValueError(
                f"cannot truncate sequence {seq_id} to {num_tokens} tokens: it holds "
                f"{table.num_tokens}"
            )
        named = len(table.block_hashes) * self.block_size
        if num_tokens < named:
            raise ValueError(
                f"cannot truncate sequence {seq_id} to {num_tokens} tokens: its first {named} "
                f"are in named prefix-cache blocks that other sequences may share"
            )
        # EXERCISE ch06.2: KV rollback -- keep the blocks that hold num_tokens, release the rest
        ### BEGIN SOLUTION
        keep = -(-num_tokens // self.block_size)
        # Released first-to-last: the next speculative round grows back into the very blocks this
        # one gave up, in the same order.
        self._release(table.blocks[keep:])
        del table.blocks[keep:]
        table.num_tokens = num_tokens
        ### END SOLUTION

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child shares every block of the parent; copy-on-write separates them later."""
        parent = self._table(parent_id)
        if child_id in self.tables:
            raise ValueError(f"sequence {child_id} already has a block table")
        if not self.shares_blocks:
            raise ValueError(
                "the contiguous layout shares no blocks, so it cannot fork: run each sample as a "
                "sequence of its own"
            )
        for block in parent.blocks:
            self.allocator.incref(block)
        self.tables[child_id] = BlockTable(
            list(parent.blocks), parent.num_tokens, list(parent.block_hashes)
        )

    def copy_on_write(self, seq_id: int, position: int) -> bool:
        """Before the sequence writes token `position`: make the block that holds it its own.

        A block it holds alone is written in place: False, nothing changes. A shared block (a
        fork's last one, say) is swapped for a fresh one, and the copy (source, destination) is
        queued for the storage, which makes it before the next forward pass (`take_copies`):
        True. With no free block it raises OutOfBlocks and changes nothing. `allocate_slots`
        calls it, for the engine and for chapter 03's one-sequence stage alike: the package's one
        copy-on-write.
        """
        table = self._table(seq_id)
        held = len(table.blocks) * self.block_size
        if not 0 <= position < held:
            raise IndexError(
                f"position {position} is outside the blocks of sequence {seq_id} ({held} slots)"
            )
        index = position // self.block_size
        # EXERCISE ch03.2: copy-on-write -- swap a shared block (refcount > 1) for a fresh copy
        ### BEGIN SOLUTION
        old = table.blocks[index]
        if self.allocator.refcount(old) == 1:
            return False  # ours alone: write in place
        if self.num_free == 0:
            raise OutOfBlocks(1, 0)
        # Order: take new -> decref old -> swap in new. The new block is taken while we still hold
        # `old`, so a pool with no free block refuses before anything changed, and `old` cannot be
        # handed back to us as the "fresh" block. The swap comes last, so the table never points at
        # a block we do not hold a reference to.
        new = self._new_block()
        self.allocator.decref(old)  # others still hold it, so it stays in use
        table.blocks[index] = new
        self.pending_copies.append((old, new))  # the storage copies old into new before the pass
        return True
        ### END SOLUTION

    def free(self, seq_id: int) -> None:
        """Let go of every block of the sequence and drop its table."""
        table = self.tables.pop(seq_id, None)
        if table is None:
            raise KeyError(
                f"sequence {seq_id} has no block table (never allocated, or already freed)"
            )
        # Tail first: a later prompt that shares this one's start hits its head blocks, so those
        # are the ones to keep the longest.
        self._release(table.blocks[::-1])

    def slot_mapping(self, seq_id: int, positions: Sequence[int]) -> list[int]:
        """Physical slot of each token position: block * block_size + offset (what storage
        indexes)."""
        table = self._table(seq_id)
        slots = []
        for p in positions:
            self._check_position(table, seq_id, p)
            slots.append(table.blocks[p // self.block_size] * self.block_size + p % self.block_size)
        return slots

    def _new_block(self) -> int:
        block = self.allocator.allocate()
        self.prefix_cache.evict(block)  # its old contents are about to be overwritten
        return block

    def _release(self, blocks: list[int]) -> None:
        """Drop one reference to each of `blocks`, given in the order they should be evicted.

        Blocks the prefix cache can still hit go to the back of the free queue (kept the longest);
        the others hold nothing worth keeping and go to the front, the first of them first.
        """
        cache = self.prefix_cache
        for block in blocks:
            if cache.holds(block):
                self.allocator.decref(block, keep=True)
        for block in reversed(blocks):
            if not cache.holds(block):
                self.allocator.decref(block, keep=False)

    # -- the scheduler's seams ---------------------------------------------------------------------
    def allocate_slots(
        self,
        seq_id: int,
        num_computed_tokens: int,
        num_new_tokens: int,
        num_lookahead_tokens: int = 0,
        *,
        shrink: bool = False,
        prefix_blocks: Sequence[int] = (),
    ) -> int:
        """Slots for positions up to `num_computed_tokens + num_new_tokens + num_lookahead_tokens`:
        what the scheduler asks before it schedules `num_new_tokens` of a sequence this step.

        The first call creates the sequence's block table; `prefix_blocks` are its prefix-cache
        hits (from `computed_prefix`), shared, not copied, and `num_computed_tokens` must be the
        tokens they hold. Returns the new tokens granted: all of them, or 0 = refused with nothing
        changed. With `shrink` (a prefill chunk of a sequence that has its table) it grants as
        many as the free blocks hold; lookahead slots (draft tokens, chapter 06) never shrink. A
        table grows lazily: first into the slack of its last block, then by new blocks. If the
        block the step writes first is shared (a fork's), it is copied first (`copy_on_write`),
        and that copy's block counts against what fits. This is where a smarter block layer plugs
        in (vLLM's `KVCacheManager.allocate_slots`: several KV-cache groups, sliding windows); the
        scheduler only sees the number.
        """
        if seq_id not in self.tables:
            return self._allocate_new(
                seq_id, num_computed_tokens, num_new_tokens, num_lookahead_tokens, prefix_blocks
            )
        if prefix_blocks:
            raise ValueError(f"sequence {seq_id} has a block table already: no prefix blocks")
        table, bs = self._table(seq_id), self.block_size
        # EXERCISE ch03.4: allocate_slots -- copy a shared block, then grow, all or nothing
        ### BEGIN SOLUTION
        # A forked sequence (parallel sampling) may share the block it writes next with its
        # siblings: that block is copied first (copy-on-write), which takes one free block.
        shared = self._shared_block_at(seq_id, num_computed_tokens)
        # Slots it could have past its computed tokens: every slot of the blocks it holds (the
        # slack of its last block; a contiguous reservation) and every free block (but the copy's).
        held = len(table.blocks) * bs
        fits = held - num_computed_tokens + (self.num_free - shared) * bs
        granted = min(num_new_tokens, fits - num_lookahead_tokens) if shrink else num_new_tokens
        if granted <= 0 or granted + num_lookahead_tokens > fits:
            return 0  # refused before anything changed
        if shared:
            self.copy_on_write(seq_id, num_computed_tokens)
        end = num_computed_tokens + granted + num_lookahead_tokens
        if end > table.num_tokens:  # first the slots of the blocks it holds, then new blocks
            table.num_tokens = min(end, held)
            if end > held:
                self.append(seq_id, end - held)  # lazy growth: just the blocks the rest needs
        return granted
        ### END SOLUTION

    def _shared_block_at(self, seq_id: int, position: int) -> bool:
        """Is the block that holds `position` also in another sequence's table? In the engine only
        a fork's last, partly filled block can be (a block of computed prefix-cache hits is never
        written); chapter 03's stage also rewrites the last token of a wholly cached prompt."""
        blocks = self._table(seq_id).blocks
        index = position // self.block_size
        return index < len(blocks) and self.allocator.refcount(blocks[index]) > 1

    def take_copies(self) -> list[tuple[int, int]]:
        """The (source, destination) block copies to make before the next forward pass; each is
        handed out once."""
        copies, self.pending_copies = self.pending_copies, []
        return copies

    @property
    def num_used(self) -> int:
        """Blocks held by at least one sequence (a block shared by n forks counts once)."""
        return self.allocator.num_blocks - self.num_free

    @property
    def shares_blocks(self) -> bool:
        """Paged: prefix-cache hits and forks share blocks. Contiguous: nothing is shared."""
        return self.layout == "paged"

    def memory(self) -> KVMemory:
        """The pool now: used, reserved, filled, saved by sharing (the engine's step trace).
        One pass over the block tables, none over blocks: O(sequences), not O(blocks)."""
        table_blocks = filled = 0
        for table in self.tables.values():
            table_blocks += len(table.blocks)
            filled += table.num_tokens
        return KVMemory(
            num_blocks=self.allocator.num_blocks,
            blocks_used=self.num_used,
            table_blocks=table_blocks,
            slots_reserved=table_blocks * self.block_size,
            slots_filled=filled,
        )

    def _allocate_new(
        self, seq_id: int, num_cached: int, num_new: int, num_lookahead: int, hits: Sequence[int]
    ) -> int:
        if num_cached != len(hits) * self.block_size:
            raise ValueError(
                f"{len(hits)} prefix blocks hold {len(hits) * self.block_size} tokens, "
                f"not num_computed_tokens={num_cached}"
            )
        try:
            self.allocate(seq_id, num_cached + num_new + num_lookahead, prefix_blocks=hits)
        except OutOfBlocks:
            return 0
        return num_new

    def commit(
        self,
        seq_id: int,
        token_ids: Sequence[int],
        num_computed_tokens: int,
        *,
        num_cacheable_tokens: int | None = None,
    ) -> None:
        """After the forward pass: the sequence's first `num_computed_tokens` of `token_ids` have
        their K/V written.

        Slots reserved past them (for draft tokens the target rejected) are rolled back. With
        prefix caching on, the caller passes `num_cacheable_tokens` (the leading tokens whose K/V
        every model has written) and the full blocks among them are named; None names nothing.
        A block layer that keeps more (a radix tree's LRU times, an offloading tier) plugs in here.
        """
        table = self._table(seq_id)
        if table.num_tokens > num_computed_tokens and self.reserved_blocks:
            table.num_tokens = num_computed_tokens  # contiguous: the reservation stays
        elif table.num_tokens > num_computed_tokens:
            self.truncate(seq_id, num_computed_tokens)
        if num_cacheable_tokens is not None:
            self.register_computed(seq_id, token_ids, num_cacheable_tokens)

    # -- prefix cache ------------------------------------------------------------------------------
    def cached_prefix(self, token_ids: Sequence[int]) -> list[int]:
        """The blocks already holding the longest cached run of full blocks that starts
        `token_ids`."""
        return self.prefix_cache.match(token_ids)

    def computed_prefix(self, token_ids: Sequence[int]) -> tuple[list[int], int]:
        """A new prompt's prefix-cache hits and how many tokens they hold. Never its last token:
        the prefill must compute something, whose logits pick the next token."""
        hits = self.cached_prefix(token_ids[:-1])
        return hits, len(hits) * self.block_size

    def register_computed(self, seq_id: int, token_ids: Sequence[int], num_computed: int) -> None:
        """Name the sequence's full blocks whose K/V are now written (the first `num_computed`
        tokens of `token_ids`), so later prompts can hit them.

        Call it only *after* the forward pass wrote them: a name on a block whose K/V are not
        there yet would hand garbage to the next hit."""
        table, bs = self._table(seq_id), self.block_size
        if not 0 <= num_computed <= min(len(token_ids), table.num_tokens):
            raise ValueError(
                f"num_computed={num_computed} is outside sequence {seq_id} "
                f"({table.num_tokens} tokens held, {len(token_ids)} given)"
            )
        if not self.shares_blocks:
            return  # contiguous: nothing is shared, so nothing is named
        for index in range(len(table.block_hashes), num_computed // bs):
            parent = table.block_hashes[-1] if table.block_hashes else None
            chunk = token_ids[index * bs : (index + 1) * bs]
            table.block_hashes.append(self.prefix_cache.insert(table.blocks[index], parent, chunk))

    def allocate_cached(self, seq_id: int, token_ids: Sequence[int]) -> int:
        """`allocate` for a whole prompt, reusing prefix-cache hits and naming its full blocks at
        once; returns how many leading tokens were cached.

        Naming before the K/V exist is only safe for a caller that computes the prompt before
        anyone else can look (chapter 03's `stream_paged`). The engine instead names blocks after
        each forward pass, in `commit`.
        """
        hits = self.cached_prefix(token_ids)
        self.allocate(seq_id, len(token_ids), prefix_blocks=hits)
        self.register_computed(seq_id, token_ids, len(token_ids))
        return len(hits) * self.block_size

    # -- read access -------------------------------------------------------------------------------
    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self.tables

    def block_table(self, seq_id: int) -> list[int]:
        """The sequence's physical blocks in logical order (a copy: edit through the manager)."""
        return list(self._table(seq_id).blocks)

    def num_tokens(self, seq_id: int) -> int:
        """Token slots the sequence holds (computed plus reserved for this step)."""
        return self._table(seq_id).num_tokens

    def _table(self, seq_id: int) -> BlockTable:
        if seq_id not in self.tables:
            raise KeyError(
                f"sequence {seq_id} has no block table (never allocated, or already freed)"
            )
        return self.tables[seq_id]

    @staticmethod
    def _check_position(table: BlockTable, seq_id: int, position: int) -> None:
        if not 0 <= position < table.num_tokens:
            raise IndexError(
                f"position {position} is outside sequence {seq_id} ({table.num_tokens} tokens)"
            )


def _reserved_blocks(
    layout: str, max_model_len: int | None, num_blocks: int, block_size: int
) -> int:
    """Blocks a new table takes up front: none when paged, those of max_model_len when contiguous
    (a pool that cannot hold even one such reservation could never run anything: refused here)."""
    if layout not in KV_LAYOUTS:
        raise ValueError(f"layout must be one of {KV_LAYOUTS}, got {layout!r}")
    if layout == "paged":
        return 0
    if not isinstance(max_model_len, int) or max_model_len < 1:
        raise ValueError(
            f"the contiguous layout reserves max_model_len tokens per sequence: give it as an "
            f"int >= 1, got {max_model_len!r}"
        )
    reserved = -(-max_model_len // block_size)
    if reserved > num_blocks:
        raise ValueError(
            f"the contiguous layout reserves max_model_len={max_model_len} tokens ({reserved} "
            f"blocks of {block_size}) per sequence, but the pool has only {num_blocks} blocks: "
            f"no sequence could ever run; give it at least {reserved} blocks or use the paged "
            f"layout"
        )
    return reserved
