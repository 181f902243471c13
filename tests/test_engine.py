"""Chapter 04: the engine -- scheduler, paged cache and model runner, connected.

With the shipped target model: greedy output is the contiguous-cache generator's output; every
request's tokens are the same in a 32-request batch (chunked prefill, mixed decodes) as alone; bad
requests are refused at the door and change nothing; abort and early-stopped streams give their
blocks back; the trace tells the whole story and survives a JSON round trip; prefix caching changes
the work, not the tokens.

The tests marked ch04.3 grade `build_batch` on hand-made plans and need no model at all.
"""

from __future__ import annotations

import copy

import pytest
import torch

from minivllm.engine.config import EngineConfig
from minivllm.engine.llm_engine import LLM, LLMEngine
from minivllm.engine.processing import RequestOutput
from minivllm.engine.trace import read_jsonl, write_jsonl
from minivllm.kv.block_manager import BlockManager
from minivllm.model.tokenizer import BOS_ID, EOS_ID, ByteTokenizer
from minivllm.runner.batch import build_batch
from minivllm.sched.plan import ScheduledChunk, StepPlan
from minivllm.sched.scheduler import Scheduler, SchedulerConfig
from minivllm.sched.sequence import SamplingParams, Sequence
from minivllm.stages.contiguous import ContiguousKVCache, generate_cached

tok = ByteTokenizer()

LINES = [
    "ROMEO:",
    "JULIET:\nO Romeo, Romeo! wherefore art thou Romeo?",
    "First Citizen:\nBefore we proceed any further, hear me speak.",
    "KING RICHARD III:\nNow is the winter of our discontent\nMade glorious summer by this sun of "
    "York;",
    "To be",
    "\n",
    "HAMLET:",
    "What light through yonder window breaks?",
]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_engine(
    model, num_blocks: int = 128, block_size: int = 16, seed: int = 0, **scheduler
) -> LLMEngine:
    scheduler.setdefault("max_num_seqs", 32)
    scheduler.setdefault("max_num_batched_tokens", 64)
    return LLMEngine(
        model,
        EngineConfig(
            num_blocks=num_blocks,
            block_size=block_size,
            seed=seed,
            scheduler=SchedulerConfig(**scheduler),
        ),
    )


def run_all(engine: LLMEngine) -> dict[int, RequestOutput]:
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def assert_pool_empty(engine: LLMEngine) -> None:
    assert engine.manager.num_free == engine.config.num_blocks and not engine.manager.tables
    assert not any(engine.manager.allocator.refcounts) and not engine.has_unfinished()


# -- build_batch (ch04.3): no model needed ---------------------------------------------------------


def hand_made_plan() -> tuple[StepPlan, dict[int, Sequence], BlockManager]:
    """A decode, a middle prefill chunk and a first prefill chunk, over scrambled physical
    blocks."""
    manager = BlockManager(8, 4)
    manager.allocate(99, 8)
    manager.free(99)  # LIFO: the next sequence gets block 1, then block 0
    params = SamplingParams(max_tokens=8)
    a = Sequence(10, [BOS_ID, 1, 2, 3, 4], params, seed=0, eos_token_id=EOS_ID)
    a.token_ids.append(5)  # sampled last step: it is the decode's input
    a.num_computed_tokens = 5
    b = Sequence(11, [BOS_ID, 20, 21, 22, 23, 24, 25, 26], params, seed=0, eos_token_id=EOS_ID)
    b.num_computed_tokens = 3
    c = Sequence(12, [BOS_ID, 40, 41], params, seed=0, eos_token_id=EOS_ID)
    manager.allocate(10, 6)  # blocks [1, 0]
    manager.allocate(11, 7)  # blocks [2, 3]: slots for the chunk's positions 3..6
    manager.allocate(12, 3)  # block [4]
    plan = StepPlan(
        1,
        (
            ScheduledChunk(10, 5, 1, False, True),
            ScheduledChunk(11, 3, 4, True, False),
            ScheduledChunk(12, 0, 3, True, True),
        ),
    )
    return plan, {10: a, 11: b, 12: c}, manager


@pytest.mark.exercise("ch04.3")
def test_build_batch_flattens_a_hand_made_plan() -> None:
    plan, sequences, manager = hand_made_plan()
    assert manager.block_table(10) == [1, 0]
    batch = build_batch(plan, sequences, manager)
    assert batch.input_ids.tolist() == [5, 22, 23, 24, 25, BOS_ID, 40, 41]
    assert batch.positions.tolist() == [5, 3, 4, 5, 6, 0, 1, 2]
    # position 5 of A: logical block 1 -> physical block 0, offset 1; B crosses from block 2 into
    # block 3.
    assert batch.slot_mapping.tolist() == [1, 11, 12, 13, 14, 16, 17, 18]
    assert batch.query_start.tolist() == [0, 1, 5, 8]
    assert batch.context_lens.tolist() == [6, 7, 3]
    assert batch.block_tables.tolist() == [[1, 0], [2, 3], [4, 0]]
    assert batch.num_decodes == 1 and batch.num_seqs == 3 and batch.num_tokens == 8
    assert batch.logits_indices.tolist() == [
        0,
        7,
    ]  # B's chunk does not reach its end: no token from it
    assert batch.block_size == 4
    for t in (
        batch.input_ids,
        batch.positions,
        batch.slot_mapping,
        batch.query_start,
        batch.context_lens,
        batch.block_tables,
        batch.logits_indices,
    ):
        assert t.dtype == torch.long


@pytest.mark.exercise("ch04.3")
def test_build_batch_of_decodes_only_and_of_one_prefill() -> None:
    plan, sequences, manager = hand_made_plan()
    decodes = build_batch(StepPlan(2, plan.chunks[:1]), sequences, manager)
    assert (
        decodes.input_ids.tolist(),
        decodes.positions.tolist(),
        decodes.slot_mapping.tolist(),
    ) == ([5], [5], [1])
    assert (decodes.query_start.tolist(), decodes.context_lens.tolist(), decodes.num_decodes) == (
        [0, 1],
        [6],
        1,
    )
    assert decodes.logits_indices.tolist() == [0] and decodes.block_tables.tolist() == [[1, 0]]
    prefill = build_batch(StepPlan(2, plan.chunks[2:]), sequences, manager)
    assert (
        prefill.input_ids.tolist(),
        prefill.positions.tolist(),
        prefill.slot_mapping.tolist(),
    ) == ([BOS_ID, 40, 41], [0, 1, 2], [16, 17, 18])
    assert (prefill.query_start.tolist(), prefill.context_lens.tolist(), prefill.num_decodes) == (
        [0, 3],
        [3],
        0,
    )
    assert prefill.logits_indices.tolist() == [2]


@pytest.mark.exercise("ch04.3")
def test_build_batch_follows_the_schedulers_plans() -> None:
    manager = BlockManager(16, 4)
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8), manager)
    prompts = [[BOS_ID, 1, 2, 3, 4], [BOS_ID, *range(20, 29)], [BOS_ID, 40, 41]]
    for i, prompt in enumerate(prompts):
        s.add(Sequence(i, prompt, SamplingParams(max_tokens=3), seed=0, eos_token_id=EOS_ID))
    plan = s.schedule()  # A's prompt (5), B's first 3 tokens
    batch = build_batch(plan, s.sequences, manager)
    assert batch.input_ids.tolist() == prompts[0] + prompts[1][:3]
    assert batch.positions.tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    assert batch.slot_mapping.tolist() == [0, 1, 2, 3, 4, 8, 9, 10]  # A: blocks 0, 1; B: block 2
    assert (batch.query_start.tolist(), batch.context_lens.tolist()) == ([0, 5, 8], [5, 3])
    assert (batch.num_decodes, batch.logits_indices.tolist()) == (0, [4])
    s.update(plan, {0: 77})
    plan = s.schedule()  # A decodes token 77; B's next 7 tokens (to its end, into a new block)
    batch = build_batch(plan, s.sequences, manager)
    assert batch.input_ids.tolist() == [77] + prompts[1][3:10]
    assert batch.positions.tolist() == [5, 3, 4, 5, 6, 7, 8, 9]
    assert batch.slot_mapping.tolist() == [5, 11, 12, 13, 14, 15, 16, 17]  # B: blocks 2, 3, 4
    assert (batch.query_start.tolist(), batch.context_lens.tolist()) == ([0, 1, 8], [6, 10])
    assert batch.block_tables.tolist() == [[0, 1, 0], [2, 3, 4]]
    assert (batch.num_decodes, batch.logits_indices.tolist()) == (1, [0, 7])


# -- output ---------------------------------------------------------------------------------------


def test_greedy_engine_matches_the_contiguous_cache_generator(target) -> None:
    prompts = [tok.encode(p, add_bos=True) for p in LINES[:6]] + [[BOS_ID, *b"ROMEO"]]
    engine = make_engine(target, max_num_batched_tokens=32)  # several prompts are chunked
    outs = engine.generate(prompts, SamplingParams(max_tokens=40, temperature=0))
    for prompt, out in zip(prompts, outs):
        want = generate_cached(
            target, prompt, 40, ContiguousKVCache(target.config, "preallocate", 512), eos_id=EOS_ID
        )
        assert out.token_ids == want, f"prompt {tok.decode(prompt)!r}"
        assert out.prompt_token_ids == prompt and out.finished
        assert out.finish_reason == ("stop" if want[-1] == EOS_ID else "length")
        assert out.text == tok.decode(want)
    assert_pool_empty(engine)
    assert max(r.num_batched_tokens for r in engine.trace) == 32


def test_string_prompts_get_bos(target) -> None:
    engine = make_engine(target)
    (out,) = engine.generate("ROMEO:", SamplingParams(max_tokens=3, temperature=0))
    assert out.prompt_token_ids == [BOS_ID, *b"ROMEO:"]


def workload(mode: str) -> tuple[list[str], list[SamplingParams]]:
    prompts = [LINES[i % len(LINES)] * (1 + i % 3) for i in range(32)]  # 2 to 280 tokens
    params = []
    for i in range(32):
        stop = ["\n\n"] if i % 5 == 0 else []
        if mode == "greedy":
            params.append(SamplingParams(max_tokens=4 + (i * 7) % 13, temperature=0, stop=stop))
        else:  # every fourth request brings no seed: the engine derives one (its seed, the id)
            seed = None if i % 4 == 3 else 1000 + i
            params.append(
                SamplingParams(
                    max_tokens=4 + (i * 7) % 13,
                    temperature=0.8,
                    top_p=0.9,
                    top_k=50,
                    seed=seed,
                    stop=stop,
                )
            )
    return prompts, params


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_a_requests_tokens_do_not_depend_on_the_batch(target, mode: str) -> None:
    prompts, params = workload(mode)
    engine = make_engine(target, num_blocks=256, max_num_seqs=32, max_num_batched_tokens=64)
    batch = engine.generate(prompts, params)
    # prefill chunks of several requests in one step
    assert any(len(r.prefilled) > 1 for r in engine.trace)
    assert any(r.decoded and r.prefilled for r in engine.trace)  # decodes mixed with prefill chunks
    assert max(len(r.running) for r in engine.trace) > 8
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        alone = make_engine(target, num_blocks=64, max_num_batched_tokens=64)
        # the same id: an unseeded request derives the same seed
        alone.add_request(prompt, p, request_id=i)
        (out,) = run_all(alone).values()
        assert batch[i].token_ids == out.token_ids and batch[i].text == out.text, f"request {i}"
        assert batch[i].finish_reason == out.finish_reason
    assert_pool_empty(engine)


def test_seeds_decide_sampled_tokens(target) -> None:
    prompt = "JULIET:"
    params = [SamplingParams(max_tokens=24, temperature=1.0, seed=s) for s in (1, 1, 2)]
    a, b, c = make_engine(target).generate([prompt] * 3, params)
    assert a.token_ids == b.token_ids and a.token_ids != c.token_ids
    # Without a seed, the engine's seed and the request id decide.
    unseeded = SamplingParams(max_tokens=24, temperature=1.0)
    x, y = make_engine(target, seed=5).generate([prompt] * 2, unseeded)
    (z,) = make_engine(target, seed=5).generate([prompt], unseeded)
    assert x.token_ids == z.token_ids and x.token_ids != y.token_ids


# -- bad requests ----------------------------------------------------------------------------------

GOOD, GOOD_PARAMS = "ROMEO:", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def good_tokens(target) -> list[int]:
    return make_engine(target, num_blocks=16).generate([GOOD], GOOD_PARAMS)[0].token_ids


BAD = {
    "empty token list": (lambda e: e.add_request([], GOOD_PARAMS), ValueError, "prompt is empty"),
    "max_tokens 0": (
        lambda e: e.add_request(GOOD, SamplingParams(max_tokens=0)),
        ValueError,
        "max_tokens",
    ),
    "max_tokens -3": (
        lambda e: e.add_request(GOOD, SamplingParams(max_tokens=-3)),
        ValueError,
        "max_tokens",
    ),
    "temperature < 0": (
        lambda e: e.add_request(GOOD, SamplingParams(temperature=-0.5)),
        ValueError,
        "temperature",
    ),
    "top_p 0": (lambda e: e.add_request(GOOD, SamplingParams(top_p=0.0)), ValueError, "top_p"),
    "top_p 1.5": (lambda e: e.add_request(GOOD, SamplingParams(top_p=1.5)), ValueError, "top_p"),
    "past the context": (
        lambda e: e.add_request("x" * 600, GOOD_PARAMS),
        ValueError,
        "context of 512 tokens",
    ),
    "prompt + max_tokens past the context": (
        lambda e: e.add_request([BOS_ID] * 500, SamplingParams(max_tokens=13)),
        ValueError,
        r"= 513 exceeds",
    ),
    "more blocks than the cache": (
        lambda e: e.add_request([65] * 300, SamplingParams(max_tokens=20)),
        ValueError,
        "needs 19 KV-cache blocks",
    ),
    "token id 300": (
        lambda e: e.add_request([BOS_ID, 300], GOOD_PARAMS),
        ValueError,
        "token id 300 .*vocabulary",
    ),
    "token id -1": (lambda e: e.add_request([BOS_ID, -1], GOOD_PARAMS), ValueError, "token id -1"),
    "a str among the ids": (
        lambda e: e.add_request([BOS_ID, "a"], GOOD_PARAMS),
        TypeError,
        "list of token ids",
    ),
    "a bool among the ids": (
        lambda e: e.add_request([BOS_ID, True], GOOD_PARAMS),
        TypeError,
        "list of token ids",
    ),
    "params is a dict": (
        lambda e: e.add_request(GOOD, {"max_tokens": 3}),
        TypeError,
        "must be a SamplingParams",
    ),
    "request id in use": (
        lambda e: e.add_request(GOOD, GOOD_PARAMS, request_id=0),
        ValueError,
        "already in use",
    ),
    "generate checks every prompt before queueing any": (
        lambda e: e.generate(["fine", "also fine", []], GOOD_PARAMS),
        ValueError,
        "prompt is empty",
    ),
    "generate with the wrong number of params": (
        lambda e: e.generate(["a", "b"], [GOOD_PARAMS]),
        ValueError,
        "2 prompts but 1 SamplingParams",
    ),
}


def snapshot(engine: LLMEngine) -> tuple:
    s, m = engine.scheduler, engine.manager
    return (
        [x.seq_id for x in s.waiting],
        [x.seq_id for x in s.running],
        sorted(s.sequences),
        s.step,
        m.num_free,
        copy.deepcopy(m.tables),
        list(m.allocator.refcounts),
        engine._next_id,
        len(engine.trace),
        [list(x.token_ids) for x in s.sequences.values()],
    )


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_request_is_refused_and_changes_nothing(target, good_tokens, case: str) -> None:
    bad, error, match = BAD[case]
    engine = make_engine(target, num_blocks=16)  # 256 token slots
    assert engine.add_request(GOOD, GOOD_PARAMS) == 0
    engine.step()
    engine.step()
    before = snapshot(engine)
    with pytest.raises(error, match=match):
        bad(engine)
    assert snapshot(engine) == before
    # The engine goes on exactly as it would have, and the next request still gets id 1.
    assert run_all(engine)[0].token_ids == good_tokens
    assert engine.add_request(GOOD, GOOD_PARAMS) == 1


@pytest.mark.parametrize(
    "num_blocks, prompt_len, max_tokens, ok",
    [
        (32, 500, 12, True),
        (32, 500, 13, False),  # the model's context: 512 tokens
        (16, 255, 200, True),
        (16, 256, 16, False),  # the prompt and one new token must fit 16 blocks of 16
    ],
)
def test_limits_are_exact(
    target, num_blocks: int, prompt_len: int, max_tokens: int, ok: bool
) -> None:
    engine = make_engine(target, num_blocks=num_blocks)
    prompt, params = [BOS_ID] + [65] * (prompt_len - 1), SamplingParams(max_tokens=max_tokens)
    if ok:
        assert engine.add_request(prompt, params) == 0 and len(engine.scheduler.waiting) == 1
    else:
        with pytest.raises(ValueError, match="context" if num_blocks == 32 else "blocks"):
            engine.add_request(prompt, params)
        assert not engine.scheduler.waiting


# -- abort, streams --------------------------------------------------------------------------------


def test_abort_mid_run_frees_the_blocks_and_spares_the_others(target) -> None:
    prompts = ["ROMEO:", LINES[3], "HAMLET:"]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    engine = make_engine(target, num_blocks=64)
    ids = [engine.add_request(p, params) for p in prompts]
    for _ in range(4):
        engine.step()
    held, free = len(engine.manager.block_table(1)), engine.manager.num_free
    out = engine.abort(1)
    assert (out.finished, out.finish_reason, out.request_id) == (True, "abort", 1)
    assert 0 < len(out.token_ids) < 20 and out.text == tok.decode(out.token_ids)
    assert 1 not in engine.manager and engine.manager.num_free == free + held and held > 0
    with pytest.raises(KeyError):
        engine.abort(1)
    done = run_all(engine)
    assert sorted(done) == [0, 2]  # the aborted request produced nothing more
    for i in (0, 2):
        (alone,) = make_engine(target, num_blocks=64).generate([prompts[i]], params)
        assert done[i].token_ids == alone.token_ids
    assert_pool_empty(engine)
    assert ids == [0, 1, 2]


def stream_workload() -> tuple[list[str], list[SamplingParams]]:
    prompts = [LINES[1], LINES[3], "ROMEO:", LINES[7] * 2]
    params = [
        SamplingParams(max_tokens=40, temperature=0.9, seed=7, stop=["\n"]),
        SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, seed=8, stop=["the ", "; "]),
        SamplingParams(max_tokens=25, temperature=0),
        SamplingParams(max_tokens=10, temperature=1.0, top_k=20, seed=9),
    ]
    return prompts, params


def test_stream_deltas_concatenate_to_generate(target) -> None:
    prompts, params = stream_workload()
    want = make_engine(target).generate(prompts, params)
    assert any(o.stop_reason is not None for o in want), (
        "the workload should exercise a stop string"
    )
    engine = make_engine(target)
    texts: dict[int, str] = {}
    ids: dict[int, list[int]] = {}
    reasons: dict[int, list] = {}
    for delta in engine.stream(prompts, params):
        texts[delta.request_id] = texts.get(delta.request_id, "") + delta.text
        ids.setdefault(delta.request_id, []).extend(delta.token_ids)
        reasons.setdefault(delta.request_id, []).append(delta.finish_reason)
    for i, out in enumerate(want):
        assert texts[i] == out.text and ids[i] == out.token_ids, f"request {i}"
        # only the last delta ends it
        assert reasons[i][-1] == out.finish_reason and not any(reasons[i][:-1])
    assert_pool_empty(engine)


def test_final_only_steps_hand_out_the_finished_requests_whole(target) -> None:
    """`step(final_only=True)` (what `generate` runs) hands out only the requests that finished,
    each with its whole text and tokens, stop strings applied: what every-step outputs add up to.
    Text without stop strings is decoded only when it is handed out."""
    prompts, params = stream_workload()
    every_step = make_engine(target)
    for prompt, p in zip(prompts, params):
        every_step.add_request(prompt, p)
    final_only = make_engine(target)
    for prompt, p in zip(prompts, params):
        final_only.add_request(prompt, p)
    whole: dict[str, RequestOutput] = {}
    handed_out: dict[str, RequestOutput] = {}
    while every_step.has_unfinished() or final_only.has_unfinished():
        for out in every_step.step():
            whole[out.request_id] = out
        outputs = final_only.step(final_only=True)
        assert all(out.finished for out in outputs)
        handed_out.update((out.request_id, out) for out in outputs)
        unstopped = [s for s in final_only.scheduler.running if not s.params.stop]
        assert all(final_only.outputs._state(s).num_decoded == 0 for s in unstopped)
    assert handed_out.keys() == whole.keys()
    for request_id, out in whole.items():
        got = handed_out[request_id]
        assert (got.text, got.token_ids, got.finish_reason, got.stop_reason) == (
            out.text,
            out.token_ids,
            out.finish_reason,
            out.stop_reason,
        ), request_id
    assert any(out.stop_reason is not None for out in whole.values())
    assert_pool_empty(final_only)


def test_a_consumer_that_stops_early_leaves_no_blocks_held(target) -> None:
    prompts, params = stream_workload()
    engine = make_engine(target)
    got = 0
    for _ in engine.stream(prompts, params):
        got += 1
        if got == 6:
            assert engine.manager.num_free < engine.config.num_blocks
            break  # the loop drops the generator: its cleanup aborts the rest
    assert_pool_empty(engine)
    stream = engine.stream(prompts, params)
    next(stream)
    stream.close()
    assert_pool_empty(engine)
    # The engine is still fine afterwards.
    assert (
        engine.generate(prompts, params)[2].token_ids
        == make_engine(target).generate(prompts, params)[2].token_ids
    )


# -- trace ---------------------------------------------------------------------------------------


def test_the_trace_tells_the_whole_story(target, tmp_path) -> None:
    engine = make_engine(target, num_blocks=32, max_num_seqs=4, max_num_batched_tokens=32)
    prompts = [tok.encode(LINES[i], add_bos=True) for i in range(7)]
    ids = [
        engine.add_request(p, SamplingParams(max_tokens=3 + i, temperature=0))
        for i, p in enumerate(prompts)
    ]
    steps, done = 0, {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        steps += 1
    trace = engine.trace
    assert len(trace) == steps and [r.step for r in trace] == list(range(1, steps + 1))
    path = tmp_path / "trace.jsonl"
    write_jsonl(trace, path)
    assert read_jsonl(path) == trace and len(path.read_text().splitlines()) == steps
    write_jsonl(trace, tmp_path / "bare.jsonl", timings=False)
    bare = read_jsonl(tmp_path / "bare.jsonl")
    assert [r.to_dict(timings=False) for r in bare] == [r.to_dict(timings=False) for r in trace]
    assert all(r.forward_s == 0.0 and r.step_s == 0.0 for r in bare) and all(
        r.step_s > 0 for r in trace
    )
    for r in trace:
        # after the step
        assert r.blocks_used + r.blocks_free == 32 and (r.blocks_used > 0) == bool(r.running)
        assert r.num_batched_tokens <= 32 and len(r.running) <= 4
        assert r.num_batched_tokens == len(r.decoded) + sum(n for _, n in r.prefilled)
        assert not set(r.running) & set(r.waiting) and not {i for i, _ in r.finished} & set(
            r.running
        )
    admitted = [i for r in trace for i in r.admitted]
    finished = [i for r in trace for i, _ in r.finished]
    assert sorted(admitted) == ids and admitted == ids  # each exactly once, first come first served
    assert sorted(finished) == ids
    for r in trace:
        for i, reason in r.finished:
            assert reason == done[i].finish_reason
    for i, prompt in zip(ids, prompts):
        assert sum(n for j, n in (p for r in trace for p in r.prefilled) if j == i) == len(prompt)
        assert sum(r.decoded.count(i) for r in trace) == len(done[i].token_ids) - 1
    assert trace[0].waiting == tuple(ids[len(trace[0].admitted) :])  # the queue, in arrival order
    assert trace[-1].running == () and trace[-1].waiting == ()


# -- prefix caching --------------------------------------------------------------------------------

PREFIX = "KING RICHARD III:\nNow is the winter of our discontent\nMade glorious summer by this sun "
"of York;\n"
SUFFIXES = ["And all the clouds", "Now are our brows", "Grim-visaged war", "Our stern alarums"]


@pytest.mark.parametrize("together", [False, True])
def test_prefix_caching_changes_the_work_not_the_tokens(target, together: bool) -> None:
    prompts = [PREFIX + s for s in SUFFIXES]
    params = SamplingParams(max_tokens=12, temperature=0)
    results = {}
    for caching in (False, True):
        engine = make_engine(
            target, num_blocks=64, max_num_batched_tokens=64, enable_prefix_caching=caching
        )
        # all at once: later prompts hit blocks of earlier ones as soon as those are computed
        if together:
            outs = engine.generate(prompts, params)
        else:  # the first request runs alone, then the rest find its prefix in the cache
            outs = engine.generate(prompts[:1], params) + engine.generate(prompts[1:], params)
        results[caching] = (outs, sum(r.prefix_hit_tokens for r in engine.trace))
        assert_pool_empty(engine)
    (off, off_hits), (on, on_hits) = results[False], results[True]
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert off_hits == 0 and all(o.num_cached_tokens == 0 for o in off)
    full_blocks = (1 + len(PREFIX)) // 16 * 16  # BOS + the shared text, in whole blocks
    if not together:
        assert [o.num_cached_tokens for o in on] == [0] + [full_blocks] * 3
    assert on[0].num_cached_tokens == 0 and all(
        0 < o.num_cached_tokens <= full_blocks for o in on[1:]
    )
    assert on_hits == sum(o.num_cached_tokens for o in on)


# -- the front door --------------------------------------------------------------------------------


def test_llm_front_door(target) -> None:
    llm = LLM(target, num_blocks=32, max_num_seqs=8, max_num_batched_tokens=16)
    assert (
        llm.engine.config.num_blocks == 32
        and llm.engine.config.scheduler.max_num_batched_tokens == 16
    )
    (out,) = llm.generate(["ROMEO:"], SamplingParams(max_tokens=8, temperature=0))
    want = generate_cached(
        target,
        tok.encode("ROMEO:", add_bos=True),
        8,
        ContiguousKVCache(target.config, "preallocate", 512),
        eos_id=EOS_ID,
    )
    assert out.token_ids == want


def test_stats_count_requests_and_generated_tokens(target) -> None:
    """What /stats and InferenceEngine.get_stats() report: requests added (n samples: one request),
    tokens generated (every sample's), and nothing held once they are done."""
    engine = make_engine(target, num_blocks=32)
    assert (engine.stats().num_requests, engine.stats().num_generated_tokens) == (0, 0)
    engine.generate(["ROMEO:", "JULIET:"], SamplingParams(max_tokens=5, ignore_eos=True))
    engine.generate(["HAMLET:"], SamplingParams(max_tokens=3, ignore_eos=True, n=2))
    request_id = engine.add_request("To be", SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()  # its prefill and first token
    running = engine.stats()
    assert (running.num_requests, running.num_generated_tokens) == (4, 2 * 5 + 2 * 3 + 1)
    assert running.num_running == 1 and running.blocks_used > 0
    engine.abort(request_id)
    done = engine.stats()
    assert (done.num_running, done.num_waiting, done.blocks_used, done.kv_cache_usage) == (
        0,
        0,
        0,
        0,
    )
    assert done.num_generated_tokens == 17 and done.peak_blocks_used > 0


def test_an_idle_engine_steps_to_nothing(target) -> None:
    engine = make_engine(target, num_blocks=16)
    assert engine.step() == [] and engine.trace == []


def test_generate_rejects_params_of_the_wrong_type(target) -> None:
    engine = make_engine(target, num_blocks=16)
    with pytest.raises(TypeError, match="SamplingParams"):
        engine.generate(["abc"], {"max_tokens": 3})
    assert not engine.has_unfinished()


def test_a_prompt_over_the_budget_without_chunking_is_refused(target) -> None:
    engine = make_engine(
        target, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=16, chunked_prefill=False
    )
    with pytest.raises(ValueError, match="chunked prefill is off"):
        engine.add_request("x" * 40, SamplingParams(max_tokens=2))
    assert not engine.has_unfinished()
    engine.add_request("x" * 10, SamplingParams(max_tokens=2, temperature=0))
    assert run_all(engine)[0].finish_reason == "length"


def test_the_attention_backend_and_device_are_chosen_and_checked(target) -> None:
    from minivllm.attention.numba_cpu import NumbaPagedAttention
    from minivllm.attention.torch_backend import TorchPagedAttention

    engine = LLMEngine(target, EngineConfig(num_blocks=8))
    expected_device = "cuda" if torch.cuda.is_available() else "cpu"
    assert engine.device == expected_device
    if expected_device == "cpu":
        assert engine.runner.backend is NumbaPagedAttention  # the native kernel on a CPU
        half = LLMEngine(target, EngineConfig(num_blocks=8, device="cpu", dtype=torch.float16))
        assert half.runner.backend is TorchPagedAttention  # the kernel is float32-only
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(attention_backend="triton")
    with pytest.raises(ValueError, match="device"):
        EngineConfig(device="tpu")


def test_auto_device_is_the_cpu_where_what_is_asked_for_runs_only_there(monkeypatch) -> None:
    """On a GPU machine, `device="auto"` is the GPU, unless the engine is asked for something
    that runs on a CPU only: the numba kernel, forward workers."""
    from minivllm.engine.config import _resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert _resolve_device(EngineConfig()) == "cuda"
    assert _resolve_device(EngineConfig(attention_backend="torch")) == "cuda"
    assert _resolve_device(EngineConfig(attention_backend="cuda")) == "cuda"
    assert _resolve_device(EngineConfig(attention_backend="numba")) == "cpu"
    assert _resolve_device(EngineConfig(forward_processes=2)) == "cpu"
    assert _resolve_device(EngineConfig(device="cpu")) == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _resolve_device(EngineConfig()) == "cpu"


# -- the attention backend registry ----------------------------------------------------------------


def test_attention_backends_are_chosen_by_name_from_a_registry() -> None:
    from minivllm.attention.backend import (
        backend_names,
        get_backend,
        register_backend,
        resolve_backend_name,
    )
    from minivllm.attention.torch_backend import TorchPagedAttention

    assert backend_names()[:3] == ("torch", "cuda", "numba")
    assert get_backend("torch") is TorchPagedAttention
    assert resolve_backend_name("auto", "cpu") == "numba"  # the native kernel, for float32
    assert resolve_backend_name("auto", "cpu", torch.float16) == "torch"
    assert resolve_backend_name("auto", "cuda") == "cuda"
    assert resolve_backend_name("torch", "cuda") == "torch"
    with pytest.raises(ValueError, match=r"unknown attention backend 'triton'.*'torch', 'cuda'"):
        get_backend("triton")
    with pytest.raises(ValueError, match=r"attention_backend must be one of 'auto', 'torch'"):
        EngineConfig(attention_backend="triton")
    with pytest.raises(ValueError, match="taken"):
        register_backend("torch", TorchPagedAttention)


CUDA_IS_LAZY = """
import sys
import torch
from minivllm.attention.backend import get_backend, is_loaded, register_backend
from minivllm.attention.backend import resolve_backend_name
from minivllm.attention.torch_backend import TorchPagedAttention
from minivllm.engine.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine

EngineConfig(device="cpu", attention_backend="cuda")  # checked against the registry ...
assert not is_loaded("cuda") and "minivllm.attention.cuda" not in sys.modules  # ... not imported
assert "numba" not in sys.modules
register_backend("cpu-half", TorchPagedAttention, devices=("cpu",), dtypes=(torch.float16,))
assert resolve_backend_name("auto", "cpu", torch.float16) == "cpu-half"  # device and dtype match
assert resolve_backend_name("auto", "cpu") == "numba"  # the first one registered for both
assert "numba" not in sys.modules  # choosing by name imports nothing
get_backend("cuda")
assert is_loaded("cuda") and "minivllm.attention.cuda" in sys.modules
"""


def test_the_cuda_backend_is_imported_only_when_asked_for() -> None:
    """In a fresh interpreter: importing the cuda package switches numba's simulator on."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-c", CUDA_IS_LAZY], env=env, capture_output=True)
    assert done.returncode == 0, done.stderr.decode()


# -- ModelRunner.execute ---------------------------------------------------------------------------


def test_a_steps_logits_land_in_the_memory_the_last_steps_held(target, monkeypatch) -> None:
    """The runner's `LogitsBuffer`: each pass's float32 logits in the same memory (no new big
    tensor a step), ordinary tensors the sampler may edit; logits over its cap get their own."""
    from minivllm.runner.batch import LogitsBuffer

    buffer = LogitsBuffer()
    with torch.inference_mode():
        rows = torch.randn(3, 5, dtype=torch.bfloat16)
    first = buffer.hold(rows)
    assert first.dtype == torch.float32 and not first.is_inference()
    assert torch.equal(first, rows.float())
    second = buffer.hold(rows[:2] * 2)
    assert second.data_ptr() == first.data_ptr() and torch.equal(second, rows[:2].float() * 2)
    monkeypatch.setattr(buffer, "MAX_BYTES", 4 * 14)  # 14 floats: 3 x 5 rows are over it
    third = buffer.hold(rows)
    assert third.data_ptr() != first.data_ptr() and torch.equal(third, rows.float())

    engine = make_engine(target, num_blocks=16, max_num_seqs=4, max_num_batched_tokens=12)
    engine.add_request("ROMEO:", SamplingParams(max_tokens=4, temperature=0))
    engine.step()
    address = engine.runner.logits.memory.data_ptr()
    engine.step()
    assert engine.runner.logits.memory.data_ptr() == address


def test_execute_runs_a_plan_and_samples_each_sampling_chunk(target) -> None:
    from minivllm.runner.model_runner import RunnerOutput

    engine = make_engine(target, num_blocks=16, max_num_seqs=4, max_num_batched_tokens=12)
    for prompt in ("ROMEO:", "JULIET: O Romeo"):  # the second is cut into chunks
        engine.add_request(prompt, SamplingParams(max_tokens=4, temperature=0))
    plan, sequences = engine.scheduler.schedule(), engine.scheduler.sequences
    assert len(plan.chunks) == 2 and plan.sampling_seq_ids == (0,)
    result = engine.runner.execute(plan, sequences)
    # The same batch again writes the same K/V and gives the same logits.
    logits = engine.runner.forward(build_batch(plan, sequences, engine.manager))
    assert result.tokens == {0: int(logits[0].argmax())}
    # The pass runs in inference mode; its logits leave it as an ordinary tensor, which the
    # sampler may edit in place (bans, biases) -- an inference tensor would refuse.
    assert not logits.is_inference()
    logits[0, 0] = float("-inf")
    assert result.speculated == () and result.forward_s > 0
    assert engine.runner.execute(StepPlan(plan.step, ()), sequences) == RunnerOutput({})
    engine.scheduler.update(plan, result.tokens)
    assert sequences[0].output_token_ids == [result.tokens[0]]
