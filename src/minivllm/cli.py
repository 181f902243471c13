"""The `minivllm` command line.

    minivllm generate "ROMEO:" --max-tokens 200 --temperature 0.8 --seed 1
    minivllm generate "ROMEO:" --speculative draft --num-speculative-tokens 4
    minivllm serve --model target --host 127.0.0.1 --port 8000
    minivllm serve --kv basic    # the KV layout before paging: max_model_len reserved per request
    minivllm serve --model ~/models/Qwen3-0.6B --kv-cache-memory 2GiB --max-model-len 4096
    minivllm chat --temperature 0.8 --max-tokens 128

`generate` streams the continuation to stdout as the engine produces it; `serve` runs the
OpenAI- and Anthropic-compatible HTTP server (chapter 09) until Ctrl-C; `chat` is a conversation in
the terminal (chat.py: the turn format, Ctrl-C, the commands). Each says on stderr, as it starts,
what its K/V cache holds and the longest sequence it serves (`--kv-cache-memory`,
`--max-model-len`; engine/config.py says how they are settled). Sampling settings a command is not
given come from the checkpoint's generation_config.json, as in vLLM, else the command's defaults.
A bad argument or a request that can never run exits with status 2 and a one-line reason on
stderr; a server whose engine died exits with status 1, so that a supervisor restarts it.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from decimal import Decimal

import torch

from minivllm.engine.config import DEFAULT_KV_CACHE_MEMORY, DEFAULT_NUM_BLOCKS, EngineConfig
from minivllm.engine.llm_engine import LLMEngine, default_sampling_params
from minivllm.model.checkpoint import CheckpointError, load_model, sampling_defaults
from minivllm.model.hf_tokenizer import load_tokenizer
from minivllm.runner.speculative import SpeculativeConfig
from minivllm.sched.scheduler import SchedulerConfig
from minivllm.sched.sequence import SamplingParams
from minivllm.serving.limits import ConnectionLimits, ServerLimits

API_KEY_VARIABLE = "MINIVLLM_API_KEY"  # as vLLM's VLLM_API_KEY
# --kv: the EngineConfig.kv_layout each choice selects
KV_LAYOUTS = {"paged": "paged", "basic": "contiguous"}
# --kv-cache-memory: bytes per unit; KB, MB, GB are powers of 1000, KiB, MiB, GiB of 1024
SIZE_UNITS = {
    "": 1,
    "b": 1,
    **{f"{p}b": 1000 ** (i + 1) for i, p in enumerate("kmgt")},
    **{f"{p}ib": 1024 ** (i + 1) for i, p in enumerate("kmgt")},
}
# where neither a flag nor the checkpoint's generation_config.json says (the rest: off)
TEMPERATURE = 0.8
SAMPLING_FLAGS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")


def parse_size(text: str) -> int:
    """Bytes from plain bytes ("1073741824") or a number and a unit ("4GiB", "512MiB", "1.5GB",
    any case); argparse reports the error it raises as a bad value of its flag."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if unit not in SIZE_UNITS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size: give bytes (1073741824) or a number and a unit (512MiB, "
            "4GiB, 2GB; KiB, MiB, GiB, TiB are powers of 1024, KB, MB, GB, TB of 1000)"
        )
    size = int(Decimal(match.group(1)) * SIZE_UNITS[unit])
    if size < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is less than one byte")
    return size


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="minivllm", description="A small vLLM-style inference engine."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="continue a prompt, streaming the text")
    gen.add_argument("prompt", help="the text to continue (a BOS token is put in front)")
    gen.add_argument("--model", default="target", help="'target', 'draft', or a weights directory")
    gen.add_argument("--max-tokens", type=int, default=200)
    add_sampling_arguments(gen)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument(
        "--ignore-eos", action="store_true", help="keep going past the end-of-scene token"
    )
    add_engine_arguments(gen)
    srv = commands.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    srv.add_argument("--model", default="target", help="'target', 'draft', or a weights directory")
    srv.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)"
    )
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument(
        "--served-model-name",
        default=None,
        help="the name clients pass as `model` (default: the --model value)",
    )
    srv.add_argument(
        "--num-blocks",
        type=int,
        default=None,
        help="KV-cache blocks of 16 tokens, instead of --kv-cache-memory",
    )
    srv.add_argument(
        "--max-num-seqs",
        type=int,
        default=SchedulerConfig.max_num_seqs,
        help="requests running at once",
    )
    srv.add_argument(
        "--enable-prefix-caching",
        action="store_true",
        help="reuse the K/V of shared prompt prefixes",
    )
    srv.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )
    srv.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_VARIABLE),
        help=f"clients must send it (Bearer, or x-api-key) to /v1/*, /tokenize, /detokenize and "
        f"/generate "
        f"(default: ${API_KEY_VARIABLE}; unset: no key)",
    )
    limits = srv.add_argument_group("limits on one request (refused with 413 or 400)")
    defaults = ServerLimits()
    for flag, field, help_text in (
        ("--max-body-bytes", "max_body_bytes", "bytes in a request body"),
        ("--max-prompts-per-request", "max_prompts", "prompts in one completions request"),
        ("--max-stop-strings", "max_stop_strings", "stop strings (or bad words) per request"),
        ("--max-stop-length", "max_stop_length", "characters in one stop string"),
        ("--max-messages", "max_messages", "messages in one chat"),
        ("--max-prompt-chars", "max_prompt_chars", "characters in a prompt (default: the context)"),
        ("--max-error-chars", "max_error_chars", "characters in an error message"),
        (
            "--max-output-units",
            "max_output_units",
            "tokens x (logprobs + 1) one answer may carry: prompts x n x (echo + max_tokens)",
        ),
        (
            "--max-seqs-per-request",
            "max_seqs_per_request",
            "sequences (prompts x n) in one request (default: --max-num-seqs)",
        ),
    ):
        default = getattr(defaults, field)
        limits.add_argument(
            flag,
            type=int,
            default=default,
            dest=field,
            metavar="N",
            help=help_text if default is None else f"{help_text} (default: {default})",
        )
    add_connection_arguments(srv)
    add_watch_arguments(srv)
    add_engine_arguments(srv)
    add_chat_parser(commands)
    return parser


def add_connection_arguments(srv) -> None:
    group = srv.add_argument_group("limits on connections (past them: 503, 408, or closed)")
    defaults = ConnectionLimits()
    for flag, field, kind, metavar, help_text in (
        ("--max-connections", "max_connections", int, "N", "connections at once; past it, 503"),
        ("--read-timeout", "read_timeout", float, "S", "seconds to send a whole request"),
        ("--write-timeout", "write_timeout", float, "S", "seconds a response waits on a reader"),
        (
            "--send-buffer-bytes",
            "send_buffer_bytes",
            int,
            "N",
            "kernel send buffer per socket (0: the kernel's own sizing)",
        ),
        (
            "--accept-error-log-interval",
            "accept_error_log_interval",
            float,
            "S",
            "seconds between two 'out of file descriptors' log lines",
        ),
        (
            "--max-access-log-chars",
            "max_access_log_chars",
            int,
            "N",
            "characters of a path in the access log",
        ),
    ):
        default = getattr(defaults, field)
        group.add_argument(
            flag,
            type=kind,
            default=default,
            dest=field,
            metavar=metavar,
            help=f"{help_text} (default: {default})",
        )


def add_watch_arguments(srv) -> None:
    group = srv.add_argument_group("watching the engine")
    group.add_argument(
        "--stall-timeout",
        type=float,
        default=60.0,
        metavar="S",
        help="/health answers 503 when one round of engine work (the inbox, then a step) has run "
        "this long (default: 60)",
    )
    group.add_argument(
        "--max-trace-bytes",
        type=int,
        default=64 << 20,
        metavar="N",
        help="bytes of step trace kept for /stats and debugging; the oldest steps go first "
        "(default: 64 MiB)",
    )


def add_chat_parser(commands) -> None:
    chat = commands.add_parser(
        "chat",
        help="talk with the model in the terminal: multi-turn, streamed (/help inside)",
        description="A conversation with the model, streamed token by token. Ctrl-C stops an "
        "answer; Ctrl-D, Ctrl-C at the prompt or /exit leaves; /reset, /prompt, /help. A model "
        "without a chat template (the shipped ones) reads the chat as a play: you are ROMEO, it "
        "is JULIET.",
    )
    chat.add_argument("--model", default="target", help="'target', 'draft', or a weights directory")
    chat.add_argument("--max-tokens", type=int, default=128, help="per answer")
    add_sampling_arguments(chat)
    chat.add_argument(
        "--seed", type=int, default=0, help="the whole conversation repeats with the same seed"
    )
    chat.add_argument("--system", default=None, help="a system line (in a play: the Chorus)")
    chat.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="recompute the whole conversation every turn (default: reuse its cached K/V)",
    )
    add_engine_arguments(chat)


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    """The sampling knobs; one not given is the checkpoint's (its generation_config.json, as
    vLLM's generation_config="auto"), else the command's default (`sampling_settings`)."""
    checkpoint = "default: the checkpoint's generation_config.json, else"
    parser.add_argument(
        "--temperature", type=float, default=None, help=f"0 = greedy ({checkpoint} {TEMPERATURE})"
    )
    parser.add_argument("--top-k", type=int, default=None, help=f"0 = off ({checkpoint} off)")
    parser.add_argument("--top-p", type=float, default=None, help=f"1 = off ({checkpoint} off)")
    parser.add_argument("--min-p", type=float, default=None, help=f"0 = off ({checkpoint} off)")
    parser.add_argument(
        "--repetition-penalty", type=float, default=None, help=f"1 = off ({checkpoint} off)"
    )


def sampling_settings(args: argparse.Namespace) -> dict:
    """temperature, top_k, top_p, min_p, repetition_penalty for SamplingParams: each flag given,
    else the checkpoint's generation_config.json setting, else the command's default."""
    recommended = sampling_defaults(args.model)
    settings = {"temperature": TEMPERATURE}
    settings.update({k: v for k, v in recommended.items() if k in SAMPLING_FLAGS})
    settings.update({k: getattr(args, k) for k in SAMPLING_FLAGS if getattr(args, k) is not None})
    return settings


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        metavar="N",
        help="the longest sequence (prompt + output) served (default: the model's context, at "
        "most what the KV cache holds)",
    )
    parser.add_argument(
        "--kv-cache-memory",
        "--kv-cache-memory-bytes",  # vLLM's spelling
        type=parse_size,
        default=None,
        dest="kv_cache_memory",
        metavar="SIZE",
        help="memory for the K/V cache: 4GiB, 512MiB, or bytes (default: "
        f"{DEFAULT_NUM_BLOCKS} blocks, at most {DEFAULT_KV_CACHE_MEMORY / 2**30:g} GiB)",
    )
    parser.add_argument(
        "--speculative",
        choices=["draft", "ngram"],
        default=None,
        help="speculative decoding: the shipped draft model, or n-gram prompt lookup (default: "
        "off)",
    )
    parser.add_argument(
        "--num-speculative-tokens", type=int, default=4, help="k, draft tokens per step"
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)"
    )
    parser.add_argument(
        "--kv",
        choices=list(KV_LAYOUTS),
        default="paged",
        help="KV-cache layout: paged blocks (default), or basic: each request reserves the "
        "model's whole context up front, as servers did before paging (no prefix caching)",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        metavar="N",
        help="split the model over N ranks, processes on this machine (or started by torchrun: "
        "see minivllm.runner.tensor_parallel), each loading its own shard (default: 1)",
    )
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        help="on a GPU, run decode steps eagerly instead of replaying CUDA graphs",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="on a CPU, run the forward under torch.compile (EngineConfig.compile_forward): "
        "faster steps of a small model, after a first pass that compiles (about 20 s for the "
        "book's model, minutes for a 28-layer one)",
    )


def model_dtype(model: torch.nn.Module) -> torch.dtype:
    """The loaded model's dtype (a checkpoint's own, `dtype="auto"`): the K/V cache takes the
    same, so an attention kernel for that dtype can run and the cache is no larger than needed."""
    return next(model.parameters()).dtype


def engine_model(args: argparse.Namespace) -> torch.nn.Module:
    """The model the engine is built from: loaded whole, or with tensor parallelism only checked
    and described (on the meta device) -- each rank then reads its own shard of the folder."""
    return load_model(args.model, weights=args.tensor_parallel_size == 1)


def speculative_config(args: argparse.Namespace) -> SpeculativeConfig | None:
    if not args.speculative:
        return None
    return SpeculativeConfig(
        method=args.speculative, num_speculative_tokens=args.num_speculative_tokens
    )


def capacity(args: argparse.Namespace) -> dict:
    """The EngineConfig fields that size the cache and the context."""
    return {
        "max_model_len": args.max_model_len,
        "kv_cache_memory_bytes": args.kv_cache_memory,
        "num_blocks": getattr(args, "num_blocks", None),  # serve's
    }


def started(engine: LLMEngine) -> LLMEngine:
    """Say on stderr what the engine's cache holds (stdout is the command's output)."""
    print(engine.describe_capacity(), file=sys.stderr)
    return engine


def generate(args: argparse.Namespace) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        seed=args.seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
        **sampling_settings(args),
    )
    model = engine_model(args)
    config = EngineConfig(
        speculative=speculative_config(args),
        kv_layout=KV_LAYOUTS[args.kv],
        enforce_eager=args.enforce_eager,
        compile_forward=args.compile,
        tensor_parallel_size=args.tensor_parallel_size,
        dtype=model_dtype(model),
        **capacity(args),
    )
    engine = started(LLMEngine(model, config, load_tokenizer(args.model), own_model=True))
    finish_reason = None
    sys.stdout.write(args.prompt)  # the continuation reads on from the prompt
    for delta in engine.stream([args.prompt], params):
        sys.stdout.write(delta.text)
        sys.stdout.flush()
        finish_reason = delta.finish_reason or finish_reason
    sys.stdout.write("\n")
    print(f"[finish_reason: {finish_reason}]", file=sys.stderr)


def build_serving_engine(args: argparse.Namespace) -> LLMEngine:
    """The engine `serve` runs: every setting checked here, before the server starts listening.
    Requests that leave a sampling knob out get the checkpoint's generation_config.json setting
    (the engine's `default_params`)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.num_blocks is not None and args.kv_cache_memory is not None:
        raise ValueError("give --num-blocks or --kv-cache-memory, not both")
    # a full batch must fit one step
    per_decode = 1 + (args.num_speculative_tokens if args.speculative else 0)
    scheduler = SchedulerConfig(
        max_num_seqs=args.max_num_seqs,
        enable_prefix_caching=args.enable_prefix_caching,
        max_num_batched_tokens=max(
            SchedulerConfig.max_num_batched_tokens, args.max_num_seqs * per_decode
        ),
    )
    defaults = default_sampling_params(args.model)
    model = engine_model(args)
    config = EngineConfig(
        scheduler=scheduler,
        speculative=speculative_config(args),
        kv_layout=KV_LAYOUTS[args.kv],
        enforce_eager=args.enforce_eager,
        compile_forward=args.compile,
        tensor_parallel_size=args.tensor_parallel_size,
        dtype=model_dtype(model),
        **capacity(args),
    )
    return LLMEngine(model, config, load_tokenizer(args.model), defaults, own_model=True)


def server_limits(args: argparse.Namespace) -> ServerLimits:
    return ServerLimits(
        **{field: getattr(args, field) for field in ServerLimits.__dataclass_fields__}
    )


def connection_limits(args: argparse.Namespace) -> ConnectionLimits:
    values = {field: getattr(args, field) for field in ConnectionLimits.__dataclass_fields__}
    if values["send_buffer_bytes"] == 0:
        values["send_buffer_bytes"] = None  # the kernel sizes it
    return ConnectionLimits(**values)


def serve(args: argparse.Namespace) -> int:
    """0 after Ctrl-C; 1 when the engine died."""
    # FastAPI and uvicorn load only for this command
    from minivllm.serving.server import serve as serve_http

    limits = server_limits(args)  # checked before the model loads
    connections = connection_limits(args)
    if args.api_key is not None and not args.api_key:
        raise ValueError("--api-key must not be empty")
    engine = started(build_serving_engine(args))
    return serve_http(
        engine,
        args.served_model_name or args.model,
        args.host,
        args.port,
        args.log_level,
        limits,
        args.api_key,
        connections,
        stall_timeout=args.stall_timeout,
        max_trace_bytes=args.max_trace_bytes,
    )


def build_chat_engine(args: argparse.Namespace) -> LLMEngine:
    """`generate`'s engine, with prefix caching (every turn re-reads the conversation so far),
    except in the basic KV layout, which shares nothing."""
    if args.threads:
        torch.set_num_threads(args.threads)
    layout = KV_LAYOUTS[args.kv]
    caching = not args.no_prefix_caching and layout == "paged"
    scheduler = SchedulerConfig(enable_prefix_caching=caching)
    model = engine_model(args)
    config = EngineConfig(
        scheduler=scheduler,
        speculative=speculative_config(args),
        kv_layout=layout,
        enforce_eager=args.enforce_eager,
        compile_forward=args.compile,
        tensor_parallel_size=args.tensor_parallel_size,
        dtype=model_dtype(model),
        **capacity(args),
    )
    return LLMEngine(model, config, load_tokenizer(args.model), own_model=True)


def chat(args: argparse.Namespace) -> int:
    from minivllm.chat import Chat, chat_format_for, repl

    params = SamplingParams(  # checked before the model loads
        max_tokens=args.max_tokens, seed=args.seed, **sampling_settings(args)
    )
    with started(build_chat_engine(args)) as engine:
        fmt = chat_format_for(engine.tokenizer)
        conversation = Chat(engine, params, fmt, system=args.system)
        banner = (
            f"minivllm chat with {args.model}: you are {fmt.user_label}, the model is "
            f"{fmt.assistant_label}. /help for commands; Ctrl-C stops an answer, Ctrl-D leaves."
        )
        return repl(conversation, read_line(), sys.stdout, banner)


def read_line():
    """`input` in a terminal (with line editing where readline exists); from a pipe, the prompt
    and the line read are both written out, so the transcript shows what was said."""
    if sys.stdin.isatty():
        try:
            import readline  # noqa: F401 -- input() gains editing and history
        except ImportError:
            pass
        return input

    def echoing(prompt: str) -> str:
        sys.stdout.write(prompt)
        line = sys.stdin.readline()
        if not line:
            raise EOFError
        sys.stdout.write(line if line.endswith("\n") else line + "\n")
        return line

    return echoing


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        status = {"generate": generate, "serve": serve, "chat": chat}[args.command](args)
    except (ValueError, TypeError, CheckpointError, FileNotFoundError) as error:
        print(f"minivllm: error: {error}", file=sys.stderr)
        return 2
    return status or 0


if __name__ == "__main__":
    sys.exit(main())
