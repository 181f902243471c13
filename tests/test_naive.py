"""Naive generation: the chapter-00 baseline every later engine must reproduce token for token."""

import pytest
import torch

from minivllm.model.transformer import ModelConfig, Transformer, init_weights
from minivllm.stages.naive import generate_naive, next_token_logits, pick_token

CONFIG = ModelConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48, max_seq_len=40)


@pytest.fixture(scope="module")
def model():
    m = Transformer(CONFIG)
    init_weights(m, seed=1)
    return m.eval()


def test_greedy_picks_the_argmax_of_a_full_recompute(model):
    prompt = [256, 10, 20, 30]
    out = generate_naive(model, prompt, max_new_tokens=6)
    ids = list(prompt)
    for token in out:
        assert token == int(next_token_logits(model, ids).argmax())
        ids.append(token)


def test_sampling_is_a_function_of_the_seed(model):
    a = generate_naive(model, [256, 1], 20, temperature=1.0, seed=5)
    b = generate_naive(model, [256, 1], 20, temperature=1.0, seed=5)
    c = generate_naive(model, [256, 1], 20, temperature=1.0, seed=6)
    assert a == b and a != c


def test_low_temperature_approaches_greedy():
    logits = torch.tensor([0.0, 3.0, 1.0])
    assert pick_token(logits, 0.0, None) == 1
    assert pick_token(logits, 1e-3, torch.Generator().manual_seed(0)) == 1


def test_stops_after_eos(model):
    first = generate_naive(model, [256, 1], 1)[0]
    assert generate_naive(model, [256, 1], 10, eos_id=first) == [first]


def test_too_long_and_empty_requests_fail_clearly(model):
    with pytest.raises(ValueError, match="exceeds the model's context of 40 tokens"):
        generate_naive(model, [1] * 30, max_new_tokens=11)
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        generate_naive(model, [], max_new_tokens=1)


def _all_generators(model):
    from minivllm.attention.storage import PagedKVStorage
    from minivllm.kv.block_manager import BlockManager
    from minivllm.stages.contiguous import ContiguousKVCache, generate_cached
    from minivllm.stages.paged import generate_paged

    yield "naive", lambda ids, n: generate_naive(model, ids, n)
    yield (
        "contiguous",
        lambda ids, n: generate_cached(model, ids, n, ContiguousKVCache(model.config, "concat")),
    )
    manager = BlockManager(num_blocks=16, block_size=4)
    storage = PagedKVStorage(model.config, 16, 4)
    yield "paged", lambda ids, n: generate_paged(model, ids, n, manager, storage, seq_id=0)


def test_every_generator_rejects_token_ids_outside_the_vocabulary(model):
    for name, generate in _all_generators(model):
        with pytest.raises(ValueError, match=r"token id 259 is outside the vocabulary 0\.\.258"):
            generate([256, 259], 3)
        with pytest.raises(ValueError, match=r"token id -1 is outside"):
            generate([-1], 3)
        with pytest.raises(ValueError, match="max_new_tokens must be >= 0"):
            generate([256], -1)
        assert len(generate([256, 65], 3)) == 3, name  # and a good request still runs afterwards
