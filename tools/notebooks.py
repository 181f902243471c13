"""The notebook pipeline: `chapters/NN_slug.py` (source) -> executed `chapters/NN_slug.ipynb`
(committed), and the same for the book's own pages in `BOOK_PAGES` (`book/scoreboard.py`).

    python tools/notebooks.py execute [chapters/00_model.py ...]   sync .py -> .ipynb, execute it
    python tools/notebooks.py execute --into DIR [...]  ... writing the .ipynb into DIR instead
                                                        (the book build's, not the committed)
    python tools/notebooks.py check                     fail if a pair drifted or a cell is unrun

Execution happens in the notebook's folder with a fresh kernel per notebook, cells in order, no
timing metadata, so running it twice on the same machine gives the same outputs. The kernel talks
to us over local IPC sockets in a private temporary folder, not TCP (which ipykernel warns is
unencrypted, once per kernel).
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import tempfile
import time
from pathlib import Path

import jupytext
import nbformat
from jupyter_client import KernelManager
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


def elapsed(seconds: float) -> str:
    minutes, seconds = divmod(round(seconds), 60)
    return f"{minutes}:{seconds:02d}"


def execute(py_path: Path, into: Path | None = None) -> Path:
    """Execute `py_path` as a notebook and write it beside its source, or into `into`."""
    nb = jupytext.read(py_path)
    stable_cell_ids(nb)
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    with tempfile.TemporaryDirectory(prefix="minivllm-kernel-") as sockets:
        kernel = KernelManager(
            kernel_name="python3", transport="ipc", ip=str(Path(sockets) / "kernel")
        )
        client = NotebookClient(
            nb,
            km=kernel,
            timeout=CELL_TIMEOUT_S,
            kernel_name="python3",
            record_timing=False,
            resources={"metadata": {"path": str(py_path.resolve().parent)}},
        )
        client.execute(cleanup_kc=True)  # shut the kernel down: nbclient keeps one it did not make
    # The kernel reports its exact Python version; keep only what matters so commits stay quiet.
    nb.metadata["language_info"] = {"name": "python"}
    target = (into or py_path.parent) / py_path.with_suffix(".ipynb").name
    jupytext.write(nb, target)
    return target


def execute_all(paths: list[Path], into: Path | None = None, what: str = "notebook") -> None:
    """Execute each in turn, saying which one starts (N of M, time so far) and how long it took."""
    started = time.perf_counter()
    for number, path in enumerate(paths, 1):
        print(
            f"  {what} {number} of {len(paths)}: {path.stem} "
            f"(started at {elapsed(time.perf_counter() - started)})",
            flush=True,
        )
        began = time.perf_counter()
        execute(path.with_suffix(".py"), into)
        print(f"    executed in {time.perf_counter() - began:.0f} s", flush=True)
    print(f"  {len(paths)} executed in {elapsed(time.perf_counter() - started)}", flush=True)


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
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("command", nargs="?", default="check", choices=["execute", "check"])
    parser.add_argument("paths", nargs="*", type=Path, help="sources (default: every one)")
    parser.add_argument("--into", type=Path, help="write the executed .ipynb files into INTO")
    args = parser.parse_intermixed_args(argv)
    if args.command == "execute":
        execute_all(args.paths or notebook_sources(), args.into)
        return 0
    found = problems()
    for problem in found:
        print(problem)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
