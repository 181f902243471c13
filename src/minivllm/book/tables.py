"""Tables a page shows (the scoreboard's): a styled HTML table -- a rule under the header, padded
cells, striped rows, numbers aligned right -- that reads the same in the HTML book, in Jupyter and
offline (the style is inline: no stylesheet or script to load), and an aligned plain-text twin for
whatever cannot show HTML (a terminal, nbval's comparison). An unstyled HTML table runs its cells
together ("0.67yes"); these never do.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from html import escape

# Inline styles, in the book's palette: thin grey rules, a pale stripe on every other row.
_TABLE = "border-collapse: collapse; margin: 0.5em 0 1em; font-size: 0.9em"
_HEAD = "border-bottom: 2px solid #555555; padding: 0.3em 0.8em; font-weight: bold"
_CELL = "border-bottom: 1px solid #dddddd; padding: 0.3em 0.8em"
STRIPED = ' style="background: #f6f6f6"'  # every other row's <tr> attribute
_CAPTION = "caption-side: bottom; text-align: left; padding-top: 0.4em; color: #555555"


@dataclass(frozen=True)
class Table:
    """`header` and `rows` are the cells' text; the columns numbered in `right` align right (the
    numbers); `caption` goes under the table, in both forms."""

    header: list[str]
    rows: list[list[str]]
    right: frozenset[int] = field(default_factory=frozenset)
    caption: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "right", frozenset(self.right))  # a set or a range will do
        widths = {len(row) for row in self.rows} | {len(self.header)}
        if len(widths) != 1:
            raise ValueError(f"every row needs {len(self.header)} cells, as the header has")

    def _align(self, column: int) -> str:
        return "right" if column in self.right else "left"

    def _repr_html_(self) -> str:
        def cells(tag: str, values: list[str], style: str) -> str:
            return "".join(
                f'<{tag} style="{style}; text-align: {self._align(i)}">{escape(v)}</{tag}>'
                for i, v in enumerate(values)
            )

        head = f"<thead><tr>{cells('th', self.header, _HEAD)}</tr></thead>"
        body = "".join(
            f"<tr{STRIPED if n % 2 else ''}>{cells('td', row, _CELL)}</tr>"
            for n, row in enumerate(self.rows)
        )
        caption = (
            f'<caption style="{_CAPTION}">{escape(self.caption)}</caption>' if self.caption else ""
        )
        return f'<table style="{_TABLE}">{caption}{head}<tbody>{body}</tbody></table>'

    def __repr__(self) -> str:
        lines = [self.header, *self.rows]
        widths = [max(len(line[i]) for line in lines) for i in range(len(self.header))]

        def text(values: list[str]) -> str:
            return "  ".join(
                v.rjust(w) if i in self.right else v.ljust(w)
                for i, (v, w) in enumerate(zip(values, widths))
            ).rstrip()

        rule = "  ".join("-" * w for w in widths)
        under = [self.caption] if self.caption else []
        return "\n".join([text(self.header), rule, *map(text, self.rows), *under])
