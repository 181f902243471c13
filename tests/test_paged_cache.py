"""The paged KV cache, storage half: write/gather through block tables (ch03.3), the same tokens and
logits as the contiguous cache, prefix-cache hits, and out-of-blocks errors that change nothing."""

import sys

import pytest
import torch

from minivllm.attention.storage import HUGE_PAGE, PagedKVStorage, zeros_on_huge_pages
from minivllm.kv.block_manager import BlockManager, OutOfBlocks
from minivllm.model.checkpoint import load_model
from minivllm.model.tokenizer import ByteTokenizer
from minivllm.model.transformer import ModelConfig, Transformer, attention_reference
from minivllm.stages.contiguous import (
    ContiguousKVCache,
    cached_causal_mask,
    generate_cached,
)
from minivllm.stages.paged import (
    PagedAttention,
    generate_paged,
    paged_attention_reference,
)

SMALL = ModelConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48, max_seq_len=64)


@pytest.fixture(scope="module")
def target() -> Transformer:
    return load_model("target")


def filled_storage(
    block_size: int, block_table: list[int], length: int, num_blocks: int = 8, seed: int = 0
):
    """A storage whose sequence (logical rows 0..length-1) is written slot by slot, no
    BlockManager."""
    g = torch.Generator().manual_seed(seed)
    storage = PagedKVStorage(SMALL, num_blocks, block_size)
    shape = (SMALL.n_layers, length, SMALL.n_kv_heads, SMALL.head_dim)
    k, v = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    slots = torch.tensor(
        [block_table[p // block_size] * block_size + p % block_size for p in range(length)]
    )
    for layer in range(SMALL.n_layers):
        storage.write(layer, slots, k[layer], v[layer])
    return storage, k, v


# -- ch03.3: gather through the block table --------------------------------------------------------


@pytest.mark.exercise("ch03.3")
@pytest.mark.parametrize(
    "block_size, block_table, length",
    [
        (4, [5, 2, 7], 10),  # out of order, ends mid-block
        (4, [3, 0], 8),  # ends exactly on a block boundary
        (1, [6, 1, 4, 0], 4),
        (16, [2], 5),
    ],
)
def test_gather_reads_back_what_was_written(block_size, block_table, length):
    storage, k, v = filled_storage(block_size, block_table, length)
    for layer in range(SMALL.n_layers):
        keys, values = storage.gather(layer, block_table, length)
        assert keys.shape == (length, SMALL.n_kv_heads, SMALL.head_dim)
        assert torch.equal(keys, k[layer]) and torch.equal(values, v[layer])


@pytest.mark.exercise("ch03.3")
def test_gather_reads_a_prefix_and_follows_the_table_order():
    storage, k, _ = filled_storage(4, [5, 2, 7], 10)
    assert torch.equal(storage.gather(1, [5, 2, 7], 6)[0], k[1, :6])
    # Swapping the table swaps the blocks read: the table, not the physical order, decides.
    assert torch.equal(storage.gather(0, [2, 5], 8)[0], torch.cat([k[0, 4:8], k[0, :4]]))


# -- the rest of the storage -----------------------------------------------------------------------


def test_layout_and_bytes():
    storage = PagedKVStorage(SMALL, num_blocks=8, block_size=4)
    assert storage.kv.shape == (SMALL.n_layers, 2, 8, 4, SMALL.n_kv_heads, SMALL.head_dim)
    assert storage.bytes == storage.kv.numel() * 4
    assert PagedKVStorage(SMALL, 8, 4, dtype=torch.float16).bytes == storage.bytes // 2


def test_write_lands_at_block_and_offset():
    storage = PagedKVStorage(SMALL, num_blocks=8, block_size=4)
    k = torch.ones(1, SMALL.n_kv_heads, SMALL.head_dim)
    storage.write(1, torch.tensor([6 * 4 + 3]), k, -k)  # block 6, offset 3
    assert torch.equal(storage.kv[1, 0, 6, 3], k[0]) and torch.equal(storage.kv[1, 1, 6, 3], -k[0])
    assert storage.kv.abs().sum() == 2 * k.numel()  # nothing else was touched


def test_a_heads_outer_pool_is_indexed_the_same_and_laid_out_head_by_head():
    """The CPU kernel's pool (`heads_outer`): the same `kv` indexing, writes and reads as the
    indexed order, with a block's rows of each head side by side in memory."""
    plain, outer = (PagedKVStorage(SMALL, 8, 4, heads_outer=h) for h in (False, True))
    assert outer.kv.shape == plain.kv.shape and outer.bytes == plain.bytes
    rows, heads = outer.kv.stride(-3), outer.kv.stride(-2)
    assert rows == SMALL.head_dim and heads == 4 * SMALL.head_dim  # a head's 4 rows, then the next
    slots = torch.tensor([6 * 4 + 3, 0, 13, 31])  # blocks 6, 0, 3, 7, out of order
    k = torch.randn(4, SMALL.n_kv_heads, SMALL.head_dim, generator=torch.Generator().manual_seed(0))
    for storage in (plain, outer):
        storage.write(1, slots, k, -k)
    assert torch.equal(outer.kv, plain.kv)  # every element where the indexed order puts it
    table = torch.tensor([[7, 0], [3, 6]])  # read back through slots of any shape
    read = [s.read_slots(1, table * 4 + 3) for s in (plain, outer)]
    assert all(torch.equal(a, b) for a, b in zip(*read))
    assert torch.equal(read[1][0][1, 1], k[0]) and torch.equal(read[1][1][0, 0], -k[3])


def test_the_cpu_kernels_engine_keeps_a_heads_outer_pool(target):
    """The engine makes its storage as its backend asks: the numba kernel's heads outside the
    rows, the torch reference's in the indexed order."""
    from minivllm import EngineConfig, LLMEngine

    for backend, outer in (("numba", True), ("torch", False)):
        config = EngineConfig(attention_backend=backend, num_blocks=16)
        kv = LLMEngine(target, config).storage.kv
        assert (kv.stride(-2) > kv.stride(-3)) is outer, backend


def test_copy_block_copies_every_layer_k_and_v():
    storage, _, _ = filled_storage(4, [5, 2], 8)
    storage.copy_block(2, 6)
    assert (
        torch.equal(storage.kv[:, :, 6], storage.kv[:, :, 2])
        and storage.kv[:, :, 6].abs().sum() > 0
    )


def test_clear_errors():
    storage = PagedKVStorage(SMALL, num_blocks=2, block_size=4)
    k = torch.zeros(2, SMALL.n_kv_heads, SMALL.head_dim)
    with pytest.raises(IndexError, match="outside the 8 slots"):
        storage.write(0, torch.tensor([0, 8]), k, k)
    with pytest.raises(IndexError, match="outside the 8 slots"):
        storage.write(0, torch.tensor([-1, 0]), k, k)
    with pytest.raises(ValueError, match="same T"):
        storage.write(0, torch.tensor([0]), k, k)
    with pytest.raises(IndexError, match="layer 2"):
        storage.write(2, torch.tensor([0, 1]), k, k)
    with pytest.raises(IndexError, match="pool of 2 blocks"):
        storage.copy_block(0, 2)
    with pytest.raises(ValueError, match="holds 4"):
        storage.gather(0, [1], 5)


def test_paged_attention_reference_matches_plain_attention():
    storage, k, v = filled_storage(4, [5, 2, 7], 10)
    q = torch.randn(3, SMALL.n_heads, SMALL.head_dim, generator=torch.Generator().manual_seed(1))
    out = paged_attention_reference(q, storage, 1, [5, 2, 7], start=7)
    expected = attention_reference(q, k[1], v[1], cached_causal_mask(7, 3))
    assert (out - expected).abs().max() < 1e-5


# -- the target model: same tokens and logits as chapter 02 ----------------------------------------

PROMPTS = ["ROMEO:\n", "KING:\n", "Señor, où êtes-vous?\n"]


@pytest.fixture(scope="module")
def cached_greedy(target) -> dict[str, tuple[list[int], list[int]]]:
    tok = ByteTokenizer()
    prompts = {text: tok.encode(text, add_bos=True) for text in PROMPTS}
    return {
        text: (ids, generate_cached(target, ids, 40, ContiguousKVCache(target.config, "concat")))
        for text, ids in prompts.items()
    }


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_greedy_tokens_equal_the_contiguous_cache(target, cached_greedy, block_size):
    manager = BlockManager(num_blocks=256 // block_size, block_size=block_size)
    storage = PagedKVStorage(target.config, 256 // block_size, block_size)
    for seq_id, (prompt, expected) in enumerate(cached_greedy.values()):
        assert generate_paged(target, prompt, 40, manager, storage, seq_id) == expected
    assert manager.num_free == manager.allocator.num_blocks and not manager.tables


def test_seeded_sampling_equals_the_contiguous_cache(target):
    prompt = ByteTokenizer().encode("ROMEO:\n", add_bos=True)
    manager, storage = BlockManager(16, 4), PagedKVStorage(target.config, 16, 4)
    for seed in (0, 1):
        expected = generate_cached(
            target,
            prompt,
            20,
            ContiguousKVCache(target.config, "concat"),
            temperature=0.8,
            seed=seed,
        )
        assert (
            generate_paged(target, prompt, 20, manager, storage, 0, temperature=0.8, seed=seed)
            == expected
        )


def test_decode_logits_equal_the_contiguous_cache(target):
    prompt = ByteTokenizer().encode("KING:\n", add_bos=True)
    contiguous = ContiguousKVCache(target.config, "concat")
    paged = PagedAttention(BlockManager(8, 4), PagedKVStorage(target.config, 8, 4), seq_id=0)
    with torch.no_grad():
        a = target(torch.tensor(prompt), torch.arange(len(prompt)), contiguous)
        b = paged.forward(target, prompt, 0)
        assert (a - b).abs().max() < 1e-5
        for token in [72, 101, 108, 108, 111]:
            a = target(torch.tensor([token]), torch.tensor([contiguous.length]), contiguous)
            b = paged.forward(target, [token], paged.length)
            assert (a - b).abs().max() < 1e-5


# -- prefix caching --------------------------------------------------------------------------------

SHARED = "ROMEO:\nBut soft, what light through yonder window breaks?\n"


def scratch_logits(model: Transformer, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor(ids))


def test_prefix_hit_gives_the_logits_and_tokens_of_a_full_prefill(target):
    tok = ByteTokenizer()
    first, second = (
        tok.encode(SHARED + "JULIET:\n", add_bos=True),
        tok.encode(SHARED + "NURSE:\n", add_bos=True),
    )
    bs = 8
    manager, storage = BlockManager(32, bs), PagedKVStorage(target.config, 32, bs)
    generate_paged(target, first, 5, manager, storage, seq_id=0, use_prefix_cache=True)
    assert manager.num_free == 32  # freed, but its full prompt blocks keep their names

    attention = PagedAttention(manager, storage, seq_id=1)
    cached = manager.allocate_cached(1, second)
    assert cached >= 2 * bs and cached == (len(tok.encode(SHARED, add_bos=True)) // bs) * bs
    with torch.no_grad():
        logits = attention.forward(target, second[cached:], cached)  # only the uncached suffix
    expected = scratch_logits(target, second)[cached:]
    # relative to the logits' size: the suffix-only and the whole prefill multiply matrices of
    # other shapes, so their float32 sums round differently, by how much depends on the CPU
    assert (logits - expected).abs().max() < 1e-5 * expected.abs().max()
    manager.free(1)

    expected = generate_cached(target, second, 20, ContiguousKVCache(target.config, "concat"))
    assert (
        generate_paged(target, second, 20, manager, storage, seq_id=2, use_prefix_cache=True)
        == expected
    )
    assert manager.num_free == 32 and not manager.tables


def test_a_fully_cached_prompt_still_computes_its_last_token(target):
    bs = 4
    prompt = ByteTokenizer().encode("KING:\nGood day", add_bos=True)[:12]  # exactly 3 full blocks
    manager, storage = BlockManager(16, bs), PagedKVStorage(target.config, 16, bs)
    expected = generate_cached(target, prompt, 10, ContiguousKVCache(target.config, "concat"))
    assert (
        generate_paged(target, prompt, 10, manager, storage, 0, use_prefix_cache=True) == expected
    )
    # Hold the cached prompt in sequence 7 so the hit blocks are shared: the rewrite of the last
    # token must copy its block instead of writing into sequence 7's.
    assert manager.allocate_cached(7, prompt) == 12
    held = list(manager.tables[7].blocks)
    before = storage.kv[:, :, held].clone()
    assert (
        generate_paged(target, prompt, 10, manager, storage, 1, use_prefix_cache=True) == expected
    )
    assert torch.equal(storage.kv[:, :, held], before)
    manager.free(7)
    assert manager.num_free == 16


# -- running out of blocks -------------------------------------------------------------------------


def test_out_of_blocks_propagates_and_frees_the_sequence(target):
    prompt = ByteTokenizer().encode("ROMEO:\n", add_bos=True)  # 8 tokens
    manager, storage = BlockManager(3, 4), PagedKVStorage(target.config, 3, 4)
    manager.allocate(99, 4)  # someone else holds one block: 2 left, room for 8 tokens
    with pytest.raises(OutOfBlocks, match="needed 1, only 0 free"):  # the first decode's block
        generate_paged(target, prompt, 10, manager, storage, seq_id=0)
    assert manager.num_free == 2 and list(manager.tables) == [99]
    manager.free(99)
    assert manager.num_free == 3


def test_a_seq_id_already_running_is_refused_and_left_alone(target):
    manager, storage = BlockManager(4, 4), PagedKVStorage(target.config, 4, 4)
    manager.allocate(0, 4)
    with pytest.raises(ValueError, match="already has a block table"):
        generate_paged(target, [256, 65], 3, manager, storage, seq_id=0)
    assert 0 in manager.tables and manager.num_free == 3


def test_a_cpu_pool_asks_for_huge_pages_and_holds_zeros() -> None:
    """The K/V pool in CPU memory starts on a 2 MiB boundary (where Linux can map it with huge
    pages) once it is that big; it is zeros, contiguous, of its shape and dtype either way."""
    for shape in [(2, 3, 5), (6, 2, 600, 16, 2, 32)]:
        pool = zeros_on_huge_pages(shape, torch.float32)
        assert pool.shape == shape and pool.dtype == torch.float32 and pool.is_contiguous()
        assert not pool.any()
        pool.view(-1)[-1] = 1.0  # the whole pool is writable memory of its own
        assert float(pool.sum()) == 1.0
        if sys.platform.startswith("linux") and pool.numel() * 4 >= HUGE_PAGE:
            assert pool.data_ptr() % HUGE_PAGE == 0
