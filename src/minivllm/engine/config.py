"""`EngineConfig`: the cache, the scheduler, the device and the attention backend of an engine."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from minivllm.attention.backend import backend_device, backend_names
from minivllm.kv.block_manager import KV_LAYOUTS
from minivllm.runner.speculative import SpeculativeConfig
from minivllm.sched.scheduler import SchedulerConfig


@dataclass(frozen=True)
class EngineConfig:
    num_blocks: int = 2048  # 2048 blocks x 16 tokens: 32k tokens, ~100 MB of K/V for the target
    block_size: int = 16
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    seed: int = 0  # requests without a seed get one derived from this and their id
    dtype: torch.dtype = torch.float32
    speculative: SpeculativeConfig | None = None  # None: plain decoding, one target pass per token
    # "cpu", "cuda", or "auto": the GPU when torch sees one, unless what else is asked for runs on
    # a CPU only (the numba backend, forward workers)
    device: str = "auto"
    # A name from minivllm.attention.backend: "torch" (the reference), "cuda" (chapter 07's kernel
    # for decodes; on a CPU it runs in numba's simulator, for small checks only), "numba" (the
    # native CPU kernel), or "auto": the CUDA kernel on a GPU, the numba kernel on a CPU (the
    # reference for a cache that is not float32).
    attention_backend: str = "auto"
    # Run a copy of the model with q, k, v as one matmul and gate, up as another (model/fused.py,
    # chapter 07): bit-for-bit the same logits, five matmul calls per layer become two. The copy
    # is taken when the engine starts: later changes to the caller's weights do not reach it.
    fuse_projections: bool = True
    # Processes that share each forward pass on a CPU, each running whole sequences on one thread
    # (runner/workers.py, chapter 07): 1 runs it here on torch's threads; 2 uses a second core
    # where threads inside each small operation hardly do. Workers start with the engine (a few
    # seconds) and stop with `LLMEngine.close()`.
    forward_processes: int = 1
    # How sequences hold K/V blocks (kv/block_manager.py): "paged" grows each sequence a block at
    # a time and shares blocks (prefix caching, n > 1 forks); "contiguous" is the layout before
    # paging (`--kv basic`): every admitted sequence reserves the blocks of the model's whole
    # context (max_model_len) until it finishes, and shares none -- no prefix caching, and a
    # request's n samples each compute the prompt.
    kv_layout: str = "paged"
    # On a CUDA device, decode steps replay CUDA graphs captured at start (runner/cuda_graph.py):
    # True runs every step eagerly, as vLLM's flag. Graphs are never used on a CPU.
    enforce_eager: bool = False

    def __post_init__(self) -> None:
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(
                f"EngineConfig.kv_layout must be one of {KV_LAYOUTS}, got {self.kv_layout!r}"
            )
        if self.kv_layout == "contiguous" and self.scheduler.enable_prefix_caching:
            raise ValueError(
                "prefix caching shares blocks between sequences, and the contiguous KV layout "
                "shares none: turn enable_prefix_caching off or use kv_layout='paged'"
            )
        if not isinstance(self.forward_processes, int) or self.forward_processes < 1:
            raise ValueError(
                f"EngineConfig.forward_processes must be an int >= 1, got "
                f"{self.forward_processes!r}"
            )
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(
                f"EngineConfig.device must be 'auto', 'cpu' or 'cuda', got {self.device!r}"
            )
        if self.attention_backend != "auto" and self.attention_backend not in backend_names():
            names = ", ".join(repr(n) for n in ("auto", *backend_names()))
            raise ValueError(
                f"EngineConfig.attention_backend must be one of {names}, "
                f"got {self.attention_backend!r}"
            )
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError(
                "EngineConfig.device is 'cuda' but torch sees no GPU: use 'cpu' or 'auto'"
            )


def _resolve_device(config: EngineConfig) -> str:
    """The device "auto" means for this config (an explicit device stays as asked: a backend that
    cannot run there says so when the engine builds it)."""
    if config.device != "auto":
        return config.device
    cpu_only = config.forward_processes > 1 or backend_device(config.attention_backend) == "cpu"
    return "cuda" if torch.cuda.is_available() and not cpu_only else "cpu"
