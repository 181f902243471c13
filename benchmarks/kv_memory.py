"""KV-cache memory: contiguous against paged on the same workload (chapters 02 and 03).

    python benchmarks/kv_memory.py [--requests 200] [--seeds 0 1 2] [--arena-slots 8192]
    [--block-sizes 8 16 32]

Replays one seeded request stream per seed through `minivllm.book.arena`: once with a contiguous
arena of `arena-slots` slots, and once per block size with a paged pool of the same memory
(num_blocks = arena_slots // block_size). Prints one row per run, then per block size the
concurrency ratio paged / contiguous averaged over seeds. A second table measures prefix caching
(`BlockManager.allocate_cached`): requests sharing a 256-token system prompt, all held at once.
Writes benchmarks/results/kv_memory.json. No model, no torch: it runs in seconds.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
from pathlib import Path

from minivllm.book.arena import (
    SimResult,
    make_workload,
    simulate_contiguous,
    simulate_paged,
)
from minivllm.kv.block_manager import BlockManager

RESULTS = Path(__file__).parent / "results" / "kv_memory.json"

HEADER = (
    f"{'seed':>4} {'cache':<14} {'util %':>7} {'waste %':>8} {'frag ref':>8} {'mean run':>8} "
    f"{'run|queued':>10} {'peak run':>8} {'steps':>6} {'preempt':>7}"
)


def row(seed: int, label: str, r: SimResult) -> str:
    return (
        f"{seed:>4} {label:<14} {100 * r.kv_utilisation:>7.1f} {100 * r.internal_waste:>8.1f} "
        f"{r.fragmentation_refusals:>8} {r.mean_running:>8.2f} {r.mean_running_saturated:>10.2f} "
        f"{r.peak_running:>8} {r.num_steps:>6} {r.preemptions:>7}"
    )


def ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def prefix_caching(
    block_sizes: list[int], num_requests: int = 32, system_len: int = 256, seed: int = 0
) -> list[dict]:
    """Admit `num_requests` prompts (shared system prompt + distinct user part) one after another,
    all held."""
    rng = random.Random(seed)
    system = [rng.randrange(256) for _ in range(system_len)]
    prompts = [
        system + [rng.randrange(256) for _ in range(rng.randint(32, 64))]
        for _ in range(num_requests)
    ]
    prompt_tokens = sum(len(p) for p in prompts)
    rows = []
    for bs in block_sizes:
        without = sum(-(-len(p) // bs) for p in prompts)  # blocks with no sharing
        manager = BlockManager(without, bs)  # big enough for all, even with no hit
        cached = sum(manager.allocate_cached(i, p) for i, p in enumerate(prompts))
        used = manager.allocator.num_used
        rows.append(
            {
                "block_size": bs,
                "requests": num_requests,
                "prompt_tokens": prompt_tokens,
                "cached_tokens": cached,
                "hit_rate": round(cached / prompt_tokens, 4),
                "blocks_without_cache": without,
                "blocks_used": used,
                "blocks_saved": without - used,
                "blocks_saved_fraction": round((without - used) / without, 4),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--arena-slots", type=int, default=8192)
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[8, 16, 32])
    args = parser.parse_args()

    runs, per_bs = [], {bs: {"saturated": [], "mean": [], "peak": []} for bs in args.block_sizes}
    print(HEADER)
    for seed in args.seeds:
        workload = make_workload(args.requests, seed=seed)
        contiguous = simulate_contiguous(workload, args.arena_slots)
        print(row(seed, "contiguous", contiguous))
        runs.append(
            {"seed": seed, "cache": "contiguous", "block_size": None, **contiguous.summary()}
        )
        for bs in args.block_sizes:
            paged = simulate_paged(workload, args.arena_slots // bs, bs)
            print(row(seed, f"paged bs={bs}", paged))
            runs.append({"seed": seed, "cache": "paged", "block_size": bs, **paged.summary()})
            per_bs[bs]["saturated"].append(
                ratio(paged.mean_running_saturated, contiguous.mean_running_saturated)
            )
            per_bs[bs]["mean"].append(ratio(paged.mean_running, contiguous.mean_running))
            per_bs[bs]["peak"].append(ratio(paged.peak_running, contiguous.peak_running))

    print(f"\nconcurrency paged / contiguous, mean over seeds {args.seeds}:")
    ratios = {}
    for bs, lists in per_bs.items():
        means = {
            k: statistics.mean(v for v in vals if v is not None)
            if any(v is not None for v in vals)
            else None
            for k, vals in lists.items()
        }
        ratios[str(bs)] = {k: round(v, 3) if v is not None else None for k, v in means.items()}
        fmt = lambda v: f"{v:.2f}x" if v is not None else "n/a"  # noqa: E731
        print(
            f"  bs={bs:<3} while queued {fmt(means['saturated'])}   "
            f"whole-run mean {fmt(means['mean'])}   peak {fmt(means['peak'])}"
        )

    prefix = prefix_caching(args.block_sizes)
    print(
        f"\nprefix caching: {prefix[0]['requests']} requests, shared 256-token system prompt "
        f"+ 32-64-token user part, all held at once"
    )
    print(
        f"{'bs':>4} {'prompt tok':>10} {'cached tok':>10} {'hit rate %':>10} "
        f"{'blocks no-cache':>15} {'blocks used':>11} {'saved':>6} {'saved %':>7}"
    )
    for p in prefix:
        print(
            f"{p['block_size']:>4} {p['prompt_tokens']:>10} {p['cached_tokens']:>10} "
            f"{100 * p['hit_rate']:>10.1f} {p['blocks_without_cache']:>15} "
            f"{p['blocks_used']:>11} {p['blocks_saved']:>6} "
            f"{100 * p['blocks_saved_fraction']:>7.1f}"
        )

    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {
                "benchmark": "kv_memory",
                "machine": platform.machine(),
                "python": platform.python_version(),
                "requests": args.requests,
                "seeds": args.seeds,
                "arena_slots": args.arena_slots,
                "block_sizes": args.block_sizes,
                "runs": runs,
                "concurrency_ratio_paged_over_contiguous": {
                    bs: {
                        "while_queued": r["saturated"],
                        "whole_run_mean": r["mean"],
                        "peak": r["peak"],
                    }
                    for bs, r in ratios.items()
                },
                "prefix_caching": prefix,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
