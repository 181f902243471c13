"""Parallel sampling (SamplingParams.n > 1, issue 18): n samples of one prompt that share its KV
blocks.

The prompt is prefilled once; the other samples fork sample 0's block table (reference counts,
chapter 03) and copy the shared, partly filled last block on their first write. Checked here: one
request id, an `index` per sample, sample 0 = the request alone, sample i = a lone request with
the seed derived for it, the same tokens among other requests and under preemption, blocks
shared after the prefill and fewer at the peak than n independent requests, abort freeing all.
"""

from __future__ import annotations

import pytest

from minivllm.engine.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.runner.sampler import derive_seed
from minivllm.sched.scheduler import SchedulerConfig
from minivllm.sched.sequence import SamplingParams, Status

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = "KING RICHARD III:\nNow is the winter of our discontent"  # 52 tokens: 3 full blocks + 4


def make_engine(model, num_blocks: int = 128, **scheduler) -> LLMEngine:
    scheduler.setdefault("max_num_seqs", 32)
    scheduler.setdefault("max_num_batched_tokens", 64)
    config = EngineConfig(
        num_blocks=num_blocks, block_size=16, scheduler=SchedulerConfig(**scheduler)
    )
    return LLMEngine(model, config)


def assert_pool_empty(engine: LLMEngine) -> None:
    assert engine.manager.num_free == engine.config.num_blocks and not engine.manager.tables
    assert not any(engine.manager.allocator.refcounts) and not engine.has_unfinished()
    assert not engine.groups


def params(n: int, **extra) -> SamplingParams:
    base = dict(max_tokens=24, temperature=0.9, seed=7, n=n)
    return SamplingParams(**{**base, **extra})


def test_one_request_id_n_indexed_samples(target):
    engine = make_engine(target)
    out = engine.generate([PROMPT], params(4))[0]
    assert out.index == 0 and [s.index for s in out.samples] == [0, 1, 2, 3]
    assert {s.request_id for s in out.samples} == {out.request_id}
    assert all(s.finished for s in out.samples)
    assert len({tuple(s.token_ids) for s in out.samples}) == 4  # they diverge
    assert_pool_empty(engine)


def test_sample_i_is_a_lone_request_with_its_derived_seed(target):
    samples = make_engine(target).generate([PROMPT], params(3))[0].samples
    for index, sample in enumerate(samples):
        seed = 7 if index == 0 else derive_seed(7, index)
        alone = make_engine(target).generate([PROMPT], params(1, seed=seed))[0]
        assert sample.token_ids == alone.token_ids and sample.text == alone.text


def test_n_equal_one_keeps_todays_shape(target):
    out = make_engine(target).generate([PROMPT], params(1))[0]
    assert out.samples == [] and out.index == 0


def test_prompt_blocks_are_shared_after_the_prefill(target):
    engine = make_engine(target)
    engine.add_request(PROMPT, params(4, max_tokens=8))
    parent_blocks = None
    while parent_blocks is None:
        engine.step()
        forks = [s for s in engine.scheduler.running if s.request_id == 0]
        if len(forks) == 4:
            parent_blocks = engine.manager.block_table(forks[0].seq_id)
    pool = engine.manager.allocator
    # the first three (full) prompt blocks: one copy, four holders
    for seq in forks[1:]:
        assert engine.manager.block_table(seq.seq_id)[:3] == parent_blocks[:3]
    assert [pool.refcount(b) for b in parent_blocks[:3]] == [4, 4, 4]
    # the partly filled last block was shared at the fork and copied on the first write
    engine.step()
    lasts = {engine.manager.block_table(s.seq_id)[3] for s in forks}
    assert len(lasts) == 4 and all(pool.refcount(b) == 1 for b in lasts)
    while engine.has_unfinished():
        engine.step()
    assert_pool_empty(engine)


def test_peak_blocks_below_n_independent_requests(target):
    n = 4
    shared = make_engine(target)
    shared.generate([PROMPT], params(n, ignore_eos=True))
    independent = make_engine(target)
    independent.generate(
        [PROMPT] * n,
        [params(1, seed=7 if i == 0 else derive_seed(7, i), ignore_eos=True) for i in range(n)],
    )
    assert shared.stats().peak_blocks_used < independent.stats().peak_blocks_used
    # 52 + 24 tokens = 5 blocks each alone; forks share the 3 full prompt blocks
    assert independent.stats().peak_blocks_used == n * 5
    assert shared.stats().peak_blocks_used == 3 + n * 2


def test_samples_are_the_same_among_others_and_under_preemption(target):
    reference = make_engine(target).generate([PROMPT], params(3, frequency_penalty=0.3))[0]
    tokens = [s.token_ids for s in reference.samples]
    crowd_params = [params(2, seed=100 + i, max_tokens=20) for i in range(6)]
    crowd = make_engine(target).generate(
        [f"ROMEO {i}:" for i in range(6)] + [PROMPT],
        crowd_params + [params(3, frequency_penalty=0.3)],
    )
    assert [s.token_ids for s in crowd[-1].samples] == tokens
    tiny = make_engine(target, num_blocks=14, max_num_seqs=12, max_num_batched_tokens=48)
    squeezed = tiny.generate(
        [PROMPT] + [f"ROMEO {i}:" for i in range(3)],
        [params(3, frequency_penalty=0.3)] + crowd_params[:3],
    )
    preemptions = sum(s.num_preemptions for o in squeezed for s in o.samples)
    assert preemptions > 0
    assert [s.token_ids for s in squeezed[0].samples] == tokens
    assert_pool_empty(tiny)


def test_stream_marks_each_delta_with_its_sample(target):
    engine = make_engine(target)
    deltas = list(engine.stream([PROMPT], params(3, max_tokens=6)))
    by_index: dict[int, list[int]] = {}
    for delta in deltas:
        by_index.setdefault(delta.index, []).extend(delta.token_ids)
    expected = make_engine(target).generate([PROMPT], params(3, max_tokens=6))[0].samples
    assert by_index == {s.index: s.token_ids for s in expected}
    assert sum(d.finish_reason is not None for d in deltas) == 3
    assert_pool_empty(engine)


def test_abort_frees_every_sample(target):
    engine = make_engine(target)
    request = engine.add_request(PROMPT, params(4, max_tokens=50))
    for _ in range(5):
        engine.step()
    assert engine.manager.num_free < engine.config.num_blocks
    out = engine.abort(request)
    assert out.finish_reason == "abort"
    assert_pool_empty(engine)


def test_abort_before_the_fork_ends_the_waiting_samples(target):
    engine = make_engine(target, max_num_batched_tokens=32)  # the prompt takes two steps
    request = engine.add_request(PROMPT, params(3))
    engine.step()
    waiting = [s for s in engine.scheduler.sequences.values() if s.index > 0]
    assert len(waiting) == 2 and all(s.status is Status.WAITING for s in waiting)
    engine.abort(request)
    assert all(s.finish_reason == "abort" for s in waiting)
    assert_pool_empty(engine)


def test_stopping_a_stream_early_frees_every_sample(target):
    engine = make_engine(target)
    stream = engine.stream([PROMPT], params(3, max_tokens=40))
    for _ in range(4):
        next(stream)
    stream.close()
    assert_pool_empty(engine)


def test_samples_need_seats(target):
    engine = make_engine(target, max_num_seqs=4, max_num_batched_tokens=64)
    with pytest.raises(ValueError, match=r"SamplingParams\.n \(5\) exceeds max_num_seqs"):
        engine.add_request(PROMPT, params(5))
    # a group never pushes the batch past max_num_seqs
    engine.generate([PROMPT, "ROMEO:", "JULIET:"], [params(3), params(1), params(2)])
    assert max(len(r.running) for r in engine.trace) <= 4


def test_request_ids_stay_unique(target):
    engine = make_engine(target)
    first = engine.add_request(PROMPT, params(3))
    second = engine.add_request("ROMEO:", params(1))
    assert second not in engine.groups[first]
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("x", params(1), request_id=engine.groups[first][1])
    while engine.has_unfinished():
        engine.step()
    assert_pool_empty(engine)


def test_prefix_caching_and_logprobs_with_samples(target):
    reference = make_engine(target).generate([PROMPT], params(3, logprobs=2))[0].samples
    engine = make_engine(target, enable_prefix_caching=True)
    engine.generate([PROMPT], params(1))  # names the prompt's full blocks
    out = engine.generate([PROMPT], params(3, logprobs=2))[0]
    assert out.num_cached_tokens == 48
    assert [s.token_ids for s in out.samples] == [s.token_ids for s in reference]
    for sample, ref in zip(out.samples, reference):
        assert len(sample.logprobs) == len(sample.token_ids)
        for got, want in zip(sample.logprobs, ref.logprobs):
            assert got.keys() == want.keys()
            assert all(abs(got[t] - want[t]) < 1e-5 for t in got)
    assert not engine.has_unfinished() and not engine.manager.tables
