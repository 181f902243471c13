"""Weights on disk in the Hugging Face layout: a folder with `config.json` and `model.safetensors`.

Loading checks every tensor's name, shape and dtype before it touches the model, and says exactly
what is wrong -- a checkpoint that is missing `model.layers.3.mlp.up_proj.weight` should fail with
that name, not with a shape error three calls later.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from minivllm.model.transformer import ModelConfig, Transformer

WEIGHTS_DIR = Path(__file__).resolve().parent.parent / "weights"  # src/minivllm/weights


class CheckpointError(ValueError):
    """A weight folder that does not match the model it claims to hold."""


def hf_config(config: ModelConfig) -> dict:
    """Our config as a Hugging Face `LlamaConfig` dictionary."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "intermediate_size": config.d_ff,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_dim,
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "torch_dtype": "float32",
    }


def config_from_hf(hf: dict) -> ModelConfig:
    if "LlamaForCausalLM" not in hf.get("architectures", []):
        raise CheckpointError(
            f"config.json describes {hf.get('architectures')}, expected LlamaForCausalLM"
        )
    rope_theta = hf.get("rope_parameters", {}).get("rope_theta", hf.get("rope_theta", 10000.0))
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        d_model=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"],
        n_heads=hf["num_attention_heads"],
        n_kv_heads=hf.get("num_key_value_heads", hf["num_attention_heads"]),
        d_ff=hf["intermediate_size"],
        max_seq_len=hf["max_position_embeddings"],
        rope_theta=float(rope_theta),
        norm_eps=hf["rms_norm_eps"],
        bos_token_id=hf["bos_token_id"],
        eos_token_id=hf["eos_token_id"],
    )


def save_checkpoint(model: Transformer, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf_config(model.config), indent=2) + "\n")
    tensors = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def _check_tensors(expected: dict[str, torch.Tensor], path: Path) -> None:
    with safe_open(str(path), framework="pt") as f:
        found = set(f.keys())
        missing = sorted(set(expected) - found)
        unexpected = sorted(found - set(expected))
        if missing:
            raise CheckpointError(
                f"{path} is missing tensor {missing[0]!r}"
                + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                + ": the file does not match config.json; re-export or retrain the weights"
            )
        if unexpected:
            raise CheckpointError(
                f"{path} has unexpected tensor {unexpected[0]!r}: is config.json for a different "
                "model?"
            )
        for name, want in expected.items():
            got = f.get_slice(name)
            shape, dtype = tuple(got.get_shape()), got.get_dtype()
            if shape != tuple(want.shape):
                raise CheckpointError(
                    f"{path}: tensor {name!r} has shape {shape}, the config needs "
                    f"{tuple(want.shape)}"
                )
            if dtype not in ("F32", "F16", "BF16"):
                raise CheckpointError(
                    f"{path}: tensor {name!r} has dtype {dtype}, expected a floating-point dtype"
                )


def load_model(folder: str | Path = "target", dtype: torch.dtype = torch.float32) -> Transformer:
    """Load `folder` (a path, or the name of a shipped model: `"target"` or `"draft"`)."""
    folder = Path(folder)
    if not folder.is_absolute() and not folder.exists():
        folder = WEIGHTS_DIR / folder
    config_path, weights_path = folder / "config.json", folder / "model.safetensors"
    for path in (config_path, weights_path):
        if not path.exists():
            raise CheckpointError(
                f"{path} not found: a model folder holds config.json and model.safetensors"
            )
    config = config_from_hf(json.loads(config_path.read_text()))
    model = Transformer(config)
    _check_tensors(model.state_dict(), weights_path)
    with safe_open(str(weights_path), framework="pt") as f:
        state = {name: f.get_tensor(name).to(torch.float32) for name in f.keys()}
    model.load_state_dict(state, strict=True)
    return model.to(dtype).eval()
