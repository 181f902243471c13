"""kernel_trace: recording which simulated CUDA thread read which element (chapter 08's figure).

One small launch of the v1 kernel, recorded, is checked against what the kernel's code says it does:
every cached element of the sequence read exactly once per phase, nothing outside its blocks, warps
taking tokens round-robin in table order, lanes over head_dim. One launch of v3 on a GQA group of
four: every cached element read once for the whole group, the block table read once (into shared
memory), teams of lanes taking different tokens in the same round.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from minivllm.attention.cuda.kernels import paged_attention_v1
from minivllm.attention.cuda.launch import paged_attention, shared_bytes
from minivllm.attention.cuda.simulator import SIMULATOR, WARP_SIZE

pytestmark = pytest.mark.skipif(
    not SIMULATOR,
    reason="recording reads needs numba's CUDA simulator (no GPU here "
    "runs it; on a GPU the reads happen in hardware)",
)

TABLE, LENGTH, BLOCK_SIZE, HEAD_DIM, THREADS = [5, 2, 7], 37, 16, 32, 2 * WARP_SIZE


@pytest.fixture(scope="module")
def recording():
    from minivllm.book.kernel_trace import recorded

    generator = torch.Generator().manual_seed(11)
    q = torch.randn(1, 1, HEAD_DIM, generator=generator)
    k_cache, v_cache = (
        torch.randn(8, BLOCK_SIZE, 1, HEAD_DIM, generator=generator) for _ in range(2)
    )
    table, lens = (
        torch.tensor([TABLE], dtype=torch.int32),
        torch.tensor([LENGTH], dtype=torch.int32),
    )
    out, key_reads, value_reads = torch.full_like(q, float("nan")), [], []
    paged_attention_v1[(1, 1), THREADS, 0, shared_bytes(HEAD_DIM, THREADS, LENGTH)](
        out.numpy(),
        q.numpy(),
        recorded(k_cache.numpy(), key_reads),
        recorded(v_cache.numpy(), value_reads),
        table.numpy(),
        lens.numpy(),
        HEAD_DIM**-0.5,
        1,
    )
    expected = paged_attention(q, k_cache, v_cache, table, lens, threads=THREADS)
    return out, expected, key_reads, value_reads


def cached_elements() -> list[tuple[int, int, int, int]]:
    return [
        (TABLE[t // BLOCK_SIZE], t % BLOCK_SIZE, 0, d)
        for t in range(LENGTH)
        for d in range(HEAD_DIM)
    ]


def test_recording_does_not_change_the_result(recording) -> None:
    out, expected, _, _ = recording
    assert torch.equal(out, expected)


def test_every_cached_element_is_read_once_per_phase_and_nothing_else(recording) -> None:
    _, _, key_reads, value_reads = recording
    for reads in (key_reads, value_reads):
        assert sorted(r.index for r in reads) == sorted(cached_elements())
        assert {r.block for r in reads} == {(0, 0, 0)}


def test_warps_take_tokens_round_robin_in_block_table_order(recording) -> None:
    from minivllm.book.kernel_trace import reads_by_thread

    num_warps = THREADS // WARP_SIZE
    for (_, thread), indices in reads_by_thread(recording[2]).items():
        warp, lane = divmod(thread, WARP_SIZE)
        tokens = [TABLE.index(block) * BLOCK_SIZE + slot for block, slot, _, _ in indices]
        # head_dim 32: one element per lane per row
        assert tokens == list(range(warp, LENGTH, num_warps))
        assert {d for *_, d in indices} == {lane}


def test_value_phase_threads_own_one_element_each(recording) -> None:
    from minivllm.book.kernel_trace import reads_by_thread

    by_thread = reads_by_thread(recording[3])
    # threads past head_dim idle
    assert sorted(thread for _, thread in by_thread) == list(range(HEAD_DIM))
    for (_, thread), indices in by_thread.items():
        assert [(block, slot) for block, slot, _, _ in indices] == [
            (TABLE[t // BLOCK_SIZE], t % BLOCK_SIZE) for t in range(LENGTH)
        ]
        assert {d for *_, d in indices} == {thread}


def test_host_reads_are_not_recorded() -> None:
    import numpy as np

    from minivllm.book.kernel_trace import recorded

    reads = []
    device = recorded(np.arange(6.0).reshape(2, 3), reads)
    assert device[1, 2] == 5.0 and reads == []


GROUP = 4  # query heads sharing the one K/V head


@pytest.fixture(scope="module")
def grouped_recording():
    """v3 on a GQA group of 4: one thread block serves the four query heads."""
    from minivllm.attention.cuda.grouped import (
        default_lanes_per_token,
        grouped_decode_kernel,
        shared_words,
    )
    from minivllm.book.kernel_trace import recorded

    generator = torch.Generator().manual_seed(12)
    q = torch.randn(1, GROUP, HEAD_DIM, generator=generator)
    k_cache, v_cache = (
        torch.randn(8, BLOCK_SIZE, 1, HEAD_DIM, generator=generator) for _ in range(2)
    )
    table, lens = (
        torch.tensor([TABLE], dtype=torch.int32),
        torch.tensor([LENGTH], dtype=torch.int32),
    )
    partition = len(TABLE) * BLOCK_SIZE  # one partition: the whole table
    out = torch.full((1, GROUP, 1, HEAD_DIM), float("nan"))
    max_logits, exp_sums = torch.empty(1, GROUP, 1), torch.empty(1, GROUP, 1)
    key_reads, value_reads, table_reads = [], [], []
    kernel = grouped_decode_kernel(HEAD_DIM, GROUP, default_lanes_per_token(HEAD_DIM), BLOCK_SIZE)
    shared = 4 * shared_words(
        len(TABLE), HEAD_DIM, GROUP, WARP_SIZE, default_lanes_per_token(HEAD_DIM)
    )
    kernel[(1, 1, 1), WARP_SIZE, 0, shared](
        out.numpy(),
        max_logits.numpy(),
        exp_sums.numpy(),
        q.numpy(),
        recorded(k_cache.view(-1).numpy(), key_reads),  # v3 takes the caches flattened
        recorded(v_cache.view(-1).numpy(), value_reads),
        recorded(table.numpy(), table_reads),
        lens.numpy(),
        LENGTH,
        HEAD_DIM**-0.5,
        partition,
    )
    expected = paged_attention(q, k_cache, v_cache, table, lens, threads=WARP_SIZE)
    return out[:, :, 0], expected, cache_indices(key_reads), cache_indices(value_reads), table_reads


def cache_indices(flat_reads):
    """The reads of a flattened cache, with (block, slot, kv_head, element) indices again."""
    shape = (8, BLOCK_SIZE, 1, HEAD_DIM)
    return [
        replace(r, index=tuple(int(i) for i in np.unravel_index(r.index[0], shape)))
        for r in flat_reads
    ]


def test_v3_reads_each_cached_element_once_for_the_whole_group(grouped_recording) -> None:
    out, expected, key_reads, value_reads, _ = grouped_recording
    assert torch.allclose(out, expected, rtol=1e-5, atol=1e-6)
    for reads in (key_reads, value_reads):  # v1 reads each of them GROUP times, once per head
        assert sorted(r.index for r in reads) == sorted(cached_elements())


def test_v3_reads_the_block_table_once_into_shared_memory(grouped_recording) -> None:
    table_reads = grouped_recording[4]
    assert sorted(r.index for r in table_reads) == [(0, i) for i in range(len(TABLE))]


def test_v3_teams_of_lanes_take_different_tokens_in_the_same_round(grouped_recording) -> None:
    """head_dim 32 -> teams of 4 lanes, 8 tokens in flight per warp; lane j of a team reads
    elements j, j + 4, ... of its token's row."""
    from minivllm.attention.cuda.grouped import default_lanes_per_token
    from minivllm.book.kernel_trace import reads_by_thread

    lanes = default_lanes_per_token(HEAD_DIM)
    teams = WARP_SIZE // lanes
    for (_, thread), indices in reads_by_thread(grouped_recording[2]).items():
        team, team_lane = divmod(thread, lanes)
        tokens = [TABLE.index(block) * BLOCK_SIZE + slot for block, slot, _, _ in indices]
        per_row = HEAD_DIM // lanes
        assert tokens == [t for t in range(team, LENGTH, teams) for _ in range(per_row)]
        assert [d for *_, d in indices[:per_row]] == list(range(team_lane, HEAD_DIM, lanes))
