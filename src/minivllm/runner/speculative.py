"""Speculative decoding: a cheap drafter guesses k tokens, the target checks them all in one pass
(chapter 06).

Plain decoding runs the whole target model once per token, and at small batch each pass costs about
the same whatever it computes: the step is latency bound. Speculative decoding buys several tokens
per target pass. A **drafter** proposes k tokens d_1..d_k, with the distributions q_1..q_k it drew
them from. The target then runs the last token and all k drafts in ONE pass (a (k + 1)-token chunk
over the paged cache) and so gets its own distributions p_1..p_{k+1} at every position. Then, left
to right:

* accept d_i with probability min(1, p_i(d_i) / q_i(d_i));
* at the first rejection, draw that position again from norm(max(0, p_i - q_i)) -- the part of p
  that
  q under-proposed -- and throw the remaining drafts away;
* if all k are accepted, draw a bonus token from p_{k+1}.

Every emitted token is then distributed exactly as the target alone would have drawn it (the proof
is in the chapter, the chi-square test in tests/test_speculative.py). Greedy is the limit where p
and q are one-hot: a draft is accepted iff it is the target's argmax, and a rejection emits the
argmax instead.

Randomness stays a pure function of (request seed, position): the draft's draw, the accept test and
the residual draw at position i use `position_uniforms(seed, i, stream)` with their own stream, and
a bonus token uses stream 0, the ordinary draw. So a request's tokens do not depend on the batch, on
preemption or on the timing of anything else -- only on (seed, k, drafter). Under sampling they are
a *different* draw from plain decoding's (the same distribution, not the same tokens); under greedy
they are the same.

Two drafters: `ModelDrafter` runs the small shipped draft model (its K/V live in their own tensor,
read through the target's block tables), and `NgramDrafter` needs no model at all: it proposes
whatever followed the latest earlier occurrence of the context's last few tokens (prompt lookup).
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass

import numpy as np
import torch

from minivllm.attention.storage import PagedKVStorage
from minivllm.attention.torch_backend import TorchPagedAttention
from minivllm.kv.block_manager import BlockManager
from minivllm.model.transformer import Transformer, placed_on
from minivllm.runner.batch import BatchPiece, pack_batch, run_model
from minivllm.runner.sampler import SamplingMetadata, sample_from_probs
from minivllm.sched.sequence import Sequence

# Independent random streams per position; stream 0 is the ordinary draw (and the bonus token's).
STREAM_DRAFT, STREAM_ACCEPT, STREAM_RESIDUAL = 1, 2, 3
METHODS = ("draft", "ngram")


@dataclass(frozen=True)
class SpeculativeConfig:
    """How the engine speculates, after vLLM's `speculative_config`."""

    method: str = "draft"  # "draft": a small model drafts; "ngram": prompt lookup, no model
    num_speculative_tokens: int = 4  # k, drafts per sequence per step
    # a model, or the name of a shipped one (method "draft")
    draft_model: Transformer | str = "draft"
    prompt_lookup_min: int = 1  # n-gram sizes tried, longest first (method "ngram")
    prompt_lookup_max: int = 3

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(
                f"SpeculativeConfig.method must be one of {METHODS}, got {self.method!r}"
            )
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(
                f"SpeculativeConfig.num_speculative_tokens must be an int >= 1, got {k!r}"
            )
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if not (isinstance(low, int) and isinstance(high, int) and 1 <= low <= high):
            raise ValueError(
                f"SpeculativeConfig needs 1 <= prompt_lookup_min <= prompt_lookup_max, "
                f"got {low!r} and {high!r}"
            )


@dataclass(frozen=True)
class Proposal:
    """A drafter's guess for one sequence: the tokens, and the distributions they were drawn from
    (`[len(tokens), vocab]`); `probs=None` means a deterministic drafter, each q a one-hot at its
    token."""

    tokens: tuple[int, ...] = ()
    probs: torch.Tensor | None = None

    def draft_probs(self, vocab_size: int) -> torch.Tensor:
        if self.probs is not None:
            return self.probs
        one_hot = torch.zeros(len(self.tokens), vocab_size, dtype=torch.float64)
        return one_hot.scatter(1, torch.tensor(self.tokens, dtype=torch.long).view(-1, 1), 1.0)


# -- the acceptance rule ---------------------------------------------------------------------------
def accept_or_resample(
    p: torch.Tensor,
    q: torch.Tensor,
    drafted: torch.Tensor,
    u_accept: torch.Tensor,
    u_residual: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule for each drafted row on its own. `p`, `q`: target and draft distributions `[R, V]`;
    `drafted`: the draft tokens `[R]`; `u_accept`, `u_residual`: one uniform in [0, 1) per row.

    Returns `accepted` `[R]` (bool: is the draft kept?) and `resampled` `[R]`: the token to emit
    instead, drawn from norm(max(0, p - q)) by inverse CDF with `u_residual`. Only a sequence's
    first rejected row is used; the caller throws away everything after it.
    """
    p_draft = p.gather(1, drafted.view(-1, 1)).view(-1)
    q_draft = q.gather(1, drafted.view(-1, 1)).view(-1)
    # EXERCISE ch06.1: acceptance rule -- accept w.p. min(1, p/q), else draw from norm(max(0, p-q))
    ### BEGIN SOLUTION
    # u < p/q, written without the division. A draft the drafter gave no probability (q = 0) is
    # never accepted: it cannot have been drawn from q, and p/q would be undefined.
    accepted = (q_draft > 0) & (u_accept * q_draft < p_draft)
    residual = (p - q).clamp(min=0)
    # Where p <= q everywhere (p == q up to round-off) a rejection has probability 0 in exact
    # arithmetic; if round-off rejects anyway, p itself is the right distribution to draw from.
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    residual = torch.where(empty, p, residual)
    resampled = sample_from_probs(residual, u_residual)  # it normalises by the row's total
    ### END SOLUTION
    return accepted, resampled


def verify(
    logits: torch.Tensor, metadata: SamplingMetadata, proposals: SequenceOf[Proposal]
) -> list[list[int]]:
    """Turn the verify pass's logits into each sequence's emitted run of tokens.

    `metadata` has a row per sequence, drawing its next token. `logits` holds, per sequence in
    order, `len(tokens) + 1` rows: row j is the target's prediction for position `num_tokens + j`
    (the first checks draft 1, the last gives the bonus). A sequence with no draft gets exactly the
    ordinary sampler's token. Returns, per sequence, the accepted drafts followed by one token of
    the target's own (the resampled one at the first rejection, or the bonus).
    """
    rows = [len(p.tokens) + 1 for p in proposals]
    if sum(rows) != logits.shape[0]:
        raise ValueError(
            f"{logits.shape[0]} rows of logits for {len(rows)} sequences that need {sum(rows)}"
        )
    accepted, own = judge_rows(logits, metadata, proposals)
    # EXERCISE ch06.3: the verify loop -- each sequence: kept drafts, then the target's own token
    ### BEGIN SOLUTION
    runs, first = [], 0  # first: the row that checks the sequence's first draft
    for prop in proposals:
        run = []
        for token in prop.tokens:
            if not accepted[first + len(run)]:
                break  # the drafts after a rejection were built on a token that is not emitted
            run.append(token)
        # the row after the kept drafts: its replacement at a rejection, the bonus after them all
        run.append(own[first + len(run)])
        runs.append(run)
        first += len(prop.tokens) + 1
    ### END SOLUTION
    return runs


def judge_rows(
    logits: torch.Tensor, metadata: SamplingMetadata, proposals: SequenceOf[Proposal]
) -> tuple[list[bool], list[int]]:
    """Per row of the verify pass's logits (laid out as `verify` says): `accepted`, whether the
    draft the row checks is kept (False on each sequence's last row, which checks none), and `own`,
    the token the target emits if the sequence's run stops at that row: at a draft's row the
    replacement drawn from the residual (ch06.1), at the last row the bonus token. Greedy rows
    compare each draft with the target's argmax, which is also every row's own token."""
    rows = [len(p.tokens) + 1 for p in proposals]
    checked = [t for prop in proposals for t in (*prop.tokens, -1)]  # -1: a bonus row checks none
    if metadata.all_greedy and not metadata.rules:
        choices = logits.argmax(dim=-1).tolist()
        return [c == d for c, d in zip(choices, checked)], choices
    # One metadata row per logits row: sequence i's rows draw positions num_tokens + 0 .. + n - 1.
    expanded = metadata.select(
        [i for i, n in enumerate(rows) for _ in range(n)], [j for n in rows for j in range(n)]
    )
    if expanded.all_greedy:  # with logit rules (position-only under speculation, e.g. min_tokens)
        choices = expanded.processed(logits).argmax(dim=-1).tolist()
        return [c == d for c, d in zip(choices, checked)], choices
    p = expanded.probs(logits)
    ends = np.cumsum(rows).tolist()  # sequence i's rows end at ends[i]; the last is its bonus row
    bonus_rows = [end - 1 for end in ends]
    draft_rows = [r for end, n in zip(ends, rows) for r in range(end - n, end - 1)]
    accepted, own = [False] * len(checked), [0] * len(checked)
    bonus = sample_from_probs(p[bonus_rows], expanded.select(bonus_rows).uniforms())
    for row, token in zip(bonus_rows, bonus.tolist()):
        own[row] = token
    if draft_rows:
        q = torch.cat([prop.draft_probs(logits.shape[-1]) for prop in proposals if prop.tokens])
        drafted = torch.tensor([t for prop in proposals for t in prop.tokens], dtype=torch.long)
        drafts = expanded.select(draft_rows)
        ok, again = accept_or_resample(
            p[draft_rows],
            q,
            drafted,
            torch.from_numpy(drafts.uniforms(STREAM_ACCEPT)),
            torch.from_numpy(drafts.uniforms(STREAM_RESIDUAL)),
        )
        for row, kept, token in zip(draft_rows, ok.tolist(), again.tolist()):
            accepted[row], own[row] = kept, token
    return accepted, own


# -- drafters --------------------------------------------------------------------------------------
class NgramDrafter:
    """Prompt lookup: find the latest earlier place where the context's last n tokens occurred (n
    from
    `max_n` down to `min_n`) and propose the tokens that followed it there. No model, no cache; its
    proposals are deterministic (q one-hot), so the acceptance test reduces to u < p(draft)."""

    uses_cache = False

    def __init__(self, min_n: int = 1, max_n: int = 3) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(
        self,
        seqs: SequenceOf[Sequence],
        lookaheads: SequenceOf[int],
        metadata: SamplingMetadata | None = None,
    ) -> list[Proposal]:
        """Up to `lookaheads[i]` tokens for `seqs[i]` (no randomness: `metadata` is not needed)."""
        return [Proposal(tuple(self.lookup(s.token_ids, k))) for s, k in zip(seqs, lookaheads)]

    def lookup(self, token_ids: SequenceOf[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier match of the last n tokens; [] if
        none."""
        if k <= 0:
            return []
        tokens = np.asarray(token_ids)
        for n in range(self.max_n, self.min_n - 1, -1):
            if len(tokens) <= n:
                continue
            # Windows that start at 0 .. len - n - 1: each is followed by at least one token, and
            # the suffix itself (starting at len - n) is not among them.
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return tokens[start : start + k].tolist()
        return []


class ModelDrafter:
    """A small model drafts k tokens per sequence in k batched passes.

    Its K/V live in their own `PagedKVStorage` but at the *same* slots as the target's: it reads and
    writes through the target's block tables (as vLLM's draft models do). So the scheduler reserves
    one set of blocks, and one truncation after the verify rolls back both caches. The draft lags
    the target by a token or two (`Sequence.num_draft_computed_tokens`); the first pass of each
    round
    catches it up -- after a fresh prefill or a preemption that is the whole prompt.
    """

    uses_cache = True

    def __init__(
        self,
        model: Transformer,
        manager: BlockManager,
        num_blocks: int,
        dtype: torch.dtype,
        device: str = "cpu",
        backend: type = TorchPagedAttention,
    ) -> None:
        self.model, self.manager, self.backend = placed_on(model, device), manager, backend
        self.storage = PagedKVStorage(
            model.config,
            num_blocks,
            manager.block_size,
            dtype,
            device,
            heads_outer=getattr(backend, "heads_outer", False),
        )

    def propose(
        self,
        seqs: SequenceOf[Sequence],
        lookaheads: SequenceOf[int],
        metadata: SamplingMetadata,
    ) -> list[Proposal]:
        """Up to `lookaheads[i]` draft tokens for `seqs[i]`; `metadata` has a row per sequence."""
        tokens = {s.seq_id: [] for s in seqs}
        probs: dict[int, list[torch.Tensor]] = {s.seq_id: [] for s in seqs}
        active = [(i, s, k) for i, (s, k) in enumerate(zip(seqs, lookaheads)) if k > 0]
        # Pass 1 catches each draft cache up to the sequence's last token; passes 2..k feed back
        # one draft.
        pieces = [
            BatchPiece(
                s.seq_id, s.num_draft_computed_tokens, s.token_ids[s.num_draft_computed_tokens :], 1
            )
            for _, s, _ in active
        ]
        while active:
            # Decodes first, as the attention wants them.
            order = sorted(range(len(active)), key=lambda i: len(pieces[i].token_ids))
            active, pieces = [active[i] for i in order], [pieces[i] for i in order]
            # Row i draws the sequence's token number num_tokens + (drafts so far).
            rows = metadata.select(
                [i for i, _, _ in active], [len(tokens[s.seq_id]) for _, s, _ in active]
            )
            drawn, q = self._draw(pieces, rows)
            still, next_pieces = [], []
            for (i, seq, k), piece, token, q_row in zip(active, pieces, drawn, q):
                tokens[seq.seq_id].append(token)
                probs[seq.seq_id].append(q_row)
                seq.num_draft_computed_tokens = piece.start + len(piece.token_ids)
                if len(tokens[seq.seq_id]) < k:
                    still.append((i, seq, k))
                    next_pieces.append(
                        BatchPiece(seq.seq_id, seq.num_draft_computed_tokens, [token], 1)
                    )
            active, pieces = still, next_pieces
        return [Proposal(tuple(tokens[s.seq_id]), _stack_or_none(probs[s.seq_id])) for s in seqs]

    def _draw(
        self, pieces: list[BatchPiece], metadata: SamplingMetadata
    ) -> tuple[list[int], list[torch.Tensor | None]]:
        """One batched draft pass: each piece's next draft token and the distribution q it came
        from (None for a greedy row: q is the one-hot at the argmax, no need to build it)."""
        logits = run_model(self.model, self.storage, pack_batch(pieces, self.manager), self.backend)
        if metadata.all_greedy:
            return metadata.processed(logits).argmax(dim=-1).tolist(), [None] * len(pieces)
        q = metadata.probs(logits)
        tokens = sample_from_probs(q, metadata.uniforms(STREAM_DRAFT)).tolist()
        # A greedy row's q is the one-hot at its token: leave it implied (None) whoever else is in
        # the pass.
        return tokens, [None if g else row for g, row in zip(metadata.greedy, q)]


def _stack_or_none(rows: list[torch.Tensor | None]) -> torch.Tensor | None:
    """A sequence's q rows as one tensor; None when there are none or they are implied one-hots
    (greedy)."""
    return None if not rows or rows[0] is None else torch.stack(rows)


def make_drafter(
    config: SpeculativeConfig,
    target: Transformer,
    manager: BlockManager,
    num_blocks: int,
    dtype: torch.dtype,
    device: str = "cpu",
    backend: type = TorchPagedAttention,
    max_model_len: int | None = None,
) -> NgramDrafter | ModelDrafter:
    """The drafter `config` names; a draft model must cover the engine's context (`max_model_len`,
    by default the target's whole context)."""
    if config.method == "ngram":
        return NgramDrafter(config.prompt_lookup_min, config.prompt_lookup_max)
    draft = config.draft_model
    if isinstance(draft, str):
        # only the draft method needs weights
        from minivllm.model.checkpoint import (
            load_model,
        )

        draft = load_model(draft)
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(
            f"the draft model's vocabulary ({draft.config.vocab_size}) differs from the target's "
            f"({target.config.vocab_size}): their token ids would not mean the same thing"
        )
    context = target.config.max_seq_len if max_model_len is None else max_model_len
    if draft.config.max_seq_len < context:
        raise ValueError(
            f"the draft model's context ({draft.config.max_seq_len}) is shorter than the engine's "
            f"max_model_len ({context}): it could not draft for long sequences"
        )
    return ModelDrafter(draft, manager, num_blocks, dtype, device, backend)
