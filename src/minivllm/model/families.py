"""The Hugging Face families on the book's transformer: Llama 2/3, Qwen2, Qwen3, Mistral.

They are all the book's model with a few switches (`ModelConfig`'s family fields, read from
`config.json` by `model/checkpoint.py`):

    Llama 3.1+      RoPE stretched to a longer context (`rope_type: "llama3"`): `RopeScaling`
    Qwen2           biases on q, k and v (`attention_bias`)
    Qwen3           an RMSNorm on every q and k head before RoPE (`qk_norm`), a head size of its
                    own (`explicit_head_dim`), often the LM head tied to the embedding
    Mistral         Llama, as long as its sliding window covers the whole context

Biases and tied embeddings are built by the book's modules (`SelfAttention`, `Transformer`). What
the book's `forward`s do not do lives here, in subclasses that the book's model never uses:
`HFSelfAttention` applies the q/k norms, `HFRMSNorm` normalises in float32 as Hugging Face does,
and `HFTransformer.forward` computes scaled RoPE and hands the layers cos and sin in the model's
dtype, so a bfloat16 model stays bfloat16 (the book's model is float32 and never needs it).
`load_model` builds an `HFTransformer` for any checkpoint the book's `Transformer` would not run
exactly as Hugging Face does; in float32 both compute the same logits, bit for bit.
"""

from __future__ import annotations

import math

import torch

from minivllm.model.transformer import (
    Attention,
    CausalAttention,
    ModelConfig,
    RMSNorm,
    RopeScaling,
    RopeTable,
    SelfAttention,
    Transformer,
    apply_rope,
)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> torch.Tensor:
    """The rotation speed of each coordinate pair, `[head_dim / 2]`; with Llama 3's scaling as
    transformers' `_compute_llama3_parameters` computes it (`modeling_rope_utils.py`).

    Llama 3.1's rule, for a pair turning at f radians per position (wavelength 2 pi / f) and the
    context C it was trained on: a wavelength longer than C / low_freq_factor turns at f / factor;
    one shorter than C / high_freq_factor keeps f; one between blends the two,
    (1 - s) f / factor + s f with s = (C / wavelength - low_freq_factor) / (high_freq_factor -
    low_freq_factor), so the speeds join up at both ends."""
    steps = torch.arange(0, head_dim, 2, dtype=torch.float32)
    inv_freq = 1.0 / theta ** (steps / head_dim)
    if scaling is None:
        return inv_freq
    # EXERCISE ch10.2: Llama 3 RoPE scaling -- slow pairs / factor, fast kept, those between blended
    ### BEGIN SOLUTION
    factor, low, high = scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor
    old_context = scaling.original_max_position_embeddings
    low_freq_wavelen, high_freq_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths (slow pairs) are slowed by `factor`, short ones kept, those between blended
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)
    ### END SOLUTION


def rope_cos_sin_scaled(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin `[..., T, head_dim]`, computed in float32 and handed over in `dtype`."""
    angles = positions.to(torch.float32)[..., None] * inv_freq.to(positions.device)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


class HFRMSNorm(RMSNorm):
    """RMSNorm computed in float32 and rounded back to the input's dtype before the gain, as
    Hugging Face's `LlamaRMSNorm` does; in float32 the book's `RMSNorm` exactly."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.to(torch.float32)
        normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * self.weight


class HFSelfAttention(SelfAttention):
    """`SelfAttention` with Qwen3's per-head RMSNorm on q and k before RoPE (where it has them)."""

    def forward(self, x, cos, sin, layer: int, attention: Attention, rows=None) -> torch.Tensor:
        lead = x.shape[:-1]
        q = self.q_proj(x).view(*lead, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(*lead, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).view(*lead, self.n_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = attention(layer, q, k, v)  # <- the seam, as in SelfAttention
        if rows is not None:  # a last layer whose outputs are wanted at these rows only
            out = out[..., rows, :, :]
        return self.o_proj(out.flatten(-2))


class HFTransformer(Transformer):
    """The book's `Transformer` for a Hugging Face checkpoint: the same parameters under the same
    names, with `HFSelfAttention` and `HFRMSNorm` for the book's attention and norms."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        for module in self.modules():
            if type(module) is SelfAttention:
                module.__class__ = HFSelfAttention
            elif type(module) is RMSNorm:
                module.__class__ = HFRMSNorm

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        """The RoPE frequencies on `device`, computed once per device: a copy from host memory in
        every forward would make the host wait for the GPU each step, and cannot be captured in a
        CUDA graph (runner/cuda_graph.py)."""
        cache = self.__dict__.setdefault("_inv_freq_by_device", {})
        if device not in cache:
            config = self.config
            frequencies = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
            cache[device] = frequencies.to(device)
        return cache[device]

    def rope_cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`rope_cos_sin_scaled` at `positions` in `dtype`; on the CPU read from a `RopeTable` of
        this model's, one per dtype."""
        if not RopeTable.serves(positions):
            return rope_cos_sin_scaled(positions, self.inv_freq(positions.device), dtype)
        tables = self.__dict__.setdefault("_rope_tables", {})
        if dtype not in tables:
            frequencies = self.inv_freq(positions.device)
            tables[dtype] = RopeTable(rope_cos_sin_scaled, frequencies, dtype)
        return tables[dtype](positions)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        attention: Attention | None = None,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits `[..., T, vocab]` (of `rows` only, when given), as `Transformer.forward`, with
        the config's RoPE scaling."""
        if positions is None:
            positions = torch.arange(input_ids.shape[-1], device=input_ids.device)
            positions = positions.expand_as(input_ids)
        attention = attention if attention is not None else CausalAttention()
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rope_cos_sin(positions, x.dtype)
        *layers, last = self.model.layers
        for layer in layers:
            x = layer(x, cos, sin, attention)
        x = last(x, cos, sin, attention, rows)  # past its attention, only `rows` go on
        return self.lm_head(self.model.norm(x))


def model_class(config: ModelConfig, dtype: torch.dtype) -> type[Transformer]:
    """The book's `Transformer` where it computes what Hugging Face does (float32, no q/k norms,
    no RoPE scaling: the shipped models), else `HFTransformer`."""
    plain = not config.qk_norm and config.rope_scaling is None
    return Transformer if plain and dtype == torch.float32 else HFTransformer
