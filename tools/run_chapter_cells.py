"""Run chapters' code cells in order, one namespace per chapter, without Jupyter: does each chapter
*run* here? (`make gpu-check` uses it on GPU machines, which have no Jupyter; outputs are not
compared with the committed notebooks, whose outputs are the CPU's.)

    python tools/run_chapter_cells.py [--jobs N] chapters/08_cuda_paged_attention.py [...]

A chapter is a jupytext py:percent file: cells start at `# %%` lines, markdown cells at
`# %% [markdown]`. A code cell may `await` at the top level, as in Jupyter. Each chapter runs in a
fresh subprocess (`--jobs` of them at a time), from its own folder, with matplotlib drawing
off-screen; the exit status is the number of chapters that failed. Each cell that takes
`SLOW_CELL_S` or more is reported as it ends (`08_cuda_paged_attention.py cell 39: 12.3 s`), so a
run stopped at a time limit still says where its time went.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import importlib.util
import io
import os
import re
import subprocess
import sys
import time
import traceback
import types
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

CELL = re.compile(r"^# %%(.*)$", re.M)
SLOW_CELL_S = 5.0


def code_cells(source: str) -> list[str]:
    """The code cells of a py:percent file (the header before the first cell is metadata)."""
    marks = list(CELL.finditer(source))
    cells = []
    for mark, following in zip(marks, marks[1:] + [None]):
        if "[markdown]" in mark.group(1) or "[raw]" in mark.group(1):
            continue
        end = following.start() if following else len(source)
        cells.append(source[mark.end() : end].strip("\n"))
    return [c for c in cells if c.strip()]


def stand_in_for_ipython() -> None:
    """Where IPython is not installed (the GPU machines have no Jupyter), a stand-in for the
    `IPython.display` names the chapters import: `display` prints what it is given, so a chapter
    that shows a Markdown table still runs every line that builds it."""
    if importlib.util.find_spec("IPython") is not None:
        return

    class Shown:
        def __init__(self, data=None, **_):
            self.data = data

        def __repr__(self) -> str:
            return str(self.data)

    display_module = types.ModuleType("IPython.display")
    display_module.display = lambda *objects, **_: print(*objects)
    for name in ("Markdown", "HTML", "Image", "SVG", "Latex", "JSON"):
        setattr(display_module, name, type(name, (Shown,), {}))
    package = types.ModuleType("IPython")
    package.display = display_module
    # what matplotlib asks of an IPython it finds in sys.modules: no shell is running here
    package.get_ipython = lambda: None
    package.version_info = (0, 0)
    sys.modules.update({"IPython": package, "IPython.display": display_module})


def run_cells(path: Path) -> None:
    """In this process: every code cell of one chapter, in one namespace."""
    import matplotlib

    stand_in_for_ipython()

    matplotlib.use("Agg")
    namespace: dict = {"__name__": "__main__"}
    loop = asyncio.new_event_loop()
    for number, cell in enumerate(code_cells(path.read_text()), 1):
        # Jupyter's top-level await: compile with the flag, await the coroutine if one comes back
        code = compile(cell, f"{path.name}[cell {number}]", "exec", ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        started = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):  # the cells' prints: not this report's
            result = eval(code, namespace)  # noqa: S307 -- the book's own cells
            if asyncio.iscoroutine(result):
                loop.run_until_complete(result)
        if (seconds := time.perf_counter() - started) >= SLOW_CELL_S:
            print(f"  {path.name} cell {number}: {seconds:.1f} s", flush=True)


def run_chapter(name: str) -> tuple[bool, float, str]:
    """One chapter in a fresh interpreter: (ran, seconds, its stderr)."""
    started = time.perf_counter()
    # stdout is this process's (each slow cell, as it ends); stderr is kept for a failure's report
    proc = subprocess.run(
        [sys.executable, __file__, "--one", name], stderr=subprocess.PIPE, text=True
    )
    return proc.returncode == 0, time.perf_counter() - started, proc.stderr


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--one":
        path = Path(sys.argv[2]).resolve()
        os.chdir(path.parent)
        try:
            run_cells(path)
        except BaseException:
            traceback.print_exc()
            return 1
        return 0
    jobs, names = 1, sys.argv[1:]
    if names[:1] == ["--jobs"]:
        jobs, names = int(names[1]), names[2:]
    failed = 0
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        running = {pool.submit(run_chapter, name): name for name in names}
        for done in as_completed(running):  # as each ends: a run stopped early still reports
            ok, seconds, stderr = done.result()
            print(f"{'ran' if ok else 'FAILED':<7}{running[done]} ({seconds:.0f} s)", flush=True)
            if not ok:
                failed += 1
                print("\n".join(stderr.splitlines()[-25:]), flush=True)
    return failed


if __name__ == "__main__":
    sys.exit(main())
