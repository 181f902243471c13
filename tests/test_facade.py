"""Chapter 09's astrai-style facade, `InferenceEngine`: an adapter over the server's AsyncEngine.

`generate` gives the offline engine's text for one prompt or a list, from several threads at once;
`stream=True` gives the same text in pieces; `generate_async` the same on the caller's event loop,
and concurrent callers share the engine's batch; `get_stats` counts what ran; a caller that stops
early frees its blocks; a bad request raises at the call and changes nothing; `shutdown` ends what
runs with EngineDeadError and leaves no thread behind.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from minivllm import InferenceEngine
from minivllm.engine.llm_engine import LLMEngine
from minivllm.sched.sequence import SamplingParams
from minivllm.serving.async_engine import EngineDeadError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["ROMEO:\n", "JULIET:\nO Romeo!", "HAMLET:\n"]
SAMPLED = dict(max_tokens=10, temperature=0.8, seed=5)


@pytest.fixture(scope="module")
def facade(target):
    with InferenceEngine(target) as engine:  # built from a model, with LLM's settings
        yield engine


@pytest.fixture(scope="module")
def offline(target) -> list[str]:
    return [o.text for o in LLMEngine(target).generate(PROMPTS, SamplingParams(**SAMPLED))]


def idle(facade: InferenceEngine, seconds: float = 30) -> dict:
    """The stats once nothing runs (an abort reaches the engine within a step)."""
    deadline = time.monotonic() + seconds
    while (stats := facade.get_stats())["active_requests"] or stats["waiting_requests"]:
        assert time.monotonic() < deadline, "a request is still running"
        time.sleep(0.01)
    return stats


def test_generate_gives_the_offline_engines_text(facade, offline) -> None:
    assert facade.generate(PROMPTS[0], **SAMPLED) == offline[0]
    assert facade.generate(PROMPTS, **SAMPLED) == offline
    assert facade.generate([[256, *b"ROMEO:\n"]], **SAMPLED) == offline[:1]  # token ids
    with ThreadPoolExecutor(3) as pool:  # callers on several threads at once
        assert list(pool.map(lambda p: facade.generate(p, **SAMPLED), PROMPTS)) == offline


def test_stream_pieces_join_to_the_text(facade, offline) -> None:
    pieces = list(facade.generate(PROMPTS[0], stream=True, **SAMPLED))
    assert len(pieces) > 1 and "".join(pieces) == offline[0]
    texts = [""] * len(PROMPTS)
    for index, piece in facade.generate(PROMPTS, stream=True, **SAMPLED):
        texts[index] += piece
    assert texts == offline


def test_generate_async_on_the_callers_loop_shares_the_batch(facade, offline) -> None:
    steps = len(facade.engine.trace())

    async def main():
        whole = await facade.generate_async(PROMPTS[0], **SAMPLED)
        pieces = [p async for p in facade.generate_async(PROMPTS[0], stream=True, **SAMPLED)]
        together = await asyncio.gather(*(facade.generate_async(p, **SAMPLED) for p in PROMPTS))
        return whole, "".join(pieces), together, await facade.generate_async(PROMPTS, **SAMPLED)

    whole, streamed, together, listed = asyncio.run(main())
    assert whole == streamed == offline[0] and together == listed == offline
    assert max(len(r.running) for r in facade.engine.trace()[steps:]) > 1  # batched together


def test_get_stats_counts_and_a_caller_that_stops_early_frees_its_blocks(facade) -> None:
    before = idle(facade)
    assert before["engine_alive"] and before["blocks_used"] == 0
    facade.generate(PROMPTS[:2], max_tokens=4, ignore_eos=True)
    after = facade.get_stats()
    assert after["total_requests"] == before["total_requests"] + 2
    assert after["tokens_generated"] == before["tokens_generated"] + 8
    pieces = facade.generate("ROMEO:\n", stream=True, max_tokens=400, ignore_eos=True)
    next(pieces)
    running = facade.get_stats()
    assert running["active_requests"] == 1 and running["cache_usage"] > 0
    pieces.close()  # a consumer that leaves a loop early
    assert idle(facade)["blocks_used"] == 0

    async def leave_early():
        async for _ in facade.generate_async("ROMEO:\n", stream=True, max_tokens=400):
            break

    asyncio.run(leave_early())
    assert idle(facade)["blocks_used"] == 0 and facade.get_stats()["cache_usage"] == 0


def test_a_bad_request_raises_at_the_call_and_changes_nothing(facade) -> None:
    before = idle(facade)
    with pytest.raises(ValueError, match="exceeds the model's context"):
        facade.generate("x" * 600)
    with pytest.raises(ValueError, match="exceeds the model's context"):
        facade.generate(["ROMEO:", "x" * 600], stream=True)  # at the call, not at the first next
    with pytest.raises(ValueError, match="exceeds the model's context"):
        asyncio.run(facade.generate_async("x" * 600))
    with pytest.raises(TypeError, match="unexpected keyword argument 'temprature'"):
        facade.generate("ROMEO:", temprature=0.5)
    with pytest.raises(ValueError, match="SamplingParams.top_p"):
        facade.generate("ROMEO:", top_p=2.0)
    with pytest.raises(ValueError, match="n must be 1"):
        facade.generate("ROMEO:", n=2)
    with pytest.raises(ValueError, match="no prompts"):
        facade.generate([])
    with pytest.raises(TypeError, match="inside a list"):
        facade.generate([256, 72])
    assert facade.get_stats() == before


def test_shutdown_ends_what_runs_and_leaves_no_thread(target) -> None:
    threads = set(threading.enumerate())
    llm = LLMEngine(target)
    with pytest.raises(TypeError, match="comes configured"):
        InferenceEngine(llm, num_blocks=8)
    engine = InferenceEngine(llm)  # an engine adapted as it is
    pieces = engine.generate("ROMEO:\n", stream=True, max_tokens=400, ignore_eos=True)
    next(pieces)
    engine.shutdown()
    with pytest.raises(EngineDeadError):
        list(pieces)
    with pytest.raises(EngineDeadError):
        engine.generate("ROMEO:")
    with pytest.raises(EngineDeadError):
        engine.generate_async("ROMEO:")
    stats = engine.get_stats()
    assert not stats["engine_alive"] and stats["blocks_used"] == 0
    engine.shutdown()  # again: nothing to do
    assert set(threading.enumerate()) == threads
