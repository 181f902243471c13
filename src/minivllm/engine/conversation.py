"""A conversation as a prompt, through the model's own chat template (issue 29, chapter 09).

`LLM.chat`, the server's `/v1/chat/completions` and `/v1/messages` (and `/tokenize` with messages)
and `minivllm chat` all lay a conversation out here, so the three cannot drift apart: a model
whose tokenizer has a chat template reads the same prompt ids whichever door the conversation came
in by. (A model without one -- the shipped byte-level models -- reads the conversation as a play,
`serving/openai_protocol.render_chat`; `LLM.chat` refuses it.)

A message is OpenAI's `{"role": ..., "content": ...}` (with an optional `name`). Its content is a
string, or a list of text parts (`[{"type": "text", "text": ...}, ...]`, which OpenAI's and
Anthropic's APIs both allow); a template is handed a string, the parts joined with newlines, as
vLLM does for templates that read `message.content` as text (most do: Qwen's, Llama's, Mistral's;
given a list, Qwen3's renders nothing). The prompt is the template's own tokenization of the
rendered text (special tokens written by the template, none added), as `transformers`'
`apply_chat_template(..., tokenize=True)` and vLLM's `apply_hf_chat_template` give it. A template
that refuses the conversation (its `raise_exception`: "roles must alternate") raises
`ChatTemplateError`, a ValueError carrying the template's own message.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from minivllm.model.chat_template import ChatTemplateError

__all__ = ["ChatTemplateError", "chat_messages", "has_chat_template", "render_conversation"]


def has_chat_template(tokenizer: Any) -> bool:
    """Whether the tokenizer lays out conversations itself (a checkpoint's `HFTokenizer` with a
    `chat_template`); the byte tokenizer does not."""
    return bool(getattr(tokenizer, "chat_template", None)) and hasattr(
        tokenizer, "apply_chat_template"
    )


def chat_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The messages as a template reads them: plain dicts, each content a string (text parts
    joined with newlines). Raises ValueError naming the message that is not one."""
    result = []
    for number, message in enumerate(messages):
        if not isinstance(message, Mapping) or "role" not in message:
            raise ValueError(
                f"messages[{number}] must be a dict with a role and a content, got "
                f"{type(message).__name__}"
            )
        content = message.get("content")
        if isinstance(content, (list, tuple)):
            content = "\n".join(_part_text(part, number) for part in content)
        elif content is not None and not isinstance(content, str):
            raise ValueError(
                f"messages[{number}].content must be text or a list of text parts, got "
                f"{type(content).__name__}"
            )
        result.append({**{k: v for k, v in message.items() if v is not None}, "content": content})
    return result


def _part_text(part: Any, number: int) -> str:
    text = part.get("text") if isinstance(part, Mapping) else None
    if isinstance(text, str) and part.get("type") == "text":
        return text
    kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
    raise ValueError(
        f"messages[{number}].content: a part of type {kind!r}; this engine reads text parts only "
        '({"type": "text", "text": ...})'
    )


def render_conversation(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    tokenize: bool = True,
    chat_template: str | None = None,
) -> list[int] | str:
    """The conversation laid out by the tokenizer's chat template (or `chat_template`, jinja
    source that replaces it, as vLLM's `LLM.chat(chat_template=...)`): its token ids, or with
    `tokenize=False` its text. `add_generation_prompt` ends it with the header of the assistant's
    turn, so the model answers next."""
    if chat_template is None and not has_chat_template(tokenizer):
        raise ValueError(
            "this model's tokenizer has no chat template (no chat_template in its "
            "tokenizer_config.json and no chat_template.jinja), so a conversation has no layout "
            "to follow: give a prompt instead, or pass chat_template=<jinja source>"
        )
    if not hasattr(tokenizer, "apply_chat_template"):
        raise ValueError(
            f"a chat template needs a Hugging Face tokenizer; this model's is "
            f"{type(tokenizer).__name__}"
        )
    override = {} if chat_template is None else {"chat_template": chat_template}
    return tokenizer.apply_chat_template(
        chat_messages(messages),
        add_generation_prompt=add_generation_prompt,
        tokenize=tokenize,
        **override,
    )
