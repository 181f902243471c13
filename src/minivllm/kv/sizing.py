"""How much K/V a model keeps per token, and how many cache blocks a memory budget buys.

Every layer keeps one key and one value vector per KV head for every token in context, so a
token's cache is `2 x layers x kv_heads x head_dim x bytes per element`. Grouped-query attention
(few KV heads) is what keeps this small at real sizes. Pure arithmetic: no torch, so the
scheduler's side of the package and the book's tables can use it.
"""

from __future__ import annotations

from dataclasses import dataclass

# bytes per element of the cache dtypes the engine runs (torch's names, without "torch.")
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def dtype_bytes(dtype) -> int:
    """Bytes per element of a dtype given as a name ("bfloat16") or a torch dtype."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise ValueError(f"no K/V cache size for dtype {dtype!r}: use one of {list(DTYPE_BYTES)}")
    return DTYPE_BYTES[name]


def kv_bytes_per_token(n_layers: int, n_kv_heads: int, head_dim: int, dtype) -> int:
    """Bytes of K and V one token holds across all layers."""
    return 2 * n_layers * n_kv_heads * head_dim * dtype_bytes(dtype)


@dataclass(frozen=True)
class CacheSize:
    """A cache sized from a memory budget: `num_blocks` blocks of `block_size` tokens."""

    num_blocks: int
    block_size: int
    bytes_per_token: int

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def num_bytes(self) -> int:
        return self.num_tokens * self.bytes_per_token

    def describe(self) -> str:
        """The start-up line: "2048 blocks of 16 = 32768 tokens (96.0 MiB of K/V)"."""
        return (
            f"{self.num_blocks} blocks of {self.block_size} = {self.num_tokens} tokens "
            f"({self.num_bytes / 2**20:.1f} MiB of K/V)"
        )


def blocks_for_memory(memory_bytes: int, block_size: int, bytes_per_token: int) -> CacheSize:
    """The most whole blocks that fit in `memory_bytes`; at least one block must fit."""
    block_bytes = block_size * bytes_per_token
    num_blocks = int(memory_bytes) // block_bytes
    if num_blocks < 1:
        raise ValueError(
            f"a K/V memory budget of {int(memory_bytes)} bytes holds no block: one block of "
            f"{block_size} tokens takes {block_bytes} bytes"
        )
    return CacheSize(num_blocks, block_size, bytes_per_token)
