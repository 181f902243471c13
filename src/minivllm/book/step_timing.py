"""Where a decode step's time goes: the engine at a steady batch of decodes, with the attention
backend's calls timed (chapter 07 and `benchmarks/throughput.py`).

`decode_engine` fills an engine with requests cut from the shipped validation text and steps it
until every prompt is prefilled, so each following step is pure decoding at that batch.
`time_decode_steps` then times steps of one or more such engines **alternately** (a shared machine
drifts; alternating puts every system under the same drift) and reports medians: the step, and the
part of it spent inside the attention backend -- writing the new K/V and attending, every layer.
`time_thread_counts` times one engine's steps on one thread and on two, alternately: what a second
core is worth inside each operation of the step.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from minivllm.engine.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.model.tokenizer import ByteTokenizer
from minivllm.model.transformer import Transformer
from minivllm.sched.scheduler import SchedulerConfig
from minivllm.sched.sequence import SamplingParams
from minivllm.training.corpus import shipped_validation_text


class _TimedBackend:
    """Wraps a backend factory: the attention objects it builds add their call time to
    `seconds`."""

    def __init__(self, factory) -> None:
        self.factory, self.seconds = factory, 0.0
        self.__name__ = getattr(factory, "__name__", "backend")

    def __call__(self, storage, batch):
        inner = self.factory(storage, batch)

        def attend(layer, q, k, v):
            started = time.perf_counter()
            out = inner(layer, q, k, v)
            self.seconds += time.perf_counter() - started
            return out

        return attend


def _clocked(engine: LLMEngine) -> _TimedBackend:
    """The engine's backend factory, wrapped in a clock once."""
    if not isinstance(engine.runner.backend, _TimedBackend):
        engine.runner.backend = _TimedBackend(engine.runner.backend)
    return engine.runner.backend


def decode_engine(
    model: Transformer,
    attention_backend: str,
    num_seqs: int = 64,
    prompt_chars: tuple[int, int] = (16, 320),
    seed: int = 0,
    forward_processes: int = 1,
    tensor_parallel_size: int = 1,
    device: str = "cpu",
) -> LLMEngine:
    """An engine with `num_seqs` greedy requests (prompts of `prompt_chars` characters of the
    validation text, lengths and offsets seeded), stepped until all are decoding. With
    `forward_processes` > 1 its passes are split between processes, with `tensor_parallel_size`
    > 1 its layers between ranks: `close()` it when done. On the CPU unless `device` says
    otherwise, also where a GPU is present: these engines time CPU steps, and a GPU engine's
    decode steps replay CUDA graphs, which never call the backend that `time_decode_steps`
    clocks."""
    text = shipped_validation_text()
    rng = np.random.default_rng(seed)
    lengths = rng.integers(prompt_chars[0], prompt_chars[1] + 1, num_seqs)
    starts = rng.integers(0, len(text) - prompt_chars[1], num_seqs)
    engine = LLMEngine(
        model,
        EngineConfig(
            num_blocks=num_seqs * (model.config.max_seq_len // 16 + 1),
            block_size=16,
            attention_backend=attention_backend,
            scheduler=SchedulerConfig(max_num_seqs=num_seqs, max_num_batched_tokens=512),
            forward_processes=forward_processes,
            tensor_parallel_size=tensor_parallel_size,
            device=device,
        ),
    )
    tokenizer = ByteTokenizer()
    for start, length in zip(starts.tolist(), lengths.tolist()):
        prompt = tokenizer.encode(text[start : start + length], add_bos=True)
        room = model.config.max_seq_len - len(prompt)  # decode as long as the model allows
        engine.add_request(prompt, SamplingParams(max_tokens=room, temperature=0, ignore_eos=True))
    while engine.scheduler.waiting or any(
        seq.num_uncomputed_tokens > 1 for seq in engine.scheduler.running
    ):
        engine.step()
    return engine


def time_decode_steps(engines: dict[str, LLMEngine], steps: int = 10, rounds: int = 3) -> dict:
    """Per engine: the median step time and attention time (ms) over `rounds` alternating runs of
    `steps` steps, and the attention's share of the step."""
    clocks = {name: _clocked(engine) for name, engine in engines.items()}
    step_ms: dict[str, list[float]] = {name: [] for name in engines}
    attention_ms: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(rounds):
        for name, engine in engines.items():
            clocks[name].seconds = 0.0
            started = time.perf_counter()
            for _ in range(steps):
                engine.step()
            step_ms[name].append(1e3 * (time.perf_counter() - started) / steps)
            attention_ms[name].append(1e3 * clocks[name].seconds / steps)
    result = {}
    for name in engines:
        step, attention = statistics.median(step_ms[name]), statistics.median(attention_ms[name])
        result[name] = {
            "batch": len(engines[name].scheduler.running),
            "step_ms": step,
            "attention_ms": attention,
            "attention_share": attention / step,
        }
    return result


def time_thread_counts(
    engine: LLMEngine, counts: tuple[int, ...] = (1, 2), steps: int = 10, rounds: int = 3
) -> dict[int, float]:
    """The median step time (ms) of one engine with torch (and so the numba kernel) on each thread
    count of `counts`, alternating `rounds` times; torch's setting is restored after."""
    before = torch.get_num_threads()
    step_ms: dict[int, list[float]] = {count: [] for count in counts}
    try:
        for _ in range(rounds):
            for count in counts:
                torch.set_num_threads(count)
                started = time.perf_counter()
                for _ in range(steps):
                    engine.step()
                step_ms[count].append(1e3 * (time.perf_counter() - started) / steps)
    finally:
        torch.set_num_threads(before)
    return {count: statistics.median(ms) for count, ms in step_ms.items()}
