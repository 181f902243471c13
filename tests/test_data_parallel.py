"""Data parallelism (engine/data_parallel.py): whole engine replicas, one in this process and one
spawned, behind LLMEngine's request API.

Against one engine: the same greedy and seeded tokens (n > 1 samples too), the outputs in the
prompts' order, and requests spread over both replicas by outstanding work. Then the request API
on either replica: streaming outputs, an abort, a refused request that leaves nothing behind; and
a replica that dies is a clear error with no process left.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest
from test_tensor_parallel import alive  # whether a process has not ended

from minivllm import LLM, EngineConfig, LLMEngine, SamplingParams, SchedulerConfig
from minivllm.engine.data_parallel import DataParallelEngine

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["ROMEO:\n", "JULIET:\nO", "To be, or not to be", "KING HENRY:\n", "What light", "Ay"]


def config(size: int) -> EngineConfig:
    scheduler = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64)
    return EngineConfig(
        num_blocks=96, scheduler=scheduler, device="cpu", data_parallel_size=size, seed=5
    )


@pytest.fixture(scope="module")
def replicas(target):
    with DataParallelEngine(target, config(2)) as engine:
        yield engine


def test_replicas_give_the_tokens_of_one_engine_in_the_prompts_order(target, replicas) -> None:
    alone = LLMEngine(target, config(1))
    for params in [
        SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, ignore_eos=True),  # seeded by id
        SamplingParams(max_tokens=10, temperature=0.8, seed=3, n=3),
    ]:
        expected = alone.generate(PROMPTS, params)
        got = replicas.generate(PROMPTS, params)
        assert [o.request_id for o in got] == [o.request_id for o in expected]
        assert [o.text for o in got] == [o.text for o in expected]
        assert [[s.token_ids for s in o.outputs] for o in got] == [
            [s.token_ids for s in o.outputs] for o in expected
        ]
    assert not replicas.has_unfinished() and replicas.load == [0, 0]


def test_requests_go_to_the_replica_with_the_least_outstanding_work(replicas) -> None:
    long, short = SamplingParams(max_tokens=200), SamplingParams(max_tokens=5)
    first = replicas.add_request("ROMEO:", long)
    second, third = replicas.add_request("JULIET:", short), replicas.add_request("KING:", short)
    placed = {i: replicas.requests[i][0] for i in (first, second, third)}
    assert placed == {first: 0, second: 1, third: 1}  # the long one outweighs two short ones
    assert replicas.load[0] == len(replicas.inputs.process("ROMEO:", long).prompt_ids) + 200
    finished = set()
    while replicas.has_unfinished():
        finished |= {o.request_id for o in replicas.step(final_only=True) if o.finished}
    assert finished == {first, second, third} and replicas.load == [0, 0]


def test_vllm_peer_gives_vllms_ranks_the_requests_the_engine_gives_its_replicas(replicas) -> None:
    """benchmarks/vllm_peer.py splits the workload between vLLM's data-parallel ranks by the
    engine's own rule, so both systems' replicas run the same requests."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from vllm_peer import data_parallel_split

    lengths = [(3 + 7 * i % 23, 2 + 11 * i % 17) for i in range(30)]  # (prompt, output) tokens
    prompts = [[65 + (i % 26)] * prompt for i, (prompt, _) in enumerate(lengths)]
    ids = [
        replicas.add_request(prompt, SamplingParams(max_tokens=out, ignore_eos=True))
        for prompt, (_, out) in zip(prompts, lengths)
    ]
    placed = [[i for i in ids if replicas.requests[i][0] == r] for r in range(2)]
    while replicas.has_unfinished():
        replicas.step(final_only=True)
    requests = [{"prompt_ids": p, "max_tokens": out} for p, (_, out) in zip(prompts, lengths)]
    assert data_parallel_split(requests, 2) == [[ids.index(i) for i in share] for share in placed]


def test_streaming_outputs_come_from_both_replicas_step_by_step(replicas) -> None:
    # a step tells the replicas what it wants (every output, not final_only) before they have
    # requests: a replica that hears of it only after a step of its own sends that step's tokens
    # in its next output's new_token_ids (the stream test below, right after a final_only
    # generate, covers that case)
    replicas.step()
    ids = [replicas.add_request(p, SamplingParams(max_tokens=6, ignore_eos=True)) for p in PROMPTS]
    assert {replicas.requests[i][0] for i in ids} == {0, 1}
    tokens, outputs = {i: [] for i in ids}, {i: 0 for i in ids}
    while replicas.has_unfinished():
        for output in replicas.step():
            tokens[output.request_id] += output.new_token_ids
            outputs[output.request_id] += 1
    assert {len(t) for t in tokens.values()} == {6}  # every token came back,
    assert set(outputs.values()) == {6}  # each in an output of its own step


def test_streams_from_replicas_are_the_generated_text_and_a_stream_left_early_aborts(replicas):
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    texts = {}
    for delta in replicas.stream(PROMPTS, params):
        texts[delta.request_id] = texts.get(delta.request_id, "") + delta.text
    assert [texts[i] for i in sorted(texts)] == [o.text for o in replicas.generate(PROMPTS, params)]
    for _ in replicas.stream(PROMPTS[:2], SamplingParams(max_tokens=300)):
        break  # the consumer leaves after one delta
    assert not replicas.has_unfinished() and replicas.load == [0, 0]
    assert "2 data-parallel replicas, each with its own KV cache" in replicas.describe_capacity()


@pytest.mark.parametrize("where", [0, 1])
def test_an_abort_ends_the_request_on_its_replica_and_nothing_of_it_comes_after(
    replicas, where
) -> None:
    ids = [replicas.add_request(p, SamplingParams(max_tokens=300)) for p in PROMPTS[:2]]
    replicas.step()
    victim = next(i for i in ids if replicas.requests[i][0] == where)
    output = replicas.abort(victim)
    assert output.finished and output.finish_reason == "abort" and output.request_id == victim
    with pytest.raises(KeyError, match="not running"):
        replicas.abort(victim)
    seen = set()
    while replicas.has_unfinished():
        seen |= {o.request_id for o in replicas.step()}
    assert victim not in seen and seen == set(ids) - {victim}


def test_a_refused_request_leaves_nothing_behind(replicas) -> None:
    before = (dict(replicas.requests), list(replicas.load))
    with pytest.raises(ValueError, match="max_tokens"):
        replicas.add_request("ROMEO:", SamplingParams(max_tokens=10_000))
    taken = replicas.add_request("ROMEO:", SamplingParams(max_tokens=40))
    with pytest.raises(ValueError, match="already in use"):
        replicas.add_request("JULIET:", SamplingParams(max_tokens=4), request_id=taken)
    replicas.abort(taken)
    assert (replicas.requests, replicas.load) == before


def test_llm_builds_replicas_and_refuses_what_they_cannot_combine_with(target) -> None:
    llm = LLM(target, data_parallel_size=2, max_num_seqs=4, num_blocks=64, device="cpu")
    try:
        assert isinstance(llm.engine, DataParallelEngine) and llm.engine.size == 2
        one = LLM(target, max_num_seqs=4, num_blocks=64, device="cpu")
        params = SamplingParams(max_tokens=8, temperature=0)
        assert [o.text for o in llm.generate(PROMPTS, params, use_tqdm=False)] == [
            o.text for o in one.generate(PROMPTS, params, use_tqdm=False)
        ]
    finally:
        llm.engine.close()
    with pytest.raises(ValueError, match="one replica"):
        LLMEngine(target, config(2))
    for other in ({"tensor_parallel_size": 2}, {"forward_processes": 2}):
        with pytest.raises(ValueError, match="data_parallel_size runs whole replicas"):
            EngineConfig(data_parallel_size=2, **other)
    with pytest.raises(ValueError, match="an int >= 1"):
        EngineConfig(data_parallel_size=0)


def test_a_dead_replica_is_a_clear_error_and_no_process_is_left(target) -> None:
    engine = DataParallelEngine(target, config(2))
    pids = engine._replicas.pids
    for prompt in PROMPTS[:2]:  # one each
        engine.add_request(prompt, SamplingParams(max_tokens=50))
    os.kill(pids[0], signal.SIGKILL)
    with pytest.raises(RuntimeError, match=r"data-parallel replica 1 \(exit code -9\) died"):
        while engine.has_unfinished():
            engine.step()
    with pytest.raises(RuntimeError, match="stopped earlier"):
        engine.step()
    engine.close()
    engine.close()
    assert not any(map(alive, pids))
