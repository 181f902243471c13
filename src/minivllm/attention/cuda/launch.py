"""Launching chapter 08's kernels from torch tensors: argument checks, grid and shared-memory
sizes, v1 (one block per sequence and head), v2 (partitions, then the merge), v3 (grouped
flash-decoding, `grouped_paged_attention`, the engine's kernel) and v4 (v3 tiled, with fewer live
values per thread: `GroupedDecode(version="v4")`).

A launch must not stall the host. Three things would: reading a device tensor's value
(`int(context_lens.max())` waits for the GPU to finish everything queued before it); handing numba
a torch tensor directly (numba then synchronises on the stream the tensor names, as the CUDA array
interface's default asks); and per-call copies. So v3 takes the longest context from the host,
which knows it from the batch metadata, converts its arguments with `device_view` (no copy, no
sync) and launches on torch's current stream. `GroupedDecode` does the checks and the conversions
that stay the same over one decode step once, for all the layers.
"""

from __future__ import annotations

import torch
from numba import cuda

from minivllm.attention.cuda.grouped import (
    default_lanes_per_token,
    grouped_decode_kernel,
    shared_words,
)
from minivllm.attention.cuda.kernels import (
    merge_partitions,
    paged_attention_v1,
    paged_attention_v2,
)
from minivllm.attention.cuda.simulator import SIMULATOR, WARP_SIZE, _simulator_pace
from minivllm.attention.cuda.tiled import tiled_decode_kernel, tiled_layout, tiled_shared_words

# -- launchers -------------------------------------------------------------------------------------
DEFAULT_THREADS = 128  # 4 warps per block
GROUPED_VERSIONS = ("v3", "v4")  # the grouped decode kernels `GroupedDecode` can launch
SHARED_LIMIT = 48 * 1024  # dynamic shared memory a block may have without opting in to more


def shared_bytes(head_dim: int, threads: int, tokens: int) -> int:
    """Dynamic shared memory one v1/v2 thread block needs (float32): the scaled query, one
    reduction slot per warp, and a score for each of the `tokens` it attends to."""
    return (head_dim + threads // WARP_SIZE + tokens) * 4


def device_view(tensor: torch.Tensor):
    """The tensor as a kernel argument, over the same memory: a numba device array on a GPU (made
    with `sync=False`: torch orders the work on its stream, and a sync here would stall the host),
    and a simulated device array over the CPU tensor's numpy view in the simulator (which would
    otherwise copy a numpy argument in and back out on every launch)."""
    if not tensor.is_contiguous():
        raise ValueError(f"kernel arguments must be contiguous, got strides {tensor.stride()}")
    if tensor.is_cuda:
        return cuda.as_cuda_array(tensor.detach(), sync=False)
    if not SIMULATOR or tensor.device.type != "cpu":
        where = "the simulator, on CPU tensors" if SIMULATOR else "the GPU"
        raise ValueError(f"the kernels run on {where}: got a tensor on {tensor.device}")
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

    return FakeCUDAArray(tensor.detach().numpy())


_STREAMS: dict[int, object] = {}


def torch_stream(device: torch.device):
    """torch's current stream on `device`, as a numba stream (cached by handle): a kernel launched
    on it is ordered with the torch work around it, and joins a CUDA-graph capture in progress."""
    if SIMULATOR:
        return 0
    handle = torch.cuda.current_stream(device).cuda_stream
    if handle not in _STREAMS:
        _STREAMS[handle] = cuda.external_stream(handle)
    return _STREAMS[handle]


def _kernel_arg(tensor: torch.Tensor):
    """What a v1/v2 kernel takes: `device_view` of the tensor."""
    return device_view(tensor)


def _check(q, key_cache, value_cache, block_tables, context_lens, threads) -> int:
    """Shapes and threads, without reading any tensor's values; returns the GQA group."""
    if q.dim() != 3:
        raise ValueError(f"q must be [num_seqs, num_heads, head_dim], got {tuple(q.shape)}")
    num_seqs, num_heads, head_dim = q.shape
    if (
        key_cache.shape != value_cache.shape
        or key_cache.dim() != 4
        or key_cache.shape[3] != head_dim
    ):
        raise ValueError(
            f"caches must both be [num_blocks, block_size, n_kv_heads, {head_dim}], got "
            f"{tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
        )
    if num_heads % key_cache.shape[2]:
        raise ValueError(
            f"{num_heads} query heads cannot share {key_cache.shape[2]} K/V heads evenly"
        )
    if block_tables.shape[0] != num_seqs or context_lens.shape != (num_seqs,):
        raise ValueError(
            f"block_tables [{num_seqs}, max_blocks] and context_lens [{num_seqs}] expected, got "
            f"{tuple(block_tables.shape)} and {tuple(context_lens.shape)}"
        )
    if threads % WARP_SIZE or not WARP_SIZE <= threads <= 1024:
        raise ValueError(
            f"threads per block must be a multiple of {WARP_SIZE} up to 1024, got {threads}"
        )
    return num_heads // key_cache.shape[2]


def _check_lengths(context_lens, longest: int, capacity: int) -> None:
    """The longest context against the tables' capacity; the lengths themselves only where reading
    them is free (a CPU tensor): on a GPU it would wait for the device, and a tensor on the meta
    device (the tests' stand-in for one) has no values to read."""
    if not 1 <= longest <= capacity:
        raise ValueError(
            f"max_context_len must be in 1..{capacity} (the block tables' capacity), got {longest}"
        )
    if context_lens.device.type == "cpu" and (
        int(context_lens.min()) < 1 or int(context_lens.max()) > longest
    ):
        raise ValueError(
            f"context lengths must be in 1..{longest} (max_context_len), got "
            f"{context_lens.tolist()}"
        )


def paged_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float | None = None,
    partition_size: int | None = None,
    threads: int = DEFAULT_THREADS,
    out: torch.Tensor | None = None,
    max_context_len: int | None = None,
) -> torch.Tensor:
    """One query per sequence, `q` `[num_seqs, num_heads, head_dim]`, against its cached keys and
    values: `key_cache`, `value_cache` `[num_blocks, block_size, n_kv_heads, head_dim]`,
    `block_tables` `[num_seqs, max_blocks]` and `context_lens` `[num_seqs]` (int32).
    `partition_size=None` runs v1; a number of tokens runs v2 with that partition size, then the
    merge. Returns `[num_seqs, num_heads, head_dim]`. `max_context_len` (the longest context, if
    the caller knows it) spares reading `context_lens` back from the device."""
    group = _check(q, key_cache, value_cache, block_tables, context_lens, threads)
    num_seqs, num_heads, head_dim = q.shape
    capacity = block_tables.shape[1] * key_cache.shape[1]
    if max_context_len is None:  # read back from the device (a sync): the teaching path
        longest = int(context_lens.max())
        if int(context_lens.min()) < 1 or longest > capacity:
            raise ValueError(
                f"context lengths must be in 1..{capacity} (the block tables' capacity), got "
                f"{context_lens.tolist()}"
            )
    else:
        longest = max_context_len
        _check_lengths(context_lens, longest, capacity)
    scale = head_dim**-0.5 if scale is None else scale
    out = torch.empty_like(q) if out is None else out
    tables, lens = (
        block_tables.to(torch.int32).contiguous(),
        context_lens.to(torch.int32).contiguous(),
    )
    args = [_kernel_arg(t) for t in (q, key_cache, value_cache, tables, lens)]
    stream = torch_stream(q.device)
    shared = shared_bytes(head_dim, threads, longest if partition_size is None else partition_size)
    if shared > SHARED_LIMIT:
        raise ValueError(
            f"a thread block would need {shared} bytes of shared memory for its scores (limit "
            f"{SHARED_LIMIT}): use partitions (partition_size) of fewer tokens"
        )
    if partition_size is None:
        with _simulator_pace():
            paged_attention_v1[(num_seqs, num_heads), threads, stream, shared](
                _kernel_arg(out), *args, scale, group
            )
        return out
    parts = -(-longest // partition_size)
    partial = torch.empty(
        num_seqs, num_heads, parts, head_dim, dtype=torch.float32, device=q.device
    )
    max_logits = torch.empty(num_seqs, num_heads, parts, dtype=torch.float32, device=q.device)
    exp_sums = torch.empty_like(max_logits)
    with _simulator_pace():
        paged_attention_v2[(num_seqs, num_heads, parts), threads, stream, shared](
            _kernel_arg(partial),
            _kernel_arg(max_logits),
            _kernel_arg(exp_sums),
            *args,
            scale,
            group,
            partition_size,
        )
        merge_partitions[(num_seqs, num_heads), min(threads, 128), stream](
            _kernel_arg(out), _kernel_arg(partial), _kernel_arg(max_logits), _kernel_arg(exp_sums)
        )
    return out


def split_partition_size(
    num_seqs: int,
    num_kv_heads: int,
    max_context_len: int,
    block_size: int,
    num_sms: int,
    min_partition: int = 128,
) -> int | None:
    """v3's partition size for a batch: None (one partition per context) when the grid already has
    two thread blocks per SM; else the size that splits the longest context into enough partitions
    to get there, a multiple of `block_size` and at least `min_partition` tokens (a partition's
    fixed costs, and the merge, must stay small next to its reads)."""
    blocks = num_seqs * num_kv_heads
    if blocks >= 2 * num_sms:
        return None
    parts = -(-2 * num_sms // blocks)
    partition = -(-max_context_len // (parts * block_size)) * block_size
    partition = max(partition, -(-min_partition // block_size) * block_size)
    return None if partition >= max_context_len else partition


class GroupedDecode:
    """v3 (or v4) for one decode step: checks, sizes and converts what every layer shares (block
    tables, context lengths, grid, shared memory) once; each call then attends one layer's queries.

    `max_context_len` is the longest context of the batch, which the host knows without asking the
    device. A context outside 1..max_context_len is refused here when `context_lens` is on the CPU;
    on a GPU the kernel writes NaN for that sequence rather than read outside its shared table.
    `partition_size=None` attends each context in one partition (one thread block per sequence and
    K/V head); a number of tokens, a multiple of the block size, splits the contexts (split-KV, for
    few and long sequences) and merges the partitions with v2's `merge_partitions`.

    `version="v4"` launches the tiled kernel (`tiled.py`), same grid and outputs.
    `lanes_per_token` is v3's knob; `tile`, `key_batch`, `value_batch` and `prefetch` are v4's
    (None: `tiled_layout`'s defaults); `max_registers` caps either."""

    def __init__(
        self,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        max_context_len: int,
        *,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        scale: float | None = None,
        partition_size: int | None = None,
        threads: int = DEFAULT_THREADS,
        lanes_per_token: int | None = None,
        max_registers: int | None = None,
        version: str = "v3",
        tile: int | None = None,
        key_batch: int | None = None,
        value_batch: int | None = None,
        prefetch: bool | None = None,
    ) -> None:
        if version not in GROUPED_VERSIONS:
            raise ValueError(f"version must be one of {GROUPED_VERSIONS}, got {version!r}")
        v3_knobs = {"lanes_per_token": lanes_per_token}
        v4_knobs = {
            "tile": tile,
            "key_batch": key_batch,
            "value_batch": value_batch,
            "prefetch": prefetch,
        }
        foreign = v4_knobs if version == "v3" else v3_knobs
        given = [name for name, value in foreign.items() if value is not None]
        if given:
            raise ValueError(f"{version} takes no {', '.join(given)}: another version's knob")
        for name, tensor in (("block_tables", block_tables), ("context_lens", context_lens)):
            if tensor.dtype != torch.int32:
                raise ValueError(f"{name} must be int32, got {tensor.dtype}")
        num_seqs = context_lens.shape[0]
        if num_heads % num_kv_heads:
            raise ValueError(
                f"{num_heads} query heads cannot share {num_kv_heads} K/V heads evenly"
            )
        if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs or context_lens.dim() != 1:
            raise ValueError(
                f"block_tables [{num_seqs}, max_blocks] and context_lens [{num_seqs}] expected, "
                f"got {tuple(block_tables.shape)} and {tuple(context_lens.shape)}"
            )
        if block_tables.device != context_lens.device:
            raise ValueError(
                f"block_tables on {block_tables.device} but context_lens on {context_lens.device}"
            )
        if threads % WARP_SIZE or not WARP_SIZE <= threads <= 1024:
            raise ValueError(
                f"threads per block must be a multiple of {WARP_SIZE} up to 1024, got {threads}"
            )
        lanes = default_lanes_per_token(head_dim) if lanes_per_token is None else lanes_per_token
        if lanes < 1 or lanes > WARP_SIZE or lanes & (lanes - 1) or head_dim % lanes:
            raise ValueError(
                f"lanes_per_token must be a power of two up to {WARP_SIZE} dividing head_dim "
                f"{head_dim}, got {lanes}"
            )
        _check_lengths(context_lens, max_context_len, block_tables.shape[1] * block_size)
        blocks_needed = -(-max_context_len // block_size)
        if partition_size is None:
            partition_size = blocks_needed * block_size
        elif partition_size <= 0 or partition_size % block_size:
            raise ValueError(
                f"partition_size must be a positive multiple of the block size {block_size}, got "
                f"{partition_size}"
            )
        group = num_heads // num_kv_heads
        table_entries = partition_size // block_size
        if version == "v3":
            self.shared = 4 * shared_words(table_entries, head_dim, group, threads, lanes)
            kernel = grouped_decode_kernel(head_dim, group, lanes, block_size, max_registers)
            # one kernel for both dtypes, reading element by element
            self._kernels = {size: (kernel, self.shared, size) for size in (2, 4)}
        else:
            # v4's layout depends on the element size (its loads are a number of bytes wide):
            # one kernel per cache dtype, sized here for both, with the alignment its loads need.
            knobs = {k: v for k, v in v4_knobs.items() if v is not None}
            self._kernels = {}
            for size in (2, 4):
                layout = tiled_layout(head_dim, size, threads, **knobs)
                words = tiled_shared_words(table_entries, group, layout)
                kernel = tiled_decode_kernel(head_dim, group, block_size, layout, max_registers)
                vector_bytes = max(layout.key_vector, layout.value_vector) * size
                self._kernels[size] = (kernel, 4 * words, vector_bytes)
            self.shared = max(shared for _, shared, _ in self._kernels.values())
        if self.shared > SHARED_LIMIT:
            raise ValueError(
                f"a thread block would need {self.shared} bytes of shared memory (limit "
                f"{SHARED_LIMIT}): use fewer threads or a smaller partition_size"
            )
        self.num_seqs, self.num_heads, self.num_kv_heads = num_seqs, num_heads, num_kv_heads
        self.head_dim, self.block_size, self.threads = head_dim, block_size, threads
        self.partition_size, self.max_context_len = partition_size, max_context_len
        self.parts = -(-max_context_len // partition_size)
        self.scale = head_dim**-0.5 if scale is None else scale
        self.version = version
        self.device = context_lens.device
        self.tables, self.lens = device_view(block_tables), device_view(context_lens)
        self.stream = torch_stream(self.device)
        # The partitions' maxima and sums (and with several partitions their outputs), kept for
        # every layer of the step: the layers run one after another on the same stream.
        stats_shape = (num_seqs, num_heads, self.parts)
        self.max_logits = torch.empty(stats_shape, dtype=torch.float32, device=self.device)
        self.exp_sums = torch.empty_like(self.max_logits)
        self.partial = (
            torch.empty(*stats_shape, head_dim, dtype=torch.float32, device=self.device)
            if self.parts > 1
            else None
        )
        self.stats = device_view(self.max_logits), device_view(self.exp_sums)
        self._cache_views: dict[tuple, object] = {}

    def _cache_view(self, cache: torch.Tensor):
        """A layer's cache, flattened, as a kernel argument: converted on its first use in this
        step and kept (the caches outlive the step; a view of the same memory, shape and dtype is
        the same argument, whichever tensor object brings it)."""
        key = (cache.data_ptr(), tuple(cache.shape), cache.dtype)
        if key not in self._cache_views:
            self._cache_views[key] = device_view(cache.view(-1))  # flat: see `grouped.py`
        return self._cache_views[key]

    def __call__(
        self,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of `q` `[num_seqs, num_heads, head_dim]` over one layer's caches `[num_blocks,
        block_size, num_kv_heads, head_dim]`, into `out` (a new tensor if None)."""
        expected_cache = (self.num_kv_heads, self.head_dim)
        if q.shape != (self.num_seqs, self.num_heads, self.head_dim):
            raise ValueError(
                f"q must be [{self.num_seqs}, {self.num_heads}, {self.head_dim}], got "
                f"{tuple(q.shape)}"
            )
        if (
            key_cache.shape != value_cache.shape
            or key_cache.dim() != 4
            or key_cache.shape[1] != self.block_size
            or tuple(key_cache.shape[2:]) != expected_cache
        ):
            raise ValueError(
                f"caches must both be [num_blocks, {self.block_size}, {self.num_kv_heads}, "
                f"{self.head_dim}], got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
            )
        if q.dtype not in (torch.float16, torch.float32) or {
            key_cache.dtype,
            value_cache.dtype,
        } != {q.dtype}:
            raise ValueError(
                f"q and the caches must share one dtype, float16 or float32, got {q.dtype}, "
                f"{key_cache.dtype} and {value_cache.dtype}"
            )
        if out is None:
            out = torch.empty_like(q)
        elif out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
            raise ValueError(
                f"out must be like q ({tuple(q.shape)}, {q.dtype}), got {tuple(out.shape)}, "
                f"{out.dtype}"
            )
        named = (("q", q), ("key_cache", key_cache), ("value_cache", value_cache), ("out", out))
        for name, tensor in named:
            if tensor.device != self.device:
                raise ValueError(f"{name} is on {tensor.device}, the block tables on {self.device}")
            if not tensor.is_contiguous():
                raise ValueError(f"{name} must be contiguous, got strides {tensor.stride()}")
        # One partition: its normalised output is the answer, written straight into `out`.
        partial = (
            out.view(self.num_seqs, self.num_heads, 1, self.head_dim)
            if self.partial is None
            else self.partial
        )
        kernel, shared, alignment = self._kernels[q.element_size()]
        for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
            if cache.data_ptr() % alignment:
                raise ValueError(
                    f"{self.version} reads {name} in {alignment}-byte vectors: its data must "
                    f"start on a multiple of {alignment} bytes, got address {cache.data_ptr():#x}"
                )
        grid = (self.num_seqs, self.num_kv_heads, self.parts)
        with _simulator_pace():
            kernel[grid, self.threads, self.stream, shared](
                device_view(partial),
                *self.stats,
                device_view(q),
                self._cache_view(key_cache),
                self._cache_view(value_cache),
                self.tables,
                self.lens,
                self.max_context_len,
                self.scale,
                self.partition_size,
            )
            if self.partial is not None:
                merge_partitions[(self.num_seqs, self.num_heads), 128, self.stream](
                    device_view(out), device_view(self.partial), *self.stats
                )
        return out


def grouped_paged_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    max_context_len: int,
    scale: float | None = None,
    partition_size: int | None = None,
    threads: int = DEFAULT_THREADS,
    lanes_per_token: int | None = None,
    out: torch.Tensor | None = None,
    version: str = "v3",
    tile: int | None = None,
) -> torch.Tensor:
    """v3 (grouped flash-decoding; v4, tiled, with `version="v4"` and its `tile`) in one call, the
    arguments of `paged_attention` plus the longest context, which the caller knows
    (`block_tables` and `context_lens` int32). For many layers of one step, build a
    `GroupedDecode` once and call it per layer."""
    if q.dim() != 3 or key_cache.dim() != 4:
        raise ValueError(
            f"q must be [num_seqs, num_heads, head_dim] and the caches [num_blocks, block_size, "
            f"n_kv_heads, head_dim], got {tuple(q.shape)} and {tuple(key_cache.shape)}"
        )
    decode = GroupedDecode(
        block_tables,
        context_lens,
        max_context_len,
        num_heads=q.shape[1],
        num_kv_heads=key_cache.shape[2],
        head_dim=q.shape[2],
        block_size=key_cache.shape[1],
        scale=scale,
        partition_size=partition_size,
        threads=threads,
        lanes_per_token=lanes_per_token,
        version=version,
        tile=tile,
    )
    return decode(q, key_cache, value_cache, out=out)
