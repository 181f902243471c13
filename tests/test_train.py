"""Training: the pipeline runs end to end on a toy config (the real runs are too slow for tests)."""

import json
from dataclasses import replace

import numpy as np
import torch

from minivllm.model.tokenizer import ByteTokenizer
from minivllm.training import corpus
from minivllm.training.train import (
    PRESETS,
    bits_per_byte,
    encode_plays,
    learning_rate,
    train,
    write_model_card,
)

SPEECHES = "ROMEO:\nBut soft, what light through yonder window breaks?\n\nJULIET:\nAy me!\n\n" * 40


def toy_plays():
    return [corpus.Play(slug="toy", title="Toy", scenes=(SPEECHES, SPEECHES[:200]))]


def test_scenes_are_wrapped_in_bos_and_eos():
    tokens = encode_plays(toy_plays(), ByteTokenizer())
    assert tokens[0] == ByteTokenizer.bos_id and tokens[-1] == ByteTokenizer.eos_id
    assert (tokens == ByteTokenizer.bos_id).sum() == 2 and (
        tokens == ByteTokenizer.eos_id
    ).sum() == 2


def test_learning_rate_warms_up_then_decays():
    cfg = replace(PRESETS["tiny"], steps=100, warmup_steps=10, lr=1.0, min_lr_ratio=0.1)
    lrs = [learning_rate(s, cfg) for s in range(100)]
    assert lrs[0] < lrs[9] == 1.0
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    assert abs(lrs[-1] - 0.1) < 0.01


def test_a_few_steps_reduce_the_loss_and_are_reproducible(tmp_path):
    cfg = replace(PRESETS["tiny"], steps=30, eval_every=30)
    tokens = encode_plays(toy_plays(), ByteTokenizer())
    before = bits_per_byte(_fresh(cfg), SPEECHES, cfg.seq_len)
    model, history = train(cfg, tokens, SPEECHES, progress=False)
    after = bits_per_byte(model, SPEECHES, cfg.seq_len)
    assert after < before - 1.0, (before, after)
    again, _ = train(cfg, tokens, SPEECHES, progress=False)
    assert torch.equal(model.lm_head.weight, again.lm_head.weight)

    report = {
        "train_plays": 1,
        "train_bytes": 10,
        "train_sha256": "x",
        "validation_bytes": 5,
        "validation_sha256": "y",
        "train_seconds": 1.0,
        "machine": "test",
        "validation_bits_per_byte": after,
        "parameters": model.num_parameters(),
    }
    write_model_card(tmp_path, "tiny", cfg, model, report)
    assert "Validation bits per byte" in (tmp_path / "MODEL_CARD.md").read_text()
    assert (
        json.loads((tmp_path / "training.json").read_text())["parameters"] == model.num_parameters()
    )


def _fresh(cfg):
    from minivllm.model.transformer import Transformer, init_weights

    model = Transformer(cfg.model)
    init_weights(model, cfg.seed)
    return model.eval()


def test_bits_per_byte_of_a_uniform_model_is_log2_vocab():
    from minivllm.model.transformer import Transformer

    model = Transformer(PRESETS["tiny"].model)
    for p in model.parameters():
        torch.nn.init.zeros_(p)
    assert abs(bits_per_byte(model, SPEECHES, 32) - np.log2(model.config.vocab_size)) < 1e-4
