"""Prefix caching: find the blocks that already hold the start of a new prompt (chapter 03).

Many prompts start the same way (a system prompt, a few-shot preamble, the turns of a chat so
far). Their K/V are the same too, so a block computed for one prompt can serve the next: the new
sequence's block table simply points at it (shared, reference counted), and the prefill starts
after it.

`PrefixCache` is the seam: what the block manager asks of any prefix cache. The one that ships,
`HashPrefixCache`, names each *full* block by a **chained hash** of its tokens and every token
before it, so equal names mean equal prefixes, and keeps a dict from name to block. A radix tree
over token ids (SGLang's RadixAttention) would plug in at the same place: it answers the same
questions with a tree walk instead of a dict.

A freed block keeps its name until the pool hands it out again (`evict`), so a later request can
still hit it -- which is why the pool's free queue evicts least-recently-used blocks first.
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Sequence
from typing import Protocol


class PrefixCache(Protocol):
    """What the block manager needs from a prefix cache. Blocks are physical block ids; a *name*
    is whatever the cache uses to identify a block's prefix (a hash, a tree node)."""

    def match(self, token_ids: Sequence[int]) -> list[int]:
        """The blocks holding the longest cached run of full blocks that starts `token_ids`."""
        ...

    def name_of(self, block: int) -> Hashable | None:
        """The block's name, or None if it holds nothing the cache knows."""
        ...

    def insert(self, block: int, parent: Hashable | None, token_ids: Sequence[int]) -> Hashable:
        """Name a full block whose K/V are written: its tokens follow the block named `parent`
        (None for the first block). Returns its name."""
        ...

    def evict(self, block: int) -> None:
        """The block is about to be overwritten: forget it, so no stale entry can ever match."""
        ...

    def holds(self, block: int) -> bool:
        """Can a later prompt hit this block? (The pool keeps such blocks free the longest.)"""
        ...


def block_hash(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    """Chained hash of one full block: it depends on this block's tokens and, through `parent`,
    on every token before them.

    sha256 over fixed-width integers, so it is the same in every run (Python's `hash()` of a str
    is salted).
    """
    h = hashlib.sha256(parent or b"")
    for t in token_ids:
        h.update(int(t).to_bytes(8, "little", signed=True))
    return h.digest()


class HashPrefixCache:
    """A `PrefixCache` of chained block hashes: name -> block, and each block's name and tokens."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.hashes: list[bytes | None] = [None] * num_blocks
        self.tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # hash -> block

    def match(self, token_ids: Sequence[int]) -> list[int]:
        hits, parent, bs = [], None, self.block_size
        for start in range(0, len(token_ids) - bs + 1, bs):  # full blocks only
            chunk = token_ids[start : start + bs]
            parent = block_hash(parent, chunk)
            block = self.lookup(parent, chunk)
            if block is None:
                break  # a chain: once one block misses, no later block can be the same prefix
            hits.append(block)
        return hits

    def lookup(self, h: bytes, token_ids: Sequence[int]) -> int | None:
        """The block named `h`, if its stored tokens really are `token_ids` (a hash is no proof)."""
        block = self.cached.get(h)
        if block is None or self.tokens[block] != tuple(token_ids):
            return None
        return block

    def name_of(self, block: int) -> bytes | None:
        return self.hashes[block]

    def insert(self, block: int, parent: bytes | None, token_ids: Sequence[int]) -> bytes:
        h = block_hash(parent, token_ids)
        self.evict(block)
        self.hashes[block], self.tokens[block] = h, tuple(token_ids)
        self.cached[h] = block  # a newer block with the same tokens replaces the older one
        return h

    def evict(self, block: int) -> None:
        h = self.hashes[block]
        if h is not None and self.cached.get(h) == block:
            del self.cached[h]
        self.hashes[block], self.tokens[block] = None, None

    def holds(self, block: int) -> bool:
        h = self.hashes[block]
        return h is not None and self.cached.get(h) == block
