"""TODO split from cuda_paged_attention.py"""

from __future__ import annotations

import torch

from minivllm.attention.cuda.launch import DEFAULT_THREADS, paged_attention
from minivllm.attention.cuda.simulator import SIMULATOR, WARP_SIZE
from minivllm.attention.torch_backend import TorchPagedAttention


class CudaPagedAttention(TorchPagedAttention):
    """The engine's attention backend with its decodes on the kernel above (v1). Writing the new K/V
    and attending prefill chunks stay the torch reference's: the kernel is a decode kernel, one
    query per sequence. `EngineConfig(attention_backend="cuda")` picks it; on a CPU it runs in the
    simulator, which is only fast enough for small checks."""

    def _attend_decodes(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        kv, nd = self.storage.kv[layer], self.batch.num_decodes
        return paged_attention(
            q.contiguous(),
            kv[0],
            kv[1],
            self.batch.block_tables[:nd].to(torch.int32),
            self.batch.context_lens[:nd].to(torch.int32),
            threads=_ENGINE_THREADS,
        )


# One warp per block in the simulator (each CUDA thread is a Python thread there); four on a GPU.
_ENGINE_THREADS = WARP_SIZE if SIMULATOR else DEFAULT_THREADS
