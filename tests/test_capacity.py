"""How big the engine's K/V cache is and how long a sequence may be (engine/config.py's
`resolve_capacity`), the checkpoint's sampling defaults (generation_config.json, vLLM's
`generation_config="auto"`), and a tokenizer naming several EOS ids -- through `LLM`, the command
line and the server, on the shipped target model (512-token context, 3 KiB of K/V per token)."""

from __future__ import annotations

import argparse
import json

import httpx
import pytest

from minivllm.cli import main, parse_size
from minivllm.engine import llm_engine
from minivllm.engine.config import (
    DEFAULT_KV_CACHE_MEMORY,
    DEFAULT_NUM_BLOCKS,
    EngineConfig,
    resolve_capacity,
)
from minivllm.engine.llm_engine import LLM, LLMEngine
from minivllm.kv.sizing import kv_bytes_per_token
from minivllm.model.checkpoint import WEIGHTS_DIR, CheckpointError, sampling_defaults
from minivllm.model.tokenizer import ByteTokenizer
from minivllm.model.transformer import ModelConfig
from minivllm.sched.sequence import STOP, SamplingParams
from minivllm.serving.facade import InferenceEngine
from minivllm.serving.server import ServerThread

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONTEXT = 512  # the target's max_position_embeddings


def per_token(config: ModelConfig, dtype: str = "float32") -> int:
    return kv_bytes_per_token(config.n_layers, config.n_kv_heads, config.head_dim, dtype)


def engine(target, **config) -> LLMEngine:
    return LLMEngine(target, EngineConfig(device="cpu", **config))


# -- max_model_len ---------------------------------------------------------------------------------


def test_max_model_len_is_the_models_unless_asked(target, monkeypatch) -> None:
    plain = engine(target)
    assert target.config.max_seq_len == CONTEXT
    assert (plain.config.max_model_len, plain.config.num_blocks) == (CONTEXT, DEFAULT_NUM_BLOCKS)
    # every reader of the context reads the engine's: the door, the basic layout's reservation,
    # the CUDA graphs' tables (built here as on a GPU, without capturing)
    monkeypatch.setattr(llm_engine, "uses_cuda_graphs", lambda config, device: True)
    short = engine(target, max_model_len=100, kv_layout="contiguous")
    assert short.config.max_model_len == short.inputs.limits.max_model_len == 100
    assert short.manager.reserved_blocks == 7 and short.runner.graphs.max_blocks == 7  # 100 / 16
    with pytest.raises(ValueError, match="exceeds the model's context of 100 tokens"):
        short.add_request("ROMEO:\n", SamplingParams(max_tokens=95))
    with pytest.raises(ValueError, match="longer than the model's context of 512 tokens"):
        engine(target, max_model_len=CONTEXT + 1)


def test_a_memory_budget_buys_whole_blocks_and_caps_the_context(target) -> None:
    block_bytes = 16 * per_token(target.config)
    budgeted = engine(target, kv_cache_memory_bytes=10 * block_bytes + block_bytes - 1)
    assert (budgeted.config.num_blocks, budgeted.config.max_model_len) == (10, 160)
    assert budgeted.cache.num_bytes == 10 * block_bytes
    assert budgeted.describe_capacity() == (
        f"KV cache: {budgeted.cache.describe()} in float32; max_model_len 160"
    )
    with pytest.raises(ValueError, match="context of 160 tokens"):
        budgeted.add_request("ROMEO:\n", SamplingParams(max_tokens=200))
    # a length the cache cannot hold for one sequence is refused, saying what to raise
    with pytest.raises(ValueError, match=r"needs 32 blocks .* raise kv_cache_memory_bytes"):
        engine(target, kv_cache_memory_bytes=10 * block_bytes, max_model_len=CONTEXT)
    # num_blocks given: the book's experiments with a small cache keep the model's context (a
    # sequence that outgrows the cache ends "cache_full", chapter 05), and it wins over a budget
    tight = engine(target, num_blocks=8, kv_cache_memory_bytes=10 * block_bytes)
    assert (tight.config.num_blocks, tight.config.max_model_len) == (8, CONTEXT)
    # the engine's config is the resolved one: it builds the same engine again
    again = LLMEngine(target, budgeted.config)
    assert (again.config, again.cache) == (budgeted.config, budgeted.cache)


def test_a_draft_models_kv_counts_in_the_budget(target) -> None:
    llm = LLM(target, kv_cache_memory_bytes=2**20, speculative={"method": "draft"}, device="cpu")
    draft = llm.engine.drafter.model.config
    assert llm.engine.cache.bytes_per_token == per_token(target.config) + per_token(draft)
    assert (
        llm.engine.cache.num_bytes
        <= 2**20
        < llm.engine.cache.num_bytes + 16 * (llm.engine.cache.bytes_per_token)
    )


def test_the_default_cache_of_a_real_model_stops_at_the_default_budget(target) -> None:
    # Qwen3-0.6B's shape in bfloat16: 2048 blocks would be 3.5 GiB
    qwen3 = ModelConfig(
        d_model=1024,
        n_layers=28,
        n_heads=16,
        n_kv_heads=8,
        explicit_head_dim=128,
        max_seq_len=40960,
    )
    qwen3_bytes = per_token(qwen3, "bfloat16")
    cache, max_model_len = resolve_capacity(EngineConfig(), qwen3, qwen3_bytes)
    assert DEFAULT_NUM_BLOCKS * 16 * qwen3_bytes > DEFAULT_KV_CACHE_MEMORY
    assert cache.num_blocks == DEFAULT_KV_CACHE_MEMORY // (16 * qwen3_bytes) == 585
    assert max_model_len == cache.num_tokens == 9360  # the context, cut to what the cache holds
    # the shipped model's default is unchanged: 2048 blocks, its whole context
    cache, max_model_len = resolve_capacity(EngineConfig(), target.config, per_token(target.config))
    assert (cache.num_blocks, max_model_len) == (DEFAULT_NUM_BLOCKS, CONTEXT)


# -- the command line ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, size",
    [("4GiB", 4 * 2**30), ("512MiB", 512 * 2**20), ("1.5 kb", 1500), ("1073741824", 2**30)],
)
def test_sizes_on_the_command_line(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["4 parsecs", "GiB", "-1GiB", "0.1B", ""])
def test_a_bad_size_is_refused_naming_it(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="size|less than one byte"):
        parse_size(text)


def test_generate_prints_the_cache_line_and_takes_the_limits(target, capsys) -> None:
    args = ["generate", "ROMEO:\n", "--max-tokens", "4", "--temperature", "0"]
    assert main([*args, "--kv-cache-memory", "1MiB", "--max-model-len", "64"]) == 0
    expected = engine(target, kv_cache_memory_bytes=2**20, max_model_len=64).describe_capacity()
    assert expected.startswith("KV cache: 21 blocks of 16") and expected in capsys.readouterr().err
    assert main([*args, "--max-model-len", "600"]) == 2
    assert "longer than the model's context of 512" in capsys.readouterr().err
    assert main(["serve", "--num-blocks", "64", "--kv-cache-memory", "1MiB"]) == 2
    assert "not both" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_status:
        main([*args, "--kv-cache-memory", "lots"])
    assert exit_status.value.code == 2
    assert "--kv-cache-memory" in capsys.readouterr().err


# -- the checkpoint's sampling defaults ------------------------------------------------------------

RECOMMENDED = {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "repetition_penalty": 1.1}


def checkpoint(tmp_path_factory, generation: dict):
    """The target's weights in a folder of their own, with a generation_config.json."""
    folder = tmp_path_factory.mktemp("checkpoint")
    for name in ("config.json", "model.safetensors"):
        (folder / name).symlink_to(WEIGHTS_DIR / "target" / name)
    (folder / "generation_config.json").write_text(json.dumps(generation))
    return folder


@pytest.fixture(scope="module")
def recommending(tmp_path_factory):
    generation = {**RECOMMENDED, "max_new_tokens": 9, "do_sample": True, "eos_token_id": 257}
    return checkpoint(tmp_path_factory, generation)


def test_generation_config_sets_the_defaults_of_a_request(recommending, tmp_path) -> None:
    assert sampling_defaults(recommending) == {**RECOMMENDED, "max_tokens": 9}
    # transformers' own defaults are no settings (vLLM reads the file's difference from them)
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_k": 50, "top_p": 1.0}))
    assert sampling_defaults(tmp_path) == {} == sampling_defaults("target")
    llm = LLM(str(recommending), device="cpu")
    recommended = SamplingParams(max_tokens=9, **RECOMMENDED)
    assert llm.get_default_sampling_params() == recommended
    assert isinstance(llm.get_tokenizer(), ByteTokenizer)
    twin = LLM(str(recommending), device="cpu")  # same seed, same request id: the same draw
    [by_default] = llm.generate("ROMEO:\n")
    [explicit] = twin.generate("ROMEO:\n", recommended)
    assert by_default.token_ids == explicit.token_ids and len(explicit.token_ids) == 9
    with InferenceEngine(str(recommending), device="cpu") as facade:  # astrai's surface too
        assert facade.generate("ROMEO:\n") == by_default.text
    # given params win; "vllm" ignores the file
    greedy = SamplingParams(max_tokens=6, temperature=0)
    plain = LLM("target", device="cpu")
    assert plain.get_default_sampling_params() == SamplingParams()
    [ours] = llm.generate("ROMEO:\n", greedy)
    assert ours.token_ids == plain.generate("ROMEO:\n", greedy)[0].token_ids
    assert LLM(str(recommending), generation_config="vllm").get_default_sampling_params() == (
        SamplingParams()
    )


@pytest.mark.parametrize(
    "generation, message",
    [({"temperature": "hot"}, "temperature must be a number"), ({"top_p": 0}, "top_p")],
)
def test_a_bad_generation_config_names_the_file(tmp_path, generation, message) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    with pytest.raises(CheckpointError, match=f"generation_config.json.*{message}"):
        llm_engine.default_sampling_params(tmp_path)


def test_the_command_line_takes_the_checkpoints_settings_unless_given(
    tmp_path_factory, capsys
) -> None:
    greedy_folder = str(checkpoint(tmp_path_factory, {"temperature": 0.0}))
    outputs = []
    for model, flags in (
        (greedy_folder, []),
        ("target", ["--temperature", "0"]),
        (greedy_folder, ["--temperature", "0.9", "--seed", "7"]),
        ("target", ["--temperature", "0.9", "--seed", "7"]),
    ):
        assert main(["generate", "ROMEO:\n", "--model", model, "--max-tokens", "12", *flags]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] and outputs[2] == outputs[3] and outputs[0] != outputs[2]


def test_the_server_fills_what_a_request_leaves_out_and_serves_max_model_len(target) -> None:
    served = LLMEngine(
        target, EngineConfig(max_model_len=100), default_params=SamplingParams(top_k=1)
    )
    with ServerThread(served) as server:
        models = httpx.get(server.url + "/v1/models").json()
        assert models["data"][0]["max_model_len"] == 100
        texts = []
        for extra in ({}, {"top_k": 0}):
            body = {"prompt": "ROMEO:\n", "max_tokens": 8, "seed": 3, **extra}
            answer = httpx.post(server.url + "/v1/completions", json=body, timeout=30).json()
            texts.append(answer["choices"][0]["text"])
    reference = LLMEngine(target)
    for text, top_k in zip(texts, (1, 0)):
        params = SamplingParams(max_tokens=8, seed=3, top_k=top_k)
        assert text == reference.generate(["ROMEO:\n"], params)[0].text
    assert texts[0] != texts[1]


# -- several EOS ids -------------------------------------------------------------------------------


class EndsAlso(ByteTokenizer):
    """The byte tokenizer, with one more end-of-sequence token beside its own."""

    def __init__(self, eos_ids: tuple[int, ...]) -> None:
        self.eos_ids = eos_ids


@pytest.mark.parametrize("first", [True, False])
def test_any_of_several_eos_ids_ends_a_request(target, first: bool) -> None:
    space, end = ord(" "), ByteTokenizer.eos_id
    greedy = SamplingParams(max_tokens=12, temperature=0)
    [plain] = engine(target).generate(["ROMEO:\n"], greedy)
    assert space in plain.token_ids[:-1], "the test needs a greedy answer with a space inside"
    ids = (space, end) if first else (end, space)
    ended = LLMEngine(target, EngineConfig(device="cpu"), EndsAlso(ids))
    assert ended.eos_token_ids == ids
    [out] = ended.generate(["ROMEO:\n"], greedy)
    cut = plain.token_ids.index(space) + 1
    assert out.finish_reason == STOP and out.token_ids == plain.token_ids[:cut]
