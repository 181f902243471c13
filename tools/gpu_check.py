"""Everything GPU-side in one command: `make gpu-check` (issue 34, part A).

On a machine with an NVIDIA GPU, from a clean checkout, it runs:

1. the CUDA kernel tests natively (`tests/test_cuda_paged_attention.py`: v1, v2, v3, v4, their
   splits, the full grids of block size x head_dim x group x dtype x partition);
2. the engine's tests, where `device="auto"` now means the GPU, and the real model's greedy tokens
   on the kernel backend against the torch backend (every other test file of `tests/` but the
   book-building ones);
3. every chapter's code cells, in order, in one namespace per chapter (outputs are not compared:
   nbval's recorded outputs are the CPU's; this checks that the chapters *run* on a GPU machine);
4. `benchmarks/paged_attention.py`: each kernel version's achieved bandwidth against the device's
   copy bandwidth, with the registers the compiler gave each kernel;
5. `benchmarks/gpu_engine.py`: the engine on the GPU, torch and kernel backends, against Hugging
   Face `generate` on the same GPU and workload;

then prints a one-screen summary and writes `benchmarks/results/gpu_check.json` (and the two
benchmarks' own JSON beside it), copied to `$OUT` when that variable is set. Each stage has a time
limit, so one hung stage cannot take the others with it; the exit status is 1 when any stage
failed. Without a GPU it says so and exits 0 having run nothing (CI never has one).

The machine. The GPU machines this project is lent have Python 3.12, torch 2.11 (CUDA 13), numba,
numba-cuda, numpy 2.5, transformers, pytest and pytest-xdist installed, and no network. The
project's pins are held by bringing wheels built for Python 3.12 in `.whl/`, which this script
installs into a private folder (`/tmp/minivllm-site`, put first on `PYTHONPATH`) before anything
runs; the package itself runs from `src/` (no install). On a machine with network, in the
repository root:

    tools/gpu_check.py --download-wheels   # fills .whl/ (about 26 MB), Python 3.12 manylinux

which downloads `numpy<2.5` (numba-cuda 0.30.4's kernels do not import under numpy 2.5),
`numba==0.68.1`, `numba-cuda==0.30.4`, and, for the server's tests, fastapi (with the
opentelemetry-api it imports), starlette, pydantic and uvicorn, at the versions `make test`
installs. numba 0.68.1 needs llvmlite 0.50, which those machines already have
(`--download-wheels --llvmlite` adds its 60 MB wheel if not). Then, on the GPU machine:

    make gpu-check            # or: python3 tools/gpu_check.py [--skip STAGE ...] [--quick]
                              #   [--benchmarks-first SECONDS] [--chapters FILE ...]

A short lease: `--benchmarks-first` times the benchmarks alone on the GPU before the checks share
it, and `--chapters` runs the chapters that changed (the 2026-11-26 calls are in
benchmarks/results/gpu/README.md).

With the project's `device` tool here: `run(command="make gpu-check", carry=[".whl"])`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
WHEELS = ROOT / ".whl"
SITE = Path("/tmp/minivllm-site")
WHEEL_PINS = [
    # the versions `make test` installs on a CPU machine, so both devices run the same code
    "numpy==2.4.6",
    "numba==0.68.1",
    "numba-cuda==0.30.4",
    "fastapi==0.165.0",
    "starlette==1.10.0",
    "pydantic==2.14.4",
    "pydantic-core==2.50.5",
    "annotated-types==0.7.0",
    "typing-inspection==0.4.5",
    "uvicorn==0.54.0",
    "typing-extensions==4.16.0",
    "opentelemetry-api==1.45.2",  # fastapi imports it
    # chapter 09 calls the server with the official clients
    "openai==3.57.0",
    "anthropic==2.14.0",
    "jiter==0.19.0",
    "httpx2==2.16.2",
    "httpcore2==2.16.2",
    "truststore==0.10.5",
    "docstring-parser==0.18.0",
    "sniffio==1.3.1",
    # chat templates (issue 29); `tokenizers` comes with the machine's transformers
    "jinja2==3.1.6",
    "markupsafe==3.0.4",
]
LLVMLITE = "llvmlite==0.50.0"
# Test files that build the HTML book or a student copy (they need the book's toolchain, not a GPU).
NOT_GPU_TESTS = {"test_book_offline.py", "test_student_mode.py"}
STAGES = ("kernels", "engine", "chapters", "paged_attention", "gpu_engine", "gpu_engine_real")
BENCHMARK_RESERVE_S = 200  # of the budget, kept for the two benchmarks after the checks


def download_wheels(with_llvmlite: bool) -> None:
    WHEELS.mkdir(exist_ok=True)
    platforms = [
        f"--platform={p}"
        for p in (
            "manylinux_2_28_x86_64",
            "manylinux_2_27_x86_64",
            "manylinux_2_24_x86_64",
            "manylinux_2_17_x86_64",
            "manylinux2014_x86_64",
            "any",
        )
    ]
    pins = WHEEL_PINS + ([LLVMLITE] if with_llvmlite else [])
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
        + ["--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(WHEELS)]
        + pins,
        check=True,
    )
    print(f"{len(list(WHEELS.glob('*.whl')))} wheels in {WHEELS}")


def install_wheels() -> str:
    """Install the carried wheels privately; returns what happened, for the record."""
    wheels = sorted(WHEELS.glob("*.whl"))
    if not wheels:
        return "no .whl/ folder: the machine's own packages"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
        + ["--no-cache-dir", "--upgrade", "--target", str(SITE), *map(str, wheels)],
        check=True,
    )
    return f"installed {len(wheels)} wheels from .whl/ into {SITE}"


def environment() -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(SITE), str(ROOT / "src")] + [p for p in [env.get("PYTHONPATH")] if p]
    env.update(
        PYTHONPATH=os.pathsep.join(paths),
        PYTHONUNBUFFERED="1",
        PYTHONHASHSEED="0",
        MPLBACKEND="Agg",
        OMP_WAIT_POLICY="PASSIVE",
    )
    env.setdefault("OMP_NUM_THREADS", "2")
    return env


class Stage:
    """One stage as a subprocess, its output to a log file, ended at its deadline."""

    def __init__(self, name: str, command: list[str], deadline: float, env: dict, log_dir: Path):
        self.name, self.deadline, self.started = name, deadline, time.perf_counter()
        self.log = log_dir / f"gpu_check_{name}.log"
        print(f"== {name}: {' '.join(command)}", flush=True)
        with self.log.open("w") as out:
            # a session of its own: at the deadline the whole stage goes, children included
            self.proc = subprocess.Popen(
                command,
                cwd=ROOT,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def wait(self) -> dict:
        try:
            code = self.proc.wait(timeout=max(1.0, self.deadline - time.perf_counter()))
            status = "passed" if code == 0 else f"failed (exit {code})"
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            status = "timed out"
        seconds = time.perf_counter() - self.started
        tail = self.log.read_text(errors="replace").splitlines()[-15:]
        print(f"   {self.name}: {status} in {seconds:.0f} s", flush=True)
        result = {"stage": self.name, "status": status, "seconds": round(seconds, 1)}
        if self.name in ("kernels", "engine"):
            result["pytest"] = pytest_counts(tail)
        return result | {"log": self.log.name, "tail": tail}


def pytest_counts(tail: list[str]) -> str:
    """pytest's last line: '3 failed, 120 passed, 2 skipped in 40.1s'."""
    for line in reversed(tail):
        if re.search(r"\d+ (passed|failed|error)", line):
            return line.strip("= ")
    return "no pytest summary"


def versions(env: dict) -> dict:
    code = (
        "import json, importlib.metadata as m, torch, platform\n"
        "v = {p: m.version(p) for p in ('numpy', 'numba', 'numba-cuda', 'llvmlite',"
        " 'transformers')}\n"
        "v.update(python=platform.python_version(), torch=torch.__version__,"
        " cuda_runtime=torch.version.cuda, gpu=torch.cuda.get_device_name(),"
        " sms=torch.cuda.get_device_properties(0).multi_processor_count)\n"
        "print(json.dumps(v))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False
    )
    record = json.loads(proc.stdout) if proc.returncode == 0 else {"error": proc.stderr[-2000:]}
    smi = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        check=False,
    )
    record["nvidia_smi"] = smi.stdout.strip()
    return record


def chapter_stage_command(chapters: list[str]) -> list[str]:
    jobs = str(len(chapters))  # side by side: the GPU machines have the cores
    return [sys.executable, str(ROOT / "tools" / "run_chapter_cells.py"), "--jobs", jobs, *chapters]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--download-wheels", action="store_true", help="fill .whl/ and stop")
    parser.add_argument("--llvmlite", action="store_true", help="with --download-wheels")
    parser.add_argument("--skip", nargs="+", choices=STAGES, default=[])
    parser.add_argument("--quick", action="store_true", help="fewer benchmark repeats")
    parser.add_argument("--workers", type=int, default=8, help="pytest-xdist workers")
    parser.add_argument(
        "--budget", type=float, default=560, help="seconds for everything (a device call: 600)"
    )
    parser.add_argument(
        "--benchmarks-first",
        type=float,
        metavar="SECONDS",
        default=None,
        help="run the benchmarks first, alone on the GPU, within SECONDS; then the checks",
    )
    parser.add_argument(
        "--chapters", nargs="+", default=None, help="chapter files for the chapters stage (all)"
    )
    args = parser.parse_args()
    if args.download_wheels:
        download_wheels(args.llvmlite)
        return
    if shutil.which("nvidia-smi") is None:
        print("gpu-check: no NVIDIA GPU here (no nvidia-smi); nothing run. CI never has one.")
        return
    started = time.perf_counter()
    RESULTS.mkdir(parents=True, exist_ok=True)
    installed = install_wheels()
    env = environment()
    record = {"installed": installed, "versions": versions(env), "stages": []}
    print(f"{installed}\n{json.dumps(record['versions'])}", flush=True)
    xdist = ["-n", str(args.workers)] if args.workers > 1 else []
    pytest = [sys.executable, "-m", "pytest", "-p", "no:randomly", "-q", "-rfE", *xdist]
    tests = sorted(
        str(p.relative_to(ROOT))
        for p in (ROOT / "tests").glob("test_*.py")
        if p.name not in NOT_GPU_TESTS | {"test_cuda_paged_attention.py"}
    )
    chapters = args.chapters or sorted(
        str(p.relative_to(ROOT)) for p in (ROOT / "chapters").glob("[0-9]*.py")
    )
    repeats = "10" if args.quick else "50"
    # Correctness first, side by side (the machine has cores to spare), then each benchmark alone
    # on the GPU. Every stage ends by the deadline, so the record always comes back.
    deadline = started + args.budget
    checks = {
        "kernels": pytest + ["tests/test_cuda_paged_attention.py"],
        "engine": pytest + tests,
        "chapters": chapter_stage_command(chapters),
    }
    benchmarks = {
        "paged_attention": [sys.executable, "benchmarks/paged_attention.py", "--repeats", repeats],
        "gpu_engine": [
            sys.executable,
            "benchmarks/gpu_engine.py",
            "--repeats",
            "1" if args.quick else "3",
        ],
        # the same on a random checkpoint of Qwen3-0.6B's shape, in float16 (the kernels' dtype),
        # with CUDA graphs only: 28 layers of eager steps are CPU-bound and cost several times
        # the graphs' time, and the shipped model's stage already measures eager against graphs
        "gpu_engine_real": [
            sys.executable,
            "benchmarks/gpu_engine.py",
            "--shape",
            "qwen3-0.6b",
            "--dtype",
            "float16",
            "--repeats",
            "1" if args.quick else "3",
            "--modes",
            "graphs",
            "--out",
            str(RESULTS / "gpu_engine_real.json"),
        ],
    }

    def run_checks(until: float) -> None:
        running = [
            Stage(name, command, until, env, RESULTS)
            for name, command in checks.items()
            if name not in args.skip
        ]
        for stage in running:
            record["stages"].append(stage.wait())
            save(record, started)

    def run_benchmarks(until: float) -> None:
        for name, command in benchmarks.items():
            if name not in args.skip:
                record["stages"].append(Stage(name, command, until, env, RESULTS).wait())
                path = RESULTS / f"{name}.json"
                if path.exists() and path.stat().st_mtime > time.time() - (
                    time.perf_counter() - started
                ):
                    record[name] = json.loads(path.read_text())
                save(record, started)

    if args.benchmarks_first is not None:
        run_benchmarks(started + args.benchmarks_first)
        run_checks(deadline)
    else:
        # time kept for the benchmarks after the checks, unless they are skipped
        reserve = BENCHMARK_RESERVE_S if set(benchmarks) - set(args.skip) else 0
        run_checks(deadline - reserve)
        run_benchmarks(deadline)
    summary(record)
    failed = [s["stage"] for s in record["stages"] if s["status"] != "passed"]
    sys.exit(1 if failed else 0)


def save(record: dict, started: float) -> None:
    """The record so far, to benchmarks/results/ and $OUT (a killed run still leaves it)."""
    record["seconds"] = round(time.perf_counter() - started, 1)
    out_path = RESULTS / "gpu_check.json"
    out_path.write_text(json.dumps(record, indent=2) + "\n")
    if os.environ.get("OUT"):
        out = Path(os.environ["OUT"])
        for name in ("gpu_check", "paged_attention", "gpu_engine", "gpu_engine_real"):
            path = RESULTS / f"{name}.json"
            if path.exists():
                shutil.copy(path, out / path.name)
        logs = out / "logs"  # the record holds each log's tail; the whole log where it failed
        logs.mkdir(exist_ok=True)
        for stage in record["stages"]:
            if stage["status"] != "passed" or stage["stage"] == "chapters":
                shutil.copy(RESULTS / stage["log"], logs / stage["log"])


def summary(record: dict) -> None:
    v = record["versions"]
    print("\n" + "=" * 78)
    print(f"gpu-check on {v.get('nvidia_smi')}")
    print(
        f"python {v.get('python')}, torch {v.get('torch')} (CUDA {v.get('cuda_runtime')}), numba "
        f"{v.get('numba')}, numba-cuda {v.get('numba-cuda')}, numpy {v.get('numpy')}"
    )
    for stage in record["stages"]:
        extra = f"  [{stage['pytest']}]" if "pytest" in stage else ""
        print(f"  {stage['stage']:<16}{stage['status']:<26}{stage['seconds']:>6.0f} s{extra}")
    pa = record.get("paged_attention")
    if pa:
        peak = pa["copy_bandwidth_bytes_per_second"]
        print(f"paged attention (copy bandwidth {peak / 1e9:,.0f} GB/s):")
        for row in pa["rows"]:
            print(f"  {row_text(row)}")
    for name in ("gpu_engine", "gpu_engine_real"):
        ge = record.get(name)
        if not ge:
            continue
        print(f"engine on the GPU, {ge['workload']['model']} (median tokens/s):")
        for row in ge["rows"]:
            differing = row["requests_differing_from_torch_backend"]
            reference = row.get("reference", "torch backend")
            print(
                f"  {row['system']:<40}{row['median_tokens_per_s']:>10,.0f}  differ from "
                f"{reference}: {differing}"
            )
    print(f"total {record['seconds']:.0f} s; JSON: benchmarks/results/gpu_check.json")


def row_text(row: dict) -> str:
    """One shape: each system's microseconds and share of the copy bandwidth."""
    cells = [
        f"{name} {r['device_seconds'] * 1e6:.0f} us {r['share_of_copy_bandwidth']:.0%}"
        for name, r in row["systems"].items()
    ]
    return f"{row['batch']}x{row['context']}: " + "; ".join(cells)


if __name__ == "__main__":
    main()
