"""Fair admission: how long a small request waits behind a big one (issue 30, item 3).

    python benchmarks/fair_admission.py [--before-ref main] [--repeats 2] [--prompts 32] [--n 16]
                                        [--max-tokens 200] [--threads 1] [--out PATH]

The issue's repro, on the server's engine path without HTTP: one client's request of `--prompts`
prompts x n=`--n` samples x `--max-tokens` tokens (greedy would make the n samples equal, so
temperature 1 with a seed; ignore_eos, so every answer is max_tokens long) goes into an
`AsyncEngine` (the server's engine thread and its `add_request`, as the completions endpoint
calls it), then, once the big request's first tokens are out, another client's 5-token prompt
(max_tokens 16). The engine is `minivllm serve`'s default: max_num_seqs 64, a 512-token budget,
2048 blocks of 16 tokens. Measured: the small request's time to first token, in engine steps (the
scheduler's step counter when it was added and when its first text came back; read through the
engine's inbox, so it may be one step late) and in seconds; then both requests are aborted.

"before" is the code at `--before-ref` (its src/, unpacked with `git archive` into a temporary
folder), "after" this working tree; each run is a fresh process, before and after alternating,
`--repeats` times each. Steps do not depend on the machine; seconds do (a shared 2-core machine is
noisy: the load average is recorded with each run).

Prints a table and writes benchmarks/results/fair_admission.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).parent / "results" / "fair_admission.json"
SMALL_PROMPT = "HAMLET"  # 5 tokens after BOS: the "5-token request"


def measure(args: argparse.Namespace) -> dict:
    """One run in this process, with whichever minivllm is on the path."""
    import minivllm  # noqa: F401 -- before torch: it sets OMP_WAIT_POLICY, read as torch loads

    # isort: split
    import torch

    from minivllm.engine.config import EngineConfig
    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.model.checkpoint import load_model
    from minivllm.sched.scheduler import SchedulerConfig
    from minivllm.sched.sequence import SamplingParams
    from minivllm.serving.async_engine import AsyncEngine

    torch.set_num_threads(args.threads)
    scheduler = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=512)
    config = EngineConfig(num_blocks=2048, block_size=16, scheduler=scheduler)
    engine = LLMEngine(load_model("target"), config)
    prompts = [f"CITIZEN {i}:\n" for i in range(args.prompts)]
    big = SamplingParams(
        max_tokens=args.max_tokens, temperature=1.0, seed=0, n=args.n, ignore_eos=True
    )
    small = SamplingParams(max_tokens=16, temperature=0)

    def step_now() -> int:
        return async_engine.call(lambda e: e.scheduler.step)

    async def main() -> dict:
        big_stream = await async_engine.add_request(prompts, big)
        async with big_stream:
            await anext(aiter(big_stream))  # the big request is running
            start_step, start = step_now(), time.perf_counter()
            small_stream = await async_engine.add_request([SMALL_PROMPT], small)
            async with small_stream:
                async for delta in small_stream:
                    if delta.text:
                        break
                seconds, steps = time.perf_counter() - start, step_now() - start_step
        return {"ttft_steps": steps, "ttft_seconds": seconds}

    with AsyncEngine(engine) as async_engine:
        load_before = os.getloadavg()[0]
        result = asyncio.run(main())
    return {**result, "load_before": load_before, "load_after": os.getloadavg()[0]}


def unpack_src(ref: str, into: Path) -> Path:
    archive = subprocess.run(
        ["git", "archive", "--format=tar", ref, "src"], cwd=ROOT, capture_output=True, check=True
    ).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into / "src"


def run_child(src: Path, args: argparse.Namespace) -> dict:
    env = {**os.environ, "PYTHONPATH": str(src)}
    command = [sys.executable, __file__, "--child", *sys.argv[1:]]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before-ref", default="main")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args)))
        return
    sys.path.insert(0, str(ROOT / "src"))
    sys.path.insert(0, str(Path(__file__).parent))
    from _common import machine_record, write_results

    runs: dict[str, list[dict]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as tmp:
        sources = {"before": unpack_src(args.before_ref, Path(tmp)), "after": ROOT / "src"}
        for repeat in range(args.repeats):
            for system in ("before", "after"):
                run = run_child(sources[system], args)
                runs[system].append(run)
                print(
                    f"  [{repeat + 1}/{args.repeats}] {system:<6} {run['ttft_steps']:5d} steps "
                    f"{run['ttft_seconds']:7.2f} s (load {run['load_before']:.2f} -> "
                    f"{run['load_after']:.2f})",
                    flush=True,
                )
    summary = {
        system: {
            "ttft_steps_median": statistics.median(r["ttft_steps"] for r in rs),
            "ttft_seconds_median": statistics.median(r["ttft_seconds"] for r in rs),
            "runs": rs,
        }
        for system, rs in runs.items()
    }
    print(f"\nbig: {args.prompts} prompts x n={args.n} x {args.max_tokens} tokens; small: 5 tokens")
    print(f"{'system':<8} {'TTFT steps':>10} {'TTFT s':>8}")
    for system, row in summary.items():
        label = f"{system} ({args.before_ref})" if system == "before" else system
        print(f"{label:<14} {row['ttft_steps_median']:>6} {row['ttft_seconds_median']:8.2f}")
    record = {
        "workload": {
            "prompts": args.prompts,
            "n": args.n,
            "max_tokens": args.max_tokens,
            "small_prompt": SMALL_PROMPT,
            "max_num_seqs": 64,
            "num_blocks": 2048,
        },
        "before_ref": args.before_ref,
        "results": summary,
        "machine": machine_record(
            "medians over fresh processes, before and after alternating", torch_threads=args.threads
        ),
    }
    write_results(args.out, record)


if __name__ == "__main__":
    main()
