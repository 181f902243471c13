"""Chapter 04: a request's parameters and bookkeeping -- `SamplingParams` checks, `Sequence`'s
stop rules (EOS, stop tokens, max_tokens), and the output processor's text: stop strings and
streamed text deltas.

No torch here: a `Sequence` is fed byte tokens by hand, exactly as the scheduler's `update` would,
and its text decoded by an `OutputProcessor`, as the engine's step does.
"""

from __future__ import annotations

import dataclasses
import weakref

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm.engine.processing import OutputProcessor, RequestOutput
from minivllm.model.tokenizer import BOS_ID, EOS_ID
from minivllm.sched.sequence import (
    ABORT,
    LENGTH,
    STOP,
    SamplingParams,
    Sequence,
    Status,
)

PROMPT = [BOS_ID, ord("Q"), ord(":")]


def make(**params) -> Sequence:
    return Sequence(7, list(PROMPT), SamplingParams(**params), seed=0, eos_token_id=EOS_ID)


_processors: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def processor(seq: Sequence) -> OutputProcessor:
    """The sequence's output processor (one per sequence here): it decodes the text, finds stop
    strings and keeps the stream cursor, as the engine's does."""
    return _processors.setdefault(seq, OutputProcessor())


def take(seq: Sequence) -> RequestOutput:
    """The sequence's output as the engine makes it after a step: its stream cursor hands out only
    what is new since the last output."""
    return processor(seq).output(seq)


def text_of(seq: Sequence) -> str:
    return processor(seq).output(seq).text


def step(seq: Sequence, token: int) -> None:
    """Append one token as the scheduler does, then decode it as the engine does: a stop string
    found in the text ends the sequence there (the engine: `Scheduler.stop`)."""
    seq.append_token(token)
    for hit in processor(seq).detokenize([seq]):
        hit.seq.stop_at(hit.num_output_tokens, hit.stop)


def feed(seq: Sequence, tokens) -> list[str]:
    """Append tokens (a str is fed as its UTF-8 bytes) until the sequence finishes; the text delta
    after each append. Tokens left over once it finished are not fed."""
    if isinstance(tokens, str):
        tokens = list(tokens.encode("utf-8"))
    deltas = []
    for token in tokens:
        assert not seq.is_finished, "fed a token to a finished sequence"
        step(seq, token)
        deltas.append(take(seq).new_text)
        if seq.is_finished:
            break
    return deltas


# -- SamplingParams --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_tokens", 0),
        ("max_tokens", -1),
        ("max_tokens", 1.5),
        ("max_tokens", True),
        ("max_tokens", "4"),
        ("temperature", -0.1),
        ("temperature", float("inf")),
        ("temperature", float("nan")),
        ("temperature", "hot"),
        ("temperature", True),
        ("top_k", -1),
        ("top_k", 2.0),
        ("top_k", True),
        ("top_p", 0),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_p", -0.5),
        ("top_p", float("nan")),
        ("top_p", "1"),
        ("seed", -1),
        ("seed", 2**63),
        ("seed", 1.5),
        ("seed", True),
        ("stop", ""),
        ("stop", ["ok", ""]),
        ("stop", [3]),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", [1.0]),
        ("stop_token_ids", [True]),
        ("ignore_eos", "yes"),
        ("ignore_eos", 1),
    ],
)
def test_every_bad_field_is_named(field: str, value) -> None:
    with pytest.raises(ValueError, match=rf"^SamplingParams\.{field} ") as raised:
        SamplingParams(**{field: value})
    assert repr(value) in str(raised.value) or field in (
        "stop",
        "stop_token_ids",
    )  # and shows what it got


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"max_tokens": 1},
        {"temperature": 0},
        {"temperature": 0.0},
        {"temperature": 2},
        {"top_k": 0},
        {"top_k": 1},
        {"top_p": 1},
        {"top_p": 1e-9},
        {"seed": 0},
        {"seed": 2**63 - 1},
        {"seed": None},
        {"stop": ()},
        {"stop_token_ids": [0, 258]},
        {"ignore_eos": True},
    ],
)
def test_good_values_are_accepted(kwargs: dict) -> None:
    params = SamplingParams(**kwargs)
    for name, value in kwargs.items():
        got = getattr(params, name)
        assert got == (tuple(value) if isinstance(value, list) else value)


def test_defaults() -> None:
    p = SamplingParams()
    assert (
        p.max_tokens,
        p.temperature,
        p.top_k,
        p.top_p,
        p.seed,
        p.stop,
        p.stop_token_ids,
        p.ignore_eos,
    ) == (16, 1.0, 0, 1.0, None, (), (), False)
    assert not p.greedy and SamplingParams(temperature=0).greedy


def test_stop_fields_become_tuples_and_params_stay_frozen() -> None:
    # one string is one stop string, not its characters
    assert SamplingParams(stop="END").stop == ("END",)
    assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc")
    assert SamplingParams(stop_token_ids=[10, 13]).stop_token_ids == (10, 13)
    p = SamplingParams(stop=["x"], stop_token_ids=[1])
    hash(p)  # frozen and made of tuples: usable as a dict key
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.top_k = 3  # type: ignore[misc]
    # replace() re-runs the checks
    with pytest.raises(ValueError, match="SamplingParams.top_k"):
        dataclasses.replace(p, top_k=-2)


# -- Sequence bookkeeping --------------------------------------------------------------------------


def test_a_new_sequence_has_its_whole_prompt_to_compute() -> None:
    seq = make()
    assert seq.token_ids == PROMPT and seq.token_ids is not seq.prompt_token_ids
    assert (
        seq.num_prompt_tokens,
        seq.num_tokens,
        seq.num_output_tokens,
        seq.num_uncomputed_tokens,
    ) == (3, 3, 0, 3)
    assert seq.status is Status.WAITING and not seq.is_finished and seq.output_token_ids == []
    seq.num_computed_tokens = 3
    seq.append_token(ord("a"))
    assert (
        seq.num_uncomputed_tokens == 1
        and seq.output_token_ids == [ord("a")]
        and text_of(seq) == "a"
    )


def test_eos_stops_and_carries_no_text() -> None:
    seq = make(max_tokens=10)
    feed(seq, [ord("h"), ord("i"), EOS_ID, ord("x")])
    assert seq.is_finished and seq.status is Status.FINISHED
    assert (seq.finish_reason, seq.stop_reason) == (STOP, None)
    assert seq.output_token_ids == [ord("h"), ord("i"), EOS_ID]  # the EOS token is kept in the ids
    assert text_of(seq) == "hi"


def test_ignore_eos_runs_to_max_tokens() -> None:
    seq = make(max_tokens=4, ignore_eos=True)
    feed(seq, [EOS_ID, ord("a"), EOS_ID, ord("b"), ord("c")])
    assert seq.finish_reason == LENGTH and seq.output_token_ids == [
        EOS_ID,
        ord("a"),
        EOS_ID,
        ord("b"),
    ]
    assert text_of(seq) == "ab"


def test_a_different_eos_id_is_just_a_token() -> None:
    seq = Sequence(1, [BOS_ID], SamplingParams(max_tokens=3), seed=0, eos_token_id=ord("!"))
    feed(seq, [EOS_ID, ord("!")])
    # 257 did not stop it: only the sequence's own eos_token_id does.
    assert seq.finish_reason == STOP and seq.output_token_ids == [EOS_ID, ord("!")]


def test_stop_token_ids_stop_with_a_reason() -> None:
    seq = make(max_tokens=10, stop_token_ids=[ord("\n"), ord(".")])
    feed(seq, "ab.cd")
    assert (seq.finish_reason, seq.stop_reason) == (STOP, ord("."))
    assert seq.output_token_ids == list(b"ab.")  # the stop token stays in the ids...
    assert text_of(seq) == "ab."  # ...and in the text (only stop *strings* are cut)


def test_max_tokens_finishes_with_length() -> None:
    seq = make(max_tokens=3)
    feed(seq, "abcdef")
    assert (seq.finish_reason, seq.stop_reason, text_of(seq), seq.num_output_tokens) == (
        LENGTH,
        None,
        "abc",
        3,
    )


def test_max_tokens_one() -> None:
    seq = make(max_tokens=1)
    seq.append_token(ord("z"))
    assert seq.finish_reason == LENGTH and text_of(seq) == "z"


@pytest.mark.parametrize(
    "tokens, reason", [([EOS_ID], STOP), ([ord("X")], STOP), (list(b"ab"), STOP)]
)
def test_a_stop_on_the_last_allowed_token_is_a_stop(tokens: list[int], reason: str) -> None:
    seq = make(max_tokens=len(tokens), stop_token_ids=[ord("X")], stop="ab")
    feed(seq, tokens)
    assert seq.finish_reason == reason


def test_stop_string_is_cut_from_the_text() -> None:
    seq = make(max_tokens=50, stop=["world"])
    feed(seq, "Hello world, again")
    assert (seq.finish_reason, seq.stop_reason) == (STOP, "world")
    assert text_of(seq) == "Hello "
    assert bytes(seq.output_token_ids) == b"Hello world"  # the ids keep every sampled token


def test_stop_string_spanning_two_tokens() -> None:
    seq = make(max_tokens=50, stop=["\n\n"])
    deltas = feed(seq, "one\n\ntwo")
    assert text_of(seq) == "one" and seq.stop_reason == "\n\n" and seq.num_output_tokens == 5
    assert "".join(deltas) == "one"


def test_the_earliest_stop_string_wins() -> None:
    # Both complete on the same token; "bcd" starts first.
    seq = make(max_tokens=50, stop=["cd", "bcd"])
    feed(seq, "abcde")
    assert (text_of(seq), seq.stop_reason, seq.num_output_tokens) == ("a", "bcd", 4)


@pytest.mark.parametrize(
    "text, stop, want",
    [
        (
            "café!",
            "é!",
            "caf",
        ),  # the stop string begins in the middle of a 2-byte character's bytes
        ("a€b", "€", "a"),  # a 3-byte stop string completes on the last byte of the character
        ("x🙂y🙂z", "y🙂", "x🙂"),  # 4-byte characters on both sides of the match
        ("ééé", "éé", ""),
    ],
)
def test_stop_string_in_a_multi_byte_stream(text: str, stop: str, want: str) -> None:
    seq = make(max_tokens=50, stop=stop)
    deltas = feed(seq, text)
    assert text_of(seq) == want and seq.stop_reason == stop and seq.finish_reason == STOP
    assert "".join(deltas) == want
    # It finished exactly on the byte that completed the stop string.
    full = text.encode("utf-8")
    assert (
        bytes(seq.output_token_ids)
        == full[: full.index(stop.encode("utf-8")) + len(stop.encode("utf-8"))]
    )


def test_stop_string_found_far_back_after_a_silent_byte() -> None:
    # A token that completes no character adds no text; the check after it must not skip the match
    # later.
    seq = make(max_tokens=50, stop=["ab\u00e9"])
    feed(seq, "xxab\u00e9yy")
    assert text_of(seq) == "xx" and seq.num_output_tokens == len(b"xxab") + 2


MIN_TOKENS_TEXT = " is Lee, and I'm a student in the college of engineering"


@pytest.mark.parametrize(
    "min_tokens, stop, want",
    [
        (0, None, MIN_TOKENS_TEXT),
        (0, "e", " is L"),
        (7, "e", " is Lee, and I'm a stud"),  # the e's of " is Lee" (7 tokens) do not stop it
        (6, "ee", " is L"),  # a match completed after min_tokens may start before it (vLLM too)
        (len(MIN_TOKENS_TEXT), "e", MIN_TOKENS_TEXT),  # min_tokens = max_tokens: never stops
    ],
)
@pytest.mark.parametrize("streamed", [True, False])
def test_stop_strings_wait_for_min_tokens(min_tokens, stop, want, streamed) -> None:
    """vLLM's rule (PR #22014): a stop string ends a request only once min_tokens tokens exist,
    and the text before then is not searched again. Streamed: decoded after every token; not
    streamed: every token first, then one decode."""
    tokens = list(MIN_TOKENS_TEXT.encode())
    seq = make(max_tokens=len(tokens), min_tokens=min_tokens, stop=stop or ())
    if streamed:
        assert "".join(feed(seq, tokens)) == want
    else:
        for token in tokens:
            seq.append_token(token)
        for hit in processor(seq).detokenize([seq]):
            hit.seq.stop_at(hit.num_output_tokens, hit.stop)
    assert text_of(seq) == want
    assert seq.finish_reason == (STOP if want != MIN_TOKENS_TEXT else LENGTH)


def test_length_finish_flushes_a_cut_off_character() -> None:
    seq = make(max_tokens=2)
    deltas = feed(seq, [ord("a"), 0xC3])  # the second byte of "é" never comes
    assert (
        seq.finish_reason == LENGTH and text_of(seq) == "a\ufffd" and "".join(deltas) == "a\ufffd"
    )


def test_finish_abort() -> None:
    seq = make(max_tokens=5)
    feed(seq, "ab")
    seq.finish(ABORT)
    assert (seq.status, seq.finish_reason, text_of(seq)) == (Status.FINISHED, ABORT, "ab")


# -- text deltas -----------------------------------------------------------------------------------


def test_deltas_hold_back_a_possible_stop_string_prefix() -> None:
    seq = make(max_tokens=6, stop=["STOP", "ZZ"])  # the longest is 4 characters: hold back 3
    assert feed(seq, "abcdef") == [
        "",
        "",
        "",
        "a",
        "b",
        "cdef",
    ]  # finished (length): the rest comes out


def test_deltas_without_stop_strings_come_at_once() -> None:
    seq = make(max_tokens=4)
    assert feed(seq, "abcd") == ["a", "b", "c", "d"]
    assert take(seq).new_text == ""  # nothing is handed out twice


def test_multi_byte_characters_are_emitted_whole() -> None:
    seq = make(max_tokens=20)
    deltas = feed(seq, "é€🙂")
    assert deltas == ["", "é", "", "", "€", "", "", "", "🙂"]


def test_new_token_ids_are_handed_out_once() -> None:
    seq = make(max_tokens=5)
    assert take(seq).new_token_ids == ()
    seq.append_token(1)
    seq.append_token(2)
    assert take(seq).new_token_ids == (1, 2) and take(seq).new_token_ids == ()
    seq.append_token(3)
    assert take(seq).new_token_ids == (3,)


def test_a_requests_outputs_share_one_copy_of_its_prompt() -> None:
    """Each step's output of a request hands out the same copy of the prompt's ids: made once,
    not copied whole again for every token streamed; never the sequence's own list."""
    seq = make(max_tokens=5)
    first = take(seq)
    seq.append_token(ord("a"))
    second = take(seq)
    assert first.prompt_token_ids == PROMPT and second.prompt_token_ids is first.prompt_token_ids
    assert first.prompt_token_ids is not seq.prompt_token_ids
    assert second.token_ids == [ord("a")] and second.text == "a"


def expected_cut(text: str, stops: list[str]) -> tuple[str, str | None]:
    """Oracle: the text is cut at the first character after which some stop string is complete; the
    match that starts earliest (the longest one ending there) is cut off."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            longest = max(done, key=len)
            return text[: end - len(longest)], longest
    return text, None


ALPHABET = "ab\n é€🙂"


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet=ALPHABET, max_size=30),
    stops=st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=4), max_size=3),
)
def test_deltas_concatenate_to_the_final_text(text: str, stops: list[str]) -> None:
    data = text.encode("utf-8")
    seq = make(max_tokens=max(1, len(data)), stop=stops)
    deltas = feed(seq, list(data) or [ord("a")])
    if not data:
        text = "a"
    want_text, want_stop = expected_cut(text, stops)
    assert seq.is_finished  # max_tokens = every byte: it ends at the latest on the last one
    assert (text_of(seq), seq.stop_reason) == (want_text, want_stop)
    assert seq.finish_reason == (STOP if want_stop is not None else LENGTH)
    # Streamed text is never taken back: the deltas are exactly the final (cut) text ...
    assert "".join(deltas) == text_of(seq)
    # ... and every delta is made of whole characters (valid input never shows U+FFFD).
    assert all("\ufffd" not in d for d in deltas)
