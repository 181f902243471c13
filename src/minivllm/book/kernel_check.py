"""Checking a paged-attention kernel: inputs that can catch it out, and what it must compute
(chapters 07 and 08).

A kernel that reads the wrong slot of a zero-filled cache, or of blocks laid out in order, can still
give the right answer. So `random_inputs` fills everything with fresh random numbers and scatters
each sequence's blocks over the pool in shuffled order, leaving spare blocks nobody owns;
`kernel_error` poisons the output with NaN before the launch, so an element the kernel forgets to
write cannot pass, and compares with `reference_attention`: gather each sequence's K/V through its
block table, then the model's own plain softmax attention. The tests, chapters 07 and 08 and the
benchmark all check the kernels here. `decode_call` and `prefill_call` are the CPU kernel's
arguments for a decode batch and a prefill chunk, and `alternating_ms` times calls against each
other as chapter 07 does.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as SequenceOf

import numpy as np
import torch

from minivllm.attention.cuda.launch import (
    DEFAULT_THREADS,
    grouped_paged_attention,
    paged_attention,
)
from minivllm.model.transformer import ModelConfig, attention_reference


def random_inputs(
    context_lens: SequenceOf[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    spare_blocks: int = 2,
    device: str = "cpu",
) -> list[torch.Tensor]:
    """[q, key_cache, value_cache, block_tables, context_lens] for one decode query per sequence, in
    the kernel's layout; every sequence's blocks are scattered over a pool with `spare_blocks`
    unowned ones."""
    generator = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    q = torch.randn(len(context_lens), num_heads, head_dim, generator=generator)
    key_cache, value_cache = (
        torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=generator)
        for _ in range(2)
    )
    order = torch.randperm(num_blocks, generator=generator)
    tables = torch.zeros(len(context_lens), max(blocks_per_seq), dtype=torch.int32)
    used = 0
    for seq, count in enumerate(blocks_per_seq):
        tables[seq, :count] = order[used : used + count]
        used += count
    lens = torch.tensor(list(context_lens), dtype=torch.int32)
    return [
        t.to(device)
        for t in (q.to(dtype), key_cache.to(dtype), value_cache.to(dtype), tables, lens)
    ]


def decode_call(
    context_lens: SequenceOf[int], config: ModelConfig, seed: int = 1, spare_blocks: int = 2000
) -> tuple[np.ndarray, ...]:
    """`paged_attention_cpu`'s positional arguments for one decode query per sequence of a model
    shaped like `config`, in blocks of 16: (q, key_cache, value_cache, block_tables,
    context_lens, query_start), float32 and int numpy arrays, from `random_inputs`."""
    tensors = random_inputs(
        context_lens,
        config.n_heads,
        config.n_kv_heads,
        config.head_dim,
        16,
        seed=seed,
        spare_blocks=spare_blocks,
    )
    return (*(t.numpy() for t in tensors), np.arange(len(context_lens) + 1))


def prefill_call(
    rows: int, num_heads: int, num_kv_heads: int, head_dim: int, seed: int = 2
) -> tuple[np.ndarray, ...]:
    """`paged_attention_cpu`'s positional arguments for one sequence's prefill chunk of `rows` new
    tokens (a multiple of 16) and nothing cached before them: q, a pool of 16-slot blocks with two
    to spare, its block table (the blocks scattered over the pool), context_lens, query_start."""
    rng = np.random.default_rng(seed)
    blocks = rows // 16
    pool_shape = (blocks + 2, 16, num_kv_heads, head_dim)
    return (
        rng.standard_normal((rows, num_heads, head_dim), dtype=np.float32),
        rng.standard_normal(pool_shape, dtype=np.float32),
        rng.standard_normal(pool_shape, dtype=np.float32),
        rng.permutation(blocks + 2)[None, :blocks],
        np.array([rows]),
        np.array([0, rows]),
    )


def alternating_ms(calls: dict, rounds: int = 30) -> dict:
    """The median milliseconds of each of `calls` (name -> a function of no arguments), called in
    turn `rounds` times: alternating, so a shared machine's slow spells fall on all of them."""
    times: dict = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            started = time.perf_counter()
            call()
            times[name].append(1e3 * (time.perf_counter() - started))
    return {name: float(np.median(ms)) for name, ms in times.items()}


def reference_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """What the kernels compute, the plain way, on the CPU in `dtype` (`kernel_error` uses
    float64): gather each sequence's K/V through its block table, then the model's softmax attention
    (grouped-query: it repeats the K/V heads)."""
    block_size = key_cache.shape[1]
    out = torch.empty(q.shape, dtype=dtype)
    for seq, length in enumerate(context_lens.tolist()):
        positions = torch.arange(length)
        blocks, slots = (
            block_tables[seq].cpu().long()[positions // block_size],
            positions % block_size,
        )
        keys, values = (
            key_cache.cpu().to(dtype)[blocks, slots],
            value_cache.cpu().to(dtype)[blocks, slots],
        )
        out[seq] = attention_reference(
            q[seq].cpu().to(dtype)[None], keys, values, torch.ones(1, length, dtype=torch.bool)
        )[0]
    return out


def kernel_error(
    inputs: SequenceOf[torch.Tensor],
    partition_size: int | None = None,
    threads: int = DEFAULT_THREADS,
    grouped: bool = False,
    lanes_per_token: int | None = None,
    version: str = "v3",
    tile: int | None = None,
) -> float:
    """Launch the kernel on `inputs` into a NaN-poisoned output; its max error relative to the
    reference's largest element. v1 (v2 with a `partition_size`), or with `grouped` v3 (its split
    form with a `partition_size`; v4 and its `tile` with `version="v4"`). Raises AssertionError if
    the kernel left any output element unwritten."""
    out = torch.full_like(inputs[0], float("nan"))
    if grouped:
        longest = int(inputs[4].max())  # the host knows it; here the inputs are ours to read
        grouped_paged_attention(
            *inputs,
            max_context_len=longest,
            partition_size=partition_size,
            threads=threads,
            lanes_per_token=lanes_per_token,
            out=out,
            version=version,
            tile=tile,
        )
    else:
        paged_attention(*inputs, partition_size=partition_size, threads=threads, out=out)
    unwritten = int(out.isnan().sum())
    assert unwritten == 0, f"the kernel left {unwritten} output elements unwritten"
    expected = reference_attention(*inputs, dtype=torch.float64)
    return float((out.cpu().double() - expected).abs().max() / expected.abs().max())
