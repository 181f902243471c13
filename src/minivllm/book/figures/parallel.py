"""Tensor parallelism's rank layout (chapter 11): which query heads, K/V heads and cache blocks
each rank holds.

One band per rank: its query heads and K/V heads filled (the rest left empty, held by another
rank), each query head in the colour of the K/V head it reads; then the K/V pool, the same block
table on every rank, blocks coloured by sequence id as in every chapter -- each rank keeps, in
every block, the K/V of its own heads only.
"""

from __future__ import annotations

from matplotlib.axes import Axes
from matplotlib.patches import Rectangle

from minivllm.book import FREE_COLOR, sequence_color
from minivllm.book.figures.blocks import block_owners
from minivllm.book.figures.readable import MIN_POINTS
from minivllm.kv.block_manager import BlockManager
from minivllm.model.parallel import Shard
from minivllm.model.transformer import ModelConfig

# K/V head colours: apart from the sequence palette, which colours the blocks
HEAD_COLORS = ["#c6dbef", "#fdd0a2", "#c7e9c0", "#dadaeb", "#fcbba1", "#d9d9d9", "#f2e6a6"]
EMPTY_EDGE = "#b0b0b0"


def _box(ax: Axes, x: float, y: float, color: str | None, label: str, size: float) -> None:
    ax.add_patch(
        Rectangle(
            (x, y),
            0.9,
            0.9,
            facecolor=color or "white",
            edgecolor="white" if color else EMPTY_EDGE,
            linestyle="-" if color else ":",
        )
    )
    ax.text(
        x + 0.45,
        y + 0.45,
        label,
        ha="center",
        va="center",
        fontsize=size,
        color="black" if color else EMPTY_EDGE,
    )


def draw_rank_layout(
    ax: Axes, config: ModelConfig, world: int, manager: BlockManager, title: str = ""
) -> None:
    """`world` ranks of `config`, one band each: held query heads (coloured by their K/V head),
    held K/V heads, and `manager`'s pool (blocks coloured by sequence, free blocks grey)."""
    group = config.n_heads // config.n_kv_heads  # query heads per K/V head
    owners = block_owners(manager)
    num_blocks = manager.allocator.num_blocks
    kv_x = config.n_heads + 0.6
    pool_x = kv_x + config.n_kv_heads + 0.6
    size = MIN_POINTS
    for rank in range(world):
        shard = Shard(rank, world)
        y = world - 1 - rank
        q_first, q_count = shard.query_heads(config)
        kv_first, kv_count = shard.kv_heads(config)
        for head in range(config.n_heads):
            held = q_first <= head < q_first + q_count
            color = HEAD_COLORS[head // group % len(HEAD_COLORS)] if held else None
            _box(ax, head, y, color, f"q{head}", size)
        for head in range(config.n_kv_heads):
            held = kv_first <= head < kv_first + kv_count
            color = HEAD_COLORS[head % len(HEAD_COLORS)] if held else None
            _box(ax, kv_x + head, y, color, f"kv{head}", size)
        for block in range(num_blocks):
            seqs = owners.get(block)
            color = sequence_color(seqs[0]) if seqs else FREE_COLOR
            _box(ax, pool_x + block, y, color, str(block), size)
        ax.text(-0.3, y + 0.45, f"rank {rank}", ha="right", va="center", fontsize=10)
    top = world + 0.15
    ax.text(config.n_heads / 2, top, "query heads", ha="center", va="bottom", fontsize=10)
    ax.text(kv_x + config.n_kv_heads / 2, top, "K/V\nheads", ha="center", va="bottom", fontsize=10)
    ax.text(
        pool_x + num_blocks / 2,
        top,
        "K/V pool (its own\nheads of each block)",
        ha="center",
        va="bottom",
        fontsize=10,
    )
    ax.set_xlim(-2.2, pool_x + num_blocks + 0.1)
    ax.set_ylim(-0.2, world + 1.6)
    ax.set_aspect("equal")
    ax.axis("off")
    if title:
        ax.set_title(title, fontsize=11, loc="left")
