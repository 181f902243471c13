"""The chi-square test the sampling checks rely on (chapter 06): its p-values against the tables."""

from __future__ import annotations

import numpy as np
import pytest

from minivllm.book.stats import chi_square, speed_change, within


def counts_with_statistic(statistic: float, cells: int) -> tuple[np.ndarray, np.ndarray]:
    """Counts over `cells` equally likely cells (10,000 expected each) whose Pearson statistic is
    exactly `statistic`: one cell high, one low, by the same amount."""
    expected = 10_000.0
    shift = (statistic * expected / 2) ** 0.5
    counts = np.full(cells, expected)
    counts[0] += shift
    counts[1] -= shift
    return counts, np.full(cells, 1 / cells)


@pytest.mark.parametrize(
    "statistic, dof, upper",
    [
        # Critical values from the standard chi-square table (NIST/SEMATECH e-Handbook, 1.3.6.7.4).
        (3.841, 1, 0.05),
        (15.137, 1, 1e-4),
        (11.070, 5, 0.05),
        (18.307, 10, 0.05),
        (23.209, 10, 0.01),
        (124.342, 100, 0.05),
        (2.706, 1, 0.10),
        (9.236, 5, 0.10),
    ],
)
def test_p_values_match_the_tables(statistic: float, dof: int, upper: float) -> None:
    got_statistic, got_dof, p_value = chi_square(*counts_with_statistic(statistic, dof + 1))
    assert got_dof == dof and got_statistic == pytest.approx(statistic)
    assert p_value == pytest.approx(upper, rel=2e-3)


def test_a_fair_sample_passes_and_a_wrong_distribution_fails() -> None:
    rng = np.random.default_rng(0)
    probs = np.array([0.1, 0.2, 0.3, 0.4])
    counts = np.bincount(rng.choice(4, 20_000, p=probs), minlength=4)
    assert chi_square(counts, probs)[2] > 1e-3
    assert chi_square(counts, [0.25] * 4)[2] < 1e-12


def test_small_cells_are_pooled_and_impossible_draws_fail() -> None:
    statistic, dof, _ = chi_square([500, 500, 1, 2], [0.499, 0.499, 0.001, 0.001])
    assert dof == 2  # the two rare cells (1 expected each) became one
    assert chi_square([10, 1], [1.0, 0.0]) == (float("inf"), 0, 0.0)
    with pytest.raises(ValueError, match="same 1-d shape"):
        chi_square([1, 2, 3], [0.5, 0.5])


def test_within_prints_the_tolerance_not_the_error() -> None:
    # the printed line is the same for any error under the tolerance: it cannot move with the CPU
    assert within(1.3e-7, 1e-5) == within(1.7e-7, 1e-5) == within(0.0, 1e-5) == "within 1e-5"
    assert within(1.3e-4, 2e-3) == "within 2e-3"
    assert within(1e-3, 2.5e-3) == "within 2.5e-3"
    assert within(1e-5, 1e-5) == "within 1e-5"


@pytest.mark.parametrize("error", [1.1e-5, float("nan"), float("inf")])
def test_within_fails_above_the_tolerance(error: float) -> None:
    with pytest.raises(AssertionError, match="above the tolerance"):
        within(error, 1e-5)


@pytest.mark.parametrize(
    ("ratio", "said"),
    [
        (1.25, "1.25x (25% faster than plain)"),
        (0.6, "0.60x (40% slower than plain)"),
        (0.8, "0.80x (20% slower than plain)"),
        (1.001, "1.00x (the same speed as plain)"),
        (7.82, "7.82x (7.8 times as fast as plain)"),
    ],
)
def test_speed_change_says_faster_or_slower_by_the_sign(ratio: float, said: str) -> None:
    assert speed_change(ratio, than="plain") == said
    assert ("slower" in speed_change(ratio)) == (ratio < 0.995)


@pytest.mark.parametrize("ratio", [0.0, -1.0, float("nan")])
def test_speed_change_refuses_a_ratio_that_is_not_a_speed(ratio: float) -> None:
    with pytest.raises(ValueError):
        speed_change(ratio)


def test_two_times_go_in_as_old_over_new() -> None:
    # A step that went from 1.25 ms to 1 ms is 25% faster; the other way round, 20% slower.
    assert speed_change(1.25 / 1.0) == "1.25x (25% faster)"
    assert speed_change(1.0 / 1.25) == "0.80x (20% slower)"  # never "0.80x faster"
