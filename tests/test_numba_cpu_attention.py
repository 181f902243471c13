"""The native CPU paged-attention kernel (attention/numba_cpu.py) against a float64 reference.

Fresh random inputs (never zeros), the output poisoned with NaN before each call, physical blocks
shuffled, contexts ending mid-block and one-token contexts, prefill chunks mixed with decodes in one
batch, over block sizes 8/16/32, head_dim 32/64/128 and GQA groups 1/2/4, on both the plain loops
and the vector paths: max relative error <= 1e-5. Cache slots past a context are never used (the
vector path scores keys eight at a time). Bad arguments are refused before anything runs. The
engine on the kernel gives the torch backend's greedy tokens.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numba
import numpy as np
import pytest
import torch
from numba import njit

import minivllm
from minivllm import EngineConfig, LLMEngine, SamplingParams, SchedulerConfig
from minivllm.attention import numba_cpu
from minivllm.attention import simd as vector_ops
from minivllm.attention.numba_cpu import (
    QUERY_TILE,
    kernel_array,
    paged_attention_cpu,
    plan_work,
    simd_fits,
    unit_cost,
    warm_up,
)
from minivllm.attention.simd import (
    BFLOAT16_DOTS,
    add8,
    as_element,
    dot16,
    fma8,
    largest_lane,
    load8,
    load16,
    max8,
    prefetch,
    prefetch_l2,
    splat8,
    store8,
    sum8x8,
    zero8,
)
from minivllm.book.kernel_check import alternating_ms, prefill_call
from minivllm.training.corpus import shipped_validation_text

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@njit
def lanes(rows, sums, fused):
    """Each operation of the vector vocabulary once: `sums` gets the rows' eight horizontal sums,
    `fused[4:12]` gets 2.5 * rows[0] + rows[1]. The vectors pass through a list, memory numba
    does not align to 32 bytes: stored as <8 x float> there, this crashed one run in three."""
    prefetch(rows[7], 0)
    prefetch_l2(rows[6], 0)
    v = [load8(rows[i], 0) for i in range(8)]
    store8(sums, 0, sum8x8(v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7]))
    fused[:] = np.nan
    store8(fused, 4, add8(fma8(splat8(np.float32(2.5)), v[0], zero8()), v[1]))


def random_batch(query_lens, context_lens, num_heads, num_kv_heads, head_dim, block_size, seed=0):
    """Random q and caches; each sequence's blocks scattered over a pool with spare blocks."""
    rng = np.random.default_rng(seed)
    blocks_per_seq = [-(-c // block_size) for c in context_lens]
    num_blocks = sum(blocks_per_seq) + 3
    order = rng.permutation(num_blocks)
    tables = np.zeros((len(context_lens), max(blocks_per_seq)), dtype=np.int64)
    taken = 0
    for i, n in enumerate(blocks_per_seq):
        tables[i, :n] = order[taken : taken + n]
        taken += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = rng.standard_normal(shape, dtype=np.float32)
    value_cache = rng.standard_normal(shape, dtype=np.float32)
    q = rng.standard_normal((sum(query_lens), num_heads, head_dim), dtype=np.float32)
    query_start = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int64)
    return q, key_cache, value_cache, tables, np.array(context_lens, dtype=np.int64), query_start


def new_row_slots(tables, query_lens, context_lens, block_size: int) -> np.ndarray:
    """The slots of each sequence's new rows: its last positions, through its block table."""
    return np.array(
        [
            int(tables[seq, p // block_size]) * block_size + p % block_size
            for seq, (n, context) in enumerate(zip(query_lens, context_lens))
            for p in range(context - n, context)
        ]
    )


def reference(q, key_cache, value_cache, tables, context_lens, query_start):
    """Gather each sequence's keys and values through its table; causal softmax in float64."""
    num_heads, dim = q.shape[1:]
    block_size, num_kv_heads = key_cache.shape[1:3]
    group = num_heads // num_kv_heads
    out = np.zeros(q.shape, dtype=np.float64)
    for i, context in enumerate(context_lens):
        slots = [(tables[i, p // block_size], p % block_size) for p in range(context)]
        keys = np.stack([key_cache[b, o] for b, o in slots]).astype(np.float64)  # [ctx, kvh, D]
        values = np.stack([value_cache[b, o] for b, o in slots]).astype(np.float64)
        rows = range(query_start[i], query_start[i + 1])
        for t, row in enumerate(rows):
            visible = context - len(rows) + t + 1
            for h in range(num_heads):
                scores = keys[:visible, h // group] @ q[row, h].astype(np.float64) / np.sqrt(dim)
                weights = np.exp(scores - scores.max())
                out[row, h] = weights @ values[:visible, h // group] / weights.sum()
    return out


def relative_error(*inputs, simd: bool | None = None) -> float:
    out = np.full_like(inputs[0], np.nan)  # poisoned: a row the kernel forgets stays NaN
    paged_attention_cpu(*inputs, out=out, simd=simd)
    expected = reference(*inputs)
    return float(np.abs(out - expected).max() / np.abs(expected).max())


@pytest.fixture(params=[2, 1], ids=["parallel", "serial"])
def numba_threads(request):
    """The parallel kernel (two threads) and the serial one (one thread: a forward worker)."""
    threads = numba.get_num_threads()
    numba.set_num_threads(min(request.param, numba.config.NUMBA_NUM_THREADS))
    yield request.param
    numba.set_num_threads(threads)


@pytest.mark.parametrize("group", [1, 2, 3, 4])
def test_the_wide_values_tile_gives_the_four_vector_ones_bit_for_bit(
    group: int, numba_threads
) -> None:
    """`_values_simd`'s wide tile (eight query vectors at once, where the CPU has AVX-512's 32
    registers) and its four-vector one, both forced, on prefill chunks whose tiles leave 0-7
    vectors over and decodes: the same outputs bit for bit, and the reference's to 1e-5. Either
    tile runs on any CPU (the wide one spills on AVX2's 16 registers: slower, not wrong)."""
    query_lens = [1, 1, 3, 16, 21]
    context_lens = [5, 40, 19, 16, 60]
    inputs = random_batch(query_lens, context_lens, 2 * group, 2, 64, 16, seed=10 + group)
    wide, four = (paged_attention_cpu(*inputs, simd=True, wide_tile=w) for w in (True, False))
    assert np.array_equal(wide, four)
    assert relative_error(*inputs, simd=True) <= 1e-5
    chunk = prefill_call(48, 2 * group, 2, 64, seed=group)  # chapter 07's prefill chunk
    wide, four = (paged_attention_cpu(*chunk, wide_tile=w) for w in (True, False))
    assert np.array_equal(wide, four)
    assert relative_error(*chunk) <= 1e-5


def widened(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bits (int16) as the float32s they stand for."""
    return (bits.astype(np.int32) << 16).view(np.float32)


def as_bfloat16(array: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`array` rounded to bfloat16: as the kernel takes it (its bits, int16) and as float32."""
    rounded = torch.from_numpy(array).to(torch.bfloat16)
    return kernel_array(rounded), rounded.float().numpy()


@pytest.mark.parametrize("simd", [False, True], ids=["plain", "simd"])
@pytest.mark.parametrize("head_dim", [32, 128])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_a_bfloat16_cache_gives_the_float32_one_holding_its_values_bit_for_bit(
    head_dim: int, group: int, simd: bool, numba_threads
) -> None:
    """A bfloat16 cache (handed over as its bits) is widened to float32 as the kernel reads it,
    exactly, and the kernel computes as it does over float32: the output over a bfloat16 cache is
    the output over a float32 cache of the same (rounded) values, bit for bit, on the plain loops
    and the vector paths, through both values tiles. The new rows' K/V reach their slots as the
    same bits."""
    query_lens, context_lens, block_size = [1, 1, 9, 20], [1, 37, 9, 45], 16
    q, key_cache, value_cache, tables, lens, starts = random_batch(
        query_lens, context_lens, 2 * group, 2, head_dim, block_size, seed=group
    )
    keys, keys32 = as_bfloat16(key_cache)
    values, values32 = as_bfloat16(value_cache)
    slots = new_row_slots(tables, query_lens, context_lens, block_size)
    where = (slots // block_size, slots % block_size)
    new_rows = dict(k_new=keys[where], v_new=values[where], slot_mapping=slots)
    keys[where] = 0  # forgotten: the kernel writes them back
    metadata = (tables, lens, starts)
    for wide in (False, True):
        out = paged_attention_cpu(q, keys, values, *metadata, **new_rows, simd=simd, wide_tile=wide)
        expected = paged_attention_cpu(q, keys32, values32, *metadata, simd=simd, wide_tile=wide)
        assert np.array_equal(out, expected)
    assert np.array_equal(keys[where], new_rows["k_new"])
    assert relative_error(q, keys32, values32, tables, lens, starts, simd=simd) <= 1e-5


@pytest.mark.parametrize("simd", [False, True], ids=["plain", "simd"])
@pytest.mark.parametrize("cache_dtype", ["float32", "bfloat16"])
def test_bfloat16_queries_and_output_are_the_float32_ones_widened_and_rounded_as_torch_does(
    cache_dtype: str, simd: bool, numba_threads
) -> None:
    """A bfloat16 model's queries go in as they are (their bits) and its output comes out in
    bfloat16: the same bits as its queries widened to float32, attended, and the float32 output
    rounded by torch (`.to(torch.bfloat16)`, what the backend did before). Decodes, a prefill
    chunk whose tiles stage their rows, a part tile; either cache. (Over a bfloat16 cache, with the
    bfloat16 dot products off: those score in an order of their own, a test below.)"""
    query_lens, context_lens, head_dim = [1, 1, 21, 5], [9, 40, 50, 5], 64
    q, keys, values, tables, lens, starts = random_batch(
        query_lens, context_lens, 4, 2, head_dim, 16, seed=3
    )
    if cache_dtype == "bfloat16":
        keys, values = as_bfloat16(keys)[0], as_bfloat16(values)[0]
    q_bits, q32 = as_bfloat16(q)
    metadata = (keys, values, tables, lens, starts)
    out = paged_attention_cpu(q_bits, *metadata, simd=simd, bfloat16_dots=False)
    expected = torch.from_numpy(paged_attention_cpu(q32, *metadata, simd=simd)).bfloat16()
    assert out.dtype == np.int16 and np.array_equal(out, kernel_array(expected))
    with pytest.raises(ValueError, match="out must be"):
        paged_attention_cpu(q_bits, *metadata, out=np.empty(q.shape[:2], dtype=np.int16))


@pytest.mark.skipif(not BFLOAT16_DOTS, reason="the CPU has no AVX-512 BF16 (vdpbf16ps)")
@pytest.mark.parametrize("group", [1, 2, 4])
def test_bfloat16_dot_products_score_to_float32_rounding(group: int, numba_threads) -> None:
    """bfloat16 queries over a bfloat16 cache, scored by `vdpbf16ps` (the default on such a CPU):
    the float64 reference's output to 1e-5 before rounding to bfloat16 (as the float32 scores
    are), and after it the float32 scores' output but for an element in a few hundred, by one
    bfloat16 step. Decodes, prefill tiles, a part tile, blocks of 8 and 16; a float32 model's
    queries (the backend's fallback) and the `dots=False` setting keep the float32 scores."""
    for block_size, head_dim in ((16, 128), (8, 64)):
        q, keys, values, tables, lens, starts = random_batch(
            [1, 3, 16, 21], [9, 40, 33, 60], 2 * group, 2, head_dim, block_size, seed=group
        )
        (q_bits, q32), (k_bits, k32), (v_bits, v32) = map(as_bfloat16, (q, keys, values))
        metadata = (tables, lens, starts)
        assert numba_cpu.vector_paths(True, True, True) == numba_cpu.BFLOAT16_DOT_PRODUCTS
        wide = paged_attention_cpu(q32, k_bits, v_bits, *metadata, out=np.empty_like(q32))
        dots = paged_attention_cpu(q_bits, k_bits, v_bits, *metadata, out=np.empty_like(q32))
        float32_scores = paged_attention_cpu(q_bits, k_bits, v_bits, *metadata, bfloat16_dots=False)
        expected = reference(q32, k32, v32, *metadata)
        assert np.abs(dots - expected).max() / np.abs(expected).max() <= 1e-5
        assert not np.array_equal(dots, wide)  # the dot products ran
        rounded = paged_attention_cpu(q_bits, k_bits, v_bits, *metadata)
        dotted, scored = (widened(bits) for bits in (rounded, float32_scores))
        difference = np.abs(dotted - scored)
        assert difference.max() <= 2.0**-8 * np.abs(scored).max()  # a bfloat16 step of the largest
        assert (difference > 0).mean() < 0.01


def bfloat16_dots(a, b, out):
    """`out` (eight lanes) plus `dot16` over `a` and `b` (bfloat16 bits), sixteen at a time."""
    total = load8(out, 0)
    for d in range(0, a.shape[0], 16):
        total = dot16(total, load16(a, d), load16(b, d))
    store8(out, 0, total)


@pytest.mark.parametrize("instruction", [True, False], ids=["vdpbf16ps", "plain-code"])
def test_dot16_adds_pairs_of_bfloat16_products_into_eight_lanes(instruction, monkeypatch) -> None:
    """`dot16` -- the instruction, or the plain vector code a CPU without it compiles instead: lane
    i gets a[2i] * b[2i] + a[2i + 1] * b[2i + 1] of each sixteen, added to what it held. Small
    integers, whose sums are exact, and random values against float64."""
    if instruction and not BFLOAT16_DOTS:
        pytest.skip("the CPU has no AVX-512 BF16 (vdpbf16ps)")
    monkeypatch.setattr(vector_ops, "BFLOAT16_DOTS", instruction)  # read as the function compiles
    compiled = njit(bfloat16_dots)
    rng = np.random.default_rng(0)
    for a32, b32 in (
        rng.integers(-8, 9, (2, 48)).astype(np.float32),
        rng.standard_normal((2, 48)).astype(np.float32),
    ):
        (a, a32), (b, b32) = as_bfloat16(a32), as_bfloat16(b32)
        start = rng.integers(-4, 5, 8).astype(np.float32)
        out = start.copy()
        compiled(a, b, out)
        products = (a32.astype(np.float64) * b32).reshape(3, 8, 2).sum(axis=(0, 2))
        np.testing.assert_allclose(out, start + products, rtol=1e-6, atol=1e-6)


@njit(cache=True)
def as_elements(out, values):
    for i in range(values.shape[0]):
        out[i] = as_element(out, values[i])


def test_as_element_rounds_a_float32_to_bfloat16_as_torch_does() -> None:
    """`simd.as_element`: a float32 as it is into a float32 array; into bfloat16 bits, rounded to
    nearest with ties to even, as torch rounds -- ties both ways, the largest values that round
    down and up to infinity, subnormals, signed zeros, infinities; a NaN stays a NaN."""
    bits = np.array(
        [
            0x3F808000,  # a tie between 1.0 and the next bfloat16: to even, down
            0x3F818000,  # a tie whose upper half is odd: up
            0x3F808001,  # just over the tie: up
            0x7F7F7FFF,  # rounds down to the largest bfloat16
            0x7F7FFFFF,  # float32's largest: up to infinity
            0x00008000,  # a subnormal tie: to even (zero)
            0x80018000,  # a negative subnormal tie: up in magnitude
            0x80000000,  # -0.0
            0x7F800000,  # inf
            0xFF800000,  # -inf
        ],
        dtype=np.uint32,
    ).view(np.float32)
    rng = np.random.default_rng(0)
    values = np.concatenate([bits, rng.standard_normal(4096).astype(np.float32) * 1e3])
    rounded = np.empty(len(values), dtype=np.int16)
    as_elements(rounded, values)
    assert np.array_equal(rounded, kernel_array(torch.from_numpy(values).bfloat16()))
    same = np.empty(len(values), dtype=np.float32)
    as_elements(same, values)
    assert np.array_equal(same.view(np.uint32), values.view(np.uint32))
    nan = np.empty(1, dtype=np.int16)
    as_elements(nan, np.array([np.nan], dtype=np.float32))
    assert torch.from_numpy(nan).view(torch.bfloat16).isnan().all()


@pytest.mark.parametrize("cache_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_a_prefill_tiles_rows_give_what_each_gives_as_a_decode_bit_for_bit(
    group: int, cache_dtype: str, numba_threads
) -> None:
    """A prefill tile of STAGE_MIN_VECTORS query vectors or more copies each block's rows of its
    K/V head into float32 scratch once (`_stage_rows`) and scores and weighs them there; a decode
    (fewer vectors) reads the cache itself. Each row of a chunk, attended again as a decode of its
    own over the same keys, gives the same output bit for bit: staging moves the rows, not the
    arithmetic. Chunks of 21 and 16 rows (a tile and a part tile), blocks partly filled."""
    query_lens, context_lens, head_dim = [21, 16], [50, 16], 64
    assert QUERY_TILE * group >= numba_cpu.STAGE_MIN_VECTORS  # the chunks' tiles stage
    q, keys, values, tables, lens, starts = random_batch(
        query_lens, context_lens, 2 * group, 2, head_dim, 16, seed=group
    )
    if cache_dtype == "bfloat16":
        keys, values = as_bfloat16(keys)[0], as_bfloat16(values)[0]
    chunked = paged_attention_cpu(q, keys, values, tables, lens, starts)
    rows = [
        (seq, context - n + r + 1)
        for seq, (n, context) in enumerate(zip(query_lens, lens))
        for r in range(n)
    ]  # each new row as a decode: its sequence, the keys it sees
    decode_tables = np.stack([tables[seq] for seq, _ in rows])
    decode_lens = np.array([seen for _, seen in rows], dtype=np.int64)
    one_row_each = np.arange(len(rows) + 1, dtype=np.int64)
    decoded = paged_attention_cpu(q, keys, values, decode_tables, decode_lens, one_row_each)
    assert np.array_equal(chunked, decoded)


def test_the_backend_on_a_bfloat16_cache_matches_the_torch_reference(target) -> None:
    """The engine's backend over a bfloat16 cache, one layer of decodes and a prefill chunk: the
    same K/V written as the reference writes them (bit for bit), and outputs equal to the
    reference's to bfloat16 rounding (the kernel attends in float32, then rounds once; torch's
    bfloat16 attention rounds along the way). "auto" picks the kernel for such a cache."""
    from minivllm.attention.backend import resolve_backend_name
    from minivllm.attention.batch import VarlenBatch
    from minivllm.attention.numba_cpu import NumbaPagedAttention
    from minivllm.attention.storage import PagedKVStorage
    from minivllm.attention.torch_backend import TorchPagedAttention

    assert resolve_backend_name("auto", "cpu", torch.bfloat16, torch.bfloat16) == "numba"
    config, block_size = target.config, 16
    query_lens, context_lens = [1, 1, 12], [20, 3, 30]
    tables = torch.tensor([[4, 1], [6, 0], [2, 5]])
    slots = torch.from_numpy(new_row_slots(tables, query_lens, context_lens, block_size))
    batch = VarlenBatch(
        input_ids=torch.zeros(len(slots), dtype=torch.long),
        positions=torch.zeros(len(slots), dtype=torch.long),
        slot_mapping=slots,
        query_start=torch.tensor([0, 1, 2, 14]),
        context_lens=torch.tensor(context_lens),
        block_tables=tables,
        num_decodes=2,
        logits_indices=torch.tensor([0, 1, 13]),
        block_size=block_size,
        max_decode_context_len=20,
    )
    generator = torch.Generator().manual_seed(0)
    heads, kv_heads, dim = config.n_heads, config.n_kv_heads, config.head_dim
    q = torch.randn(len(slots), heads, dim, generator=generator).bfloat16()
    k, v = (torch.randn(len(slots), kv_heads, dim, generator=generator).bfloat16() for _ in "kv")
    outputs, pools = [], []
    for backend in (NumbaPagedAttention, TorchPagedAttention):
        storage = PagedKVStorage(config, 8, block_size, dtype=torch.bfloat16)
        torch.manual_seed(1)
        storage.kv.copy_(torch.randn(storage.kv.shape))  # the cached prefixes
        outputs.append(backend(storage, batch)(0, q, k, v))
        pools.append(storage.kv)
    assert outputs[0].dtype == torch.bfloat16
    assert torch.equal(pools[0], pools[1])
    torch.testing.assert_close(outputs[0], outputs[1], rtol=2**-7, atol=2**-7)


@pytest.mark.parametrize("head_dim", [64, 128, 48])
def test_a_decodes_two_query_vectors_give_what_each_gives_alone_bit_for_bit(
    head_dim: int, numba_threads
) -> None:
    """A decode of a model with two query heads per K/V head has two query vectors, which
    `_values_simd` takes as a pair (where head_dim is a multiple of 32); each head alone (a group
    of one, the same K/V) takes the one-vector path. Each accumulator adds the same terms in the
    same order either way: the same outputs bit for bit."""
    query_lens, context_lens = [1, 1, 1], [9, 40, 77]
    q, keys, values, tables, lens, starts = random_batch(
        query_lens, context_lens, 4, 2, head_dim, 16, seed=head_dim
    )
    pairs = paged_attention_cpu(q, keys, values, tables, lens, starts)
    for first in (0, 1):  # heads 0 and 2 (K/V heads 0 and 1), then heads 1 and 3
        alone = np.ascontiguousarray(q[:, first::2])
        assert np.array_equal(
            paged_attention_cpu(alone, keys, values, tables, lens, starts), pairs[:, first::2]
        )
    assert relative_error(q, keys, values, tables, lens, starts) <= 1e-5


def test_alternating_ms_calls_each_in_turn_and_gives_each_its_median() -> None:
    order = []
    medians = alternating_ms({"a": lambda: order.append("a"), "b": lambda: order.append("b")}, 3)
    assert order == ["a", "b"] * 3
    assert list(medians) == ["a", "b"] and all(ms >= 0 for ms in medians.values())


@pytest.mark.exercise("ch07.1")
@pytest.mark.parametrize("simd", [False, True], ids=["plain", "simd"])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_kernel_matches_the_reference(
    block_size: int, head_dim: int, group: int, simd, numba_threads
) -> None:
    # Decodes first (one row; one-token and mid-block contexts), then prefill chunks: a whole
    # prompt, and a chunk over a cached prefix that ends mid-block. Both paths: the plain loops and
    # the vector ones; both kernels: the parallel one and the serial one.
    query_lens = [1, 1, 1, 7, 19]
    context_lens = [1, block_size + 3, 3 * block_size, 7, 2 * block_size + 5]
    inputs = random_batch(query_lens, context_lens, 2 * group, 2, head_dim, block_size, seed=group)
    assert relative_error(*inputs, simd=simd) <= 1e-5


@pytest.mark.exercise("ch07.1")
def test_the_serial_and_parallel_kernels_agree_bit_for_bit() -> None:
    # The same units, in the same order within each, on one thread or two: the same floats.
    inputs = random_batch([1, 1, 5, 40], [9, 70, 21, 60], 8, 2, 32, 16, seed=3)
    threads = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        serial = paged_attention_cpu(*inputs)
        numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
        parallel = paged_attention_cpu(*inputs)
    finally:
        numba.set_num_threads(threads)
    assert np.array_equal(serial, parallel)


@pytest.mark.exercise("ch07.1")
@pytest.mark.parametrize("block_size, head_dim", [(4, 32), (16, 24), (2, 8)])
def test_shapes_the_vector_paths_cannot_take_run_the_plain_loops(block_size, head_dim) -> None:
    assert not simd_fits(head_dim, block_size)
    inputs = random_batch([1, 1, 6], [1, 11, 13], 4, 2, head_dim, block_size, seed=5)
    assert relative_error(*inputs) <= 1e-5  # the default picks the plain loops
    with pytest.raises(ValueError, match="simd=False"):
        paged_attention_cpu(*inputs, simd=True)


@pytest.mark.exercise("ch07.1")
@pytest.mark.parametrize("simd", [False, True], ids=["plain", "simd"])
def test_slots_past_a_context_are_never_read(simd: bool) -> None:
    # The vector path scores keys eight at a time, so it computes scores past a context's end
    # inside its last block: NaN in every slot past the contexts must not reach the output.
    q, key_cache, value_cache, tables, lens, starts = random_batch(
        [1, 3, 1], [5, 11, 17], 8, 2, 32, 8
    )
    for i, context in enumerate(lens):
        last, used = tables[i, (context - 1) // 8], context % 8
        if used:
            key_cache[last, used:] = value_cache[last, used:] = np.nan
    assert relative_error(q, key_cache, value_cache, tables, lens, starts, simd=simd) <= 1e-5


def test_a_parallel_launch_whose_threads_stopped_early_is_not_returned_as_a_result() -> None:
    # numba's worker threads drop an exception they raise: the parallel kernel says so by its
    # result, and `_launch` reruns the work on the calling thread, where an exception is raised.
    # Here the serial rerun succeeds, so the launch cannot say what went wrong, but it must not
    # pass the output off as computed.
    inputs = random_batch([1, 2], [5, 9], 4, 2, 32, 8)
    work = plan_work(inputs[4], inputs[5], 2, 2)
    empty_rows = np.empty((0, 2, 32), dtype=np.float32)
    args = (np.empty_like(inputs[0]), inputs[0], empty_rows, empty_rows, np.empty(0, np.int64))
    with pytest.raises(RuntimeError, match="stopped early"):
        numba_cpu._launch(lambda *_: False, *args, *inputs[1:], *work, np.float32(0.2), True)


def test_the_vector_vocabulary_lane_by_lane() -> None:
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((8, 8), dtype=np.float32)
    sums, fused = np.empty(8, dtype=np.float32), np.empty(16, dtype=np.float32)
    lanes(rows, sums, fused)
    np.testing.assert_allclose(sums, rows.sum(axis=1), rtol=1e-6)  # lane i: row i's sum
    np.testing.assert_allclose(fused[4:12], rows[0] * np.float32(2.5) + rows[1], rtol=1e-6)
    assert np.isnan(fused[:4]).all() and np.isnan(fused[12:]).all()  # store8 wrote its 8 only


@njit
def lane_maxima(a, b):
    return largest_lane(load8(a, 0)), largest_lane(max8(load8(a, 0), load8(b, 0)))


def test_the_largest_score_of_a_row_by_lanes_and_the_rest() -> None:
    """`max8` lane by lane and `largest_lane` across them; the softmax's `_largest` over every
    length 1 .. 40 (whole groups of eight, the rest alone), wherever the largest falls."""
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((2, 8), dtype=np.float32)
    assert lane_maxima(a, b) == (a.max(), np.maximum(a, b).max())
    for n in range(1, 41):
        for where in (0, n // 2, n - 1):
            row = rng.standard_normal(48, dtype=np.float32) - 10
            row[where], row[n:] = 5.0 + n, 100.0  # past n: never looked at
            assert numba_cpu._largest(row, n) == row[:n].max(), (n, where)


def test_a_nan_key_reaches_the_output() -> None:
    """The max passes over a NaN score, but its exponential is NaN: the row's output is NaN, as
    the reference's, not a softmax quietly computed without that key."""
    q, key_cache, value_cache, tables, context_lens, query_start = random_batch(
        [1], [40], 4, 2, 32, 8
    )
    key_cache[tables[0, 2], 3, 1] = np.nan  # key 19 of K/V head 1
    out = paged_attention_cpu(q, key_cache, value_cache, tables, context_lens, query_start)
    assert np.isnan(out[0, 2:]).all() and not np.isnan(out[0, :2]).any()


@pytest.mark.exercise("ch07.1")
def test_a_long_context_and_a_single_sequence() -> None:
    inputs = random_batch([1], [1000], 8, 2, 32, 16, seed=7)
    assert relative_error(*inputs) <= 1e-5


@pytest.mark.exercise("ch07.1")
def test_values_far_from_zero_do_not_overflow_the_softmax() -> None:
    q, key_cache, value_cache, tables, lens, starts = random_batch([1, 5], [40, 9], 4, 2, 32, 16)
    q *= 30.0  # scores of several hundred: exp() would overflow without the running max
    assert relative_error(q, key_cache, value_cache, tables, lens, starts) <= 1e-5


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: a.update(q=a["q"].astype(np.float64)), "float32"),
        (lambda a: a.update(context_lens=a["context_lens"] + 100), "block table"),
        (lambda a: a["tables"].__setitem__((0, 0), 999), "outside the pool"),
        (lambda a: a.update(query_start=a["query_start"][:-1]), "query_start"),
        (lambda a: a.update(query_start=np.array([0, 2, 1, 3])), "query_start"),
        (lambda a: a.update(q=a["q"][:, :3]), "heads"),
        (lambda a: a.update(key_cache=a["key_cache"].astype(np.float64)), "bfloat16 bits"),
        (
            lambda a: a.update(
                value_cache=kernel_array(torch.from_numpy(a["value_cache"]).bfloat16())
            ),
            "value_cache",
        ),
    ],
)
def test_bad_arguments_are_refused_before_anything_runs(change, message: str) -> None:
    names = ("q", "key_cache", "value_cache", "tables", "context_lens", "query_start")
    args = dict(zip(names, random_batch([1, 1, 1], [5, 9, 17], 4, 2, 32, 8)))
    change(args)
    out = np.full((3, 4, 32), np.nan, dtype=np.float32)
    with pytest.raises(ValueError, match=message):
        paged_attention_cpu(*args.values(), out=out)
    assert np.isnan(out).all()  # nothing was written


def test_new_keys_and_values_are_written_to_their_slots_in_the_same_call() -> None:
    # A decode and a prefill chunk longer than a query tile: the new rows' K/V arrive separately and
    # the kernel writes them through the slot mapping before anyone attends them.
    query_lens, context_lens, block_size = [1, 2 * QUERY_TILE + 3], [21, 2 * QUERY_TILE + 9], 8
    q, key_cache, value_cache, tables, lens, starts = random_batch(
        query_lens, context_lens, 4, 2, 32, block_size, seed=3
    )
    slots = new_row_slots(tables, query_lens, context_lens, block_size)
    k_new = np.stack([key_cache[s // block_size, s % block_size] for s in slots])
    v_new = np.stack([value_cache[s // block_size, s % block_size] for s in slots])
    expected = reference(q, key_cache, value_cache, tables, lens, starts)
    for s in slots:  # forget the new rows: the kernel must bring them
        key_cache[s // block_size, s % block_size] = np.nan
        value_cache[s // block_size, s % block_size] = np.nan
    out = paged_attention_cpu(
        q,
        key_cache,
        value_cache,
        tables,
        lens,
        starts,
        k_new=k_new,
        v_new=v_new,
        slot_mapping=slots,
    )
    assert np.abs(out - expected).max() / np.abs(expected).max() <= 1e-5
    assert np.array_equal(
        np.stack([key_cache[s // block_size, s % block_size] for s in slots]), k_new
    )


def test_a_slot_outside_the_cache_is_refused_before_anything_is_written() -> None:
    q, key_cache, value_cache, tables, lens, starts = random_batch([1, 1], [5, 9], 4, 2, 32, 8)
    before = key_cache.copy()
    k_new = np.ones((2, 2, 32), dtype=np.float32)
    with pytest.raises(ValueError, match="slot"):
        paged_attention_cpu(
            q,
            key_cache,
            value_cache,
            tables,
            lens,
            starts,
            k_new=k_new,
            v_new=k_new,
            slot_mapping=np.array([3, key_cache.shape[0] * 8]),
        )
    assert np.array_equal(key_cache, before)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_work_plan_covers_every_row_and_head_once_and_balances_the_threads(threads) -> None:
    query_lens = np.array([1] * 40 + [3 * QUERY_TILE + 5, 70, 2])
    context_lens = query_lens + np.arange(len(query_lens)) * 7
    starts = np.concatenate([[0], np.cumsum(query_lens)])
    work, work_start = plan_work(context_lens, starts, 2, threads)
    assert work_start[0] == 0 and work_start[-1] == len(work) and len(work_start) == threads + 1
    covered = sorted((s, t, h) for s, t0, t1, h in work.tolist() for t in range(t0, t1))
    expected = sorted((s, t, h) for s, n in enumerate(query_lens) for t in range(n) for h in (0, 1))
    assert covered == expected
    assert (work[:, 2] - work[:, 1] <= QUERY_TILE).all()
    cost = unit_cost(work, context_lens, starts)
    loads = [cost[a:b].sum() for a, b in zip(work_start[:-1], work_start[1:])]
    assert max(loads) - min(loads) <= cost.max()  # no thread is left with more than one extra unit


@pytest.mark.parametrize("threads", [2, 3])
def test_a_pass_of_decodes_gives_each_sequences_heads_to_one_thread(threads) -> None:
    """Decodes alone, two or more for every thread: each thread holds every K/V head of the
    sequences it has (it reads their blocks whole), the threads within one sequence's cost of each
    other. One decode, or a pass with a prefill chunk, is dealt head by head as before."""
    context_lens = np.arange(40) * 7 + 20
    starts = np.arange(41)
    work, work_start = plan_work(context_lens, starts, 4, threads)
    cost = unit_cost(work, context_lens, starts)
    loads = [cost[a:b].sum() for a, b in zip(work_start[:-1], work_start[1:])]
    assert max(loads) - min(loads) <= 4 * cost.max()
    for a, b in zip(work_start[:-1], work_start[1:]):
        held = sorted((s, h) for s, _, _, h in work[a:b].tolist())
        assert held == sorted((s, h) for s in {s for s, *_ in held} for h in range(4))
    work, work_start = plan_work(np.array([300]), np.array([0, 1]), 4, 2)
    assert np.diff(work_start).tolist() == [2, 2]  # a lone decode: both threads work
    mixed, mixed_start = plan_work(np.append(context_lens, 64), np.append(starts, 64 + 40), 4, 2)
    first = [(s, h) for s, _, _, h in mixed[: mixed_start[1]].tolist()]
    assert any(len({h for t, h in first if t == s}) < 4 for s, _ in first)  # split by head


def test_a_pass_too_small_to_wake_a_second_thread_runs_on_one(monkeypatch) -> None:
    """The backend's pick: the parallel kernel only for a pass costing PARALLEL_MIN_COST or more
    (query rows x keys they see, over the K/V heads); `pass_cost` adds up plan_work's units."""
    from minivllm.attention.batch import VarlenBatch
    from minivllm.attention.numba_cpu import NumbaPagedAttention, pass_cost
    from minivllm.attention.storage import PagedKVStorage
    from minivllm.model.transformer import ModelConfig

    query_lens = np.array([1, 1, 40])
    context_lens = np.array([30, 7, 40])
    starts = np.concatenate([[0], np.cumsum(query_lens)])
    work, _ = plan_work(context_lens, starts, 2, 2)
    assert pass_cost(context_lens, starts, 2) == unit_cost(work, context_lens, starts).sum()
    config = ModelConfig(n_layers=1)
    storage = PagedKVStorage(config, 8, 16, dtype=torch.float32)
    batch = VarlenBatch(
        input_ids=torch.zeros(42, dtype=torch.long),
        positions=torch.zeros(42, dtype=torch.long),
        slot_mapping=torch.arange(42),
        query_start=torch.from_numpy(starts),
        context_lens=torch.from_numpy(context_lens),
        block_tables=torch.arange(9).reshape(3, 3) % 8,
        logits_indices=torch.tensor([0, 1, 41]),
        num_decodes=2,
        block_size=16,
        max_decode_context_len=30,
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        if numba.config.NUMBA_NUM_THREADS < 2:
            pytest.skip("numba allows one thread in this process")
        monkeypatch.setattr(numba_cpu, "PARALLEL_MIN_COST", pass_cost(context_lens, starts, 2))
        assert NumbaPagedAttention(storage, batch).kernel is numba_cpu._paged_attention_kernel
        monkeypatch.setattr(numba_cpu, "PARALLEL_MIN_COST", numba_cpu.PARALLEL_MIN_COST + 1)
        assert NumbaPagedAttention(storage, batch).kernel is numba_cpu._paged_attention_serial
    finally:
        torch.set_num_threads(threads)


def test_a_decode_pass_a_token_on_from_the_last_deals_its_units_as_the_last_did() -> None:
    """The backend plans its units (`plan_work`) once for a run of decode passes: a pass of the
    same sequences, each a token further on, is dealt as the last was -- its units each cost one
    more, so the deal by cost stands, and it is the plan `plan_work` makes for it. Any other pass
    (another set of sequences, a prefill chunk, another thread count) is planned anew."""
    from minivllm.attention.batch import VarlenBatch
    from minivllm.attention.numba_cpu import NumbaPagedAttention
    from minivllm.attention.storage import PagedKVStorage
    from minivllm.model.transformer import ModelConfig

    storage = PagedKVStorage(ModelConfig(n_layers=1), 64, 16, dtype=torch.float32)

    def decode_pass(context_lens, query_lens=None):
        context_lens = np.array(context_lens)
        query_lens = np.ones_like(context_lens) if query_lens is None else np.array(query_lens)
        starts = np.concatenate([[0], np.cumsum(query_lens)])
        rows = int(starts[-1])
        blocks = -(-int(context_lens.max()) // 16)
        batch = VarlenBatch(
            input_ids=torch.zeros(rows, dtype=torch.long),
            positions=torch.zeros(rows, dtype=torch.long),
            slot_mapping=torch.arange(rows),
            query_start=torch.from_numpy(starts),
            context_lens=torch.from_numpy(context_lens),
            block_tables=torch.arange(len(context_lens) * blocks).reshape(-1, blocks) % 64,
            logits_indices=torch.from_numpy(starts[1:] - 1),
            num_decodes=int((query_lens == 1).sum()),
            block_size=16,
            max_decode_context_len=int(context_lens.max()),
        )
        backend = NumbaPagedAttention(storage, batch)
        planned = plan_work(context_lens, starts, 2, len(backend.work[1]) - 1)
        for made, expected in zip(backend.work, planned):
            np.testing.assert_array_equal(made, expected)
        return backend.work

    lens = [90, 30, 200, 7, 64, 120, 33, 18]
    first = decode_pass(lens)
    assert decode_pass([n + 1 for n in lens])[0] is first[0]  # the same plan, not a new one
    assert decode_pass([n + 2 for n in lens])[0] is first[0]
    assert decode_pass([n + 2 for n in lens])[0] is not first[0]  # not a token on: planned anew
    again = decode_pass(lens[:-1])  # a sequence finished
    assert again[0] is not first[0]
    decode_pass([n + 1 for n in lens[:-1]], [1] * 6 + [20])  # a prefill chunk among them
    assert decode_pass([n + 2 for n in lens[:-1]])[0] is not again[0]


def test_warm_up_compiles_or_loads_the_kernel() -> None:
    warm_up()  # no error, and the next call needs no compilation
    assert relative_error(*random_batch([1], [3], 2, 1, 32, 8)) <= 1e-5


def test_the_engine_on_the_kernel_gives_the_torch_backends_greedy_tokens(target) -> None:
    text = shipped_validation_text()
    prompts = [text[i * 400 : i * 400 + 30 + 23 * i] for i in range(12)]
    params = [SamplingParams(max_tokens=24 + 4 * i, temperature=0) for i in range(12)]

    def run(backend: str):
        config = EngineConfig(
            device="cpu",  # the numba kernel is a CPU kernel, on a GPU machine too
            num_blocks=128,
            block_size=16,
            attention_backend=backend,
            scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
        )
        return [o.token_ids for o in LLMEngine(target, config).generate(prompts, params)]

    assert run("numba") == run("torch")


def test_the_cuda_simulator_still_starts_after_the_cpu_kernel_imported_numba() -> None:
    code = (
        "import minivllm.attention.numba_cpu\n"
        "from minivllm.attention.cuda.simulator import SIMULATOR\n"
        "import torch\n"
        "assert SIMULATOR or torch.cuda.is_available()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)


def test_the_backend_refuses_a_cache_it_cannot_read() -> None:
    from minivllm.attention.numba_cpu import NumbaPagedAttention
    from minivllm.attention.storage import PagedKVStorage
    from minivllm.model.transformer import ModelConfig

    storage = PagedKVStorage(ModelConfig(n_layers=1), 4, 16, dtype=torch.float16)
    with pytest.raises(ValueError, match="float32"):
        NumbaPagedAttention(storage, batch=None)


@pytest.mark.parametrize(
    "preset, first, expected",
    [(None, "minivllm", "PASSIVE"), ("ACTIVE", "minivllm", "ACTIVE"), (None, "torch", "unset")],
)
def test_importing_minivllm_before_torch_makes_torchs_idle_threads_sleep(
    preset: str | None, first: str, expected: str
) -> None:
    """libgomp reads OMP_WAIT_POLICY once, when torch loads: the package sets PASSIVE when torch has
    not loaded yet, leaves a value the user chose alone, and after torch changes nothing (so the
    environment still says what torch got)."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if preset is not None:
        env["OMP_WAIT_POLICY"] = preset
    second = "torch" if first == "minivllm" else "minivllm"
    code = f"import os, {first}, {second}; print(os.environ.get('OMP_WAIT_POLICY', 'unset'))"
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True
    )
    assert done.stdout.strip() == expected


SPIN_PROBE = """
import os
import minivllm
from minivllm.attention import numba_cpu
numba_cpu.warm_up(2)
print(os.environ.get("GOMP_SPINCOUNT", "unset"))
"""


@pytest.mark.parametrize("preset", [None, minivllm.SHORT_SPIN_COUNT, "777"])
def test_a_spin_count_reaches_torchs_threads_and_not_numbas_libgomp(preset: str | None) -> None:
    """Two libgomps load in the engine's process, torch's and the one numba names, and each prints
    the settings it read (OMP_DISPLAY_ENV). Where no wait policy is set, minivllm's short spin
    reaches torch's threads; a spin count the user exports does instead; either way the second
    reads none, while the environment still says what torch got. (With torch's pip build numba's
    OpenMP calls bind to torch's libgomp, loaded first, and its kernels run on torch's threads:
    `model/numba_threads.py`.)"""
    try:
        import numba.np.ufunc.omppool  # noqa: F401
    except ImportError:
        pytest.skip("numba finds no libgomp here: its threads are the workqueue's")
    unset = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "NUMBA_THREADING_LAYER")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    env.update(OMP_DISPLAY_ENV="VERBOSE", NUMBA_NUM_THREADS="2")
    if preset is not None:
        env["GOMP_SPINCOUNT"] = preset
    done = subprocess.run(
        [sys.executable, "-c", SPIN_PROBE], env=env, capture_output=True, text=True, check=True
    )
    read = re.findall(r"GOMP_SPINCOUNT = '(\d+)'", done.stderr)
    torchs = preset or minivllm.SHORT_SPIN_COUNT
    assert read == [torchs, "0"], done.stderr[-2000:]  # torch's libgomp loads first
    assert done.stdout.split()[-1] == torchs


LAYER_PROBE = """
import numba
from minivllm.attention import numba_cpu
numba_cpu.warm_up(2)
print(numba.threading_layer(), numba_cpu.openmp_layer(), numba_cpu.PARALLEL_MIN_COST)
"""


@pytest.mark.parametrize("policy", ["PASSIVE", "ACTIVE"])
def test_the_threading_layer_is_openmp_only_where_its_threads_sleep(policy: str) -> None:
    """OpenMP's idle threads sleep at once only with OMP_WAIT_POLICY=PASSIVE: then numba runs its
    parallel kernel there, and small passes go parallel sooner; otherwise, the workqueue. Each
    layer has its own default threshold, and `openmp_layer` says which one a process got."""
    try:
        import numba.np.ufunc.omppool  # noqa: F401
    except ImportError:
        if policy == "PASSIVE":
            pytest.skip("numba finds no libgomp here: the workqueue layer is the only choice")
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("NUMBA_THREADING_LAYER", "NUMBA_THREADING_LAYER_PRIORITY")
        and key != "MINIVLLM_PARALLEL_MIN_COST"
    }
    env.update(OMP_WAIT_POLICY=policy, NUMBA_NUM_THREADS="2")
    done = subprocess.run(
        [sys.executable, "-c", LAYER_PROBE], env=env, capture_output=True, text=True, check=True
    )
    layer, openmp, threshold = done.stdout.split()
    expected = ("omp", "True", str(4 * 1024)) if policy == "PASSIVE" else ("workqueue", "False")
    assert (layer, openmp, threshold)[: len(expected)] == expected, done.stdout
    if policy == "ACTIVE":
        assert threshold == str(128 * 1024)


def test_a_threshold_that_is_not_a_number_is_refused_by_name() -> None:
    env = {**os.environ, "MINIVLLM_PARALLEL_MIN_COST": "lots"}
    done = subprocess.run(
        [sys.executable, "-c", "import minivllm.attention.numba_cpu"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode != 0
    assert "MINIVLLM_PARALLEL_MIN_COST must be a whole number" in done.stderr
    assert "'lots'" in done.stderr


POOL_PROBE = """
import torch
from minivllm.attention import numba_cpu
torch.set_num_threads(2)
# torch applies its count to this thread's OpenMP setting once, lazily: here, or at an engine's
# first parallel op -- which always comes before the first kernel
assert torch.get_num_threads() == 2
{start}
print(torch.get_num_threads())
"""


@pytest.mark.parametrize(
    "start", ["numba_cpu.warm_up(2)", "numba_cpu.default_threads()", "numba_cpu.warm_up()"]
)
def test_starting_numbas_thread_pool_leaves_torchs_thread_count(start: str) -> None:
    """numba's OpenMP layer starts its pool by setting the process's OpenMP thread count to
    NUMBA_NUM_THREADS (every core), where torch reads its own: with more cores than torch was told
    to use, torch would run on all of them after the first parallel kernel. Here numba is allowed
    4 threads and torch 2; however the pool starts, torch keeps 2."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_THREADING_LAYER"}
    env.update(NUMBA_NUM_THREADS="4", OMP_WAIT_POLICY="PASSIVE")
    code = POOL_PROBE.format(start=start)
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert done.stdout.split()[-1] == "2", done.stdout
