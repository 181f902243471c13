"""How many thread blocks of a kernel an SM holds at once, and how full a launch keeps the GPU
(chapter 08).

An SM runs several thread blocks side by side, as many as its warp slots, its register file, its
shared memory and its block limit all allow -- the arithmetic of NVIDIA's occupancy calculator. A
decode kernel is memory-bound, and its loads in flight come from resident warps, so the measure
here is the *warp occupancy* of a launch: resident warps over the SMs' warp slots, averaged over
the waves a grid of `blocks` takes. Registers per thread come from the compiler (numba:
`kernel.get_regs_per_thread()` on a GPU) or from Nsight Compute; the simulator has no registers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from minivllm.attention.cuda.simulator import WARP_SIZE


@dataclass(frozen=True)
class SMLimits:
    """One streaming multiprocessor's resources and the device's SM count."""

    name: str
    sms: int
    max_warps: int = 64
    max_blocks: int = 32
    registers: int = 65536
    register_unit: int = 256  # registers are given to a warp in lumps of this many
    shared_bytes: int = 228 * 1024
    shared_reserved: int = 1024  # the system keeps this much per block (sm_80 and later)
    shared_unit: int = 128


H100_SXM = SMLimits("H100 SXM", sms=132)


@dataclass(frozen=True)
class Occupancy:
    blocks_per_sm: int
    limiter: str  # what stops the SM from holding one more block
    waves: int
    warp_occupancy: float  # resident warps / warp slots, averaged over the waves


def blocks_per_sm(
    threads: int, registers_per_thread: int, shared_bytes: int, sm: SMLimits = H100_SXM
) -> tuple[int, str]:
    """Blocks of this shape one SM holds at once, and the resource that limits it."""
    warps = math.ceil(threads / WARP_SIZE)
    registers_per_warp = math.ceil(registers_per_thread * WARP_SIZE / sm.register_unit)
    registers_per_warp *= sm.register_unit
    shared_per_block = math.ceil((shared_bytes + sm.shared_reserved) / sm.shared_unit)
    shared_per_block *= sm.shared_unit
    limits = {
        "warp slots": sm.max_warps // warps,
        "block slots": sm.max_blocks,
        "registers": (sm.registers // registers_per_warp) // warps,
        "shared memory": sm.shared_bytes // shared_per_block,
    }
    limiter = min(limits, key=limits.get)
    return limits[limiter], limiter


def occupancy(
    blocks: int,
    threads: int,
    registers_per_thread: int,
    shared_bytes: int,
    sm: SMLimits = H100_SXM,
) -> Occupancy:
    """The warp occupancy of a grid of `blocks` thread blocks: the SMs take blocks_per_sm each per
    wave; a last, partial wave leaves slots empty."""
    if blocks < 1:
        raise ValueError(f"a launch has at least one block, got {blocks}")
    per_sm, limiter = blocks_per_sm(threads, registers_per_thread, shared_bytes, sm)
    if per_sm == 0:
        raise ValueError(f"one block of this shape does not fit on an SM ({limiter})")
    waves = math.ceil(blocks / (sm.sms * per_sm))
    warps = math.ceil(threads / WARP_SIZE)
    share = blocks * warps / (waves * sm.sms * sm.max_warps)
    return Occupancy(per_sm, limiter, waves, share)
