"""A checkpoint's own tokenizer: `tokenizer.json` through Hugging Face's `tokenizers` library.

A Hugging Face folder describes its tokenizer in three files. `tokenizer.json` is the tokenizer
itself (normalizer, pre-tokenizer, BPE merges, decoder, the special tokens, and a post-processor
that may put BOS before a prompt). `tokenizer_config.json` names the special tokens (`bos_token`,
`eos_token`) and may override the post-processor (`add_bos_token`, `add_eos_token`): Llama 3's
post-processor puts `<|begin_of_text|>` first, Qwen's puts nothing. `generation_config.json` may
name several EOS ids (Llama 3 Instruct ends on `<|eot_id|>` or `<|end_of_text|>`). `HFTokenizer`
reads the three and offers what the engine asks of any tokenizer (the `Tokenizer` protocol of
tokenizer.py), like the shipped `ByteTokenizer`.

**Streaming text.** One BPE token is several bytes, and a token may end in the middle of a UTF-8
character (`日` is three bytes; a token may hold the last of them and the first of the next
character). Decoding each token alone would show U+FFFD and never take it back. The
`IncrementalDetokenizer` is vLLM's `detokenize_incrementally`
(`vllm/transformers_utils/detokenizer_utils.py`): it decodes a short window of recent tokens twice,
without and with the new ones, and hands out the difference only once it does not end in U+FFFD.
The window starts a few tokens back (`prefix_offset`), so a decoder that looks at neighbours (a
leading space that belongs to the previous word) decodes the new tokens as the whole text would.
`tokenizers`' own `DecodeStream` (0.21 and later) works the same way, but has no `flush`: a stream
that ends mid-character must end, as `decode` of all its ids does, with U+FFFD.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field
from pathlib import Path

import tokenizers

from minivllm.model.chat_template import read_chat_template, render_chat_template
from minivllm.model.checkpoint import CheckpointError, model_folder, read_config, tokenizer_files
from minivllm.model.tokenizer import BOS_ID, EOS_ID, REPLACEMENT_CHARACTER, VOCAB_SIZE


@dataclass
class IncrementalDetokenizer:
    """Token ids in, one at a time; text out once it decodes cleanly, never taken back."""

    decode: Callable[[list[int]], str]
    ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0  # where the window decoded with each new token starts
    read_offset: int = 0  # tokens before this have had their text handed out

    def push(self, token_id: int) -> str:
        """One more id; the text it makes final. The window is `ids[prefix_offset:]`, and its
        first `read_offset - prefix_offset` ids are the ones whose text was handed out already:
        the new text is what decoding the window adds to decoding those alone. It is held back
        ("") while it is empty or ends in U+FFFD (a character the next id may complete); once
        handed out, the window moves: it starts where the handed-out ids ended, and every id so
        far is read."""
        self.ids.append(token_id)
        # EXERCISE ch10.1: window decode -- new text unless it ends in U+FFFD; then move the offsets
        ### BEGIN SOLUTION
        before = self.decode(self.ids[self.prefix_offset : self.read_offset])
        text = self.decode(self.ids[self.prefix_offset :])
        if len(text) <= len(before) or text.endswith(REPLACEMENT_CHARACTER):
            return ""  # no text yet, or a character that the next token may still complete
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return text[len(before) :]
        ### END SOLUTION

    def flush(self) -> str:
        """End of stream: whatever is held back can never complete (shown as U+FFFD)."""
        # EXERCISE ch10.1: window decode -- hand out whatever push held back, as it decodes now
        ### BEGIN SOLUTION
        before = self.decode(self.ids[self.prefix_offset : self.read_offset])
        text = self.decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return text[len(before) :]
        ### END SOLUTION


class HFTokenizer:
    """`tokenizer.json` + `tokenizer_config.json` (+ `generation_config.json`) from a folder."""

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        config: dict | None = None,
        generation_config: dict | None = None,
        chat_template: str | None = None,
        source: str = "the tokenizer",
    ) -> None:
        self.tokenizer, config = tokenizer, config or {}
        self.source = source  # what errors name: the tokenizer.json it was read from
        # jinja2 source (model/chat_template.py); None: the tokenizer has no chat layout
        self.chat_template = chat_template
        # the special tokens as text, as a template reads them (`bos_token`, `eos_token`, ...)
        self.special_tokens = {
            name: self._special_text(config, name)
            for name in ("bos_token", "eos_token", "unk_token", "pad_token")
        }
        self.bos_id = self._special_id(config, "bos_token")
        self.pad_id = self._special_id(config, "pad_token")
        # None: as tokenizer.json's post-processor does; True/False: transformers' override
        self.add_bos_token = config.get("add_bos_token")
        self.add_eos_token = config.get("add_eos_token")
        eos = self._special_id(config, "eos_token")
        more = (generation_config or {}).get("eos_token_id")
        more = [more] if isinstance(more, int) else list(more or [])
        self.eos_ids = tuple(dict.fromkeys(i for i in [eos, *more] if i is not None))
        self.eos_id = self.eos_ids[0] if self.eos_ids else None
        # the ids it can produce are 0..vocab_size-1: one past the highest (a vocabulary may have
        # gaps, so not its count)
        self.vocab_size = max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1) + 1

    @classmethod
    def from_folder(cls, path: str | Path) -> HFTokenizer:
        folder = Path(path)
        if not (folder / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{folder} has no tokenizer.json")

        def read(name: str) -> dict | None:
            file = folder / name
            return json.loads(file.read_text(encoding="utf-8")) if file.is_file() else None

        tokenizer = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
        config = read("tokenizer_config.json") or {}
        template = read_chat_template(folder, config)
        source = str(folder / "tokenizer.json")
        return cls(tokenizer, config, read("generation_config.json"), template, source)

    @staticmethod
    def _special_text(config: dict, name: str) -> str | None:
        token = config.get(name)
        return token.get("content") if isinstance(token, dict) else token

    def apply_chat_template(
        self,
        messages: SequenceOf[Mapping],
        add_generation_prompt: bool = True,
        tokenize: bool = True,
        chat_template: str | None = None,
    ) -> list[int] | str:
        """The conversation in the model's own layout (Hugging Face's `apply_chat_template`): the
        rendered text, or with `tokenize` its ids, encoded without the tokenizer's own special
        tokens (the template wrote them). `chat_template` (jinja source) replaces the tokenizer's
        own for this call, as in transformers."""
        template = chat_template or self.chat_template
        if template is None:
            raise ValueError(
                "this tokenizer has no chat template (no chat_template in tokenizer_config.json "
                "and no chat_template.jinja): give a prompt, not messages"
            )
        text = render_chat_template(template, messages, add_generation_prompt, self.special_tokens)
        return self.tokenizer.encode(text, add_special_tokens=False).ids if tokenize else text

    def _special_id(self, config: dict, name: str) -> int | None:
        token = config.get(name)
        if isinstance(token, dict):  # a serialised AddedToken
            token = token.get("content")
        if token is None:
            return None
        token_id = self.tokenizer.token_to_id(token)
        if token_id is None:
            raise ValueError(f"tokenizer_config.json's {name} {token!r} is not in the vocabulary")
        return token_id

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """Token ids of `text`; with `add_bos` (a prompt), the special tokens the tokenizer adds
        (its post-processor, as tokenizer_config's add_bos_token / add_eos_token override it)."""
        ids = self.tokenizer.encode(text, add_special_tokens=add_bos).ids
        if not add_bos:
            return ids
        if self.bos_id is not None and self.add_bos_token is not None:
            has_bos = ids[:1] == [self.bos_id]
            if self.add_bos_token and not has_bos:
                ids = [self.bos_id, *ids]
            elif not self.add_bos_token and has_bos:
                ids = ids[1:]
        if self.eos_id is not None and self.add_eos_token is not None:
            has_eos = ids[-1:] == [self.eos_id]
            if self.add_eos_token and not has_eos:
                ids = [*ids, self.eos_id]
            elif not self.add_eos_token and has_eos:
                ids = ids[:-1]
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`, special tokens skipped (ids outside the vocabulary too)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def token_repr(self, token_id: int) -> str:
        token = self.tokenizer.id_to_token(token_id)
        if token is None:
            raise ValueError(
                f"token id {token_id} is outside the vocabulary 0..{self.vocab_size - 1}"
            )
        return token

    def detokenizer(self) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.decode)


def load_tokenizer(path: str | Path) -> HFTokenizer | None:
    """The tokenizer of a model folder: its `tokenizer.json`, or None for the book's byte-level
    models (the shipped "target" and "draft", and any that training/train.py writes: config.json's
    vocabulary is the byte tokenizer's), which the engine gives the `ByteTokenizer`.

    Any other folder without a tokenizer.json is refused here, before anything is built: the
    engine would otherwise read its text as bytes, ids that mean nothing to this model."""
    folder = model_folder(path)
    if (folder / "tokenizer.json").is_file():
        return HFTokenizer.from_folder(folder)
    config = read_config(folder)
    byte_level = (config.get("vocab_size"), config.get("bos_token_id"), config.get("eos_token_id"))
    if byte_level == (VOCAB_SIZE, BOS_ID, EOS_ID):
        return None
    others = [name for name in tokenizer_files(folder) if name != "tokenizer.json"]
    has = f" (it has {', '.join(others)})" if others else ""
    raise CheckpointError(
        f"{folder} has no tokenizer.json{has}: minivllm reads a model's tokenizer from its "
        "tokenizer.json (the `tokenizers` format, with tokenizer_config.json beside it), and "
        "without it cannot turn text into this model's token ids. Copy the model's tokenizer "
        "files into the folder (`AutoTokenizer.from_pretrained(...).save_pretrained(folder)` "
        "writes them), or pass a folder that has them: "
        f"LLM({str(folder)!r}, tokenizer='/path/to/tokenizer/folder')"
    )
