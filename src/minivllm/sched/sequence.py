"""A request as the engine sees it: its sampling parameters and its progress (chapter 04).

`SamplingParams` is what the caller asks for; it is checked once, when the request arrives, and each
bad field is named. `Sequence` is the engine's bookkeeping for one request: its token ids (prompt,
then output), how many of them already have K/V in the cache (`num_computed_tokens`), its status,
and the text decoded so far. It imports no torch: the scheduler (pure policy) and the tests use it
bare.

One number drives the whole engine: `num_tokens - num_computed_tokens`, the tokens the model still
has to run. A fresh prompt has all of them left (a prefill, perhaps in chunks); a running sequence
has exactly one, the token it sampled last step (a decode). A sequence that was preempted and lost
its cache (chapter 05) simply has many again.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from minivllm.model.tokenizer import StreamingDecoder


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each new token and when to stop, in the spirit of vLLM's class of the same name.

    temperature 0 is greedy. top_k 0 and top_p 1 switch those filters off. `seed` fixes the
    request's randomness: token i is drawn with a uniform number that depends only on (seed, i), so
    the request gives the same tokens whatever else is in the batch. `stop` strings end the request
    and are cut from its text; `stop_token_ids` end it too (the token is kept in the ids); EOS ends
    it unless `ignore_eos`.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        # Accept a single string or any list for the stop fields; store tuples so the value stays
        # frozen.
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        for problem in self._problems():
            raise ValueError(f"SamplingParams.{problem}")

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
        if not all(isinstance(s, str) and s for s in self.stop):
            yield f"stop must be non-empty strings, got {self.stop!r}"
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            yield f"stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}"
        if not isinstance(self.ignore_eos, bool):
            yield f"ignore_eos must be True or False, got {self.ignore_eos!r}"

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


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
    eos_token_id: int
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
    output_text: str = ""
    _decoder: StreamingDecoder = field(default_factory=StreamingDecoder, repr=False)
    _text_checked: int = field(default=0, repr=False)  # chars already searched for stop strings

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

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
        """Record a sampled token and decide whether the request is now done."""
        self.token_ids.append(token)
        self.output_text += self._decoder.push(token)
        params = self.params
        if token == self.eos_token_id and not params.ignore_eos:
            self.finish(STOP)
        elif token in params.stop_token_ids:
            self.finish(STOP, stop_reason=token)
        elif (hit := self._find_stop_string()) is not None:
            self.finish(STOP, stop_reason=hit[1])
            # the stop string is not part of the answer
            self.output_text = self.output_text[: hit[0]]
        elif self.num_output_tokens >= params.max_tokens:
            self.finish(LENGTH)

    def _find_stop_string(self) -> tuple[int, str] | None:
        """Earliest stop string in the text; only the tail can hold a new match, so look there."""
        best = None
        for stop in self.params.stop:
            index = self.output_text.find(stop, max(0, self._text_checked - len(stop) + 1))
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        self._text_checked = len(self.output_text)
        return best

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        # a cut-off character is shown as U+FFFD, not lost
        self.output_text += self._decoder.flush()
        self.status, self.finish_reason, self.stop_reason = Status.FINISHED, reason, stop_reason
