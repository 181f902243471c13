"""Forward workers (runner/workers.py): one forward pass split between processes by sequence.

The split itself (`split_sequences`, `balanced_bounds`) against the whole batch: the parts' logits,
concatenated, are the whole pass's rows in order, to a matmul's rounding. Then an engine with a
worker process against one without: the same greedy and seeded tokens through chunked prefills and
decodes; a worker's error comes back as the step's error; a dead worker or a closed engine is a
clear error, not a hang.
"""

from __future__ import annotations

import os
import pickle
import signal
import time
from dataclasses import replace

import numpy as np
import pytest
import torch
from test_tensor_parallel import alive  # whether a process has not ended

from minivllm import EngineConfig, LLMEngine, SamplingParams, SchedulerConfig
from minivllm.attention.backend import get_backend
from minivllm.attention.batch import split_sequences
from minivllm.attention.storage import PagedKVStorage
from minivllm.kv.block_manager import BlockManager
from minivllm.model.fused import fuse_projections
from minivllm.runner.batch import BatchPiece, pack_batch, run_model
from minivllm.runner.launcher import FIRST_BYTES, batch_fields
from minivllm.runner.workers import ForwardWorkers, balanced_bounds, warn_if_threads_spin
from minivllm.training.corpus import shipped_validation_text

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def mixed_batch(model, seed: int = 0):
    """Two decodes over cached contexts, a speculative verify (a token and two drafts, three
    logits rows), then two prefill chunks, one wanting every row's logits and one over a cached
    prefix: a storage whose cache holds random K/V, and the packed batch."""
    rng = np.random.default_rng(seed)
    manager = BlockManager(64, 16)
    storage = PagedKVStorage(model.config, 64, 16)
    storage.kv.copy_(torch.randn(storage.kv.shape, generator=torch.Generator().manual_seed(seed)))
    shapes = [(30, 1, 1), (5, 1, 1), (17, 3, 3), (0, 40, 40), (20, 9, 1)]  # start, tokens, logits
    pieces = []
    for seq_id, (start, tokens, logits) in enumerate(shapes):
        manager.allocate(seq_id, start + tokens)
        ids = rng.integers(1, model.config.vocab_size, tokens).tolist()
        pieces.append(BatchPiece(seq_id, start, ids, logits))
    return storage, pack_batch(pieces, manager)


@pytest.mark.parametrize("bounds", [[0, 5], [0, 1, 5], [0, 3, 4, 5], [0, 1, 2, 3, 4, 5]])
def test_the_parts_logits_are_the_whole_batchs(target, bounds) -> None:
    model = fuse_projections(target)
    storage, batch = mixed_batch(model)
    whole = run_model(model, storage, batch)
    parts = split_sequences(batch, bounds)
    assert [p.num_seqs for p in parts] == np.diff(bounds).tolist()
    assert sum(p.num_decodes for p in parts) == batch.num_decodes
    logits = torch.cat([run_model(model, storage, part) for part in parts])
    # A matmul's rounding depends on how many rows it has (MKL treats leftover rows with other
    # kernels), so a row's logits may move in the last bits -- as from one step to the next in any
    # engine, whose batch changes every step. Nothing more: same rows, same order, same argmax.
    torch.testing.assert_close(logits, whole, rtol=1e-5, atol=1e-4)
    assert torch.equal(logits.argmax(-1), whole.argmax(-1))
    if bounds == [0, 5]:
        assert torch.equal(logits, whole)


@pytest.mark.parametrize("bounds", [[1, 5], [0, 4], [0, 3, 3, 5], [0, 4, 2, 5]])
def test_bounds_that_do_not_rise_through_the_batch_are_refused(target, bounds) -> None:
    _, batch = mixed_batch(fuse_projections(target))
    with pytest.raises(ValueError, match="bounds must rise"):
        split_sequences(batch, bounds)


def test_balanced_bounds_cut_at_the_nearest_boundary_and_never_leave_a_part_empty() -> None:
    decodes = np.ones(64, dtype=np.int64)
    assert balanced_bounds(decodes, np.full(64, 200), 2, 300.0) == [0, 32, 64]
    assert balanced_bounds(decodes, np.full(64, 200), 4, 300.0) == [0, 16, 32, 48, 64]
    # 30 decodes, then chunks of 200, 150 and 120 tokens: the cut falls between chunks
    query = np.array([1] * 30 + [200, 150, 120])
    context = np.array([200] * 30 + [200, 150, 300])
    bounds = balanced_bounds(query, context, 2, 300.0)
    cost = query * (context - (query - 1) / 2 + 300.0)
    halves = [cost[: bounds[1]].sum(), cost[bounds[1] :].sum()]
    for other in range(1, len(query)):  # no other single cut is more even
        assert abs(halves[0] - halves[1]) <= abs(cost[:other].sum() - cost[other:].sum())
    assert balanced_bounds(np.array([1]), np.array([5]), 2, 300.0) == [0, 1]  # one sequence
    assert balanced_bounds(np.array([400, 1]), np.array([400, 5]), 3, 300.0) == [0, 1, 2]


def workload(count: int = 12, seed: int = 0) -> list[list[int]]:
    text = shipped_validation_text().encode()
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(text) - 200, count).tolist()
    return [[1, *text[s : s + n]] for s, n in zip(starts, rng.integers(10, 120, count).tolist())]


def engine(model, processes: int) -> LLMEngine:
    # a small token budget: prompts are prefilled in chunks, beside other sequences' decodes
    scheduler = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64)
    # device="cpu": forward workers share a K/V pool in CPU memory (on a GPU machine too)
    config = EngineConfig(
        num_blocks=256, scheduler=scheduler, forward_processes=processes, device="cpu"
    )
    return LLMEngine(model, config)


@pytest.fixture(scope="module")
def split_engine(target):
    with engine(target, 2) as split:
        yield split


def test_an_engine_with_a_worker_gives_the_tokens_of_one_without(target, split_engine) -> None:
    prompts = workload()
    params = [
        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True),
    ]
    alone = engine(target, 1)
    for param in params:
        expected = [o.token_ids for o in alone.generate(prompts, param)]
        assert [o.token_ids for o in split_engine.generate(prompts, param)] == expected
    steps = split_engine.trace[-30:]
    assert any(r.prefilled and r.decoded for r in steps)  # chunks and decodes shared passes
    assert len(split_engine.runner.workers.part_seconds) == 2  # and both processes ran a part


def test_a_workers_error_is_the_steps_error_and_the_workers_serve_on(target, split_engine):
    workers = split_engine.runner.workers
    _, batch = mixed_batch(split_engine.runner.model)
    # the last sequence (always the worker's) names a block outside the pool: its kernel says so
    tables = batch.block_tables.clone()
    tables[-1] = 10_000
    with pytest.raises(RuntimeError, match="forward worker 1 failed: ValueError: .*outside"):
        workers.forward(replace(batch, block_tables=tables), split_engine.runner.backend)
    prompts = workload(4, seed=1)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    assert [o.token_ids for o in split_engine.generate(prompts, params)] == [
        o.token_ids for o in engine(target, 1).generate(prompts, params)
    ]


def test_a_dead_worker_or_a_closed_engine_is_a_clear_error(target) -> None:
    """A worker killed while an engine beside it (the module's) keeps its own: the next step
    names it, its group ends and no worker is left; close() twice is safe."""
    split = engine(target, 2)
    for prompt in workload(2):  # two sequences: a part each
        split.add_request(prompt, SamplingParams(max_tokens=4, temperature=0))
    pids = split.runner.workers.pids
    os.kill(pids[0], signal.SIGKILL)
    with pytest.raises(RuntimeError, match=r"forward worker 1 \(exit code -9\) died"):
        while split.has_unfinished():  # until a step has two sequences to split
            split.step()
    split.close()
    split.close()
    assert not split.runner.workers.alive
    assert not any(map(alive, pids))
    with pytest.raises(RuntimeError, match="closed"):
        split.runner.workers.forward(None, split.runner.backend)


def test_idle_workers_outwait_the_steps_timeout_and_long_messages_arrive(target) -> None:
    """Only a step's messages time out: workers wait for the next step as long as the engine is
    idle (here twice the timeout), then serve it. A step's message longer than one
    broadcast (block tables padded past 64 KiB) arrives whole: the same logits."""
    model = fuse_projections(target)
    storage, batch = mixed_batch(model)
    # 1 s was too short for a cold worker's first step on a loaded 16-core GPU machine
    workers = ForwardWorkers(model, storage, "torch", 2, timeout_s=2.5)
    try:
        expected = workers.forward(batch, get_backend("torch"))
        time.sleep(5)
        assert workers.alive
        torch.testing.assert_close(workers.forward(batch, get_backend("torch")), expected)
        wide = torch.nn.functional.pad(batch.block_tables, (0, 8000 - batch.block_tables.shape[1]))
        padded = replace(batch, block_tables=wide)
        assert len(pickle.dumps(batch_fields(padded))) > FIRST_BYTES
        torch.testing.assert_close(workers.forward(padded, get_backend("torch")), expected)
    finally:
        workers.close()
    assert not any(map(alive, workers.pids))


@pytest.mark.parametrize("policy", [None, "active", "ACTIVE"])
def test_workers_warn_when_torchs_threads_may_spin(monkeypatch, policy) -> None:
    if policy is None:
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    else:
        monkeypatch.setenv("OMP_WAIT_POLICY", policy)
    with pytest.warns(UserWarning, match="OMP_WAIT_POLICY is not PASSIVE"):
        assert warn_if_threads_spin()
    monkeypatch.setenv("OMP_WAIT_POLICY", "passive")
    assert not warn_if_threads_spin()


def test_workers_refuse_a_cache_off_the_cpu(target) -> None:
    storage = PagedKVStorage(target.config, 4, 16, device="meta")  # no memory, not the CPU's
    with pytest.raises(ValueError, match="forward_processes > 1 is for a CPU engine"):
        ForwardWorkers(target, storage, "torch", 2)


@pytest.mark.parametrize("processes", [0, -1, 1.5, "2"])
def test_forward_processes_must_be_a_positive_int(processes) -> None:
    with pytest.raises(ValueError, match="forward_processes"):
        EngineConfig(forward_processes=processes)
