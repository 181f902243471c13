"""The decode step as a CUDA graph: captured once per padded batch size, replayed every step
(issue 34, as nano-vllm's `ModelRunner.capture_cudagraph` and vLLM's `CUDAGraphRunner`).

Why. On a GPU the engine is bound by the host, not the device. `benchmarks/gpu_engine.py` on an
H100 (recorded in `benchmarks/results/gpu/gpu_engine.json`, its `decode_profiles`): an eager
batch-64 decode step of the shipped 6-layer model is a couple of hundred kernel launches, each a
few microseconds of Python and torch dispatch (numba's launches more), plus host syncs, and its
GPU kernels are busy for under a tenth of the step. A CUDA graph records those launches once and
replays them as ONE launch: the host's cost of a step no longer grows with the number of kernels
in it. (The sampler's syncs, after the forward, stay.) The same file has the step times and the
tokens/s with and without graphs.

What is captured. The model's forward over a decode-only batch of `bs` rows -- embedding, every
layer with its attention backend (K/V written through the slot mapping, then paged decode
attention), final norm and `lm_head` -- reading its inputs from static device buffers and writing
the logits into a static output. A graph replays the same kernels on the same addresses, so:

* the inputs live in one int64 buffer (token ids, positions, slots, context lengths, block
  tables `[max_bs, max_blocks]`, max_blocks = ceil(max_model_len / block_size)), filled on the
  host in a pinned twin and copied over in one transfer per step;
* shapes are fixed per graph: the decode attention attends over the whole table's capacity
  (`max_decode_context_len = max_blocks * block_size`, masked to each row's context length;
  chapter 08's kernel reads only the real blocks, with a partition size fixed at capture);
* nothing in the forward reads a device value on the host (no `.item()`, no `int(t.max())`):
  the backend takes widths from the batch's host metadata, and the slots are checked on the
  host, before they are copied in (`VarlenBatch.slots_checked`).

Graphs are captured for the batch sizes in `graph_batch_sizes` (1, 2, 4, 8, 16, 24, ... up to
the scheduler's `max_num_seqs`), largest first, each after one eager warm-up pass (numba compiles
its kernel, cuBLAS makes its handles, outside the capture), all in one memory pool: they never
run at once, so they can share their intermediate tensors.

Padding. A batch of n sequences replays the smallest captured size bs >= n. Rows n..bs run on
dummy inputs that must not touch any sequence's cache: they write their K/V into a padding sink,
one extra block of the storage that the `BlockManager` never hands out (the engine allocates
`num_blocks + 1` blocks and the manager knows `num_blocks`), and attend to it alone (context
length 1, a block table of sink blocks). Their logits are dropped.

What stays eager: any step with a prefill chunk, draft tokens (speculation) or a row whose logits
are not exactly one per sequence (prompt logprobs), a batch larger than the largest graph or with
a context beyond `max_model_len`, engines on a CPU, and `EngineConfig(enforce_eager=True)`. A
capture that fails (a backend that syncs inside it, say) warns and leaves every step eager.

`DecodeGraphs(capture=False)` runs the same padded, fixed-width, static-buffer forward eagerly
instead of replaying: the tests check on a CPU that it gives the engine's tokens, and that the
sink block is the only one padding writes. Only a GPU run exercises the capture itself.
"""

from __future__ import annotations

import logging
import time
import warnings

import torch

from minivllm.attention.backend import BackendFactory
from minivllm.attention.batch import VarlenBatch
from minivllm.attention.storage import PagedKVStorage
from minivllm.model.transformer import Transformer

logger = logging.getLogger("minivllm.engine")


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The decode batch sizes that get a graph: 1, 2, 4, 8, then every multiple of 8 up to
    `max_num_seqs` (and `max_num_seqs` itself), as vLLM's capture sizes. A batch pads up to the
    next one: never more than 7 wasted rows above 8, where a row costs little anyway."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs] + list(range(8, max_num_seqs, 8))
    return [*sizes, max_num_seqs]


class DecodeGraphs:
    """Decode steps on static buffers, one CUDA graph per batch size in `sizes`.

    `sink_block` is the storage's padding block (no sequence may own it). `capture=False` keeps
    the static buffers, the padding and the fixed widths but runs the forward eagerly at each
    step (for tests on a CPU)."""

    def __init__(
        self,
        model: Transformer,
        storage: PagedKVStorage,
        backend: BackendFactory,
        *,
        sink_block: int,
        max_num_seqs: int,
        max_model_len: int,
        capture: bool = True,
    ) -> None:
        if not 0 <= sink_block < storage.num_blocks:
            raise ValueError(
                f"the padding sink block {sink_block} is not one of the storage's "
                f"{storage.num_blocks} blocks"
            )
        device = storage.kv.device
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a cache on a CUDA device, got {device}")
        self.model, self.storage, self.backend = model, storage, backend
        self.sink_block, self.capture = sink_block, capture
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.max_bs = self.sizes[-1]
        self.block_size = storage.block_size
        self.max_blocks = -(-max_model_len // self.block_size)
        self.capacity = self.max_blocks * self.block_size  # the fixed decode width
        # One int64 buffer for every input, and its host twin (pinned: one async copy per step).
        n, w = self.max_bs, self.max_blocks
        self.host = torch.zeros(n * (4 + w), dtype=torch.long, pin_memory=device.type == "cuda")
        self.static = torch.zeros_like(self.host, device=device)
        self.host_views = _views(self.host, n, w)
        views = _views(self.static, n, w)
        self.batches = {bs: self._static_batch(views, bs) for bs in self.sizes}
        dtype = model.lm_head.weight.dtype
        self.logits = torch.zeros(n, model.config.vocab_size, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.replays = 0  # decode steps run here (replayed, or run eagerly with capture=False)
        self.capture_s, self.pool_bytes = 0.0, 0
        self._pad(0)
        self.static.copy_(self.host)
        # Why capture failed, if it did: the engine then runs every step eagerly (a warning says
        # so) rather than not at all.
        self.capture_error: str | None = None
        if capture:
            try:
                self._capture_all()
            except Exception as error:  # torch's RuntimeError, numba's CudaAPIError, ...
                self.graphs.clear()
                self.capture_error = f"{type(error).__name__}: {error}"
                warnings.warn(
                    f"capturing the decode CUDA graphs failed, every step runs eagerly: "
                    f"{self.capture_error}",
                    RuntimeWarning,
                    stacklevel=2,
                )

    def _static_batch(self, views: dict[str, torch.Tensor], bs: int) -> VarlenBatch:
        """The decode batch of the first `bs` rows of the static buffers."""
        rows = torch.arange(bs + 1, device=self.static.device)
        return VarlenBatch(
            input_ids=views["input_ids"][:bs],
            positions=views["positions"][:bs],
            slot_mapping=views["slot_mapping"][:bs],
            query_start=rows,
            context_lens=views["context_lens"][:bs],
            block_tables=views["block_tables"][:bs],
            num_decodes=bs,
            logits_indices=rows[:bs],
            block_size=self.block_size,
            max_decode_context_len=self.capacity,
            slots_checked=True,  # on the host, in `run`, before they are copied in
        )

    def _pad(self, first: int) -> None:
        """Rows `first:` of the host buffers become padding: token 0 at position 0, written to the
        sink block's first slot, attending to it alone."""
        views = self.host_views
        views["input_ids"][first:] = 0
        views["positions"][first:] = 0
        views["slot_mapping"][first:] = self.sink_block * self.block_size
        views["context_lens"][first:] = 1
        views["block_tables"][first:] = self.sink_block

    def _forward(self, bs: int) -> None:
        """The pass a graph records: the model over the static batch of `bs` rows, logits into
        the static output."""
        batch = self.batches[bs]
        attention = self.backend(self.storage, batch)
        self.logits[:bs] = self.model(batch.input_ids, batch.positions, attention)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        # Each capture empties torch's cache of unused blocks as it starts; emptied here too,
        # before and after, what stays reserved in between is the graphs' pool.
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        started, reserved = time.perf_counter(), torch.cuda.memory_reserved()
        pool = torch.cuda.graph_pool_handle()
        for bs in reversed(self.sizes):  # largest first: the smaller ones fit in its pool
            self._forward(bs)  # warm-up: kernels compiled, handles and workspaces made
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._forward(bs)
            self.graphs[bs] = graph
        torch.cuda.synchronize()
        self.capture_s = time.perf_counter() - started
        torch.cuda.empty_cache()
        self.pool_bytes = torch.cuda.memory_reserved() - reserved
        logger.info(
            "captured %d decode CUDA graphs (batch sizes %s) in %.2f s; %.1f MiB reserved",
            len(self.graphs),
            self.sizes,
            self.capture_s,
            self.pool_bytes / 2**20,
        )

    def can_run(self, batch: VarlenBatch) -> bool:
        """Whether `batch` (on the host) is a decode step that fits a graph: every sequence one
        token, one logits row per sequence in order, contexts and tables within capacity."""
        n = batch.num_seqs
        return (
            self.capture_error is None
            and 1 <= n <= self.max_bs
            and batch.num_decodes == n
            and batch.num_tokens == n
            and batch.slot_mapping.device.type == "cpu"
            and batch.block_tables.shape[1] <= self.max_blocks
            and batch.max_decode_context_len <= self.capacity
            and torch.equal(batch.logits_indices, torch.arange(n))
        )

    def run(self, batch: VarlenBatch, on_host: bool = True) -> torch.Tensor:
        """The logits of a decode batch (`can_run`), `[n, vocab]` float32 on the CPU (on the GPU
        with `on_host=False`, copied out of the static buffer the next replay overwrites): the
        batch copied into the static buffers with padding rows after it, then the graph of the
        next captured size replayed."""
        if not self.can_run(batch):
            raise ValueError("not a decode-only batch within the captured sizes: run it eagerly")
        n = batch.num_seqs
        bs = next(s for s in self.sizes if s >= n)
        self.storage.check_slots(batch.slot_mapping)  # on the host: a CPU tensor, no sync
        views = self.host_views
        views["input_ids"][:n] = batch.input_ids
        views["positions"][:n] = batch.positions
        views["slot_mapping"][:n] = batch.slot_mapping
        views["context_lens"][:n] = batch.context_lens
        views["block_tables"][:n] = 0
        views["block_tables"][:n, : batch.block_tables.shape[1]] = batch.block_tables
        self._pad(n)
        # Pinned memory: queued on the stream before the replay; the host waits for the logits
        # (or the sampler's ids) before the next step, so the host buffer is not rewritten while
        # the copy may still read it.
        self.static.copy_(self.host, non_blocking=True)
        with torch.inference_mode():
            if self.capture:
                self.graphs[bs].replay()
            else:
                self._forward(bs)
        self.replays += 1
        return self.logits[:n].to(
            "cpu" if on_host else self.logits.device, torch.float32, copy=True
        )


def _views(buffer: torch.Tensor, n: int, w: int) -> dict[str, torch.Tensor]:
    """The inputs laid end to end in one flat buffer: four `[n]` vectors, then `[n, w]` tables."""
    names = ("input_ids", "positions", "slot_mapping", "context_lens")
    views = {name: buffer[i * n : (i + 1) * n] for i, name in enumerate(names)}
    views["block_tables"] = buffer[4 * n :].view(n, w)
    return views
