"""Shared test setup.

`pytest --exercise ch01.1` runs only the tests that grade one exercise (repeat the option for more).
`one_torch_thread` (module scope) runs a test module's torch work on one thread, and `target` loads
the shipped model once per module.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


def pytest_configure(config: pytest.Config) -> None:
    """Refuse to test a `minivllm` other than this project's own: in a student copy, a reference
    package found first on the import path would be graded instead of the student's code."""
    own = Path(__file__).resolve().parents[1] / "src" / "minivllm"
    if not own.is_dir():  # a project without the package (test_student_mode's toy project)
        return
    spec = importlib.util.find_spec("minivllm")
    found = Path(spec.origin).parent.resolve() if spec and spec.origin else None
    if found != own:
        raise pytest.UsageError(
            f"these tests belong to the package in {own}, but `import minivllm` finds {found}. "
            f"Install this copy (`pip install -e .` here, in its own virtualenv) or run with "
            f"PYTHONPATH={own.parent}."
        )


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--exercise",
        action="append",
        default=[],
        metavar="ID",
        help="run only the tests marked exercise(ID); may be given more than once",
    )


def exercise_ids(item: pytest.Item) -> set[str]:
    return {mark.args[0] for mark in item.iter_markers("exercise") if mark.args}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    wanted = set(config.getoption("exercise"))
    if not wanted:
        return
    carried = set().union(*(exercise_ids(item) for item in items))
    # A typo would otherwise select nothing and "pass"; say so instead.
    if unknown := wanted - carried:
        raise pytest.UsageError(
            f"no collected test is marked exercise({', '.join(sorted(unknown))}); "
            f"collected exercises: {', '.join(sorted(carried)) or 'none'}"
        )
    kept = [item for item in items if exercise_ids(item) & wanted]
    config.hook.pytest_deselected(items=[item for item in items if not exercise_ids(item) & wanted])
    items[:] = kept


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for the module: on a small shared machine two BLAS threads can make a small
    matmul hundreds of times slower, and the engine's steps are many small matmuls."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def target():
    from minivllm.model.checkpoint import load_model

    return load_model("target")
