"""What goes into the engine and what comes out of it, in one place (chapters 04 and 08).

This is where text lives. The scheduler and the sequences below it know token ids only; the
engine's tokenizer (`Tokenizer`: the byte tokenizer, or a checkpoint's own) is used here, and only
here, in both directions, so a prompt is encoded and its answer decoded by the same tokenizer.

`InputProcessor` turns a caller's prompt and `SamplingParams` into checked token ids *before* the
scheduler sees them (bad words too: `bad_word_ids`): a bad request raises an error that says what
to change, and nothing in the engine changes. `OutputProcessor` decodes each sequence's new tokens
(a `Detokenizer` per sequence: whole characters only), looks for stop strings in that text, and
turns a `Sequence` into the `RequestOutput` the caller gets after a step. A stop string found ends
the request: `detokenize` returns it, and the engine ends the sequence in the scheduler
(`Scheduler.stop`; vLLM aborts it with finish reason "stop"), the text cut at the stop string. The
processor also keeps each request's **stream cursor**: how much of its text and how many of its
tokens were handed out already, so that every output also carries just what is new since the last
one. `LLMEngine` and the server's `AsyncEngine` both use these two, so a rule about requests (a
limit, a new parameter, how a stop string is held back) is written once. The same split is vLLM's
`InputProcessor` / `OutputProcessor` and its detokenizer (vllm/v1/engine/).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field

from minivllm.model.tokenizer import ByteTokenizer, Detokenizer, Tokenizer
from minivllm.sched.sequence import SamplingParams, Sequence

Prompt = str | SequenceOf[int]


@dataclass(frozen=True)
class CompletionOutput:
    """One sample of a request, as vLLM's class of the same name (`RequestOutput.outputs`)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None  # the sampled tokens' logprobs summed, when asked for
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    """A request as the caller sees it after a step: everything so far, and what is new.

    One output is one sample (`index`); its fields are that sample's. `outputs` is vLLM's view:
    every sample of the request as a `CompletionOutput` (after `generate`, all n of them)."""

    request_id: int
    prompt_token_ids: list[int]  # one list, shared by all of the request's outputs
    token_ids: list[int]  # generated tokens
    text: str  # generated text (a stop string is cut off)
    finished: bool
    finish_reason: str | None  # "stop", "length", "abort" or "cache_full"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache
    num_preemptions: int = 0
    finish_message: str | None = None  # why the engine ended it, for finish_reason "cache_full"
    new_text: str = ""  # text since this request's last output (see OutputProcessor)
    new_token_ids: tuple[int, ...] = ()  # tokens since this request's last output
    # Parallel sampling (SamplingParams.n > 1): which of the request's samples this is. Every
    # sample reports under the same request_id and finishes on its own.
    index: int = 0
    # SamplingParams.logprobs: one {token id: logprob} per generated token (the sampled token
    # and the top ones, likeliest first); new_logprobs are those of new_token_ids.
    logprobs: list[dict[int, float]] | None = None
    new_logprobs: tuple[dict[int, float], ...] | None = None
    # SamplingParams.prompt_logprobs: one per prompt token, None for the first (as vLLM).
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # LLMEngine.generate with n > 1: all n finished samples in index order (this one first);
    # empty otherwise.
    samples: list[RequestOutput] = field(default_factory=list, repr=False, compare=False)
    prompt: str | None = None  # the prompt's text, when it was given as text (LLMEngine.generate)

    @property
    def outputs(self) -> list[CompletionOutput]:
        """vLLM's `RequestOutput.outputs`: this output's samples (just itself when n is 1)."""
        return [sample.completion() for sample in self.samples or [self]]

    def completion(self) -> CompletionOutput:
        cumulative = None
        if self.logprobs is not None:
            cumulative = sum(entry[t] for t, entry in zip(self.token_ids, self.logprobs))
        return CompletionOutput(
            self.index,
            self.text,
            list(self.token_ids),
            cumulative,
            self.logprobs,
            self.finish_reason,
            self.stop_reason,
        )

    def delta(self) -> TextDelta:
        """The streamed piece of this output."""
        return TextDelta(
            self.request_id,
            self.new_text,
            self.new_token_ids,
            self.finish_reason,
            self.index,
            self.new_logprobs,
        )


@dataclass(frozen=True)
class TextDelta:
    """One piece of a streamed response: the new text of one request since its last delta."""

    request_id: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None
    index: int = 0  # which sample of the request (n > 1)
    logprobs: tuple[dict[int, float], ...] | None = None  # per token, when the request asked


@dataclass(frozen=True)
class EngineRequest:
    """A request as `InputProcessor.process` checked it: what `LLMEngine.add_request` (and the
    server's AsyncEngine) queue without checking again -- admission happens once."""

    prompt_ids: tuple[int, ...]
    params: SamplingParams
    bad_word_ids: tuple[tuple[int, ...], ...]  # `params.bad_words` as token ids, for the sampler
    checked_by: object = field(default=None, repr=False, compare=False)  # the InputProcessor


@dataclass(frozen=True)
class RequestLimits:
    """What the engine can ever run, for the checks at the door."""

    vocab_size: int
    max_model_len: int  # the model's context: prompt + output tokens
    max_prompt_blocks: int  # KV-cache blocks a prompt may need, with its first new token
    block_size: int
    max_unchunked_prompt: int | None = None  # without chunked prefill: the step's token budget
    max_num_seqs: int | None = None  # sequences running at once: the most samples (n) a request
    speculative: bool = False  # speculative decoding on: some parameters are refused (below)


class InputProcessor:
    """Checks and tokenises requests before they reach the scheduler."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        limits: RequestLimits,
        eos_token_ids: tuple[int, ...] | None = None,
        default_params: SamplingParams | None = None,
    ) -> None:
        self.tokenizer, self.limits = tokenizer, limits
        self.eos_token_ids = tokenizer.eos_ids if eos_token_ids is None else eos_token_ids
        self.default_params = self.params(default_params)

    def process(
        self, prompt: Prompt | EngineRequest, params: SamplingParams | None
    ) -> EngineRequest:
        """The request checked once, as the engine will run it: the prompt's token ids, the params
        (None: the engine's defaults) and the bad words' token ids. Raises TypeError or ValueError
        saying what to change. An EngineRequest this processor made passes as it is (one another
        engine made is checked again: its limits may differ)."""
        if isinstance(prompt, EngineRequest):
            if params is not None:
                raise TypeError("an EngineRequest carries its SamplingParams: pass params=None")
            if prompt.checked_by is self:
                return prompt
            prompt, params = list(prompt.prompt_ids), prompt.params
        params = self.default_params if params is None else self.params(params)
        prompt_ids = self.prompt_ids(prompt)
        self.check_params(params)
        self.check_fits(prompt_ids, params)
        return EngineRequest(tuple(prompt_ids), params, self.bad_word_ids(params), checked_by=self)

    def check_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone: token ids against the vocabulary, n against
        the batch, and the parameters speculative decoding does not support.

        With speculative decoding the drafts are verified against the target's distribution at
        each position; parameters whose distribution depends on the tokens before it (penalties,
        bad_words), the logprobs, and n > 1 are refused there with a ValueError rather than
        applied to draft positions they were not designed for. logit_bias, min_p, min_tokens and
        allowed_token_ids depend on the position alone and work with it."""
        limits, vocab = self.limits, self.limits.vocab_size
        for name, ids in (
            ("stop_token_ids", params.stop_token_ids),
            ("allowed_token_ids", params.allowed_token_ids or ()),
            ("logit_bias", [t for t, _ in params.logit_bias]),
        ):
            if bad := [t for t in ids if t >= vocab]:
                raise ValueError(
                    f"SamplingParams.{name}: token id {min(bad)} is outside the vocabulary "
                    f"0..{vocab - 1}"
                )
        if params.allowed_token_ids is not None:
            self._check_something_is_allowed(params)
        if limits.max_num_seqs is not None and params.n > limits.max_num_seqs:
            raise ValueError(
                f"SamplingParams.n ({params.n}) exceeds max_num_seqs ({limits.max_num_seqs}): its "
                "samples run side by side, so ask for fewer or raise max_num_seqs"
            )
        if limits.speculative:
            unsupported = [
                name
                for name, used in (
                    ("n", params.n > 1),
                    ("logprobs", params.logprobs is not None),
                    ("prompt_logprobs", params.prompt_logprobs is not None),
                    ("presence_penalty", params.presence_penalty != 0),
                    ("frequency_penalty", params.frequency_penalty != 0),
                    ("repetition_penalty", params.repetition_penalty != 1),
                    ("bad_words", bool(params.bad_words)),
                )
                if used
            ]
            if unsupported:
                raise ValueError(
                    f"SamplingParams.{unsupported[0]} is not supported with speculative decoding "
                    "in this engine: leave it at its default or run without speculation"
                )

    def _check_something_is_allowed(self, params: SamplingParams) -> None:
        """allowed_token_ids that the other rules ban outright would leave a position nothing to
        draw: refuse the request rather than sample it with the rules silently dropped."""
        banned_always = {
            ids[0] for w in params.bad_words if len(ids := self.tokenizer.encode(w)) == 1
        }
        allowed = set(params.allowed_token_ids) - banned_always
        if not allowed:
            raise ValueError(
                "SamplingParams.allowed_token_ids: every allowed token is also a one-token bad "
                "word, so no token could ever be drawn"
            )
        eos = () if params.ignore_eos else self.eos_token_ids
        stops = set(params.stop_token_ids) | set(eos)
        if params.min_tokens and allowed <= stops:
            raise ValueError(
                f"SamplingParams.allowed_token_ids: only stop tokens are allowed, but min_tokens="
                f"{params.min_tokens} bans them until then, so no token could be drawn"
            )

    def bad_word_ids(self, params: SamplingParams) -> tuple[tuple[int, ...], ...]:
        """`bad_words` as token ids (no special tokens), for the sampler's ban."""
        return tuple(tuple(self.tokenizer.encode(word)) for word in params.bad_words)

    @staticmethod
    def params(params: SamplingParams | None) -> SamplingParams:
        if params is None:
            return SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        return params

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_bos=True)
        elif isinstance(prompt, (list, tuple)) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            ids = list(prompt)
        else:
            raise TypeError("prompt must be a string or a list of token ids (ints)")
        if not ids:
            raise ValueError(
                "the prompt is empty: give at least one token (a string prompt gets BOS first)"
            )
        vocab = self.limits.vocab_size
        if bad := [t for t in ids if not 0 <= t < vocab]:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary 0..{vocab - 1}")
        return ids

    def check_fits(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Refuse a request that could never run to the end: longer than the model's context, or
        a prompt the cache (or, without chunked prefill, one step) can never hold."""
        limits, length = self.limits, len(prompt_ids)
        total = length + params.max_tokens
        if total > limits.max_model_len:
            raise ValueError(
                f"prompt ({length} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds "
                f"the model's context of {limits.max_model_len} tokens: shorten the prompt or "
                "lower max_tokens"
            )
        budget = limits.max_unchunked_prompt
        if budget is not None and length > budget:
            raise ValueError(
                f"the prompt ({length} tokens) is longer than max_num_batched_tokens ({budget}) "
                "and chunked prefill is off, so it could never be scheduled: raise the budget or "
                "turn chunked_prefill on"
            )
        # The prompt must fit the whole cache with room for one new token. Beyond that max_tokens
        # is an upper bound (EOS may come first); a sequence that outgrows the cache alone ends
        # "cache_full".
        blocks = -(-(length + 1) // limits.block_size)
        if blocks > limits.max_prompt_blocks:
            raise ValueError(
                f"the prompt ({length} tokens) needs {blocks} KV-cache blocks with its first new "
                f"token, but the whole cache has {limits.max_prompt_blocks}: it could never run; "
                "build a bigger cache or shorten the prompt"
            )


@dataclass
class StopStringHit:
    """A stop string found in a sequence's text: output token `num_output_tokens` completed it."""

    seq: Sequence
    stop: str
    num_output_tokens: int


@dataclass
class _RequestState:
    """What the output processor keeps per sequence (vLLM's `RequestState`): its detokenizer and
    text, how far the stop-string search went, and the stream cursor."""

    detokenizer: Detokenizer
    text: str = ""  # the output text decoded so far (cut at a stop string)
    num_decoded: int = 0  # output tokens fed to the detokenizer
    text_checked: int = 0  # characters already searched for stop strings
    stop: StopStringHit | None = None  # the stop string that ended it
    final: bool = False  # the text will not change any more (the sequence finished)
    text_sent: int = 0  # characters of the output text already handed out
    tokens_sent: int = 0  # output tokens already handed out
    # The prompt's token ids as every output of the request hands them out: one copy, made at
    # its first output, not one per step (a long prompt streamed token by token would be copied
    # whole for every token). vLLM hands out one list too.
    prompt_token_ids: list[int] | None = None


class OutputProcessor:
    """Decodes sequences' tokens, finds stop strings, makes each step's `RequestOutput`s.

    Per sequence it keeps a `_RequestState`. A state lives exactly as long as its `Sequence` (a
    weak reference): a server that runs for days keeps none for the requests it finished, and a
    finished request asked again hands out nothing twice."""

    def __init__(self, tokenizer: Tokenizer | None = None) -> None:
        self.tokenizer = tokenizer or ByteTokenizer()
        self.states: weakref.WeakKeyDictionary[Sequence, _RequestState] = (
            weakref.WeakKeyDictionary()
        )
        self.num_tokens = 0  # generated tokens handed out so far, every request's (for stats)

    def detokenize(self, seqs: Iterable[Sequence]) -> list[StopStringHit]:
        """Decode the sequences' new tokens; the stop strings found. The caller ends those
        sequences (`LLMEngine.step`: `Scheduler.stop`, which drops the tokens after the hit)."""
        return [hit for seq in seqs if (hit := self._detokenize(seq)) is not None]

    def _detokenize(self, seq: Sequence) -> StopStringHit | None:
        state = self._state(seq)
        if state.final:
            return None
        new = seq.token_ids[seq.num_prompt_tokens + state.num_decoded :]  # not every output token
        for count, token in enumerate(new, start=1):
            state.num_decoded += 1
            state.text += state.detokenizer.push(token)
            if count == len(new) and seq.stopped_by_token:
                break  # its stop token came first: no stop string ends at it
            if state.num_decoded <= seq.params.min_tokens:
                # vLLM (PR #22014): stop strings wait until min_tokens tokens exist; text before
                # then is not searched again, except the overlap a later match may start in.
                state.text_checked = len(state.text)
                continue
            if (found := self._find_stop_string(seq, state)) is not None:
                index, stop = found
                # the stop string is not part of the answer, unless asked for
                keep = len(stop) if seq.params.include_stop_str_in_output else 0
                state.text, state.final = state.text[: index + keep], True
                state.stop = StopStringHit(seq, stop, state.num_decoded)
                return state.stop
        if seq.is_finished:  # a cut-off character is shown as U+FFFD, not lost
            state.text, state.final = state.text + state.detokenizer.flush(), True
        return None

    @staticmethod
    def _find_stop_string(seq: Sequence, state: _RequestState) -> tuple[int, str] | None:
        """Earliest stop string in the text; only the tail can hold a new match, so look there."""
        best = None
        for stop in seq.params.stop:
            index = state.text.find(stop, max(0, state.text_checked - len(stop) + 1))
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        state.text_checked = len(state.text)
        return best

    def _state(self, seq: Sequence) -> _RequestState:
        state = self.states.get(seq)
        if state is None:
            state = self.states[seq] = _RequestState(self.tokenizer.detokenizer())
        return state

    def output(self, seq: Sequence) -> RequestOutput:
        """The request's state now, with what is new since its last output. Tokens not decoded
        yet are decoded first; a stop string found then is reported as the sequence's end (the
        engine has ended it in the scheduler already: `detokenize` came first)."""
        self._detokenize(seq)
        state = self._state(seq)
        hit, token_ids = state.stop, seq.output_token_ids
        if hit is not None:
            token_ids = token_ids[: hit.num_output_tokens]
        new_logprobs = None
        if seq.output_logprobs is not None:  # before _take_tokens moves the cursor
            new_logprobs = tuple(seq.output_logprobs[state.tokens_sent : len(token_ids)])
        new_text, new_token_ids = _take_text(seq, state), _take_tokens(token_ids, state)
        self.num_tokens += len(new_token_ids)
        if state.prompt_token_ids is None:
            state.prompt_token_ids = list(seq.prompt_token_ids)
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=state.prompt_token_ids,
            token_ids=token_ids,
            text=state.text,
            finished=state.final,
            finish_reason="stop" if hit is not None else seq.finish_reason,
            stop_reason=hit.stop if hit is not None else seq.stop_reason,
            num_cached_tokens=seq.num_cached_tokens,
            num_preemptions=seq.num_preemptions,
            finish_message=seq.finish_message,
            new_text=new_text,
            new_token_ids=new_token_ids,
            index=seq.index,
            logprobs=None if seq.output_logprobs is None else seq.output_logprobs[: len(token_ids)],
            new_logprobs=new_logprobs,
            prompt_logprobs=seq.prompt_logprobs,
        )


def _take_text(seq: Sequence, state: _RequestState) -> str:
    """Text not handed out yet. While the request runs, hold back a tail that could still turn out
    to be the start of a stop string, so streamed text never has to be taken back."""
    end = len(state.text)
    if not state.final and seq.params.stop:
        end -= max(len(s) for s in seq.params.stop) - 1
    delta = state.text[state.text_sent : max(end, state.text_sent)]
    state.text_sent += len(delta)
    return delta


def _take_tokens(token_ids: list[int], state: _RequestState) -> tuple[int, ...]:
    """Output token ids not handed out yet."""
    new = tuple(token_ids[state.tokens_sent :])
    state.tokens_sent += len(new)
    return new
