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

# torch's OpenMP threads (libgomp) spin after each parallel region by default, for milliseconds,
# waiting for the next one on cores that numba's attention threads, the engine's Python or another
# process need; on a busy 2-core machine that made the engine an order of magnitude slower
# (chapter 07 measures it). Passive threads sleep at once -- and each of the few hundred parallel
# ops of a step must then wake them again, slow on a virtual machine whose idle vCPUs halt. So
# minivllm's default lies between: passive, with a short spin first (GOMP_SPINCOUNT; libgomp's own
# estimate is 100,000 spins a millisecond, so about 0.2 ms), which bridges the gap between two ops.
# numba's attention and norm loops run on these same threads, as torch's pip build shares its
# libgomp (`model/numba_threads.py`). Spinning threads would hold cores another busy process
# needs -- two engines sharing the book's two cores each took 5x as long -- so the engine
# watches its cores and, while other processes keep them busy, runs a pass on the cores they
# leave (`runner/threads.py`, `CoreWatch`): one thread, and nothing spins.
# Measured on the book's 2-core machine (issue 32), vllm_peer's workload at 128 requests ran in
# 0.92x the time eager and 0.89x compiled on an AMD Zen 3 (medians of 6 alternating runs), 0.76x
# eager on a Zen 4, whose idle vCPUs wake slowly (medians of 3).
# libgomp reads these once, when torch loads: so they are set only when torch has not loaded yet
# (the environment then says what torch really got), and only where you set no wait policy --
# `OMP_WAIT_POLICY=PASSIVE` alone (the Makefile exports it, for the tests) is passive, no spin.
SHORT_SPIN_COUNT = "20000"
if "torch" not in sys.modules and "OMP_WAIT_POLICY" not in os.environ:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    os.environ.setdefault("GOMP_SPINCOUNT", SHORT_SPIN_COUNT)

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
