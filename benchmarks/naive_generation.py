"""Naive generation: time per token against position (chapter 00's baseline).

    python benchmarks/naive_generation.py [--tokens 400] [--repeats 3]

Prints a table and writes benchmarks/results/naive_generation.json. Each row is the median time of
one decode step (a full forward over the sequence so far) at that position.
"""

from __future__ import annotations

import minivllm  # noqa: F401 -- before torch: it sets OMP_WAIT_POLICY, read as torch loads

# isort: split
import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from minivllm.model.checkpoint import load_model
from minivllm.model.tokenizer import ByteTokenizer
from minivllm.stages.naive import next_token_logits

RESULTS = Path(__file__).parent / "results" / "naive_generation.json"


def step_times(model, prompt_ids: list[int], tokens: int) -> list[float]:
    ids, times = list(prompt_ids), []
    for _ in range(tokens):
        started = time.perf_counter()
        ids.append(int(next_token_logits(model, ids).argmax()))
        times.append(time.perf_counter() - started)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(2)
    model = load_model("target")
    prompt = ByteTokenizer().encode("ROMEO:\n", add_bos=True)
    runs = [step_times(model, prompt, args.tokens) for _ in range(args.repeats)]
    median_ms = [1000 * statistics.median(run[i] for run in runs) for i in range(args.tokens)]
    checkpoints = [p for p in (1, 50, 100, 200, 300, 400, 500) if p <= args.tokens]
    print(f"{'position':>8} {'ms/token':>9}")
    for p in checkpoints:
        print(f"{len(prompt) + p:>8} {median_ms[p - 1]:>9.2f}")
    total_s = sum(median_ms) / 1000
    print(
        f"{args.tokens} tokens in {total_s:.2f} s ({args.tokens / total_s:.1f} tokens/s), median "
        f"of {args.repeats} runs"
    )
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {
                "benchmark": "naive_generation",
                "machine": platform.machine(),
                "torch": torch.__version__,
                "threads": torch.get_num_threads(),
                "prompt_tokens": len(prompt),
                "tokens": args.tokens,
                "repeats": args.repeats,
                "median_ms_per_token": [round(m, 3) for m in median_ms],
                "tokens_per_second": args.tokens / total_s,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
