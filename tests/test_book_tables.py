"""The book's styled tables (minivllm.book.tables): cells that never run together, in HTML and in
plain text."""

from __future__ import annotations

import re

import pytest

from minivllm.book.tables import Table


def scoreboard_like() -> Table:
    return Table(
        ["layer", "speed-up", "tokens identical"],
        [["naive", "1.0×", "yes"], ["continuous batching", "0.67×", "no: 1 of 256 differ"]],
        right={1},
        caption="recorded at commit abc",
    )


def test_the_html_pads_every_cell_and_aligns_numbers_right() -> None:
    html = scoreboard_like()._repr_html_()
    cells = re.findall(r"<t[hd] style=\"([^\"]*)\">([^<]*)</t[hd]>", html)
    assert len(cells) == 9
    assert all("padding" in style for style, _ in cells)
    aligned = {text: "text-align: right" in style for style, text in cells}
    assert aligned["0.67×"] and aligned["speed-up"] and not aligned["yes"]
    assert html.count('style="background') == 1  # the second row is striped
    assert "<caption" in html and "http" not in html  # nothing to load


def test_the_text_twin_keeps_columns_apart() -> None:
    lines = repr(scoreboard_like()).splitlines()
    assert lines[0].split("  ")[0] == "layer"
    assert "0.67×  no: 1 of 256 differ" in lines[3]  # never "0.67×no"
    assert lines[-1] == "recorded at commit abc"
    assert len(lines[1]) == max(len(line) for line in lines[2:-1])  # the rule spans the table


def test_cells_are_escaped_and_rows_must_match_the_header() -> None:
    assert "&lt;b&gt;" in Table(["x"], [["<b>"]])._repr_html_()
    with pytest.raises(ValueError):
        Table(["a", "b"], [["only one"]])
