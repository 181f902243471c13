"""`VarlenBatch`: a step's sequences flattened into one token axis, with what attention needs to
keep them apart (chapter 04); `context_slots` turns block tables into the slots of each context."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch


@dataclass(frozen=True)
class VarlenBatch:
    input_ids: torch.Tensor  # [N] long
    positions: torch.Tensor  # [N] long
    slot_mapping: torch.Tensor  # [N] long: where each new token's K/V is written
    query_start: torch.Tensor  # [B + 1] long
    context_lens: torch.Tensor  # [B] long
    block_tables: torch.Tensor  # [B, max_blocks] long
    num_decodes: int  # the first num_decodes sequences have exactly one new token
    logits_indices: torch.Tensor  # [S] long: rows whose logits pick a next token
    block_size: int
    # The longest context of the decode group, known on the host: a GPU kernel sizes its launch by
    # it without reading `context_lens` back from the device (a sync per step). 0: no decodes.
    max_decode_context_len: int = 0

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    def to(self, device: torch.device | str) -> VarlenBatch:
        """The same batch with every tensor on `device` (the batch is built on the CPU)."""
        moved = {
            f.name: getattr(self, f.name).to(device)
            for f in fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        return replace(self, **moved)


def context_slots(batch: VarlenBatch, rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
    """For sequences `rows`: the slot of each of their cached tokens, `[b, max_len]`, and which
    entries are real, `[b, max_len]` (the rest is padding, pointing at slot 0)."""
    lens = batch.context_lens[rows]
    width = int(lens.max())
    offsets = torch.arange(width, device=lens.device)
    blocks = batch.block_tables[rows][:, offsets // batch.block_size]
    valid = offsets[None, :] < lens[:, None]
    slots = torch.where(valid, blocks * batch.block_size + offsets % batch.block_size, 0)
    return slots, valid
