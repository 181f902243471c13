"""A chapter's float checks print the same text on any x86-64 CPU (issue 28).

Strict nbval compares a chapter's printed text on every machine, and a float error's last digits
move with the CPU: torch's kernels for it (vector width, BLAS), and even the inputs, since
`torch.randn`'s vectorised path depends on the CPU too. So a check prints its tolerance
(`minivllm.book.stats.within`), never the error. Here chapters' own check cells run again in a fresh
process on torch's plain kernels (`ATEN_CPU_CAPABILITY=default`: other random inputs, another
float32 reference), and must print what the committed notebook shows. A few seconds: the numba
kernel is in numba's cache by now (`test_numba_cpu_attention.py` runs first).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

CHAPTERS = Path(__file__).resolve().parents[1] / "chapters"
SEPARATOR = "-- end of cell --"

# (chapter, a line of the check cell, what the cell needs from the chapter's earlier cells)
CHECKS = [
    (
        "00_model",
        'print(f"max |fused - reference| {within(max_diff, 1e-5)}")',
        "import torch\n"
        "from minivllm.model.transformer import CausalAttention, attention_reference\n",
    ),
    (
        "07_cpu_kernel",
        'print(f"decodes, {path}: max relative error {within(cpu_error, 1e-5)}")',
        "import numpy as np\n"
        "import torch\n"
        "from minivllm.attention.numba_cpu import paged_attention_cpu\n"
        "from minivllm.book.kernel_check import random_inputs, reference_attention\n"
        "from minivllm.book.stats import within\n"
        "from minivllm.model.checkpoint import load_model\n"
        "torch.set_num_threads(2)\n"
        'config = load_model("target").config\n',
    ),
]


def cell_source(chapter: str, line: str) -> str:
    """The code cell of `chapters/<chapter>.py` holding `line`."""
    text = (CHAPTERS / f"{chapter}.py").read_text()
    cells = [cell for cell in text.split("\n# %%") if line in cell]
    assert len(cells) == 1, f"{chapter}.py has {len(cells)} cells with {line!r}: update CHECKS"
    return cells[0].split("\n", 1)[1]  # past the cell marker's own line


def committed_output(chapter: str, line: str) -> str:
    """What the committed notebook printed for that cell."""
    notebook = json.loads((CHAPTERS / f"{chapter}.ipynb").read_text())
    [cell] = [c for c in notebook["cells"] if line in "".join(c["source"])]
    return "".join("".join(o["text"]) for o in cell["outputs"] if o.get("name") == "stdout")


def test_checks_print_the_same_on_torch_plain_kernels() -> None:
    # one process for all the cells: torch's import is most of the time
    cells = [(preamble, cell_source(chapter, line)) for chapter, line, preamble in CHECKS]
    script = (
        "import json, sys\n"
        "for preamble, source in json.loads(sys.argv[1]):\n"
        "    exec(preamble + source, {})\n"
        "    print(SEPARATOR, flush=True)\n"
    ).replace("SEPARATOR", repr(SEPARATOR))
    run = subprocess.run(
        [sys.executable, "-c", script, json.dumps(cells)],
        env={**os.environ, "ATEN_CPU_CAPABILITY": "default"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    printed = run.stdout.split(SEPARATOR + "\n")[:-1]
    for (chapter, line, _), text in zip(CHECKS, printed, strict=True):
        assert text == committed_output(chapter, line), chapter
