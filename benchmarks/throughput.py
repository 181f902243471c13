"""Throughput: minivllm's engine against naive generation and Hugging Face `generate` (chapter 04).

    python benchmarks/throughput.py [--requests 64] [--seed 0] [--repeats 3] [--quick] [--skip-hf]
    [--skip-naive] [--backends numba] [--processes 2] [--kv basic]

One seeded workload -- prompts are 16-200-byte slices of the shipped validation text (cut at UTF-8
character boundaries, BOS first), outputs 32-256 tokens, greedy, `ignore_eos` -- run on the shipped
target model by every system in one process, 2 torch threads:

* minivllm, continuous batching: `LLMEngine`, max_num_seqs 64, a token budget per step
  (`--budget`; the first value is the headline, the others a sweep);
* with `--backends NAME ...`, the headline continuous system again on each attention backend named
  (`EngineConfig(attention_backend=NAME)`; the headline's "auto" is the native CPU kernel,
  `numba`, so `--backends torch` adds the reference);
* with `--processes N ...`, the headline continuous system again with N forward processes
  (`EngineConfig(forward_processes=N)`: each pass split by sequence between this process and
  N - 1 workers, one thread each; its CPU seconds count the workers' too);
* with `--kv basic`, the headline continuous system again with the KV layout before paging
  (`EngineConfig(kv_layout="contiguous")`: each admitted request reserves the model's whole
  context, so the same cache holds num_blocks / 32 requests at once);
* minivllm, static batching: the same engine with `batching="static"` (a new batch is admitted only
  when the whole last one has finished). At batch 64 the whole workload is one batch, so static and
  continuous run the same batch and only prefill chunking differs; at batch 16 the slots a finished
  request leaves stay idle until its whole batch is done, next to continuous batching at 16 slots;
* naive sequential generation (`generate_naive`: every token re-runs the model over the whole
  sequence so far, one request after another);
* Hugging Face `LlamaForCausalLM.generate` on the same weights (greedy, EOS off): batched with left
  padding, each batch running to its longest request (only each request's own tokens count), and
  one request at a time.

Throughput is useful generated tokens / wall-clock seconds. The quadratic systems (naive, HF one by
one) run the same seeded subset of the requests; their tokens/s is a per-token rate, which
concurrency does not change. The batched systems run `--repeats` times, round-robin, and report the
best (least disturbed) run, with the median and every run's load average beside it: on a shared
machine one 2-thread run can be several times slower than the next. Greedy tokens are compared with
minivllm continuous (reported, not asserted: an argmax near-tie can flip with the summation order).

The engine's overhead is the share of step time not spent in the model forward, from the engine's
own trace (`StepRecord.forward_s` / `step_s`), overall and for steps with >= 48 decodes. A decode
stretch at batch 64 is then timed per component (schedule, build_batch, forward, sample, update,
record, outputs) and run under cProfile for the hot spots outside the forward. Last, a decode step
at batch 64 on each attention backend (`book/step_timing.py`, alternating, medians): the share of it
spent in the backend's calls -- writing the new K/V and attending, every layer.

Prints a table and writes benchmarks/results/throughput.json (a --quick smoke run writes nothing
unless --out is given). Hugging Face rows need `transformers` (`pip install -e '.[dev]'`).
"""

from __future__ import annotations

import minivllm  # noqa: F401 -- before torch: it sets OMP_WAIT_POLICY, read as torch loads

# isort: split
import argparse
import cProfile
import pstats
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from _common import (
    Request,
    best_of,
    cpu_seconds_of,
    load_str,
    machine_record,
    make_workload,
    print_run,
    write_results,
)

import minivllm.runner.model_runner as runner_module
from minivllm.attention.backend import resolve_backend_name
from minivllm.book.modes import StaticBatching
from minivllm.book.step_timing import decode_engine, time_decode_steps
from minivllm.engine.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.model.checkpoint import hf_config, load_model
from minivllm.model.tokenizer import PAD_ID
from minivllm.model.transformer import Transformer
from minivllm.sched.scheduler import SchedulerConfig
from minivllm.sched.sequence import SamplingParams
from minivllm.stages.naive import generate_naive

RESULTS = Path(__file__).parent / "results" / "throughput.json"
THREADS = 2
BIG_BATCH_DECODES = 48  # "batch 64": steps with at least this many running decodes


# -- the workload (make_workload is in _common.py) -------------------------------------------------
def subset(requests: list[Request], count: int, seed: int) -> list[Request]:
    """A seeded subset (the first `count` of one permutation, so subsets nest), in workload
    order."""
    if count >= len(requests):
        return list(requests)
    order = np.random.default_rng(seed + 1).permutation(len(requests))[:count]
    return [requests[i] for i in sorted(int(i) for i in order)]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def timed_run(
    label: str, requests: list[Request], work: Callable[[], list[list[int]]], **extra
) -> dict:
    """Run `work` (returning each request's generated ids) under the wall clock."""
    load_before, cpu = load_str(), time.process_time()
    started = time.perf_counter()
    tokens = work()
    seconds = time.perf_counter() - started
    return {
        "system": label,
        "requests": len(requests),
        "tokens": sum(map(len, tokens)),
        "seconds": seconds,
        "cpu_seconds": time.process_time() - cpu,
        "load_before": load_before,
        "load_after": load_str(),
        **extra,
        "_tokens": tokens,
    }


# -- minivllm --------------------------------------------------------------------------------------
def blocks_for(requests: list[Request], block_size: int = 16) -> int:
    """A cache that holds every request at its full length at once: no stalls, no preemption."""
    return max(2048, sum(-(-(len(r.prompt_ids) + r.max_tokens) // block_size) for r in requests))


def make_engine(
    model: Transformer,
    requests: list[Request],
    attention_backend: str = "auto",
    forward_processes: int = 1,
    kv_layout: str = "paged",
    **scheduler,
) -> LLMEngine:
    if scheduler.get("batching") == "static":  # recorded as "static"; the book's admission rule
        scheduler = {**scheduler, "batching": StaticBatching()}
    config = EngineConfig(
        num_blocks=blocks_for(requests),
        scheduler=SchedulerConfig(**scheduler),
        attention_backend=attention_backend,
        forward_processes=forward_processes,
        kv_layout=kv_layout,
    )
    return LLMEngine(model, config)


def run_engine(
    model: Transformer,
    requests: list[Request],
    label: str,
    attention_backend: str = "auto",
    forward_processes: int = 1,
    kv_layout: str = "paged",
    **scheduler,
) -> dict:
    # workers (forward_processes > 1) start here, before the clock
    engine = make_engine(
        model, requests, attention_backend, forward_processes, kv_layout, **scheduler
    )
    workers = engine.runner.workers.pids if engine.runner.workers else []
    worker_cpu = cpu_seconds_of(workers)

    def work() -> list[list[int]]:
        outputs = engine.generate(
            [r.prompt_ids for r in requests], [greedy(r.max_tokens) for r in requests]
        )
        return [list(o.token_ids) for o in outputs]

    result = timed_run(
        label,
        requests,
        work,
        scheduler=dict(scheduler),
        num_blocks=engine.config.num_blocks,
        attention_backend=attention_backend,
        forward_processes=forward_processes,
        kv_layout=kv_layout,
    )
    result["cpu_seconds"] += cpu_seconds_of(workers) - worker_cpu  # the workers' CPU time too
    engine.close()
    result.update(
        steps=len(engine.trace),
        peak_running=max(len(r.running) for r in engine.trace),
        overhead=overhead(engine.trace, result["seconds"]),
        _trace=engine.trace,
    )
    return result


def overhead(trace, wall_s: float) -> dict:
    """Share of step time outside the model forward, from the engine's own trace."""

    def share(records) -> dict:
        records = list(records)
        if not records:
            return {"steps": 0, "overhead": None}
        forward, step = sum(r.forward_s for r in records), sum(r.step_s for r in records)
        return {
            "steps": len(records),
            "forward_s": round(forward, 4),
            "step_s": round(step, 4),
            "overhead": round(1 - forward / step, 4),
            # per-step ratios: one step slowed down by another process weighs no more than any other
            "overhead_median_step": round(
                statistics.median(1 - r.forward_s / r.step_s for r in records), 4
            ),
            "ms_per_step": round(1000 * step / len(records), 3),
            "ms_per_step_median": round(1000 * statistics.median(r.step_s for r in records), 3),
        }

    big = [r for r in trace if len(r.decoded) >= BIG_BATCH_DECODES]
    forward = sum(r.forward_s for r in trace)
    return {
        "all_steps": share(trace),
        f"decodes_ge_{BIG_BATCH_DECODES}": share(big),
        f"decode_only_ge_{BIG_BATCH_DECODES}": share(r for r in big if not r.prefilled),
        # The wall clock also counts what the trace's step_s leaves out: the RequestOutputs that
        # step() builds after its timer stops, generate()'s loop, add_request.
        "wall": {
            "forward_s": round(forward, 4),
            "wall_s": round(wall_s, 4),
            "overhead": round(1 - forward / wall_s, 4),
        },
    }


# -- naive -----------------------------------------------------------------------------------------
def run_naive(model: Transformer, requests: list[Request], total: int) -> dict:
    return timed_run(
        "naive sequential (recompute, no KV cache)",
        requests,
        lambda: [
            generate_naive(model, r.prompt_ids, r.max_tokens, temperature=0.0) for r in requests
        ],
        subset_of=total,
        indices=[r.index for r in requests],
    )


# -- Hugging Face ----------------------------------------------------------------------------------
def build_hf(model: Transformer):
    """LlamaForCausalLM from our config (`hf_config`) holding our model's tensors."""
    import transformers

    config = transformers.LlamaConfig(**hf_config(model.config), pad_token_id=PAD_ID)
    hf = transformers.LlamaForCausalLM(config)
    hf.load_state_dict(model.state_dict(), strict=True)
    hf = hf.to(torch.float32).eval()
    # Greedy, no EOS: every request runs exactly max_new_tokens (what ignore_eos does in minivllm).
    hf.generation_config = transformers.GenerationConfig(
        do_sample=False,
        eos_token_id=None,
        pad_token_id=PAD_ID,
        bos_token_id=model.config.bos_token_id,
    )
    return hf, transformers.__version__


@torch.no_grad()
def hf_generate(hf, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """One left-padded batch; returns each row's generated ids (max_new_tokens of them)."""
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    out = hf.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=None,
        pad_token_id=PAD_ID,
    )
    if out.shape[1] != width + max_new_tokens:
        raise RuntimeError(
            f"HF generated {out.shape[1] - width} tokens, asked for {max_new_tokens}"
        )
    return out[:, width:].tolist()


def run_hf(hf, requests: list[Request], batch_size: int, label: str, total: int) -> dict:
    padded = 0

    def work() -> list[list[int]]:
        nonlocal padded
        tokens = []
        for i in range(0, len(requests), batch_size):
            batch = requests[i : i + batch_size]
            longest = max(r.max_tokens for r in batch)
            rows = hf_generate(hf, [r.prompt_ids for r in batch], longest)
            # only a request's own tokens count
            tokens += [row[: r.max_tokens] for row, r in zip(rows, batch)]
            padded += longest * len(batch)
        return tokens

    result = timed_run(label, requests, work, batch_size=batch_size)
    result["tokens_generated_incl_waste"] = padded
    if len(requests) < total:
        result.update(subset_of=total, indices=[r.index for r in requests])
    return result


# -- correctness -----------------------------------------------------------------------------------
def compare(reference: dict, other: dict, requests: list[Request]) -> dict:
    """Requests whose greedy tokens differ from the reference's (over the requests `other` ran)."""
    ref = {r.index: t for r, t in zip(requests, reference["_tokens"])}
    indices = other.get("indices", [r.index for r in requests])
    first = {}
    for i, toks in zip(indices, other["_tokens"]):
        if toks != ref[i]:
            first[i] = next(
                (k for k, (a, b) in enumerate(zip(toks, ref[i])) if a != b),
                min(len(toks), len(ref[i])),
            )
    return {
        "system": other["system"],
        "against": reference["system"],
        "requests_compared": len(indices),
        "requests_differing": len(first),
        "first_differing_token": {str(k): v for k, v in sorted(first.items())},
    }


# -- where the engine's step time goes -------------------------------------------------------------
def decode_stretch_engine(model: Transformer, requests: list[Request], budget: int) -> LLMEngine:
    """The workload with every request asked for 256 tokens, stepped until every prompt is
    prefilled:
    what follows is pure decoding at batch 64 (or the workload's size)."""
    longest = [
        replace(r, max_tokens=min(256, model.config.max_seq_len - len(r.prompt_ids)))
        for r in requests
    ]
    engine = make_engine(model, longest, max_num_seqs=64, max_num_batched_tokens=budget)
    for r in longest:
        engine.add_request(r.prompt_ids, greedy(r.max_tokens))
    while engine.scheduler.waiting or any(
        s.num_uncomputed_tokens > 1 for s in engine.scheduler.running
    ):
        engine.step()
    engine.step()
    return engine


def component_times(model: Transformer, requests: list[Request], budget: int, steps: int) -> dict:
    """Time each part of `LLMEngine.step` over a decode stretch with plain timers (no profiler)."""
    engine = decode_stretch_engine(model, requests, budget)
    acc: dict[str, float] = defaultdict(float)

    def timed(fn, key):
        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                acc[key] += time.perf_counter() - t

        return wrapper

    engine.scheduler.schedule = timed(engine.scheduler.schedule, "schedule")
    engine.scheduler.update = timed(engine.scheduler.update, "update")
    engine.runner.forward = timed(engine.runner.forward, "forward")
    engine.runner.sample = timed(engine.runner.sample, "sample")
    engine._record = timed(engine._record, "record")
    # built after step_s stops: not in the trace's overhead
    engine.outputs.output = timed(engine.outputs.output, "outputs")
    original_build = runner_module.build_batch  # what ModelRunner.execute calls
    runner_module.build_batch = timed(original_build, "build_batch")
    try:
        batch = len(engine.scheduler.running)
        started = time.perf_counter()
        for _ in range(steps):
            engine.step()
        total = time.perf_counter() - started
    finally:
        runner_module.build_batch = original_build
    parts = dict(acc)
    parts["other"] = total - sum(parts.values())
    ordered = sorted(parts.items(), key=lambda kv: -kv[1])
    return {
        "batch": batch,
        "steps": steps,
        "ms_per_step": round(1000 * total / steps, 3),
        "overhead": round(1 - parts["forward"] / total, 4),
        "overhead_excluding_outputs": round(1 - parts["forward"] / (total - parts["outputs"]), 4),
        "ms_per_step_by_part": {k: round(1000 * v / steps, 3) for k, v in ordered},
        "share_by_part": {k: round(v / total, 4) for k, v in ordered},
    }


def _where(key) -> str:
    file, line, name = key
    return f"{Path(file).name}:{line}({name})" if line else name


def profile_decode(
    model: Transformer, requests: list[Request], budget: int, steps: int, top: int = 12
) -> dict:
    """cProfile over a decode stretch. The engine's own functions are those `LLMEngine.step` reaches
    without going through `ModelRunner.forward` (calls from inside the forward are not counted for
    them); the forward's are listed apart. cProfile inflates Python-heavy code, so read the shares
    from
    `component_times`; this says *where*."""
    engine = decode_stretch_engine(model, requests, budget)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        engine.step()
    profiler.disable()
    # key -> (calls, primitive calls, tottime, cumtime, callers)
    stats = pstats.Stats(profiler).stats
    total = sum(v[2] for v in stats.values())
    # The engine's side: everything reachable from LLMEngine.step without passing
    # ModelRunner.forward.
    forward = {
        k
        for k in stats
        if (k[0].endswith("model_runner.py") and k[2] == "forward") or k[2] == "decorate_context"
    }  # ... and the torch.no_grad wrapper around it
    callees = defaultdict(set)
    for key, value in stats.items():
        for caller in value[4]:
            callees[caller].add(key)

    def reach(starts, barrier) -> set:
        seen, frontier = set(starts), list(starts)
        while frontier:
            node = frontier.pop()
            if node in barrier and node not in starts:
                continue  # both sides call it (len, torch.tensor): its callees stay unattributed
            for callee in callees[node]:
                if callee not in seen and callee not in forward:
                    seen.add(callee)
                    frontier.append(callee)
        return seen

    roots = [k for k in stats if k[0].endswith("engine.py") and k[2] == "step"]
    forward_reach = reach(list(forward), set()) - set(roots)
    reached = reach(roots, forward_reach)
    engine_side = []
    for key in reached:
        calls, _, self_s, cum_s, callers = stats[key]
        # a function called from both sides: count only the calls from the engine's
        if key not in roots:
            calls = sum(c[0] for caller, c in callers.items() if caller in reached)
            self_s = sum(c[2] for caller, c in callers.items() if caller in reached)
            cum_s = sum(c[3] for caller, c in callers.items() if caller in reached)
        engine_side.append((key, calls, self_s, cum_s))
    engine_total = sum(e[2] for e in engine_side)
    engine_side.sort(key=lambda e: -e[2])

    def row(key, calls, self_s, cum_s) -> dict:
        return {
            "function": _where(key),
            "calls_per_step": round(calls / steps, 1),
            "self_ms_per_step": round(1000 * self_s / steps, 4),
            "cum_ms_per_step": round(1000 * cum_s / steps, 4),
        }

    forward_side = sorted(
        ((k, v) for k, v in stats.items() if k not in reached), key=lambda kv: -kv[1][2]
    )[:top]
    return {
        "steps": steps,
        "batch": len(engine.scheduler.running),
        "profiled_ms_per_step": round(1000 * total / steps, 3),
        "engine_side_ms_per_step": round(1000 * engine_total / steps, 3),
        "engine_side_share": round(engine_total / total, 4),
        "engine_side_by_self_time": [row(*e) for e in engine_side[:top]],
        "engine_side_by_cumulative_time": [
            row(*e) for e in sorted(engine_side, key=lambda e: -e[3])[:top]
        ],
        "forward_by_self_time": [row(k, v[1], v[2], v[3]) for k, v in forward_side],
    }


# -- report ----------------------------------------------------------------------------------------


def public(result: dict, reference_tps: float | None = None) -> dict:
    out = {k: v for k, v in result.items() if not k.startswith("_")}
    out["tokens_per_second"] = result["tokens"] / result["seconds"]
    if "median_seconds" in result:
        out["tokens_per_second_median_run"] = round(result["tokens"] / result["median_seconds"], 4)
    for key in ("seconds", "median_seconds", "cpu_seconds", "tokens_per_second"):
        if key in out:
            out[key] = round(out[key], 4)
    if reference_tps is not None:
        out["continuous_over_this"] = round(
            reference_tps / (result["tokens"] / result["seconds"]), 4
        )
    return out


def print_table(results: list[dict], reference: dict) -> None:
    ref_tps = reference["tokens"] / reference["seconds"]
    print(
        f"\n| {'system':<52} | {'requests':>8} | {'tokens':>6} | {'seconds':>7} | {'median s':>8} "
        "| "
        f"{'tokens/s':>8} | {'continuous / this':>17} |"
    )
    print(f"|{'-' * 54}|{'-' * 10}|{'-' * 8}|{'-' * 9}|{'-' * 10}|{'-' * 10}|{'-' * 19}|")
    for r in results:
        tps = r["tokens"] / r["seconds"]
        reqs = f"{r['requests']}/{r['subset_of']}" if "subset_of" in r else str(r["requests"])
        median = f"{r['median_seconds']:.2f}" if r.get("repeats", 1) > 1 else "-"
        print(
            f"| {r['system']:<52} | {reqs:>8} | {r['tokens']:>6} | {r['seconds']:>7.2f} | "
            f"{median:>8} | "
            f"{tps:>8.1f} | {ref_tps / tps:>16.2f}x |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--budget",
        type=int,
        nargs="+",
        default=[512, 256, 2048],
        help="max_num_batched_tokens for continuous batching: the first is the headline, "
        "the rest a sweep",
    )
    parser.add_argument(
        "--small-batch",
        type=int,
        default=16,
        help="the static batch size that shows idle slots (run next to continuous with "
        "as many slots); the workload as one static batch always runs",
    )
    parser.add_argument(
        "--hf-batch", type=int, default=64, help="HF generate batch size (left padding)"
    )
    parser.add_argument(
        "--sequential-requests",
        type=int,
        default=8,
        help="seeded subset that naive sequential and HF one-by-one run",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="round-robin runs of the batched systems; best reported",
    )
    parser.add_argument(
        "--profile-steps", type=int, default=30, help="decode steps timed and profiled at batch 64"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: 8 requests, 8-32 output tokens, one run each",
    )
    parser.add_argument(
        "--backends",
        nargs="*",
        default=[],
        help="attention backends to run the headline continuous system on as well, next to the "
        "default one (e.g. --backends numba: the native CPU kernel)",
    )
    parser.add_argument(
        "--processes",
        nargs="+",
        type=int,
        default=[],
        help="forward processes to run the headline continuous system with as well "
        "(EngineConfig.forward_processes; e.g. --processes 2: each pass split by sequence "
        "between this process and a worker, one thread each)",
    )
    parser.add_argument(
        "--kv",
        nargs="*",
        choices=["paged", "basic"],
        default=[],
        help="KV layouts to run the headline continuous system with as well (--kv basic: each "
        "request reserves the model's whole context, as before paging; paged is the headline)",
    )
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--skip-naive", action="store_true")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="JSON path (default benchmarks/results/throughput.json; --quick writes nothing unless "
        "given)",
    )
    args = parser.parse_args()
    # one process is the headline system itself: no second row for it
    args.processes = sorted({p for p in args.processes if p > 1})

    torch.set_num_threads(THREADS)
    output_range = (8, 32) if args.quick else (32, 256)
    num_requests = min(args.requests, 8) if args.quick else args.requests
    if args.quick:
        args.sequential_requests, args.profile_steps, args.repeats, args.small_batch = 2, 3, 1, 4
        args.budget = args.budget[:1]
    out_path = args.out if args.out is not None else (None if args.quick else RESULTS)

    model = load_model("target")
    requests = make_workload(num_requests, args.seed, output_tokens=output_range)
    prompt_lens = [len(r.prompt_ids) for r in requests]
    out_lens = [r.max_tokens for r in requests]
    print(
        f"workload: {len(requests)} requests (seed {args.seed}), prompts "
        f"{min(prompt_lens)}-{max(prompt_lens)} "
        f"tokens (mean {statistics.mean(prompt_lens):.0f}), outputs "
        f"{min(out_lens)}-{max(out_lens)} tokens "
        f"(mean {statistics.mean(out_lens):.0f}, total {sum(out_lens)}); torch "
        f"{torch.__version__}, "
        f"{torch.get_num_threads()} threads, load average {load_str()}"
    )

    # The batched systems, run round-robin `repeats` times (best run reported).
    n, small, longest_prompt = len(requests), min(args.small_batch, len(requests)), max(prompt_lens)
    systems: dict[str, Callable[[], dict]] = {}
    for budget in args.budget:
        systems[f"continuous/{budget}"] = lambda b=budget: run_engine(
            model,
            requests,
            f"minivllm continuous (64 slots, budget {b})",
            max_num_seqs=64,
            max_num_batched_tokens=b,
        )

    def headline_with(label: str, **config):
        """The headline continuous system with one setting changed."""
        name = f"minivllm continuous (64 slots, budget {args.budget[0]}, {label})"
        return lambda: run_engine(
            model, requests, name, max_num_seqs=64, max_num_batched_tokens=args.budget[0], **config
        )

    # The headline system on every other attention backend asked for (e.g. the native CPU kernel).
    for backend in args.backends:
        systems[f"continuous/{args.budget[0]}/{backend}"] = headline_with(
            f"{backend} attention", attention_backend=backend
        )
    # The headline system with its forward passes split between processes, one thread each.
    for processes in args.processes:
        systems[f"continuous/{args.budget[0]}/{processes}p"] = headline_with(
            f"{processes} procs", forward_processes=processes
        )
    # The headline system with the KV layout before paging: the same cache, reserved per request.
    if "basic" in args.kv:
        systems[f"continuous/{args.budget[0]}/basic-kv"] = headline_with(
            "basic KV", kv_layout="contiguous"
        )
    # Static admits a batch only into an empty engine, so its budget must hold the whole batch's
    # prompts.
    systems["static/all"] = lambda: run_engine(
        model,
        requests,
        f"minivllm static (batch {min(64, n)})",
        max_num_seqs=min(64, n),
        max_num_batched_tokens=min(64, n) * longest_prompt,
        batching="static",
    )
    if small < min(64, n):
        systems["continuous/small"] = lambda: run_engine(
            model,
            requests,
            f"minivllm continuous ({small} slots, budget {args.budget[0]})",
            max_num_seqs=small,
            max_num_batched_tokens=max(args.budget[0], small),
        )
        systems["static/small"] = lambda: run_engine(
            model,
            requests,
            f"minivllm static (batch {small})",
            max_num_seqs=small,
            max_num_batched_tokens=small * longest_prompt,
            batching="static",
        )
    hf, hf_version, notes = None, None, []
    if not args.skip_hf:
        try:
            hf, hf_version = build_hf(model)
        except ImportError:
            notes.append("transformers is not installed (pip install -e '.[dev]'): HF rows skipped")
            print(f"  {notes[-1]}")
        else:
            hf_batch = min(args.hf_batch, n)
            systems["hf/batched"] = lambda: run_hf(
                hf, requests, hf_batch, f"HF generate, batched ({hf_batch}, left padding)", n
            )

    # Warm-up: a process's first forward pays for thread pools and allocator growth.
    warm = requests[:2]
    for backend in ["auto", *args.backends]:  # a kernel compiles (or loads its cache) here
        engine = LLMEngine(model, EngineConfig(attention_backend=backend))
        engine.generate([r.prompt_ids for r in warm], greedy(4))
    generate_naive(model, warm[0].prompt_ids, 2)
    if hf is not None:
        hf_generate(hf, [r.prompt_ids for r in warm], 2)

    runs: dict[str, list[dict]] = defaultdict(list)
    for repeat in range(args.repeats):
        for key, run in systems.items():
            r = run()
            runs[key].append(r)
            print_run(repeat, args.repeats, r, 48)
    best = {key: best_of(rs) for key, rs in runs.items()}
    continuous = best[f"continuous/{args.budget[0]}"]
    order = [
        f"continuous/{args.budget[0]}",
        *(f"continuous/{args.budget[0]}/{backend}" for backend in args.backends),
        *(f"continuous/{args.budget[0]}/{p}p" for p in args.processes),
        *([f"continuous/{args.budget[0]}/basic-kv"] if "basic" in args.kv else []),
        "static/all",
        "continuous/small",
        "static/small",
        "hf/batched",
    ]
    results = [best[k] for k in order if k in best]

    # The sequential systems, once each, on the same seeded subset.
    chosen = subset(requests, args.sequential_requests, args.seed)
    sequential = []
    if not args.skip_naive:
        sequential.append(run_naive(model, chosen, n))
    if hf is not None:
        sequential.append(run_hf(hf, chosen, 1, "HF generate, one by one", n))
    for r in sequential:
        print(
            f"  {r['system']:<54} {r['tokens'] / r['seconds']:8.1f} tokens/s ({r['requests']} "
            "requests, "
            f"{r['seconds']:6.2f} s, load {r['load_before']} -> {r['load_after']})",
            flush=True,
        )
    results += sequential
    comparisons = [
        compare(continuous, r, requests)
        for r in results[1:] + [best[f"continuous/{b}"] for b in args.budget[1:]]
    ]

    # Where a decode step's time goes, at batch 64 (the least disturbed of `repeats` timings).
    parts = min(
        (
            component_times(model, requests, args.budget[0], args.profile_steps)
            for _ in range(max(1, args.repeats))
        ),
        key=lambda p: p["ms_per_step"],
    )
    profile = profile_decode(model, requests, args.budget[0], args.profile_steps)
    # The attention's share of a decode step at batch 64, on each backend (alternating, medians).
    headline = resolve_backend_name("auto", "cpu")
    step_engines = {
        name: decode_engine(model, name, num_seqs=min(64, n), seed=args.seed)
        for name in dict.fromkeys([headline, *args.backends])
    }
    decode_steps = time_decode_steps(
        step_engines, steps=max(1, args.profile_steps // 3), rounds=max(3, args.repeats)
    )

    # -- the report --
    print_table(results, continuous)
    cont_tps = continuous["tokens"] / continuous["seconds"]
    tps = {r["system"]: r["tokens"] / r["seconds"] for r in results}
    if len(args.budget) > 1:
        print(
            "\ncontinuous batching, token budget (max_num_batched_tokens) sweep, best of "
            f"{args.repeats}:"
        )
        for budget in args.budget:
            r = best[f"continuous/{budget}"]
            print(
                f"  {budget:>5}: {r['tokens'] / r['seconds']:7.1f} tokens/s (median run "
                f"{r['tokens'] / r['median_seconds']:7.1f}), {r['steps']} steps"
            )

    def ratio_goal(prefix: str, goal: float, system: dict = continuous) -> dict | None:
        match = next((r for r in results if r["system"].startswith(prefix)), None)
        if match is None:
            return None
        value = round(tps[system["system"]] / tps[match["system"]], 3)
        return {"goal": goal, "value": value, "met": value >= goal, "against": match["system"]}

    ov = continuous["overhead"]
    big = ov[f"decodes_ge_{BIG_BATCH_DECODES}"]["overhead"]
    goals = {
        "continuous_over_hf_batched": ratio_goal("HF generate, batched", 2.0),
        **{
            f"continuous_{p}_processes_over_hf_batched": ratio_goal(
                "HF generate, batched", 2.0, best[f"continuous/{args.budget[0]}/{p}p"]
            )
            for p in args.processes
        },
        "continuous_over_naive_sequential": ratio_goal("naive sequential", 15.0),
        f"overhead_at_decodes_ge_{BIG_BATCH_DECODES}": (
            {"goal": 0.10, "value": big, "met": big <= 0.10} if big is not None else None
        ),
    }
    print("\ngoals:")
    for name, g in goals.items():
        if g is None:
            print(f"  {name}: not measured (skipped, or no such steps in this run)")
        elif name.startswith(("overhead", "attention_share")):
            print(
                f"  {name}: {100 * g['value']:.1f} % (goal <= {100 * g['goal']:.0f} %): "
                f"{'met' if g['met'] else 'NOT met'}"
            )
        else:
            print(
                f"  {name}: {g['value']:.2f}x (goal >= {g['goal']:.0f}x): "
                f"{'met' if g['met'] else 'NOT met'}"
            )

    print(
        f"\na decode step at batch {decode_steps[headline]['batch']} by attention backend "
        "(alternating, medians; attention = the backend's calls: K/V write + attend, all layers):"
    )
    for name, t in decode_steps.items():
        print(
            f"  {name:<8} step {t['step_ms']:6.2f} ms, attention {t['attention_ms']:6.2f} ms "
            f"({100 * t['attention_share']:.1f} %)"
        )

    print("\nengine overhead, 1 - forward / step (trace of the headline continuous run):")
    for key, val in ov.items():
        if key == "wall":
            print(f"  {'wall clock (+ outputs, generate loop)':<40} {100 * val['overhead']:5.1f} %")
        elif val["steps"]:
            print(
                f"  {key:<40} {100 * val['overhead']:5.1f} %  (median step "
                f"{100 * val['overhead_median_step']:.1f} %; "
                f"{val['steps']} steps, {val['ms_per_step']:.1f} ms/step)"
            )
    print(
        f"  decode stretch at batch {parts['batch']} ({parts['steps']} steps, "
        f"{parts['ms_per_step']:.1f} ms/step): "
        f"overhead {100 * parts['overhead']:.1f} % "
        f"({100 * parts['overhead_excluding_outputs']:.1f} % without the "
        f"RequestOutputs)\n    ms/step by part: "
        + ", ".join(f"{k} {v:.2f}" for k, v in parts["ms_per_step_by_part"].items())
    )
    print(
        f"  cProfile ({profile['steps']} steps at batch {profile['batch']}), engine side by self "
        "time, ms/step: "
        + ", ".join(
            f"{e['function']} {e['self_ms_per_step']:.2f}"
            for e in profile["engine_side_by_self_time"][:8]
        )
    )

    print("\ngreedy tokens against minivllm continuous (reported, not asserted):")
    for c in comparisons:
        print(
            f"  {c['system']:<54} {c['requests_differing']}/{c['requests_compared']} requests "
            "differ"
        )

    if out_path is None:
        print("\nquick run: no JSON written (give --out to write one)")
        return
    write_results(
        out_path,
        {
            "benchmark": "throughput",
            "machine": machine_record(
                "wall clock on a shared machine: each result keeps its runs' load averages",
                transformers=hf_version,
            ),
            "workload": {
                "seed": args.seed,
                "requests": n,
                "quick": args.quick,
                "prompt_source": "byte slices of "
                "minivllm.training.corpus.shipped_validation_text(), cut at UTF-8 "
                "character boundaries; ByteTokenizer with BOS",
                "prompt_bytes": [16, 200],
                "output_tokens": list(output_range),
                "prompt_tokens": {
                    "min": min(prompt_lens),
                    "max": max(prompt_lens),
                    "total": sum(prompt_lens),
                },
                "output_tokens_total": sum(out_lens),
                "sampling": "greedy (temperature 0), ignore_eos",
                "sequential_subset": [r.index for r in chosen],
                "requests_list": [[p, o] for p, o in zip(prompt_lens, out_lens)],
                "requests_list_columns": ["prompt_tokens", "max_tokens"],
            },
            "config": {
                "continuous": {
                    "max_num_seqs": 64,
                    "max_num_batched_tokens": args.budget[0],
                    "budget_sweep": args.budget[1:],
                },
                "static": {
                    "batch_sizes": sorted({min(64, n), small}, reverse=True),
                    "max_num_batched_tokens": "batch size x longest prompt (a batch is "
                    "admitted whole)",
                },
                "hf_batch": min(args.hf_batch, n),
                "sequential_requests": len(chosen),
                "repeats": args.repeats,
                "threads": THREADS,
                "throughput": "useful generated tokens / wall seconds (best of repeats)",
            },
            "results": [public(r, cont_tps) for r in results],
            "budget_sweep": [public(best[f"continuous/{b}"], cont_tps) for b in args.budget]
            if len(args.budget) > 1
            else None,
            "goals": goals,
            "correctness": comparisons,
            "overhead": {
                "continuous_trace": ov,
                "decode_stretch_components": parts,
                "cprofile": profile,
            },
            "decode_step_by_backend": decode_steps,
            "notes": notes,
        },
    )
    print(f"\nwrote {out_path}")


if __name__ == "__main__":
    main()
