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

vLLM's other parameters (issue 18) are each row's `LogitRules`: allowed tokens, bad words,
min_tokens, logit_bias and the repetition / frequency / presence penalties, applied to the logits
before temperature by `apply_logit_rules` in a few tensor operations for the whole batch, from
tensors built once per sequence (`build_logit_rules`). They read only the row's own tokens before
the position it draws, so they keep that guarantee; a batch without them pays nothing.
`logprob_dicts` gives vLLM V1's logprobs: the log-softmax of the raw logits, before any of it.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from minivllm.sched.sequence import Sequence as SequenceState

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_NO_IDS = torch.zeros(0, dtype=torch.long)


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
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_ks: torch.Tensor,
    top_ps: torch.Tensor,
    min_ps: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-row sampling distributions, float64 `[B, V]`, from logits `[B, V]`.

    temperature scales the logits, top-k keeps the k most likely tokens (0 = all), top-p then keeps
    the smallest head of the sorted distribution whose mass reaches p (1 = all); the survivors are
    renormalised. A greedy row (temperature 0) becomes a one-hot at its argmax. `min_ps` (vLLM's
    order: after temperature, before top-k) first drops every token less likely than min_p times
    the likeliest.
    """
    logits = logits.to(torch.float64)
    greedy = temperatures == 0
    # Shift so the largest logit is 0 before dividing: a tiny temperature then sends the others to
    # -inf instead of overflowing everything to +inf (NaN probabilities).
    shifted = logits - logits.max(dim=-1, keepdim=True).values
    scaled = shifted / torch.where(greedy, 1.0, temperatures.to(torch.float64))[:, None]
    if min_ps is not None:  # the largest scaled logit is 0, so p / p_max = exp(scaled)
        floor = torch.log(min_ps.to(torch.float64))[:, None]  # min_p 0: -inf, nothing dropped
        scaled = scaled.masked_fill(scaled < floor, float("-inf"))
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


@dataclass(frozen=True, eq=False)
class LogitRules:
    """What one row does to its logits before temperature: vLLM's logits processors, in its order
    (allowed tokens, bad words, min_tokens, logit_bias, then the repetition, frequency and presence
    penalties). A row with none of them has no rules (None) and its logits are used as they are.

    Built ONCE per sequence (`of` keeps them while the sequence lives), with every id list as a
    tensor, so a step's work grows with the batch and the vocabulary, never with the length of a
    list the request sent. `history` is the sequence's token ids (a reference, not a copy): a row
    drawing position p sees the first p of them, so the rules depend only on the request's own
    tokens."""

    history: Sequence[int]
    prompt_len: int
    min_tokens: int = 0
    min_tokens_banned: torch.Tensor = _NO_IDS  # EOS and the stop token ids, until min_tokens
    always_banned: torch.Tensor = _NO_IDS  # the one-token bad words
    # The longer bad words: {tokens before the last: the last tokens they ban}, by prefix length.
    bad_word_tails: Mapping[int, Mapping[tuple[int, ...], torch.Tensor]] = field(
        default_factory=dict
    )
    allowed_token_ids: torch.Tensor | None = None
    bias_token_ids: torch.Tensor = _NO_IDS
    bias_values: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.float64))
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    _disallowed: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, seq: SequenceState) -> LogitRules | None:
        """The rules of a sequence's params, or None when it has none; built on the first call
        for a sequence, then the same object every step."""
        if not seq.params.has_logit_rules:  # the common case, checked without building anything
            return None
        rules = _RULES_OF_SEQUENCE.get(seq)
        if rules is None:
            rules = _RULES_OF_SEQUENCE[seq] = build_logit_rules(seq)
        return rules

    @property
    def penalises(self) -> bool:
        return bool(self.repetition_penalty != 1 or self.frequency_penalty or self.presence_penalty)

    def disallowed(self, vocab: int) -> torch.Tensor | None:
        """`[vocab]` bool, True where allowed_token_ids does not reach (None without them), made
        once per vocabulary size."""
        if self.allowed_token_ids is None:
            return None
        if vocab not in self._disallowed:
            mask = torch.ones(vocab, dtype=torch.bool)
            mask[self.allowed_token_ids] = False
            self._disallowed[vocab] = mask
        return self._disallowed[vocab]

    def banned(self, position: int) -> list[torch.Tensor]:
        """Tokens this row may not draw at `position`, as id tensors: stop tokens before
        min_tokens, and the last token of each bad word whose other tokens the output just ended
        with (as vLLM, only the generated tokens count). One dictionary look-up per bad-word
        length, however many bad words there are."""
        generated = position - self.prompt_len
        banned = [self.always_banned] if len(self.always_banned) else []
        if generated < self.min_tokens and len(self.min_tokens_banned):
            banned.append(self.min_tokens_banned)
        for before, tails in self.bad_word_tails.items():
            if generated >= before:
                last = tails.get(tuple(self.history[position - before : position]))
                if last is not None:
                    banned.append(last)
        return banned


# Each live sequence's rules: a sequence that finishes and is dropped takes its entry with it.
_RULES_OF_SEQUENCE: weakref.WeakKeyDictionary[SequenceState, LogitRules] = (
    weakref.WeakKeyDictionary()
)


def _ids(ids) -> torch.Tensor:
    return torch.tensor(list(dict.fromkeys(ids)), dtype=torch.long)


def build_logit_rules(seq: SequenceState) -> LogitRules:
    """A sequence's `LogitRules`, every list turned into a tensor (once: see `LogitRules.of`)."""
    p = seq.params
    stops = (() if p.ignore_eos else seq.eos_token_ids) + p.stop_token_ids
    words = [w for w in dict.fromkeys(seq.bad_word_ids) if w]  # an empty encoding bans nothing
    tails: dict[int, dict[tuple[int, ...], list[int]]] = {}
    for word in words:
        if len(word) > 1:
            tails.setdefault(len(word) - 1, {}).setdefault(word[:-1], []).append(word[-1])
    return LogitRules(
        history=seq.token_ids,
        prompt_len=seq.num_prompt_tokens,
        min_tokens=p.min_tokens,
        min_tokens_banned=_ids(stops) if p.min_tokens else _NO_IDS,
        always_banned=_ids(w[0] for w in words if len(w) == 1),
        bad_word_tails={
            before: {prefix: _ids(last) for prefix, last in table.items()}
            for before, table in tails.items()
        },
        allowed_token_ids=None if p.allowed_token_ids is None else _ids(p.allowed_token_ids),
        bias_token_ids=torch.tensor([t for t, _ in p.logit_bias], dtype=torch.long),
        bias_values=torch.tensor([b for _, b in p.logit_bias], dtype=torch.float64),
        repetition_penalty=p.repetition_penalty,
        frequency_penalty=p.frequency_penalty,
        presence_penalty=p.presence_penalty,
    )


def _row_index(rows: list[int], pieces: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) index tensors for id tensors `pieces`, piece i belonging to row rows[i]."""
    if not pieces:
        empty = torch.zeros(0, dtype=torch.long)
        return empty, empty
    counts = torch.tensor([len(piece) for piece in pieces])
    return torch.repeat_interleave(torch.tensor(rows), counts), torch.cat(pieces)


def apply_logit_rules(
    logits: torch.Tensor, rules: Sequence[LogitRules | None], positions: Sequence[int]
) -> torch.Tensor:
    """Logits `[R, V]` after each row's rules (float64; the rows without rules unchanged).

    One Python loop over the rows collects each row's prebuilt id tensors; every change to the
    logits is then one tensor operation for the whole batch, never a loop over the vocabulary or
    over a request's id lists."""
    logits = logits.to(torch.float64)
    rows = [r for r, rule in enumerate(rules) if rule is not None]
    if not rows:
        return logits
    logits = logits.clone()
    ban_rows, bans, bias_rows, restricted = [], [], [], []
    out_rows, out_tokens, seen_rows, seen_tokens, penalised = [], [], [], [], []
    for r in rows:
        rule, position = rules[r], positions[r]
        for banned in rule.banned(position):
            ban_rows.append(r)
            bans.append(banned)
        if rule.allowed_token_ids is not None:
            restricted.append(r)
        if len(rule.bias_token_ids):
            bias_rows.append(r)
        if rule.penalises:
            penalised.append(r)
            history = rule.history[:position]
            output = history[rule.prompt_len :]
            out_rows += [r] * len(output)
            out_tokens += output
            seen_rows += [r] * len(history)
            seen_tokens += history
    before_bans = logits.clone()
    if restricted:  # everything but the allowed tokens is banned
        vocab = logits.shape[-1]
        disallowed = torch.stack([rules[r].disallowed(vocab) for r in restricted])
        logits[restricted] = logits[restricted].masked_fill(disallowed, float("-inf"))
    if ban_rows:
        logits[_row_index(ban_rows, bans)] = float("-inf")
    if bias_rows:
        # accumulate=False: a token appears once per row (logit_bias is a mapping)
        index = _row_index(bias_rows, [rules[r].bias_token_ids for r in bias_rows])
        logits[index] += torch.cat([rules[r].bias_values for r in bias_rows])
    if penalised:
        logits = _penalise(
            logits, rules, penalised, (out_rows, out_tokens), (seen_rows, seen_tokens)
        )
    # A row whose rules left nothing to draw (say allowed_token_ids=[EOS] before min_tokens) keeps
    # its logits without the bans rather than sample from NaN.
    dead = torch.isneginf(logits).all(dim=-1)
    if dead.any():
        logits[dead] = before_bans[dead]
    return logits


def _penalise(logits, rules, penalised, output, seen) -> torch.Tensor:
    """vLLM's penalties: repetition over prompt + output (a positive logit divided by it, a
    negative one multiplied), then frequency (per earlier occurrence) and presence (once) over the
    output."""
    counts = torch.zeros_like(logits)
    counts.index_put_(
        (torch.tensor(output[0], dtype=torch.long), torch.tensor(output[1], dtype=torch.long)),
        torch.ones(len(output[0]), dtype=torch.float64),
        accumulate=True,
    )
    in_history = torch.zeros_like(logits, dtype=torch.bool)
    in_history[seen[0], seen[1]] = True
    column = torch.zeros(logits.shape[0], 3, dtype=torch.float64)
    column[:, 0] = 1.0
    for r in penalised:
        rule = rules[r]
        column[r] = torch.tensor(
            [rule.repetition_penalty, rule.frequency_penalty, rule.presence_penalty],
            dtype=torch.float64,
        )
    repetition, frequency, presence = (column[:, i : i + 1] for i in range(3))
    repeated = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(in_history, repeated, logits)
    return logits - frequency * counts - presence * (counts > 0)


def undrawable_rows(logits: torch.Tensor) -> list[int]:
    """Rows of `[R, V]` logits no distribution can come from: a NaN or +inf (an overflow upstream)
    makes softmax NaN, and a row with no finite logit has nothing to draw. One reduction: a row's
    max is NaN, +inf or -inf exactly then."""
    return (~torch.isfinite(logits.amax(dim=-1))).nonzero().flatten().tolist()


class UndrawableLogitsError(ValueError):
    """Sequences whose logits hold NaN or +inf, or no finite value: sampling them would emit
    arbitrary tokens, so they are named instead (the engine ends them, the rest of the batch
    goes on: ModelRunner.execute)."""

    def __init__(self, seq_ids: tuple[int, ...]) -> None:
        self.seq_ids = seq_ids
        super().__init__(
            f"the logits of sequence(s) {list(seq_ids)} hold NaN or +inf (or nothing finite): "
            "no token can be drawn from them"
        )


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
    min_ps: tuple[float, ...] = ()  # 0 = no min-p; empty = none in the batch
    rules: tuple[LogitRules | None, ...] = ()  # empty = no row has any
    logprobs: tuple[int | None, ...] = ()  # top logprobs wanted per row; empty = none

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
            min_ps=[p.min_p for p in params],
            rules=[LogitRules.of(s) for s in seqs],
            logprobs=[p.logprobs for p in params],
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
        *,
        min_ps: Sequence[float] = (),
        rules: Sequence[LogitRules | None] = (),
        logprobs: Sequence[int | None] = (),
    ) -> SamplingMetadata:
        """Rows given column by column; `seq_ids` default to 0, 1, 2, ... A column that is all
        "off" is stored empty, so a plain batch pays nothing for the features it does not use."""
        greedy = tuple(t == 0 for t in temperatures)
        min_ps = tuple(min_ps) if any(min_ps) else ()
        rules = tuple(rules) if any(r is not None for r in rules) else ()
        logprobs = tuple(logprobs) if any(k is not None for k in logprobs) else ()
        return cls(
            seq_ids=tuple(seq_ids if seq_ids is not None else range(len(temperatures))),
            temperatures=tuple(temperatures),
            top_ks=tuple(top_ks),
            top_ps=tuple(top_ps),
            seeds=tuple(seeds),
            positions=tuple(positions),
            greedy=greedy,
            all_greedy=all(greedy),
            min_ps=min_ps,
            rules=rules,
            logprobs=logprobs,
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
            min_ps=tuple(self.min_ps[r] for r in rows) if self.min_ps else (),
            rules=tuple(self.rules[r] for r in rows) if self.rules else (),
            logprobs=tuple(self.logprobs[r] for r in rows) if self.logprobs else (),
        )

    def processed(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits after each row's rules (see `apply_logit_rules`); as given without rules.
        Every draw goes through here, so a row nothing can be drawn from stops here too (see
        `undrawable_rows`), never becoming a silent token."""
        if self.rules:
            logits = apply_logit_rules(logits, self.rules, self.positions)
        if bad := undrawable_rows(logits):
            raise UndrawableLogitsError(tuple(dict.fromkeys(self.seq_ids[r] for r in bad)))
        return logits

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's sampling distribution, float64 `[R, V]` on the host (see `token_probs`),
        wherever the logits are: every draw is made on the host (see `sample`). The parameter
        tensors are made here, not per step: an all-greedy step never needs them."""
        return token_probs(
            self.processed(logits.cpu()),
            torch.tensor(self.temperatures, dtype=torch.float64),
            torch.tensor(self.top_ks, dtype=torch.long),
            torch.tensor(self.top_ps, dtype=torch.float64),
            torch.tensor(self.min_ps, dtype=torch.float64) if self.min_ps else None,
        )

    def uniforms(self, stream: int = 0) -> np.ndarray:
        """Each row's uniform number for `stream` (see `position_uniforms`)."""
        return position_uniforms(self.seeds, self.positions, stream)


def sample(logits: torch.Tensor, metadata: SamplingMetadata) -> list[int]:
    """The engine's sampler: one token per row of `logits`, each from its own request's
    distribution. A greedy batch without logit rules takes its argmax where the logits are (on a
    GPU only the ids cross to the host); anything else is drawn on the host, in float64, so a
    request's tokens never depend on the device."""
    if metadata.rules or not metadata.all_greedy:
        logits = logits.cpu()
    if metadata.all_greedy:  # skip the sort and the hash
        return greedy_tokens(metadata.processed(logits))
    return sample_from_probs(metadata.probs(logits), metadata.uniforms()).tolist()


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """Each row's argmax (its first largest logit): over a real vocabulary on the CPU in
    compiled vector code (`runner/greedy.py`, the same indices), else torch's."""
    from minivllm.runner import greedy  # imported at the first greedy step: it imports numba

    if greedy.takes(logits):
        return greedy.first_largest(logits)
    return logits.argmax(dim=-1).tolist()


def logprob_dicts(
    logits: torch.Tensor, tokens: Sequence[int], top: Sequence[int]
) -> list[dict[int, float]]:
    """Per row of raw logits `[R, V]`: {token id: logprob} for `tokens[r]` and the `top[r]`
    likeliest tokens, likeliest first (the chosen token last when it is not among them).

    vLLM V1's logprobs: the log-softmax of the model's raw logits in float64, before temperature,
    penalties or any filter, so they describe the model, not the sampling settings."""
    if not len(tokens):
        return []
    logprobs = torch.log_softmax(logits.to("cpu", torch.float64), dim=-1)
    width = max(top)
    values, ids = logprobs.topk(width, dim=-1) if width else (None, None)
    chosen = logprobs.gather(-1, torch.as_tensor(list(tokens)).reshape(-1, 1)).reshape(-1)
    dicts = []
    for r, (token, k) in enumerate(zip(tokens, top)):
        entry = dict(zip(ids[r, :k].tolist(), values[r, :k].tolist())) if k else {}
        entry.setdefault(int(token), float(chosen[r]))
        dicts.append(entry)
    return dicts


def sample_logprobs(
    logits: torch.Tensor, metadata: SamplingMetadata, tokens: Sequence[int]
) -> list[dict[int, float] | None]:
    """The logprobs of each row's drawn token (and its top ones), None for a row that asked for
    none."""
    if not metadata.logprobs:
        return [None] * len(tokens)
    rows = [r for r, k in enumerate(metadata.logprobs) if k is not None]
    dicts = logprob_dicts(
        logits[rows], [tokens[r] for r in rows], [metadata.logprobs[r] for r in rows]
    )
    out: list[dict[int, float] | None] = [None] * len(tokens)
    for r, entry in zip(rows, dicts):
        out[r] = entry
    return out
