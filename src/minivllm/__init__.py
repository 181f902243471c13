"""minivllm: a small vLLM-style inference engine, built one layer at a time by the book.

The public surface is vLLM's:

    from minivllm import LLM, SamplingParams

    llm = LLM("target")
    for out in llm.generate(["ROMEO:\\n"], SamplingParams(max_tokens=60, temperature=0.8, seed=1)):
        print(out.text)

And astrai's facade, for callers that come and go (threads, coroutines: they share one batch):

    from minivllm import InferenceEngine

    with InferenceEngine("target") as engine:
        print(engine.generate("ROMEO:\\n", max_tokens=60, seed=1))

The names below are imported on first use (PEP 562), not here: `import minivllm.kv` must stay free
of torch, and the package's `__init__` runs before every submodule. ARCHITECTURE.md maps the rest.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import TYPE_CHECKING

# torch's OpenMP threads (libgomp) spin after each parallel region by default, waiting for the next
# one on cores that numba's attention threads, the engine's Python or another process need; on a
# busy 2-core machine that made the engine an order of magnitude slower (chapter 07 measures it).
# Passive threads sleep at once -- and then every parallel op of a step wakes them again, a few
# hundred times a step, each a system call and, on a virtual machine, a sleeping virtual CPU to
# rouse. So torch's threads get a short spin first: GOMP_SPINCOUNT spins (libgomp's own estimate:
# 100,000 a millisecond), long enough to bridge the gap between two ops of a pass, too short to
# hold a core through the attention kernel or the engine's host work. numba's OpenMP threads sleep
# at once (`attention/numba_cpu.py`: a layer of matmuls lies between two of its kernels). On the
# book's 2-core machine the short spin ran the 128-request vllm_peer workload in 0.92x the time
# eager and 0.89x compiled, against passive threads alone (medians of 6 alternating runs, issue 32).
# libgomp reads both once, when torch loads: so only when torch has not loaded yet (the environment
# then says what torch really got), and a value already set wins. The Makefile exports them too,
# for notebooks and scripts that import torch first.
TORCH_SPIN_COUNT = "20000"
if "torch" not in sys.modules:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("GOMP_SPINCOUNT", TORCH_SPIN_COUNT)

_HOMES = {
    "CompletionOutput": "minivllm.engine.processing",
    "LLM": "minivllm.engine.llm_engine",
    "LLMEngine": "minivllm.engine.llm_engine",
    "EngineConfig": "minivllm.engine.config",
    "InferenceEngine": "minivllm.serving.facade",
    "RequestOutput": "minivllm.engine.processing",
    "SamplingParams": "minivllm.sched.sequence",
    "SchedulerConfig": "minivllm.sched.scheduler",
    "SpeculativeConfig": "minivllm.runner.speculative",
}
__all__ = [
    "CompletionOutput",
    "LLM",
    "EngineConfig",
    "InferenceEngine",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
    "SchedulerConfig",
    "SpeculativeConfig",
]

if TYPE_CHECKING:
    from minivllm.engine.config import EngineConfig
    from minivllm.engine.llm_engine import LLM, LLMEngine
    from minivllm.engine.processing import CompletionOutput, RequestOutput
    from minivllm.runner.speculative import SpeculativeConfig
    from minivllm.sched.scheduler import SchedulerConfig
    from minivllm.sched.sequence import SamplingParams
    from minivllm.serving.facade import InferenceEngine


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'minivllm' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
