"""Helpers the benchmark scripts share (not a benchmark itself: `make bench` skips files
starting with _): the seeded workload of validation-text prompts, machine and source records,
best-of-N runs."""

from __future__ import annotations

import datetime
import json
import os
import statistics
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from minivllm.model.tokenizer import ByteTokenizer
from minivllm.training.corpus import shipped_validation_text

ROOT = Path(__file__).resolve().parent.parent


def char_start(data: bytes, i: int) -> bool:
    """Does a UTF-8 character start at byte i (or is i the end)?"""
    return i >= len(data) or not 0x80 <= data[i] <= 0xBF


def source_version() -> dict:
    """The commit the numbers were measured at, and whether the working tree differed from it."""
    root = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        )
        status = subprocess.run(
            ["git", "status", "--porcelain", "--", "src"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "src_modified": None}
    return {"commit": commit.stdout.strip(), "src_modified": bool(status.stdout.strip())}


def cpu_model() -> str:
    """The processor's name as Linux reports it (/proc/cpuinfo), else the platform's word."""
    import platform

    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# The instruction-set flags a CPU path can pick by: vector width (AVX2, AVX-512), fused
# multiply-add, and the bfloat16 / matrix units a bf16 path needs (AVX-512 BF16, AMX).
VECTOR_FLAGS = (
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
    "asimd",
    "sve",
)


def cpu_features() -> dict:
    """What the CPU offers the paths that pick by it: the vector flags Linux lists, the level
    torch's kernels dispatch to, and the CPU numba's compiler (LLVM) targets for the kernels."""
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    import torch

    record = {
        "vector_flags": [f for f in VECTOR_FLAGS if f in flags],
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }
    try:
        import llvmlite.binding as llvm

        record["llvm_cpu"] = llvm.get_host_cpu_name()
    except ImportError:
        pass
    return record


def machine_record(note: str, **extra) -> dict:
    """Where and when the numbers were measured: the platform, the CPU, cores, torch and its
    threads, the load average at the end, the date (UTC) and the source commit; `extra` adds or
    overrides fields (a benchmark's own versions, say)."""
    import platform

    import torch

    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_model": cpu_model(),
        "cpu_features": cpu_features(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"),
        "GOMP_SPINCOUNT": os.environ.get("GOMP_SPINCOUNT"),  # torch's (numba's sleep, if PASSIVE)
        "core_watch": core_watch_record(),
        **extra,
        "load_average_at_end": load_str(),
        "recorded_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "source": source_version(),
        "note": note,
    }


def core_watch_record() -> dict:
    """Whether this process's passes watched its cores (torch's threads spin:
    `minivllm.runner.threads`), and how many of them, so far, got fewer threads than torch has
    because other processes kept the cores busy."""
    from minivllm.runner import threads

    watch = threads.core_watch()
    return {
        "watching": threads.WATCH_CORES and not threads.THREADS_SLEEP,
        "passes": watch.asked,
        "narrowed": watch.narrowed,
    }


def write_results(path: Path, record: dict) -> None:
    """A benchmark's JSON record at `path` (its folder made if need be), said on stdout."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")
    full = path.resolve()
    shown = full.relative_to(ROOT) if full.is_relative_to(ROOT) else path
    print(f"wrote {shown}")


def load_str() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def print_run(repeat: int, repeats: int, run: dict, width: int, extra: str = "") -> None:
    """One timed run's progress line: system, tokens/s, seconds and the load around it."""
    print(
        f"  [{repeat + 1}/{repeats}] {run['system']:<{width}} "
        f"{run['tokens'] / run['seconds']:8.1f} tokens/s ({run['seconds']:6.2f} s, "
        f"load {run['load_before']} -> {run['load_after']}{extra})",
        flush=True,
    )


def cpu_seconds_of(pids: list[int]) -> float:
    """CPU seconds (user + system) other processes of ours have run so far, from /proc (Linux;
    0 elsewhere): an engine's forward workers."""
    ticks, total = os.sysconf("SC_CLK_TCK"), 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
    return total


def best_of(runs: list[dict]) -> dict:
    """The least disturbed run of a system, with the spread of all of them."""
    best = dict(min(runs, key=lambda r: r["seconds"]))
    best["repeats"] = len(runs)
    best["median_seconds"] = statistics.median(r["seconds"] for r in runs)
    best["runs"] = [
        {
            "seconds": round(r["seconds"], 4),
            "load_before": r["load_before"],
            "load_after": r["load_after"],
        }
        for r in runs
    ]
    return best


@dataclass(frozen=True)
class Request:
    index: int
    prompt: str
    prompt_ids: list[int]
    max_tokens: int


def make_workload(
    num_requests: int,
    seed: int,
    prompt_bytes: tuple[int, int] = (16, 200),
    output_tokens: tuple[int, int] = (32, 256),
) -> list[Request]:
    """Seeded requests: a random slice of the validation text as the prompt, a uniform output
    length."""
    data = shipped_validation_text().encode("utf-8")
    rng = np.random.default_rng(seed)
    tokenizer, requests = ByteTokenizer(), []
    lo, hi = prompt_bytes
    for index in range(num_requests):
        length = int(rng.integers(lo, hi + 1))
        start = int(rng.integers(0, len(data) - hi - 8))
        while not char_start(data, start):
            start += 1
        end = start + length
        while not char_start(data, end) and end > start:  # never cut a character in two
            end -= 1
        while end - start < lo or not char_start(data, end):  # ... nor go under the minimum
            end += 1
        prompt = data[start:end].decode("utf-8")
        max_tokens = int(rng.integers(output_tokens[0], output_tokens[1] + 1))
        requests.append(Request(index, prompt, tokenizer.encode(prompt, add_bos=True), max_tokens))
    return requests


def start_server(*serve_args: str) -> tuple[subprocess.Popen, str]:
    """`minivllm serve *serve_args` in a process of its own, on a free local port; returns the
    process and its URL once /health answers (or exits, saying why the server did not start)."""
    import socket
    import sys
    import time

    import httpx

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "minivllm.cli", "serve", "--port", str(port)]
    command += [*serve_args, "--log-level", "warning"]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 120
    while True:
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise SystemExit(f"the server did not start: {process.communicate()[1][-2000:]}")
        try:
            if httpx.get(url + "/health").status_code == 200:
                return process, url
        except httpx.TransportError:
            time.sleep(0.2)
