"""Bytes as tokens: the tokenizer that needs no vocabulary file and never meets an unknown word.

Token ids 0-255 are the UTF-8 bytes of the text. Special tokens live above 255 and can only enter a
sequence on purpose -- no string encodes to them. Decoding never raises: bytes that are not valid
UTF-8 become U+FFFD, the replacement character.

A server streams text token by token, but one token is one *byte*, and a character may need up to
four. `StreamingDecoder` holds back the bytes of a character that has not finished yet, so a client
never receives half an emoji.
"""

from __future__ import annotations

from dataclasses import dataclass, field

BOS_ID = 256
EOS_ID = 257
PAD_ID = 258
SPECIAL_TOKENS = {"<bos>": BOS_ID, "<eos>": EOS_ID, "<pad>": PAD_ID}
VOCAB_SIZE = 259


class ByteTokenizer:
    bos_id = BOS_ID
    eos_id = EOS_ID
    pad_id = PAD_ID
    vocab_size = VOCAB_SIZE

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [BOS_ID, *ids] if add_bos else ids

    def decode(self, ids: list[int]) -> str:
        """Text of the byte tokens in `ids`; special tokens are skipped, invalid bytes become U+FFFD."""
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def token_repr(self, token_id: int) -> str:
        """A printable name for one token, for tables and figures."""
        names = {v: k for k, v in SPECIAL_TOKENS.items()}
        if token_id in names:
            return names[token_id]
        if not 0 <= token_id < 256:
            raise ValueError(f"token id {token_id} is outside the vocabulary 0..{VOCAB_SIZE - 1}")
        char = bytes([token_id]).decode("latin-1")
        return char if char.isprintable() and token_id < 128 else f"<0x{token_id:02X}>"


def incomplete_utf8_tail(data: bytes) -> int:
    """How many bytes at the end of `data` begin a UTF-8 character that could still be completed (0-3).

    Those bytes must wait for the next token. Everything before them -- finished characters, and
    bytes that can never become valid -- can be decoded now without changing the final text.
    """
    # EXERCISE ch01.1: count the trailing bytes of an unfinished (but still valid) UTF-8 character
    ### BEGIN SOLUTION
    for length in range(1, min(3, len(data)) + 1):
        byte = data[-length]
        if byte < 0x80:  # ASCII: nothing is pending
            return 0
        if byte >= 0xC0:  # the lead byte of the last character
            expected = 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
            if length >= expected:
                return 0
            try:
                data[-length:].decode("utf-8")
            except UnicodeDecodeError as error:
                # A valid start that merely ran out of bytes; anything else is garbage already.
                return length if error.reason == "unexpected end of data" else 0
            return 0
    return 0
    ### END SOLUTION


@dataclass
class StreamingDecoder:
    """Feed token ids one at a time; get back only whole characters.

    The text `push` returns over a whole stream, plus `flush()`, equals `ByteTokenizer().decode` of
    all the ids at once.
    """

    pending: bytes = field(default=b"")

    def push(self, token_id: int) -> str:
        if token_id >= 256:  # special tokens carry no text
            return ""
        data = self.pending + bytes([token_id])
        hold = incomplete_utf8_tail(data)
        ready, self.pending = data[: len(data) - hold], data[len(data) - hold :]
        return ready.decode("utf-8", errors="replace")

    def flush(self) -> str:
        """End of stream: whatever is still held back can never complete."""
        text, self.pending = self.pending.decode("utf-8", errors="replace"), b""
        return text
