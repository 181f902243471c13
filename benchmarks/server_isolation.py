"""Isolation: do 24 streams keep flowing while the server answers one huge non-streamed request?
(chapter 09; issue 30, item 2)

    python benchmarks/server_isolation.py [--prompts 32] [--n 16] [--logprobs 20] [--rounds 3]
                                          [--out PATH]

The issue's request: 32 prompts of 480 tokens, `n` samples each, echoed, with 20 logprobs, not
streamed: about 125 MB of JSON at n=16. Two ways of writing that answer, alternated round by round,
each round in a fresh process (so its peak RSS is its own):

* `whole`: the old way, every choice built and the body encoded in one go, on the event loop;
* `pieces`: `responses.json_in_pieces`, a choice at a time with the event loop free between.

Beside it, 24 seeded streams of 120 tokens (the big request starts 1 s after them). What is
reported: the streams' inter-token gaps (median, p99, max), the big answer's size and time, and the
process's peak RSS. The server's output budget (`--max-output-units`) and its cap on sequences
per request (`--max-seqs-per-request`) would refuse the issue's request, so both are raised here:
this measures the writer, not the limits.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import load_str, machine_record, write_results  # noqa: E402

MODES = ("whole", "pieces")
PROMPT_TOKENS = 480


def one_round(mode: str, prompts: int, n: int, logprobs: int) -> dict:
    """One server, the streams and the big request; the measurements as a dict."""
    import asyncio

    from minivllm import LLMEngine
    from minivllm.model.checkpoint import load_model
    from minivllm.serving import responses
    from minivllm.serving.client import streams_beside
    from minivllm.serving.limits import ServerLimits
    from minivllm.serving.server import ServerThread

    if mode == "whole":  # never written in pieces: the answer is encoded in one go, as before
        responses.INLINE_ANSWER_UNITS = float("inf")
    streams = [
        {"prompt": "ROMEO:\n", "max_tokens": 120, "ignore_eos": True, "seed": i, "temperature": 0.8}
        for i in range(24)
    ]
    prompt = [65 + i % 26 for i in range(PROMPT_TOKENS)]
    big = {"prompt": [prompt] * prompts, "n": n, "logprobs": logprobs, "echo": True}
    limits = ServerLimits(max_output_units=10**12, max_seqs_per_request=prompts * n)
    with ServerThread(LLMEngine(load_model("target")), limits=limits) as server:
        run = asyncio.run(streams_beside(server.base_url, streams, big, big_after=1.0))
    if run.big_status != 200:
        raise RuntimeError(f"the big request was answered {run.big_status}")
    gaps = sorted(run.gaps)
    return {
        "mode": mode,
        "big_status": run.big_status,
        "big_mb": run.big_bytes / 1e6,
        "big_s": run.big_seconds,
        "gap_median_s": statistics.median(gaps),
        "gap_p99_s": gaps[int(0.99 * (len(gaps) - 1))],
        "gap_max_s": gaps[-1],
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "load": load_str(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--logprobs", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--one", choices=MODES, help=argparse.SUPPRESS)  # a round, in a child
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "server_isolation.json"
    )
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_round(args.one, args.prompts, args.n, args.logprobs)))
        return
    runs = []
    shape = ["--prompts", str(args.prompts), "--n", str(args.n), "--logprobs", str(args.logprobs)]
    for round_ in range(args.rounds):
        for mode in MODES if round_ % 2 == 0 else reversed(MODES):
            child = subprocess.run(
                [sys.executable, __file__, "--one", mode, *shape],
                capture_output=True,
                text=True,
                check=True,
            )
            runs.append({"round": round_, **json.loads(child.stdout.splitlines()[-1])})
            run = runs[-1]
            print(
                f"round {round_} {mode:6s}: answer {run['big_mb']:6.1f} MB in {run['big_s']:5.1f} s"
                f" | stream gaps median {run['gap_median_s'] * 1e3:5.0f} ms, p99 "
                f"{run['gap_p99_s'] * 1e3:5.0f} ms, max {run['gap_max_s'] * 1e3:5.0f} ms | peak "
                f"RSS {run['peak_rss_mb']:5.0f} MB | load {run['load']}",
                flush=True,
            )
    summary = {
        mode: {
            key: statistics.median(r[key] for r in runs if r["mode"] == mode)
            for key in ("big_s", "gap_median_s", "gap_p99_s", "gap_max_s", "peak_rss_mb")
        }
        for mode in MODES
    }
    print("\nmedians over rounds")
    print(f"{'mode':8s} {'answer s':>9s} {'gap med ms':>11s} {'p99 ms':>7s} {'max ms':>7s} RSS MB")
    for mode, row in summary.items():
        print(
            f"{mode:8s} {row['big_s']:9.1f} {row['gap_median_s'] * 1e3:11.0f} "
            f"{row['gap_p99_s'] * 1e3:7.0f} {row['gap_max_s'] * 1e3:7.0f} {row['peak_rss_mb']:7.0f}"
        )
    record = machine_record(
        "24 seeded streams of 120 tokens beside one non-streamed request of "
        f"{args.prompts} prompts x {PROMPT_TOKENS} tokens, n={args.n}, logprobs={args.logprobs}, "
        "echo; whole = encoded in one go on the event loop, pieces = a choice at a time",
        runs=runs,
        medians=summary,
    )
    write_results(args.out, record)


if __name__ == "__main__":
    main()
