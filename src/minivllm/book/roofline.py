"""The roofline of a decode step: the bytes it must move and the FLOPs it must do, per component,
against this machine's limits (chapter 07 and `benchmarks/step_profile.py`).

A component that must move `b` bytes and do `f` FLOPs can take no less than
max(b / bandwidth, f / peak FLOP/s) on this machine: its floor. `floors` gives the (bytes, FLOPs)
of each part of one decode step of a Llama-style model from its shapes alone (every weight read
once, every cached K/V row read once, activations read and written once); `measure_limits` reads
the two limits in a few seconds: stream bandwidth (a large float32 copy and add) and matmul FLOP/s
(a large float32 GEMM), the best of several runs, as this process sees them with its threads.

`model_dims` turns a `Transformer`'s config into the Hugging Face names the formulas (and vLLM's
`config.json`) use. Nothing here runs in the engine: torch is imported only to measure.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence


def model_dims(model) -> dict:
    """A minivllm `Transformer`'s shapes under the Hugging Face config names."""
    c = model.config
    return {
        "hidden_size": c.d_model,
        "head_dim": c.head_dim,
        "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.n_kv_heads,
        "intermediate_size": c.d_ff,
        "vocab_size": c.vocab_size,
        "num_hidden_layers": c.n_layers,
    }


def matmul_names(config: dict) -> dict[tuple[int, int], str]:
    """(out_features, in_features) of each projection of the model -> its component (q, k and v
    fused into one matmul, gate and up into another, as the engine and vLLM run them)."""
    d, hd = config["hidden_size"], config["head_dim"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    ff = config["intermediate_size"]
    names = {
        ((heads + 2 * kv_heads) * hd, d): "qkv matmul",
        (d, heads * hd): "o matmul",
        (2 * ff, d): "gate/up matmul",
        (d, ff): "down matmul",
        (config["vocab_size"], d): "LM head",
    }
    if len(names) != 5:
        raise ValueError(f"two projections of this model share a shape: {names}")
    return names


def attention_traffic(
    contexts: Sequence[float],
    layers: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    element_bytes: int = 4,
) -> tuple[float, float]:
    """(bytes, FLOPs) of one decode step's attention over a paged K/V cache, all `layers`: each
    sequence decodes one token, whose query attends `contexts[i]` cached tokens. Per layer and
    sequence: every cached K and V row read once (its `kv_heads` heads: under grouped-query
    attention a K/V head is read once for all the query heads sharing it), the new token's K and V
    written to their slot, its query read and its output written (`heads` heads each); q.k and p.v
    are a multiply-add per element of every query head for every cached token."""
    if min(layers, heads, kv_heads, head_dim, element_bytes) < 1 or heads % kv_heads:
        raise ValueError(
            f"want positive sizes and heads a multiple of kv_heads, got layers {layers}, heads "
            f"{heads}, kv_heads {kv_heads}, head_dim {head_dim}, element_bytes {element_bytes}"
        )
    if any(context < 0 for context in contexts):
        raise ValueError(f"a context cannot be negative: {list(contexts)}")
    # EXERCISE ch07.2: bytes and FLOPs of one decode step's attention, every sequence and layer
    ### BEGIN SOLUTION
    kv_row = 2 * kv_heads * head_dim * element_bytes  # one token's K and V in one layer
    query_row = heads * head_dim * element_bytes
    bytes_per_layer = flops_per_layer = 0.0
    for context in contexts:
        bytes_per_layer += context * kv_row + kv_row  # the cache read, the new row written
        bytes_per_layer += 2 * query_row  # the query in, the output out
        flops_per_layer += 2 * 2.0 * context * heads * head_dim  # q.k, then p.v
    return layers * bytes_per_layer, layers * flops_per_layer
    ### END SOLUTION


def floors(
    config: dict, batch: int, context_sum: float, element_bytes: int = 4
) -> dict[str, tuple[float, float]]:
    """(bytes, FLOPs) each forward component must move and do at this batch, one token per
    sequence attending `context_sum` cached tokens in all (shared evenly: the floor is linear in
    each context); sampling reads the logits. `element_bytes`: 4 for float32."""
    f = element_bytes
    d, hd, layers = config["hidden_size"], config["head_dim"], config["num_hidden_layers"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    ff, vocab = config["intermediate_size"], config["vocab_size"]
    out: dict[str, tuple[float, float]] = {}
    for (n_out, n_in), name in matmul_names(config).items():
        times = 1 if name == "LM head" else layers
        bytes_ = f * (n_out * n_in + batch * n_in + batch * n_out)
        out[name] = (times * bytes_, times * 2.0 * batch * n_in * n_out)
    out["attention"] = attention_traffic(
        [context_sum / batch] * batch, layers, heads, kv, hd, element_bytes=f
    )
    out["norms"] = ((2 * layers + 1) * f * (2 * batch * d + d), (2 * layers + 1) * 4.0 * batch * d)
    rope = 2 * batch * (heads + 2 * kv) * hd  # q and k read and written (+ cos, sin)
    out["RoPE"] = (layers * f * rope, layers * 3.0 * batch * (heads + kv) * hd)
    out["SiLU*mul"] = (layers * f * 3 * batch * ff, layers * 5.0 * batch * ff)
    out["residual adds"] = (2 * layers * f * 3 * batch * d, 2 * layers * 1.0 * batch * d)
    out["embedding"] = (f * 2 * batch * d, 0.0)
    out["other ops"] = (f * 2 * batch * vocab, 0.0)  # the logits rows, copied out once
    out["sampling"] = (f * batch * vocab, 1.0 * batch * vocab)  # greedy: one pass over the logits
    return out


def floor_seconds(bytes_: float, flops: float, bandwidth_GBps: float, peak_GFLOPs: float) -> float:
    """The least time `bytes_` and `flops` can take: the slower of the two limits."""
    return max(bytes_ / (bandwidth_GBps * 1e9), flops / (peak_GFLOPs * 1e9))


def best_seconds(function: Callable[[], object], repeats: int) -> float:
    """The fastest of `repeats` calls (after one untimed call: first touch, thread pool)."""
    function()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        best = min(best, time.perf_counter() - started)
    return best


def stream_seconds(n: int, repeats: int = 5) -> tuple[float, float]:
    """Best seconds of a copy and of an add of `n`-element float32 tensors."""
    import torch

    a, b, c = torch.rand(n), torch.rand(n), torch.empty(n)
    copy_s = best_seconds(lambda: c.copy_(a), repeats)
    return copy_s, best_seconds(lambda: torch.add(a, b, out=c), repeats)


def measure_limits(
    elements: int = 64 * 2**20, gemm_size: int = 2048, repeats: int = 5
) -> dict[str, float]:
    """This machine's limits, best of `repeats` runs: stream bandwidth (a float32 copy and an add
    of `elements` elements, GB/s of bytes read + written; larger than the caches), the speed of a
    copy that stays in the caches (the engine's small weights and K/V may), and matmul FLOP/s (a
    `gemm_size`^3 float32 GEMM, under `gemm_<size>_GFLOPs`)."""
    import torch

    copy_s, add_s = stream_seconds(elements, repeats)
    # a copy of 2 Mi elements (8 MiB each way), ten times: how fast data in the caches is read
    cached = 2 * 2**20
    small_a, small_c = torch.rand(cached), torch.empty(cached)
    cache_copy_s = best_seconds(lambda: [small_c.copy_(small_a) for _ in range(10)], repeats) / 10
    x, w = torch.rand(gemm_size, gemm_size), torch.rand(gemm_size, gemm_size)
    gemm_s = best_seconds(lambda: torch.mm(x, w), max(1, repeats - 2))
    copy_bps, add_bps = 2 * 4 * elements / copy_s, 3 * 4 * elements / add_s
    return {
        "copy_GBps": round(copy_bps / 1e9, 2),
        "add_GBps": round(add_bps / 1e9, 2),
        "bandwidth_GBps": round(max(copy_bps, add_bps) / 1e9, 2),
        "cache_copy_GBps": round(2 * 4 * cached / cache_copy_s / 1e9, 2),
        f"gemm_{gemm_size}_GFLOPs": round(2 * gemm_size**3 / gemm_s / 1e9, 2),
    }
