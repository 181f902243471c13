"""Attention over a flattened (varlen) batch of many sequences, read from the paged cache (chapter
04).

The engine runs every scheduled sequence in ONE forward pass. Their new tokens are laid end to end
in one axis of N tokens -- no padding in the model's matmuls -- and `VarlenBatch` says which tokens
belong to whom, the same metadata FlashAttention's varlen API and vLLM's attention backends take:

    input_ids, positions, slot_mapping   [N]      one entry per new token
    query_start                          [B + 1]  sequence i owns tokens query_start[i] :
    query_start[i+1] context_lens                         [B]      tokens of sequence i in the cache
    once this pass wrote block_tables                         [B, max_blocks]   (padded with 0;
    context_lens says what is real)

Sequences with a single new token (decodes) come first, `num_decodes` of them, then prefill chunks.

`TorchPagedAttention` is the reference backend: chapter 03's gather-and-attend, extended to the
batch. Each layer writes the new K/V of ALL sequences through the slot mapping, then attends in two
groups: decodes as one `[num_decodes, kv_heads, group, context]` call, prefill chunks padded to the
longest chunk. Splitting the groups keeps a 400-token prefill from padding 60 one-token decodes to
400 queries each. Chapter 07 writes a CUDA kernel that takes the same `VarlenBatch`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minivllm.attention.batch import VarlenBatch, context_slots
from minivllm.attention.storage import PagedKVStorage


class TorchPagedAttention:
    """The attention seam for one forward pass over a `VarlenBatch`; the masks and gathers are built
    once here and reused by every layer."""

    def __init__(self, storage: PagedKVStorage, batch: VarlenBatch) -> None:
        self.storage, self.batch = storage, batch
        nd, nseq = batch.num_decodes, batch.num_seqs
        if nd:
            self.decode_slots, valid = context_slots(batch, slice(0, nd))
            self.decode_mask = valid[:, None, None, :]  # [nd, kv_heads, group, keys], broadcast
        if nd < nseq:
            self._prepare_prefills(slice(nd, nseq))

    def _prepare_prefills(self, rows: slice) -> None:
        batch = self.batch
        starts, ends = batch.query_start[rows], batch.query_start[rows.start + 1 : rows.stop + 1]
        lens = ends - starts
        width = int(lens.max())
        t = torch.arange(width, device=lens.device)
        real = t[None, :] < lens[:, None]  # [b, width]: padded query rows are not real
        # Padded layout [b * width] <- flat rows: where each real prefill token sits in the padded
        # grid.
        self.prefill_rows = torch.arange(int(starts[0]), int(ends[-1]), device=lens.device)
        self.padded_index = (
            torch.arange(len(lens), device=lens.device)[:, None] * width + t[None, :]
        )[real]
        self.prefill_width = width
        self.prefill_slots, valid = context_slots(batch, rows)
        query_pos = (batch.context_lens[rows] - lens)[:, None] + t[
            None, :
        ]  # absolute position of each query
        keys = torch.arange(self.prefill_slots.shape[1], device=lens.device)
        mask = valid[:, None, :] & (keys[None, None, :] <= query_pos[:, :, None])
        mask[~real] = keys == 0  # a padded query looks at one key, so its softmax is not 0/0 (NaN)
        self.prefill_mask = mask[:, None]  # [b, heads, width, keys]

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        batch = self.batch
        self.storage.write(layer, batch.slot_mapping, k, v)
        out = torch.empty_like(q)
        nd = batch.num_decodes
        if nd:
            out[:nd] = self._attend_decodes(layer, q[:nd])
        if nd < batch.num_seqs:
            heads, dim = q.shape[1:]
            padded = q.new_zeros(len(self.prefill_slots) * self.prefill_width, heads, dim)
            padded[self.padded_index] = q[self.prefill_rows]
            padded = padded.view(len(self.prefill_slots), self.prefill_width, heads, dim)
            result = self._attend(layer, padded, self.prefill_slots, self.prefill_mask)
            out[self.prefill_rows] = result.reshape(-1, heads, dim)[self.padded_index]
        return out

    def _attend_decodes(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """One query per sequence, `[nd, heads, D]`. The query heads that share a K/V head are laid
        along the query axis, `[nd, kv_heads, group, D]`, so each cached K/V row is read once per
        K/V head
        rather than copied once per query head (what `enable_gqa` does on the CPU)."""
        nd, heads, dim = q.shape
        keys, values = self.storage.read_slots(layer, self.decode_slots)  # [nd, S, kv_heads, D]
        kv_heads = keys.shape[2]
        grouped = q.view(nd, kv_heads, heads // kv_heads, dim)
        out = F.scaled_dot_product_attention(
            grouped,
            keys.to(q.dtype).transpose(1, 2),
            values.to(q.dtype).transpose(1, 2),
            attn_mask=self.decode_mask,
        )
        return out.reshape(nd, heads, dim)

    def _attend(
        self, layer: int, q: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """q `[b, T, heads, D]` against the K/V at `slots` `[b, S]` -> `[b, T, heads, D]`."""
        keys, values = self.storage.read_slots(layer, slots)  # [b, S, kv_heads, D]
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            keys.to(q.dtype).transpose(1, 2),
            values.to(q.dtype).transpose(1, 2),
            attn_mask=mask,
            enable_gqa=True,
        )
        return out.transpose(1, 2)
