"""Parallel sampling: peak KV-cache blocks of n forked samples against n independent requests
(issue 18, chapter 09).

    python benchmarks/parallel_sampling.py [--n 2 4 8] [--prompt-tokens 32 128 384]
    [--max-tokens 64] [--seed 0]

For each prompt length (a piece of the held-out plays) and each n, the shipped target model runs
the prompt once with `SamplingParams(n=n)` (the samples fork sample 0's block table after the
prefill and share every prompt block) and once as n separate requests with the same seeds (each
prefills and holds its own copy). Both sample at temperature 0.9 with ignore_eos, so every sample
makes exactly max-tokens tokens and the comparison is like for like. It prints the peak blocks
in use (`EngineStats.peak_blocks_used`), the fraction saved, the prompt tokens computed, and checks
that both ways give the same tokens; writes benchmarks/results/parallel_sampling.json.
"""

from __future__ import annotations

import minivllm  # noqa: F401 -- before torch: it sets OMP_WAIT_POLICY, read as torch loads

# isort: split
import argparse
import json
from pathlib import Path

import torch
from _common import machine_record

from minivllm.engine.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.model.checkpoint import load_model
from minivllm.model.tokenizer import ByteTokenizer
from minivllm.runner.sampler import derive_seed
from minivllm.sched.scheduler import SchedulerConfig
from minivllm.sched.sequence import SamplingParams
from minivllm.training.corpus import shipped_validation_text

RESULTS = Path(__file__).parent / "results" / "parallel_sampling.json"
BLOCK_SIZE = 16


def engine(model) -> LLMEngine:
    scheduler = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=1024)
    return LLMEngine(
        model, EngineConfig(num_blocks=1024, block_size=BLOCK_SIZE, scheduler=scheduler)
    )


def prompt_of(length: int) -> list[int]:
    """`length` token ids: BOS and the first bytes of the held-out text."""
    data = ByteTokenizer().encode(shipped_validation_text(), add_bos=True)
    return data[:length]


def prefill_tokens(engine: LLMEngine, n: int, max_tokens: int) -> int:
    """Prompt tokens the engine computed: every token it ran, less the decodes (each sample's
    first token comes from the prefill's logits, the other max_tokens - 1 from a decode each)."""
    return sum(r.num_batched_tokens for r in engine.trace) - n * (max_tokens - 1)


def measure(model, prompt: list[int], n: int, max_tokens: int, seed: int) -> dict:
    def params(n_: int, seed_: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens, temperature=0.9, seed=seed_, n=n_, ignore_eos=True
        )

    forked = engine(model)
    samples = forked.generate([prompt], params(n, seed))[0].samples
    alone = engine(model)
    seeds = [seed if i == 0 else derive_seed(seed, i) for i in range(n)]
    separate = alone.generate([prompt] * n, [params(1, s) for s in seeds])
    same = [s.token_ids for s in samples] == [o.token_ids for o in separate]
    shared, independent = forked.stats().peak_blocks_used, alone.stats().peak_blocks_used
    return {
        "prompt_tokens": len(prompt),
        "n": n,
        "max_tokens": max_tokens,
        "peak_blocks_forked": shared,
        "peak_blocks_independent": independent,
        "blocks_saved_fraction": round(1 - shared / independent, 4),
        "prompt_tokens_computed_forked": prefill_tokens(forked, n, max_tokens),
        "prompt_tokens_computed_independent": prefill_tokens(alone, n, max_tokens),
        "same_tokens": same,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[32, 128, 384])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = load_model("target")
    print(
        f"{'prompt':>6} {'n':>3} {'peak forked':>11} {'peak indep.':>11} {'saved':>7} "
        f"{'prefill forked':>14} {'prefill indep.':>14} {'same tokens':>11}"
    )
    results = []
    for length in args.prompt_tokens:
        for n in args.n:
            r = measure(model, prompt_of(length), n, args.max_tokens, args.seed)
            results.append(r)
            print(
                f"{length:>6} {n:>3} {r['peak_blocks_forked']:>11} "
                f"{r['peak_blocks_independent']:>11} {r['blocks_saved_fraction']:>7.1%} "
                f"{r['prompt_tokens_computed_forked']:>14} "
                f"{r['prompt_tokens_computed_independent']:>14} {str(r['same_tokens']):>11}"
            )
    if not all(r["same_tokens"] for r in results):
        raise SystemExit("forked samples differ from the independent requests: a bug")
    RESULTS.parent.mkdir(exist_ok=True)
    record = {
        "benchmark": "parallel_sampling",
        "block_size": BLOCK_SIZE,
        "seed": args.seed,
        "machine": machine_record("peak KV blocks: n forked samples vs n independent requests"),
        "results": results,
    }
    RESULTS.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
