import pytest

from minivllm.kv.sizing import blocks_for_memory, dtype_bytes, kv_bytes_per_token


def test_kv_bytes_per_token_counts_k_and_v_in_every_layer():
    # Qwen3-0.6B: 28 layers, 8 KV heads of 128, bf16 -> 112 KiB a token
    assert kv_bytes_per_token(28, 8, 128, "bfloat16") == 2 * 28 * 8 * 128 * 2 == 114688


def test_dtype_bytes_takes_names_and_torch_dtypes():
    torch = pytest.importorskip("torch")
    assert dtype_bytes(torch.float32) == dtype_bytes("float32") == 4
    assert dtype_bytes(torch.bfloat16) == 2
    with pytest.raises(ValueError, match="int8"):
        dtype_bytes("int8")


def test_blocks_for_memory_rounds_down_to_whole_blocks():
    size = blocks_for_memory(10 * 16 * 100 + 99, block_size=16, bytes_per_token=100)
    assert (size.num_blocks, size.num_tokens, size.num_bytes) == (10, 160, 16000)
    assert size.describe().startswith("10 blocks of 16 = 160 tokens")
    with pytest.raises(ValueError, match="holds no block"):
        blocks_for_memory(1599, block_size=16, bytes_per_token=100)
