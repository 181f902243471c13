"""One sequence over a paged KV cache (chapter 03): chapter 02's generator, with its keys and
values in blocks.

`kv/` decides *where* each token's keys and values go (block tables, the slot mapping,
copy-on-write); `attention/storage.py`'s `PagedKVStorage` owns the bytes. This module connects the
two for ONE sequence, before chapter 04's engine batches many:

`PagedAttention` is the model's attention seam (see `model/transformer.py`) for one sequence over a
shared pool: `prepare` asks the block manager for the new tokens' slots with the engine's own call
(`allocate_slots`, which also copies a shared block before it is written) and computes their slot
mapping, then each layer's call writes its k, v through the slots and attends over the history
gathered through the block table (`paged_attention_reference`). `generate_paged` mirrors chapter
02's `generate_cached` token for token, and can skip a prompt prefix that the prefix cache already
holds.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F

from minivllm.attention.storage import PagedKVStorage
from minivllm.kv.block_manager import BlockManager, OutOfBlocks
from minivllm.model.transformer import Transformer
from minivllm.stages.contiguous import cached_causal_mask
from minivllm.stages.naive import check_request, pick_token


def paged_attention_reference(
    q: torch.Tensor, storage: PagedKVStorage, layer: int, block_table: Sequence[int], start: int
) -> torch.Tensor:
    """Attention for queries `q` (`[T, n_heads, head_dim]`) at positions `start..start+T-1`, over
    keys `0..start+T-1` gathered through the block table. The new tokens must already be written."""
    keys, values = storage.gather(layer, block_table, start + q.shape[0])
    mask = cached_causal_mask(start, q.shape[0])
    # SDPA wants [heads, T, D]; the [T, S] mask broadcasts over heads (same call as
    # ContiguousKVCache).
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        keys.to(q.dtype).transpose(0, 1),
        values.to(q.dtype).transpose(0, 1),
        attn_mask=mask,
        enable_gqa=True,
    )
    return out.transpose(0, 1)


class PagedAttention:
    """The attention seam for one sequence over a shared `BlockManager` + `PagedKVStorage`."""

    def __init__(self, manager: BlockManager, storage: PagedKVStorage, seq_id: int) -> None:
        if manager.block_size != storage.block_size:
            raise ValueError(
                f"manager block_size {manager.block_size} != storage block_size "
                f"{storage.block_size}"
            )
        self.manager, self.storage, self.seq_id = manager, storage, seq_id
        self.start = 0  # position of the first token of the pass being run
        self.slots = torch.zeros(0, dtype=torch.long)  # its slot mapping
        self.length = 0  # tokens whose K/V are written, once the pass is done

    def prepare(self, start: int, num_new: int) -> None:
        """Before a forward pass over `num_new` tokens at positions `start..`: ask the block manager
        for their slots exactly as the engine's scheduler does (`allocate_slots`: lazy growth, a
        copy of a shared block first, all or nothing), make the copies it asks for, map the slots.
        A refusal raises `OutOfBlocks`, nothing changed."""
        end = start + num_new
        if not self.manager.allocate_slots(self.seq_id, start, num_new):
            raise OutOfBlocks(self._blocks_wanted(start, end), self.manager.num_free)
        for source, destination in self.manager.take_copies():  # copy-on-write, before any write
            self.storage.copy_block(source, destination)
        self.slots = torch.tensor(
            self.manager.slot_mapping(self.seq_id, range(start, end)), dtype=torch.long
        )
        self.start, self.length = start, end

    def _blocks_wanted(self, start: int, end: int) -> int:
        """New blocks a refused pass over positions `start..end-1` needed: those past the ones
        the sequence holds, plus one if it writes first into a block it shares (the copy)."""
        manager, size = self.manager, self.manager.block_size
        table = manager.block_table(self.seq_id) if self.seq_id in manager else []
        wanted = max(0, -(-end // size) - len(table))
        first = start // size
        return wanted + (first < len(table) and manager.allocator.refcount(table[first]) > 1)

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        if k.shape[0] != len(self.slots):
            raise ValueError(
                f"layer {layer} got {k.shape[0]} new tokens but prepare() mapped "
                f"{len(self.slots)}: call prepare(start, num_new) before every forward pass"
            )
        self.storage.write(layer, self.slots, k, v)
        return paged_attention_reference(
            q, self.storage, layer, self.manager.block_table(self.seq_id), self.start
        )

    def forward(self, model: Transformer, token_ids: list[int], start: int) -> torch.Tensor:
        """Logits `[T, vocab]` for `token_ids` at positions `start..`, through the paged cache."""
        self.prepare(start, len(token_ids))
        return model(torch.tensor(token_ids), torch.arange(start, start + len(token_ids)), self)


@torch.no_grad()
def stream_paged(
    model: Transformer,
    prompt_ids: list[int],
    max_new_tokens: int,
    manager: BlockManager,
    storage: PagedKVStorage,
    seq_id: int,
    temperature: float = 0.0,
    seed: int = 0,
    eos_id: int | None = None,
    use_prefix_cache: bool = False,
) -> Iterator[int]:
    """`stream_cached` over the paged cache; the sequence's blocks are freed when it ends, however
    it ends."""
    check_request(model, prompt_ids, max_new_tokens)
    if seq_id in manager:
        raise ValueError(f"sequence {seq_id} already has a block table: use a fresh seq_id")
    if max_new_tokens <= 0:
        return
    # same convention as stream_naive / stream_cached
    generator = torch.Generator().manual_seed(seed)
    attention = PagedAttention(manager, storage, seq_id)
    try:
        cached = manager.allocate_cached(seq_id, prompt_ids) if use_prefix_cache else 0
        # Skip the cached prefix, but always compute the last prompt token: its logits pick token 1.
        start = min(cached, len(prompt_ids) - 1)
        logits = attention.forward(model, prompt_ids[start:], start)[-1]
        for step in range(max_new_tokens):
            token = pick_token(logits, temperature, generator)
            yield token
            if token == eos_id or step == max_new_tokens - 1:
                return
            logits = attention.forward(model, [token], attention.length)[-1]
    finally:
        if seq_id in manager:
            manager.free(seq_id)


def generate_paged(
    model: Transformer,
    prompt_ids: list[int],
    max_new_tokens: int,
    manager: BlockManager,
    storage: PagedKVStorage,
    seq_id: int,
    **kwargs,
) -> list[int]:
    return list(stream_paged(model, prompt_ids, max_new_tokens, manager, storage, seq_id, **kwargs))
