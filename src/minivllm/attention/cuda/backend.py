"""Chapter 08's kernel as an engine attention backend, registered as "cuda" (v3); v4, the tiled
kernel, as "cuda-v4", which "auto" never picks: it becomes the default once a GPU run has measured
it against v3."""

from __future__ import annotations

import torch

from minivllm.attention.batch import VarlenBatch
from minivllm.attention.cuda.launch import DEFAULT_THREADS, GroupedDecode, split_partition_size
from minivllm.attention.cuda.simulator import SIMULATOR, WARP_SIZE
from minivllm.attention.storage import PagedKVStorage
from minivllm.attention.torch_backend import TorchPagedAttention

# One warp per block in the simulator (each CUDA thread is a Python thread there); four on a GPU.
ENGINE_THREADS = WARP_SIZE if SIMULATOR else DEFAULT_THREADS


def engine_partition_size(
    num_seqs: int, num_kv_heads: int, longest: int, block_size: int, device: torch.device
) -> int | None:
    """Split-KV on a GPU when the batch has too few (sequence, K/V head) blocks to fill its SMs;
    one partition in the simulator, where there are no SMs to fill."""
    if SIMULATOR:
        return None
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return split_partition_size(num_seqs, num_kv_heads, longest, block_size, sms)


class KernelDecodeAttention:
    """The decode group on the v3 kernel (grouped flash-decoding), in the place of the reference's
    `DecodeAttention`. Built once per step: the block tables and context lengths are converted, and
    the launch sized, once for all the layers."""

    version = "v3"  # which of `GroupedDecode`'s kernels

    def __init__(self, storage: PagedKVStorage, batch: VarlenBatch) -> None:
        nd = batch.num_decodes
        self.storage = storage
        context_lens = batch.context_lens[:nd]
        config = storage.config
        longest = batch.max_decode_context_len  # known on the host: no read from the device
        self.decode = GroupedDecode(
            batch.block_tables[:nd].to(torch.int32).contiguous(),
            context_lens.to(torch.int32).contiguous(),
            longest,
            partition_size=engine_partition_size(
                nd, config.n_kv_heads, longest, storage.block_size, context_lens.device
            ),
            num_heads=config.n_heads,
            num_kv_heads=config.n_kv_heads,
            head_dim=config.head_dim,
            block_size=storage.block_size,
            threads=ENGINE_THREADS,
            version=self.version,
        )

    def __call__(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        key_cache, value_cache = self.storage.kv[layer]
        return self.decode(q.contiguous(), key_cache, value_cache)


class CudaPagedAttention(TorchPagedAttention):
    """The engine's attention backend with its decodes on the kernel: the torch reference with its
    decode piece swapped. Writing the new K/V and attending prefill chunks stay the reference's
    (the kernel is a decode kernel, one query per sequence). `EngineConfig(attention_backend=
    "cuda")` picks it; on a CPU it runs in the simulator, which is only fast enough for small
    checks."""

    def __init__(self, storage: PagedKVStorage, batch: VarlenBatch) -> None:
        super().__init__(storage, batch, decodes=KernelDecodeAttention)


class TiledKernelDecodeAttention(KernelDecodeAttention):
    """The decode group on v4 (`tiled.py`: fewer live values per thread)."""

    version = "v4"


class CudaTiledPagedAttention(TorchPagedAttention):
    """`CudaPagedAttention` with its decodes on v4: `EngineConfig(attention_backend="cuda-v4")`."""

    def __init__(self, storage: PagedKVStorage, batch: VarlenBatch) -> None:
        super().__init__(storage, batch, decodes=TiledKernelDecodeAttention)
