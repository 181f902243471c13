"""Figures of speculative decoding (chapter 06): one draft-and-verify round, and which drafts
were accepted step by step.
"""

from __future__ import annotations

from matplotlib.axes import Axes
from matplotlib.patches import Rectangle

ACCEPTED_COLOR, REJECTED_COLOR, UNCHECKED_COLOR, TARGET_COLOR = (
    "#2ca02c",
    "#d62728",
    "#d9d9d9",
    "#1f77b4",
)


def draw_speculative_round(
    ax: Axes,
    drafted: list[str],
    p: list[float],
    q: list[float],
    num_accepted: int,
    final: str,
    final_kind: str,
) -> None:
    """One round: for each draft token, the target's p(token) and the draft's q(token) side by side,
    the column shaded by its fate (accepted, the first rejection, or never checked), then the token
    the target adds itself (`final_kind`: "resampled" after a rejection, or "bonus")."""
    for i, (text, p_t, q_t) in enumerate(zip(drafted, p, q)):
        fate = (
            ACCEPTED_COLOR
            if i < num_accepted
            else REJECTED_COLOR
            if i == num_accepted
            else UNCHECKED_COLOR
        )
        ax.axvspan(i - 0.45, i + 0.45, color=fate, alpha=0.15, lw=0)
        ax.bar(
            i - 0.17, p_t, width=0.32, color=TARGET_COLOR, label="p (target)" if i == 0 else None
        )
        ax.bar(i + 0.17, q_t, width=0.32, color="#ff7f0e", label="q (draft)" if i == 0 else None)
        verdict = "accept" if i < num_accepted else "reject" if i == num_accepted else "unchecked"
        ax.text(i, 1.04, f"{text!r}\n{verdict}", ha="center", fontsize=9)
    end = len(drafted)
    at = num_accepted if num_accepted < end else end
    ax.annotate(
        f"{final_kind}\n{final!r}",
        xy=(at, 0.5),
        xytext=(end + 0.6, 0.5),
        fontsize=9,
        ha="center",
        va="center",
        color=TARGET_COLOR,
        arrowprops=dict(arrowstyle="->", color=TARGET_COLOR, lw=0.8),
    )
    ax.set_xlim(-0.6, end + 1.2)
    ax.set_ylim(0, 1.22)
    ax.set_xticks(range(end), [f"draft {i + 1}" for i in range(end)])
    ax.set_ylabel("probability of the draft token")
    ax.legend(loc="upper right", bbox_to_anchor=(1.0, 0.92), fontsize=9)
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
                color = (
                    ACCEPTED_COLOR
                    if row < accepted
                    else REJECTED_COLOR
                    if row == accepted
                    else UNCHECKED_COLOR
                )
                ax.add_patch(Rectangle((column, row), 0.9, 0.9, color=color, lw=0))
            if accepted < proposed:
                ax.plot(column + 0.45, accepted + 0.45, "o", color=TARGET_COLOR, markersize=3)
            else:
                ax.add_patch(Rectangle((column, proposed), 0.9, 0.9, color=TARGET_COLOR, lw=0))
            column += 1
    ax.set_xlim(0, max(column, 1))
    ax.set_ylim(
        0, max((p for r in records for s, p, _ in r.speculated if s == seq_id), default=1) + 1.2
    )
    ax.set_xlabel("verify pass (one target forward)")
    ax.set_ylabel("draft position")
    ax.grid(False)
    ax.set_title(title, fontsize=10)
