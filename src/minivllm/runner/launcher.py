"""Spawned processes joined by a torch.distributed process group: the one launcher that tensor
parallelism (`runner/tensor_parallel.py`) and forward workers (`runner/workers.py`) share
(chapter 11).

Rank 0 is the engine's process; `Launched(what).start(entry, args, world, threads)` spawns ranks
1 .. W-1 (the spawn start method: a fresh interpreter, no threads inherited from this one), each
with `threads` threads for OpenMP, MKL and numba. A rank builds what it needs (its model shard, a
warmed-up attention backend), says so on its pipe -- or sends back why it could not -- and joins
the group (`join_group`: gloo over 127.0.0.1 on a CPU). From then on rank 0 talks to the ranks
only through the group (`Messages`): one pickled object broadcast per step, tensors sent back.

Failure. A rank that dies, fails or stops answering makes rank 0's next message fail; `failure`
says which rank and why (its exit code, or the exception it sent on its pipe before it died), and
`stop()` ends every rank: joined, else terminated, else killed -- none is left behind. A rank
whose parent is gone exits by itself (a watchdog thread), and it ignores Ctrl-C, which the
engine's process handles. A rank waiting for the next step waits as long as the engine is idle:
only a step's own messages time out.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from minivllm.attention.batch import VarlenBatch

READY = "ready"
LOOPBACK = "lo0" if sys.platform == "darwin" else "lo"  # the loopback interface's name
START_TIMEOUT_S = 180.0  # a rank imports torch and numba and loads its shard: slow on a busy CPU
# How long a rank waits for the next step: an engine may sit idle for days (a server at night);
# its ranks end with it all the same (their parent watch, or the group's sockets closing).
IDLE_WAIT = datetime.timedelta(days=365)
# A step's message goes in one broadcast of this many bytes when it fits (a 64-sequence decode
# step's batch pickles to some 10 KB); the rest of a longer one follows in a second.
FIRST_BYTES = 1 << 16


@contextlib.contextmanager
def children_threads(threads: int = 1):
    """Processes started inside inherit an environment of `threads` threads for OpenMP, MKL and
    numba (read by each library as it loads): a rank never starts a thread pool it would not use."""
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


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def batch_fields(batch: VarlenBatch) -> dict:
    """A batch for a message: its tensors as numpy arrays (pickled as bytes; a torch tensor would
    go through a fresh shared-memory segment every step), its plain fields as they are."""
    return {
        name: value.numpy() if isinstance(value, torch.Tensor) else value
        for name, value in vars(batch).items()
    }


def batch_of(fields: dict) -> VarlenBatch:
    return VarlenBatch(
        **{k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in fields.items()}
    )


class Messages:
    """Rank 0's per-step messages over a gloo group, in CPU tensors: a pickled object broadcast
    to every rank, and tensors sent between two ranks. Any failure -- a rank gone, a step's
    message not answered within the group's timeout -- raises RuntimeError."""

    def __init__(self, group, rank: int, default_group: bool) -> None:
        self.group, self.rank, self.default_group = group, rank, default_group

    def broadcast(self, message=None, idle: bool = False):
        """Rank 0 sends `message`, every other rank returns it. `idle`: a rank waiting for the
        next step, which waits as long as it takes. One broadcast of FIRST_BYTES -- the pickle's
        length, then its first bytes -- and a second for the rest of a longer one: a receiver
        must know a message's size before it arrives, and a step's message is small."""
        options = dist.BroadcastOptions()
        options.rootRank, options.rootTensor = 0, 0
        if idle:
            options.timeout = IDLE_WAIT
        first = torch.zeros(FIRST_BYTES, dtype=torch.uint8)
        if self.rank == 0:
            payload = pickle.dumps(message)
            head = len(payload).to_bytes(8, "little") + payload[: FIRST_BYTES - 8]
            first[: len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
        self.group.broadcast([first], options).wait()
        options.timeout = dist.BroadcastOptions().timeout  # the group's own timeout
        size = int.from_bytes(first[:8].numpy().tobytes(), "little")
        rest = torch.empty(max(size - (FIRST_BYTES - 8), 0), dtype=torch.uint8)
        if self.rank == 0:
            if len(rest):
                rest = torch.frombuffer(bytearray(payload[FIRST_BYTES - 8 :]), dtype=torch.uint8)
                self.group.broadcast([rest], options).wait()
            return message
        if len(rest):
            self.group.broadcast([rest], options).wait()
        return pickle.loads(first[8 : 8 + size].numpy().tobytes() + rest.numpy().tobytes())

    def send(self, tensor: torch.Tensor, to: int) -> None:
        self.group.send([tensor], to, 0).wait()

    def receive(self, into: torch.Tensor, source: int) -> torch.Tensor:
        self.group.recv([into], source, 0).wait()
        return into

    def close(self) -> None:
        """Leave the group (its sockets close: a rank still waiting sees the engine gone)."""
        if self.default_group:
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        self.group = None


@contextlib.contextmanager
def _loopback(init_method: str):
    """Ranks meeting on 127.0.0.1 talk over the loopback interface (gloo would otherwise pick the
    interface the host name resolves to, which a machine without a network may not have), unless
    GLOO_SOCKET_IFNAME says otherwise."""
    loopback = init_method.startswith("tcp://127.0.0.1:") and "GLOO_SOCKET_IFNAME" not in os.environ
    if loopback:
        os.environ["GLOO_SOCKET_IFNAME"] = LOOPBACK
    try:
        yield
    finally:
        if loopback:
            del os.environ["GLOO_SOCKET_IFNAME"]


def join_group(
    rank: int,
    world: int,
    init_method: str,
    timeout_s: float,
    device: str = "cpu",
    default_group: bool = True,
) -> Messages:
    """Join the ranks' group; its messages. `default_group`: the process's default group (what
    `dist.all_reduce` uses without a group: tensor parallelism's layers), NCCL on GPUs (the
    messages then go over a gloo group beside it); otherwise a gloo group of its own (forward
    workers: an engine beside them may hold the default group)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    with _loopback(init_method):
        if default_group:
            dist.init_process_group(
                "nccl" if device == "cuda" else "gloo",
                init_method=init_method,
                rank=rank,
                world_size=world,
                timeout=timeout,
            )
            group = dist.new_group(backend="gloo") if device == "cuda" else dist.group.WORLD
        else:
            store, _, _ = next(dist.rendezvous(init_method, rank, world, timeout=timeout))
            group = dist.ProcessGroupGloo(store, rank, world, timeout)
    return Messages(group, rank, default_group)


def _watch_parent(parent: int) -> None:
    """Exit this process when its parent is gone (a spawned rank must never outlive the engine:
    SIGKILL on the engine closes nothing)."""

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os._exit(3)

    threading.Thread(target=watch, name="minivllm-parent-watch", daemon=True).start()


def _spawned(entry: Callable, rank: int, args: tuple, conn: Connection, parent: int) -> None:
    """A spawned rank's life: `entry(rank, *args, ready=...)`, which calls `ready()` once built and
    returns when rank 0 says stop. An exception goes back on the pipe before the process ends."""
    _watch_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the engine's to handle
    try:
        entry(rank, *args, ready=lambda: conn.send((READY, None, None)))
    except BaseException as error:
        with contextlib.suppress(OSError, ValueError):
            conn.send(("error", f"{type(error).__name__}: {error}", traceback.format_exc()))
        raise


class Launched:
    """Rank 0's side of the spawned ranks: their processes and pipes, and the group's messages
    once this process has joined (`messages`). Named `what` in errors ("forward worker 1")."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.workers: list = []
        self.conns: list[Connection] = []
        self.messages: Messages | None = None
        self.healthy = True

    def start(self, entry: Callable, args: tuple, world: int, threads: int = 1) -> str:
        """Spawn ranks 1 .. world-1 running `entry`; the group's address, for `join_group`."""
        init_method = f"tcp://127.0.0.1:{free_port()}"
        context = mp.get_context("spawn")
        with children_threads(threads):
            for rank in range(1, world):
                mine, theirs = context.Pipe()
                worker = context.Process(
                    target=_spawned,
                    args=(entry, rank, (*args, init_method), theirs, os.getpid()),
                    name=f"minivllm-{self.what.replace(' ', '-')}-{rank}",
                    daemon=True,
                )
                worker.start()
                theirs.close()
                self.workers.append(worker)
                self.conns.append(mine)
        return init_method

    def wait_ready(self) -> None:
        """Every spawned rank is built (or the start fails, saying which and why)."""
        deadline = time.monotonic() + START_TIMEOUT_S
        for index, (worker, conn) in enumerate(zip(self.workers, self.conns)):
            name = f"{self.what} {index + 1}"
            while not conn.poll(0.2):
                if not worker.is_alive():
                    raise RuntimeError(f"{name} died while starting (exit code {worker.exitcode})")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{name} did not start in {START_TIMEOUT_S:.0f} s")
            try:
                kind, _, detail = conn.recv()
            except (EOFError, OSError):
                kind, detail = "error", f"exit code {worker.exitcode}"
            if kind != READY:
                raise RuntimeError(f"{name} failed to start: {detail}")

    def failure(self, error: Exception) -> str:
        """Why a step's message failed: the ranks that died (exit code, and the exception each
        sent back, if any), else the error itself (a rank that stopped answering)."""
        self.healthy = False
        time.sleep(0.2)  # let a dying rank's exit code settle
        dead = []
        for index, (worker, conn) in enumerate(zip(self.workers, self.conns)):
            if worker.is_alive():
                continue
            why = ""
            with contextlib.suppress(EOFError, OSError, ValueError):
                if conn.poll():
                    why = f": {conn.recv()[1]}"
            dead.append(f"{self.what} {index + 1} (exit code {worker.exitcode}) died{why}")
        return "; ".join(dead) if dead else f"a rank failed or timed out ({error})"

    @property
    def pids(self) -> list[int]:
        return [worker.pid for worker in self.workers]

    @property
    def alive(self) -> bool:
        return self.healthy and all(w.is_alive() for w in self.workers)

    def stop(self) -> None:
        """Tell the ranks to stop (when they are waiting for a step), leave the group, and make
        sure every process has ended: joined, else terminated, else killed. Idempotent."""
        if self.messages is not None:
            if self.healthy:
                with contextlib.suppress(Exception):
                    self.messages.broadcast(None)
            self.messages.close()
            self.messages = None
        for worker in self.workers:
            worker.join(timeout=5 if self.healthy else 0.5)
            if worker.is_alive():
                worker.terminate()
                worker.join(timeout=2)
            if worker.is_alive():
                worker.kill()
                worker.join(timeout=2)
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.close()
        self.healthy = False
