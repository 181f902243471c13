"""Forward workers: one forward pass shared by processes, one core each (chapter 11).

At batch 64 a decode step of the target model is some 200 small operations: 25 matmuls of a few
million multiply-adds, six attention calls, and elementwise work on 64 x 256 floats. Two threads
inside each of them hardly pay on a small machine: every operation that splits its work wakes the
other core and waits for it at the end. On the 2-core virtual machine this was written on, a
one-sequence pass, with nothing worth splitting, took about 20 % longer on two threads than on one
(some 30 µs per operation that splits), and the batch-64 step hardly gained from the second thread
(chapter 11 measures it live). The other way to use a second core is coarser: give it whole
sequences. Attention keeps sequences apart, and every other layer works row by row, so the batch
splits between sequences into parts that need nothing from each other; each part runs the whole
model on a core of its own, with one thread, and meets the others once per step, when the logits
come back. This is data parallelism inside a step, over one scheduler, one block manager and one
K/V pool -- the pool and the weights live in shared memory, so every process reads and writes the
same blocks.

`ForwardWorkers(model, storage, backend, processes)` starts `processes - 1` worker processes
and runs the first part itself. `forward(batch)` has `run_model`'s contract: the logits of the
batch's sampling rows, in order. The parts are cut where the work -- each sequence's new tokens
times (the keys they see + the matmuls' share) -- is even, and the cut is a pure function of the
batch. A row's logits are what a one-thread pass over its part gives: a matmul's rounding depends
on its number of rows, so they can move in the last bits with the cut, as they do in any engine
from one step's batch to the next (greedy tokens change only at a near-tie; the tests compare
tokens against a one-process engine).

The workers start and talk as tensor parallelism's ranks do (`runner/tensor_parallel.py`), on the
same launcher (`runner/launcher.py`): spawned processes that join a gloo group on 127.0.0.1 -- a
group of their own, so that an engine with forward workers can stand beside a tensor-parallel one
in a process. Each step, rank 0 broadcasts the parts (one pickled object, as tensor parallelism
broadcasts its batch), each process runs its own, and each worker sends its logits back. The group
carries only these messages: the weights and the K/V pool live in shared memory, mapped by every
process, and a worker writes its sequences' K/V into the same blocks the engine's block manager
handed out.

A worker whose part fails sends its error back, the step raises it and the workers serve on; a
worker that dies or stops answering ends the workers, naming it, and the step raises
`RuntimeError`. `close()` stops the workers (also when the object is garbage-collected), none is
left behind.

`benchmarks/tensor_parallel.py` measures this split against tensor parallelism on a 2-core CPU
(results/tensor_parallel*.json): on the shipped target model and on a real-shaped one (`--shape
100m`) this one is the faster of the two -- one exchange per step against two all-reduces per
layer -- which is why it is kept beside it; tensor parallelism is what goes past one machine's
memory.
"""

from __future__ import annotations

import os
import time
import warnings
import weakref

import numpy as np
import torch

from minivllm.attention.backend import BackendFactory, get_backend, warm_up_backend
from minivllm.attention.batch import VarlenBatch, split_sequences
from minivllm.attention.storage import PagedKVStorage
from minivllm.model.fused import pack_weights
from minivllm.model.transformer import ModelConfig, Transformer
from minivllm.runner.batch import run_model
from minivllm.runner.launcher import Launched, Messages, batch_fields, batch_of, join_group
from minivllm.runner.threads import torch_threads

# A reply's first two numbers, before the logits: the length of the error the worker sends next (0:
# none), and its part's forward time in seconds.
HEADER = 2
# A sequence's cost, for cutting the batch, is counted in keys attended: a new token's matmuls
# weigh their multiply-adds' worth of keys, over ATTENTION_SLOWDOWN -- on a CPU the kernel's
# multiply-adds run slower than the matmuls' (a least-squares fit of one-thread forward times over
# the parts of the throughput workload gave 1.8 for the target model).
ATTENTION_SLOWDOWN = 2


def matmul_keys_per_token(config: ModelConfig) -> float:
    """What a new token's matmuls cost, in keys attended: a layer's weights (one multiply-add per
    weight per token) over a key's multiply-adds (q.k and p.v for each query head), over the
    attention's slowdown."""
    weights = config.d_model * (config.n_heads + 2 * config.n_kv_heads) * config.head_dim
    weights += config.n_heads * config.head_dim * config.d_model + 3 * config.d_model * config.d_ff
    return weights / (2 * config.n_heads * config.head_dim) / ATTENTION_SLOWDOWN


def balanced_bounds(query_lens: np.ndarray, context_lens: np.ndarray, parts: int, per_token: float):
    """Cut sequences (in order) into at most `parts` runs of about equal cost. A sequence's cost
    is, per new token, the keys that token sees (its chunk is causal: the last token sees the
    whole context, the first one `query_len - 1` fewer) plus `per_token`. Each cut goes at the
    sequence boundary nearest its share of the total; a prefill chunk is never cut in two (its
    later tokens attend to its earlier ones, layer by layer). Returns the bounds, 0 .. n."""
    cost = query_lens * (context_lens - (query_lens - 1) / 2 + per_token)
    done = np.concatenate([[0.0], np.cumsum(cost)])  # done[k]: the cost of sequences before k
    bounds = [0]
    for share in done[-1] * np.arange(1, parts) / parts:
        after = int(np.searchsorted(done, share))  # the first boundary at or past the share
        cut = after if done[after] - share <= share - done[after - 1] else after - 1
        if bounds[-1] < cut < len(cost):
            bounds.append(cut)
    return bounds + [len(cost)]


def _serve(
    rank: int,
    model: Transformer,
    storage: PagedKVStorage,
    backend: str,
    world: int,
    timeout_s: float,
    init_method: str,
    ready,
) -> None:
    """A worker's life (the launcher's entry point): one thread, the backend warmed up, then the
    group's steps -- run part `rank`, send back its logits or its error -- until rank 0 says stop
    (None)."""
    torch.set_num_threads(1)
    factory = get_backend(backend)
    warm_up_backend(factory, threads=1, dtype=storage.dtype)
    pack_weights(model)  # this process's own packed copies (the cache is per process)
    ready()
    messages = join_group(rank, world, init_method, timeout_s, default_group=False)
    try:
        while (parts := messages.broadcast(idle=True)) is not None:
            if rank < len(parts):  # a batch of fewer sequences than processes leaves some idle
                _answer(messages, model, storage, batch_of(parts[rank]), factory)
    finally:
        messages.close()


def _answer(
    messages: Messages,
    model: Transformer,
    storage: PagedKVStorage,
    part: VarlenBatch,
    factory: BackendFactory,
) -> None:
    """Run one part, and send rank 0 its logits behind a header -- or, where it failed, the header
    and zeros of the same size (rank 0 waits for that many numbers), then the error."""
    rows, vocab = len(part.logits_indices), model.config.vocab_size
    reply = torch.zeros(HEADER + rows * vocab)
    error = b""
    try:
        started = time.perf_counter()
        logits = run_model(model, storage, part, factory)
        reply[HEADER:] = logits.reshape(-1)
        reply[1] = time.perf_counter() - started
    except Exception as failure:  # sent back: the step that asked raises it
        error = f"{type(failure).__name__}: {failure}".encode()
        reply[0] = len(error)
    messages.send(reply, to=0)
    if error:
        messages.send(torch.frombuffer(bytearray(error), dtype=torch.uint8), to=0)


def warn_if_threads_spin() -> bool:
    """Warn (and say so) when torch's idle OpenMP threads in this process may spin: torch loaded
    before minivllm could set OMP_WAIT_POLICY=PASSIVE, or it was set otherwise. After each
    parallel op a spinning thread busy-waits on the core a forward worker computes on."""
    if os.environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE":
        return False
    warnings.warn(
        "OMP_WAIT_POLICY is not PASSIVE: torch's idle threads in this process spin on the core a "
        "forward worker needs, and can make the split slower than no split. Import minivllm "
        "before torch, or export OMP_WAIT_POLICY=PASSIVE (the Makefile does).",
        stacklevel=3,
    )
    return True


class ForwardWorkers:
    """`processes` processes sharing each forward pass: this one and `processes - 1` workers."""

    def __init__(
        self,
        model: Transformer,
        storage: PagedKVStorage,
        backend: str,
        processes: int,
        main_backend: BackendFactory | None = None,
        timeout_s: float = 300.0,
    ) -> None:
        """`backend`: the attention backend's name, for the workers; `main_backend`: the factory
        this process runs its part on (default: the named one), warmed up for one thread here;
        `timeout_s`: how long a step waits for a worker's logits before it gives up."""
        if processes < 2:
            raise ValueError(f"ForwardWorkers needs 2 processes or more, got {processes}")
        if storage.kv.device.type != "cpu":
            raise ValueError(
                f"forward_processes > 1 is for a CPU engine: forward workers share a cache in "
                f"CPU memory, not on {storage.kv.device}"
            )
        warn_if_threads_spin()
        self.model, self.storage, self.processes = model, storage, processes
        self.per_token = matmul_keys_per_token(model.config)
        self.part_seconds: list[float] = []  # the last pass: each part's forward time, in order
        # The weights and the K/V pool move to shared memory (in place: the engine keeps using
        # the same tensors), and the workers map them instead of copying.
        model.share_memory()
        storage.kv.share_memory_()
        # this process's part runs on one thread too
        warm_up_backend(main_backend or get_backend(backend), threads=1, dtype=storage.dtype)
        self._ranks = Launched("forward worker")
        self._finalizer = weakref.finalize(self, self._ranks.stop)
        try:
            args = (model, storage, backend, processes, timeout_s)
            init_method = self._ranks.start(_serve, args, processes, threads=1)
            self._ranks.wait_ready()
            self._ranks.messages = join_group(
                0, processes, init_method, timeout_s, default_group=False
            )
        except BaseException:
            self._ranks.healthy = False  # nobody waits for a step: stop the workers at once
            self.close()
            raise

    def _message(self, send_or_receive, *args):
        """One of the step's messages; a worker that died or stopped answering ends them all."""
        try:
            return send_or_receive(*args)
        except RuntimeError as error:
            why = self._ranks.failure(error)
            self.close()
            raise RuntimeError(
                f"the forward workers failed: {why}; they are stopped, build a new engine to go on"
            ) from error
        except BaseException:  # Ctrl-C inside a message: the workers are out of step
            self._ranks.healthy = False
            self.close()
            raise

    def _receive(self, index: int, rows: int) -> tuple[str, object, float]:
        """Worker `index`'s reply to a part of `rows` sampling rows."""
        vocab = self.model.config.vocab_size
        reply = torch.empty(HEADER + rows * vocab)
        self._message(self._ranks.messages.receive, reply, index)
        error_bytes, seconds = int(reply[0]), float(reply[1])
        if error_bytes:
            error = torch.empty(error_bytes, dtype=torch.uint8)
            self._message(self._ranks.messages.receive, error, index)
            return "error", error.numpy().tobytes().decode(), seconds
        return "logits", reply[HEADER:].view(rows, vocab), seconds

    def forward(self, batch: VarlenBatch, backend: BackendFactory) -> torch.Tensor:
        """`run_model(model, storage, batch, backend)`, the batch's sequences split between the
        processes (`backend` runs this process's part; the workers run theirs on the backend
        named when they started): the logits of its sampling rows, `[S, vocab]`, in order."""
        if self._ranks.messages is None or not self._ranks.healthy:
            raise RuntimeError("the forward workers were closed (or one failed before)")
        query_lens = batch.query_start.diff().numpy()
        bounds = balanced_bounds(
            query_lens, batch.context_lens.numpy(), self.processes, self.per_token
        )
        parts = split_sequences(batch, bounds)
        # every process gets the parts, each runs its own: the workers first (none when the
        # batch is one sequence) ...
        if len(parts) > 1:
            self._message(self._ranks.messages.broadcast, [batch_fields(p) for p in parts])
        try:
            with torch_threads(1):  # ... and this process runs its own on one thread, as they do
                started = time.perf_counter()
                logits = [run_model(self.model, self.storage, parts[0], backend)]
                self.part_seconds = [time.perf_counter() - started]
        finally:
            # every sent part is answered, even when this process's part failed
            replies = [
                self._receive(i, len(part.logits_indices)) for i, part in enumerate(parts[1:], 1)
            ]
        for index, (kind, value, seconds) in enumerate(replies, 1):
            if kind == "error":
                raise RuntimeError(f"forward worker {index} failed: {value}")
            logits.append(value)
            self.part_seconds.append(seconds)
        return torch.cat(logits)

    def close(self) -> None:
        """Stop the workers (idempotent)."""
        self._finalizer()

    @property
    def pids(self) -> list[int]:
        """The worker processes' ids (benchmarks add up their CPU time)."""
        return self._ranks.pids

    @property
    def alive(self) -> bool:
        return self._ranks.alive
