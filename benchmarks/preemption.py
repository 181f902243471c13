"""Preemption: recompute overhead and throughput against cache size, per victim policy (chapter 05).

    python benchmarks/preemption.py [--requests 32] [--seed 0] [--blocks 24 32 48 64 128] [--threads
    2]

A seeded workload on the shipped target model: prompts of 16-240 bytes of the held-out plays, 30-150
new tokens each (greedy, ignore_eos), all arriving at once, a token budget of 64 per step. For every
cache size (blocks of 16 tokens) and both shipped policies it prints steps, preemptions, how often
the other policy would have picked a different victim, the recompute overhead (tokens computed again
/ useful tokens) and tokens/s, checks that every run produced the same tokens, and writes
benchmarks/results/preemption.json.
"""

from __future__ import annotations

import minivllm  # noqa: F401 -- before torch: it sets OMP_WAIT_POLICY, read as torch loads

# isort: split
import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np
import torch

from minivllm.engine.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.model.checkpoint import load_model
from minivllm.sched.preemption import VICTIM_POLICIES, CountingPolicy
from minivllm.sched.scheduler import SchedulerConfig
from minivllm.sched.sequence import SamplingParams
from minivllm.training.corpus import shipped_validation_text

RESULTS = Path(__file__).parent / "results" / "preemption.json"


def workload(num_requests: int, seed: int) -> tuple[list[str], list[SamplingParams]]:
    rng, text = np.random.default_rng(seed), shipped_validation_text()
    sizes = rng.integers(16, 241, size=num_requests)
    prompts = [
        text[s : s + int(n)]
        for s, n in zip(rng.integers(0, len(text) - 240, size=num_requests), sizes)
    ]
    params = [
        SamplingParams(max_tokens=int(n), temperature=0, ignore_eos=True)
        for n in rng.integers(30, 151, size=num_requests)
    ]
    return prompts, params


def run(model, prompts, params, num_blocks: int, policy_name: str) -> tuple[dict, list[list[int]]]:
    counter = CountingPolicy(VICTIM_POLICIES[policy_name])
    config = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=64, preemption=counter)
    engine = LLMEngine(model, EngineConfig(num_blocks=num_blocks, block_size=16, scheduler=config))
    started = time.perf_counter()
    outs = engine.generate(prompts, params)
    seconds = time.perf_counter() - started
    useful = sum(len(o.prompt_token_ids) + len(o.token_ids) for o in outs)
    generated = sum(len(o.token_ids) for o in outs)
    result = dict(
        num_blocks=num_blocks,
        policy=policy_name,
        steps=len(engine.trace),
        preemptions=counter.calls,
        other_policy_differs=counter.disagreements,
        recomputed_tokens=sum(r.recomputed_tokens for r in engine.trace),
        useful_tokens=useful,
        recompute_overhead=sum(r.recomputed_tokens for r in engine.trace) / useful,
        generated_tokens=generated,
        seconds=round(seconds, 3),
        tokens_per_second=generated / seconds,
    )
    return result, [o.token_ids for o in outs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--blocks", type=int, nargs="+", default=[24, 32, 48, 64, 128])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model("target")
    prompts, params = workload(args.requests, args.seed)
    results, reference, mismatches = [], None, 0
    print(
        f"{'blocks':>6} {'policy':>16} {'steps':>6} {'preempt':>7} {'differ':>6} {'recompute':>9} "
        f"{'tok/s':>7}"
    )
    for num_blocks in args.blocks:
        for policy in VICTIM_POLICIES:
            result, tokens = run(model, prompts, params, num_blocks, policy)
            reference = reference or tokens
            mismatches += sum(a != b for a, b in zip(tokens, reference))
            results.append(result)
            print(
                f"{num_blocks:>6} {policy:>16} {result['steps']:>6} {result['preemptions']:>7} "
                f"{result['other_policy_differs']:>6} {result['recompute_overhead']:>9.1%} "
                f"{result['tokens_per_second']:>7.0f}"
            )
    print(f"requests whose tokens differ from the first run: {mismatches} (must be 0)")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            dict(
                benchmark="preemption",
                seed=args.seed,
                requests=args.requests,
                token_mismatches=mismatches,
                machine=dict(
                    platform=platform.platform(),
                    torch=torch.__version__,
                    threads=args.threads,
                    load_average=" ".join(f"{x:.2f}" for x in os.getloadavg()),
                ),
                results=results,
            ),
            indent=1,
        )
        + "\n"
    )
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
