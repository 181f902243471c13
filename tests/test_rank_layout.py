"""The rank layout (exercise ch11.2, `Shard.query_heads` and `Shard.kv_heads` in
model/parallel.py): which query heads and which K/V heads each tensor-parallel rank holds, with
K/V heads replicated when there are fewer of them than ranks. Pure Python, no processes: the
layout is arithmetic on the config, which every rank's model, slices and K/V pool are built from.
"""

from __future__ import annotations

import pytest

from minivllm.model.parallel import Shard, local_config
from minivllm.model.transformer import ModelConfig


def heads(n_heads: int, n_kv_heads: int) -> ModelConfig:
    return ModelConfig(n_heads=n_heads, n_kv_heads=n_kv_heads, d_model=8 * n_heads, d_ff=64)


def layout(config: ModelConfig, world: int) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Each rank's ((first, count) of query heads, (first, count) of K/V heads)."""
    shards = [Shard(rank, world) for rank in range(world)]
    return [(s.query_heads(config), s.kv_heads(config)) for s in shards]


# 8 query heads sharing 2 K/V heads (4 query heads read each), written out rank by rank.
EIGHT_BY_TWO = {
    1: [((0, 8), (0, 2))],
    2: [((0, 4), (0, 1)), ((4, 4), (1, 1))],
    4: [((0, 2), (0, 1)), ((2, 2), (0, 1)), ((4, 2), (1, 1)), ((6, 2), (1, 1))],
    8: [((r, 1), (0 if r < 4 else 1, 1)) for r in range(8)],
}


@pytest.mark.exercise("ch11.2")
@pytest.mark.parametrize("world", sorted(EIGHT_BY_TWO))
def test_eight_query_heads_and_two_kv_heads(world) -> None:
    assert layout(heads(8, 2), world) == EIGHT_BY_TWO[world]


@pytest.mark.exercise("ch11.2")
@pytest.mark.parametrize(
    "n_heads, n_kv_heads, world",
    [
        (8, 8, 4),  # multi-head attention: each rank its own K/V heads
        (16, 8, 2),
        (32, 8, 8),  # Llama 3 8B at TP 8: one K/V head a rank, none replicated
        (32, 8, 16),  # ... at TP 16: each K/V head on two ranks
        (14, 2, 2),  # Qwen2.5-0.5B's heads
        (12, 3, 6),  # replicated, not a power of two
        (8, 1, 4),  # multi-query attention: every rank holds the one K/V head
    ],
)
def test_every_rank_holds_the_kv_heads_its_query_heads_read(n_heads, n_kv_heads, world) -> None:
    config = heads(n_heads, n_kv_heads)
    group = n_heads // n_kv_heads  # query heads per K/V head
    holders = {head: 0 for head in range(n_kv_heads)}
    next_query = 0
    for (q_first, q_count), (kv_first, kv_count) in layout(config, world):
        assert q_first == next_query and q_count == n_heads // world  # equal, contiguous, in order
        next_query += q_count
        held = range(kv_first, kv_first + kv_count)
        assert kv_count == max(1, n_kv_heads // world)
        read = {query // group for query in range(q_first, q_first + q_count)}
        assert read == set(held)  # exactly the K/V heads its query heads read, no others
        for head in held:
            holders[head] += 1
    assert next_query == n_heads  # every query head on exactly one rank
    assert set(holders.values()) == {max(1, world // n_kv_heads)}  # replicated W / n_kv times


@pytest.mark.exercise("ch11.2")
def test_a_ranks_config_has_its_heads() -> None:
    """The shapes of a rank's model and K/V pool come from the layout."""
    mine = local_config(heads(8, 2), Shard(3, 4))
    assert (mine.n_heads, mine.n_kv_heads, mine.head_dim) == (2, 1, 8)


@pytest.mark.exercise("ch11.2")
@pytest.mark.parametrize(
    "n_heads, n_kv_heads, world, which",
    [
        (8, 2, 3, "query"),  # 8 query heads over 3 ranks
        (6, 3, 2, "kv"),  # 3 K/V heads over 2 ranks: one rank would hold half a head
        (12, 3, 4, "kv"),  # 4 ranks, 3 K/V heads: a rank's queries would read two heads
    ],
)
def test_heads_that_do_not_split_are_refused(n_heads, n_kv_heads, world, which) -> None:
    config = heads(n_heads, n_kv_heads)
    method = Shard.query_heads if which == "query" else Shard.kv_heads
    for rank in range(world):
        with pytest.raises(ValueError, match=f"{world} ranks"):
            method(Shard(rank, world), config)
