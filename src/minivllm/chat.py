"""`minivllm chat`: a conversation with a model in the terminal, streamed token by token.

    minivllm chat                       # the shipped model; Ctrl-C stops an answer, Ctrl-D leaves
    minivllm chat --temperature 0 --max-tokens 64 --system "A street in Verona."

Each turn the whole conversation so far -- the optional system line, then every speech -- is
rendered into one prompt and sent to the engine as a new request; the answer streams as the engine
steps, and goes into the conversation for the next turn. Prefix caching is on (vLLM's default too),
so the turns the engine has already read are mostly served from the KV cache: the line after each
answer says how many prompt tokens were, with the time to the first token and the decode speed.

**The turn format.** How a conversation becomes a prompt is a `ChatFormat`, chosen once by
`chat_format_for(tokenizer)`:

* a tokenizer with a chat template (a Hugging Face tokenizer's `chat_template`, rendered by its
  `apply_chat_template`) gets `TemplateFormat`: the model's own turn markers, the template's
  generation prompt, and the model's end-of-turn token to stop on. That is the seam where real
  checkpoints plug in;
* a model without one -- the shipped byte-level Shakespeare model has no template and has only ever
  read plays -- gets `PlayFormat`, the plain-text format the server's `/v1/chat/completions` uses
  (`render_chat`, chapter 09): every speech is `SPEAKER:` on its own line, the speech, and a blank
  line; you are ROMEO, the model JULIET, a system line the Chorus; the prompt ends with `JULIET:`
  and a newline, and the answer ends at the blank line that closes her speech (or at the end of
  the scene). Blank lines inside a speech would end it early, so they are folded into one.

**Long conversations.** The model reads a fixed context (512 tokens for the shipped one) that must
hold the prompt and the whole answer (`--max-tokens`). When the conversation outgrows it, the
oldest speeches are forgotten, one at a time (the system line is kept), and the chat says so; a
line too long to leave any room for an answer is refused.

**Ctrl-C** during an answer stops that answer, not the program: the request is aborted in the
engine, its KV blocks go back to the pool at once, and what was said so far stays in the
conversation. While an answer runs, Ctrl-C only raises a flag that is read between engine steps, so
a step is never cut in half (a `KeyboardInterrupt` that arrives anyway aborts the request the same
way). At the prompt, Ctrl-C or Ctrl-D (end of input) ends the chat; so does `/exit`.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, TextIO

from minivllm.engine.conversation import has_chat_template, render_conversation
from minivllm.engine.llm_engine import LLMEngine
from minivllm.runner.sampler import derive_seed
from minivllm.sched.sequence import SamplingParams
from minivllm.serving.openai_protocol import END_OF_TURN, SPEAKERS, ChatMessage, render_chat

Message = dict[str, str]  # {"role": "system" | "user" | "assistant", "content": text}: OpenAI's
# (and Hugging Face's apply_chat_template's) shape, so a template reads the history unchanged
INTERRUPTED = "interrupted"  # the finish reason of an answer stopped by Ctrl-C

HELP = """\
Type a line and press Enter; the model answers, streaming.
  /reset   forget the conversation (the system line stays) and start again
  /prompt  show the latest prompt the model read: the conversation in its turn format
  /help    this text
  /exit    leave (also /quit, Ctrl-D, or Ctrl-C at the prompt)
Ctrl-C while the model answers stops the answer; what it said so far stays in the conversation.
"""


# -- the turn format: where a chat template plugs in -----------------------------------------------
class ChatFormat(Protocol):
    """How a conversation becomes the model's prompt, and where its answer ends."""

    user_label: str  # shown at the input prompt
    assistant_label: str  # shown before each answer
    stop: tuple[str, ...]  # stop strings that end an answer (besides the model's EOS)

    def render(self, messages: Sequence[Message]) -> str | list[int]:
        """The prompt for the next answer: text (the engine puts BOS in front) or token ids
        (used as they are, as a template's own tokenization)."""
        ...


@dataclass(frozen=True)
class PlayFormat:
    """For a model without a chat template: the conversation as a scene of a play (the server's
    `render_chat`), answered by the next speaker; the blank line after a speech ends it."""

    user_label: str = SPEAKERS["user"]
    assistant_label: str = SPEAKERS["assistant"]
    stop: tuple[str, ...] = (END_OF_TURN,)

    def render(self, messages: Sequence[Message]) -> str:
        return render_chat([ChatMessage(role=m["role"], content=m["content"]) for m in messages])


@dataclass(frozen=True)
class TemplateFormat:
    """A tokenizer's own chat template: anything with Hugging Face's
    `apply_chat_template(messages, add_generation_prompt=True, tokenize=True) -> [token ids]`.
    The template ends each turn with a token the model's EOS (or `stop_token_ids`) stops on, so
    there is no stop string."""

    tokenizer: Any
    user_label: str = "user"
    assistant_label: str = "assistant"
    stop: tuple[str, ...] = ()

    def render(self, messages: Sequence[Message]) -> list[int]:
        # the layout of LLM.chat and the server's chat endpoints (engine/conversation.py)
        return list(render_conversation(self.tokenizer, messages))


def chat_format_for(tokenizer: Any) -> ChatFormat:
    """The tokenizer's chat template when it has one, else the play (the shipped byte tokenizer)."""
    if has_chat_template(tokenizer):
        return TemplateFormat(tokenizer)
    return PlayFormat()


# -- one conversation ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Turn:
    """A user line made ready to send: the prompt, its parameters, what had to give way."""

    prompt: str | list[int]
    prompt_tokens: int
    params: SamplingParams
    forgotten: int  # speeches dropped from the start of the conversation to make room
    capped: bool  # max_tokens lowered to the room left in the context


@dataclass(frozen=True)
class TurnStats:
    """How one answer went. `tokens_per_s` is the decode speed: the tokens after the first over
    the time after the first (the first token's wait is `first_token_s`, the prefill)."""

    prompt_tokens: int
    cached_tokens: int  # prompt tokens served by the prefix cache
    output_tokens: int
    first_token_s: float | None  # None: no token came
    total_s: float
    finish_reason: str  # "stop", "length", "cache_full", or INTERRUPTED

    @property
    def tokens_per_s(self) -> float | None:
        if self.first_token_s is None or self.output_tokens < 2:
            return None
        after_first = self.total_s - self.first_token_s
        return (self.output_tokens - 1) / after_first if after_first > 0 else None

    def line(self) -> str:
        parts = [f"{self.output_tokens} token{'s' if self.output_tokens != 1 else ''}"]
        if self.first_token_s is not None:
            parts.append(f"first token {self.first_token_s * 1000:.0f} ms")
        if (speed := self.tokens_per_s) is not None:
            parts.append(f"{speed:.1f} tokens/s")
        parts.append(f"prompt {self.prompt_tokens} ({self.cached_tokens} cached)")
        parts.append(self.finish_reason)
        return "[" + " · ".join(parts) + "]"


@dataclass
class Chat:
    """A conversation with one engine: `prepare` a user line, then `run` its answer."""

    engine: LLMEngine
    params: SamplingParams  # max_tokens, temperature, ...; the seed is varied per turn
    format: ChatFormat = field(default_factory=PlayFormat)
    system: str | None = None
    clock: Callable[[], float] = time.perf_counter
    messages: list[Message] = field(default_factory=list)
    turns: int = 0  # answers run since the start (or /reset): turn i samples with seed (seed, i)
    last_prompt: str | list[int] | None = None

    def __post_init__(self) -> None:
        context = self.engine.inputs.limits.max_model_len
        if self.params.max_tokens >= context:
            raise ValueError(
                f"max_tokens ({self.params.max_tokens}) leaves no room for a prompt in the model's "
                f"{context}-token context"
            )
        self.params = replace(self.params, stop=(*self.params.stop, *self.format.stop))
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.turns, self.last_prompt = 0, None

    def last_prompt_text(self) -> str | None:
        """The prompt of the latest answer, as text: the conversation in its turn format."""
        prompt = self.last_prompt
        if prompt is None or isinstance(prompt, str):
            return prompt
        return self.engine.tokenizer.decode(prompt)

    def prepare(self, text: str) -> Turn:
        """Add the user's line and render the prompt, forgetting the oldest speeches (not the
        system line) while the prompt and a whole answer do not fit the context. When even the line
        alone leaves no room, ValueError, and the conversation stays as it was."""
        kept = [*self.messages, {"role": "user", "content": text}]
        context, forgotten = self.engine.inputs.limits.max_model_len, 0
        while True:
            prompt = self.format.render(kept)
            length = len(self.engine.inputs.prompt_ids(prompt))
            if length + self.params.max_tokens <= context:
                params, capped = self._params(), False
                break
            older = [i for i, m in enumerate(kept[:-1]) if m["role"] != "system"]
            if not older:
                if length >= context:
                    raise ValueError(
                        f"that line makes a {length}-token prompt, and the model's context is "
                        f"{context} tokens: say something shorter"
                    )
                params, capped = self._params(context - length), True
                break
            del kept[older[0]]
            forgotten += 1
        self.messages = kept
        return Turn(prompt, length, params, forgotten, capped)

    def _params(self, max_tokens: int | None = None) -> SamplingParams:
        changes = {} if max_tokens is None else {"max_tokens": max_tokens}
        if self.params.seed is not None:  # each turn its own draw, the conversation repeatable
            changes["seed"] = derive_seed(self.params.seed, self.turns)
        return replace(self.params, **changes)

    def run(self, turn: Turn, write: Callable[[str], Any]) -> TurnStats:
        """Stream the answer to `write` as the engine steps; keep it in the conversation. Ctrl-C
        (or a KeyboardInterrupt) ends it early: the request is aborted, its blocks freed."""
        engine, started = self.engine, self.clock()
        try:
            request_id = engine.add_request(turn.prompt, turn.params)
        except ValueError:
            self.messages.pop()  # never asked
            raise
        self.turns, self.last_prompt = self.turns + 1, turn.prompt
        last, first_token_at = None, None
        with interrupts_deferred() as ctrl_c:
            try:
                while not (last is not None and last.finished) and not ctrl_c.is_set():
                    if not engine.has_unfinished():
                        break  # ended without a word to us (cannot happen; never spin)
                    for out in engine.step():
                        if out.request_id != request_id:
                            continue
                        last = out
                        if first_token_at is None and out.new_token_ids:
                            first_token_at = self.clock()
                        if out.new_text:
                            write(out.new_text)
            except KeyboardInterrupt:
                pass  # not deferred (off the main thread, or raised by hand): aborted all the same
            finally:
                if (
                    not (last is not None and last.finished)
                    and request_id in engine.scheduler.sequences
                ):
                    last = engine.abort(request_id)  # its blocks go back to the pool now
                    if last.new_text:  # the tail held back in case it began a stop string
                        write(last.new_text)
        finished = self.clock()
        reason = last.finish_reason if last is not None else "abort"
        answer = last.text if last is not None else ""
        if answer.strip():  # an empty answer is no speech (the user's line stays)
            self.messages.append({"role": "assistant", "content": answer})
        return TurnStats(
            prompt_tokens=turn.prompt_tokens,
            cached_tokens=last.num_cached_tokens if last is not None else 0,
            output_tokens=len(last.token_ids) if last is not None else 0,
            first_token_s=None if first_token_at is None else first_token_at - started,
            total_s=finished - started,
            finish_reason=INTERRUPTED if reason == "abort" else reason,
        )


@contextmanager
def interrupts_deferred() -> Iterator[threading.Event]:
    """While inside, Ctrl-C (SIGINT) sets the yielded event instead of raising KeyboardInterrupt,
    so the caller stops between two engine steps, never inside one. Off the main thread (where
    Python cannot handle signals) the event is never set and Ctrl-C behaves as usual."""
    pressed = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield pressed
        return
    previous = signal.signal(signal.SIGINT, lambda _signum, _frame: pressed.set())
    try:
        yield pressed
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler if previous is None else previous)


# -- the REPL --------------------------------------------------------------------------------------
def repl(chat: Chat, read: Callable[[str], str], out: TextIO, banner: str | None = None) -> int:
    """Read a line, answer it, repeat; 0 on /exit, end of input or Ctrl-C at the prompt. `read`
    is `input` in a terminal: it shows its prompt, and raises EOFError at the end of input and
    KeyboardInterrupt on Ctrl-C."""

    written = ["\n"]  # the last text written, to end the answer's line before the stats

    def write(text: str) -> None:
        if text:
            written[0] = text
        out.write(text)
        out.flush()

    if banner:
        write(banner + "\n")
    while True:
        try:
            line = read(f"{chat.format.user_label}: ").strip()
        except (EOFError, KeyboardInterrupt):
            write("\n")
            return 0
        if not line:
            continue
        if line.startswith("/"):
            command = line.split()[0].lower()
            if command in ("/exit", "/quit"):
                return 0
            if command == "/reset":
                chat.reset()
                write("[the conversation is forgotten]\n")
            elif command == "/prompt":
                prompt = chat.last_prompt_text()
                write("[nothing asked yet]\n" if prompt is None else prompt + "\n")
            elif command == "/help":
                write(HELP)
            else:
                write(f"[unknown command {command}: /help lists them]\n")
            continue
        try:
            turn = chat.prepare(line)
        except ValueError as error:
            write(f"[{error}]\n")
            continue
        if turn.forgotten:
            write(
                f"[forgot the {turn.forgotten} oldest speech{'es' if turn.forgotten > 1 else ''}: "
                "the conversation outgrew the model's context]\n"
            )
        if turn.capped:
            write(f"[the answer may have {turn.params.max_tokens} tokens at most: the context]\n")
        write(f"{chat.format.assistant_label}:\n")
        try:
            stats = chat.run(turn, write)
        except ValueError as error:
            write(f"[{error}]\n")
            continue
        if not written[0].endswith("\n"):
            write("\n")
        write(stats.line() + "\n")
