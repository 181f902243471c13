"""Helpers the chapters share: show the package's real source, one colour palette, one plot style.

Chapters explain the package's code by displaying it with `show(obj)`, never by keeping a copy.
"""

from __future__ import annotations

import inspect
import re
import textwrap
from typing import Any

# One colour per sequence id, the same in every chapter: matplotlib's tab10, then tab20's pale
# half -- with tab10's grey (and its pale twin) swapped for tab20b's indigo, since grey means "free"
# or "waiting" in the book's figures.
SEQUENCE_COLORS = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#393b79",
    "#bcbd22",
    "#17becf",
    "#aec7e8",
    "#ffbb78",
    "#98df8a",
    "#ff9896",
    "#c5b0d5",
    "#c49c94",
    "#f7b6d2",
    "#9c9ede",
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


def show(obj: Any, lines: tuple[int, int] | None = None) -> SourceView:
    """Display the package's own source for `obj`, highlighted; `lines` picks a 1-based inclusive
    range. An exercise's solution is folded: the reader opens it on purpose."""
    return SourceView(source(obj, lines))


SOLUTION = re.compile(
    r"^(?P<indent>[ \t]*)### BEGIN SOLUTION\n(?P<body>.*?)^[ \t]*### END SOLUTION\n?", re.M | re.S
)
EXERCISE_ID = re.compile(r"# EXERCISE (?P<id>[\w.-]+):")


class SourceView:
    """Source text shown in a chapter: plain text is the source as it is (what nbval compares and
    the student copy stubs); the HTML highlights it, with each `### BEGIN/END SOLUTION` region
    folded into a `<details>` element naming its exercise."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text.rstrip("\n")

    def _repr_html_(self) -> str:
        from pygments import highlight
        from pygments.formatters import HtmlFormatter
        from pygments.lexers import PythonLexer

        formatter = HtmlFormatter()

        def code(piece: str) -> str:
            return highlight(piece, PythonLexer(), formatter) if piece else ""

        parts, start = [], 0
        for region in SOLUTION.finditer(self.text):
            before = self.text[start : region.start()]
            exercises = EXERCISE_ID.findall(before)
            label = f"exercise {exercises[-1]}" if exercises else "the exercise"
            parts += [
                code(before),
                f'<details class="minivllm-solution"><summary>Solution to {label} '
                f"(open it once you have tried)</summary>\n{code(region['body'])}</details>",
            ]
            start = region.end()
        parts.append(code(self.text[start:]))
        # The same style block IPython's Code display carries, so Jupyter colours it as before.
        style = f"<style>{formatter.get_style_defs('.output_html')}</style>"
        return f'{style}<div class="minivllm-source">{"".join(parts)}</div>'


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
