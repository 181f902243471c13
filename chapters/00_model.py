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
# # Chapter 00 — The model an engine serves
#
# :::{admonition} At a glance
# - **Builds:** a Llama-architecture transformer read line by line, its weights loaded, text
#   sampled, and naive generation timed.
# - **Needs:** Python and a first look at PyTorch tensors; what a transformer layer does, roughly.
# - **Runs in:** about 50 s, start to end (`make book` on a quiet 2-core AMD EPYC).
# :::
#
# An inference engine is everything that stands between a trained model and the people asking it for
# text: memory for keys and values, a {term}`scheduler` that batches requests, a sampler, a server.
# This book builds one, layer by layer. Before any of that, you need the thing being served.
#
# This chapter introduces it: a small Llama-architecture transformer {cite}`touvron2023llama` (the
# decoder-only transformer of {cite}`vaswani2017attention` with {term}`RMSNorm`
# {cite}`zhang2019rmsnorm`, rotary positions {cite}`su2021roformer` and
# {term}`grouped-query attention` {cite}`ainslie2023gqa`), trained by this project on Shakespeare's
# plays, shipped in the package as safetensors. You will read its code, count its parameters, make
# it write, and then watch the simplest way of generating text get slower with every token — the
# problem the next three chapters solve.

# %% tags=["remove-input"] mystnb={"image": {"alt": "The roadmap of the engine, chapter 00 highlighted: the chapters before it built, those after it to come"}}
from minivllm.book.figures.roadmap import roadmap

roadmap(0)

# %%
import json

import matplotlib.pyplot as plt
import torch

from minivllm.book import sequence_color, show, use_book_style
from minivllm.model.checkpoint import WEIGHTS_DIR, load_model
from minivllm.model.tokenizer import ByteTokenizer

torch.manual_seed(0)
torch.set_num_threads(2)
use_book_style()

model = load_model("target")
tokenizer = ByteTokenizer()
print(model.config)

# %% [markdown]
# ## What a language model computes
#
# The model reads a sequence of token ids and, for every position, returns a score (a *logit*) for
# each possible next token. Here a token is one byte of UTF-8 text (chapter 01 explains why), so the
# vocabulary is the 256 byte values plus three {term}`special tokens <special token>`.
#
# `Transformer.forward` is the whole computation, top to bottom: embed the tokens, work out the
# rotation angles for their positions, run a stack of decoder layers, apply a final norm, and the LM
# head that turns each position's vector into logits. (`rows` is for the engine of chapter 04, which
# needs the logits of one position per sequence: the other positions skip the LM head, and the last
# layer's work after its attention, whose output feeds nothing else. llama.cpp skips it so too.)

# %%
from minivllm.model.transformer import Transformer

show(Transformer.forward)

# %% [markdown]
# Each decoder layer is two residual blocks: attention (tokens look at earlier tokens) and an MLP
# (each token thinks on its own). Both read a normalised copy of the residual stream and add their
# result back.

# %%
from minivllm.model.transformer import DecoderLayer

show(DecoderLayer.forward)

# %% [markdown]
# ### RMSNorm
#
# Llama normalises with RMSNorm: divide each vector by its root-mean-square and multiply by a
# learned gain. There is no mean subtraction and no bias — cheaper than LayerNorm and just as good
# in practice. You will write this function yourself in exercise ch00.1.

# %%
from minivllm.model.transformer import RMSNorm

show(RMSNorm.forward)

# %% [markdown]
# ### Attention, and the seam
#
# Attention projects each token's vector into a *query*, a *key* and a *value*. The model here uses
# **grouped-query attention**: it has fewer key/value heads than query heads (`n_kv_heads` and
# `n_heads` in the config above), and each key/value head is shared by a group of query heads. That
# shrinks the keys and values — the very tensors an engine must keep in memory — by the group size;
# the parameter count below measures it.
#
# Read the last lines of `SelfAttention.forward` closely. After rotating q and k by their positions,
# the layer does **not** compute attention itself. It hands `(layer, q, k, v)` to an `attention`
# object the *caller* supplied. That line is the seam the whole book plugs into: chapter 02 passes
# an object that remembers keys and values, chapter 03 one that stores them in pages, chapter 04 one
# that serves a whole batch at once. The model never changes.

# %%
from minivllm.model.transformer import SelfAttention

show(SelfAttention.forward)

# %% [markdown]
# With no cache at all, the attention object is plain causal attention over the tokens it was given:

# %%
from minivllm.model.transformer import CausalAttention, attention_reference

show(CausalAttention)

# %% [markdown]
# `CausalAttention` uses torch's fused {term}`kernel <kernel (CUDA)>`. `attention_reference` writes
# the same softmax out by hand, with an explicit mask. Every attention implementation in this book
# is checked against it, so check the first one now: same inputs, the causal mask, the same output
# — to float32 rounding, whose last digits differ from one CPU to another. So a check in this book
# prints the tolerance it holds the difference to, never the difference itself.

# %%
from minivllm.book.stats import within

g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(5, h, 32, generator=g) for h in (8, 2, 2))
causal_mask = torch.ones(5, 5, dtype=torch.bool).tril()
max_diff = (
    (CausalAttention()(0, q, k, v) - attention_reference(q, k, v, causal_mask)).abs().max().item()
)
print(f"max |fused - reference| {within(max_diff, 1e-5)}")

# %% [markdown]
# ### Rotary position embeddings
#
# Attention by itself does not know the order of tokens. RoPE tells it by *rotating* each pair of
# coordinates in q and k by an angle proportional to the token's position, with a different speed
# for each pair. The dot product of a rotated query and key then depends only on how far apart the
# two tokens are. Exercise ch00.2 asks you to write `apply_rope`.

# %%
from minivllm.model.transformer import apply_rope, rope_cos_sin

show(apply_rope)

# %%
q1, k1 = torch.randn(1, 1, 32, generator=g), torch.randn(1, 1, 32, generator=g)


def rotated_score(pos_q: int, pos_k: int) -> float:
    cq, sq = rope_cos_sin(torch.tensor([pos_q]), 32, model.config.rope_theta)
    ck, sk = rope_cos_sin(torch.tensor([pos_k]), 32, model.config.rope_theta)
    return float((apply_rope(q1, cq, sq) * apply_rope(k1, ck, sk)).sum())


for pos_q, pos_k in [(3, 0), (103, 100), (403, 400), (3, 2)]:
    score = rotated_score(pos_q, pos_k)
    print(f"query at {pos_q:3d}, key at {pos_k:3d}, distance {pos_q - pos_k}: score {score:+.3f}")

# %% [markdown]
# The same distance gives the same score wherever the pair sits; a different distance gives a
# different one. That property is what lets an engine compute a token's key *once*, at its position,
# and reuse it for every later query.
#
# ### The MLP
#
# The feed-forward block is a {term}`SwiGLU`: two projections up, one gated by SiLU, multiplied,
# projected back down.

# %%
from minivllm.model.transformer import SwiGLU

show(SwiGLU)

# %% [markdown]
# ## Where the parameters are
#
# Count every weight by the component it belongs to.


# %%
def component(name: str) -> str:
    if "embed_tokens" in name:
        return "token embedding"
    if "lm_head" in name:
        return "LM head"
    if "self_attn.q_proj" in name or "self_attn.o_proj" in name:
        return "attention q, o"
    if "self_attn.k_proj" in name or "self_attn.v_proj" in name:
        return "attention k, v"
    if "mlp" in name:
        return "MLP (SwiGLU)"
    return "norms"


counts: dict[str, int] = {}
for name, param in model.named_parameters():
    counts[component(name)] = counts.get(component(name), 0) + param.numel()
total = model.num_parameters()
for part, n in counts.items():
    print(f"{part:16s} {n:>10,d}  {n / total:6.1%}")
print(f"{'total':16s} {total:>10,d}")

# %% tags=["hide-input"] mystnb={"figure": {"caption": "Where the target model's parameters sit, by component: one bar per part of the model, its length in millions of parameters.", "name": "fig-00-parameters"}}
fig, ax = plt.subplots(figsize=(7.5, 2.8))
parts = sorted(counts, key=counts.get)
ax.barh(
    parts, [counts[p] / 1e6 for p in parts], color=[sequence_color(i) for i in range(len(parts))]
)
ax.set_xlabel("parameters (millions)")
ax.set_title(f"minivllm target: {total / 1e6:.2f} M parameters")
plt.show()

# %% [markdown]
# The MLPs hold most of the weights. The key and value projections are small — grouped-query
# attention at work — and that matters more than their size suggests: k and v are what an engine
# caches, once per token per layer.

# %%
c = model.config
kv_bytes_per_token = c.n_layers * 2 * c.n_kv_heads * c.head_dim * 4
print(
    f"KV cache per token: {c.n_layers} layers x 2 (k, v) x {c.n_kv_heads} heads x {c.head_dim} dims"
    f" x 4 bytes = {kv_bytes_per_token:,} bytes"
)
ungrouped_bytes = kv_bytes_per_token * c.n_heads // c.n_kv_heads
print(f"with {c.n_heads} kv heads (no grouping) it would be {ungrouped_bytes:,} bytes")

# %% [markdown]
# ## The weights on disk
#
# The shipped weights use the Hugging Face layout: a folder with `config.json` and
# `model.safetensors`, with Llama's tensor names. Hugging Face `transformers` loads them as a
# `LlamaForCausalLM`, and the test suite checks that its logits equal ours.

# %%
from safetensors import safe_open

with safe_open(str(WEIGHTS_DIR / "target" / "model.safetensors"), framework="pt") as f:
    for name in f.keys():
        if name.startswith("model.layers.0.") or "layers" not in name:
            print(f"{name:42s} {tuple(f.get_slice(name).get_shape())}")

# %% [markdown]
# The loader checks every name, shape and dtype before it builds anything, and a broken file fails
# with a message that names the problem. Here is a copy of the weights with one tensor removed:

# %%
import shutil
import tempfile
from pathlib import Path

from safetensors.torch import load_file, save_file

from minivllm.model.checkpoint import CheckpointError

with tempfile.TemporaryDirectory() as tmp:
    broken = Path(tmp) / "broken"
    shutil.copytree(WEIGHTS_DIR / "target", broken)
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["model.layers.3.mlp.up_proj.weight"]
    save_file(tensors, str(broken / "model.safetensors"))
    try:
        load_model(broken)
    except CheckpointError as error:
        print("CheckpointError:", str(error).replace(tmp, "<tmp>"))

# %% [markdown]
# ## How it was trained
#
# `python -m minivllm.training.train --preset target` trains this model from a fixed seed on the
# plays in the corpus except *Macbeth* and *Twelfth Night*, and scores it on those two, which it
# never saw. The folder's model card records the result.

# %%
card = json.loads((WEIGHTS_DIR / "target" / "training.json").read_text())
draft_card = json.loads((WEIGHTS_DIR / "draft" / "training.json").read_text())
for name, info in [("target", card), ("draft", draft_card)]:
    print(
        f"{name:6s}: {info['parameters']:>9,d} parameters, {info['train_config']['steps']} steps, "
        f"validation {info['validation_bits_per_byte']:.3f} bits per byte"
    )
print(f"held out: {card['validation_bytes']:,} bytes of Macbeth and Twelfth Night")

# %% tags=["hide-input"] mystnb={"figure": {"caption": "Held-out bits per byte of the target and the draft model while training, scored on a sample of the validation text at each checkpoint; lower is better.", "name": "fig-00-training"}}
fig, ax = plt.subplots()
for name, info, color in [
    ("target", card, sequence_color(0)),
    ("draft", draft_card, sequence_color(1)),
]:
    steps = [h["step"] for h in info["history"]]
    ax.plot(
        steps,
        [h["val_bpb_sample"] for h in info["history"]],
        "o-",
        color=color,
        label=f"{name} (validation sample)",
    )
ax.set_xlabel("training step")
ax.set_ylabel("bits per byte")
ax.legend()
ax.set_title("Held-out bits per byte while training")
plt.show()

# %% [markdown]
# *{term}`Bits per byte`* is the average number of bits the model needs to encode each byte of
# unseen text. A model that knows nothing needs 8 (any of 256 bytes, equally likely); the lower, the
# better it predicts Shakespeare. The curves are scored on the first 64 windows of the held-out text
# while training; the model card's number is the whole held-out text, scored once at the end.
#
# ## Making it write
#
# Generation is a loop: run the model, pick a next token from the last position's logits, append it,
# repeat. The simplest version recomputes the whole sequence every step.

# %%
from minivllm.stages.naive import generate_naive, stream_naive

show(stream_naive)

# %%
prompt = "ROMEO:\n"
prompt_ids = tokenizer.encode(prompt, add_bos=True)
greedy = generate_naive(model, prompt_ids, max_new_tokens=200)
print(prompt + tokenizer.decode(greedy))

# %% [markdown]
# Greedy decoding always takes the most likely byte, which tends to loop. Sampling at a temperature
# below 1 is livelier; the seed makes it repeatable.

# %%
sampled = generate_naive(
    model,
    tokenizer.encode("KING HENRY V:\n", add_bos=True),
    max_new_tokens=300,
    temperature=0.8,
    seed=7,
)
print("KING HENRY V:\n" + tokenizer.decode(sampled))

# %% [markdown]
# ## Why naive generation does not scale
#
# Every step of `stream_naive` runs the model over *all* tokens so far, to use only the last row of
# logits. Step *t* pushes *t* tokens through every layer, so the work per token grows with the
# position, and the whole generation costs a sum that grows with the square of its length. Count it
# with an attention object that records how many tokens cross the seam:


# %%
class CountingAttention(CausalAttention):
    def __init__(self) -> None:
        self.tokens = 0

    def __call__(self, layer, q, k, v):
        if layer == 0:
            self.tokens += q.shape[-3]
        return super().__call__(layer, q, k, v)


def tokens_through_model(prompt_len: int, new_tokens: int) -> int:
    counter = CountingAttention()
    ids = list(range(prompt_len))
    with torch.no_grad():
        for _ in range(new_tokens):
            model(torch.tensor(ids), attention=counter)
            ids.append(65)
    return counter.tokens


for n in (50, 100, 200):
    print(
        f"{n:3d} new tokens after an 8-token prompt: {tokens_through_model(8, n):6,d} token-passes"
    )

# %% [markdown]
# Doubling the output roughly quadruples the work. Now time it: generate 300 tokens and record how
# long each step takes.

# %%
# NBVAL_IGNORE_OUTPUT
import time

from minivllm.stages.naive import next_token_logits

ids = tokenizer.encode("ROMEO:\n", add_bos=True)
step_seconds = []
for _ in range(300):
    started = time.perf_counter()
    ids.append(int(next_token_logits(model, ids).argmax()))
    step_seconds.append(time.perf_counter() - started)
print(
    f"first 10 steps: {1000 * sum(step_seconds[:10]) / 10:.1f} ms per token; "
    f"last 10 steps: {1000 * sum(step_seconds[-10:]) / 10:.1f} ms per token"
)

# %% tags=["hide-input"] mystnb={"figure": {"caption": "Naive generation: the time to produce each token against its position; every step reruns the model over the whole prefix, so each token costs more than the last.", "name": "fig-00-naive-step-time"}}
fig, ax = plt.subplots()
positions = range(len(tokenizer.encode("ROMEO:\n", add_bos=True)), len(ids))
ax.plot(
    positions,
    [1000 * s for s in step_seconds],
    ".",
    ms=3,
    color=sequence_color(0),
    label="measured",
)
ax.set_xlabel("position of the generated token")
ax.set_ylabel("time for that token (ms)")
ax.set_title("Naive generation: every token costs more than the last")
ax.set_ylim(bottom=0)
ax.legend()
plt.show()

# %% [markdown]
# The time per token climbs with the position: each step redoes all the work of the steps before it.
# Yet the keys and values of earlier tokens never change — RoPE fixed them at their positions, and
# causal attention never lets an early token see a later one. Chapter 02 stores them instead of
# recomputing them, and the time per token goes flat.
#
# ## Exercises
#
# Solutions live in the package between `### BEGIN SOLUTION` and `### END SOLUTION`; in a student
# copy (`make student DEST=...`) they are replaced by `raise NotImplementedError`. Each exercise has
# tests marked with its id; run one exercise's tests, from the project's folder, in the environment
# `make book` installed (it has pytest):
#
# ```
# . .venv/bin/activate        # once per shell; every chapter's `pytest` command runs in it
# pytest tests/test_model.py --exercise ch00.1
# ```
#
# 1. **ch00.1 — RMSNorm.** Implement `RMSNorm.forward` in `src/minivllm/model/transformer.py`:
#    divide `x` by the root-mean-square of its last dimension (plus `eps`, inside the square root),
#    then multiply by `self.weight`. The tests check the definition and that the output has unit RMS
#    whatever the input's scale.
#
#    *Hint:* Reduce over the last dimension with `keepdim=True`, so the RMS keeps a size-1 axis and
#    broadcasts back against `x`. Unlike LayerNorm there is no mean to subtract and no bias.
# 2. **ch00.2 — {term}`RoPE`.** Implement `apply_rope`: split the last dimension in halves, build
#    `rotate_half(x) = [-x2, x1]`, and return `x * cos + rotate_half(x) * sin` (broadcast over
#    heads). The tests check the identity at position 0, an exact rotation, and that scores depend
#    only on the distance between positions.
#
#    *Hint:* `rope_cos_sin` gives `cos` and `sin` as `[..., T, head_dim]`, with no heads axis, while
#    `x` is `[..., T, heads, head_dim]`: give them a size-1 axis just before the last one. At
#    position 0 the angle is 0, so your output must be `x` itself.
# 3. *(Explore, no test.)* Count parameters for a model with 8 key/value heads instead of 2, and the
#    KV cache bytes per token. At what context length does the {term}`KV cache` of one sequence
#    outgrow the model itself?
#
#    *Hint:* `Transformer(dataclasses.replace(model.config, n_kv_heads=8)).num_parameters()` counts
#    it for you; only `k_proj` and `v_proj` grow. The break-even context is the model's bytes
#    divided by the KV bytes per token, both at 4 bytes a number.

# %% [markdown]
# ## Summary
#
# You have the model the rest of the book serves: a Llama-architecture decoder (RMSNorm, rotary
# positions, grouped-query attention, a SwiGLU MLP) whose attention is a seam the caller fills, its
# parameters counted, its weights loaded from safetensors, and its text sampled. And you have the
# problem: naive generation re-runs the whole sequence for every token, so the time per token climbs
# with the length — the curve measured above, which chapter 02 flattens.
#
# **The same idea in vLLM.** The model: `vllm/model_executor/models/llama.py`, with its layers in
# `vllm/model_executor/layers/` (`layernorm.py`, `rotary_embedding/`, `activation.py`); the
# attention seam is vLLM's `Attention` layer (`vllm/attention/layer.py`), which forwards to the
# backend the engine chose. nano-vllm: `nanovllm/models/qwen3.py` and `nanovllm/layers/`.
