"""The reader's HTML book: it reads offline -- no page or stylesheet loads a script, style, font,
image or frame from another host (MathJax is served from the build, steppers carry their frames
inline) -- and every exercise's solution the chapters show is folded, for the reader to open."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT / "tools"))  # tools/listing_widths.py, a script beside the build's

# What a browser fetches by itself when a page opens (a plain <a href> link is not fetched).
LOADS = [
    re.compile(
        r"<(?:script|img|iframe|source|audio|video|embed)\b[^>]*?\bsrc=[\"']([^\"']+)", re.I
    ),
    re.compile(r"<link\b[^>]*?\bhref=[\"']([^\"']+)", re.I),
    re.compile(r"url\(\s*[\"']?([^\"')]+)", re.I),  # CSS: fonts, backgrounds, @import url(...)
    re.compile(r"@import\s+[\"']([^\"']+)", re.I),
]
REMOTE = re.compile(r"^(?:[a-z][a-z0-9+.-]*:)?//", re.I)  # http://, https://, protocol-relative //


def remote_loads(text: str) -> list[str]:
    return [url for pattern in LOADS for url in pattern.findall(text) if REMOTE.match(url)]


def test_the_scanner_sees_each_kind_of_remote_load() -> None:
    page = """<script src="https://cdn.example/x.js"></script><link rel="stylesheet"
    href="//cdn.example/s.css"><style>@font-face { src: url('https://fonts.example/f.woff2') }
    </style><img src="data:image/png;base64,AAAA"><script src="../_static/local.js"></script>
    <a href="https://docs.example/">a link is not a load</a>"""
    assert remote_loads(page) == [
        "https://cdn.example/x.js",
        "//cdn.example/s.css",
        "https://fonts.example/f.woff2",
    ]


@pytest.fixture(scope="module")
def built_book(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("jupyter_book", reason="the book extra is not installed")
    tmp_path = tmp_path_factory.mktemp("book")
    build = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "build_book.py"), "--path-output", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert build.returncode == 0, build.stdout[-2000:] + build.stderr[-2000:]
    return tmp_path / "_build" / "html"


@pytest.mark.slow
def test_the_built_book_loads_nothing_from_another_host(built_book: Path) -> None:
    html = built_book
    pages = sorted(html.rglob("*.html")) + sorted(html.rglob("*.css"))
    assert len(list(html.glob("chapters/*.html"))) >= 9
    found = {
        str(page.relative_to(html)): loads
        for page in pages
        if (loads := remote_loads(page.read_text(errors="replace")))
    }
    assert not found, f"pages that load from another host: {found}"
    chapter = (html / "chapters" / "08_cuda_paged_attention.html").read_text()  # it has formulas
    assert 'src="../_static/mathjax/tex-chtml.js"' in chapter, (
        "MathJax is not served from the build"
    )
    assert (html / "_static" / "mathjax" / "tex-chtml.js").is_file()


@pytest.mark.slow
def test_every_shown_solution_is_folded(built_book: Path) -> None:
    pages = {p.name: p.read_text() for p in sorted(built_book.glob("chapters/*.html"))}
    # A solution region shown unfolded would carry its highlighted marker comment.
    unfolded = [name for name, page in pages.items() if '"c1">### BEGIN SOLUTION' in page]
    assert not unfolded, f"solutions shown unfolded in {unfolded}"
    folds = sum(page.count('<details class="minivllm-solution">') for page in pages.values())
    assert folds >= 15, f"only {folds} folded solutions in the reader's book"


def test_a_stepper_carries_its_frames_and_its_script_inline() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from minivllm.book.stepper import Stepper

    def draw(step: int):
        fig, ax = plt.subplots(figsize=(2, 1))
        ax.set_title(f"step {step}")
        return fig

    stepper = Stepper(draw, steps=range(0, 30, 10), start=10)
    page = stepper._repr_html_()
    assert page.count("data:image/png;base64,") == 3 + 1  # every frame, and the one shown first
    assert 'value="1"' in page and "<output>10</output>" in page
    assert not remote_loads(page) and "<script>" in page and "src=" in page
    assert repr(stepper) == "Stepper(3 frames, step 0..20)"
    with pytest.raises(ValueError, match="start=5"):
        Stepper(draw, steps=[0, 10], start=5)


@pytest.mark.slow
def test_every_show_listing_fits_the_code_column(built_book: Path) -> None:
    """The longest line of each show() listing against the characters the code column holds at a
    1280 px window, as tools/listing_widths.py derives it from book/_static/minivllm.css."""
    import listing_widths as widths  # tools/, put on the path above

    pages = widths.page_pres(built_book)
    listings = [pre for found in pages.values() for pre in found if pre.kind == "listing"]
    assert len(listings) >= 50, f"only {len(listings)} show() listings found in the built book"
    assert widths.too_wide(pages) == []
    css = (built_book / "_static" / "minivllm.css").read_text()
    assert css == widths.STYLESHEET.read_text(), "the book does not carry the stylesheet measured"
    assert (
        'href="../_static/minivllm.css' in (built_book / "chapters" / "04_engine.html").read_text()
    )


@pytest.mark.slow
def test_each_script_runs_once_per_page(built_book: Path) -> None:
    """An inline script listed twice redeclares its consts (sphinx-thebe's THEBE_JS_URL threw a
    SyntaxError on every page)."""
    script = re.compile(r"<script\b[^>]*>.*?</script>", re.S)
    twice = {}
    for page in sorted(built_book.rglob("*.html")):
        scripts = script.findall(page.read_text(errors="replace"))
        repeated = {s[:80] for s in scripts if scripts.count(s) > 1}
        if repeated:
            twice[str(page.relative_to(built_book))] = sorted(repeated)
    assert not twice, f"scripts listed twice: {twice}"
