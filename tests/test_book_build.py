"""The book's build: the listing-width check (tools/listing_widths.py) and the capacity it derives
from the book's stylesheet, executing chapters into the build instead of over the committed
notebooks, and the commands the README and `make help` promise."""

from __future__ import annotations

import os
import re
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT / "tools"))  # tools/listing_widths.py, a script beside the build's
import listing_widths as widths  # noqa: E402

PAGE = """<html><body><div class="cell docutils container">
<div class="cell_input docutils container"><div class="highlight"><pre><span></span>
<span class="n">x</span> <span class="o">=</span> <span class="s2">&quot;{code}&quot;</span>
</pre></div></div>
<div class="cell_output docutils container"><div class="output text_html">
<div class="minivllm-source"><div class="highlight"><pre><span class="k">def</span> f():
    return &lt;{listing}&gt;
</pre></div>
<details class="minivllm-solution"><summary>Solution</summary><div class="highlight">
<pre>    <span class="k">pass</span>  # {solution}
</pre></div></details></div></div>
<div class="output stream highlight-myst-ansi"><pre>{output}
second line</pre></div></div></div>
<p>prose</p><pre>{prose}</pre></body></html>"""


def test_the_collector_measures_each_pre_by_its_kind_and_decoded_text() -> None:
    page = PAGE.format(
        code="c" * 90, listing="L" * 95, solution="s" * 100, output="o" * 300, prose="p" * 7
    )
    found = widths.pres(page)
    assert [(pre.kind, pre.width) for pre in found] == [
        ("code", len('x = "' + "c" * 90 + '"')),
        ("listing", len("    return <" + "L" * 95 + ">")),  # entities count as one character
        ("listing", len("    pass  # " + "s" * 100)),  # a folded solution is a listing too
        ("output", 300),
        ("prose", 7),
    ]


def test_a_listing_wider_than_the_column_is_reported_and_nothing_else_is() -> None:
    page = PAGE.format(
        code="c" * 200, listing="L" * 50, solution="s" * 10, output="o" * 300, prose="p" * 200
    )
    pages = {"chapters/x.html": widths.pres(page)}
    assert widths.too_wide(pages, capacity=100) == []  # long code, output and prose wrap
    page = PAGE.format(code="c", listing="L" * 120, solution="s", output="o", prose="p")
    (problem,) = widths.too_wide({"chapters/x.html": widths.pres(page)}, capacity=100)
    assert problem.startswith("chapters/x.html: a listing line of 133 characters (the column holds")
    assert widths.too_wide({"x": widths.pres(page)}, capacity=133) == []


def test_the_capacity_follows_the_stylesheet() -> None:
    css = """:root { --minivllm-primary-width: 15rem; --minivllm-secondary-width: 12rem;
      --minivllm-article-padding: 1rem; --minivllm-code-padding: 0.5rem;
      --minivllm-code-font: 0.75rem; }"""
    # 1280 - 16 (scrollbar) - 240 - 192 - 2 x 16 = 800 px of column; 784 inside the padding;
    # a glyph of 12 px type is 7.2 px wide: 108 characters (Chromium measured 785 px, 108).
    assert widths.column_capacity(css) == 108
    assert widths.column_capacity(css.replace("0.75rem", "0.875rem")) == 93  # 14 px type
    with pytest.raises(ValueError, match="--minivllm-code-font"):
        widths.column_capacity(css.replace("--minivllm-code-font", "--other"))


def test_the_column_holds_a_line_as_long_as_ruff_formats_the_package() -> None:
    line_length = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"][
        "line-length"
    ]
    assert widths.column_capacity() >= line_length


def test_executing_into_a_folder_leaves_the_notebook_beside_its_source_alone(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("nbclient")
    nbformat = pytest.importorskip("nbformat")
    import notebooks  # tools/notebooks.py

    sources = tmp_path / "chapters"
    sources.mkdir()
    for name in ("00_one", "01_two"):
        (sources / f"{name}.py").write_text(
            "# %%\nimport os\nprint(os.path.basename(os.getcwd()), os.getpid())\n"
        )
    into = tmp_path / "build"
    into.mkdir()
    notebooks.execute_all(sorted(sources.glob("*.py")), into=into, what="chapter")
    said = capfd.readouterr()
    assert "chapter 1 of 2: 00_one (started at 0:00)" in said.out
    assert "chapter 2 of 2: 01_two (started at" in said.out
    # The kernel talks over IPC sockets: ipykernel has no unencrypted TCP to warn about.
    assert "without encryption" not in said.out + said.err
    assert not list(sources.glob("*.ipynb"))
    for name in ("00_one", "01_two"):
        (cell,) = nbformat.read(into / f"{name}.ipynb", as_version=4).cells
        folder, pid = cell.outputs[0]["text"].split()
        assert folder == "chapters"  # it ran in its source's folder
        with pytest.raises(ProcessLookupError):  # and its kernel was shut down after it
            os.kill(int(pid), 0)


def test_make_book_executes_into_the_build_and_make_html_only_builds() -> None:
    makefile = (ROOT / "Makefile").read_text()
    recipe = dict(re.findall(r"^(book|html|notebooks): .*\n\t(.*)", makefile, re.M))
    assert recipe["book"] == "$(PY) tools/build_book.py --execute"
    assert recipe["html"] == "$(PY) tools/build_book.py"
    assert recipe["notebooks"].startswith("$(PY) tools/notebooks.py execute")
    assert "make html" in makefile.split("\nhelp:")[1].split("\n\n")[0]
    assert "make html" in (ROOT / "README.md").read_text()
