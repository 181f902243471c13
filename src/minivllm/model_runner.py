"""The model runner: one StepPlan in, one forward pass, one sampled token per finished chunk out (chapter 04).

The scheduler decided who runs; the runner only translates. `build_batch` flattens the plan's chunks
into a `VarlenBatch` -- token ids, positions, slot mapping, query offsets, context lengths, block
tables -- then ONE call of the model runs all of them, prefill chunks and decodes mixed, with
`TorchPagedAttention` writing and reading the paged cache. There is no loop over sequences around the
model. The rows that end a sequence's chunk are sampled together in one batched call.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .block_allocator import BlockManager
from .model import Transformer
from .paged_cache import PagedKVStorage
from .sampler import sample
from .scheduler import StepPlan
from .sequence import Sequence
from .varlen_attention import TorchPagedAttention, VarlenBatch


def build_batch(plan: StepPlan, sequences: Mapping[int, Sequence], manager: BlockManager) -> VarlenBatch:
    """Lay the plan's chunks end to end: decodes first (the plan's order), then prefill chunks."""
    if not plan.chunks:
        raise ValueError(f"step {plan.step} schedules nothing: there is no batch to build")
    input_ids, positions, slots, query_start, context_lens, tables, logits_indices = [], [], [], [0], [], [], []
    for chunk in plan.chunks:
        seq = sequences[chunk.seq_id]
        end = chunk.start + chunk.num_tokens
        # EXERCISE ch04.3: flatten one chunk -- its token ids, positions and slots; where it ends; its context
        ### BEGIN SOLUTION
        input_ids += seq.token_ids[chunk.start:end]
        positions += range(chunk.start, end)
        slots += manager.slot_mapping(chunk.seq_id, range(chunk.start, end))
        query_start.append(query_start[-1] + chunk.num_tokens)
        context_lens.append(end)  # everything before the chunk is in the cache, and the chunk joins it
        ### END SOLUTION
        tables.append(manager.block_table(chunk.seq_id))
        if chunk.samples:
            logits_indices.append(query_start[-1] - 1)  # the chunk's last token predicts the next one
    width = max(len(t) for t in tables)
    return VarlenBatch(
        input_ids=torch.tensor(input_ids), positions=torch.tensor(positions), slot_mapping=torch.tensor(slots),
        query_start=torch.tensor(query_start), context_lens=torch.tensor(context_lens),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        num_decodes=_leading_single_token_chunks(plan),
        logits_indices=torch.tensor(logits_indices, dtype=torch.long), block_size=manager.block_size,
    )


def _leading_single_token_chunks(plan: StepPlan) -> int:
    """How many chunks at the front of the plan have one token: the attention's decode group. (A
    one-token prefill chunk that happens to follow them is attended the same way, correctly.)"""
    count = 0
    for chunk in plan.chunks:
        if chunk.num_tokens != 1:
            break
        count += 1
    return count


class ModelRunner:
    def __init__(self, model: Transformer, storage: PagedKVStorage, manager: BlockManager) -> None:
        self.model, self.storage, self.manager = model, storage, manager

    @torch.no_grad()
    def forward(self, batch: VarlenBatch) -> torch.Tensor:
        """Logits of the rows that pick a token, `[S, vocab]`."""
        attention = TorchPagedAttention(self.storage, batch)
        logits = self.model(batch.input_ids, batch.positions, attention)
        return logits[batch.logits_indices]

    def sample(self, plan: StepPlan, sequences: Mapping[int, Sequence], logits: torch.Tensor) -> dict[int, int]:
        """One token per sampling chunk; its position is the index it will have in the sequence."""
        seqs = [sequences[i] for i in plan.sampling_seq_ids]
        tokens = sample(
            logits,
            temperatures=[s.params.temperature for s in seqs], top_ks=[s.params.top_k for s in seqs],
            top_ps=[s.params.top_p for s in seqs], seeds=[s.seed for s in seqs],
            positions=[s.num_tokens for s in seqs],
        )
        return dict(zip(plan.sampling_seq_ids, tokens))
