"""Chapter 04: the batched sampler -- per-request uniforms, top-k/top-p filtering (ch04.1) and the
inverse-CDF draw (ch04.2).

`position_uniforms` is not an exercise: those tests pass in the student copy too. Tests marked
ch04.1 call `token_probs`, tests marked ch04.2 call `sample_from_probs` directly; `sample()` on a
batch with a sampled row needs both.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm.runner.sampler import (
    SamplingMetadata,
    derive_seed,
    position_uniforms,
    sample,
    sample_from_probs,
    token_probs,
)

U_MAX = 1.0 - 2.0**-53  # the largest value position_uniforms can return


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def probs_of(logits, temperature=1.0, top_k=0, top_p=1.0) -> torch.Tensor:
    """token_probs for one row given as a list."""
    return token_probs(
        torch.tensor([logits], dtype=torch.float64),
        torch.tensor([temperature], dtype=torch.float64),
        torch.tensor([top_k]),
        torch.tensor([top_p], dtype=torch.float64),
    )[0]


def logits_for(probs) -> list[float]:
    return [math.log(p) for p in probs]


def draw(probs, uniforms) -> list[int]:
    probs = torch.tensor(probs, dtype=torch.float64)
    if probs.dim() == 1:
        probs = probs.expand(len(uniforms), -1)
    return sample_from_probs(probs, np.asarray(uniforms, dtype=np.float64)).tolist()


# -- position_uniforms: a pure function of (seed, position, stream) --------------------------------


def test_uniforms_are_a_pure_function() -> None:
    seeds, positions = [0, 1, 5, 2**63 - 1, 5], [0, 0, 17, 3, 18]
    first = position_uniforms(seeds, positions)
    assert first.dtype == np.float64 and first.shape == (5,)
    assert np.array_equal(first, position_uniforms(seeds, positions))
    assert np.array_equal(
        first, position_uniforms(np.array(seeds, dtype=np.uint64), np.array(positions))
    )
    # Each row alone gives the same number as in the batch, and the batch order does not matter.
    for i in range(5):
        assert position_uniforms([seeds[i]], [positions[i]])[0] == first[i]
    order = [3, 0, 4, 2, 1]
    assert np.array_equal(
        position_uniforms([seeds[i] for i in order], [positions[i] for i in order]), first[order]
    )
    # Pinned values: if the hash changed, every seeded request would give different tokens than
    # before.
    assert position_uniforms([5, 0, 2**63 - 1], [17, 0, 123456789]).tolist() == [
        0.02816456642444165,
        0.20310281705476096,
        0.19842125134987587,
    ]
    assert position_uniforms([5], [17], stream=1).tolist() == [0.9044180474275082]


def test_uniforms_are_in_the_unit_interval_and_on_the_53_bit_grid() -> None:
    seeds = np.arange(2000, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)  # large seeds too
    u = position_uniforms(seeds, np.arange(2000) * 1_000_003)
    assert ((0 <= u) & (u < 1)).all()
    assert np.array_equal(u * 2.0**53, np.floor(u * 2.0**53))


def test_different_seeds_positions_and_streams_give_different_numbers() -> None:
    n = 10_000
    by_position = position_uniforms([7] * n, range(n))
    by_seed = position_uniforms(range(n), [7] * n)
    assert len(set(by_position)) == n and len(set(by_seed)) == n
    streams = [position_uniforms([7] * n, range(n), stream=k) for k in (0, 1, 2)]
    for a in range(3):
        for b in range(a + 1, 3):
            assert (streams[a] != streams[b]).mean() > 0.999
    # Seed s at position p is not seed p at position s, nor seed s+1 at position p-1.
    assert position_uniforms([3], [4])[0] != position_uniforms([4], [3])[0]
    assert position_uniforms([3], [4])[0] != position_uniforms([2], [5])[0]


def ks_statistic(u: np.ndarray) -> float:
    u = np.sort(u)
    n = len(u)
    ranks = np.arange(1, n + 1) / n
    return float(max((ranks - u).max(), (u - (ranks - 1 / n)).max()))


@pytest.mark.parametrize(
    "seeds, positions",
    [
        ([123] * 10_000, range(10_000)),  # one request's tokens
        (range(10_000), [0] * 10_000),  # the first token of many requests
        (range(10_000), range(10_000)),
    ],
)
def test_uniforms_look_uniform(seeds, positions) -> None:
    u = position_uniforms(seeds, positions)
    assert abs(u.mean() - 0.5) < 0.02 and abs(u.var() - 1 / 12) < 0.005
    assert ks_statistic(u) < 1.63 / math.sqrt(len(u))  # Kolmogorov-Smirnov at the 1% level
    counts = np.bincount((u * 10).astype(int), minlength=10)
    assert counts.min() > 850 and counts.max() < 1150
    # Neighbouring positions are not correlated.
    assert abs(np.corrcoef(u[:-1], u[1:])[0, 1]) < 0.05


def test_derive_seed() -> None:
    seeds = {derive_seed(0, i) for i in range(1000)} | {derive_seed(1, i) for i in range(1000)}
    assert len(seeds) == 2000 and all(0 <= s < 2**63 for s in seeds)
    assert derive_seed(3, 9) == derive_seed(3, 9)
    assert isinstance(derive_seed(3, 9), int)


# -- token_probs (ch04.1) --------------------------------------------------------------------------


@pytest.mark.exercise("ch04.1")
def test_greedy_rows_are_one_hot_at_the_argmax() -> None:
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.9], [5.0, 5.0, 1.0, 0.0], [-3.0, -2.0, -1.0, -4.0]])
    probs = token_probs(
        logits, torch.zeros(3), torch.tensor([0, 2, 1]), torch.tensor([1.0, 0.5, 0.1])
    )
    assert probs.dtype == torch.float64
    assert probs.tolist() == [[0, 1, 0, 0], [1, 0, 0, 0], [0, 0, 1, 0]]  # a tie goes to the first


@pytest.mark.exercise("ch04.1")
def test_no_filter_is_the_softmax() -> None:
    logits = [1.0, 2.5, -0.5, 0.0, 3.0]
    want = torch.tensor(logits, dtype=torch.float64).softmax(-1)
    assert torch.allclose(probs_of(logits), want, atol=1e-12)
    assert torch.allclose(probs_of(logits, top_k=5), want, atol=1e-12)
    # k larger than the vocabulary
    assert torch.allclose(probs_of(logits, top_k=100), want, atol=1e-12)
    assert torch.allclose(probs_of(logits, top_p=1.0), want, atol=1e-12)


@pytest.mark.exercise("ch04.1")
@pytest.mark.parametrize("temperature", [0.25, 0.8, 1.0, 2.0, 10.0])
def test_temperature_scales_the_logits(temperature: float) -> None:
    logits = [1.0, 2.5, -0.5, 0.0, 3.0]
    want = (torch.tensor(logits, dtype=torch.float64) / temperature).softmax(-1)
    assert torch.allclose(probs_of(logits, temperature), want, atol=1e-12)


@pytest.mark.exercise("ch04.1")
def test_higher_temperature_flattens() -> None:
    logits = [1.0, 2.5, -0.5, 0.0, 3.0]
    entropy = [
        float(-(p * p.clamp_min(1e-300).log()).sum())
        for p in (probs_of(logits, t) for t in (0.1, 0.5, 1.0, 2.0, 8.0))
    ]
    assert entropy == sorted(entropy) and entropy[0] < 0.1 and entropy[-1] > math.log(5) - 0.1


@pytest.mark.exercise("ch04.1")
def test_top_k_one_is_greedy() -> None:
    logits = [0.3, -1.0, 2.2, 2.1, 0.0]
    assert probs_of(logits, temperature=0.7, top_k=1).tolist() == [0, 0, 1, 0, 0]
    assert probs_of(logits, temperature=5.0, top_k=1, top_p=0.3).tolist() == [0, 0, 1, 0, 0]


@pytest.mark.exercise("ch04.1")
@pytest.mark.parametrize("k", [1, 2, 3, 5, 7, 8])
def test_top_k_keeps_exactly_the_k_largest(k: int) -> None:
    g = torch.Generator().manual_seed(k)
    logits = torch.randn(8, generator=g, dtype=torch.float64)
    probs = probs_of(logits.tolist(), temperature=1.3, top_k=k)
    kept = set(torch.nonzero(probs).flatten().tolist())
    assert kept == set(logits.topk(k).indices.tolist())
    # The survivors keep their relative odds, renormalised.
    index = sorted(kept)
    want = (logits[index] / 1.3).softmax(-1)
    assert torch.allclose(probs[index], want, atol=1e-12) and abs(float(probs.sum()) - 1) < 1e-12


@pytest.mark.exercise("ch04.1")
@pytest.mark.parametrize(
    "probs, top_p, kept",
    [
        # The smallest head (in sorted order) whose mass reaches p.
        ([0.5, 0.3, 0.15, 0.05], 0.7, 2),
        ([0.5, 0.3, 0.15, 0.05], 0.8 - 1e-9, 2),
        ([0.5, 0.3, 0.15, 0.05], 0.81, 3),
        ([0.5, 0.3, 0.15, 0.05], 0.5 - 1e-9, 1),
        ([0.5, 0.3, 0.15, 0.05], 0.96, 4),
        ([0.05, 0.15, 0.5, 0.3], 0.7, 2),  # the order in the vocabulary does not matter
        # Exact in binary, so the boundary itself is tested: a head whose mass *equals* p is enough.
        ([0.5, 0.25, 0.125, 0.0625, 0.0625], 0.5, 1),
        ([0.5, 0.25, 0.125, 0.0625, 0.0625], 0.75, 2),
        ([0.5, 0.25, 0.125, 0.0625, 0.0625], 0.875, 3),
        ([0.5, 0.25, 0.125, 0.0625, 0.0625], 0.875 + 1e-9, 4),
        ([0.5, 0.25, 0.125, 0.0625, 0.0625], 1.0, 5),
        ([0.5, 0.25, 0.125, 0.0625, 0.0625], 1e-9, 1),  # the top token always stays
    ],
)
def test_top_p_keeps_the_smallest_head_reaching_p(
    probs: list[float], top_p: float, kept: int
) -> None:
    out = probs_of(logits_for(probs), top_p=top_p)
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    assert [i for i in range(len(probs)) if out[i] > 0] == sorted(order[:kept])
    head = torch.tensor([probs[i] for i in order[:kept]], dtype=torch.float64)
    assert torch.allclose(out[order[:kept]], head / head.sum(), atol=1e-12)


@pytest.mark.exercise("ch04.1")
def test_top_p_is_applied_after_top_k_to_the_renormalised_head() -> None:
    # top-k 2 leaves [0.4, 0.3] -> [4/7, 3/7]; then p = 0.5 is reached by the first token alone.
    # (top-p on the original distribution would have kept two tokens: 0.4 < 0.5.)
    assert probs_of(logits_for([0.4, 0.3, 0.2, 0.1]), top_k=2, top_p=0.5).tolist() == [1, 0, 0, 0]
    # [4/9, 3/9, 2/9]: 7/9 >= 0.7
    out = probs_of(logits_for([0.4, 0.3, 0.2, 0.1]), top_k=3, top_p=0.7)
    assert (out > 0).tolist() == [True, True, False, False]


@pytest.mark.exercise("ch04.1")
def test_rows_are_filtered_independently() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g)
    temps = [0.0, 0.5, 1.0, 1.5, 0.9, 1.0]
    ks = [0, 5, 0, 10, 1, 50]
    ps = [1.0, 1.0, 0.8, 0.5, 1.0, 0.95]
    batch = token_probs(
        logits, torch.tensor(temps), torch.tensor(ks), torch.tensor(ps, dtype=torch.float64)
    )
    for i in range(6):
        alone = token_probs(
            logits[i : i + 1],
            torch.tensor(temps[i : i + 1]),
            torch.tensor(ks[i : i + 1]),
            torch.tensor(ps[i : i + 1], dtype=torch.float64),
        )
        assert torch.allclose(batch[i : i + 1], alone, rtol=0, atol=1e-15)
        assert abs(float(batch[i].sum()) - 1) < 1e-12 and (batch[i] >= 0).all()
    assert [int((row > 0).sum()) for row in batch][0:2] == [1, 5] and int((batch[4] > 0).sum()) == 1


@pytest.mark.exercise("ch04.1")
def test_masked_logits_stay_impossible() -> None:
    logits = torch.tensor([[0.0, float("-inf"), 1.0, float("-inf")]])
    probs = token_probs(
        logits, torch.tensor([1.0]), torch.tensor([0]), torch.tensor([1.0], dtype=torch.float64)
    )
    assert probs[0, 1] == 0 and probs[0, 3] == 0 and not probs.isnan().any()


# -- sample_from_probs (ch04.2) --------------------------------------------------------------------

DYADIC = [0.0, 0.5, 0.0, 0.25, 0.25]  # cumulative 0, .5, .5, .75, 1 -- exact in binary


@pytest.mark.exercise("ch04.2")
@pytest.mark.parametrize(
    "u, token",
    [
        (0.0, 1),  # u = 0 picks the first token with any probability, never the zero before it
        (0.25, 1),
        (0.5 - 2**-53, 1),
        (
            0.5,
            3,
        ),  # the first token whose cumulative probability *exceeds* u: skips the zero at index 2
        (0.75 - 2**-53, 3),
        (0.75, 4),
        (U_MAX, 4),
    ],
)
def test_inverse_cdf_by_hand(u: float, token: int) -> None:
    assert draw(DYADIC, [u]) == [token]


@pytest.mark.exercise("ch04.2")
def test_one_uniform_per_row() -> None:
    probs = torch.tensor(
        [[1.0, 0.0, 0.0], [0.0, 0.0, 1.0], [0.5, 0.5, 0.0], [0.5, 0.5, 0.0]], dtype=torch.float64
    )
    tokens = sample_from_probs(probs, np.array([0.9, 0.1, 0.25, 0.75]))
    assert tokens.dtype == torch.long and tokens.shape == (4,) and tokens.tolist() == [0, 2, 0, 1]
    assert sample_from_probs(probs, torch.tensor([0.9, 0.1, 0.25, 0.75])).tolist() == [0, 2, 0, 1]


@pytest.mark.exercise("ch04.2")
def test_a_row_that_does_not_sum_to_one_is_scaled() -> None:
    # u is a fraction of the row's own total: a round-off shortfall cannot run off the end of the
    # vocabulary.
    assert draw([1.0, 1.0], [0.49, 0.5, U_MAX]) == [0, 1, 1]
    assert draw([0.3, 0.3, 0.0], [0.49, 0.5, U_MAX]) == [0, 1, 1]
    short = [0.1] * 10  # sums to 0.9999999999999999 in floating point
    assert draw(short, [U_MAX]) == [9]


@pytest.mark.exercise("ch04.2")
def test_empirical_frequencies_match_the_probabilities() -> None:
    probs = [0.1, 0.0, 0.2, 0.3, 0.4]
    n = 20_000
    grid = (np.arange(n) + 0.5) / n  # evenly spread uniforms: counts are exact up to one per bucket
    counts = np.bincount(draw(probs, grid), minlength=5)
    assert np.abs(counts - np.array(probs) * n).max() <= 1
    counts = np.bincount(draw(probs, position_uniforms([11] * n, range(n))), minlength=5) / n
    assert counts[1] == 0 and np.abs(counts - probs).max() < 0.015


@pytest.mark.exercise("ch04.2")
@settings(max_examples=300, deadline=None)
@given(
    weights=st.lists(st.one_of(st.just(0.0), st.floats(1e-6, 1.0)), min_size=1, max_size=12).filter(
        lambda w: any(x > 0 for x in w)
    ),
    u=st.one_of(st.floats(0.0, 1.0, exclude_max=True), st.sampled_from([0.0, U_MAX])),
)
def test_never_picks_a_zero_probability_token(weights: list[float], u: float) -> None:
    probs = torch.tensor(weights, dtype=torch.float64)
    probs = probs / probs.sum()
    (token,) = sample_from_probs(probs[None], np.array([u])).tolist()
    assert 0 <= token < len(weights) and weights[token] > 0
    # ... and it is the inverse CDF: the cumulative mass before it is <= u * total < the mass
    # through it.
    cdf = probs.cumsum(0)
    before = float(cdf[token - 1]) if token else 0.0
    assert before <= u * float(cdf[-1]) < float(cdf[token])


# -- sample(): the engine's entry point ------------------------------------------------------------
metadata = SamplingMetadata.from_lists  # temperatures, top_ks, top_ps, seeds, positions


def test_an_all_greedy_batch_is_the_argmax() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, -1.0, 2.5]])
    assert sample(logits, metadata([0.0, 0.0], [0, 5], [1.0, 0.2], [1, 2], [0, 9])) == [1, 2]


ROWS = [  # temperature, top_k, top_p, seed, position
    (0.0, 0, 1.0, 1, 10),
    (0.8, 50, 0.9, 2, 11),
    (1.0, 0, 0.9, 3, 5),
    (0.0, 3, 0.5, 4, 7),
    (1.5, 0, 1.0, 5, 100),
    (0.8, 5, 1.0, 2, 12),
    (1.0, 0, 1.0, 3, 5),  # the same seed and position as row 2, but no top-p
]


def sample_rows(logits: torch.Tensor, rows: list[tuple]) -> list[int]:
    t, k, p, s, pos = zip(*rows)
    return sample(logits, metadata(t, k, p, s, pos))


@pytest.mark.exercise("ch04.1")
@pytest.mark.exercise("ch04.2")
def test_each_row_of_a_mixed_batch_is_sampled_as_if_alone() -> None:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(len(ROWS), 259, generator=g) * 2
    batch = sample_rows(logits, ROWS)
    alone = [sample_rows(logits[i : i + 1], [row])[0] for i, row in enumerate(ROWS)]
    assert batch == alone
    assert batch[0] == int(logits[0].argmax()) and batch[3] == int(logits[3].argmax())
    # Shuffling the batch moves the tokens with their rows.
    order = [4, 2, 6, 0, 5, 1, 3]
    assert sample_rows(logits[order], [ROWS[i] for i in order]) == [batch[i] for i in order]
    # It is exactly the documented pipeline: filter, then inverse CDF with the request's own
    # uniform.
    t, k, p, s, pos = zip(*ROWS)
    f64 = torch.float64
    probs = token_probs(
        logits, torch.tensor(t, dtype=f64), torch.tensor(k), torch.tensor(p, dtype=f64)
    )
    assert sample_from_probs(probs, position_uniforms(s, pos)).tolist() == batch
    assert all(probs[i, tok] > 0 for i, tok in enumerate(batch))


@pytest.mark.exercise("ch04.1")
@pytest.mark.exercise("ch04.2")
def test_sampled_tokens_follow_the_filtered_distribution() -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    n = 20_000
    rows = metadata([0.9] * n, [4] * n, [1.0] * n, [77] * n, range(n))
    tokens = sample(logits.expand(n, -1), rows)
    freq = np.bincount(tokens, minlength=6) / n
    want = probs_of(logits.tolist(), temperature=0.9, top_k=4).numpy()
    assert freq[4] == 0 and freq[5] == 0 and np.abs(freq - want).max() < 0.015
    # Different positions of one request draw different tokens; the same position always the same
    # one.
    assert sample(logits[None], metadata([0.9], [4], [1.0], [77], [123])) == [tokens[123]]


def test_a_tiny_temperature_is_greedy_not_nan() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0], [3.0, 1.0, 0.0]])
    assert sample(logits, metadata([1e-310, 1e-310], [0, 0], [1.0, 1.0], [1, 2], [0, 0])) == [2, 0]
    probs = token_probs(
        logits,
        torch.tensor([1e-300, 1e-300], dtype=torch.float64),
        torch.tensor([0, 0]),
        torch.tensor([1.0, 1.0], dtype=torch.float64),
    )
    assert not probs.isnan().any() and probs.argmax(dim=-1).tolist() == [2, 0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (make gpu-check)")
def test_probs_of_logits_on_the_gpu_are_made_on_the_host() -> None:
    """A GPU runner's logits stay on the GPU; `probs` (chapter 06 calls it on them, the verifier
    and the drafter too) makes its distributions on the host in float64, as `sample` draws."""
    logits = torch.randn(3, 259, generator=torch.Generator().manual_seed(0))
    md = SamplingMetadata.from_lists(
        [0.8, 0.0, 1.3], [0, 0, 20], [0.9, 1.0, 1.0], [1, 2, 3], [0] * 3
    )
    on_gpu = md.probs(logits.cuda())
    assert on_gpu.device.type == "cpu" and on_gpu.dtype == torch.float64
    assert torch.equal(on_gpu, md.probs(logits))
