"""The model runner: one StepPlan in, one forward pass, the sampled tokens out (chapter 04).

The scheduler decided who runs; the runner only translates. `execute` is the whole step on the
model's side:

    metadata = SamplingMetadata.from_sequences(...)   # the sampling rows, once per step
    proposals = runner.propose(plan, ..., metadata)   # drafts, with speculation (chapter 06)
    batch = build_batch(plan, sequences, manager)     # the plan's chunks, flattened
    logits = runner.forward(batch)                    # ONE forward pass over all of them
    tokens = runner.sample(logits, metadata, ...)     # one batched sampling (or verify) call

`build_batch` lays the chunks end to end in a `VarlenBatch` -- token ids, positions, slot mapping,
query offsets, context lengths, block tables -- and ONE call of the model runs all of them, prefill
chunks and decodes mixed, with the attention backend writing and reading the paged cache. There is
no loop over sequences around the model.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from minivllm.attention.backend import BackendFactory
from minivllm.attention.batch import VarlenBatch
from minivllm.attention.storage import PagedKVStorage
from minivllm.attention.torch_backend import TorchPagedAttention
from minivllm.kv.block_manager import BlockManager
from minivllm.model.transformer import Transformer
from minivllm.runner.batch import build_batch, run_model
from minivllm.runner.sampler import SamplingMetadata, sample
from minivllm.runner.speculative import ModelDrafter, NgramDrafter, Proposal, verify
from minivllm.sched.plan import StepPlan
from minivllm.sched.sequence import Sequence


@dataclass(frozen=True)
class RunnerOutput:
    """What one executed step produced, for the scheduler's update and the trace."""

    tokens: dict[int, int | list[int]]  # per sampling sequence: a token, or a run (speculation)
    speculated: tuple[tuple[int, int, int], ...] = ()  # (seq_id, drafted, accepted)
    forward_s: float = 0.0
    draft_s: float = 0.0


class ModelRunner:
    def __init__(
        self,
        model: Transformer,
        storage: PagedKVStorage,
        manager: BlockManager,
        backend: BackendFactory = TorchPagedAttention,
        drafter: NgramDrafter | ModelDrafter | None = None,
    ) -> None:
        self.model, self.storage, self.manager = model, storage, manager
        self.backend, self.drafter = backend, drafter

    def execute(self, plan: StepPlan, sequences: Mapping[int, Sequence]) -> RunnerOutput:
        """Run the plan's chunks: draft (with speculation), one forward pass, sample or verify."""
        if not plan.chunks:  # a plan can be empty when all it did was end a too-big sequence
            return RunnerOutput({})
        metadata = SamplingMetadata.from_sequences([sequences[i] for i in plan.sampling_seq_ids])
        started = time.perf_counter()
        proposals = self.propose(plan, sequences, metadata)
        draft_s = time.perf_counter() - started
        drafts = {i: p.tokens for i, p in proposals.items()}
        batch = build_batch(plan, sequences, self.manager, drafts)
        started = time.perf_counter()
        logits = self.forward(batch)
        forward_s = time.perf_counter() - started
        tokens = self.sample(logits, metadata, proposals)
        speculated = tuple((i, len(p.tokens), len(tokens[i]) - 1) for i, p in proposals.items())
        return RunnerOutput(tokens, speculated, forward_s, draft_s)

    def propose(
        self, plan: StepPlan, sequences: Mapping[int, Sequence], metadata: SamplingMetadata
    ) -> dict[int, Proposal]:
        """The drafter's tokens for every chunk with lookahead slots (none without speculation)."""
        chunks = [c for c in plan.chunks if c.num_lookahead]
        if self.drafter is None or not chunks:
            return {}
        row = {seq_id: r for r, seq_id in enumerate(metadata.seq_ids)}
        proposals = self.drafter.propose(
            [sequences[c.seq_id] for c in chunks],
            [c.num_lookahead for c in chunks],
            metadata.select([row[c.seq_id] for c in chunks]),
        )
        return {c.seq_id: p for c, p in zip(chunks, proposals)}

    def forward(self, batch: VarlenBatch) -> torch.Tensor:
        """Logits of the rows that pick (or check) a token, `[S, vocab]`."""
        return run_model(self.model, self.storage, batch, self.backend)

    def sample(
        self,
        logits: torch.Tensor,
        metadata: SamplingMetadata,
        proposals: Mapping[int, Proposal] | None = None,
    ) -> dict[int, int | list[int]]:
        """A token per sampling sequence; with a drafter, the run `verify` keeps of its drafts."""
        if self.drafter is None:
            return dict(zip(metadata.seq_ids, sample(logits, metadata)))
        proposals = proposals or {}
        mine = [proposals.get(i, Proposal()) for i in metadata.seq_ids]
        return dict(zip(metadata.seq_ids, verify(logits, metadata, mine)))
