"""The model runner: one StepPlan in, one forward pass, one sampled token per finished chunk out
(chapter 04).

The scheduler decided who runs; the runner only translates. `build_batch` flattens the plan's chunks
into a `VarlenBatch` -- token ids, positions, slot mapping, query offsets, context lengths, block
tables -- then ONE call of the model runs all of them, prefill chunks and decodes mixed, with
`TorchPagedAttention` writing and reading the paged cache. There is no loop over sequences around
the model. The rows that end a sequence's chunk are sampled together in one batched call.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from minivllm.attention.batch import VarlenBatch
from minivllm.attention.storage import PagedKVStorage
from minivllm.attention.torch_backend import TorchPagedAttention
from minivllm.kv.block_manager import BlockManager
from minivllm.model.transformer import Transformer
from minivllm.runner.sampler import sample
from minivllm.sched.plan import StepPlan
from minivllm.sched.sequence import Sequence


@torch.no_grad()
def run_model(
    model: Transformer,
    storage: PagedKVStorage,
    batch: VarlenBatch,
    backend: type = TorchPagedAttention,
) -> torch.Tensor:
    """One forward pass over a flattened batch, on the storage's device, with an attention backend
    (`TorchPagedAttention`, or chapter 07's `CudaPagedAttention`); the logits of the rows it asks
    for, `[S, vocab]`, back on the CPU, where sampling happens."""
    batch = batch.to(storage.kv.device)
    logits = model(batch.input_ids, batch.positions, backend(storage, batch))
    return logits[batch.logits_indices].float().cpu()


class ModelRunner:
    def __init__(
        self,
        model: Transformer,
        storage: PagedKVStorage,
        manager: BlockManager,
        backend: type = TorchPagedAttention,
    ) -> None:
        self.model, self.storage, self.manager, self.backend = model, storage, manager, backend

    def forward(self, batch: VarlenBatch) -> torch.Tensor:
        """Logits of the rows that pick (or check) a token, `[S, vocab]`."""
        return run_model(self.model, self.storage, batch, self.backend)

    def sample(
        self, plan: StepPlan, sequences: Mapping[int, Sequence], logits: torch.Tensor
    ) -> dict[int, int]:
        """One token per sampling chunk; its position is the index it will have in the sequence."""
        seqs = [sequences[i] for i in plan.sampling_seq_ids]
        tokens = sample(
            logits,
            temperatures=[s.params.temperature for s in seqs],
            top_ks=[s.params.top_k for s in seqs],
            top_ps=[s.params.top_p for s in seqs],
            seeds=[s.seed for s in seqs],
            positions=[s.num_tokens for s in seqs],
        )
        return dict(zip(plan.sampling_seq_ids, tokens))
