"""Course mode: write a student copy of the book with every exercise's solution stubbed out.

    python tools/student.py DEST [--force] [--exercises ch03.1,ch05.2] [--book]
        write the student copy to DEST (`make student DEST=dir [EXERCISES=...]`)
    python tools/student.py DEST --probe
        write a probe copy: every solution kept, each region recording that it was entered
    python tools/student.py --grade [--exercises ch03.1,...] [--json F]
        run the exercise tests here (a student copy's assigned ones by default); one line per
        exercise: passed, failed (with its first failure) or blocked by another exercise's stub
    python tools/student.py --deps [--exercises ...] [--refresh [--chapters STEM ...]]
        which exercises block which chapters and which other exercises' tests (DEPS); --refresh
        recomputes it in a probe copy: grades it and runs every chapter (many minutes);
        --chapters runs only those and keeps the others' entries from the committed map

Solutions live in the package source between nbgrader-style markers, right after an EXERCISE
comment:

    # EXERCISE ch00.1: RMSNorm -- divide x by its root-mean-square, times self.weight
    ### BEGIN SOLUTION
    ...
    ### END SOLUTION

In the student copy each region becomes one line, at the BEGIN line's indentation:
`raise NotImplementedError("exercise ch00.1: RMSNorm -- ...")`. The EXERCISE comment stays.
One exercise may span several regions (they repeat its id).

A probe copy keeps every solution and puts one line in front of each region, at the same
indentation: `__import__('_exercise_probe').enter('ch00.1')`. Graded there, the report says which
exercises' regions each test entered (see `_region_probe`). A region inside a function numba
compiles for the CPU (`@njit`) cannot call Python: its file marks the Python line that launches its
kernels with a `# KERNEL LAUNCH` comment, and the probe line goes there instead (a launch counts as
entering every such region of the file).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
EXERCISE = re.compile(r"^\s*# EXERCISE (?P<id>[\w.-]+): (?P<description>\S.*?)\s*$")
# Comments that look like markers but are not exactly one would silently ship a solution: refuse
# them.
NEAR_MISS = re.compile(r"#+\s*((?i:BEGIN SOLUTION|END SOLUTION)|EXERCISE\b)")
# The top-level module a probe copy adds to its src/. Calling it from an expression statement is
# valid at any indentation and binds no name that the region could shadow or be shadowed by.
PROBE_MODULE = "_exercise_probe"
PROBE_SOURCE = '''"""Written into a probe copy by tools/student.py: each solution region here starts
by calling enter(its exercise id); the grading plugin empties `entered` before each test. With
EXERCISE_PROBE_LOG set (inherited by a chapter's kernel and the processes it starts), each process
also appends every id it enters, once, to that file."""

import os

entered: set[str] = set()
_logged: set[str] = set()


def enter(exercise_id: str) -> None:
    entered.add(exercise_id)
    if exercise_id not in _logged and (log := os.environ.get("EXERCISE_PROBE_LOG")):
        _logged.add(exercise_id)
        with open(log, "a", encoding="utf-8") as file:
            file.write(exercise_id + "\\n")
'''
# Where Python launches a file's CPU-compiled kernels: a probe copy records there the regions
# inside them (`_jitted_regions`).
KERNEL_LAUNCH = re.compile(r"^(?P<indent>\s*)# KERNEL LAUNCH\b")
# In a student copy: the exercises it stubs, one id a line (`--grade` grades these by default).
ASSIGNED = Path("tools") / "assigned_exercises.txt"
# The dependency map, as data: which exercises' regions each chapter and each exercise's tests
# enter. `--deps` prints it; `--deps --refresh` recomputes it in a probe copy (minutes), and
# tests/test_student_mode.py checks its test half against its own grading of a probe copy.
DEPS = Path("tools") / "exercise_deps.json"
# What a stub raises, as pytest prints it; numba's CUDA simulator puts the thread's coordinates
# between the two.
STUB_RAISED = re.compile(r"NotImplementedError: [^\n]*?\bexercise ([\w.-]+):")
# What a student copy holds, when it exists here; everything else (.venv, .git, student/) stays
# behind.
COPIED = (
    "src",
    "tests",
    "chapters",
    "book",
    "tools",
    "benchmarks",
    "pyproject.toml",
    "environment.yml",
    "jupytext.toml",
    "Makefile",
    "README.md",
    "ARCHITECTURE.md",  # test_architecture.py checks it against the package
    "LICENSE",
    ".gitignore",
)
SKIPPED = {
    "__pycache__",
    ".ipynb_checkpoints",
    ".pytest_cache",
    ".hypothesis",
    ".mypy_cache",
    ".ruff_cache",
}


class Exercise(NamedTuple):
    id: str
    path: Path  # relative to the project root when found by find_exercises
    line: int  # 1-based line of the EXERCISE comment
    description: str


class MarkerError(ValueError):
    """A malformed solution region; the message starts with `file:line:`."""


STUB_WIDTH = 100  # the package's line length: a stub shown by show() fits the book's code column


def stub_line(indent: str, message: str) -> str:
    """`raise NotImplementedError(message)` at `indent`, on one line when it fits STUB_WIDTH, else
    with the message as string pieces on lines of their own, cut between words (a stub is shown in
    the student's book, whose code column does not scroll)."""
    one = f"{indent}raise NotImplementedError({json.dumps(message, ensure_ascii=False)})\n"
    if len(one) <= STUB_WIDTH + 1:
        return one
    inner = indent + "    "
    literals, piece = [], ""
    for word in re.findall(r"\S+\s*", message):  # each word keeps the space after it
        literal = json.dumps(piece + word, ensure_ascii=False)
        if piece and len(inner) + len(literal) > STUB_WIDTH:
            literals.append(json.dumps(piece, ensure_ascii=False))
            piece = ""
        piece += word
    literals.append(json.dumps(piece, ensure_ascii=False))
    lines = "".join(f"{inner}{literal}\n" for literal in literals)
    return f"{indent}raise NotImplementedError(\n{lines}{indent})\n"


def stub_source(
    text: str, where: str = "<string>", only: set[str] | None = None, probe: bool = False
) -> tuple[str, list[Exercise]]:
    """`text` with every solution region replaced by its stub, and the exercises it held. With
    `only`, just those exercises are stubbed; the other regions keep their code, unmarked (they are
    the reference the assigned exercises build on). With `probe`, no region is stubbed: each keeps
    its code, unmarked, after a line that tells `PROBE_MODULE` its exercise was entered.

    An EXERCISE comment alone is fine (a student copy keeps them above the stubs); a region is not.
    """
    out: list[str] = []
    found: list[Exercise] = []
    jitted = _jitted_regions(text) if probe else {}  # regions in numba-compiled code, by line
    launches = 0  # KERNEL LAUNCH lines seen
    above: Exercise | None = None  # the EXERCISE comment on the line just above, if any
    opened = 0  # line of the open region's BEGIN, 0 when outside a region
    kept = False  # the open region is not assigned: its lines stay
    for number, line in enumerate(text.splitlines(keepends=True), start=1):
        marker, comment, above = line.strip(), above, None
        if marker == BEGIN:
            if opened:
                raise MarkerError(
                    f"{where}:{number}: nested {BEGIN} (the region at line {opened} is still open)"
                )
            if comment is None:
                raise MarkerError(
                    f"{where}:{number}: {BEGIN} without an '# EXERCISE <id>: <what>' line above it"
                )
            opened, kept = number, probe or (only is not None and comment.id not in only)
            found.append(comment)
            indent = line[: len(line) - len(line.lstrip())]
            if probe and comment.line not in jitted:
                out.append(f"{indent}__import__({PROBE_MODULE!r}).enter({comment.id!r})\n")
            if kept:
                continue
            out.append(stub_line(indent, f"exercise {comment.id}: {comment.description}"))
        elif marker == END:
            if not opened:
                raise MarkerError(f"{where}:{number}: {END} without {BEGIN}")
            opened = 0
        elif opened:
            if kept:
                out.append(line)
            continue  # an assigned exercise's solution lines are dropped
        else:
            if NEAR_MISS.match(marker):
                above = _exercise_comment(line, where, number)
            out.append(line)
            if jitted and (launch := KERNEL_LAUNCH.match(line)):
                launches += 1
                ids = sorted(set(jitted.values()), key=_exercise_order)
                out += [
                    f"{launch['indent']}__import__({PROBE_MODULE!r}).enter({i!r})\n" for i in ids
                ]
    if opened:
        raise MarkerError(f"{where}:{opened}: {BEGIN} without {END}")
    if jitted and not launches:
        raise MarkerError(
            f"{where}:{min(jitted)}: a region inside a numba-compiled function, and no "
            "'# KERNEL LAUNCH' line where Python launches the kernels for the probe to go"
        )
    return "".join(out), found


def _jitted_regions(text: str) -> dict[int, str]:
    """The EXERCISE comments of `text` inside a function numba compiles for the CPU (decorated
    `njit`, `jit`, `numba.njit` or `numba.jit`, called or not), line -> exercise id. `cuda.jit`
    kernels are not among them: graded in the simulator, they run as Python, probe line and all."""
    import ast

    def numba_cpu(decorator: ast.expr) -> bool:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name):
            return target.value.id == "numba" and target.attr in ("njit", "jit")
        return isinstance(target, ast.Name) and target.id in ("njit", "jit")

    spans = [
        (node.lineno, node.end_lineno or node.lineno)
        for node in ast.walk(ast.parse(text))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and any(numba_cpu(d) for d in node.decorator_list)
    ]
    return {
        number: match["id"]
        for number, line in enumerate(text.splitlines(), start=1)
        if (match := EXERCISE.match(line)) and any(a <= number <= b for a, b in spans)
    }


def _exercise_comment(line: str, where: str, number: int) -> Exercise:
    match = EXERCISE.match(line)
    if not match:
        raise MarkerError(
            f"{where}:{number}: malformed marker {line.strip()!r}; "
            f"expected '# EXERCISE <id>: <what>', {BEGIN!r} or {END!r}"
        )
    return Exercise(match["id"], Path(where), number, match["description"])


def package_sources(root: Path) -> list[Path]:
    return sorted(p for p in (root / "src").rglob("*.py") if "__pycache__" not in p.parts)


def find_exercises(root: Path) -> list[Exercise]:
    """Every solution region under `root/src`, in file order; paths relative to `root`."""
    found: list[Exercise] = []
    for path in package_sources(root):
        found += stub_source(path.read_text(encoding="utf-8"), str(path.relative_to(root)))[1]
    return found


def check_destination(root: Path, dest: Path, force: bool) -> None:
    root, dest = root.resolve(), dest.resolve()
    if root.is_relative_to(dest):
        raise SystemExit(
            f"refusing to write the student copy into {dest}: it is (or contains) the repository"
        )
    for name in COPIED:
        if dest.is_relative_to(root / name):
            raise SystemExit(
                f"refusing to write the student copy inside {root / name}: it would copy itself"
            )
    if dest.exists() and any(dest.iterdir()) and not force:
        raise SystemExit(f"{dest} is not empty; pass --force to write over it")


def _ignore(root: Path):
    def ignore(directory: str, names: list[str]) -> set[str]:
        skipped = {n for n in names if n in SKIPPED or n.endswith((".egg-info", ".tmp", ".pyc"))}
        if Path(directory).resolve() == root / "book":  # the HTML book's build outputs
            skipped |= {"_build", "chapters"} & set(names)
        return skipped

    return ignore


def stub_package(dest: Path, only: set[str] | None = None, probe: bool = False) -> list[Exercise]:
    """Replace the solution regions of the copied package (those of `only`, if given; with `probe`,
    put the probe line in front of each), in place; each changed file must still compile. Returns
    the exercises stubbed (probed)."""
    found: list[Exercise] = []
    for path in package_sources(dest):
        where = str(path.relative_to(dest))
        original = path.read_text(encoding="utf-8")
        text, exercises = stub_source(original, where, only, probe)
        if text != original:  # regions stubbed, or (with `only`) markers taken off kept ones
            compile(text, where, "exec")  # a SyntaxError here names the file and line
            path.write_text(text, encoding="utf-8")
        found += [e for e in exercises if only is None or e.id in only]
    return found


def scrub_notebook(path: Path, only: set[str] | None = None) -> bool:
    """Stub the solutions that executed cells displayed (`minivllm.book.show`; those of `only`, if
    given, the others unmarked); True if anything changed."""
    import nbformat
    from IPython.core.formatters import DisplayFormatter

    from minivllm.book import SourceView

    nb, changed = nbformat.read(path, as_version=4), False
    for index, cell in enumerate(nb.cells):
        for output in cell.get("outputs", []):
            where = f"{path.name} cell {index}"
            if output.output_type == "stream" and BEGIN in output.text:
                output.text, changed = stub_source(output.text, where, only)[0], True
            elif BEGIN in output.get("data", {}).get("text/plain", ""):
                # The displayed text has no final newline; the stub line brings one, so add and drop
                # one.
                stubbed = stub_source(output.data["text/plain"] + "\n", where, only)[0][:-1]
                # Rebuild every format (html, latex) the way show() renders it, from the stubbed
                # text.
                output.data, changed = (
                    DisplayFormatter().format(SourceView(stubbed))[0],
                    True,
                )
    if changed:
        nbformat.write(nb, path)
    return changed


def make_student_copy(
    src_root: Path, dest: Path, force: bool = False, only: set[str] | None = None
) -> list[Exercise]:
    """Write the student copy of the project at `src_root` to `dest` with every exercise stubbed, or
    those of `only`; return the exercises stubbed."""
    src_root, dest = src_root.resolve(), dest.resolve()
    check_destination(src_root, dest, force)
    if only is not None:
        known = {e.id for e in find_exercises(src_root)}
        if unknown := sorted(only - known):
            raise SystemExit(
                f"unknown exercise(s) {', '.join(unknown)}; the exercises are "
                f"{', '.join(sorted(known, key=_exercise_order))}"
            )
    _copy_project(src_root, dest, COPIED)
    exercises = stub_package(dest, only)
    for notebook in sorted((dest / "chapters").glob("*.ipynb")):
        scrub_notebook(notebook, only)
    assigned = sorted({e.id for e in exercises}, key=_exercise_order)
    (dest / ASSIGNED).write_text("".join(f"{e}\n" for e in assigned), encoding="utf-8")
    blocks = load_dependency_map(src_root)["blocks"] if (src_root / DEPS).is_file() else None
    chapters = [path.stem for path in sorted((dest / "chapters").glob("[0-9][0-9]_*.py"))]
    (dest / "STUDENT.md").write_text(student_readme(exercises, blocks, chapters), encoding="utf-8")
    return exercises


def _copy_project(src_root: Path, dest: Path, names: tuple[str, ...]) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for name in names:
        source = src_root / name
        if source.is_dir():
            shutil.copytree(source, dest / name, ignore=_ignore(src_root), dirs_exist_ok=True)
        elif source.is_file():
            shutil.copy2(source, dest / name)


def make_probe_copy(
    src_root: Path, dest: Path, force: bool = False, everything: bool = False
) -> list[Exercise]:
    """Write a probe copy of the project at `src_root` to `dest`: only what grading needs (no
    notebooks, no book; with `everything`, what a student copy holds), every region kept and
    probed. Returns the exercises probed."""
    src_root, dest = src_root.resolve(), dest.resolve()
    check_destination(src_root, dest, force)
    names = COPIED if everything else ("src", "tests", "tools", "pyproject.toml")
    _copy_project(src_root, dest, names)
    exercises = stub_package(dest, probe=True)
    (dest / "src" / f"{PROBE_MODULE}.py").write_text(PROBE_SOURCE, encoding="utf-8")
    return exercises


def _exercise_order(exercise_id: str) -> list[int]:
    return [int(n) for n in re.findall(r"\d+", exercise_id)]  # ch01.2 < ch01.10


def build_student_book(dest: Path) -> int:
    """Build the copy's own HTML book (DEST/book/_build/html) from its scrubbed notebooks."""
    return subprocess.run([sys.executable, str(dest / "tools" / "build_book.py")]).returncode


def student_readme(
    exercises: list[Exercise], blocks: dict[str, dict] | None = None, chapters: list[str] = ()
) -> str:
    """STUDENT.md for a copy stubbing `exercises`; `blocks` is the dependency map, `chapters` the
    copy's chapter names (`03_paged_cache`), where each exercise's statement lives."""
    ordered = sorted(exercises, key=lambda e: _exercise_order(e.id))
    by_number = {chapter.split("_", 1)[0]: chapter for chapter in chapters}

    def chapter_of(exercise_id: str) -> str:
        chapter = by_number.get(exercise_id.removeprefix("ch").split(".", 1)[0])
        return f"`chapters/{chapter}.ipynb`" if chapter else "its chapter"

    rows = [
        f"| `{e.id}` | `{e.path.as_posix()}:{e.line}` | {e.description} | {chapter_of(e.id)} |"
        for e in ordered
    ]
    first = ordered[0].id if ordered else "ch00.1"
    assigned = sorted({e.id for e in ordered}, key=_exercise_order)
    lines = [
        "# Student copy",
        "",
        "## Install (once)",
        "",
        "Any Python that `requires-python` in `pyproject.toml` accepts (`python3 --version`):",
        "",
        "```bash",
        "python3 -m venv .venv && . .venv/bin/activate",
        'pip install -e ".[dev]"   # this copy, editable: your edits are what the tests grade',
        "```",
        "",
        "The tests refuse to run if `import minivllm` finds another copy of the package (the "
        "reference, say)",
        "first on the import path; the error names both.",
        "",
        "## Where the exercises are",
        "",
        "Each exercise's full statement and its hints are in the **Exercises** section at the end "
        "of its chapter:",
        "`chapters/NN_*.ipynb` (`jupyter lab chapters`), or the same page of this copy's HTML "
        "book,",
        "`book/_build/html/chapters/NN_*.html`. In the package source, each exercise is a",
        "`raise NotImplementedError(...)` right under an `# EXERCISE` comment that sums it up in "
        "one line;",
        "replace the `raise` with your code.",
        "",
        "## Grade",
        "",
        "```bash",
        f"{'pytest --exercise ' + first:<34}# one exercise's tests (repeat --exercise for more)",
        f"{'python tools/student.py --grade':<34}# one line per assigned exercise: passed,",
        f"{'':<34}# failed (and the first failure) or blocked",
        f"{'python tools/build_book.py':<34}# this copy's HTML book, book/_build/html",
        "```",
        "",
        "The chapters (`chapters/*.ipynb`) call the package, so a cell that needs an unsolved "
        "exercise stops",
        "with `NotImplementedError: exercise <id>: ...` until you solve it; the book shows the "
        "stored outputs.",
        "",
        "| exercise | where | what to implement | statement and hints |",
        "|---|---|---|---|",
        *rows,
        "",
    ]
    if blocks is not None:
        lines += [
            "## Which exercise blocks what",
            "",
            "<!-- generated by tools/student.py from tools/exercise_deps.json -->",
            "The engine calls some exercises' code, so until such an exercise is solved, other "
            "exercises' tests",
            "and the chapters' cells that reach it stop at its `NotImplementedError`; "
            "`--grade` reports those",
            "tests as *blocked by* it. Solve the blocking ones first.",
            "",
            dependency_table(blocks, assigned),
            "",
            "`python tools/student.py --deps` prints the map for every exercise of the book.",
            "",
        ]
    return "\n".join(lines)


class _Recorder:
    """A pytest plugin: which exercises each selected test grades, and how it ended."""

    def __init__(self) -> None:
        self.tests: dict[str, dict] = {}

    def pytest_collection_finish(self, session) -> None:
        for item in session.items:
            ids = sorted({m.args[0] for m in item.iter_markers("exercise") if m.args})
            self.tests[item.nodeid] = {"exercises": ids, "outcome": "not run", "message": ""}

    def pytest_runtest_logreport(self, report) -> None:
        test = self.tests.get(report.nodeid)
        if test is None or test["outcome"] == "failed" or (report.when != "call" and report.passed):
            return
        test["outcome"] = report.outcome
        test["message"] = report.longreprtext[-2000:] if report.failed else ""
        if report.failed:
            stubs = STUB_RAISED.findall(report.longreprtext)
            test["stub"] = stubs[-1] if stubs else ""  # the exercise whose stub stopped it
            crash = getattr(report.longrepr, "reprcrash", None)
            summary = crash.message if crash else report.longreprtext.strip()[-300:]
            test["summary"] = re.sub(r"^\S+:\d+: ", "", summary)  # no file:line in front


def _region_probe(recorder: _Recorder, probe):
    """A pytest plugin for a probe copy (`probe` is its PROBE_MODULE): for each test, the exercises
    whose regions it entered, in `recorder.tests[nodeid]["entered"]`. That counts its own setup,
    call and teardown, and also the setup of any broader-scoped fixture it uses: that fixture ran
    once, in some earlier test's window, yet a stub entered there would fail every test using it."""
    import pytest

    class RegionProbe:
        def __init__(self) -> None:
            self.by_fixture: dict = {}  # FixtureDef (scope above function) -> exercises entered

        @pytest.hookimpl(wrapper=True)
        def pytest_fixture_setup(self, fixturedef, request):
            outer, probe.entered = probe.entered, set()
            try:
                return (yield)
            finally:
                own = probe.entered
                probe.entered = outer | own
                if fixturedef.scope != "function":  # a function-scoped one is in its test's window
                    self.by_fixture.setdefault(fixturedef, set()).update(own)

        @pytest.hookimpl(wrapper=True)
        def pytest_runtest_protocol(self, item, nextitem):
            probe.entered = set()
            try:
                return (yield)
            finally:
                entered = set(probe.entered)
                definitions = item._fixtureinfo.name2fixturedefs
                for name in item.fixturenames:
                    for fixturedef in definitions.get(name, ()):
                        entered |= self.by_fixture.get(fixturedef, set())
                if item.nodeid in recorder.tests:
                    recorder.tests[item.nodeid]["entered"] = sorted(entered)

    return RegionProbe()


def grade(root: Path, extra: list[str], exercises: list[str] | None = None) -> dict:
    """Run the exercise tests of the project at `root` in this process (those of `exercises`, if
    given), quietly: the report, not pytest's tracebacks, is the output. In a probe copy each
    test's record also lists the exercises whose regions it `entered`."""
    import importlib

    import pytest

    recorder = _Recorder()
    plugins: list = [recorder]
    if (root / "src" / f"{PROBE_MODULE}.py").is_file():
        plugins.append(_region_probe(recorder, importlib.import_module(PROBE_MODULE)))
    # Collect only the test files that use the marker (for `exercises`, with one of their ids):
    # importing every test module costs minutes.
    marked = {
        path: path.read_text(encoding="utf-8")
        for path in sorted((root / "tests").rglob("test_*.py"))
        if "mark.exercise(" in path.read_text(encoding="utf-8")
    }
    chosen = {
        path
        for path, text in marked.items()
        for exercise in exercises or ()
        if f'exercise("{exercise}")' in text or f"exercise('{exercise}')" in text
    }
    # an id marked some other way (a variable) is found by collecting every marked file
    found_all = all(
        any(f'exercise("{e}")' in marked[p] or f"exercise('{e}')" in marked[p] for p in chosen)
        for e in exercises or ()
    )
    files = [str(path) for path in (sorted(chosen) if exercises and found_all else marked)]
    args = [
        *(files or [str(root / "tests")]),
        "-m",
        "exercise",
        *(f"--exercise={exercise}" for exercise in exercises or ()),
        # progress dots and one count line: the per-exercise report says what failed, and why
        "-q",
        "--no-header",
        "--tb=no",
        "-rN",
        "--disable-warnings",
        "-p",
        "no:cacheprovider",
        *extra,
    ]
    exit_code = pytest.main(args, plugins=plugins)
    # Which copy of each package under src/ the tests really imported (PYTHONPATH or an installed
    # one).
    names = [init.parent.name for init in (root / "src").glob("*/__init__.py")]
    packages = {
        name: str(Path(sys.modules[name].__file__).resolve())
        for name in names
        if name in sys.modules
    }
    return {"exit_code": int(exit_code), "tests": recorder.tests, "packages": packages}


class Result(NamedTuple):
    exercise: str
    status: str  # passed, failed (on its own code), blocked (on other exercises' stubs)
    passed: int  # tests passed ...
    tests: int  # ... of the tests marked with the exercise
    detail: str  # the first failure's test and message, or the blockers


# How tests/conftest.py ends a repeated stub failure (every one after the first in a run).
SAME_STUB = ": the same stub as above"


def exercise_results(report: dict, exercises: list[str] | None = None) -> list[Result]:
    """One result per exercise (those of `exercises`, if given). A test that stops at the stub of
    another exercise is blocked, not failed: it cannot pass until that one is solved."""
    by_exercise: dict[str, list[tuple[str, dict]]] = {e: [] for e in exercises or ()}
    for nodeid, test in report["tests"].items():
        for exercise in test["exercises"]:
            if exercises is None or exercise in exercises:
                by_exercise.setdefault(exercise, []).append((nodeid, test))
    # conftest.py shortens every repeat of a stub's failure to "the same stub as above"; a grade
    # line shows one failure alone, so it gets the stub's whole message back from its first failure
    whole = {}
    for test in report["tests"].values():
        summary = test.get("summary", "")
        if test.get("stub") and not summary.endswith(SAME_STUB):
            whole.setdefault(test["stub"], summary)
    results = []
    for exercise in sorted(by_exercise, key=_exercise_order):
        tests = by_exercise[exercise]
        passed = sum(test["outcome"] == "passed" for _, test in tests)
        failed = [(nodeid, test) for nodeid, test in tests if test["outcome"] == "failed"]
        # failed on another exercise's stub, else on its own code (or its own stub)
        stopped = [(n, t) for n, t in failed if t.get("stub") and t["stub"] != exercise]
        own = [(n, t) for n, t in failed if (n, t) not in stopped]
        blockers = sorted({t["stub"] for _, t in stopped}, key=_exercise_order)
        first_own = ""
        if own:
            nodeid, test = own[0]
            summary = test.get("summary", "")
            if summary.endswith(SAME_STUB):
                summary = whole.get(test.get("stub"), summary)
            first_own = f"{nodeid.rsplit('/', 1)[-1]}: {_one_line(summary)}"
        if blockers:  # its grade is not final until they are solved
            status = "blocked"
            stubs = "its stub" if len(blockers) == 1 else "their stubs"
            detail = f"by {', '.join(blockers)} ({len(stopped)} tests stop at {stubs})"
            if own:
                detail += f"; {len(own)} fail on its own, first {first_own}"
        elif own:
            status, detail = "failed", first_own
        elif not tests:
            status, detail = "failed", "no test is marked with this exercise"
        else:
            skipped = len(tests) - passed
            status, detail = "passed", f"{skipped} skipped" if skipped else ""
        results.append(Result(exercise, status, passed, len(tests), detail))
    return results


def _one_line(message: str, width: int = 100) -> str:
    """The first line of `message`, cut at a word boundary with an ellipsis past `width`."""
    line = message.strip().splitlines()[0] if message.strip() else "(no message)"
    if len(line) <= width:
        return line
    return line[:width].rsplit(" ", 1)[0] + " …"


def grade_table(results: list[Result]) -> str:
    rows = [
        f"{r.exercise:<8} {r.status:<8} {r.passed:>3}/{r.tests:<3} points  {r.detail}".rstrip()
        for r in results
    ]
    counts = {s: sum(r.status == s for r in results) for s in ("passed", "failed", "blocked")}
    rows.append(f"{len(results)} exercise(s): " + ", ".join(f"{n} {s}" for s, n in counts.items()))
    return "\n".join(rows)


def assigned_exercises(root: Path) -> list[str] | None:
    """The exercises a student copy at `root` stubs (None elsewhere: grade them all)."""
    path = root / ASSIGNED
    if not path.is_file():
        return None
    return [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def dependency_map(tests: dict, chapters: dict[str, list[str]]) -> dict[str, dict]:
    """For each exercise: the other exercises whose tests enter its regions (`tests`: a probe
    copy's graded tests), and the chapters whose execution does (`chapters`: chapter -> the
    exercises it entered). Stubbing it stops those tests and those chapters' cells."""
    ids = {e for test in tests.values() for e in test["exercises"]}
    ids |= {e for test in tests.values() for e in test["entered"]}
    ids |= {e for entered in chapters.values() for e in entered}
    blocks: dict[str, dict] = {e: {"exercises": set(), "chapters": set()} for e in ids}
    for test in tests.values():
        for entered in test["entered"]:
            blocks[entered]["exercises"] |= set(test["exercises"]) - {entered}
    for chapter, entered in chapters.items():
        for exercise in entered:
            blocks[exercise]["chapters"].add(chapter)
    return {
        e: {
            "exercises": sorted(blocks[e]["exercises"], key=_exercise_order),
            "chapters": sorted(blocks[e]["chapters"]),
        }
        for e in sorted(ids, key=_exercise_order)
    }


def load_dependency_map(root: Path = ROOT) -> dict:
    return json.loads((root / DEPS).read_text(encoding="utf-8"))


def _chapter_numbers(chapters: list[str]) -> str:
    """['03_paged_cache', '04_engine', '05_x', '08_y'] -> '03-05, 08' (runs joined by a dash)."""
    numbers = sorted(int(c.split("_", 1)[0]) for c in chapters)
    runs: list[list[int]] = []
    for n in numbers:
        if runs and n == runs[-1][-1] + 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    return ", ".join(f"{r[0]:02d}" if len(r) == 1 else f"{r[0]:02d}–{r[-1]:02d}" for r in runs)


def dependency_table(blocks: dict[str, dict], only: list[str] | None = None) -> str:
    """The map as a markdown table, one row per exercise (those of `only`, if given)."""
    rows = [
        "| exercise | stubbed, it stops the tests of | and cells of the chapters |",
        "|---|---|---|",
    ]
    for exercise, blocked in blocks.items():
        if only is None or exercise in only:
            others = ", ".join(blocked["exercises"]) or "none"
            rows.append(
                f"| `{exercise}` | {others} | {_chapter_numbers(blocked['chapters']) or 'none'} |"
            )
    return "\n".join(rows)


# The CPU attention kernels numba compiles (`cache=True`). Copies that keep their exercise's
# solution hold them unchanged (see `seed_kernel_cache`), and may load what the reference compiled
# instead of compiling them again.
KERNELS = Path("src") / "minivllm" / "attention" / "numba_cpu.py"


def _compiled_code(text: str) -> list[str]:
    """`text` without solution markers and probe lines: what a copy keeping every solution
    compiles."""
    probe_line = f"__import__({PROBE_MODULE!r}).enter("
    return [
        line
        for line in text.splitlines()
        if line.strip() not in (BEGIN, END) and not line.strip().startswith(probe_line)
    ]


def seed_kernel_cache(root: Path, project: Path, cache_dir: Path) -> bool:
    """Put the reference's compiled CPU kernels where numba, run in `project` with
    NUMBA_CACHE_DIR=`cache_dir`, looks for them (compiling them here first if needed: what
    the engine does when it starts). A minute of compiling saved per graded copy. False, and
    nothing put, if the copy's kernels differ from the reference's (a stubbed exercise there).

    numba finds a function's cache files by its name and line, and trusts them while the source
    file's stamp (numba 0.68: the SHA-256 of its bytes) is the one they were saved with. A copy
    that only took solution markers out, or put probe lines in, compiles the same code: its index
    files get the copy's stamp. That holds while the markers' removal moves no compiled function to
    another line, which numba_cpu.py keeps by having its region in its last compiled function; if
    it did move one, numba would find no cache file for it and compile it, as without the seed."""
    source, copied = root / KERNELS, project / KERNELS
    if not copied.is_file():
        return False
    reference, copy = (path.read_text(encoding="utf-8") for path in (source, copied))
    if copy != reference and _compiled_code(copy) != _compiled_code(reference):
        return False
    import hashlib
    import pickle

    from numba.core import caching, config, serialize

    from minivllm.attention import numba_cpu

    numba_cpu.warm_up()
    numba_cpu.warm_up(threads=1)  # the serial kernel, which one-thread engines use
    where = caching.UserProvidedCacheLocator.get_suitable_cache_subpath
    compiled = (
        Path(config.CACHE_DIR) / where(str(source))
        if config.CACHE_DIR
        else source.parent / "__pycache__"
    )
    target = cache_dir / where(str(copied.resolve()))
    target.mkdir(parents=True, exist_ok=True)
    # An index file: numba's version, pickled, then (source stamp, overloads) pickled; the stamp
    # says which version of the source it was compiled from (older ones may linger).
    current, stamp = (hashlib.sha256(path.read_bytes()).digest() for path in (source, copied))
    seeded = False
    for path in compiled.glob(f"{source.stem}.*.nbi"):
        with path.open("rb") as index:
            version, (saved, overloads) = pickle.load(index), pickle.loads(index.read())
        if saved != current:
            continue
        for data in {*overloads.values()}:  # the compiled code, one file per signature
            shutil.copy2(path.parent / data, target / data)
        with (target / path.name).open("wb") as index:  # as `IndexDataCacheFile._save_index`
            pickle.dump(version, index, protocol=-1)
            index.write(serialize.dumps((stamp, overloads)))
        seeded = True
    return seeded  # False: no index of this source's stamp (numba's stamp is not a SHA-256)


def chapters_entered(blocks: dict[str, dict]) -> dict[str, list[str]]:
    """The chapter half of a map turned around: chapter -> the exercises its execution entered."""
    entered: dict[str, set[str]] = {}
    for exercise, blocked in blocks.items():
        for chapter in blocked["chapters"]:
            entered.setdefault(chapter, set()).add(exercise)
    return {chapter: sorted(ids, key=_exercise_order) for chapter, ids in entered.items()}


def refresh_dependency_map(
    root: Path, work: Path, only: list[str] | None = None, previous: dict | None = None
) -> dict:
    """Recompute the map in a probe copy under `work`: grade every exercise test there (in order,
    so a value one test memoizes for the next is counted the same way each time), then execute
    each chapter with the probe logging what its kernel, and any process it starts, entered.
    With `only` (chapter stems), execute just those and keep the other chapters' entries, and
    the commit each was computed at, from `previous` (the committed map)."""
    probe, commit = work / "probe", _head_commit(root)  # what the copy is made from
    present = sorted(path.stem for path in (root / "chapters").glob("[0-9][0-9]_*.py"))
    kept: dict[str, list[str]] = {}
    kept_commits: dict[str, str] = {}
    if only is not None:
        unknown = sorted(set(only) - set(present))
        if unknown:
            raise SystemExit(f"no such chapter: {', '.join(unknown)} (chapters: {present})")
        previous = previous or {"blocks": {}, "chapters_run": [], "commit": "unknown"}
        before = chapters_entered(previous["blocks"])
        missing = sorted(set(present) - set(only) - set(previous["chapters_run"]))
        if missing:
            raise SystemExit(f"the committed map never ran {missing}: name them in --chapters too")
        for chapter in set(present) - set(only):
            kept[chapter] = before.get(chapter, [])
            kept_commits[chapter] = previous.get("chapter_commits", {}).get(
                chapter, previous["commit"]
            )
    make_probe_copy(root, probe, everything=True)
    seed_kernel_cache(root, probe, work / "numba-cache")
    env = {
        **os.environ,
        "PYTHONPATH": str(probe / "src"),
        "PYTHONDONTWRITEBYTECODE": "1",
        "NUMBA_CACHE_DIR": str(work / "numba-cache"),
        # a probe line is Python: on a GPU numba would refuse to compile a kernel holding one
        "NUMBA_ENABLE_CUDASIM": "1",
    }
    report_path = work / "probe.json"
    command = [sys.executable, "tools/student.py", "--grade", "--json", str(report_path)]
    subprocess.run([*command, "-pno:randomly"], cwd=probe, env=env, check=False)
    tests = json.loads(report_path.read_text(encoding="utf-8"))["tests"]
    failed = [n for n, t in tests.items() if t["outcome"] not in ("passed", "skipped")]
    if failed or not tests:
        raise SystemExit(f"the probe copy did not pass its exercise tests: {failed or 'none ran'}")
    chapters = dict(kept)
    for chapter in sorted((probe / "chapters").glob("[0-9][0-9]_*.py")):
        if chapter.stem in kept:
            continue
        log = work / f"{chapter.stem}.log"
        log.write_text("", encoding="utf-8")
        print(f"executing {chapter.name} in the probe copy", flush=True)
        subprocess.run(
            [sys.executable, "tools/notebooks.py", "execute", str(chapter)],
            cwd=probe,
            env={**env, "EXERCISE_PROBE_LOG": str(log)},
            check=True,
        )
        chapters[chapter.stem] = sorted(set(log.read_text(encoding="utf-8").split()))
    return {
        "regenerate": "python tools/student.py --deps --refresh",
        # the test half and every chapter executed in this run; a chapter kept from an earlier map
        # (--chapters) says its own commit in chapter_commits
        "commit": commit,
        "chapters_run": sorted(chapters),
        "chapter_commits": {c: kept_commits.get(c, commit) for c in sorted(chapters)},
        "blocks": dependency_map(tests, chapters),
    }


def _head_commit(root: Path) -> str:
    done = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=False
    )
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "src", "chapters", "tests"],
        cwd=root,
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    return done.stdout.strip() + (" with uncommitted changes" if dirty else "") or "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("dest", nargs="?", type=Path, help="where to write the student copy")
    parser.add_argument("--force", action="store_true", help="write into a non-empty DEST")
    parser.add_argument(
        "--exercises",
        help="comma-separated ids (e.g. ch03.1,ch05.2) to stub; the default is every exercise. "
        "With --grade: the exercises to grade (default: a student copy's assigned ones, else all)",
    )
    parser.add_argument(
        "--book", action="store_true", help="also build the copy's HTML book, without solutions"
    )
    parser.add_argument(
        "--probe",
        action="store_true",
        help="write a probe copy to DEST instead: every solution kept, each region recording that "
        "a test entered it (graded, the report lists them per test)",
    )
    parser.add_argument(
        "--grade",
        action="store_true",
        help="run the exercise tests here; one line per exercise: passed, failed or blocked",
    )
    parser.add_argument(
        "--json", type=Path, help="with --grade: also write the full report to this file"
    )
    parser.add_argument(
        "--deps",
        action="store_true",
        help=f"print which exercises block which chapters and other exercises' tests ({DEPS})",
    )
    parser.add_argument(
        "--refresh",
        action="store_true",
        help=f"with --deps: recompute {DEPS} in a probe copy (grades it, runs every chapter)",
    )
    parser.add_argument(
        "--chapters",
        nargs="+",
        metavar="STEM",
        help="with --deps --refresh: execute only these chapters (e.g. 07_cpu_kernel) and keep "
        f"the others' entries, with the commit each was computed at, from the committed {DEPS}",
    )
    args, extra = parser.parse_known_args(argv)
    only = set(filter(None, args.exercises.split(","))) if args.exercises else None
    if args.grade:
        chosen = sorted(only, key=_exercise_order) if only else assigned_exercises(ROOT)
        report = grade(ROOT, extra, chosen)
        if args.json:
            args.json.write_text(json.dumps(report, indent=1), encoding="utf-8")
        print(grade_table(exercise_results(report, chosen)))
        return report["exit_code"]
    if args.deps:
        if args.refresh:
            import tempfile

            previous = load_dependency_map() if args.chapters else None
            with tempfile.TemporaryDirectory(prefix="minivllm-deps-") as work:
                data = refresh_dependency_map(ROOT, Path(work), args.chapters, previous)
            (ROOT / DEPS).write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
            print(f"wrote {DEPS}")
        data = load_dependency_map()
        print(dependency_table(data["blocks"], sorted(only) if only else None))
        print(f"(computed at {data['commit']}; `{data['regenerate']}` recomputes it)")
        older = {c: at for c, at in data.get("chapter_commits", {}).items() if at != data["commit"]}
        for chapter, at in older.items():
            print(f"  ({chapter}: its chapter entries computed at {at})")
        return 0
    if args.chapters:
        parser.error("--chapters goes with --deps --refresh")
    if args.dest is None or extra:
        parser.error("give DEST (and nothing else), --grade or --deps")
    if args.probe and (args.exercises or args.book):
        parser.error("--probe keeps every exercise and writes no book")
    try:
        if args.probe:
            exercises = make_probe_copy(ROOT, args.dest, args.force)
            print(f"wrote a probe copy to {args.dest.resolve()}: {len(exercises)} regions probed")
            return 0
        exercises = make_student_copy(ROOT, args.dest, args.force, only)
    except MarkerError as error:
        raise SystemExit(f"error: {error}") from None
    print(
        f"wrote a student copy to {args.dest.resolve()}: {len(exercises)} solution regions stubbed"
    )
    for exercise in exercises:
        print(
            f"  {exercise.id:<8} {exercise.path.as_posix()}:{exercise.line}  {exercise.description}"
        )
    print(f"see {args.dest / 'STUDENT.md'}")
    return build_student_book(args.dest.resolve()) if args.book else 0


if __name__ == "__main__":
    sys.exit(main())
