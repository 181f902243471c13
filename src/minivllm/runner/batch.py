"""From a StepPlan to a `VarlenBatch`, and one forward pass over it (chapter 04).

`build_batch` turns each scheduled chunk into a `BatchPiece` -- its tokens, where they start, how
many rows of logits it wants -- and `pack_batch` lays the pieces end to end. `run_model` runs the
model once over the packed batch with an attention backend. Chapter 06's draft model uses the same
two functions on pieces of its own.
"""

from __future__ import annotations

from collections.abc import Container, Mapping
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, replace

import numpy as np
import torch

from minivllm.attention.backend import BackendFactory
from minivllm.attention.batch import VarlenBatch
from minivllm.attention.storage import PagedKVStorage
from minivllm.attention.torch_backend import TorchPagedAttention
from minivllm.kv.block_manager import BlockManager
from minivllm.model.transformer import Transformer
from minivllm.runner.threads import free_threads, pass_threads, torch_threads
from minivllm.sched.plan import StepPlan
from minivllm.sched.sequence import Sequence


@dataclass(frozen=True)
class BatchPiece:
    """Run `token_ids` of sequence `seq_id` at positions `start, start+1, ...`; the logits of the
    last `num_logits` of them are wanted (0: none, 1: the next token, k + 1: a speculative
    verify)."""

    seq_id: int
    start: int
    token_ids: SequenceOf[int]
    num_logits: int


def build_batch(
    plan: StepPlan,
    sequences: Mapping[int, Sequence],
    manager: BlockManager,
    drafts: Mapping[int, SequenceOf[int]] | None = None,
    every_row: Container[int] = (),
) -> VarlenBatch:
    """Lay the plan's chunks end to end: decodes first (the plan's order), then prefill chunks. A
    chunk with lookahead slots carries its sequence's draft tokens (chapter 06) after its own. The
    chunks of the sequences in `every_row` want the logits of every token (prompt logprobs), not
    only of the last."""
    if not plan.chunks:
        raise ValueError(f"step {plan.step} schedules nothing: there is no batch to build")
    drafts = drafts or {}
    pieces = []
    for chunk in plan.chunks:
        draft = list(drafts.get(chunk.seq_id, ()))
        if len(draft) > chunk.num_lookahead:
            raise ValueError(
                f"sequence {chunk.seq_id} brings {len(draft)} draft tokens but the plan reserved "
                f"{chunk.num_lookahead} slots for them"
            )
        own = sequences[chunk.seq_id].token_ids[chunk.start : chunk.start + chunk.num_tokens]
        num_logits = (1 + len(draft)) if chunk.samples else 0
        if chunk.seq_id in every_row:
            num_logits = len(own) + len(draft)
        pieces.append(BatchPiece(chunk.seq_id, chunk.start, own + draft, num_logits))
    return pack_batch(pieces, manager)


def pack_batch(pieces: SequenceOf[BatchPiece], manager: BlockManager) -> VarlenBatch:
    """Flatten pieces into one `VarlenBatch`, in the order given. Every position a piece runs must
    already have a slot in its block table. The loop is per piece; positions and slots are then
    computed for every token at once, with array arithmetic (a step at batch 64 has no Python loop
    over tokens)."""
    input_ids, starts, context_lens, tables, logits_indices = [], [], [], [], []
    query_start = [0]
    for piece in pieces:
        end = piece.start + len(piece.token_ids)
        if end > manager.num_tokens(piece.seq_id):
            raise IndexError(
                f"sequence {piece.seq_id} runs positions up to {end - 1} but its block table "
                f"holds {manager.num_tokens(piece.seq_id)} tokens"
            )
        # EXERCISE ch04.3: flatten one chunk -- its token ids; where it ends in the batch; context
        ### BEGIN SOLUTION
        input_ids += piece.token_ids
        query_start.append(query_start[-1] + len(piece.token_ids))
        context_lens.append(end)  # everything before the chunk is in the cache, and it joins them
        ### END SOLUTION
        starts.append(piece.start)
        tables.append(manager.block_table(piece.seq_id))
        # The last token predicts the next one; with drafts, each of the last k + 1 rows is checked.
        logits_indices += range(query_start[-1] - piece.num_logits, query_start[-1])
    # The arithmetic in numpy, whose calls cost a microsecond or two where torch's cost five to
    # ten, and whose lists-to-arrays are faster still (the block tables: 29 us against torch's 119
    # at batch 64); the tensors share the arrays' memory.
    width = max(len(t) for t in tables)
    block_tables = np.array([t + [0] * (width - len(t)) for t in tables], dtype=np.int64)
    offsets = np.array(query_start, dtype=np.int64)
    # Which piece each token belongs to; its position counts on from the piece's start, and its
    # slot is block * block_size + offset through that piece's block table.
    owner = np.repeat(np.arange(len(tables)), np.diff(offsets))
    positions = np.array(starts, dtype=np.int64)[owner] + np.arange(len(input_ids)) - offsets[owner]
    size = manager.block_size
    slots = block_tables[owner, positions // size] * size + positions % size
    num_decodes = _leading_single_tokens(pieces)
    return VarlenBatch(
        input_ids=_tensor(input_ids),
        positions=torch.from_numpy(positions),
        slot_mapping=torch.from_numpy(slots),
        query_start=torch.from_numpy(offsets),
        context_lens=_tensor(context_lens),
        block_tables=torch.from_numpy(block_tables),
        num_decodes=num_decodes,
        logits_indices=_tensor(logits_indices),
        block_size=size,
        max_decode_context_len=max(context_lens[:num_decodes], default=0),
    )


def _tensor(values: SequenceOf[int]) -> torch.Tensor:
    """A list of ints as a long tensor, through numpy (five times faster than `torch.tensor`)."""
    return torch.from_numpy(np.array(values, dtype=np.int64))


def _leading_single_tokens(pieces: SequenceOf[BatchPiece]) -> int:
    """How many pieces at the front have one token: the attention's decode group. (A one-token
    prefill chunk that happens to follow them is attended the same way, correctly.)"""
    count = 0
    for piece in pieces:
        if len(piece.token_ids) != 1:
            break
        count += 1
    return count


class LogitsBuffer:
    """float32 memory for a pass's logits, kept from step to step (the engine's runner has one).

    A step's logits are a new tensor of rows x vocabulary, and a big one is new memory at every
    step: glibc's malloc maps a block over 32 MiB (the most its threshold rises to) from the system
    and hands it back when freed, so the copy into it faults in every page. Qwen3's 151,936-token
    vocabulary at batch 64 is 39 MB: that copy took 8.9 ms of a 314 ms decode step, and 1.6 ms
    into this buffer (AMD EPYC Zen 4, the step profiled). Each step's logits overwrite the last
    step's, which nothing holds by then (the runner's `execute` keeps tokens, not logits). Logits
    over MAX_BYTES (a long prompt's every row, for its logprobs) get a tensor of their own."""

    MAX_BYTES = 64 << 20

    def __init__(self) -> None:
        self.memory: torch.Tensor | None = None

    def hold(self, rows: torch.Tensor) -> torch.Tensor:
        """`rows` as float32 on their device, in this buffer where they fit MAX_BYTES."""
        count = rows.numel()
        if count * 4 > self.MAX_BYTES:
            return rows.to(rows.device, torch.float32, copy=True)
        memory = self.memory
        if memory is None or memory.numel() < count or memory.device != rows.device:
            memory = self.memory = torch.empty(count, dtype=torch.float32, device=rows.device)
        return memory[:count].view(rows.shape).copy_(rows)


def run_model(
    model: Transformer,
    storage: PagedKVStorage,
    batch: VarlenBatch,
    backend: BackendFactory = TorchPagedAttention,
    on_host: bool = True,
    buffer: LogitsBuffer | None = None,
) -> torch.Tensor:
    """One forward pass over a flattened batch, on the storage's device, with an attention backend
    (see `minivllm.attention.backend`); the logits of the rows it asks for, `[S, vocab]` float32,
    back on the CPU, where sampling happens -- or, with `on_host=False`, left on the model's device
    (the engine's runner: the sampler then moves to the host only what it needs), in `buffer`'s
    memory where one is given (overwritten by the next pass that uses it)."""
    if not batch.slots_checked and batch.slot_mapping.device.type == "cpu":
        # On the host, where reading the slots is free; the backend then does not read them back
        # from the device.
        storage.check_slots(batch.slot_mapping)
        batch = replace(batch, slots_checked=True)
    batch = batch.to(storage.kv.device)
    # Inference mode, not just no_grad: autograd keeps no version counters or view metadata on
    # the pass's few hundred small operations, a few percent of a CPU decode step.
    device = storage.kv.device
    # The cores other processes leave free, where torch's threads spin (runner/threads.py)
    with torch.inference_mode(), torch_threads(free_threads(device)):
        attention = backend(storage, batch)  # picks its threads from torch's count: every one
        threads = pass_threads(model, batch.input_ids.numel(), device)
        with torch_threads(threads):  # a small pass's matmuls on one (runner/threads.py)
            rows = model(batch.input_ids, batch.positions, attention, rows=batch.logits_indices)
    # Copied out of inference mode: the sampler edits its logits in place (bans, biases), which
    # an inference tensor refuses outside it.
    if buffer is not None and not on_host:
        return buffer.hold(rows)
    return rows.to("cpu" if on_host else rows.device, torch.float32, copy=True)
