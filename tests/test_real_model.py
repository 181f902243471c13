"""Chapter 10's pieces: the real configs shipped with the package, the tiny-checkpoint builder
(`minivllm.book.tiny_checkpoint`) and its checkpoints loaded (exercise ch10.3), and Llama 3's RoPE
scaling worked by hand (exercise ch10.2)."""

from __future__ import annotations

import math

import pytest
import torch

from minivllm.book.tiny_checkpoint import (
    LLAMA3_TOKENS,
    save_tokenizer,
    shipped_chat_template,
    shipped_config,
    tiny_checkpoint,
    token_bytes,
    train_bpe_tokenizer,
)
from minivllm.engine.llm_engine import LLM
from minivllm.kv.sizing import kv_bytes_per_token
from minivllm.model.checkpoint import config_from_hf, load_model
from minivllm.model.families import HFTransformer, model_class, rope_inv_freq
from minivllm.model.hf_tokenizer import HFTokenizer
from minivllm.model.transformer import RopeScaling
from minivllm.sched.sequence import SamplingParams
from minivllm.stages.naive import generate_naive

TEXTS = ["Tokyo 東京 🙂", "naïve façade — Ελληνικά!", "the cat sat on the mat"]


def parameters(config) -> int:
    with torch.device("meta"):
        return model_class(config, torch.bfloat16)(config).num_parameters()


def test_the_shipped_configs_are_the_published_models() -> None:
    """Read as their families, with the sizes their model cards give: Qwen3-0.6B has 0.6 B
    parameters, 0.44 B of them outside the embedding; Llama 3 8B has 8.03 B."""
    qwen = config_from_hf(shipped_config("Qwen3-0.6B"))
    assert (qwen.architecture, qwen.qk_norm, qwen.tie_word_embeddings) == (
        "Qwen3ForCausalLM",
        True,
        True,
    )
    assert qwen.head_dim == 128 != qwen.d_model // qwen.n_heads
    assert round(parameters(qwen) / 1e9, 2) == 0.60
    assert round((parameters(qwen) - qwen.vocab_size * qwen.d_model) / 1e9, 2) == 0.44
    llama = config_from_hf(shipped_config("Meta-Llama-3-8B"))
    assert llama.rope_scaling is None and round(parameters(llama) / 1e9, 2) == 8.03
    llama31 = config_from_hf(shipped_config("Llama-3.1-8B"))
    assert llama31.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 8192)
    # 2 x layers x KV heads x head size x 2 bytes (bfloat16)
    assert kv_bytes_per_token(qwen.n_layers, qwen.n_kv_heads, qwen.head_dim, "bfloat16") == 114688
    assert kv_bytes_per_token(llama.n_layers, llama.n_kv_heads, 128, "bfloat16") == 131072
    assert "<|eot_id|>" in shipped_chat_template("Meta-Llama-3-8B-Instruct")
    with pytest.raises(FileNotFoundError, match="the shipped ones are .*'Qwen3-0.6B'"):
        shipped_config("Qwen9-1T")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    """A small BPE tokenizer with Llama 3's special tokens and chat template, and a tiny Qwen3 and
    Llama 3.1 built from the shipped configs."""
    root = tmp_path_factory.mktemp("tiny")
    bpe = train_bpe_tokenizer([" ".join(TEXTS) * 20], 320, LLAMA3_TOKENS.values())
    ids = {role: bpe.token_to_id(token) for role, token in LLAMA3_TOKENS.items()}
    tokenizer_dir = save_tokenizer(
        root / "tokenizer",
        bpe,
        {
            "bos_token": LLAMA3_TOKENS["bos"],
            "eos_token": LLAMA3_TOKENS["eot"],
            "chat_template": shipped_chat_template("Meta-Llama-3-8B-Instruct"),
        },
        {"eos_token_id": [ids["end_of_text"], ids["eot"]]},
        bos_first=LLAMA3_TOKENS["bos"],
    )
    return {
        "tokenizer": tokenizer_dir,
        "qwen3": tiny_checkpoint(root / "qwen3", shipped_config("Qwen3-0.6B"), tokenizer_dir, 0),
        "llama": tiny_checkpoint(root / "llama", shipped_config("Llama-3.1-8B"), tokenizer_dir, 1),
    }


@pytest.mark.exercise("ch10.3")
def test_a_tiny_checkpoint_keeps_its_familys_switches(tiny) -> None:
    qwen3, llama = load_model(tiny["qwen3"]).config, load_model(tiny["llama"]).config
    assert (qwen3.qk_norm, qwen3.tie_word_embeddings, qwen3.n_heads // qwen3.n_kv_heads) == (
        True,
        True,
        2,
    )
    assert qwen3.head_dim != qwen3.d_model // qwen3.n_heads  # a head size of its own
    assert llama.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 8192)
    assert llama.n_heads // llama.n_kv_heads == 4 and not llama.tie_word_embeddings
    tokenizer = HFTokenizer.from_folder(tiny["qwen3"])
    assert qwen3.vocab_size == tokenizer.vocab_size and qwen3.bos_token_id == tokenizer.bos_id


def test_random_weights_are_a_function_of_the_seed(tiny, tmp_path) -> None:
    real = shipped_config("Qwen3-0.6B")
    again = tiny_checkpoint(tmp_path / "again", real, tiny["tokenizer"], 0)
    other = tiny_checkpoint(tmp_path / "other", real, tiny["tokenizer"], 5)
    weights = [(f / "model.safetensors").read_bytes() for f in (tiny["qwen3"], again, other)]
    assert weights[0] == weights[1] != weights[2]


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_llm_runs_a_tiny_checkpoint_as_its_plain_forward_does(tiny, family) -> None:
    """`LLM(folder)`: the folder's tokenizer encodes the prompt (BOS first), and the paged engine
    writes the tokens the model's own forward pass picks without any cache."""
    llm = LLM(str(tiny[family]), num_blocks=32, device="cpu", attention_backend="torch")
    model = load_model(tiny[family])
    assert isinstance(model, HFTransformer)
    tokenizer = llm.engine.tokenizer
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    for prompt, out in zip(TEXTS, llm.generate(TEXTS, greedy, use_tqdm=False)):
        ids = tokenizer.encode(prompt, add_bos=True)
        assert out.prompt_token_ids == ids and ids[0] == tokenizer.bos_id
        assert out.token_ids == generate_naive(model, ids, 8)
        assert out.text == tokenizer.decode(out.token_ids)
    [chat] = llm.chat([{"role": "user", "content": TEXTS[0]}], greedy, use_tqdm=False)
    assert chat.prompt.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_token_bytes_reads_the_byte_level_alphabet(tiny) -> None:
    tokenizer = HFTokenizer.from_folder(tiny["tokenizer"])
    for text in TEXTS:
        pieces = [tokenizer.token_repr(i) for i in tokenizer.encode(text)]
        assert b"".join(token_bytes(piece) for piece in pieces) == text.encode()


@pytest.mark.exercise("ch10.2")
def test_llama3_scaling_worked_by_hand() -> None:
    """head_dim 16, theta 10000: the pairs' wavelengths are 2 pi 10000^(i/8), about 6, 20, 63,
    199 and up. Trained on 64 positions with low 1 and high 4: pair 0 (under 64 / 4) is kept,
    pairs 3 on (over 64 / 1) turn 8 times slower, pairs 1 and 2 are blended."""
    scaling = RopeScaling(8.0, 1.0, 4.0, original_max_position_embeddings=64)
    plain, scaled = rope_inv_freq(16, 10000.0), rope_inv_freq(16, 10000.0, scaling)
    assert scaled.shape == plain.shape == (8,)
    assert scaled[0] == plain[0]
    assert torch.equal(scaled[3:], plain[3:] / 8)
    for pair in (1, 2):
        speed = plain[pair].item()
        blend = (64 / (2 * math.pi / speed) - 1) / (4 - 1)
        assert 0 < blend < 1
        assert scaled[pair].item() == pytest.approx((1 - blend) * speed / 8 + blend * speed)
    assert torch.all(scaled[1:] < scaled[:-1])  # each pair still turns slower than the one before
