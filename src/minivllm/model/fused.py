"""Fused projections: the model an engine runs, with q, k and v as one matmul and gate and up as
another (chapter 07's "the rest of the step").

At batch 64 a layer of the target model is seven matmuls of a few million multiply-adds each, and
a small matmul pays a fixed cost -- the call, splitting the work over the threads, packing the
weights -- that a bigger one spreads thinner. q, k and v read the same input, as do the MLP's gate
and up, so their weights stacked row-wise give the same outputs side by side from one call: five
calls become two. vLLM does this when it loads a model (`QKVParallelLinear`,
`MergedColumnParallelLinear` in `vllm/model_executor/layers/linear.py`).

Each output column is still one dot product over the same input, in the same order, so the logits
are bit-for-bit those of the unfused model (`tests/test_fused.py` checks it at several batch
sizes) -- at the thread counts the book runs (1 to 4 checked). On 8 and 16 threads (an AMD EPYC)
a 301-token prompt's logits differed by float32 rounding (7.6e-6), though each fused matmul alone
stayed exact: some op splits its work otherwise there (not tracked down).

`fuse_projections` returns a copy: the caller's model, which chapter 00 reads and training
updates, keeps its separate projections; the copy holds the stacked weights instead. A model no one
else holds -- one the engine loaded from a folder itself -- is fused in place (`in_place=True`):
each layer's stacked weights replace its projections as they are made, so a 0.6 B model never
lives twice in memory.

A Hugging Face family adds what `fuse_model` (the engine's call) carries over: Qwen2's q, k and v
biases, stacked as the weights are (`qkv_bias`); Qwen3's q/k norms, applied to the split heads
before RoPE; cos and sin in the model's dtype (`families.HFTransformer` hands them over so; the
book's are float32). A tied LM head stays tied in the copy (`deepcopy` keeps one tensor).

On the CPU, in float32, two more steps take fewer calls with the same arithmetic: an engine's batch
takes q and k through RoPE in one compiled loop each (`cpu_kernels.rope_qk`) instead of seven
torch ops each, and every RMSNorm is torch's one `rms_norm` op instead of five. A weight of
PACK_MIN_BYTES or more (a real model's) is multiplied through oneDNN in a packed layout
(`linear`): there the logits match the unfused model's to float32 rounding, not bit for bit. The
engine packs them as it starts (`pack_weights`), not in a request's step, and where the model is
its alone keeps only the packed copies: the weights are not held twice. The engine packs smaller
ones too, down to PACK_BATCHED_MIN_BYTES (the book's model's stacked projections and MLP down
projection), and multiplies them packed where a batch has two rows or more. Such a model runs its
norms as one compiled loop each (`cpu_kernels.rms_norm`), also to float32 rounding. A model the
engine never packed (`fuse_projections` alone: chapter 07's) keeps the unfused model's bits.
In bfloat16 the same holds where the CPU multiplies bfloat16 (AVX-512 BF16, AMX): big weights
pack (with F.linear's bits), RoPE is one loop (`rope_qk_bfloat16`, apply_rope's bits), and a
packed model's Hugging Face norms are one loop each (`hf_rms_norm_bfloat16`); Qwen3's q and k
norms and RoPE, between the q|k|v matmul and the attention, are then one call for both
(`qk_norm_rope_bfloat16`, the three calls' bits).
"""

from __future__ import annotations

import copy
import functools

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.model.derived import DerivedCache
from minivllm.model.families import HFRMSNorm
from minivllm.model.transformer import (
    Attention,
    DecoderLayer,
    RMSNorm,
    SelfAttention,
    SwiGLU,
    Transformer,
    apply_rope,
)


def on_cpu_in_float32(*tensors: torch.Tensor) -> bool:
    """Whether `cpu_kernels` (and torch's one-op norm, bit for bit) can take these tensors."""
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)


def on_cpu_in_bfloat16(*tensors: torch.Tensor) -> bool:
    """Whether `cpu_kernels`' bfloat16 loops can take these tensors."""
    return all(t.device.type == "cpu" and t.dtype == torch.bfloat16 for t in tensors)


# A float32 weight this big (bytes) is multiplied on the CPU through oneDNN, in the layout oneDNN
# packs it into once. A real model's decode is a few rows against weights of tens of MiB, and there
# torch's default path (MKL's sgemm) streamed them at a third to a half of the speed of the packed
# one on the book's 2-core machine: a 3072 x 1024 projection at 8 rows took 1.87 ms against 0.69
# to 0.78 ms, Qwen3-0.6B's LM head 167 ms against 50 ms; vLLM's CPU build packs its weights so
# (`onednn_mm`), and it packs all of them.
PACK_MIN_BYTES = 4 << 20
# A weight under PACK_MIN_BYTES but of PACK_BATCHED_MIN_BYTES or more is packed only where the
# engine packs its model (`pack_weights`), and taken packed only by an input of PACKED_MIN_ROWS
# rows or more: the packed call costs about 12 us more than F.linear's, which decides at one row,
# and batches gain. The book's model, batch 64, 2 threads, AMD EPYC Zen 4 (us, F.linear against
# packed): the gate-up projection (1 MiB) 225 against 166, down (512 KiB) 128 against 93, q/k/v
# (384 KiB) 81 against 72; at one row q/k/v 8.5 against 20, down 11 against 21. The 256 KiB
# o-projection and LM head gained nothing at 64 rows (54 against 53) and lost at fewer, so stay.
PACK_BATCHED_MIN_BYTES = 320 << 10
PACKED_MIN_ROWS = 2
# An input of fewer rows than this, against a weight of PACK_MIN_BYTES or more, is multiplied as
# this many: rows of zeros added, their results dropped. Such a matmul streams its weight once
# whatever its rows, and oneDNN's kernels for two or three rows streamed it slower than its kernel
# for four. On the book's 2-core AMD EPYC Zen 4, Qwen3-0.6B's 112 decode projections alone took
# 41-45 ms at two rows against 36-43 padded (bfloat16) and 40-42 against 33-34 (float32); in the
# engine (its shape, 300-token contexts, alternating) a batch-2 decode step took 0.86-0.89x the
# time padded (three runs, both dtypes), batch 3 0.93-0.96x. One row pads in float32 only: 0.89x
# there, while in bfloat16 the one-row kernel was as fast (1.02-1.04x padded). A real checkpoint's
# last decode steps, as its longer requests finish, run at such batches. In bfloat16 a row's
# results were the same bits either way (AMD Zen 4; an Intel host with AMX may sum otherwise); in
# float32 they move by float32 rounding (four rows sum in another order).
PADDED_MIN_ROWS = 4
# oneDNN makes a primitive for each number of rows it multiplies a packed weight by -- machine code
# for that shape, made at the first such call and kept in its cache (1024 of them, by default) --
# and a step with a prefill chunk may bring any number of rows up to the token budget. Each took
# about 0.5 ms to make and held about 0.6 MiB (the book's model's projections in float32; 1.1 to
# 1.9 MiB at Qwen3-0.6B's shapes; AMD EPYC Zen 4): `vllm_peer.py`'s 256 requests made 504 of them,
# and a long-running engine would hold up to the cache's 1024. So above EXACT_ROWS rows (a
# decode's batch, up to 64 sequences, multiplied as it is) a packed matmul runs at one of
# SIZES_PER_DOUBLING sizes between each power of two and the next (`matmul_rows`: 72, 80, ...,
# 128, 144, ..., 256, 288, ...), with at most an eighth more rows, whose results are dropped --
# where the input's memory runs on that far (`row_padded`), as the model's norms and SwiGLU leave
# it, so that nothing is copied. That workload then made 219, 3.5 % more rows in its prefill
# steps' matmuls, and its engine's peak memory went from 966 to 796 MiB; its run time moved within
# the machine's noise (issue 32).
EXACT_ROWS = 64
SIZES_PER_DOUBLING = 8
# Whether this torch has oneDNN's CPU linear ops (x86 and arm64 builds do). A constant, read once:
# torch.compile will not trace `torch.backends.mkldnn.is_available` (a graph break per layer).
ONEDNN_LINEAR = torch.backends.mkldnn.is_available() and hasattr(
    torch.ops.mkldnn, "_linear_pointwise"
)
# bfloat16 weights pack too where the CPU multiplies bfloat16 itself (AVX-512 BF16, AMX): there
# torch's F.linear in bfloat16 is oneDNN's matmul already, on the weight reordered at every call;
# the packed one gives its bits on an AMD Zen 4, and within one bfloat16 rounding on an Intel host
# with AMX (a 300-row batch: the two sum in different orders there). Qwen3-0.6B's LM head at 8
# rows took 14 ms packed against 24 ms, a 4096 x 1024 projection 0.30 against 0.53 ms (AMD EPYC
# Zen 4, 2 threads). Without such a CPU oneDNN has no bfloat16 path, and F.linear stays.
ONEDNN_BFLOAT16 = ONEDNN_LINEAR and torch.ops.mkldnn._is_mkldnn_bf16_supported()
PACKED_DTYPES = (torch.float32, torch.bfloat16) if ONEDNN_BFLOAT16 else (torch.float32,)
# Each weight's packed copy, made once: again after an in-place change, gone with the weight.
_PACKED: DerivedCache[torch.Tensor] = DerivedCache()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """`F.linear(x, weight, bias)`; for a float32 (or bfloat16, `PACKED_DTYPES`) weight of
    PACK_MIN_BYTES or more on the CPU -- or one `pack_weights` packed, with an input of
    PACKED_MIN_ROWS rows or more (`packs`; any input in a compiled graph) -- through oneDNN with
    the weight packed once (cached per weight, packed again if it is changed in place). In
    float32 the packed path sums in another order: equal to float32 rounding, not bit for bit; in
    bfloat16 both are oneDNN's, and may still sum in different orders (`ONEDNN_BFLOAT16`). Under
    torch.compile (runner/compiled.py) the packed path is one opaque op, as vLLM's `onednn_mm`:
    inductor would otherwise hand the matmul to MKL's unpacked sgemm."""
    compiling = torch.compiler.is_compiling()
    # A compiled graph serves every batch size (runner/compiled.py marks them unbacked) and cannot
    # branch on the rows: there a weight `pack_weights` packed is taken packed at any batch, as
    # vLLM takes its own.
    rows = PACKED_MIN_ROWS if compiling else x.numel() // max(x.shape[-1], 1)
    if not packs(weight, rows) or x.device.type != "cpu" or x.dtype != weight.dtype:
        return F.linear(x, weight, bias)
    return packed_linear(x, weight, bias) if compiling else _packed_linear(x, weight, bias)


def packs(weight: torch.Tensor, rows: int = PACKED_MIN_ROWS) -> bool:
    """Whether `linear` takes `weight` through oneDNN's packed path for an input of `rows` rows
    (of its dtype, on the CPU): a CPU weight in one of `PACKED_DTYPES`, where this torch has the
    ops, of PACK_MIN_BYTES or more; or of PACK_BATCHED_MIN_BYTES or more that `pack_weights`
    packed, for PACKED_MIN_ROWS rows or more; or a weight `pack_weights` released, of which only
    the packed copy is left."""
    if weight.is_meta:
        return _is_packed(weight)
    if not _packable(weight):
        return False
    size = weight.numel() * weight.element_size()
    batched = size >= PACK_BATCHED_MIN_BYTES and rows >= PACKED_MIN_ROWS and _is_packed(weight)
    return size >= PACK_MIN_BYTES or batched


def _packable(weight: torch.Tensor) -> bool:
    """Whether oneDNN's packed path can take `weight` at all: on the CPU, in `PACKED_DTYPES`."""
    return ONEDNN_LINEAR and weight.device.type == "cpu" and weight.dtype in PACKED_DTYPES


def _is_packed(weight: torch.Tensor) -> bool:
    """Whether the cache holds a packing of this very tensor (perhaps of an older version)."""
    return _PACKED.holds(weight)


def _packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """oneDNN's linear on `weight` packed once (the cache above); a big weight's input of fewer
    than PADDED_MIN_ROWS rows padded to that many, and one of more than EXACT_ROWS run at
    `matmul_rows` where its memory allows (see there)."""
    packed = _packed(weight)
    rows = x.numel() // max(x.shape[-1], 1)
    if rows > EXACT_ROWS:
        run = _rows_run_on(x, matmul_rows(rows))
        out = torch.ops.mkldnn._linear_pointwise(run, packed, bias, "none", [], "")
        return out[:rows].view(*x.shape[:-1], out.shape[-1]) if run is not x else out
    small = weight.numel() * weight.element_size() < PACK_MIN_BYTES
    if rows >= PADDED_MIN_ROWS or small or (rows == 1 and x.dtype != torch.float32):
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    padded = x.new_zeros(PADDED_MIN_ROWS, x.shape[-1])
    padded[:rows] = x.reshape(rows, x.shape[-1])
    out = torch.ops.mkldnn._linear_pointwise(padded, packed, bias, "none", [], "")
    return out[:rows].view(*x.shape[:-1], out.shape[-1])


def matmul_rows(rows: int) -> int:
    """The rows a packed matmul of `rows` input rows runs at: `rows` itself up to EXACT_ROWS, else
    rounded up to a multiple of 1/SIZES_PER_DOUBLING of the power of two below it."""
    if rows <= EXACT_ROWS:
        return rows
    step = max(1, (1 << (rows - 1).bit_length()) // (2 * SIZES_PER_DOUBLING))
    return -(-rows // step) * step


def row_padded(rows: int, columns: int, like: torch.Tensor) -> torch.Tensor:
    """A new `[rows, columns]` tensor of `like`'s dtype and device whose memory runs on to
    `matmul_rows(rows)` rows, zeros there: an output a packed matmul then takes as its input at
    that many rows without a copy."""
    full = like.new_empty(matmul_rows(rows), columns)
    full[rows:].zero_()  # results of these rows are dropped; zeros keep them cheap to compute
    return full[:rows]


def _rows_run_on(x: torch.Tensor, rows: int) -> torch.Tensor:
    """`x` (`[..., columns]`) as `[rows, columns]`, reading on past its own rows into the memory
    after them, where `x` is contiguous and its storage holds that many; else `x` itself."""
    columns = x.shape[-1]
    end = (x.storage_offset() + rows * columns) * x.element_size()
    if not x.is_contiguous() or x.untyped_storage().nbytes() < end:
        return x
    return x.as_strided((rows, columns), (columns, 1))


def _packed(weight: torch.Tensor) -> torch.Tensor:
    """`weight` in oneDNN's packed layout, from the cache, packed (again) where it is not there."""
    return _PACKED.get(weight, _pack)


def _pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` reordered into oneDNN's packed layout (a copy)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


@torch.library.custom_op("minivllm::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`linear`'s packed path as one op a compiled graph calls: the packing cache is looked up
    when the graph runs, for the weight the graph is given."""
    return _packed_linear(x, weight, bias)


@packed_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


class FusedLinear(nn.Linear):
    """`nn.Linear` through `linear`: o_proj, down_proj and the LM head of the fused model."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


@functools.cache
def _cpu_kernels():
    """`model/cpu_kernels.py`, imported on first use: numba compiles it, and a model on a GPU, or
    a program that only loads one, never needs numba."""
    from minivllm.model import cpu_kernels

    return cpu_kernels


class FusedSelfAttention(SelfAttention):
    """`SelfAttention` with `qkv_weight` (q, k and v stacked) in place of three projections."""

    def forward(self, x, cos, sin, layer: int, attention, rows=None) -> torch.Tensor:
        lead = x.shape[:-1]
        qkv = linear(x, self.qkv_weight, getattr(self, "qkv_bias", None))
        q, k, v = qkv.split(self.qkv_sizes, dim=-1)
        q = q.view(*lead, self.n_heads, self.head_dim)
        k = k.view(*lead, self.n_kv_heads, self.head_dim)
        v = v.view(*lead, self.n_kv_heads, self.head_dim)
        q, k = self._normed_and_rotated(q, k, cos, sin)
        out = attention(layer, q, k, v)  # <- the seam, as in SelfAttention
        if rows is not None:  # a last layer whose outputs are wanted at these rows only
            out = out[..., rows, :, :]
        return self.o_proj(out.flatten(-2))

    def _normed_and_rotated(self, q, k, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k through Qwen3's norms (where the model has them) and RoPE."""
        # an engine's batch on the CPU; under torch.compile inductor fuses apply_rope itself
        batch = q.dim() == 3 and not torch.compiler.is_compiling()
        if hasattr(self, "q_norm"):  # Qwen3
            norms = self.q_norm, self.k_norm
            weights = (norm.weight for norm in norms)
            if batch and self.q_norm.compiled_loop and on_cpu_in_bfloat16(q, k, cos, *weights):
                # the norms' loops and RoPE's as one call, with their bits
                return _cpu_kernels().qk_norm_rope_bfloat16(q, k, *norms, cos, sin)
            q, k = self.q_norm(q), self.k_norm(k)
        if batch and on_cpu_in_float32(q, cos):
            return _cpu_kernels().rope_qk(q, k, cos, sin)  # one loop each, apply_rope exactly
        if batch and on_cpu_in_bfloat16(q, cos):
            return _cpu_kernels().rope_qk_bfloat16(q, k, cos, sin)  # apply_rope's bits too
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


def _matmul_input(
    x: torch.Tensor, columns: int, weight: torch.Tensor | None = None
) -> torch.Tensor | None:
    """Where an op on an engine's rows `x` (`[tokens, features]`) writes its `[tokens, columns]`
    result when a packed matmul (of `weight`, where given) takes it next at more rows
    (`matmul_rows`): memory that matmul reads on into (`row_padded`). Else None: a tensor of the
    op's own."""
    rows = x.shape[0]
    if x.dim() != 2 or matmul_rows(rows) == rows:
        return None
    if weight is not None and not (x.device.type == "cpu" and packs(weight, rows)):
        return None
    return row_padded(rows, columns, x)


class FusedRMSNorm(RMSNorm):
    """`RMSNorm` as torch's one `rms_norm` op on the CPU in float32: the same arithmetic in the
    same order as the module's five (bit for bit), dispatched once -- or, in a model whose weights
    `pack_weights` packed (`compiled_loop`), as one compiled loop (`cpu_kernels.rms_norm`), equal
    to float32 rounding, as the packed matmuls are. Elsewhere, the module's own."""

    compiled_loop = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not on_cpu_in_float32(x):
            return super().forward(x)
        if self.compiled_loop and not torch.compiler.is_compiling():
            out = _matmul_input(x, x.shape[-1])
            return _cpu_kernels().rms_norm(x, self.weight, self.eps, out)
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class FusedHFRMSNorm(FusedRMSNorm, HFRMSNorm):
    """`HFRMSNorm` the same way: in float32 it is the book's `RMSNorm`. In bfloat16 (where it
    normalises in float32 first), with `compiled_loop`, one compiled loop that rounds where its
    steps round (`cpu_kernels.hf_rms_norm_bfloat16`): its sum of squares in float32 vector lanes,
    in an order of its own, may move a row by a bfloat16 rounding. Elsewhere, its own steps."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        loop = self.compiled_loop and not torch.compiler.is_compiling()
        if loop and on_cpu_in_bfloat16(x, self.weight):
            out = _matmul_input(x, x.shape[-1])
            return _cpu_kernels().hf_rms_norm_bfloat16(x, self.weight, self.eps, out)
        return super().forward(x)


class FusedDecoderLayer(DecoderLayer):
    """`DecoderLayer` adding each residual into the sublayer's output, a tensor of the layer's own,
    in place: the same sums, bit for bit, and no new tensor for either (vLLM adds its residuals in
    place too). On the book's machine the engine's runs moved within the noise with it."""

    def forward(self, x, cos, sin, attention: Attention, rows=None) -> torch.Tensor:
        if _traced_or_trained():
            return super().forward(x, cos, sin, attention, rows)
        normed = self.input_layernorm(x)
        mixed = self.self_attn(normed, cos, sin, self.index, attention, rows)
        x = mixed.add_(x if rows is None else x[..., rows, :])
        return self.mlp(self.post_attention_layernorm(x)).add_(x)


_FUSED_CLASSES = {
    RMSNorm: FusedRMSNorm,
    HFRMSNorm: FusedHFRMSNorm,
    nn.Linear: FusedLinear,
    DecoderLayer: FusedDecoderLayer,
}


class FusedSwiGLU(SwiGLU):
    """`SwiGLU` with `gate_up_weight` (gate and up stacked) in place of two projections."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = linear(x, self.gate_up_weight).chunk(2, dim=-1)
        if _traced_or_trained():
            return self.down_proj(F.silu(gate) * up)
        # gate|up is this call's own tensor: SiLU in place, into the gate half (the same bits)
        gate = F.silu(gate, inplace=True)
        # the product where a packed down projection reads on into it (or a tensor of its own)
        product = _matmul_input(x, gate.shape[-1], self.down_proj.weight)
        if product is None:
            return self.down_proj(gate * up)
        return self.down_proj(torch.mul(gate, up, out=product))


def _traced_or_trained() -> bool:
    """Whether a forward keeps to out-of-place ops: under torch.compile (inductor fuses them
    itself) or where autograd records (an in-place op may overwrite what a backward needs)."""
    return torch.compiler.is_compiling() or torch.is_grad_enabled()


def fuse_projections(model: Transformer, in_place: bool = False) -> Transformer:
    """A copy of `model` for inference whose layers compute q, k, v in one matmul and gate, up in
    another; every other weight is copied unchanged. `in_place`: `model` itself, changed so (its
    separate projections are freed layer by layer, unless something else holds them)."""
    if is_fused(model):  # an engine's own model, handed to another engine: nothing to do
        return model.eval()
    fused = (model if in_place else copy.deepcopy(model)).eval()
    for layer in fused.model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        stacked = (attention.q_proj, attention.k_proj, attention.v_proj)
        attention.__class__ = FusedSelfAttention
        attention.register_buffer("qkv_weight", torch.cat([p.weight.detach() for p in stacked]))
        attention.qkv_sizes = [p.out_features for p in stacked]
        mlp.__class__ = FusedSwiGLU
        mlp.register_buffer(
            "gate_up_weight",
            torch.cat([mlp.gate_proj.weight.detach(), mlp.up_proj.weight.detach()]),
        )
        del attention.q_proj, attention.k_proj, attention.v_proj, mlp.gate_proj, mlp.up_proj
    # every norm (the layers', the final one, Qwen3's q/k norms) and every other projection
    for module in fused.modules():
        module.__class__ = _FUSED_CLASSES.get(type(module), type(module))
    return fused


def pack_weights(model: nn.Module, release: bool = False) -> int:
    """Pack now every weight of the fused `model` of PACK_BATCHED_MIN_BYTES or more: the engine
    calls this as it starts, as vLLM packs its weights at load, so no request's step pays for it
    -- a Qwen3-0.6B in float32 took 4.8 s to pack, on the book's 2-core machine, all in the first
    step. From then on `linear` takes those under PACK_MIN_BYTES packed too, for batches of
    PACKED_MIN_ROWS rows or more. Returns the packed copies' bytes: 0 where nothing is big enough,
    or the model is not on the CPU in one of `PACKED_DTYPES`.

    The packed copies are held beside the weights, so a model holds those weights twice -- unless
    `release`, for a model that is the caller's alone (the engine's own, loaded for it): then each
    weight of PACK_MIN_BYTES or more drops its own copy, as vLLM drops its (`remove_weight`), and
    the model holds in its place a meta tensor of its shape, which `linear` runs through the packed
    copy and anything else fails on loudly (no data). A weight an embedding reads (a tied LM head)
    stays, as does a smaller one, which a one-row input multiplies unpacked.

    Where anything was packed, the model's logits equal the unfused model's to float32 rounding,
    not bit for bit, and its norms become one compiled loop each (`FusedRMSNorm.compiled_loop`):
    a real checkpoint's 512-token prefill chunk spent about 0.1 s of its 2.5 s in torch's
    composite norm."""
    holders: dict[int, list[tuple[nn.Module, str]]] = {}  # by id: a tied weight is packed once
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for module in model.modules():
        names = ["weight"] if isinstance(module, FusedLinear) else []
        names += [
            n
            for n in ("qkv_weight", "gate_up_weight")
            if isinstance(getattr(module, n, None), torch.Tensor)
        ]
        for name in names:
            holders.setdefault(id(getattr(module, name)), []).append((module, name))
    packed_bytes = 0
    with torch.no_grad():
        for where in holders.values():
            weight = getattr(*where[0])
            size = weight.numel() * weight.element_size()
            wanted = _packable(weight) and size >= PACK_BATCHED_MIN_BYTES
            if not (wanted or packs(weight)):
                continue
            packed = _packed(weight)
            packed_bytes += packed.nbytes
            big = size >= PACK_MIN_BYTES
            if release and big and not weight.is_meta and id(weight) not in embedded:
                stand_in = torch.empty_like(weight, device="meta")
                if isinstance(weight, nn.Parameter):
                    stand_in = nn.Parameter(stand_in, requires_grad=False)
                for module, name in where:
                    held = module._parameters if name in module._parameters else module._buffers
                    held[name] = stand_in
                _PACKED.put(stand_in, packed)
    for module in model.modules():
        if isinstance(module, FusedRMSNorm):
            module.compiled_loop = packed_bytes > 0
    return packed_bytes


def fuse_model(model: Transformer, in_place: bool = False) -> Transformer:
    """What the engine runs: `fuse_projections(model, in_place)`, with the q, k and v biases
    stacked into `qkv_bias` where the model has them (Qwen2)."""
    if is_fused(model):
        return model.eval()
    biases = [
        [p.bias for p in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj)]
        for layer in model.model.layers
    ]
    fused = fuse_projections(model, in_place)
    for layer, stacked in zip(fused.model.layers, biases):
        if stacked[0] is not None:
            layer.self_attn.register_buffer("qkv_bias", torch.cat([b.detach() for b in stacked]))
    return fused


def is_fused(model: Transformer) -> bool:
    return all(isinstance(layer.self_attn, FusedSelfAttention) for layer in model.model.layers)
