"""Sampling for a whole batch in one call, with randomness that belongs to the request (chapter 04).

Every row of the batch has its own temperature, top-k and top-p. `token_probs` turns logits into the
distribution the request asked for (a one-hot at the argmax for greedy rows), and
`sample_from_probs` draws from it by **inverse CDF** with one uniform number per row.

Where does that number come from? Not from a generator object that advances with every draw: then a
request's tokens would depend on how many draws other requests made before it, on batch order, on
chunking, on preemption. Instead `position_uniforms` *computes* it from (request seed, token
position) with a counter-based hash (splitmix64). Token 17 of a request with seed 5 always sees the
same number, whatever else ran, so batching, preemption and speculation (chapters 05 and 06) can
never change a request's tokens. `stream` gives speculative decoding further independent numbers per
position.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from minivllm.sched.sequence import Sequence as SequenceState

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser: a bijection on 64-bit ints that scrambles every input bit into
    every output bit. numpy uint64 arithmetic wraps modulo 2**64, which is exactly what it needs."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def position_uniforms(
    seeds: Sequence[int], positions: Sequence[int], stream: int = 0
) -> np.ndarray:
    """One float64 in [0, 1) per row, a pure function of (seed, position, stream)."""
    seeds = np.asarray(seeds, dtype=np.uint64).reshape(-1)
    positions = np.asarray(positions, dtype=np.uint64).reshape(-1)
    key = _splitmix64(seeds ^ _splitmix64(np.full_like(seeds, stream) + _GOLDEN))
    bits = _splitmix64(key + positions * _GOLDEN)
    return (bits >> np.uint64(11)).astype(np.float64) * 2.0**-53  # 53 bits fill a double exactly


def derive_seed(engine_seed: int, request_id: int) -> int:
    """A seed for a request that did not bring one: reproducible from the engine's seed."""
    mixed = _splitmix64(
        np.asarray([engine_seed], dtype=np.uint64)
        ^ _splitmix64(np.asarray([request_id], dtype=np.uint64))
    )
    return int(mixed[0] >> np.uint64(1))  # fits a non-negative int64


def token_probs(
    logits: torch.Tensor, temperatures: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor
) -> torch.Tensor:
    """Per-row sampling distributions, float64 `[B, V]`, from logits `[B, V]`.

    temperature scales the logits, top-k keeps the k most likely tokens (0 = all), top-p then keeps
    the smallest head of the sorted distribution whose mass reaches p (1 = all); the survivors are
    renormalised. A greedy row (temperature 0) becomes a one-hot at its argmax.
    """
    logits = logits.to(torch.float64)
    greedy = temperatures == 0
    # Shift so the largest logit is 0 before dividing: a tiny temperature then sends the others to
    # -inf instead of overflowing everything to +inf (NaN probabilities).
    shifted = logits - logits.max(dim=-1, keepdim=True).values
    scaled = shifted / torch.where(greedy, 1.0, temperatures.to(torch.float64))[:, None]
    # EXERCISE ch04.1: top-k / top-p -- each row's k likeliest tokens, then the smallest head >= p
    ### BEGIN SOLUTION
    sorted_logits, order = scaled.sort(dim=-1, descending=True, stable=True)
    vocab = logits.shape[-1]
    k = torch.where(top_ks > 0, top_ks, vocab)[:, None]
    ranks = torch.arange(vocab)[None, :]
    sorted_logits = sorted_logits.masked_fill(ranks >= k, float("-inf"))
    sorted_probs = sorted_logits.softmax(dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    # Keep a token while the mass strictly before it is < p: the head reaches p, and the top
    # token always stays.
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_ps.to(torch.float64)[:, None], 0.0)
    probs = torch.zeros_like(sorted_probs).scatter(-1, order, sorted_probs)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    ### END SOLUTION
    one_hot = torch.zeros_like(probs).scatter(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    return torch.where(greedy[:, None], one_hot, probs)


def sample_from_probs(probs: torch.Tensor, uniforms: np.ndarray | torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw, one token per row: the first token whose cumulative probability exceeds
    u."""
    u = torch.as_tensor(uniforms, dtype=torch.float64).reshape(-1, 1)
    # EXERCISE ch04.2: inverse CDF -- the first token whose running probability total is > u * total
    ### BEGIN SOLUTION
    cdf = probs.cumsum(dim=-1)
    # Scale u by the row's total (1 up to rounding): a round-off shortfall never runs off the end.
    tokens = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)
    return tokens.clamp(max=probs.shape[-1] - 1).reshape(-1)
    ### END SOLUTION


@dataclass(frozen=True)
class SamplingMetadata:
    """What the sampler needs of each row it draws, built ONCE per step from the sequences and then
    only indexed: by the plain sampler (a row per sequence), by the drafter (a row per drafting
    sequence and pass) and by the verify (a row per draft, plus the bonus row)."""

    seq_ids: tuple[int, ...]  # the sequence each row belongs to
    temperatures: tuple[float, ...]  # 0 = greedy
    top_ks: tuple[int, ...]  # 0 = no top-k
    top_ps: tuple[float, ...]  # 1 = no top-p
    seeds: tuple[int, ...]
    positions: tuple[int, ...]  # the index in its sequence of the token the row draws
    greedy: tuple[bool, ...]
    all_greedy: bool  # then sampling is an argmax: no sort, no hash

    @classmethod
    def from_sequences(cls, seqs: Sequence[SequenceState]) -> SamplingMetadata:
        """One row per sequence, drawing its next token (at position `num_tokens`)."""
        params = [s.params for s in seqs]
        return cls.from_lists(
            [p.temperature for p in params],
            [p.top_k for p in params],
            [p.top_p for p in params],
            [s.seed for s in seqs],
            [s.num_tokens for s in seqs],
            seq_ids=[s.seq_id for s in seqs],
        )

    @classmethod
    def from_lists(
        cls,
        temperatures: Sequence[float],
        top_ks: Sequence[int],
        top_ps: Sequence[float],
        seeds: Sequence[int],
        positions: Sequence[int],
        seq_ids: Sequence[int] | None = None,
    ) -> SamplingMetadata:
        """Rows given column by column; `seq_ids` default to 0, 1, 2, ..."""
        greedy = tuple(t == 0 for t in temperatures)
        return cls(
            seq_ids=tuple(seq_ids if seq_ids is not None else range(len(temperatures))),
            temperatures=tuple(temperatures),
            top_ks=tuple(top_ks),
            top_ps=tuple(top_ps),
            seeds=tuple(seeds),
            positions=tuple(positions),
            greedy=greedy,
            all_greedy=all(greedy),
        )

    def select(self, rows: Sequence[int], ahead: Sequence[int] | None = None) -> SamplingMetadata:
        """Rows `rows` (repeats allowed), each drawing `ahead[i]` positions further on."""
        ahead = ahead if ahead is not None else [0] * len(rows)
        greedy = tuple(self.greedy[r] for r in rows)
        return SamplingMetadata(
            seq_ids=tuple(self.seq_ids[r] for r in rows),
            temperatures=tuple(self.temperatures[r] for r in rows),
            top_ks=tuple(self.top_ks[r] for r in rows),
            top_ps=tuple(self.top_ps[r] for r in rows),
            seeds=tuple(self.seeds[r] for r in rows),
            positions=tuple(self.positions[r] + a for r, a in zip(rows, ahead)),
            greedy=greedy,
            all_greedy=all(greedy),
        )

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's sampling distribution, float64 `[R, V]` (see `token_probs`). The parameter
        tensors are made here, not per step: an all-greedy step never needs them."""
        return token_probs(
            logits,
            torch.tensor(self.temperatures, dtype=torch.float64),
            torch.tensor(self.top_ks, dtype=torch.long),
            torch.tensor(self.top_ps, dtype=torch.float64),
        )

    def uniforms(self, stream: int = 0) -> np.ndarray:
        """Each row's uniform number for `stream` (see `position_uniforms`)."""
        return position_uniforms(self.seeds, self.positions, stream)


def sample(logits: torch.Tensor, metadata: SamplingMetadata) -> list[int]:
    """The engine's sampler: one token per row of `logits`, each from its own request's
    distribution."""
    if metadata.all_greedy:
        return logits.argmax(dim=-1).tolist()  # all greedy: skip the sort and the hash
    return sample_from_probs(metadata.probs(logits), metadata.uniforms()).tolist()
