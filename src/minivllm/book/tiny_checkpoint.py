"""Tiny Hugging Face checkpoints, built offline: a byte-level BPE tokenizer trained with
`tokenizers`, and random weights for a real model's config shrunk to toy sizes (chapter 10, and
the tests of `HFTokenizer`).

A folder as Hugging Face saves a model -- `config.json`, `model.safetensors`, `tokenizer.json`,
`tokenizer_config.json`, `generation_config.json` -- is all `LLM(folder)` reads. A random one goes
through every step a downloaded one does (the family's switches read by `config_from_hf`, the
checks and the tensor-by-tensor reads of `load_model`, the tokenizer's merges, special tokens and
chat template); only its answers are noise. `transformers` is not needed: the weights come from the
package's own model (`model_class`), saved under Hugging Face's tensor names, which are ours.

The real configs and the chat template the chapter reads ship in `minivllm/data/configs/`; its
README says where each file came from.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import tokenizers
import torch
from safetensors.torch import save_file

from minivllm.model.checkpoint import config_from_hf
from minivllm.model.families import model_class

SHIPPED_CONFIGS = Path(__file__).resolve().parent.parent / "data" / "configs"
# Llama 3's special tokens, by their role (tokenizer_config.json names them as text)
LLAMA3_TOKENS = {
    "bos": "<|begin_of_text|>",
    "end_of_text": "<|end_of_text|>",
    "start_header": "<|start_header_id|>",
    "end_header": "<|end_header_id|>",
    "eot": "<|eot_id|>",  # end of turn: where an Instruct model's answer ends
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
# The sizes a real config is shrunk to: a forward pass of a few thousand multiply-adds per token
TOY_SIZES = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
}


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's table, read backwards: the printable character that stands for each byte in a
    byte-level BPE vocabulary. Printable Latin-1 bytes stand for themselves; the others (space,
    control bytes, ...) for the characters from U+0100 on, in byte order (space is `Ġ`)."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    others = (byte for byte in range(256) if byte not in printable)
    table = {chr(byte): byte for byte in printable}
    table.update({chr(0x100 + shift): byte for shift, byte in enumerate(others)})
    return table


BYTE_LEVEL_ALPHABET = _byte_level_alphabet()


def token_bytes(token: str) -> bytes:
    """The bytes a byte-level BPE token stands for (`token` as the vocabulary writes it)."""
    return bytes(BYTE_LEVEL_ALPHABET[char] for char in token)


def shipped_config(name: str) -> dict:
    """A real model's `config.json`, as published, from `minivllm/data/configs/<name>/`."""
    path = SHIPPED_CONFIGS / name / "config.json"
    if not path.is_file():
        known = sorted(p.parent.name for p in SHIPPED_CONFIGS.glob("*/config.json"))
        raise FileNotFoundError(f"no shipped config {name!r}: the shipped ones are {known}")
    return json.loads(path.read_text(encoding="utf-8"))


def shipped_chat_template(name: str) -> str:
    """A real model's chat template (jinja2), from `minivllm/data/configs/<name>/`."""
    return (SHIPPED_CONFIGS / name / "chat_template.jinja").read_text(encoding="utf-8")


def train_bpe_tokenizer(
    texts: Iterable[str], vocab_size: int, special_tokens: Sequence[str]
) -> tokenizers.Tokenizer:
    """A byte-level BPE tokenizer, the kind GPT-2, Llama 3 and Qwen use: text is UTF-8 bytes, each
    byte a symbol of the initial alphabet, and training merges the most frequent adjacent pair
    until the vocabulary (special tokens included) has `vocab_size` entries. Deterministic."""
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def save_tokenizer(
    folder: str | Path,
    tokenizer: tokenizers.Tokenizer,
    config: dict,
    generation: dict | None = None,
    bos_first: str | None = None,
) -> Path:
    """Write a checkpoint's tokenizer files into `folder` (created): `tokenizer.json`,
    `tokenizer_config.json` (`config`: its special tokens, chat template, ...) and, given,
    `generation_config.json`. `bos_first` names a token the post-processor puts before every
    encoded text (Llama 3's `<|begin_of_text|>`); None puts nothing first (Qwen's)."""
    from tokenizers import processors

    folder = Path(folder)
    folder.mkdir(parents=True)
    tokenizer = tokenizers.Tokenizer.from_str(tokenizer.to_str())  # the caller's stays as it was
    if bos_first is not None:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos_first} $A", special_tokens=[(bos_first, tokenizer.token_to_id(bos_first))]
        )
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **config}  # as transformers reads it
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    if generation is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return folder


def shrink_config(hf: dict, vocab_size: int, bos_id: int | None, eos_id: int | None) -> dict:
    """`hf` (a real `config.json`) at toy sizes (`TOY_SIZES`), stored in float32: the same
    architecture and family switches (biases, q/k norms, tied embeddings, RoPE and its scaling,
    the context length), the same share of query heads per KV head, and a head size of its own
    where the real one has one. The vocabulary and special tokens are the tokenizer's."""
    small = {**hf, **TOY_SIZES, "vocab_size": vocab_size}
    heads = hf["num_attention_heads"]
    group = heads // (hf.get("num_key_value_heads") or heads)  # query heads per KV head
    small["num_key_value_heads"] = max(1, TOY_SIZES["num_attention_heads"] // group)
    if "head_dim" in hf:  # Qwen3's head size is not hidden_size / heads: keep it so
        natural = TOY_SIZES["hidden_size"] // TOY_SIZES["num_attention_heads"]
        small["head_dim"] = 2 * natural
    small.update(bos_token_id=bos_id, eos_token_id=eos_id, torch_dtype="float32")
    small.pop("dtype", None)  # transformers 5's spelling of torch_dtype
    return small


def save_random_weights(folder: str | Path, hf: dict, seed: int, std: float = 0.2) -> Path:
    """`config.json` (`hf` as given) and `model.safetensors` of the model `hf` describes, with
    random weights: N(0, std) for every matrix (a larger spread than training's 0.02, so the
    logits are far apart and greedy choices are rarely near-ties), ones for the norms' gains,
    zeros for biases. Drawn with numpy's seeded generator, whose bits are the same on every CPU.
    A tied LM head is not saved (it is the embedding), as Hugging Face saves one."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = config_from_hf(hf, folder / "config.json")
    model = model_class(config, torch.float32)(config)
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, param in model.named_parameters():  # a tied head appears once, as the embedding
        if name.endswith("norm.weight"):
            value = np.ones(param.shape)
        elif name.endswith(".bias"):
            value = np.zeros(param.shape)
        else:
            value = rng.standard_normal(param.shape) * std
        tensors[name] = torch.from_numpy(value.astype(np.float32))
    (folder / "config.json").write_text(json.dumps(hf, indent=2) + "\n", encoding="utf-8")
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def tiny_checkpoint(
    folder: str | Path, real: dict, tokenizer_folder: str | Path, seed: int
) -> Path:
    """A checkpoint folder for `LLM(folder)`: the real config `real` shrunk to toy sizes
    (`shrink_config`), random weights (`save_random_weights`), and the tokenizer files of
    `tokenizer_folder` copied beside them."""
    folder, tokenizer_folder = Path(folder), Path(tokenizer_folder)
    tokenizer = tokenizers.Tokenizer.from_file(str(tokenizer_folder / "tokenizer.json"))
    special = json.loads((tokenizer_folder / "tokenizer_config.json").read_text(encoding="utf-8"))

    def token_id(name: str) -> int | None:
        token = special.get(name)
        token = token.get("content") if isinstance(token, dict) else token  # an AddedToken
        return None if token is None else tokenizer.token_to_id(token)

    hf = shrink_config(
        real,
        tokenizer.get_vocab_size(with_added_tokens=True),
        token_id("bos_token"),
        token_id("eos_token"),
    )
    save_random_weights(folder, hf, seed)
    for name in TOKENIZER_FILES:
        if (tokenizer_folder / name).is_file():
            shutil.copy2(tokenizer_folder / name, folder / name)
    return folder
