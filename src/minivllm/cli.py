"""The `minivllm` command line.

    minivllm generate "ROMEO:" --max-tokens 200 --temperature 0.8 --seed 1
    minivllm generate "ROMEO:" --speculative draft --num-speculative-tokens 4

streams the continuation to stdout as the engine produces it. A bad argument or a request that can
never run exits with status 2 and a one-line reason on stderr.
"""

from __future__ import annotations

import argparse
import sys

import torch

from .checkpoint import CheckpointError, load_model
from .engine import EngineConfig, LLMEngine
from .sequence import SamplingParams
from .speculative import SpeculativeConfig


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="minivllm", description="A small vLLM-style inference engine.")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="continue a prompt, streaming the text")
    gen.add_argument("prompt", help="the text to continue (a BOS token is put in front)")
    gen.add_argument("--model", default="target", help="'target', 'draft', or a weights directory")
    gen.add_argument("--max-tokens", type=int, default=200)
    gen.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=0, help="0 = off")
    gen.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true", help="keep going past the end-of-scene token")
    gen.add_argument("--speculative", choices=["draft", "ngram"], default=None,
                     help="speculative decoding: the shipped draft model, or n-gram prompt lookup (default: off)")
    gen.add_argument("--num-speculative-tokens", type=int, default=4, help="k, draft tokens per step")
    gen.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    return parser


def generate(args: argparse.Namespace) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos)
    speculative = None
    if args.speculative:
        speculative = SpeculativeConfig(method=args.speculative, num_speculative_tokens=args.num_speculative_tokens)
    engine = LLMEngine(load_model(args.model), EngineConfig(speculative=speculative))
    finish_reason = None
    sys.stdout.write(args.prompt)  # the continuation reads on from the prompt
    for delta in engine.stream([args.prompt], params):
        sys.stdout.write(delta.text)
        sys.stdout.flush()
        finish_reason = delta.finish_reason or finish_reason
    sys.stdout.write("\n")
    print(f"[finish_reason: {finish_reason}]", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        generate(args)
    except (ValueError, TypeError, CheckpointError, FileNotFoundError) as error:
        print(f"minivllm: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
