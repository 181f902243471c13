"""The numba-cuda paged-attention kernels (chapter 07) against the torch reference.

On a CPU the kernels run in numba's CUDA simulator -- the same source, every CUDA thread a Python
thread -- so these shapes are small. The full grid of the issue (block sizes 8/16/32, head_dim
32/64/128, GQA 1/2/4, float32 and float16) runs natively when a GPU is present. Inputs are fresh
random numbers (never zeros) and the output is poisoned with NaN before the launch, so an element
the kernel forgets to write cannot pass.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from minivllm.attention.cuda.launch import paged_attention
from minivllm.attention.cuda.simulator import SIMULATOR
from minivllm.book.kernel_check import kernel_error, random_inputs

GPU = torch.cuda.is_available()
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3}


def make_case(num_heads_kv_dim, block_size, context_lens, dtype, seed, device="cpu"):
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


def relative_error(case, partition_size=None, threads=32) -> float:
    """One warp per block by default: a simulated thread is a Python thread, so fewer is faster."""
    return kernel_error(case, partition_size=partition_size, threads=threads)


def test_the_simulator_runs_when_there_is_no_gpu() -> None:
    print(
        "kernels run "
        f"{'in the CUDA simulator' if SIMULATOR else 'natively on ' + torch.cuda.get_device_name()}"
    )
    assert SIMULATOR != GPU


@pytest.mark.exercise("ch07.1")
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


@pytest.mark.exercise("ch07.1")
def test_v1_in_float16() -> None:
    assert (
        relative_error(make_case((2, 1, 16), 4, [10], torch.float16, seed=3))
        <= TOLERANCE[torch.float16]
    )


@pytest.mark.exercise("ch07.2")
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


GRID = list(
    itertools.product([8, 16, 32], [32, 64, 128], [1, 2, 4], [torch.float32, torch.float16])
)


@pytest.mark.skipif(
    not GPU,
    reason="no CUDA GPU: the native kernels need one (the simulator tests above run "
    "the same kernel source on the CPU)",
)
@pytest.mark.parametrize("block_size, head_dim, group, dtype", GRID)
@pytest.mark.parametrize("partition_size", [None, 64])
def test_full_grid_on_the_gpu(block_size, head_dim, group, dtype, partition_size) -> None:
    lens = [1, block_size - 1, 3 * block_size + 5, 517]
    case = make_case(
        (8, 8 // group, head_dim),
        block_size,
        lens,
        dtype,
        seed=block_size + head_dim + group,
        device="cuda",
    )
    assert relative_error(case, partition_size=partition_size, threads=128) <= TOLERANCE[dtype]


def test_the_engine_gives_the_same_tokens_with_the_kernel_backend() -> None:
    """A tiny random model, so the simulator can run every decode of a few requests through the
    kernel."""
    from minivllm.attention.cuda.backend import CudaPagedAttention
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
    outputs = {}
    for backend in ["torch", "cuda"]:
        engine = LLMEngine(
            model,
            EngineConfig(num_blocks=16, block_size=4, device="cpu", attention_backend=backend),
        )
        outputs[backend] = [o.token_ids for o in engine.generate(prompts, params)]
    assert engine.runner.backend is CudaPagedAttention
    assert outputs["cuda"] == outputs["torch"] and all(len(t) == 3 for t in outputs["torch"])


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
    for backend in ["torch", "cuda"]:
        engine = LLMEngine(target, EngineConfig(device="cuda", attention_backend=backend))
        outputs[backend] = [o.token_ids for o in engine.generate(prompts, params)]
    assert outputs["cuda"] == outputs["torch"]
