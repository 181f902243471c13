"""Our model and Hugging Face's LlamaForCausalLM compute the same logits from the same weights."""

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is a dev dependency: pip install -e '.[dev]'"
)

from minivllm.model.checkpoint import WEIGHTS_DIR, load_model, save_checkpoint  # noqa: E402
from minivllm.model.tokenizer import ByteTokenizer  # noqa: E402
from minivllm.model.transformer import ModelConfig, Transformer, init_weights  # noqa: E402

PROMPTS = [
    "ROMEO:\nBut soft, what light",
    "First Witch:\nWhen shall we three meet again",
    "KING:\n",
    "Café — naïve 🙂",
]


def hf_logits(folder, ids: list[int]) -> torch.Tensor:
    hf = transformers.LlamaForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def assert_same_logits(folder, prompts):
    ours = load_model(folder)
    tok = ByteTokenizer()
    for prompt in prompts:
        ids = tok.encode(prompt, add_bos=True)
        with torch.no_grad():
            mine = ours(torch.tensor(ids))
        diff = (mine - hf_logits(folder, ids)).abs().max().item()
        assert diff < 1e-4, f"{prompt!r}: max |logit difference| = {diff:.2e}"


def test_random_gqa_model_matches(tmp_path):
    model = Transformer(
        ModelConfig(d_model=64, n_layers=2, n_heads=8, n_kv_heads=2, d_ff=96, max_seq_len=64)
    )
    init_weights(model, seed=3)
    save_checkpoint(model, tmp_path)
    assert_same_logits(tmp_path, PROMPTS[:2])


@pytest.mark.parametrize("name", ["target", "draft"])
def test_shipped_model_matches(name):
    assert_same_logits(WEIGHTS_DIR / name, PROMPTS)
