"""benchmarks/real_model.py's checkpoint builder: a Qwen3 folder with the shapes asked for, a BPE
tokenizer trained here, built once and then reused, that the engine serves. (The benchmark's
--quick run is not a test: it measures loading memory in fresh interpreters, over a minute.)"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="transformers is a dev dependency")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from real_model import SHAPES, TOKENIZER_VOCAB, make_checkpoint, summarize  # noqa: E402

from minivllm import LLM, SamplingParams  # noqa: E402
from minivllm.model.hf_tokenizer import HFTokenizer  # noqa: E402


@pytest.mark.usefixtures("one_torch_thread")
def test_the_builder_makes_a_folder_the_engine_serves_once(tmp_path) -> None:
    folder = make_checkpoint(tmp_path, "tiny", "bfloat16")
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["dtype"] == "bfloat16"
    for key in ("hidden_size", "num_hidden_layers", "num_key_value_heads", "head_dim"):
        assert config[key] == SHAPES["tiny"][key]
    weights = folder / "model.safetensors"
    built = weights.stat().st_mtime_ns
    assert make_checkpoint(tmp_path, "tiny", "bfloat16") == folder
    assert weights.stat().st_mtime_ns == built  # found, not built again

    llm = LLM(str(folder), num_blocks=16, device="cpu")
    tokenizer = llm.engine.tokenizer
    assert isinstance(tokenizer, HFTokenizer) and tokenizer.vocab_size == TOKENIZER_VOCAB
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    out = llm.generate(["To be, or not to be"], params)[0]
    # the random model writes the tokenizer's tokens (the embedding rows past it are near zero),
    # so its text is text
    assert len(out.token_ids) == 12 and max(out.token_ids) < TOKENIZER_VOCAB
    assert out.text == tokenizer.decode(out.token_ids) and out.text.strip()


def test_a_runs_time_splits_where_the_last_request_got_its_first_token() -> None:
    """The summary's two phases: up to the last first token (every prompt's prefill), and the rest
    (decoding); each run's, and their medians. A request with no first token is left out."""
    run = {"system": "s", "tokens": 10, "load_before": "", "load_after": ""}
    runs = [
        {**run, "seconds": 5.0, "_ttft": [1.0, 2.0, None]},
        {**run, "seconds": 6.0, "_ttft": [3.0, 1.5]},
        {**run, "seconds": 7.0, "_ttft": [2.5]},
    ]
    summary = summarize(runs)
    assert [r["last_first_token_s"] for r in summary["runs"]] == [2.0, 3.0, 2.5]
    assert [r["after_last_first_token_s"] for r in summary["runs"]] == [3.0, 3.0, 4.5]
    assert summary["last_first_token_s_median"] == 2.5
    assert summary["after_last_first_token_s_median"] == 3.0
