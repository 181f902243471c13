"""Nsight Compute's CSV of the paged-attention kernels, boiled down to one row per kernel version
and shape (issue 34): registers, theoretical and achieved occupancy, DRAM and SM throughput, L2 hit
rate, duration -- the medians over each version's launches.

    python benchmarks/ncu_summary.py benchmarks/results/gpu/ncu_versions.csv.gz \
        [--out benchmarks/results/gpu/ncu_versions.json]

The CSV comes from (on the GPU machine, `make gpu-check`'s environment):

    ncu --clock-control none --csv --metrics <METRICS, comma-separated> \
        -k regex:paged_attention python3 benchmarks/paged_attention.py \
        --shapes 64x1024 1x4096 --repeats 2 --only v1 v2 v3 "v3 split" v4 "v4 split" \
        "v4 256 threads regs<=64" --no-write > ncu_versions.csv

A launch is named by its kernel's module (kernels: v1/v2, grouped: v3, tiled: v4), its grid (a
third grid dimension above 1 is a split into partitions) and its block (256 threads: the v4 row
run with 256 threads and registers capped at 64). The benchmark's small correctness case (batch 3)
is left out. Where a split variant launches the very kernel of the unsplit one (batch 64: one
partition is enough), the two are one row.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import io
import json
import statistics
from pathlib import Path

METRICS = {
    "gpu__time_duration.sum": "duration_us",
    "launch__registers_per_thread": "registers_per_thread",
    "sm__maximum_warps_per_active_cycle_pct": "theoretical_occupancy_pct",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "achieved_occupancy_pct",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "dram_throughput_pct",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed": "sm_throughput_pct",
    "lts__t_sector_hit_rate.pct": "l2_hit_rate_pct",
    "dram__bytes_read.sum": "dram_bytes_read",
}
MODULE_VERSION = {"kernels": "v1", "grouped": "v3", "tiled": "v4"}


def version_of(kernel: str, grid: tuple[int, ...], block: tuple[int, ...]) -> str:
    module = kernel.split("::")[0]
    version = MODULE_VERSION.get(module, module)
    split = grid[2] > 1
    if version == "v1":
        return "v2" if split else "v1"
    name = f"{version} split" if split else version
    return f"{name} 256 threads regs<=64" if block[0] == 256 else name


def parse_triple(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.strip("()").split(","))


def summarize(csv_text: str, contexts: dict[int, int]) -> list[dict]:
    """One row per (version, shape); `contexts`: each profiled batch size's context length."""
    lines = csv_text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith('"ID"'))
    table = [line for line in lines[header:] if line.startswith('"')]
    launches: dict[int, dict] = {}
    for row in csv.DictReader(io.StringIO("\n".join(table))):
        grid, block = parse_triple(row["Grid Size"]), parse_triple(row["Block Size"])
        launch = launches.setdefault(
            int(row["ID"]),
            {"kernel": row["Kernel Name"], "grid": grid, "block": block, "metrics": {}},
        )
        if row["Metric Name"] in METRICS:
            value = float(row["Metric Value"].replace(",", ""))
            if row["Metric Name"] == "gpu__time_duration.sum":  # ncu reports nanoseconds
                value /= 1e3
            launch["metrics"][METRICS[row["Metric Name"]]] = value
    groups: dict[tuple, list[dict]] = {}
    for launch in launches.values():
        batch = launch["grid"][0]
        if batch == 3:  # the benchmark's small correctness case
            continue
        key = (version_of(launch["kernel"], launch["grid"], launch["block"]), batch)
        groups.setdefault(key, []).append(launch)
    rows = []
    for (version, batch), group in groups.items():
        metrics = {
            name: round(statistics.median(g["metrics"][name] for g in group), 2)
            for name in METRICS.values()
            if all(name in g["metrics"] for g in group)
        }
        rows.append(
            {
                "version": version,
                "batch": batch,
                "context": contexts[batch],
                "grid": list(group[0]["grid"]),
                "block": list(group[0]["block"]),
                "launches": len(group),
                **metrics,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", type=Path)
    parser.add_argument(
        "--shapes", nargs="+", default=["64x1024", "1x4096"], help="the shapes profiled"
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    contexts = dict(tuple(int(x) for x in shape.split("x")) for shape in args.shapes)
    raw = args.csv.read_bytes()
    text = (gzip.decompress(raw) if args.csv.suffix == ".gz" else raw).decode()
    rows = summarize(text, contexts)
    print(
        f"{'version':<26}{'shape':>9}{'regs':>6}{'theo occ':>9}{'achieved':>9}{'DRAM':>7}"
        f"{'SM':>7}{'L2 hit':>8}{'us':>9}"
    )
    for r in rows:
        print(
            f"{r['version']:<26}{r['batch']:>4}x{r['context']:<4}"
            f"{r['registers_per_thread']:>6.0f}{r['theoretical_occupancy_pct']:>8.1f}%"
            f"{r['achieved_occupancy_pct']:>8.1f}%{r['dram_throughput_pct']:>6.1f}%"
            f"{r['sm_throughput_pct']:>6.1f}%{r['l2_hit_rate_pct']:>7.1f}%{r['duration_us']:>9.1f}"
        )
    out = args.out or Path(str(args.csv).removesuffix(".gz")).with_suffix(".json")
    record = {
        "source": args.csv.name,  # the whole CSV, gzipped beside this file
        "tool": "Nsight Compute, --clock-control none, medians over each version's launches",
        "rows": rows,
    }
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
