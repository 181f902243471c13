"""The attention seam: what an attention backend is, and the registry the engine picks one from.

The model calls attention once per layer and knows nothing of the paged cache. The backend does:
the engine's runner builds one per forward pass from `(storage, batch)` -- the `PagedKVStorage` and
the pass's `VarlenBatch`, so whatever depends only on the batch (slots, masks, tables) is prepared
once -- and the model calls it once per layer as `backend(layer, q, k, v) -> out`. It writes the new
K/V through the slot mapping and attends every sequence to its own context.

What plugs in here:

    "torch"  `TorchPagedAttention`, the reference (chapter 04): gathers and
             `scaled_dot_product_attention`, on any device torch runs on.
    "cuda"   `CudaPagedAttention`, chapter 08's numba-cuda decode kernel (prefill chunks stay the
             reference's). Registered by module path: importing it switches numba's CUDA simulator
             on when there is no GPU, so it is imported only when first asked for.
    "cuda-v4" the same with the decodes on v4, the tiled kernel (fewer live values per thread);
             "auto" never picks it: it replaces "cuda" once a GPU run has measured it faster.
    "numba"  `NumbaPagedAttention`, the native CPU kernel (numba_cpu.py, chapter 07): reads K/V
             in place through the block tables, decodes and prefill chunks in one call. "auto"
             picks it for a float32 or bfloat16 cache on a CPU, where `benchmarks/throughput.py`
             (float32) and `benchmarks/real_model.py` (bfloat16) measure it faster than the
             reference.

`EngineConfig.attention_backend` names one of `backend_names()`, or "auto": the first backend
registered for the engine's device and cache dtype, else the reference.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from minivllm.attention.batch import VarlenBatch
from minivllm.attention.storage import PagedKVStorage
from minivllm.attention.torch_backend import TorchPagedAttention

REFERENCE = "torch"


class AttentionBackend(Protocol):
    """One forward pass's attention: called once per layer."""

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """Write the new k, v `[N, kv_heads, D]` into the cache at the batch's slots, then attend
        q `[N, heads, D]` to each sequence's context -> `[N, heads, D]`."""
        ...


BackendFactory = Callable[[PagedKVStorage, VarlenBatch], AttentionBackend]


@dataclass
class _Entry:
    factory: BackendFactory | str  # the factory, or "module:name" to import when first asked for
    devices: tuple[str, ...]  # where "auto" picks it
    dtypes: tuple[torch.dtype, ...]  # the cache dtypes "auto" picks it for (empty: any)
    only_on: str | None = None  # the one device it can run on, if it cannot run on every one


_REGISTRY: dict[str, _Entry] = {}


def register_backend(
    name: str,
    factory: BackendFactory | str,
    devices: tuple[str, ...] = (),
    dtypes: tuple[torch.dtype, ...] = (),
    only_on: str | None = None,
) -> None:
    """Make `name` an attention backend. `factory` builds one from `(storage, batch)`; give it as
    "package.module:Name" to import it only when the backend is first asked for. `devices` are those
    on which "auto" chooses it ("cpu", "cuda"), for a cache of one of `dtypes` (none given: any); it
    can always be named explicitly. `only_on` names the one device a backend can run on at all
    (an engine asked for it with `device="auto"` then runs there, on a GPU machine too)."""
    if name == "auto" or name in _REGISTRY:
        raise ValueError(f"attention backend name {name!r} is taken")
    _REGISTRY[name] = _Entry(factory, tuple(devices), tuple(dtypes), only_on)


def backend_device(name: str) -> str | None:
    """The one device backend `name` runs on, or None if it runs on any ("auto" runs anywhere)."""
    return None if name == "auto" else _entry(name).only_on


def backend_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def resolve_backend_name(
    name: str,
    device: str,
    dtype: torch.dtype = torch.float32,
    model_dtype: torch.dtype | None = None,
) -> str:
    """The backend a name means on `device` for a cache of `dtype`: itself, or for "auto" the first
    backend registered for both, else the reference. A kernel reads q in the model's dtype
    (`model_dtype`, if given) and K/V in the cache's: "auto" picks one only where the two agree
    (a bfloat16 model over a float32 cache runs on the reference). A backend named explicitly
    must take both dtypes."""
    if name != "auto":
        takes = _entry(name).dtypes
        refused = [d for d in (dtype, model_dtype) if takes and d is not None and d not in takes]
        if refused:
            raise ValueError(
                f"attention backend {name!r} takes {', '.join(str(d) for d in takes)}, not "
                f"{refused[0]} (the model's or the cache's dtype): use 'auto' or 'torch'"
            )
        return name
    if model_dtype is not None and model_dtype != dtype:
        return REFERENCE
    chosen = (
        n
        for n, e in _REGISTRY.items()
        if device in e.devices and (not e.dtypes or dtype in e.dtypes)
    )
    return next(chosen, REFERENCE)


def get_backend(name: str) -> BackendFactory:
    """The factory registered as `name`, imported now if it was registered by path."""
    entry = _entry(name)
    if isinstance(entry.factory, str):
        module, _, attr = entry.factory.partition(":")
        entry.factory = getattr(importlib.import_module(module), attr)
    return entry.factory


def warm_up_backend(
    factory: BackendFactory, threads: int | None = None, dtype: torch.dtype = torch.float32
) -> None:
    """Compile (or load) a backend's kernel for `threads` (default: torch's count) and a cache of
    `dtype` now, rather than in the first step, where the backend has one (a `warm_up` static
    method, taking `dtype` where it compiles one kernel per cache dtype)."""
    warm_up = getattr(factory, "warm_up", None)
    if warm_up is None:
        return
    if dtype == torch.float32:
        warm_up(threads)
    else:
        warm_up(threads, dtype)


def is_loaded(name: str) -> bool:
    """Whether the backend's code has been imported (false for a path not yet asked for)."""
    return not isinstance(_entry(name).factory, str)


def _entry(name: str) -> _Entry:
    if name not in _REGISTRY:
        raise ValueError(
            f"unknown attention backend {name!r}: choose 'auto' or one of "
            f"{', '.join(repr(n) for n in _REGISTRY)}"
        )
    return _REGISTRY[name]


register_backend(REFERENCE, TorchPagedAttention)
register_backend(
    "cuda",
    "minivllm.attention.cuda.backend:CudaPagedAttention",
    devices=("cuda",),
    dtypes=(torch.float32, torch.float16),  # the kernel's; not bfloat16
)
register_backend(
    "numba",
    "minivllm.attention.numba_cpu:NumbaPagedAttention",
    devices=("cpu",),
    dtypes=(torch.float32, torch.bfloat16),  # a bfloat16 cache is read as such, in float32
    only_on="cpu",  # a CPU kernel over a cache in CPU memory
)
register_backend(
    "cuda-v4",  # chapter 08's v4 (tiled): named explicitly only until a GPU run measures it
    "minivllm.attention.cuda.backend:CudaTiledPagedAttention",
    dtypes=(torch.float32, torch.float16),
)
