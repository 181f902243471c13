"""benchmarks/step_profile.py's minivllm half, kept working: one profiled decode step at batch 1
is attributed to every component of the table, the parts add up to the step, the roofline floors
come from the shapes, and the profiling wrappers are gone afterwards. (The benchmark itself, with
vLLM, is not a test: minutes.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from _common import make_workload  # noqa: E402
from step_profile import (  # noqa: E402
    COMPONENTS,
    MATMULS,
    TARGET,
    minivllm_run,
    table,
)

from minivllm.book.roofline import floors, model_dims  # noqa: E402
from minivllm.model import fused, transformer  # noqa: E402
from minivllm.model.checkpoint import load_model  # noqa: E402
from minivllm.model.fused import fuse_model  # noqa: E402


@pytest.mark.usefixtures("one_torch_thread")
def test_one_profiled_step_is_attributed_to_every_component() -> None:
    model = fuse_model(load_model(TARGET, "float32"), in_place=True)
    originals = (F.linear, transformer.RMSNorm.forward, fused.apply_rope)
    prompts = {"1": [r.prompt_ids for r in make_workload(1, 0)]}
    record = minivllm_run(model, prompts, warmup=0, steps=1)["1"]
    assert (F.linear, transformer.RMSNorm.forward, fused.apply_rope) == originals
    assert len(record["wall_ms"]) == 1 and len(record["profiled"]) == 1
    step = record["profiled"][0]
    unknown = set(step) - set(COMPONENTS) - {"step (profiled)"}
    assert not unknown, f"time given to no component of the table: {unknown}"
    for component in [*MATMULS, "attention", "norms", "RoPE", "schedule", "batch build"]:
        assert step.get(component, 0.0) > 0.0, component
    parts = sum(v for k, v in step.items() if k in COMPONENTS)
    assert parts == pytest.approx(step["step (profiled)"], rel=0.02)

    config = model_dims(model)
    limits = {"bandwidth_GBps": 10.0, "cache_copy_GBps": 50.0, "gemm_2048_GFLOPs": 100.0}
    rows = {r["component"]: r for r in table("minivllm", 1, record, limits, config, 100.0)}
    # q/k/v at batch 1 is a read of its weights: 6 layers x 384 x 256 floats, bandwidth-bound
    qkv_bytes = 6 * 4 * (384 * 256 + 256 + 384)
    assert rows["qkv matmul"]["roofline_ms"] == pytest.approx(qkv_bytes / 10e9 * 1e3, rel=1e-3)
    # in bfloat16 (`--dtype bfloat16`) the same read moves half the bytes
    halves = {r["component"]: r for r in table("minivllm", 1, record, limits, config, 100.0, 2)}
    assert halves["qkv matmul"]["roofline_ms"] == pytest.approx(
        qkv_bytes / 2 / 10e9 * 1e3, rel=1e-3
    )
    assert rows["schedule"]["roofline_ms"] is None  # host work: no floor worth the name
    assert floors(config, 64, 64 * 100.0)["gate/up matmul"][1] == 6 * 2 * 64 * 256 * 1024
    torch.testing.assert_close(
        rows["step (profiled)"]["roofline_ms"],
        sum(r["roofline_ms"] or 0.0 for k, r in rows.items() if k in COMPONENTS),
        rtol=1e-3,
        atol=1e-4,
    )


def test_every_benchmark_record_names_the_cpus_features() -> None:
    """Issue 32, item 4: a result says which vector paths its CPU offered (the flags Linux lists,
    the level torch dispatched to, the CPU numba compiled for), so runs on an AVX2 EPYC and an
    AVX-512 Xeon are told apart."""
    from _common import VECTOR_FLAGS, machine_record

    features = machine_record("test")["cpu_features"]
    assert set(features["vector_flags"]) <= set(VECTOR_FLAGS)
    assert isinstance(features["torch_cpu_capability"], str) and features["torch_cpu_capability"]
    assert features["llvm_cpu"]  # llvmlite comes with numba, which the project requires
    if Path("/proc/cpuinfo").exists() and "avx2" in Path("/proc/cpuinfo").read_text():
        assert "avx2" in features["vector_flags"]
        if "avx512f" not in features["vector_flags"]:  # torch's widest path here is AVX2
            assert features["torch_cpu_capability"] == "AVX2"


class _Event:
    """What `attribute` reads of a profiler event: its name, parent, children and duration."""

    def __init__(self, name: str, us: float, children: tuple = ()) -> None:
        self.name, self.cpu_parent, self.cpu_children = name, None, list(children)
        self.time_range = type("Span", (), {"elapsed_us": lambda _self: us})()
        for child in children:
            child.cpu_parent = self

    def walk(self):
        yield self
        for child in self.cpu_children:
            yield from child.walk()


def test_a_compiled_vllm_step_splits_into_its_graph_matmuls_and_attention() -> None:
    """`vllm-compiled`: the ops inductor's graph calls are named by what they do, the graph's own
    time is its fused kernels, the matmul after it (in `postprocess`) is the LM head -- as a
    compiled vLLM 0.32 step's profile nests them."""
    from step_profile import GRAPH, GRAPH_MATMULS, attribute

    attention = _Event(
        "vllm::unified_attention_with_output", 80, (_Event("_C::cpu_attention_with_kv_cache", 40),)
    )
    graph = _Event(
        "## Call CompiledFxGraph None ##",
        2000,
        (_Event("_C::onednn_mm", 600), attention, _Event("vllm::unified_kv_cache_update", 70)),
    )
    forward = _Event("gpu_model_runner: forward", 2500, (_Event("Pregraph bytecode", 90), graph))
    postprocess = _Event("gpu_model_runner: postprocess", 200, (_Event("_C::onednn_mm", 30),))
    step = _Event("sp:step", 3000, (forward, postprocess))
    [parts] = attribute(list(step.walk()))
    assert parts[GRAPH_MATMULS] == pytest.approx(0.6)
    assert parts["attention"] == pytest.approx(0.15)
    assert parts[GRAPH] == pytest.approx(2.0 - 0.6 - 0.08 - 0.07)
    assert parts["LM head"] == pytest.approx(0.03)
    assert parts["other ops"] == pytest.approx(0.09)  # dynamo's guards, before the graph
    assert parts["forward: Python and gaps"] == pytest.approx(2.5 - 2.0 - 0.09 + 0.2 - 0.03)
    assert sum(v for k, v in parts.items() if k in COMPONENTS) == pytest.approx(3.0)
