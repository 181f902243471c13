"""Figures of chapters 07 and 08's kernels: the launch hierarchy (grid -> thread block -> warp ->
lanes), and which warp read which slot of the paged cache in a recorded simulator run.
"""

from __future__ import annotations

from matplotlib.axes import Axes
from matplotlib.patches import Rectangle

from minivllm.book import FREE_COLOR, sequence_color

# Every text of these figures, in points: they are drawn at the page's width (7.5 in), where
# `figures/readable.py` asks for 9 pt at least.
FONT = 9

# -- chapter 08: the CUDA kernel -------------------------------------------------------------------
WARP_COLORS = (
    "#66c2a5",
    "#fc8d62",
    "#8da0cb",
    "#e78ac3",
    "#a6d854",
    "#ffd92f",
    "#e5c494",
    "#b3b3b3",
)


def _box(
    ax: Axes,
    x: float,
    y: float,
    w: float,
    h: float,
    color: str,
    label: str = "",
    fontsize: int = FONT,
    **style,
) -> None:
    ax.add_patch(
        Rectangle((x, y), w, h, facecolor=color, edgecolor=style.pop("edgecolor", "white"), **style)
    )
    if label:
        ax.text(x + w / 2, y + h / 2, label, ha="center", va="center", fontsize=fontsize)


def _zoom(
    ax: Axes, source: tuple[float, float, float, float], target: tuple[float, float, float, float]
) -> None:
    """Two grey lines from the box `source` (x, y, w, h) to the box `target`: "this, enlarged"."""
    (sx, sy, sw, sh), (tx, ty, _tw, th) = source, target
    for a, b in (((sx + sw, sy + sh), (tx, ty + th)), ((sx + sw, sy), (tx, ty))):
        ax.plot([a[0], b[0]], [a[1], b[1]], color="#999999", lw=0.7, ls="--")


def draw_execution_model(
    ax: Axes, num_seqs: int, num_heads: int, threads: int, head_dim: int
) -> None:
    """The kernel's launch as the GPU sees it: a grid of thread blocks (one per sequence and head),
    a block's warps (each takes every num_warps-th token), and a warp's 32 lanes (each takes every
    32nd element of head_dim), left to right, each an enlargement of the highlighted piece of the
    last."""
    num_warps, cell, gap = threads // 32, 0.9, 1.4
    for s in range(num_seqs):  # the grid
        for h in range(num_heads):
            _box(
                ax,
                h,
                num_seqs - 1 - s,
                cell,
                cell,
                "#1f77b4" if (s, h) == (0, 0) else "#c6dbef",
                f"{s},{h}",
            )
    ax.text(
        num_heads / 2,
        num_seqs + 0.2,
        f"grid: {num_seqs} × {num_heads} thread blocks\nblockIdx = (sequence, head)",
        ha="center",
        va="bottom",
        fontsize=FONT,
    )
    x0, width, height = num_heads + gap, 5.0, num_seqs
    _zoom(ax, (0, num_seqs - 1, cell, cell), (x0, 0, width, height))
    strip = height / num_warps
    for w in range(num_warps):  # the chosen block's warps
        tokens = ", ".join(str(t) for t in range(w, w + 2 * num_warps, num_warps))
        _box(
            ax,
            x0,
            height - (w + 1) * strip + 0.05,
            width,
            strip - 0.1,
            WARP_COLORS[w],
            f"warp {w}: tokens {tokens}, …",
        )
    ax.text(
        x0 + width / 2,
        height + 0.2,
        f"block (0, 0): {threads} threads\n= {num_warps} warps + shared memory",
        ha="center",
        va="bottom",
        fontsize=FONT,
    )
    x1, lane_w = x0 + width + gap, 4.0 / 32
    _zoom(ax, (x0, height - strip + 0.05, width, strip - 0.1), (x1, 0, 32 * lane_w, height))
    for lane in range(32):  # one warp's lanes over head_dim
        _box(ax, x1 + lane * lane_w, 0, lane_w, height, WARP_COLORS[0], edgecolor="#ffffff", lw=0.4)
        if lane % 8 == 0 or lane == 31:
            ax.text(
                x1 + (lane + 0.5) * lane_w, -0.15, str(lane), ha="center", va="top", fontsize=FONT
            )
    ax.text(x1 + 2, -0.75, "lane", ha="center", va="top", fontsize=FONT)
    reads = "d = ℓ" if head_dim <= 32 else "d = ℓ, ℓ + 32, …"
    ax.text(
        x1 + 2,
        height + 0.2,
        f"warp 0: 32 lanes\nin lockstep; lane ℓ\nreads {reads}",
        ha="center",
        va="bottom",
        fontsize=FONT,
    )
    ax.set_xlim(-0.2, x1 + 4.2)
    ax.set_ylim(-1.2, num_seqs + 1.8)
    ax.set_aspect("equal")
    ax.axis("off")


def draw_cache_reads(
    ax: Axes,
    key_reads: dict,
    block_table: list[int],
    block_size: int,
    num_blocks: int,
    warp_size: int = 32,
) -> None:
    """GPU-Puzzles style: the physical key cache, one row per physical block, one cell per slot. A
    slot this thread block read is coloured by the warp that read its key row, labelled with the
    round in which that warp read it (its 1st, 2nd, ... token); slots of other sequences' blocks
    stay blank. `key_reads` is `kernel_trace.reads_by_thread` over the key cache's reads of ONE
    thread block."""
    rounds: dict[tuple[int, int], tuple[int, int]] = {}  # (block, slot) -> (warp, round)
    for (_, thread), indices in key_reads.items():
        if thread % warp_size:
            continue  # every lane of a warp reads the same rows; lane 0 speaks for its warp
        slots = list(dict.fromkeys((block, slot) for block, slot, *_ in indices))
        for order, where in enumerate(slots):
            rounds[where] = (thread // warp_size, order + 1)
    logical = {block: i for i, block in enumerate(block_table)}
    for block in range(num_blocks):
        y = num_blocks - 1 - block
        name = f"block {block}" + (f" = logical {logical[block]}" if block in logical else "")
        ax.text(-0.3, y + 0.45, name, ha="right", va="center", fontsize=FONT)
        for slot in range(block_size):
            if (block, slot) in rounds:
                warp, order = rounds[block, slot]
                _box(ax, slot, y, 0.92, 0.92, WARP_COLORS[warp % len(WARP_COLORS)], str(order))
            else:
                _box(ax, slot, y, 0.92, 0.92, FREE_COLOR)
    warps = sorted({w for w, _ in rounds.values()})
    for i, warp in enumerate(warps):
        _box(
            ax,
            block_size + 0.6,
            num_blocks - 1 - i,
            0.92,
            0.92,
            WARP_COLORS[warp % len(WARP_COLORS)],
        )
        ax.text(
            block_size + 1.7, num_blocks - 1 - i + 0.45, f"warp {warp}", va="center", fontsize=FONT
        )
    ax.set_xlim(-0.2, block_size + 3.5)
    ax.set_ylim(-0.2, num_blocks)
    ax.set_aspect("equal")
    ax.set_xticks(
        [s + 0.46 for s in range(block_size)], [str(s) for s in range(block_size)], fontsize=FONT
    )
    ax.set_yticks([])
    ax.tick_params(length=0)
    ax.set_xlabel("slot in the block")
    ax.grid(False)
    for spine in ax.spines.values():
        spine.set_visible(False)


# -- chapter 07: the CPU kernel's work plan --------------------------------------------------------
def draw_work_plan(ax: Axes, work, work_start, cost, title: str = "") -> None:
    """One bar per thread, built from its units of work (sequence, query tile, K/V head) in the
    order it runs them, each as long as its cost and coloured by its sequence."""
    for thread in range(len(work_start) - 1):
        left = 0
        for unit in range(int(work_start[thread]), int(work_start[thread + 1])):
            seq = int(work[unit][0])
            width = float(cost[unit])
            ax.barh(
                thread,
                width,
                left=left,
                height=0.6,
                color=sequence_color(seq),
                edgecolor="white",
                linewidth=0.5,
            )
            left += width
        ax.text(left, thread, f"  {left:,.0f}", va="center", fontsize=FONT)
    ax.set_yticks(range(len(work_start) - 1))
    ax.set_yticklabels([f"thread {t}" for t in range(len(work_start) - 1)])
    ax.invert_yaxis()
    ax.set_xlabel("work (query rows x keys they see)")
    if title:
        ax.set_title(title)
