"""Bytes as tokens: the tokenizer that needs no vocabulary file and never meets an unknown word.

Token ids 0-255 are the UTF-8 bytes of the text. Special tokens live above 255 and can only enter a
sequence on purpose -- no string encodes to them. Decoding never raises: bytes that are not valid
UTF-8 become U+FFFD, the replacement character.

A server streams text token by token, but one token is one *byte*, and a character may need up to
four. `StreamingDecoder` holds back the bytes of a character that has not finished yet, so a client
never receives half an emoji.

`Tokenizer` is what the engine asks of any tokenizer: `ByteTokenizer` here, or a checkpoint's own
(`HFTokenizer`, hf_tokenizer.py). Each makes fresh `Detokenizer`s, one per stream: token ids in,
text out, never a broken character and never a piece that a later token changes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

BOS_ID = 256
EOS_ID = 257
PAD_ID = 258
SPECIAL_TOKENS = {"<bos>": BOS_ID, "<eos>": EOS_ID, "<pad>": PAD_ID}
VOCAB_SIZE = 259
REPLACEMENT_CHARACTER = "\ufffd"


class Detokenizer(Protocol):
    """One stream's text, token by token. Over a whole stream, what `push` returns plus `flush()`
    equals the tokenizer's `decode` of all the ids at once, and nothing returned is taken back."""

    def push(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


@runtime_checkable
class Tokenizer(Protocol):
    """What the engine needs of a tokenizer. `encode(text, add_bos=True)` is a prompt: with the
    special tokens the tokenizer puts first (BOS here; a checkpoint's tokenizer may add none).
    `eos_ids` are every id that ends a request (a checkpoint may name several); `eos_id` is the
    first. `decode` skips special tokens."""

    bos_id: int | None
    eos_id: int | None
    eos_ids: tuple[int, ...]
    vocab_size: int

    def encode(self, text: str, add_bos: bool = False) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...

    def token_repr(self, token_id: int) -> str: ...

    def detokenizer(self) -> Detokenizer: ...


class ByteTokenizer:
    bos_id = BOS_ID
    eos_id = EOS_ID
    eos_ids = (EOS_ID,)
    pad_id = PAD_ID
    vocab_size = VOCAB_SIZE

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """The UTF-8 bytes of `text` as token ids 0-255, after `<bos>` if `add_bos`."""
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate (U+D800-U+DFFF) is not a character at all
            data = "".join(
                REPLACEMENT_CHARACTER if 0xD800 <= ord(c) <= 0xDFFF else c for c in text
            ).encode("utf-8")
        ids = list(data)
        return [BOS_ID, *ids] if add_bos else ids

    def decode(self, ids: Iterable[int]) -> str:
        """Text of the byte tokens in `ids`; special tokens are skipped, invalid bytes become
        U+FFFD."""
        # EXERCISE ch01.2: token ids to text -- keep only the byte ids 0-255, replace invalid UTF-8
        ### BEGIN SOLUTION
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")
        ### END SOLUTION

    def token_repr(self, token_id: int) -> str:
        """A printable name for one token, for tables and figures."""
        names = {v: k for k, v in SPECIAL_TOKENS.items()}
        if token_id in names:
            return names[token_id]
        if not 0 <= token_id < 256:
            raise ValueError(f"token id {token_id} is outside the vocabulary 0..{VOCAB_SIZE - 1}")
        char = bytes([token_id]).decode("latin-1")
        return char if char.isprintable() and token_id < 128 else f"<0x{token_id:02X}>"

    def detokenizer(self) -> StreamingDecoder:
        """A fresh streaming decoder for one stream of ids (below)."""
        return StreamingDecoder()


# After these four lead bytes the second byte has a narrower range than 80-BF: E0 and F0 would
# otherwise allow overlong encodings, ED the surrogates U+D800-U+DFFF, F4 code points past U+10FFFF.
SECOND_BYTE_RANGE = {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F), 0xF0: (0x90, 0xBF), 0xF4: (0x80, 0x8F)}


def utf8_length(lead: int) -> int:
    """How many bytes the character that starts with byte `lead` has; 0 if no character starts
    so."""
    if lead < 0x80:
        return 1  # ASCII
    if 0xC2 <= lead <= 0xDF:
        return 2
    if 0xE0 <= lead <= 0xEF:
        return 3
    if 0xF0 <= lead <= 0xF4:
        return 4
    return 0  # a continuation byte 80-BF, or C0, C1, F5-FF, which valid UTF-8 never contains


def incomplete_utf8_tail(data: bytes) -> int:
    """How many bytes at the end of `data` begin a UTF-8 character that could still be completed
    (0-3).

    Those bytes must wait for the next token. Everything before them -- finished characters, and
    bytes that can never become valid -- can be decoded now without changing the final text.
    """
    # EXERCISE ch01.1: count the trailing bytes of an unfinished (but still valid) UTF-8 character
    ### BEGIN SOLUTION
    for back in range(1, min(3, len(data)) + 1):
        lead = data[-back]
        if 0x80 <= lead <= 0xBF:
            continue  # a continuation byte: the character's lead byte is further back
        if utf8_length(lead) <= back:
            return 0  # ASCII, a byte that starts no character, or a character that is complete
        low, high = SECOND_BYTE_RANGE.get(lead, (0x80, 0xBF))
        if back >= 2 and not low <= data[-back + 1] <= high:
            return 0  # already invalid (overlong, surrogate, too large): waiting cannot fix it
        return back
    return 0
    ### END SOLUTION


@dataclass
class StreamingDecoder:
    """Feed token ids one at a time; get back only whole characters.

    The text `push` returns over a whole stream, plus `flush()`, equals `ByteTokenizer().decode` of
    all the ids at once -- and no text it has returned is ever taken back.
    """

    pending: bytes = field(default=b"")

    def push(self, token_id: int) -> str:
        if not 0 <= token_id < 256:  # special tokens carry no text
            return ""
        data = self.pending + bytes([token_id])
        hold = incomplete_utf8_tail(data)
        ready, self.pending = data[: len(data) - hold], data[len(data) - hold :]
        return ready.decode("utf-8", errors="replace")

    def flush(self) -> str:
        """End of stream: whatever is still held back can never complete."""
        text, self.pending = self.pending.decode("utf-8", errors="replace"), b""
        return text
