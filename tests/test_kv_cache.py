"""The contiguous KV cache: same tokens and logits as no cache, its byte accounting (ch02.1), the
mask (ch02.2)."""

import pytest
import torch

from minivllm.model.checkpoint import load_model
from minivllm.model.tokenizer import ByteTokenizer
from minivllm.model.transformer import ModelConfig, Transformer, init_weights
from minivllm.stages.contiguous import (
    ContiguousKVCache,
    cached_causal_mask,
    generate_cached,
)
from minivllm.stages.naive import generate_naive

SMALL = ModelConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48, max_seq_len=64)
STRATEGIES = ["concat", "preallocate"]
# K and V, every layer, one token, float32.
PER_TOKEN = SMALL.n_layers * 2 * SMALL.n_kv_heads * SMALL.head_dim * 4


@pytest.fixture(scope="module")
def small() -> Transformer:
    m = Transformer(SMALL)
    init_weights(m, seed=0)
    return m.eval()


@pytest.fixture(scope="module")
def target() -> Transformer:
    return load_model("target")


def kv_rows(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (n, SMALL.n_kv_heads, SMALL.head_dim)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def append_all_layers(
    cache: ContiguousKVCache, n: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    k, v = kv_rows(n, seed)
    for layer in range(SMALL.n_layers):
        cache.append(layer, k + layer, v - layer)
    return k, v


# -- ch02.2: the mask ------------------------------------------------------------------------------


@pytest.mark.exercise("ch02.2")
def test_mask_for_a_prefill_is_lower_triangular():
    assert torch.equal(cached_causal_mask(0, 4), torch.ones(4, 4, dtype=torch.bool).tril())


@pytest.mark.exercise("ch02.2")
def test_mask_after_cached_tokens_sees_the_whole_history():
    mask = cached_causal_mask(3, 2)
    assert mask.dtype == torch.bool and mask.shape == (2, 5)
    assert mask.tolist() == [[True, True, True, True, False], [True, True, True, True, True]]
    assert cached_causal_mask(7, 1).all()  # a one-token decode sees everything


# -- ch02.1: the concat strategy -------------------------------------------------------------------


@pytest.mark.exercise("ch02.1")
def test_concat_stores_the_appended_rows_in_order():
    cache = ContiguousKVCache(SMALL, "concat")
    k1, v1 = append_all_layers(cache, 3, seed=1)
    k2, v2 = append_all_layers(cache, 2, seed=2)
    assert cache.length == 5
    for layer in range(SMALL.n_layers):
        assert torch.equal(cache.keys(layer), torch.cat([k1, k2]) + layer)
        assert torch.equal(cache.values(layer), torch.cat([v1, v2]) - layer)
        assert cache.k[layer].is_contiguous()


@pytest.mark.exercise("ch02.1")
def test_concat_copies_the_whole_history_on_every_append():
    cache = ContiguousKVCache(SMALL, "concat")
    n = 10
    for step in range(n):
        append_all_layers(cache, 1, seed=step)
    # Append t copies the t tokens already cached: 0 + 1 + ... + (n-1) tokens, every layer, K and V.
    assert cache.bytes_copied == sum(range(n)) * PER_TOKEN
    assert cache.used_bytes == cache.reserved_bytes == n * PER_TOKEN


# -- preallocate and accounting --------------------------------------------------------------------


def test_preallocate_copies_nothing_and_reserves_max_len_slots():
    cache = ContiguousKVCache(SMALL, "preallocate", max_len=16)
    k1, _ = append_all_layers(cache, 3, seed=1)
    k2, _ = append_all_layers(cache, 1, seed=2)
    assert cache.bytes_copied == 0 and cache.length == 4
    assert cache.used_bytes == 4 * PER_TOKEN and cache.reserved_bytes == 16 * PER_TOKEN
    assert torch.equal(cache.keys(1), torch.cat([k1, k2]) + 1)
    assert ContiguousKVCache(SMALL, "preallocate").reserved_bytes == SMALL.max_seq_len * PER_TOKEN


def test_per_token_bytes_follow_the_dtype():
    assert (
        ContiguousKVCache(SMALL, "preallocate", dtype=torch.float16).per_token_bytes
        == PER_TOKEN // 2
    )
    assert ContiguousKVCache(SMALL, "concat").per_token_bytes == PER_TOKEN


def test_clear_errors():
    with pytest.raises(ValueError, match="unknown strategy 'paged'"):
        ContiguousKVCache(SMALL, "paged")
    cache = ContiguousKVCache(SMALL, "preallocate", max_len=4)
    append_all_layers(cache, 3, seed=0)
    with pytest.raises(ValueError, match="4 slots reserved but 5 are needed"):
        cache.append(0, *kv_rows(2, seed=1))
    with pytest.raises(
        ValueError, match="every forward pass must append the same tokens to all layers"
    ):
        cache.append(1, *kv_rows(1, seed=1))  # layer 1 before layer 0
    cache.append(0, *kv_rows(1, seed=1))
    with pytest.raises(
        ValueError, match="every forward pass must append the same tokens to all layers"
    ):
        cache.append(1, *kv_rows(2, seed=1))  # a different number of tokens than layer 0
    with pytest.raises(ValueError, match="every forward pass"):
        cache.append(0, *kv_rows(1, seed=1))  # layer 0 again before layer 1 finished the pass


# -- the cache inside the model --------------------------------------------------------------------


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_decode_logits_match_a_full_forward(small, strategy):
    ids = torch.randint(
        0, SMALL.vocab_size, (20,), generator=torch.Generator().manual_seed(4)
    ).tolist()
    cache = ContiguousKVCache(SMALL, strategy)
    with torch.no_grad():
        logits = small(torch.tensor(ids[:5]), torch.arange(5), cache)
        torch.testing.assert_close(logits, small(torch.tensor(ids[:5])), atol=1e-4, rtol=0)
        for pos in range(5, len(ids)):
            step = small(torch.tensor([ids[pos]]), torch.tensor([pos]), cache)[-1]
            full = small(torch.tensor(ids[: pos + 1]))[-1]
            assert (step - full).abs().max() < 1e-4
            assert cache.length == pos + 1


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_chunked_prefill_matches_one_big_prefill(small, strategy):
    ids = torch.randint(0, SMALL.vocab_size, (24,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        whole = small(ids, torch.arange(24), ContiguousKVCache(SMALL, strategy))
        cache = ContiguousKVCache(SMALL, strategy)
        chunks = [small(ids[a:b], torch.arange(a, b), cache) for a, b in ((0, 7), (7, 8), (8, 24))]
    torch.testing.assert_close(torch.cat(chunks), whole, atol=1e-5, rtol=1e-5)
    assert cache.length == 24


def test_generation_validates_its_request(small):
    cache = ContiguousKVCache(SMALL, "concat")
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        generate_cached(small, [], 1, cache)
    with pytest.raises(ValueError, match="exceeds the model's context of 64 tokens"):
        generate_cached(small, [1] * 60, 5, cache)
    generate_cached(small, [256, 1], 3, cache)
    with pytest.raises(ValueError, match="already holds 4 tokens"):
        generate_cached(small, [256, 1], 3, cache)


def test_stops_after_eos_and_prefill_only_fills_the_prompt(small):
    first = generate_naive(small, [256, 1], 1)[0]
    cache = ContiguousKVCache(SMALL, "preallocate")
    assert generate_cached(small, [256, 1], 10, cache, eos_id=first) == [first]
    assert cache.length == 2  # the last token picked is never fed back


PROMPTS = ["ROMEO:\n", "KING:\n", "Señor, où êtes-vous?\n"]
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def naive_greedy(target) -> dict[str, tuple[list[int], list[int]]]:
    """Prompt ids and naive greedy tokens per prompt, computed once for both strategies."""
    tok = ByteTokenizer()
    prompts = {text: tok.encode(text, add_bos=True) for text in PROMPTS}
    return {text: (ids, generate_naive(target, ids, NEW_TOKENS)) for text, ids in prompts.items()}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_greedy_tokens_equal_naive_on_the_target(target, naive_greedy, strategy):
    for text, (prompt, expected) in naive_greedy.items():
        cache = ContiguousKVCache(target.config, strategy)
        assert generate_cached(target, prompt, NEW_TOKENS, cache) == expected, text
        assert cache.length == len(prompt) + NEW_TOKENS - 1


def test_seeded_sampling_equals_naive_on_the_target(target):
    prompt = ByteTokenizer().encode("ROMEO:\n", add_bos=True)
    expected = generate_naive(target, prompt, NEW_TOKENS, temperature=0.8, seed=3)
    assert expected != generate_naive(target, prompt, NEW_TOKENS)  # really sampled, not greedy
    for strategy in STRATEGIES:
        cache = ContiguousKVCache(target.config, strategy, max_len=128)
        assert (
            generate_cached(target, prompt, NEW_TOKENS, cache, temperature=0.8, seed=3) == expected
        ), strategy
