"""astrai's front door: `InferenceEngine`, a small facade beside `LLM` (chapter 09).

    engine = InferenceEngine("target")  # or InferenceEngine(LLMEngine(...)), adapted as it is
    engine.generate("ROMEO:\\n", max_tokens=40)  # -> str
    engine.generate(["ROMEO:\\n", "JULIET:\\n"], seed=1)  # -> [str, str], in prompt order
    for piece in engine.generate("ROMEO:\\n", stream=True):  # the text, piece by piece
        print(piece, end="")
    await engine.generate_async("ROMEO:\\n")  # -> str (a list for a list)
    async for piece in engine.generate_async("ROMEO:\\n", stream=True): ...
    engine.get_stats()  # -> the numbers GET /stats answers
    engine.shutdown()  # or leave a `with` block

The keywords are `SamplingParams`' fields (`max_tokens`, `temperature`, `top_p`, `top_k`, `seed`,
`stop`, ...). A list of prompts streams `(index, piece)` pairs, as astrai's does. A prompt is text
(a BOS token goes in front) or, inside a list, token ids.

It is an adapter, not a second engine. `LLM` is for one caller that runs a batch to its end;
this is for callers that come and go -- several threads, coroutines, a notebook -- and all of it
is the server's machinery: ONE `AsyncEngine` whose thread alone touches the `LLMEngine`, so
concurrent calls are batched together step by step, a caller that stops early (a broken loop,
Ctrl-C) aborts its requests and frees their blocks, and `get_stats` reads the engine between two
steps. The AsyncEngine's streams live on an event loop; the synchronous calls use one of the
facade's own, on a thread of its own (a caller's loop may already be running, as a notebook's is),
while `generate_async` runs on the caller's loop. The facade stands beside `LLM` in the package's
surface (`from minivllm import InferenceEngine`), but lives here, next to the AsyncEngine it
adapts: `engine/` may not import upward.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import AsyncIterator, Coroutine, Iterator
from collections.abc import Sequence as SequenceOf
from typing import Any, TypeVar

from minivllm.engine.llm_engine import LLM, LLMEngine
from minivllm.model.transformer import Transformer
from minivllm.sched.sequence import SamplingParams
from minivllm.serving.async_engine import AsyncEngine, EngineDeadError, stats_summary

T = TypeVar("T")
Prompt = str | SequenceOf[int]
Prompts = str | SequenceOf[Prompt]


class InferenceEngine:
    """astrai's `InferenceEngine` surface over minivllm's engine: generate, stream, await, stats,
    shutdown. `model` is a name or directory ("target"), a `Transformer` (both with `LLM`'s keyword
    settings), or an `LLMEngine` to adapt as it is."""

    def __init__(self, model: str | Transformer | LLMEngine = "target", **config: Any) -> None:
        if isinstance(model, LLMEngine):
            if config:
                raise TypeError(f"an LLMEngine comes configured; got settings {sorted(config)}")
            engine, self._owns_engine = model, False
        else:
            engine, self._owns_engine = LLM(model, **config).engine, True
        self.engine = AsyncEngine(engine)
        self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(
            target=self._loop.run_forever, name="minivllm-facade", daemon=True
        )
        self._loop_thread.start()
        self._lock = threading.Lock()  # submissions to the loop vs shutdown
        self._closed = False

    # -- synchronous -------------------------------------------------------------------------------
    def generate(
        self, prompt: Prompts, stream: bool = False, **sampling: Any
    ) -> str | list[str] | Iterator[str] | Iterator[tuple[int, str]]:
        """The text of `prompt` (a str), or of each of a list of prompts (a list of str, in their
        order). With `stream=True` a generator of text pieces (`(index, piece)` for a list) as
        the steps produce them; leaving it early aborts what is still running. Raises the
        engine's ValueError for a bad request (at the call, also when streaming)."""
        prompts, params, many = self._request(prompt, sampling)
        if stream:
            self.engine.call(lambda engine: _check(engine, prompts, params))
            return self._pieces(prompts, params, many)
        texts = self._wait(self._texts(prompts, params))
        return texts if many else texts[0]

    def get_stats(self) -> dict:
        """GET /stats's numbers: active, waiting and total requests, cache usage, tokens generated,
        the blocks; read on the engine thread between two steps."""
        stats = self.engine.call(lambda engine: engine.stats())
        return {**stats_summary(stats), "engine_alive": self.is_alive}

    @property
    def is_alive(self) -> bool:
        return not self._closed and self.engine.is_alive

    def shutdown(self) -> None:
        """Stop: running requests are aborted (their blocks freed) and their callers get
        EngineDeadError; later calls raise it too. Idempotent; also on leaving a `with` block."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.engine.close()  # every open stream now holds EngineDeadError
        asyncio.run_coroutine_threadsafe(_settle(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._loop_thread.join()
        self._loop.close()
        if self._owns_engine:
            self.engine.engine.close()  # its forward workers, if it has any

    def __enter__(self) -> InferenceEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    # -- asynchronous ------------------------------------------------------------------------------
    def generate_async(
        self, prompt: Prompts, stream: bool = False, **sampling: Any
    ) -> Coroutine[Any, Any, str | list[str]] | AsyncIterator[str] | AsyncIterator[tuple[int, str]]:
        """`generate` for asyncio code, on the caller's event loop: `await` it for the text (a list
        for a list), or, with `stream=True`, `async for` over the pieces."""
        prompts, params, many = self._request(prompt, sampling)
        if stream:
            return self._pieces_async(prompts, params, many)
        return self._texts_async(prompts, params, many)

    async def _texts_async(self, prompts, params, many: bool) -> str | list[str]:
        texts = await self._texts(prompts, params)
        return texts if many else texts[0]

    async def _pieces_async(self, prompts, params, many: bool):
        stream = await self.engine.add_request(prompts, params)
        number = {request_id: i for i, request_id in enumerate(stream.request_ids)}
        async with stream:  # leaving early (break, cancel) aborts what still runs
            async for delta in stream:
                if delta.text:
                    yield (number[delta.request_id], delta.text) if many else delta.text

    # -- the plumbing ------------------------------------------------------------------------------
    async def _texts(self, prompts: list[Prompt], params: SamplingParams) -> list[str]:
        """Every prompt's whole text, in order (on whichever loop awaits it)."""
        stream = await self.engine.add_request(prompts, params)
        number = {request_id: i for i, request_id in enumerate(stream.request_ids)}
        texts = [""] * len(prompts)
        async with stream:
            async for delta in stream:
                texts[number[delta.request_id]] += delta.text
        return texts

    def _pieces(self, prompts: list[Prompt], params: SamplingParams, many: bool):
        """The synchronous stream: each delta fetched from the facade's loop."""
        stream = self._wait(self.engine.add_request(prompts, params))
        number = {request_id: i for i, request_id in enumerate(stream.request_ids)}
        try:
            while True:
                try:
                    delta = self._wait(stream.__anext__())
                except StopAsyncIteration:
                    return
                if delta.text:
                    yield (number[delta.request_id], delta.text) if many else delta.text
        finally:  # a consumer that stops early must not leave its requests holding blocks
            with self._lock:
                if not self._closed:
                    self._loop.call_soon_threadsafe(stream.abort)

    def _wait(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run `coroutine` on the facade's loop and wait for it; a caller interrupted while it
        waits (Ctrl-C) cancels it, which aborts its requests."""
        with self._lock:
            if self._closed:
                coroutine.close()
                raise EngineDeadError("the engine was shut down")
            future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()
            raise

    def _request(
        self, prompt: Prompts, sampling: dict
    ) -> tuple[list[Prompt], SamplingParams, bool]:
        """The prompts as a list, the SamplingParams (the engine's defaults -- a checkpoint's
        generation_config.json -- with the keywords given over them; checked: a ValueError or
        TypeError names a bad keyword), and whether a list came in; EngineDeadError after
        `shutdown`."""
        if self._closed:
            raise EngineDeadError("the engine was shut down")
        many = not isinstance(prompt, str)
        prompts = list(prompt) if many else [prompt]
        if not prompts:
            raise ValueError("no prompts: give a str, or a non-empty list of prompts")
        if many and all(isinstance(p, int) for p in prompts):
            raise TypeError("token ids are one prompt: put them inside a list, [[256, 72, ...]]")
        params = dataclasses.replace(self.engine.engine.default_params, **sampling)
        if params.n != 1:
            raise ValueError("generate answers one text per prompt, so n must be 1: use LLM")
        return prompts, params, many


def _check(engine: LLMEngine, prompts: list[Prompt], params: SamplingParams) -> None:
    """The engine's own checks of every prompt, changing nothing (on the engine thread)."""
    for prompt in prompts:
        engine.inputs.process(prompt, params)


async def _settle() -> None:
    """On the facade's loop at shutdown: let every task see its stream's EngineDeadError."""
    tasks = asyncio.all_tasks() - {asyncio.current_task()}
    if tasks:
        await asyncio.wait(tasks, timeout=5)
    for task in tasks:
        task.cancel()
