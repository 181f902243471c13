"""Attention over a flattened (varlen) batch of many sequences, read from the paged cache (chapter
04).

The engine runs every scheduled sequence in ONE forward pass. Their new tokens are laid end to end
in one axis of N tokens -- no padding in the model's matmuls -- and `VarlenBatch` says which tokens
belong to whom, the same metadata FlashAttention's varlen API and vLLM's attention backends take:

    input_ids, positions, slot_mapping   [N]              one entry per new token
    query_start                          [B + 1]          sequence i owns tokens
                                                          query_start[i] : query_start[i+1]
    context_lens                         [B]              tokens of sequence i in the cache
                                                          once this pass wrote
    block_tables                         [B, max_blocks]  (padded with 0; context_lens says
                                                          what is real)

Sequences with a single new token (decodes) come first, `num_decodes` of them, then prefill chunks.

`TorchPagedAttention` is the reference backend: chapter 03's gather-and-attend, extended to the
batch. Each layer writes the new K/V of ALL sequences through the slot mapping, then attends in two
groups: `DecodeAttention`, the decodes as one `[num_decodes, kv_heads, group, context]` call, and
`PrefillAttention`, the prefill chunks padded to the longest chunk. Splitting the groups keeps a
400-token prefill from padding 60 one-token decodes to 400 queries each. The two groups are public
pieces: chapter 08's CUDA backend keeps the prefill piece and puts its kernel in the decodes' place.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from minivllm.attention.batch import VarlenBatch, context_slots
from minivllm.attention.storage import PagedKVStorage


class TorchPagedAttention:
    """The attention seam for one forward pass over a `VarlenBatch`; the masks and gathers are built
    once here and reused by every layer."""

    def __init__(
        self,
        storage: PagedKVStorage,
        batch: VarlenBatch,
        decodes: Callable[[PagedKVStorage, VarlenBatch], DecodePiece] | None = None,
    ) -> None:
        """`decodes` builds the piece that attends the decode group (default `DecodeAttention`):
        a decode kernel takes its place and keeps everything else (chapter 08's CUDA backend)."""
        self.storage, self.batch = storage, batch
        if not batch.slots_checked:  # once per pass, not once per layer
            storage.check_slots(batch.slot_mapping)
        nd, nseq = batch.num_decodes, batch.num_seqs
        self.decodes = (decodes or DecodeAttention)(storage, batch) if nd else None
        self.prefills = PrefillAttention(storage, batch) if nd < nseq else None

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        nd = self.batch.num_decodes
        self.storage.write(layer, self.batch.slot_mapping, k, v, slots_checked=True)
        out = torch.empty_like(q)
        if self.decodes is not None:
            out[:nd] = self.decodes(layer, q[:nd])
        if self.prefills is not None:
            out[nd:] = self.prefills(layer, q[nd:])
        return out


# A decode piece: `(layer, q [num_decodes, heads, D]) -> [num_decodes, heads, D]`.
DecodePiece = Callable[[int, torch.Tensor], torch.Tensor]


class DecodeAttention:
    """The decode group: one query per sequence, the first `num_decodes` rows of the batch."""

    def __init__(self, storage: PagedKVStorage, batch: VarlenBatch) -> None:
        self.storage = storage
        # The gather's width from the host (a CUDA graph fixes it at the captured capacity).
        width = batch.max_decode_context_len or None
        self.slots, valid = context_slots(batch, slice(0, batch.num_decodes), width)
        self.mask = valid[:, None, None, :]  # [nd, kv_heads, group, keys], broadcast

    def __call__(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """`q` `[nd, heads, D]` -> `[nd, heads, D]`. The query heads that share a K/V head are laid
        along the query axis, `[nd, kv_heads, group, D]`, so each cached K/V row is read once per
        K/V head rather than copied once per query head (what `enable_gqa` does on the CPU)."""
        nd, heads, dim = q.shape
        keys, values = self.storage.read_slots(layer, self.slots)  # [nd, S, kv_heads, D]
        kv_heads = keys.shape[2]
        grouped = q.view(nd, kv_heads, heads // kv_heads, dim)
        out = F.scaled_dot_product_attention(
            grouped,
            keys.to(q.dtype).transpose(1, 2),
            values.to(q.dtype).transpose(1, 2),
            attn_mask=self.mask,
        )
        return out.reshape(nd, heads, dim)


class PrefillAttention:
    """The prefill group: the chunks after the decodes, padded to the longest one, causal."""

    def __init__(self, storage: PagedKVStorage, batch: VarlenBatch) -> None:
        self.storage = storage
        rows = slice(batch.num_decodes, batch.num_seqs)
        starts, ends = batch.query_start[rows], batch.query_start[rows.start + 1 : rows.stop + 1]
        lens = ends - starts
        width = int(lens.max())
        t = torch.arange(width, device=lens.device)
        real = t[None, :] < lens[:, None]  # [b, width]: padded query rows are not real
        # Where each real prefill token sits in the padded grid [b * width], in flat order.
        b = len(lens)
        self.padded_index = (torch.arange(b, device=lens.device)[:, None] * width + t)[real]
        self.width = width
        self.slots, valid = context_slots(batch, rows)
        query_pos = (batch.context_lens[rows] - lens)[:, None] + t  # each query's absolute position
        keys = torch.arange(self.slots.shape[1], device=lens.device)
        mask = valid[:, None, :] & (keys[None, None, :] <= query_pos[:, :, None])
        mask[~real] = keys == 0  # a padded query looks at one key, so its softmax is not 0/0 (NaN)
        self.mask = mask[:, None]  # [b, heads, width, keys]

    def __call__(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """`q` `[tokens, heads, D]`, the prefill chunks' rows end to end -> the same shape."""
        heads, dim = q.shape[1:]
        b = len(self.slots)
        padded = q.new_zeros(b * self.width, heads, dim)
        padded[self.padded_index] = q
        padded = padded.view(b, self.width, heads, dim)
        keys, values = self.storage.read_slots(layer, self.slots)  # [b, S, kv_heads, D]
        out = F.scaled_dot_product_attention(
            padded.transpose(1, 2),
            keys.to(q.dtype).transpose(1, 2),
            values.to(q.dtype).transpose(1, 2),
            attn_mask=self.mask,
            enable_gqa=True,
        )
        return out.transpose(1, 2).reshape(-1, heads, dim)[self.padded_index]
