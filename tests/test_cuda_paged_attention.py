"""The numba-cuda paged-attention kernels (chapter 08) against a float64 reference.

On a CPU the kernels run in numba's CUDA simulator -- the same source, every CUDA thread a Python
thread -- so these shapes are small: v3 is checked on a set of cases in which every block size
(8/16/32), head_dim (32/64/128), GQA group (1/2/4) and dtype appears, and the full product of them
runs natively when a GPU is present; v4 on two of those cases and on what only its tiles have, and
natively on every head_dim, group and dtype. Inputs are fresh random numbers (never zeros) and the
output is poisoned with NaN before the launch, so an element the kernel forgets to write cannot
pass.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from minivllm.attention.cuda.kernels import merge_partitions
from minivllm.attention.cuda.launch import (
    GroupedDecode,
    device_view,
    grouped_paged_attention,
    paged_attention,
)
from minivllm.attention.cuda.simulator import SIMULATOR
from minivllm.book.kernel_check import kernel_error, random_inputs, reference_attention

GPU = torch.cuda.is_available()
# The kernels take tensors where they run: on the GPU when there is one, else the simulator's CPU.
DEVICE = "cuda" if GPU else "cpu"
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3}


def make_case(num_heads_kv_dim, block_size, context_lens, dtype, seed, device=DEVICE):
    """Random inputs with each sequence's blocks scattered, three spare blocks nobody owns."""
    num_heads, num_kv_heads, head_dim = num_heads_kv_dim
    return random_inputs(
        context_lens,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        dtype,
        seed,
        spare_blocks=3,
        device=device,
    )


def relative_error(case, partition_size=None, threads=32, **options) -> float:
    """One warp per block by default: a simulated thread is a Python thread, so fewer is faster."""
    return kernel_error(case, partition_size=partition_size, threads=threads, **options)


def test_the_simulator_runs_when_there_is_no_gpu() -> None:
    print(
        "kernels run "
        f"{'in the CUDA simulator' if SIMULATOR else 'natively on ' + torch.cuda.get_device_name()}"
    )
    assert SIMULATOR != GPU


@pytest.mark.exercise("ch08.1")
@pytest.mark.parametrize(
    "shape, block_size, lens, threads",
    [
        ((2, 1, 16), 4, [1, 11], 32),  # GQA 2, a one-token context, a context ending mid-block
        ((2, 2, 32), 8, [8, 3], 64),  # no GQA, a context ending on a block boundary, two warps
    ],
)
def test_v1_matches_the_reference(shape, block_size, lens, threads) -> None:
    assert (
        relative_error(
            make_case(shape, block_size, lens, torch.float32, seed=len(lens) + threads),
            threads=threads,
        )
        <= TOLERANCE[torch.float32]
    )


@pytest.mark.exercise("ch08.1")
def test_v1_in_float16() -> None:
    assert (
        relative_error(make_case((2, 1, 16), 4, [10], torch.float16, seed=3))
        <= TOLERANCE[torch.float16]
    )


@pytest.mark.exercise("ch08.2")
def test_the_merge_weights_each_partition_by_its_log_sum_exp() -> None:
    """`merge_partitions` alone, on partitions computed here in float64 (so ch08.2 is graded
    without v2's attention, ch08.1's code): 2 sequences x 3 heads, partitions of 4 scores; the
    second sequence has 5 tokens, so its last partition is empty, with NaN where its output would
    be -- an empty partition must weigh nothing."""
    generator = torch.Generator().manual_seed(7)
    seqs, heads, parts, size, dim = 2, 3, 3, 4, 16
    lengths = [parts * size, 5]
    scores = 3 * torch.randn(seqs, heads, parts * size, generator=generator, dtype=torch.float64)
    values = torch.randn(seqs, parts * size, dim, generator=generator, dtype=torch.float64)
    partial = torch.full((seqs, heads, parts, dim), float("nan"), dtype=torch.float64)
    max_logits = torch.full((seqs, heads, parts), float("-inf"), dtype=torch.float64)
    exp_sums = torch.zeros(seqs, heads, parts, dtype=torch.float64)
    expected = torch.empty(seqs, heads, dim, dtype=torch.float64)
    for seq, length in enumerate(lengths):
        real = scores[seq, :, :length]
        expected[seq] = real.softmax(-1) @ values[seq, :length]
        for p in range(-(-length // size)):
            chunk = real[:, p * size : (p + 1) * size]
            max_logits[seq, :, p] = chunk.max(-1).values
            weights = (chunk - max_logits[seq, :, p, None]).exp()
            exp_sums[seq, :, p] = weights.sum(-1)
            chunk_values = values[seq, p * size : p * size + chunk.shape[1]]
            partial[seq, :, p] = weights @ chunk_values / exp_sums[seq, :, p, None]
    out = torch.full((seqs, heads, dim), float("nan"), device=DEVICE)
    arguments = [out] + [t.float().to(DEVICE) for t in (partial, max_logits, exp_sums)]
    merge_partitions[(seqs, heads), 32](*(device_view(t) for t in arguments))
    error = (out.cpu().double() - expected).abs().max() / expected.abs().max()
    assert error <= TOLERANCE[torch.float32]


@pytest.mark.exercise("ch08.1")
@pytest.mark.exercise("ch08.2")
def test_v2_merges_partitions_including_empty_ones() -> None:
    # Partitions of 4 tokens: the 9-token sequence has 3, the 2-token one 1 real and 2 empty.
    case = make_case((4, 1, 16), 4, [9, 2], torch.float32, seed=5)
    assert relative_error(case, partition_size=4) <= TOLERANCE[torch.float32]


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda c: [c[0], c[1], c[2][:, :, :, :8].contiguous(), c[3], c[4]], "caches must both be"),
        (lambda c: [c[0], c[1], c[2], c[3], c[4] * 100], "context lengths must be"),
        (
            lambda c: [
                c[0],
                c[1][:, :, :1].expand(-1, -1, 3, -1).contiguous(),
                c[2][:, :, :1].expand(-1, -1, 3, -1).contiguous(),
                c[3],
                c[4],
            ],
            "cannot share",
        ),
    ],
)
def test_bad_shapes_are_refused_before_a_launch(change, message) -> None:
    case = make_case((2, 1, 16), 4, [5, 3], torch.float32, seed=0)
    with pytest.raises(ValueError, match=message):
        paged_attention(*change(case))
    with pytest.raises(ValueError, match="multiple of 32"):
        paged_attention(*case, threads=48)


# v3 in the simulator: each block size, head_dim, group and dtype at least twice; contexts of one
# token, ending mid-block and (with two sequences) spanning several blocks.
V3_CASES = [
    (8, 32, 1, torch.float32),
    (8, 128, 2, torch.float16),
    (16, 64, 2, torch.float32),
    (16, 32, 4, torch.float16),
    (32, 128, 4, torch.float32),
    (32, 64, 1, torch.float16),
]


@pytest.mark.exercise("ch08.3")
@pytest.mark.parametrize("block_size, head_dim, group, dtype", V3_CASES)
def test_v3_matches_the_reference(block_size, head_dim, group, dtype) -> None:
    lens = [1, block_size + 3]
    case = make_case((group, 1, head_dim), block_size, lens, dtype, seed=block_size + head_dim)
    assert relative_error(case, grouped=True) <= TOLERANCE[dtype]


@pytest.mark.exercise("ch08.3")
@pytest.mark.parametrize(
    "lanes_per_token, threads",
    [
        (1, 32),  # every lane its own token: 32 tokens in flight, 32 states to merge
        (32, 32),  # a whole warp on one token, as v1
        (8, 64),  # two warps of four teams each
    ],
)
def test_v3_teams_and_warps_merge_their_softmax_states(lanes_per_token, threads) -> None:
    case = make_case((4, 2, 32), 8, [3, 21], torch.float32, seed=lanes_per_token + threads)
    error = relative_error(case, threads=threads, grouped=True, lanes_per_token=lanes_per_token)
    assert error <= TOLERANCE[torch.float32]


@pytest.mark.exercise("ch08.3")
def test_v3_one_partition_over_every_context_needs_no_merge() -> None:
    case = make_case((4, 2, 32), 8, [19, 6], torch.float32, seed=24)
    assert relative_error(case, partition_size=24, grouped=True) <= TOLERANCE[torch.float32]


@pytest.mark.exercise("ch08.3")
@pytest.mark.exercise("ch08.2")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_v3_split_kv_merges_partitions(dtype) -> None:
    # 3 partitions of 8 tokens; the short sequence has 1 real and 2 empty ones
    case = make_case((4, 2, 32), 8, [19, 6], dtype, seed=8)
    error = relative_error(case, partition_size=8, grouped=True)
    assert error <= TOLERANCE[dtype]


# v4 (tiled) in the simulator, in tiles of 32 tokens (the least: a warp's worth), so that short
# contexts span several: two of v3's cases, then what only v4 has, then its split form.
V4_TILE = 32


@pytest.mark.parametrize("block_size, head_dim, group, dtype", [V3_CASES[1], V3_CASES[3]])
def test_v4_matches_the_reference(block_size, head_dim, group, dtype) -> None:
    lens = [1, block_size + 3]
    case = make_case((group, 1, head_dim), block_size, lens, dtype, seed=block_size + head_dim)
    assert relative_error(case, grouped=True, version="v4", tile=V4_TILE) <= TOLERANCE[dtype]


def test_v4_rescales_over_tiles_and_scatters_a_padded_group() -> None:
    """70 tokens: three tiles, so the running max is rescaled twice and both score buffers are
    reused. Six query heads, padded to eight for the scores' reduce-scatter, two heads a lane (a
    float16 row of 16 is 4 lanes' worth of 8-byte loads); two warps, three heads each in the
    softmax."""
    case = make_case((6, 1, 16), 8, [70, 5], torch.float16, seed=6)
    error = relative_error(case, threads=64, grouped=True, version="v4", tile=V4_TILE)
    assert error <= TOLERANCE[torch.float16]


@pytest.mark.parametrize(
    "shape, block_size, lens, partition_size, dtype",
    [
        # 3 partitions; the short sequence has 1 real and 2 empty ones
        ((4, 2, 32), 8, [19, 6], 8, torch.float16),
        # a group of 3 (padded to 4, one head a lane group); partitions of 16 in blocks of 4
        ((3, 1, 16), 4, [40, 33], 16, torch.float32),
    ],
)
def test_v4_split_kv_merges_partitions(shape, block_size, lens, partition_size, dtype) -> None:
    case = make_case(shape, block_size, lens, dtype, seed=partition_size)
    error = relative_error(
        case, partition_size=partition_size, grouped=True, version="v4", tile=V4_TILE
    )
    assert error <= TOLERANCE[dtype]


def test_v3_decode_serves_every_layer_of_a_step() -> None:
    """One `GroupedDecode` per step, called per layer with that layer's caches and queries."""
    layers = [make_case((4, 2, 32), 8, [5, 12], torch.float32, seed=s) for s in (1, 2)]
    tables, lens = layers[0][3], layers[0][4]
    decode = GroupedDecode(
        tables, lens, 12, num_heads=4, num_kv_heads=2, head_dim=32, block_size=8, threads=32
    )
    for q, key_cache, value_cache, _, _ in layers:
        out = decode(q, key_cache, value_cache)
        expected = reference_attention(q, key_cache, value_cache, tables, lens, torch.float64)
        assert (out.cpu().double() - expected).abs().max() <= 1e-5 * expected.abs().max()


def test_v3_writes_nan_for_a_context_longer_than_the_host_promised() -> None:
    """On a GPU the lengths are not read back, so the kernel guards its shared table itself."""
    q, key_cache, value_cache, tables, lens = make_case((2, 1, 32), 8, [4, 9], torch.float32, 3)
    decode = GroupedDecode(
        tables, lens, 9, num_heads=2, num_kv_heads=1, head_dim=32, block_size=8, threads=32
    )
    lens[1] = 16  # after the checks: as a GPU-side length would be, unseen by the host
    out = decode(q, key_cache, value_cache)
    assert out[1].isnan().all()
    expected = reference_attention(q[:1], key_cache, value_cache, tables[:1], lens[:1])
    assert torch.allclose(out[:1].cpu(), expected, rtol=1e-5, atol=1e-6)


def v3_case():
    return make_case((4, 2, 16), 4, [5, 3], torch.float32, seed=0)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda c: {"max_context_len": 0}, "max_context_len must be in 1..8"),
        (lambda c: {"max_context_len": 9}, "max_context_len must be in 1..8"),
        pytest.param(
            lambda c: {"max_context_len": 4},
            r"context lengths must be in 1..4 ",
            marks=pytest.mark.skipif(
                GPU,
                reason="on a GPU the lengths are not read back (that would be a host sync); "
                "test_v3_writes_nan_for_a_context_longer_than_the_host_promised checks the "
                "kernel's own guard",
            ),
        ),
        (lambda c: {"partition_size": 6}, "partition_size must be a positive multiple of"),
        (lambda c: {"lanes_per_token": 3}, "lanes_per_token must be a power of two"),
        (lambda c: {"lanes_per_token": 32}, "lanes_per_token must be a power of two"),
        (lambda c: {"threads": 48}, "multiple of 32"),
        (lambda c: {"block_tables": c[3].long()}, "block_tables must be int32"),
        (lambda c: {"context_lens": c[4][:1]}, r"and context_lens \[1\] expected, got \(2, 2\)"),
        (lambda c: {"q": c[0][:, :3].contiguous()}, "cannot share"),
        (lambda c: {"q": c[0].half()}, "share one dtype"),
        (lambda c: {"key_cache": c[1][:, :, :1].contiguous()}, "caches must both be"),
        (lambda c: {"value_cache": c[2][..., ::2]}, "caches must both be"),
        (
            lambda c: {"value_cache": c[2].transpose(0, 1).contiguous().transpose(0, 1)},
            "value_cache must be contiguous",
        ),
        (
            lambda c: {"out": torch.full((2, 4, 8), float("nan"), device=DEVICE)},
            "out must be like q",
        ),
        (lambda c: {"partition_size": 50_000}, "bytes of shared memory"),
        (lambda c: {"version": "v5"}, r"version must be one of \('v3', 'v4'\), got 'v5'"),
        (lambda c: {"version": "v4", "lanes_per_token": 4}, "v4 takes no lanes_per_token"),
        (lambda c: {"tile": 64}, "v3 takes no tile"),
        (lambda c: {"version": "v4", "tile": 0}, "tile must be a positive number of tokens"),
        (
            lambda c: {
                "version": "v4",
                # the same cache one float further on: off the 8-byte boundary of two-float loads
                "key_cache": torch.empty(c[1].numel() + 1, device=DEVICE)[1:].view(c[1].shape),
            },
            r"v4 reads key_cache in 8-byte vectors: its data must start on a multiple of 8",
        ),
    ],
)
def test_v3_and_v4_refuse_bad_arguments_before_a_launch(change, message) -> None:
    q, key_cache, value_cache, tables, lens = v3_case()
    arguments = {
        "q": q,
        "key_cache": key_cache,
        "value_cache": value_cache,
        "block_tables": tables,
        "context_lens": lens,
        "max_context_len": 5,
        "threads": 32,
        "out": torch.full_like(q, float("nan")),
    }
    arguments.update(change(v3_case()))
    with pytest.raises(ValueError, match=message):
        grouped_paged_attention(**arguments)
    assert arguments["out"].isnan().all()  # nothing was launched


def test_v3_checks_read_no_value_of_a_device_tensor() -> None:
    """Tables and lengths on the meta device have shapes but no values: reading one (what a GPU
    tensor would need a host-device sync for) would raise, not give the ValueError."""
    tables = torch.empty(2, 3, dtype=torch.int32, device="meta")
    lens = torch.empty(2, dtype=torch.int32, device="meta")
    shape = {"num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "block_size": 4}
    with pytest.raises(ValueError, match=r"max_context_len must be in 1..12"):
        GroupedDecode(tables, lens, 13, **shape)
    with pytest.raises(ValueError, match="partition_size must be"):
        GroupedDecode(tables, lens, 12, partition_size=6, **shape)
    with pytest.raises(ValueError, match="the kernels run on"):  # valid: only the
        GroupedDecode(tables, lens, 12, **shape)  # device itself is refused


def test_split_kv_only_when_the_grid_cannot_fill_the_sms() -> None:
    from minivllm.attention.cuda.launch import split_partition_size

    # 64 sequences x 8 K/V heads = 512 blocks >= 2 per SM on 132 SMs: one partition.
    assert split_partition_size(64, 8, 1024, 16, num_sms=132) is None
    # 1 x 8 blocks: 2 x 132 / 8 = 33 partitions wanted; 4096 / 33 -> 128 tokens, a multiple of 16.
    assert split_partition_size(1, 8, 4096, 16, num_sms=132) == 128
    # Never below min_partition, and no split at all when that leaves one partition.
    assert split_partition_size(1, 8, 1000, 16, num_sms=132, min_partition=200) == 208
    assert split_partition_size(1, 8, 100, 16, num_sms=132) is None


def test_occupancy_counts_several_blocks_per_sm() -> None:
    from minivllm.attention.cuda.occupancy import H100_SXM, blocks_per_sm, occupancy

    # v1 as Nsight Compute saw it (80 registers, 128 threads): 80 x 32 = 2,560 registers a warp,
    # 65,536 / 2,560 = 25 warps, 6 blocks of 4 -- not 1 block per SM.
    assert blocks_per_sm(128, 80, 4 * 1200) == (6, "registers")
    assert blocks_per_sm(128, 32, 4 * 1200) == (16, "warp slots")
    assert blocks_per_sm(128, 32, 60 * 1024) == (3, "shared memory")  # 61 KiB a block
    batch_64 = occupancy(64 * 32, 128, 80, 4 * 1200)  # 2,048 blocks, 792 resident at a time
    assert batch_64.waves == 3
    assert batch_64.warp_occupancy == pytest.approx(2048 * 4 / (3 * 132 * 64))
    assert occupancy(8, 128, 80, 4 * 1200).warp_occupancy == pytest.approx(32 / (132 * 64))
    with pytest.raises(ValueError, match="does not fit"):
        occupancy(1, 128, 32, 300 * 1024, H100_SXM)


GPU_ONLY = pytest.mark.skipif(
    not GPU,
    reason="no CUDA GPU: the native kernels need one (the simulator tests above run "
    "the same kernel source on the CPU)",
)
GRID = list(
    itertools.product([8, 16, 32], [32, 64, 128], [1, 2, 4], [torch.float32, torch.float16])
)


def grid_case(block_size, head_dim, group, dtype, lens):
    """A case of the GPU grid: 8 query heads in groups of `group`, on the GPU."""
    seed = block_size + head_dim + group
    return make_case((8, 8 // group, head_dim), block_size, lens, dtype, seed, device="cuda")


@GPU_ONLY
@pytest.mark.parametrize("block_size, head_dim, group, dtype", GRID)
@pytest.mark.parametrize("partition_size", [None, 64])
def test_full_grid_on_the_gpu(block_size, head_dim, group, dtype, partition_size) -> None:
    case = grid_case(
        block_size, head_dim, group, dtype, [1, block_size - 1, 3 * block_size + 5, 517]
    )
    assert relative_error(case, partition_size=partition_size, threads=128) <= TOLERANCE[dtype]


@GPU_ONLY
@pytest.mark.parametrize("block_size, head_dim, group, dtype", GRID)
@pytest.mark.parametrize("partition_size", [None, 64, 512])
def test_v3_full_grid_on_the_gpu(block_size, head_dim, group, dtype, partition_size) -> None:
    lens = [1, block_size - 1, 3 * block_size + 5, 517, 2000]
    case = grid_case(block_size, head_dim, group, dtype, lens)
    error = relative_error(case, partition_size=partition_size, threads=128, grouped=True)
    assert error <= TOLERANCE[dtype]


V4_GRID = [
    (16, head_dim, group, dtype)
    for head_dim, group, dtype in itertools.product(
        [32, 64, 128], [1, 2, 4], [torch.float32, torch.float16]
    )
] + [(8, 128, 4, torch.float16), (32, 128, 4, torch.float16)]


@GPU_ONLY
@pytest.mark.parametrize("block_size, head_dim, group, dtype", V4_GRID)
@pytest.mark.parametrize("partition_size", [None, 64, 512])
def test_v4_full_grid_on_the_gpu(block_size, head_dim, group, dtype, partition_size) -> None:
    """Every head_dim, group and dtype at block size 16, the other block sizes at one shape (each
    shape is a compilation); its default tile of 64 tokens."""
    lens = [1, block_size - 1, 3 * block_size + 5, 517, 2000]
    case = grid_case(block_size, head_dim, group, dtype, lens)
    error = relative_error(
        case, partition_size=partition_size, threads=128, grouped=True, version="v4"
    )
    assert error <= TOLERANCE[dtype]


@GPU_ONLY
@pytest.mark.parametrize("partition_size", [None, 512])
def test_v4_with_eight_warps_a_block_on_the_gpu(partition_size) -> None:
    """The benchmark's 256-thread variant: 8 key teams and 8 value teams a block."""
    case = grid_case(16, 128, 4, torch.float16, [1, 15, 53, 517, 2000])
    error = relative_error(
        case, partition_size=partition_size, threads=256, grouped=True, version="v4"
    )
    assert error <= TOLERANCE[torch.float16]


def test_the_engine_gives_the_same_tokens_with_the_kernel_backend(monkeypatch) -> None:
    """A tiny random model, so the simulator can run every decode of a few requests through the
    kernel: "cuda" on v3, "cuda-v4" on v4."""
    from minivllm.attention.cuda.backend import CudaPagedAttention, CudaTiledPagedAttention
    from minivllm.engine.config import EngineConfig
    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.model.transformer import ModelConfig, Transformer, init_weights
    from minivllm.sched.sequence import SamplingParams

    model = Transformer(
        ModelConfig(d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64, max_seq_len=64)
    )
    init_weights(model, seed=0)
    prompts, params = (
        [[256, 65, 66], [256, 71, 72, 73, 74]],
        SamplingParams(max_tokens=3, temperature=0),
    )
    outputs, ran, versions = {}, {}, []
    original_call = GroupedDecode.__call__

    def counting_call(self, *args, **kwargs):
        versions.append(self.version)
        return original_call(self, *args, **kwargs)

    monkeypatch.setattr(GroupedDecode, "__call__", counting_call)
    for backend in ["torch", "cuda", "cuda-v4"]:
        versions.clear()
        engine = LLMEngine(
            model,
            EngineConfig(num_blocks=16, block_size=4, device=DEVICE, attention_backend=backend),
        )
        outputs[backend] = [o.token_ids for o in engine.generate(prompts, params)]
        ran[backend] = (engine.runner.backend, sorted(set(versions)))
    assert ran["cuda"] == (CudaPagedAttention, ["v3"]), "the decodes did not run on v3"
    assert ran["cuda-v4"] == (CudaTiledPagedAttention, ["v4"]), "the decodes did not run on v4"
    assert all(len(t) == 3 for t in outputs["torch"])
    assert outputs["cuda"] == outputs["torch"] and outputs["cuda-v4"] == outputs["torch"]


@pytest.mark.skipif(
    not GPU,
    reason="no CUDA GPU: the real model's decodes on the native kernel need one (the "
    "simulator test above runs a tiny model through the same backend)",
)
def test_the_real_model_gives_the_same_greedy_tokens_on_the_gpu_kernel(target) -> None:
    from minivllm.engine.config import EngineConfig
    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.sched.sequence import SamplingParams
    from minivllm.training.corpus import shipped_validation_text

    text = shipped_validation_text()
    # uneven prompts, batched decodes
    prompts = [text[i * 500 : i * 500 + 20 + 37 * i] for i in range(8)]
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    outputs = {}
    for backend in ["torch", "cuda", "cuda-v4"]:
        engine = LLMEngine(target, EngineConfig(device="cuda", attention_backend=backend))
        outputs[backend] = [o.token_ids for o in engine.generate(prompts, params)]
    assert outputs["cuda"] == outputs["torch"] and outputs["cuda-v4"] == outputs["torch"]
