"""`PagedKVStorage`: the one K/V tensor of a paged cache, written through slots and read through
block tables (chapter 03). The block manager decides which blocks a sequence owns; this holds
what is in them."""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Sequence

import torch

from minivllm.model.transformer import ModelConfig


class PagedKVStorage:
    """The single K/V tensor of a paged cache; written through slots, read through block tables.

    `kv` is `[n_layers, 2, num_blocks, block_size, n_kv_heads, head_dim]` however it lives. With
    `heads_outer` (a backend that asks for it: the CPU kernel's), in CPU memory, its elements are
    laid out with the heads outside the block's rows (`cpu_kv_pool`), and `kv` is a view with
    those two axes swapped: indexing it is the same, its memory is not."""

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        heads_outer: bool = False,
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(
                f"num_blocks and block_size must be positive, got {num_blocks} and {block_size}"
            )
        self.config, self.num_blocks, self.block_size, self.dtype = (
            config,
            num_blocks,
            block_size,
            dtype,
        )
        shape = (config.n_layers, 2, num_blocks, block_size, config.n_kv_heads, config.head_dim)
        if torch.device(device).type == "cpu" and heads_outer:
            self.kv = cpu_kv_pool(shape, dtype)
        elif torch.device(device).type == "cpu":
            self.kv = zeros_on_huge_pages(shape, dtype)
        else:
            self.kv = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def bytes(self) -> int:
        return tensor_bytes(self.kv)

    def _rows(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's K and V as `[2, rows, width]` in memory order (a view, no copy), and where
        `slots` (`[T]`) have their rows there: for the indexed order a slot's heads are one row,
        `[T]`; for a pool with the heads outside the rows (`cpu_kv_pool`) each head of a slot is a
        row, `[T * n_kv_heads]`. Either way, one index for torch's gather and scatter, whose rows
        come out in (slot, head) order."""
        if not 0 <= layer < self.config.n_layers:
            raise IndexError(f"layer {layer} is outside the model's {self.config.n_layers} layers")
        layer_kv, heads, dim = self.kv[layer], self.config.n_kv_heads, self.config.head_dim
        if layer_kv.stride(-2) > layer_kv.stride(-3):  # heads outside the rows (`cpu_kv_pool`)
            blocks, offsets = slots // self.block_size, slots % self.block_size
            head = torch.arange(heads, device=slots.device)
            where = (blocks[:, None] * heads + head) * self.block_size + offsets[:, None]
            return layer_kv.transpose(-3, -2).view(2, -1, dim), where.reshape(-1)
        return layer_kv.view(2, -1, heads * dim), slots

    def write(
        self,
        layer: int,
        slots: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        slots_checked: bool = False,
    ) -> None:
        """Scatter `k`, `v` (`[T, n_kv_heads, head_dim]`) into this layer's slots (`[T]`, long).
        A backend checks its batch's slots once per pass (`check_slots`) and passes
        `slots_checked=True` in every layer: the check reads the slots back to the host, a sync
        per layer on a GPU."""
        slots = torch.as_tensor(slots, dtype=torch.long)
        if slots.dim() != 1 or k.shape[0] != slots.shape[0] or v.shape != k.shape:
            raise ValueError(
                f"write needs slots [T] and k, v [T, heads, dim] with the same T; got slots "
                f"{tuple(slots.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
            )
        if not slots_checked:
            self.check_slots(slots)
        rows, where = self._rows(layer, slots)
        rows[0, where] = k.to(self.dtype).reshape(-1, rows.shape[-1])
        rows[1, where] = v.to(self.dtype).reshape(-1, rows.shape[-1])

    def check_slots(self, slots: torch.Tensor) -> None:
        """IndexError unless every slot is one of the cache's."""
        if len(slots) and not (0 <= int(slots.min()) and int(slots.max()) < self.num_slots):
            raise IndexError(
                f"slots {slots.tolist()} fall outside the {self.num_slots} slots "
                f"({self.num_blocks} blocks of {self.block_size})"
            )

    def read_slots(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at the given slots (any shape of long indices), `[*slots.shape, n_kv_heads,
        head_dim]`: the gather a batched attention needs, with block tables already turned into
        slots."""
        rows, where = self._rows(layer, slots.reshape(-1))
        picked = rows.index_select(1, where)
        shape = (*slots.shape, self.config.n_kv_heads, self.config.head_dim)
        return picked[0].view(shape), picked[1].view(shape)

    def copy_block(self, src: int, dst: int) -> None:
        """Copy-on-write: block `src` into block `dst`, K and V of every layer."""
        for block in (src, dst):
            if not 0 <= block < self.num_blocks:
                raise IndexError(f"block {block} is outside the pool of {self.num_blocks} blocks")
        self.kv[:, :, dst] = self.kv[:, :, src]

    def gather(
        self, layer: int, block_table: Sequence[int], length: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `length` keys and values of a sequence, `[length, n_kv_heads, head_dim]` each,
        read through its block table: logical block i lives in physical block `block_table[i]`."""
        held = len(block_table) * self.block_size
        if not 0 <= length <= held:
            raise ValueError(
                f"gather of {length} tokens, but the block table {list(block_table)} holds {held}"
            )
        heads, dim = self.config.n_kv_heads, self.config.head_dim
        # EXERCISE ch03.3: gather -- this sequence's first `length` K/V rows, via its block table
        ### BEGIN SOLUTION
        used = -(-length // self.block_size)  # blocks that hold any of the tokens
        blocks = torch.tensor(list(block_table[:used]), dtype=torch.long)
        # [2, used, block_size, heads, dim] in table order -> blocks end to end -> cut to length.
        rows = self.kv[layer][:, blocks].reshape(2, used * self.block_size, heads, dim)[:, :length]
        return rows[0], rows[1]
        ### END SOLUTION


HUGE_PAGE = 2 << 20  # x86-64 and arm64 Linux's transparent huge page: 2 MiB
_MADV_HUGEPAGE = 14  # linux/mman.h


def cpu_kv_pool(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed K/V pool in CPU memory, `[..., block_size, n_kv_heads, head_dim]` as indexed, laid
    out `[..., n_kv_heads, block_size, head_dim]` (on huge pages, `zeros_on_huge_pages`): a view
    with the two axes swapped.

    A CPU kernel attends one sequence's K/V head at a time, so it wants a head's rows of a block
    side by side -- one stretch of memory the hardware prefetcher streams through -- where the
    indexed order would interleave them with the other heads' (the book's model: 128 bytes of a
    head, then 128 of the other, sixteen times over). vLLM's CPU backend keeps its cache so too
    (its `LBHNC` layout). On the book's 2-core AMD EPYC Zen 4 the numba kernel's batch-64 decode
    pass, K/V out of cache, took 0.80x the time on one thread and 0.87x on two (issue 32); in
    the engine (four alternating pairs of runs) the attention's time in decode steps went from
    0.84 of the matmuls' to 0.79, a few percent of a whole run, under the machine's noise. The numba
    backend asks for this pool (`NumbaPagedAttention.heads_outer`); the torch backend gathers
    whole slots, and a GPU's kernels read the indexed order (chapter 08), so theirs keep it."""
    *outer, block_size, heads, dim = shape
    return zeros_on_huge_pages((*outer, heads, block_size, dim), dtype).transpose(-3, -2)


def zeros_on_huge_pages(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """`torch.zeros(shape, dtype)` in CPU memory that Linux is asked to back with 2 MiB pages.

    A block table scatters a sequence's blocks over the pool, and a block of the book's model
    (16 rows of 2 heads x 32 floats) is one 4 KiB page: with 4 KiB pages every block an attention
    kernel reads is another page-table walk, and a decode step of 64 sequences reads thousands of
    them. Transparent huge pages (`madvise`, the mode most distributions ship) map 512 of those
    pages with one entry. On the book's 2-core machine the numba kernel's pass over 64 sequences
    whose K/V had left the caches took 15 % less, and an engine's batch-64 decode step spent 5 %
    less in attention (measured once, side by side, for issue 32). Elsewhere -- another OS, THP
    off, a pool under 2 MiB -- the hint is skipped or ignored and the pages are the usual ones."""
    nbytes = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
    if not sys.platform.startswith("linux") or nbytes < HUGE_PAGE:
        return torch.zeros(shape, dtype=dtype)
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)  # room to start on a 2 MiB boundary
    start = -raw.data_ptr() % HUGE_PAGE
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise(ctypes.c_void_p(raw.data_ptr() + start), ctypes.c_size_t(nbytes), _MADV_HUGEPAGE)
    pool = raw[start : start + nbytes].view(dtype).view(shape)
    pool.zero_()  # the first touch: this is when the kernel hands out the (huge) pages
    return pool


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
