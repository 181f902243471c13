"""The roadmap atop every chapter: the engine's pieces in the order the book builds them, the
reader's chapter highlighted, the ones before it built, the ones after it faint.

`CHAPTERS` is the one list of the chapters and their names; a test holds it to the book's table of
contents (book/_toc.yml) and to the chapters/ folder, so a chapter added, renamed or moved there
fails until it is named here.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Patch

from minivllm.book.figures.readable import PAGE_WIDTH


@dataclass(frozen=True)
class Chapter:
    slug: str  # its file's name in chapters/, without the suffix: "03_paged_cache"
    name: str  # the piece of the engine it builds, as the roadmap writes it
    part: str  # the part of the book's table of contents it sits in

    @property
    def number(self) -> int:
        return int(self.slug[:2])


CHAPTERS = (
    Chapter("00_model", "model", "Foundation"),
    Chapter("01_tokenizer", "tokenizer", "Foundation"),
    Chapter("02_contiguous_cache", "contiguous\nKV cache", "Memory"),
    Chapter("03_paged_cache", "paged\nKV cache", "Memory"),
    Chapter("04_engine", "continuous\nbatching", "Engine"),
    Chapter("05_preemption", "preemption", "Engine"),
    Chapter("06_speculative", "speculative\ndecoding", "Engine"),
    Chapter("07_cpu_kernel", "CPU kernel", "Hardware"),
    Chapter("08_cuda_paged_attention", "CUDA kernel", "Hardware"),
    Chapter("09_server", "HTTP server", "Serving"),
    Chapter("10_real_model", "real\ncheckpoints", "Real models"),
    Chapter("11_beyond_one_device", "tensor\nparallelism", "Scaling out"),
)

# Okabe-Ito colours (told apart with any colour vision), and a second cue beside colour for each
# state: the current chapter bold with a thick rim, a built one with a check mark, a later one
# with a dashed rim and grey text.
BUILT, CURRENT, LATER = "built", "this chapter", "to come"
STYLE = {
    BUILT: dict(facecolor="#cde4f4", edgecolor="#0072B2", linestyle="-", linewidth=1.0),
    CURRENT: dict(facecolor="#E69F00", edgecolor="#7a4f00", linestyle="-", linewidth=2.2),
    LATER: dict(facecolor="white", edgecolor="#9a9a9a", linestyle="--", linewidth=0.9),
}
TEXT_COLOR = {BUILT: "#1a1a1a", CURRENT: "black", LATER: "#6a6a6a"}
PER_ROW = 6
FONT_SIZE = 9.0  # the names; the page shows the figure at its width, so this is the size read


def state(chapter: Chapter, current: int) -> str:
    """Where `chapter` stands for a reader of chapter `current`."""
    if chapter.number < current:
        return BUILT
    return CURRENT if chapter.number == current else LATER


class RoadmapFigure(Figure):
    """A figure that shows itself as a PNG when it is a cell's value. The roadmap's cell comes
    before the chapter imports pyplot, so Jupyter's inline display of figures is not set up yet."""

    def _repr_png_(self) -> bytes:
        buffer = io.BytesIO()
        self.savefig(buffer, format="png", dpi=self.dpi)
        return buffer.getvalue()


def roadmap(chapter: int) -> RoadmapFigure:
    """The roadmap as seen from chapter `chapter` (its number): two rows of six boxes, read left to
    right and top to bottom. The figure is the cell's value, not left to pyplot, so a cell ending
    in `roadmap(3)` shows it once."""
    numbers = [c.number for c in CHAPTERS]
    if chapter not in numbers:
        raise ValueError(f"chapter {chapter} is not one of the book's chapters {numbers}")
    rows = -(-len(CHAPTERS) // PER_ROW)
    # Not a pyplot figure: the cell's value shows it, and pyplot does not show it a second time.
    fig = RoadmapFigure(figsize=(PAGE_WIDTH, 0.3 + 0.66 * rows), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    fig.subplots_adjust(left=0.005, right=0.995, bottom=0.01, top=1 - 0.3 / fig.get_figheight())
    ax.set_xlim(0, PER_ROW)
    ax.set_ylim(-rows, 0)
    ax.axis("off")
    for index, piece in enumerate(CHAPTERS):
        _box(ax, index, piece, state(piece, chapter))
    here = CHAPTERS[numbers.index(chapter)]
    fig.text(
        0.005,
        1 - 0.04 / fig.get_figheight(),
        f"Where you are in the engine: {here.part}, chapter {here.number:02d}",
        fontsize=10,
        fontweight="bold",
        va="top",
    )
    handles = [Patch(**STYLE[s], label=s) for s in (BUILT, CURRENT, LATER)]
    fig.legend(
        handles=handles,
        loc="upper right",
        bbox_to_anchor=(0.995, 1.0),
        ncol=3,
        frameon=False,
        fontsize=9,
        handlelength=1.4,
        columnspacing=1.0,
        borderaxespad=0.1,
    )
    return fig


def _box(ax, index: int, piece: Chapter, where: str) -> None:
    """One chapter's box, and the arrow from it to the next one in its row."""
    column, row = index % PER_ROW, index // PER_ROW
    x, y, width, height = column + 0.05, -row - 0.92, 0.8, 0.84
    ax.add_patch(
        FancyBboxPatch(
            (x, y),
            width,
            height,
            boxstyle="round,pad=0,rounding_size=0.06",
            mutation_aspect=0.25,
            gid=f"roadmap-{piece.slug}",
            **STYLE[where],
        )
    )
    mark = "✓ " if where == BUILT else ""
    ax.text(
        x + width / 2,
        y + height / 2,
        f"{mark}{piece.number:02d}\n{piece.name}",
        ha="center",
        va="center",
        fontsize=FONT_SIZE,
        linespacing=1.0,
        color=TEXT_COLOR[where],
        fontweight="bold" if where == CURRENT else "normal",
        gid=f"roadmap-label-{piece.slug}",
    )
    if column < PER_ROW - 1 and index < len(CHAPTERS) - 1:
        ax.add_patch(
            FancyArrowPatch(
                (x + width + 0.01, y + height / 2),
                (x + 1 - 0.01, y + height / 2),
                arrowstyle="-|>",
                mutation_scale=8,
                color="#777777",
                linewidth=0.8,
            )
        )
