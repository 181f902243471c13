"""Course mode: the student copy stubs every solution, and the exercise tests notice.

The marker parsing is tested on small synthetic sources; the whole round trip (copy, grade) on a toy
project; and the real book in subprocesses, so each imports its own `minivllm` -- the copy's
package must be the one its tests exercise: a probe copy (the reference's code, each region
recording that it was entered), a copy with every exercise stubbed, and an assignment's round trip
(ch03.1 and ch05.2 stubbed, graded, solved, graded). The probe copy shows, at the cost of one
grading, that every exercise can be assigned alone (see
`test_each_exercise_stubbed_alone_fails_its_own_tests`) and keeps the dependency map honest.
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
from typing import NamedTuple

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


def test_a_long_stub_message_is_cut_between_words_to_fit_the_line_length() -> None:
    """The student's book shows stubs in listings that must not scroll: a raise longer than the
    package's 100 columns puts its message in string pieces on lines of their own."""
    description = (
        'chat -> play: "SPEAKER:\\n<speech>" per message, ' + "then more " * 8 + "and so on"
    )
    module = f"def f():\n    # EXERCISE ch09.2: {description}\n    {student.BEGIN}\n"
    module += f"    return 1\n    {student.END}\n"
    text, _ = student.stub_source(module, "long.py")
    stub = text.split("raise", 1)[1]
    assert max(len(line) for line in stub.splitlines()) <= 100, text
    assert text.count("raise NotImplementedError(\n") == 1 and text.count('"\n') >= 2, text
    namespace: dict = {}
    exec(compile(text, "long.py", "exec"), namespace)
    with pytest.raises(NotImplementedError) as raised:
        namespace["f"]()
    assert str(raised.value) == f"exercise ch09.2: {description}"


def test_one_exercise_may_span_several_regions() -> None:
    text, found = student.stub_source(MODULE.replace("ch09.2", "ch09.1"), "toy.py")
    assert [e.id for e in found] == ["ch09.1", "ch09.1"] and text.count(
        "raise NotImplementedError"
    ) == 2


def test_a_probe_keeps_each_region_after_a_line_that_records_its_exercise() -> None:
    text, found = student.stub_source(MODULE, "toy.py", probe=True)
    assert [e.id for e in found] == ["ch09.1", "ch09.2"]
    assert student.BEGIN not in text and student.END not in text
    assert "return 42" in text and "side * side" in text and "NotImplementedError" not in text
    assert "    __import__('_exercise_probe').enter('ch09.1')\n    return 42\n" in text
    probe = type(sys)("_exercise_probe")
    exec(student.PROBE_SOURCE, probe.__dict__)
    namespace: dict = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(sys.modules, "_exercise_probe", probe)
        exec(compile(text, "toy.py", "exec"), namespace)
        assert namespace["Box"]().size() == 9 and probe.entered == {"ch09.2"}
        assert namespace["top"]() == 42 and probe.entered == {"ch09.1", "ch09.2"}


KERNELS_MODULE = textwrap.dedent("""\
    import numpy as np
    from numba import cuda, njit


    @njit(cache=False)
    def halve(x):
        # EXERCISE ch09.3: halve x in place
        ### BEGIN SOLUTION
        for i in range(x.shape[0]):
            x[i] /= 2
        ### END SOLUTION


    @cuda.jit(device=True)
    def twice(x):
        # EXERCISE ch09.4: twice x
        ### BEGIN SOLUTION
        return 2 * x
        ### END SOLUTION


    def launch(x):
        # KERNEL LAUNCH: the probe line for the compiled regions goes here
        halve(x)
        return x
""")


def test_a_region_numba_compiles_is_probed_where_python_launches_it() -> None:
    # numba cannot compile a call to Python inside @njit: that region's probe line goes after the
    # KERNEL LAUNCH comment; a cuda.jit region (run as Python by the simulator) keeps its own.
    text, found = student.stub_source(KERNELS_MODULE, "kernels.py", probe=True)
    assert [e.id for e in found] == ["ch09.3", "ch09.4"]
    probe_line = "__import__('_exercise_probe').enter"
    assert f"    {probe_line}('ch09.4')\n    return 2 * x\n" in text
    assert f"the compiled regions goes here\n    {probe_line}('ch09.3')\n    halve(x)" in text
    assert text.count(probe_line) == 2
    probe = type(sys)("_exercise_probe")
    exec(student.PROBE_SOURCE, probe.__dict__)
    namespace: dict = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(sys.modules, "_exercise_probe", probe)
        exec(compile(text, "kernels.py", "exec"), namespace)
        halved = namespace["launch"](namespace["np"].array([2.0, 6.0]))
    assert halved.tolist() == [1.0, 3.0] and probe.entered == {"ch09.3"}  # compiled and probed
    # a student copy stubs the region inside the compiled function as any other
    stubbed = student.stub_source(KERNELS_MODULE, "kernels.py", only={"ch09.3"})[0]
    assert '    raise NotImplementedError("exercise ch09.3: halve x in place")\n' in stubbed


def test_a_compiled_region_without_a_kernel_launch_line_is_refused() -> None:
    without = KERNELS_MODULE.replace("# KERNEL LAUNCH: the probe line", "# the probe line")
    with pytest.raises(student.MarkerError, match=r"kernels.py:7: .*no '# KERNEL LAUNCH' line"):
        student.stub_source(without, "kernels.py", probe=True)
    assert student.stub_source(without, "kernels.py")[1]  # a student copy needs no launch line


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


def numba_cache(project: Path) -> Path:
    return project.parent / f"{project.name}-numba-cache"


def run(
    args: list[str], cwd: Path, timeout: int = 1200, plugins: bool = True, env: dict | None = None
) -> subprocess.CompletedProcess:
    """Run Python in `cwd` with only `cwd/src` in front of the path, so its own package is
    imported."""
    # pytest prints whole failure messages in its short summary when it sees CI (or BUILD_NUMBER)
    # set; a student's terminal does not, and the output these tests check is what a student reads
    inherited = {k: v for k, v in os.environ.items() if k not in ("CI", "BUILD_NUMBER")}
    env = {
        **inherited,
        **(env or {}),
        "PYTHONPATH": str(cwd / "src"),
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    # numba caches compiled kernels beside their source (`__pycache__`) unless told otherwise: keep
    # the graded project as free of them as PYTHONDONTWRITEBYTECODE keeps it of bytecode
    env["NUMBA_CACHE_DIR"] = str(numba_cache(cwd))
    if not plugins:  # the toy project needs no installed pytest plugins; loading them costs seconds
        env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def grade(project: Path, report: Path, plugins: bool = True, extra: list[str] = ()) -> dict:
    env = {}
    if (project / "src" / f"{student.PROBE_MODULE}.py").is_file():
        # A probe line is Python: on a GPU numba would compile chapter 08's kernels and refuse it;
        # the simulator runs them as Python (the tests' tensors are on the CPU either way).
        env["NUMBA_ENABLE_CUDASIM"] = "1"
    done = run(
        ["tools/student.py", "--grade", "--json", str(report), *extra],
        project,
        plugins=plugins,
        env=env,
    )
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
    assert [e.id for e in student.make_probe_copy(toy, tmp_path / "probe")] == ["ch09.1", "ch09.2"]
    report = grade(tmp_path / "probe", tmp_path / "probe.json", plugins=False)
    assert {name: (t["outcome"], t["entered"]) for name, t in report["tests"].items()} == {
        "tests/test_toy.py::test_top": ("passed", ["ch09.1"]),
        "tests/test_toy.py::test_size": ("passed", ["ch09.2"]),
    }


def test_a_probe_counts_what_a_shared_fixture_entered_for_every_test_using_it(
    tmp_path: Path,
) -> None:
    """A module fixture runs once, in the first test's window; a stub there would fail every test
    that uses it, so each of them is counted as entering its regions."""
    toy = make_toy_project(tmp_path / "toy")
    (toy / "tests" / "test_toy.py").write_text(
        "import pytest\nfrom toy import top, Box\n\n"
        "@pytest.fixture(scope='module')\ndef answer():\n    return top()\n\n"
        "@pytest.mark.exercise('ch09.2')\n@pytest.mark.parametrize('n', [1, 2])\n"
        "def test_size(answer, n):\n    assert Box().size() * n == 9 * n and answer == 42\n"
    )
    student.make_probe_copy(toy, tmp_path / "probe")
    report = grade(tmp_path / "probe", tmp_path / "probe.json", plugins=False)
    assert [t["entered"] for t in report["tests"].values()] == [["ch09.1", "ch09.2"]] * 2


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


def test_a_stub_fails_its_tests_in_a_line_or_two_not_a_traceback_each(tmp_path: Path) -> None:
    toy = make_toy_project(tmp_path / "toy")
    (toy / "tests" / "test_toy.py").write_text(
        TOY_TESTS
        + "".join(
            f"\n@pytest.mark.exercise('ch09.1')\ndef test_top_{n}():\n    assert top() == 42\n"
            for n in range(5)
        )
    )
    copy = tmp_path / "copy"
    student.make_student_copy(toy, copy, only={"ch09.1"})
    done = run(["-m", "pytest", "tests", "--exercise", "ch09.1"], copy, timeout=120, plugins=False)
    out = done.stdout
    assert done.returncode == pytest.ExitCode.TESTS_FAILED and "6 failed" in out, out
    assert out.count("exercise ch09.1 is not solved yet") == 1, out
    assert out.count("NotImplementedError: exercise ch09.1: the same stub as above") == 5, out
    assert "src/toy/__init__.py:3: NotImplementedError: exercise ch09.1: return the answer" in out
    assert len(out.splitlines()) < 45, out  # was a traceback of a dozen lines per test


def test_the_intros_grading_command_needs_only_the_book_extra() -> None:
    """Chapter 00 tells a reader who ran `make book` to grade ch00.1 with pytest: the book extra
    must bring pytest, and the test file it names (and conftest) must import, at module level,
    nothing that only the dev extra installs."""
    import ast
    import tomllib

    intro = next((ROOT / "chapters").glob("00_*.py")).read_text(encoding="utf-8")
    command = re.search(r"^# (pytest (tests/\S+\.py) --exercise ch00\.1)$", intro, re.M)
    assert command, "chapter 00 no longer shows its grading command"
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert any(re.match(r"pytest\b", r) for r in extras["book"])
    dev_only = {re.match(r"[\w-]+", r)[0] for r in extras["dev"]} - {"minivllm", "pytest"}
    for path in (ROOT / command[2], ROOT / "tests" / "conftest.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        top = {
            alias.name.split(".")[0]
            for node in tree.body
            if isinstance(node, ast.Import)
            for alias in node.names
        } | {
            node.module.split(".")[0]
            for node in tree.body
            if isinstance(node, ast.ImportFrom) and node.module
        }
        assert not top & dev_only, f"{path.name} imports {top & dev_only} (dev extra only)"


def test_a_grade_line_shows_the_stubs_whole_message_not_the_same_stub_as_above() -> None:
    # conftest.py shortens every repeat of a stub's failure; the grade line of an exercise whose
    # own tests all came after the first repeat must still say what the stub asks for.
    whole = "NotImplementedError: exercise ch04.4: admission -- take waiting sequences in order"
    short = "NotImplementedError: exercise ch04.4: the same stub as above"
    report = {
        "tests": {
            "tests/test_preemption.py::test_a": {
                "exercises": ["ch05.2"],
                "outcome": "failed",
                "stub": "ch04.4",
                "summary": whole,
            },
            "tests/test_scheduler.py::test_b": {
                "exercises": ["ch04.4"],
                "outcome": "failed",
                "stub": "ch04.4",
                "summary": short,
            },
        }
    }
    by_id = {r.exercise: r for r in student.exercise_results(report)}
    assert by_id["ch04.4"].status == "failed"
    assert by_id["ch04.4"].detail == f"test_scheduler.py::test_b: {whole}"
    assert by_id["ch05.2"].status == "blocked"


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


# -- the real book: the probe copy passes, a student copy fails on its stubs -----------------------


@pytest.fixture(scope="module")
def exercises() -> list:
    found = student.find_exercises(ROOT)
    if not found:
        pytest.skip("no solution regions under src/: this is a student copy")
    return found


class Reports(NamedTuple):
    copy: dict  # the student copy, every exercise stubbed, graded
    copy_root: Path
    probe: dict  # the probe copy graded: each test's record lists the exercises it `entered`
    round_trip: list  # (stubbed, solved): a copy assigning ASSIGNED graded, then solved, regraded
    assigned_readme: str  # that copy's STUDENT.md


# The README's own example: ch05.2's tests run the scheduler, which grows block tables with
# ch03.1's blocks_needed, so grading must report ch05.2 as blocked by ch03.1.
ASSIGNED = ["ch03.1", "ch05.2"]


def solve(copy: Path) -> None:
    """What a student who solves every assigned exercise does: each stub becomes the reference's
    code (the markers off, as a student copy has them)."""
    for path in student.package_sources(ROOT):
        solved = student.stub_source(path.read_text(encoding="utf-8"), only=set())[0]
        target = copy / path.relative_to(ROOT)
        if target.read_text(encoding="utf-8") != solved:
            target.write_text(solved, encoding="utf-8")


def round_trip(copy: Path, work: Path) -> list:
    """Grade the copy as its student would (`--grade`: its assigned exercises' tests only), solve
    it, grade it again: the two reports and their printed outputs."""
    graded = []
    for stage in ("stubbed", "solved"):
        if stage == "solved":
            solve(copy)
        report = work / f"round-trip-{stage}.json"
        done = run(["tools/student.py", "--grade", "--json", str(report)], copy)
        assert report.exists(), done.stdout[-3000:] + done.stderr[-3000:]
        graded.append((json.loads(report.read_text()), done.stdout))
    return graded


@pytest.fixture(scope="module")
def reports(exercises: list, tmp_path_factory: pytest.TempPathFactory) -> Reports:
    """Grade, side by side (each imports torch): a probe copy of the real book (the reference's
    code, so it also shows the reference passing), a student copy with every exercise stubbed, and
    the round trip of a copy assigning ASSIGNED. The main suite runs the same tests on the
    reference itself; grading it again here would only repeat them."""
    work = tmp_path_factory.mktemp("student")
    copy, probe, assigned = work / "copy", work / "probe", work / "assigned"
    student.make_student_copy(ROOT, copy)
    student.make_probe_copy(ROOT, probe)
    student.make_student_copy(ROOT, assigned, only=set(ASSIGNED))
    # the probe copy and an assignment without ch07.1 compile the reference's CPU kernels: they
    # load them; the copy with every exercise stubbed, ch07.1's in the kernels, compiles its own
    assert not student.seed_kernel_cache(ROOT, copy, numba_cache(copy))
    for project in (probe, assigned):
        assert student.seed_kernel_cache(ROOT, project, numba_cache(project))
    with ThreadPoolExecutor(3) as pool:
        # in file order: which test first computes a value a module fixture keeps is then fixed,
        # as it is when tools/student.py --deps --refresh computes the committed map
        probed = pool.submit(grade, probe, work / "probe.json", extra=["-pno:randomly"])
        copied = pool.submit(grade, copy, work / "copy.json")
        trip = pool.submit(round_trip, assigned, work)
        readme = (assigned / "STUDENT.md").read_text(encoding="utf-8")
        return Reports(copied.result(), copy, probed.result(), trip.result(), readme)


def test_every_exercise_has_tests_and_every_test_an_exercise(
    exercises: list, reports: tuple
) -> None:
    in_source = {e.id for e in exercises}
    in_tests = {i for test in reports.probe["tests"].values() for i in test["exercises"]}
    assert not in_source - in_tests, (
        f"exercises with no marked test: {sorted(in_source - in_tests)}"
    )
    assert not in_tests - in_source, (
        f"tests marked with unknown exercises: {sorted(in_tests - in_source)}"
    )


def test_student_copy_fails_every_exercise_test_on_a_stub(reports: Reports) -> None:
    copy_report, copy = reports.copy, reports.copy_root
    package = Path(copy_report["packages"]["minivllm"])
    assert package.is_relative_to(copy / "src"), (
        f"the copy's tests imported {package}, not the copy's package"
    )
    assert copy_report["tests"].keys() == reports.probe["tests"].keys()
    wrong = {
        name: t["outcome"] + ": " + t["message"][-300:]
        for name, t in copy_report["tests"].items()
        if t["outcome"] != "failed" or "NotImplementedError" not in t["message"]
    }
    assert not wrong, (
        "these exercise tests do not fail on a stub in the student copy:\n"
        + json.dumps(wrong, indent=1)
    )


def test_grading_an_assignment_reports_the_blocked_exercise_then_passes_once_solved(
    reports: Reports,
) -> None:
    """ch05.2's tests stop at ch03.1's stub: the grade says so instead of failing ch05.2, lists
    only the assigned exercises, one line each, and once both are solved, both pass."""
    (stubbed, stubbed_output), (solved, solved_output) = reports.round_trip
    graded = {e for t in stubbed["tests"].values() for e in t["exercises"]}
    assert set(ASSIGNED) <= graded, "the assigned exercises' tests were not all graded"
    assert all(set(t["exercises"]) & set(ASSIGNED) for t in stubbed["tests"].values()), (
        "tests of exercises that were not assigned were graded"
    )
    results = {r.exercise: r for r in student.exercise_results(stubbed, ASSIGNED)}
    three, five = results["ch03.1"], results["ch05.2"]
    assert (three.status, three.passed) == ("failed", 0) and three.tests > 0
    assert "NotImplementedError: exercise ch03.1" in three.detail
    assert five.status == "blocked" and five.detail.startswith("by ch03.1 ("), five
    table = [line for line in stubbed_output.splitlines() if line.startswith("ch")]
    assert [line.split()[:2] for line in table] == [["ch03.1", "failed"], ["ch05.2", "blocked"]]
    assert f"0/{three.tests}" in table[0] and "by ch03.1" in table[1]
    assert len(stubbed_output.splitlines()) < 20, stubbed_output  # no tracebacks
    after = student.exercise_results(solved, ASSIGNED)
    assert [(r.exercise, r.status, r.passed) for r in after] == [
        ("ch03.1", "passed", three.tests),
        ("ch05.2", "passed", five.tests),
    ], solved_output
    assert "2 exercise(s): 2 passed, 0 failed, 0 blocked" in solved_output


def test_student_md_says_where_statements_are_and_what_blocks_what(reports: Reports) -> None:
    readme = reports.assigned_readme
    assert "python3.1" not in readme  # no fixed minor version
    assert "**Exercises** section" in readme and "`chapters/03_paged_cache.ipynb`" in readme
    blocks = student.load_dependency_map()["blocks"]
    assert student.dependency_table(blocks, ASSIGNED) in readme
    section = readme.split("## Which exercise blocks what", 1)[1]
    row = next(line for line in section.splitlines() if line.startswith("| `ch03.1` |"))
    assert "ch05.2" in row.split("|")[2], row  # the pair this module grades as blocked


def test_the_committed_dependency_map_is_current(exercises: list, reports: Reports) -> None:
    """Its test half is recomputed from this module's probe grading; its chapter half costs a run
    of every chapter (`--deps --refresh`), so here only its chapters and exercises are checked to
    be the book's."""
    committed = student.load_dependency_map()
    live = student.dependency_map(reports.probe["tests"], {})
    assert committed["blocks"].keys() == {e.id for e in exercises}
    stale = {
        exercise: (blocks["exercises"], live.get(exercise, {"exercises": []})["exercises"])
        for exercise, blocks in committed["blocks"].items()
        if blocks["exercises"] != live.get(exercise, {"exercises": []})["exercises"]
    }
    assert not stale, (
        f"{student.DEPS} is stale (exercise: committed, now); run {committed['regenerate']}: "
        + json.dumps(stale)
    )
    chapters = sorted(path.stem for path in (ROOT / "chapters").glob("[0-9][0-9]_*.py"))
    assert committed["chapters_run"] == chapters, f"run {committed['regenerate']}"
    # where each chapter's entries came from (a --chapters refresh keeps the others' commits)
    assert sorted(committed["chapter_commits"]) == chapters
    assert committed["commit"] in committed["chapter_commits"].values()
    for exercise, blocks in committed["blocks"].items():
        assert set(blocks["chapters"]) <= set(chapters), exercise


def test_a_partial_refresh_keeps_the_other_chapters_entries() -> None:
    """`--chapters` turns the committed chapter half around (chapter -> exercises entered) to keep
    the chapters it does not run; turned back, it is the same map."""
    entered = {"03_x": ["ch03.1"], "04_y": ["ch03.1", "ch04.2"], "05_z": []}
    blocks = student.dependency_map({}, entered)
    assert student.chapters_entered(blocks) == {"03_x": ["ch03.1"], "04_y": ["ch03.1", "ch04.2"]}
    assert student.dependency_map({}, student.chapters_entered(blocks)) == blocks


# -- each exercise assignable alone, from one grading of the probe copy ---------------------------

# Chains the book means: tests of one exercise that run another exercise's solution, by test
# function (parameters stripped) or by whole test file, with why. Stubbing an exercise named here
# alone also fails these tests. Any other test that enters a foreign region fails the check below.
# The core exercises are the engine's own path, so their tests build on the chapters' small ones.
ALLOCATE = (
    "allocate_slots (ch03.4) grows a block table through append, which counts new blocks with "
    "blocks_needed (ch03.1), and separates a fork with copy_on_write (ch03.2): the chapter's core "
    "is built on its two small exercises"
)
ADMISSION = (
    "the scheduler's admission loop (ch04.4) asks BlockManager.allocate_slots (ch03.4), which "
    "grows tables by blocks_needed (ch03.1); random workloads run out of blocks and preempt "
    "(ch05.1, ch05.2, ch05.3)"
)
SCHEDULER = (
    "the pure scheduler admits (ch04.4) and grows each sequence's block table by allocate_slots "
    "and blocks_needed (ch03.4, ch03.1), and appends every sampled token to the sequence's text "
    "through the streaming UTF-8 decoder (ch01.1): preemption is what happens when that growth "
    "runs out of blocks, and make_room preempts each victim with preempt (ch05.2)"
)
ENGINE = (
    "an end-to-end run of the engine with the shipped model, the point of the test: loading it "
    "(ch10.3), RMSNorm and RoPE on a GPU (ch00.1, ch00.2: on the CPU the fused model computes "
    "them with torch's one-op norm and a compiled loop), the streaming decoder (ch01.1), admission "
    "and block growth (ch04.4, ch03.4, ch03.1), the batch flattening (ch04.3) and, sampling, "
    "top-k/top-p and the inverse-CDF draw (ch04.1, ch04.2); on a CPU its attention is chapter "
    "07's kernel, whose softmax is ch07.1; preempting policies make room (ch05.1, ch05.3)"
)
SERVER = ENGINE + (
    "; the server streams it as SSE lines (ch09.1), a chat's messages laid out as a play (ch09.2)"
)
SSE = "the streamed answer (ch09.3) is made of SSE lines, each written by sse_event (ch09.1)"
RESIDUAL_DRAW = (
    "the acceptance rule's reference solution draws the replacement token from norm(max(0, p - q)) "
    "with the inverse-CDF draw of ch04.2, as the chapter teaches; the distribution tests also run "
    "the drafter and target's sampler (top-k/top-p, ch04.1), the sequences' decoder (ch01.1) and "
    "the verify loop that applies the rule (ch06.3)"
)
VERIFY = (
    "the verify loop (ch06.3) judges each draft by the acceptance rule (ch06.1); its residual "
    "draws and bonus tokens come from the sampler (top-k/top-p and inverse CDF, ch04.1, ch04.2)"
)
_SCHEDULER_ONLY = {"ch01.1", "ch03.1", "ch03.4", "ch04.4", "ch05.2"}
_ENGINE_ALL = {
    *("ch00.1", "ch00.2", "ch01.1", "ch03.1", "ch03.4", "ch04.1", "ch04.2", "ch04.3", "ch04.4"),
    *("ch05.1", "ch05.3", "ch07.1", "ch10.3"),
}
ALLOWED_CHAINS: dict[str, tuple[set[str], str]] = {
    **{
        f"tests/test_block_allocator.py::test_allocate_slots_{name}": (
            {"ch03.1", "ch03.2"},
            ALLOCATE,
        )
        for name in (
            "copies_a_forks_shared_block_before_writing",
            "counts_the_copy_of_a_shared_block",
            "creates_the_table_and_grows_it_lazily",
            "fills_the_slack_of_the_last_block_first",
            "never_shrinks_lookahead",
            "refuses_without_changing_anything",
            "shrinks_a_prefill_chunk_to_what_fits",
        )
    },
    "tests/test_scheduler.py": ({"ch03.1", "ch03.4", "ch05.1", "ch05.2", "ch05.3"}, ADMISSION),
    "tests/test_engine.py::test_build_batch_follows_the_schedulers_plans": (
        _SCHEDULER_ONLY,
        SCHEDULER,
    ),
    **{
        f"tests/test_preemption.py::{name}": (_SCHEDULER_ONLY | {"ch05.1"}, SCHEDULER)
        for name in (
            "test_a_preemption_worked_by_hand",
            "test_a_sequence_can_be_its_own_victim",
            "test_a_custom_policy_sees_the_unserved_running_sequences_in_admission_order",
            "test_several_victims_in_one_step_queue_in_front_of_fresh_requests",
            "test_make_room_asks_first_and_preempts_nobody_when_the_sequence_fits",
            "test_make_room_gives_up_when_the_sequence_is_alone",
            "test_make_room_never_offers_a_served_sequence_and_stops_when_it_is_its_own_victim",
            "test_make_room_preempts_victims_one_at_a_time_until_the_sequence_fits",
            "test_random_preempting_workloads_finish_and_keep_the_books",
        )
    },
    **{
        f"tests/test_preemption.py::{name}": (_ENGINE_ALL | {"ch05.2"}, ENGINE)
        for name in (
            "test_the_worked_example_step_by_step",
            "test_preemption_never_changes_a_token",
            "test_a_resumed_sequence_finds_its_prefix_in_the_cache",
            "test_a_neighbour_preempted_for_a_hopeless_request_comes_back",
            "test_with_preemption_the_same_burst_finishes",
            "test_a_request_that_cannot_fit_alone_ends_cache_full",
        )
    },
    **{
        f"tests/test_server.py::{name}": (_ENGINE_ALL | {"ch09.1", "ch09.2"}, SERVER)
        for name in (
            "test_a_client_that_disconnects_mid_stream_is_aborted",
            "test_openai_chat_streamed_equals_non_streamed",
            "test_openai_completion_streamed_equals_non_streamed",
        )
    },
    "tests/test_tensor_parallel.py::test_the_ranks_slices_tile_every_tensor": (
        {"ch10.3"},
        "it cuts the shipped model and each family's checkpoint into the ranks' shares; loading "
        "them checks their tensors (ch10.3)",
    ),
    **{
        f"tests/test_openai_protocol.py::{name}": ({"ch09.1"}, SSE)
        for name in (
            "test_a_client_that_goes_away_mid_stream_aborts_the_request",
            "test_a_stream_sends_its_chunks_in_order_then_usage_then_done",
            "test_without_include_usage_the_finish_chunks_come_last_before_done",
        )
    },
    **{
        f"tests/test_speculative.py::{name}": (
            {"ch01.1", "ch04.1", "ch04.2", "ch06.3"},
            RESIDUAL_DRAW,
        )
        for name in (
            "test_a_draft_at_least_as_likely_under_p_is_always_accepted",
            "test_acceptance_probability_is_min_1_p_over_q",
            "test_a_draft_the_drafter_gave_no_probability_is_rejected_and_resampled_from_the_residual",
            "test_a_draft_the_target_gives_no_probability_is_always_rejected",
            "test_the_residual_draw_is_norm_max_0_p_minus_q",
            "test_p_equal_to_q_gives_no_nan_and_falls_back_to_p",
            "test_greedy_one_hot_rows_accept_iff_the_draft_is_the_argmax",
            "test_rows_are_independent",
            "test_first_speculative_token_has_the_targets_distribution",
            "test_next_token_given_the_first_has_the_targets_distribution",
        )
    },
    **{
        f"tests/test_speculative.py::{name}": ({"ch04.1", "ch04.2", "ch06.1"}, VERIFY)
        for name in (
            "test_all_drafts_accepted_the_run_ends_with_the_bonus_token",
            "test_each_sequences_run_is_its_own_whatever_the_batch",
            "test_sampled_runs_are_a_function_of_seed_and_position",
            "test_sampled_verify_uses_the_request_streams",
            "test_sampled_verify_without_drafts_is_the_ordinary_sampler",
            "test_the_first_rejection_ends_the_run_with_the_resampled_token",
        )
    },
}
# Tests whose regions the probe cannot see: they read engine runs that a module fixture
# (test_preemption's `runs`) computes on first use and keeps; the regions a run enters count only
# for the test that computed it, and pytest-randomly shuffles which test that is. Stubbed, a run
# raises and is not kept, so every test needing it fails: their own exercise is not checked here,
# only that they enter nothing unexplained.
PROBE_BLIND = {
    "tests/test_preemption.py::test_preemption_never_changes_a_token",
    "tests/test_preemption.py::test_a_resumed_sequence_finds_its_prefix_in_the_cache",
}


def function_of(nodeid: str) -> str:
    return nodeid.split("[", 1)[0]


def allowed_chain(nodeid: str) -> set[str]:
    """The exercises a test may run besides its own: its function's chain and its file's."""
    by_function = ALLOWED_CHAINS.get(function_of(nodeid), (set(), ""))[0]
    return by_function | ALLOWED_CHAINS.get(nodeid.split("::", 1)[0], (set(), ""))[0]


def probe_table(tests: dict, names: list[str]) -> str:
    width = max(len(name) for name in names)
    rows = [f"{'test':<{width}}  marked -> entered"]
    rows += [
        f"{name:<{width}}  {','.join(tests[name]['exercises'])} -> "
        f"{','.join(tests[name]['entered']) or 'nothing'}"
        for name in sorted(names)
    ]
    return "\n".join(rows)


def test_the_probe_copy_passes_and_records_every_exercise_test(reports: Reports) -> None:
    probe = reports.probe["tests"]
    # the probe copy's package ran: the reference's code, each region behind its probe line
    assert Path(reports.probe["packages"]["minivllm"]).parents[2].name == "probe"
    failed = {
        n: t["outcome"] + t["message"][-300:] for n, t in probe.items() if t["outcome"] != "passed"
    }
    assert not failed, "the probe line changed what these tests see:\n" + json.dumps(
        failed, indent=1
    )
    assert all("entered" in t for t in probe.values())
    graded = {function_of(n) for n in probe} | {n.split("::", 1)[0] for n in probe}
    assert not (ALLOWED_CHAINS.keys() | PROBE_BLIND) - graded, (
        "stale entries: no such exercise test"
    )


def test_each_exercise_stubbed_alone_fails_its_own_tests(reports: Reports) -> None:
    """Grading one probe copy stands for grading one student copy per exercise, each stubbing that
    exercise alone (20+ gradings of minutes each).

    The copy with X alone stubbed differs from the reference only in X's regions, and a stub raises
    NotImplementedError("exercise X: ...") as soon as it is entered. The probe copy runs exactly the
    reference's code, each region first telling the probe its exercise was entered; so a test's
    `entered` set is the set of exercises whose regions the reference runs for it (in its own
    setup, call and teardown, and in the setup of the broader fixtures it uses). Hence:

    * X's tests fail when X alone is stubbed <=> each test marked X enters a region of X (this
      test), and does not swallow the NotImplementedError (the all-stubbed copy shows each exercise
      test failing with it, naming its own exercise:
      `test_each_stubbed_test_fails_on_its_own_exercises_stub`);
    * only X's tests fail <=> no test marked Y != X enters a region of X: it then runs in that copy
      just as in the reference, which passes it (the next test; ALLOWED_CHAINS are the exceptions
      the book means, each with its reason).

    The probe cannot see into another process, nor through a value memoized by one test and read
    by another (PROBE_BLIND); none of the graded tests starts a process."""
    probe = reports.probe["tests"]
    missing = [
        name
        for name, t in probe.items()
        if set(t["exercises"]) - set(t["entered"]) and function_of(name) not in PROBE_BLIND
    ]
    assert not missing, (
        "these tests would pass with their own exercise stubbed alone (they enter none of its "
        "regions):\n" + probe_table(probe, missing)
    )


def test_each_exercise_stubbed_alone_fails_only_its_own_tests(reports: Reports) -> None:
    """See `test_each_exercise_stubbed_alone_fails_its_own_tests` for why this is the check."""
    probe = reports.probe["tests"]
    foreign = [
        name
        for name, t in probe.items()
        if set(t["entered"]) - set(t["exercises"]) - allowed_chain(name)
    ]
    assert not foreign, (
        "these tests run another exercise's solution, so stubbing that exercise alone would fail "
        "them too (make them build their inputs without it, or add the chain to ALLOWED_CHAINS "
        "with its reason):\n" + probe_table(probe, foreign)
    )


def test_each_stubbed_test_fails_on_its_own_exercises_stub(reports: Reports) -> None:
    """In the all-stubbed copy each exercise test fails on a stub of its own exercise (or of one it
    is allowed to build on), not on another exercise's stub it happens to reach first."""
    wrong = {}
    for name, t in reports.copy["tests"].items():
        # numba's CUDA simulator puts the thread's coordinates between the two
        named = re.findall(r"NotImplementedError: [^\n]*?\bexercise ([\w.-]+):", t["message"])
        if not named or named[-1] not in set(t["exercises"]) | allowed_chain(name):
            wrong[name] = f"marked {','.join(t['exercises'])}; failed on " + (
                f"exercise {named[-1]}" if named else repr(t["message"][-200:])
            )
    assert not wrong, json.dumps(wrong, indent=1)


def test_student_copy_is_complete_and_free_of_solutions(exercises: list, reports: Reports) -> None:
    copy = reports.copy_root
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


def test_student_book_shows_no_solution(exercises: list, reports: Reports) -> None:
    """The copy builds its own HTML book from its scrubbed notebooks: no solution code in it."""
    pytest.importorskip("jupyter_book", reason="the book extra is not installed")
    copy = reports.copy_root
    assert student.build_student_book(copy) == 0
    pages = sorted((copy / "book" / "_build" / "html" / "chapters").glob("*.html"))
    assert len(pages) >= 9
    text = "\n".join(html.unescape(re.sub(r"<[^>]+>", "", p.read_text())) for p in pages)
    assert "minivllm-solution" not in "".join(p.read_text() for p in pages)
    reference = {p: p.read_text() for p in (ROOT / "src").rglob("*.py")}
    solution = r"### BEGIN SOLUTION\n(.*?)### END SOLUTION"
    # a line the package also has outside every region (a loop header) is shown anyway
    outside = {
        line.strip()
        for source in reference.values()
        for line in re.sub(solution, "", source, flags=re.S).splitlines()
    }
    bodies = [
        line.strip()
        for source in reference.values()
        for region in re.findall(solution, source, re.S)
        for line in region.splitlines()
        if len(line.strip()) > 24  # a distinctive line, not `return x`
        and line.strip() not in outside
    ]
    assert bodies
    leaked = [line for line in bodies if line in text]
    assert not leaked, f"solution lines in the student book: {leaked[:5]}"
