"""Figures of the engine over time (chapters 04, 05, 08): who ran in which step, and a step's
flattened batch.

`draw_gantt` colours each request's state per step from a trace (waiting, prefill, decode,
preempted, recompute ...), `draw_batch_places` shows which batch places were busy,
`draw_flat_batch` lays one step's tokens end to end with their positions and cache slots, and
`draw_memory_trace` plots a trace's three memory series (pool used, reserved slots empty, blocks
saved by sharing).
"""

from __future__ import annotations

from matplotlib.axes import Axes
from matplotlib.patches import Rectangle

from minivllm.book import sequence_color

# How each request state is drawn in a timeline: (alpha of the sequence's colour, hatch); None =
# grey.
_STATE_STYLE = {
    "decode": (1.0, None),
    "prefill": (1.0, "////"),
    "unscheduled": (0.35, None),
    "stalled": (0.35, "xx"),
    "preempted": (None, "xx"),
    "waiting": (None, None),
    "recompute": (0.6, "\\\\"),
}


def draw_gantt(ax: Axes, records, title: str = "requests over steps", label_every: int = 1) -> None:
    """One row per request, one cell per step: grey while waiting, hatched while its prompt is
    prefilled, solid while it decodes, pale while running but not scheduled (stalled: crossed);
    grey and crossed once preempted, pale and back-hatched while it recomputes."""
    from minivllm.engine.trace import request_timeline

    timeline = request_timeline(records)
    seq_ids = sorted(timeline)
    for row, seq_id in enumerate(seq_ids):
        y = len(seq_ids) - 1 - row
        for step, state in sorted(timeline[seq_id].items()):
            alpha, hatch = _STATE_STYLE[state]
            color = "#d9d9d9" if alpha is None else sequence_color(seq_id)
            ax.add_patch(
                Rectangle(
                    (step - 0.5, y),
                    1,
                    0.8,
                    facecolor=color,
                    alpha=alpha or 1.0,
                    hatch=hatch,
                    edgecolor="white" if hatch else "none",
                    lw=0,
                )
            )
    ax.gantt_steps = max((max(t) for t in timeline.values()), default=1)
    # Axes sharing x (`sharex=True`) share one limit: fit the longest run drawn on any of them, or a
    # shorter run drawn second would clip the longer one above it.
    siblings = ax.get_shared_x_axes().get_siblings(ax)
    ax.set_xlim(0.5, max(getattr(a, "gantt_steps", 0) for a in siblings) + 0.5)
    ax.set_ylim(-0.2, len(seq_ids))
    ticks = [y for y in range(len(seq_ids)) if (len(seq_ids) - 1 - y) % label_every == 0]
    ax.set_yticks(
        [y + 0.4 for y in ticks],
        [f"req {seq_ids[len(seq_ids) - 1 - y]}" for y in ticks],
        fontsize=9,
    )
    ax.set_xlabel("engine step")
    ax.grid(False)
    ax.set_title(title, fontsize=10)


def draw_flat_batch(ax: Axes, batch, token_text: list[str], seq_ids: list[int]) -> None:
    """The flattened batch of one step: each new token a cell coloured by its sequence, with its
    position above and its cache slot below; a bracket over each sequence's query range
    (`query_start[i]:query_start[i + 1]`, its rows of the batch), labelled with the sequence id."""
    starts = batch.query_start.tolist()
    for i, seq_id in enumerate(seq_ids):
        color = sequence_color(seq_id)
        for row in range(starts[i], starts[i + 1]):
            ax.add_patch(Rectangle((row, 0), 0.94, 1, facecolor=color, alpha=0.85))
            text = token_text[row]
            ax.text(row + 0.47, 0.5, text, ha="center", va="center", color="white", fontsize=9)
            ax.text(row + 0.47, 1.12, str(int(batch.positions[row])), ha="center", va="bottom")
            ax.text(
                row + 0.47,
                -0.12,
                str(int(batch.slot_mapping[row])),
                ha="center",
                va="top",
                color="#555555",
            )
        _bracket(ax, starts[i], starts[i + 1] - 0.06, 1.75, color)
        ax.text((starts[i] + starts[i + 1] - 0.06) / 2, 1.8, str(seq_id), ha="center", color=color)
    # Over the brackets, which of them decode (one token each) and which prefill a chunk.
    for kind, first, last in (
        ("decodes", 0, batch.num_decodes),
        ("prefill", batch.num_decodes, len(seq_ids)),
    ):
        if last > first:
            middle = (starts[first] + starts[last] - 0.06) / 2
            ax.text(middle, 2.35, kind, ha="center", weight="bold")
    ax.text(-0.3, 1.8, "sequence", ha="right")
    ax.text(-0.3, 1.12, "position", ha="right", va="bottom")
    ax.text(-0.3, 0.5, "token", ha="right", va="center")
    ax.text(-0.3, -0.12, "slot", ha="right", va="top", color="#555555")
    ax.set_xlim(-1.9, starts[-1])
    ax.set_ylim(-0.75, 2.9)
    ax.axis("off")


def _bracket(ax: Axes, left: float, right: float, y: float, color: str) -> None:
    """A square bracket opening downwards from `left` to `right` at height `y`."""
    ax.plot([left, left, right, right], [y - 0.15, y, y, y - 0.15], color=color, lw=1.5)


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
    ax.set_yticks(
        [places - 1 - r + 0.45 for r in range(places)], [f"place {r}" for r in range(places)]
    )
    ax.set_xlabel("engine step")
    ax.grid(False)
    ax.set_title(title, fontsize=10)


# The memory series of a step trace: (StepRecord property, label, colour).
_MEMORY_SERIES = (
    ("kv_utilization", "pool in use (blocks used / all)", sequence_color(0)),
    ("fragmentation", "reserved slots empty", sequence_color(3)),
    ("saved_fraction", "blocks saved by sharing", sequence_color(2)),
)


def draw_memory_trace(ax: Axes, records, title: str = "KV memory over steps") -> None:
    """The three memory series of a trace, one point per engine step, each a fraction in [0, 1]:
    the pool's blocks in use, the reserved slots that hold no token (internal fragmentation), and
    the blocks that sharing saved (prefix-cache hits, forks)."""
    steps = [r.step for r in records]
    for name, label, color in _MEMORY_SERIES:
        ax.plot(steps, [getattr(r, name) for r in records], color=color, lw=1.2, label=label)
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("engine step")
    ax.set_ylabel("fraction")
    ax.set_title(title, fontsize=10)
