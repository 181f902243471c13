"""A request as the engine sees it: its sampling parameters and its progress (chapter 04).

`SamplingParams` is what the caller asks for; it is checked once, when the request arrives, and each
bad field is named. `Sequence` is the engine's bookkeeping for one request: its token ids (prompt,
then output), how many of them already have K/V in the cache (`num_computed_tokens`) and its
status. It imports no torch: the scheduler (pure policy) and the tests use it bare.

It knows tokens, not text: EOS, stop token ids and max_tokens end a sequence here, as each token is
appended. Text -- decoding, stop strings, bad words -- belongs to the engine's tokenizer and lives
in engine/processing.py (vLLM's OutputProcessor and detokenizer); a stop string found there ends
the sequence through the scheduler (`Scheduler.stop`, `Sequence.stop_at`).

One number drives the whole engine: `num_tokens - num_computed_tokens`, the tokens the model still
has to run. A fresh prompt has all of them left (a prefill, perhaps in chunks); a running sequence
has exactly one, the token it sampled last step (a decode). A sequence that was preempted and lost
its cache (chapter 05) simply has many again.

A request with n > 1 samples is n sequences under one `request_id`: sample 0 is queued, the others
wait in its `forks` until its prompt is computed, then share its prompt's blocks (scheduler.py).
"""

from __future__ import annotations

import enum
from collections.abc import Hashable
from dataclasses import dataclass, field


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


MAX_N = 16  # parallel samples per request (SamplingParams.n)
MAX_LOGPROBS = 20  # top logprobs per token, as OpenAI's top_logprobs
# vLLM takes any repetition_penalty > 0, but a positive logit is divided by it: 1e-320 makes it
# infinite and the distribution NaN. Below 1e-3 (a repeated token's logit x 1000) nothing useful is
# left to ask for.
MIN_REPETITION_PENALTY = 1e-3


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each new token and when to stop, in the spirit of vLLM's class of the same name.

    temperature 0 is greedy. top_k 0 and top_p 1 switch those filters off. `seed` fixes the
    request's randomness: token i is drawn with a uniform number that depends only on (seed, i), so
    the request gives the same tokens whatever else is in the batch. `stop` strings end the request
    and are cut from its text (kept with `include_stop_str_in_output`; the engine's output
    processor finds them in the decoded text); `stop_token_ids` end it too (the token is kept in
    the ids and its text); EOS ends it unless `ignore_eos`.

    vLLM's further parameters, with its meaning and its order (the sampler applies them to the
    logits before temperature): `allowed_token_ids` (only these may be drawn), `bad_words` (a
    word's last token is banned right after its other tokens were generated), `min_tokens` (EOS and
    `stop_token_ids` are banned until this many tokens exist), `logit_bias` (token id -> bias added
    to its logit, in [-100, 100]; a dict is accepted and stored as sorted pairs),
    `repetition_penalty` (> 1 discourages every token of the prompt and output: a positive logit is
    divided by it, a negative one multiplied; at least MIN_REPETITION_PENALTY), `frequency_penalty`
    and `presence_penalty` (in [-2, 2]: subtracted once per earlier occurrence in the output, and
    once if it occurs at all),
    then `min_p` (after temperature: drop tokens less likely than min_p times the likeliest).
    Repeated ids and words in the list fields are kept once.

    `n` (1..16) asks for n samples of one prompt that share its KV blocks (sample i's randomness
    depends on (seed, i, position); sample 0 is the request alone). `logprobs` (0..20) returns, per
    generated token, the log-probabilities of the sampled token and of the `logprobs` likeliest;
    `prompt_logprobs` the same for each prompt token after the first. Both are vLLM V1's: the
    log-softmax of the model's raw logits, before any of the processing above.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    bad_words: tuple[str, ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    # stop_token_ids as a set, for the test on every appended token
    stop_token_set: frozenset[int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Accept a single string or any list for the list fields, a dict for logit_bias; store
        # tuples so the value stays frozen (and hashable).
        stop = (self.stop,) if isinstance(self.stop, str) else _tuple(self.stop)
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", _tuple(self.stop_token_ids))
        bad = (self.bad_words,) if isinstance(self.bad_words, str) else _tuple(self.bad_words)
        object.__setattr__(self, "bad_words", bad)
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", _tuple(self.allowed_token_ids))
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        for problem in self._problems():
            raise ValueError(f"SamplingParams.{problem}")
        # Repeats change nothing but would cost work on every step: keep each id and word once.
        # With the vocabulary check at the door (InputProcessor) no list is then longer than the
        # vocabulary, whatever the request sent.
        for name in ("stop_token_ids", "bad_words", "allowed_token_ids"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, tuple(dict.fromkeys(getattr(self, name))))
        object.__setattr__(self, "stop_token_set", frozenset(self.stop_token_ids))

    def _problems(self):
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            yield f"max_tokens must be an int >= 1, got {self.max_tokens!r}"
        if not _is_number(self.temperature) or not 0 <= self.temperature < float("inf"):
            yield f"temperature must be a number >= 0 (0 = greedy), got {self.temperature!r}"
        if not _is_int(self.top_k) or self.top_k < 0:
            yield f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}"
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            yield f"top_p must be a number in (0, 1] (1 = off), got {self.top_p!r}"
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**63):
            yield f"seed must be None or an int in [0, 2**63), got {self.seed!r}"
        if not _all(self.stop, lambda s: isinstance(s, str) and s):
            yield f"stop must be non-empty strings, got {_short(self.stop)}"
        if not _all(self.stop_token_ids, lambda t: _is_int(t) and t >= 0):
            yield f"stop_token_ids must be non-negative ints, got {_short(self.stop_token_ids)}"
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                yield f"{name} must be True or False, got {getattr(self, name)!r}"
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            yield f"n must be an int in [1, {MAX_N}], got {self.n!r}"
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                yield f"{name} must be a number in [-2, 2] (0 = off), got {value!r}"
        rep = self.repetition_penalty
        if not _is_number(rep) or not MIN_REPETITION_PENALTY <= rep < float("inf"):
            yield (
                f"repetition_penalty must be a finite number >= {MIN_REPETITION_PENALTY} (1 = off;"
                f" far below 1 a repeated token's logit is divided toward overflow), got {rep!r}"
            )
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            yield f"min_p must be a number in [0, 1] (0 = off), got {self.min_p!r}"
        if not _all(self.logit_bias, _is_bias_pair):
            yield (
                "logit_bias must map token ids (ints >= 0) to numbers in [-100, 100], "
                f"got {_short(self.logit_bias)}"
            )
        elif len({t for t, _ in self.logit_bias}) < len(self.logit_bias):
            yield f"logit_bias names a token id twice, got {_short(self.logit_bias)}"
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            yield (
                f"min_tokens must be an int in [0, max_tokens={self.max_tokens}], "
                f"got {self.min_tokens!r}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                yield f"{name} must be None or an int in [0, {MAX_LOGPROBS}], got {value!r}"
        if not _all(self.bad_words, lambda w: isinstance(w, str) and w):
            yield f"bad_words must be non-empty strings, got {_short(self.bad_words)}"
        allowed = self.allowed_token_ids
        if allowed is not None and (
            not allowed or not _all(allowed, lambda t: _is_int(t) and t >= 0)
        ):
            yield (
                "allowed_token_ids must be None or a non-empty list of non-negative ints, "
                f"got {_short(allowed)}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_logit_rules(self) -> bool:
        """Does the sampler change this request's logits before temperature (see the class)?"""
        return bool(
            self.min_tokens
            or self.allowed_token_ids is not None
            or self.bad_words
            or self.logit_bias
            or self.uses_history
        )

    @property
    def uses_history(self) -> bool:
        """Does a token's distribution depend on the tokens before it (penalties, bad words)?"""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1
            or self.bad_words
        )


def _all(values, check) -> bool:
    return isinstance(values, tuple) and all(check(v) for v in values)


def _is_bias_pair(pair) -> bool:
    return (
        isinstance(pair, tuple)
        and len(pair) == 2
        and _is_int(pair[0])
        and pair[0] >= 0
        and _is_number(pair[1])
        and -100 <= pair[1] <= 100
    )


def _tuple(value) -> tuple:
    """A list-like field as a tuple; anything else is kept as it is, for `_problems` to name."""
    return tuple(value) if isinstance(value, (list, tuple, set, frozenset)) else value


def _bias_pairs(value) -> tuple:
    """logit_bias as sorted (token id, bias) pairs, from a dict or pairs; a bad shape is kept for
    `_problems` to name."""
    if isinstance(value, dict):
        value = value.items()
    try:
        pairs = tuple((t, b) for t, b in value)
    except (TypeError, ValueError):
        return value if isinstance(value, tuple) else (value,)
    if all(_is_int(t) for t, _ in pairs):
        pairs = tuple(sorted(pairs, key=lambda pair: pair[0]))
    return pairs


def _short(value, limit: int = 80) -> str:
    """A value's repr, cut: an error message never echoes a huge input back."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class Status(enum.Enum):
    WAITING = "waiting"  # queued; holds no blocks
    RUNNING = "running"  # admitted; holds the blocks of its computed tokens
    FINISHED = "finished"  # done; its blocks are back in the pool


# Finish reasons, as the OpenAI API names them, plus "abort" (as vLLM) and "cache_full": the
# sequence outgrew the whole KV cache while running alone, so no amount of waiting could let it
# continue.
STOP, LENGTH, ABORT, CACHE_FULL = "stop", "length", "abort", "cache_full"


@dataclass(eq=False)
class Sequence:
    """One request's state inside the engine."""

    seq_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # the params' seed, or one the engine derived from its own seed and the request id
    eos_token_id: int | tuple[int, ...] | None  # the EOS id(s): a tokenizer may name several
    arrival_step: int = 0
    token_ids: list[int] = field(default_factory=list)  # prompt then output
    num_computed_tokens: int = 0  # leading tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # of those, how many came from the prefix cache at admission
    max_computed_tokens: int = 0  # the most it ever had computed (more than now after a preemption)
    # Speculative decoding with a draft model (chapter 06): leading tokens whose K/V are in the
    # DRAFT model's cache. None when no draft model keeps a cache for this sequence.
    num_draft_computed_tokens: int | None = None
    num_preemptions: int = 0
    status: Status = Status.WAITING
    finish_reason: str | None = None
    # the stop token or string that ended it (None for EOS / length)
    stop_reason: int | str | None = None
    finish_message: str | None = None  # why, in words, when the engine ended it (cache_full)
    # Parallel sampling (SamplingParams.n > 1): the caller's request id and which sample this is.
    # A lone request has request_id == seq_id and index 0.
    request_id: int | None = None
    index: int = 0
    # Fairness (waiting.py): the client request it belongs to. Every prompt and sample of one HTTP
    # request shares one; the waiting queue serves groups in turns. Default: its request_id.
    group: Hashable | None = None
    # The other samples of its request, waiting for this one's prompt: when its prefill is done
    # they fork its block table (sharing the prompt's blocks) and draw their first tokens from the
    # same logits (scheduler.update).
    forks: list[Sequence] = field(default_factory=list, repr=False)
    # SamplingParams.logprobs: {token id: logprob} per output token (the sampled one and the top
    # k); prompt_logprobs: one per prompt token, None for the first (nothing predicts it).
    output_logprobs: list[dict[int, float]] | None = field(default=None, repr=False)
    prompt_logprobs: list[dict[int, float] | None] | None = field(default=None, repr=False)
    # params.bad_words as token ids, by the engine's tokenizer (InputProcessor.bad_word_ids)
    bad_word_ids: tuple[tuple[int, ...], ...] = field(default=(), repr=False)
    eos_token_ids: tuple[int, ...] = field(init=False, repr=False)  # eos_token_id as a tuple

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if self.request_id is None:
            self.request_id = self.seq_id
        if self.group is None:
            self.group = self.request_id
        if self.params.logprobs is not None and self.output_logprobs is None:
            self.output_logprobs = []
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None]
        eos = self.eos_token_id
        self.eos_token_ids = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)

    @property
    def prompt_logprobs_done(self) -> bool:
        """Has every prompt token its logprobs (or were none asked for)?"""
        return self.prompt_logprobs is None or len(self.prompt_logprobs) >= self.num_prompt_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        """What the model still has to run: the whole prompt at first, then one token per step."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_decoding(self) -> bool:
        """Its whole prompt is computed, and only the token it sampled last is not: one to run."""
        return (
            self.num_uncomputed_tokens == 1 and self.num_computed_tokens >= self.num_prompt_tokens
        )

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def append_tokens(self, tokens: list[int]) -> int:
        """Append a run of tokens (speculative decoding accepts several at once) until one of them
        finishes the request; returns how many were appended. The rest of the run is dropped."""
        for count, token in enumerate(tokens, start=1):
            self.append_token(token)
            if self.is_finished:
                return count
        return len(tokens)

    def append_token(self, token: int) -> None:
        """Record a sampled token and decide whether the request is now done (stop strings are
        the output processor's: they need the text)."""
        self.token_ids.append(token)
        params = self.params
        # The sampler never draws EOS or a stop token before min_tokens; a token run handed in
        # from outside still must not end the request early.
        may_stop = self.num_output_tokens > params.min_tokens
        if token in self.eos_token_ids and not params.ignore_eos and may_stop:
            self.finish(STOP)
        elif token in params.stop_token_set and may_stop:
            self.finish(STOP, stop_reason=token)
        elif self.num_output_tokens >= params.max_tokens:
            self.finish(LENGTH)

    @property
    def stopped_by_token(self) -> bool:
        """Did its last token end it (EOS or a stop token id)? Then no stop string is looked for
        in that token's text: the token came first, as when it was appended."""
        return self.finish_reason == STOP and not isinstance(self.stop_reason, str)

    def stop_at(self, num_output_tokens: int, stop: str) -> None:
        """End on stop string `stop`, which output token `num_output_tokens` completed: the tokens
        after it (a speculative run appends several at once) are dropped. It wins over a length
        finish in the same step, as it would have token by token."""
        del self.token_ids[self.num_prompt_tokens + num_output_tokens :]
        if self.output_logprobs is not None:
            del self.output_logprobs[num_output_tokens:]
        self.num_computed_tokens = min(self.num_computed_tokens, self.num_tokens)
        self.finish(STOP, stop_reason=stop)

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        self.status, self.finish_reason, self.stop_reason = Status.FINISHED, reason, stop_reason
