"""The engine on a GPU: minivllm on each attention backend against Hugging Face `generate`, on the
same GPU and workload (issue 34, `make gpu-check`).

    python benchmarks/gpu_engine.py [--requests 64] [--seed 0] [--repeats 3] [--dtype float32]
        [--shape qwen3-0.6b] [--out benchmarks/results/gpu_engine.json]

The workload is `throughput.py`'s: prompts are 16-200-byte slices of the shipped validation text,
outputs 32-256 tokens, greedy, `ignore_eos`, on the shipped target model -- or, with `--shape`, on
a random-initialised Hugging Face Qwen3 checkpoint of that real shape (`real_model.py`'s
`make_checkpoint`; the prompts' byte ids are token ids there), loaded by minivllm's loader and by
`transformers`' `from_pretrained`. Systems:

* minivllm `LLMEngine(device="cuda")` with the `torch` attention backend (gather through the block
  table, then SDPA), the `cuda` backend (chapter 08's numba-cuda v3 kernel) and `cuda-v4` (its
  tiled v4), each run eagerly
  (`enforce_eager=True`) and with its decode steps replayed as CUDA graphs (runner/cuda_graph.py:
  captured at engine start, the capture time and the memory its pool took are reported);
* Hugging Face `LlamaForCausalLM.generate` holding the same tensors, on the same GPU: all requests
  in one left-padded batch (each batch runs to its longest request; only a request's own tokens
  count).

Every system runs `--repeats` times, round-robin, after one warm-up run each (kernel compilation and
CUDA context set-up stay out of the numbers); the table shows the median tokens/s and the best.
Greedy tokens are compared with the eager torch backend: reported, not asserted (a near-tie can
flip with the summation order, which differs between kernels, and between an eager decode and a
graph's, which attends over the fixed capacity of the block tables).

Then, where the time goes: a stretch of pure decode steps at batch 64 (every prompt prefilled),
each backend under `torch.profiler` -- wall milliseconds per step, GPU kernel time per step (how
busy the GPU is), kernel launches per step, host-device synchronisations per step (the calls that
make the CPU wait for the GPU), and the operators that cost the CPU most.

On a machine without a CUDA GPU the script says so and exits 0 without writing anything.
"""

from __future__ import annotations

import minivllm  # noqa: F401 -- before torch: it sets OMP_WAIT_POLICY, read as torch loads

# isort: split
import argparse
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch
from _common import machine_record, make_workload, write_results
from throughput import build_hf, compare, greedy

from minivllm.engine.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.model.checkpoint import load_model
from minivllm.model.tokenizer import PAD_ID

RESULTS = Path(__file__).parent / "results" / "gpu_engine.json"


BACKENDS = ("torch", "cuda", "cuda-v4")
MAX_MODEL_LEN = 512  # the workload's longest request is 201 + 256 tokens: the graphs' table width
GRAPHS = " + CUDA graphs"


def system_name(backend: str, graphs: bool) -> str:
    return f"minivllm {backend} backend" + (GRAPHS if graphs else "")


def engine_system(model, requests, backend: str, dtype: torch.dtype, graphs: bool = False):
    blocks = max(2048, sum(-(-(len(r.prompt_ids) + r.max_tokens) // 16) for r in requests))
    config = EngineConfig(
        num_blocks=blocks,
        max_model_len=MAX_MODEL_LEN,
        device="cuda",
        attention_backend=backend,
        dtype=dtype,
        enforce_eager=not graphs,
    )
    engine = LLMEngine(model, config)

    def run() -> list[list[int]]:
        outputs = engine.generate(
            [r.prompt_ids for r in requests], [greedy(r.max_tokens) for r in requests]
        )
        return [list(o.token_ids) for o in outputs]

    return engine, run


@torch.no_grad()
def hf_system(hf, requests):
    def run() -> list[list[int]]:
        prompts = [r.prompt_ids for r in requests]
        width, longest = max(map(len, prompts)), max(r.max_tokens for r in requests)
        ids = torch.full((len(prompts), width), PAD_ID, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        out = hf.generate(
            input_ids=ids.cuda(),
            attention_mask=mask.cuda(),
            do_sample=False,
            max_new_tokens=longest,
            eos_token_id=None,
            pad_token_id=PAD_ID,
        )
        rows = out[:, width:].tolist()
        return [row[: r.max_tokens] for row, r in zip(rows, requests)]

    return run


def decode_profile(
    model, requests, backend: str, dtype: torch.dtype, graphs: bool, steps: int = 20
) -> dict:
    """Profile `steps` pure decode steps at the workload's batch size on one backend, eagerly or
    replaying CUDA graphs (a replay counts as one launch here: `cudaGraphLaunch`)."""
    from torch.profiler import ProfilerActivity, profile

    longest = [replace(r, max_tokens=256) for r in requests]
    engine, _ = engine_system(model, longest, backend, dtype, graphs)
    for r in longest:
        engine.add_request(r.prompt_ids, greedy(r.max_tokens))
    while engine.scheduler.waiting or any(
        s.num_uncomputed_tokens > 1 for s in engine.scheduler.running
    ):
        engine.step()
    for _ in range(3):  # warm: every decode shape compiled
        engine.step()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - started) / steps
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type.name == "CUDA"]
    gpu_us = sum(e.self_device_time_total for e in kernels) / steps
    launches = sum(
        e.count
        for e in events
        if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch")
    )
    syncs = {
        e.key: e.count / steps
        for e in events
        if "Synchronize" in e.key or "Memcpy" in e.key or e.key == "aten::item"
    }
    top = sorted(
        (e for e in events if e.device_type.name == "CPU"), key=lambda e: -e.self_cpu_time_total
    )[:15]
    return {
        "backend": backend,
        "system": system_name(backend, graphs),
        "cuda_graphs": graphs,
        "graph_replays": engine.runner.graphs.replays if graphs else 0,
        "batch": len(engine.scheduler.running),
        "ms_per_step": round(wall * 1e3, 3),
        "gpu_kernel_ms_per_step": round(gpu_us / 1e3, 3),
        "gpu_busy_share": round(gpu_us / 1e6 / wall, 3),
        "kernel_launches_per_step": round(launches / steps, 1),
        "syncs_and_copies_per_step": syncs,
        "top_cpu_ops_us_per_step": {e.key: round(e.self_cpu_time_total / steps, 1) for e in top},
    }


def timed(run) -> tuple[float, list[list[int]]]:
    torch.cuda.synchronize()
    started = time.perf_counter()
    tokens = run()
    torch.cuda.synchronize()
    return time.perf_counter() - started, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument(
        "--shape", default=None, help="a real_model.py shape (qwen3-0.6b): a random checkpoint"
    )
    parser.add_argument("--dir", type=Path, default=None, help="where --shape's folder is built")
    parser.add_argument("--out", type=Path, default=None, help="default: results/gpu_engine.json")
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=["eager", "graphs"],
        default=["eager", "graphs"],
        help="eager steps, CUDA-graph replay, or both (the first system is the token reference)",
    )
    parser.add_argument("--no-profile", action="store_true", help="skip the decode-step profiles")
    args = parser.parse_args()
    modes = [mode == "graphs" for mode in args.modes]
    if args.out is None:
        suffix = "" if args.shape is None else "_" + args.shape.replace(".", "").replace("-", "_")
        args.out = RESULTS.with_name(f"gpu_engine{suffix}.json")
    if not torch.cuda.is_available():
        print("no CUDA GPU here: the engine-on-GPU comparison needs one; nothing measured")
        return
    dtype = getattr(torch, args.dtype)
    requests = make_workload(args.requests, args.seed)
    folder = "target"
    if args.shape is not None:
        from real_model import DEFAULT_DIR, make_checkpoint

        started = time.perf_counter()
        folder = make_checkpoint(args.dir or DEFAULT_DIR, args.shape, args.dtype)
        print(f"checkpoint {folder} ready in {time.perf_counter() - started:.0f} s", flush=True)
    model = load_model(folder, args.dtype)
    systems, captures = {}, {}
    for backend in BACKENDS:
        for graphs in modes:
            engine, run = engine_system(model, requests, backend, dtype, graphs)
            systems[system_name(backend, graphs)] = run
            if graphs:
                captured = engine.runner.graphs
                captures[system_name(backend, graphs)] = {
                    "batch_sizes": captured.sizes,
                    "capture_s": round(captured.capture_s, 3),
                    "pool_mib": round(captured.pool_bytes / 2**20, 1),
                    "capture_error": captured.capture_error,  # None: every size captured
                }
    if args.shape is None:
        hf, hf_version = build_hf(load_model("target"))
    else:
        import transformers

        hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
        hf.generation_config.eos_token_id = None  # every request runs to its own max_tokens
        hf_version = transformers.__version__
    hf = hf.to(device="cuda", dtype=dtype)
    systems["HF generate (one batch)"] = hf_system(hf, requests)

    for name, run in systems.items():  # warm-up: compilation, context, allocator
        timed(run)
        print(f"warmed up {name}", flush=True)
    seconds = {name: [] for name in systems}
    tokens = {}
    total = sum(r.max_tokens for r in requests)
    for round_index in range(args.repeats):
        for name, run in systems.items():
            elapsed, tokens[name] = timed(run)
            seconds[name].append(elapsed)
            # as it goes: a run stopped at its time limit still leaves its numbers in the log
            print(
                f"round {round_index + 1}: {name}: {elapsed:.2f} s, {total / elapsed:,.0f} tok/s",
                flush=True,
            )
    reference = next(iter(systems))  # the torch backend, eager when eager steps were run
    rows = []
    for name, runs in seconds.items():
        agreement = compare(
            {"system": reference, "_tokens": tokens[reference]},
            {"system": name, "_tokens": tokens[name]},
            requests,
        )
        rows.append(
            {
                "system": name,
                "tokens": total,
                "seconds": runs,
                "median_tokens_per_s": total / statistics.median(runs),
                "best_tokens_per_s": total / min(runs),
                "reference": reference,
                "requests_differing_from_torch_backend": agreement["requests_differing"],
                "first_differing_token": agreement["first_differing_token"],
                "cuda_graph_capture": captures.get(name),
            }
        )
    hf_tps = rows[-1]["median_tokens_per_s"]
    device = torch.cuda.get_device_name()
    print(f"\n{args.requests} requests, {total} tokens, {args.dtype}, {device}")
    print(f"{'system':<42}{'median tok/s':>14}{'best tok/s':>12}{'x HF':>7}{'differ':>8}")
    for row in rows:
        print(
            f"{row['system']:<42}{row['median_tokens_per_s']:>14,.0f}"
            f"{row['best_tokens_per_s']:>12,.0f}{row['median_tokens_per_s'] / hf_tps:>7.2f}"
            f"{row['requests_differing_from_torch_backend']:>8}"
        )
    for name, capture in captures.items():
        print(
            f"{name}: {len(capture['batch_sizes'])} graphs captured in {capture['capture_s']:.2f} "
            f"s, pool {capture['pool_mib']:.1f} MiB"
        )
    record = {
        "machine": machine_record(
            "engine on the GPU against HF generate, same GPU and workload",
            device=torch.cuda.get_device_name(),
            cuda_runtime=torch.version.cuda,
            transformers=hf_version,
        ),
        "workload": {
            "requests": args.requests,
            "seed": args.seed,
            "dtype": args.dtype,
            "model": "target" if args.shape is None else f"random {args.shape} ({folder.name})",
            "parameters": sum(p.numel() for p in model.parameters()),
        },
        "repeats": args.repeats,
        "rows": rows,
    }
    # written before the profiles too: a run stopped at its time limit keeps the timed rounds
    write_results(args.out, record)
    if args.no_profile:
        return
    profiles = [
        decode_profile(model, requests, backend, dtype, graphs)
        for backend in BACKENDS
        for graphs in modes
    ]
    print(f"\ndecode steps at batch {args.requests}, under torch.profiler:")
    for prof in profiles:
        print(
            f"  {prof['system']:<36} {prof['ms_per_step']:7.2f} ms/step, GPU kernels "
            f"{prof['gpu_kernel_ms_per_step']:.2f} ms ({prof['gpu_busy_share']:.0%} busy), "
            f"{prof['kernel_launches_per_step']:.0f} launches, syncs/copies "
            f"{prof['syncs_and_copies_per_step']}"
        )
        for name, us in list(prof["top_cpu_ops_us_per_step"].items())[:8]:
            print(f"      {us:9.1f} us  {name}")
    record["decode_profiles"] = profiles
    write_results(args.out, record)


if __name__ == "__main__":
    main()
