"""The paged KV cache, policy half: which physical block holds which tokens (chapter 03).

A paged KV cache splits one big tensor into `num_blocks` fixed-size blocks of `block_size` token
slots. This module is the *policy*: it hands out block ids, counts who holds each block, and keeps
one
**block table** per sequence (its logical blocks -> physical block ids). It never touches a tensor
and imports no torch. The *storage* (a separate torch module) owns the tensor and only reads what
this module decides: the **slot mapping** (physical slot = block * block_size + offset) and the
copies that copy-on-write asks for. One module knows the layout; the other knows the bytes.

Four ideas carry the whole file:

- **LIFO reuse.** The free list is a stack: the block freed last is handed out first (it is the one
  most likely still warm in a cache, and the order is easy to predict and test).
- **Reference counts.** `fork` lets a child share every block of its parent (beam search, parallel
  sampling); a block returns to the free list only when its last holder lets go. Writing into a
  shared block first copies it (**copy-on-write**), so a sequence never sees another's tokens
  change.
- **Transactional growth.** `allocate`, `append` and `write` check everything *before* they change
  anything: they either fully succeed or raise `OutOfBlocks(needed, free)` with every structure
  exactly as it was, so the scheduler can preempt someone and simply retry.
- **Prefix caching.** A full block is named by a chained hash of its tokens and every token before
  it;
  a new prompt that starts the same way reuses those blocks instead of recomputing them. A freed
  block keeps its name until it is handed out again, so a later request can still hit it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field


class OutOfBlocks(Exception):
    """Not enough free blocks right now; nothing was changed. Free or preempt a sequence and retry."""

    def __init__(self, needed: int, free: int) -> None:
        self.needed, self.free = needed, free
        super().__init__(
            f"out of KV-cache blocks: needed {needed}, only {free} free; "
            f"free or preempt a sequence and retry"
        )


class SequenceTooLong(ValueError):
    """The sequence needs more blocks than the whole pool holds: retrying can never help."""

    def __init__(self, needed: int, num_blocks: int) -> None:
        self.needed, self.num_blocks = needed, num_blocks
        super().__init__(
            f"sequence needs {needed} blocks but the pool only has {num_blocks}: it can never "
            f"fit; shorten it or build a bigger cache"
        )


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def block_hash(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    """Chained hash of one full block: depends on this block's tokens and, via `parent`, on all
    before.

    sha256 over fixed-width integers, so it is the same in every run (Python's `hash()` of str is
    salted).
    """
    h = hashlib.sha256(parent or b"")
    for t in token_ids:
        h.update(int(t).to_bytes(8, "little", signed=True))
    return h.digest()


class BlockAllocator:
    """A fixed pool of physical blocks: a LIFO free list and a reference count per block."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        _positive("num_blocks", num_blocks)
        _positive("block_size", block_size)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.refcounts = [0] * num_blocks
        self.free_list = list(
            reversed(range(num_blocks))
        )  # a stack: pop() from the end gives 0, 1, 2, ...
        # Prefix cache: the name (hash) and tokens of each full block, kept after it is freed.
        self.hashes: list[bytes | None] = [None] * num_blocks
        self.tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # hash -> block

    @property
    def num_free(self) -> int:
        return len(self.free_list)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_list)

    def refcount(self, block: int) -> int:
        self._check(block)
        return self.refcounts[block]

    def allocate(self) -> int:
        """Pop the most recently freed block; it starts with one holder and no prefix-cache name."""
        if not self.free_list:
            raise OutOfBlocks(1, 0)
        block = self.free_list.pop()
        self.refcounts[block] = 1
        self.forget(
            block
        )  # its old contents are about to be overwritten: a stale hash must never match
        return block

    def incref(self, block: int) -> None:
        if self.refcount(block) == 0:
            raise ValueError(f"incref of block {block}, which is free: allocate it first")
        self.refcounts[block] += 1

    def decref(self, block: int) -> None:
        """Drop one holder; at zero the block goes back on top of the free list."""
        if self.refcount(block) == 0:
            raise ValueError(f"decref of block {block}, which is already free (a double free)")
        self.refcounts[block] -= 1
        if self.refcounts[block] == 0:
            self.free_list.append(block)

    # -- prefix cache
    # --------------------------------------------------------------------------------
    def lookup(self, h: bytes, token_ids: Sequence[int]) -> int | None:
        """The block named `h`, if its stored tokens really are `token_ids` (a hash is not a proof)."""
        block = self.cached.get(h)
        if block is None or self.tokens[block] != tuple(token_ids):
            return None
        return block

    def take(self, block: int) -> None:
        """Hold a cache hit: incref a block in use, or take a free one back off the free list."""
        if self.refcount(block) == 0:
            self.free_list.remove(block)
        self.refcounts[block] += 1

    def register(self, block: int, h: bytes, token_ids: Sequence[int]) -> None:
        self.forget(block)
        self.hashes[block], self.tokens[block] = h, tuple(token_ids)
        self.cached[h] = block  # a newer block with the same tokens replaces the older one

    def forget(self, block: int) -> None:
        h = self.hashes[block]
        if h is not None and self.cached.get(h) == block:
            del self.cached[h]
        self.hashes[block], self.tokens[block] = None, None

    def _check(self, block: int) -> None:
        if not 0 <= block < self.num_blocks:
            raise IndexError(f"block {block} is outside the pool of {self.num_blocks} blocks")


@dataclass
class BlockTable:
    """One sequence's logical blocks, in order, and how many token slots of them it uses."""

    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0
    block_hashes: list[bytes] = field(
        default_factory=list
    )  # prefix-cache names of its leading computed blocks


class BlockManager:
    """Block tables for every running sequence, on top of one BlockAllocator."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.allocator = BlockAllocator(num_blocks, block_size)
        self.block_size = block_size
        self.tables: dict[int, BlockTable] = {}

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

    def allocate(self, seq_id: int, num_tokens: int, prefix_blocks: Sequence[int] = ()) -> None:
        """A block table for a new sequence of `num_tokens` tokens (all or nothing). `prefix_blocks`
        are
        prefix-cache hits (from `cached_prefix`) that become its first blocks, shared, not copied."""
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id} already has a block table")
        alloc, hits = self.allocator, list(prefix_blocks)
        total = -(-num_tokens // self.block_size)
        if total > alloc.num_blocks:
            raise SequenceTooLong(total, alloc.num_blocks)
        if len(hits) > total:
            raise ValueError(
                f"{len(hits)} prefix blocks for a sequence of {num_tokens} tokens ({total} blocks)"
            )
        # A hit that sits free (refcount 0) leaves the free list when taken: count it before
        # deciding.
        free_after_hits = alloc.num_free - sum(alloc.refcount(b) == 0 for b in hits)
        if (
            total - len(hits) > free_after_hits
        ):  # check first: never allocate some and then roll back
            raise OutOfBlocks(total - len(hits), free_after_hits)
        for block in hits:
            alloc.take(block)
        blocks = hits + [alloc.allocate() for _ in range(total - len(hits))]
        names = [alloc.hashes[b] for b in hits]
        self.tables[seq_id] = BlockTable(blocks, num_tokens, names)

    def append(self, seq_id: int, extra_tokens: int) -> None:
        """Grow a sequence by `extra_tokens`; raises OutOfBlocks with nothing changed if they do not fit."""
        self._grow(self._table(seq_id), extra_tokens)

    def _grow(self, table: BlockTable, extra_tokens: int) -> None:
        needed = self.blocks_needed(table.num_tokens, extra_tokens)
        if len(table.blocks) + needed > self.allocator.num_blocks:
            raise SequenceTooLong(len(table.blocks) + needed, self.allocator.num_blocks)
        if needed > self.num_free:  # check first: never allocate some and then roll back
            raise OutOfBlocks(needed, self.num_free)
        table.blocks.extend(self.allocator.allocate() for _ in range(needed))
        table.num_tokens += extra_tokens

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Roll the sequence back to its first `num_tokens` token slots and free the blocks past
        them
        (speculative decoding: the slots of rejected draft tokens, chapter 06). All or nothing: it
        refuses, changing nothing, to cut into a block the prefix cache has named (others may share it)."""
        table = self._table(seq_id)
        if not 0 <= num_tokens <= table.num_tokens:
            raise ValueError(
                f"cannot truncate sequence {seq_id} to {num_tokens} tokens: it holds "
                f"{table.num_tokens}"
            )
        named = len(table.block_hashes) * self.block_size
        if num_tokens < named:
            raise ValueError(
                f"cannot truncate sequence {seq_id} to {num_tokens} tokens: its first {named} are "
                "in "
                f"named prefix-cache blocks that other sequences may share"
            )
        # EXERCISE ch06.2: KV rollback -- keep the blocks that hold num_tokens, give the rest back, set the count
        ### BEGIN SOLUTION
        keep = -(-num_tokens // self.block_size)
        # Free the last block first, so the LIFO stack hands the first freed block out again first:
        # the next speculative round grows back into the very blocks this one gave up.
        for block in reversed(table.blocks[keep:]):
            self.allocator.decref(block)
        del table.blocks[keep:]
        table.num_tokens = num_tokens
        ### END SOLUTION

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child shares every block of the parent; writes are separated later by copy-on-write."""
        parent = self._table(parent_id)
        if child_id in self.tables:
            raise ValueError(f"sequence {child_id} already has a block table")
        for block in parent.blocks:
            self.allocator.incref(block)
        self.tables[child_id] = BlockTable(
            list(parent.blocks), parent.num_tokens, list(parent.block_hashes)
        )

    def write(self, seq_id: int, position: int) -> tuple[int, int | None]:
        """Prepare to write token `position`: (block to write into, block to copy it from first, or
        None).

        A block held by one sequence is written in place. A shared block is copied first, so the
        other holders keep their tokens: the caller (storage) must copy `src` into the new block
        before it writes the new token.
        """
        table = self._table(seq_id)
        self._check_position(table, seq_id, position)
        index = position // self.block_size
        old = table.blocks[index]
        # EXERCISE ch03.2: copy-on-write -- a shared block (refcount > 1) is copied into a fresh one first
        ### BEGIN SOLUTION
        if self.allocator.refcount(old) == 1:
            return old, None  # ours alone: write in place
        if self.num_free == 0:
            raise OutOfBlocks(1, 0)
        # Order: copy -> decref old -> swap in new. The new block is taken (and the copy from `old`
        # recorded) while we still hold `old`, so `old` cannot be freed and handed back to us as the
        # "fresh" block (with a LIFO list it would be the very next one) before its tokens are
        # copied. The swap comes last, so the table never points at a block we do not hold a
        # reference to.
        new = self.allocator.allocate()
        self.allocator.decref(old)
        table.blocks[index] = new
        return new, old
        ### END SOLUTION

    def free(self, seq_id: int) -> None:
        """Let go of every block of the sequence and drop its table."""
        table = self.tables.pop(seq_id, None)
        if table is None:
            raise KeyError(
                f"sequence {seq_id} has no block table (never allocated, or already freed)"
            )
        # Tail blocks end on top of the LIFO stack and are reused first; prefix blocks (the ones a
        # later prompt may hit in the prefix cache) stay free-but-named the longest.
        for block in table.blocks:
            self.allocator.decref(block)

    def slot_mapping(self, seq_id: int, positions: Sequence[int]) -> list[int]:
        """Physical slot of each token position: block * block_size + offset (what storage indexes)."""
        table = self._table(seq_id)
        slots = []
        for p in positions:
            self._check_position(table, seq_id, p)
            slots.append(table.blocks[p // self.block_size] * self.block_size + p % self.block_size)
        return slots

    # -- prefix cache
    # --------------------------------------------------------------------------------
    def cached_prefix(self, token_ids: Sequence[int]) -> list[int]:
        """The blocks already holding the longest cached run of full blocks that starts `token_ids`."""
        hits, parent, bs = [], None, self.block_size
        for start in range(0, len(token_ids) - bs + 1, bs):  # full blocks only
            chunk = token_ids[start : start + bs]
            parent = block_hash(parent, chunk)
            block = self.allocator.lookup(parent, chunk)
            if block is None:
                break  # a chain: once one block misses, no later block can be the same prefix
            hits.append(block)
        return hits

    def register_computed(self, seq_id: int, token_ids: Sequence[int], num_computed: int) -> None:
        """Name the sequence's full blocks whose K/V are now written (the first `num_computed`
        tokens of `token_ids`), so later prompts can hit them. Call it only *after* the forward pass
        wrote them: a name on a block whose K/V are not there yet would hand garbage to the next hit."""
        table, bs = self._table(seq_id), self.block_size
        if not 0 <= num_computed <= min(len(token_ids), table.num_tokens):
            raise ValueError(
                f"num_computed={num_computed} is outside sequence {seq_id} "
                f"({table.num_tokens} tokens held, {len(token_ids)} given)"
            )
        for index in range(len(table.block_hashes), num_computed // bs):
            parent = table.block_hashes[-1] if table.block_hashes else None
            chunk = token_ids[index * bs : (index + 1) * bs]
            name = block_hash(parent, chunk)
            self.allocator.register(table.blocks[index], name, chunk)
            table.block_hashes.append(name)

    def allocate_cached(self, seq_id: int, token_ids: Sequence[int]) -> int:
        """`allocate` for a whole prompt, reusing prefix-cache hits and naming its full blocks at
        once; returns how many leading tokens were cached.

        Naming before the K/V exist is only safe for a caller that computes the prompt before anyone
        else can look (chapter 03's `stream_paged`). The engine instead names blocks after each
        forward pass with `register_computed`.
        """
        hits = self.cached_prefix(token_ids)
        self.allocate(seq_id, len(token_ids), prefix_blocks=hits)
        self.register_computed(seq_id, token_ids, len(token_ids))
        return len(hits) * self.block_size

    # -- read access
    # ----------------------------------------------------------------------------------
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
