"""Weights on disk: the Hugging Face layout, and clear errors for files that do not match.

Exercise ch10.3 (`check_tensors`) is graded here: every family's checkpoint loads as saved, and a
checkpoint that does not match its config gets one error naming the tensor, before any memory is
allocated."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from minivllm.book.tiny_checkpoint import save_random_weights, shipped_config, shrink_config
from minivllm.model.checkpoint import CheckpointError, load_model, save_checkpoint
from minivllm.model.families import HFTransformer
from minivllm.model.transformer import ModelConfig, Transformer, init_weights

SMALL = ModelConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48, max_seq_len=32)


@pytest.fixture
def saved(tmp_path):
    model = Transformer(SMALL)
    init_weights(model, seed=0)
    save_checkpoint(model, tmp_path)
    return model, tmp_path


@pytest.mark.exercise("ch10.3")
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


@pytest.mark.exercise("ch10.3")
def test_missing_tensor_is_named(saved):
    _, folder = saved
    _rewrite(folder, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(
        CheckpointError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"
    ):
        load_model(folder)


@pytest.mark.exercise("ch10.3")
def test_unexpected_tensor_is_named(saved):
    _, folder = saved
    _rewrite(folder, lambda t: t.update({"model.layers.2.mlp.up_proj.weight": torch.zeros(1)}))
    with pytest.raises(
        CheckpointError, match=r"unexpected tensor 'model\.layers\.2\.mlp\.up_proj\.weight'"
    ):
        load_model(folder)


@pytest.mark.exercise("ch10.3")
def test_misshaped_tensor_is_named_with_both_shapes(saved):
    _, folder = saved
    _rewrite(folder, lambda t: t.update({"lm_head.weight": torch.zeros(10, 32)}))
    with pytest.raises(
        CheckpointError,
        match=r"'lm_head\.weight' has shape \(10, 32\), the config needs \(259, 32\)",
    ):
        load_model(folder)


@pytest.mark.exercise("ch10.3")
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


@pytest.mark.exercise("ch10.3")
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


# -- every family, checked tensor by tensor (exercise ch10.3) ------------------------------------

# family -> the shipped config it starts from, and what makes it that family
FAMILIES = {
    "llama3": ("Meta-Llama-3-8B", {}),
    "llama3.1": ("Llama-3.1-8B", {}),  # llama3 RoPE scaling
    "qwen2": ("Meta-Llama-3-8B", {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}),
    "qwen3": ("Qwen3-0.6B", {}),  # q/k norms, its own head size, tied embeddings
    "mistral": (
        "Meta-Llama-3-8B",
        {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": None},
    ),
}


def family_checkpoint(folder, family: str):
    """A checkpoint of `family` at toy sizes with seeded random weights, as Hugging Face lays it
    out (a tied LM head not saved)."""
    real, changes = FAMILIES[family]
    hf = {**shrink_config(shipped_config(real), 96, None, None), **changes}
    return save_random_weights(folder, hf, seed=0)


def refused(folder, monkeypatch) -> str:
    """The error `load_model(folder)` raises, checked to come before the model's memory."""

    def allocate(*args, **kwargs):
        raise AssertionError(
            "the model's memory was allocated before the checkpoint was checked: a broken "
            "tensor got past check_tensors"
        )

    monkeypatch.setattr(torch.nn.Module, "to_empty", allocate)
    with pytest.raises(CheckpointError) as error:
        load_model(folder)
    message = str(error.value)
    assert str(folder) in message, f"the error does not name the file: {message}"
    return message


@pytest.mark.exercise("ch10.3")
@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_loads_its_own_tensors(tmp_path, family):
    folder = family_checkpoint(tmp_path, family)
    saved = load_file(str(folder / "model.safetensors"))
    model = load_model(folder)
    params = dict(model.named_parameters())
    assert params.keys() == saved.keys(), f"{family}: {sorted(params.keys() ^ saved.keys())}"
    for name, param in params.items():
        assert torch.equal(param, saved[name]), f"{family}: {name} is not the checkpoint's"
    layer = model.model.layers[0].self_attn
    assert (layer.q_proj.bias is not None) == (family == "qwen2"), "q/k/v biases: Qwen2's only"
    assert hasattr(layer, "q_norm") == (family == "qwen3"), "q/k norms: Qwen3's only"
    assert isinstance(model, HFTransformer) == (family in ("llama3.1", "qwen3"))


@pytest.mark.exercise("ch10.3")
def test_a_tied_lm_head_is_the_embedding_even_when_saved_anyway(tmp_path):
    """Qwen3-0.6B ties its LM head: the checkpoint stores the embedding once; an export that also
    saves `lm_head.weight` loads the same (that copy is skipped, not 'unexpected')."""
    folder = family_checkpoint(tmp_path, "qwen3")
    embedding = load_file(str(folder / "model.safetensors"))["model.embed_tokens.weight"]
    _rewrite(folder, lambda t: t.update({"lm_head.weight": torch.zeros_like(embedding)}))
    model = load_model(folder)
    assert model.lm_head.weight is model.model.embed_tokens.weight, "the head is not tied"
    assert torch.equal(model.lm_head.weight, embedding), "the saved head was read, not skipped"


@pytest.mark.exercise("ch10.3")
def test_rope_tables_that_older_exports_saved_are_skipped(tmp_path):
    folder = family_checkpoint(tmp_path, "llama3")
    table = {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}
    _rewrite(folder, lambda t: t.update(table))
    assert isinstance(load_model(folder), torch.nn.Module)


@pytest.mark.exercise("ch10.3")
def test_an_untied_lm_head_that_is_missing_is_named(tmp_path, monkeypatch):
    folder = family_checkpoint(tmp_path, "llama3")
    _rewrite(folder, lambda t: t.pop("lm_head.weight"))
    message = refused(folder, monkeypatch)
    assert "missing tensor 'lm_head.weight'" in message, message


@pytest.mark.exercise("ch10.3")
def test_several_missing_tensors_name_the_first_and_count_the_rest(tmp_path, monkeypatch):
    folder = family_checkpoint(tmp_path, "qwen2")
    gone = [f"model.layers.{i}.self_attn.k_proj.bias" for i in (1, 0)] + ["model.norm.weight"]
    _rewrite(folder, lambda t: [t.pop(name) for name in gone])
    message = refused(folder, monkeypatch)
    first = "missing tensor 'model.layers.0.self_attn.k_proj.bias' (and 2 more)"
    assert first in message, f"expected {first!r} (the first name in sorted order): {message}"


@pytest.mark.exercise("ch10.3")
@pytest.mark.parametrize(
    ("family", "name", "shape"),
    [
        ("qwen3", "model.layers.1.self_attn.q_norm.weight", (16,)),  # its head size is 32
        ("qwen2", "model.layers.0.self_attn.v_proj.bias", (64,)),  # 1 KV head of 16
        ("llama3.1", "model.embed_tokens.weight", (95, 64)),
    ],
)
def test_a_family_tensor_of_the_wrong_shape_is_named_with_both_shapes(
    tmp_path, monkeypatch, family, name, shape
):
    folder = family_checkpoint(tmp_path, family)
    right = tuple(load_file(str(folder / "model.safetensors"))[name].shape)
    _rewrite(folder, lambda t: t.update({name: torch.zeros(shape)}))
    message = refused(folder, monkeypatch)
    wanted = f"tensor {name!r} has shape {shape}, the config needs {right}"
    assert wanted in message, f"expected {wanted!r} in: {message}"
