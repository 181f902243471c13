"""Weights on disk: the Hugging Face layout, and clear errors for files that do not match."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from minivllm.model.checkpoint import CheckpointError, load_model, save_checkpoint
from minivllm.model.transformer import ModelConfig, Transformer, init_weights

SMALL = ModelConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48, max_seq_len=32)


@pytest.fixture
def saved(tmp_path):
    model = Transformer(SMALL)
    init_weights(model, seed=0)
    save_checkpoint(model, tmp_path)
    return model, tmp_path


def test_round_trip_is_exact(saved):
    model, folder = saved
    loaded = load_model(folder)
    assert loaded.config == SMALL
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_files_use_hugging_face_names_and_config(saved):
    _, folder = saved
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_key_value_heads"] == 2 and config["hidden_size"] == 32
    names = set(load_file(str(folder / "model.safetensors")))
    assert {
        "model.embed_tokens.weight",
        "model.layers.1.self_attn.q_proj.weight",
        "model.layers.0.mlp.gate_proj.weight",
        "model.norm.weight",
        "lm_head.weight",
    } <= names


def _rewrite(folder, change):
    tensors = load_file(str(folder / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(folder / "model.safetensors"))


def test_weights_stored_in_another_dtype_are_converted_a_few_rows_at_a_time(saved, monkeypatch):
    """bfloat16 on disk, float32 asked for: each tensor passes through a buffer of a few rows
    (here 64 bytes: several reads per tensor), and comes out as the whole tensor converted."""
    from minivllm.model import checkpoint

    model, folder = saved
    _rewrite(folder, lambda t: t.update({k: v.to(torch.bfloat16) for k, v in t.items()}))
    monkeypatch.setattr(checkpoint, "CONVERT_CHUNK_BYTES", 64)
    loaded = load_model(folder, dtype="float32").state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded[name], tensor.to(torch.bfloat16).float()), name


def test_missing_tensor_is_named(saved):
    _, folder = saved
    _rewrite(folder, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(
        CheckpointError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"
    ):
        load_model(folder)


def test_unexpected_tensor_is_named(saved):
    _, folder = saved
    _rewrite(folder, lambda t: t.update({"model.layers.2.mlp.up_proj.weight": torch.zeros(1)}))
    with pytest.raises(
        CheckpointError, match=r"unexpected tensor 'model\.layers\.2\.mlp\.up_proj\.weight'"
    ):
        load_model(folder)


def test_misshaped_tensor_is_named_with_both_shapes(saved):
    _, folder = saved
    _rewrite(folder, lambda t: t.update({"lm_head.weight": torch.zeros(10, 32)}))
    with pytest.raises(
        CheckpointError,
        match=r"'lm_head\.weight' has shape \(10, 32\), the config needs \(259, 32\)",
    ):
        load_model(folder)


def test_integer_tensor_is_rejected(saved):
    _, folder = saved
    _rewrite(folder, lambda t: t.update({"model.norm.weight": torch.ones(32, dtype=torch.int32)}))
    with pytest.raises(CheckpointError, match=r"'model\.norm\.weight' has dtype I32"):
        load_model(folder)


def test_missing_files_and_wrong_architecture(tmp_path, saved):
    with pytest.raises(CheckpointError, match="config.json not found"):
        load_model(tmp_path / "nowhere")
    _, folder = saved
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="expected LlamaForCausalLM"):
        load_model(folder)


@pytest.mark.parametrize("name", ["target", "draft"])
def test_shipped_models_load_and_have_their_model_card(name):
    model = load_model(name)
    folder = model_folder(name)
    card = json.loads((folder / "training.json").read_text())
    assert card["parameters"] == model.num_parameters()
    assert (folder / "MODEL_CARD.md").exists()


def model_folder(name):
    from minivllm.model.checkpoint import WEIGHTS_DIR

    return WEIGHTS_DIR / name


def test_the_book_config_prints_as_before_and_its_transformer_refuses_family_features():
    """Chapter 00 prints the config: the family fields show only where they are set."""
    config = load_model("target").config
    assert repr(config) == (
        "ModelConfig(vocab_size=259, d_model=256, n_layers=6, n_heads=8, n_kv_heads=2, "
        "d_ff=512, max_seq_len=512, rope_theta=10000.0, norm_eps=1e-05, bos_token_id=256, "
        "eos_token_id=257)"
    )
    qwen3 = ModelConfig(d_model=32, n_heads=4, n_kv_heads=2, explicit_head_dim=16, qk_norm=True)
    assert "explicit_head_dim=16, qk_norm=True)" in repr(qwen3)
    with pytest.raises(ValueError, match="HFTransformer"):
        Transformer(qwen3)
