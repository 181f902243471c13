"""The physical blocks of the paged KV cache: who holds each, and which is reused next (chapter 03).

The pool knows nothing about sequences or tokens. It keeps two things:

- **A reference count per block.** A block is held by every sequence whose block table lists it
  (`fork` and prefix-cache hits share blocks). It is free when nobody holds it.
- **The free queue, in eviction order.** `allocate` takes the block at the front. A free block may
  still hold something worth keeping -- a prefix-cache entry a later prompt can hit -- so a block
  that does goes to the *back* when it is freed (least recently used is evicted first: an **LRU**
  queue), and a block that holds nothing useful goes to the *front*, to be reused first. A
  prefix-cache hit can take a free block back out of the middle of the queue.

All three moves are O(1): the queue is an `OrderedDict` used as a doubly linked list, as vLLM's
`FreeKVCacheBlockQueue` is. Blocks never used yet start at the front, in order 0, 1, 2, ...
"""

from __future__ import annotations

from collections import OrderedDict


class OutOfBlocks(Exception):
    """Not enough free blocks right now; nothing was changed. Free or preempt someone, and retry."""

    def __init__(self, needed: int, free: int) -> None:
        self.needed, self.free = needed, free
        super().__init__(
            f"out of KV-cache blocks: needed {needed}, only {free} free; "
            f"free or preempt a sequence and retry"
        )


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


class BlockPool:
    """A fixed pool of physical blocks: a reference count per block and an LRU free queue."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        _positive("num_blocks", num_blocks)
        _positive("block_size", block_size)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.refcounts = [0] * num_blocks
        # The free queue: front = next to be handed out. Only the keys matter.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def free_blocks(self) -> list[int]:
        """The free blocks in the order they will be handed out (a copy, for tests and figures)."""
        return list(self._free)

    def refcount(self, block: int) -> int:
        self._check(block)
        return self.refcounts[block]

    def allocate(self) -> int:
        """Take the block at the front of the free queue; it starts with one holder."""
        if not self._free:
            raise OutOfBlocks(1, 0)
        block, _ = self._free.popitem(last=False)
        self.refcounts[block] = 1
        return block

    def incref(self, block: int) -> None:
        if self.refcount(block) == 0:
            raise ValueError(f"incref of block {block}, which is free: allocate it first")
        self.refcounts[block] += 1

    def decref(self, block: int, *, keep: bool = True) -> None:
        """Drop one holder. At zero the block is free: at the back of the queue if its contents are
        worth keeping (`keep`, evicted last), else at the front (reused first)."""
        if self.refcount(block) == 0:
            raise ValueError(f"decref of block {block}, which is already free (a double free)")
        self.refcounts[block] -= 1
        if self.refcounts[block] == 0:
            self._free[block] = None
            if not keep:
                self._free.move_to_end(block, last=False)

    def take(self, block: int) -> None:
        """Hold a prefix-cache hit: incref a block in use, or take a free one out of the queue."""
        if self.refcount(block) == 0:
            del self._free[block]
        self.refcounts[block] += 1

    def _check(self, block: int) -> None:
        if not 0 <= block < self.num_blocks:
            raise IndexError(f"block {block} is outside the pool of {self.num_blocks} blocks")
