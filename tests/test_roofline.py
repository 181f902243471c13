"""The roofline arithmetic of a decode step (`minivllm.book.roofline`): attention's K/V bytes and
FLOPs (exercise ch07.2), checked against small cases counted by hand; the step's floors built on
it; and the machine-limit measurement's shape (its numbers are this machine's, not tested)."""

from __future__ import annotations

import pytest

from minivllm.book.roofline import attention_traffic, floor_seconds, floors, measure_limits


@pytest.mark.exercise("ch07.2")
def test_one_sequence_one_layer_multi_head() -> None:
    # 2 heads of 4, each with its own K/V head, float32, 10 cached tokens:
    # K and V rows read: 10 x 2 (K, V) x 2 heads x 4 x 4 B = 640; the new row written: 64;
    # the query in and the output out: 2 x 2 heads x 4 x 4 B = 64
    assert attention_traffic([10], layers=1, heads=2, kv_heads=2, head_dim=4) == (768, 320)


@pytest.mark.exercise("ch07.2")
def test_grouped_query_heads_share_their_kv_reads() -> None:
    # 8 query heads on 2 K/V heads of 32, float32, 100 cached tokens: the cache is read once
    # per K/V head (100 x 2 x 2 x 32 x 4 = 51200), the new row is 512, q and out 2 x 8 x 32 x 4
    # = 2048; the FLOPs follow the query heads: 4 x 100 x 8 x 32
    gqa = attention_traffic([100], layers=1, heads=8, kv_heads=2, head_dim=32)
    assert gqa == (51200 + 512 + 2048, 102400)
    mha = attention_traffic([100], layers=1, heads=8, kv_heads=8, head_dim=32)
    assert mha == (4 * (51200 + 512) + 2048, 102400)


@pytest.mark.exercise("ch07.2")
def test_sequences_of_different_contexts_and_layers_add_up() -> None:
    # 3 sequences at 5, 17 and 0 cached tokens, 3 layers; 4 heads on 1 K/V head of 8, float32:
    # per token one K/V row is 2 x 1 x 8 x 4 = 64 B, a query 4 x 8 x 4 = 128 B
    per_layer_bytes = (5 + 17 + 0) * 64 + 3 * 64 + 3 * 2 * 128
    per_layer_flops = 4 * (5 + 17 + 0) * 4 * 8
    got = attention_traffic([5, 17, 0], layers=3, heads=4, kv_heads=1, head_dim=8)
    assert got == (3 * per_layer_bytes, 3 * per_layer_flops)
    one_by_one = [attention_traffic([n], 3, 4, 1, 8) for n in (5, 17, 0)]
    assert got == tuple(sum(part) for part in zip(*one_by_one))
    assert attention_traffic([], 3, 4, 1, 8) == (0, 0)


@pytest.mark.exercise("ch07.2")
def test_bfloat16_moves_half_the_bytes_of_float32_for_the_same_flops() -> None:
    fp32 = attention_traffic([40, 7], layers=2, heads=4, kv_heads=2, head_dim=16)
    bf16 = attention_traffic([40, 7], layers=2, heads=4, kv_heads=2, head_dim=16, element_bytes=2)
    # per layer: (47 + 2) rows x 2 x 2 x 16 x 2 B + 2 x 2 x 4 x 16 x 2 B, FLOPs 4 x 47 x 4 x 16
    assert bf16 == (2 * (49 * 128 + 512), 2 * 12032)
    assert fp32 == (2 * bf16[0], bf16[1])


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        attention_traffic([10], layers=1, heads=6, kv_heads=4, head_dim=8)
    with pytest.raises(ValueError, match="negative"):
        attention_traffic([10, -1], layers=1, heads=4, kv_heads=2, head_dim=8)


def test_step_floors_use_attention_and_the_weights() -> None:
    config = {
        "hidden_size": 16,
        "head_dim": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 32,
        "vocab_size": 50,
        "num_hidden_layers": 2,
    }
    floor = floors(config, batch=2, context_sum=30.0)
    assert floor["attention"] == attention_traffic([15.0, 15.0], 2, 4, 2, 4)
    # the LM head at batch 2: its 50 x 16 weights, 2 inputs of 16 and 2 rows of logits, once
    assert floor["LM head"] == (4 * (50 * 16 + 2 * 16 + 2 * 50), 2.0 * 2 * 16 * 50)
    half = floors(config, batch=2, context_sum=30.0, element_bytes=2)
    assert half["qkv matmul"] == (floor["qkv matmul"][0] / 2, floor["qkv matmul"][1])
    assert floor_seconds(8e9, 1e9, bandwidth_GBps=4.0, peak_GFLOPs=100.0) == 2.0
    assert floor_seconds(8e9, 1e12, bandwidth_GBps=4.0, peak_GFLOPs=100.0) == 10.0


def test_measure_limits_reads_positive_limits() -> None:
    limits = measure_limits(elements=2**20, gemm_size=128, repeats=2)
    assert set(limits) == {
        "copy_GBps",
        "add_GBps",
        "bandwidth_GBps",
        "cache_copy_GBps",
        "gemm_128_GFLOPs",
    }
    assert all(value > 0 for value in limits.values())
    assert limits["bandwidth_GBps"] == max(limits["copy_GBps"], limits["add_GBps"])
