"""What "readable" means for the book's figures, as checks a test can run on a drawn figure.

A figure is shown at most as wide as the page: one drawn wider is scaled down to fit, and its text
with it. So a label's size *on the page* is its size in points times `min(1, PAGE_WIDTH / width)`,
and that must be at least `MIN_POINTS`.
"""

from __future__ import annotations

from matplotlib.axes import Axes
from matplotlib.figure import Figure, SubFigure
from matplotlib.text import Text

PAGE_WIDTH = 7.5  # inches: the book style's default figure width, about the HTML page's column
MIN_POINTS = 9.0


def page_scale(fig: Figure) -> float:
    """How much the page shrinks `fig` to fit its width (1 when it fits)."""
    return min(1.0, PAGE_WIDTH / fig.get_figwidth())


def drawn_text(fig: Figure | SubFigure) -> list[Text]:
    """The texts `fig` draws: its own, its subfigures', and in each axes the titles, the texts and
    annotations, the legend, and (unless the axes is switched off) the axis labels and tick
    labels."""
    fig.canvas.draw()  # tick labels exist only once the figure is drawn
    texts = list(fig.texts)
    for legend in fig.legends:
        texts += [*legend.get_texts(), legend.get_title()]
    for sub in fig.subfigs:
        texts += drawn_text(sub)
    for ax in fig.axes:
        if getattr(ax, "figure", None) is not fig and fig.subfigs:
            continue  # drawn by its subfigure
        texts += [ax.title, ax._left_title, ax._right_title, *ax.texts]
        if ax.get_legend() is not None:
            texts += [*ax.get_legend().get_texts(), ax.get_legend().get_title()]
        if ax.axison:
            for axis in (ax.xaxis, ax.yaxis):
                if axis.get_visible():
                    texts += [axis.label, *axis.get_ticklabels(), axis.get_offset_text()]
    return [t for t in texts if t.get_visible() and t.get_text().strip()]


def small_text(fig: Figure, min_points: float = MIN_POINTS) -> list[tuple[str, float]]:
    """Each text `fig` draws (titles, labels, tick labels, legends, annotations) that is smaller
    than `min_points` on the page, with its size there in points."""
    scale = page_scale(fig)
    return [
        (text.get_text(), round(float(text.get_fontsize()) * scale, 1))
        for text in drawn_text(fig)
        if text.get_fontsize() * scale < min_points - 1e-6
    ]


def overlapping_tick_labels(ax: Axes, axis: str = "x") -> list[tuple[str, str]]:
    """Neighbouring tick labels of `ax` whose drawn boxes overlap (a run of labels nobody can
    read)."""
    ax.figure.canvas.draw()
    renderer = ax.figure.canvas.get_renderer()
    labels = ax.get_xticklabels() if axis == "x" else ax.get_yticklabels()
    shown = [label for label in labels if label.get_visible() and label.get_text()]
    boxes = [label.get_window_extent(renderer) for label in shown]
    return [
        (shown[i].get_text(), shown[i + 1].get_text())
        for i in range(len(shown) - 1)
        if boxes[i].overlaps(boxes[i + 1])
    ]
