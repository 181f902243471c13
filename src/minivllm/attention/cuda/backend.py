"""Chapter 07's kernel as an engine attention backend, registered as "cuda"."""

from __future__ import annotations

import torch

from minivllm.attention.batch import VarlenBatch
from minivllm.attention.cuda.launch import DEFAULT_THREADS, paged_attention
from minivllm.attention.cuda.simulator import SIMULATOR, WARP_SIZE
from minivllm.attention.storage import PagedKVStorage
from minivllm.attention.torch_backend import PrefillAttention


class CudaPagedAttention:
    """The engine's attention backend with its decodes on the kernel (v1). Writing the new K/V and
    attending prefill chunks stay the torch reference's (`PrefillAttention`): the kernel is a decode
    kernel, one query per sequence. `EngineConfig(attention_backend="cuda")` picks it; on a CPU it
    runs in the simulator, which is only fast enough for small checks."""

    def __init__(self, storage: PagedKVStorage, batch: VarlenBatch) -> None:
        self.storage, self.batch = storage, batch
        nd = batch.num_decodes
        self.block_tables = batch.block_tables[:nd].to(torch.int32)
        self.context_lens = batch.context_lens[:nd].to(torch.int32)
        self.prefills = PrefillAttention(storage, batch) if nd < batch.num_seqs else None

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        nd = self.batch.num_decodes
        self.storage.write(layer, self.batch.slot_mapping, k, v)
        out = torch.empty_like(q)
        if nd:
            key_cache, value_cache = self.storage.kv[layer]
            out[:nd] = paged_attention(
                q[:nd].contiguous(),
                key_cache,
                value_cache,
                self.block_tables,
                self.context_lens,
                threads=_ENGINE_THREADS,
            )
        if self.prefills is not None:
            out[nd:] = self.prefills(layer, q[nd:])
        return out


# One warp per block in the simulator (each CUDA thread is a Python thread there); four on a GPU.
_ENGINE_THREADS = WARP_SIZE if SIMULATOR else DEFAULT_THREADS
