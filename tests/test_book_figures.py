"""The book's figures read on the page: every text a drawing function writes is at least 9 pt once
the figure is shown as wide as the page, tick labels do not run into each other, and a stepper is as
wide as the page with a slider that reaches every frame.

Each drawing function is drawn with small inputs at the page's width, as the chapters draw it."""

from __future__ import annotations

import re
import struct
from pathlib import Path
from types import SimpleNamespace

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from matplotlib.colors import to_rgba  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from minivllm.book import FREE_COLOR, use_book_style  # noqa: E402
from minivllm.book.figures.blocks import (  # noqa: E402
    block_legend,
    draw_block_pool,
    draw_block_tables,
    label_color,
)
from minivllm.book.figures.kernels import (  # noqa: E402
    draw_cache_reads,
    draw_execution_model,
    draw_work_plan,
)
from minivllm.book.figures.parallel import draw_rank_layout  # noqa: E402
from minivllm.book.figures.preemption import draw_step_pool  # noqa: E402
from minivllm.book.figures.readable import (  # noqa: E402
    PAGE_WIDTH,
    overlapping_tick_labels,
    small_text,
)
from minivllm.book.figures.roadmap import (  # noqa: E402
    BUILT,
    CHAPTERS,
    CURRENT,
    LATER,
    roadmap,
)
from minivllm.book.figures.roadmap import STYLE as ROADMAP_STYLE  # noqa: E402
from minivllm.book.figures.sampling import (  # noqa: E402
    draw_next_token_probs,
    tick_label,
    token_label,
)
from minivllm.book.figures.speculative import (  # noqa: E402
    draw_acceptance_map,
    draw_speculative_round,
)
from minivllm.book.figures.timelines import (  # noqa: E402
    draw_batch_places,
    draw_flat_batch,
    draw_gantt,
    draw_memory_trace,
)
from minivllm.book.stepper import Stepper  # noqa: E402
from minivllm.engine.trace import StepRecord  # noqa: E402
from minivllm.kv.block_manager import BlockManager  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def book_style():
    use_book_style()
    yield
    plt.close("all")


def record(step: int, **fields) -> StepRecord:
    """A step record with nothing in it but `fields`."""
    empty = dict.fromkeys(
        ["admitted", "decoded", "prefilled", "finished", "stalled", "preempted", "resumed"], ()
    )
    counts = dict(num_batched_tokens=0, prefix_hit_tokens=0, recomputed_tokens=0)
    base = empty | counts | dict(running=(), waiting=(), blocks_used=0, blocks_free=8)
    return StepRecord(step=step, **(base | fields))


# Three requests: 0 and 1 run from step 1, 2 waits, 1 is preempted at step 3 and comes back.
TRACE = [
    record(1, admitted=(0, 1), prefilled=((0, 4), (1, 4)), running=(0, 1), waiting=(2,)),
    record(2, decoded=(0, 1), running=(0, 1), waiting=(2,), blocks_used=4, blocks_free=4),
    record(3, decoded=(0,), preempted=(1,), running=(0,), waiting=(1, 2), blocks_used=3),
    record(4, admitted=(1,), resumed=(1,), prefilled=((1, 6),), decoded=(0,), running=(0, 1)),
    record(5, decoded=(0, 1), finished=((0, "length"),), running=(1,), waiting=(2,)),
    record(6, admitted=(2,), prefilled=((2, 4),), decoded=(1,), finished=((1, "stop"),)),
    record(7, decoded=(2,), finished=((2, "length"),), speculated=((2, 4, 2),)),
]


def shared_pool() -> BlockManager:
    """A pool where sequences share blocks (a fork) and one has its own."""
    manager = BlockManager(num_blocks=32, block_size=16)
    manager.allocate(0, 100)
    manager.fork(0, 1)
    manager.allocate(2, 30)
    return manager


def draw_pool_and_tables():
    fig, (tables_ax, pool_ax) = plt.subplots(
        1, 2, figsize=(PAGE_WIDTH, 3.2), gridspec_kw={"width_ratios": [1, 1.2]}
    )
    centres = draw_block_pool(pool_ax, shared_pool(), columns=8)
    draw_block_tables(tables_ax, shared_pool(), pool_ax, centres)
    block_legend(fig, tables=True)
    return fig


def draw_flat():
    batch = SimpleNamespace(
        query_start=np.array([0, 1, 2, 12]),
        positions=np.array([10, 11, *range(10)]),
        slot_mapping=np.array([38, 19, *range(44, 54)]),
        num_decodes=2,
    )
    names = ["w", " ", "<bos>", *"MACBETH:", "<0x0A>"]
    fig, ax = plt.subplots(figsize=(PAGE_WIDTH, 2.2))
    draw_flat_batch(ax, batch, [token_label(n) for n in names], [0, 1, 3])
    return fig


def draw_probs():
    fig, ax = plt.subplots(figsize=(PAGE_WIDTH, 3))
    tokens = [" ", "'", "f", "<0x0A>", "<0xA9>", "<0xB0>", "<0xAF>", "<bos>"]
    series = {f"T={t}": [1 / (i + 1) ** t for i in range(len(tokens))] for t in (1.0, 0.7)}
    draw_next_token_probs(ax, tokens, series)
    return fig


def draw_timelines():
    fig, axes = plt.subplots(3, 1, figsize=(PAGE_WIDTH, 6))
    draw_gantt(axes[0], TRACE)
    draw_batch_places(axes[1], TRACE, 2, "places")
    draw_memory_trace(axes[2], TRACE)
    axes[2].legend(fontsize=9)
    return fig


def draw_speculation():
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(PAGE_WIDTH, 5))
    draw_speculative_round(
        top, ["a", "b", "c", "d"], [0.9, 0.5, 0.1, 0.3], [0.5] * 4, 2, "x", "resampled"
    )
    draw_acceptance_map(bottom, TRACE, seq_id=2, title="request 2")
    return fig


def draw_preemption_step():
    previous, now = (
        BlockManager(num_blocks=6, block_size=1),
        BlockManager(num_blocks=6, block_size=1),
    )
    previous.allocate(0, 3)
    previous.allocate(1, 3)
    now.allocate(0, 4)
    fig, ax = plt.subplots(figsize=(PAGE_WIDTH, 3.4))
    draw_step_pool(ax, now, TRACE[2], {0: "A", 1: "B", 2: "C"}, previous, "B is preempted")
    return fig


def draw_ranks():
    """Chapter 11's layout: 8 query heads over 2 K/V heads at TP 2 and (replicated) TP 4."""
    from minivllm.model.transformer import ModelConfig

    config = ModelConfig(n_heads=8, n_kv_heads=2)
    fig, (two, four) = plt.subplots(
        2, 1, figsize=(PAGE_WIDTH, 4.2), gridspec_kw={"height_ratios": [3.6, 5.6]}
    )
    draw_rank_layout(two, config, 2, shared_pool(), "tensor parallel 2")
    draw_rank_layout(four, config, 4, shared_pool(), "tensor parallel 4")
    return fig


def draw_kernel_launch():
    """Chapter 08's launch hierarchy, at the target model's shapes."""
    fig, ax = plt.subplots(figsize=(PAGE_WIDTH, 3.4))
    draw_execution_model(ax, num_seqs=4, num_heads=8, threads=128, head_dim=32)
    return fig


def draw_kernel_reads():
    """Chapter 08's cache reads: 40 tokens in blocks 5, 2, 7 of 8, two warps taking turns."""
    table, reads = [5, 2, 7], {}
    for token in range(40):
        warp = token % 2
        block, slot = table[token // 16], token % 16
        rows = reads.setdefault(((0, 0, 0), 32 * warp), [])
        rows += [(block, slot, 0, element) for element in range(32)]
    fig, ax = plt.subplots(figsize=(PAGE_WIDTH, 4))
    draw_cache_reads(ax, reads, table, block_size=16, num_blocks=8)
    return fig


def draw_cpu_work_plan():
    """Chapter 07's work plan: decodes and two prefill tiles dealt to two threads."""
    work = np.array([[seq, 0, 1, 0] for seq in range(12)] + [[12, 0, 16, 0], [13, 0, 16, 0]])
    cost = np.array([200.0] * 12 + [1600.0, 1600.0])
    fig, axes = plt.subplots(2, 1, figsize=(PAGE_WIDTH, 3.6), sharex=True)
    draw_work_plan(axes[0], work, np.array([0, 7, 14]), cost, "an even count of units per thread")
    draw_work_plan(axes[1], work, np.array([0, 8, 14]), cost, "plan_work: dealt by cost")
    return fig


FIGURES = [
    draw_kernel_launch,
    draw_kernel_reads,
    draw_cpu_work_plan,
    draw_pool_and_tables,
    draw_flat,
    draw_probs,
    draw_timelines,
    draw_speculation,
    draw_preemption_step,
    draw_ranks,
]


@pytest.mark.parametrize("draw", FIGURES, ids=lambda draw: draw.__name__)
def test_every_text_is_at_least_9_pt_on_the_page(draw) -> None:
    assert small_text(draw()) == []


def test_the_size_check_sees_small_text_and_figures_wider_than_the_page() -> None:
    fig, ax = plt.subplots(figsize=(PAGE_WIDTH, 3))
    ax.set_title("small", fontsize=7)
    assert ("small", 7.0) in small_text(fig)
    fig, ax = plt.subplots(figsize=(2 * PAGE_WIDTH, 3))  # shown at half size on the page
    ax.set_title("shrunk", fontsize=12)
    assert ("shrunk", 6.0) in small_text(fig)
    fig, ax = plt.subplots(figsize=(PAGE_WIDTH, 3))
    ax.axis("off")  # the tick labels of a hidden axis are not drawn
    ax.text(0, 0, "big", fontsize=12)
    assert small_text(fig) == []


def test_token_names_are_printable() -> None:
    assert [token_label(n) for n in [" ", "<0x0A>", "<0xA9>", "a", "<bos>"]] == [
        "␣",
        "↵",
        "0xA9",
        "a",
        "<bos>",
    ]
    assert [tick_label(n) for n in [" ", "<0x0A>", "<0xA9>", "a"]] == [
        "' '",
        "'\\n'",
        "0xA9",
        "'a'",
    ]


def test_token_ticks_do_not_run_together() -> None:
    fig = draw_probs()
    assert overlapping_tick_labels(fig.axes[0]) == []
    # The check itself: twelve raw byte names on a narrow axis do run together.
    fig, ax = plt.subplots(figsize=(4, 2))
    ax.set_xticks(range(12), [f"<0x{0xA0 + i:02X}>" for i in range(12)])
    assert overlapping_tick_labels(ax)


def test_the_flat_batch_draws_a_bracket_per_sequence() -> None:
    ax = draw_flat().axes[0]
    assert len(ax.lines) == 3  # one per sequence's query range
    brackets = sorted(line.get_xdata()[0] for line in ax.lines)
    assert brackets == [0, 1, 2]  # each starts at the sequence's query_start


def png_width(png: bytes) -> int:
    return struct.unpack(">I", png[16:20])[0]


def test_a_stepper_is_page_wide_with_a_slider_step_and_tick_per_frame() -> None:
    import base64

    def draw(step: int):
        fig, ax = plt.subplots(figsize=(PAGE_WIDTH, 2))
        ax.set_title(f"step {step}")
        return fig

    stepper = Stepper(draw, steps=range(0, 50, 5), start=20)
    page = stepper._repr_html_()
    assert png_width(base64.b64decode(stepper.frames[0])) == PAGE_WIDTH * 100  # 100 dpi
    slider = re.search(r'<input type="range"[^>]*>', page).group(0)
    assert 'min="0"' in slider and 'max="9"' in slider and 'step="1"' in slider
    assert 'value="4"' in slider  # step 20 is the fifth frame
    assert "flex: 1" in slider  # the slider takes the row's width, not a fixed few pixels
    assert page.count("<option") == 10  # one tick per frame
    assert page.count("<button") == 2  # one frame back, one forward
    assert "(frame <span>5</span> of 10)" in page


def test_a_stepper_refuses_a_frame_with_text_under_10_pt() -> None:
    def draw(step: int):
        fig, ax = plt.subplots(figsize=(PAGE_WIDTH, 2))
        ax.set_title(f"step {step}", fontsize=11 if step < 2 else 9.5)
        ax.legend(handles=[Patch(color="C0", label="held")], fontsize=10)
        return fig

    assert len(Stepper(draw, steps=[0, 1]).frames) == 2
    with pytest.raises(ValueError, match=r"step 2 has 1 texts under 10.0 pt.*'step 2' at 9.5 pt"):
        Stepper(draw, steps=[0, 1, 2])


def test_a_frame_shrunk_to_the_page_counts_its_text_at_the_shrunk_size() -> None:
    def draw(step: int):
        fig, ax = plt.subplots(figsize=(2 * PAGE_WIDTH, 2))  # shown at half size
        ax.axis("off")
        ax.set_title(f"step {step}", fontsize=16)
        return fig

    with pytest.raises(ValueError, match="'step 0' at 8.0 pt"):
        Stepper(draw, steps=[0])


STEPPER_CELL = re.compile(r"^# %%(?P<meta>[^\n]*)\n(?P<code>(?:(?!# %%).*\n)*?)Stepper\(", re.M)


def test_every_chapter_stepper_is_a_captioned_numbered_figure() -> None:
    """A stepper's caption and its number come from its cell's mystnb figure metadata: a caption
    that says what to drag, and a name (which numbers it and lets the prose refer to it)."""
    found = 0
    for path in sorted((ROOT / "chapters").glob("[0-9][0-9]_*.py")):
        for cell in STEPPER_CELL.finditer(path.read_text()):
            found += 1
            meta = cell.group("meta")
            assert '"caption": "' in meta and "slider" in meta, (path.name, meta)
            assert re.search(r'"name": "fig-\d\d-[\w-]+"', meta), (path.name, meta)
    assert found >= 2  # chapters 03 and 05


def burst_frame(tokens: list[int]):
    """Chapter 05's stepper frame for sequences of `tokens` tokens: the pool and the tables side
    by side, the tables laid out for a run whose longest table has 10 blocks and whose most tables
    are 8."""
    manager = BlockManager(num_blocks=24, block_size=16)
    for seq_id, count in enumerate(tokens):
        manager.allocate(seq_id, count)
    fig = plt.figure(figsize=(PAGE_WIDTH, 4.1), layout="constrained")
    pool_ax, table_ax = fig.subplots(1, 2, gridspec_kw={"width_ratios": [6.1, 10 + 1.6]})
    draw_block_pool(pool_ax, manager, columns=6, title="step 1", label_points=10)
    draw_block_tables(table_ax, manager, width=10, rows=8, label_points=10)
    block_legend(fig, tables=True, loc="outside lower center")
    fig.canvas.draw()
    return fig, table_ax


def test_a_burst_frame_keeps_one_cell_size_and_its_labels_in_their_cells_at_10_pt() -> None:
    """Chapter 05's stepper: every frame's cells the same size and its first table in the same
    place, whatever it holds (the slider flips between frames, so a cell that grew, shrank or
    moved would jump), each label inside its cell, nothing under 10 pt."""
    sizes, tops = set(), set()
    for tokens in ([160, 60, 20], [16] * 8, [100]):
        fig, table_ax = burst_frame(tokens)
        assert small_text(fig, 10) == []
        renderer = fig.canvas.get_renderer()
        cells = [p.get_window_extent(renderer) for p in table_ax.patches]
        labels = [t for t in table_ax.texts if t.get_text().startswith("→")]
        assert len(labels) == len(cells) == sum(-(-n // 16) for n in tokens)
        for cell, label in zip(cells, labels):
            box = label.get_window_extent(renderer)
            assert cell.x0 <= box.x0 and box.x1 <= cell.x1, label.get_text()
            assert cell.y0 <= box.y0 and box.y1 <= cell.y1, label.get_text()
        sizes |= {(round(cell.width), round(cell.height)) for cell in cells}
        tops.add(round(max(cell.y1 for cell in cells)))  # the first table: at the top, always
    assert len(sizes) == 1 and len(tops) == 1


def test_a_cells_label_is_black_or_white_whichever_reads_better() -> None:
    assert label_color("#393b79") == "white"  # the palette's indigo
    assert label_color("#bcbd22") == "black"  # its olive
    assert label_color(FREE_COLOR) == "black"


def forked_pool(samples: int = 4) -> BlockManager:
    """Chapter 08's parallel sampling: one prompt's blocks shared by every sample, each sample
    with a block of its own."""
    manager = BlockManager(num_blocks=48, block_size=16)
    manager.allocate(0, 7 * 16)
    for child in range(1, samples):
        manager.fork(0, child)
    for seq_id in range(samples):
        manager.append(seq_id, 1)  # the first token past the prompt: a block of its own
    return manager


def share_labels_outside_their_cells(ax) -> list[str]:
    """The share-count labels ("0\\n×4") of a drawn pool whose box -- the white plate that lifts
    them off the hatching -- spills out of their cell."""
    renderer = ax.figure.canvas.get_renderer()
    ax.figure.canvas.draw()
    cells = {(round(p.get_x(), 2), round(p.get_y(), 2)): p for p in ax.patches}
    spilled = []
    for text in ax.texts:
        if "×" not in text.get_text():
            continue
        x, y = text.get_position()
        cell = cells[(round(x - 0.46, 2), round(y - 0.46, 2))].get_window_extent(renderer)
        label = text.get_bbox_patch().get_window_extent(renderer)
        if not (cell.x0 - 1 <= label.x0 and label.x1 <= cell.x1 + 1):
            spilled.append(text.get_text())
        if not (cell.y0 - 1 <= label.y0 and label.y1 <= cell.y1 + 1):
            spilled.append(text.get_text())
    return spilled


def test_chapter_08s_share_counts_fit_their_cells_at_a_readable_size() -> None:
    """Chapter 08 draws the pool above the tables, each the page's width: every "×4" sits inside
    its cell at 9 pt or more. Side by side, as the chapter drew them before, they did not."""
    fig, (pool_ax, table_ax) = plt.subplots(2, 1, figsize=(PAGE_WIDTH, 5.4), layout="constrained")
    draw_block_pool(pool_ax, forked_pool(), columns=12)
    draw_block_tables(table_ax, forked_pool())
    block_legend(fig, tables=True, loc="outside lower center")
    assert small_text(fig) == []
    assert share_labels_outside_their_cells(pool_ax) == []
    layout = {"width_ratios": [8.1, 9.6], "wspace": 0.05, "left": 0.01, "right": 0.99}
    fig, (pool_ax, table_ax) = plt.subplots(1, 2, figsize=(PAGE_WIDTH, 3.2), gridspec_kw=layout)
    centres = draw_block_pool(pool_ax, forked_pool(), columns=8)
    draw_block_tables(table_ax, forked_pool(), pool_ax, centres)
    assert share_labels_outside_their_cells(pool_ax)


def test_tables_drawn_with_one_width_share_their_cells() -> None:
    """Chapter 06 draws a block table before the verify and after the rollback, one above the
    other: with the same `width` their cells are the same size and line up."""
    before = BlockManager(num_blocks=32, block_size=4)
    before.allocate(0, 46)  # 12 blocks, the drafts' slots reserved
    after = BlockManager(num_blocks=32, block_size=4)
    after.allocate(0, 43)  # 11 blocks after the rollback
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(PAGE_WIDTH, 2.4))
    draw_block_tables(top, before, width=12)
    draw_block_tables(bottom, after, width=12)
    assert top.get_xlim() == bottom.get_xlim()
    sizes = {text.get_fontsize() for ax in (top, bottom) for text in ax.texts}
    assert len(sizes) == 1 and small_text(fig) == []
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(PAGE_WIDTH, 2.4))
    draw_block_tables(top, before)
    draw_block_tables(bottom, after)  # each as wide as its own table: the cells differ
    assert top.get_xlim() != bottom.get_xlim()


def toc_chapters() -> list[tuple[str, str]]:
    """(slug, part caption) of every chapter in the book's table of contents, in order."""
    import yaml

    toc = yaml.safe_load((ROOT / "book" / "_toc.yml").read_text())
    return [
        (entry["file"].removeprefix("chapters/"), part["caption"])
        for part in toc["parts"]
        for entry in part["chapters"]
        if entry["file"].startswith("chapters/")
    ]


def test_the_roadmap_names_every_chapter_of_the_toc_and_the_chapters_folder_in_order() -> None:
    assert [(c.slug, c.part) for c in CHAPTERS] == toc_chapters()
    on_disk = sorted(path.stem for path in (ROOT / "chapters").glob("[0-9][0-9]_*.py"))
    assert [c.slug for c in CHAPTERS] == on_disk
    assert [c.number for c in CHAPTERS] == list(range(len(CHAPTERS)))


def roadmap_boxes(fig) -> list[tuple[str, object, object]]:
    """(slug, box, label) of each chapter the roadmap draws, in reading order (rows top to bottom,
    each left to right)."""
    ax = fig.axes[0]
    boxes = {p.get_gid().removeprefix("roadmap-"): p for p in ax.patches if p.get_gid()}
    labels = {t.get_gid().removeprefix("roadmap-label-"): t for t in ax.texts if t.get_gid()}
    order = sorted(boxes, key=lambda slug: (-boxes[slug].get_y(), boxes[slug].get_x()))
    return [(slug, boxes[slug], labels[slug]) for slug in order]


@pytest.mark.parametrize("chapter", [0, 3, 11])
def test_the_roadmap_reads_in_order_with_the_current_chapter_highlighted(chapter) -> None:
    fig = roadmap(chapter)
    drawn = roadmap_boxes(fig)
    assert [slug for slug, _, _ in drawn] == [slug for slug, _ in toc_chapters()]
    for slug, box, label in drawn:
        number = int(slug[:2])
        assert f"{number:02d}" in label.get_text()
        expected = BUILT if number < chapter else CURRENT if number == chapter else LATER
        assert box.get_facecolor() == to_rgba(ROADMAP_STYLE[expected]["facecolor"])
        assert (label.get_fontweight() == "bold") == (number == chapter)
        assert ("✓" in label.get_text()) == (number < chapter)
    assert small_text(fig) == []
    assert fig.get_figwidth() == PAGE_WIDTH and fig.get_figheight() <= 2  # wide and low
    assert f"chapter {chapter:02d}" in fig.texts[0].get_text()


def test_the_roadmaps_labels_sit_inside_their_boxes() -> None:
    fig = roadmap(4)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for slug, box, label in roadmap_boxes(fig):
        outer, inner = box.get_window_extent(renderer), label.get_window_extent(renderer)
        assert outer.x0 < inner.x0 and inner.x1 < outer.x1, slug
        assert outer.y0 < inner.y0 and inner.y1 < outer.y1, slug


def test_the_roadmap_refuses_a_chapter_the_book_has_not() -> None:
    with pytest.raises(ValueError, match="chapter 12 is not one of the book's chapters"):
        roadmap(12)


ROADMAP_CELL = re.compile(
    r'^# %% tags=\["remove-input"\] mystnb=\{"image": \{"alt": "(?P<alt>[^"]+)"\}\}\n'
    r"from minivllm\.book\.figures\.roadmap import roadmap\n\nroadmap\((?P<chapter>\d+)\)\n",
    re.M,
)


def test_every_chapter_opens_with_its_own_roadmap_its_code_removed_from_the_page() -> None:
    for chapter in CHAPTERS:
        source = (ROOT / "chapters" / f"{chapter.slug}.py").read_text()
        cells = re.split(r"^(?=# %%)", source, flags=re.M)
        first_code = next(i for i, cell in enumerate(cells) if cell.startswith("# %%") and i > 1)
        cell = ROADMAP_CELL.match(cells[first_code])
        assert cell, f"{chapter.slug}: its first code cell is not the roadmap"
        assert int(cell.group("chapter")) == chapter.number
        assert f"chapter {chapter.number:02d} highlighted" in cell.group("alt")
