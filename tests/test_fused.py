"""Fused projections (model/fused.py): one matmul for q, k, v and one for gate, up give the unfused
model's logits bit for bit; the caller's model keeps its own projections; the engine runs the fused
copy and gives the same greedy tokens either way."""

from __future__ import annotations

import pytest
import torch

from minivllm import EngineConfig, LLMEngine, SamplingParams
from minivllm.model.fused import FusedSelfAttention, FusedSwiGLU, fuse_projections
from minivllm.training.corpus import shipped_validation_text


@pytest.fixture(scope="module")
def fused(target):
    return fuse_projections(target)


@pytest.mark.parametrize("shape", [(1,), (7,), (64,), (300,), (4, 33)])
def test_fused_logits_are_the_unfused_ones_bit_for_bit(target, fused, shape) -> None:
    ids = torch.randint(0, 256, shape, generator=torch.Generator().manual_seed(len(shape)))
    with torch.no_grad():
        assert torch.equal(fused(ids), target(ids))


def test_every_layer_is_fused_and_the_callers_model_is_untouched(target, fused) -> None:
    for original, layer in zip(target.model.layers, fused.model.layers):
        assert isinstance(layer.self_attn, FusedSelfAttention)
        assert isinstance(layer.mlp, FusedSwiGLU)
        assert not hasattr(layer.self_attn, "q_proj") and not hasattr(layer.mlp, "up_proj")
        assert type(original.self_attn).__name__ == "SelfAttention"
        q, k, v = (original.self_attn.q_proj, original.self_attn.k_proj, original.self_attn.v_proj)
        assert torch.equal(layer.self_attn.qkv_weight, torch.cat([q.weight, k.weight, v.weight]))
    assert not any(True for _ in target.buffers())  # nothing was added to the caller's model


def test_the_engine_runs_the_fused_copy_with_the_same_greedy_tokens(target) -> None:
    text = shipped_validation_text()
    prompts = [text[500 * i : 500 * i + 20 + 9 * i] for i in range(6)]
    params = SamplingParams(max_tokens=24, temperature=0)
    tokens = {}
    for fuse in (False, True):
        engine = LLMEngine(target, EngineConfig(num_blocks=64, fuse_projections=fuse))
        layer = engine.runner.model.model.layers[0]
        assert isinstance(layer.self_attn, FusedSelfAttention) == fuse
        tokens[fuse] = [o.token_ids for o in engine.generate(prompts, params)]
    assert tokens[True] == tokens[False]
