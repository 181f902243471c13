"""Chapter 09's AsyncEngine, without HTTP: one engine thread, an inbox of functions, per-request
queues.

Streams carry exactly the offline engine's text, in whole characters; a bad request is refused at
the door and leaves the engine as it was; an abort takes effect within one step; a failing engine
ends every stream with EngineDeadError and refuses new work; close() frees every block and leaves no
thread behind.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from minivllm.engine.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.sched.sequence import SamplingParams
from minivllm.serving.async_engine import (
    AsyncEngine,
    EngineDeadError,
    RequestFailedError,
    RequestStream,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = [
    "ROMEO:\n",
    "JULIET:\nO Romeo, Romeo!",
    "HAMLET:\nTo be, or not to be",
    "First Citizen:\n",
]
GREEDY = SamplingParams(max_tokens=12, temperature=0)


@pytest.fixture(scope="module")
def engine(target):
    with AsyncEngine(LLMEngine(target)) as running:
        yield running


async def texts(stream: RequestStream) -> dict[int, tuple[str, tuple[int, ...], str | None]]:
    """Each request's joined text, token ids and finish reason."""
    out = {i: ("", (), None) for i in stream.request_ids}
    async with stream:
        async for delta in stream:
            text, ids, _ = out[delta.request_id]
            out[delta.request_id] = (text + delta.text, ids + delta.token_ids, delta.finish_reason)
    return out


def engine_state(engine: AsyncEngine) -> tuple:
    return engine.call(
        lambda e: (len(e.trace), e.manager.allocator.num_used, e.has_unfinished(), e._next_id)
    )


def test_streams_carry_the_offline_engines_output(engine: AsyncEngine, target) -> None:
    expected = LLMEngine(target).generate(PROMPTS, GREEDY)

    async def main():
        one_by_one = [await engine.add_request(p, GREEDY) for p in PROMPTS]
        together = await engine.add_request(PROMPTS, GREEDY)  # several prompts, one stream
        return await asyncio.gather(*(texts(s) for s in one_by_one)), await texts(together)

    singles, together = asyncio.run(main())
    singles = [next(iter(s.values())) for s in singles]
    for got in (singles, list(together.values())):
        assert got == [(e.text, tuple(e.token_ids), e.finish_reason) for e in expected]
    assert engine.blocks_in_use() == 0


def test_deltas_are_whole_characters(target) -> None:
    text = "aé❤𝄞!"  # 1, 2, 3, 4 and 1 bytes
    forced = list(text.encode("utf-8"))
    llm = LLMEngine(target)
    sequences = llm.scheduler.sequences
    llm.runner.sample = lambda logits, metadata, proposals: {  # the model "says" `text`'s bytes
        i: forced[sequences[i].num_output_tokens] for i in metadata.seq_ids
    }

    async def main():
        stream = await async_engine.add_request(
            "x", SamplingParams(max_tokens=len(forced), ignore_eos=True)
        )
        async with stream:
            return [delta async for delta in stream]

    with AsyncEngine(llm) as async_engine:
        deltas = asyncio.run(main())
    assert [d.text for d in deltas] == ["a", "", "é", "", "", "❤", "", "", "", "𝄞", "!"]
    assert [t for d in deltas for t in d.token_ids] == forced and deltas[
        -1
    ].finish_reason == "length"


def test_a_bad_request_is_refused_and_changes_nothing(engine: AsyncEngine) -> None:
    before = engine_state(engine)
    for prompts in (
        "x" * 600,
        ["ROMEO:", "x" * 600],
    ):  # the second: the good prompt is not added either
        with pytest.raises(ValueError, match="exceeds the model's context"):
            asyncio.run(engine.add_request(prompts, GREEDY))
    with pytest.raises(ValueError, match="2 prompts but 3 SamplingParams"):
        asyncio.run(engine.add_request(["a", "b"], [GREEDY] * 3))
    assert engine_state(engine)[:3] == before[:3]
    assert engine.is_alive


def test_an_abort_takes_effect_within_one_step(engine: AsyncEngine) -> None:
    holding, gate = threading.Event(), threading.Event()

    def hold(_) -> None:
        holding.set()
        gate.wait(30)

    async def main():
        stream = await engine.add_request(
            "ROMEO:\n", SamplingParams(max_tokens=400, ignore_eos=True)
        )
        await anext(stream)  # it is running
        engine.submit(hold)  # hold the engine thread between two steps...
        assert holding.wait(30)
        steps = len(engine.engine.trace)  # (stable: the engine thread is waiting)
        stream.abort()  # ...queue the abort behind that, and let go
        gate.set()
        freed = await engine.acall(
            lambda e: (stream.request_ids[0] in e.scheduler.sequences, e.manager.allocator.num_used)
        )
        return stream.request_ids[0], steps, freed

    request_id, steps, freed = asyncio.run(main())
    assert freed == (False, 0)
    after = [
        r for r in engine.trace()[steps:] if request_id in r.decoded or request_id in r.running
    ]
    assert len(after) <= 1  # at most the step that started before the abort reached the engine


def test_stats_are_read_on_the_engine_thread(engine: AsyncEngine) -> None:
    """GET /stats never reads the engine from the event loop while it steps: the read goes through
    the inbox, between two steps."""
    readers = []
    stats = engine.engine.stats
    engine.engine.stats = lambda: (readers.append(threading.current_thread().name), stats())[1]

    async def main():
        before = await engine.stats()
        (out,) = (await texts(await engine.add_request("ROMEO:\n", GREEDY))).values()
        return before, len(out[1]), await engine.stats()

    try:
        before, generated, after = asyncio.run(main())
    finally:
        del engine.engine.stats
    assert readers == ["minivllm-engine"] * 2
    assert after.num_requests == before.num_requests + 1
    assert after.num_generated_tokens == before.num_generated_tokens + generated > 0


def test_a_failing_engine_ends_every_stream_and_refuses_new_work(target) -> None:
    threads = set(threading.enumerate())
    llm = LLMEngine(target)
    real_step = llm.step

    def step():
        if len(llm.trace) >= 3:
            raise RuntimeError("boom: the forward pass failed")
        return real_step()

    llm.step = step
    async_engine = AsyncEngine(llm)

    async def main():
        stream = await async_engine.add_request(
            PROMPTS, SamplingParams(max_tokens=50, temperature=0)
        )
        with pytest.raises(EngineDeadError, match="boom"):
            await texts(stream)
        with pytest.raises(EngineDeadError, match="boom"):
            await async_engine.add_request("ROMEO:", GREEDY)

    asyncio.run(main())
    assert not async_engine.is_alive and "boom" in str(async_engine.error)
    assert async_engine.trace() and "minivllm:num_requests_running" in asyncio.run(
        async_engine.render_metrics()
    )
    async_engine.close()
    assert set(threading.enumerate()) == threads


def test_close_aborts_what_runs_and_leaves_no_thread(target) -> None:
    threads = set(threading.enumerate())
    async_engine = AsyncEngine(LLMEngine(target, EngineConfig(num_blocks=64)))

    async def main():
        stream = await async_engine.add_request(
            "ROMEO:\n", SamplingParams(max_tokens=400, ignore_eos=True)
        )
        await anext(stream)
        await asyncio.get_running_loop().run_in_executor(None, async_engine.close)
        with pytest.raises(EngineDeadError, match="closed"):
            async for _ in stream:  # what was delivered before the close, then the error
                pass

    asyncio.run(main())
    assert async_engine.blocks_in_use() == 0 and not async_engine.engine.has_unfinished()
    assert set(threading.enumerate()) == threads


def test_a_request_that_fails_while_served_ends_alone(target) -> None:
    """A failure in one request's output (here: its delta, poisoned on purpose) ends that request
    with RequestFailedError; the request beside it, and the engine, go on."""
    llm = LLMEngine(target)
    poison = llm.tokenizer.encode("POISON", add_bos=True)
    make_output = llm.outputs.output

    def output(seq):
        out = make_output(seq)
        if out.prompt_token_ids == poison and out.token_ids:

            def fail():
                raise RuntimeError("a poisoned output")

            out.delta = fail
        return out

    llm.outputs.output = output
    expected = LLMEngine(target).generate(["ROMEO:\n"], GREEDY)[0]

    async def run() -> tuple[dict, BaseException]:
        healthy = await engine.add_request("ROMEO:\n", GREEDY)
        poisoned = await engine.add_request("POISON", GREEDY)
        with pytest.raises(RequestFailedError, match="poisoned") as raised:
            await texts(poisoned)
        return await texts(healthy), raised.value

    with AsyncEngine(llm) as engine:
        got, _ = asyncio.run(run())
        (got,) = got.values()
        assert got == (expected.text, tuple(expected.token_ids), expected.finish_reason)
        assert engine.is_alive and engine.blocks_in_use() == 0
        assert 'minivllm:engine_alive{model_name="target"} 1' in asyncio.run(
            engine.render_metrics()
        )
