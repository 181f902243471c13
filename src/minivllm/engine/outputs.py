"""TODO split from engine.py"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RequestOutput:
    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated tokens
    text: str  # generated text (a stop string is cut off)
    finished: bool
    finish_reason: str | None  # "stop", "length", "abort" or "cache_full"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache
    num_preemptions: int = 0
    finish_message: str | None = None  # why the engine ended it, for finish_reason "cache_full"


@dataclass(frozen=True)
class TextDelta:
    """One piece of a streamed response: the new text of one request since its last delta."""

    request_id: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None
