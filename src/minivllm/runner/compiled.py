"""The forward pass under `torch.compile` (`EngineConfig(compile_forward=True)`, on the CPU).

A decode step of the book's model is a few hundred small torch ops, and at batch 64 each costs
more in dispatch, and in the Python between them, than in arithmetic: issue 32's profile put
about 2.4 ms of a 21 ms step in Python alone, more in norms, RoPE and SiLU x up that move a few
KiB each. vLLM's default (compiled) mode hands the model to inductor, which fuses those ops into
a few generated C++ loops and runs the graph without Python. This module does the same for
minivllm's model: in the book model's graph the embedding and the first RMSNorm become one loop,
RoPE one loop with the q/k/v split, and each residual add rides in its matmul (`addmm`); the
matmuls stay MKL's. A real model's big weights keep their packed oneDNN path (model/fused.py
`linear`) as another opaque op, `minivllm::packed_linear`, as vLLM keeps its `onednn_mm`. The
weights are graph inputs, not constants: another model of the same shapes runs on the same graph,
and a weight changed in place is seen.

Attention stays the engine's backend. It reads and writes the K/V cache, which the graph never
sees, so inductor gets it as one opaque op, `minivllm::attention`: the op calls the pass's
backend object, which `CompiledForward.__call__` puts in a thread-local before the graph runs
(a backend object holds its pass's block tables, so it cannot be a graph input). No other op of
the graph touches the cache, so nothing can be reordered around the write.

What it costs:
- the engine compiles as it starts (`warm_up`, as vLLM does: not in a request's first step): about
  20 s on two cores for the book's model, about 100 s for a random Qwen3-0.6B-shaped one (28
  layers). The batch's sizes are marked unbacked, so one graph serves every batch (a backed size
  would be specialised at 1: a second compile for a lone row). Inductor's cache on disk serves
  later processes in seconds;
- the logits move by float32 rounding (fused reductions sum in another order): greedy tokens can
  differ from the eager model's where two logits nearly tie.
"""

from __future__ import annotations

import shutil
import threading

import torch

from minivllm.attention.backend import BackendFactory
from minivllm.attention.storage import PagedKVStorage
from minivllm.kv.block_manager import BlockManager
from minivllm.model.transformer import Transformer
from minivllm.runner.batch import BatchPiece, pack_batch, run_model

_PASS = threading.local()  # .attention: the pass's backend object, while the graph runs
WARM_UP_SEQ = -1  # the warm-up pass's sequence id: no request has it


@torch.library.custom_op("minivllm::attention", mutates_args=())
def attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    """The pass's attention backend on one layer: writes the layer's new K/V into the cache (out
    of the graph's sight) and returns the attention output, `q`'s shape, contiguous (as the fake
    below promises inductor: a backend may hand back a transposed view)."""
    return _PASS.attention(layer, q, k, v).contiguous()


@attention_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def _attention_seam(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """What the traced model calls at its attention seam: the opaque op."""
    return attention_op(q, k, v, layer)


def cpp_compiler() -> str | None:
    """The C++ compiler inductor will call for CPU code (`CXX`, else g++), where it is installed."""
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        return shutil.which(get_cpp_compiler())
    except RuntimeError:  # torch found none it can use
        return None


class CompiledForward:
    """`model`'s forward, compiled: called like the model (`run_model` takes either), it runs
    the graph with `attention` behind the custom op. Compiles on first use: the engine makes that
    use `warm_up`, while it is built."""

    def __init__(self, model: Transformer) -> None:
        if cpp_compiler() is None:  # else inductor fails inside the first step
            raise ValueError(
                "compile_forward needs a C++ compiler (inductor writes C++ for the CPU) and none "
                "was found: install g++ (or name one in CXX), or run without compile_forward"
            )
        self.model = model
        self.graph = torch.compile(self._forward, dynamic=True)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor):
        return self.model(input_ids, positions, _attention_seam, rows=rows)

    def __call__(self, input_ids, positions, attention, rows=None) -> torch.Tensor:
        if rows is None:  # one graph input kind: every row's logits
            rows = torch.arange(input_ids.shape[-1], device=input_ids.device)
        for tensor in (input_ids, positions, rows):  # one graph for every batch size
            torch._dynamo.decorators.mark_unbacked(tensor, 0)
        _PASS.attention = attention
        try:
            return self.graph(input_ids, positions, rows)
        finally:
            _PASS.attention = None

    def warm_up(self, storage: PagedKVStorage, manager: BlockManager, backend: BackendFactory):
        """Compile now, on one token in a block `manager` lends and takes back (the front of its
        free queue, where it came from: later blocks go as they would have). The token's K/V
        lands in that free block, which a sequence writes before it reads."""
        manager.allocate(WARM_UP_SEQ, 1)
        try:
            batch = pack_batch([BatchPiece(WARM_UP_SEQ, 0, [0], 1)], manager)
            run_model(self, storage, batch, backend)
        finally:
            manager.free(WARM_UP_SEQ)
