"""Chapter 01: the byte tokenizer and the streaming decoder.

Tests marked `exercise("ch01.1")` grade `incomplete_utf8_tail` (and the `StreamingDecoder` built on
it); tests marked `exercise("ch01.2")` grade `ByteTokenizer.decode`. The two never call each other's
exercise, so each fails on its own when its solution is stubbed out.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm.model.tokenizer import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    SPECIAL_TOKENS,
    VOCAB_SIZE,
    ByteTokenizer,
    StreamingDecoder,
    incomplete_utf8_tail,
    utf8_length,
)

tok = ByteTokenizer()
byte_ids = st.lists(st.integers(0, 255), max_size=40)
any_ids = st.lists(st.integers(0, VOCAB_SIZE - 1), max_size=40)

# Characters of every UTF-8 length, and clusters made of several code points.
MULTI_BYTE = {
    "2-byte é": "é",
    "3-byte €": "€",
    "3-byte hangul": "한",
    "4-byte emoji": "🙂",
    "4-byte clef": "𝄞",
    "combining mark": "e\u0301",
    "flag": "🇫🇷",
    "ZWJ family": "👩\u200d👩\u200d👧",
    "skin tone": "👍🏽",
    "max code point": "\U0010ffff",
}


def stream(ids) -> tuple[list[str], str]:
    """What a StreamingDecoder returns for each pushed id, and what `flush` returns at the end."""
    decoder = StreamingDecoder()
    return [decoder.push(i) for i in ids], decoder.flush()


def strict_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def can_complete(data: bytes) -> bool:
    """True if `data` is the start of one UTF-8 character, with bytes still missing (an oracle)."""
    if not data or strict_utf8(data):
        return False
    # Any valid lead byte has a valid second byte among 80, 90, A0; later bytes accept any of 80-BF.
    return any(
        strict_utf8(data + bytes([filler]) * missing)
        and len((data + bytes([filler]) * missing).decode()) == 1
        for filler in (0x80, 0x90, 0xA0)
        for missing in (1, 2, 3)
    )


def expected_tail(data: bytes) -> int:
    return max([k for k in (1, 2, 3) if k <= len(data) and can_complete(data[-k:])], default=0)


# ---------------------------------------------------------------------------------------------
# Encoding and the vocabulary (no exercise)


def test_vocabulary_layout():
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (
        BOS_ID,
        EOS_ID,
        PAD_ID,
        VOCAB_SIZE,
    )
    assert sorted(SPECIAL_TOKENS.values()) == [256, 257, 258] and VOCAB_SIZE == 259


def test_encode_is_utf8_bytes():
    assert tok.encode("hi") == [104, 105]
    assert tok.encode("hi", add_bos=True) == [BOS_ID, 104, 105]
    assert tok.encode("") == []
    assert tok.encode("é") == [0xC3, 0xA9]
    assert tok.encode("€") == [0xE2, 0x82, 0xAC]
    assert tok.encode("🙂") == [0xF0, 0x9F, 0x99, 0x82]


def test_special_token_names_encode_as_plain_bytes():
    for name in SPECIAL_TOKENS:
        assert tok.encode(name) == list(name.encode("ascii"))
    assert len(tok.encode("<eos>")) == 5


def test_lone_surrogates_still_encode():
    assert tok.encode("a\ud800b") == list("a\ufffdb".encode("utf-8"))


@given(st.text())
def test_every_text_encodes_to_bytes_only(text):
    ids = tok.encode(text, add_bos=True)
    assert ids[0] == BOS_ID
    assert ids[1:] == list(text.encode("utf-8"))
    assert all(0 <= i < 256 for i in ids[1:])


@given(st.lists(st.characters() | st.characters(categories=["Cs"])).map("".join))
def test_even_strings_with_surrogates_encode(text):
    assert all(0 <= i < 256 for i in tok.encode(text))


def test_token_repr():
    assert tok.token_repr(ord("a")) == "a"
    assert tok.token_repr(0x0A) == "<0x0A>"
    assert tok.token_repr(0xE2) == "<0xE2>"
    assert tok.token_repr(EOS_ID) == "<eos>"
    with pytest.raises(ValueError):
        tok.token_repr(VOCAB_SIZE)


def test_utf8_length():
    assert [utf8_length(b) for b in (0x41, 0xC3, 0xE2, 0xF0)] == [1, 2, 3, 4]
    assert [utf8_length(b) for b in (0x80, 0xBF, 0xC0, 0xC1, 0xF5, 0xFF)] == [0] * 6


# ---------------------------------------------------------------------------------------------
# Exercise ch01.2: decode


@pytest.mark.exercise("ch01.2")
@given(st.text())
def test_decode_round_trips(text):
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode(tok.encode(text, add_bos=True)) == text


@pytest.mark.exercise("ch01.2")
def test_decode_skips_special_tokens():
    assert tok.decode([BOS_ID, 104, 105, EOS_ID, PAD_ID, PAD_ID]) == "hi"
    assert tok.decode([EOS_ID]) == ""
    assert tok.decode([]) == ""


@pytest.mark.exercise("ch01.2")
@pytest.mark.parametrize(
    ("data", "text"),
    [
        (b"a\x80b", "a\ufffdb"),  # a lone continuation byte
        (b"\xc0\xaf", "\ufffd\ufffd"),  # an overlong encoding of '/'
        (b"\xed\xa0\x80", "\ufffd\ufffd\ufffd"),  # a surrogate
        (b"\xf5\x80\x80\x80", "\ufffd" * 4),  # past U+10FFFF
        (b"\xff", "\ufffd"),
        (b"\xe2\x82A", "\ufffdA"),  # a truncated character, then ASCII: one U+FFFD
        (b"ok\xf0\x9f\x99", "ok\ufffd"),  # truncated at the end
    ],
)
def test_decode_replaces_invalid_bytes(data, text):
    assert tok.decode(list(data)) == text


@pytest.mark.exercise("ch01.2")
@given(st.lists(st.integers(-3, 2 * VOCAB_SIZE), max_size=40))
def test_decode_never_raises(ids):
    assert tok.decode(ids) == bytes(i for i in ids if 0 <= i < 256).decode(
        "utf-8", errors="replace"
    )


# ---------------------------------------------------------------------------------------------
# Exercise ch01.1: incomplete_utf8_tail, and the streaming decoder that relies on it


@pytest.mark.exercise("ch01.1")
@pytest.mark.parametrize(
    ("data", "tail"),
    [
        (b"", 0),
        (b"a", 0),
        (b"\xc3\xa9", 0),
        (b"\xe2\x82\xac", 0),
        (b"\xf0\x9f\x99\x82", 0),
        (b"\xc3", 1),
        (b"\xe2", 1),
        (b"\xe2\x82", 2),
        (b"\xf0", 1),
        (b"\xf0\x9f", 2),
        (b"\xf0\x9f\x99", 3),
        (b"ok\xf0\x9f\x99", 3),
        (b"\xe2\x82\xac\xe2", 1),
        (b"\xc3\xa9\xc3", 1),
        (b"\xe0\xa0", 2),
        (b"\xed\x9f", 2),
        (b"\xf4\x8f\xbf", 3),  # the edges of the narrow ranges
        (b"\x80", 0),
        (b"\x80\x80\x80", 0),
        (b"\xc0", 0),
        (b"\xc1", 0),
        (b"\xf5", 0),
        (b"\xff", 0),
        (b"\xe0\x80", 0),
        (b"\xf0\x8f", 0),  # overlong: can never become valid
        (b"\xed\xa0", 0),  # a surrogate
        (b"\xf4\x90", 0),  # past U+10FFFF
        (b"\xe2A", 0),
        (b"\xe2\x82\xac\xac", 0),
    ],
)
def test_incomplete_utf8_tail_cases(data, tail):
    assert incomplete_utf8_tail(data) == tail


@pytest.mark.exercise("ch01.1")
@given(st.binary(max_size=8))
def test_incomplete_utf8_tail_matches_oracle(data):
    assert incomplete_utf8_tail(data) == expected_tail(data)


@pytest.mark.exercise("ch01.1")
@pytest.mark.parametrize("chars", MULTI_BYTE.values(), ids=MULTI_BYTE.keys())
def test_streaming_splits_at_every_position(chars):
    text = f"a{chars}b"
    ids = list(text.encode("utf-8"))
    pieces, rest = stream(ids)
    assert "".join(pieces) + rest == text and rest == ""
    emitted = ""
    for k, piece in enumerate(pieces, start=1):
        emitted += piece
        # After k bytes you have exactly the characters whose bytes have all arrived: never half of
        # one.
        assert emitted == text.encode("utf-8")[:k].decode("utf-8", errors="ignore")
        assert "\ufffd" not in emitted


@pytest.mark.exercise("ch01.1")
@pytest.mark.parametrize(
    ("data", "pieces", "rest"),
    [
        (b"a\x80b", ["a", "\ufffd", "b"], ""),  # a lone continuation byte is wrong at once
        (b"\xc0\xaf", ["\ufffd", "\ufffd"], ""),  # overlong
        (
            b"\xed\xa0\x80",
            ["", "\ufffd\ufffd", "\ufffd"],
            "",
        ),  # surrogate: wrong as soon as A0 arrives
        (b"\xf5\x80", ["\ufffd", "\ufffd"], ""),  # F5 and above start nothing
        (b"\xe2\x82A", ["", "", "\ufffdA"], ""),  # truncated, then ASCII: one U+FFFD
        (
            b"ok\xf0\x9f\x99",
            ["o", "k", "", "", ""],
            "\ufffd",
        ),  # truncated at the end: flush says so
    ],
)
def test_streaming_invalid_bytes(data, pieces, rest):
    assert stream(list(data)) == (pieces, rest)


@pytest.mark.exercise("ch01.1")
def test_special_tokens_do_not_disturb_a_pending_character():
    decoder = StreamingDecoder()
    assert [decoder.push(i) for i in [BOS_ID, 0xE2, 0x82, EOS_ID, 0xAC, PAD_ID]] == [
        "",
        "",
        "",
        "",
        "€",
        "",
    ]
    assert decoder.flush() == ""


@pytest.mark.exercise("ch01.1")
def test_flush_resets_the_decoder():
    decoder = StreamingDecoder()
    assert decoder.push(0xF0) == ""
    assert decoder.flush() == "\ufffd"
    assert decoder.flush() == ""
    assert decoder.push(ord("x")) == "x"


@pytest.mark.exercise("ch01.1")
@given(st.text())
def test_streaming_any_text(text):
    pieces, rest = stream(tok.encode(text, add_bos=True) + [EOS_ID])
    assert "".join(pieces) + rest == text
    assert "\ufffd" not in "".join(pieces) or "\ufffd" in text


@pytest.mark.exercise("ch01.1")
@given(byte_ids)
def test_streaming_any_bytes_matches_python(ids):
    pieces, rest = stream(ids)
    assert "".join(pieces) + rest == bytes(ids).decode("utf-8", errors="replace")


@pytest.mark.exercise("ch01.1")
@settings(max_examples=200)
@given(byte_ids, byte_ids)
def test_pushed_text_is_final(prefix, suffix):
    """Whatever comes next, the text already pushed out stays the start of the final text."""
    decoder = StreamingDecoder()
    emitted = "".join(decoder.push(i) for i in prefix)
    assert bytes(prefix + suffix).decode("utf-8", errors="replace").startswith(emitted)
    # ... and nothing is held back that is already decided: only a character that can still
    # complete.
    assert decoder.pending == b"" or can_complete(decoder.pending)


# ---------------------------------------------------------------------------------------------
# The streaming decoder and decode agree (uses both exercises)


@given(any_ids)
def test_streaming_equals_decode(ids):
    pieces, rest = stream(ids)
    assert "".join(pieces) + rest == tok.decode(ids)
