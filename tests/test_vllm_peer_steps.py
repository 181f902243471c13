"""benchmarks/vllm_peer.py's step kinds: where in a run one engine gains on the other."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from vllm_peer import combined_kinds, step_kinds  # noqa: E402


def test_steps_are_summed_by_kind_in_the_tables_order() -> None:
    steps = [
        (0.004, 1, False),  # a lone decode
        (0.006, 16, False),  # the largest of the smallest kind
        (0.010, 17, False),
        (0.012, 64, False),
        (0.020, 64, True),  # a prompt chunk among decodes: a prefill kind, whatever its size
        (0.030, 300, True),
        (0.050, 512, True),
    ]
    kinds = step_kinds(steps)
    assert list(kinds) == [
        "decode, 1-16 rows",
        "decode, 17-32 rows",
        "decode, 33-64 rows",
        "with a prompt chunk, up to 128 rows",
        "with a prompt chunk, 257-512 rows",
    ]  # STEP_KINDS' order; a kind no step had is left out
    assert kinds["decode, 1-16 rows"] == {
        "steps": 2,
        "tokens": 17,
        "seconds": 0.01,
        "ms_per_step": 5.0,
    }
    assert kinds["with a prompt chunk, 257-512 rows"]["steps"] == 2
    assert sum(k["steps"] for k in kinds.values()) == len(steps)
    assert sum(k["tokens"] for k in kinds.values()) == sum(t for _, t, _ in steps)


def test_runs_combine_into_one_table() -> None:
    first = step_kinds([(0.004, 8, False), (0.020, 200, True)])
    second = step_kinds([(0.006, 8, False)])
    both = combined_kinds([first, second])
    assert both["decode, 1-16 rows"] == {
        "steps": 2,
        "tokens": 16,
        "seconds": 0.01,
        "ms_per_step": 5.0,
    }
    assert both["with a prompt chunk, 129-256 rows"]["ms_per_step"] == pytest.approx(20.0)
