"""A checkpoint's chat template, rendered as Hugging Face `transformers` renders it (issue 29).

A chat model is trained on conversations laid out with its own markers (`<|im_start|>user ...`,
`<|start_header_id|>...`), and its tokenizer ships the layout as a jinja2 template: in
`tokenizer_config.json`'s `chat_template` (a string, or a list of named templates), or in a
`chat_template.jinja` file beside it. The template reads `messages` (OpenAI-style `{"role",
"content"}` dicts), `add_generation_prompt` (end with the header of the assistant's turn) and the
tokenizer's special tokens as strings (`bos_token`, `eos_token`, ...).

The environment is transformers' (`_compile_jinja_template`): a sandbox, `trim_blocks` and
`lstrip_blocks`, the loop-control extension, a `tojson` filter that keeps non-ASCII text as it is,
and the globals `raise_exception` and `strftime_now` that templates call. The rendered text is then
encoded *without* the tokenizer's own special tokens (the template wrote them), as transformers'
`apply_chat_template(..., tokenize=True)` does.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """A template that does not parse, or that refuses the conversation (`raise_exception`)."""


def _raise_exception(message: str):
    raise ChatTemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@functools.cache
def compile_template(source: str) -> jinja2.Template:
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    try:
        return environment.from_string(source)
    except jinja2.TemplateSyntaxError as error:
        raise ChatTemplateError(f"the chat template does not parse: {error}") from None


def render_chat_template(
    source: str,
    messages: Sequence[Mapping],
    add_generation_prompt: bool = True,
    special_tokens: Mapping[str, str | None] | None = None,
) -> str:
    """The conversation as the text the model was trained on."""
    try:
        return compile_template(source).render(
            messages=[dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            **dict(special_tokens or {}),
        )
    except ChatTemplateError:
        raise  # the template's own refusal (raise_exception), its message as it wrote it
    except (jinja2.TemplateError, TypeError, ValueError, LookupError, AttributeError) as error:
        # a template that reads the conversation in a way it does not allow (a missing key, text
        # where it adds numbers): the conversation does not fit the template, said as such
        raise ChatTemplateError(f"the chat template failed: {error}") from None


def read_chat_template(folder: Path, config: Mapping) -> str | None:
    """The folder's chat template: `chat_template.jinja`, else tokenizer_config.json's
    `chat_template` (a string, or named templates, of which "default" is the chat one), else
    `chat_template.json`'s; None where it has none."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if template is None and (folder / "chat_template.json").is_file():
        template = json.loads((folder / "chat_template.json").read_text(encoding="utf-8")).get(
            "chat_template"
        )
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use"}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template else None
