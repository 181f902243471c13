"""Chapter 07's kernel as an engine attention backend, registered as "cuda"."""

from __future__ import annotations

import torch

from minivllm.attention.batch import VarlenBatch
from minivllm.attention.cuda.launch import DEFAULT_THREADS, paged_attention
from minivllm.attention.cuda.simulator import SIMULATOR, WARP_SIZE
from minivllm.attention.storage import PagedKVStorage
from minivllm.attention.torch_backend import TorchPagedAttention

# One warp per block in the simulator (each CUDA thread is a Python thread there); four on a GPU.
ENGINE_THREADS = WARP_SIZE if SIMULATOR else DEFAULT_THREADS


class KernelDecodeAttention:
    """The decode group on the kernel (v1), in the place of the reference's `DecodeAttention`."""

    def __init__(self, storage: PagedKVStorage, batch: VarlenBatch) -> None:
        nd = batch.num_decodes
        self.storage = storage
        self.block_tables = batch.block_tables[:nd].to(torch.int32)
        self.context_lens = batch.context_lens[:nd].to(torch.int32)

    def __call__(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        key_cache, value_cache = self.storage.kv[layer]
        return paged_attention(
            q.contiguous(),
            key_cache,
            value_cache,
            self.block_tables,
            self.context_lens,
            threads=ENGINE_THREADS,
        )


class CudaPagedAttention(TorchPagedAttention):
    """The engine's attention backend with its decodes on the kernel: the torch reference with its
    decode piece swapped. Writing the new K/V and attending prefill chunks stay the reference's
    (the kernel is a decode kernel, one query per sequence). `EngineConfig(attention_backend=
    "cuda")` picks it; on a CPU it runs in the simulator, which is only fast enough for small
    checks."""

    def __init__(self, storage: PagedKVStorage, batch: VarlenBatch) -> None:
        super().__init__(storage, batch, decodes=KernelDecodeAttention)
