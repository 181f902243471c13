"""Chapter 06: speculative decoding -- the acceptance rule, verify, the drafters, and the engine
with them.

The load-bearing claims, each tested so that it could fail:

* Greedy: speculation changes the work, never the tokens. With the shipped draft (for every k from 1
  to 8),
  with a useless draft (random weights, or the draft with its output rows shuffled) and with the
  n-gram drafter, every request's tokens are the plain engine's. The traces show that drafts really
  were accepted (or, for the useless drafts, that none were), so the identity is not vacuous.
* Sampling: every emitted token has the target's distribution. Chi-square goodness of fit on
  synthetic p
  and q (q != p, with zeros on both sides), for the first token and for the joint (first, next) --
  through `verify` and the random streams the engine uses -- and the same test rejects three
  tempting wrong rules, so it has the power to fail. End to end, the first speculative token of the
  real models agrees with the target's own distribution.
* The edges: EOS, a stop token or a stop string inside an accepted run ends the request right there;
  max_tokens is never passed; all blocks come back; seeded tokens do not depend on the batch or on
  preemption; prefix caching and speculation together keep the tokens.

The tests marked ch06.1 grade `accept_or_resample` on hand-made rows (the chi-square tests count
too: they run the rule through `verify`). Those marked ch06.3 grade verify's loop on hand-made
logits: all drafts kept -> the bonus token; the first rejection -> the resampled token there and
nothing after it; greedy runs are the target's argmax chain; each sequence's run is its own
whatever the batch; sampled runs are a function of (seed, position). `BlockManager.truncate`
(ch06.2) is graded in test_block_allocator.py.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from minivllm.book.stats import chi_square
from minivllm.engine.config import EngineConfig
from minivllm.engine.llm_engine import LLM, LLMEngine
from minivllm.engine.processing import RequestOutput
from minivllm.model.checkpoint import load_model
from minivllm.model.tokenizer import BOS_ID, EOS_ID, ByteTokenizer
from minivllm.model.transformer import ModelConfig, Transformer, init_weights
from minivllm.runner import speculative
from minivllm.runner.sampler import (
    SamplingMetadata,
    position_uniforms,
    sample,
    sample_from_probs,
)
from minivllm.runner.speculative import (
    STREAM_ACCEPT,
    STREAM_DRAFT,
    STREAM_RESIDUAL,
    NgramDrafter,
    Proposal,
    SpeculativeConfig,
    accept_or_resample,
    verify,
)
from minivllm.sched.scheduler import SchedulerConfig
from minivllm.sched.sequence import SamplingParams, Sequence

tok = ByteTokenizer()
ch06_1 = pytest.mark.exercise("ch06.1")
ch06_3 = pytest.mark.exercise("ch06.3")

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def goodness_of_fit(counts: np.ndarray, probs: np.ndarray) -> float:
    """p-value of the counts against the distribution (`minivllm.book.stats.chi_square`). Cells with
    probability 0 must be empty (asserted: one such count is already proof of a wrong sampler)."""
    counts, probs = (
        np.asarray(counts, dtype=np.float64).ravel(),
        np.asarray(probs, dtype=np.float64).ravel(),
    )
    impossible = np.flatnonzero((probs == 0) & (counts > 0))
    assert not impossible.size, f"tokens emitted where the target gives probability 0: {impossible}"
    return chi_square(counts, probs)[2]


# -- the acceptance rule on hand-made rows (ch06.1) ------------------------------------------------

ALMOST_ONE = 1.0 - 2.0**-53  # the largest uniform position_uniforms can return


def rows(*dists) -> torch.Tensor:
    return torch.tensor(dists, dtype=torch.float64)


def rule(p, q, drafted, u_accept, u_residual) -> tuple[list[bool], list[int]]:
    """accept_or_resample on plain lists; checks the types and shapes of what comes back."""
    n = len(drafted)
    accepted, resampled = accept_or_resample(
        torch.as_tensor(p, dtype=torch.float64),
        torch.as_tensor(q, dtype=torch.float64),
        torch.tensor(drafted, dtype=torch.long),
        torch.tensor(u_accept, dtype=torch.float64),
        torch.tensor(u_residual, dtype=torch.float64),
    )
    assert accepted.dtype == torch.bool and accepted.shape == (n,)
    assert resampled.dtype == torch.long and resampled.shape == (n,)
    return accepted.tolist(), resampled.tolist()


P4 = [0.1, 0.4, 0.3, 0.2]
Q4 = [0.3, 0.2, 0.3, 0.2]  # p > q at 1, p == q at 2 and 3, p < q at 0


@ch06_1
def test_a_draft_at_least_as_likely_under_p_is_always_accepted() -> None:
    # tokens 1 (p > q), 2 and 3 (p == q), with the most hostile uniform there is
    accepted, _ = rule([P4] * 3, [Q4] * 3, [1, 2, 3], [ALMOST_ONE] * 3, [0.5] * 3)
    assert accepted == [True, True, True]
    generator = torch.Generator().manual_seed(0)
    p = torch.rand(200, 7, generator=generator, dtype=torch.float64).softmax(-1)
    q = torch.rand(200, 7, generator=generator, dtype=torch.float64).softmax(-1)
    drafted = (p - q).argmax(-1)  # the token where p exceeds q most: p(t) > q(t)
    accepted, _ = rule(p, q, drafted.tolist(), [ALMOST_ONE] * 200, [0.0] * 200)
    assert all(accepted)


@ch06_1
def test_acceptance_probability_is_min_1_p_over_q() -> None:
    # token 0: p/q = 1/3. Sweep u over a fine grid: the accepted fraction must be 1/3 (to the grid's
    # step).
    m = 3000
    u = [(i + 0.5) / m for i in range(m)]
    accepted, _ = rule([P4] * m, [Q4] * m, [0] * m, u, [0.5] * m)
    assert sum(accepted) == pytest.approx(m / 3, abs=1)


@ch06_1
def test_a_draft_the_drafter_gave_no_probability_is_rejected_and_resampled_from_the_residual() -> (
    None
):
    p, q = [0.5, 0.25, 0.25, 0.0], [0.0, 0.5, 0.5, 0.0]
    m = 400
    u = [(i + 0.5) / m for i in range(m)]
    accepted, resampled = rule([p] * m, [q] * m, [0] * m, [0.0] * m, u)
    assert not any(accepted)  # q(0) = 0: it cannot have been drawn from q; even u = 0 rejects it
    assert set(resampled) == {0}  # the residual max(0, p - q) = (0.5, 0, 0, 0)


@ch06_1
def test_a_draft_the_target_gives_no_probability_is_always_rejected() -> None:
    p, q = [0.0, 0.5, 0.5, 0.0], [0.25, 0.25, 0.25, 0.25]
    accepted, resampled = rule(
        [p] * 4, [q] * 4, [0, 3, 0, 3], [0.0, 0.0, 0.5, 0.9], [0.0, 0.3, 0.6, ALMOST_ONE]
    )
    assert accepted == [False] * 4
    assert set(resampled) <= {1, 2}


@ch06_1
def test_the_residual_draw_is_norm_max_0_p_minus_q() -> None:
    p, q = (
        [0.1, 0.4, 0.3, 0.0, 0.2],
        [0.3, 0.1, 0.3, 0.2, 0.1],
    )  # residual (0, 0.3, 0, 0, 0.1) / 0.4
    m = 4000
    u = [(i + 0.5) / m for i in range(m)]
    _, resampled = rule([p] * m, [q] * m, [0] * m, [ALMOST_ONE] * m, u)
    counts = np.bincount(resampled, minlength=5)
    assert counts[[0, 2, 3]].sum() == 0  # never a token where p <= q
    assert counts[1] == pytest.approx(0.75 * m, abs=1) and counts[4] == pytest.approx(
        0.25 * m, abs=1
    )
    # Random rows: the resampled token always has p > q.
    generator = torch.Generator().manual_seed(1)
    p = torch.rand(500, 9, generator=generator, dtype=torch.float64) ** 3
    q = torch.rand(500, 9, generator=generator, dtype=torch.float64) ** 3
    p, q = p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)
    u = torch.rand(500, generator=generator, dtype=torch.float64)
    _, resampled = rule(p, q, [0] * 500, [ALMOST_ONE] * 500, u.tolist())
    chosen = torch.tensor(resampled).view(-1, 1)
    assert (p.gather(1, chosen) > q.gather(1, chosen)).all()


@ch06_1
def test_p_equal_to_q_gives_no_nan_and_falls_back_to_p() -> None:
    p = [0.25, 0.0, 0.5, 0.25]
    m = 400
    u = [(i + 0.5) / m for i in range(m)]
    accepted, resampled = rule([p] * m, [p] * m, [2] * m, [ALMOST_ONE] * m, u)
    assert all(accepted)  # p(t) / q(t) = 1
    # The residual is all zeros; should round-off ever reject, the row falls back to p itself.
    counts = np.bincount(resampled, minlength=4)
    assert counts[1] == 0 and counts[[0, 2, 3]] == pytest.approx([m / 4, m / 2, m / 4], abs=1)


@ch06_1
def test_greedy_one_hot_rows_accept_iff_the_draft_is_the_argmax() -> None:
    v = 6
    one_hot = torch.eye(v, dtype=torch.float64)
    targets, drafts = [0, 3, 5, 5, 1], [0, 2, 5, 1, 4]
    accepted, resampled = rule(
        one_hot[targets],
        one_hot[drafts],
        drafts,
        [ALMOST_ONE, 0.0, 0.5, 0.0, 0.7],
        [0.0, 0.99, 0.5, 0.3, 0.0],
    )
    assert accepted == [t == d for t, d in zip(targets, drafts)]
    assert [r for r, a in zip(resampled, accepted) if not a] == [3, 5, 1]  # the target's argmax


@ch06_1
def test_rows_are_independent() -> None:
    generator = torch.Generator().manual_seed(2)
    p = torch.rand(64, 5, generator=generator, dtype=torch.float64).softmax(-1)
    q = torch.rand(64, 5, generator=generator, dtype=torch.float64).softmax(-1)
    drafted = torch.randint(0, 5, (64,), generator=generator)
    ua = torch.rand(64, generator=generator, dtype=torch.float64)
    ur = torch.rand(64, generator=generator, dtype=torch.float64)
    accepted, resampled = rule(p, q, drafted.tolist(), ua.tolist(), ur.tolist())
    order = torch.randperm(64, generator=generator).tolist()
    shuffled = rule(
        p[order], q[order], drafted[order].tolist(), ua[order].tolist(), ur[order].tolist()
    )
    assert shuffled == ([accepted[i] for i in order], [resampled[i] for i in order])
    alone = [
        rule(p[i : i + 1], q[i : i + 1], [int(drafted[i])], [float(ua[i])], [float(ur[i])])
        for i in range(0, 64, 9)
    ]
    assert alone == [([accepted[i]], [resampled[i]]) for i in range(0, 64, 9)]


# -- the emitted distribution: chi-square through verify -------------------------------------------

N_TRIALS = 20_000
START = 7  # the sequences' length when they speculate: the position of the first draft


def normalise(x) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    return x / x.sum(axis=-1, keepdims=True)


# V = 8 for the first token: p(5) = 0 (a draft the target refuses), q(2) = 0 (a token only the
# residual gives).
P_FIRST = normalise([0.30, 0.05, 0.15, 0.10, 0.20, 0.00, 0.12, 0.08])
Q_FIRST = normalise([0.10, 0.25, 0.00, 0.20, 0.05, 0.15, 0.15, 0.10])
# V = 6 for the joint: p2 and q2 depend on the token before them (differently), each with a zero.
P1 = normalise([0.30, 0.10, 0.20, 0.00, 0.25, 0.15])
Q1 = normalise([0.10, 0.30, 0.00, 0.20, 0.15, 0.25])
# P2[x1] = p2(.|x1)
P2 = np.stack([np.roll(normalise([0.40, 0.05, 0.00, 0.25, 0.10, 0.20]), x) for x in range(6)])
Q2 = np.stack([np.roll(normalise([0.05, 0.35, 0.20, 0.00, 0.30, 0.10]), 2 * d) for d in range(6)])
P3 = normalise(np.ones(6))  # the bonus after two accepted drafts: never part of (x1, x2)


def sequences(n: int, length: int, seed0: int) -> list[Sequence]:
    params = SamplingParams(max_tokens=64, temperature=1.0)
    return [
        Sequence(i, [BOS_ID] * length, params, seed=seed0 + i, eos_token_id=EOS_ID)
        for i in range(n)
    ]


def draw(probs: np.ndarray, seeds: list[int], position: int) -> np.ndarray:
    """What a drafter does: one token per row of `probs`, from the draft stream at `position`."""
    u = position_uniforms(seeds, [position] * len(seeds), STREAM_DRAFT)
    return sample_from_probs(torch.from_numpy(np.ascontiguousarray(probs)), u).numpy()


def log(probs: np.ndarray) -> torch.Tensor:
    with np.errstate(divide="ignore"):
        # p = 0 -> -inf: the sampler gives those tokens nothing
        return torch.from_numpy(np.log(probs))


def first_tokens(seed0: int, deterministic: bool) -> np.ndarray:
    """One speculative round (k = 1) per trial; the first emitted token of each."""
    seqs = sequences(N_TRIALS, START, seed0)
    seeds = [s.seed for s in seqs]
    # an n-gram style drafter: a guess that is no draw at all, q one-hot (Proposal.probs None)
    if deterministic:
        drafts = np.arange(N_TRIALS) % len(P_FIRST)
        proposals = [Proposal((int(d),)) for d in drafts]
    else:
        drafts = draw(np.broadcast_to(Q_FIRST, (N_TRIALS, len(Q_FIRST))), seeds, START)
        q = torch.from_numpy(Q_FIRST)[None]
        proposals = [Proposal((int(d),), q) for d in drafts]
    # [p, bonus p] per sequence
    logits = log(np.broadcast_to(P_FIRST, (2 * N_TRIALS, len(P_FIRST))))
    runs = verify(logits, SamplingMetadata.from_sequences(seqs), proposals)
    assert all(1 <= len(run) <= 2 for run in runs)
    return np.array([run[0] for run in runs])


def joint_tokens(seed0: int, k: int) -> np.ndarray:
    """(x1, x2) per trial: a round with k drafts d1 ~ q1, d2 ~ q2(.|d1) verified against p1,
    p2(.|d1), ...; where it emits only x1 (a rejection at d1), a second round from x1 gives x2, as
    the engine would."""
    v = len(P1)
    seqs = sequences(N_TRIALS, START, seed0)
    seeds = [s.seed for s in seqs]
    d1 = draw(np.broadcast_to(Q1, (N_TRIALS, v)), seeds, START)
    # the drafter's next token, from the distribution given its first
    d2 = draw(Q2[d1], seeds, START + 1)
    if k == 1:
        proposals = [Proposal((int(a),), torch.from_numpy(Q1)[None]) for a in d1]
        per_seq = [P1[None], P2[d1][:, None]]  # the bonus row is p2(.|d1)
    else:
        proposals = [
            Proposal((int(a), int(b)), torch.from_numpy(np.stack([Q1, Q2[a]])))
            for a, b in zip(d1, d2)
        ]
        per_seq = [P1[None], P2[d1][:, None], P3[None]]
    logits = np.concatenate(np.broadcast_arrays(*per_seq), axis=1).reshape(-1, v)
    runs = verify(log(logits), SamplingMetadata.from_sequences(seqs), proposals)
    x1 = np.array([run[0] for run in runs])
    x2 = np.array([run[1] if len(run) > 1 else -1 for run in runs])
    # the next round: one draft from q2(.|x1), verified against p2(.|x1)
    again = np.flatnonzero(x2 == -1)
    assert 0 < len(again) < N_TRIALS
    later = sequences(len(again), START, seed0)
    for s, i in zip(later, again):
        s.seed = seeds[i]
        s.append_token(int(x1[i]))
    drafts = draw(Q2[x1[again]], [seeds[i] for i in again], START + 1)
    proposals = [
        Proposal((int(d),), torch.from_numpy(Q2[x])[None]) for d, x in zip(drafts, x1[again])
    ]
    logits = np.concatenate(
        np.broadcast_arrays(P2[x1[again]][:, None], P3[None, None]), axis=1
    ).reshape(-1, v)
    runs = verify(log(logits), SamplingMetadata.from_sequences(later), proposals)
    x2[again] = [run[0] for run in runs]
    return x1 * v + x2


def joint_probs() -> np.ndarray:
    return (P1[:, None] * P2).ravel()  # cell x1 * V + x2


@ch06_1
@pytest.mark.parametrize("deterministic", [False, True], ids=["q-drafter", "one-hot-drafter"])
def test_first_speculative_token_has_the_targets_distribution(deterministic: bool) -> None:
    emitted = first_tokens(seed0=1000, deterministic=deterministic)
    counts = np.bincount(emitted, minlength=len(P_FIRST))
    assert counts[2] > 0  # the token the drafter never proposes comes from the residual
    assert goodness_of_fit(counts, P_FIRST) > 1e-4


@ch06_1
@pytest.mark.parametrize("k", [1, 2])
def test_next_token_given_the_first_has_the_targets_distribution(k: int) -> None:
    cells = joint_tokens(seed0=50_000, k=k)
    counts = np.bincount(cells, minlength=len(P1) ** 2)
    assert goodness_of_fit(counts, joint_probs()) > 1e-4


# Tempting wrong rules, each plugged into the same harness: the chi-square tests must catch every
# one.
def _gathered(p, q, drafted):
    return p.gather(1, drafted.view(-1, 1)).view(-1), q.gather(1, drafted.view(-1, 1)).view(-1)


def accept_if_p_above_q(p, q, drafted, u_accept, u_residual):
    """Keep a draft the target likes more than the drafter did; otherwise a fresh draw from p."""
    p_d, q_d = _gathered(p, q, drafted)
    return p_d > q_d, sample_from_probs(p, u_residual)


def accept_if_p_above_q_else_argmax(p, q, drafted, u_accept, u_residual):
    p_d, q_d = _gathered(p, q, drafted)
    return p_d >= q_d, p.argmax(dim=-1)


def resample_from_p_not_the_residual(p, q, drafted, u_accept, u_residual):
    """The right test, min(1, p/q), but a rejection draws from p itself."""
    p_d, q_d = _gathered(p, q, drafted)
    return (q_d > 0) & (u_accept * q_d < p_d), sample_from_probs(p, u_residual)


WRONG_RULES = [
    accept_if_p_above_q,
    accept_if_p_above_q_else_argmax,
    resample_from_p_not_the_residual,
]


@pytest.mark.parametrize("wrong", WRONG_RULES, ids=lambda f: f.__name__)
def test_the_chi_square_tests_reject_wrong_rules(monkeypatch, wrong) -> None:
    # With a drafter that draws from q. (Against the one-hot drafter, whose guesses cycle evenly
    # through the vocabulary, the first and third rules happen to emit exactly p: q(d) = 1 means
    # "accept iff p > q" never accepts, and a uniform d averages the third rule's bias away.)
    monkeypatch.setattr(speculative, "accept_or_resample", wrong)
    first = np.bincount(first_tokens(seed0=1000, deterministic=False), minlength=len(P_FIRST))
    joint = np.bincount(joint_tokens(seed0=50_000, k=2), minlength=len(P1) ** 2)
    for counts, probs in ((first, P_FIRST), (joint, joint_probs())):
        zero_cells_hit = counts[probs == 0].sum() > 0
        assert zero_cells_hit or goodness_of_fit(counts, probs) < 1e-6


# -- verify on hand-made logits (ch06.3: each row's verdict becomes a run) -------------------------


def greedy_seqs(n: int) -> list[Sequence]:
    return [
        Sequence(i, [BOS_ID, 1, 2], SamplingParams(temperature=0), seed=i, eos_token_id=EOS_ID)
        for i in range(n)
    ]


def one_hot_logits(choices: list[int], v: int = 10) -> torch.Tensor:
    return torch.eye(v)[choices] * 5.0


def certain_logits(choices: list[int], v: int = 10) -> torch.Tensor:
    """Rows whose sampling distribution is all on one token (-inf elsewhere): at any temperature
    the target emits exactly that token, and keeps a draft of it with probability 1."""
    logits = torch.full((len(choices), v), -torch.inf)
    logits[torch.arange(len(choices)), choices] = 0.0
    return logits


def sampled_seqs(n: int, seed0: int = 0, length: int = START) -> list[Sequence]:
    params = SamplingParams(max_tokens=64, temperature=0.8)
    return [
        Sequence(i, [BOS_ID] * length, params, seed=seed0 + i, eos_token_id=EOS_ID)
        for i in range(n)
    ]


@ch06_3
@pytest.mark.parametrize("temperature", [0, 0.8], ids=["greedy", "sampled"])
def test_all_drafts_accepted_the_run_ends_with_the_bonus_token(temperature: float) -> None:
    seqs = greedy_seqs(1) if temperature == 0 else sampled_seqs(1)
    # each draft is the target's only choice at its row; the last row (the bonus) picks 9
    runs = verify(
        certain_logits([4, 5, 6, 9]), SamplingMetadata.from_sequences(seqs), [Proposal((4, 5, 6))]
    )
    assert runs == [[4, 5, 6, 9]], (
        f"three drafts the target certainly keeps, then the bonus row's 9: want [[4, 5, 6, 9]], "
        f"got {runs}"
    )


@ch06_3
@pytest.mark.parametrize("temperature", [0, 0.8], ids=["greedy", "sampled"])
def test_the_first_rejection_ends_the_run_with_the_resampled_token(temperature: float) -> None:
    seqs = greedy_seqs(3) if temperature == 0 else sampled_seqs(3)
    proposals = [Proposal((4, 5, 6))] * 3
    # The target gives draft 5 no chance (it wants 7 there); draft 6 after it would be kept, but
    # it was built on a token that is not emitted, so it must not be.
    choices = [4, 7, 6, 9] + [8, 5, 6, 9] + [4, 5, 3, 9]
    runs = verify(certain_logits(choices), SamplingMetadata.from_sequences(seqs), proposals)
    want = [[4, 7], [8], [4, 5, 3]]
    assert runs == want, (
        f"rejected at draft 2, 1 and 3: the kept drafts, then the target's token at the rejected "
        f"row, nothing after it: want {want}, got {runs}"
    )


@ch06_3
def test_greedy_runs_are_exactly_the_targets_argmax_chain() -> None:
    generator = torch.Generator().manual_seed(11)
    logits = torch.randn(6 * 5, 50, generator=generator)
    argmax = logits.argmax(dim=-1).view(6, 5).tolist()
    # sequence i's drafts agree with the argmax for its first i tokens, then one wrong guess
    proposals = [
        Proposal(tuple(row[:i]) + tuple((row[i] + 1) % 50 for _ in range(min(1, 4 - i))))
        for i, row in enumerate(argmax[:5])
    ] + [Proposal(tuple(argmax[5][:4]))]
    rows_of = [len(p.tokens) + 1 for p in proposals]
    ends = np.cumsum(rows_of)
    logits = torch.cat([logits[5 * i : 5 * i + n] for i, n in enumerate(rows_of)])
    runs = verify(logits, SamplingMetadata.from_sequences(greedy_seqs(6)), proposals)
    for i, (run, end, n) in enumerate(zip(runs, ends, rows_of)):
        want = logits[end - n : end].argmax(dim=-1).tolist()[: min(i, 4) + 1]
        assert run == want, (
            f"sequence {i}: its first {min(i, 4)} drafts are the argmax, so greedy speculation "
            f"must emit the argmax chain {want}, as plain greedy decoding would; got {run}"
        )


@ch06_3
def test_each_sequences_run_is_its_own_whatever_the_batch() -> None:
    """A rejection in one sequence never cuts another's run, and a sequence's run is the same
    alone, first or last in a batch, next to greedy and sampled neighbours."""
    q = torch.from_numpy(np.stack([Q1, Q1, Q1]))
    p = log(np.stack([P1, P1, P1, P1]))
    params = [SamplingParams(temperature=t) for t in (0.8, 0, 1.0, 0.8, 0)]
    seqs = [
        Sequence(i, [BOS_ID] * (START + i), params[i], seed=100 + i, eos_token_id=EOS_ID)
        for i in range(5)
    ]
    proposals = [
        Proposal((0, 4, 5), q),
        Proposal((0, 0)),
        Proposal((1, 0, 2), q),
        Proposal(()),
        Proposal((3,)),
    ]
    logits = [p[: len(prop.tokens) + 1] for prop in proposals]
    alone = [
        verify(rows_i, SamplingMetadata.from_sequences([s]), [prop])[0]
        for rows_i, s, prop in zip(logits, seqs, proposals)
    ]
    together = verify(torch.cat(logits), SamplingMetadata.from_sequences(seqs), proposals)
    assert together == alone, f"runs in one batch {together} != each verified alone {alone}"
    order = [4, 2, 0, 3, 1]
    reversed_batch = verify(
        torch.cat([logits[i] for i in order]),
        SamplingMetadata.from_sequences([seqs[i] for i in order]),
        [proposals[i] for i in order],
    )
    assert reversed_batch == [alone[i] for i in order], (
        f"the batch in order {order} gave {reversed_batch}, not the same runs reordered"
    )
    assert alone[1] == [0, 0, 0], "greedy: drafts (0, 0) are the argmax of P1, then the bonus 0"
    assert alone[4] == [0], "greedy: draft 3 is not the argmax of P1 (0), which replaces it"


@ch06_3
def test_sampled_runs_are_a_function_of_seed_and_position() -> None:
    """The same (seed, position) gives the same run under another sequence id and in another
    batch; another position or another seed gives other draws."""
    n, q = 300, torch.from_numpy(Q1)[None]
    logits = log(np.broadcast_to(P1, (2 * n, len(P1))))
    proposals = [Proposal((1,), q)] * n  # a draft of 1 is kept with probability p/q = 1/3

    def runs(seqs: list[Sequence]) -> list[list[int]]:
        return verify(logits, SamplingMetadata.from_sequences(seqs), proposals)

    base = runs(sampled_seqs(n, seed0=40))
    renamed = sampled_seqs(n, seed0=40)
    for s in renamed:
        s.seq_id += 1000
    assert runs(renamed) == base, "a sequence's id, not only its seed and position, changed it"
    kept = sum(len(run) == 2 for run in base)
    assert 50 < kept < 150, f"{kept} of {n} drafts kept, where p/q = 1/3 keeps about {n // 3}"
    for other, what in [
        (sampled_seqs(n, seed0=40, length=START + 1), "position"),
        (sampled_seqs(n, seed0=40 + n), "seed"),
    ]:
        same = sum(a == b for a, b in zip(runs(other), base))
        assert same < 0.8 * n, f"{same} of {n} runs unchanged with another {what}"


@ch06_3
def test_greedy_verify_keeps_drafts_while_they_are_the_argmax() -> None:
    proposals = [Proposal((4, 5, 6)), Proposal((4, 5, 6)), Proposal((7,)), Proposal(())]
    greedy = SamplingMetadata.from_sequences(greedy_seqs(4))
    # all kept + bonus 9; rejected at 5 -> 8; at 7 -> 3; none
    choices = [4, 5, 6, 9] + [4, 8, 6, 9] + [3, 2] + [1]
    assert verify(one_hot_logits(choices), greedy, proposals) == [
        [4, 5, 6, 9],
        [4, 8],
        [3],
        [1],
    ]
    with pytest.raises(ValueError, match="rows of logits"):
        verify(one_hot_logits(choices[:-1]), greedy, proposals)


@ch06_3
def test_sampled_verify_without_drafts_is_the_ordinary_sampler() -> None:
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(64, 259, generator=generator)
    params = SamplingParams(temperature=0.9, top_k=40, top_p=0.95)
    seqs = [
        Sequence(i, [BOS_ID] * (3 + i % 5), params, seed=77 + i, eos_token_id=EOS_ID)
        for i in range(64)
    ]
    runs = verify(logits, SamplingMetadata.from_sequences(seqs), [Proposal()] * 64)
    seeds, positions = [s.seed for s in seqs], [s.num_tokens for s in seqs]
    want = sample(
        logits, SamplingMetadata.from_lists([0.9] * 64, [40] * 64, [0.95] * 64, seeds, positions)
    )
    assert [run for run in runs] == [[t] for t in want]


@ch06_3
def test_sampled_verify_uses_the_request_streams() -> None:
    """accept at (seed, position) with STREAM_ACCEPT, resample with STREAM_RESIDUAL, bonus with
    stream 0."""
    p, q = (
        normalise([0.2, 0.5, 0.3]),
        normalise([0.6, 0.2, 0.2]),
    )  # a draft of token 0 is kept w.p. 1/3
    seqs = sequences(400, START, seed0=9)
    seeds = [s.seed for s in seqs]
    logits = log(np.broadcast_to(p, (800, 3)))
    proposals = [Proposal((0,), torch.from_numpy(q)[None])] * 400
    runs = verify(logits, SamplingMetadata.from_sequences(seqs), proposals)
    u_accept = position_uniforms(seeds, [START] * 400, STREAM_ACCEPT)
    u_residual = position_uniforms(seeds, [START] * 400, STREAM_RESIDUAL)
    u_bonus = position_uniforms(seeds, [START + 1] * 400)
    residual = normalise(np.maximum(p - q, 0))
    for run, ua, ur, ub in zip(runs, u_accept, u_residual, u_bonus):
        if ua * q[0] < p[0]:
            assert run == [0, int(np.searchsorted(np.cumsum(p), ub, side="right"))]
        else:
            assert run == [int(np.searchsorted(np.cumsum(residual), ur, side="right"))]
    assert 50 < sum(len(run) == 2 for run in runs) < 350


# -- the n-gram drafter ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tokens, k, max_n, want",
    [
        ([1, 2, 5, 1, 2, 6, 1, 2], 3, 2, [6, 1, 2]),  # two earlier matches: the latest wins
        ([1, 2, 9, 3, 2, 8, 1, 2], 4, 2, [9, 3, 2, 8]),  # a 2-gram match beats a later 1-gram match
        (
            [1, 2, 9, 3, 2, 8, 1, 2],
            4,
            1,
            [8, 1, 2],
        ),  # ... which is what n = 1 alone finds; fewer than k left
        ([2, 5, 2], 4, 3, [5, 2]),  # the suffix never matches itself
        ([9, 4, 2], 4, 3, []),  # no earlier occurrence
        ([7], 4, 3, []),  # nothing before the suffix at all
        ([1, 1, 1, 1], 3, 2, [1]),  # overlapping the suffix is fine, but only earlier windows count
        ([3, 4, 5, 6, 7, 8, 3, 4], 2, 2, [5, 6]),  # cut to k
        ([3, 4, 5, 6, 7, 8, 3, 4], 0, 2, []),
    ],
)
def test_ngram_lookup(tokens: list[int], k: int, max_n: int, want: list[int]) -> None:
    assert NgramDrafter(1, max_n).lookup(tokens, k) == want


def test_ngram_lookup_respects_min_n() -> None:
    tokens = [4, 2, 8, 9, 1, 2]  # only a 1-gram ([2]) recurs
    assert NgramDrafter(1, 3).lookup(tokens, 3) == [8, 9, 1]
    assert NgramDrafter(2, 3).lookup(tokens, 3) == []


def test_ngram_propose_is_deterministic_one_hot() -> None:
    seqs = [
        Sequence(0, [1, 2, 3, 1, 2], SamplingParams(), seed=0, eos_token_id=EOS_ID),
        Sequence(1, [5, 6, 7], SamplingParams(), seed=1, eos_token_id=EOS_ID),
    ]
    proposals = NgramDrafter(1, 3).propose(seqs, [2, 4])
    assert proposals == [Proposal((3, 1)), Proposal(())]
    assert NgramDrafter(1, 3).propose(seqs[:1], [0]) == [Proposal(())]
    assert proposals[0].draft_probs(5).tolist() == [[0, 0, 0, 1, 0], [0, 1, 0, 0, 0]]


# -- the engine with real models: greedy output is the plain engine's ------------------------------

PROMPTS = [
    "ROMEO:",
    "JULIET:\nO Romeo, Romeo! wherefore art thou Romeo?",
    "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\nFirst "
    "Citizen:\n"
    # 148 tokens: prefilled in chunks next to decodes
    "You are all resolved rather to die than to famish?",
    "To be",
    "KING RICHARD III:\nNow is the winter",
]
GREEDY = SamplingParams(max_tokens=28, temperature=0)


@pytest.fixture(scope="module")
def draft() -> Transformer:
    return load_model("draft")


@pytest.fixture(scope="module", params=["random", "shuffled"])
def bad_draft(request, draft) -> Transformer:
    """A draft that is almost never right: fresh random weights, or the real draft with its output
    rows permuted (it still proposes confidently, just the wrong tokens)."""
    if request.param == "random":
        model = Transformer(draft.config)
        init_weights(model, seed=0)
        return model.eval()
    model = copy.deepcopy(draft)
    permutation = torch.randperm(
        draft.config.vocab_size, generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        model.lm_head.weight.copy_(draft.lm_head.weight[permutation])
    return model


def make_engine(
    model,
    speculative: SpeculativeConfig | None = None,
    num_blocks: int = 64,
    seed: int = 0,
    **scheduler,
) -> LLMEngine:
    scheduler.setdefault("max_num_seqs", 4)
    scheduler.setdefault("max_num_batched_tokens", 48)  # >= 4 x (1 + 8): every k up to 8 fits
    return LLMEngine(
        model,
        EngineConfig(
            num_blocks=num_blocks,
            seed=seed,
            scheduler=SchedulerConfig(**scheduler),
            speculative=speculative,
        ),
    )


class Run:
    """Step an engine to the end, checking the books after every step, and keep per request the
    speculative rounds as (proposed, accepted, appended): appended < accepted + 1 means the run was
    cut."""

    def __init__(self, engine: LLMEngine, prompts, params, request_ids=None) -> None:
        self.engine = engine
        if request_ids is None:
            ids = engine._add_all(prompts, params)
        else:
            params = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
            ids = [
                engine.add_request(p, sp, request_id=i)
                for p, sp, i in zip(prompts, params, request_ids)
            ]
        self.rounds: dict[int, list[tuple[int, int, int]]] = {i: [] for i in ids}
        lengths, done = dict.fromkeys(ids, 0), {}
        while engine.has_unfinished():
            got = {out.request_id: out for out in engine.step()}
            for i, proposed, accepted in engine.trace[-1].speculated:
                assert 0 <= accepted <= proposed
                self.rounds[i].append((proposed, accepted, len(got[i].token_ids) - lengths[i]))
                # its accepted drafts were computed in the verify pass: one token left
                if not got[i].finished:
                    assert engine.scheduler.sequences[i].is_decoding, f"sequence {i} after a round"
            for i, out in got.items():
                lengths[i] = len(out.token_ids)
                if out.finished:
                    done[i] = out
            self._check_books()
        self.outputs: list[RequestOutput] = [done[i] for i in ids]
        manager = engine.manager
        assert manager.num_free == engine.config.num_blocks and not manager.tables
        assert not any(manager.allocator.refcounts)

    def _check_books(self) -> None:
        """After a step every running sequence holds exactly its computed tokens' slots: the slots
        of rejected drafts are back in the pool; and no block is held that no table holds."""
        engine, manager = self.engine, self.engine.manager
        held = [0] * engine.config.num_blocks
        for seq in engine.scheduler.running:
            assert manager.num_tokens(seq.seq_id) == seq.num_computed_tokens, (
                f"sequence {seq.seq_id}"
            )
            if seq.num_draft_computed_tokens is not None:
                assert seq.num_draft_computed_tokens <= seq.num_computed_tokens
        for table in manager.tables.values():
            assert len(table.blocks) == -(-table.num_tokens // manager.block_size)
            for block in table.blocks:
                held[block] += 1
        assert held == manager.allocator.refcounts and manager.num_free == held.count(0)

    @property
    def tokens(self) -> list[list[int]]:
        return [out.token_ids for out in self.outputs]

    def totals(self) -> tuple[int, int]:
        """(proposed, accepted) over every round of every request."""
        rounds = [r for rs in self.rounds.values() for r in rs]
        return sum(r[0] for r in rounds), sum(r[1] for r in rounds)

    def cut_rounds(self, index: int) -> list[tuple[int, int, int]]:
        rounds = self.rounds[self.outputs[index].request_id]
        return [r for r in rounds if r[2] < r[1] + 1]


@pytest.fixture(scope="module")
def plain_run(target) -> Run:
    return Run(make_engine(target), PROMPTS, GREEDY)


@pytest.fixture(scope="module")
def plain(plain_run) -> list[list[int]]:
    return plain_run.tokens


@pytest.mark.parametrize("k", range(1, 9))
def test_greedy_with_the_draft_model_is_the_plain_engine(target, draft, plain_run, k: int) -> None:
    run = Run(
        make_engine(target, SpeculativeConfig("draft", k, draft_model=draft)), PROMPTS, GREEDY
    )
    assert run.tokens == plain_run.tokens
    proposed, accepted = run.totals()
    assert proposed > 0 and accepted > 0.4 * proposed, (
        proposed,
        accepted,
    )  # the shipped draft agrees ~80%
    trace = run.engine.trace
    assert any(r.speculated and r.prefilled for r in trace)  # verify rounds next to prefill chunks
    if k >= 2:
        assert any(a >= 2 for rounds in run.rounds.values() for _, a, _ in rounds)
        assert len(trace) < len(plain_run.engine.trace)  # fewer target passes


@pytest.mark.parametrize("k", [1, 5])
def test_greedy_with_a_useless_draft_is_still_the_plain_engine(
    target, bad_draft, plain, k: int
) -> None:
    run = Run(
        make_engine(target, SpeculativeConfig("draft", k, draft_model=bad_draft)), PROMPTS, GREEDY
    )
    assert run.tokens == plain
    proposed, accepted = run.totals()
    assert proposed > 50 and accepted <= 0.02 * proposed, (proposed, accepted)


@pytest.mark.parametrize("k", [2, 6])
def test_greedy_with_the_ngram_drafter_is_the_plain_engine(target, plain, k: int) -> None:
    run = Run(
        make_engine(target, SpeculativeConfig("ngram", k, prompt_lookup_max=3)), PROMPTS, GREEDY
    )
    assert run.tokens == plain
    proposed, accepted = run.totals()
    assert proposed > 0 and accepted > 0, (proposed, accepted)


def test_llm_front_door_takes_a_speculative_dict(target, plain) -> None:
    llm = LLM(
        target,
        num_blocks=64,
        max_num_seqs=4,
        max_num_batched_tokens=48,
        speculative={"num_speculative_tokens": 3},
    )  # the draft model loaded by its name
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == plain
    assert sum(a for r in llm.engine.trace for _, _, a in r.speculated) > 0
    with pytest.raises(ValueError, match="method"):
        LLM(target, speculative={"method": "medusa"})


# -- the edges: stops inside an accepted run, max_tokens, the pool ---------------------------------

EOS_PROMPTS = [
    "First Citizen:\nBefore we proceed any further, hear me speak.\n\nSecond Citizen:\n",
    "KING RICHARD III:\nNow is the winter",
    "HAMLET:\nTo be, or not",
    "First Citizen:\nBefore we proceed",
    "MACBETH:\nIs this a dagger",
]


@pytest.fixture(scope="module")
def eos_models(target, draft) -> tuple[Transformer, Transformer]:
    """The shipped models almost never pick EOS greedily (< 5% anywhere in the validation text).
    These copies pick it wherever they would end a line: EOS's output row is 1.05 x the
    newline's."""
    models = []
    for model in (target, draft):
        model = copy.deepcopy(model)
        with torch.no_grad():
            model.lm_head.weight[EOS_ID] = model.lm_head.weight[ord("\n")] * 1.05
        models.append(model)
    return models[0], models[1]


def test_eos_accepted_mid_run_ends_the_request_there(eos_models) -> None:
    target, draft = eos_models
    params = SamplingParams(max_tokens=60, temperature=0)
    want = Run(make_engine(target), EOS_PROMPTS, params).outputs
    run = Run(
        make_engine(target, SpeculativeConfig("draft", 4, draft_model=draft)), EOS_PROMPTS, params
    )
    assert run.tokens == [o.token_ids for o in want]
    assert [o.text for o in run.outputs] == [o.text for o in want]
    ended = [i for i, o in enumerate(run.outputs) if o.token_ids[-1] == EOS_ID]
    assert all(
        run.outputs[i].finish_reason == "stop" and run.outputs[i].stop_reason is None for i in ended
    )
    assert EOS_ID not in [t for o in run.outputs for t in o.token_ids[:-1]]
    # An accepted EOS cuts its round: the drafts after it and the bonus token are thrown away.
    cut = [i for i in ended if run.cut_rounds(i)]
    assert cut, "no request got EOS as an accepted draft: the workload no longer tests the cut"
    # only the last round
    assert all(run.cut_rounds(i) == run.rounds[run.outputs[i].request_id][-1:] for i in cut)


STOP_PROMPTS = ["ROMEO:", "First Citizen:\nBefore we proceed", "To be", "HAMLET:"]


@pytest.mark.parametrize(
    "stop",
    [
        {"stop_token_ids": [ord("o")]},
        {"stop_token_ids": [ord("t"), ord(",")]},
        {"stop": ["so much"]},
        {"stop": ["I will", "the state"]},
    ],
    ids=["token-o", "tokens-t-comma", "string-so-much", "strings"],
)
def test_a_stop_inside_an_accepted_run_ends_the_request_there(target, draft, stop: dict) -> None:
    params = SamplingParams(max_tokens=32, temperature=0, **stop)
    want = Run(make_engine(target), STOP_PROMPTS, params).outputs
    run = Run(
        make_engine(target, SpeculativeConfig("draft", 4, draft_model=draft)), STOP_PROMPTS, params
    )
    for out, plain_out in zip(run.outputs, want):
        assert (out.token_ids, out.text, out.finish_reason, out.stop_reason) == (
            plain_out.token_ids,
            plain_out.text,
            plain_out.finish_reason,
            plain_out.stop_reason,
        )
    stopped = [i for i, o in enumerate(run.outputs) if o.finish_reason == "stop"]
    assert any(run.cut_rounds(i) for i in stopped), "no stop fell inside an accepted run"
    for out in run.outputs:
        for s in params.stop:
            assert s not in out.text
        if "stop_token_ids" in stop and out.finish_reason == "stop":
            assert (
                out.token_ids[-1] in params.stop_token_ids and out.stop_reason == out.token_ids[-1]
            )


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_max_tokens_is_never_passed(target, draft, method: str) -> None:
    k = 4
    spec = SpeculativeConfig(method, k, draft_model=draft)
    prompts = ["ROMEO:", "To be", "JULIET:\nO Romeo, Romeo! wherefore art thou Romeo?"]
    clipped = False
    for max_tokens in range(1, 10):
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        want = Run(make_engine(target), prompts, params).tokens
        run = Run(make_engine(target, spec), prompts, params)
        assert run.tokens == want
        assert all(
            len(o.token_ids) == max_tokens and o.finish_reason == "length" for o in run.outputs
        )
        for rounds in run.rounds.values():
            produced = 1  # the prefill's token
            for proposed, _accepted, appended in rounds:
                # lookahead clipped before the round
                assert proposed <= min(k, max_tokens - produced - 1)
                clipped |= proposed < k and max_tokens - produced - 1 < k
                produced += appended
    assert clipped


PREFIX = "KING RICHARD III:\nNow is the winter of our discontent\nMade glorious summer by this sun "
"of York;\n"
PREFIXED = [
    PREFIX + s for s in ["And all the clouds", "Now are our brows", "Grim-visaged war", "Our stern"]
]


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_prefix_caching_changes_the_work_not_the_tokens_nor_the_drafts(
    target, draft, method: str
) -> None:
    """Greedy drafts are a function of the draft model's K/V: a prefix-cache hit must hand the draft
    model the same K/V it would have computed, so every round (proposed, accepted, appended) is as
    without caching."""
    spec = SpeculativeConfig(method, 4, draft_model=draft)
    params = SamplingParams(max_tokens=20, temperature=0)
    want = Run(make_engine(target, max_num_batched_tokens=64), PREFIXED, params).tokens
    uncached = Run(make_engine(target, spec, max_num_batched_tokens=64), PREFIXED[1:], params)
    assert uncached.tokens == want[1:]
    full_blocks = (1 + len(PREFIX)) // 16 * 16
    # The first request runs to the end alone, then the rest find its prefix in the cache.
    engine = make_engine(target, spec, max_num_batched_tokens=64, enable_prefix_caching=True)
    first, rest = Run(engine, PREFIXED[:1], params), Run(engine, PREFIXED[1:], params)
    assert first.tokens + rest.tokens == want
    assert [o.num_cached_tokens for o in rest.outputs] == [full_blocks] * 3
    assert list(rest.rounds.values()) == list(uncached.rounds.values())
    # A first request that ends at its prefill never runs the draft model over its prompt: a block
    # it leaves must not give a later request target K/V without the draft's (the rounds would
    # change).
    engine = make_engine(target, spec, max_num_batched_tokens=64, enable_prefix_caching=True)
    Run(engine, PREFIXED[:1], SamplingParams(max_tokens=1, temperature=0))
    rest = Run(engine, PREFIXED[1:], params)
    assert rest.tokens == want[1:] and list(rest.rounds.values()) == list(uncached.rounds.values())
    # All at once: later prompts hit blocks of earlier ones as soon as both models' K/V are in them.
    together = Run(
        make_engine(target, spec, max_num_batched_tokens=64, enable_prefix_caching=True),
        PREFIXED,
        params,
    )
    assert together.tokens == want and sum(r.prefix_hit_tokens for r in together.engine.trace) > 0
    assert sum(a for rounds in together.rounds.values() for _, a, _ in rounds) > 0


# -- sampling through the engine -------------------------------------------------------------------

SAMPLED_PROMPTS = [
    "ROMEO:",
    "JULIET:\nO Romeo, Romeo!",
    "To be",
    "HAMLET:",
    "First Citizen:\nBefore we proceed",
    "KING RICHARD III:\nNow is the winter",
    "What light",
    "MACBETH:\nIs this a dagger",
]


def sampled_params() -> list[SamplingParams]:
    params = []
    for i in range(8):
        # one request without a seed: the engine derives it from its id
        seed = None if i == 5 else 100 + i
        params.append(
            SamplingParams(
                max_tokens=14 + i,
                temperature=(0.7, 1.0, 1.3)[i % 3],
                top_k=(0, 20)[i % 2],
                top_p=(1.0, 0.9, 1.0, 0.8)[i % 4],
                seed=seed,
            )
        )
    return params


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_seeded_tokens_do_not_depend_on_the_batch_or_on_preemption(
    target, draft, method: str
) -> None:
    spec = SpeculativeConfig(method, 4, draft_model=draft)
    params, ids = sampled_params(), list(range(8))
    batch = Run(make_engine(target, spec, num_blocks=64), SAMPLED_PROMPTS, params, request_ids=ids)
    for i in ids:
        alone = Run(
            make_engine(target, spec, num_blocks=16),
            SAMPLED_PROMPTS[i : i + 1],
            params[i],
            request_ids=[i],
        )
        assert alone.tokens == batch.tokens[i : i + 1], f"request {i}"
    tiny = Run(make_engine(target, spec, num_blocks=7), SAMPLED_PROMPTS, params, request_ids=ids)
    assert sum(len(r.preempted) for r in tiny.engine.trace) >= 3
    assert tiny.tokens == batch.tokens
    assert [o.text for o in tiny.outputs] == [o.text for o in batch.outputs]
    proposed, accepted = batch.totals()
    assert 0 < accepted < proposed  # some drafts kept, some rejected: the sampled rule really ran
    # The first token comes from the prefill, with no draft: exactly the plain engine's draw.
    plain_batch = Run(make_engine(target, num_blocks=64), SAMPLED_PROMPTS, params, request_ids=ids)
    assert [t[0] for t in plain_batch.tokens] == [t[0] for t in batch.tokens]


def test_the_same_seed_gives_the_same_tokens(target, draft) -> None:
    spec = SpeculativeConfig("draft", 3, draft_model=draft)
    params = [SamplingParams(max_tokens=24, temperature=1.0, seed=s) for s in (1, 1, 2)]
    a, b, c = Run(make_engine(target, spec), ["JULIET:"] * 3, params).tokens
    assert a == b and a != c
    (again,) = Run(make_engine(target, spec), ["JULIET:"], params[0]).tokens
    assert again == a


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_requests_keep_their_tokens_next_to_sampled_ones(
    target, draft, plain, method: str
) -> None:
    spec = SpeculativeConfig(method, 4, draft_model=draft)
    greedy = PROMPTS[:3]
    sampled = [SamplingParams(max_tokens=3, temperature=1.0, seed=s) for s in (5, 6)]
    run = Run(make_engine(target, spec), greedy + ["HAMLET:", "To be"], [GREEDY] * 3 + sampled)
    assert run.tokens[:3] == plain[:3]


def test_first_speculative_token_has_the_targets_distribution_end_to_end(target, draft) -> None:
    """Real models at temperature 1: x1 comes from the prefill, x2 from the first verify (a draft
    from the draft model, accepted or resampled). Their joint must be the target's
    p(x1) p(x2 | x1)."""
    prompt = tok.encode("ROMEO:\nI will", add_bos=True)
    n = 1200
    engine = make_engine(
        target,
        SpeculativeConfig("draft", 1, draft_model=draft),
        num_blocks=300,
        max_num_seqs=256,
        max_num_batched_tokens=2048,
    )
    params = [
        SamplingParams(max_tokens=3, temperature=1.0, seed=10_000 + i, ignore_eos=True)
        for i in range(n)
    ]
    outs = engine.generate([prompt] * n, params)
    proposed = sum(p for r in engine.trace for _, p, _ in r.speculated)
    accepted = sum(a for r in engine.trace for _, _, a in r.speculated)
    # the draft is often right, not always
    assert proposed == n and 0.2 * n < accepted < 0.95 * n, accepted
    v = target.config.vocab_size
    with torch.no_grad():
        p1 = target(torch.tensor(prompt))[-1].double().softmax(-1)
        ids = torch.tensor([prompt + [x] for x in range(v)])
        p2 = target(ids)[:, -1].double().softmax(-1)  # p2[x1] = p(. | prompt, x1)
    joint = (p1[:, None] * p2).numpy()
    counts = np.zeros(v * v)
    np.add.at(counts, [o.token_ids[0] * v + o.token_ids[1] for o in outs], 1)
    assert goodness_of_fit(counts, joint) > 1e-4


# -- configuration errors --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"method": "medusa"}, "method must be one of"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens must be an int >= 1"),
        ({"num_speculative_tokens": -2}, "num_speculative_tokens"),
        ({"num_speculative_tokens": True}, "num_speculative_tokens"),
        ({"num_speculative_tokens": 2.0}, "num_speculative_tokens"),
        ({"prompt_lookup_min": 0}, "prompt_lookup_min"),
        (
            {"prompt_lookup_min": 4, "prompt_lookup_max": 3},
            "prompt_lookup_min <= prompt_lookup_max",
        ),
    ],
)
def test_speculative_config_is_checked(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig(**kwargs)


def small_model(**config) -> Transformer:
    base = dict(d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64, max_seq_len=512)
    return Transformer(ModelConfig(**{**base, **config}))


def test_a_draft_that_does_not_fit_the_target_is_refused(target) -> None:
    with pytest.raises(ValueError, match=r"vocabulary \(100\) differs from the target's \(259\)"):
        make_engine(target, SpeculativeConfig("draft", 2, draft_model=small_model(vocab_size=100)))
    with pytest.raises(ValueError, match=r"context \(128\) is shorter"):
        make_engine(target, SpeculativeConfig("draft", 2, draft_model=small_model(max_seq_len=128)))
    # same vocab and context: fine
    make_engine(target, SpeculativeConfig("draft", 2, draft_model=small_model()))


def test_a_budget_too_small_for_the_lookahead_is_refused(target) -> None:
    make_engine(target, max_num_seqs=8, max_num_batched_tokens=32)  # fine without speculation
    with pytest.raises(
        ValueError, match=r"max_num_batched_tokens \(32\) must be >= max_num_seqs \(8\) x 5 tokens"
    ):
        make_engine(
            target, SpeculativeConfig("ngram", 4), max_num_seqs=8, max_num_batched_tokens=32
        )
    # 8 x 5 fits
    make_engine(target, SpeculativeConfig("ngram", 4), max_num_seqs=8, max_num_batched_tokens=40)
