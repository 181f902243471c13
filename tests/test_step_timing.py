"""book/step_timing.py, which chapter 07 and two benchmarks time CPU decode steps with: its engines
are on the CPU and all decoding, also on a GPU machine (there `device="auto"` would put them on
the GPU, whose CUDA graphs never call the clocked backend: attention would read 0 ms)."""

from __future__ import annotations

import torch

from minivllm.book.step_timing import decode_engine, time_decode_steps


def test_decode_engines_time_cpu_steps_with_their_attention(target, monkeypatch) -> None:
    # a GPU, as far as device="auto" asks: the engines must stay on the CPU all the same
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    engines = {name: decode_engine(target, name, num_seqs=4) for name in ("torch", "numba")}
    for engine in engines.values():
        assert engine.config.device == "cpu"
        assert next(engine.model.parameters()).device.type == "cpu"
        assert len(engine.scheduler.running) == 4
        assert all(seq.num_tokens > seq.num_prompt_tokens for seq in engine.scheduler.running)
    timing = time_decode_steps(engines, steps=2, rounds=1)
    for row in timing.values():
        assert row["batch"] == 4
        assert 0 < row["attention_ms"] < row["step_ms"]
        assert 0 < row["attention_share"] < 1
