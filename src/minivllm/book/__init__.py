"""Helpers the chapters share: show the package's real source, one colour palette, one plot style.

Chapters explain the package's code by displaying it with `show(obj)`, never by keeping a copy.
"""

from __future__ import annotations

import inspect
import textwrap
from typing import Any

# One colour per sequence id, the same in every chapter (matplotlib's tab10, then tab20's pale
# half).
SEQUENCE_COLORS = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
    "#aec7e8",
    "#ffbb78",
    "#98df8a",
    "#ff9896",
    "#c5b0d5",
    "#c49c94",
    "#f7b6d2",
    "#c7c7c7",
    "#dbdb8d",
    "#9edae5",
)
FREE_COLOR = "#f0f0f0"


def sequence_color(seq_id: int) -> str:
    return SEQUENCE_COLORS[seq_id % len(SEQUENCE_COLORS)]


def source(obj: Any, lines: tuple[int, int] | None = None) -> str:
    """The source text of a function, class or module from the installed package."""
    text = textwrap.dedent(inspect.getsource(obj))
    if lines is not None:
        first, last = lines
        text = "\n".join(text.splitlines()[first - 1 : last]) + "\n"
    return text


def show(obj: Any, lines: tuple[int, int] | None = None):
    """Display the package's own source for `obj`, highlighted; `lines` picks a 1-based inclusive
    range."""
    from IPython.display import Code

    return Code(source(obj, lines), language="python")


def use_book_style() -> None:
    """A quiet, readable matplotlib style for every figure in the book."""
    import matplotlib as mpl

    mpl.rcParams.update(
        {
            "figure.figsize": (7.5, 3.6),
            "figure.dpi": 100,
            "axes.spines.top": False,
            "axes.spines.right": False,
            "axes.grid": True,
            "grid.alpha": 0.3,
            "font.size": 10,
            "axes.titlesize": 11,
            "svg.hashsalt": "minivllm",
        }
    )
