"""How tall each page of the built HTML book is, in CSS pixels, at a given window width: the
length a reader scrolls. Headless Chromium loads each page (a copy with a small script added that
writes `document.documentElement.scrollHeight` into the DOM once the page's own scripts, MathJax
included, have run), and the DOM it dumps is read back. Offline: pages and assets are local files.

    python tools/page_heights.py [--html book/_build/html] [--width 1280] [--limit 25000] [PAGE ...]

Prints one line per page (chapters and the book's other pages) and exits 1 when a chapter is
taller than --limit pixels.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Set after the page's scripts: MathJax typesets after load, and its formulas change the height.
MEASURE = """<script>
window.addEventListener("load", () => setTimeout(() => {
  document.body.setAttribute("data-measured-height", document.documentElement.scrollHeight);
}, 4000));
</script>"""
HEIGHT = re.compile(r'data-measured-height="(\d+)"')


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if found := shutil.which(name):
            return found
    raise SystemExit("no chromium on PATH: the heights need a headless browser")


def page_height(page: Path, width: int, browser: str) -> int:
    """The page's scroll height at a `width`-pixel window."""
    copy = page.with_name(page.stem + ".measure.html")  # beside it: relative assets still load
    copy.write_text(page.read_text(encoding="utf-8").replace("</body>", MEASURE + "</body>"))
    try:
        done = subprocess.run(
            [
                browser,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--allow-file-access-from-files",
                f"--window-size={width},900",
                "--virtual-time-budget=15000",
                "--dump-dom",
                copy.resolve().as_uri(),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    finally:
        copy.unlink()
    found = HEIGHT.search(done.stdout)
    if not found:
        raise RuntimeError(f"{page}: no height came back\n{done.stderr[-2000:]}")
    return int(found.group(1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("pages", nargs="*", type=Path, help="pages to measure (default: all)")
    parser.add_argument("--html", type=Path, default=ROOT / "book" / "_build" / "html")
    parser.add_argument("--width", type=int, default=1280, help="window width in pixels")
    parser.add_argument("--limit", type=int, default=25_000, help="the most a chapter may be")
    args = parser.parse_args(argv)
    args.html = args.html.resolve()
    pages = [page.resolve() for page in args.pages] or [
        *sorted((args.html / "chapters").glob("[0-9][0-9]_*.html")),
        # index.html only redirects to the intro
        *sorted(
            p for p in args.html.glob("*.html") if p.stem not in ("genindex", "search", "index")
        ),
    ]
    if not pages:
        raise SystemExit(f"no pages under {args.html}: build the book first")
    browser, over = chromium(), []
    for page in pages:
        height = page_height(page, args.width, browser)
        is_chapter = page.parent.name == "chapters"
        if is_chapter and height > args.limit:
            over.append(page.stem)
        print(f"{height:>8,} px  {page.relative_to(args.html)}", flush=True)
    if over:
        print(f"taller than {args.limit:,} px at {args.width} px: {', '.join(over)}")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
