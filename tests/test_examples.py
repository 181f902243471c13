"""examples/: vLLM's offline quickstart and chat example, run as a reader runs them.

Each script runs as `__main__` (in this process, for speed) on conftest's tiny random Qwen3 chat
checkpoint, named by MINIVLLM_MODEL as a reader names theirs. It prints vLLM's lines, `Prompt:
..., Generated text: ...`, one per request, and the text is what the engine answers to that prompt
with the script's own SamplingParams.
"""

from __future__ import annotations

import ast
import runpy
from pathlib import Path

import pytest

from minivllm.engine.llm_engine import LLM

pytestmark = pytest.mark.usefixtures("one_torch_thread")
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
DASHES = "-" * 80


def run(script: str, capsys) -> tuple[dict, list[str], str]:
    """The script's globals, the lines it printed, and what it wrote to stderr."""
    capsys.readouterr()
    found = runpy.run_path(str(EXAMPLES / script), run_name="__main__")
    captured = capsys.readouterr()
    return found, captured.out.splitlines(), captured.err


def printed(line: str) -> tuple[str, str]:
    """(prompt, generated text) of one `Prompt: ..., Generated text: ...` line."""
    prompt, text = line.removeprefix("Prompt: ").split(", Generated text: ")
    return ast.literal_eval(prompt), ast.literal_eval(text)


def test_the_quickstart_prints_each_prompt_and_its_answer(
    chat_checkpoint, monkeypatch, capsys
) -> None:
    monkeypatch.setenv("MINIVLLM_MODEL", str(chat_checkpoint))
    found, lines, _ = run("basic.py", capsys)
    prompts, params = found["prompts"], found["sampling_params"]
    offline = LLM(str(chat_checkpoint)).generate(prompts, params, use_tqdm=False)
    assert [printed(line) for line in lines] == [(o.prompt, o.outputs[0].text) for o in offline]
    assert [o.prompt for o in offline] == prompts and all(o.outputs[0].text for o in offline)


def test_the_chat_example_prints_the_templated_conversations_and_answers(
    chat_checkpoint, monkeypatch, capsys
) -> None:
    monkeypatch.setenv("MINIVLLM_MODEL", str(chat_checkpoint))
    found, lines, err = run("chat.py", capsys)
    # one conversation, then a batch of two, each block closed by a line of dashes
    assert [i for i, line in enumerate(lines) if line == DASHES] == [1, 4]
    answers = [printed(line) for line in lines if line != DASHES]
    assert len(answers) == 3
    assert "Processed prompts: 100%" in err and "2/2" in err  # use_tqdm=True: the batch's bar
    for prompt, _ in answers:  # the model's template laid it out, ready for the answer
        assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("assistant\n")
    # each answer is the engine's to that prompt (a fresh engine: the same request ids, seeds)
    llm = LLM(str(chat_checkpoint))
    tokenizer, params = llm.engine.tokenizer, found["sampling_params"]
    first = llm.generate([tokenizer.encode(answers[0][0])], params, use_tqdm=False)
    batch = llm.generate([tokenizer.encode(p) for p, _ in answers[1:]], params, use_tqdm=False)
    assert [o.outputs[0].text for o in first + batch] == [text for _, text in answers]


def test_the_chat_example_says_it_needs_a_chat_model(monkeypatch) -> None:
    monkeypatch.delenv("MINIVLLM_MODEL", raising=False)
    with pytest.raises(SystemExit, match="set MINIVLLM_MODEL to a chat model's folder"):
        runpy.run_path(str(EXAMPLES / "chat.py"), run_name="__main__")
