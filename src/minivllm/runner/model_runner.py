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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from minivllm.attention.backend import BackendFactory
from minivllm.attention.batch import VarlenBatch
from minivllm.attention.storage import PagedKVStorage
from minivllm.attention.torch_backend import TorchPagedAttention
from minivllm.kv.block_manager import BlockManager
from minivllm.model.transformer import Transformer
from minivllm.runner.batch import LogitsBuffer, build_batch, run_model
from minivllm.runner.cuda_graph import DecodeGraphs
from minivllm.runner.sampler import (
    SamplingMetadata,
    logprob_dicts,
    sample,
    sample_logprobs,
    undrawable_rows,
)
from minivllm.runner.speculative import ModelDrafter, NgramDrafter, Proposal, verify
from minivllm.runner.tensor_parallel import TensorParallelGroup
from minivllm.runner.workers import ForwardWorkers
from minivllm.sched.plan import StepPlan
from minivllm.sched.sequence import Sequence

if TYPE_CHECKING:  # imported when an engine compiles: it registers a torch custom op
    from minivllm.runner.compiled import CompiledForward


@dataclass(frozen=True)
class RunnerOutput:
    """What one executed step produced, for the scheduler's update and the trace."""

    tokens: dict[int, int | list[int]]  # per sampling sequence: a token, or a run (speculation)
    speculated: tuple[tuple[int, int, int], ...] = ()  # (seq_id, drafted, accepted)
    forward_s: float = 0.0
    draft_s: float = 0.0
    # SamplingParams.logprobs: per sampling sequence that asked, its token's {token id: logprob}
    logprobs: dict[int, dict[int, float]] = field(default_factory=dict)
    # SamplingParams.prompt_logprobs: per sequence, (prompt position, {token id: logprob}) for the
    # prompt tokens this step's chunk predicted
    prompt_logprobs: dict[int, list[tuple[int, dict[int, float]]]] = field(default_factory=dict)
    # Sequences whose logits no token can be drawn from (undrawable_rows): no token for them, and
    # why, for the engine to end them
    failed: dict[int, str] = field(default_factory=dict)


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
        # ForwardWorkers (runner/workers.py) when other processes share the forward pass
        self.workers: ForwardWorkers | None = None
        # DecodeGraphs (runner/cuda_graph.py) when decode steps replay CUDA graphs
        self.graphs: DecodeGraphs | None = None
        # TensorParallelGroup (runner/tensor_parallel.py) when the model is split over ranks
        self.parallel: TensorParallelGroup | None = None
        # CompiledForward (runner/compiled.py) when the forward runs under torch.compile
        self.compiled: CompiledForward | None = None
        self.logits = LogitsBuffer()  # each step's logits, in memory the last step's held

    def execute(self, plan: StepPlan, sequences: Mapping[int, Sequence]) -> RunnerOutput:
        """Run the plan's chunks: draft (with speculation), one forward pass, sample or verify.

        Two extras ride on the same pass. A sequence whose prompt finishes this step and whose
        request wants n > 1 samples has its siblings (`Sequence.forks`) draw their first tokens
        from its logits row, each with its own seed. A sequence that wants prompt logprobs gets
        the logits of every prompt token of its chunk."""
        for src, dst in self.manager.take_copies():  # copy-on-write of forked blocks, first
            self.storage.copy_block(src, dst)
        if not plan.chunks:  # a plan can be empty when all it did was end a too-big sequence
            return RunnerOutput({})
        sampling = [sequences[i] for i in plan.sampling_seq_ids]
        forks = [(row, f) for row, s in enumerate(sampling) for f in s.forks if not f.is_finished]
        metadata = SamplingMetadata.from_sequences(sampling + [f for _, f in forks])
        started = time.perf_counter()
        proposals = self.propose(plan, sequences, metadata)
        draft_s = time.perf_counter() - started
        drafts = {i: p.tokens for i, p in proposals.items()}
        every_row = {
            c.seq_id for c in plan.prefills if not sequences[c.seq_id].prompt_logprobs_done
        }
        batch = build_batch(plan, sequences, self.manager, drafts, every_row)
        started = time.perf_counter()
        logits = self.forward(batch)
        forward_s = time.perf_counter() - started
        logits, prompt_logprobs = self._split_prompt_rows(plan, sequences, logits, every_row)
        if forks:  # each waiting sibling draws from its parent's row, with its own seed
            logits = torch.cat([logits, logits[[row for row, _ in forks]]])
        logits, failed = _set_aside_undrawable(logits, metadata, proposals)
        tokens = self.sample(logits, metadata, proposals)
        logprobs = _token_logprobs(logits, metadata, tokens)
        for seq_id in failed:  # the stand-in rows drew something: it is never appended
            tokens.pop(seq_id, None)
            logprobs.pop(seq_id, None)
            proposals.pop(seq_id, None)
        speculated = tuple((i, len(p.tokens), len(tokens[i]) - 1) for i, p in proposals.items())
        return RunnerOutput(
            tokens, speculated, forward_s, draft_s, logprobs, prompt_logprobs, failed
        )

    def _split_prompt_rows(
        self,
        plan: StepPlan,
        sequences: Mapping[int, Sequence],
        logits: torch.Tensor,
        every_row: set[int],
    ) -> tuple[torch.Tensor, dict[int, list[tuple[int, dict[int, float]]]]]:
        """Separate the logits rows of prompt-logprob chunks: the row at position p predicts
        prompt token p + 1. Returns the sampling rows alone (one per sampling chunk, as without
        prompt logprobs) and each sequence's (position, logprobs) of its prompt tokens."""
        if not every_row:
            return logits, {}
        keep, wanted, found = [], [], []
        row = 0
        for chunk in plan.chunks:
            seq = sequences[chunk.seq_id]
            if chunk.seq_id in every_row:
                for offset in range(chunk.num_tokens):
                    target = chunk.start + offset + 1
                    if target < seq.num_prompt_tokens:
                        wanted.append(row + offset)
                        found.append((seq, target))
                row += chunk.num_tokens
                if chunk.samples:
                    keep.append(row - 1)
            elif chunk.samples:
                keep.append(row)
                row += 1  # no draft rows: prompt logprobs are refused with speculation
        dicts = logprob_dicts(
            logits[wanted],
            [seq.token_ids[target] for seq, target in found],
            [seq.params.prompt_logprobs for seq, _ in found],
        )
        prompt_logprobs: dict[int, list[tuple[int, dict[int, float]]]] = {}
        for (seq, target), entry in zip(found, dicts):
            prompt_logprobs.setdefault(seq.seq_id, []).append((target, entry))
        return logits[keep], prompt_logprobs

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
        """Logits of the rows that pick (or check) a token, `[S, vocab]` float32, on the model's
        device: a decode-only batch that fits a captured size replays a CUDA graph, anything else
        runs eagerly. On a GPU they stay there: a greedy step's argmax runs where they are and
        only the ids cross to the host (`sample`), not `S x vocab` floats. An eager pass of this
        process writes them into the runner's `LogitsBuffer`: the next pass overwrites them (clone
        what you keep)."""
        if self.workers is not None:
            return self.workers.forward(batch, self.backend)
        if self.parallel is not None:  # every rank makes the queued block copies, then its pass
            return self.parallel.forward(batch)
        if self.graphs is not None and self.graphs.can_run(batch):
            return self.graphs.run(batch, on_host=False)
        model = self.compiled if self.compiled is not None else self.model
        return run_model(model, self.storage, batch, self.backend, False, buffer=self.logits)

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
        return dict(zip(metadata.seq_ids, verify(logits.cpu(), metadata, mine)))


def _set_aside_undrawable(
    logits: torch.Tensor, metadata: SamplingMetadata, proposals: Mapping[int, Proposal]
) -> tuple[torch.Tensor, dict[int, str]]:
    """The sequences whose model logits hold NaN or +inf (or nothing finite), each with a message;
    their rows are replaced by zeros so the batch samples as usual for everyone else (each row
    draws alone), and the caller drops what the stand-ins drew."""
    bad = undrawable_rows(logits)
    if not bad:
        return logits, {}
    # A row per sampling sequence; with a drafter, one per draft token and one more.
    owners = [
        i for i in metadata.seq_ids for _ in range(1 + len(proposals.get(i, Proposal()).tokens))
    ]
    failed = {
        owners[r]: f"the model's logits for sequence {owners[r]} hold NaN or +inf (or nothing "
        "finite): no token can be drawn, so it was ended"
        for r in bad
    }
    logits = logits.clone()
    logits[[r for r, owner in enumerate(owners) if owner in failed]] = 0.0
    return logits, failed


def _token_logprobs(
    logits: torch.Tensor, metadata: SamplingMetadata, tokens: Mapping[int, int | list[int]]
) -> dict[int, dict[int, float]]:
    """The logprobs of each drawn token, for the rows that asked (never with speculation: the
    engine refuses the combination, so each row drew one token)."""
    if not metadata.logprobs:
        return {}
    drawn = [tokens[i] for i in metadata.seq_ids]
    entries = sample_logprobs(logits, metadata, drawn)
    return {i: e for i, e in zip(metadata.seq_ids, entries) if e is not None}
