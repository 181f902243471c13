"""RoPE on the CPU as one compiled loop per tensor, between a layer's matmuls (issue 32).

At batch 64 a layer of the book's model spends as long in its elementwise steps as in its
matmuls, although they move a few hundred KiB: rotating q and k by position (`apply_rope`) is
seven torch ops per tensor, each a pass over memory, an allocation and an OpenMP launch of a few
microseconds. vLLM's CPU build runs them as custom C++ ops (`rotary_embedding`); here numba
compiles each to one loop over the rows, on the calling thread.

`rope_qk` is `apply_rope` on q and k at once. It computes each output element as `apply_rope`
does -- `x * cos + rotated * sin`, each product rounded to float32, then the sum (no fused
multiply-add: no `fastmath`) -- so its result is `apply_rope`'s bit for bit (`tests/test_fused.py`
checks it), and the engine's tokens do not move.

The fused model (`model/fused.py`) calls them for float32 tensors in CPU memory, on one flattened
batch of rows (an engine's `[tokens, heads, head_dim]`), and imports this module only then: an
engine on a GPU never loads numba. Elsewhere -- a GPU, half precision, chapter 00's `[B, T]`
batches -- the fused model keeps the torch ops.
"""

from __future__ import annotations

import torch
from numba import njit


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
