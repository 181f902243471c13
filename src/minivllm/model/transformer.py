"""A Llama-architecture transformer in plain torch, with attention as a seam the caller fills in.

The model turns token ids into logits. Inside each decoder layer it computes the query, key and
value vectors, rotates q and k by their positions (RoPE), and then hands `(layer, q, k, v)` to an
*attention object supplied by the caller*. That object decides where keys and values live and which
of them each query may see:

* chapter 00 -- `CausalAttention`: no cache, every call sees only the tokens it was given;
* chapter 02 -- a contiguous KV cache;
* chapter 03 -- a paged KV cache read through a block table;
* chapter 04 -- a flattened (varlen) batch of many sequences over the paged cache.

So later chapters add attention objects; they never edit this file. The tensors crossing the seam
have any leading shape (`[T]` for one sequence, `[B, T]` for a padded batch, `[N]` for a flattened
batch) followed by `(heads, head_dim)`.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field, fields
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's stretch of RoPE to a longer context (`rope_type: "llama3"` in a Hugging Face
    config): the slow frequencies are divided by `factor`, the fast ones kept, and those between
    blended (`model/families.py` computes it)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int
    rope_type: str = "llama3"


# What the Hugging Face families add to the book's model. Their defaults are the book's model, and
# the repr leaves them out where they are at those defaults (chapter 00 prints the config).
_FAMILY = {"family": True}


@dataclass(frozen=True, repr=False)
class ModelConfig:
    vocab_size: int = 259
    d_model: int = 256
    n_layers: int = 6
    n_heads: int = 8
    n_kv_heads: int = 2
    d_ff: int = 512
    max_seq_len: int = 1024
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    bos_token_id: int | None = 256
    eos_token_id: int | None = 257  # None: a checkpoint that names none
    architecture: str = field(default="LlamaForCausalLM", metadata=_FAMILY)
    # a head size of its own (Qwen3's need not be d_model / n_heads); None: d_model // n_heads
    explicit_head_dim: int | None = field(default=None, metadata=_FAMILY)
    attention_bias: bool = field(default=False, metadata=_FAMILY)  # biases on q, k, v (Qwen2)
    o_proj_bias: bool = field(default=False, metadata=_FAMILY)  # and on o (Llama attention_bias)
    qk_norm: bool = field(default=False, metadata=_FAMILY)  # RMSNorm per head on q, k (Qwen3)
    tie_word_embeddings: bool = field(default=False, metadata=_FAMILY)  # lm_head is the embedding
    rope_scaling: RopeScaling | None = field(default=None, metadata=_FAMILY)

    def __post_init__(self) -> None:
        if self.explicit_head_dim is None and self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")

    @property
    def head_dim(self) -> int:
        if self.explicit_head_dim is not None:
            return self.explicit_head_dim
        return self.d_model // self.n_heads

    def to_dict(self) -> dict:
        return asdict(self)

    def __repr__(self) -> str:
        shown = [
            f"{f.name}={getattr(self, f.name)!r}"
            for f in fields(self)
            if not f.metadata.get("family") or getattr(self, f.name) != f.default
        ]
        return f"ModelConfig({', '.join(shown)})"


class Attention(Protocol):
    """The seam. `q` is `[..., T, n_heads, head_dim]`, `k` and `v` are `[..., T, n_kv_heads,
    head_dim]`, already rotated. Returns `[..., T, n_heads, head_dim]`."""

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor: ...


def expand_kv_heads(kv: torch.Tensor, group_size: int) -> torch.Tensor:
    """`[..., S, n_kv_heads, D]` -> `[..., S, n_kv_heads * group_size, D]`: query head h reads
    kv head h // group_size."""
    return kv if group_size == 1 else kv.repeat_interleave(group_size, dim=-2)


def attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Plain softmax attention, written out so every later backend can be checked against it.

    `q`: `[T, H, D]`, `k`, `v`: `[S, H_kv, D]`, `mask`: `[T, S]` boolean, True where a query may
    look.
    """
    k = expand_kv_heads(k, q.shape[-2] // k.shape[-2])
    v = expand_kv_heads(v, q.shape[-2] // v.shape[-2])
    scores = torch.einsum("thd,shd->hts", q, k) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hts,shd->thd", scores.softmax(dim=-1), v)


class CausalAttention:
    """No cache: the tokens of this call attend to themselves, causally. Chapter 00's attention, and
    the one training uses (a `[B, T]` batch of independent windows)."""

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        # SDPA wants [..., heads, T, D]; enable_gqa lets 8 query heads share 2 kv heads without a
        # copy.
        out = F.scaled_dot_product_attention(
            q.transpose(-3, -2),
            k.transpose(-3, -2),
            v.transpose(-3, -2),
            is_causal=True,
            enable_gqa=True,
        )
        return out.transpose(-3, -2)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # EXERCISE ch00.1: RMSNorm -- x / its RMS over the last dim (+ eps), times self.weight
        ### BEGIN SOLUTION
        # Scale each vector to unit root-mean-square, then by a learned gain; no mean, no bias.
        rms = torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return x * rms * self.weight
        ### END SOLUTION


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles, `[..., T, head_dim]`, for the given integer positions.
    On the CPU they are read from a `RopeTable` of the same values."""
    if RopeTable.serves(positions):
        key = (head_dim, float(theta))
        table = _ROPE_TABLES.get(key)
        if table is None:
            table = _ROPE_TABLES.setdefault(key, RopeTable(_rope_cos_sin, head_dim, theta))
        return table(positions)
    return _rope_cos_sin(positions, head_dim, theta)


def _rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rope_cos_sin`, computed."""
    steps = torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device)
    inv_freq = 1.0 / theta ** (steps / head_dim)
    angles = positions.to(torch.float32)[..., None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


class RopeTable:
    """cos and sin for positions 0..n-1, computed once by `cos_sin(positions, *args)` and then
    read by position: vLLM's `cos_sin_cache`. Six small ops a forward become two lookups (at the
    book's model's batch-64 decode step, about 0.19 ms against 0.02). Each row is what `cos_sin`
    computes for its position, element by element -- torch takes every element of a cos or sin
    through the same vector function, wherever it falls in the tensor -- so a lookup gives the
    computed values bit for bit. The table grows by doubling to the largest position asked. On the
    CPU outside a compiled graph only (`serves`): growing reads the largest position, which on a
    GPU would wait for it and could not be captured in a CUDA graph, and inductor fuses the
    computation itself. `cos_sin` is a module's function, so a model holding a table pickles (a
    forward worker's copy)."""

    def __init__(self, cos_sin, *args) -> None:
        self.cos_sin, self.args = cos_sin, args
        self.rows: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin `[n, head_dim]`

    @staticmethod
    def serves(positions: torch.Tensor) -> bool:
        """Whether `rope_cos_sin` reads these positions from a table. (Whether it is compiling
        comes first: a compiled graph's batch size is unbacked, and no guard may read it.)"""
        if torch.compiler.is_compiling():
            return False
        return positions.device.type == "cpu" and positions.numel() > 0

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.rows
        needed = int(positions.max()) + 1
        if rows is None or needed > rows[0].shape[0]:
            # one assignment, so an engine in another thread reads the old table or the new one
            size = max(256, 1 << (needed - 1).bit_length())
            rows = self.rows = self.cos_sin(torch.arange(size), *self.args)
        flat, shape = positions.reshape(-1), (*positions.shape, rows[0].shape[-1])
        return rows[0].index_select(0, flat).view(shape), rows[1].index_select(0, flat).view(shape)


# (head_dim, theta) -> its table, for `rope_cos_sin`
_ROPE_TABLES: dict[tuple[int, float], RopeTable] = {}


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` (`[..., T, heads, head_dim]`) by position. Pairs are (i, i + head_dim/2), the
    "rotate half" layout Hugging Face's Llama uses, so our weights load there unchanged."""
    # EXERCISE ch00.2: RoPE -- rotate each pair (x[i], x[i + half]) by the angle in cos/sin
    ### BEGIN SOLUTION
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[..., None, :] + rotated * sin[..., None, :]
    ### END SOLUTION


class SelfAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = (
            config.n_heads,
            config.n_kv_heads,
            config.head_dim,
        )
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.d_model, config.n_heads * config.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.d_model, config.n_kv_heads * config.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.d_model, config.n_kv_heads * config.head_dim, bias=bias)
        self.o_proj = nn.Linear(
            config.n_heads * config.head_dim, config.d_model, bias=config.o_proj_bias
        )
        if config.qk_norm:  # applied by families.HFSelfAttention, which the book's model is not
            self.q_norm = RMSNorm(config.head_dim, config.norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.norm_eps)

    def forward(self, x, cos, sin, layer: int, attention: Attention, rows=None) -> torch.Tensor:
        lead = x.shape[:-1]
        q = self.q_proj(x).view(*lead, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(*lead, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).view(*lead, self.n_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = attention(layer, q, k, v)  # <- the seam
        if rows is not None:  # a last layer whose outputs are wanted at these rows only
            out = out[..., rows, :, :]
        return self.o_proj(out.flatten(-2))


class SwiGLU(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.up_proj = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.down_proj = nn.Linear(config.d_ff, config.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, index: int) -> None:
        super().__init__()
        self.index = index
        self.input_layernorm = RMSNorm(config.d_model, config.norm_eps)
        self.self_attn = SelfAttention(config)
        self.post_attention_layernorm = RMSNorm(config.d_model, config.norm_eps)
        self.mlp = SwiGLU(config)

    def forward(self, x, cos, sin, attention: Attention, rows=None) -> torch.Tensor:
        mixed = self.self_attn(self.input_layernorm(x), cos, sin, self.index, attention, rows)
        x = (x if rows is None else x[..., rows, :]) + mixed
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    """Embedding, decoder layers, final norm. Named `model` inside `Transformer` so that parameter
    names match Hugging Face's (`model.layers.0.self_attn.q_proj.weight`, ...)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.n_layers))
        self.norm = RMSNorm(config.d_model, config.norm_eps)


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if type(self) is Transformer and (config.qk_norm or config.rope_scaling is not None):
            raise ValueError(
                "the book's Transformer applies neither q/k norms nor RoPE scaling: build "
                "minivllm.model.families.HFTransformer (load_model does)"
            )
        self.config = config
        self.model = Backbone(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """With `tie_word_embeddings`, the LM head is the embedding matrix itself (one tensor)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        attention: Attention | None = None,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits `[..., T, vocab]` for `input_ids` `[..., T]` at `positions` (default `0..T-1`);
        with `rows`, only those positions' logits: an engine samples one row per sequence, and a
        long prompt's other rows would cost the LM head (vocab x d_model per row) for nothing --
        and the last layer's work past its attention, which feeds nothing but the LM head. Every
        row still goes through that attention: the keys and values it caches are every row's."""
        if positions is None:
            positions = torch.arange(input_ids.shape[-1], device=input_ids.device)
            positions = positions.expand_as(input_ids)
        attention = attention if attention is not None else CausalAttention()
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta)
        x = self.model.embed_tokens(input_ids)
        *layers, last = self.model.layers
        for layer in layers:
            x = layer(x, cos, sin, attention)
        x = last(x, cos, sin, attention, rows)  # past its attention, only `rows` go on
        return self.lm_head(self.model.norm(x))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def placed_on(
    model: Transformer, device: str | torch.device, in_place: bool = False
) -> Transformer:
    """The model to run on `device`, in eval mode: the caller's own when it already lives there,
    otherwise a copy moved there. Moving the caller's model in place would hand it back on another
    device: its CPU code would then meet a CUDA model (vLLM sidesteps this by loading its own).
    `in_place`: move `model` itself, for a model no one else holds (one the engine loaded)."""
    device = torch.device(device)
    current = next(model.parameters()).device
    same = current.type == device.type and device.index in (None, current.index)
    if same:
        return model.eval()
    return (model if in_place else copy.deepcopy(model)).to(device).eval()


def init_weights(model: Transformer, seed: int) -> None:
    """GPT-2 style initialisation: N(0, 0.02), residual projections scaled down by depth."""
    generator = torch.Generator().manual_seed(seed)
    residual_std = 0.02 / (2 * model.config.n_layers) ** 0.5
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            nn.init.ones_(param)
        else:
            std = residual_std if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
            with torch.no_grad():
                param.copy_(torch.randn(param.shape, generator=generator) * std)
