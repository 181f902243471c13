"""Tensor-parallel ranks: one model split across processes (`model/parallel.py`), driven by rank 0.

The scheduler, the block manager and the sampler run once, in the engine's process, which is rank
0. Every step, rank 0 sends the step's batch -- token ids, positions, slots, block tables: the
`VarlenBatch` the model runner built, and the copy-on-write copies to make first -- to the other
ranks in ONE broadcast (a pickled object: `torch.distributed.broadcast_object_list`), then every
rank runs the same forward pass over its own heads and its own K/V pool, the ranks meeting in the
layers' all-reduces, and the logits are gathered on rank 0. The block tables are the same on
every rank: block b holds the same tokens' K/V everywhere, each rank its own heads of it.

    rank 0 (the engine)                         rank r > 0 (`serve_rank`)
    schedule, build the batch
    broadcast (batch, copies)  ---------------> receive
    forward over its shard                      forward over its shard
      all-reduce x 2 per layer  <-------------->  all-reduce x 2 per layer
    gather logits              <---------------  send its vocabulary's logits
    sample, update, detokenize                  wait for the next step

Launch. `TensorParallelGroup(source, settings)` spawns ranks 1 .. W-1 as processes on this machine
with the launcher forward workers use too (`runner/launcher.py`: the spawn start method, a
rendezvous on 127.0.0.1 at a free port), each loading its own shard of the weights -- from the
checkpoint folder, reading only its slices, or sliced from a model in this process's memory, shared
with them -- and building its own K/V pool; gloo carries the collectives on a CPU, NCCL on GPUs
(rank r on `cuda:r`; the per-step batch then goes over a gloo group beside it), with the same code.

The same ranks can come from `torchrun`, on one machine or several: every process then runs the
same command, and the engine's constructor on a rank other than 0 becomes that rank's worker loop
(`serve_rank`) and exits the process when rank 0 closes; rank 0 goes on as the engine. E.g.

    torchrun --nproc-per-node 2 -m minivllm.cli generate "ROMEO:" --tensor-parallel-size 2
    torchrun --nnodes 2 --node-rank N --nproc-per-node 8 --master-addr HOST --master-port 29500 \\
        -m minivllm.cli serve --model DIR --tensor-parallel-size 16

(`WORLD_SIZE` must equal the tensor-parallel size; torchrun sets `RANK`, `MASTER_ADDR` and
`MASTER_PORT`, read through `init_method="env://"`).

Failure. A rank that dies, or fails, or does not answer within `settings.timeout_s`, makes rank
0's next collective fail; the step then raises `RuntimeError` naming the rank and its exit code
(and the exception it died of), and the group is closed: every rank process is stopped (killed if
it will not stop), none is left behind. A rank waiting for the next step waits as long as the
engine is idle. A worker whose parent process is gone exits by itself, and ignores Ctrl-C, which
the engine's process handles: `close()` (also on garbage collection and at exit) stops them all.
"""

from __future__ import annotations

import os
import time
import weakref
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

from minivllm.attention.backend import get_backend, warm_up_backend
from minivllm.attention.batch import VarlenBatch
from minivllm.attention.storage import PagedKVStorage
from minivllm.model.checkpoint import load_model
from minivllm.model.fused import fuse_model, pack_weights
from minivllm.model.parallel import Shard, local_config, shard_from_model
from minivllm.model.transformer import Transformer
from minivllm.runner.launcher import Launched, batch_fields, batch_of, join_group
from minivllm.runner.threads import torch_threads


@dataclass(frozen=True)
class WeightsSource:
    """Where a rank gets its shard: a checkpoint folder (each rank reads only its slices), or a
    whole model in memory (shared with spawned ranks, each copies its slices)."""

    folder: str | None = None
    dtype: torch.dtype | None = None
    model: Transformer | None = None

    @classmethod
    def of(cls, model: Transformer) -> WeightsSource:
        """A model with weights is sliced as it is; one on the meta device (`load_model(...,
        weights=False)`) is read from its checkpoint folder by each rank."""
        param = next(model.parameters())
        if param.device.type == "meta":
            folder = getattr(model, "checkpoint_folder", None)
            if folder is None:
                raise ValueError("a model on the meta device needs its checkpoint_folder")
            return cls(folder=str(folder), dtype=param.dtype)
        return cls(model=model)

    def load(self, shard: Shard, device: str) -> Transformer:
        if self.model is not None:
            return shard_from_model(self.model, shard).to(device)
        return load_model(Path(self.folder), self.dtype, shard=shard).to(device)


@dataclass(frozen=True)
class RankSettings:
    """What every rank builds: its K/V pool, its attention backend, its threads."""

    world: int
    num_blocks: int
    block_size: int
    cache_dtype: torch.dtype
    device: str  # "cpu" or "cuda" (rank r on cuda:r)
    backend: str  # the attention backend's registered name
    fuse: bool = True  # q/k/v and gate/up as one matmul each (model/fused.py)
    threads: int = 1  # torch threads per rank on a CPU
    timeout_s: float = 300.0  # a collective that waits longer fails the step


@dataclass
class RankState:
    """One rank's part of the engine: its model shard, its K/V pool, its attention backend."""

    model: Transformer
    storage: PagedKVStorage
    backend: object
    device: torch.device
    rank: int

    @classmethod
    def build(cls, source: WeightsSource, settings: RankSettings, rank: int) -> RankState:
        device = torch.device(f"cuda:{rank}" if settings.device == "cuda" else "cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        shard = Shard(rank, settings.world)
        model = source.load(shard, str(device))
        if settings.fuse:
            model = fuse_model(model, in_place=True)
            pack_weights(model, release=True)  # as the engine does; the shard is this rank's alone
        backend = get_backend(settings.backend)
        storage = PagedKVStorage(
            local_config(model.config, shard),
            settings.num_blocks,
            settings.block_size,
            settings.cache_dtype,
            device,
            heads_outer=getattr(backend, "heads_outer", False),
        )
        warm_up_backend(backend, threads=settings.threads, dtype=storage.dtype)
        return cls(model, storage, backend, device, rank)

    def step(self, batch: VarlenBatch, copies: list[tuple[int, int]]) -> torch.Tensor | None:
        """Copy-on-write first, then this rank's forward pass over the whole batch: on rank 0 the
        logits of the batch's sampling rows, `[S, vocab]`, on the CPU (`run_model`'s contract);
        None on the other ranks."""
        for src, dst in copies:
            self.storage.copy_block(src, dst)
        batch = replace(batch, slots_checked=True).to(self.device)  # rank 0 checked them
        with torch.inference_mode():
            attention = self.backend(self.storage, batch)
            # the sampling rows only past the last layer's attention, on every rank alike: a
            # prefill's other rows are neither computed nor gathered
            rows = batch.logits_indices
            logits = self.model(batch.input_ids, batch.positions, attention, rows=rows)
        return logits.to("cpu", torch.float32, copy=True) if self.rank == 0 else None


def serve_rank(
    rank: int,
    settings: RankSettings,
    source: WeightsSource,
    init_method: str = "env://",
    ready=None,
) -> None:
    """A rank's life, ranks 1 .. W-1 (the launcher's entry point; `torchrun` reaches it through the
    engine's constructor): load its shard, say it is `ready` (spawned ranks), join the group, then
    run every step rank 0 broadcasts until it broadcasts None."""
    torch.set_num_threads(settings.threads)
    state = RankState.build(source, settings, rank)
    if ready is not None:
        ready()
    messages = join_group(rank, settings.world, init_method, settings.timeout_s, settings.device)
    try:
        while (message := messages.broadcast(idle=True)) is not None:
            fields, copies = message
            state.step(batch_of(fields), copies)
    finally:
        messages.close()


def launched_by_torchrun(world: int) -> int | None:
    """This process's rank when `torchrun` started `world` ranks (RANK and WORLD_SIZE set), else
    None; a WORLD_SIZE other than `world` is an error."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    if int(os.environ["WORLD_SIZE"]) != world:
        raise ValueError(
            f"torchrun started {os.environ['WORLD_SIZE']} processes but tensor_parallel_size is "
            f"{world}: give --nproc-per-node x --nnodes = the tensor-parallel size"
        )
    return int(os.environ["RANK"])


class QueuedCopies:
    """Rank 0's K/V storage as the model runner sees it: a block copy (copy-on-write) is queued and
    travels to every rank with the next step's batch, so all ranks copy their share of the block;
    everything else is this rank's own storage."""

    def __init__(self, group: TensorParallelGroup) -> None:
        self._group = group

    def copy_block(self, src: int, dst: int) -> None:
        self._group.pending_copies.append((src, dst))

    def __getattr__(self, name: str):
        return getattr(self._group.storage, name)


class TensorParallelGroup:
    """Rank 0 of a tensor-parallel engine: the other ranks' processes, this rank's shard and K/V
    pool (`model`, `storage`), and `forward(batch)` with `run_model`'s contract."""

    def __init__(self, source: WeightsSource, settings: RankSettings) -> None:
        if settings.world < 2:
            raise ValueError(f"a tensor-parallel group needs 2 ranks or more, got {settings.world}")
        self.settings = settings
        self.broadcast_s = 0.0  # time spent sending batches (rank 0's side), for the benchmark
        # copy-on-write copies the runner asked for, made on every rank before the next step
        self.pending_copies: list[tuple[int, int]] = []
        self._ranks = Launched("tensor-parallel rank")
        self._finalizer = weakref.finalize(self, self._ranks.stop)
        rank = launched_by_torchrun(settings.world)
        if rank is not None and rank != 0:  # torchrun: this process is a worker, not the engine
            serve_rank(rank, settings, source)
            raise SystemExit(0)
        if dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is already initialised in this process: one tensor-parallel "
                "engine per process (close the other first)"
            )
        try:
            if rank is None:
                if source.model is not None:  # shared, not pickled: the ranks map its memory
                    source.model.share_memory()
                args = (settings, source)
                init_method = self._ranks.start(serve_rank, args, settings.world, settings.threads)
            else:
                init_method = "env://"
            self.state = RankState.build(source, settings, 0)
            self._ranks.wait_ready()
            self._ranks.messages = join_group(
                0, settings.world, init_method, settings.timeout_s, settings.device
            )
        except BaseException:
            self._ranks.healthy = False  # nobody waits for a step: stop the ranks at once
            self.close()
            raise

    @property
    def model(self) -> Transformer:
        return self.state.model

    @property
    def storage(self) -> PagedKVStorage:
        return self.state.storage

    @property
    def pids(self) -> list[int]:
        """The spawned ranks' process ids (none under torchrun)."""
        return self._ranks.pids

    @property
    def alive(self) -> bool:
        return self._ranks.alive

    def forward(
        self, batch: VarlenBatch, copies: list[tuple[int, int]] | None = None
    ) -> torch.Tensor:
        """One step on every rank: the batch (and the block copies to make first: `copies`, else
        those `queued_storage` collected) broadcast once, then this rank's forward; the logits of
        the batch's sampling rows, `[S, vocab]`."""
        if copies is None:
            copies, self.pending_copies = self.pending_copies, []
        if self._ranks.messages is None or not self._ranks.healthy:
            raise RuntimeError("the tensor-parallel ranks were closed (or one failed before)")
        self.state.storage.check_slots(batch.slot_mapping)  # a bad batch never reaches the ranks
        with torch_threads(self.settings.threads):
            try:
                started = time.perf_counter()
                self._ranks.messages.broadcast((batch_fields(batch), list(copies)))
                self.broadcast_s += time.perf_counter() - started
                return self.state.step(batch, list(copies))
            except RuntimeError as error:  # a collective failed: a rank died or timed out
                raise self._failed(error) from error
            except BaseException:  # Ctrl-C mid-step: the ranks are out of step, stop them all
                self._ranks.healthy = False
                self.close()
                raise

    def _failed(self, error: RuntimeError) -> RuntimeError:
        why = self._ranks.failure(error)
        self.close()
        return RuntimeError(
            f"tensor parallelism failed: {why}; the engine's ranks are stopped, build a new "
            "engine to go on"
        )

    def close(self) -> None:
        """Stop every rank (idempotent; also on garbage collection and at exit)."""
        self._finalizer()
