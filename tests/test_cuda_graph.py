"""CUDA graphs for decode steps (runner/cuda_graph.py, issue 34).

On a CPU, `DecodeGraphs(capture=False)` runs the graph's padded, fixed-width, static-buffer
forward eagerly: the engine gives the same greedy tokens through it as without it, at batch sizes
that need padding, with sequences finishing at different steps; padding writes only the sink
block; steps that are not decode-only run eagerly. The capture itself needs a GPU (the last test).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from minivllm.attention.storage import PagedKVStorage
from minivllm.attention.torch_backend import TorchPagedAttention
from minivllm.engine import llm_engine
from minivllm.engine.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.kv.block_manager import BlockManager
from minivllm.model import fused
from minivllm.model.fused import fuse_projections
from minivllm.model.transformer import ModelConfig, RopeTable, Transformer, init_weights
from minivllm.runner.batch import BatchPiece, pack_batch
from minivllm.runner.cuda_graph import DecodeGraphs, graph_batch_sizes
from minivllm.sched.scheduler import SchedulerConfig
from minivllm.sched.sequence import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NUM_BLOCKS, BLOCK_SIZE = 48, 4


@pytest.fixture(scope="module")
def tiny() -> Transformer:
    model = Transformer(
        ModelConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48, max_seq_len=40)
    )
    init_weights(model, seed=0)
    return model


def make_engine(model, graphs: bool, monkeypatch, backend: str = "torch", **scheduler):
    """An engine on the CPU; with `graphs`, built as on a GPU (the sink block, `DecodeGraphs`)
    but with `capture=False`, the engine's choice where there is no GPU."""
    monkeypatch.setattr(llm_engine, "uses_cuda_graphs", lambda config, device: graphs)
    scheduler.setdefault("max_num_seqs", 8)
    config = EngineConfig(
        num_blocks=NUM_BLOCKS,
        block_size=BLOCK_SIZE,
        device="cpu",
        attention_backend=backend,
        scheduler=SchedulerConfig(max_num_batched_tokens=64, **scheduler),
    )
    engine = LLMEngine(model, config)
    assert (engine.runner.graphs is not None) == graphs
    return engine


def prompts_and_params(count: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Uneven prompts; each request stops at another step, so the decode batch shrinks."""
    prompts = [[256, *range(65 + i, 65 + i + 2 + 3 * i)] for i in range(count)]
    params = [
        SamplingParams(max_tokens=4 + 3 * i, temperature=0, ignore_eos=True) for i in range(count)
    ]
    return prompts, params


def decode_only_steps(engine: LLMEngine) -> int:
    return sum(1 for r in engine.trace if r.decoded and not r.prefilled)


def test_graph_batch_sizes_are_vllms() -> None:
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert graph_batch_sizes(3) == [1, 2, 3]
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]


@pytest.mark.parametrize("count", [3, 5])
def test_padded_static_decode_gives_the_engines_tokens(tiny, monkeypatch, count) -> None:
    """3 sequences pad to 4, 5 to 8 (then 4, 3, 2, 1 as they finish): the same greedy tokens,
    and the real blocks' K/V the same as the eager engine's; padding wrote the sink alone."""
    prompts, params = prompts_and_params(count)
    eager = make_engine(tiny, False, monkeypatch)
    expected = [o.token_ids for o in eager.generate(prompts, params)]
    engine = make_engine(tiny, True, monkeypatch)
    graphs = engine.runner.graphs
    assert graphs.sink_block == NUM_BLOCKS and engine.storage.num_blocks == NUM_BLOCKS + 1
    assert [o.token_ids for o in engine.generate(prompts, params)] == expected
    assert graphs.replays == decode_only_steps(engine) >= 6
    assert len({len(r.decoded) for r in engine.trace if r.decoded}) == count  # it shrank
    real, sink = engine.storage.kv[:, :, :NUM_BLOCKS], engine.storage.kv[:, :, NUM_BLOCKS]
    torch.testing.assert_close(real, eager.storage.kv, rtol=1e-5, atol=1e-6)
    assert sink[:, :, 0].abs().sum() > 0 and not sink[:, :, 1:].any()  # slot 0 only


def test_steps_that_are_not_decode_only_run_eagerly(tiny, monkeypatch) -> None:
    """Requests arriving while others decode: the mixed steps (a prefill chunk in them) run
    eagerly, the decode-only ones through the graphs, and the tokens are the eager engine's."""
    prompts, params = prompts_and_params(4)
    outputs = {}
    for graphs in (False, True):
        engine = make_engine(tiny, graphs, monkeypatch, max_num_seqs=2)
        ids = [engine.add_request(p, s) for p, s in zip(prompts[:2], params[:2])]
        for _ in range(3):
            engine.step()
        ids += [engine.add_request(p, s) for p, s in zip(prompts[2:], params[2:])]
        done = {}
        while engine.has_unfinished():
            done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
        outputs[graphs] = [done[i] for i in ids]
    mixed = [r for r in engine.trace if r.decoded and r.prefilled]
    assert mixed, "the workload was meant to mix prefills into decode steps"
    assert engine.runner.graphs.replays == decode_only_steps(engine)
    assert outputs[True] == outputs[False]


def test_only_decode_only_batches_fit_a_graph(tiny) -> None:
    manager = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
    for seq_id in range(10):
        manager.allocate(seq_id, 6)
    graphs = DecodeGraphs(
        tiny,
        PagedKVStorage(tiny.config, NUM_BLOCKS + 1, BLOCK_SIZE),
        TorchPagedAttention,
        sink_block=NUM_BLOCKS,
        max_num_seqs=8,
        max_model_len=tiny.config.max_seq_len,
        capture=False,
    )

    def batch(*pieces):
        return pack_batch([BatchPiece(*p) for p in pieces], manager)

    assert graphs.can_run(batch((0, 5, [1], 1), (1, 3, [2], 1)))
    assert not graphs.can_run(batch((0, 5, [1], 1), (1, 0, [2, 3, 4], 1)))  # a prefill chunk
    assert not graphs.can_run(batch((0, 3, [1, 2, 3], 3)))  # a verify (draft tokens)
    assert not graphs.can_run(batch((0, 5, [1], 1), (1, 3, [2], 0)))  # a row without logits
    assert not graphs.can_run(batch(*[(i, 5, [1], 1) for i in range(9)]))  # beyond max_num_seqs
    with pytest.raises(ValueError, match="eagerly"):
        graphs.run(batch((0, 0, [1, 2], 1)))


READS = ("item", "tolist", "numpy", "nonzero", "__int__", "__bool__", "__float__", "__index__")


def spy_on_host_reads(monkeypatch) -> list[str]:
    """Record every read of a tensor's values on the host (`.item()`, `int(t)`, `bool(t)`, ...)
    and every boolean-mask index (its output is sized by the mask's values): each would wait for
    the GPU, and none may run inside a CUDA-graph capture. (Patching the methods, not a
    `TorchDispatchMode`, which imports torch._dynamo: seconds on a small machine.)"""
    found: list[str] = []

    def spy(name, original):
        def wrapper(self, *args, **kwargs):
            index = args[0] if args else None
            masks = index if isinstance(index, tuple) else (index,)
            if name not in ("__getitem__", "__setitem__") or any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in masks
            ):
                found.append(name)
            return original(self, *args, **kwargs)

        return wrapper

    for name in (*READS, "__getitem__", "__setitem__"):
        monkeypatch.setattr(torch.Tensor, name, spy(name, getattr(torch.Tensor, name)))
    return found


def test_the_captured_forward_reads_nothing_back_on_the_torch_backend(tiny, monkeypatch) -> None:
    """The pass a graph records (model, K/V writes, decode attention at the fixed width), run
    on the CPU under a spy: not one value read back, so on a GPU not one sync in the capture."""
    model = fuse_projections(tiny)
    storage = PagedKVStorage(tiny.config, NUM_BLOCKS + 1, BLOCK_SIZE)
    graphs = DecodeGraphs(
        model,
        storage,
        TorchPagedAttention,
        sink_block=NUM_BLOCKS,
        max_num_seqs=8,
        max_model_len=tiny.config.max_seq_len,
        capture=False,
    )
    # The fused model's CPU-only steps (numba's RoPE through numpy, oneDNN's packed weights) never
    # run on a GPU, where a graph is captured: the stand-in here takes the path a GPU takes.
    monkeypatch.setattr(fused, "on_cpu_in_float32", lambda *tensors: False)
    # and RoPE's cos and sin computed, as on a GPU: the CPU's table reads the largest position
    monkeypatch.setattr(RopeTable, "serves", staticmethod(lambda positions: False))
    found = spy_on_host_reads(monkeypatch)
    for bs in graphs.sizes:
        with torch.inference_mode():
            graphs._forward(bs)
        assert found == [], f"batch {bs}: {found}"
    int(storage.kv[0].max()), storage.kv[storage.kv > 0]  # the spy sees them
    assert found == ["__int__", "__getitem__"]


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="a GPU is here: numba runs the kernel natively, on CUDA tensors only (the GPU test "
    "below runs the kernel backend with real graphs)",
)
def test_the_kernel_backend_runs_the_padded_step_in_the_simulator(tiny, monkeypatch) -> None:
    """Chapter 08's kernel (numba's simulator here) at the graph's fixed width, with padding rows
    of context 1 on the sink block and one partition, as a capture would size it."""
    pytest.importorskip("numba")
    model = Transformer(replace(tiny.config, n_layers=1))  # the simulator is slow: one layer
    init_weights(model, seed=1)
    prompts, _ = prompts_and_params(3)
    params = [SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)] * 3
    eager = make_engine(model, False, monkeypatch)
    expected = [o.token_ids for o in eager.generate(prompts, params)]
    engine = make_engine(model, True, monkeypatch, backend="cuda")
    assert [o.token_ids for o in engine.generate(prompts, params)] == expected
    assert engine.runner.graphs.replays == 2  # 3 sequences padded to 4, twice


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="no CUDA GPU: capturing and replaying CUDA graphs needs one (the tests above run the "
    "same padded static-buffer forward eagerly on the CPU)",
)
@pytest.mark.parametrize("backend", ["torch", "cuda"])
def test_graphs_give_the_eager_tokens_on_the_gpu(target, backend) -> None:
    from minivllm.training.corpus import shipped_validation_text

    text = shipped_validation_text()
    prompts = [text[i * 500 : i * 500 + 20 + 37 * i] for i in range(11)]  # 11 pads to 16
    params = [
        SamplingParams(max_tokens=24 + 4 * i, temperature=0, ignore_eos=True) for i in range(11)
    ]
    outputs = {}
    for eager in (True, False):
        config = EngineConfig(device="cuda", attention_backend=backend, enforce_eager=eager)
        engine = LLMEngine(target, config)
        outputs[eager] = [o.token_ids for o in engine.generate(prompts, params)]
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.capture and graphs.capture_error is None, (
        graphs.capture_error
    )
    assert set(graphs.graphs) == set(graphs.sizes)
    assert graphs.replays == decode_only_steps(engine) > 0
    assert outputs[False] == outputs[True]
