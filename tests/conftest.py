"""`pytest --exercise ch01.1`: run only the tests that grade one exercise (repeat the option for more)."""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--exercise", action="append", default=[], metavar="ID",
                     help="run only the tests marked exercise(ID); may be given more than once")


def exercise_ids(item: pytest.Item) -> set[str]:
    return {mark.args[0] for mark in item.iter_markers("exercise") if mark.args}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    wanted = set(config.getoption("exercise"))
    if not wanted:
        return
    carried = set().union(*(exercise_ids(item) for item in items))
    # A typo would otherwise select nothing and "pass"; say so instead.
    if unknown := wanted - carried:
        raise pytest.UsageError(f"no collected test is marked exercise({', '.join(sorted(unknown))}); "
                                f"collected exercises: {', '.join(sorted(carried)) or 'none'}")
    kept = [item for item in items if exercise_ids(item) & wanted]
    config.hook.pytest_deselected(items=[item for item in items if not exercise_ids(item) & wanted])
    items[:] = kept
