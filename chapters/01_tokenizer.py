# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Chapter 01 — Bytes as tokens
#
# :::{admonition} At a glance
# - **Builds:** a byte-level tokenizer and a streaming decoder that never splits a character.
# - **Needs:** chapter 00; UTF-8 in outline (the chapter explains what it needs).
# - **Runs in:** a few seconds, start to end (`make book` on a quiet 2-core AMD EPYC).
# :::
#
# A model reads and writes token ids, not text. Something has to turn your prompt into ids and the
# ids the model produces back into text — and, in a server, back into text *one token at a time*,
# while the client watches the answer appear.
#
# This chapter builds the simplest tokenizer that can never fail: one token per UTF-8 byte. You
# will see what it costs (longer sequences), what it buys (no unknown words, no vocabulary file, a
# tiny embedding table), and the one place where it bites: a character can span several tokens, so
# streaming text token by token needs a decoder that knows when a character is finished.
#
# The code lives in `src/minivllm/model/tokenizer.py`; its tests are in `tests/test_tokenizer.py`.

# %% tags=["remove-input"] mystnb={"image": {"alt": "The roadmap of the engine, chapter 01 highlighted: the chapters before it built, those after it to come"}}
from minivllm.book.figures.roadmap import roadmap

roadmap(1)

# %%
import random
import re
from collections import Counter

import matplotlib.pyplot as plt

from minivllm.book import sequence_color, show, use_book_style
from minivllm.model.tokenizer import (
    BOS_ID,
    EOS_ID,
    SECOND_BYTE_RANGE,
    SPECIAL_TOKENS,
    VOCAB_SIZE,
    ByteTokenizer,
    StreamingDecoder,
    incomplete_utf8_tail,
    utf8_length,
)
from minivllm.training.corpus import shipped_validation_text

SEED = 0  # the only randomness in this chapter: the random byte strings of the check below
random.seed(SEED)
use_book_style()
tok = ByteTokenizer()

# %% [markdown]
# ## Why: a vocabulary of words runs out of words
#
# The obvious tokenizer gives every word its own id. Build one from *Macbeth* and hand it *Twelfth
# Night* — the two plays held out of training, shipped gzipped with the package — and see what it
# makes of the comedy's first line.

# %%
validation = shipped_validation_text()
# The shipped text is Macbeth followed by Twelfth Night, which opens with Orsino's "If music be...".
split_at = validation.index("DUKE ORSINO:\nIf music be the food of love")
macbeth, twelfth_night = validation[:split_at], validation[split_at:]

WORD = re.compile(r"\w+(?:'\w+)*|[^\w\s]")  # a word (with its apostrophes), or one punctuation mark


def words(text: str) -> list[str]:
    return WORD.findall(text)


word_vocab = set(words(macbeth))
first_lines = "\n".join(twelfth_night.splitlines()[:3])
print(first_lines)
print()
print(" ".join(w if w in word_vocab else "<unk>" for w in words(first_lines)))

# %% [markdown]
# Every `<unk>` is a word the model can neither read nor ever write. A bigger vocabulary pushes the
# problem back but never removes it: there is always a name, a typo, a word in another language or
# an emoji it has not seen. The *Measure* section counts how often it happens.
#
# The other way round has a problem too. Suppose every token is one byte and a server sends each
# token to the client the moment the model produces it, decoding it on its own:

# %%
reply = "Olá 🙂"
naive = "".join(tok.decode([i]) for i in tok.encode(reply))
print(f"the model wrote   {reply!r}")
print(f"the client shows  {naive!r}")

# %% [markdown]
# The `á` and the emoji take several bytes each; decoded one at a time, none of those bytes is a
# character, so the client shows U+FFFD, the {term}`replacement character` `�`, once for every byte
# of them. You will fix both: bytes make unknown tokens impossible, and a {term}`streaming decoder`
# makes the stream come out right.

# %% [markdown]
# ## Build: the byte tokenizer
#
# UTF-8 writes every Unicode character as one to four bytes. The {term}`byte tokenizer` takes those
# bytes as the token ids 0-255, and puts three *{term}`special tokens <special token>`* above them:
# `<bos>` (beginning of sequence, put in front of every prompt), `<eos>` (the model says it is done)
# and `<pad>`.

# %%
show(ByteTokenizer)

# %% [markdown]
# Three things to notice:
#
# - `encode` is `text.encode("utf-8")`. Every string has a UTF-8 encoding, so every string encodes.
#   (A Python string may hold a *lone {term}`surrogate`*, half of a UTF-16 pair, which is not a
#   character; it becomes U+FFFD rather than an error.)
# - Special tokens are never produced by `encode`. The five characters `<eos>` are five bytes; only
#   your code can put the real `<eos>` into a sequence. A user cannot end the model's turn by typing
#   it.
# - `decode` never raises. It skips special tokens, and bytes that are not valid UTF-8 become
#   U+FFFD. A model can emit any id in any order, and the server must turn whatever comes out into
#   text.

# %%
print("vocabulary size:", tok.vocab_size, "  special tokens:", SPECIAL_TOKENS)
print(tok.encode("Hi!"), "->", repr(tok.decode(tok.encode("Hi!"))))
print(tok.encode("<eos>"), " <- the string '<eos>' is 5 bytes, not token", EOS_ID)
print(tok.encode("Hi!", add_bos=True), "<- a prompt starts with <bos>")
print(repr(tok.decode([BOS_ID, *tok.encode("Hi!"), EOS_ID])), "<- decode skips the special tokens")

# %% [markdown]
# ## How many bytes is a character?
#
# ASCII characters are one byte. Everything else takes two, three or four, and some things you see
# as one character are several code points glued together: an accent can be a separate *combining
# mark*, a flag is two *regional indicator* letters, and a family emoji is three people joined by
# invisible *{term}`zero-width joiners <zero-width joiner>`* (ZWJ, U+200D).

# %%
examples = {
    "e": "e",
    "é": "é",
    "€": "€",
    "🙂": "🙂",
    "e + combining acute": "e\u0301",
    "flag of France": "🇫🇷",
    "family (ZWJ)": "👩\u200d👩\u200d👧",
}
for name, text in examples.items():
    ids = tok.encode(text)
    points = " ".join(f"U+{ord(c):04X}" for c in text)
    print(
        f"{name:20} {len(text)} code point(s) {points:34} {len(ids):2} bytes: {bytes(ids).hex(' ')}"
    )

# %% [markdown]
# The first byte of a character says how long it is, and every other byte is a *continuation byte*
# `10xxxxxx` (0x80-0xBF). That is what makes streaming possible: looking at the last few bytes, you
# can tell whether a character is still unfinished.
#
# | first byte | bytes | code points |
# |---|---|---|
# | 00-7F | 1 | U+0000-U+007F (ASCII) |
# | C2-DF | 2 | U+0080-U+07FF |
# | E0-EF | 3 | U+0800-U+FFFF |
# | F0-F4 | 4 | U+10000-U+10FFFF |
# | 80-BF, C0, C1, F5-FF | — | never the first byte of a character |
#
# A few first bytes also narrow the range of the *second* byte, to forbid *overlong* encodings (a
# character written with more bytes than it needs, like `C0 AF` for `/`), the surrogates
# U+D800-DFFF, and anything past U+10FFFF. The package keeps these facts in one small function and
# one table:

# %%
print(
    "second byte after",
    {f"{lead:02X}": f"{low:02X}-{high:02X}" for lead, (low, high) in SECOND_BYTE_RANGE.items()},
)
show(utf8_length)

# %% [markdown]
# The picture below colours each byte by the character it belongs to. Count the cells: the ASCII
# characters are one cell each, the emoji four.


# %% tags=["hide-input"] mystnb={"figure": {"caption": "The UTF-8 bytes of two short strings, one cell per byte (one byte is one token), coloured by the character it encodes and labelled with its hex value: ASCII characters take one cell, emoji and joined sequences several.", "name": "fig-01-utf8-bytes"}}
def byte_map(ax, text: str) -> None:
    """One cell per byte, coloured by the character it belongs to, labelled with its hex value."""
    x = 0
    for index, char in enumerate(text):
        data = char.encode("utf-8")
        for offset, byte in enumerate(data):
            ax.add_patch(
                plt.Rectangle((x + offset, 0), 0.95, 0.95, color=sequence_color(index), alpha=0.85)
            )
            ax.text(
                x + offset + 0.475,
                0.47,
                f"{byte:02X}",
                ha="center",
                va="center",
                fontsize=8,
                color="white",
            )
        label = (
            char if char.isascii() and char.isprintable() or char in "é€" else f"U+{ord(char):04X}"
        )
        ax.text(
            x + len(data) / 2 - 0.025,
            1.15,
            label if char != " " else "space",
            ha="center",
            fontsize=8,
        )
        x += len(data)
    ax.set_xlim(-0.2, x + 0.2)
    ax.set_ylim(-0.1, 1.5)
    ax.axis("off")


fig, axes = plt.subplots(2, 1, figsize=(9, 2.6))
byte_map(axes[0], "né €5 🙂")
byte_map(axes[1], "👩\u200d👩\u200d👧 🇫🇷")
axes[0].set_title("UTF-8 bytes, coloured by character (one cell = one token)")
plt.show()

# %% [markdown]
# How much longer text gets depends on its script. Each phrase below is a greeting, counted with its
# spaces and punctuation, so the ratios sit a little under the byte length of the script's letters.

# %%
phrases = {
    "English": "Hello, world",
    "German": "Grüß Gott, schöne Grüße",
    "Greek": "Καλημέρα κόσμε",
    "Russian": "Привет, мир",
    "Hebrew": "שלום עולם",
    "Arabic": "مرحبا بالعالم",
    "Hindi": "नमस्ते दुनिया",
    "Thai": "สวัสดีชาวโลก",
    "Chinese": "你好，世界",
    "Japanese": "こんにちは世界",
    "Korean": "안녕하세요 세계",
    "Emoji": "🙂👍🏽🎉",
}
bytes_per_char = {name: len(tok.encode(text)) / len(text) for name, text in phrases.items()}
for name, ratio in bytes_per_char.items():
    print(f"{name:9} {ratio:.2f} tokens per code point")

# %% tags=["hide-input"] mystnb={"figure": {"caption": "What one character costs a byte tokenizer: the average number of tokens (bytes) per code point of a short greeting, by script.", "name": "fig-01-bytes-per-char"}}
fig, ax = plt.subplots()
ax.bar(list(bytes_per_char), list(bytes_per_char.values()), color=sequence_color(0))
ax.set_ylabel("tokens (bytes) per code point")
ax.set_title("What one character costs a byte tokenizer, by script")
ax.tick_params(axis="x", rotation=45)
plt.show()

# %% [markdown]
# ## Build: a decoder for streams
#
# A server decodes as the tokens arrive. Take the reply `"café 🙂"` one token at a time and compare
# three ways to turn it into text:
#
# - **per token**: decode each token alone and send it — what the *Why* section did;
# - **re-decode**: decode everything so far and send the new part — but a character that was half
#   there has been sent as `�` already, and the next byte turns it into something else: text you
#   sent has to be taken back;
# - **streaming**: hold back the bytes of an unfinished character until it is complete.

# %%
reply = "café 🙂"
ids = tok.encode(reply)
decoder = StreamingDecoder()
print(f"{'step':>4}  {'token':10} {'per token':10} {'decode(all so far)':22} {'streaming':10}")
for step, token in enumerate(ids, start=1):
    print(
        f"{step:>4}  {tok.token_repr(token)!r:10} {tok.decode([token])!r:10} "
        f"{tok.decode(ids[:step])!r:22} {decoder.push(token)!r:10}"
    )
print(f"{'end':>4}  {'':10} {'':10} {'':22} {decoder.flush()!r:10}  <- flush")

# %% [markdown]
# The streaming column is silent while a character is incomplete, then sends the whole character
# at once; nothing it sends ever changes. The per-token column is garbage for good. (Decoded as
# Latin-1 instead, each byte would be a character of its own, and you would get the classic
# *{term}`mojibake`*:)

# %%
print(repr(reply.encode("utf-8").decode("latin-1")))

# %% [markdown]
# The whole streaming decoder rests on one question: *how many bytes at the end of what you have are
# the start of a character that can still be completed?* Those wait; everything before them is
# final.

# %%
show(incomplete_utf8_tail)

# %% [markdown]
# It walks back over at most three continuation bytes to find the first byte of the last character.
# If that character is already complete, or already invalid — an overlong start, a surrogate, a byte
# that starts nothing — waiting cannot help: it is decoded now, as U+FFFD if it must be. Only a
# valid but unfinished character is held back. Then the decoder itself is a few lines:

# %%
show(StreamingDecoder)

# %% [markdown]
# `flush` is for the end of the stream: bytes still held back then belong to a character that will
# never finish, so they become U+FFFD — exactly what decoding the whole stream at once gives.
#
# Here is what `incomplete_utf8_tail` says about some endings:

# %%
for data in [
    b"caf",
    b"caf\xc3",
    b"caf\xc3\xa9",
    b"\xf0\x9f",
    b"\xf0\x9f\x99",
    b"\xf0\x9f\x99\x82",
    b"\xe0\x80",
    b"\xed\xa0",
    b"\xf5",
]:
    print(f"{data.hex(' '):15} -> hold back {incomplete_utf8_tail(data)}")

# %% [markdown]
# The last three are never held: `E0 80` can only become an {term}`overlong encoding`, `ED A0` a
# surrogate, and `F5` starts nothing at all.
#
# One limit of the guarantee: the decoder works in *code points*, not in what you see as one
# character (a *{term}`grapheme cluster`*). The family emoji arrives person by person — never a
# broken byte, but a terminal shows one woman, then two, then the family:

# %%
decoder = StreamingDecoder()
pieces = [decoder.push(i) for i in tok.encode("👩\u200d👩\u200d👧")] + [decoder.flush()]
print([" ".join(f"U+{ord(c):04X}" for c in piece) for piece in pieces if piece])

# %% [markdown]
# ## Check
#
# The tests pin these invariants with property-based tests: `hypothesis` generates many strings and
# byte sequences, and shrinks any failure to the smallest one. The same checks, small and visible:


# %%
def stream(ids: list[int]) -> tuple[list[str], str]:
    decoder = StreamingDecoder()
    return [decoder.push(i) for i in ids], decoder.flush()


# 1. Round trip on the whole validation text, and no token outside 0-255.
ids = tok.encode(validation)
assert max(ids) < 256 and tok.decode(ids) == validation

# 2. Streaming the whole text gives the same text, and nothing is held back at the end.
pieces, rest = stream(tok.encode(validation, add_bos=True) + [EOS_ID])
assert "".join(pieces) == validation and rest == ""

# 3. Any bytes at all -- mostly invalid UTF-8 -- stream to exactly what Python's decoder makes of them,
#    and every piece, once sent, stays the start of the final text.
for _ in range(2000):
    data = bytes(
        random.choice([0x41, 0x80, 0xBF, 0xC3, 0xE2, 0xED, 0xF0, 0xF4, 0xFF, random.randrange(256)])
        for _ in range(random.randrange(12))
    )
    pieces, rest = stream(list(data))
    final = data.decode("utf-8", errors="replace")
    assert "".join(pieces) + rest == final
    assert all(final.startswith("".join(pieces[:k])) for k in range(len(pieces) + 1))

# 4. decode never raises, whatever the ids.
assert tok.decode([0xC0, 0xAF, BOS_ID, 0xED, 0xA0, 0x80, EOS_ID, 0xFF]) == "\ufffd" * 6
print("all checks passed")

# %% [markdown]
# ## Measure: what bytes cost, and what they buy
#
# Count the validation plays three ways: characters, byte tokens, and word-level tokens (words and
# punctuation marks, as the *Why* section split them).

# %%
n_chars, n_bytes, n_words = len(validation), len(tok.encode(validation)), len(words(validation))
print(f"characters        {n_chars:>8,}")
print(f"byte tokens       {n_bytes:>8,}   {n_bytes / n_chars:.2f} per character")
print(f"word-level tokens {n_words:>8,}   {n_bytes / n_words:.2f} byte tokens per word-level token")

# %% [markdown]
# The plays are plain ASCII, so a byte is a character and the cost per character is nothing. The
# real cost is against words: the cell above says how many times longer a sequence of bytes is than
# the same text in words. Every token is one step of the model when it generates, so a reply takes
# that many times more steps — and the naive loop of chapter 00, which re-reads the whole sequence
# at every step, pays for it twice over:

# %%
ratio = n_bytes / n_words
print(f"generation steps per word-level token: {ratio:.1f}")
print(f"naive generation (cost grows with length squared): {ratio**2:.0f}x the work")

# %% [markdown]
# That quadratic bill is what the {term}`KV cache` of chapter 02 removes. Now what bytes buy. A
# word-level vocabulary has to be built from text, and it keeps growing as you read more: the curve
# below counts the distinct words seen so far while reading through *Macbeth* and then *Twelfth
# Night*. The byte vocabulary is the flat line — it was complete before you read anything.

# %% tags=["hide-input"] mystnb={"figure": {"caption": "Distinct tokens seen while reading Macbeth and then Twelfth Night (dotted line: where Twelfth Night begins): the word-level vocabulary keeps growing, while the byte vocabulary is a flat line, complete from the start.", "name": "fig-01-vocab-growth"}}
seen: set[str] = set()
growth = []
for word in words(validation):
    seen.add(word)
    growth.append(len(seen))

fig, ax = plt.subplots()
ax.plot(range(1, len(growth) + 1), growth, color=sequence_color(0), label="word-level vocabulary")
ax.axhline(VOCAB_SIZE, color=sequence_color(1), label=f"byte vocabulary ({VOCAB_SIZE} tokens)")
ax.axvline(len(words(macbeth)), color="grey", linestyle=":", label="Twelfth Night begins")
ax.set_xlabel("word-level tokens read")
ax.set_ylabel("distinct tokens")
ax.set_title("A word vocabulary never stops growing")
ax.legend()
plt.show()

# %% [markdown]
# Build the word vocabulary on *Macbeth* alone and count what it does not know in *Twelfth Night*:

# %%
macbeth_vocab = set(words(macbeth))
tn_words = words(twelfth_night)
unknown = [w for w in tn_words if w not in macbeth_vocab]
print(f"word vocabulary built on Macbeth:  {len(macbeth_vocab):,} entries")
print(
    f"Twelfth Night word-level tokens:   {len(tn_words):,}, of which {len(unknown):,} unknown "
    f"({len(unknown) / len(tn_words):.1%})"
)
print(f"distinct unknown words:            {len(set(unknown)):,} of {len(set(tn_words)):,}")
print("most frequent unknowns:", ", ".join(w for w, _ in Counter(unknown).most_common(8)))
tn_ids = tok.encode(twelfth_night)
print(
    f"byte tokenizer on Twelfth Night:   {sum(i >= 256 for i in tn_ids)} unknown, "
    f"round trip exact: {tok.decode(tn_ids) == twelfth_night}"
)

# %% [markdown]
# Read the last lines as the case for bytes: a word vocabulary built on one play does not know the
# main characters of the next, and every unknown word is lost for good — the model can never read it
# in a prompt or write it in a reply. The byte tokenizer knows everything in advance, needs no
# vocabulary file to ship or keep in step with the weights, and its embedding table is tiny:

# %%
full_vocab = len(set(words(validation)))
print(f"embedding rows, byte tokenizer:          {VOCAB_SIZE}")
times_more = full_vocab / VOCAB_SIZE
print(f"embedding rows, words of these two plays: {full_vocab:,} ({times_more:.0f}x more)")

# %% [markdown]
# Each row is one vector of the model's width, and the output layer has one row per token too, so
# the ratio holds for those parameters as well. Real systems split the difference with subword
# tokenizers (BPE): a vocabulary of tens of thousands of byte sequences, which falls back to single
# bytes for anything it has never seen. This book stays with bytes: the engine does not care what
# a token means, and bytes keep every sequence long enough to make the engine's work visible.

# %% [markdown]
# ## Exercises
#
# Each exercise is a function in `src/minivllm/model/tokenizer.py` whose body sits between
# `### BEGIN SOLUTION` and `### END SOLUTION`. In the student copy (`make student DEST=somewhere`)
# the body is replaced by `raise NotImplementedError`, and you write it. The tests marked with the
# exercise's id grade it:
#
# ```bash
# pytest tests/test_tokenizer.py --exercise ch01.1      # or: pytest tests/test_tokenizer.py -m exercise
# ```
#
# **Exercise ch01.1 — `incomplete_utf8_tail(data)`.** Return how many bytes at the end of `data`
# (0-3) are the start of a character that can still be completed. Use `utf8_length` and
# `SECOND_BYTE_RANGE`. The tests try every ending of 2-, 3- and 4-byte characters, flags, ZWJ
# sequences and combining marks, the invalid cases (lone continuation bytes, `C0 AF`, `ED A0 80`,
# `F5`, a truncated character followed by ASCII or by the end of the stream), and then, through
# `StreamingDecoder`, random byte strings: the stream must equal
# `bytes(ids).decode("utf-8", errors="replace")` and nothing sent may ever change. *Hint:* walk back
# from the end over {term}`continuation bytes <continuation byte>` until you find a first byte.
#
# **Exercise ch01.2 — `ByteTokenizer.decode(ids)`.** Turn ids back into text: keep only the byte
# ids 0-255 (special tokens and anything out of range carry no text) and replace invalid UTF-8 with
# U+FFFD. It is one line once you know which `bytes.decode` argument to use; the tests check the
# round trip on arbitrary text, special tokens, each kind of invalid byte, and that no list of ids
# makes it raise.
#
# *Hint:* Drop the out-of-range ids *before* you build the `bytes` (`bytes()` rejects values above
# 255), and decode the whole byte string at once, not id by id: a multi-byte character decodes only
# when its bytes are together.
#
# **Going further (not graded).** Python has a streaming UTF-8 decoder of its own:
# `codecs.getincrementaldecoder("utf-8")(errors="replace")`. Feed it `ED A0 80` one byte at a time
# next to `StreamingDecoder`. Which one sends the first U+FFFD sooner, and why is that allowed?
#
# *Hint:* Print what each returns after every byte. Once `ED A0` is in, look it up in
# `SECOND_BYTE_RANGE`: can any later byte still make it valid? Sending early is fine as long as
# nothing sent is ever taken back.

# %% [markdown]
# ## Summary
#
# A tokenizer that can never fail: one token per UTF-8 byte and no vocabulary file. It costs
# longer sequences (the bytes-per-character table above), and it needs a streaming decoder that holds
# back an unfinished character, so a client never sees half of a multi-byte character or a
# replacement character that later turns out to be wrong.
#
# **The same idea in vLLM.** Tokenizers come from Hugging Face (`vllm/transformers_utils/`), and
# streaming text is made by an incremental detokenizer (`vllm/v1/engine/detokenizer.py`), which
# holds back text the same way: until the bytes decode cleanly, and while it might still be the
# start of a stop string.
