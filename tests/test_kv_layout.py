"""The two KV layouts behind the block manager's seam (issue 28), and the trace's memory series.

`layout="contiguous"` (`--kv basic`) is the layout before paging: each sequence reserves the blocks
of max_model_len tokens at admission, keeps them until it finishes, and shares nothing. Checked
here without a model: the reservation, admission limited by it, a rollback that keeps it, no
sharing, clear errors, and `memory()` (used, reserved, empty, saved by sharing) for both layouts.
With the shipped target model: the same greedy tokens and the same seeded samples under both
layouts, fewer sequences at once and no preemption under the contiguous one, and the memory series
in the trace and its JSON lines; `--kv basic|paged` on the command line.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm.cli import build_parser, build_serving_engine, main
from minivllm.engine.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.trace import read_jsonl, write_jsonl
from minivllm.kv.block_manager import BlockManager, KVMemory
from minivllm.runner.speculative import SpeculativeConfig
from minivllm.sched.scheduler import SchedulerConfig
from minivllm.sched.sequence import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# -- the block manager, no model -------------------------------------------------------------------


def contiguous(num_blocks: int = 16, block_size: int = 4, max_model_len: int = 10) -> BlockManager:
    return BlockManager(num_blocks, block_size, layout="contiguous", max_model_len=max_model_len)


def test_contiguous_reserves_max_model_len_up_front_and_never_grows() -> None:
    m = contiguous()  # 10 tokens of context: 3 blocks of 4 per sequence
    assert m.reserved_blocks == 3 and not m.shares_blocks
    assert m.allocate_slots(0, 0, 2) == 2
    assert m.block_table(0) == [0, 1, 2] and m.num_tokens(0) == 2 and m.num_free == 13
    for position in range(2, 10):  # decodes fill the reservation; no new block
        assert m.allocate_slots(0, position, 1) == 1
    assert m.block_table(0) == [0, 1, 2] and m.num_tokens(0) == 10 and m.num_free == 13
    m.free(0)
    assert m.num_free == 16 and not m.tables


def test_contiguous_admission_is_limited_by_the_reservation() -> None:
    m = contiguous()  # 16 blocks, 3 per sequence: 5 sequences, one block left over
    assert all(m.allocate_slots(i, 0, 1) == 1 for i in range(5))
    assert m.num_free == 1 and m.allocate_slots(5, 0, 1) == 0 and 5 not in m
    paged = BlockManager(16, 4)  # the same pool, paged: a block each
    assert all(paged.allocate_slots(i, 0, 1) == 1 for i in range(16))


def test_contiguous_rollback_keeps_the_reservation() -> None:
    m = contiguous()
    m.allocate_slots(0, 0, 3)
    m.commit(0, [1, 2, 3], 3)
    m.allocate_slots(0, 3, 1, 4)  # a decode and 4 lookahead slots (speculative decoding)
    assert m.num_tokens(0) == 8
    m.commit(0, list(range(8)), 5)  # two drafts rejected: their slots go back, the blocks stay
    assert m.num_tokens(0) == 5 and m.block_table(0) == [0, 1, 2] and m.num_free == 13


def test_contiguous_shares_nothing() -> None:
    m = contiguous()
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert m.allocate_cached(0, tokens) == 0
    assert m.tables[0].block_hashes == [] and m.cached_prefix(tokens) == []  # nothing named
    assert m.allocate_cached(1, tokens) == 0 and m.num_free == 10  # its own 3 blocks
    with pytest.raises(ValueError, match="cannot fork"):
        m.fork(0, 2)
    with pytest.raises(ValueError, match="no prefix blocks"):
        m.allocate(3, 4, prefix_blocks=[0])
    assert 2 not in m and 3 not in m


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(1, 6), st.integers(0, 3)), max_size=40))
def test_contiguous_tables_keep_their_reservation_through_any_steps(steps: list) -> None:
    """Random steps through the scheduler's seam (a chunk of `new` tokens and `lookahead` draft
    slots, all drafts rejected; a sequence past its 10-token context is freed): every table holds
    exactly its 3 blocks, and memory() counts what they hold."""
    m, computed = contiguous(), {}
    for seq_id, new, lookahead in steps:
        start = computed.get(seq_id, 0)
        if start + new + lookahead > 10:
            if seq_id in m:
                m.free(seq_id)
            computed.pop(seq_id, None)
            continue
        if m.allocate_slots(seq_id, start, new, lookahead):
            m.commit(seq_id, [7] * (start + new + lookahead), start + new)
            computed[seq_id] = start + new
        else:
            assert seq_id not in m and len(m.tables) == 5  # only a new sequence is ever refused
        assert all(len(t.blocks) == 3 for t in m.tables.values())
        assert m.num_free == 16 - 3 * len(m.tables)
        memory = m.memory()
        assert memory.slots_empty == 12 * len(m.tables) - sum(computed.values())
        assert memory.blocks_saved == 0 and memory.blocks_used == 3 * len(m.tables)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(layout="radix"), "layout must be one of"),
        (dict(layout="contiguous"), "reserves max_model_len tokens per sequence"),
        (dict(layout="contiguous", max_model_len=80), "no sequence could ever run"),
    ],
)
def test_a_layout_that_can_never_run_is_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BlockManager(16, 4, **kwargs)  # 80 tokens: 20 blocks, more than the pool


def test_memory_counts_used_empty_and_saved_by_sharing() -> None:
    m = BlockManager(8, 4)
    m.allocate_cached(0, [1, 2, 3, 4, 5, 6])  # blocks [0, 1]; block 0 named
    hits, cached = m.computed_prefix([1, 2, 3, 4, 9, 9, 9])
    assert m.allocate_slots(1, cached, 3, prefix_blocks=hits) == 3  # blocks [0, 2]
    m.fork(0, 2)  # blocks [0, 1]
    memory = m.memory()
    # 3 blocks held; the tables list 6 (block 0 three times, block 1 twice)
    assert memory == KVMemory(
        num_blocks=8, blocks_used=3, table_blocks=6, slots_reserved=24, slots_filled=19
    )
    assert (memory.slots_empty, memory.blocks_saved) == (5, 3)  # tails of 2 + 1 + 2 slots
    assert (memory.utilization, memory.fragmentation, memory.saved_fraction) == (
        3 / 8,
        5 / 24,
        0.5,
    )
    m = contiguous()
    m.allocate_slots(0, 0, 5)
    m.allocate_slots(1, 0, 1)
    memory = m.memory()
    assert (memory.blocks_used, memory.slots_reserved, memory.slots_empty) == (6, 24, 18)
    assert memory.blocks_saved == 0 and memory.fragmentation == 0.75
    empty = BlockManager(8, 4).memory()
    assert (empty.utilization, empty.fragmentation, empty.saved_fraction) == (0, 0, 0)


# -- the engine, with the shipped target model -----------------------------------------------------

PROMPTS = [
    "ROMEO:",
    "JULIET:\nO Romeo, Romeo!",
    "First Citizen:\nBefore we proceed",
    "To be",
    "HAMLET:",
    "What light through yonder window",
]


def engine_for(model, layout: str, num_blocks: int = 64, **extra) -> LLMEngine:
    scheduler = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64)
    return LLMEngine(
        model, EngineConfig(num_blocks=num_blocks, scheduler=scheduler, kv_layout=layout, **extra)
    )


def test_greedy_tokens_are_the_same_under_both_layouts(target, tmp_path) -> None:
    """64 blocks of 16: room for 1024 tokens paged, for two contiguous reservations of the target's
    512-token context."""
    params = [SamplingParams(max_tokens=8 + 3 * i, temperature=0) for i in range(len(PROMPTS))]
    runs = {}
    for layout in ("paged", "contiguous"):
        engine = engine_for(target, layout)
        runs[layout] = engine, [o.token_ids for o in engine.generate(PROMPTS, params)]
        assert engine.manager.num_free == 64 and not engine.manager.tables
    (paged, paged_tokens), (basic, basic_tokens) = runs["paged"], runs["contiguous"]
    assert basic_tokens == paged_tokens
    assert max(len(r.running) for r in basic.trace) == 2 < max(len(r.running) for r in paged.trace)
    assert len(basic.trace) > len(paged.trace) and not any(r.preempted for r in basic.trace)
    for r in basic.trace:  # every running sequence holds 32 blocks, shares none
        assert r.blocks_used == 32 * len(r.running) and r.slots_reserved == 512 * len(r.running)
        assert r.blocks_saved == 0
    for r in paged.trace:  # only each sequence's last block has empty slots
        assert r.slots_empty <= 15 * len(r.running) and r.slots_reserved == 16 * r.blocks_used
    busy = [r for r in basic.trace if r.running]
    assert min(r.fragmentation for r in busy) > 0.8 > max(r.fragmentation for r in paged.trace)
    path = tmp_path / "trace.jsonl"
    write_jsonl(basic.trace, path)
    assert read_jsonl(path) == basic.trace
    first = json.loads(path.read_text().splitlines()[0])
    assert first["kv_utilization"] == round(basic.trace[0].kv_utilization, 4) == 1.0
    assert {"slots_reserved", "slots_empty", "blocks_saved", "fragmentation", "saved_fraction"} <= (
        first.keys()
    )


def test_samples_are_the_same_under_both_layouts_without_sharing(target) -> None:
    params = SamplingParams(n=3, max_tokens=10, temperature=0.9, seed=5)
    samples, traces = {}, {}
    for layout in ("paged", "contiguous"):
        engine = engine_for(target, layout, num_blocks=128)
        out = engine.generate([PROMPTS[1]], params)[0]
        samples[layout] = [s.token_ids for s in out.samples]
        traces[layout] = engine.trace
        assert engine.manager.num_free == 128 and not engine.groups
    assert samples["paged"] == samples["contiguous"] and len(set(map(tuple, samples["paged"]))) == 3
    prompt_len = len(PROMPTS[1]) + 1  # bytes and BOS
    prefilled = {k: sum(n for r in t for _, n in r.prefilled) for k, t in traces.items()}
    assert prefilled == {"paged": prompt_len, "contiguous": 3 * prompt_len}
    assert max(r.blocks_saved for r in traces["paged"]) > 0  # the forks share the prompt
    assert max(r.blocks_saved for r in traces["contiguous"]) == 0


def test_speculative_rollback_under_the_contiguous_layout(target) -> None:
    params = SamplingParams(max_tokens=16, temperature=0)
    tokens = {}
    for layout in ("paged", "contiguous"):
        spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
        engine = engine_for(target, layout, speculative=spec)
        tokens[layout] = [o.token_ids for o in engine.generate(PROMPTS[:3], params)]
        assert engine.manager.num_free == 64
        rounds = [s for r in engine.trace for s in r.speculated]
        assert any(accepted < proposed for _, proposed, accepted in rounds)  # slots rolled back
    assert tokens["paged"] == tokens["contiguous"]


def test_the_contiguous_layout_refuses_what_it_can_never_do(target) -> None:
    with pytest.raises(ValueError, match="prefix caching shares blocks"):
        EngineConfig(kv_layout="contiguous", scheduler=SchedulerConfig(enable_prefix_caching=True))
    with pytest.raises(ValueError, match="kv_layout must be one of"):
        EngineConfig(kv_layout="basic")  # the command line's name, not the config's
    with pytest.raises(ValueError, match=r"max_model_len=512 tokens \(32 blocks of 16\)"):
        engine_for(target, "contiguous", num_blocks=31)
    engine = engine_for(target, "contiguous", num_blocks=32)  # exactly one reservation
    with pytest.raises(ValueError, match="exceeds the model's context of 512 tokens"):
        engine.add_request("x" * 500, SamplingParams(max_tokens=20))
    assert not engine.has_unfinished()


# -- the command line ------------------------------------------------------------------------------


def test_kv_basic_on_the_command_line(capsys) -> None:
    base = ["generate", "ROMEO:\n", "--max-tokens", "10", "--temperature", "0"]
    texts = []
    for kv in ("paged", "basic"):
        assert main([*base, "--kv", kv]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and len(texts[0]) > len("ROMEO:\n\n")
    args = build_parser().parse_args(["serve", "--kv", "basic", "--num-blocks", "64"])
    engine = build_serving_engine(args)
    assert engine.config.kv_layout == "contiguous" and engine.manager.reserved_blocks == 32
    assert main(["serve", "--kv", "basic", "--enable-prefix-caching"]) == 2
    assert "prefix caching shares blocks" in capsys.readouterr().err
    assert main(["serve", "--kv", "basic", "--num-blocks", "16"]) == 2
    assert "no sequence could ever run" in capsys.readouterr().err
