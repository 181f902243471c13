"""The notebook pipeline: `chapters/NN_slug.py` (source) -> executed `chapters/NN_slug.ipynb`
(committed), and the same for the book's own pages in `BOOK_PAGES` (`book/scoreboard.py`).

    python tools/notebooks.py execute [chapters/00_model.py ...]   sync .py -> .ipynb, execute it
    python tools/notebooks.py check                     fail if a pair drifted or a cell is unrun

Execution happens in the notebook's folder with a fresh kernel per notebook, cells in order, no
timing metadata, so running it twice on the same machine gives the same outputs.
"""

from __future__ import annotations

import hashlib
import sys
import time
from pathlib import Path

import jupytext
import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = ROOT / "chapters"
# Pages of the book that are notebooks but not chapters (they live in book/, next to _toc.yml).
BOOK_PAGES = [ROOT / "book" / "scoreboard.py"]
CELL_TIMEOUT_S = 600


def chapter_sources() -> list[Path]:
    return sorted(CHAPTERS.glob("[0-9][0-9]_*.py"))


def notebook_sources() -> list[Path]:
    """Every paired source: the chapters, then the book's own pages that exist."""
    return chapter_sources() + [page for page in BOOK_PAGES if page.exists()]


def cell_sources(nb: nbformat.NotebookNode) -> list[tuple[str, str]]:
    return [(cell.cell_type, cell.source.strip()) for cell in nb.cells]


def stable_cell_ids(nb: nbformat.NotebookNode) -> None:
    """nbformat gives new cells random ids; derive them from position and source so a re-run of an
    unchanged chapter leaves its .ipynb unchanged."""
    for index, cell in enumerate(nb.cells):
        digest = hashlib.sha1(f"{index}:{cell.source}".encode()).hexdigest()[:8]
        cell["id"] = f"c{index:03d}-{digest}"


def execute(py_path: Path) -> None:
    nb = jupytext.read(py_path)
    stable_cell_ids(nb)
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    started = time.perf_counter()
    client = NotebookClient(
        nb,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        record_timing=False,
        resources={"metadata": {"path": str(py_path.resolve().parent)}},
    )
    client.execute()
    # The kernel reports its exact Python version; keep only what matters so commits stay quiet.
    nb.metadata["language_info"] = {"name": "python"}
    jupytext.write(nb, py_path.with_suffix(".ipynb"))
    print(f"executed {py_path.name} in {time.perf_counter() - started:.0f} s")


def problems() -> list[str]:
    found = []
    for py_path in notebook_sources():
        ipynb = py_path.with_suffix(".ipynb")
        if not ipynb.exists():
            found.append(f"{py_path.name} has no executed {ipynb.name}: run `make notebooks`")
            continue
        stored = nbformat.read(ipynb, as_version=4)
        if cell_sources(stored) != cell_sources(jupytext.read(py_path)):
            found.append(
                f"{ipynb.name} does not hold the same cells as {py_path.name}: run `make notebooks`"
            )
        unrun = [
            i
            for i, c in enumerate(stored.cells)
            if c.cell_type == "code" and c.source.strip() and c.execution_count is None
        ]
        if unrun:
            found.append(
                f"{ipynb.name}: code cells {unrun} were never executed: run `make notebooks`"
            )
    return found


def main(argv: list[str]) -> int:
    command, paths = (argv[0] if argv else "check"), [Path(p) for p in argv[1:]]
    if command == "execute":
        for path in paths or notebook_sources():
            execute(path.with_suffix(".py"))
        return 0
    if command == "check":
        found = problems()
        for problem in found:
            print(problem)
        return 1 if found else 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
