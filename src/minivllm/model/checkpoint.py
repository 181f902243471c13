"""Weights on disk in the Hugging Face layout: a folder with `config.json` and `model.safetensors`.

Loading checks every tensor's name, shape and dtype before it touches the model, and says exactly
what is wrong -- a checkpoint that is missing `model.layers.3.mlp.up_proj.weight` should fail with
that name, not with a shape error three calls later.

The same loader reads a checkpoint as Hugging Face publishes one (`LLM(folder)`, `minivllm
generate --model folder`): `config.json` of a Llama, Mistral, Qwen2 or Qwen3 model
(`config_from_hf`; `model/families.py` says what each adds), its weights in one
`model.safetensors` or in shards listed by `model.safetensors.index.json`, stored in float32,
float16 or bfloat16, and run in the checkpoint's own dtype (`dtype="auto"`) or one asked for.
What the model cannot compute exactly -- another architecture, a RoPE type other than the default
and Llama 3's, a sliding window shorter than the context -- is refused with one error naming the
file, as is a missing, extra or misshapen tensor or a shard the index names that is not there;
all before the model's memory is allocated. The weights are then read one tensor at a time from
the files straight into the model's memory, so a checkpoint is never held twice.
`tokenizer_files` and `generation_config` say what else the folder holds (the tokenizer is built
elsewhere), and `sampling_defaults` the sampling settings its generation_config.json recommends.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from minivllm.model.families import model_class
from minivllm.model.parallel import Shard, Slice, build_shard, shard_slices, zero_padding
from minivllm.model.transformer import ModelConfig, RopeScaling, Transformer

WEIGHTS_DIR = Path(__file__).resolve().parent.parent / "weights"  # src/minivllm/weights


class CheckpointError(ValueError):
    """A weight folder that does not match the model it claims to hold."""


def hf_config(config: ModelConfig) -> dict:
    """Our config as a Hugging Face config dictionary (a `LlamaConfig` for the book's models)."""
    hf = {
        "architectures": [config.architecture],
        "model_type": ARCHITECTURES[config.architecture],
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
        "attention_bias": config.o_proj_bias,
        "mlp_bias": False,
        "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "torch_dtype": "float32",
    }
    if config.rope_scaling is not None:
        hf["rope_parameters"] = {"rope_theta": config.rope_theta, **asdict(config.rope_scaling)}
    if config.architecture == "MistralForCausalLM":
        hf["sliding_window"] = None
    if config.attention_bias != (config.architecture == "Qwen2ForCausalLM" or config.o_proj_bias):
        raise ValueError(f"{config.architecture} cannot say attention_bias={config.attention_bias}")
    return hf


ARCHITECTURES = {  # what minivllm runs -> Hugging Face's model_type
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# the dtypes a safetensors header names that the model can be loaded from
SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def config_from_hf(hf: dict, source: str | Path = "config.json") -> ModelConfig:
    """Our config from a Hugging Face `config.json` (`source` names it in errors). Refuses, with
    what is wrong, an architecture or a setting the model does not run: it never runs one wrong."""
    archs = hf.get("architectures") or []
    arch = next((a for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        raise CheckpointError(
            f"{source} describes {archs}, which minivllm does not run: expected "
            f"{', '.join(ARCHITECTURES)}"
        )
    _refuse_unsupported(hf, arch, source)
    try:
        d_model, n_heads = hf["hidden_size"], hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or d_model // n_heads
        rope_theta, scaling = _rope(hf, source)
        return ModelConfig(
            vocab_size=hf["vocab_size"],
            d_model=d_model,
            n_layers=hf["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=hf.get("num_key_value_heads") or n_heads,
            d_ff=hf["intermediate_size"],
            max_seq_len=hf["max_position_embeddings"],
            rope_theta=rope_theta,
            norm_eps=hf.get("rms_norm_eps", 1e-6),
            bos_token_id=_first(hf.get("bos_token_id")),
            eos_token_id=_first(hf.get("eos_token_id")),
            architecture=arch,
            explicit_head_dim=None if head_dim * n_heads == d_model else head_dim,
            attention_bias=arch == "Qwen2ForCausalLM" or bool(hf.get("attention_bias")),
            o_proj_bias=arch in ("LlamaForCausalLM", "Qwen3ForCausalLM")
            and bool(hf.get("attention_bias")),
            qk_norm=arch == "Qwen3ForCausalLM",
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            rope_scaling=scaling,
        )
    except KeyError as error:
        raise CheckpointError(f"{source} has no {error.args[0]!r}, which the model needs") from None
    except ValueError as error:  # ModelConfig's own checks (heads that do not divide, ...)
        raise CheckpointError(f"{source}: {error}") from None


def _refuse_unsupported(hf: dict, arch: str, source) -> None:
    """What a family may switch on that this model does not compute: refused, not ignored."""
    if hf.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{source}: hidden_act {hf['hidden_act']!r}, the MLP here is SiLU")
    if hf.get("mlp_bias"):
        raise CheckpointError(f"{source}: mlp_bias is true, the MLP here has no biases")
    window, context = hf.get("sliding_window"), hf.get("max_position_embeddings")
    sliding = (
        hf.get("use_sliding_window", arch == "MistralForCausalLM")
        and window is not None
        and (context is None or window < context)
    ) or "sliding_attention" in (hf.get("layer_types") or [])
    if sliding:
        raise CheckpointError(
            f"{source}: {arch} with sliding-window attention (sliding_window={window}, "
            f"max_position_embeddings={context}); minivllm attends to the whole context and "
            "would compute it wrong past the window: set sliding_window to null if it covers "
            "the context you serve"
        )


def _rope(hf: dict, source) -> tuple[float, RopeScaling | None]:
    """RoPE's theta and scaling, spelled either way: transformers 5's `rope_parameters`, or the
    older `rope_theta` and `rope_scaling`."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if any(isinstance(v, dict) for v in params.values()):
        raise CheckpointError(f"{source}: RoPE parameters per layer type are not supported")
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise CheckpointError(
            f"{source}: rope_type {rope_type!r} is not supported (only 'default' and 'llama3')"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise CheckpointError(f"{source}: partial_rotary_factor is not supported")
    try:
        scaling = RopeScaling(
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(
                params.get("original_max_position_embeddings", hf["max_position_embeddings"])
            ),
        )
    except KeyError as error:
        raise CheckpointError(f"{source}: llama3 RoPE scaling without {error.args[0]!r}") from None
    return theta, scaling


def _first(token_id: int | list[int] | None) -> int | None:
    """A special token id; of a list (Llama 3's several end tokens), the first."""
    if isinstance(token_id, list):
        return token_id[0] if token_id else None
    return token_id


def resolve_dtype(
    dtype: str | torch.dtype, hf: dict | None = None, source="config.json"
) -> torch.dtype:
    """`"auto"`: the checkpoint's own (config.json's `dtype`, or `torch_dtype` before
    transformers 5; float32 if it names none); else float32, bfloat16 or float16, by name or as
    a torch dtype."""
    if dtype == "auto":
        hf = hf or {}
        dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if dtype not in DTYPES:
        raise CheckpointError(
            f"dtype {dtype!r} (from {source} or the caller) is not one of 'auto', "
            f"{', '.join(repr(n) for n in DTYPES)}"
        )
    return DTYPES[dtype]


def save_checkpoint(model: Transformer, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf_config(model.config), indent=2) + "\n")
    tensors = {name: t.detach().contiguous() for name, t in model.named_parameters()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def model_folder(folder: str | Path) -> Path:
    """A path, or the name of a shipped model (`"target"`, `"draft"`)."""
    folder = Path(folder)
    if not folder.is_absolute() and not folder.exists():
        folder = WEIGHTS_DIR / folder
    return folder


def read_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.exists():
        raise CheckpointError(
            f"{path} not found: a model folder holds config.json and model.safetensors (or "
            "safetensors shards and model.safetensors.index.json)"
        )
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{path} is not valid JSON: {error}") from None


def generation_config(folder: str | Path) -> dict:
    """`generation_config.json` (the checkpoint's end tokens and sampling defaults), or {}."""
    path = model_folder(folder) / "generation_config.json"
    if not path.exists():
        return {}
    try:
        found = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(found, dict):
        raise CheckpointError(f"{path} must hold a JSON object, got {type(found).__name__}")
    return found


# generation_config.json's sampling settings, as vLLM applies them (`generation_config="auto"`):
# file key -> (SamplingParams' name, transformers' GenerationConfig default). vLLM reads the file's
# difference from GenerationConfig(), so a value equal to transformers' default sets nothing (a
# file saying top_k 50 leaves top_k off, as in vLLM).
GENERATION_SAMPLING_KEYS = {
    "temperature": ("temperature", 1.0),
    "top_k": ("top_k", 50),
    "top_p": ("top_p", 1.0),
    "min_p": ("min_p", None),
    "repetition_penalty": ("repetition_penalty", 1.0),
    "max_new_tokens": ("max_tokens", None),
}


def sampling_defaults(folder: str | Path) -> dict[str, int | float]:
    """The sampling settings a checkpoint recommends in its generation_config.json, by
    SamplingParams' names (max_new_tokens is max_tokens); {} for a folder without one (the
    shipped models). `do_sample` is not read, as vLLM does not: a request's temperature says it."""
    config, found = generation_config(folder), {}
    for key, (name, transformers_default) in GENERATION_SAMPLING_KEYS.items():
        value = config.get(key)
        if value is None or value == transformers_default:
            continue
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise CheckpointError(
                f"{model_folder(folder) / 'generation_config.json'}: {key} must be a number, "
                f"got {value!r}"
            )
        found[name] = value
    return found


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)


def tokenizer_files(folder: str | Path) -> dict[str, Path]:
    """The tokenizer files a model folder has, by name (none: the shipped byte-level models)."""
    folder = model_folder(folder)
    return {name: folder / name for name in TOKENIZER_FILES if (folder / name).exists()}


def weight_files(folder: Path) -> tuple[dict[str, Path], Path]:
    """Which file holds each tensor, and the file that says so: `model.safetensors`, or the
    shards that `model.safetensors.index.json` maps the names to (how larger models ship)."""
    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise CheckpointError(f"{index} is not a safetensors index (no weight_map)") from None
        for shard in sorted(set(weight_map.values())):
            if not (folder / shard).exists():
                raise CheckpointError(f"{index} names shard {shard!r}, which is not in {folder}")
        return {name: folder / shard for name, shard in weight_map.items()}, index
    if not single.exists():
        raise CheckpointError(
            f"{single} not found: a model folder holds config.json and model.safetensors (or "
            "safetensors shards and model.safetensors.index.json)"
        )
    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}, single


def ignored_tensor(name: str, config: ModelConfig) -> bool:
    """Tensors a checkpoint may hold that are not weights: RoPE tables older exports saved, and a
    tied LM head saved anyway (the embedding is the one used)."""
    return name.endswith("rotary_emb.inv_freq") or (
        config.tie_word_embeddings and name == "lm_head.weight"
    )


def check_tensors(
    expected: dict[str, tuple[int, ...]], files: dict[str, Path], listing: Path, config
) -> None:
    """Every name, shape and dtype against the model's, from the files' headers alone: nothing is
    read or allocated until the whole checkpoint is known to fit.

    `expected`: the model's parameter names and shapes (a tied LM head is not one of them: it is
    the embedding); `files`: which file holds each tensor of the checkpoint, as `listing` (the
    one file, or the shards' index) says (`weight_files`). The first problem found is raised as a
    `CheckpointError` naming the tensor -- in this order:

        {listing} is missing tensor 'name'  (then " (and 3 more)" if there are more)
        {listing} has unexpected tensor 'name'   (one `ignored_tensor` says to skip is not)
        {path} is missing tensor 'name', which {listing.name} puts there  (an index that lies)
        {path}: tensor 'name' has shape (a, b), the config needs (c, d)
        {path}: tensor 'name' has dtype I32, ...  (not one of SAFETENSORS_DTYPES)
    """
    # EXERCISE ch10.3: check names (missing, unexpected), then each file's shapes and dtypes
    ### BEGIN SOLUTION
    found = {name for name in files if not ignored_tensor(name, config)}
    missing, unexpected = sorted(set(expected) - found), sorted(found - set(expected))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(
            f"{listing} is missing tensor {missing[0]!r}{more}: the file does not match "
            "config.json; re-export or retrain the weights"
        )
    if unexpected:
        raise CheckpointError(
            f"{listing} has unexpected tensor {unexpected[0]!r}: is config.json another model's?"
        )
    for path, names in _by_file(files, expected).items():
        with safe_open(str(path), framework="pt") as f:  # reads the header, not the data
            present = set(f.keys())
            for name in names:
                if name not in present:
                    raise CheckpointError(
                        f"{path} is missing tensor {name!r}, which {listing.name} puts there"
                    )
                header, need = f.get_slice(name), expected[name]
                shape, dtype = tuple(header.get_shape()), header.get_dtype()
                if shape != need:
                    raise CheckpointError(
                        f"{path}: tensor {name!r} has shape {shape}, the config needs {need}"
                    )
                if dtype not in SAFETENSORS_DTYPES:
                    raise CheckpointError(
                        f"{path}: tensor {name!r} has dtype {dtype}, not a floating-point one"
                    )
    ### END SOLUTION


def _by_file(files: dict[str, Path], names) -> dict[Path, list[str]]:
    grouped: dict[Path, list[str]] = {}
    for name in names:
        grouped.setdefault(files[name], []).append(name)
    return grouped


def load_model(
    folder: str | Path = "target",
    dtype: str | torch.dtype = "auto",
    shard: Shard | None = None,
    weights: bool = True,
) -> Transformer:
    """Load `folder` (a path, or the name of a shipped model: `"target"` or `"draft"`) in `dtype`
    (`"auto"`: the checkpoint's own).

    Everything is checked first, from config.json and the safetensors headers. The model is then
    built with no memory behind it (torch's meta device), given uninitialised memory in `dtype`
    once, and filled tensor by tensor from the files (`_read_into`), each converted as it is
    copied: a checkpoint is never held twice.

    `shard`: only tensor-parallel rank `shard.rank`'s part (`model/parallel.py`), each split
    tensor's slice read from the file and nothing else. `weights=False`: the checked model on the
    meta device, no memory at all (a tensor-parallel engine's driver, whose ranks load their
    shards). Either way the model remembers where it came from (`checkpoint_folder`)."""
    folder = model_folder(folder)
    hf = read_config(folder)
    source = folder / "config.json"
    config = config_from_hf(hf, source)
    dtype = resolve_dtype(dtype, hf, source)
    files, listing = weight_files(folder)
    with torch.device("meta"):
        model = model_class(config, dtype)(config)
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()}
    check_tensors(expected, files, listing, config)
    if not weights:
        model = model.to(dtype)
    elif shard is None:
        model = model.to(dtype).to_empty(device="cpu")
        model.tie_weights()
    else:
        model = build_shard(config, dtype, shard)
    slices = shard_slices(config, shard) if shard is not None else {}
    params = dict(model.named_parameters())
    with torch.no_grad():
        for path, names in _by_file(files, expected).items() if weights else ():
            _read_into(path, {name: params[name] for name in names}, slices)
    model.checkpoint_folder = folder
    return model.eval()


CONVERT_CHUNK_BYTES = 16 << 20  # the buffer a tensor stored in another dtype passes through


def _read_into(
    path: Path, params: dict[str, torch.Tensor], slices: dict[str, Slice] | None = None
) -> None:
    """Each named tensor of the safetensors file `path`, read from the file straight into its
    parameter's memory; one stored in another dtype passes through a small buffer, a few rows at
    a time, and is converted as it is copied. A tensor in `slices` (a tensor-parallel rank's
    part) gets only its slice: rows are read from where they start; columns pass through the
    buffer a few whole rows at a time and only theirs are kept -- the whole tensor is never
    held.

    Plain reads, not the memory map that `safe_open` reads through: a mapped file's pages count in
    the process's resident memory for as long as the file is open, so a one-file checkpoint loaded
    through its map would peak at its model's size plus the file's -- twice the weights when the
    dtypes agree. Read this way, the weights' bytes are the only large allocation."""
    slices = slices or {}
    with open(path, "rb") as f:
        (header_size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_size))
        data_start = 8 + header_size
        for name, param in params.items():
            entry = header[name]  # check_tensors has seen every name, shape and dtype
            stored = SAFETENSORS_DTYPES[entry["dtype"]]
            offset = data_start + entry["data_offsets"][0]
            part = slices.get(name)
            if part is None:
                f.seek(offset)
                _read_rows(f, param.data, stored, path, name)
                continue
            shape = entry["shape"]
            row_values = math.prod(shape[1:])
            if part.dim == 0:
                f.seek(offset + part.start * row_values * stored.itemsize)
                _read_rows(f, param.data.narrow(0, 0, part.length), stored, path, name)
            else:  # columns of a matrix: whole rows through the buffer
                f.seek(offset)
                _read_rows(f, param.data, stored, path, name, (shape[1], part.start))
            zero_padding(param, part)


def _read_rows(
    f,
    target: torch.Tensor,
    stored: torch.dtype,
    path: Path,
    name: str,
    columns: tuple[int, int] | None = None,
) -> None:
    """The next rows of `f` (values of dtype `stored`) into `target`, converted as they are
    copied. `columns` = (width, first): the file's rows are `width` values long and `target`
    takes its columns from `first` on."""
    rows = target.reshape(-1, target.shape[-1]) if target.dim() > 1 else target[None]
    width, first = columns or (rows.shape[1], 0)
    if stored == target.dtype and columns is None:
        _read_exactly(f, target, path, name)
        return
    row_bytes = width * stored.itemsize
    step = max(1, CONVERT_CHUNK_BYTES // row_bytes)
    buffer = torch.empty((min(step, rows.shape[0]), width), dtype=stored)
    for start in range(0, rows.shape[0], step):
        chunk = buffer[: min(step, rows.shape[0] - start)]
        _read_exactly(f, chunk, path, name)
        rows[start : start + len(chunk)].copy_(chunk[:, first : first + rows.shape[1]])


def _read_exactly(f, tensor: torch.Tensor, path: Path, name: str) -> None:
    """The next bytes of `f` into the contiguous `tensor`'s memory, all of them or an error."""
    size = tensor.numel() * tensor.element_size()
    if f.readinto(memoryview(tensor.view(torch.uint8).reshape(-1).numpy())) != size:
        raise CheckpointError(f"{path} ends inside tensor {name!r}: the file is truncated")
