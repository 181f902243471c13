"""`minivllm chat`: the conversation goes back to the model each turn as a play, answers stream, and
Ctrl-C stops an answer (its request aborted, its blocks freed) but not the chat."""

from __future__ import annotations

import io
import signal
import sys

import pytest

from minivllm.chat import (
    INTERRUPTED,
    Chat,
    PlayFormat,
    TemplateFormat,
    TurnStats,
    chat_format_for,
    repl,
)
from minivllm.cli import main
from minivllm.engine.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.model.tokenizer import ByteTokenizer
from minivllm.sched.scheduler import SchedulerConfig
from minivllm.sched.sequence import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")
GREEDY = SamplingParams(max_tokens=12, temperature=0)


@pytest.fixture
def engine(target) -> LLMEngine:
    return LLMEngine(target, EngineConfig(scheduler=SchedulerConfig(enable_prefix_caching=True)))


def lines(*said):
    """A fake `input`: each call returns the next line, or raises it if it is an exception."""
    queue = list(said)

    def read(prompt: str) -> str:
        item = queue.pop(0)
        if isinstance(item, BaseException) or isinstance(item, type):
            raise item
        return item

    return read


def test_each_turn_sends_the_whole_conversation_as_a_play_and_streams_the_answer(engine) -> None:
    chat, out = Chat(engine, GREEDY), io.StringIO()
    assert repl(chat, lines("Good morrow.", "What say you?", "/exit"), out) == 0
    first = "ROMEO:\nGood morrow.\n\nJULIET:\n"
    reference = LLMEngine(chat.engine.model)  # the plain engine, one request at a time
    stop = SamplingParams(max_tokens=12, temperature=0, stop=["\n\n"])
    answer = reference.generate([first], stop)[0].text
    second = f"{first}{answer}\n\nROMEO:\nWhat say you?\n\nJULIET:\n"
    assert chat.last_prompt == second  # the first answer went back in
    again = reference.generate([second], stop)[0].text
    assert [m["content"] for m in chat.messages] == [
        "Good morrow.",
        answer,
        "What say you?",
        again,
    ]
    text = out.getvalue()
    assert f"JULIET:\n{answer}" in text and f"JULIET:\n{again}" in text
    assert text.count(" tokens/s · prompt ") == 2 and "first token " in text
    assert engine.manager.num_used == 0 and not engine.has_unfinished()


def test_the_second_turn_reads_the_first_from_the_prefix_cache(engine) -> None:
    chat = Chat(engine, GREEDY)
    stats = [chat.run(chat.prepare(line), lambda text: None) for line in ("Hail!", "Speak.")]
    assert stats[0].cached_tokens == 0 and stats[1].cached_tokens >= 16
    assert stats[1].prompt_tokens > stats[0].prompt_tokens
    assert all(s.output_tokens >= 1 and s.first_token_s is not None for s in stats)


def test_ctrl_c_stops_the_answer_frees_its_blocks_and_the_chat_goes_on(engine) -> None:
    """A real SIGINT during the answer: the handler only flags it, the loop stops between steps."""
    chat = Chat(engine, SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))
    pieces = []

    def press_ctrl_c_after_three_pieces(text: str) -> None:
        pieces.append(text)
        if len(pieces) == 3:
            signal.raise_signal(signal.SIGINT)

    before = signal.getsignal(signal.SIGINT)  # Python's handler; SIG_IGN in a pytest-xdist worker
    stats = chat.run(chat.prepare("Tell me a long tale."), press_ctrl_c_after_three_pieces)
    assert stats.finish_reason == INTERRUPTED and stats.output_tokens < 60
    assert engine.manager.num_used == 0 and not engine.has_unfinished()
    assert signal.getsignal(signal.SIGINT) is before  # Ctrl-C does again what it did before
    assert chat.messages[-1] == {"role": "assistant", "content": "".join(pieces)}  # what was said
    after = chat.run(chat.prepare("Go on."), lambda text: None)
    assert after.finish_reason in ("stop", "length") and after.output_tokens >= 1


def test_a_keyboard_interrupt_inside_a_step_aborts_the_request(engine, monkeypatch) -> None:
    """Where Ctrl-C raises after all (off the main thread, say): the same abort, via the REPL."""
    step, calls = engine.step, []

    def interrupted_third_step():
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return step()

    monkeypatch.setattr(engine, "step", interrupted_third_step)
    chat, out = (
        Chat(engine, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)),
        io.StringIO(),
    )
    assert repl(chat, lines("Speak!", "Again.", EOFError), out) == 0
    text = out.getvalue()
    assert f"· {INTERRUPTED}]" in text and text.count("tokens/s") == 2
    assert engine.manager.num_used == 0 and not engine.has_unfinished()
    assert chat.messages[-2]["content"] == "Again." and chat.turns == 2


@pytest.mark.parametrize("leave", [EOFError, KeyboardInterrupt, "/exit", "/quit"])
def test_ctrl_d_ctrl_c_or_exit_at_the_prompt_leave_cleanly(engine, leave) -> None:
    out = io.StringIO()
    assert repl(Chat(engine, GREEDY), lines(leave), out, banner="hello") == 0
    assert out.getvalue().startswith("hello\n")


def test_commands_help_reset_and_prompt(engine) -> None:
    chat, out = Chat(engine, GREEDY, system="A street in Verona."), io.StringIO()
    said = ("/help", "/prompt", "", "Hail!", "/prompt", "/reset", "/nope", "/exit")
    assert repl(chat, lines(*said), out) == 0
    text = out.getvalue()
    assert "/reset" in text and "[nothing asked yet]" in text and "unknown command /nope" in text
    assert "Chorus:\nA street in Verona.\n\nROMEO:\nHail!\n\nJULIET:\n\n" in text  # /prompt
    assert "[the conversation is forgotten]" in text
    assert chat.messages == [{"role": "system", "content": "A street in Verona."}]
    assert chat.turns == 0 and chat.last_prompt is None


def test_a_seed_repeats_the_conversation_with_a_new_draw_each_turn(engine) -> None:
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=3)

    def converse() -> list[str]:
        chat = Chat(engine, params)
        for line in ("Hail!", "Hail!"):
            chat.run(chat.prepare(line), lambda text: None)
        return [m["content"] for m in chat.messages]

    first = converse()
    assert converse() == first
    turns = [Chat(engine, params), Chat(engine, params)]
    turns[1].turns = 1  # the second turn of a conversation draws with another seed
    assert turns[0]._params().seed != turns[1]._params().seed


def test_a_long_conversation_forgets_its_oldest_speeches(engine) -> None:
    chat = Chat(engine, SamplingParams(max_tokens=16, temperature=0), system="Verona.")
    line = "Speak " * 40  # 240 bytes: two of them and their answers overflow 512 tokens
    forgotten = []
    for _ in range(3):
        turn = chat.prepare(line.strip())
        forgotten.append(turn.forgotten)
        assert turn.prompt_tokens + turn.params.max_tokens <= 512
        chat.run(turn, lambda text: None)
    assert forgotten[0] == 0 and sum(forgotten) >= 2
    assert chat.messages[0] == {"role": "system", "content": "Verona."}  # the Chorus stays
    before = list(chat.messages)
    with pytest.raises(ValueError, match="context is 512"):
        chat.prepare("x" * 600)
    assert chat.messages == before  # a refused line changes nothing
    capped = chat.prepare("y" * 470)  # fits alone, with less room than max_tokens
    assert capped.capped and capped.forgotten and capped.params.max_tokens < 16


def test_max_tokens_must_leave_room_for_a_prompt(engine) -> None:
    with pytest.raises(ValueError, match="no room for a prompt"):
        Chat(engine, SamplingParams(max_tokens=512))


def test_the_stats_line() -> None:
    stats = TurnStats(10, 3, 11, first_token_s=0.05, total_s=0.15, finish_reason="stop")
    assert stats.tokens_per_s == pytest.approx(100.0)
    assert stats.line() == (
        "[11 tokens · first token 50 ms · 100.0 tokens/s · prompt 10 (3 cached) · stop]"
    )
    nothing = TurnStats(10, 0, 0, first_token_s=None, total_s=0.01, finish_reason=INTERRUPTED)
    assert nothing.line() == "[0 tokens · prompt 10 (0 cached) · interrupted]"


class TemplatedTokenizer:
    """Stands in for a Hugging Face tokenizer with a chat template."""

    chat_template = "{% for m in messages %}...{% endfor %}"

    def __init__(self) -> None:
        self.calls = []

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        self.calls.append((messages, add_generation_prompt, tokenize))
        return [1, 2, 3]


def test_a_tokenizer_with_a_chat_template_renders_the_chat_itself() -> None:
    assert isinstance(chat_format_for(ByteTokenizer()), PlayFormat)
    tokenizer = TemplatedTokenizer()
    fmt = chat_format_for(tokenizer)
    assert isinstance(fmt, TemplateFormat) and fmt.stop == ()
    messages = [{"role": "user", "content": "hi"}]
    assert fmt.render(messages) == [1, 2, 3]
    assert tokenizer.calls == [(messages, True, True)]


def test_minivllm_chat_from_a_pipe(monkeypatch, capsys) -> None:
    """The command itself, stdin a pipe: what was said is echoed, then answered; EOF ends it."""
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hail!\n/prompt\nFarewell."))
    assert main(["chat", "--max-tokens", "6", "--temperature", "0", "--system", "Verona."]) == 0
    out = capsys.readouterr().out
    assert out.startswith("minivllm chat with target: you are ROMEO, the model is JULIET.")
    assert "ROMEO: Hail!\nJULIET:\n" in out and "[6 tokens · first token " in out
    assert "ROMEO: /prompt\nChorus:\nVerona.\n\nROMEO:\nHail!\n\nJULIET:\n" in out
    assert "ROMEO: Farewell.\nJULIET:\n" in out and out.endswith("ROMEO: \n")


def test_a_bad_chat_argument_exits_2(capsys) -> None:
    assert main(["chat", "--max-tokens", "0"]) == 2
    assert "max_tokens" in capsys.readouterr().err


@pytest.mark.parametrize(
    "kv, layout, caching", [("paged", "paged", True), ("basic", "contiguous", False)]
)
def test_chat_takes_the_kv_layout_and_caches_prefixes_where_it_can(kv, layout, caching) -> None:
    from minivllm.cli import build_chat_engine, build_parser

    args = build_parser().parse_args(["chat", "--kv", kv])
    with build_chat_engine(args) as chat_engine:
        assert chat_engine.config.kv_layout == layout
        assert chat_engine.config.scheduler.enable_prefix_caching is caching
