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
come back. This is data
parallelism inside a step, over one scheduler, one block manager and one K/V pool -- the pool and
the weights live in shared memory, so every process reads and writes the same blocks.

`ForwardWorkers(model, storage, backend, processes)` starts `processes - 1` worker processes
(spawned: a fresh interpreter, no threads inherited from this one) and runs the first part itself.
`forward(batch)` has `run_model`'s contract: the logits of the batch's sampling rows, in order.
The parts are cut where the work -- each sequence's new tokens times (the keys they see + the
matmuls' share) -- is even, and the cut is a pure function of the batch. A row's logits are what a
one-thread pass over its part gives: a matmul's rounding depends on its number of rows, so they
can move in the last bits with the cut, as they do in any engine from one step's batch to the next
(greedy tokens change only at a near-tie; the tests compare tokens against a one-process engine).

A worker that fails sends its error back and the step raises it; a worker that dies makes the step
raise `RuntimeError`. `close()` stops the workers (also when the object is garbage-collected).

Beside it stands tensor parallelism (`runner/tensor_parallel.py`, `EngineConfig.
tensor_parallel_size`), which splits each layer by heads rather than the batch by sequences, and is
what goes past one machine's memory. This split is kept apart from it, not rebuilt on its process
group: `benchmarks/tensor_parallel.py` measures both on a shared 2-core CPU
(results/tensor_parallel*.json). On the shipped target model they reach about the same tokens/s,
this one in fewer CPU seconds (one exchange per step against two all-reduces per layer); on a
real-shaped model (`--shape 100m`) tensor parallelism keeps up with one process and this split
falls behind. Neither beats one process on torch's threads there, so neither replaces it.
"""

from __future__ import annotations

import contextlib
import os
import time
import warnings
import weakref
from multiprocessing.connection import Connection

import numpy as np
import torch
import torch.multiprocessing as mp

from minivllm.attention.backend import BackendFactory, get_backend, warm_up_backend
from minivllm.attention.batch import VarlenBatch, split_sequences
from minivllm.attention.storage import PagedKVStorage
from minivllm.model.transformer import ModelConfig, Transformer
from minivllm.runner.batch import run_model

# A worker's first message, once it has imported everything and compiled (or loaded) its kernel.
_READY = "ready"
# Seconds to wait for a worker to start (a fresh interpreter imports torch and numba: seconds on a
# slow machine) before the engine gives up with an error.
START_TIMEOUT_S = 120.0
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


def _packed(batch: VarlenBatch) -> dict:
    """A part for the pipe: its tensors as numpy arrays (pickled as bytes; a torch tensor would
    go through a fresh shared-memory segment every step), its plain fields as they are."""
    return {
        name: value.numpy() if isinstance(value, torch.Tensor) else value
        for name, value in vars(batch).items()
    }


def _unpacked(fields: dict) -> VarlenBatch:
    return VarlenBatch(
        **{k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in fields.items()}
    )


def _serve(conn: Connection, model: Transformer, storage: PagedKVStorage, backend: str) -> None:
    """A worker's life: one thread, the backend warmed up, then parts in and logits out until the
    pipe closes or says stop (None)."""
    torch.set_num_threads(1)
    factory = get_backend(backend)
    warm_up_backend(factory, threads=1)
    conn.send(_READY)
    while True:
        try:
            fields = conn.recv()
        except (EOFError, OSError):  # the engine has gone
            return
        if fields is None:
            return
        try:
            started = time.perf_counter()
            logits = run_model(model, storage, _unpacked(fields), factory).numpy()
            conn.send(("logits", logits, time.perf_counter() - started))
        except Exception as error:  # sent back: the step that asked raises it
            conn.send(("error", f"{type(error).__name__}: {error}"))


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


@contextlib.contextmanager
def children_threads(threads: int = 1):
    """Processes started inside inherit an environment of `threads` threads for OpenMP, MKL and
    numba (read by each library as it loads): a forward worker gets one, and never starts a thread
    pool it would not use."""
    names = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")
    saved = {name: os.environ.get(name) for name in names}
    os.environ.update(dict.fromkeys(names, str(threads)))
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name)
            else:
                os.environ[name] = value


def _stop(conns: list[Connection], processes: list) -> None:
    for conn in conns:
        try:
            conn.send(None)
            conn.close()
        except (OSError, ValueError):
            pass
    for process in processes:
        process.join(timeout=5)
        if process.is_alive():
            process.kill()


class ForwardWorkers:
    """`processes` processes sharing each forward pass: this one and `processes - 1` workers."""

    def __init__(
        self,
        model: Transformer,
        storage: PagedKVStorage,
        backend: str,
        processes: int,
        main_backend: BackendFactory | None = None,
    ) -> None:
        """`backend`: the attention backend's name, for the workers; `main_backend`: the factory
        this process runs its part on (default: the named one), warmed up for one thread here."""
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
        warm_up_backend(main_backend or get_backend(backend), threads=1)
        context = mp.get_context("spawn")
        self._conns: list[Connection] = []
        self._workers = []
        with children_threads():
            for index in range(processes - 1):
                mine, theirs = context.Pipe()
                worker = context.Process(
                    target=_serve,
                    args=(theirs, model, storage, backend),
                    name=f"minivllm-forward-{index + 1}",
                    daemon=True,
                )
                worker.start()
                theirs.close()
                self._conns.append(mine)
                self._workers.append(worker)
        self._finalizer = weakref.finalize(self, _stop, self._conns, self._workers)
        for index, conn in enumerate(self._conns):
            if not conn.poll(START_TIMEOUT_S) or self._receive(index) != _READY:
                self.close()
                raise RuntimeError(f"forward worker {index + 1} did not start")

    def _died(self, index: int) -> RuntimeError:
        code = self._workers[index].exitcode
        return RuntimeError(f"forward worker {index + 1} died (exit code {code})")

    def _send(self, index: int, message) -> None:
        try:
            self._conns[index].send(message)
        except OSError as error:  # the pipe's other end is gone
            raise self._died(index) from error

    def _receive(self, index: int):
        try:
            return self._conns[index].recv()
        except (EOFError, OSError) as error:
            raise self._died(index) from error

    def forward(self, batch: VarlenBatch, backend: BackendFactory) -> torch.Tensor:
        """`run_model(model, storage, batch, backend)`, the batch's sequences split between the
        processes (`backend` runs this process's part; the workers run theirs on the backend
        named when they started): the logits of its sampling rows, `[S, vocab]`, in order."""
        if self._finalizer.alive is False:
            raise RuntimeError("the forward workers were closed")
        query_lens = batch.query_start.diff().numpy()
        bounds = balanced_bounds(
            query_lens, batch.context_lens.numpy(), self.processes, self.per_token
        )
        parts = split_sequences(batch, bounds)
        for index, part in enumerate(parts[1:]):  # the workers' parts go first ...
            self._send(index, _packed(part))
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # ... and this process runs its own on one thread, as they do
        try:
            started = time.perf_counter()
            logits = [run_model(self.model, self.storage, parts[0], backend)]
            self.part_seconds = [time.perf_counter() - started]
        finally:
            torch.set_num_threads(threads)
            # every sent part is answered, even when this process's part failed
            replies = [self._receive(i) for i in range(len(parts) - 1)]
        for index, (kind, *value) in enumerate(replies):
            if kind == "error":
                raise RuntimeError(f"forward worker {index + 1} failed: {value[0]}")
            logits.append(torch.from_numpy(value[0]))
            self.part_seconds.append(value[1])
        return torch.cat(logits)

    def close(self) -> None:
        """Stop the workers (idempotent)."""
        self._finalizer()

    @property
    def pids(self) -> list[int]:
        """The worker processes' ids (benchmarks add up their CPU time)."""
        return [worker.pid for worker in self._workers]

    @property
    def alive(self) -> bool:
        return self._finalizer.alive and all(w.is_alive() for w in self._workers)
