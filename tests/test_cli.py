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
from minivllm.runner.compiled import cpp_compiler
from minivllm.sched.sequence import SamplingParams

COMPILES = cpp_compiler() is not None  # --compile needs one (a machine without: refused)

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
            "--enforce-eager",
            *(["--compile"] if COMPILES else []),
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
    assert engine.config.scheduler.max_num_seqs == 16 and engine.config.enforce_eager
    if COMPILES:
        assert engine.config.compile_forward and engine.runner.compiled is not None


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


# A test-only fault, injected from outside the package: the subprocess replaces LLMEngine.step with
# one that raises once the test creates the trigger file, then runs `minivllm serve` unchanged.
SERVE_WITH_A_FAULT = """
import sys
from pathlib import Path

from minivllm import cli
from minivllm.engine.llm_engine import LLMEngine

trigger, step = Path(sys.argv[1]), LLMEngine.step


def step_that_fails_on_purpose(self):
    if trigger.exists():
        raise RuntimeError("injected fault: the forward pass failed")
    return step(self)


LLMEngine.step = step_that_fails_on_purpose
sys.exit(cli.main(sys.argv[2:]))
"""


def test_serve_exits_non_zero_when_its_engine_dies(tmp_path) -> None:
    """As vLLM V1: a dead engine is logged with its cause and the process exits 1, so a supervisor
    restarts it, instead of answering 503 forever."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    trigger = tmp_path / "fail-now"
    command = [sys.executable, "-c", SERVE_WITH_A_FAULT, str(trigger), "serve", "--port", str(port)]
    command += ["--threads", "1", "--log-level", "warning", "--api-key", "k"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url, auth = f"http://127.0.0.1:{port}", {"authorization": "Bearer k"}
    body = {"model": "target", "prompt": "ROMEO:\n", "max_tokens": 3}
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        served = httpx.post(url + "/v1/completions", json=body, headers=auth, timeout=30)
        assert served.status_code == 200
        trigger.touch()
        try:
            failed = httpx.post(url + "/v1/completions", json=body, headers=auth, timeout=30)
            assert failed.status_code == 503 and failed.json()["error"]["code"] == "engine_dead"
        except httpx.TransportError:
            pass  # the server may already be gone
        _, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 1
    assert "injected fault: the forward pass failed" in err and "the engine died" in err


def test_serve_limits_and_key_come_from_the_command_line(monkeypatch) -> None:
    from minivllm.cli import server_limits

    args = build_parser().parse_args(
        ["serve", "--max-body-bytes", "1000", "--max-stop-strings", "2", "--api-key", "k"]
    )
    limits = server_limits(args)
    assert (limits.max_body_bytes, limits.max_stop_strings, limits.max_prompts) == (1000, 2, 32)
    assert args.api_key == "k"
    monkeypatch.setenv("MINIVLLM_API_KEY", "from-the-environment")
    assert build_parser().parse_args(["serve"]).api_key == "from-the-environment"
    with pytest.raises(ValueError, match="max_messages must be an int >= 1"):
        server_limits(build_parser().parse_args(["serve", "--max-messages", "0"]))
