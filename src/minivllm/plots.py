"""Figures the chapters draw: the block pool and block tables, request timelines, speculative rounds, and
chapter 07's kernel: its launch hierarchy and which thread read which slot of the cache.

Colour = sequence id, from `minivllm.book`'s palette, in every chapter. A block held by more than one
sequence (prefix sharing, fork) is hatched and labelled with its reference count.
"""

from __future__ import annotations

from matplotlib.axes import Axes
from matplotlib.patches import ConnectionPatch, Rectangle

from .block_allocator import BlockManager
from .book import FREE_COLOR, sequence_color


def block_owners(manager: BlockManager) -> dict[int, list[int]]:
    """Physical block -> the sequences whose tables hold it, in seq-id order."""
    owners: dict[int, list[int]] = {}
    for seq_id in sorted(manager.tables):
        for block in manager.tables[seq_id].blocks:
            owners.setdefault(block, []).append(seq_id)
    return owners


def _cell(ax: Axes, x: float, y: float, color: str, label: str, shared: bool = False) -> None:
    ax.add_patch(Rectangle((x, y), 0.92, 0.92, facecolor=color, edgecolor="white", hatch="///" if shared else None))
    ax.text(x + 0.46, y + 0.46, label, ha="center", va="center", fontsize=7)


def draw_block_pool(ax: Axes, manager: BlockManager, columns: int = 8, title: str = "block pool") -> dict[int, tuple]:
    """The physical pool as a grid, block 0 top left; returns each block's cell centre (for arrows)."""
    owners, centres = block_owners(manager), {}
    num_blocks = manager.allocator.num_blocks
    rows = -(-num_blocks // columns)
    for block in range(num_blocks):
        x, y = block % columns, rows - 1 - block // columns
        holders = owners.get(block, [])
        color = sequence_color(holders[0]) if holders else FREE_COLOR
        label = f"{block}" + (f"\n×{len(holders)}" if len(holders) > 1 else "")
        _cell(ax, x, y, color, label, shared=len(holders) > 1)
        centres[block] = (x + 0.46, y + 0.46)
    ax.set_xlim(-0.1, columns)
    ax.set_ylim(-0.1, rows)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(f"{title}: {manager.num_free} of {num_blocks} free", fontsize=9)
    return centres


def draw_block_tables(ax: Axes, manager: BlockManager, pool_ax: Axes | None = None,
                      pool_centres: dict[int, tuple] | None = None) -> None:
    """One row per sequence: its logical blocks, each labelled with the physical block it maps to.
    With `pool_ax`, an arrow runs from every logical block to its physical block."""
    seq_ids = sorted(manager.tables)
    width = max((len(manager.tables[s].blocks) for s in seq_ids), default=1)
    for row, seq_id in enumerate(seq_ids):
        y = len(seq_ids) - 1 - row
        ax.text(-0.2, y + 0.46, f"seq {seq_id}", ha="right", va="center", fontsize=8)
        for logical, block in enumerate(manager.tables[seq_id].blocks):
            _cell(ax, logical, y, sequence_color(seq_id), f"→{block}")
            if pool_ax is not None and pool_centres is not None:
                ax.figure.add_artist(ConnectionPatch(
                    xyA=(logical + 0.9, y + 0.46), coordsA=ax.transData, xyB=pool_centres[block],
                    coordsB=pool_ax.transData, color=sequence_color(seq_id), alpha=0.45, lw=0.8,
                    arrowstyle="-|>", mutation_scale=6))
    ax.set_xlim(-1.6, max(width, 1))
    ax.set_ylim(-0.1, max(len(seq_ids), 1))
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title("block tables (logical → physical)", fontsize=9)


# How each request state is drawn in a timeline: (alpha of the sequence's colour, hatch); None = grey.
_STATE_STYLE = {
    "decode": (1.0, None), "prefill": (1.0, "////"), "unscheduled": (0.35, None),
    "stalled": (0.35, "xx"), "preempted": (None, "xx"), "waiting": (None, None), "recompute": (0.6, "\\\\"),
}


def draw_gantt(ax: Axes, records, title: str = "requests over steps", label_every: int = 1) -> None:
    """One row per request, one cell per step: grey while waiting, hatched while its prompt is
    prefilled, solid while it decodes, pale while running but not scheduled (stalled: crossed);
    grey and crossed once preempted, pale and back-hatched while it recomputes."""
    from .trace import request_timeline

    timeline = request_timeline(records)
    seq_ids = sorted(timeline)
    for row, seq_id in enumerate(seq_ids):
        y = len(seq_ids) - 1 - row
        for step, state in sorted(timeline[seq_id].items()):
            alpha, hatch = _STATE_STYLE[state]
            color = "#d9d9d9" if alpha is None else sequence_color(seq_id)
            ax.add_patch(Rectangle((step - 0.5, y), 1, 0.8, facecolor=color, alpha=alpha or 1.0,
                                   hatch=hatch, edgecolor="white" if hatch else "none", lw=0))
    ax.set_xlim(0.5, max((max(t) for t in timeline.values()), default=1) + 0.5)
    ax.set_ylim(-0.2, len(seq_ids))
    ticks = [y for y in range(len(seq_ids)) if (len(seq_ids) - 1 - y) % label_every == 0]
    ax.set_yticks([y + 0.4 for y in ticks], [f"req {seq_ids[len(seq_ids) - 1 - y]}" for y in ticks], fontsize=7)
    ax.set_xlabel("engine step")
    ax.grid(False)
    ax.set_title(title, fontsize=10)


def draw_flat_batch(ax: Axes, batch, token_text: list[str], seq_ids: list[int]) -> None:
    """The flattened batch of one step: each new token a cell coloured by its sequence, with its
    position above and its cache slot below; brackets show each sequence's query range."""
    starts = batch.query_start.tolist()
    for i, seq_id in enumerate(seq_ids):
        for row in range(starts[i], starts[i + 1]):
            ax.add_patch(Rectangle((row, 0), 0.94, 1, facecolor=sequence_color(seq_id), alpha=0.85))
            ax.text(row + 0.47, 0.5, token_text[row], ha="center", va="center", fontsize=7, color="white")
            ax.text(row + 0.47, 1.15, str(int(batch.positions[row])), ha="center", fontsize=6)
            ax.text(row + 0.47, -0.35, str(int(batch.slot_mapping[row])), ha="center", fontsize=6, color="#555555")
        kind = "decode" if i < batch.num_decodes else "prefill"
        ax.text((starts[i] + starts[i + 1]) / 2, 1.6, f"seq {seq_id}\n{kind}", ha="center", fontsize=7)
    ax.text(-0.6, 1.15, "position", ha="right", fontsize=7)
    ax.text(-0.6, 0.5, "token", ha="right", va="center", fontsize=7)
    ax.text(-0.6, -0.35, "slot", ha="right", fontsize=7, color="#555555")
    ax.set_xlim(-0.2, starts[-1])
    ax.set_ylim(-0.6, 2.3)
    ax.axis("off")


def draw_batch_places(ax: Axes, records, places: int, title: str) -> None:
    """Which request sits in which batch place at each step; a place is held from a request's first
    scheduled step until it finishes, and grey where nobody uses it."""
    place: dict[int, int] = {}
    for col, record in enumerate(records):
        for seq_id in [*record.decoded, *(s for s, _ in record.prefilled)]:
            if seq_id not in place:
                place[seq_id] = min(set(range(places)) - set(place.values()))
        taken = {p: s for s, p in place.items()}
        for row in range(places):
            color = sequence_color(taken[row]) if row in taken else "#eeeeee"
            ax.add_patch(Rectangle((col, places - 1 - row), 1, 0.9, color=color, lw=0))
        for seq_id, _ in record.finished:
            del place[seq_id]
    ax.set_xlim(0, len(records))
    ax.set_ylim(-0.1, places)
    ax.set_yticks([places - 1 - r + 0.45 for r in range(places)], [f"place {r}" for r in range(places)])
    ax.set_xlabel("engine step")
    ax.grid(False)
    ax.set_title(title, fontsize=10)


# The fate of a draft token in speculative decoding (chapter 06).
ACCEPTED_COLOR, REJECTED_COLOR, UNCHECKED_COLOR, TARGET_COLOR = "#2ca02c", "#d62728", "#d9d9d9", "#1f77b4"


def draw_speculative_round(ax: Axes, drafted: list[str], p: list[float], q: list[float], num_accepted: int,
                           final: str, final_kind: str) -> None:
    """One round: for each draft token, the target's p(token) and the draft's q(token) side by side,
    the column shaded by its fate (accepted, the first rejection, or never checked), then the token the
    target adds itself (`final_kind`: "resampled" after a rejection, or "bonus")."""
    for i, (text, p_t, q_t) in enumerate(zip(drafted, p, q)):
        fate = ACCEPTED_COLOR if i < num_accepted else REJECTED_COLOR if i == num_accepted else UNCHECKED_COLOR
        ax.axvspan(i - 0.45, i + 0.45, color=fate, alpha=0.15, lw=0)
        ax.bar(i - 0.17, p_t, width=0.32, color=TARGET_COLOR, label="p (target)" if i == 0 else None)
        ax.bar(i + 0.17, q_t, width=0.32, color="#ff7f0e", label="q (draft)" if i == 0 else None)
        verdict = "accept" if i < num_accepted else "reject" if i == num_accepted else "unchecked"
        ax.text(i, 1.04, f"{text!r}\n{verdict}", ha="center", fontsize=8)
    end = len(drafted)
    at = num_accepted if num_accepted < end else end
    ax.annotate(f"{final_kind}\n{final!r}", xy=(at, 0.5), xytext=(end + 0.6, 0.5), fontsize=8,
                ha="center", va="center", color=TARGET_COLOR,
                arrowprops=dict(arrowstyle="->", color=TARGET_COLOR, lw=0.8))
    ax.set_xlim(-0.6, end + 1.2)
    ax.set_ylim(0, 1.22)
    ax.set_xticks(range(end), [f"draft {i + 1}" for i in range(end)])
    ax.set_ylabel("probability of the draft token")
    ax.legend(loc="upper right", bbox_to_anchor=(1.0, 0.92), fontsize=8)
    ax.grid(False)


def draw_acceptance_map(ax: Axes, records, seq_id: int, title: str = "") -> None:
    """One column per verify pass of a request: its draft tokens bottom up (green accepted, red the
    first rejected, grey never checked). The blue mark is the token the target adds itself: a dot on
    the rejected draft it replaces, or a bonus cell on top when every draft was accepted. A column
    emits its green cells plus the blue mark."""
    column = 0
    for record in records:
        for sid, proposed, accepted in record.speculated:
            if sid != seq_id:
                continue
            for row in range(proposed):
                color = ACCEPTED_COLOR if row < accepted else REJECTED_COLOR if row == accepted else UNCHECKED_COLOR
                ax.add_patch(Rectangle((column, row), 0.9, 0.9, color=color, lw=0))
            if accepted < proposed:
                ax.plot(column + 0.45, accepted + 0.45, "o", color=TARGET_COLOR, markersize=3)
            else:
                ax.add_patch(Rectangle((column, proposed), 0.9, 0.9, color=TARGET_COLOR, lw=0))
            column += 1
    ax.set_xlim(0, max(column, 1))
    ax.set_ylim(0, max((p for r in records for s, p, _ in r.speculated if s == seq_id), default=1) + 1.2)
    ax.set_xlabel("verify pass (one target forward)")
    ax.set_ylabel("draft position")
    ax.grid(False)
    ax.set_title(title, fontsize=10)


# -- chapter 07: the CUDA kernel -------------------------------------------------------------------------
WARP_COLORS = ("#66c2a5", "#fc8d62", "#8da0cb", "#e78ac3", "#a6d854", "#ffd92f", "#e5c494", "#b3b3b3")


def _box(ax: Axes, x: float, y: float, w: float, h: float, color: str, label: str = "", fontsize: int = 7,
         **style) -> None:
    ax.add_patch(Rectangle((x, y), w, h, facecolor=color, edgecolor=style.pop("edgecolor", "white"), **style))
    if label:
        ax.text(x + w / 2, y + h / 2, label, ha="center", va="center", fontsize=fontsize)


def _zoom(ax: Axes, source: tuple[float, float, float, float], target: tuple[float, float, float, float]) -> None:
    """Two grey lines from the box `source` (x, y, w, h) to the box `target`: "this, enlarged"."""
    (sx, sy, sw, sh), (tx, ty, tw, th) = source, target
    for a, b in (((sx + sw, sy + sh), (tx, ty + th)), ((sx + sw, sy), (tx, ty))):
        ax.plot([a[0], b[0]], [a[1], b[1]], color="#999999", lw=0.7, ls="--")


def draw_execution_model(ax: Axes, num_seqs: int, num_heads: int, threads: int, head_dim: int) -> None:
    """The kernel's launch as the GPU sees it: a grid of thread blocks (one per sequence and head), a
    block's warps (each takes every num_warps-th token), and a warp's 32 lanes (each takes every 32nd
    element of head_dim), left to right, each an enlargement of the highlighted piece of the last."""
    num_warps, cell, gap = threads // 32, 0.9, 2.2
    for s in range(num_seqs):  # the grid
        for h in range(num_heads):
            _box(ax, h, num_seqs - 1 - s, cell, cell, "#1f77b4" if (s, h) == (0, 0) else "#c6dbef", f"{s},{h}", 6)
    ax.text(num_heads / 2, num_seqs + 0.2, f"grid: {num_seqs} × {num_heads} thread blocks\n"
            "blockIdx = (sequence, head)", ha="center", va="bottom", fontsize=8)
    x0, width, height = num_heads + gap, 4.0, num_seqs
    _zoom(ax, (0, num_seqs - 1, cell, cell), (x0, 0, width, height))
    strip = height / num_warps
    for w in range(num_warps):  # the chosen block's warps
        tokens = ", ".join(str(t) for t in range(w, w + 3 * num_warps, num_warps))
        _box(ax, x0, height - (w + 1) * strip + 0.05, width, strip - 0.1, WARP_COLORS[w], f"warp {w}: tokens {tokens}, …", 7)
    ax.text(x0 + width / 2, height + 0.2, f"block (0, 0): {threads} threads\n= {num_warps} warps + shared memory",
            ha="center", va="bottom", fontsize=8)
    x1, lane_w = x0 + width + gap, 4.0 / 32
    _zoom(ax, (x0, height - strip + 0.05, width, strip - 0.1), (x1, 0, 32 * lane_w, height))
    for lane in range(32):  # one warp's lanes over head_dim
        _box(ax, x1 + lane * lane_w, 0, lane_w, height, WARP_COLORS[0], edgecolor="#ffffff", lw=0.4)
        if lane % 8 == 0 or lane == 31:
            ax.text(x1 + (lane + 0.5) * lane_w, -0.15, str(lane), ha="center", va="top", fontsize=6)
    ax.text(x1 + 2, -0.75, "lane", ha="center", va="top", fontsize=7)
    reads = "d = ℓ" if head_dim <= 32 else "d = ℓ, ℓ + 32, …"
    ax.text(x1 + 2, height + 0.2, f"warp 0: 32 lanes in lockstep;\nlane ℓ reads {reads} of a key row",
            ha="center", va="bottom", fontsize=8)
    ax.set_xlim(-0.2, x1 + 4.2)
    ax.set_ylim(-1.1, num_seqs + 1.2)
    ax.set_aspect("equal")
    ax.axis("off")


def draw_cache_reads(ax: Axes, key_reads: dict, block_table: list[int], block_size: int, num_blocks: int,
                     warp_size: int = 32) -> None:
    """GPU-Puzzles style: the physical key cache, one row per physical block, one cell per slot. A slot
    this thread block read is coloured by the warp that read its key row, labelled with the round in
    which that warp read it (its 1st, 2nd, ... token); slots of other sequences' blocks stay blank.
    `key_reads` is `kernel_trace.reads_by_thread` over the key cache's reads of ONE thread block."""
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
        ax.text(-0.3, y + 0.45, name, ha="right", va="center", fontsize=7)
        for slot in range(block_size):
            if (block, slot) in rounds:
                warp, order = rounds[block, slot]
                _box(ax, slot, y, 0.92, 0.92, WARP_COLORS[warp % len(WARP_COLORS)], str(order), 7)
            else:
                _box(ax, slot, y, 0.92, 0.92, FREE_COLOR)
    warps = sorted({w for w, _ in rounds.values()})
    for i, warp in enumerate(warps):
        _box(ax, block_size + 0.6, num_blocks - 1 - i, 0.92, 0.92, WARP_COLORS[warp % len(WARP_COLORS)])
        ax.text(block_size + 1.7, num_blocks - 1 - i + 0.45, f"warp {warp}", va="center", fontsize=7)
    ax.set_xlim(-0.2, block_size + 3.5)
    ax.set_ylim(-0.2, num_blocks)
    ax.set_aspect("equal")
    ax.set_xticks([s + 0.46 for s in range(block_size)], [str(s) for s in range(block_size)], fontsize=6)
    ax.set_yticks([])
    ax.tick_params(length=0)
    ax.set_xlabel("slot in the block")
    ax.grid(False)
    for spine in ax.spines.values():
        spine.set_visible(False)
