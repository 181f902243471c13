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
    # True once `PagedKVStorage.check_slots` has passed `slot_mapping` on the host (`run_model`
    # does, before the batch goes to the device): a backend then skips its own check, which on a
    # GPU reads the slots back (a sync, and not allowed inside a CUDA-graph capture).
    slots_checked: bool = False

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


def split_sequences(batch: VarlenBatch, bounds: list[int]) -> list[VarlenBatch]:
    """The batch cut between sequences: part i is sequences `bounds[i]:bounds[i + 1]` with their
    tokens, slots, tables and the logits rows among their tokens, renumbered from 0 (chapter 11's
    forward workers run one part each). The parts' logits, concatenated in order, are the whole
    batch's rows in their order: `logits_indices` rise through the batch. On the host."""
    rising = all(a < b for a, b in zip(bounds, bounds[1:]))
    if bounds[0] != 0 or bounds[-1] != batch.num_seqs or not rising:
        raise ValueError(f"bounds must rise from 0 to {batch.num_seqs}, got {bounds}")
    if (batch.logits_indices.diff() <= 0).any():
        raise ValueError("logits_indices must rise through the batch to be split")
    parts = []
    for first, end in zip(bounds, bounds[1:]):
        t0, t1 = int(batch.query_start[first]), int(batch.query_start[end])
        rows = batch.logits_indices
        num_decodes = min(max(batch.num_decodes - first, 0), end - first)
        context_lens = batch.context_lens[first:end]
        parts.append(
            VarlenBatch(
                input_ids=batch.input_ids[t0:t1],
                positions=batch.positions[t0:t1],
                slot_mapping=batch.slot_mapping[t0:t1],
                query_start=batch.query_start[first : end + 1] - t0,
                context_lens=context_lens,
                block_tables=batch.block_tables[first:end],
                num_decodes=num_decodes,
                logits_indices=rows[(rows >= t0) & (rows < t1)] - t0,
                block_size=batch.block_size,
                max_decode_context_len=int(context_lens[:num_decodes].max()) if num_decodes else 0,
            )
        )
    return parts


def context_slots(
    batch: VarlenBatch, rows: slice, width: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """For sequences `rows`: the slot of each of their cached tokens, `[b, width]`, and which
    entries are real, `[b, width]` (the rest is padding, pointing at slot 0). `width` is the
    longest of their contexts unless given (the decode group's is known on the host,
    `max_decode_context_len`; reading it from a device tensor would wait for the GPU)."""
    lens = batch.context_lens[rows]
    width = int(lens.max()) if width is None else width
    offsets = torch.arange(width, device=lens.device)
    blocks = batch.block_tables[rows][:, offsets // batch.block_size]
    valid = offsets[None, :] < lens[:, None]
    slots = torch.where(valid, blocks * batch.block_size + offsets % batch.block_size, 0)
    return slots, valid
