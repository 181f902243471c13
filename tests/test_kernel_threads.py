"""benchmarks/kernel_threads.py kept working: the serial and the parallel kernel give an engine the
same tokens step by step, and the record says which was faster where (the numbers themselves are
the benchmark's, not a test's)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from kernel_threads import engine_steps  # noqa: E402

from minivllm.attention import numba_cpu  # noqa: E402


def test_both_kernels_step_an_engine_to_the_same_tokens(target) -> None:
    original = numba_cpu._kernel_for, numba_cpu.PARALLEL_MIN_COST
    (row,) = engine_steps(target, [4], steps=8)
    # the engine's own choice is put back
    assert (numba_cpu._kernel_for, numba_cpu.PARALLEL_MIN_COST) == original
    assert row["same_tokens"] and row["steps"] == 8
    assert row["serial_step_ms"] > 0 and row["parallel_step_ms"] > 0
