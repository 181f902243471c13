"""Launching chapter 07's kernels from torch tensors: argument checks, grid and shared-memory
sizes, v1 (one block per sequence and head) or v2 (partitions, then the merge)."""

from __future__ import annotations

import torch

from minivllm.attention.cuda.kernels import (
    merge_partitions,
    paged_attention_v1,
    paged_attention_v2,
)
from minivllm.attention.cuda.simulator import WARP_SIZE, _simulator_pace

# -- launchers -------------------------------------------------------------------------------------
DEFAULT_THREADS = 128  # 4 warps per block


def shared_bytes(head_dim: int, threads: int, tokens: int) -> int:
    """Dynamic shared memory one thread block needs (float32): the scaled query, one reduction slot
    per
    warp, and a score for each of the `tokens` it attends to."""
    return (head_dim + threads // WARP_SIZE + tokens) * 4


def _kernel_arg(tensor: torch.Tensor):
    """What a kernel takes: the CUDA tensor itself (numba reads it in place, no copy), or on the
    simulator the CPU tensor's numpy view (the simulator copies it in and back out, as it emulates
    device memory)."""
    if not tensor.is_contiguous():
        raise ValueError(f"kernel arguments must be contiguous, got strides {tensor.stride()}")
    return tensor if tensor.is_cuda else tensor.numpy()


def _check(q, key_cache, value_cache, block_tables, context_lens, threads) -> int:
    num_seqs, num_heads, head_dim = q.shape
    if (
        key_cache.shape != value_cache.shape
        or key_cache.dim() != 4
        or key_cache.shape[3] != head_dim
    ):
        raise ValueError(
            f"caches must both be [num_blocks, block_size, n_kv_heads, {head_dim}], got "
            f"{tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
        )
    if num_heads % key_cache.shape[2]:
        raise ValueError(
            f"{num_heads} query heads cannot share {key_cache.shape[2]} K/V heads evenly"
        )
    if block_tables.shape[0] != num_seqs or context_lens.shape != (num_seqs,):
        raise ValueError(
            f"block_tables [{num_seqs}, max_blocks] and context_lens [{num_seqs}] expected, got "
            f"{tuple(block_tables.shape)} and {tuple(context_lens.shape)}"
        )
    if (
        int(context_lens.min()) < 1
        or int(context_lens.max()) > block_tables.shape[1] * key_cache.shape[1]
    ):
        raise ValueError(
            f"context lengths must be in 1..{block_tables.shape[1] * key_cache.shape[1]} "
            f"(the block tables' capacity), got {context_lens.tolist()}"
        )
    if threads % WARP_SIZE or threads < WARP_SIZE:
        raise ValueError(f"threads per block must be a multiple of {WARP_SIZE}, got {threads}")
    return num_heads // key_cache.shape[2]


def paged_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float | None = None,
    partition_size: int | None = None,
    threads: int = DEFAULT_THREADS,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query per sequence, `q` `[num_seqs, num_heads, head_dim]`, against its cached keys and
    values: `key_cache`, `value_cache` `[num_blocks, block_size, n_kv_heads, head_dim]`,
    `block_tables` `[num_seqs, max_blocks]` and `context_lens` `[num_seqs]` (int32).
    `partition_size=None` runs v1; a number of tokens runs v2 with that partition size, then the
    merge. Returns `[num_seqs, num_heads, head_dim]`."""
    group = _check(q, key_cache, value_cache, block_tables, context_lens, threads)
    num_seqs, num_heads, head_dim = q.shape
    scale = head_dim**-0.5 if scale is None else scale
    out = torch.empty_like(q) if out is None else out
    tables, lens = (
        block_tables.to(torch.int32).contiguous(),
        context_lens.to(torch.int32).contiguous(),
    )
    longest = int(context_lens.max())
    args = [_kernel_arg(t) for t in (q, key_cache, value_cache, tables, lens)]
    if partition_size is None:
        shared = shared_bytes(head_dim, threads, longest)
        with _simulator_pace():
            paged_attention_v1[(num_seqs, num_heads), threads, 0, shared](
                _kernel_arg(out), *args, scale, group
            )
        return out
    parts = -(-longest // partition_size)
    partial = torch.empty(
        num_seqs, num_heads, parts, head_dim, dtype=torch.float32, device=q.device
    )
    max_logits = torch.empty(num_seqs, num_heads, parts, dtype=torch.float32, device=q.device)
    exp_sums = torch.empty_like(max_logits)
    shared = shared_bytes(head_dim, threads, partition_size)
    with _simulator_pace():
        paged_attention_v2[(num_seqs, num_heads, parts), threads, 0, shared](
            _kernel_arg(partial),
            _kernel_arg(max_logits),
            _kernel_arg(exp_sums),
            *args,
            scale,
            group,
            partition_size,
        )
        merge_partitions[(num_seqs, num_heads), min(threads, 128)](
            _kernel_arg(out), _kernel_arg(partial), _kernel_arg(max_logits), _kernel_arg(exp_sums)
        )
    return out
