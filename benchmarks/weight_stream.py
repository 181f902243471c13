"""A decode step's matmuls against the rate this machine reads memory at (issue 32).

    python benchmarks/weight_stream.py [--rounds 5] [--rows 1 4 8 16] [--dtype bfloat16|float32]
    [--out PATH]

A real checkpoint's decode step multiplies a few rows by every weight of the model, once: its
matmuls stream the weights from memory (Qwen3-0.6B: 1.2 GB a step in bfloat16) and do a few
multiply-adds per byte. What bounds them is the rate two threads can read memory -- not a copy's
or an add's, which `step_profile.py` measures for its roofline and which move two or three streams
at once, reads and writes overlapping.

For each of Qwen3-0.6B's four decode projections (q|k|v, o, gate|up, down: 28 of each a step)
this times, on weights that come from memory -- `--copies` distinct weights of the shape, cycled,
together many times the last-level cache, as a step's 28 layers are --

* the engine's matmul (`model.fused.linear` on the weight packed as the engine packs it: oneDNN),
  at each of `--rows` rows;
* a read of the same bytes and nothing else, as fast as torch and numba read: torch's `sum` of
  a float32 tensor of the same size, and a numba loop summing it on every thread (`prange`);

kinds alternating within each round, medians over `--rounds`. It prints GB/s for each and each
matmul's share of the faster read, and writes results/weight_stream.json with the machine (CPU,
flags, caches) and the load. A share near 1 says the matmul reads its weights as fast as the
machine reads anything: a faster kernel cannot make that step's matmuls much faster, fewer bytes
(a smaller dtype, quantised weights) can.
"""

from __future__ import annotations

import minivllm  # noqa: F401 -- before torch: it sets OMP_WAIT_POLICY, read as torch loads

# isort: split
import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from _common import load_str, machine_record, write_results
from numba import njit, prange

from minivllm.model import fused
from minivllm.model.numba_threads import use_threads

RESULTS = Path(__file__).resolve().parent / "results" / "weight_stream.json"
# Qwen3-0.6B's decode projections, [out_features, in_features]
SHAPES = {
    "q|k|v": (4096, 1024),
    "o": (1024, 2048),
    "gate|up": (6144, 1024),
    "down": (1024, 3072),
}


@njit(parallel=True, fastmath=True, cache=True)
def _numba_read(chunks):
    """Each chunk (a row of `chunks`) summed on one of numba's threads: a read and nothing else."""
    sums = np.zeros(chunks.shape[0], np.float32)
    for i in prange(chunks.shape[0]):
        total = np.float32(0.0)
        for j in range(chunks.shape[1]):
            total += chunks[i, j]
        sums[i] = total
    return sums


def seconds_per_call(call, copies: int, laps: int = 4) -> float:
    """The mean time of `call(i)` over `laps` passes through every copy i, after one unmeasured."""
    for i in range(copies):
        call(i)
    start = time.perf_counter()
    for _ in range(laps):
        for i in range(copies):
            call(i)
    return (time.perf_counter() - start) / (laps * copies)


def measure(shape, dtype, rows: list[int], copies: int, rounds: int) -> list[dict]:
    """One projection shape: a row per kind (each matmul's rows, each read) with its median us, its
    GB/s and its share of the faster read's GB/s (see the module's docstring)."""
    generator = torch.Generator().manual_seed(0)
    out_features, in_features = shape
    weights = [
        torch.randn(out_features, in_features, generator=generator).to(dtype) for _ in range(copies)
    ]
    for weight in weights:  # packed now, once: a weight this big is packed at any rows
        fused.linear(torch.zeros(1, in_features, dtype=dtype), weight)
    nbytes = weights[0].numel() * weights[0].element_size()
    floats = [torch.randn(nbytes // 4, generator=generator) for _ in range(copies)]
    chunks = [f.numpy().reshape(64, -1) for f in floats]
    inputs = [(m, torch.randn(m, in_features, generator=generator).to(dtype)) for m in rows]
    kinds = {f"matmul, {m} rows": (lambda i, x=x: fused.linear(x, weights[i])) for m, x in inputs}
    kinds["read: torch sum"] = lambda i: floats[i].sum()
    kinds["read: numba prange"] = lambda i: _numba_read(chunks[i])
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    with torch.inference_mode():
        for _ in range(rounds):
            for kind, call in kinds.items():
                times[kind].append(seconds_per_call(call, copies))
    table = []
    for kind, seconds in times.items():
        median = statistics.median(seconds)
        table.append(
            {"kind": kind, "us": round(median * 1e6, 1), "GBps": round(nbytes / median / 1e9, 2)}
        )
    read = max(row["GBps"] for row in table if row["kind"].startswith("read"))
    for row in table:
        row["share_of_read"] = round(row["GBps"] / read, 2)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 4, 8, 16])
    parser.add_argument(
        "--dtype",
        choices=["bfloat16", "float32"],
        default="bfloat16" if fused.ONEDNN_BFLOAT16 else "float32",
        help="default: bfloat16 where oneDNN multiplies it (AVX-512 BF16, AMX), else float32",
    )
    parser.add_argument(
        "--copies", type=int, default=28, help="distinct weights per shape (a model's layers)"
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.dtype == "bfloat16" and not fused.ONEDNN_BFLOAT16:
        parser.error(
            "this CPU has no bfloat16 matmuls in oneDNN (AVX-512 BF16, AMX): the engine "
            "would run F.linear unpacked; use --dtype float32"
        )
    use_threads(torch.get_num_threads())
    dtype = getattr(torch, args.dtype)
    load_start = load_str()
    results = {}
    for name, shape in SHAPES.items():
        table = measure(shape, dtype, args.rows, args.copies, args.rounds)
        results[name] = {"shape": list(shape), "table": table}
        size = shape[0] * shape[1] * dtype.itemsize / 2**20
        copies = f"{args.copies} copies"
        print(f"\n{name} {shape[0]} x {shape[1]} ({size:.1f} MiB in {args.dtype}, {copies})")
        print("| kind                 |      us |   GB/s | share of read |")
        print("|----------------------|---------|--------|---------------|")
        for row in table:
            print(
                f"| {row['kind']:20s} | {row['us']:7.1f} | {row['GBps']:6.2f} | "
                f"{row['share_of_read']:13.2f} |"
            )
    record = {
        "benchmark": "weight_stream",
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "copies": args.copies,
        "rounds": args.rounds,
        "projections": results,
        "load_average": {"start": load_start, "end": load_str()},
        "machine": machine_record("decode matmuls against the machine's read rate"),
    }
    write_results(args.out, record)


if __name__ == "__main__":
    main()
