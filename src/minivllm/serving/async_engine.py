"""One engine, many clients: the engine on a thread of its own, requests in and text out through
queues (chapter 09).

A web server answers every client from one asyncio event loop. `LLMEngine` is synchronous, its
`step()` computes for milliseconds, and it is not thread-safe. So the two live apart:

* ONE **engine thread** owns the engine and makes every call on it. With nothing to do it sleeps on
  a condition variable (no busy spinning); while any request is unfinished it steps.
* The asyncio side never touches the engine. It puts *functions* in the engine thread's **inbox** --
  "add these requests", "abort those", "read the trace" -- and gets each result back through a
  future. The engine thread runs its whole inbox before every step, so an abort frees its blocks
  before the next forward pass, and a prompt that can never fit fails in `add_request` (a
  ValueError) before any response has started: the server can still answer 400.
* After each step the engine thread takes each request's new text from the step's outputs (the
  engine's `OutputProcessor`: whole UTF-8 characters only, never a piece of a stop string) and hands
  the step's `TextDelta`s to the event loop with ONE `call_soon_threadsafe` per step, not one per
  token: one wake-up of the loop, which puts each delta on the queue of the `RequestStream` that
  waits for it.

Failures are kept as small as their cause. A bad request fails in `add_request`, for its caller
alone. A failure while handing out one request's output (turning it into a delta) ends that request
with the error and the engine steps on. But if `step()` itself raises, the engine's state can no
longer be trusted and the AsyncEngine is **dead**: the cause is logged, every open stream gets an
`EngineDeadError`, so does every new request, the server answers 503, and `on_death` callbacks run
(`minivllm serve` stops and exits non-zero, so a supervisor can restart it, as vLLM V1 does).
An engine thread that is alive but stuck -- one round of work running past `stall_timeout` while
requests wait -- is caught too: `stalled()` says why, and `/health` answers 503 with it.

With `n > 1` one engine request is n samples; each delta names its sample (`index`), and a
stream is done when every sample of every request has finished.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable
from collections.abc import Sequence as SequenceOf
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TypeVar

from minivllm.engine.llm_engine import EngineStats, LLMEngine
from minivllm.engine.processing import RequestOutput, TextDelta
from minivllm.engine.trace import StepRecord, TraceBudget
from minivllm.sched.sequence import SamplingParams
from minivllm.serving.metrics import ServingMetrics

T = TypeVar("T")
logger = logging.getLogger("minivllm.serving")
Choice = tuple[int, int]  # (request id, sample index): one choice of a response


class EngineDeadError(RuntimeError):
    """The engine thread has stopped -- the engine failed, or was closed -- and will run nothing
    more."""


class RequestFailedError(RuntimeError):
    """One request failed while being served; it is ended, and the engine goes on."""


class RequestStream:
    """The asyncio side of one client's request: one or more engine requests (a completion may have
    several prompts) whose `TextDelta`s arrive on one queue, in the order the steps produced them.

        async with stream:                # leaving early -- an error, a cancelled task, a client
        that
            async for delta in stream:    # went away -- aborts every request still running
                ...
    """

    def __init__(self, engine: AsyncEngine) -> None:
        # The engine names its requests (the n samples of one take ids of its own too), so the
        # engine thread fills these in when it adds them, before add_request returns the stream.
        self.request_ids: tuple[int, ...] = ()
        # every choice in the order of the response: prompt by prompt, sample by sample
        self.choices: tuple[Choice, ...] = ()
        # filled in by the engine thread: when it adds them, and before it hands a finish over
        self.num_prompt_tokens: dict[int, int] = {}
        self.stop_reasons: dict[Choice, int | str | None] = {}
        self.prompt_logprobs: dict[int, list] = {}  # per request, when it asked for them
        self.loop = asyncio.get_running_loop()
        self._engine = engine
        self._queue: asyncio.Queue[TextDelta | BaseException] = asyncio.Queue()
        self._unfinished: set[Choice] = set()

    def added(self, request_ids: list[int], num_samples: int) -> None:
        """Called by the engine thread once the requests are in."""
        self.request_ids = tuple(request_ids)
        self.choices = tuple((r, index) for r in request_ids for index in range(num_samples))
        self._unfinished = set(self.choices)

    def put_nowait(self, item: TextDelta | BaseException) -> None:
        """Called on the event loop (see AsyncEngine._hand_over)."""
        self._queue.put_nowait(item)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> TextDelta:
        if not self._unfinished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            # leaving `async with` aborts the stream's other requests (a no-op on a dead engine)
            raise item
        if item.finish_reason is not None:
            self._unfinished.discard(choice_of(item))
        return item

    def abort(self) -> None:
        """Stop whatever is still running; a no-op once every request has finished. Before the
        requests are in (the caller gave up while waiting) the engine thread, which adds them
        first, stops them right after."""
        if self._unfinished or not self.request_ids:
            self._engine.abort_stream(self)
            self._unfinished.clear()

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc_info) -> None:
        self.abort()  # no await in here: it must run to the end even in a task being cancelled


def choice_of(delta: TextDelta) -> Choice:
    return delta.request_id, delta.index


@dataclass
class _Sample:
    """The engine thread's timings of one sample of a request (what its metrics are made of)."""

    scheduled: float | None = None  # when the step that first ran it began
    first_token: float | None = None
    last_output: float | None = None
    finished: bool = False


@dataclass
class _Request:
    """The engine thread's bookkeeping for one unfinished request (all its samples)."""

    stream: RequestStream
    arrival: float  # time.perf_counter() when the client's request reached add_request
    samples: list[_Sample]  # by index: n of them
    seq_ids: tuple[int, ...]  # the samples' sequences, by index (sample 0's is the request's id)

    @property
    def unfinished(self) -> int:
        return sum(not sample.finished for sample in self.samples)


class AsyncEngine:
    """An `LLMEngine` for asyncio code, run by a thread of its own:

    async_engine = AsyncEngine(LLMEngine(load_model("target")))
    stream = await async_engine.add_request("ROMEO:\n", SamplingParams(max_tokens=40))
    async with stream:
        async for delta in stream:
            print(delta.text, end="")
    async_engine.close()
    """

    def __init__(
        self,
        engine: LLMEngine,
        metrics: ServingMetrics | None = None,
        max_trace: int = 100_000,
        max_trace_bytes: int = 64 << 20,
        stall_timeout: float = 60.0,
    ) -> None:
        self.engine = engine
        self.metrics = metrics or ServingMetrics()
        # called on the engine thread, once, with the error, when the engine dies
        self.on_death: list[Callable[[EngineDeadError], object]] = []
        # the step records kept, at most this many and this many bytes (estimated): a server runs
        # for days, and a trace must not grow forever
        self.trace_budget = TraceBudget(max_trace, max_trace_bytes)
        # `stalled()` says so once the engine has had work and made no progress for this long
        self.stall_timeout = stall_timeout
        # when the engine thread began its current round of work (its inbox, then one step), or
        # None while it sleeps with nothing to do; read by other threads (`stalled`)
        self._busy_since: float | None = None
        self.error: EngineDeadError | None = None
        self._inbox: list[tuple[Future, Callable[[LLMEngine], object]]] = []
        self._wakeup = threading.Condition()
        self._closing = False
        self._requests: dict[int, _Request] = {}  # touched by the engine thread only
        # seq id -> (request id, sample index) of every sample of those requests (the trace
        # names sequences; a request's sample 0 has the request's id)
        self._sample_of: dict[int, tuple[int, int]] = {}
        self._num_streams = 0  # streams added so far, to name each one's group (engine thread)
        self._thread = threading.Thread(target=self._run, name="minivllm-engine", daemon=True)
        self._thread.start()

    # -- the asyncio side --------------------------------------------------------------------------
    async def add_request(
        self,
        prompts: str | SequenceOf[str | list[int]],
        params: SamplingParams | SequenceOf[SamplingParams],
    ) -> RequestStream:
        """Queue one prompt (a str) or several (a list; a token-id prompt must be inside a list),
        with one SamplingParams for all or one each. All are added or none: a bad one raises the
        engine's ValueError (or TypeError), saying what to change. Raises EngineDeadError when the
        engine is dead."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(
                f"{len(prompts)} prompts but {len(params)} SamplingParams: give one, or one each"
            )
        if len({p.n for p in params}) != 1:
            raise ValueError(f"the SamplingParams of one stream must share n, got {params}")
        stream, arrival = RequestStream(self), time.perf_counter()
        try:
            await asyncio.wrap_future(
                self.submit(lambda engine: self._add(stream, prompts, params, arrival))
            )
        except asyncio.CancelledError:
            stream.abort()  # the caller gave up while we waited: if its requests got in, stop them
            raise
        return stream

    def abort(self, request_ids: Iterable[int]) -> None:
        """Stop these requests (finished or unknown ones are skipped); their blocks are free before
        the next step. Returns at once: the engine thread does the work."""
        ids = tuple(request_ids)
        self.submit(lambda engine: self._abort(ids))  # a dead engine's refusal is nobody's business

    def abort_stream(self, stream: RequestStream) -> None:
        """Stop every request of `stream` still running (on the engine thread, after any add)."""
        self.submit(lambda engine: self._abort(stream.request_ids))

    def submit(self, fn: Callable[[LLMEngine], T]) -> Future[T]:
        """Run `fn(engine)` on the engine thread, between two steps; its result (or exception) comes
        back in the future. When the engine is dead the future holds the EngineDeadError at once."""
        future: Future[T] = Future()
        with self._wakeup:
            if self.error is not None:
                future.set_exception(self.error)
            else:
                self._inbox.append((future, fn))
                self._wakeup.notify()
        return future

    def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """`fn(engine)` between two steps, waiting for the result: for code outside the event loop
        (a test, a notebook). Once the engine thread has stopped nothing changes the engine: `fn`
        runs here."""
        try:
            return self.submit(fn).result()
        except EngineDeadError:
            return fn(self.engine)

    async def acall(self, fn: Callable[[LLMEngine], T]) -> T:
        """`call` for coroutines: awaits the engine thread instead of blocking the event loop."""
        try:
            return await asyncio.wrap_future(self.submit(fn))
        except EngineDeadError:
            return fn(self.engine)

    def blocks_in_use(self) -> int:
        return self.call(lambda engine: engine.stats().blocks_used)

    def trace(self) -> list[StepRecord]:
        """A copy of the engine's step trace: the latest steps, within `trace_budget`."""
        return self.call(lambda engine: list(engine.trace))

    async def render_metrics(self) -> str:
        return await self.acall(self._render_metrics)

    async def stats(self) -> EngineStats:
        """`LLMEngine.stats()`, read on the engine thread between two steps: one consistent
        snapshot (the event loop never reads the engine while it steps)."""
        return await self.acall(lambda engine: engine.stats())

    @property
    def is_alive(self) -> bool:
        return self.error is None and self._thread.is_alive()

    def stalled(self) -> str | None:
        """Why the engine is stuck, or None. The engine thread works in rounds (its inbox, then one
        step) and sleeps when there is nothing to do; a round that has run for `stall_timeout`
        seconds -- a step or a submitted function that never returns -- means work is waiting
        and nothing moves. Safe to call from any thread: it reads one attribute, never the engine.
        """
        busy_since = self._busy_since
        if busy_since is None or not self.is_alive:
            return None
        stuck = time.monotonic() - busy_since
        if stuck < self.stall_timeout:
            return None
        return (
            f"the engine has made no progress for {stuck:.1f} s (limit {self.stall_timeout:g} s) "
            "while work is waiting"
        )

    def close(self, timeout: float | None = 30) -> None:
        """Stop the engine thread: requests still running are aborted (their blocks freed) and their
        streams end with EngineDeadError. Waits for the step in progress."""
        with self._wakeup:
            self._closing = True
            self._wakeup.notify()
        self._thread.join(timeout)

    def __enter__(self) -> AsyncEngine:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # -- the engine thread -------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._wakeup:
                while not (self._inbox or self._closing or self.engine.has_unfinished()):
                    self._busy_since = None  # idle: nothing waits, so nothing can be stuck
                    self._wakeup.wait()
                self._busy_since = time.monotonic()  # each round is progress (see `stalled`)
                inbox, self._inbox, closing = self._inbox, [], self._closing
            for future, fn in inbox:
                # False: its caller cancelled it while it waited
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn(self.engine))
                    except Exception as error:
                        # The caller's error (a bad request), not the engine's: it goes back to
                        # the caller, and the engine steps on.
                        future.set_exception(error)
            if closing:
                return self._stop(EngineDeadError("the engine was closed"))
            try:
                self._deliver(self._step())  # a failure of one request's output ends it alone
            except Exception as error:
                logger.exception("the engine failed in step(); every request is ended")
                return self._stop(EngineDeadError(f"the engine failed and was stopped: {error!r}"))

    def _step(self) -> list[RequestOutput]:
        engine, before = self.engine, len(self.engine.trace)
        outputs = engine.step()
        now = time.perf_counter()
        for record in engine.trace[before:]:
            self.metrics.preemptions.inc(len(record.preempted))
            for seq_id in record.admitted:
                self._scheduled(seq_id, now - record.step_s)
            for _, proposed, accepted in record.speculated:
                self.metrics.speculated(proposed, accepted)
        self.trace_budget.keep(engine.trace, len(engine.trace) - before)
        return outputs

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Each output's new text to its stream: one hand-over per event loop for the whole step.

        An output that cannot be handed out ends its own request with the error; the others go on.
        """
        now, batches = time.perf_counter(), {}
        for out in outputs:
            request = self._requests.get(out.request_id)
            if request is None:
                continue  # aborted, or not ours
            try:
                item = self._delta(request, out, now)
            except Exception as error:
                logger.exception(
                    "request %s failed while its output was handed out", out.request_id
                )
                self._forget(out.request_id)
                with contextlib.suppress(Exception):
                    self.engine.abort(out.request_id)
                item = RequestFailedError(f"the request failed: {error!r}")
            batches.setdefault(request.stream.loop, []).append((request.stream, item))
        for loop, items in batches.items():
            self._send(loop, items)

    def _delta(self, request: _Request, out: RequestOutput, now: float) -> TextDelta:
        delta = out.delta()
        self._observe(request, out, now)
        if out.prompt_logprobs is not None and out.request_id not in request.stream.prompt_logprobs:
            request.stream.prompt_logprobs[out.request_id] = out.prompt_logprobs
        if delta.finish_reason is not None:
            request.stream.stop_reasons[choice_of(delta)] = out.stop_reason
            request.samples[out.index].finished = True
            if request.unfinished == 0:
                self._forget(out.request_id)
        return delta

    def _send(
        self, loop: asyncio.AbstractEventLoop, items: list[tuple[RequestStream, object]]
    ) -> None:
        try:
            loop.call_soon_threadsafe(_hand_over, items)
        except RuntimeError:  # the loop is closed: nobody will ever read these streams
            self._abort([d.request_id for _, d in items if isinstance(d, TextDelta)])

    def _scheduled(self, seq_id: int, when: float) -> None:
        """The sequence `seq_id` was admitted by the step that began at `when`: the first time, its
        sample's queue time is over."""
        request_id, index = self._sample_of.get(seq_id, (-1, 0))
        request = self._requests.get(request_id)
        if request is not None and request.samples[index].scheduled is None:
            request.samples[index].scheduled = when
            self.metrics.scheduled(when - request.arrival)

    def _observe(self, request: _Request, out: RequestOutput, now: float) -> None:
        """The metrics of one output: every request-level metric counts per sample (see
        metrics.py), so each sample has its own first token, gaps and finish."""
        sample = request.samples[out.index]
        if sample.first_token is None:
            if sample.scheduled is None and request.samples[0].scheduled is not None:
                # a fork is never admitted itself: it waited in its parent's seat, and runs from
                # the parent's prompt on
                sample.scheduled = request.samples[0].scheduled
                self.metrics.scheduled(sample.scheduled - request.arrival)
            prefill = None if sample.scheduled is None else now - sample.scheduled
            self.metrics.first_token(
                now - request.arrival, len(out.prompt_token_ids), out.num_cached_tokens, prefill
            )
            sample.first_token = now
        since_last = None if sample.last_output is None else now - sample.last_output
        self.metrics.tokens(len(out.new_token_ids), since_last)
        sample.last_output = now
        if out.finish_reason is not None:
            self.metrics.finished(
                out.finish_reason,
                now - request.arrival,
                len(out.token_ids),
                now - sample.first_token,
            )

    def _add(
        self, stream: RequestStream, prompts: list, params: list[SamplingParams], arrival: float
    ) -> None:
        added: dict[int, int] = {}  # request id -> prompt tokens
        # One group for every prompt and sample of this client request: the scheduler admits
        # groups in turns, so a small request is not queued behind all of a big one. A tuple
        # never equals a lone request's group (its int request id).
        self._num_streams += 1
        group = ("stream", self._num_streams)
        try:
            for prompt, p in zip(prompts, params):
                request = self.engine.inputs.process(prompt, p)  # checked once, here
                added[self.engine.add_request(request, group=group)] = len(request.prompt_ids)
        except Exception:
            # All or none: one error for the client, no half-started answer.
            for request_id in added:
                self.engine.abort(request_id)
            raise
        stream.num_prompt_tokens.update(added)
        n = params[0].n
        stream.added(list(added), n)
        for request_id in added:
            seq_ids = self.engine.groups.get(request_id, (request_id,))
            samples = [_Sample() for _ in range(n)]
            self._requests[request_id] = _Request(stream, arrival, samples, seq_ids)
            self._sample_of.update({seq_id: (request_id, i) for i, seq_id in enumerate(seq_ids)})

    def _forget(self, request_id: int) -> _Request | None:
        """Stop tracking a request (finished, aborted or failed); its bookkeeping, if it had any."""
        request = self._requests.pop(request_id, None)
        if request is not None:
            for seq_id in request.seq_ids:
                self._sample_of.pop(seq_id, None)
        return request

    def _abort(self, request_ids: Iterable[int]) -> None:
        now = time.perf_counter()
        for request_id in request_ids:
            request = self._forget(request_id)
            if request is not None:
                self.engine.abort(request_id)
                for _ in range(request.unfinished):  # one abort per sample still running
                    self.metrics.finished("abort", now - request.arrival)

    def _stop(self, error: EngineDeadError) -> None:
        """No more steps: fail what waits in the inbox, end every open stream with `error`, tell
        whoever watches (`on_death`)."""
        with self._wakeup:
            self.error = error
            inbox, self._inbox = self._inbox, []
        self.metrics.engine_alive.set(0)
        for future, _ in inbox:
            if future.set_running_or_notify_cancel():
                future.set_exception(error)
        requests, self._requests, self._sample_of = self._requests, {}, {}
        with contextlib.suppress(Exception):  # give the blocks back; a failed engine may refuse
            for request_id in requests:
                self.engine.abort(request_id)
        for stream in {r.stream for r in requests.values()}:
            self._send(stream.loop, [(stream, error)])
        for callback in self.on_death:
            try:
                callback(error)
            except Exception:
                logger.exception("an on_death callback failed")

    def _render_metrics(self, engine: LLMEngine) -> str:
        # samples, the metrics' unit: a sequence whose forks wait for its prompt seats them too
        scheduler = engine.scheduler
        running, waiting = (
            sum(1 + len(s.forks) for s in q) for q in (scheduler.running, scheduler.waiting)
        )
        self.metrics.engine_state(running, waiting, engine.stats().kv_cache_usage)
        return self.metrics.render()


def stats_summary(stats: EngineStats) -> dict:
    """The engine's stats under astrai's names (GET /stats, `InferenceEngine.get_stats()`), with
    the block counts beside. A request's n samples are n active requests, as in vLLM V1."""
    return {
        "active_requests": stats.num_running,
        "waiting_requests": stats.num_waiting,
        "total_requests": stats.num_requests,
        "cache_usage": stats.kv_cache_usage,
        "tokens_generated": stats.num_generated_tokens,
        "num_blocks": stats.num_blocks,
        "blocks_used": stats.blocks_used,
        "peak_blocks_used": stats.peak_blocks_used,
    }


def _hand_over(items: list[tuple[RequestStream, TextDelta | BaseException]]) -> None:
    """On the event loop: one step's deltas onto their streams' queues."""
    for stream, item in items:
        stream.put_nowait(item)
