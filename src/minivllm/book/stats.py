"""Numbers a chapter reports about a check: `within`, the line it prints for a float error
(chapters 00, 02, 03 and 07), and a chi-square goodness-of-fit test, for checking that a sampler
draws from the distribution it claims (chapter 06 and its tests). torch has the regularised
incomplete gamma function, so no scipy is needed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def chi_square(
    counts: Sequence[int], probs: Sequence[float], min_expected: float = 5.0
) -> tuple[float, int, float]:
    """Pearson's test of observed `counts` against a distribution `probs` over the same cells.

    Returns (statistic, degrees of freedom, p-value): the p-value is the chance that a sampler truly
    drawing from `probs` shows a deviation at least this large. Cells expected fewer than
    `min_expected` times are pooled into one, the usual rule for the chi-square approximation to
    hold. A count in a cell of probability 0 is an impossible draw: the p-value is then 0.
    """
    counts = torch.as_tensor(counts, dtype=torch.float64)
    probs = torch.as_tensor(probs, dtype=torch.float64)
    if counts.shape != probs.shape or counts.dim() != 1:
        raise ValueError(
            f"counts {tuple(counts.shape)} and probs {tuple(probs.shape)} must be the same 1-d "
            "shape"
        )
    if bool((counts[probs == 0] > 0).any()):
        return float("inf"), 0, 0.0
    expected = probs / probs.sum() * counts.sum()
    small = expected < min_expected
    observed_cells = torch.cat([counts[~small], counts[small].sum().view(1)])
    expected_cells = torch.cat([expected[~small], expected[small].sum().view(1)])
    keep = expected_cells > 0
    observed_cells, expected_cells = observed_cells[keep], expected_cells[keep]
    statistic = float(((observed_cells - expected_cells) ** 2 / expected_cells).sum())
    dof = len(observed_cells) - 1
    if dof < 1:
        raise ValueError("fewer than two cells with enough expected counts: draw more samples")
    p_value = float(
        torch.special.gammaincc(
            torch.tensor(dof / 2, dtype=torch.float64),
            torch.tensor(statistic / 2, dtype=torch.float64),
        )
    )
    return statistic, dof, p_value


def within(error: float, tolerance: float) -> str:
    """What a chapter prints for a float check: "within 1e-5", the tolerance `error` is held to,
    never `error` itself. An error's last digits move with the machine -- the vector width, the
    BLAS, the thread count, even the bits of `torch.randn` (its vectorised path depends on the CPU)
    -- and strict nbval compares the printed text on every machine; the tolerance does not move.
    Raises AssertionError when `error` is above `tolerance` or not a number: the print is the
    check."""
    error = float(error)  # a 0-d tensor or numpy scalar too
    if not error <= tolerance:  # NaN fails too
        raise AssertionError(f"error {error:.2e} is above the tolerance {tolerance:.0e}")
    mantissa, exponent = f"{tolerance:e}".split("e")
    return f"within {mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


def speed_change(ratio: float, than: str = "") -> str:
    """A speed ratio (new rate / old rate, or old time / new time) said by its sign: "1.25x (25%
    faster than plain)", "0.60x (40% slower than plain)", "7.82x (7.8 times as fast as plain)", or
    "1.00x (the same speed as plain)" when the change rounds to 0 %. For two times, pass old / new.
    A summary line printing "0.80x faster" contradicts its own number; this one cannot. `than`
    names what the ratio is measured against ("plain")."""
    ratio = float(ratio)
    if not ratio > 0:  # NaN too
        raise ValueError(f"a speed ratio must be positive, not {ratio}")
    change = abs(ratio - 1)
    if round(change, 2) == 0:
        return f"{ratio:.2f}x (the same speed{' as ' + than if than else ''})"
    if ratio >= 2:  # "682% faster" is hard to read: say how many times as fast
        return f"{ratio:.2f}x ({ratio:.1f} times as fast{' as ' + than if than else ''})"
    word = "faster" if ratio > 1 else "slower"
    return f"{ratio:.2f}x ({change:.0%} {word}{' than ' + than if than else ''})"
