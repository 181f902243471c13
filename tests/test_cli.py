"""The `minivllm generate` command line: streams the continuation, exits 2 with a reason on bad input."""

from __future__ import annotations

import pytest

from minivllm.checkpoint import load_model
from minivllm.cli import main
from minivllm.engine import LLMEngine
from minivllm.sequence import SamplingParams


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_generate_streams_the_engines_text(capsys) -> None:
    assert main(["generate", "ROMEO:\n", "--max-tokens", "12", "--temperature", "0"]) == 0
    out, err = capsys.readouterr()
    expected = LLMEngine(load_model("target")).generate(["ROMEO:\n"], SamplingParams(max_tokens=12, temperature=0))[0]
    assert out == "ROMEO:\n" + expected.text + "\n"
    assert f"finish_reason: {expected.finish_reason}" in err


def test_a_seed_makes_sampling_repeatable(capsys) -> None:
    args = ["generate", "JULIET:", "--max-tokens", "20", "--temperature", "0.9", "--seed", "7"]
    main(args)
    first = capsys.readouterr().out
    main(args)
    assert capsys.readouterr().out == first


@pytest.mark.parametrize("args, message", [
    (["--max-tokens", "0"], "max_tokens"),
    (["--top-p", "1.5"], "top_p"),
    (["--model", "no-such-model"], "no-such-model"),
    (["--max-tokens", "600"], "context"),
])
def test_bad_arguments_exit_2_with_the_reason(capsys, args: list[str], message: str) -> None:
    assert main(["generate", "ROMEO:", *args]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_speculative_greedy_prints_the_plain_text(capsys, method: str) -> None:
    base = ["generate", "KING HENRY:\n", "--max-tokens", "30", "--temperature", "0"]
    main(base)
    plain = capsys.readouterr().out
    assert main([*base, "--speculative", method, "--num-speculative-tokens", "3"]) == 0
    assert capsys.readouterr().out == plain


def test_a_bad_speculative_setting_exits_2(capsys) -> None:
    assert main(["generate", "ROMEO:", "--speculative", "draft", "--num-speculative-tokens", "0"]) == 2
    assert "num_speculative_tokens" in capsys.readouterr().err
