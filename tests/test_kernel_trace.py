"""kernel_trace: recording which simulated CUDA thread read which element (chapter 07's figure).

One small launch of the v1 kernel, recorded, is checked against what the kernel's code says it does:
every cached element of the sequence read exactly once per phase, nothing outside its blocks, warps
taking tokens round-robin in table order, lanes over head_dim.
"""

from __future__ import annotations

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
