"""Decode paged attention: the numba-cuda kernels against torch, in achieved memory bandwidth
(chapter 07).

    python benchmarks/paged_attention.py [--batches 1 16 64] [--contexts 512 1024 4096] [--repeats
    50]

Decode attention reads every cached key and value once and does little arithmetic with them, so its
yardstick is memory bandwidth: bytes of K/V read per call / time per call, against the device's copy
bandwidth measured in the same run (a device-to-device copy of a 1 GiB tensor). Shapes: head_dim
128, 32 query heads sharing 8 K/V heads (GQA 4), block size 16, float16, each sequence's blocks
scattered through the pool. Per call: CUDA events around the launch, after warm-up, the median of
`--repeats`.

Systems: the v1 kernel (one thread block per sequence x head), v2 (partitions of 512 tokens merged
by log-sum-exp), the engine's torch reference (gather through the block table, then SDPA; what
`TorchPagedAttention` does for decodes), and `scaled_dot_product_attention` alone over K/V gathered
in advance (the attention arithmetic without the paged gather). Goal (issue 7): >= 80 % of the copy
bandwidth at batch 64 x context 1k.

On a machine with no CUDA GPU the script says so, checks the kernels in numba's simulator on a small
case, measures nothing and writes no JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

from minivllm.attention.cuda.launch import paged_attention
from minivllm.attention.cuda.simulator import SIMULATOR
from minivllm.book.kernel_check import kernel_error, random_inputs

RESULTS = Path(__file__).parent / "results" / "paged_attention.json"
HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, PARTITION = 32, 8, 128, 16, 512


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


def torch_paged(q, key_cache, value_cache, tables, lens):
    """The reference's decode path: gather every sequence's K/V through its table, then SDPA."""
    positions = torch.arange(int(lens.max()), device=q.device)
    blocks = tables.long()[:, positions // BLOCK_SIZE]
    keys = key_cache[blocks, positions % BLOCK_SIZE]  # [batch, context, kv_heads, dim]
    values = value_cache[blocks, positions % BLOCK_SIZE]
    return sdpa_gathered(q, keys, values)


def sdpa_gathered(q, keys, values):
    grouped = q.view(q.shape[0], KV_HEADS, HEADS // KV_HEADS, HEAD_DIM)
    out = F.scaled_dot_product_attention(grouped, keys.transpose(1, 2), values.transpose(1, 2))
    return out.reshape(q.shape)


def time_call(fn, repeats: int) -> float:
    """Median seconds per call, CUDA events around each call, after warm-up."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def copy_bandwidth(repeats: int) -> float:
    """Bytes per second of a device-to-device copy (read + write) of a 1 GiB tensor."""
    source = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    seconds = time_call(lambda: target.copy_(source), repeats)
    return 2 * source.numel() / seconds


def check_small_case() -> float:
    """The kernels against the reference on a small float32 case: the max relative error of v1 and
    v2."""
    inputs = random_inputs([9, 5], num_heads=4, num_kv_heads=2, head_dim=16, block_size=4)
    return max(kernel_error(inputs, partition_size=p, threads=32) for p in (None, 4))


def contenders(q, key_cache, value_cache, tables, lens) -> dict:
    """The four ways to attend one batch, each a call with no arguments, to time."""
    positions = torch.arange(int(lens.max()), device=q.device)
    blocks = tables.long()[:, positions // BLOCK_SIZE]
    keys = key_cache[blocks, positions % BLOCK_SIZE]
    values = value_cache[blocks, positions % BLOCK_SIZE]
    return {
        "v1": lambda: paged_attention(q, key_cache, value_cache, tables, lens),
        "v2": lambda: paged_attention(
            q, key_cache, value_cache, tables, lens, partition_size=PARTITION
        ),
        "torch paged": lambda: torch_paged(q, key_cache, value_cache, tables, lens),
        "SDPA (pre-gathered)": lambda: sdpa_gathered(q, keys, values),
    }


def measure(batches, contexts, repeats: int) -> dict:
    peak = copy_bandwidth(repeats)
    print(f"device: {torch.cuda.get_device_name()}; measured copy bandwidth {peak / 1e9:.0f} GB/s")
    rows = []
    header = f"{'batch':>5} {'context':>7} {'MB K/V':>7} | " + " | ".join(
        f"{name:>22}" for name in ("v1", "v2", "torch paged", "SDPA (pre-gathered)")
    )
    print(header + "\n" + "-" * len(header))
    for batch in batches:
        for context in contexts:
            q, key_cache, value_cache, tables, lens = make_inputs(batch, context, "cuda")
            kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * key_cache.element_size()
            systems = contenders(q, key_cache, value_cache, tables, lens)
            row = {"batch": batch, "context": context, "kv_bytes": kv_bytes, "systems": {}}
            cells = []
            for name, fn in systems.items():
                seconds = time_call(fn, repeats)
                bandwidth = kv_bytes / seconds
                row["systems"][name] = {
                    "seconds": seconds,
                    "bytes_per_second": bandwidth,
                    "share_of_copy_bandwidth": bandwidth / peak,
                }
                cells.append(f"{seconds * 1e6:8.1f} us {bandwidth / peak:6.1%}")
            rows.append(row)
            print(
                f"{batch:5d} {context:7d} {kv_bytes / 1e6:7.1f} | "
                + " | ".join(f"{c:>22}" for c in cells)
            )
    goal = next((r for r in rows if r["batch"] == 64 and r["context"] == 1024), None)
    if goal is not None:
        best = max(goal["systems"][k]["share_of_copy_bandwidth"] for k in ("v1", "v2"))
        print(
            f"goal: >= 80% of copy bandwidth at batch 64 x context 1k: {best:.1%} "
            f"({'met' if best >= 0.8 else 'NOT met'})"
        )
    return {"copy_bandwidth_bytes_per_second": peak, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 1024, 4096])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    error = check_small_case()
    path = (
        "numba's CUDA simulator (CPU)"
        if SIMULATOR
        else f"natively on {torch.cuda.get_device_name()}"
    )
    print(f"kernels run {path}; small-case max relative error against the reference: {error:.2e}")
    if error > 1e-5:
        raise SystemExit("the kernels disagree with the reference: not measuring")
    report = {
        "benchmark": "paged_attention",
        "machine": {
            "platform": platform.platform(),
            "torch": torch.__version__,
            "simulator": SIMULATOR,
        },
        "small_case_error": error,
    }
    if not torch.cuda.is_available():
        print(
            "no CUDA GPU here: correctness checked in the simulator, no timings taken (they need a "
            "GPU), "
            f"{args.out} left as it was"
        )
        return
    report["machine"]["device"] = torch.cuda.get_device_name()
    report.update(measure(args.batches, args.contexts, args.repeats))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
