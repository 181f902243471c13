"""A step-through figure that works in a static page: every frame drawn now, embedded as a PNG, and
a range slider flipping between them (chapters 03 and 05).

An ipywidgets slider redraws on a live kernel and loads its JavaScript from a CDN, so in the HTML
book (read offline, or with no kernel behind it) it is a blank box. `Stepper` renders to HTML that
carries its frames and its few lines of script inline: it needs no kernel and no network.
"""

from __future__ import annotations

import base64
import html
import io
import itertools
from collections.abc import Callable, Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

_ids = itertools.count()


def figure_png(fig: Figure, dpi: int = 72) -> bytes:
    """The figure as PNG bytes, at screen resolution (a stepper embeds dozens of them); the figure
    is closed (it is not shown again below the cell)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    plt.close(fig)
    return buffer.getvalue()


class Stepper:
    """Frames `draw(step)` for each of `steps`, behind a slider labelled with the step; it opens at
    `start` (a step from `steps`). `draw` returns a matplotlib figure."""

    def __init__(
        self,
        draw: Callable[[int], Figure],
        steps: Sequence[int],
        start: int | None = None,
        label: str = "step",
    ) -> None:
        self.steps = list(steps)
        if not self.steps:
            raise ValueError("a stepper needs at least one step")
        if start is not None and start not in self.steps:
            raise ValueError(f"start={start} is not one of the steps {self.steps[:5]}...")
        self.start = self.steps.index(start) if start is not None else 0
        self.label = label
        self.frames = [base64.b64encode(figure_png(draw(step))).decode() for step in self.steps]

    def _repr_html_(self) -> str:
        name = f"minivllm-stepper-{next(_ids)}"
        frames = ",".join(f'"data:image/png;base64,{frame}"' for frame in self.frames)
        steps = ",".join(str(step) for step in self.steps)
        label = html.escape(self.label)
        return f"""<div id="{name}">
<label>{label} <input type="range" min="0" max="{len(self.frames) - 1}" value="{self.start}"
 style="width: 60%; vertical-align: middle"> <output>{self.steps[self.start]}</output></label><br>
<img style="max-width: 100%" src="data:image/png;base64,{self.frames[self.start]}">
<script>
(function () {{
  const root = document.getElementById("{name}");
  const frames = [{frames}], steps = [{steps}];
  const slider = root.querySelector("input"), image = root.querySelector("img");
  const shown = root.querySelector("output");
  slider.addEventListener("input", () => {{
    image.src = frames[slider.value];
    shown.textContent = steps[slider.value];
  }});
}})();
</script>
</div>"""

    def __repr__(self) -> str:
        first, last = self.steps[0], self.steps[-1]
        return f"Stepper({len(self.frames)} frames, {self.label} {first}..{last})"
