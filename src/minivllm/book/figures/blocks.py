"""Figures of the paged KV cache (chapters 03, 05, 06): the block pool and the block tables.

Colour = sequence id, from `minivllm.book`'s palette, in every chapter. A block held by more than
one sequence (prefix sharing, fork) is hatched and labelled with its reference count.
"""

from __future__ import annotations

from matplotlib.axes import Axes
from matplotlib.colors import to_rgb
from matplotlib.legend_handler import HandlerTuple
from matplotlib.patches import ConnectionPatch, Patch, Rectangle

from minivllm.book import FREE_COLOR, sequence_color
from minivllm.book.figures.readable import MIN_POINTS
from minivllm.kv.block_manager import BlockManager


def block_owners(manager: BlockManager) -> dict[int, list[int]]:
    """Physical block -> the sequences whose tables hold it, in seq-id order."""
    owners: dict[int, list[int]] = {}
    for seq_id in sorted(manager.tables):
        for block in manager.tables[seq_id].blocks:
            owners.setdefault(block, []).append(seq_id)
    return owners


def _label_size(ax: Axes, x_span: float, y_span: float) -> float:
    """A font size (points) for a cell's label: as large as two lines of it fit in the cell once the
    axes keeps its aspect ratio, between the book's smallest readable size and 13 pt. A figure with
    many cells must be drawn large enough for its labels: none is drawn smaller than a reader can
    read."""
    box = ax.get_window_extent()
    points_per_unit = min(box.width / x_span, box.height / y_span) * 72 / ax.figure.dpi
    return max(MIN_POINTS, min(13.0, points_per_unit / 2.6))


def label_color(fill: str) -> str:
    """Black or white, whichever reads better on `fill` (the higher WCAG contrast ratio): black
    on the palette's light colours, white on its dark ones (indigo, blue, brown, red)."""
    luminance = relative_luminance(fill)
    on_black, on_white = (luminance + 0.05) / 0.05, 1.05 / (luminance + 0.05)
    return "black" if on_black >= on_white else "white"


def relative_luminance(color: str) -> float:
    """WCAG 2's relative luminance of an sRGB colour: 0 for black, 1 for white."""
    channels = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in to_rgb(color)]
    return 0.2126 * channels[0] + 0.7152 * channels[1] + 0.0722 * channels[2]


def _cell(
    ax: Axes, x: float, y: float, color: str, label: str, size: float, shared: bool = False
) -> None:
    ax.add_patch(
        Rectangle(
            (x, y), 0.92, 0.92, facecolor=color, edgecolor="white", hatch="//" if shared else None
        )
    )
    # A shared cell's hatching would run through its label: the label sits on a white plate, above
    # the hatching, so only the cell's rim shows the stripes.
    plate = dict(boxstyle="round,pad=0.12", facecolor="white", edgecolor="none")
    ax.text(
        x + 0.46,
        y + 0.46,
        label,
        ha="center",
        va="center",
        fontsize=size,
        color="black" if shared else label_color(color),
        bbox=plate if shared else None,
        zorder=3,
    )


def draw_block_pool(
    ax: Axes,
    manager: BlockManager,
    columns: int = 8,
    title: str = "block pool",
    label_points: float | None = None,
) -> dict[int, tuple]:
    """The physical pool as a grid, block 0 top left; returns each block's cell centre (for
    arrows). `label_points` fixes the cells' label size (by default it is fitted to the cells as
    the axes stands before any layout engine has run)."""
    owners, centres = block_owners(manager), {}
    num_blocks = manager.allocator.num_blocks
    rows = -(-num_blocks // columns)
    ax.set_xlim(-0.1, columns)
    ax.set_ylim(-0.1, rows)
    ax.set_aspect("equal")
    ax.axis("off")
    size = label_points or _label_size(ax, columns + 0.1, rows + 0.1)
    for block in range(num_blocks):
        x, y = block % columns, rows - 1 - block // columns
        holders = owners.get(block, [])
        color = sequence_color(holders[0]) if holders else FREE_COLOR
        label = f"{block}" + (f"\n×{len(holders)}" if len(holders) > 1 else "")
        _cell(ax, x, y, color, label, size, shared=len(holders) > 1)
        centres[block] = (x + 0.46, y + 0.46)
    ax.set_title(f"{title}: {manager.num_free} of {num_blocks} free", fontsize=11)
    return centres


def _lower_left(centre: tuple) -> tuple:
    """Where an arrow ends on a pool cell: near its lower left corner, so the arrow head does not
    sit on the cell's label."""
    return centre[0] - 0.34, centre[1] - 0.3


def draw_block_tables(
    ax: Axes,
    manager: BlockManager,
    pool_ax: Axes | None = None,
    pool_centres: dict[int, tuple] | None = None,
    width: int = 1,
    rows: int = 1,
    label_points: float | None = None,
) -> None:
    """One row per sequence: its logical blocks, each labelled with the physical block it maps to.
    With `pool_ax`, an arrow runs from every logical block to its physical block. The drawing is at
    least `width` logical blocks wide: two tables drawn one above the other with the same `width`
    get the same cells, lined up, so what one has more of shows as a gap in the other (and the
    frames of a stepper drawn with one `width` and `rows` -- at least that many rows, from the top
    -- keep their cells' size). `label_points` fixes the labels' size, as in `draw_block_pool`."""
    seq_ids = sorted(manager.tables)
    width = max([width, *(len(manager.tables[s].blocks) for s in seq_ids)])
    ax.set_xlim(-1.6, max(width, 1))
    height = max(rows, len(seq_ids), 1)
    ax.set_ylim(-0.1, height)
    ax.set_aspect("equal")
    ax.axis("off")
    size = label_points or _label_size(ax, max(width, 1) + 1.6, height + 0.1)
    for row, seq_id in enumerate(seq_ids):
        y = height - 1 - row
        ax.text(-0.2, y + 0.46, f"seq {seq_id}", ha="right", va="center", fontsize=size)
        for logical, block in enumerate(manager.tables[seq_id].blocks):
            _cell(ax, logical, y, sequence_color(seq_id), f"→{block}", size)
            if pool_ax is not None and pool_centres is not None:
                ax.figure.add_artist(
                    ConnectionPatch(
                        xyA=(logical + 0.9, y + 0.46),
                        coordsA=ax.transData,
                        xyB=_lower_left(pool_centres[block]),
                        coordsB=pool_ax.transData,
                        color=sequence_color(seq_id),
                        alpha=0.45,
                        lw=0.8,
                        arrowstyle="-|>",
                        mutation_scale=6,
                    )
                )
    ax.set_title("block tables (logical → physical)", fontsize=11)


# The fate of a draft token in speculative decoding (chapter 06).


def block_legend(fig, tables: bool = False, free_label: str = "free block", **where) -> None:
    """A legend for the pool (and block tables) under `fig` (a figure or subfigure): a free block,
    a held block (its colour names its sequence), and with `tables` what a table cell's label
    means. `where` goes to `fig.legend` (by default: centred below the drawing)."""
    held = tuple(Patch(facecolor=sequence_color(s)) for s in range(4))
    handles = [Patch(facecolor=FREE_COLOR, edgecolor="#cccccc"), held]
    labels = [free_label, "held: one colour per sequence"]
    if tables:
        handles.append(Patch(facecolor="none", edgecolor="none"))
        labels.append("→n: maps to physical block n")
    options = dict(loc="lower center", ncol=len(handles), frameon=False, fontsize=10)
    handler_map = {tuple: HandlerTuple(ndivide=None, pad=0)}  # the four colours side by side
    fig.legend(handles, labels, handler_map=handler_map, **options | where)
