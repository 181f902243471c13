"""Do the book's listings fit its code column? The longest line of every <pre> in the built HTML,
against the number of characters the column holds at the narrowest width the book is laid out
for (a 1280 px window), as book/_static/minivllm.css sets it.

    python tools/listing_widths.py [book/_build/html]   a table: longest line per chapter and kind

The capacity is computed from the stylesheet, not measured in a browser: it states, in rem, the
widths that share a 1280 px window (the sidebars, the article's padding), the code font size and
the padding inside a <pre>. A classic scrollbar takes 15-17 px of the window (counted as 16; overlay
scrollbars take none), and a monospace glyph is 0.6 em wide in the fonts the theme asks for (DejaVu
Sans Mono, Menlo, Consolas, Liberation Mono, Courier: 0.600-0.602 em), so

    column   = 1280 - scrollbar - primary sidebar - secondary sidebar - 2 x article padding
    capacity = (column - 2 x code padding) / (code font x 0.6)                (1 rem = 16 px)

(Chromium at a 1280 px window measured the same: a <pre> 785 px wide inside, 7.225 px a glyph of
12 px DejaVu Sans Mono, 108 characters. A cell whose code is folded sits in a box 22 px narrower.)

`tools/build_book.py --strict` (what CI runs) fails when a show() listing of the package's source
is longer than that. A cell's own code or output that is longer wraps (the stylesheet wraps every
<pre> rather than scroll the page sideways); the build counts them and this script lists them.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STYLESHEET = ROOT / "book" / "_static" / "minivllm.css"
ROOT_FONT_PX = 16
WINDOW_PX = 1280
SCROLLBAR_PX = 16
MONOSPACE_ADVANCE_EM = 0.6
# The kind of <pre> whose lines must fit: show() listings; the others wrap (see the docstring).
MUST_FIT = ("listing",)


def css_rem(name: str, css: str | None = None) -> float:
    """The value of the custom property `name` (in rem) as the book's stylesheet sets it."""
    css = STYLESHEET.read_text() if css is None else css
    found = re.search(rf"{re.escape(name)}\s*:\s*([0-9.]+)rem\s*;", css)
    if not found:
        raise ValueError(f"{STYLESHEET.name} sets no {name} in rem")
    return float(found[1])


def column_capacity(css: str | None = None) -> int:
    """Characters of code a line of the code column holds (see the module docstring)."""
    css = STYLESHEET.read_text() if css is None else css

    def px(name: str) -> float:
        return css_rem(name, css) * ROOT_FONT_PX

    column_px = (
        WINDOW_PX
        - SCROLLBAR_PX
        - px("--minivllm-primary-width")
        - px("--minivllm-secondary-width")
        - 2 * px("--minivllm-article-padding")
    )
    glyph_px = px("--minivllm-code-font") * MONOSPACE_ADVANCE_EM
    return int((column_px - 2 * px("--minivllm-code-padding")) / glyph_px)


@dataclass
class Pre:
    kind: str  # listing (show()), code (a cell's source), output (a cell's text), prose
    longest: str  # its longest line

    @property
    def width(self) -> int:
        return len(self.longest)


class _PreCollector(HTMLParser):
    """Every <pre> with its text and the kind its enclosing elements give it."""

    VOID = {"br", "img", "input", "meta", "link", "hr", "source", "wbr", "col", "area", "embed"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[str] = []  # class attribute of each open element
        self.pre_depth = 0
        self.text: list[str] = []
        self.kind = ""
        self.found: list[Pre] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in self.VOID:
            return
        classes = dict(attrs).get("class") or ""
        self.stack.append(classes)
        if tag == "pre":
            if self.pre_depth == 0:
                self.text, self.kind = [], self._kind()
            self.pre_depth += 1

    def handle_endtag(self, tag: str) -> None:
        if tag in self.VOID or not self.stack:
            return
        self.stack.pop()
        if tag == "pre" and self.pre_depth:
            self.pre_depth -= 1
            if self.pre_depth == 0:
                lines = "".join(self.text).expandtabs().splitlines() or [""]
                self.found.append(Pre(self.kind, max(lines, key=len)))

    def handle_data(self, data: str) -> None:
        if self.pre_depth:
            self.text.append(data)

    def _kind(self) -> str:
        classes = " ".join(self.stack).split()
        if "minivllm-source" in classes:
            return "listing"
        if "cell_input" in classes:
            return "code"
        if "cell_output" in classes:
            return "output"
        return "prose"


def pres(page: str) -> list[Pre]:
    collector = _PreCollector()
    collector.feed(page)
    collector.close()
    return collector.found


def page_pres(html_dir: Path) -> dict[str, list[Pre]]:
    """The <pre> blocks of every content page (not the search or index pages)."""
    pages = sorted(html_dir.glob("*.html")) + sorted(html_dir.glob("chapters/*.html"))
    skip = {"search.html", "genindex.html", "index.html"}
    return {
        str(page.relative_to(html_dir)): pres(page.read_text(errors="replace"))
        for page in pages
        if page.name not in skip
    }


def too_wide(
    pages: dict[str, list[Pre]], kinds: tuple[str, ...] = MUST_FIT, capacity: int | None = None
) -> list[str]:
    """One line per <pre> of those kinds (in `page_pres`'s pages) longer than the column holds."""
    capacity = column_capacity() if capacity is None else capacity
    return [
        f"{name}: a {pre.kind} line of {pre.width} characters (the column holds {capacity}): "
        f"{pre.longest.strip()[:60]}"
        for name, found in pages.items()
        for pre in found
        if pre.kind in kinds and pre.width > capacity
    ]


def report(html_dir: Path) -> str:
    """Longest line per page and kind against the capacity: the table the issue asks for."""
    capacity = column_capacity()
    pages = page_pres(html_dir)
    kinds = ("listing", "code", "output", "prose")
    rows = [f"column capacity at 1280 px: {capacity} characters", ""]
    rows.append(f"{'page':<38}" + "".join(f"{kind:>9}" for kind in kinds) + "  longer")
    for name, found in pages.items():
        widest = {k: max((p.width for p in found if p.kind == k), default=0) for k in kinds}
        over = sum(p.width > capacity for p in found)
        cells = "".join(f"{widest[k] or '-':>9}" for k in kinds)
        rows.append(f"{name:<38}{cells}{over:>8}")
    rows += ["", "longer than the column (they wrap; a listing among them fails --strict):"]
    rows += too_wide(pages, kinds) or ["none"]
    return "\n".join(rows)


if __name__ == "__main__":
    html_dir = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "book" / "_build" / "html"
    print(report(html_dir))
    sys.exit(1 if too_wide(page_pres(html_dir)) else 0)
