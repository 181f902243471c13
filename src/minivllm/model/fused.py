"""Fused projections: the model an engine runs, with q, k and v as one matmul and gate and up as
another (chapter 07's "the rest of the step").

At batch 64 a layer of the target model is seven matmuls of a few million multiply-adds each, and
a small matmul pays a fixed cost -- the call, splitting the work over the threads, packing the
weights -- that a bigger one spreads thinner. q, k and v read the same input, as do the MLP's gate
and up, so their weights stacked row-wise give the same outputs side by side from one call: five
calls become two. vLLM does this when it loads a model (`QKVParallelLinear`,
`MergedColumnParallelLinear` in `vllm/model_executor/layers/linear.py`).

Each output column is still one dot product over the same input, in the same order, so the logits
are bit-for-bit those of the unfused model (`tests/test_model.py` checks it at several batch
sizes). `fuse_projections` returns a copy: the caller's model, which chapter 00 reads and training
updates, keeps its separate projections; the copy holds the stacked weights instead.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from minivllm.model.transformer import SelfAttention, SwiGLU, Transformer, apply_rope


class FusedSelfAttention(SelfAttention):
    """`SelfAttention` with `qkv_weight` (q, k and v stacked) in place of three projections."""

    def forward(self, x, cos, sin, layer: int, attention) -> torch.Tensor:
        lead = x.shape[:-1]
        q, k, v = F.linear(x, self.qkv_weight).split(self.qkv_sizes, dim=-1)
        q = q.view(*lead, self.n_heads, self.head_dim)
        k = k.view(*lead, self.n_kv_heads, self.head_dim)
        v = v.view(*lead, self.n_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = attention(layer, q, k, v)  # <- the seam, as in SelfAttention
        return self.o_proj(out.reshape(*lead, self.n_heads * self.head_dim))


class FusedSwiGLU(SwiGLU):
    """`SwiGLU` with `gate_up_weight` (gate and up stacked) in place of two projections."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up_weight).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


def fuse_projections(model: Transformer) -> Transformer:
    """A copy of `model` for inference whose layers compute q, k, v in one matmul and gate, up in
    another; every other weight is copied unchanged."""
    fused = copy.deepcopy(model).eval()
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
    return fused
