"""Course mode: the student copy stubs every solution, and the exercise tests notice.

The marker parsing is tested on small synthetic sources; the whole round trip (copy, grade) on a toy
project; and the real book in two subprocesses (reference and student copy), so each imports its own
`minivllm` -- the copy's package must be the one its tests exercise.
"""

from __future__ import annotations

import html
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location(
    "minivllm_student_tool", ROOT / "tools" / "student.py"
)
student = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(student)

MODULE = textwrap.dedent("""\
    def top():
        # EXERCISE ch09.1: return the answer
        ### BEGIN SOLUTION
        return 42
        ### END SOLUTION


    class Box:
        def size(self):
            # EXERCISE ch09.2: "measure" the box
            ### BEGIN SOLUTION
            side = 3
            return side * side
            ### END SOLUTION

        def after(self):
            return "kept"
""")


def test_each_region_becomes_one_raise_at_its_indentation() -> None:
    text, found = student.stub_source(MODULE, "toy.py")
    assert "BEGIN SOLUTION" not in text and "return 42" not in text and "side * side" not in text
    assert '    raise NotImplementedError("exercise ch09.1: return the answer")\n' in text
    assert '        raise NotImplementedError("exercise ch09.2: \\"measure\\" the box")\n' in text
    assert '        # EXERCISE ch09.2: "measure" the box\n' in text  # the comment stays
    assert 'return "kept"' in text
    assert [(e.id, e.line, e.description) for e in found] == [
        ("ch09.1", 2, "return the answer"),
        ("ch09.2", 10, '"measure" the box'),
    ]
    namespace: dict = {}
    exec(compile(text, "toy.py", "exec"), namespace)
    with pytest.raises(NotImplementedError, match="ch09.2"):
        namespace["Box"]().size()


def test_one_exercise_may_span_several_regions() -> None:
    text, found = student.stub_source(MODULE.replace("ch09.2", "ch09.1"), "toy.py")
    assert [e.id for e in found] == ["ch09.1", "ch09.1"] and text.count(
        "raise NotImplementedError"
    ) == 2


def test_source_without_regions_is_unchanged() -> None:
    plain = "x = 1  # EXERCISEs live elsewhere\n# exercise for the reader\n"
    assert student.stub_source(plain, "plain.py") == (plain, [])
    # a student copy, solved or not, has no regions
    stubbed = student.stub_source(MODULE, "toy.py")[0]
    assert student.stub_source(stubbed, "toy.py") == (stubbed, [])


EX, BEGIN, END = "# EXERCISE ch09.1: do it", "### BEGIN SOLUTION", "### END SOLUTION"


def test_only_the_chosen_exercises_are_stubbed_the_rest_kept_unmarked() -> None:
    text, found = student.stub_source(MODULE, "toy.py", only={"ch09.2"})
    assert [e.id for e in found] == ["ch09.1", "ch09.2"]
    assert "return 42" in text and "side * side" not in text
    assert 'raise NotImplementedError("exercise ch09.2: ' in text
    assert student.BEGIN not in text and student.END not in text
    assert compile(text, "toy.py", "exec")


def test_a_shown_solution_is_folded_under_its_exercise() -> None:
    from minivllm.book import SourceView

    view = SourceView(MODULE)
    assert repr(view) == MODULE.rstrip("\n")  # the plain text is the source, for nbval and scrub
    page = view._repr_html_()
    folds = re.findall(r'<details class="minivllm-solution"><summary>(.*?)</summary>', page)
    assert folds == [
        "Solution to exercise ch09.1 (open it once you have tried)",
        "Solution to exercise ch09.2 (open it once you have tried)",
    ]
    outside = re.sub(r"<details.*?</details>", "", page, flags=re.S)
    assert "42" not in outside and "side" not in outside and "kept" in outside
    assert "SOLUTION" not in page


@pytest.mark.parametrize(
    "lines, error",
    [
        ([EX, BEGIN, "x = 1"], "m.py:2: ### BEGIN SOLUTION without ### END SOLUTION"),
        ([EX, BEGIN, EX, BEGIN, END, END], "m.py:4: nested"),
        (["x = 1", END], "m.py:2: ### END SOLUTION without ### BEGIN SOLUTION"),
        (["x = 1", BEGIN, END], "m.py:2: ### BEGIN SOLUTION without an '# EXERCISE"),
        ([EX, "", BEGIN, END], "m.py:3: ### BEGIN SOLUTION without an '# EXERCISE"),
        (["x = 1", "## BEGIN SOLUTION", END], "m.py:2: malformed marker"),
        (["# EXERCISE ch09.1 no colon", BEGIN, END], "m.py:1: malformed marker"),
        (["x = 1", "### begin solution"], "m.py:2: malformed marker"),
    ],
)
def test_malformed_markers_fail_naming_file_and_line(lines: list[str], error: str) -> None:
    with pytest.raises(student.MarkerError) as raised:
        student.stub_source("\n".join(lines) + "\n", "m.py")
    assert str(raised.value).startswith(error)


def test_refuses_unsafe_destinations(tmp_path: Path) -> None:
    for dest in (ROOT, ROOT.parent, ROOT / "src" / "copy", ROOT / "tests" / "copy"):
        with pytest.raises(SystemExit, match="refusing"):
            student.check_destination(ROOT, dest, force=True)
    (tmp_path / "old.txt").write_text("x")
    with pytest.raises(SystemExit, match="--force"):
        student.check_destination(ROOT, tmp_path, force=False)
    student.check_destination(ROOT, tmp_path, force=True)
    student.check_destination(ROOT, tmp_path / "new", force=False)


def test_scrub_notebook_stubs_displayed_solutions(tmp_path: Path) -> None:
    nbformat = pytest.importorskip("nbformat")
    from IPython.core.formatters import DisplayFormatter

    from minivllm.book import SourceView

    shown = DisplayFormatter().format(SourceView(MODULE))[0]
    cell = nbformat.v4.new_code_cell(
        "show(top)",
        execution_count=1,
        outputs=[
            nbformat.v4.new_output("display_data", data=shown),
            nbformat.v4.new_output("stream", name="stdout", text=MODULE),
        ],
    )
    path = tmp_path / "00_toy.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[cell]), path)
    assert student.scrub_notebook(path)
    data, stream = nbformat.read(path, as_version=4).cells[0].outputs
    assert "SOLUTION" not in json.dumps(data) + json.dumps(stream)
    # Exactly what show() renders for the stubbed source, so nbval in the student copy agrees with
    # the stored output.
    stubbed = student.stub_source(MODULE)[0]
    assert data["data"] == DisplayFormatter().format(SourceView(stubbed))[0]
    assert stream["text"] == stubbed
    assert not student.scrub_notebook(path)  # nothing left to scrub


# -- the round trip on a toy project: copy, then grade the copy in a subprocess --------------------

TOY_TESTS = """\
import pytest
from toy import top, Box

@pytest.mark.exercise("ch09.1")
def test_top():
    assert top() == 42

@pytest.mark.exercise("ch09.2")
def test_size():
    assert Box().size() == 9

def test_unmarked():
    assert Box().after() == "kept"
"""


def run(
    args: list[str], cwd: Path, timeout: int = 1200, plugins: bool = True
) -> subprocess.CompletedProcess:
    """Run Python in `cwd` with only `cwd/src` in front of the path, so its own package is
    imported."""
    env = {**os.environ, "PYTHONPATH": str(cwd / "src"), "PYTHONDONTWRITEBYTECODE": "1"}
    # numba caches compiled kernels beside their source (`__pycache__`) unless told otherwise: keep
    # the graded project as free of them as PYTHONDONTWRITEBYTECODE keeps it of bytecode
    env["NUMBA_CACHE_DIR"] = str(cwd.parent / f"{cwd.name}-numba-cache")
    if not plugins:  # the toy project needs no installed pytest plugins; loading them costs seconds
        env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def grade(project: Path, report: Path, plugins: bool = True) -> dict:
    done = run(["tools/student.py", "--grade", "--json", str(report)], project, plugins=plugins)
    assert report.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(report.read_text())


def make_toy_project(root: Path) -> Path:
    (root / "src" / "toy").mkdir(parents=True)
    (root / "tests").mkdir()
    (root / "tools").mkdir()
    (root / "src" / "toy" / "__init__.py").write_text(MODULE)
    (root / "tests" / "test_toy.py").write_text(TOY_TESTS)
    shutil.copy(ROOT / "tests" / "conftest.py", root / "tests" / "conftest.py")
    shutil.copy(ROOT / "tools" / "student.py", root / "tools" / "student.py")
    (root / "pyproject.toml").write_text(
        '[tool.pytest.ini_options]\naddopts = "--strict-markers -p no:cacheprovider"\n'
        'markers = ["exercise(id): grades one exercise"]\n'
    )
    return root


def test_toy_round_trip(tmp_path: Path) -> None:
    toy = make_toy_project(tmp_path / "toy")
    exercises = student.make_student_copy(toy, tmp_path / "copy")
    assert [e.id for e in exercises] == ["ch09.1", "ch09.2"]
    assert "return 42" not in (tmp_path / "copy" / "src" / "toy" / "__init__.py").read_text()
    assert "`ch09.2`" in (tmp_path / "copy" / "STUDENT.md").read_text()
    for project, outcome in ((toy, "passed"), (tmp_path / "copy", "failed")):
        report = grade(project, tmp_path / f"{project.name}.json", plugins=False)
        assert Path(report["packages"]["toy"]).is_relative_to(project)
        assert {name: (t["exercises"], t["outcome"]) for name, t in report["tests"].items()} == {
            "tests/test_toy.py::test_top": (["ch09.1"], outcome),
            "tests/test_toy.py::test_size": (["ch09.2"], outcome),
        }


def test_exercise_option_selects_by_marker(tmp_path: Path) -> None:
    toy = make_toy_project(tmp_path)
    one = run(
        ["-m", "pytest", "tests", "--exercise", "ch09.2", "-q"], toy, timeout=120, plugins=False
    )
    assert one.returncode == 0 and "1 passed, 2 deselected" in one.stdout, one.stdout + one.stderr
    typo = run(
        ["-m", "pytest", "tests", "--exercise", "ch9.2", "-q"], toy, timeout=120, plugins=False
    )
    assert typo.returncode == pytest.ExitCode.USAGE_ERROR and "exercise(ch9.2)" in typo.stderr


def test_a_copy_refuses_to_grade_a_package_found_elsewhere(tmp_path: Path) -> None:
    """With the reference first on the import path, a student copy's tests would grade the
    reference: the shared conftest refuses, naming both packages."""
    copy = tmp_path / "copy"
    (copy / "src" / "minivllm").mkdir(parents=True)
    (copy / "src" / "minivllm" / "__init__.py").write_text("")
    (copy / "tests").mkdir()
    shutil.copy(ROOT / "tests" / "conftest.py", copy / "tests" / "conftest.py")
    (copy / "tests" / "test_nothing.py").write_text("def test_nothing():\n    pass\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"]
    wrong = subprocess.run(command, cwd=copy, env=env, capture_output=True, text=True)
    assert wrong.returncode == pytest.ExitCode.USAGE_ERROR, wrong.stdout + wrong.stderr
    assert str(copy / "src" / "minivllm") in wrong.stderr
    assert str(ROOT / "src" / "minivllm") in wrong.stderr
    env["PYTHONPATH"] = str(copy / "src")
    right = subprocess.run(command, cwd=copy, env=env, capture_output=True, text=True)
    assert right.returncode == 0, right.stdout + right.stderr


# -- the real book: reference passes, student copy fails with the stubs ----------------------------


@pytest.fixture(scope="module")
def exercises() -> list:
    found = student.find_exercises(ROOT)
    if not found:
        pytest.skip("no solution regions under src/: this is a student copy")
    return found


@pytest.fixture(scope="module")
def reports(exercises: list, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict, Path]:
    """Grade the reference and a fresh student copy of the real book, side by side (each imports
    torch)."""
    work = tmp_path_factory.mktemp("student")
    copy = work / "copy"
    student.make_student_copy(ROOT, copy)
    with ThreadPoolExecutor(2) as pool:
        reference, copied = pool.map(
            grade, (ROOT, copy), (work / "reference.json", work / "copy.json")
        )
    return reference, copied, copy


def test_every_exercise_has_tests_and_every_test_an_exercise(
    exercises: list, reports: tuple
) -> None:
    in_source = {e.id for e in exercises}
    in_tests = {i for test in reports[0]["tests"].values() for i in test["exercises"]}
    assert not in_source - in_tests, (
        f"exercises with no marked test: {sorted(in_source - in_tests)}"
    )
    assert not in_tests - in_source, (
        f"tests marked with unknown exercises: {sorted(in_tests - in_source)}"
    )


def test_reference_passes_every_exercise_test(reports: tuple) -> None:
    reference = reports[0]
    assert Path(reference["packages"]["minivllm"]).is_relative_to(ROOT / "src")
    failed = {
        name: t["message"][-500:]
        for name, t in reference["tests"].items()
        if t["outcome"] != "passed"
    }
    assert not failed, json.dumps(failed, indent=1)


def test_student_copy_fails_every_exercise_test_on_a_stub(reports: tuple) -> None:
    reference, copy_report, copy = reports
    package = Path(copy_report["packages"]["minivllm"])
    assert package.is_relative_to(copy / "src"), (
        f"the copy's tests imported {package}, not the copy's package"
    )
    assert copy_report["tests"].keys() == reference["tests"].keys()
    wrong = {
        name: t["outcome"] + ": " + t["message"][-300:]
        for name, t in copy_report["tests"].items()
        if t["outcome"] != "failed" or "NotImplementedError" not in t["message"]
    }
    assert not wrong, (
        "these exercise tests do not fail on a stub in the student copy:\n"
        + json.dumps(wrong, indent=1)
    )


def test_student_copy_is_complete_and_free_of_solutions(exercises: list, reports: tuple) -> None:
    copy = reports[2]
    for name in student.COPIED:
        assert (copy / name).exists() == (ROOT / name).exists(), name
    leftovers = [p for p in copy.rglob("*") if p.name in {".venv", ".git", "__pycache__", "_build"}]
    assert not leftovers
    # Prose may name the markers; a solution is a marker line in the package or in a cell's output.
    leaks = [
        p
        for p in (copy / "src").rglob("*.py")
        if any(line.strip() == student.BEGIN for line in p.read_text().splitlines())
    ]
    leaks += [
        p
        for p in (copy / "chapters").glob("*.ipynb")
        if student.BEGIN
        in json.dumps([cell.get("outputs", []) for cell in json.loads(p.read_text())["cells"]])
    ]
    assert not leaks, f"solutions left in the student copy: {leaks}"
    listing = (copy / "STUDENT.md").read_text()
    assert all(f"`{e.id}`" in listing for e in exercises)


def test_student_book_shows_no_solution(exercises: list, reports: tuple) -> None:
    """The copy builds its own HTML book from its scrubbed notebooks: no solution code in it."""
    pytest.importorskip("jupyter_book", reason="the book extra is not installed")
    copy = reports[2]
    assert student.build_student_book(copy) == 0
    pages = sorted((copy / "book" / "_build" / "html" / "chapters").glob("*.html"))
    assert len(pages) >= 9
    text = "\n".join(html.unescape(re.sub(r"<[^>]+>", "", p.read_text())) for p in pages)
    assert "minivllm-solution" not in "".join(p.read_text() for p in pages)
    reference = {p: p.read_text() for p in (ROOT / "src").rglob("*.py")}
    bodies = [
        line.strip()
        for source in reference.values()
        for region in re.findall(r"### BEGIN SOLUTION\n(.*?)### END SOLUTION", source, re.S)
        for line in region.splitlines()
        if len(line.strip()) > 24  # a distinctive line, not `return x`
    ]
    assert bodies
    leaked = [line for line in bodies if line in text]
    assert not leaked, f"solution lines in the student book: {leaked[:5]}"
