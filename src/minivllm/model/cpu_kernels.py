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

A bfloat16 model (a real checkpoint in its own dtype) has the same two as `rope_qk_bfloat16` and
`hf_rms_norm_bfloat16`, each step rounded to bfloat16 where torch's ops round: RoPE's
products and their sum (so its result is `apply_rope`'s in bfloat16 bit for bit), and
`HFRMSNorm`'s normalised row before the gain multiplies it (its sum of squares, in float32 vector
lanes, to float32 rounding). numpy has no bfloat16: the loops take a bfloat16 tensor's bits (int16)
and widen or round them themselves (`_widen`, `_round`). On the book's 2-core machine (AMD EPYC
Zen 4) the norm of 512 x 1024 took 0.66 ms against 1.35 ms, and the 91 decode steps of
`real_model.py`'s workload on Qwen3-0.6B's shape 9.7 s against 11.0 s (medians of 3, alternating).
Qwen3 norms every head of q and k, then rotates them: `qk_norm_rope_bfloat16` does both, row by
row, in one call (a decode step of its 28 layers made 84 calls of these, now 28), with the bits
of the two loops.

The fused model (`model/fused.py`) calls them for float32 (or bfloat16) tensors in CPU memory, on
one flattened batch of rows (an engine's `[tokens, heads, head_dim]`), and imports this module
only then: an engine on a GPU never loads numba. Elsewhere -- a GPU, float16, chapter 00's `[B, T]`
batches -- the fused model keeps the torch ops.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit

from minivllm.model.derived import DerivedCache

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


def _array(t: torch.Tensor) -> np.ndarray:
    """A float32 CPU tensor as numpy, or a bfloat16 one as its bits (int16), sharing its memory."""
    t = t.detach() if t.requires_grad else t
    return t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()


# Each tensor's `_array`, for tensors a step hands to these loops again and again unchanged -- a
# norm's weight every step, a step's cos and sin in every layer. In a decode step each small torch
# op costs microseconds on a host whose caches the layer's weights have just streamed through:
# Qwen3-0.6B's shape spent about 28 us a norm call around a 5 us loop (AMD EPYC Zen 4), the
# tensors' views and conversions most of it.
_HELD: DerivedCache[np.ndarray] = DerivedCache()


def _held(t: torch.Tensor) -> np.ndarray:
    """`_array(t.contiguous())`, made once while `t` lives and is not changed in place."""
    return _HELD.get(t, _contiguous_array)


def _contiguous_array(t: torch.Tensor) -> np.ndarray:
    return _array(t.contiguous())


def _new_array(shape, dtype: torch.dtype) -> tuple[torch.Tensor, np.ndarray]:
    """A new float32 or bfloat16 tensor of `shape` and its `_array` (numpy's memory)."""
    if dtype == torch.bfloat16:
        bits = np.empty(shape, dtype=np.int16)
        return torch.from_numpy(bits).view(torch.bfloat16), bits
    array = np.empty(shape, dtype=np.float32)
    return torch.from_numpy(array), array


def rope_qk(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`apply_rope(q, cos, sin), apply_rope(k, cos, sin)` for an engine's flattened batch: q
    `[tokens, heads, head_dim]` and k `[tokens, kv_heads, head_dim]` (views into the q|k|v matmul's
    output are fine), cos and sin `[tokens, head_dim]`. Returns new contiguous tensors."""
    (q_out, q_array), (k_out, k_array) = (_new_array(t.shape, t.dtype) for t in (q, k))
    cos_array, sin_array = _held(cos), _held(sin)
    _rotate(_array(q), cos_array, sin_array, q_array)
    _rotate(_array(k), cos_array, sin_array, k_array)
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
    return _norm_rows(_rms_rows, x, weight, eps)


def _norm_rows(loop, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """A norm's compiled `loop(rows, weight, eps, out)` over the last axis of `x` (float32 or
    bfloat16), the weight held from call to call (`_held`). Returns a new contiguous tensor."""
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # a view where the strides allow one
    out, out_array = _new_array(rows.shape, x.dtype)
    loop(_array(rows), _held(weight), np.float32(eps), out_array)
    return out if x.dim() == 2 else out.view(x.shape)


# -- bfloat16 --------------------------------------------------------------------------------------
# A bfloat16 is a float32's upper 16 bits. Widening is exact; rounding a float32 to bfloat16 is to
# nearest, ties to even, as torch does (a NaN stays a NaN).


@njit(cache=True, nogil=True, inline="always")
def _widen(bits, out):
    """out[:] = the float32s of bfloat16 `bits` (int16), written through out's bits."""
    wide = out.view(np.uint32)
    for i in range(bits.shape[0]):
        wide[i] = np.uint32(np.uint16(bits[i])) << np.uint32(16)


@njit(cache=True, nogil=True, inline="always")
def _round(values):
    """values[:] = values rounded to bfloat16 (still float32: the low 16 bits zero)."""
    wide = values.view(np.uint32)
    for i in range(values.shape[0]):
        b = wide[i]
        if (b & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):  # NaN: a quiet one
            wide[i] = np.uint32(0x7FC00000)
        else:
            b += np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))
            wide[i] = b & np.uint32(0xFFFF0000)


@njit(cache=True, nogil=True, inline="always")
def _store_bits(values, bits):
    """bits[:] = the upper halves of `values` (already rounded by `_round`)."""
    wide = values.view(np.uint32)
    for i in range(values.shape[0]):
        bits[i] = np.int16(np.uint16(wide[i] >> np.uint32(16)))


@njit(cache=True, nogil=True)
def _rotate_row_bfloat16(row, c, s, scratch, out):
    """One head's row (float32 holding bfloat16 values) rotated by cos and sin `c`, `s` (float32
    too), with torch's bfloat16 roundings, to `out` (bits). `scratch`: three float32 rows."""
    half = row.shape[0] // 2
    first, second, total = scratch[0], scratch[1], scratch[2]
    for i in range(half):
        first[i], first[i + half] = row[i] * c[i], row[i + half] * c[i + half]
        second[i], second[i + half] = -row[i + half] * s[i], row[i] * s[i + half]
    _round(first)
    _round(second)
    for i in range(row.shape[0]):
        total[i] = first[i] + second[i]
    _round(total)
    _store_bits(total, out)


@njit(cache=True, nogil=True)
def _rotate_bfloat16(x, cos, sin, out):
    """`_rotate` in bfloat16 (all four arrays its bits): x * cos and rotated * sin each rounded to
    bfloat16, then their sum, as torch's bfloat16 ops round. x `[tokens, heads, head_dim]` (any
    strides), cos and sin `[tokens, head_dim]`."""
    dim = x.shape[2]
    scratch = np.empty((6, dim), dtype=np.float32)
    row, c, s = scratch[0], scratch[1], scratch[2]
    for t in range(x.shape[0]):
        _widen(cos[t], c)
        _widen(sin[t], s)
        for h in range(x.shape[1]):
            _widen(x[t, h], row)
            _rotate_row_bfloat16(row, c, s, scratch[3:], out[t, h])


@njit(cache=True, nogil=True, fastmath=FASTMATH)
def _hf_rms_row_bfloat16(bits, gain, eps, row):
    """row[:] = `HFRMSNorm` of one bfloat16 row (its bits), as float32 holding the bfloat16
    result: in float32, the normalised row rounded to bfloat16, times the gain (float32), rounded
    again. A function of its own (not inlined): its float32 sum runs in vector lanes (`fastmath`),
    which the RoPE loops that follow it in `_qk_norm_rope_bfloat16` must not (no fused
    multiply-adds there)."""
    dim = bits.shape[0]
    _widen(bits, row)
    squares = np.float32(0.0)
    for i in range(dim):
        squares += row[i] * row[i]
    scale = np.float32(1.0) / np.sqrt(squares / np.float32(dim) + eps)
    for i in range(dim):
        row[i] = row[i] * scale
    _round(row)
    for i in range(dim):
        row[i] = row[i] * gain[i]
    _round(row)


@njit(cache=True, nogil=True)
def _hf_rms_rows_bfloat16(x, weight, eps, out):
    """`HFRMSNorm` on bfloat16 rows (x, weight, out their bits), row by row
    (`_hf_rms_row_bfloat16`). x `[rows, dim]` (any strides)."""
    dim = x.shape[1]
    scratch = np.empty((2, dim), dtype=np.float32)
    row, gain = scratch[0], scratch[1]
    _widen(weight, gain)
    for r in range(x.shape[0]):
        _hf_rms_row_bfloat16(x[r], gain, eps, row)
        _store_bits(row, out[r])


@njit(cache=True, nogil=True)
def _qk_norm_rope_bfloat16(q, k, q_weight, k_weight, q_eps, k_eps, cos, sin, q_out, k_out):
    """Qwen3's q and k norms, then RoPE, in one pass over the tokens (all arrays bfloat16 bits):
    each head's row normed (`_hf_rms_row_bfloat16`) and rotated (`_rotate_row_bfloat16`) while it
    is at hand -- the same steps, the same bits, as the norms' loop and then the rotation's."""
    dim = q.shape[2]
    scratch = np.empty((8, dim), dtype=np.float32)
    row, c, s, q_gain, k_gain = scratch[0], scratch[1], scratch[2], scratch[3], scratch[4]
    _widen(q_weight, q_gain)
    _widen(k_weight, k_gain)
    for t in range(q.shape[0]):
        _widen(cos[t], c)
        _widen(sin[t], s)
        for h in range(q.shape[1]):
            _hf_rms_row_bfloat16(q[t, h], q_gain, q_eps, row)
            _rotate_row_bfloat16(row, c, s, scratch[5:], q_out[t, h])
        for h in range(k.shape[1]):
            _hf_rms_row_bfloat16(k[t, h], k_gain, k_eps, row)
            _rotate_row_bfloat16(row, c, s, scratch[5:], k_out[t, h])


def rope_qk_bfloat16(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rope_qk` for bfloat16 q, k, cos and sin: `apply_rope`'s result in bfloat16, bit for bit."""
    (q_out, q_bits), (k_out, k_bits) = (_new_array(t.shape, t.dtype) for t in (q, k))
    cos_bits, sin_bits = _held(cos), _held(sin)
    _rotate_bfloat16(_array(q), cos_bits, sin_bits, q_bits)
    _rotate_bfloat16(_array(k), cos_bits, sin_bits, k_bits)
    return q_out, k_out


def hf_rms_norm_bfloat16(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`HFRMSNorm` over the last axis of a bfloat16 `x` (a view into a matmul's output is fine),
    its sum of squares to float32 rounding. Returns a new contiguous tensor."""
    return _norm_rows(_hf_rms_rows_bfloat16, x, weight, eps)


def qk_norm_rope_bfloat16(
    q: torch.Tensor,
    k: torch.Tensor,
    q_norm: torch.nn.Module,
    k_norm: torch.nn.Module,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rope_qk_bfloat16(hf_rms_norm_bfloat16(q, ...), hf_rms_norm_bfloat16(k, ...), cos, sin)`
    -- Qwen3's step between its q|k|v matmul and the attention -- as one call instead of three,
    bit for bit theirs. q `[tokens, heads, head_dim]`, k `[tokens, kv_heads, head_dim]` (views are
    fine), the norms' modules (their `weight` and `eps`), cos and sin `[tokens, head_dim]`."""
    (q_out, q_bits), (k_out, k_bits) = (_new_array(t.shape, t.dtype) for t in (q, k))
    _qk_norm_rope_bfloat16(
        _array(q),
        _array(k),
        _held(q_norm.weight),
        _held(k_norm.weight),
        np.float32(q_norm.eps),
        np.float32(k_norm.eps),
        _held(cos),
        _held(sin),
        q_bits,
        k_bits,
    )
    return q_out, k_out
