"""Figures of sampling (chapter 04): how temperature, top-k and top-p reshape one distribution.

Tokens are named so a reader can read them: a space as ␣ (in a cell) or ' ' (on an axis), a new line
as ↵, and a byte that is no character on its own (part of a multi-byte UTF-8 character) by its hex
value.
"""

from __future__ import annotations

import re

from matplotlib.axes import Axes

from minivllm.book import sequence_color

_BYTE = re.compile(r"^<0x([0-9A-F]{2})>$")


def token_label(name: str) -> str:
    """A tokenizer's printable name for a token (`token_repr`), shortened for a figure's cell or
    tick: ␣ for a space, ↵ for a new line, and 0xA9 for a lone byte."""
    if name == " ":
        return "␣"
    if name == "<0x0A>":
        return "↵"
    byte = _BYTE.match(name)
    return f"0x{byte.group(1)}" if byte else name


def tick_label(name: str) -> str:
    """A token's name on an axis, where a lone glyph is easy to miss: a character quoted (' ' is a
    space), a new line as '\\n', a lone byte as 0xA9, a special token as it is."""
    if name == "<0x0A>":
        return repr("\n")
    return repr(name) if len(name) == 1 else token_label(name)


def draw_next_token_probs(ax: Axes, tokens: list[str], series: dict[str, list[float]]) -> None:
    """Grouped bars: for each token (x, in the order given, named by the tokenizer's `token_repr`)
    the probability each setting in `series` (name -> probabilities, one per token) gives it; one
    colour per setting."""
    width = 0.8 / max(len(series), 1)
    for k, (name, probs) in enumerate(series.items()):
        offset = (k - (len(series) - 1) / 2) * width
        ax.bar(
            [x + offset for x in range(len(tokens))],
            probs,
            width=width,
            color=sequence_color(k),
            label=name,
        )
    ax.set_xticks(range(len(tokens)), [tick_label(token) for token in tokens])
    lone_bytes = any(_BYTE.match(token) for token in tokens)
    ax.set_xlabel("next token" + (" (0xNN: one byte of a longer character)" if lone_bytes else ""))
    ax.set_ylabel("probability")
    ax.grid(axis="x", visible=False)
    ax.legend(fontsize=9)
