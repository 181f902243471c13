"""Build the HTML book from the executed chapter notebooks into book/_build/html.

    python tools/build_book.py            build from the committed notebooks (what CI does)
    python tools/build_book.py --strict   ... with Sphinx warnings as errors
    python tools/build_book.py --path-output DIR   ... into DIR/_build (the tests build elsewhere)

The notebooks are copied into book/chapters/ (ignored by git) so the book's source folder is
self-contained; nothing is re-executed here (`make notebooks` executes).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BOOK = ROOT / "book"
CHAPTERS = ROOT / "chapters"


def copy_chapters() -> list[Path]:
    target = BOOK / "chapters"
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir()
    notebooks = sorted(CHAPTERS.glob("[0-9][0-9]_*.ipynb"))
    if not notebooks:
        raise SystemExit("no executed chapters in chapters/: run `make notebooks` first")
    for notebook in notebooks:
        shutil.copy2(notebook, target / notebook.name)
    return notebooks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--strict", action="store_true", help="treat Sphinx warnings as errors")
    parser.add_argument(
        "--no-execute", action="store_true", help="accepted for clarity: the build never executes"
    )
    parser.add_argument(
        "--path-output", type=Path, default=BOOK, help="the build goes to PATH_OUTPUT/_build"
    )
    args = parser.parse_args()
    copy_chapters()
    shutil.rmtree(args.path_output / "_build", ignore_errors=True)
    command = [
        str(Path(sys.executable).parent / "jupyter-book"),
        "build",
        str(BOOK),
        "--path-output",
        str(args.path_output),
    ]
    if args.strict:
        command += ["--warningiserror", "--keep-going"]
    result = subprocess.run(command)
    if result.returncode != 0:
        return result.returncode
    index = args.path_output / "_build" / "html" / "index.html"
    print(f"\nThe book is ready: {index}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
