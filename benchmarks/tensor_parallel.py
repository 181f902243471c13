"""Tensor parallelism against forward workers on a CPU: the two ways this engine uses more than one
process (issue 33).

    tensor parallel (EngineConfig.tensor_parallel_size=N, runner/tensor_parallel.py): every rank
        runs the whole batch over its share of each layer's heads and MLP units, one thread each;
        two all-reduces per layer and a gather of the logits.
    forward workers (EngineConfig.forward_processes=N, runner/workers.py): every process runs the
        whole model over its share of the batch's sequences, one thread each; one exchange per
        step (the logits).

against one process on torch's threads. The workload is seeded (validation-text prompts, greedy,
fixed output lengths), the same for every system; each system's engine starts once, before the
clock, and the systems' runs alternate (ABCABC...), so a change in the machine's load hits them
alike. Reported per system, medians over the repeats: tokens/s, the mean step time, and for tensor
parallelism the share of rank 0's wall time spent in collectives (all-reduces, the logits' gather:
time waiting for the slower rank included) and in the per-step broadcast of the batch. Every
system's greedy tokens are compared with the one-process run.

    python benchmarks/tensor_parallel.py                 # 3 repeats, 24 requests
    python benchmarks/tensor_parallel.py --repeats 5 --requests 48
    python benchmarks/tensor_parallel.py --shape 100m --requests 8 --output-tokens 16 32

`--shape 100m` runs a real-shaped model (benchmarks/real_model.py's random Qwen3 checkpoint, built
once) in float32. Writes benchmarks/results/tensor_parallel.json (tensor_parallel_SHAPE.json for a
shape), with the CPU model and the load average before and after each run: on a shared machine
say so beside the numbers.
"""

from __future__ import annotations

import minivllm  # noqa: F401 -- before torch: it sets OMP_WAIT_POLICY, read as torch loads

# isort: split
import argparse
import statistics
import time
from pathlib import Path

import torch
from _common import cpu_seconds_of, load_str, machine_record, make_workload, write_results

from minivllm.engine.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.model.checkpoint import load_model
from minivllm.model.parallel import COMM
from minivllm.sched.scheduler import SchedulerConfig
from minivllm.sched.sequence import SamplingParams

RESULTS = Path(__file__).parent / "results" / "tensor_parallel.json"


def systems(threads: int) -> dict[str, dict]:
    """Label -> EngineConfig fields."""
    return {
        f"1 process, {threads} threads": {},
        "1 process, 1 thread": {"_threads": 1},
        "tensor parallel 2 (1 thread/rank)": {"tensor_parallel_size": 2},
        "forward workers 2 (1 thread/proc)": {"forward_processes": 2},
    }


def build(folder, fields: dict, num_blocks: int, threads: int, shared: dict) -> LLMEngine:
    """An engine for one system: the one-process systems share one engine (only the threads
    differ), tensor parallelism's ranks read their shards of the folder themselves."""
    torch.set_num_threads(threads)  # TP shares torch's threads out between its ranks
    config = EngineConfig(
        num_blocks=num_blocks,
        scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=512),
        dtype=torch.float32,
        **{k: v for k, v in fields.items() if not k.startswith("_")},
    )
    if config.tensor_parallel_size > 1:
        return LLMEngine(load_model(folder, torch.float32, weights=False), config)
    if config.forward_processes == 1 and "one process" in shared:
        return shared["one process"]
    engine = LLMEngine(load_model(folder, torch.float32), config, own_model=True)
    if config.forward_processes == 1:
        shared["one process"] = engine
    return engine


def run_once(engine: LLMEngine, threads: int, requests) -> dict:
    torch.set_num_threads(threads)
    pids = []
    if engine.runner.workers is not None:
        pids = engine.runner.workers.pids
    if engine.parallel is not None:
        pids = engine.parallel.pids
    prompts = [r.prompt_ids for r in requests]
    params = [
        SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True) for r in requests
    ]
    engine.trace.clear()
    COMM.reset()
    broadcast_before = engine.parallel.broadcast_s if engine.parallel else 0.0
    load_before, cpu, others = load_str(), time.process_time(), cpu_seconds_of(pids)
    started = time.perf_counter()
    outputs = engine.generate(prompts, params)
    seconds = time.perf_counter() - started
    broadcast = (engine.parallel.broadcast_s if engine.parallel else 0.0) - broadcast_before
    tokens = [list(o.token_ids) for o in outputs]
    steps = [r.step_s for r in engine.trace]
    return {
        "seconds": seconds,
        "tokens": sum(map(len, tokens)),
        "tokens_per_s": sum(map(len, tokens)) / seconds,
        "steps": len(steps),
        "mean_step_ms": 1000 * statistics.mean(steps),
        "comm_share": COMM.seconds / seconds,
        "comm_calls": COMM.calls,
        "comm_mib": COMM.bytes / 2**20,
        "broadcast_share": broadcast / seconds,
        "broadcast_ms_per_step": 1000 * broadcast / len(steps),
        "cpu_seconds": time.process_time() - cpu + cpu_seconds_of(pids) - others,
        "load_before": load_before,
        "load_after": load_str(),
        "_tokens": tokens,
    }


def pack_int64(batch) -> torch.Tensor:
    """The other way to send a batch: every integer field in one int64 tensor behind a header of
    sizes (the receiver would read the header, then the tensor; `launcher.Messages.broadcast`
    sends a pickled object in one broadcast of up to 64 KiB, a second only for a longer one)."""
    header = torch.tensor(
        [
            batch.num_tokens,
            batch.num_seqs,
            batch.block_tables.shape[1],
            len(batch.logits_indices),
            batch.num_decodes,
            batch.block_size,
            batch.max_decode_context_len,
        ]
    )
    parts = [
        batch.input_ids,
        batch.positions,
        batch.slot_mapping,
        batch.query_start,
        batch.context_lens,
        batch.block_tables.reshape(-1),
        batch.logits_indices,
    ]
    return torch.cat([header, *parts])


def message_costs(num_seqs: int = 64, context: int = 200, reps: int = 2000) -> dict:
    """What building one step's message costs on rank 0, for a decode step of `num_seqs`
    sequences of `context` tokens: the pickled object the ranks receive today against one packed
    int64 tensor (bytes, and microseconds to make it)."""
    import pickle

    from minivllm.kv.block_manager import BlockManager
    from minivllm.runner.batch import BatchPiece, pack_batch
    from minivllm.runner.launcher import batch_fields

    manager = BlockManager(num_seqs * (context // 16 + 2), 16)
    for seq_id in range(num_seqs):
        manager.allocate(seq_id, context)
    batch = pack_batch([BatchPiece(i, context - 1, [7], 1) for i in range(num_seqs)], manager)
    started = time.perf_counter()
    for _ in range(reps):
        pickled = pickle.dumps(batch_fields(batch))
    pickled_us = 1e6 * (time.perf_counter() - started) / reps
    started = time.perf_counter()
    for _ in range(reps):
        packed = pack_int64(batch)
    packed_us = 1e6 * (time.perf_counter() - started) / reps
    return {
        "batch": f"{num_seqs} decodes, {context} tokens of context each",
        "pickled_bytes": len(pickled),
        "pickled_us_to_build": round(pickled_us, 1),
        "packed_int64_bytes": packed.numel() * 8,
        "packed_us_to_build": round(packed_us, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--threads", type=int, default=2, help="the one-process engine's threads")
    parser.add_argument(
        "--shape",
        default="target",
        help="'target' (the shipped model) or a shape of benchmarks/real_model.py (100m, "
        "qwen3-0.6b, tiny): a random Qwen3 checkpoint of that shape, built once",
    )
    parser.add_argument("--dir", type=Path, default=None, help="where real_model.py's go")
    parser.add_argument("--output-tokens", type=int, nargs=2, default=(32, 96), metavar="N")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    if args.shape == "target":
        folder, out = "target", args.out or RESULTS
    else:
        from real_model import DEFAULT_DIR, make_checkpoint

        folder = make_checkpoint(args.dir or DEFAULT_DIR, args.shape, "float32")
        out = args.out or RESULTS.with_name(f"tensor_parallel_{args.shape}.json")
    requests = make_workload(args.requests, seed=0, output_tokens=tuple(args.output_tokens))
    num_blocks = sum(-(-(len(r.prompt_ids) + r.max_tokens) // 16) for r in requests) + 16
    engines, shared = {}, {}
    for label, fields in systems(args.threads).items():
        started = time.perf_counter()
        engine = build(folder, fields, num_blocks, args.threads, shared)
        engines[label] = engine, fields.get("_threads", args.threads)
        print(f"started {label} in {time.perf_counter() - started:.1f} s", flush=True)
    runs: dict[str, list[dict]] = {label: [] for label in engines}
    try:
        for engine, threads in engines.values():  # a warm-up run each, not recorded
            run_once(engine, threads, requests[:4])
        for repeat in range(args.repeats):
            for label, (engine, threads) in engines.items():
                run = run_once(engine, threads, requests)
                runs[label].append(run)
                print(
                    f"  [{repeat + 1}/{args.repeats}] {label:<36} {run['tokens_per_s']:8.1f} "
                    f"tokens/s  step {run['mean_step_ms']:6.2f} ms  comm "
                    f"{100 * run['comm_share']:4.1f} %  (load {run['load_before']} -> "
                    f"{run['load_after']})",
                    flush=True,
                )
    finally:
        for engine, _ in engines.values():
            engine.close()  # the shared one-process engine twice: close() is idempotent

    reference = runs[next(iter(runs))][0]["_tokens"]
    summary = []
    for label, recorded in runs.items():

        def median(key, recorded=recorded):
            return statistics.median(r[key] for r in recorded)

        summary.append(
            {
                "system": label,
                "tokens_per_s": round(median("tokens_per_s"), 1),
                "mean_step_ms": round(median("mean_step_ms"), 3),
                "comm_share": round(median("comm_share"), 4),
                "broadcast_share": round(median("broadcast_share"), 4),
                "broadcast_ms_per_step": round(median("broadcast_ms_per_step"), 4),
                "comm_calls_per_run": recorded[0]["comm_calls"],
                "comm_mib_per_run": round(recorded[0]["comm_mib"], 2),
                "cpu_seconds": round(median("cpu_seconds"), 2),
                "steps": recorded[0]["steps"],
                "tokens": recorded[0]["tokens"],
                "same_tokens_as_one_process": all(r["_tokens"] == reference for r in recorded),
                "runs": [
                    {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}
                    for r in ({k: v for k, v in r.items() if k != "_tokens"} for r in recorded)
                ],
            }
        )
    base = summary[0]["tokens_per_s"]
    print()
    print(
        f"{'system':<36} {'tokens/s':>9} {'x':>6} {'step ms':>8} {'comm %':>7} "
        f"{'bcast ms':>9} {'cpu s':>7} same"
    )
    for row in summary:
        print(
            f"{row['system']:<36} {row['tokens_per_s']:9.1f} {row['tokens_per_s'] / base:6.2f} "
            f"{row['mean_step_ms']:8.2f} {100 * row['comm_share']:7.1f} "
            f"{row['broadcast_ms_per_step']:9.3f} {row['cpu_seconds']:7.2f} "
            f"{row['same_tokens_as_one_process']}"
        )
    costs = message_costs()
    print(
        f"\none step's message ({costs['batch']}): pickled {costs['pickled_bytes']} bytes in "
        f"{costs['pickled_us_to_build']} us; packed int64 tensor {costs['packed_int64_bytes']} "
        f"bytes in {costs['packed_us_to_build']} us"
    )
    record = {
        "benchmark": "tensor_parallel",
        "model": str(folder) if args.shape == "target" else f"random Qwen3, shape {args.shape}",
        "dtype": "float32",
        "workload": {
            "requests": len(requests),
            "prompt_tokens": sum(len(r.prompt_ids) for r in requests),
            "output_tokens": sum(r.max_tokens for r in requests),
            "seed": 0,
            "greedy": True,
        },
        "repeats": args.repeats,
        "statistic": "median over repeats, systems alternating",
        "systems": summary,
        "message_costs": costs,
        "machine": machine_record(
            "comm_share: rank 0's wall time inside all-reduce and the logits' gather (waiting "
            "for the slower rank included) over the run's wall time; broadcast: the per-step "
            "pickled batch (launcher.Messages.broadcast). Measured on a shared "
            "machine: see the load averages per run."
        ),
    }
    write_results(out, record)


if __name__ == "__main__":
    main()
