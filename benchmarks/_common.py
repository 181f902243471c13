"""Helpers the benchmark scripts share (not a benchmark itself: `make bench` skips files starting with _)."""

from __future__ import annotations

import os
import statistics
import subprocess
from pathlib import Path


def char_start(data: bytes, i: int) -> bool:
    """Does a UTF-8 character start at byte i (or is i the end)?"""
    return i >= len(data) or not 0x80 <= data[i] <= 0xBF


def source_version() -> dict:
    """The commit the numbers were measured at, and whether the working tree differed from it."""
    root = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True)
        status = subprocess.run(["git", "status", "--porcelain", "--", "src"], cwd=root, capture_output=True,
                                text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "src_modified": None}
    return {"commit": commit.stdout.strip(), "src_modified": bool(status.stdout.strip())}


def load_str() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def best_of(runs: list[dict]) -> dict:
    """The least disturbed run of a system, with the spread of all of them."""
    best = dict(min(runs, key=lambda r: r["seconds"]))
    best["repeats"] = len(runs)
    best["median_seconds"] = statistics.median(r["seconds"] for r in runs)
    best["runs"] = [{"seconds": round(r["seconds"], 4), "load_before": r["load_before"],
                     "load_after": r["load_after"]} for r in runs]
    return best
