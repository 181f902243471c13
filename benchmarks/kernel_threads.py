"""The CPU attention kernel on two threads or on one, inside the engine (issue 32).

    python benchmarks/kernel_threads.py [--steps 60] [--rounds 2] [--calls 40] [--out PATH]
    NUMBA_THREADING_LAYER=workqueue python benchmarks/kernel_threads.py   # the other layer

The numba backend runs the parallel kernel (`_paged_attention_kernel`, on numba's threading layer:
OpenMP where its threads are passive, else the workqueue) when torch has more than one thread and
the pass costs at least `PARALLEL_MIN_COST`, and the serial one (`_paged_attention_serial`, the
calling thread) otherwise. Between two attention calls
the engine runs torch's matmuls on torch's own threads, so the kernel's threads have gone to sleep
by the time they are needed, and waking them has a cost (on a virtual machine, waking a halted
vCPU is a trip through the hypervisor). This measures whether the second thread pays for
itself, two ways:

* **engine steps**: two engines of the shipped target model at the same batch (1, 16, 64), one
  with each kernel, stepped alternately (same process, same moments of noise); the median decode
  step of each, tokens compared;
* **the kernel alone** at a few shapes (sequences x context), each call after torch matmuls like
  those the engine runs between layers, and back to back (no torch work between calls),
  alternating serial and parallel calls.

Both variants see the same load; the load is recorded. A default should change on a quiet machine's
numbers only. A process has one threading layer: the record names it, and its default file is
`kernel_threads.json` for OpenMP, `kernel_threads_workqueue.json` for the workqueue.
"""

from __future__ import annotations

import minivllm  # noqa: F401 -- before torch: it sets OMP_WAIT_POLICY, read as torch loads

# isort: split
import argparse
import statistics
import time
from pathlib import Path

import numba
import torch
from _common import load_str, machine_record, write_results

from minivllm.attention import numba_cpu
from minivllm.book.kernel_check import decode_call
from minivllm.book.step_timing import decode_engine
from minivllm.model.checkpoint import load_model

RESULTS = Path(__file__).parent / "results" / "kernel_threads.json"
RESULTS_WORKQUEUE = RESULTS.with_name("kernel_threads_workqueue.json")
THREADS = 2
# (the smallest pass that runs in parallel, the kernel for a thread count) per variant
KERNELS = {
    "parallel": (0, numba_cpu._kernel_for),  # every pass on torch's 2 threads
    "serial": (0, lambda threads: numba_cpu._paged_attention_serial),
}
ENGINE_CHOICE = (numba_cpu.PARALLEL_MIN_COST, numba_cpu._kernel_for)


def use(variant: tuple) -> None:
    """Make the numba backend pick as `variant` says (read as each pass builds its backend)."""
    numba_cpu.PARALLEL_MIN_COST, numba_cpu._kernel_for = variant


SHAPES = [(1, 64), (1, 1024), (16, 175), (64, 175), (64, 700), (64, 2000)]


def engine_steps(model, batches: list[int], steps: int) -> list[dict]:
    rows = []
    for batch in batches:
        engines = {}
        for name, variant in KERNELS.items():
            use(variant)
            engines[name] = decode_engine(model, "numba", num_seqs=batch)
        times = {name: [] for name in KERNELS}
        before = load_str()
        try:
            for _ in range(steps):
                for name, engine in engines.items():
                    use(KERNELS[name])
                    started = time.perf_counter()
                    engine.step()
                    times[name].append(time.perf_counter() - started)
        finally:
            use(ENGINE_CHOICE)
        tokens = {
            name: [list(s.output_token_ids) for s in engine.scheduler.running]
            for name, engine in engines.items()
        }
        row = {
            "batch": batch,
            "steps": steps,
            "load_before": before,
            "load_after": load_str(),
            "same_tokens": tokens["parallel"] == tokens["serial"],
        }
        for name, seconds in times.items():  # the first steps warm caches and the allocator
            row[f"{name}_step_ms"] = round(statistics.median(seconds[5:]) * 1e3, 3)
        row["serial_over_parallel"] = round(row["serial_step_ms"] / row["parallel_step_ms"], 3)
        print(
            f"batch {batch:>3}: parallel {row['parallel_step_ms']:7.2f} ms, serial "
            f"{row['serial_step_ms']:7.2f} ms a step (load {before} -> {row['load_after']})",
            flush=True,
        )
        rows.append(row)
    return rows


def kernel_alone(config, calls: int) -> list[dict]:
    x = torch.randn(64, config.d_model)
    w = torch.randn(4 * config.d_model, config.d_model)
    between = {
        "after torch matmuls": lambda: [torch.nn.functional.linear(x, w) for _ in range(4)],
        "back to back": lambda: None,
    }
    rows = []
    for seqs, context in SHAPES:
        args = decode_call([context] * seqs, config)
        for mode, work in between.items():
            times = {1: [], THREADS: []}
            before = load_str()
            for _ in range(calls):
                for threads in times:
                    work()
                    started = time.perf_counter()
                    numba_cpu.paged_attention_cpu(*args, threads=threads)
                    times[threads].append(time.perf_counter() - started)
            serial, parallel = (statistics.median(times[t]) * 1e3 for t in (1, THREADS))
            rows.append(
                {
                    "shape": f"{seqs} x {context}",
                    "pass_cost": numba_cpu.pass_cost(args[4], args[5], config.n_kv_heads),
                    "mode": mode,
                    "serial_ms": round(serial, 3),
                    "parallel_ms": round(parallel, 3),
                    "serial_over_parallel": round(serial / parallel, 3),
                    "load_before": before,
                    "load_after": load_str(),
                }
            )
            print(
                f"{seqs:>3} x {context:<5} {mode:<19}: serial {serial:7.3f} ms, parallel "
                f"{parallel:7.3f} ms",
                flush=True,
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="decode steps per engine and batch")
    parser.add_argument("--calls", type=int, default=40, help="kernel calls per shape and mode")
    parser.add_argument("--rounds", type=int, default=2, help="repeats of the engine comparison")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 16, 64])
    parser.add_argument("--out", type=Path, help="default: by threading layer (see above)")
    args = parser.parse_args()
    torch.set_num_threads(THREADS)
    numba_cpu.warm_up(1)
    numba_cpu.warm_up(THREADS)
    model = load_model("target")
    load_start = load_str()
    engine = [
        dict(round=r + 1, **row)
        for r in range(args.rounds)
        for row in engine_steps(model, args.batches, args.steps)
    ]
    alone = kernel_alone(model.config, args.calls)
    layer = numba.threading_layer()
    record = {
        "benchmark": "kernel_threads",
        "model": "target",
        "threads": THREADS,
        "threading_layer": layer,
        "parallel_min_cost": ENGINE_CHOICE[0],
        "engine_steps": engine,
        "kernel_alone": alone,
        "load_average": {"start": load_start, "end": load_str()},
        "machine": machine_record("the numba attention kernel on one thread against two"),
    }
    write_results(args.out or (RESULTS if layer == "omp" else RESULTS_WORKQUEUE), record)


if __name__ == "__main__":
    main()
