"""Naive generation: every new token re-runs the model over the whole sequence so far.

This is the baseline the rest of the book improves on. Step t costs a forward pass over t tokens,
so the time per token grows with the position and a whole generation costs O(T^2) token-passes.
Chapter 02 keeps the keys and values instead of recomputing them.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from minivllm.model.transformer import Transformer


@torch.no_grad()
def next_token_logits(model: Transformer, ids: list[int]) -> torch.Tensor:
    """Logits for the token after `ids`: a forward pass over all of them, keeping only the last
    row."""
    return model(torch.tensor(ids))[-1]


def pick_token(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> int:
    """Greedy at temperature 0, otherwise a draw from softmax(logits / temperature)."""
    if temperature == 0.0:
        return int(logits.argmax())
    probs = torch.softmax(logits / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def check_request(model: Transformer, prompt_ids: list[int], max_new_tokens: int) -> None:
    """Reject a request that can never run, saying what to change: every generator calls this
    first."""
    if not prompt_ids:
        raise ValueError("prompt_ids is empty: start the prompt with at least one token (e.g. BOS)")
    vocab = model.config.vocab_size
    outside = [t for t in prompt_ids if not 0 <= t < vocab]
    if outside:
        raise ValueError(
            f"prompt token id {outside[0]} is outside the vocabulary 0..{vocab - 1}: "
            f"encode text with ByteTokenizer rather than building ids by hand"
        )
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    limit = model.config.max_seq_len
    if len(prompt_ids) + max_new_tokens > limit:
        raise ValueError(
            f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
            f"model's context of {limit} tokens: shorten the prompt or ask for fewer tokens"
        )


def stream_naive(
    model: Transformer,
    prompt_ids: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    eos_id: int | None = None,
) -> Iterator[int]:
    """Yield new token ids one at a time, recomputing the full prefix for each."""
    check_request(model, prompt_ids, max_new_tokens)
    generator = torch.Generator().manual_seed(seed)
    ids = list(prompt_ids)
    for _ in range(max_new_tokens):
        token = pick_token(next_token_logits(model, ids), temperature, generator)
        ids.append(token)
        yield token
        if token == eos_id:
            return


def generate_naive(
    model: Transformer, prompt_ids: list[int], max_new_tokens: int, **kwargs
) -> list[int]:
    return list(stream_naive(model, prompt_ids, max_new_tokens, **kwargs))
