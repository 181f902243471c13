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
# # Chapter 10 — A real model
#
# :::{admonition} At a glance
# - **Builds:** what it takes to serve a Hugging Face checkpoint: a BPE tokenizer and its
#   incremental detokenizer, the checkpoint's chat template, four model families as switches on
#   one transformer, and the K/V arithmetic of real model sizes.
# - **Needs:** chapters 00, 01, 03 and 04; chapter 09 for the chat endpoints.
# - **Runs in:** about 15 s, start to end (`make book` on a quiet 2-core AMD EPYC); with
#   `MINIVLLM_MODEL` set, as long as your model takes.
# :::
#
# Everything so far ran the book's own model: 3.5 M parameters, one token per byte, trained on
# plays. The model already on your disk is different in every way that matters to an engine. Its
# tokenizer merges bytes into a vocabulary of some 150 000 pieces, so one token may hold half a
# character. It was trained on conversations laid out by a template of its own. It belongs to a
# *family* — Llama, Qwen2, Qwen3, Mistral — each of which changes the transformer a little. And its
# size turns the KV cache from a detail into the quantity that decides how many requests a GPU
# serves at once. This chapter walks through each difference, in the package's code, and runs
# `LLM(folder)` — vLLM's front door — on checkpoints laid out exactly as Hugging Face saves them.
#
# The checkpoints here are built in the chapter: real configs (shipped in
# `src/minivllm/data/configs/`) shrunk to toy sizes, with random weights, and a tokenizer trained
# in a second. Their answers are noise; everything else is what a downloaded model goes through. At
# the end, a cell runs the model you point `MINIVLLM_MODEL` at.

# %% tags=["remove-input"] mystnb={"image": {"alt": "The roadmap of the engine, chapter 10 highlighted: the chapters before it built, those after it to come"}}
from minivllm.book.figures.roadmap import roadmap

roadmap(10)

# %%
import json
import os
import random
import shutil
import tempfile
import textwrap
import time
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import torch
from safetensors.torch import load_file, save_file

from minivllm import LLM, SamplingParams
from minivllm.book import sequence_color, show, use_book_style
from minivllm.book.tiny_checkpoint import (
    LLAMA3_TOKENS,
    save_tokenizer,
    shipped_chat_template,
    shipped_config,
    shrink_config,
    tiny_checkpoint,
    token_bytes,
    train_bpe_tokenizer,
)
from minivllm.kv.sizing import blocks_for_memory, kv_bytes_per_token
from minivllm.model.checkpoint import (
    CheckpointError,
    check_tensors,
    config_from_hf,
    load_model,
    model_folder,
    read_config,
)
from minivllm.model.families import HFSelfAttention, model_class, rope_inv_freq
from minivllm.model.hf_tokenizer import HFTokenizer, IncrementalDetokenizer
from minivllm.model.tokenizer import ByteTokenizer
from minivllm.stages.naive import generate_naive
from minivllm.training.corpus import shipped_validation_text

torch.manual_seed(0)
torch.set_num_threads(2)
use_book_style()
workdir = Path(tempfile.mkdtemp(prefix="minivllm-ch10-"))  # the chapter's checkpoints

# %% [markdown]
# ## Why: what a real checkpoint changes
#
# A Hugging Face checkpoint describes its model in `config.json`. Three of them ship with the
# package, exactly as published (`src/minivllm/data/configs/README.md` says where each came from):
# Qwen3-0.6B, Llama 3 8B and Llama 3.1 8B. Read by the same `config_from_hf` that `LLM(folder)`
# uses, next to the book's own model — the parameters counted on torch's `meta` device, which
# builds the model's shapes with no memory behind them:


# %%
def parameters(config) -> int:
    with torch.device("meta"):  # shapes only: an 8 B model costs nothing to count
        return model_class(config, torch.bfloat16)(config).num_parameters()


configs = {
    "book's target": config_from_hf(read_config(model_folder("target"))),
    "Qwen3-0.6B": config_from_hf(shipped_config("Qwen3-0.6B")),
    "Llama-3-8B": config_from_hf(shipped_config("Meta-Llama-3-8B")),
}
rows = {
    "parameters": lambda c: f"{parameters(c) / 1e6:,.1f} M",
    "vocabulary": lambda c: f"{c.vocab_size:,}",
    "layers": lambda c: c.n_layers,
    "query heads": lambda c: c.n_heads,
    "KV heads": lambda c: c.n_kv_heads,
    "head size": lambda c: c.head_dim,
    "context": lambda c: f"{c.max_seq_len:,}",
}
print(f"{'':<12}" + "".join(f"{name:>16}" for name in configs))
for row, value in rows.items():
    print(f"{row:<12}" + "".join(f"{value(c):>16}" for c in configs.values()))

# %% [markdown]
# Four things change, and the engine has to handle each of them:
#
# 1. **The tokenizer.** Not bytes, but a learned vocabulary of merged byte sequences, hundreds of
#    times the byte tokenizer's. A token is no longer a byte, nor a character: it can end in the
#    middle of one, and text must be decoded *incrementally*.
# 2. **The conversation layout.** A chat model was fine-tuned on conversations written with its
#    own special tokens; the checkpoint ships that layout as a **chat template**.
# 3. **The family.** Qwen3 normalises every query and key head, has a head size of its own, and
#    shares its embedding with the LM head; Llama 3.1 stretches RoPE to a longer context; Qwen2
#    puts biases on q, k and v. Each is a switch on the book's transformer.
# 4. **The size.** Every layer caches a key and a value per KV head per token. At these sizes
#    that is what fills the GPU, and why real models have few KV heads.
#
# ## Build 1: a vocabulary of merges
#
# **{term}`Byte pair encoding <byte pair encoding (BPE)>`** {cite}`sennrich2016bpe` starts from
# an alphabet — for GPT-2, Llama 3 and Qwen, the 256 bytes {cite}`radford2019gpt2`, so no text is
# ever unknown — and learns merges: the most frequent adjacent pair of symbols in a corpus becomes
# one new symbol, again and again, until the vocabulary has the size asked for. Common words end up
# as one token; rare text falls back to pieces, down to single bytes. The `tokenizers` library
# (what `transformers` uses) trains one in well under a second. Ours learns from the first half of
# the held-out plays and a few lines in other scripts, with Llama 3's special tokens, and is saved
# as a checkpoint's tokenizer files: `tokenizer.json`, `tokenizer_config.json` (which tokens are
# BOS and EOS, and the chat template of Build 3) and `generation_config.json` (the ids that end a
# request):

# %%
plays = shipped_validation_text()
half = len(plays) // 2
WORLD = (
    "東京で会いましょう。日本語のテキスト、日本の本。今日は天気がいいですね。北京欢迎你。"
    "我们明天见。 Ελληνικά κείμενα, καλημέρα. Русский текст, добрый день. café crème brûlée, "
    "naïve façade. emoji 🙂🎉👍 are fun! "
)
bpe = train_bpe_tokenizer([plays[:half], WORLD * 20], 1024, LLAMA3_TOKENS.values())
special_id = {role: bpe.token_to_id(token) for role, token in LLAMA3_TOKENS.items()}
tokenizer_dir = save_tokenizer(
    workdir / "tokenizer",
    bpe,
    config={
        "bos_token": LLAMA3_TOKENS["bos"],
        "eos_token": LLAMA3_TOKENS["eot"],  # an Instruct model ends its turn with <|eot_id|>
        "chat_template": shipped_chat_template("Meta-Llama-3-8B-Instruct"),
    },
    generation={"eos_token_id": [special_id["end_of_text"], special_id["eot"]]},
    bos_first=LLAMA3_TOKENS["bos"],  # Llama 3 puts <|begin_of_text|> before every prompt
)
tokenizer = HFTokenizer.from_folder(tokenizer_dir)
merges = json.loads((tokenizer_dir / "tokenizer.json").read_text())["model"]["merges"]
print(sorted(p.name for p in tokenizer_dir.iterdir()))
print(
    f"vocabulary: {tokenizer.vocab_size} ids = 256 bytes + {len(merges)} merges + "
    f"{len(LLAMA3_TOKENS)} special tokens; EOS ids {tokenizer.eos_ids}"
)
print(
    "the first merges learned:", [" + ".join(m) if isinstance(m, list) else m for m in merges[:8]]
)

# %% [markdown]
# The merges are written in the byte-level alphabet: each byte as a printable character, `Ġ` for
# the space. What they buy, on the *second* half of the plays, which the tokenizer never saw: fewer
# tokens for the same text — fewer decode steps to write it, fewer K/V slots to hold it.

# %%
held_out = plays[half:]
for name, tok in [("bytes (chapter 01)", ByteTokenizer()), ("BPE, 1024 ids", tokenizer)]:
    count = len(tok.encode(held_out))
    print(f"{name:<19} {count:>7} tokens, {len(held_out) / count:.2f} characters per token")

# %% [markdown]
# A real vocabulary (the second row of the first table), trained on trillions of tokens, goes much
# further; that is why real models are byte-level BPE and not bytes.
#
# ## Build 2: text, one token at a time
#
# The price is paid when text streams out. One token's bytes need not be whole characters: a
# character the merges never saw often enough is split into several tokens. Here is how ours
# writes a short text:

# %%
text = "Tokyo 東京 🙂"
ids = tokenizer.encode(text)
print(f"{'id':>5}  {'token':<8} {'bytes':<14} decoded alone")
ends = []  # where each token's bytes end in the text's UTF-8
for token_id in ids:
    piece = tokenizer.token_repr(token_id)
    ends.append((ends[-1] if ends else 0) + len(token_bytes(piece)))
    alone = tokenizer.decode([token_id])
    print(f"{token_id:>5}  {piece:<8} {token_bytes(piece).hex(' '):<14} {alone!r}")
split, start = {}, 0  # each character: how many tokens hold a part of it
for char in text:
    stop = start + len(char.encode())
    split[char] = sum(
        1 for i, end in enumerate(ends) if end > start and (i == 0 or ends[i - 1] < stop)
    )
    start = stop
print("characters split across tokens:", {c: n for c, n in split.items() if n > 1})

# %% [markdown]
# The Latin letters come in merged pieces; each character of the last line is spread over
# several tokens, and a token may even hold the end of one character and the start of the next.
# Decoded one token at a time — what a server that forwards each token's text as it comes would
# send — every piece of a split character is invalid UTF-8 on its own and turns into U+FFFD, the
# {term}`replacement character`, never to be taken back:

# %%
print("each token decoded alone:", repr("".join(tokenizer.decode([i]) for i in ids)))
detokenizer = tokenizer.detokenizer()
pieces = [detokenizer.push(i) for i in ids] + [detokenizer.flush()]
print("incremental detokenizer: ", pieces)
assert "".join(pieces) == text == tokenizer.decode(ids)

# %% [markdown]
# Each empty piece is a token that left a character unfinished; a character comes out with the
# token that completes it, or later still when that token also begins the next character.
#
# Chapter 01's {term}`streaming decoder` solved this for bytes by counting the bytes of an
# unfinished UTF-8 character. A BPE tokenizer hides its bytes behind a `decode` that may do more
# than join them (a SentencePiece decoder drops the space that starts the text, for instance), so
# the **{term}`incremental detokenizer`** works from `decode` alone, as vLLM's
# `detokenize_incrementally` does (`vllm/transformers_utils/detokenizer_utils.py`). It keeps two
# offsets into the ids: `read_offset`, where the text already handed out ends, and `prefix_offset`,
# a little before it. Each new id decodes the window from `prefix_offset` twice — up to
# `read_offset`, and to the end — and the difference is the new text, unless it ends in U+FFFD: a
# character the next id may still complete. Starting the window a few ids back, rather than at
# `read_offset`, decodes the new ids with their left neighbours, as decoding the whole text would
# (exercise ch10.1 is this class):

# %%
show(IncrementalDetokenizer)

# %% [markdown]
# Each step decodes a few ids, however long the answer has grown. The engine keeps one per
# sequence, in `engine/processing.py`'s `OutputProcessor`, built by the engine's tokenizer
# (`Tokenizer.detokenizer()`): a `ByteTokenizer` hands out chapter 01's streaming decoder, an
# `HFTokenizer` this one. The scheduler never sees text.
#
# ## Check: any ids, one at a time
#
# Two promises, for any stream of ids — broken characters, special tokens, a stream that stops in
# the middle of a character: the pieces add up to `decode(all ids)`, and no piece is ever taken
# back (each prefix of the stream decodes to text that starts with what was handed out).

# %%
rng = random.Random(0)
for _trial in range(300):
    stream_ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(0, 24))]
    detokenizer, streamed = tokenizer.detokenizer(), ""
    for count, token_id in enumerate(stream_ids, start=1):
        streamed += detokenizer.push(token_id)
        assert tokenizer.decode(stream_ids[:count]).startswith(streamed)
    assert streamed + detokenizer.flush() == tokenizer.decode(stream_ids)
print("300 random streams: the pieces are decode(all ids), and nothing was taken back")

# %% [markdown]
# ## Build 3: the chat template
#
# An Instruct model was fine-tuned on conversations written in one exact layout, and answers well
# only when prompted in it. The checkpoint ships the layout as a {term}`chat template`: a jinja2
# program in `tokenizer_config.json` (or `chat_template.jinja`) that turns OpenAI-style messages
# into the prompt's text. Here is Llama 3 8B Instruct's, as published — our tokenizer carries it:

# %%
print(shipped_chat_template("Meta-Llama-3-8B-Instruct"))

# %% [markdown]
# Each message becomes a header (`<|start_header_id|>role<|end_header_id|>` and a blank line), its
# text, and `<|eot_id|>`, the end of a turn; BOS comes first, once; with `add_generation_prompt`
# the prompt ends with the assistant's header, so the model's next words are its answer — and the
# answer ends when the model writes `<|eot_id|>`, which is why generation_config.json names it as
# an EOS id. `HFTokenizer.apply_chat_template` renders it as `transformers` does (its sandboxed
# jinja2 environment, in `model/chat_template.py`), then encodes the text *without* adding BOS
# again, since the template wrote it:

# %%
show(HFTokenizer.apply_chat_template)

# %%
conversation = [
    {"role": "system", "content": "Answer in one line."},
    {"role": "user", "content": "Where do we meet? 🙂"},
    {"role": "assistant", "content": "In Tokyo, 東京."},
    {"role": "user", "content": "When?"},
]
prompt_text = tokenizer.apply_chat_template(conversation, tokenize=False)
prompt_ids = tokenizer.apply_chat_template(conversation)
print(prompt_text)
special_ids = set(special_id.values())
print([tokenizer.token_repr(i) if i in special_ids else i for i in prompt_ids[:16]], "...")
print(f"{len(prompt_ids)} ids, {sum(i in special_ids for i in prompt_ids)} of them special tokens")

# %% [markdown]
# Every marker is one id: the tokenizer knows them as special tokens, and the model learnt them as
# such. The same conversation in Qwen's layout would read `<|im_start|>user` … `<|im_end|>`; the
# engine does not care, it renders whatever template the checkpoint ships. `LLM.chat`, the
# server's `/v1/chat/completions` and `/v1/messages`, and `minivllm chat` all lay a conversation
# out through `engine/conversation.py`, which calls this method — for the book's own model, which
# has no template, chapter 09's play layout stands in.
#
# ## Build 4: four families, one transformer
#
# vLLM keeps a model file per family (`llama.py`, `qwen2.py`, `qwen3.py`, …), which share much of
# their code. Here the families are a handful of fields on the book's `ModelConfig`, read from
# `config.json` by `config_from_hf`; `ModelConfig`'s repr shows them only where they differ from
# the book's model:

# %%
for name in ("Qwen3-0.6B", "Meta-Llama-3-8B", "Llama-3.1-8B"):
    wrapped = textwrap.fill(repr(config_from_hf(shipped_config(name))), 96, subsequent_indent="  ")
    print(f"{name}:\n  {wrapped}")

# %% [markdown]
# What each switch does, and where:
#
# - `attention_bias` (Qwen2): biases on the q, k and v projections — built by the book's
#   `SelfAttention`, which passes `bias=` to its `nn.Linear`s.
# - `tie_word_embeddings` (Qwen3-0.6B): the LM head *is* the embedding matrix, one tensor, not a
#   copy {cite}`press2017tying`; the checkpoint stores it once.
# - `explicit_head_dim` (Qwen3): the head size is its own number, not `d_model / n_heads` —
#   Qwen3-0.6B's query heads together are wider than the model (`n_heads`, `explicit_head_dim`
#   and `d_model` above).
# - `qk_norm` (Qwen3): an RMSNorm on every query and key head before RoPE, which keeps attention
#   logits from growing large {cite}`dehghani2023scaling,yang2025qwen3`. The book's attention does
#   not apply it, so `families.py` does, in a subclass that only checkpoints get:

# %%
show(HFSelfAttention.forward)

# %% [markdown]
# - `rope_scaling` (Llama 3.1): the model was trained on `original_max_position_embeddings`
#   positions, then extended to its `max_seq_len` by slowing its RoPE rotations — but not all of
#   them {cite}`grattafiori2024llama3`.
#   Pairs that turn fast (short wavelengths) already see every relative position many times over
#   and are kept; pairs that turn slowly would meet angles never seen in training and are slowed
#   by `factor`; those between are blended, the "NTK-by-parts" idea of YaRN {cite}`peng2023yarn`
#   (exercise ch10.2):

# %%
show(rope_inv_freq)

# %% [markdown]
# ## See: Llama 3.1's RoPE, stretched
#
# The wavelength of each of Llama 3.1 8B's rotation pairs — how many positions a full turn takes —
# with and without its scaling:

# %% tags=["hide-input"] mystnb={"figure": {"caption": "Llama 3.1 8B's RoPE: the wavelength of each rotation pair, as trained (grey) and as scaled (blue). Pairs whose wavelength is under the lower dashed line are kept, those over the upper one slowed by the scaling factor, those between blended.", "name": "fig-10-rope-scaling"}}
llama31 = config_from_hf(shipped_config("Llama-3.1-8B"))
plain = rope_inv_freq(llama31.head_dim, llama31.rope_theta)
scaled = rope_inv_freq(llama31.head_dim, llama31.rope_theta, llama31.rope_scaling)
scaling = llama31.rope_scaling
trained_context = scaling.original_max_position_embeddings
fig, ax = plt.subplots(figsize=(7.5, 3.4))
pairs = np.arange(len(plain))
ax.semilogy(pairs, 2 * np.pi / plain.numpy(), "o", ms=3, color="#999999", label="as trained")
ax.semilogy(pairs, 2 * np.pi / scaled.numpy(), "o", ms=3, color=sequence_color(0), label="scaled")
for wavelength, label in [
    (trained_context / scaling.high_freq_factor, "kept below"),
    (trained_context / scaling.low_freq_factor, f"slowed x{scaling.factor:g} above"),
]:
    ax.axhline(wavelength, color="#d62728", lw=0.8, ls="--")
    ax.annotate(f"{label} {wavelength:g}", (1, wavelength), va="bottom", fontsize=8)
ax.set_xlabel(f"rotation pair (of the head's {llama31.head_dim} coordinates)")
ax.set_ylabel("wavelength (positions)")
ax.legend(loc="lower right")
plt.show()
kept = int((scaled == plain).sum())
slowed = int((scaled == plain / scaling.factor).sum())
blended = len(plain) - kept - slowed
print(f"{kept} pairs kept, {slowed} slowed by {scaling.factor:g}, {blended} blended")

# %% [markdown]
# ## Build 5: the checkpoint's tensors, checked by name and shape
#
# Now two checkpoints: the real Qwen3-0.6B and Llama 3.1 8B configs shrunk to toy sizes by
# `shrink_config` — the same family and switches, the same share of query heads per KV head, the
# tokenizer's vocabulary — with seeded random weights, saved in Hugging Face's layout, the
# tokenizer's files beside them:

# %%
show(shrink_config)

# %%
folders = {
    "tiny Qwen3": tiny_checkpoint(
        workdir / "tiny-qwen3", shipped_config("Qwen3-0.6B"), tokenizer_dir, seed=0
    ),
    "tiny Llama 3.1": tiny_checkpoint(
        workdir / "tiny-llama3.1", shipped_config("Llama-3.1-8B"), tokenizer_dir, seed=1
    ),
}
print(sorted(p.name for p in folders["tiny Qwen3"].iterdir()))
for name, folder in folders.items():
    tiny = config_from_hf(json.loads((folder / "config.json").read_text()))
    print(f"{name}:\n  {textwrap.fill(repr(tiny), 96, subsequent_indent='  ')}")

# %% [markdown]
# A `.safetensors` file opens with a JSON header giving each tensor's name, dtype, shape and
# where its bytes lie. The model the config describes, built on the `meta` device, lists the
# tensors it needs: `named_parameters()`, with no memory behind them. The book's modules carry
# Hugging Face's names (`model.layers.0.self_attn.q_proj.weight` in both), so nothing is renamed:
# loading compares the two lists, then copies. A tied LM head *is* the embedding, stored once;
# one saved anyway is skipped, as are RoPE tables older exports saved (`ignored_tensor`).
# `load_model` reads the config (Build 4), checks the headers against the model, and only then
# allocates the model's memory and copies tensor by tensor. The check is the heart of it — the
# first thing wrong raised with the tensor's name, not a shape error three calls later (exercise
# ch10.3):

# %%
show(check_tensors)

# %% [markdown]
# ## Check: a broken checkpoint, refused by name
#
# Three ways a checkpoint goes wrong — a tensor lost, a tensor of another model (a third layer
# this config does not have), Qwen3's q-norm saved for a head size other than the config's — and
# one that is not wrong: the tied LM head saved beside the embedding.


# %%
def broken_copy(change) -> Path:
    """A copy of the tiny Qwen3 with its tensors changed by `change`."""
    folder = workdir / "broken"
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(folders["tiny Qwen3"], folder)
    tensors = load_file(str(folder / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


head_dim = config_from_hf(read_config(folders["tiny Qwen3"])).head_dim
breakages = {
    "a tensor lost": lambda t: t.pop("model.layers.1.mlp.up_proj.weight"),
    "another model's": lambda t: t.update({"model.layers.2.mlp.up_proj.weight": torch.ones(2)}),
    "q-norm misshapen": lambda t: t.update(
        {"model.layers.0.self_attn.q_norm.weight": torch.ones(head_dim // 2)}
    ),
}
for what, change in breakages.items():
    folder = broken_copy(change)
    try:
        load_model(folder)
        raise AssertionError(f"{what}: loaded")
    except CheckpointError as error:
        print(f"{what}:\n  {str(error).replace(str(folder), 'broken')}")


def head_saved_anyway(tensors):  # zeros: were it read, the head would not be the embedding
    tensors["lm_head.weight"] = torch.zeros_like(tensors["model.embed_tokens.weight"])


tied = load_model(broken_copy(head_saved_anyway))
assert tied.lm_head.weight is tied.model.embed_tokens.weight and tied.lm_head.weight.any()
print("the tied head saved anyway: loads, and the LM head is the embedding, one tensor")

# %% [markdown]
# ## Run it: checkpoints through `LLM(folder)`
#
# `LLM(folder)` reads the folder's config, weights and tokenizer, and sizes the cache from a
# memory budget as vLLM does (`kv_cache_memory_bytes`): the K/V bytes one token costs
# (`kv/sizing.py`, worked out at real sizes below), then as many whole blocks as the budget buys;
# the longest sequence it serves (`max_model_len`) is the model's context, capped by what the cache
# holds. The cell does the arithmetic itself and checks that the engine did the same. The prompts
# are text, encoded by the checkpoint's tokenizer with its BOS first; greedy, so the answers are
# reproducible:

# %%
greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
prompts = ["ROMEO: Tokyo 東京 🙂", "JULIET:"]
engines = {}
for name, folder in folders.items():
    config = config_from_hf(json.loads((folder / "config.json").read_text()))
    kv_per_token = kv_bytes_per_token(
        config.n_layers, config.n_kv_heads, config.head_dim, "float32"
    )
    engines[name] = LLM(str(folder), kv_cache_memory_bytes=2 * 2**20)
    assert engines[name].engine.cache == blocks_for_memory(2 * 2**20, 16, kv_per_token)
    print(f"{name}: {kv_per_token} bytes of K/V per token")
    print(f"  {engines[name].engine.describe_capacity()}")
    for out in engines[name].generate(prompts, greedy, use_tqdm=False):
        print(f"  {out.prompt!r} -> {out.text!r}")

# %% [markdown]
# Noise, as promised — random weights — but tokenized, run and detokenized as a downloaded model
# would be. Two checks that it is the *right* noise. The prompt's ids are the tokenizer's, BOS
# first; and the paged engine — fused projections, the paged cache, continuous batching, the
# `HFTransformer` of the family — writes exactly the tokens that the model's plain forward pass,
# recomputing every prefix without any cache (chapter 00's `generate_naive`), picks:

# %%
for name, folder in folders.items():
    model = load_model(folder)
    for prompt, out in zip(prompts, engines[name].generate(prompts, greedy, use_tqdm=False)):
        ids = tokenizer.encode(prompt, add_bos=True)
        assert out.prompt_token_ids == ids and ids[0] == tokenizer.bos_id
        assert out.token_ids == generate_naive(model, ids, greedy.max_tokens)
    print(f"{name} ({type(model).__name__}): the engine's tokens are the plain forward's")

# %% [markdown]
# Streamed, the text arrives in whole characters. A step whose token ends inside a character
# streams its tokens with no text; the text comes with the token that completes it:

# %%
llm = engines["tiny Qwen3"]
deltas = list(llm.engine.stream(prompts[:1], SamplingParams(max_tokens=48, temperature=0)))
held = sum(1 for d in deltas if d.token_ids and not d.text)
[whole] = llm.generate(prompts[:1], SamplingParams(max_tokens=48, temperature=0), use_tqdm=False)
assert "".join(d.text for d in deltas) == whole.text == tokenizer.decode(whole.token_ids)
print(f"{len(deltas)} deltas, {held} of them held back for a character still incomplete")

# %% [markdown]
# And a chat: `LLM.chat` renders the conversation with the checkpoint's template, and the answer
# ends at the first of the EOS ids (`<|eot_id|>` or `<|end_of_text|>`) — or, for a random model,
# at `max_tokens`:

# %%
[answer] = llm.chat(conversation, SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)
assert answer.prompt_token_ids == prompt_ids and answer.prompt == prompt_text
print(f"prompt: {len(answer.prompt_token_ids)} ids, ending {answer.prompt[-40:]!r}")
print(f"answer: {answer.text!r} ({answer.finish_reason})")

# %% [markdown]
# ## Measure: grouped-query attention at real sizes
#
# Every layer keeps a key and a value vector per KV head for every token in context. One token's
# cache is therefore
#
# $$ \text{bytes per token} = 2 \times L \times H_{kv} \times d_{head} \times \text{bytes per
# element}, $$
#
# with $L$ layers, $H_{kv}$ KV heads of size $d_{head}$. With one KV head per query head
# (multi-head attention, MHA) $H_{kv}$ would be the number of query heads; **{term}`grouped-query
# attention`** {cite}`ainslie2023gqa` lets a group of query heads share one KV head — the limit
# of one KV head for all is multi-query attention {cite}`shazeer2019mqa` — and divides the cache by
# the group size. In bfloat16, from the shipped configs:

# %%
real = {"Qwen3-0.6B": configs["Qwen3-0.6B"], "Llama-3-8B": configs["Llama-3-8B"]}


def per_token(config, heads: int) -> int:
    return kv_bytes_per_token(config.n_layers, heads, config.head_dim, "bfloat16")


for name, c in real.items():
    gqa, mha = per_token(c, c.n_kv_heads), per_token(c, c.n_heads)
    print(
        f"{name:<11} 2 x {c.n_layers} layers x {c.n_kv_heads} KV heads x {c.head_dim} x 2 bytes "
        f"= {gqa / 1024:.0f} KiB per token; as MHA ({c.n_heads} KV heads) {mha / 1024:.0f} KiB"
    )

# %% [markdown]
# What that means for serving: one 80 GiB GPU, of which vLLM by default lets the engine use 90 %
# (`gpu_memory_utilization=0.9`); the weights in bfloat16 take their share, and the rest is KV
# cache (a real engine also sets some aside for activations, which we leave out). Blocks of 16
# tokens, from `blocks_for_memory`; requests that fit are those whose whole context is cached at
# once:

# %%
GPU, UTILIZATION, BLOCK = 80 * 2**30, 0.9, 16
weights = {name: 2 * parameters(c) for name, c in real.items()}  # bfloat16: 2 bytes each
kv_budget = {name: int(GPU * UTILIZATION) - weights[name] for name in real}


def requests_that_fit(name: str, heads: int, context: int) -> int:
    cache = blocks_for_memory(kv_budget[name], BLOCK, per_token(real[name], heads))
    return cache.num_blocks // -(-context // BLOCK)  # blocks per request: context / 16, rounded up


print(f"{'':<11} {'weights':>9} {'K/V budget':>11} {'tokens cached':>14}   requests of 2k / 8k")
for name, c in real.items():
    cache = blocks_for_memory(kv_budget[name], BLOCK, per_token(c, c.n_kv_heads))
    gqa = [requests_that_fit(name, c.n_kv_heads, n) for n in (2048, 8192)]
    mha = [requests_that_fit(name, c.n_heads, n) for n in (2048, 8192)]
    print(
        f"{name:<11} {weights[name] / 2**30:5.1f} GiB {kv_budget[name] / 2**30:7.1f} GiB "
        f"{cache.num_tokens:>14,}   GQA {gqa[0]:>3} / {gqa[1]:>3}, as MHA {mha[0]:>3} / {mha[1]:>3}"
        f"  ({gqa[0] / mha[0]:.1f}x)"
    )

# %% mystnb={"figure": {"caption": "Requests whose whole context fits in the KV cache of one 80 GiB GPU (90 % of it, less the bfloat16 weights), against the context length, up to each model's own: as the checkpoints are (grouped-query attention, solid) and as they would be with one KV head per query head (dashed).", "name": "fig-10-requests-that-fit"}}
fig, ax = plt.subplots(figsize=(7.5, 3.6))
for index, (name, c) in enumerate(real.items()):
    contexts = [2**k for k in range(9, 17) if 2**k <= c.max_seq_len]  # up to the model's own
    for heads, style, label in [(c.n_kv_heads, "-", "GQA"), (c.n_heads, "--", "as MHA")]:
        fits = [requests_that_fit(name, heads, n) for n in contexts]
        ax.loglog(contexts, fits, style, marker="o", ms=3, color=sequence_color(index), base=2)
        ax.lines[-1].set_label(f"{name}, {label} ({heads} KV heads)")
ax.set_xlabel("context per request (tokens)")
ax.set_ylabel("requests that fit at once")
ax.legend(loc="upper right", fontsize=8)
plt.show()

# %% [markdown]
# Grouped-query attention multiplies the requests that fit by about its group size (the last
# column). And the small model is hardly cheaper per token than the 8 B one: its cache is nearly as
# deep and its heads as wide. What it saves is weights, which leaves more of the GPU to the cache.
# Continuous batching (chapter 04) can only batch what the cache holds, so this number bounds the
# batch, and with it the throughput.
#
# ## Measure: what incremental detokenization costs
#
# The obvious correct way to stream text is to decode all the ids after every token and hand out
# what is new. It costs a decode of the whole answer per token, so the answer's length squared
# overall; the window costs a few ids per token. On answers of growing length (wall clock, so the
# numbers vary with the machine and are not compared when the book is tested):


# %%
# NBVAL_IGNORE_OUTPUT
def whole_text_each_token(ids: list[int]) -> str:
    shown = ""
    for count in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:count])
        if not text.endswith("\ufffd"):  # a server sends what is new: text[len(shown):]
            shown = text
    return shown


def incremental(ids: list[int]) -> str:
    detokenizer = IncrementalDetokenizer(tokenizer.decode)
    return "".join(detokenizer.push(i) for i in ids) + detokenizer.flush()


answer_ids = tokenizer.encode(held_out[:10000])
print(f"{'answer':>8} {'whole text each token':>22} {'incremental':>12}  (microseconds per token)")
for length in (250, 500, 1000, 2000):
    timings = []
    for method in (whole_text_each_token, incremental):
        started = time.perf_counter()
        assert method(answer_ids[:length]) == tokenizer.decode(answer_ids[:length])
        timings.append((time.perf_counter() - started) / length * 1e6)
    print(f"{length:>8} {timings[0]:>22.1f} {timings[1]:>12.1f}")

# %% [markdown]
# ## Your own checkpoint
#
# Point `MINIVLLM_MODEL` at a Hugging Face folder you have downloaded — a Llama, Qwen2 or Qwen3
# checkpoint, or a Mistral whose sliding window covers its context (`config_from_hf` refuses the
# others rather than compute them wrong) — and run the chapter again:
#
# ```bash
# huggingface-cli download Qwen/Qwen3-0.6B --local-dir ~/models/Qwen3-0.6B
# MINIVLLM_MODEL=~/models/Qwen3-0.6B jupyter lab
# ```
#
# The cells below then load it, size its cache to 1 GiB, show how its tokenizer writes the text of
# Build 2, and stream a chat answer. Without it they say so and skip; their output is never
# compared when the book is tested.

# %%
# NBVAL_IGNORE_OUTPUT
model_dir = os.environ.get("MINIVLLM_MODEL")
if not model_dir:
    real_llm = None
    print("MINIVLLM_MODEL is not set: skipping the cells that run a downloaded checkpoint")
else:
    hf = json.loads((Path(model_dir).expanduser() / "config.json").read_text())
    mine = config_from_hf(hf)
    dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    mine_per_token = kv_bytes_per_token(mine.n_layers, mine.n_kv_heads, mine.head_dim, dtype)
    print(f"{model_dir}: {mine}")
    print(f"{mine_per_token / 1024:.0f} KiB of K/V per token in {dtype}")
    started = time.perf_counter()
    real_llm = LLM(str(Path(model_dir).expanduser()), kv_cache_memory_bytes=2**30)
    print(f"loaded in {time.perf_counter() - started:.1f} s; {real_llm.engine.describe_capacity()}")
    mine_tokenizer = real_llm.engine.tokenizer
    for token_id in mine_tokenizer.encode(text):
        piece, alone = mine_tokenizer.token_repr(token_id), mine_tokenizer.decode([token_id])
        print(f"{token_id:>7} {piece!r:<12} alone: {alone!r}")

# %%
# NBVAL_IGNORE_OUTPUT
if real_llm is None:
    print("MINIVLLM_MODEL is not set: skipping")
else:
    question = [{"role": "user", "content": "Name three cities in Japan, in Japanese and English."}]
    chat_ids = mine_tokenizer.apply_chat_template(question)
    started, first = time.perf_counter(), None
    for delta in real_llm.engine.stream([chat_ids], SamplingParams(max_tokens=96, temperature=0)):
        first = first or time.perf_counter()
        print(delta.text, end="", flush=True)
    done = time.perf_counter() - started
    print(f"\n\n(first text after {first - started:.2f} s; done after {done:.1f} s)")

# %% [markdown]
# ## Exercises
#
# Solutions live between `### BEGIN SOLUTION` and `### END SOLUTION` in
# `src/minivllm/model/checkpoint.py` (ch10.3), `src/minivllm/model/hf_tokenizer.py` (ch10.1) and
# `src/minivllm/model/families.py` (ch10.2); run one exercise's tests with
# `pytest tests --exercise ch10.3`.
#
# 1. **ch10.3 — checking a checkpoint against its model** (this chapter's core). Write
#    `check_tensors`: given the model's names and shapes (`expected`), the file holding each of
#    the checkpoint's tensors (`files`) and the file saying so (`listing`), pass a checkpoint that
#    fits, else raise `CheckpointError` for the first problem, in the docstring's order and words:
#    missing, unexpected (not what `ignored_tensor` skips), absent from its file, misshapen, not a
#    float. Headers only, never the data. The tests load every family (Llama 3 and 3.1, Qwen2,
#    Qwen3 tied, Mistral; one file or shards) and compare each parameter with the file, then break
#    checkpoints one way at a time: each gets its error, naming tensor and file, before any memory
#    is allocated. Unsolved, no model loads — the shipped ones neither — so each chapter that runs
#    a model stops at its first. Three hints, from a nudge to nearly the answer, are folded below
#    the list.
# 2. **ch10.1 — the incremental detokenizer.** Write
#    `IncrementalDetokenizer.push` and `flush`. `push(token_id)` has appended the id; return the
#    text it makes final, and move the offsets as its docstring says. `flush()` ends the stream:
#    return whatever is still held back, as it decodes now. The tests stream hand-picked texts
#    whose tokens split characters, and hundreds of random id lists (special tokens, broken
#    characters, streams cut mid-character): the pieces must add up to `decode(all ids)`, and no
#    piece may ever be taken back. Its three hints are folded below ch10.3's.
# 3. **ch10.2 — Llama 3's RoPE scaling.** In `rope_inv_freq`, when `scaling` is given, return the
#    scaled speeds: by each pair's wavelength, kept, divided by `factor`, or blended, as its
#    docstring says. The tests compare hand-worked pairs in each band and, where `transformers` is
#    installed, its own function bit for bit on Llama 3.1 8B's settings.
#
#    *Hint:* Work on the whole tensor at once: compute every pair's wavelength, then pick per pair
#    with `torch.where`, once for the slowed band and once for the blended one. The figure above is
#    the answer to check yours against.
# 4. *(Explore, no test.)* The KV arithmetic for a model of your choice: Llama 3 70B has 80 layers,
#    8 KV heads of 128 and 64 query heads. How many 8k-token requests fit next to its bfloat16
#    weights on eight 80 GiB GPUs? And if the cache were stored in 8-bit floats, as vLLM's
#    `kv_cache_dtype="fp8"` does?
#
#    *Hint:* `kv_bytes_per_token` takes a dtype name; for one byte per element, write the formula
#    out. The weights: count them on the meta device from a config dict you write by hand.
# 5. *(Explore, no test.)* A user's message that contains the text `<|eot_id|>`: render it with
#    `apply_chat_template` and look at the ids. What could a user do with that, and how would you
#    stop it?
#
#    *Hint:* The rendered prompt is encoded with the tokenizer's special tokens recognised
#    anywhere in the text. `tokenizers` can encode a message's content on its own, without them;
#    where would that have to happen?

# %% [markdown]
# The hints for ch10.3, the chapter's core, then for ch10.1, are folded: open one at a time.
#
# :::{admonition} Hint 1 for ch10.3 — a nudge
# :class: dropdown
# Two questions, in this order: are the checkpoint's names the model's (compare the two sets both
# ways, once `ignored_tensor` has had its say)? Then, name by name, does each file's header agree?
# `safe_open` reads a header only, and a slice of it knows its tensor's shape and dtype.
# :::
#
# :::{admonition} Hint 2 for ch10.3 — the approach
# :class: dropdown
# Missing: `expected`'s names less the kept names of `files`; unexpected: the reverse; sorted, so
# the error names the first. Then `_by_file` groups the names by file: open each once with
# `safe_open(..., framework="pt")`, look for each name in its `keys()`, and compare
# `get_slice(name)`'s `get_shape()` with `expected[name]` and its `get_dtype()` (`"BF16"`, ...)
# with `SAFETENSORS_DTYPES`.
# :::
#
# :::{admonition} Hint 3 for ch10.3 — nearly there
# :class: dropdown
# Messages start with `listing` (names) or the file's `path` (headers), as the docstring writes
# them. `get_shape()` is a list: make it a tuple, or `[10, 32]` never equals `(10, 32)`. Write
# `" (and N more)"` only when several are missing, N the count less the one named.
# :::
#
# :::{admonition} Hint 1 for ch10.1 — a nudge
# :class: dropdown
# You never need to know which bytes a token holds. `self.decode` of a list of ids is all the
# tokenizer you get, and U+FFFD at the *end* of a decoded text is the one sign that the text is
# not final yet.
# :::
#
# :::{admonition} Hint 2 for ch10.1 — the approach
# :class: dropdown
# Decode the window twice: `ids[prefix_offset:read_offset]` (what was handed out, with its left
# neighbours) and `ids[prefix_offset:]`. The new text is the second decoding minus as many
# characters as the first one has. If there are none, or the new text ends in U+FFFD, return ""
# and leave the offsets alone: the next id decodes the same window, one id longer.
# :::
#
# :::{admonition} Hint 3 for ch10.1 — nearly there
# :class: dropdown
# When you do hand text out, the ids before `read_offset` are needed only as left context for
# the ones after them: move `prefix_offset` to the old `read_offset`, and `read_offset` to
# `len(self.ids)`. `flush` is the same subtraction with no check, then both offsets to the end.
# :::

# %% [markdown]
# ## Summary
#
# The engine serves a model laid out as Hugging Face saves it. A checkpoint's tokenizer is a
# vocabulary of byte merges, so a token may end inside a character: the incremental detokenizer
# decodes a short window twice per token and hands out text only when it ends in a whole
# character. The checkpoint's chat template writes conversations in the layout the model was tuned
# on, special tokens as single ids. Llama, Qwen2, Qwen3 and Mistral are one transformer with a few
# switches, each read from `config.json` and refused when the model cannot compute it exactly. And
# at real sizes the KV cache is what bounds the batch: the table above counts how many requests
# one GPU holds, and grouped-query attention multiplies that number by its group size.
#
# **The same ideas in vLLM.** The families: `vllm/model_executor/models/llama.py` and `qwen3.py`
# (`Qwen3Attention` with its `q_norm` and `k_norm`), RoPE scaling in
# `vllm/model_executor/layers/rotary_embedding/`; detokenizing: `vllm/v1/engine/detokenizer.py`
# over `detokenize_incrementally` in `vllm/transformers_utils/detokenizer_utils.py`; chat
# templates: `vllm/entrypoints/chat_utils.py`; the cache sized from a memory budget:
# `vllm/v1/core/kv_cache_utils.py`.
