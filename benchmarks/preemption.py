"""Preemption: recompute overhead and throughput against cache size, per victim policy (chapter 05).

    python benchmarks/preemption.py [--requests 32] [--seed 0] [--blocks 24 32 48 64 128] [--threads
    2] [--kv basic]

A seeded workload on the shipped target model: prompts of 16-240 bytes of the held-out plays, 30-150
new tokens each (greedy, ignore_eos), all arriving at once, a token budget of 64 per step. For every
cache size (blocks of 16 tokens) and both shipped policies it prints steps, preemptions, how often
the other policy would have picked a different victim, the recompute overhead (tokens computed again
/ useful tokens) and tokens/s, checks that every run produced the same tokens, and writes
benchmarks/results/preemption.json.

`--kv basic` runs the same sweep with the KV layout before paging (`kv_layout="contiguous"`): each
admitted request reserves the model's whole context (32 blocks), so nobody is ever preempted, and
a cache of B blocks runs B // 32 requests at once (sizes below one reservation are skipped). It
writes benchmarks/results/preemption_basic.json.
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
KV_LAYOUTS = {"paged": "paged", "basic": "contiguous"}  # --kv: EngineConfig.kv_layout


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


def run(
    model, prompts, params, num_blocks: int, policy_name: str, kv_layout: str = "paged"
) -> tuple[dict, list[list[int]]]:
    counter = CountingPolicy(VICTIM_POLICIES[policy_name])
    config = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=64, preemption=counter)
    engine = LLMEngine(
        model,
        EngineConfig(num_blocks=num_blocks, block_size=16, scheduler=config, kv_layout=kv_layout),
    )
    started = time.perf_counter()
    outs = engine.generate(prompts, params)
    seconds = time.perf_counter() - started
    useful = sum(len(o.prompt_token_ids) + len(o.token_ids) for o in outs)
    generated = sum(len(o.token_ids) for o in outs)
    result = dict(
        num_blocks=num_blocks,
        policy=policy_name,
        kv_layout=kv_layout,
        steps=len(engine.trace),
        peak_running=max(len(r.running) for r in engine.trace),
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
    parser.add_argument(
        "--kv",
        choices=list(KV_LAYOUTS),
        default="paged",
        help="KV layout: paged, or basic (each request reserves the whole context)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model("target")
    kv_layout, out = KV_LAYOUTS[args.kv], RESULTS
    if args.kv == "basic":
        out = RESULTS.with_name("preemption_basic.json")
        reserved = -(-model.config.max_seq_len // 16)  # blocks of 16 for the whole context
        if skipped := [b for b in args.blocks if b < reserved]:
            print(f"basic KV: skipping caches of {skipped} blocks, under one {reserved}-block seat")
        args.blocks = [b for b in args.blocks if b >= reserved]
    prompts, params = workload(args.requests, args.seed)
    results, reference, mismatches = [], None, 0
    print(
        f"{'blocks':>6} {'policy':>16} {'steps':>6} {'preempt':>7} {'differ':>6} {'recompute':>9} "
        f"{'tok/s':>7}"
    )
    for num_blocks in args.blocks:
        for policy in VICTIM_POLICIES:
            result, tokens = run(model, prompts, params, num_blocks, policy, kv_layout)
            reference = reference or tokens
            mismatches += sum(a != b for a, b in zip(tokens, reference))
            results.append(result)
            print(
                f"{num_blocks:>6} {policy:>16} {result['steps']:>6} {result['preemptions']:>7} "
                f"{result['other_policy_differs']:>6} {result['recompute_overhead']:>9.1%} "
                f"{result['tokens_per_second']:>7.0f}"
            )
    print(f"requests whose tokens differ from the first run: {mismatches} (must be 0)")
    out.parent.mkdir(exist_ok=True)
    out.write_text(
        json.dumps(
            dict(
                benchmark="preemption",
                kv_layout=kv_layout,
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
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
