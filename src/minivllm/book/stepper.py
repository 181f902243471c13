"""A step-through figure that works in a static page: every frame drawn now, embedded as a PNG, and
a range slider flipping between them (chapters 03 and 05).

An ipywidgets slider redraws on a live kernel and loads its JavaScript from a CDN, so in the HTML
book (read offline, or with no kernel behind it) it is a blank box. `Stepper` renders to HTML that
carries its frames and its few lines of script inline: it needs no kernel and no network.

A stepper is read frame by frame, closely: its text is at least `MIN_POINTS` (10 pt) on the page,
one point over the book's floor for figures, and a frame with smaller text is refused when it is
drawn, naming the text, rather than shipped to the page. Its caption and number come from the
chapter cell's `mystnb` figure metadata, as any figure's do.
"""

from __future__ import annotations

import base64
import html
import io
import itertools
from collections.abc import Callable, Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from minivllm.book.figures.readable import small_text

_ids = itertools.count()
MIN_POINTS = 10.0


def figure_png(fig: Figure, dpi: int = 100) -> bytes:
    """The figure as PNG bytes, at the resolution the book's other figures have (a figure as wide
    as the page is as many pixels wide as the page's column); the figure is closed (it is not shown
    again below the cell)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    plt.close(fig)
    return buffer.getvalue()


def readable(fig: Figure, step: int, min_points: float) -> Figure:
    """`fig` if every text it draws is at least `min_points` on the page; an error naming the
    smallest ones if not."""
    small = sorted(small_text(fig, min_points), key=lambda text_size: text_size[1])
    if small:
        plt.close(fig)
        shown = ", ".join(f"{text!r} at {size} pt" for text, size in small[:5])
        raise ValueError(
            f"the frame for step {step} has {len(small)} texts under {min_points} pt on the page "
            f"(a stepper's text must be readable frame by frame): {shown}"
        )
    return fig


class Stepper:
    """Frames `draw(step)` for each of `steps`, behind a slider labelled with the step; it opens at
    `start` (a step from `steps`). `draw` returns a matplotlib figure, drawn as wide as the page
    (wider is shrunk to fit, text and all) with every text at least `min_points` there."""

    def __init__(
        self,
        draw: Callable[[int], Figure],
        steps: Sequence[int],
        start: int | None = None,
        label: str = "step",
        min_points: float = MIN_POINTS,
    ) -> None:
        self.steps = list(steps)
        if not self.steps:
            raise ValueError("a stepper needs at least one step")
        if start is not None and start not in self.steps:
            raise ValueError(f"start={start} is not one of the steps {self.steps[:5]}...")
        self.start = self.steps.index(start) if start is not None else 0
        self.label = label
        self.frames = [
            base64.b64encode(figure_png(readable(draw(step), step, min_points))).decode()
            for step in self.steps
        ]

    def _repr_html_(self) -> str:
        name = f"minivllm-stepper-{next(_ids)}"
        frames = ",".join(f'"data:image/png;base64,{frame}"' for frame in self.frames)
        steps = ",".join(str(step) for step in self.steps)
        label = html.escape(self.label)
        last = len(self.frames) - 1
        # One tick per frame on the slider (the browser draws a datalist's options as ticks), and
        # buttons that move one frame, so every frame can be reached however many there are.
        ticks = "".join(f'<option value="{i}"></option>' for i in range(len(self.frames)))
        return f"""<div id="{name}" style="width: 100%; font-size: 1em">
<div style="display: flex; align-items: center; gap: 0.5em">
<button type="button" title="previous frame" aria-label="previous frame">&#9664;</button>
<input type="range" min="0" max="{last}" step="1" value="{self.start}" list="{name}-ticks"
 aria-label="{label}" style="flex: 1; min-width: 0">
<button type="button" title="next frame" aria-label="next frame">&#9654;</button>
<span style="white-space: nowrap">{label} <output>{self.steps[self.start]}</output>
 (frame <span>{self.start + 1}</span> of {len(self.frames)})</span>
</div>
<datalist id="{name}-ticks">{ticks}</datalist>
<img style="width: 100%; max-width: 100%" alt="{label} {self.steps[self.start]}"
 src="data:image/png;base64,{self.frames[self.start]}">
<script>
(function () {{
  const root = document.getElementById("{name}");
  const frames = [{frames}], steps = [{steps}];
  const slider = root.querySelector("input"), image = root.querySelector("img");
  const shown = root.querySelector("output"), frame = root.querySelector("output + span");
  const [previous, next] = root.querySelectorAll("button");
  function go(index) {{
    slider.value = Math.max(0, Math.min({last}, index));
    image.src = frames[slider.value];
    image.alt = "{label} " + steps[slider.value];
    shown.textContent = steps[slider.value];
    frame.textContent = Number(slider.value) + 1;
  }}
  slider.addEventListener("input", () => go(Number(slider.value)));
  previous.addEventListener("click", () => go(Number(slider.value) - 1));
  next.addEventListener("click", () => go(Number(slider.value) + 1));
}})();
</script>
</div>"""

    def __repr__(self) -> str:
        first, last = self.steps[0], self.steps[-1]
        return f"Stepper({len(self.frames)} frames, {self.label} {first}..{last})"
