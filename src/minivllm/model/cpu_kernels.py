"""RoPE and RMSNorm on the CPU as one compiled loop each, between a layer's matmuls (issue 32).

At batch 64 a layer of the book's model spends as long in its elementwise steps as in its
matmuls, although they move a few hundred KiB: rotating q and k by position (`apply_rope`) is
seven torch ops per tensor, each a pass over memory, an allocation and an OpenMP launch of a few
microseconds. vLLM's CPU build runs them as custom C++ ops (`rotary_embedding`); here numba
compiles each to one loop over the rows, on the calling thread.

`rope_qk` is `apply_rope` on q and k at once. It computes each output element as `apply_rope`
does -- `x * cos + rotated * sin`, each product rounded to float32, then the sum (no fused
multiply-add: no `fastmath`) -- so its result is `apply_rope`'s bit for bit (`tests/test_fused.py`
checks it), and the engine's tokens do not move.

`rms_norm` is a real checkpoint's RMSNorm (vLLM's `rms_norm` op). torch's one `rms_norm` op is
still a composite on the CPU -- square, mean, add, rsqrt, two products -- and a 512-token prefill
chunk of Qwen3-0.6B (hidden 1024) took 1.6 ms a norm with it against 0.09 ms in this loop, on the
book's 2-core machine (AMD EPYC Zen 4): 113 norms a chunk. Its sum of squares runs in vector lanes
(`fastmath`), in an order of its own: equal to torch's to float32 rounding, not bit for bit. So the
fused model takes it only where the logits are not bit for bit already: a model whose matmuls run
packed (`fused.pack_weights`).

The fused model (`model/fused.py`) calls them for float32 tensors in CPU memory, on one flattened
batch of rows (an engine's `[tokens, heads, head_dim]`), and imports this module only then: an
engine on a GPU never loads numba. Elsewhere -- a GPU, half precision, chapter 00's `[B, T]`
batches -- the fused model keeps the torch ops.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit

# Reassociation lets LLVM keep a row's sum of squares in several vector lanes at once.
FASTMATH = {"reassoc", "contract", "nsz", "arcp"}


@njit(cache=True, nogil=True)
def _rotate(x, cos, sin, out):
    """out = x rotated pairwise by (cos, sin): `apply_rope`'s arithmetic, element by element.
    x `[tokens, heads, head_dim]` (any strides), cos and sin `[tokens, head_dim]`."""
    half = x.shape[2] // 2
    for t in range(x.shape[0]):
        for h in range(x.shape[1]):
            for i in range(half):
                a, b = x[t, h, i], x[t, h, i + half]
                # rotated = (-b, a): x * cos + rotated * sin, with torch's roundings
                out[t, h, i] = a * cos[t, i] + -b * sin[t, i]
                out[t, h, i + half] = b * cos[t, i + half] + a * sin[t, i + half]


def rope_qk(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`apply_rope(q, cos, sin), apply_rope(k, cos, sin)` for an engine's flattened batch: q
    `[tokens, heads, head_dim]` and k `[tokens, kv_heads, head_dim]` (views into the q|k|v matmul's
    output are fine), cos and sin `[tokens, head_dim]`. Returns new contiguous tensors."""
    q_out, k_out = (
        torch.empty_like(q, memory_format=torch.contiguous_format),
        torch.empty_like(k, memory_format=torch.contiguous_format),
    )
    cos_np, sin_np = cos.contiguous().numpy(), sin.contiguous().numpy()
    _rotate(q.numpy(), cos_np, sin_np, q_out.numpy())
    _rotate(k.numpy(), cos_np, sin_np, k_out.numpy())
    return q_out, k_out


@njit(cache=True, nogil=True, fastmath=FASTMATH)
def _rms_rows(x, weight, eps, out):
    """out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight, row by row: x `[rows, dim]` (any
    strides). The scaled row is rounded before the gain multiplies it, as in `RMSNorm`."""
    dim = x.shape[1]
    for r in range(x.shape[0]):
        row = x[r]
        squares = np.float32(0.0)
        for i in range(dim):
            squares += row[i] * row[i]
        scale = np.float32(1.0) / np.sqrt(squares / np.float32(dim) + eps)
        for i in range(dim):
            out[r, i] = (row[i] * scale) * weight[i]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`RMSNorm` over the last axis of `x` (float32 on the CPU; a view into a matmul's output, as
    Qwen3's q and k are, is fine), to float32 rounding. Returns a new contiguous tensor."""
    rows = x.reshape(-1, x.shape[-1])  # a view where the strides allow one
    out = torch.empty(rows.shape, dtype=x.dtype)
    _rms_rows(rows.detach().numpy(), weight.detach().numpy(), np.float32(eps), out.numpy())
    return out.view(x.shape)
