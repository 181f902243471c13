"""forge-infer's native endpoint as plain data: `POST /generate` (chapter 09).

Not every client wants OpenAI's envelope of ids, objects and choices. forge-infer's server answers
`POST /generate` with the text alone; this is the same endpoint over minivllm's engine:

    {"prompt": "ROMEO:\\n", "max_tokens": 8, "temperature": 0}
    -> {"text": "...", "token_ids": [...], "finish_reason": "length",
        "prompt_tokens": 8, "completion_tokens": 8}

The body is one prompt (text, which gets a BOS token in front, or token ids), `max_tokens`
(forge-infer's default, 32) and any sampling field of /v1/completions -- `temperature`, `top_p`,
`top_k`, `seed`, `stop`, `min_p`, the penalties, `logit_bias`, `stop_token_ids`, `ignore_eos`,
... -- with the same bounds and the same refusals, since it is the same pydantic model underneath
(`SamplingFields`). `model` may be left out; given, it must name the served model. `n` must be 1:
one prompt, one text (/v1/completions serves n samples). `finish_reason` is the engine's own word:
"stop", "length", or "cache_full" for a sequence that outgrew the KV cache (which OpenAI's
endpoints report as "length").

With `"stream": true` the answer is Server-Sent Events, each a `data:` line in the same shape with
the new piece -- `{"text": piece, "token_ids": [...], "finish_reason": null}` -- the last one with
the finish reason and the token counts, then `data: [DONE]`. Joined, the pieces are the answer.
Like the other protocol modules this one knows no engine and imports no torch.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from typing import Annotated

from pydantic import Field, field_validator

from minivllm.serving.openai_protocol import SamplingFields, TokenId

GENERATE_MAX_TOKENS = 32  # forge-infer's default for /generate


class GenerateRequest(SamplingFields):
    """POST /generate: continue one prompt, text or token ids."""

    prompt: str | Annotated[list[TokenId], Field(min_length=1)]

    @field_validator("n")
    @classmethod
    def _one_sample(cls, n: int | None) -> int | None:
        if n not in (None, 1):
            raise ValueError(
                f"/generate answers one text, so n must be 1 (got {n}): ask /v1/completions for "
                "n samples"
            )
        return n


def generate_body(
    text: str,
    token_ids: SequenceOf[int],
    finish_reason: str | None,
    counts: tuple[int, int] | None = None,
) -> dict:
    """A whole answer, or one streamed piece of it; `counts` (prompt, completion tokens) go with
    the whole answer and with the last piece."""
    body = {"text": text, "token_ids": list(token_ids), "finish_reason": finish_reason}
    if counts is not None:
        body["prompt_tokens"], body["completion_tokens"] = counts
    return body
