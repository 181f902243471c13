"""RoPE and RMSNorm on the CPU as one compiled loop each, between a layer's matmuls (issue 32).

At batch 64 a layer of the book's model spends as long in its elementwise steps as in its
matmuls, although they move a few hundred KiB: rotating q and k by position (`apply_rope`) is
seven torch ops per tensor, each a pass over memory, an allocation and an OpenMP launch of a few
microseconds. vLLM's CPU build runs them as custom C++ ops (`rotary_embedding`); here numba
compiles each to one loop over the rows.

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
Qwen3 norms every head of q and k, then rotates them: `qk_norm_rope_bfloat16` does both, token by
token, in one call (a decode step of its 28 layers made 84 calls of these, now 28), with the bits
of the two loops.

The loops read q and k where the q|k|v matmul wrote them, through `_token_rows`: one token's heads
at a time as a contiguous array, each step one pass over all of them, which LLVM vectorises. Over
the strided views themselves it did not: a 512-token chunk of Qwen3-0.6B's shape took 2.3-2.6 ms
a layer in `qk_norm_rope_bfloat16` so against 1.5 now, and the book's model's RoPE at batch 64
110 us against 43 (AMD EPYC Zen 4, alternating, the same bits). A prefill chunk's
`qk_norm_rope_bfloat16` (PARALLEL_MIN_TOKENS tokens or more) runs on numba's threads, each a share
of the tokens; every other loop here, on the calling thread.

The fused model (`model/fused.py`) calls them for float32 (or bfloat16) tensors in CPU memory, on
one flattened batch of rows (an engine's `[tokens, heads, head_dim]`), and imports this module
only then: an engine on a GPU never loads numba. Elsewhere -- a GPU, float16, chapter 00's `[B, T]`
batches -- the fused model keeps the torch ops.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

from minivllm.model.derived import DerivedCache
from minivllm.model.numba_threads import LAUNCH, loop_threads, use_threads

# Reassociation lets LLVM keep a row's sum of squares in several vector lanes at once.
FASTMATH = {"reassoc", "contract", "nsz", "arcp"}


@njit(cache=True, nogil=True, inline="always")
def _token_heads(x, stride, t, heads, dim):
    """Token `t`'s `[heads, dim]` of a `_token_rows` array `x`, a contiguous view."""
    start = t * stride
    return x[start : start + heads * dim].reshape((heads, dim))


@njit(cache=True, nogil=True)
def _rotate(x, stride, cos, sin, out):
    """out = x rotated pairwise by (cos, sin): `apply_rope`'s arithmetic, element by element.
    x a `_token_rows` array (its tokens `stride` apart), out `[tokens, heads, head_dim]`, cos and
    sin `[tokens, head_dim]`."""
    tokens, heads, dim = out.shape
    half = dim // 2
    for t in range(tokens):
        rows = _token_heads(x, stride, t, heads, dim)
        for h in range(heads):
            for i in range(half):
                a, b = rows[h, i], rows[h, i + half]
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


def _token_rows(t: torch.Tensor) -> tuple[np.ndarray, int]:
    """`t` `[tokens, heads, head_dim]` as the loops read it: one flat array from its first element
    to its last, and the stride from token to token. A token's heads must lie side by side, as
    they do in a view into a q|k|v matmul's output; anything else is made contiguous first.

    numba types a strided array (such a view, as numpy) as of unknown layout, and LLVM does not
    vectorise a loop over one: widening the bfloat16 q heads of a 512-token chunk of Qwen3-0.6B's
    shape took 37 ns a 128-element row so, against 6.5 over contiguous rows (AMD EPYC Zen 4). A
    token's slice of the flat array (`_token_heads`) is contiguous, and its loops vectorise."""
    if t.stride(2) != 1 or t.stride(1) != t.shape[2]:
        t = t.contiguous()
    width = t.shape[1] * t.shape[2]
    length = (t.shape[0] - 1) * t.stride(0) + width if t.shape[0] else 0
    return _array(t.as_strided((length,), (1,))), t.stride(0)


def _new_array(shape, dtype: torch.dtype) -> tuple[torch.Tensor, np.ndarray]:
    """A new float32 or bfloat16 tensor of `shape` and its `_array` (numpy's memory)."""
    if dtype == torch.bfloat16:
        bits = np.empty(shape, dtype=np.int16)
        return torch.from_numpy(bits).view(torch.bfloat16), bits
    array = np.empty(shape, dtype=np.float32)
    return torch.from_numpy(array), array


# A loop over this many tokens or more runs on numba's threads (those torch has, at most), in equal
# shares of the tokens: a prefill chunk. At a decode step's few tokens waking a thread costs more
# than it saves. Qwen3-0.6B's q/k norms and RoPE (`qk_norm_rope_bfloat16`) on two threads took
# 0.61-0.63x the time of one at 512 tokens, 0.65-0.79x at 256, 0.85-0.92x at 128 and 0.93-1.05x at
# 64 under minivllm's default thread policy (a short spin), and 0.66-0.91x, 0.82-1.06x and
# 1.25-1.29x at 512, 128 and 64 with idle threads asleep at once (OMP_WAIT_POLICY=PASSIVE alone);
# AMD EPYC Zen 4, alternating, each call after a matmul. In the engine (the real-shaped
# benchmark's prompts) a call on a 512-token chunk took 1.16 ms against 1.91.
PARALLEL_MIN_TOKENS = 128


def _shares(tokens: int) -> np.ndarray | None:
    """Where the shares of a loop over `tokens` begin and end on numba's threads, or None where it
    runs on the calling thread alone. A parallel loop runs under `numba_threads.LAUNCH`: one at a
    time in a process. (numba's threads cannot hand an exception back; these loops raise none.)"""
    threads = loop_threads()
    if threads < 2 or tokens < PARALLEL_MIN_TOKENS:
        return None
    use_threads(threads)
    return np.linspace(0, tokens, threads + 1).astype(np.int64)


def _on_shares(loop, shared_loop, tokens: int, *args) -> None:
    """`loop(0, tokens, *args)` on the calling thread, or `shared_loop` (its `prange` over shares)
    on numba's threads where `_shares` says so."""
    bounds = _shares(tokens)
    if bounds is None:
        loop(0, tokens, *args)
    else:
        with LAUNCH:
            shared_loop(bounds, *args)


def rope_qk(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`apply_rope(q, cos, sin), apply_rope(k, cos, sin)` for an engine's flattened batch: q
    `[tokens, heads, head_dim]` and k `[tokens, kv_heads, head_dim]` (views into the q|k|v matmul's
    output are fine), cos and sin `[tokens, head_dim]`. Returns new contiguous tensors."""
    (q_out, q_array), (k_out, k_array) = (_new_array(t.shape, t.dtype) for t in (q, k))
    cos_array, sin_array = _held(cos), _held(sin)
    _rotate(*_token_rows(q), cos_array, sin_array, q_array)
    _rotate(*_token_rows(k), cos_array, sin_array, k_array)
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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out=None) -> torch.Tensor:
    """`RMSNorm` over the last axis of `x` (float32 on the CPU; a view into a matmul's output, as
    Qwen3's q and k are, is fine), to float32 rounding. Returns a new contiguous tensor, or `out`
    (see `_norm_rows`)."""
    return _norm_rows(_rms_rows, x, weight, eps, out)


def _norm_rows(loop, x: torch.Tensor, weight: torch.Tensor, eps: float, out=None) -> torch.Tensor:
    """A norm's compiled `loop(rows, weight, eps, out)` over the last axis of `x` (float32 or
    bfloat16), the weight held from call to call (`_held`). Returns a new contiguous tensor, or
    `out` (contiguous, of `x`'s shape and dtype, given for a 2-D `x`) written."""
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # a view where the strides allow one
    if out is None:
        out, out_array = _new_array(rows.shape, x.dtype)
    else:
        out_array = _array(out)
    loop(_array(rows), _held(weight), np.float32(eps), out_array)
    return out if x.dim() == 2 else out.view(x.shape)


# -- bfloat16 --------------------------------------------------------------------------------------
# A bfloat16 is a float32's upper 16 bits. Widening is exact; rounding a float32 to bfloat16 is to
# nearest, ties to even, as torch does (a NaN stays a NaN).


@njit(cache=True, nogil=True, inline="always")
def _widened(bits):
    """The float32 bits (uint32) of one bfloat16's `bits` (int16): its upper half."""
    return np.uint32(np.uint16(bits)) << np.uint32(16)


@njit(cache=True, nogil=True, inline="always")
def _narrowed(wide):
    """The bfloat16 bits (int16) of float32 bits `wide` already rounded (`_rounded`)."""
    return np.int16(np.uint16(wide >> np.uint32(16)))


@njit(cache=True, nogil=True, inline="always")
def _widen(bits, out):
    """out[:] = the float32s of bfloat16 `bits` (int16), written through out's bits."""
    wide = out.view(np.uint32)
    for i in range(bits.shape[0]):
        wide[i] = _widened(bits[i])


@njit(cache=True, nogil=True, inline="always")
def _rounded(b):
    """The bits (uint32) of the float32 of bits `b` rounded to bfloat16 (the low 16 bits zero)."""
    odd = (b >> np.uint32(16)) & np.uint32(1)  # ties to even
    nearest = (b + np.uint32(0x7FFF) + odd) & np.uint32(0xFFFF0000)
    # a NaN stays a NaN: a quiet one
    return np.uint32(0x7FC00000) if (b & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000) else nearest


@njit(cache=True, nogil=True, fastmath=FASTMATH)
def _norm_heads_bfloat16(x, gain, eps, rows):
    """rows[r] = `HFRMSNorm` of the bfloat16 row x[r] (its bits), as float32 holding the bfloat16
    result: in float32, the normalised row rounded to bfloat16, times the gain (float32), rounded
    again. x `[n, dim]` (contiguous: a token's heads, or a few rows of a hidden state), rows
    `[n, dim]` float32. Each step is one pass over all n rows, a loop LLVM vectorises. A function
    of its own (not inlined): its float32 sums run in vector lanes (`fastmath`), which the RoPE
    loops that follow it must not (no fused multiply-adds there), and every caller gets the one
    order of those sums -- the same bits."""
    n, dim = x.shape
    wide = rows.view(np.uint32)
    for r in range(n):
        for i in range(dim):
            wide[r, i] = _widened(x[r, i])
    for r in range(n):
        squares = np.float32(0.0)
        for i in range(dim):
            squares += rows[r, i] * rows[r, i]
        scale = np.float32(1.0) / np.sqrt(squares / np.float32(dim) + eps)
        for i in range(dim):
            rows[r, i] = rows[r, i] * scale
    for r in range(n):
        for i in range(dim):
            wide[r, i] = _rounded(wide[r, i])
    for r in range(n):
        for i in range(dim):
            rows[r, i] = rows[r, i] * gain[i]
    for r in range(n):
        for i in range(dim):
            wide[r, i] = _rounded(wide[r, i])


@njit(cache=True, nogil=True)
def _rotate_heads_bfloat16(rows, c, s, first, second, out):
    """A token's heads `rows` `[heads, dim]` (float32 holding bfloat16 values) rotated by its cos
    and sin `c`, `s` (float32 too), with torch's bfloat16 roundings -- x * cos and rotated * sin
    each rounded, then their sum -- to `out` `[heads, dim]` (bits). `first`, `second`: float32
    scratch as big as `rows`."""
    heads, dim = rows.shape
    half = dim // 2
    for h in range(heads):
        for i in range(half):
            first[h, i], first[h, i + half] = rows[h, i] * c[i], rows[h, i + half] * c[i + half]
            second[h, i], second[h, i + half] = -rows[h, i + half] * s[i], rows[h, i] * s[i + half]
    first_bits, second_bits = first.view(np.uint32), second.view(np.uint32)
    for h in range(heads):
        for i in range(dim):
            first_bits[h, i] = _rounded(first_bits[h, i])
            second_bits[h, i] = _rounded(second_bits[h, i])
    for h in range(heads):
        for i in range(dim):
            first[h, i] = first[h, i] + second[h, i]
    for h in range(heads):
        for i in range(dim):
            out[h, i] = _narrowed(_rounded(first_bits[h, i]))


@njit(cache=True, nogil=True)
def _rotate_bfloat16(x, stride, cos, sin, out):
    """`_rotate` in bfloat16 (x, cos, sin and out their bits): x * cos and rotated * sin each
    rounded to bfloat16, then their sum, as torch's bfloat16 ops round. x a `_token_rows` array,
    out `[tokens, heads, head_dim]`, cos and sin `[tokens, head_dim]`."""
    tokens, heads, dim = out.shape
    scratch = np.empty((3, heads, dim), dtype=np.float32)
    rows, first, second = scratch[0], scratch[1], scratch[2]
    c, s = np.empty(dim, dtype=np.float32), np.empty(dim, dtype=np.float32)
    wide = rows.view(np.uint32)
    for t in range(tokens):
        _widen(cos[t], c)
        _widen(sin[t], s)
        bits = _token_heads(x, stride, t, heads, dim)
        for h in range(heads):
            for i in range(dim):
                wide[h, i] = _widened(bits[h, i])
        _rotate_heads_bfloat16(rows, c, s, first, second, out[t])


# `_hf_rms_rows_bfloat16` norms a hidden state's rows a few at a time, in float32 scratch of about
# this many elements (8 KiB): every pass over them stays in the first-level cache.
NORM_CHUNK_ELEMENTS = 2048


@njit(cache=True, nogil=True)
def _hf_rms_rows_bfloat16(x, weight, eps, out):
    """`HFRMSNorm` on bfloat16 rows (x, weight, out their bits), a few rows at a time
    (`_norm_heads_bfloat16`). x `[rows, dim]`."""
    dim = x.shape[1]
    chunk = max(1, NORM_CHUNK_ELEMENTS // dim)
    scratch = np.empty((chunk, dim), dtype=np.float32)
    gain = np.empty(dim, dtype=np.float32)
    _widen(weight, gain)
    wide = scratch.view(np.uint32)
    for start in range(0, x.shape[0], chunk):
        n = min(chunk, x.shape[0] - start)
        _norm_heads_bfloat16(x[start : start + n], gain, eps, scratch[:n])
        rows_out = out[start : start + n]  # indexed by the loops' own counters: they vectorise
        for r in range(n):
            for i in range(dim):
                rows_out[r, i] = _narrowed(wide[r, i])


@njit(cache=True, nogil=True)
def _qk_norm_rope_bfloat16(
    begin, end, q, q_stride, k, k_stride, q_weight, k_weight, q_eps, k_eps, cos, sin, q_out, k_out
):
    """Qwen3's q and k norms, then RoPE, in one pass over tokens `begin` to `end` (all arrays
    bfloat16 bits; q and k `_token_rows` arrays): each token's heads normed
    (`_norm_heads_bfloat16`) and rotated (`_rotate_heads_bfloat16`) while they are at hand -- the
    same steps, the same bits, as the norms' loop and then the rotation's."""
    q_heads, dim = q_out.shape[1], q_out.shape[2]
    k_heads = k_out.shape[1]
    scratch = np.empty((3, max(q_heads, k_heads), dim), dtype=np.float32)
    rows, first, second = scratch[0], scratch[1], scratch[2]
    small = np.empty((4, dim), dtype=np.float32)
    c, s, q_gain, k_gain = small[0], small[1], small[2], small[3]
    _widen(q_weight, q_gain)
    _widen(k_weight, k_gain)
    for t in range(begin, end):
        _widen(cos[t], c)
        _widen(sin[t], s)
        q_rows, k_rows = rows[:q_heads], rows[:k_heads]
        _norm_heads_bfloat16(_token_heads(q, q_stride, t, q_heads, dim), q_gain, q_eps, q_rows)
        _rotate_heads_bfloat16(q_rows, c, s, first[:q_heads], second[:q_heads], q_out[t])
        _norm_heads_bfloat16(_token_heads(k, k_stride, t, k_heads, dim), k_gain, k_eps, k_rows)
        _rotate_heads_bfloat16(k_rows, c, s, first[:k_heads], second[:k_heads], k_out[t])


@njit(cache=True, nogil=True, parallel=True)
def _qk_norm_rope_bfloat16_shared(
    bounds, q, q_stride, k, k_stride, q_weight, k_weight, q_eps, k_eps, cos, sin, q_out, k_out
):
    """`_qk_norm_rope_bfloat16` on numba's threads, share i over tokens bounds[i] to bounds[i+1]."""
    for share in prange(bounds.shape[0] - 1):
        _qk_norm_rope_bfloat16(
            bounds[share], bounds[share + 1], q, q_stride, k, k_stride, q_weight, k_weight,
            q_eps, k_eps, cos, sin, q_out, k_out,
        )  # fmt: skip


def rope_qk_bfloat16(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rope_qk` for bfloat16 q, k, cos and sin: `apply_rope`'s result in bfloat16, bit for bit."""
    (q_out, q_bits), (k_out, k_bits) = (_new_array(t.shape, t.dtype) for t in (q, k))
    cos_bits, sin_bits = _held(cos), _held(sin)
    _rotate_bfloat16(*_token_rows(q), cos_bits, sin_bits, q_bits)
    _rotate_bfloat16(*_token_rows(k), cos_bits, sin_bits, k_bits)
    return q_out, k_out


def hf_rms_norm_bfloat16(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out=None
) -> torch.Tensor:
    """`HFRMSNorm` over the last axis of a bfloat16 `x` (a view into a matmul's output is fine),
    its sum of squares to float32 rounding. Returns a new contiguous tensor, or `out` (see
    `_norm_rows`)."""
    return _norm_rows(_hf_rms_rows_bfloat16, x, weight, eps, out)


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
    args = (
        *_token_rows(q),
        *_token_rows(k),
        _held(q_norm.weight),
        _held(k_norm.weight),
        np.float32(q_norm.eps),
        np.float32(k_norm.eps),
        _held(cos),
        _held(sin),
        q_bits,
        k_bits,
    )
    _on_shares(_qk_norm_rope_bfloat16, _qk_norm_rope_bfloat16_shared, q.shape[0], *args)
    return q_out, k_out
