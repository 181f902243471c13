"""Hugging Face checkpoints of every family the engine serves, built here, offline, with
`transformers` (random weights, config -> model -> save_pretrained): Llama 3 (llama3 RoPE scaling,
attention biases, sharded), Qwen2 (q/k/v biases, bfloat16 on disk), Qwen3 (q/k norms, its own head
size, tied embeddings, bfloat16), Mistral (float16). Our logits and greedy tokens against theirs,
on every attention backend, and one clear error for each kind of broken checkpoint."""

import json
import shutil

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is a dev dependency: pip install -e '.[dev]'"
)

from minivllm.engine.config import EngineConfig  # noqa: E402
from minivllm.engine.llm_engine import LLM, LLMEngine  # noqa: E402
from minivllm.model.checkpoint import (  # noqa: E402
    CheckpointError,
    config_from_hf,
    load_model,
    tokenizer_files,
)
from minivllm.model.families import HFTransformer, rope_inv_freq  # noqa: E402
from minivllm.model.fused import fuse_model  # noqa: E402
from minivllm.model.hf_tokenizer import HFTokenizer  # noqa: E402
from minivllm.runner.compiled import cpp_compiler  # noqa: E402
from minivllm.sched.sequence import SamplingParams  # noqa: E402

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,  # shorter than the prompts: the scaling matters
}
# family -> (its config's extra fields, dtype on disk, max_shard_size)
FAMILIES = {
    "llama": ({"attention_bias": True, "rope_parameters": LLAMA3_ROPE}, torch.float32, "8KB"),
    "qwen2": ({}, torch.bfloat16, None),
    "qwen3": ({"head_dim": 16, "tie_word_embeddings": True}, torch.bfloat16, None),
    "mistral": ({"sliding_window": None}, torch.float16, None),
}
CONFIGS = {
    "llama": "LlamaConfig",
    "qwen2": "Qwen2Config",
    "qwen3": "Qwen3Config",
    "mistral": "MistralConfig",
}
# A larger initializer_range than the default 0.02: logits spread over a few units, so greedy
# choices are rarely near-ties.
TINY = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    initializer_range=0.2,
    bos_token_id=None,
    eos_token_id=None,  # greedy runs to max_tokens on both sides
    pad_token_id=None,
)
PROMPTS = [
    [5, 17, 33],
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18],
    [90, 3, 44],
]
MAX_TOKENS = 8
FP32_TOLERANCE = 1e-4  # max |logit difference|, logits of a few units
HALF_TOLERANCE = 0.02  # bfloat16 / float16 compute: a fraction of the largest |logit|


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    torch.manual_seed(0)
    folders = {}
    for family, (extra, dtype, shard) in FAMILIES.items():
        config = getattr(transformers, CONFIGS[family])(**TINY, **extra)
        model = transformers.AutoModelForCausalLM.from_config(config).to(dtype)
        folder = tmp_path_factory.mktemp(family)
        model.save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
        folders[family] = folder
    return folders


@pytest.fixture(scope="module")
def hf_models(checkpoints) -> dict:
    """Each checkpoint in Hugging Face's own model, float32, and its greedy tokens per prompt."""
    found = {}
    for family, folder in checkpoints.items():
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        found[family] = hf, [hf_greedy(hf, prompt) for prompt in PROMPTS]
    return found


def hf_greedy(hf, prompt: list[int]) -> list[int]:
    out = hf.generate(
        torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


def assert_same_or_near_tie(hf, prompt, ours, theirs, tolerance) -> None:
    """Identical greedy tokens, or at the first difference Hugging Face's own top two logits
    within `tolerance` of each other (a near-tie either side may break its own way)."""
    if ours == theirs:
        return
    at = next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + theirs[:at]])).logits[0, -1].float()
    top = logits.topk(2).values
    assert top[0] - top[1] <= tolerance, f"token {at}: ours {ours}, Hugging Face's {theirs}"


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_hugging_face(checkpoints, hf_models, family) -> None:
    hf, _ = hf_models[family]
    ours = load_model(checkpoints[family], dtype=torch.float32)
    ids = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        diff = (ours(ids[0]) - hf(ids).logits[0]).abs().max().item()
    assert diff < FP32_TOLERANCE, f"{family}: max |logit difference| {diff:.1e}"
    dtype = FAMILIES[family][1]
    if dtype != torch.float32:  # in the checkpoint's own dtype ("auto") on both sides
        ours = load_model(checkpoints[family])
        assert next(ours.parameters()).dtype == dtype
        hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoints[family], dtype=dtype)
        with torch.no_grad():
            theirs = hf(ids).logits[0].float()
            diff = (ours(ids[0]).float() - theirs).abs().max().item()
        assert diff < HALF_TOLERANCE * theirs.abs().max().item(), f"{family} in {dtype}: {diff}"


@pytest.mark.parametrize("backend", ["torch", "numba"])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_match_generate(checkpoints, hf_models, family, backend) -> None:
    hf, expected = hf_models[family]
    engine = LLMEngine(
        load_model(checkpoints[family], dtype=torch.float32),
        EngineConfig(num_blocks=32, block_size=4, device="cpu", attention_backend=backend),
    )
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    for prompt, out, theirs in zip(PROMPTS, engine.generate(PROMPTS, params), expected):
        assert_same_or_near_tie(hf, prompt, out.token_ids, theirs, FP32_TOLERANCE)


@pytest.mark.skipif(cpp_compiler() is None, reason="no C++ compiler: inductor needs one")
@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_forward_matches_generate(checkpoints, hf_models, family) -> None:
    """Each family's forward under torch.compile (Qwen2's biases, Qwen3's q/k norms, the rope
    settings traced into the graph): Hugging Face's greedy tokens, or a near-tie."""
    hf, expected = hf_models[family]
    config = EngineConfig(num_blocks=32, block_size=4, compile_forward=True)
    engine = LLMEngine(load_model(checkpoints[family], dtype=torch.float32), config)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    for prompt, out, theirs in zip(PROMPTS, engine.generate(PROMPTS, params), expected):
        assert_same_or_near_tie(hf, prompt, out.token_ids, theirs, FP32_TOLERANCE)


def test_bfloat16_engine_matches_generate_in_bfloat16(checkpoints) -> None:
    """`LLM(folder)`: the checkpoint's bfloat16 for the model and the cache; "auto" picks the
    numba kernel there (which reads a bfloat16 cache), and both it and the reference give
    `generate`'s greedy tokens in bfloat16, or a near-tie. A float16 cache the kernel refuses."""
    from minivllm.attention.numba_cpu import NumbaPagedAttention
    from minivllm.attention.torch_backend import TorchPagedAttention

    folder = checkpoints["qwen3"]
    tokenizer = ids_tokenizer(TINY["vocab_size"])  # the random checkpoints ship none
    cache = dict(num_blocks=32, block_size=4, device="cpu")
    with pytest.raises(ValueError, match="backend 'numba' takes .*, not torch.float16"):
        LLM(str(folder), tokenizer, **cache, dtype="float16", attention_backend="numba")
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    for backend, runs_on in (("auto", NumbaPagedAttention), ("torch", TorchPagedAttention)):
        llm = LLM(str(folder), tokenizer, **cache, attention_backend=backend)
        assert llm.engine.config.dtype == torch.bfloat16
        assert llm.engine.runner.backend is runs_on
        for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, params)):
            with torch.no_grad():
                scale = hf(torch.tensor([prompt])).logits.float().abs().max().item()
            theirs = hf_greedy(hf, prompt)
            assert_same_or_near_tie(hf, prompt, out.token_ids, theirs, HALF_TOLERANCE * scale)


def test_a_packed_bfloat16_qwen3_takes_its_norms_and_rope_as_one_call(checkpoints, monkeypatch):
    """A bfloat16 Qwen3 whose weights the engine packed (its norms then run as compiled loops)
    takes its q and k norms and RoPE as one call a layer (`cpu_kernels.qk_norm_rope_bfloat16`),
    with the greedy tokens of the three calls it replaces."""
    from minivllm.model import cpu_kernels
    from minivllm.model import fused as fused_module

    if not fused_module.ONEDNN_BFLOAT16:
        pytest.skip("this CPU has no bfloat16 matmuls for oneDNN: nothing is packed in bfloat16")
    monkeypatch.setattr(fused_module, "PACK_BATCHED_MIN_BYTES", 0)  # the tiny weights pack too
    one_call, calls = cpu_kernels.qk_norm_rope_bfloat16, []

    def counted(*args):
        calls.append(args[0].shape[0])
        return one_call(*args)

    def three_calls(q, k, q_norm, k_norm, cos, sin):
        normed_q = cpu_kernels.hf_rms_norm_bfloat16(q, q_norm.weight, q_norm.eps)
        normed_k = cpu_kernels.hf_rms_norm_bfloat16(k, k_norm.weight, k_norm.eps)
        return cpu_kernels.rope_qk_bfloat16(normed_q, normed_k, cos, sin)

    tokenizer = ids_tokenizer(TINY["vocab_size"])
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    outputs = []
    for kernel in (counted, three_calls):
        monkeypatch.setattr(cpu_kernels, "qk_norm_rope_bfloat16", kernel)
        llm = LLM(str(checkpoints["qwen3"]), tokenizer, num_blocks=32, block_size=4, device="cpu")
        assert llm.engine.config.dtype == torch.bfloat16
        outputs.append([out.token_ids for out in llm.generate(PROMPTS, params)])
    layers = TINY["num_hidden_layers"]
    assert calls and len(calls) % layers == 0  # every layer of every step
    assert outputs[0] == outputs[1]


def ids_tokenizer(vocab_size: int) -> HFTokenizer:
    """A tokenizer with one made-up word per id, for tests that give token ids: a Hugging Face
    folder without a tokenizer is refused (`load_tokenizer`)."""
    from tokenizers import Tokenizer, models

    vocab = {f"t{i}": i for i in range(vocab_size)}
    return HFTokenizer(Tokenizer(models.WordLevel(vocab, unk_token="t0")))


def test_cuda_kernel_in_the_simulator(checkpoints, hf_models) -> None:
    """The decode kernel in numba's CUDA simulator (slow: one family, two prompts, 3 tokens), or
    natively on a GPU."""
    from minivllm.attention.cuda.simulator import KERNEL_DEVICE

    hf, expected = hf_models["qwen3"]
    engine = LLMEngine(
        load_model(checkpoints["qwen3"], dtype=torch.float32),
        EngineConfig(num_blocks=16, block_size=4, device=KERNEL_DEVICE, attention_backend="cuda"),
    )
    prompts = [PROMPTS[0], PROMPTS[2]]
    outs = engine.generate(prompts, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    for prompt, out, theirs in zip(prompts, outs, [expected[0], expected[2]]):
        assert_same_or_near_tie(hf, prompt, out.token_ids, theirs[:3], FP32_TOLERANCE)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (make gpu-check)")
@pytest.mark.parametrize("backend", ["torch", "cuda"])
@pytest.mark.parametrize("family", FAMILIES)
def test_families_on_the_gpu_with_cuda_graphs(checkpoints, hf_models, family, backend) -> None:
    """Every family on the GPU, decode steps replayed from CUDA graphs (RoPE scaling, biases, q/k
    norms and tied embeddings all captured), greedy against Hugging Face's."""
    hf, expected = hf_models[family]
    engine = LLMEngine(
        load_model(checkpoints[family], dtype=torch.float32),
        EngineConfig(num_blocks=32, block_size=4, device="cuda", attention_backend=backend),
    )
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    for prompt, out, theirs in zip(PROMPTS, engine.generate(PROMPTS, params), expected):
        assert_same_or_near_tie(hf, prompt, out.token_ids, theirs, FP32_TOLERANCE)
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.capture_error is None and graphs.replays > 0


# -- what the loader reads -------------------------------------------------------------------------


@pytest.mark.exercise("ch10.3")
def test_layouts_and_families_are_read_as_saved(checkpoints, hf_models) -> None:
    llama = checkpoints["llama"]
    shards = sorted(p.name for p in llama.glob("model-*.safetensors"))
    assert len(shards) > 1 and (llama / "model.safetensors.index.json").exists()
    ours = load_model(llama)
    hf_state = hf_models["llama"][0].state_dict()
    assert all(torch.equal(p, hf_state[name]) for name, p in ours.named_parameters())
    assert ours.config.rope_scaling.factor == 4.0 and ours.config.o_proj_bias
    assert isinstance(ours, HFTransformer)  # RoPE scaling: the book's forward does not do it
    qwen3 = load_model(checkpoints["qwen3"], dtype="float32")
    assert qwen3.config.head_dim == 16 != qwen3.config.d_model // qwen3.config.n_heads
    assert qwen3.lm_head.weight is qwen3.model.embed_tokens.weight  # tied: one tensor
    fused = fuse_model(qwen3)
    assert fused.lm_head.weight is fused.model.embed_tokens.weight
    qwen2 = fuse_model(load_model(checkpoints["qwen2"], dtype=torch.float32))
    assert qwen2.model.layers[0].self_attn.qkv_bias.shape == (32 + 2 * 16,)
    assert tokenizer_files(llama) == {}  # random checkpoints: no tokenizer


def test_dtype_auto_is_the_checkpoints_own(checkpoints) -> None:
    dtypes = {family: next(load_model(f).parameters()).dtype for family, f in checkpoints.items()}
    assert dtypes == {family: dtype for family, (_, dtype, _) in FAMILIES.items()}
    with pytest.raises(CheckpointError, match="dtype 'int8'.* not one of 'auto', 'float32'"):
        load_model(checkpoints["qwen2"], dtype="int8")


def test_rope_frequencies_are_computed_once_per_device(checkpoints, monkeypatch) -> None:
    """Not in every forward: a host-to-GPU copy each step would make the host wait for the GPU,
    and cannot be captured in a CUDA graph."""
    import minivllm.model.families as families

    model = load_model(checkpoints["llama"])
    calls = []
    original = families.rope_inv_freq
    monkeypatch.setattr(
        families, "rope_inv_freq", lambda *args: calls.append(args) or original(*args)
    )
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        first, second = model(ids), model(ids)
    assert len(calls) == 1 and torch.equal(first, second)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_rope_cos_sin_is_read_from_the_models_table_in_its_dtype(checkpoints, family) -> None:
    """On the CPU an `HFTransformer` reads its scaled cos and sin from a table of its own, one per
    dtype, with `rope_cos_sin_scaled`'s values bit for bit; the model still pickles (a forward
    worker's copy), table and all."""
    import pickle

    from minivllm.model.families import rope_cos_sin_scaled

    model = load_model(checkpoints[family])
    dtype = next(model.parameters()).dtype
    positions = torch.tensor([[0, 7, 300], [2, 1, 999]])
    frequencies = model.inv_freq(positions.device)
    for read, direct in zip(
        model.rope_cos_sin(positions, dtype), rope_cos_sin_scaled(positions, frequencies, dtype)
    ):
        assert read.dtype == dtype and torch.equal(read, direct)
    assert list(model._rope_tables) == [dtype]
    copy = pickle.loads(pickle.dumps(model))
    assert torch.equal(
        copy.rope_cos_sin(positions, dtype)[1], model.rope_cos_sin(positions, dtype)[1]
    )


def test_a_tokenizer_naming_no_eos_leaves_the_models_own() -> None:
    from types import SimpleNamespace

    from minivllm.engine.llm_engine import eos_token_ids
    from minivllm.model.transformer import ModelConfig

    config = ModelConfig(vocab_size=300, eos_token_id=257)
    assert eos_token_ids(config, SimpleNamespace(eos_ids=())) == (257,)
    assert eos_token_ids(config, SimpleNamespace(eos_ids=(5, 9))) == (5, 9)
    assert eos_token_ids(config, None) == (257,)


def test_both_spellings_of_rope_settings_are_read() -> None:
    new = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 96,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 64,
        "eos_token_id": [7, 8],  # Llama 3's several end tokens: the first
        "rope_parameters": LLAMA3_ROPE,
    }
    old = {k: v for k, v in new.items() if k != "rope_parameters"}
    old["rope_theta"] = LLAMA3_ROPE["rope_theta"]
    old["rope_scaling"] = {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}
    older = {**old, "rope_scaling": {**old["rope_scaling"], "type": "llama3"}}
    del older["rope_scaling"]["rope_type"]
    configs = [config_from_hf(c) for c in (new, old, older)]
    assert configs[0] == configs[1] == configs[2] and configs[0].eos_token_id == 7
    assert configs[0].rope_scaling.original_max_position_embeddings == 16


@pytest.mark.exercise("ch10.2")
def test_llama3_frequencies_are_transformers_own() -> None:
    """Llama 3.1 8B's RoPE settings: the same inverse frequencies, bit for bit."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {**LLAMA3_ROPE, "rope_theta": 500000.0, "factor": 8.0}
    rope["original_max_position_embeddings"] = 8192
    hf = transformers.LlamaConfig(
        hidden_size=4096,
        num_attention_heads=32,
        max_position_embeddings=131072,
        rope_parameters=rope,
    )
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](hf)
    config = config_from_hf({**hf.to_dict(), "architectures": ["LlamaForCausalLM"]})
    ours = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
    assert torch.equal(ours, theirs)


# -- one clear error per broken checkpoint, before anything large is allocated --------------------


def _index(folder):
    return json.loads((folder / "model.safetensors.index.json").read_text())


def _write_index(folder, index):
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def drop_from_index(folder):
    index = _index(folder)
    del index["weight_map"]["model.layers.1.mlp.up_proj.weight"]
    _write_index(folder, index)


def add_to_index(folder):
    index = _index(folder)
    index["weight_map"]["model.layers.2.mlp.up_proj.weight"] = "model-00001-of-00012.safetensors"
    _write_index(folder, index)


def misplace_in_index(folder):
    index = _index(folder)
    index["weight_map"]["model.norm.weight"] = "model-00001-of-00012.safetensors"
    _write_index(folder, index)


def delete_shard(folder):
    (folder / "model-00003-of-00012.safetensors").unlink()


def reshape_tensor(folder):
    from safetensors.torch import load_file, save_file

    path = folder / _index(folder)["weight_map"]["model.layers.0.self_attn.o_proj.bias"]
    tensors = load_file(str(path))
    tensors["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(31)
    save_file(tensors, str(path))


def edit_config(**changes):
    def edit(folder):
        config = json.loads((folder / "config.json").read_text())
        config.update(changes)
        (folder / "config.json").write_text(json.dumps(config))

    return edit


BROKEN = {
    "missing tensor": (
        drop_from_index,
        r"index\.json is missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'",
    ),
    "extra tensor": (
        add_to_index,
        r"index\.json has unexpected tensor 'model\.layers\.2\.mlp\.up_proj\.weight'",
    ),
    "tensor not in its shard": (
        misplace_in_index,
        r"model-00001-of-00012\.safetensors is missing tensor 'model\.norm\.weight', which "
        r"model\.safetensors\.index\.json puts there",
    ),
    "misshapen tensor": (
        reshape_tensor,
        r"\.safetensors: tensor 'model\.layers\.0\.self_attn\.o_proj\.bias' has shape \(31,\), "
        r"the config needs \(32,\)",
    ),
    "missing shard": (
        delete_shard,
        r"index\.json names shard 'model-00003-of-00012\.safetensors', which is not in",
    ),
    "architecture": (
        edit_config(architectures=["GPT2LMHeadModel"]),
        r"config\.json describes \['GPT2LMHeadModel'\], which minivllm does not run",
    ),
    "rope type": (
        edit_config(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}),
        r"config\.json: rope_type 'yarn' is not supported",
    ),
    "sliding window": (
        edit_config(architectures=["MistralForCausalLM"], sliding_window=16),
        r"config\.json: MistralForCausalLM with sliding-window attention \(sliding_window=16",
    ),
}


# The cases `check_tensors` finds (exercise ch10.3); the others are config.json's or the index's.
TENSOR_CASES = ("missing tensor", "extra tensor", "tensor not in its shard", "misshapen tensor")


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(case, marks=[pytest.mark.exercise("ch10.3")] if case in TENSOR_CASES else [])
        for case in BROKEN
    ],
)
def test_a_broken_checkpoint_gets_one_clear_error(checkpoints, tmp_path, monkeypatch, case):
    folder = tmp_path / "broken"
    shutil.copytree(checkpoints["llama"], folder)
    break_it, message = BROKEN[case]
    break_it(folder)

    def allocate(*args, **kwargs):
        raise AssertionError("the model's memory was allocated before the checkpoint was checked")

    monkeypatch.setattr(torch.nn.Module, "to_empty", allocate)
    with pytest.raises(CheckpointError, match=message) as error:
        load_model(folder)
    assert str(folder) in str(error.value)
