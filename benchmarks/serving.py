"""Serving: the OpenAI-compatible server under 1-64 concurrent streaming clients, against the
offline engine (chapter 09).

    python benchmarks/serving.py [--concurrency 1 8 32 64] [--requests-per-client 2]
                                 [--min-requests 16] [--output-tokens 32 96] [--threads 1]
                                 [--repeats 3] [--seed 0] [--quick] [--out PATH]

The server runs as `minivllm serve` in a process of its own (the shipped target model, default
engine: 2048 blocks, max_num_seqs 64, a 512-token budget per step, `--threads` torch threads); the
clients run in this process, over loopback, with `httpx`'s async client. One torch thread by
default: on the 2-core machine the engine thread gets one core and the event loop and the clients
share the other; with two, the engine's OpenMP threads fight the clients for the cores and every run
is slower and far noisier. At concurrency c, c clients share one list of requests: each sends the
next one, reads its stream to `[DONE]`, and sends the next, until the list is done (a closed loop: c
requests in flight, then a tail as the last ones finish). A level has max(--min-requests, c x
--requests-per-client) requests: the first of one seeded workload (prompts are 16-200-byte slices of
the held-out plays, BOS first; --output-tokens generated each, greedy, ignore_eos).

What is measured, from the client's side of the socket:

* throughput: generated tokens (the `usage` of each stream) / wall seconds of the whole level;
* TTFT, time to first token: from sending the request to the first chunk that carries text;
* ITL, inter-token latency: the gaps between a stream's consecutive text chunks, pooled over
  requests.

The offline engine (`LLMEngine.generate`, in this process, the same threads) runs the same requests
twice: with max_num_seqs = c, the same concurrency (so the share is the cost of serving alone), and
with max_num_seqs = 64, the engine at full batch (the issue's goal: the server at 64 clients reaches
>= 80 % of it). Every system runs `--repeats` times, round-robin, and the best (least disturbed) run
is reported, with each run's load average: on a shared 2-core machine one run can be far slower than
the next. Beside the best-against-best share, "paired" is the median over repeats of server /
offline at full batch within one repeat (runs a minute apart see the same machine). Greedy texts are
compared with the offline engine's (reported, not asserted).

What holds the server below the offline engine at 64 clients (profiled on the 2-core machine): the
scheduling is the same -- the server runs as many steps as the offline engine, with the same batches
(189 against 188 steps, 44 sequences on average) -- and its engine thread is inside `step()` 95 % of
the wall clock; but each forward pass takes 15-25 % longer. The event loop spends 100-120 us of CPU
per streamed token (h11, asyncio, Starlette, the JSON, a loopback `send`), in the same process as
the engine: while it holds the GIL the engine thread cannot start its next torch op, and engine CPU
+ loop CPU add up to the wall clock (a pure-Python thread busy 10 % of the time slows the offline
engine by 20 % the same way). Handing a step's deltas to the loop with one `call_soon_threadsafe`
instead of one per token makes no measurable difference (the wake-up is not the cost, the per-chunk
HTTP work is); two torch threads make every run slower and noisier; a smaller GIL switch interval
changes nothing measurable; uvloop + httptools (uvicorn[standard]) cut the loop's CPU per token by
about a quarter. The cure vLLM chose is the engine in a process of its own, so the HTTP side never
competes with it for one interpreter lock.

Prints a table and writes benchmarks/results/serving.json (a --quick smoke run writes nothing unless
--out is given).
"""

from __future__ import annotations

import minivllm  # noqa: F401 -- before torch: it sets OMP_WAIT_POLICY, read as torch loads

# isort: split
import argparse
import asyncio
import statistics
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
from _common import (
    Request,
    best_of,
    load_str,
    machine_record,
    make_workload,
    start_server,
    write_results,
)

from minivllm.engine.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.model.checkpoint import load_model
from minivllm.model.transformer import Transformer
from minivllm.sched.scheduler import SchedulerConfig
from minivllm.sched.sequence import SamplingParams
from minivllm.serving.client import run_clients

RESULTS = Path(__file__).parent / "results" / "serving.json"
FULL_BATCH = 64  # the server's max_num_seqs, and the offline engine's at full batch
GOAL_CLIENTS, GOAL_SHARE = 64, 0.80


# -- the clients (minivllm.serving.client: closed-loop streaming clients that time every chunk) ----


def run_server(url: str, requests: list[Request], concurrency: int) -> dict:
    bodies = [
        {
            "model": "target",
            "prompt": r.prompt,
            "max_tokens": r.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }
        for r in requests
    ]
    load_before = load_str()
    seconds, streams = asyncio.run(run_clients(url + "/v1", bodies, concurrency))
    return {
        "system": f"server, {concurrency} clients",
        "seconds": seconds,
        "tokens": sum(s.completion_tokens for s in streams),
        "ttft_ms": percentiles([s.ttft for s in streams]),
        "itl_ms": percentiles([gap for s in streams for gap in s.itls]),
        "texts": [s.text for s in streams],
        "load_before": load_before,
        "load_after": load_str(),
    }


def percentiles(seconds: list[float]) -> dict:
    values = np.array(seconds) * 1000
    return {
        "p50": round(float(np.percentile(values, 50)), 2),
        "p99": round(float(np.percentile(values, 99)), 2),
        "mean": round(float(values.mean()), 2),
        "count": len(values),
    }


# -- the offline engine ----------------------------------------------------------------------------


def run_offline(model: Transformer, requests: list[Request], max_num_seqs: int) -> dict:
    engine = LLMEngine(model, EngineConfig(scheduler=SchedulerConfig(max_num_seqs=max_num_seqs)))
    params = [
        SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True) for r in requests
    ]
    load_before, started = load_str(), time.perf_counter()
    outputs = engine.generate([r.prompt_ids for r in requests], params)
    seconds = time.perf_counter() - started
    return {
        "system": f"offline, max_num_seqs {max_num_seqs}",
        "seconds": seconds,
        "tokens": sum(len(o.token_ids) for o in outputs),
        "texts": [o.text for o in outputs],
        "load_before": load_before,
        "load_after": load_str(),
    }


# -- the report ------------------------------------------------------------------------------------


def tps(result: dict) -> float:
    return result["tokens"] / result["seconds"]


def level_row(c: int, requests: list[Request], server: dict, same: dict, full: dict) -> dict:
    return {
        "clients": c,
        "requests": len(requests),
        "tokens": server["tokens"],
        "seconds": round(server["seconds"], 3),
        "tokens_per_s": round(tps(server), 1),
        "ttft_ms": server["ttft_ms"],
        "itl_ms": server["itl_ms"],
        "offline_same_concurrency_tokens_per_s": round(tps(same), 1),
        "share_of_offline_same_concurrency": round(tps(server) / tps(same), 3),
        "offline_full_batch_tokens_per_s": round(tps(full), 1),
        "share_of_offline_full_batch": round(tps(server) / tps(full), 3),
        "share_of_offline_full_batch_paired_median": paired_share(server, full),
        "texts_differing_from_offline": sum(a != b for a, b in zip(server["texts"], same["texts"])),
        "server_runs": server["runs"],
        "offline_runs": same["runs"],
    }


def paired_share(server: dict, offline: dict) -> float:
    """The median over repeats of server / offline throughput within one repeat: runs taken a
    minute apart share the machine's mood, so on a shared machine this is steadier than a ratio of
    two bests."""
    # both runs of a repeat serve the same tokens, so a ratio of seconds is one of throughputs
    ratios = [o["seconds"] / s["seconds"] for s, o in zip(server["runs"], offline["runs"])]
    return round(statistics.median(ratios), 3)


def print_table(rows: list[dict]) -> None:
    print(
        f"\n{'clients':>7} {'requests':>8} {'tokens':>7} {'tok/s':>7} {'offline(c)':>10} "
        f"{'share':>6} {'offline(64)':>11} {'share':>6} {'paired':>6} "
        f"{'TTFT p50':>9} {'p99':>7} {'ITL p50':>8} {'p99':>7}  differ"
    )
    for r in rows:
        print(
            f"{r['clients']:>7} {r['requests']:>8} {r['tokens']:>7} {r['tokens_per_s']:>7.1f} "
            f"{r['offline_same_concurrency_tokens_per_s']:>10.1f} "
            f"{100 * r['share_of_offline_same_concurrency']:>5.1f}% "
            f"{r['offline_full_batch_tokens_per_s']:>11.1f} "
            f"{100 * r['share_of_offline_full_batch']:>5.1f}% "
            f"{100 * r['share_of_offline_full_batch_paired_median']:>5.1f}% "
            f"{r['ttft_ms']['p50']:>7.1f}ms {r['ttft_ms']['p99']:>5.1f}ms "
            f"{r['itl_ms']['p50']:>6.1f}ms {r['itl_ms']['p99']:>5.1f}ms  "
            f"{r['texts_differing_from_offline']}/{r['requests']}"
        )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--concurrency", type=int, nargs="+", default=[1, 8, 32, 64], help="clients at once, swept"
    )
    parser.add_argument(
        "--requests-per-client", type=int, default=2, help="requests per client at each level"
    )
    parser.add_argument(
        "--min-requests", type=int, default=16, help="requests at least, at each level"
    )
    parser.add_argument(
        "--output-tokens", type=int, nargs=2, default=[32, 96], help="generated tokens: min max"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads, the server's and the offline engine's (1: see the docstring)",
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="round-robin runs of every system; best reported"
    )
    parser.add_argument("--seed", type=int, default=0, help="the workload's seed")
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: 1 and 8 clients, few short requests"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="JSON path (default benchmarks/results/serving.json; --quick writes nothing unless "
        "given)",
    )
    args = parser.parse_args()
    if args.quick:
        args.concurrency, args.requests_per_client, args.min_requests = [1, 8], 1, 4
        args.output_tokens, args.repeats = [16, 32], 1
    args.out_path = args.out if args.out is not None else (None if args.quick else RESULTS)
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    model = load_model("target")
    levels = {
        c: make_workload(
            max(args.min_requests, c * args.requests_per_client),
            args.seed,
            output_tokens=tuple(args.output_tokens),
        )
        for c in args.concurrency
    }
    process, url = start_server("--threads", str(args.threads), "--max-num-seqs", str(FULL_BATCH))
    runs: dict[tuple, list[dict]] = defaultdict(list)
    try:
        warm = levels[args.concurrency[0]][:2]  # a process's first forward pays for thread pools
        run_server(url, warm, 2)
        run_offline(model, warm, 2)
        for repeat in range(args.repeats):
            for c, requests in levels.items():
                # called below, within this iteration; the defaults pin requests and c (B023)
                systems = {
                    ("server", c): lambda r=requests, c=c: run_server(url, r, c),
                    ("offline", c): lambda r=requests, c=c: run_offline(model, r, c),
                }
                if c != FULL_BATCH:
                    systems[("full", c)] = lambda r=requests: run_offline(model, r, FULL_BATCH)
                for key, run in systems.items():
                    runs[key].append(result := run())
                    print(
                        f"  [{repeat + 1}/{args.repeats}] {result['system']:<28} "
                        f"{len(requests):>4} requests "
                        f"{tps(result):8.1f} tokens/s ({result['seconds']:6.2f} s, load "
                        f"{result['load_before']} -> "
                        f"{result['load_after']})",
                        flush=True,
                    )
    finally:
        process.terminate()
        process.wait(30)
    best = {key: best_of(rs) for key, rs in runs.items()}
    rows = [
        level_row(
            c,
            levels[c],
            best[("server", c)],
            best[("offline", c)],
            best[("offline" if c == FULL_BATCH else "full", c)],
        )
        for c in args.concurrency
    ]
    print_table(rows)
    goal_row = next((r for r in rows if r["clients"] == GOAL_CLIENTS), None)
    goal = (
        None
        if goal_row is None
        else {
            "clients": GOAL_CLIENTS,
            "goal": GOAL_SHARE,
            "value": goal_row["share_of_offline_full_batch"],
            "paired_median": goal_row["share_of_offline_full_batch_paired_median"],
            "met": goal_row["share_of_offline_full_batch"] >= GOAL_SHARE,
        }
    )
    if goal is not None:
        print(
            f"\ngoal: the server at {GOAL_CLIENTS} clients reaches {100 * goal['value']:.1f} % of "
            "the offline engine at full batch, best against best "
            f"({100 * goal['paired_median']:.1f} %, the median of paired runs; "
            f"goal >= {100 * GOAL_SHARE:.0f} %): {'met' if goal['met'] else 'NOT met'}"
        )
    if args.out_path is None:
        print("\nquick run: no JSON written (give --out to write one)")
        return
    write_json(args, levels, rows, goal)


def write_json(args: argparse.Namespace, levels: dict, rows: list[dict], goal: dict | None) -> None:
    write_results(
        args.out_path,
        {
            "benchmark": "serving",
            "machine": machine_record(
                "wall clock on a shared machine; the server, its clients and the offline "
                "engine share the same cores (server and clients in two processes, over "
                "loopback)",
                torch_threads=args.threads,
            ),
            "workload": {
                "seed": args.seed,
                "quick": args.quick,
                "requests_per_level": {str(c): len(r) for c, r in levels.items()},
                "prompt_source": (
                    "byte slices of minivllm.training.corpus.shipped_validation_text() "
                    "(16-200 bytes), cut at UTF-8 character boundaries; BOS first"
                ),
                "output_tokens": args.output_tokens,
                "sampling": "greedy (temperature 0), ignore_eos",
                "clients": (
                    "closed loop: each client sends its next request when its last stream ends"
                ),
            },
            "config": {
                "server": (
                    f"minivllm serve --max-num-seqs {FULL_BATCH} --threads {args.threads} "
                    "(2048 blocks, budget 512)"
                ),
                "repeats": args.repeats,
                "throughput": (
                    "generated tokens (usage) / wall seconds of the level (best of repeats)"
                ),
                "ttft": "request sent -> first chunk with text, client side",
                "itl": "gaps between a stream's consecutive text chunks, pooled",
            },
            "notes": [
                "the server's engine thread and event loop share one GIL: the loop's 100-120 "
                "us of CPU per streamed token lengthens the engine's forward passes (see the "
                "docstring)"
            ],
            "results": rows,
            "goals": {"share_of_offline_at_64_clients": goal},
        },
    )
    print(f"\nwrote {args.out_path}")


if __name__ == "__main__":
    main()
