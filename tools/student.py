"""Course mode: write a student copy of the book with every exercise's solution stubbed out.

    python tools/student.py DEST [--force] [--exercises ch03.1,ch05.2] [--book]
        write the student copy to DEST (`make student DEST=dir [EXERCISES=...]`)
    python tools/student.py DEST --probe
        write a probe copy: every solution kept, each region recording that it was entered
    python tools/student.py --grade [--json F]
        run the exercise tests here; a pass/fail table per exercise

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
exercises' regions each test entered (see `_region_probe`).
"""

from __future__ import annotations

import argparse
import json
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
by calling enter(its exercise id); the grading plugin empties `entered` before each test."""

entered: set[str] = set()


def enter(exercise_id: str) -> None:
    entered.add(exercise_id)
'''
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
            if probe:
                out.append(f"{indent}__import__({PROBE_MODULE!r}).enter({comment.id!r})\n")
            if kept:
                continue
            message = json.dumps(
                f"exercise {comment.id}: {comment.description}", ensure_ascii=False
            )
            out.append(f"{indent}raise NotImplementedError({message})\n")
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
    if opened:
        raise MarkerError(f"{where}:{opened}: {BEGIN} without {END}")
    return "".join(out), found


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
    (dest / "STUDENT.md").write_text(student_readme(exercises), encoding="utf-8")
    return exercises


def _copy_project(src_root: Path, dest: Path, names: tuple[str, ...]) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for name in names:
        source = src_root / name
        if source.is_dir():
            shutil.copytree(source, dest / name, ignore=_ignore(src_root), dirs_exist_ok=True)
        elif source.is_file():
            shutil.copy2(source, dest / name)


def make_probe_copy(src_root: Path, dest: Path, force: bool = False) -> list[Exercise]:
    """Write a probe copy of the project at `src_root` to `dest`: only what grading needs (no
    notebooks, no book), every region kept and probed. Returns the exercises probed."""
    src_root, dest = src_root.resolve(), dest.resolve()
    check_destination(src_root, dest, force)
    _copy_project(src_root, dest, ("src", "tests", "tools", "pyproject.toml"))
    exercises = stub_package(dest, probe=True)
    (dest / "src" / f"{PROBE_MODULE}.py").write_text(PROBE_SOURCE, encoding="utf-8")
    return exercises


def _exercise_order(exercise_id: str) -> list[int]:
    return [int(n) for n in re.findall(r"\d+", exercise_id)]  # ch01.2 < ch01.10


def build_student_book(dest: Path) -> int:
    """Build the copy's own HTML book (DEST/book/_build/html) from its scrubbed notebooks."""
    return subprocess.run([sys.executable, str(dest / "tools" / "build_book.py")]).returncode


def student_readme(exercises: list[Exercise]) -> str:
    ordered = sorted(exercises, key=lambda e: _exercise_order(e.id))
    rows = [f"| `{e.id}` | `{e.path.as_posix()}:{e.line}` | {e.description} |" for e in ordered]
    first = ordered[0].id if ordered else "ch00.1"
    return "\n".join(
        [
            "# Student copy",
            "",
            "## Install (once)",
            "",
            "```bash",
            "python3.11 -m venv .venv && . .venv/bin/activate",
            'pip install -e ".[dev]"   # this copy, editable: your edits are what the tests grade',
            "```",
            "",
            "The tests refuse to run if `import minivllm` finds another copy of the package (the "
            "reference, say)",
            "first on the import path; the error names both.",
            "",
            "## Work and grade",
            "",
            "Each exercise below is a `raise NotImplementedError(...)` in the package source, "
            "right under its",
            "`# EXERCISE` comment. Replace the `raise` with your code, then run that exercise's "
            "tests:",
            "",
            "```bash",
            f"{'pytest --exercise ' + first:<34}# one exercise (repeat --exercise for more)",
            f"{'pytest -m exercise':<34}# every exercise's tests",
            f"{'python tools/student.py --grade':<34}# a pass/fail table per exercise",
            f"{'python tools/build_book.py':<34}# this copy's HTML book, book/_build/html",
            "```",
            "",
            "The chapters (`chapters/*.ipynb`) call the package, so a cell that needs an unsolved "
            "exercise stops",
            "with `NotImplementedError: exercise <id>: ...` until you solve it; the book shows the "
            "stored outputs.",
            "",
            "| exercise | where | what to implement |",
            "|---|---|---|",
            *rows,
            "",
        ]
    )


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


def grade(root: Path, extra: list[str]) -> dict:
    """Run the exercise tests of the project at `root` in this process. In a probe copy each test's
    record also lists the exercises whose regions it `entered`."""
    import importlib

    import pytest

    recorder = _Recorder()
    plugins: list = [recorder]
    if (root / "src" / f"{PROBE_MODULE}.py").is_file():
        plugins.append(_region_probe(recorder, importlib.import_module(PROBE_MODULE)))
    # Collect only the test files that use the marker: importing every test module costs minutes.
    files = [
        str(path)
        for path in sorted((root / "tests").rglob("test_*.py"))
        if "mark.exercise(" in path.read_text()
    ]
    args = [
        *(files or [str(root / "tests")]),
        "-m",
        "exercise",
        "-q",
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


def grade_table(report: dict) -> str:
    per_exercise: dict[str, list[str]] = {}
    for test in report["tests"].values():
        for exercise in test["exercises"]:
            per_exercise.setdefault(exercise, []).append(test["outcome"])
    return "\n".join(
        f"{exercise:<10} {outcomes.count('passed')}/{len(outcomes)} tests passed"
        for exercise, outcomes in sorted(per_exercise.items())
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("dest", nargs="?", type=Path, help="where to write the student copy")
    parser.add_argument("--force", action="store_true", help="write into a non-empty DEST")
    parser.add_argument(
        "--exercises",
        help="comma-separated ids (e.g. ch03.1,ch05.2) to stub; the default is every exercise",
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
        "--grade", action="store_true", help="run the exercise tests here and report per exercise"
    )
    parser.add_argument(
        "--json", type=Path, help="with --grade: also write the full report to this file"
    )
    args, extra = parser.parse_known_args(argv)
    if args.grade:
        report = grade(ROOT, extra)
        print(grade_table(report))
        if args.json:
            args.json.write_text(json.dumps(report, indent=1), encoding="utf-8")
        return report["exit_code"]
    if args.dest is None or extra:
        parser.error("give DEST (and nothing else), or --grade")
    if args.probe and (args.exercises or args.book):
        parser.error("--probe keeps every exercise and writes no book")
    try:
        if args.probe:
            exercises = make_probe_copy(ROOT, args.dest, args.force)
            print(f"wrote a probe copy to {args.dest.resolve()}: {len(exercises)} regions probed")
            return 0
        only = set(filter(None, args.exercises.split(","))) if args.exercises else None
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
