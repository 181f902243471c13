"""`EngineConfig`: the cache, the scheduler, the device and the attention backend of an engine.

How big the K/V cache is and how long a sequence may be are settled once, when the engine starts
(`resolve_capacity`), from what the config asks and what the model is:

- the cache: `num_blocks` if given; else as many blocks as `kv_cache_memory_bytes` holds at the
  model's K/V bytes per token (kv/sizing.py); else 2048 blocks, but never more than 1 GiB of K/V
  (`DEFAULT_NUM_BLOCKS`, `DEFAULT_KV_CACHE_MEMORY`, and why below);
- the context, `max_model_len`: as asked, never beyond the model's own (config.json's
  max_position_embeddings) nor beyond what the cache holds for one sequence; not asked, the model's
  own, capped by the cache when the engine sized the cache from memory.

The engine keeps the result as its `config` (`num_blocks` and `max_model_len` filled in), so the
request checks, the block manager, the CUDA graphs, the server and `minivllm chat` read one number.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from minivllm.attention.backend import backend_device, backend_names
from minivllm.kv.block_manager import KV_LAYOUTS
from minivllm.kv.sizing import CacheSize, blocks_for_memory
from minivllm.model.transformer import ModelConfig
from minivllm.runner.speculative import SpeculativeConfig
from minivllm.sched.scheduler import SchedulerConfig

# The cache when the config names neither num_blocks nor a memory budget. 2048 blocks of 16 (32k
# tokens) is what the book's workloads were written against: 96 MiB of K/V for the shipped target
# model, whose outputs must not change. A real checkpoint keeps ~1000x more per token (Qwen3-0.6B in
# bfloat16: 112 KiB), so 2048 blocks would be 3.5 GiB allocated up front, and 4 GiB for Llama-3-8B,
# more than a laptop spares beside the weights. The default therefore also stops at 1 GiB -- about
# the weights of a 0.6B model in bfloat16; 9360 tokens of Qwen3-0.6B, 8192 of Llama-3-8B -- and says
# so at start-up; `kv_cache_memory_bytes` (`--kv-cache-memory`) asks for more.
DEFAULT_NUM_BLOCKS = 2048
DEFAULT_KV_CACHE_MEMORY = 2**30


@dataclass(frozen=True)
class EngineConfig:
    # KV-cache blocks of `block_size` tokens. None: from kv_cache_memory_bytes, or the default
    # above. Given, it wins over a budget (as vLLM's num_gpu_blocks_override), and it is taken as
    # an experiment with the cache's size (chapter 05 makes it smaller than one sequence on
    # purpose): the context is not cut to it, and a sequence that outgrows it ends "cache_full".
    num_blocks: int | None = None
    block_size: int = 16
    # vLLM's name: the bytes of K/V to allocate (the draft model's included, with speculative
    # decoding by a draft model); the cache gets the whole blocks that fit.
    kv_cache_memory_bytes: int | None = None
    # The longest sequence, prompt + output, the engine accepts. None: the model's own context,
    # capped by the cache when the cache was sized from memory. More than the model's context, or
    # than the cache holds, is refused.
    max_model_len: int | None = None
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    seed: int = 0  # requests without a seed get one derived from this and their id
    dtype: torch.dtype = torch.float32
    speculative: SpeculativeConfig | None = None  # None: plain decoding, one target pass per token
    # "cpu", "cuda", or "auto": the GPU when torch sees one, unless what else is asked for runs on
    # a CPU only (the numba backend, forward workers, compile_forward)
    device: str = "auto"
    # A name from minivllm.attention.backend: "torch" (the reference), "cuda" (chapter 08's kernel
    # for decodes; on a CPU it runs in numba's simulator, for small checks only), "numba" (the
    # native CPU kernel), or "auto": the CUDA kernel on a GPU, the numba kernel on a CPU (the
    # reference for a cache that is not float32).
    attention_backend: str = "auto"
    # Run a copy of the model with q, k, v as one matmul and gate, up as another (model/fused.py,
    # chapter 07): bit-for-bit the same logits, five matmul calls per layer become two. The copy
    # is taken when the engine starts: later changes to the caller's weights do not reach it. A
    # model the engine loaded itself (`LLM(folder)`, the CLI) is fused in place: no second copy.
    fuse_projections: bool = True
    # Run the forward under torch.compile (runner/compiled.py), as vLLM's default mode: inductor
    # fuses the small ops between the matmuls and runs the graph without Python; attention stays
    # the backend's, as one opaque op. The engine compiles as it is built (about 20 s on two cores
    # for the book's model, minutes for a 28-layer one; inductor's disk cache serves later ones),
    # and the logits move by float32 rounding. On the CPU, in one process: a GPU engine replays
    # CUDA graphs instead.
    compile_forward: bool = False
    # Processes that share each forward pass on a CPU, each running whole sequences on one thread
    # (runner/workers.py, chapter 11): 1 runs it here on torch's threads; 2 uses a second core
    # where threads inside each small operation hardly do. Workers start with the engine (a few
    # seconds) and stop with `LLMEngine.close()`.
    forward_processes: int = 1
    # Ranks that split the model between them, Megatron-style (runner/tensor_parallel.py): each
    # holds its share of every layer's heads and MLP units and its own K/V pool for its heads,
    # and they meet in two all-reduces per layer. The ranks are processes spawned on this
    # machine when the engine starts (or started by torchrun), gloo on a CPU, NCCL on GPUs; the
    # scheduler and the sampler run once, in this process. Stopped by `LLMEngine.close()`. The
    # cache's blocks are counted at the whole model's K/V bytes per token, so a memory budget is
    # shared out between the ranks, each holding its heads' part of every block (with fewer K/V
    # heads than ranks, a rank holds one whole head: more than its share).
    tensor_parallel_size: int = 1
    # Whole engine replicas on a CPU (engine/data_parallel.py, vLLM's name): each runs its own
    # requests -- scheduler, K/V pool and steps of its own -- on its share of torch's threads, in
    # its own process (replica 0 in this one), and they never meet. More throughput from a
    # machine's cores, not a faster request; N replicas hold N copies of the weights and of the
    # cache. `LLM` builds a `DataParallelEngine` for it; an `LLMEngine` is one replica.
    data_parallel_size: int = 1
    # A tensor-parallel step whose collectives wait longer than this (a rank hung) fails.
    distributed_timeout_s: float = 300.0
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
        for name in ("num_blocks", "kv_cache_memory_bytes", "max_model_len"):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or value < 1
            ):
                raise ValueError(f"EngineConfig.{name} must be None or an int >= 1, got {value!r}")
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
        tp = self.tensor_parallel_size
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"EngineConfig.tensor_parallel_size must be an int >= 1, got {tp!r}")
        if tp > 1 and self.forward_processes > 1:
            raise ValueError(
                "tensor_parallel_size and forward_processes are two ways to use more processes: "
                "choose one"
            )
        dp = self.data_parallel_size
        if not isinstance(dp, int) or isinstance(dp, bool) or dp < 1:
            raise ValueError(f"EngineConfig.data_parallel_size must be an int >= 1, got {dp!r}")
        if dp > 1 and (tp > 1 or self.forward_processes > 1 or self.device == "cuda"):
            raise ValueError(
                "data_parallel_size runs whole replicas on the CPU's cores, one process each: "
                "use it with device 'cpu' or 'auto', tensor_parallel_size 1 and "
                "forward_processes 1"
            )
        if tp > 1 and self.speculative is not None and self.speculative.method == "draft":
            raise ValueError(
                "speculative decoding with a draft model is not split over tensor-parallel "
                "ranks: use method 'ngram', or tensor_parallel_size=1"
            )
        if not self.distributed_timeout_s > 0:
            raise ValueError(
                f"EngineConfig.distributed_timeout_s must be > 0, got {self.distributed_timeout_s}"
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
        if self.compile_forward and (self.device == "cuda" or tp > 1 or self.forward_processes > 1):
            raise ValueError(
                "compile_forward runs the forward on the CPU, in this process: use device 'cpu' "
                "or 'auto', with tensor_parallel_size and forward_processes 1 (a GPU engine "
                "replays CUDA graphs instead)"
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
    cpu_only = (
        config.forward_processes > 1
        or config.data_parallel_size > 1
        or config.compile_forward
        or backend_device(config.attention_backend) == "cpu"
    )
    # a GPU per tensor-parallel rank, or the ranks run on the CPU
    tp = config.tensor_parallel_size
    enough = torch.cuda.is_available() and (tp == 1 or torch.cuda.device_count() >= tp)
    return "cuda" if enough and not cpu_only else "cpu"


def resolve_capacity(
    config: EngineConfig, model_config: ModelConfig, bytes_per_token: int
) -> tuple[CacheSize, int]:
    """The cache (blocks, and what they hold) and max_model_len of an engine running a model with
    context `model_config.max_seq_len` and `bytes_per_token` of K/V per token (see the module
    docstring). Raises ValueError, saying what to change, for a length the model or the cache
    cannot take."""
    context, block_size = model_config.max_seq_len, config.block_size
    asked = config.max_model_len
    if asked is not None and asked > context:
        raise ValueError(
            f"max_model_len {asked} is longer than the model's context of {context} tokens "
            f"(max_position_embeddings in its config.json): ask for at most {context}"
        )
    if config.num_blocks is not None:
        cache = CacheSize(config.num_blocks, block_size, bytes_per_token)
    else:
        budget = config.kv_cache_memory_bytes
        if budget is None:
            budget = min(DEFAULT_NUM_BLOCKS * block_size * bytes_per_token, DEFAULT_KV_CACHE_MEMORY)
        cache = blocks_for_memory(budget, block_size, bytes_per_token)
    if asked is None:
        sized_from_memory = config.num_blocks is None
        return cache, min(context, cache.num_tokens) if sized_from_memory else context
    if asked > cache.num_tokens:
        needed = -(-asked // block_size)
        needed_bytes = needed * block_size * bytes_per_token
        raise ValueError(
            f"max_model_len {asked} needs {needed} blocks of {block_size} for one sequence, but "
            f"the KV cache is {cache.describe()}: raise kv_cache_memory_bytes "
            f"(--kv-cache-memory) to at least {needed_bytes} bytes "
            f"({needed_bytes / 2**20:.1f} MiB) or num_blocks to {needed}, or lower max_model_len"
        )
    return cache, asked
