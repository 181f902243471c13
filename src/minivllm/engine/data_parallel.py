"""Data parallelism: whole engine replicas, one per core, that never meet (issue 32, chapter 11).

On a CPU a decode step of a small model is mostly fixed costs -- a few hundred small operations,
each dispatched, most of them too small to split -- and a second core is hard to use inside one:
* threads inside each operation pay a wake-up per operation. On the book's 2-core virtual machine
  (an AMD EPYC Zen 4) an idle vCPU halts at once (the guest's `haltpoll` idles with
  `guest_halt_poll_ns` 0) and waking it is slow: the attention kernel of one batch-64 decode layer
  took 404 us on two sleeping threads, 407 us on one and 245 us on two spinning ones. The
  engine's decode passes run torch on one thread for that reason (`runner/threads.py`);
* forward workers (`runner/workers.py`) split each step's batch between processes. The halves meet
  every step, and each still pays the whole step's fixed costs: on vllm_peer's workload each
  half-batch pass took 14-15 ms (medians) against 15.8 ms for the whole batch in one process.

Replicas split the *requests* instead. Each is a whole `LLMEngine` -- its own scheduler, block
manager, K/V pool and batch of up to `max_num_seqs` sequences -- on its own share of the threads,
and runs its own steps without waiting for the other: nothing is exchanged per step, only requests
going in and outputs coming back. It is vLLM's `data_parallel_size`, and what a fleet does with
machines; on one machine it turns cores into throughput where a single engine cannot. What it
does not do is make one request faster: a request's step is one replica's step.

`DataParallelEngine(model, config)` with `config.data_parallel_size = N` runs replica 0 in this
process and replicas 1 .. N-1 in spawned processes (the launcher forward workers and tensor
parallelism use, `runner/launcher.py`), each with `torch.get_num_threads() // N` threads (at least
one). `add_request` sends a request to the replica with the least work outstanding (prompt and
output tokens it may still compute, a pure function of the requests added and finished so far);
`step` runs one step of replica 0 and gathers what the others have sent meanwhile. Request ids
are the engine's, assigned as `LLMEngine` assigns them, and a request's seed comes from its id
(`SamplingParams.seed`, else the engine seed and the id): a request's tokens do not depend on the
replica it ran on, only, as in any engine, on float32 rounding at a near-tie when its batch
changes.

Each replica holds its own copy of the weights and its own K/V cache of the config's size: N
replicas hold N times a single engine's memory, as vLLM's data-parallel ranks do. A replica that
fails sends its error back, or dies and its pipe closes: the next `step` raises `RuntimeError`
naming it, every replica is stopped, and a new engine must be built. A request goes wherever
there is least work, never to a replica that has room now: the split is decided as requests
arrive, so a replica that runs out of requests early idles while another finishes (`generate`
with every request added at once balances them by their token counts).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Hashable
from dataclasses import replace
from multiprocessing.connection import Connection, wait

import torch

from minivllm.engine.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine, checked_request_id
from minivllm.engine.processing import RequestOutput
from minivllm.model.tokenizer import Tokenizer
from minivllm.model.transformer import Transformer
from minivllm.runner.launcher import Launched
from minivllm.runner.threads import torch_threads
from minivllm.sched.sequence import SamplingParams


def _serve_replica(
    rank: int,
    model: Transformer,
    config: EngineConfig,
    tokenizer: Tokenizer | None,
    default_params: SamplingParams | None,
    pipes: list[Connection],
    init_method: str,
    ready,
) -> None:
    """A spawned replica's life (the launcher's entry point; it joins no process group, so
    `init_method` goes unused): build its engine, then step while it has work and read its pipe,
    `pipes[rank - 1]` -- waiting on it while idle -- until told to stop."""
    conn = pipes[rank - 1]
    engine = LLMEngine(model, config, tokenizer, default_params, own_model=True)
    ready()
    final_only = False
    while True:
        if not engine.has_unfinished() or conn.poll():
            while True:  # every message waiting, before the next step
                message = conn.recv()
                if message[0] == "stop":
                    engine.close()
                    return
                final_only = _handle(engine, conn, message, final_only)
                if not conn.poll():
                    break
        if engine.has_unfinished():
            try:
                outputs = engine.step(final_only=final_only)
            except Exception as error:  # sent back: the caller's next step raises it
                conn.send(("failed", f"{type(error).__name__}: {error}"))
                raise
            if outputs:
                conn.send(("outputs", outputs))


def _handle(engine: LLMEngine, conn: Connection, message: tuple, final_only: bool) -> bool:
    """One message to a replica: a request, an abort (answered at once) or the outputs wanted.
    Returns whether only finished requests' outputs are sent now."""
    kind = message[0]
    if kind == "add":
        _, request, request_id, group = message
        engine.add_request(request, None, request_id, group)
    elif kind == "abort":
        try:
            conn.send(("aborted", message[1], engine.abort(message[1])))
        except KeyError as error:
            conn.send(("not_aborted", message[1], str(error)))
    elif kind == "final_only":
        final_only = message[1]
    return final_only


def _stop(conns: list[Connection], replicas: Launched) -> None:
    """Tell every spawned replica to stop, and make sure each has ended (`Launched.stop`)."""
    for conn in conns:
        with contextlib.suppress(OSError, ValueError):
            conn.send(("stop",))
    replicas.stop()


class DataParallelEngine:
    """`config.data_parallel_size` engine replicas behind `LLMEngine`'s request API
    (`add_request`, `step`, `abort`, `has_unfinished`, `generate`, `stream`, `close`)."""

    def __init__(
        self,
        model: Transformer,
        config: EngineConfig,
        tokenizer: Tokenizer | None = None,
        default_params: SamplingParams | None = None,
        *,
        own_model: bool = False,
    ) -> None:
        """As `LLMEngine`'s arguments. The spawned replicas start first (each loads its copy of
        `model` and builds its engine, seconds each), then replica 0 here -- which, with
        `own_model`, may fuse `model` in place."""
        size = config.data_parallel_size
        if size < 2:
            raise ValueError(f"DataParallelEngine needs data_parallel_size >= 2, got {size}")
        self.threads = max(1, torch.get_num_threads() // size)
        replica = replace(config, data_parallel_size=1)
        self._replicas = Launched("data-parallel replica")
        self.conns: list[Connection] = []
        # the spawned replicas stop with the engine, also when it is garbage-collected unclosed
        self._finalizer = weakref.finalize(self, _stop, self.conns, self._replicas)
        try:
            context = torch.multiprocessing.get_context("spawn")
            pipes = [context.Pipe() for _ in range(size - 1)]
            self.conns.extend(mine for mine, _ in pipes)  # the list the finalizer holds
            theirs = [end for _, end in pipes]  # replica r reads theirs[r - 1]
            args = (model, replica, tokenizer, default_params, theirs)
            self._replicas.start(_serve_replica, args, size, threads=self.threads)
            for end in theirs:
                end.close()
            self._replicas.wait_ready()
            with torch_threads(self.threads):
                self.local = LLMEngine(
                    model, replica, tokenizer, default_params, own_model=own_model
                )
        except BaseException:
            self.close()
            raise
        self.config = replace(self.local.config, data_parallel_size=size)
        self.tokenizer, self.default_params = self.local.tokenizer, self.local.default_params
        self.inputs = self.local.inputs
        # request id -> (replica, the seq ids its samples hold there, its outstanding cost)
        self.requests: dict[int, tuple[int, range, int]] = {}
        self.groups: dict[int, tuple[int, ...]] = {}  # as LLMEngine's: requests with n > 1
        self.load = [0] * size  # each replica's outstanding tokens
        self._next_ids = [0] * size  # each replica's LLMEngine._next_id, mirrored
        self._next_id = 0
        self._done_samples: dict[int, set[int]] = {}  # request id -> its finished samples
        self._pending: list[RequestOutput] = []  # outputs read while waiting for an abort
        self._final_only = False
        self._failed: str | None = None

    @property
    def size(self) -> int:
        return len(self.load)

    # -- requests ----------------------------------------------------------------------------------
    def add_request(
        self,
        prompt,
        params: SamplingParams | None = None,
        request_id: int | None = None,
        group: Hashable | None = None,
    ) -> int:
        """`LLMEngine.add_request`: checked here (a bad request raises, nothing is sent), then
        queued on the replica with the least outstanding work."""
        self._check_alive()
        request = self.inputs.process(prompt, params)
        request_id = checked_request_id(self._next_id if request_id is None else request_id)
        n = request.params.n
        replica = min(range(self.size), key=lambda r: (self.load[r], r))
        # the seq ids its samples take there, as that replica's LLMEngine picks them
        first_sibling = max(self._next_ids[replica], request_id + 1)
        seq_ids = range(first_sibling, first_sibling + n - 1)
        taken = {request_id, *seq_ids}
        if any(i == r or i in s for i in taken for r, (_, s, _) in self.requests.items()):
            raise ValueError(f"request id {request_id} is already in use by an unfinished request")
        max_tokens = request.params.max_tokens
        if max_tokens is None:
            max_tokens = self.config.max_model_len - len(request.prompt_ids)
        cost = (len(request.prompt_ids) + max_tokens) * n
        if replica == 0:
            self.local.add_request(request, None, request_id, group)
        else:
            self._send(replica, ("add", request, request_id, group))
        self.requests[request_id] = (replica, seq_ids, cost)
        self.load[replica] += cost
        if n > 1:
            self.groups[request_id] = (request_id, *seq_ids)
        self._next_ids[replica] = first_sibling + n - 1
        self._next_id = max(self._next_id, request_id + 1) + n - 1
        return request_id

    def abort(self, request_id: int) -> RequestOutput:
        """`LLMEngine.abort`, on the replica that holds the request (a spawned one answers
        within its step)."""
        self._check_alive()
        if request_id not in self.requests:
            raise KeyError(f"request {request_id} is not running: unknown or finished")
        replica = self.requests[request_id][0]
        if replica == 0:
            output = self.local.abort(request_id)
        else:
            self._send(replica, ("abort", request_id))
            output = self._await_abort(replica, request_id)
        self._finished(request_id)
        self._pending = [o for o in self._pending if o.request_id != request_id]
        return output

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def step(self, final_only: bool = False) -> list[RequestOutput]:
        """One step of replica 0 (on its share of the threads), and the outputs the spawned
        replicas sent meanwhile. With nothing for replica 0 to do, it waits for theirs.

        The spawned replicas step on their own and learn `final_only` from these calls: one that
        stepped before it heard that every output is wanted sends those steps' tokens in its
        next output (`new_token_ids` holds every token since a request's last output)."""
        self._check_alive()
        if final_only != self._final_only:
            self._final_only = final_only
            for replica in range(1, self.size):
                self._send(replica, ("final_only", final_only))
        outputs, self._pending = self._pending, []
        if self.local.has_unfinished():
            with torch_threads(self.threads):
                outputs += self.local.step(final_only)
        elsewhere = any(self.load[1:])  # a spawned replica holds requests (each costs > 0)
        idle = not self.local.has_unfinished()
        outputs += self._receive(block=elsewhere and idle and not outputs)
        kept = []
        for output in outputs:
            if output.request_id not in self.requests:
                continue  # aborted while its output was on its way
            kept.append(output)
            if output.finished:
                self._sample_finished(output)
        return kept

    generate = LLMEngine.generate
    stream = LLMEngine.stream
    _add_all = LLMEngine._add_all

    def _is_running(self, request_id: int) -> bool:
        return request_id in self.requests

    def describe_capacity(self) -> str:
        """`LLMEngine.describe_capacity` of one replica, and how many there are."""
        one = self.local.describe_capacity()
        return f"{self.size} data-parallel replicas, each with its own {one}"

    def close(self) -> None:
        """Stop the spawned replicas; idempotent."""
        self._finalizer()

    def __enter__(self) -> DataParallelEngine:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # -- bookkeeping -------------------------------------------------------------------------------
    def _sample_finished(self, output: RequestOutput) -> None:
        """A finished sample: its request ends with its last one."""
        done = self._done_samples.setdefault(output.request_id, set())
        done.add(output.index)
        if len(done) == len(self.requests[output.request_id][1]) + 1:
            self._finished(output.request_id)

    def _finished(self, request_id: int) -> None:
        replica, _, cost = self.requests.pop(request_id)
        self.load[replica] -= cost
        self.groups.pop(request_id, None)
        self._done_samples.pop(request_id, None)

    def _send(self, replica: int, message: tuple) -> None:
        try:
            self.conns[replica - 1].send(message)
        except (OSError, ValueError) as error:
            self._fail(f"replica {replica} is gone ({error})")

    def _receive(self, block: bool) -> list[RequestOutput]:
        """Every message the spawned replicas have sent; with `block`, wait for one first."""
        outputs = []
        ready = wait(self.conns, timeout=None if block else 0)
        for conn in ready:
            while True:
                outputs += self._read(conn)
                if not conn.poll():
                    break
        return outputs

    def _read(self, conn: Connection) -> list[RequestOutput]:
        """The outputs in a spawned replica's next message (`_message`)."""
        replica = self.conns.index(conn) + 1
        message = self._message(replica)
        if message[0] != "outputs":
            raise RuntimeError(f"unexpected message from replica {replica}: {message[0]!r}")
        return message[1]

    def _await_abort(self, replica: int, request_id: int) -> RequestOutput:
        """The abort's answer from `replica`; outputs sent before it wait for the next step."""
        while True:
            message = self._message(replica)
            if message[0] == "outputs":
                self._pending += message[1]
            elif message[1] == request_id and message[0] == "aborted":
                return message[2]
            elif message[1] == request_id and message[0] == "not_aborted":
                raise KeyError(message[2])

    def _message(self, replica: int) -> tuple:
        """`replica`'s next message; one saying it failed, or a closed pipe (it died), stops
        the engine and raises."""
        try:
            message = self.conns[replica - 1].recv()
        except (EOFError, OSError):
            self._fail(self._replicas.failure(RuntimeError(f"replica {replica} closed its pipe")))
        if message[0] == "failed":
            self._fail(f"replica {replica} failed: {message[1]}")
        return message

    def _fail(self, why: str):
        self._failed = why
        self.close()
        raise RuntimeError(f"the data-parallel engine stopped: {why}")

    def _check_alive(self) -> None:
        if self._failed is not None:
            raise RuntimeError(
                f"the data-parallel engine stopped earlier ({self._failed}): build a new one"
            )
