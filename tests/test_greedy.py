"""runner/greedy.py: a greedy step's argmax in vector lanes is torch's argmax, index for index."""

from __future__ import annotations

import pytest
import torch

from minivllm.runner import greedy
from minivllm.runner.sampler import SamplingMetadata, greedy_tokens, sample

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("width", [1, 7, 63, 64, 65, 127, 128, 129, 4096, 4096 + 37, 151_936])
def test_the_first_largest_is_torchs_argmax_ties_included(width: int) -> None:
    """Values from a handful, so most rows tie for their maximum in several blocks and in the
    tail; some rows hold -inf and both zeros. The first occurrence wins, as in torch."""
    generator = torch.Generator().manual_seed(width)
    rows = torch.randint(0, 6, (24, width), generator=generator).float()
    rows[1] = float("-inf")  # a row with nothing finite: index 0, as torch gives
    rows[2, : width // 2] = float("-inf")
    rows[3] = 0.0
    rows[3, width // 3 :: 2] = -0.0  # -0.0 and 0.0 compare equal: the first of either
    rows[4] = torch.randn(width, generator=generator)  # one largest, anywhere
    rows[5] = -torch.rand(width, generator=generator)  # all negative
    assert greedy.first_largest(rows) == rows.argmax(dim=-1).tolist()


def test_a_later_equal_maximum_does_not_replace_the_first() -> None:
    width = 10 * greedy.BLOCK + 5
    row = torch.zeros(1, width)
    for column in (3 * greedy.BLOCK + 17, 7 * greedy.BLOCK, width - 1):  # blocks 3, 7; the tail
        row[0, column] = 2.0
    assert greedy.first_largest(row) == [3 * greedy.BLOCK + 17]
    row[0, width - 2] = 3.0  # larger, in the tail
    assert greedy.first_largest(row) == [width - 2]


def test_a_view_of_rows_is_read_as_its_values() -> None:
    """The sampler's logits may be a slice or a transposed view: the rows are made contiguous."""
    full = torch.randn(8, 2 * greedy.MIN_VOCAB, generator=torch.Generator().manual_seed(1))
    for view in (full[::2], full[:, 3:], full.t().contiguous().t()):
        assert greedy.first_largest(view) == view.argmax(dim=-1).tolist()


def test_only_float32_cpu_logits_of_a_real_vocabulary_take_it() -> None:
    assert greedy.takes(torch.zeros(2, greedy.MIN_VOCAB))
    assert not greedy.takes(torch.zeros(2, greedy.MIN_VOCAB - 1))  # the book's 259 bytes: torch
    assert not greedy.takes(torch.zeros(2, greedy.MIN_VOCAB, dtype=torch.float64))
    assert not greedy.takes(torch.zeros(greedy.MIN_VOCAB))
    assert not greedy.takes(torch.zeros(2, greedy.MIN_VOCAB, device="meta"))


def test_an_all_greedy_batch_of_a_real_vocabulary_samples_its_argmax(monkeypatch) -> None:
    """`sample` takes the compiled path for such logits, and its tokens are torch's argmax."""
    calls = []
    monkeypatch.setattr(greedy, "first_largest", lambda x: calls.append(x) or x.argmax(-1).tolist())
    logits = torch.randn(3, greedy.MIN_VOCAB, generator=torch.Generator().manual_seed(2))
    # temperatures, top_ks, top_ps, seeds, positions: three greedy rows
    metadata = SamplingMetadata.from_lists([0.0] * 3, [0] * 3, [1.0] * 3, [1, 2, 3], [5] * 3)
    assert sample(logits, metadata) == logits.argmax(dim=-1).tolist()
    assert len(calls) == 1
    monkeypatch.undo()
    assert greedy_tokens(logits) == logits.argmax(dim=-1).tolist()


def test_a_row_holding_a_nan_gets_an_index_inside_it() -> None:
    """The sampler sets such rows aside before any argmax; called directly, the search stays in
    the row."""
    rows = torch.zeros(3, greedy.MIN_VOCAB + 5)
    rows[0, 0] = float("nan")
    rows[1, -1] = float("nan")
    rows[2] = float("nan")
    assert all(0 <= i < rows.shape[1] for i in greedy.first_largest(rows))
