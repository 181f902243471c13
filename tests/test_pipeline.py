"""The book's own plumbing: paired and executed notebooks, dependency lists in step, the promised
layout."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = sorted((ROOT / "chapters").glob("[0-9][0-9]_*.py"))
NOTEBOOKS = sorted((ROOT / "chapters").glob("[0-9][0-9]_*.ipynb"))
EACH_CHAPTER = pytest.mark.parametrize(
    "chapter",
    CHAPTERS or [pytest.param(None, marks=pytest.mark.skip(reason="no chapters yet"))],
    ids=lambda path: path.stem if path else "none",
)


def notebooks_tool():
    spec = importlib.util.spec_from_file_location(
        "minivllm_notebooks_tool", ROOT / "tools" / "notebooks.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def stored_notebook(chapter: Path):
    nbformat = pytest.importorskip("nbformat")
    notebook = chapter.with_suffix(".ipynb")
    assert notebook.exists(), (
        f"{chapter.name} has no executed {notebook.name}: run `make notebooks`"
    )
    return nbformat.read(notebook, as_version=4)


@EACH_CHAPTER
def test_notebook_holds_the_same_cells_as_its_source(chapter: Path) -> None:
    pytest.importorskip("jupytext")
    tool = notebooks_tool()
    stored = tool.cell_sources(stored_notebook(chapter))
    assert stored == tool.cell_sources(tool.jupytext.read(chapter)), (
        f"{chapter.with_suffix('.ipynb').name} drifted from {chapter.name}: run `make notebooks "
        f"CHAPTERS={chapter}`"
    )


@EACH_CHAPTER
def test_notebook_was_executed_top_to_bottom_without_errors(chapter: Path) -> None:
    cells = [
        c for c in stored_notebook(chapter).cells if c.cell_type == "code" and c.source.strip()
    ]
    counts = [c.execution_count for c in cells]
    # A fresh kernel running every cell in order numbers them 1, 2, 3...; anything else was run by
    # hand.
    assert counts == list(range(1, len(cells) + 1)), (
        f"execution counts {counts}: run `make notebooks`"
    )
    errors = [i for i, c in enumerate(cells) if any(o.output_type == "error" for o in c.outputs)]
    assert not errors, f"code cells {errors} stored an error"


@EACH_CHAPTER
def test_chapter_is_in_the_books_table_of_contents(chapter: Path) -> None:
    assert f"file: chapters/{chapter.stem}" in (ROOT / "book" / "_toc.yml").read_text()


def test_every_notebook_has_its_source() -> None:
    orphans = [nb.name for nb in NOTEBOOKS if not nb.with_suffix(".py").exists()]
    assert not orphans, f"notebooks without a chapters/*.py source: {orphans}"


def normalize(requirement: str) -> str:
    name, rest = re.match(r"\s*([A-Za-z0-9._-]+)(.*)", requirement).groups()
    return re.sub(r"[-_.]+", "-", name.lower()) + re.sub(r"\s+", "", rest)


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_environment_yml_lists_the_pyproject_dependencies() -> None:
    yaml = pytest.importorskip("yaml")
    project = pyproject()["project"]
    extras = project["optional-dependencies"]
    wanted = {
        normalize(r)
        for r in project["dependencies"] + extras["book"] + extras["dev"]
        if not r.startswith(project["name"] + "[")
    }  # minivllm[book]: the dev extra pulls in book
    conda = yaml.safe_load((ROOT / "environment.yml").read_text())["dependencies"]
    pip = next(d["pip"] for d in conda if isinstance(d, dict))
    listed = {normalize(r) for r in pip if r != "-e ."}
    assert listed == wanted, (
        f"only in pyproject.toml: {sorted(wanted - listed)}; "
        f"only in environment.yml: {sorted(listed - wanted)}"
    )
    assert "-e ." in pip and "pip" in conda


def test_environment_yml_pins_a_supported_python() -> None:
    yaml = pytest.importorskip("yaml")
    from packaging.specifiers import SpecifierSet

    conda = yaml.safe_load((ROOT / "environment.yml").read_text())["dependencies"]
    pins = [d.split("=", 1)[1] for d in conda if isinstance(d, str) and re.match(r"python\s*=", d)]
    assert pins == ["3.11"], f"environment.yml pins python {pins}; the book targets 3.11"
    assert SpecifierSet(pyproject()["project"]["requires-python"]).contains("3.11")


@pytest.mark.parametrize(
    "path",
    [
        "book",
        "chapters",
        "src/minivllm",
        "tests",
        "benchmarks",
        "tools",
        "environment.yml",
        "pyproject.toml",
        "jupytext.toml",
        "Makefile",
        "README.md",
        ".ci/run",
        "LICENSE",
        "tests/nbval_sanitize.cfg",
        "tools/student.py",
    ],
)
def test_layout(path: str) -> None:
    assert (ROOT / path).exists(), f"{path} is missing (see BOOK_GUIDE.md, Layout)"


def test_ci_runs_make_test() -> None:
    run = ROOT / ".ci" / "run"
    assert os.access(run, os.X_OK), ".ci/run is not executable"
    assert re.search(r"^\s*make test\b", run.read_text(), re.MULTILINE)


def test_readme_gives_the_two_commands() -> None:
    readme = (ROOT / "README.md").read_text() if (ROOT / "README.md").exists() else ""
    assert "make book" in readme and "make test" in readme


def test_make_test_uses_the_sanitize_file_and_make_student_the_tool() -> None:
    makefile = (ROOT / "Makefile").read_text()
    assert "--nbval-sanitize-with tests/nbval_sanitize.cfg" in makefile
    assert "tools/student.py $(DEST)" in makefile


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
@pytest.mark.parametrize("venv", ["present", "absent"])
def test_make_bench_runs_vllm_peer_before_the_scoreboard_that_reads_it(
    venv: str, tmp_path: Path
) -> None:
    """Every benchmark alphabetically, but vllm_peer.py (only where vLLM's venv exists) and then
    scoreboard.py last: the scoreboard reads results/vllm_peer.json. A dry run: PY echoes."""
    vllm_python = sys.executable if venv == "present" else tmp_path / "no-venv" / "python"
    done = subprocess.run(
        ["make", "--no-print-directory", "-o", ".venv/.installed-dev", "bench"]
        + ["PY=echo RUN", f"VLLM_PEER_PYTHON={vllm_python}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    ran = [line.split()[1] for line in done.stdout.splitlines() if line.startswith("RUN ")]
    scripts = sorted(p.relative_to(ROOT).as_posix() for p in ROOT.glob("benchmarks/[!_]*.py"))
    peer, scoreboard = "benchmarks/vllm_peer.py", "benchmarks/scoreboard.py"
    others = [s for s in scripts if s not in (peer, scoreboard)]
    if venv == "present":
        assert ran == [*others, peer, scoreboard]
    else:
        assert ran == [*others, scoreboard]
        assert f"vllm_peer.py skipped: no vLLM virtualenv at {vllm_python}" in done.stdout
