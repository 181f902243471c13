"""Decode paged attention: the numba-cuda kernels against torch, in achieved memory bandwidth
(chapter 08).

    python benchmarks/paged_attention.py [--shapes 1x4096 64x1024 64x4096] [--repeats 50]
        [--only v3] [--no-write]

Decode attention reads every cached key and value once and does little arithmetic with them, so its
yardstick is memory bandwidth: bytes of K/V read per call / time per call, against the device's copy
bandwidth measured in the same run (a device-to-device copy of a 1 GiB tensor). Shapes: batch x
context, head_dim 128, 32 query heads sharing 8 K/V heads (GQA 4), block size 16, float16, each
sequence's blocks scattered through the pool.

Two times per call. *Device time*: the GPU is first kept busy (`torch.cuda._sleep`) so the call's
launches queue up behind it; CUDA events around the call then time the kernels alone, the median of
`--repeats`. *Host time*: what one call costs the CPU (checks, argument conversion, launches),
`--repeats` calls back to back without waiting, per call -- it bounds how often a decode step can
launch, whatever the kernel's speed.

Systems: v1 (one thread block per sequence x query head), v2 (v1's work in partitions of 512
tokens, merged by log-sum-exp), v3 (grouped flash-decoding: one block per sequence x K/V head, one
pass, the step's arguments prepared once as the engine does), v3 split (v3 with the partition size
the engine picks for the batch, `split_partition_size`), v3 warp/token (v3 with a whole warp on
each token instead of 16 lanes: fewer registers, fewer loads in flight per lane), v3 regs<=96 and
regs<=64 (v3 compiled with its registers per thread capped: more resident warps, some spilled to
local memory), v4 (`attention/cuda/tiled.py`: v3 tiled, with fewer live values per thread --
8-byte vector loads, scores reduce-scattered, one exp2 per score, each output element owned by one
thread, the next rows prefetched into L2), v4 split (with v3 split's partition size), v4 regs<=64
(capped so that 8 blocks fit an SM; `tools/kernel_registers.py` counts what ptxas spills for it)
v4 no prefetch (the prefetches' share) and v4 256 threads regs<=64 (8 warps a block: more resident
warps from the same grid), the engine's torch reference (gather through the
block table, then SDPA) and `scaled_dot_product_attention` over K/V gathered in advance (the
attention arithmetic without the paged gather). Goals (issue 17): >= 80 % of the copy
bandwidth at batch 64 x context 1k, >= 60 % at batch 1 x 4k.

For Nsight Compute, profile one system on one shape without writing the results:
`ncu --set full -k regex:paged_attention python benchmarks/paged_attention.py --shapes 64x1024
--only v3 --repeats 3 --no-write`.

On a machine with no CUDA GPU the script says so, checks every kernel version in numba's simulator
on a small case, measures nothing and writes no JSON.
"""

from __future__ import annotations

import minivllm  # noqa: F401 -- before torch: it sets OMP_WAIT_POLICY, read as torch loads

# isort: split
import argparse
import datetime
import functools
import importlib.metadata
import json
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from minivllm.attention.cuda.launch import GroupedDecode, paged_attention, split_partition_size
from minivllm.attention.cuda.simulator import SIMULATOR
from minivllm.book.kernel_check import kernel_error, random_inputs

RESULTS = Path(__file__).parent / "results" / "paged_attention.json"
HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, PARTITION = 32, 8, 128, 16, 512
SHAPE = {"num_heads": HEADS, "num_kv_heads": KV_HEADS, "head_dim": HEAD_DIM}
# v4's variants on one partition: its defaults; capped at 64 registers (ptxas fits the benchmark's
# shape in 64 with no spill); without the L2 prefetches; 8 warps a block, capped. At batch 64 x 8
# K/V heads the grid is 512 blocks, about 4 per SM whatever the registers allow: only bigger
# blocks (or more partitions) turn fewer registers into more resident warps.
V4_VARIANTS = {
    "v4": {},
    "v4 regs<=64": {"max_registers": 64},
    "v4 no prefetch": {"prefetch": False},
    "v4 256 threads regs<=64": {"threads": 256, "max_registers": 64},
}
SYSTEMS = (
    "v1",
    "v2",
    "v3",
    "v3 split",
    "v3 warp/token",
    "v3 regs<=96",
    "v3 regs<=64",
    "v4",
    "v4 split",
    "v4 regs<=64",
    "v4 no prefetch",
    "v4 256 threads regs<=64",
    "torch paged",
    "SDPA (pre-gathered)",
)


def make_inputs(batch: int, context: int, device: str, dtype=torch.float16, seed: int = 0):
    """`batch` sequences of `context` tokens, their blocks scattered over a pool with no spare
    blocks."""
    return random_inputs(
        [context] * batch,
        HEADS,
        KV_HEADS,
        HEAD_DIM,
        BLOCK_SIZE,
        dtype,
        seed,
        spare_blocks=0,
        device=device,
    )


def gather(key_cache, value_cache, tables, context: int):
    """Every sequence's keys and values through its block table: `[batch, context, kv_heads,
    dim]` each."""
    positions = torch.arange(context, device=key_cache.device)
    blocks = tables.long()[:, positions // BLOCK_SIZE]
    slots = positions % BLOCK_SIZE
    return key_cache[blocks, slots], value_cache[blocks, slots]


def sdpa_gathered(q, keys, values):
    grouped = q.view(q.shape[0], KV_HEADS, HEADS // KV_HEADS, HEAD_DIM)
    out = F.scaled_dot_product_attention(grouped, keys.transpose(1, 2), values.transpose(1, 2))
    return out.reshape(q.shape)


def device_seconds(fn, repeats: int) -> float:
    """Median seconds of GPU time per call: CUDA events around each call, launched while the GPU is
    still busy with a sleep so that host launch costs stay out of the interval."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(2_000_000)  # about a millisecond of queue for the launches to join
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def host_seconds(fn, repeats: int) -> float:
    """CPU seconds per call, calls back to back (the GPU catches up at the end)."""
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    elapsed = time.perf_counter() - started
    torch.cuda.synchronize()
    return elapsed / repeats


def copy_bandwidth(repeats: int) -> float:
    """Bytes per second of a device-to-device copy (read + write) of a 1 GiB tensor."""
    source = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    seconds = device_seconds(lambda: target.copy_(source), repeats)
    return 2 * source.numel() / seconds


def check_small_case() -> dict[str, float]:
    """Every kernel version against the float64 reference on a small float32 case (GQA 2, a
    one-token context, one ending mid-block): max relative error per version."""
    inputs = random_inputs([9, 5, 1], num_heads=4, num_kv_heads=2, head_dim=16, block_size=4)
    if not SIMULATOR:
        inputs = [t.cuda() for t in inputs]
    return {
        "v1": kernel_error(inputs, threads=32),
        "v2": kernel_error(inputs, partition_size=4, threads=32),
        "v3": kernel_error(inputs, threads=32, grouped=True),
        "v3 split": kernel_error(inputs, partition_size=4, threads=32, grouped=True),
        "v4": kernel_error(inputs, threads=32, grouped=True, version="v4"),
        "v4 split": kernel_error(inputs, partition_size=4, threads=32, grouped=True, version="v4"),
    }


def contenders(q, key_cache, value_cache, tables, lens, context: int, sms: int) -> dict:
    """The ways to attend one batch, each a call with no arguments, to time. v3's per-step work
    (checks, the tables' conversion) happens here, once, as in the engine's decode step."""
    keys, values = gather(key_cache, value_cache, tables, context)
    batch = q.shape[0]
    split = split_partition_size(batch, KV_HEADS, context, BLOCK_SIZE, sms)
    shape = SHAPE
    v3 = GroupedDecode(tables, lens, context, block_size=BLOCK_SIZE, **shape)
    v3_split = GroupedDecode(
        tables, lens, context, block_size=BLOCK_SIZE, partition_size=split, **shape
    )
    # A whole warp per token: fewer registers (more resident warps), fewer loads per lane.
    v3_warp = GroupedDecode(
        tables, lens, context, block_size=BLOCK_SIZE, lanes_per_token=32, **shape
    )
    # Registers capped (ptxas spills the rest): Nsight Compute saw v3 at 128 registers a thread,
    # 4 blocks of 128 threads an SM, 25 % theoretical occupancy; 96 allows 5 blocks, 64 allows 8.
    v3_capped = {
        cap: GroupedDecode(tables, lens, context, block_size=BLOCK_SIZE, max_registers=cap, **shape)
        for cap in (96, 64)
    }
    v4 = {
        name: GroupedDecode(
            tables, lens, context, block_size=BLOCK_SIZE, version="v4", **knobs, **shape
        )
        for name, knobs in V4_VARIANTS.items()
    }
    v4["v4 split"] = GroupedDecode(
        tables, lens, context, block_size=BLOCK_SIZE, partition_size=split, version="v4", **shape
    )
    return {
        "v1": lambda: paged_attention(
            q, key_cache, value_cache, tables, lens, max_context_len=context
        ),
        "v2": lambda: paged_attention(
            q,
            key_cache,
            value_cache,
            tables,
            lens,
            partition_size=PARTITION,
            max_context_len=context,
        ),
        "v3": lambda: v3(q, key_cache, value_cache),
        "v3 split": lambda: v3_split(q, key_cache, value_cache),
        "v3 warp/token": lambda: v3_warp(q, key_cache, value_cache),
        "v3 regs<=96": lambda: v3_capped[96](q, key_cache, value_cache),
        "v3 regs<=64": lambda: v3_capped[64](q, key_cache, value_cache),
        **{
            name: functools.partial(decode, q, key_cache, value_cache)
            for name, decode in v4.items()
        },
        "torch paged": lambda: sdpa_gathered(q, *gather(key_cache, value_cache, tables, context)),
        "SDPA (pre-gathered)": lambda: sdpa_gathered(q, keys, values),
    }, split


def measure(shapes, repeats: int, only: list[str] | None) -> dict:
    peak = copy_bandwidth(repeats)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"device: {torch.cuda.get_device_name()}; measured copy bandwidth {peak / 1e9:.0f} GB/s")
    names = [n for n in SYSTEMS if only is None or n in only]
    header = f"{'batch':>5} {'context':>7} {'MB K/V':>7} | " + " | ".join(
        f"{name:>26}" for name in names
    )
    print(header + "\n" + "-" * len(header))
    rows = []
    for batch, context in shapes:
        q, key_cache, value_cache, tables, lens = make_inputs(batch, context, "cuda")
        kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * key_cache.element_size()
        systems, split = contenders(q, key_cache, value_cache, tables, lens, context, sms)
        expected = systems["SDPA (pre-gathered)"]()
        row = {
            "batch": batch,
            "context": context,
            "kv_bytes": kv_bytes,
            "v3_split_partition_size": split,
            "systems": {},
        }
        cells = []
        for name in names:
            fn = systems[name]
            error = float((fn().float() - expected.float()).abs().max())
            seconds = device_seconds(fn, repeats)
            bandwidth = kv_bytes / seconds
            row["systems"][name] = {
                "device_seconds": seconds,
                "host_seconds_per_call": host_seconds(fn, repeats),
                "bytes_per_second": bandwidth,
                "share_of_copy_bandwidth": bandwidth / peak,
                "max_abs_difference_from_sdpa": error,
            }
            cells.append(f"{seconds * 1e6:9.1f} us {bandwidth / peak:6.1%}")
        rows.append(row)
        print(
            f"{batch:5d} {context:7d} {kv_bytes / 1e6:7.1f} | "
            + " | ".join(f"{c:>26}" for c in cells)
        )
    for (batch, context), goal in (((64, 1024), 0.8), ((1, 4096), 0.6)):
        row = next((r for r in rows if (r["batch"], r["context"]) == (batch, context)), None)
        kernels = [n for n in SYSTEMS if n.startswith("v") and row and n in row["systems"]]
        if kernels:
            best = max(row["systems"][n]["share_of_copy_bandwidth"] for n in kernels)
            print(
                f"goal: >= {goal:.0%} of copy bandwidth at batch {batch} x context {context}: "
                f"{best:.1%} ({'met' if best >= goal else 'NOT met'})"
            )
    return {
        "copy_bandwidth_bytes_per_second": peak,
        "num_sms": sms,
        "kernel_resources": kernel_resources(),
        "rows": rows,
    }


def kernel_resources() -> dict:
    """Registers per thread and static shared memory of the kernels compiled in this run, as the
    compiler reports them: the evidence for a registers column, and the input of the occupancy
    model (`attention/cuda/occupancy.py`)."""
    from minivllm.attention.cuda.grouped import grouped_decode_kernel
    from minivllm.attention.cuda.kernels import (
        merge_partitions,
        paged_attention_v1,
        paged_attention_v2,
    )
    from minivllm.attention.cuda.launch import DEFAULT_THREADS
    from minivllm.attention.cuda.tiled import tiled_decode_kernel, tiled_layout

    dispatchers = {"v1": paged_attention_v1, "v2": paged_attention_v2, "merge": merge_partitions}
    for key in _compiled_v3_keys():
        dispatchers[f"v3 {key}"] = grouped_decode_kernel(*key)
    for name, knobs in V4_VARIANTS.items():  # the float16 kernels `GroupedDecode` launched
        layout_knobs = {k: v for k, v in knobs.items() if k not in ("max_registers", "threads")}
        threads = knobs.get("threads", DEFAULT_THREADS)
        layout = tiled_layout(HEAD_DIM, 2, threads, **layout_knobs)
        dispatchers[name] = tiled_decode_kernel(
            HEAD_DIM, HEADS // KV_HEADS, BLOCK_SIZE, layout, knobs.get("max_registers")
        )
    resources = {}
    for name, dispatcher in dispatchers.items():
        for signature, overload in dispatcher.overloads.items():
            resources[f"{name} {signature}"] = {
                "registers_per_thread": overload.regs_per_thread,
                "static_shared_bytes": overload.shared_mem_per_block,
            }
    return resources


def _compiled_v3_keys() -> list[tuple]:
    """(head_dim, group, lanes_per_token, block_size, max_registers) of the v3 kernels this run
    compiled."""
    from minivllm.attention.cuda.grouped import default_lanes_per_token

    group, lanes = HEADS // KV_HEADS, default_lanes_per_token(HEAD_DIM)
    return [
        (HEAD_DIM, group, lanes, BLOCK_SIZE, None),
        (HEAD_DIM, group, 32, BLOCK_SIZE, None),
        (HEAD_DIM, group, lanes, BLOCK_SIZE, 96),
        (HEAD_DIM, group, lanes, BLOCK_SIZE, 64),
    ]


def machine() -> dict:
    """What the numbers were measured on: device, driver, and the versions that made them."""
    try:
        driver = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split("\n")[0]
    except (OSError, subprocess.CalledProcessError):
        driver = None
    return {
        "device": torch.cuda.get_device_name(),
        "driver": driver,
        "cuda_runtime": torch.version.cuda,
        "torch": torch.__version__,
        "numba": importlib.metadata.version("numba"),
        "numba-cuda": importlib.metadata.version("numba-cuda"),
        "numpy": importlib.metadata.version("numpy"),
        "platform": platform.platform(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def parse_shape(text: str) -> tuple[int, int]:
    batch, _, context = text.partition("x")
    try:
        return int(batch), int(context)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"a shape is BATCHxCONTEXT, like 64x1024: {text!r}"
        ) from None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--shapes", type=parse_shape, nargs="+", default=[(1, 4096), (64, 1024), (64, 4096)]
    )
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--only", nargs="+", choices=SYSTEMS, help="time only these systems")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--no-write", action="store_true", help="print, write no JSON")
    args = parser.parse_args()
    errors = check_small_case()
    path = (
        "numba's CUDA simulator (CPU)"
        if SIMULATOR
        else f"natively on {torch.cuda.get_device_name()}"
    )
    print(
        f"kernels run {path}; small-case max relative error against the float64 reference: "
        + ", ".join(f"{name} {error:.1e}" for name, error in errors.items())
    )
    if max(errors.values()) > 1e-5:
        raise SystemExit("the kernels disagree with the reference: not measuring")
    if not torch.cuda.is_available():
        print(
            "no CUDA GPU here: correctness checked in the simulator, no timings taken (they need a "
            f"GPU), {args.out} left as it was"
        )
        return
    report = {
        "benchmark": "paged_attention",
        "machine": machine(),
        "shape": {
            "heads": HEADS,
            "kv_heads": KV_HEADS,
            "head_dim": HEAD_DIM,
            "block_size": BLOCK_SIZE,
            "dtype": "float16",
            "v2_partition_size": PARTITION,
        },
        "small_case_errors": errors,
        "timing": "device: median of CUDA-event intervals per call behind a GPU sleep; host: "
        "CPU time per call, calls back to back",
    }
    report.update(measure(args.shapes, args.repeats, args.only))
    if args.no_write:
        return
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
