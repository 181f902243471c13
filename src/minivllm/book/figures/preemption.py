"""Figures of preemption (chapter 05): one engine step as a panel of a story.

`draw_step_pool` draws the block pool as its forward pass saw it (one large cell per block, labelled
with the request that holds it), what the step did, and the queues after it. In the step that
preempts, the victim's old blocks are outlined in its colour and the annotation says how many went
back to the pool; the victim is shown back in the waiting queue. Colour = sequence id, as in every
chapter.
"""

from __future__ import annotations

from matplotlib.axes import Axes
from matplotlib.patches import FancyBboxPatch, Rectangle

from minivllm.book import FREE_COLOR, sequence_color
from minivllm.book.figures.blocks import block_owners
from minivllm.kv.block_manager import BlockManager

_TEXT = 11  # points: the figure is drawn about as wide as the book's page, so ~10 pt there


def _queue(ax: Axes, y: float, label: str, seq_ids, names: dict[int, str], note: str = "") -> None:
    """One queue as a row of small coloured boxes, each with its request's name."""
    ax.text(-0.1, y, label, ha="right", va="center", fontsize=_TEXT, color="#444444")
    for slot, seq_id in enumerate(seq_ids):
        ax.add_patch(
            FancyBboxPatch(
                (slot * 0.9 + 0.05, y - 0.3),
                0.7,
                0.6,
                boxstyle="round,pad=0.02",
                facecolor=sequence_color(seq_id),
                edgecolor="none",
            )
        )
        ax.text(
            slot * 0.9 + 0.4,
            y,
            names[seq_id],
            ha="center",
            va="center",
            fontsize=_TEXT,
            color="white",
            weight="bold",
        )
    if not seq_ids:
        ax.text(0.1, y, "none", ha="left", va="center", fontsize=_TEXT, color="#888888")
    if note:
        x = max(len(seq_ids), 1) * 0.9 + 0.2
        ax.text(x, y, note, ha="left", va="center", fontsize=_TEXT, color="#444444")


def draw_step_pool(
    ax: Axes,
    pool: BlockManager,
    record,
    names: dict[int, str],
    previous: BlockManager | None = None,
    headline: str = "",
) -> None:
    """One step: `pool` as the step's forward pass used it (after `schedule()`, before finished
    sequences give their blocks back), `record` the step's trace record (queues after the step),
    `previous` the pool of the step before (to show which blocks a preempted sequence lost)."""
    owners = block_owners(pool)
    freed = {
        block: victim
        for victim in record.preempted
        if previous is not None and victim in previous.tables
        for block in previous.tables[victim].blocks
    }
    num_blocks = pool.allocator.num_blocks
    for block in range(num_blocks):
        holders = owners.get(block, [])
        color = sequence_color(holders[0]) if holders else FREE_COLOR
        ax.add_patch(Rectangle((block, 0), 0.9, 0.9, facecolor=color, edgecolor="white"))
        if block in freed:  # it belonged to the victim a moment ago: outline it in its colour
            ax.add_patch(
                Rectangle(
                    (block + 0.04, 0.04),
                    0.82,
                    0.82,
                    facecolor="none",
                    edgecolor=sequence_color(freed[block]),
                    lw=2.5,
                    linestyle=(0, (3, 2)),
                    hatch=None if holders else "//",
                )
            )
        if holders:
            ax.text(
                block + 0.45,
                0.45,
                names[holders[0]],
                ha="center",
                va="center",
                fontsize=_TEXT + 2,
                color="white",
                weight="bold",
            )
        ax.text(block + 0.45, 1.05, str(block), ha="center", fontsize=_TEXT - 1, color="#777777")
    ax.text(-0.1, 0.45, "pool", ha="right", va="center", fontsize=_TEXT, color="#444444")
    _caption(ax, pool, record, names, freed, num_blocks)
    if record.preempted:  # the step that preempts: a frame in the victim's colour
        ax.add_patch(
            FancyBboxPatch(
                (-1.9, -3.35),
                max(num_blocks, 5.5) + 1.85,
                4.75,
                boxstyle="round,pad=0.05",
                facecolor=sequence_color(record.preempted[0]),
                alpha=0.08,
                edgecolor="none",
                zorder=0,
            )
        )
    title_color = sequence_color(record.preempted[0]) if record.preempted else "black"
    ax.set_title(
        f"step {record.step}: {headline}", fontsize=_TEXT + 1, loc="left", color=title_color
    )
    ax.set_xlim(-2.0, max(num_blocks, 5.5))
    ax.set_ylim(-3.45, 1.5)
    ax.set_aspect("equal")
    ax.axis("off")


def _caption(ax: Axes, pool: BlockManager, record, names, freed: dict, num_blocks: int) -> None:
    """Under the pool: what happened to blocks in this step, then the queues after it."""
    lines, owners = [], block_owners(pool)
    for victim in record.preempted:
        lost = sum(1 for v in freed.values() if v == victim)
        lines.append((f"{names[victim]} preempted: {lost} blocks freed", sequence_color(victim)))
        for block in sorted(b for b, v in freed.items() if v == victim and b in owners):
            lines.append((f"{names[owners[block][0]]} takes block {block}", "#444444"))
    for seq_id in record.resumed:
        tokens = dict(record.prefilled).get(seq_id, 0)
        lines.append((f"{names[seq_id]} resumed: prefills {tokens} tokens at once", "#444444"))
    for seq_id, _ in record.finished:
        held = len(pool.tables[seq_id].blocks) if seq_id in pool.tables else 0
        lines.append((f"{names[seq_id]} finished: {held} blocks return", "#444444"))
    if not lines:
        lines.append((f"{pool.num_free} of {num_blocks} blocks free", "#444444"))
    for row, (text, color) in enumerate(lines):
        ax.text(
            -0.05,
            -0.45 - 0.55 * row,
            text,
            ha="left",
            va="center",
            fontsize=_TEXT,
            color=color,
            weight="bold" if color != "#444444" else "normal",
        )
    preempted_now = set(record.preempted)
    waiting_note = "← back in the queue" if preempted_now & set(record.waiting) else ""
    _queue(ax, -2.2, "running", record.running, names)
    _queue(ax, -2.95, "waiting", record.waiting, names, waiting_note)
