"""The forward under torch.compile (runner/compiled.py, `EngineConfig(compile_forward=True)`):
its logits are the eager model's to float32 rounding on a mixed batch, on both CPU backends; an
engine on it gives the eager engine's greedy tokens (where one differs, the eager logits nearly
tie there); another model of the same shapes runs on the same graph with its own weights; big
weights stay on the packed oneDNN path inside one graph, with no graph break; the configurations
it cannot run in (and a machine without a C++ compiler) are refused. One compile per test process
(about 20 s) serves most tests here; the packed one compiles its own."""

from __future__ import annotations

import copy
import functools
import json
import sys
from pathlib import Path

import pytest
import torch
from test_forward_workers import mixed_batch

import minivllm.model.fused as fused_module
from minivllm import EngineConfig, LLMEngine, SamplingParams
from minivllm.attention.backend import get_backend
from minivllm.engine.config import _resolve_device
from minivllm.model.fused import fuse_projections
from minivllm.runner import compiled as compiled_module
from minivllm.runner.batch import run_model
from minivllm.runner.compiled import CompiledForward, cpp_compiler
from minivllm.training.corpus import shipped_validation_text

needs_cxx = pytest.mark.skipif(
    cpp_compiler() is None, reason="no C++ compiler: inductor cannot build CPU code here"
)

# The largest logit difference compiled against eager: the fused loops sum in another order.
TOLERANCE = 1e-4
# Greedy tokens may part where the eager model's two likeliest tokens are closer than this.
NEAR_TIE = 1e-3


@needs_cxx
@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_compiled_logits_are_the_eager_ones_to_rounding(target, backend) -> None:
    model = fuse_projections(target)
    storage, batch = mixed_batch(model)
    eager = run_model(model, storage, batch, get_backend(backend))
    compiled = run_model(CompiledForward(model), storage, batch, get_backend(backend))
    assert compiled.shape == eager.shape == (len(batch.logits_indices), model.config.vocab_size)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=TOLERANCE)


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@needs_cxx
def test_a_compiled_engine_gives_the_eager_greedy_tokens(target) -> None:
    text = shipped_validation_text()
    prompts = [text[300 * i : 300 * i + 20 + 37 * i] for i in range(10)]
    params = [SamplingParams(max_tokens=16 + 4 * i, temperature=0) for i in range(10)]
    tokens = {}
    for compiled in (False, True):
        config = EngineConfig(num_blocks=128, block_size=16, compile_forward=compiled)
        engine = LLMEngine(target, config)
        assert (engine.runner.compiled is not None) == compiled
        outputs = engine.generate(prompts, params)
        tokens[compiled] = [(o.prompt_token_ids, o.token_ids) for o in outputs]
    parted = 0
    for (prompt, eager), (_, compiled) in zip(tokens[False], tokens[True]):
        assert len(eager) == len(compiled)
        if eager == compiled:
            continue
        parted += 1  # only at a near-tie of the eager model's logits
        i = first_difference(eager, compiled)
        with torch.no_grad():
            logits = target(torch.tensor(list(prompt) + list(eager[:i])))[-1]
        top2 = logits.topk(2).values
        assert float(top2[0] - top2[1]) < NEAR_TIE, (i, eager[i], compiled[i])
    assert parted <= 2, f"{parted} of {len(prompts)} requests parted"


@needs_cxx
def test_a_compiled_engine_compiles_as_it_starts(target, monkeypatch) -> None:
    """One warm-up pass when the engine is built (a server's first request does not wait for
    the compile), in a block lent and taken back: later blocks go as they would have."""
    passes = []
    original = CompiledForward.__call__

    def counted(self, *args, **kwargs):
        passes.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(CompiledForward, "__call__", counted)
    engines = [
        LLMEngine(target, EngineConfig(num_blocks=32, block_size=16, compile_forward=compiled))
        for compiled in (False, True)
    ]
    assert passes == [1]
    for engine in engines:
        assert engine.manager.num_free == 32 and not engine.manager.tables
        engine.add_request("ROMEO:\nBut soft", SamplingParams(max_tokens=20, temperature=0))
        engine.step()
    assert engines[0].manager.block_table(0) == engines[1].manager.block_table(0)


@needs_cxx
def test_another_model_runs_on_the_same_graph_with_its_own_weights(target) -> None:
    """The weights are graph inputs, not constants folded in: a second model of the same shapes
    (or a weight changed in place) is computed with its own values."""
    first = fuse_projections(target)
    second = copy.deepcopy(first)
    with torch.no_grad():
        for weight in second.parameters():
            weight.mul_(1.01)
    for model in (first, second, first):
        storage, batch = mixed_batch(model)
        eager = run_model(model, storage, batch, get_backend("numba"))
        compiled = run_model(CompiledForward(model), storage, batch, get_backend("numba"))
        torch.testing.assert_close(compiled, eager, rtol=0, atol=TOLERANCE)


@needs_cxx
@pytest.mark.parametrize("packing", ["every weight big", "packed by pack_weights"])
def test_packed_weights_stay_packed_inside_the_graph(target, monkeypatch, packing: str) -> None:
    """A real model's big weights go through oneDNN packed (model/fused.py `linear`); under
    compile that path is one opaque op (`minivllm::packed_linear`), called with the graph's own
    weights, so inductor does not hand the matmul to MKL's unpacked sgemm. Either every weight
    counts as big (threshold 0), or the book's three a layer that the engine's `pack_weights`
    packs, which `linear` takes packed for a batch (the mixed batch is one)."""
    if packing == "every weight big":
        monkeypatch.setattr(fused_module, "PACK_MIN_BYTES", 0)
    calls = []
    packed = fused_module._packed_linear
    monkeypatch.setattr(
        fused_module, "_packed_linear", lambda *args: calls.append(1) or packed(*args)
    )
    model = fuse_projections(target)
    if packing == "packed by pack_weights":
        assert fused_module.pack_weights(model) > 0
    # One graph or an error: a frame dynamo gives up on runs eager, calls and all, which the
    # counts below would not tell apart (a branch on the unbacked batch size did so). The frames
    # other tests of this process compiled would count towards dynamo's recompile limit: reset.
    torch._dynamo.reset()
    whole = functools.partial(torch.compile, fullgraph=True)
    monkeypatch.setattr(torch, "compile", lambda *args, **kwargs: whole(*args, **kwargs))
    storage, batch = mixed_batch(model)
    eager = run_model(model, storage, batch, get_backend("numba"))
    eager_calls, calls[:] = len(calls), []
    torch._dynamo.utils.counters.clear()
    compiled = run_model(CompiledForward(model), storage, batch, get_backend("numba"))
    assert len(calls) == eager_calls > 0  # every projection and the LM head, packed, both ways
    # traced anew (the threshold is guarded), as one graph: a break would compile each layer alone
    assert not torch._dynamo.utils.counters["graph_break"], dict(
        torch._dynamo.utils.counters["graph_break"]
    )
    torch.testing.assert_close(compiled, eager, rtol=0, atol=TOLERANCE)


@pytest.mark.parametrize(
    "settings",
    [{"device": "cuda"}, {"forward_processes": 2}, {"tensor_parallel_size": 2}],
)
def test_compiling_is_refused_off_the_cpu_or_in_several_processes(settings) -> None:
    with pytest.raises(ValueError, match="compile_forward runs the forward on the CPU"):
        EngineConfig(compile_forward=True, **settings)


def test_a_compiled_engine_runs_on_the_cpu_where_a_gpu_is_present(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU, as far as "auto" asks
    assert _resolve_device(EngineConfig()) == "cuda"
    assert _resolve_device(EngineConfig(compile_forward=True)) == "cpu"


@needs_cxx
def test_the_benchmark_steps_both_engines_to_the_same_tokens(tmp_path, monkeypatch) -> None:
    """benchmarks/compiled_forward.py kept working (its numbers are the benchmark's, not a
    test's): both engines step the whole workload, every step kind is timed on both, and the
    record counts the requests whose tokens agree."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import compiled_forward

    out = tmp_path / "compiled_forward.json"
    monkeypatch.setattr(sys, "argv", ["compiled_forward.py", "--requests", "6", "--out", str(out)])
    compiled_forward.main()
    record = json.loads(out.read_text())
    assert record["greedy_identical"]["requests"] == 6
    assert record["rows"] and all(row["count"] > 0 for row in record["rows"])
    assert record["rows"][0]["steps"] == "with prefill"
    assert all(t > 0 for t in record["total_step_s"].values())


def test_without_a_cpp_compiler_the_engine_says_so_when_built(target, monkeypatch) -> None:
    monkeypatch.setattr(compiled_module.shutil, "which", lambda name: None)
    with pytest.raises(ValueError, match="compile_forward needs a C\\+\\+ compiler"):
        LLMEngine(target, EngineConfig(num_blocks=16, compile_forward=True))
