"""The `minivllm` command line: `generate` streams the continuation, `serve` answers over HTTP; both
exit 2 with a reason on bad input."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from minivllm.cli import build_parser, build_serving_engine, main
from minivllm.engine.llm_engine import LLMEngine
from minivllm.model.checkpoint import load_model
from minivllm.sched.sequence import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_generate_streams_the_engines_text(capsys) -> None:
    assert main(["generate", "ROMEO:\n", "--max-tokens", "12", "--temperature", "0"]) == 0
    out, err = capsys.readouterr()
    expected = LLMEngine(load_model("target")).generate(
        ["ROMEO:\n"], SamplingParams(max_tokens=12, temperature=0)
    )[0]
    assert out == "ROMEO:\n" + expected.text + "\n"
    assert f"finish_reason: {expected.finish_reason}" in err


def test_a_seed_makes_sampling_repeatable(capsys) -> None:
    args = ["generate", "JULIET:", "--max-tokens", "20", "--temperature", "0.9", "--seed", "7"]
    main(args)
    first = capsys.readouterr().out
    main(args)
    assert capsys.readouterr().out == first


@pytest.mark.parametrize(
    "args, message",
    [
        (["--max-tokens", "0"], "max_tokens"),
        (["--top-p", "1.5"], "top_p"),
        (["--model", "no-such-model"], "no-such-model"),
        (["--max-tokens", "600"], "context"),
    ],
)
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
    assert (
        main(["generate", "ROMEO:", "--speculative", "draft", "--num-speculative-tokens", "0"]) == 2
    )
    assert "num_speculative_tokens" in capsys.readouterr().err


# -- serve -----------------------------------------------------------------------------------------


def test_serve_arguments_build_the_engine_they_name() -> None:
    args = build_parser().parse_args(
        [
            "serve",
            "--port",
            "9001",
            "--max-num-seqs",
            "16",
            "--num-blocks",
            "256",
            "--speculative",
            "ngram",
            "--num-speculative-tokens",
            "3",
        ]
    )
    assert (args.command, args.model, args.host, args.port) == (
        "serve",
        "target",
        "127.0.0.1",
        9001,
    )
    engine = build_serving_engine(args)
    assert engine.config.num_blocks == 256 and engine.config.speculative.num_speculative_tokens == 3
    assert engine.config.scheduler.max_num_seqs == 16


def test_serve_refuses_a_bad_setting_before_listening(capsys) -> None:
    assert main(["serve", "--num-speculative-tokens", "0", "--speculative", "draft"]) == 2
    assert "num_speculative_tokens" in capsys.readouterr().err


def test_serve_answers_over_http_and_stops_on_ctrl_c() -> None:
    with socket.socket() as probe:  # a free port (the server binds it a moment later)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [
        sys.executable,
        "-m",
        "minivllm.cli",
        "serve",
        "--port",
        str(port),
        "--threads",
        "1",
        "--log-level",
        "warning",
    ]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        body = {"model": "target", "prompt": "ROMEO:\n", "max_tokens": 5, "temperature": 0}
        answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=30).json()
        assert (
            answer["choices"][0]["finish_reason"] == "length"
            and answer["usage"]["completion_tokens"] == 5
        )
    finally:
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=30)
    assert process.returncode == 0, err
