"""A contiguous KV cache: keep every layer's keys and values so each new token is one small forward
pass.

Naive generation (chapter 00) re-runs the model over the whole prefix for every new token, although
the keys and values of the earlier tokens never change: token i's k and v depend only on tokens
0..i. So we compute them once, keep them, and feed the model only the new token at its position. A
step then costs a forward pass over one token plus an attention read over the cached history.

`ContiguousKVCache` is an attention object (the model's seam, see `model/transformer.py`) for ONE
sequence. It stores, per layer, K and V as one contiguous `[length, n_kv_heads, head_dim]` tensor
each, grown by one of the two classic strategies:

* `"concat"` -- `torch.cat` the history with the new rows on every append. Memory is exactly what
  the sequence needs, but every append copies the whole history: O(T^2) bytes over a generation
  (`bytes_copied` counts them).
* `"preallocate"` -- reserve `max_len` slots per layer up front and write into slices. No copies,
  but every sequence pays for `max_len` slots whatever its length (`reserved_bytes` vs
  `used_bytes`), and it cannot grow past them. With many sequences that reserved-but-unused memory
  is what chapter 03's paged cache wins back.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F

from minivllm.attention.storage import tensor_bytes
from minivllm.model.transformer import ModelConfig, Transformer
from minivllm.stages.naive import check_request, pick_token

STRATEGIES = ("concat", "preallocate")


def cached_causal_mask(start: int, new_tokens: int) -> torch.Tensor:
    """`[new_tokens, start + new_tokens]` boolean, True where a query may look.

    Query i of this call sits at absolute position `start + i` and may see keys `0..start + i`: all
    of the cached history, and the new tokens up to and including itself.
    """
    # EXERCISE ch02.2: causal mask -- queries at positions start.. over keys 0..start+new_tokens-1
    ### BEGIN SOLUTION
    query_positions = torch.arange(start, start + new_tokens)[:, None]
    key_positions = torch.arange(start + new_tokens)[None, :]
    return key_positions <= query_positions
    ### END SOLUTION


class ContiguousKVCache:
    """Per-layer K and V for one sequence, as contiguous tensors; called by the model at the
    seam."""

    def __init__(
        self,
        config: ModelConfig,
        strategy: str,
        max_len: int | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if strategy not in STRATEGIES:
            raise ValueError(
                f"unknown strategy {strategy!r}: choose one of {', '.join(STRATEGIES)}"
            )
        self.config, self.strategy, self.dtype = config, strategy, dtype
        self.max_len = max_len if max_len is not None else config.max_seq_len
        rows = self.max_len if strategy == "preallocate" else 0  # concat starts empty and grows
        shape = (rows, config.n_kv_heads, config.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype) for _ in range(config.n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype) for _ in range(config.n_layers)]
        # Tokens each layer holds. Layers append one after another within a forward pass, so they
        # differ only mid-pass; the sequence's length is the last layer's.
        self.layer_lengths = [0] * config.n_layers
        self.bytes_copied = 0

    @property
    def length(self) -> int:
        return self.layer_lengths[-1]

    @property
    def per_token_bytes(self) -> int:
        """K and V of one token in every layer."""
        c = self.config
        return c.n_layers * 2 * c.n_kv_heads * c.head_dim * self.dtype.itemsize

    @property
    def used_bytes(self) -> int:
        return self.length * self.per_token_bytes

    @property
    def reserved_bytes(self) -> int:
        """Memory the tensors actually hold: max_len slots when preallocated, the history when
        concatenated."""
        return sum(tensor_bytes(t) for t in self.k + self.v)

    def keys(self, layer: int) -> torch.Tensor:
        return self.k[layer][: self.layer_lengths[layer]]

    def values(self, layer: int) -> torch.Tensor:
        return self.v[layer][: self.layer_lengths[layer]]

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> int:
        """Store `k`, `v` (`[T, n_kv_heads, head_dim]`) after this layer's history; returns the
        position of the first new token."""
        start, new = self.layer_lengths[layer], k.shape[0]
        self._check_in_step(layer, start, new)
        if self.strategy == "concat":
            self._append_concat(layer, k.to(self.dtype), v.to(self.dtype))
        else:
            self._append_preallocated(layer, start, k.to(self.dtype), v.to(self.dtype))
        self.layer_lengths[layer] = start + new
        return start

    def _check_in_step(self, layer: int, start: int, new: int) -> None:
        # Layer 0 opens a pass once every layer has finished the previous one; layer l then follows
        # layer l-1 with the same tokens. Anything else means the caller mixed up sequences or
        # passes.
        expected = self.layer_lengths[-1] if layer == 0 else self.layer_lengths[layer - 1]
        got = start if layer == 0 else start + new
        if got != expected:
            raise ValueError(
                f"layer {layer} appends {new} tokens to {start} cached, but the other layers hold "
                f"{self.layer_lengths}: every forward pass must append the same tokens to all "
                "layers in order"
            )

    def _append_concat(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        # EXERCISE ch02.1: concat append -- torch.cat k, v onto the history; count self.bytes_copied
        ### BEGIN SOLUTION
        # torch.cat allocates a new tensor and copies the whole history into it: that is the cost.
        self.bytes_copied += tensor_bytes(self.k[layer]) + tensor_bytes(self.v[layer])
        self.k[layer] = torch.cat([self.k[layer], k])
        self.v[layer] = torch.cat([self.v[layer], v])
        ### END SOLUTION

    def _append_preallocated(
        self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        end = start + k.shape[0]
        if end > self.max_len:
            raise ValueError(
                f"preallocated KV cache has {self.max_len} slots reserved but {end} are needed: "
                f"create the cache with a larger max_len"
            )
        self.k[layer][start:end] = k
        self.v[layer][start:end] = v

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """Append this call's k, v, then attend its queries over the whole cached history."""
        start = self.append(layer, k, v)
        keys, values = self.keys(layer).to(q.dtype), self.values(layer).to(q.dtype)
        mask = cached_causal_mask(start, q.shape[0])
        # SDPA wants [heads, T, D]; the [T, S] mask broadcasts over heads.
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1),
            keys.transpose(0, 1),
            values.transpose(0, 1),
            attn_mask=mask,
            enable_gqa=True,
        )
        return out.transpose(0, 1)


@torch.no_grad()
def stream_cached(
    model: Transformer,
    prompt_ids: list[int],
    max_new_tokens: int,
    cache: ContiguousKVCache,
    temperature: float = 0.0,
    seed: int = 0,
    eos_id: int | None = None,
) -> Iterator[int]:
    """Yield new token ids one at a time: prefill the prompt in one pass, then one token per
    pass."""
    check_request(model, prompt_ids, max_new_tokens)
    if cache.length:
        raise ValueError(
            f"the cache already holds {cache.length} tokens: use a fresh cache for each sequence"
        )
    if max_new_tokens <= 0:
        return
    # Same generator convention as stream_naive, so the same seed draws the same tokens.
    generator = torch.Generator().manual_seed(seed)
    logits = model(torch.tensor(prompt_ids), torch.arange(len(prompt_ids)), cache)[-1]
    for step in range(max_new_tokens):
        token = pick_token(logits, temperature, generator)
        yield token
        if token == eos_id or step == max_new_tokens - 1:
            return  # no forward pass for a token nobody will read
        logits = model(torch.tensor([token]), torch.tensor([cache.length]), cache)[-1]


def generate_cached(
    model: Transformer,
    prompt_ids: list[int],
    max_new_tokens: int,
    cache: ContiguousKVCache,
    **kwargs,
) -> list[int]:
    return list(stream_cached(model, prompt_ids, max_new_tokens, cache, **kwargs))
