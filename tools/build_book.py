"""Build the HTML book into book/_build/html, saying which step it is on.

    python tools/build_book.py            from the committed notebooks (`make html`, under a minute)
    python tools/build_book.py --execute  execute every chapter first, into the build (`make book`)
    python tools/build_book.py --strict   ... with Sphinx warnings as errors, and every show()
                                          listing within the code column (what CI runs)
    python tools/build_book.py --path-output DIR   ... into DIR/_build (the tests build elsewhere)

The book's source folder is book/; the chapter notebooks it renders are put in book/chapters/
(ignored by git): copies of the committed chapters/*.ipynb, or with --execute, the chapters executed
afresh, written there and only there, so the committed notebooks (and `git status`) stay as they
were. `make notebooks` is the way to update the committed ones. The Scoreboard page renders its
committed book/scoreboard.ipynb either way.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

# Run as a script, so tools/ is on the import path.
import listing_widths
import notebooks

ROOT = Path(__file__).resolve().parent.parent
BOOK = ROOT / "book"
CHAPTERS = ROOT / "chapters"
BUILD_CHAPTERS = BOOK / "chapters"


def step(text: str) -> None:
    print(f"== {text}", flush=True)


def copy_chapters() -> list[Path]:
    shutil.rmtree(BUILD_CHAPTERS, ignore_errors=True)
    BUILD_CHAPTERS.mkdir()
    notebooks = sorted(CHAPTERS.glob("[0-9][0-9]_*.ipynb"))
    if not notebooks:
        raise SystemExit("no executed chapters in chapters/: run `make notebooks` first")
    for notebook in notebooks:
        shutil.copy2(notebook, BUILD_CHAPTERS / notebook.name)
    return notebooks


def execute_chapters() -> None:
    shutil.rmtree(BUILD_CHAPTERS, ignore_errors=True)
    BUILD_CHAPTERS.mkdir()
    notebooks.execute_all(notebooks.chapter_sources(), into=BUILD_CHAPTERS, what="chapter")


def build_html(path_output: Path, strict: bool) -> int:
    """jupyter-book, quiet: Sphinx's warnings and errors only, not its progress (the config dump,
    a line per page and per image copied) nor jupyter-book's banner, unless the build fails."""
    shutil.rmtree(path_output / "_build", ignore_errors=True)
    command = [
        str(Path(sys.executable).parent / "jupyter-book"),
        "build",
        str(BOOK),
        "--path-output",
        str(path_output),
        "--quiet",
    ]
    if strict:
        command += ["--warningiserror", "--keep-going"]
    result = subprocess.run(command, stdout=subprocess.PIPE, text=True)  # stderr: the warnings
    if result.returncode != 0:
        print(result.stdout, end="")
    return result.returncode


def check_listings(html_dir: Path, strict: bool) -> int:
    """Say how the listings fit the code column; with `strict`, fail on one that does not."""
    pages = listing_widths.page_pres(html_dir)
    capacity = listing_widths.column_capacity()
    clipped = listing_widths.too_wide(pages)
    wrapped = listing_widths.too_wide(pages, kinds=("code", "output"))
    kinds = listing_widths.MUST_FIT
    longest = max(
        (p.width for found in pages.values() for p in found if p.kind in kinds), default=0
    )
    print(
        f"   listings: the longest show() line is {longest} characters, the code column holds "
        f"{capacity} at 1280 px; {len(wrapped)} longer cell lines wrap "
        f"(python tools/listing_widths.py lists them)"
    )
    for line in clipped:
        print(f"   listing too wide: {line}", file=sys.stderr)
    return 1 if clipped and strict else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--execute",
        action="store_true",
        help="execute every chapter into the build first (the committed notebooks stay unchanged)",
    )
    parser.add_argument(
        "--no-execute", action="store_true", help="build from the committed notebooks (the default)"
    )
    parser.add_argument(
        "--strict",
        action="store_true",
        help="treat Sphinx warnings as errors, and a show() listing wider than the column",
    )
    parser.add_argument(
        "--path-output", type=Path, default=BOOK, help="the build goes to PATH_OUTPUT/_build"
    )
    args = parser.parse_args()
    if args.execute and args.no_execute:
        parser.error("--execute and --no-execute contradict each other")
    started = time.perf_counter()
    steps = 2 if args.execute else 1
    if args.execute:
        step(f"1/{steps} executing the chapters into {BUILD_CHAPTERS.relative_to(ROOT)}/")
        execute_chapters()
    else:
        copy_chapters()
    html_dir = args.path_output / "_build" / "html"
    step(f"{steps}/{steps} HTML: jupyter-book build")
    began = time.perf_counter()
    returncode = build_html(args.path_output, args.strict)
    if returncode != 0:
        print(f"jupyter-book failed (exit status {returncode})", file=sys.stderr)
        return returncode
    print(f"   built in {time.perf_counter() - began:.0f} s", flush=True)
    if check_listings(html_dir, args.strict):
        return 1
    print(f"\nThe book is ready ({time.perf_counter() - started:.0f} s): {html_dir / 'index.html'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
