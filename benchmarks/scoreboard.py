"""The scoreboard: one seeded workload through every layer the book builds (chapters 00-08).

    python benchmarks/scoreboard.py [--requests 24] [--seed 0] [--repeats 3] [--quick] [--out PATH]

One workload -- `make_workload(--requests, seed)` of _common.py: prompts are 16-200-byte slices of
the shipped validation text (cut at UTF-8 character boundaries, BOS first), outputs of 24-64
tokens, greedy, `ignore_eos` -- run on the shipped target model, 2 torch threads, by each layer as
the package offers it:

| row          | ch | what runs                                                                 |
|--------------|----|---------------------------------------------------------------------------|
| naive        | 00 | `generate_naive`, one request after another: every token re-runs the prefix |
| kv_cache     | 02 | `generate_cached` over a `ContiguousKVCache("preallocate")` of the context  |
| paged        | 03 | `generate_paged` over a `BlockManager` + `PagedKVStorage`, one at a time   |
| continuous   | 04 | `LLMEngine`: continuous batching, all requests at once, torch attention    |
| speculative  | 06 | the same engine with the shipped draft model proposing k = 4 tokens        |
| numba        | 07 | the engine of row 4 on the numba CPU paged-attention kernel               |
| http         | 08 | `minivllm serve` (numba, a subprocess on loopback), every request a       |
|              |    | streaming client, all at once                                             |

The engines (and the server) get the same scheduler -- `max_num_seqs` 64, a budget of 512 tokens
per step -- and a KV cache sized to hold every request at its full length at once (no stall, no
preemption), so a row differs from the one before it by its chapter's idea alone.

Each row is timed with the wall clock over the whole workload (generated tokens / seconds; the
server's from the clients' first request to their last stream's end). Rows alternate, `--repeats`
rounds (naive, kv_cache, ..., http, then again), after one warm-up of each on two short requests;
the table gives each row's median and best run, and every run keeps its load average.

KV-cache memory, two numbers per row, in bytes of K and V (float32):

* reserved: what the layer allocates for K/V while it runs -- none for naive generation; one
  request's `max_seq_len` slots for the preallocated contiguous cache (one request at a time);
  the block pool for the paged rows (one request's worth for the one-at-a-time paged row, the whole
  workload's for the engines; the speculative engine adds the draft model's pool);
* peak used: the most bytes holding live tokens at one moment -- the longest request's tokens for
  the contiguous cache, the most blocks in use x the bytes of a block for the paged rows (the
  engine's `peak_blocks_used`; plus the draft model's blocks, the same block tables, for the
  speculative row); for the server, the largest `minivllm:kv_cache_usage_perc` seen by polling
  `/metrics` every 0.1 s, x the pool (a sampled peak: it can miss a step's maximum).

Greedy tokens are compared with the naive row's, request by request (reported, not asserted: an
argmax near-tie can flip with the summation order). The server streams text, not token ids: its row
compares each request's text with the naive tokens decoded by the same byte tokenizer.

The vLLM row is not measured here: `benchmarks/results/vllm_peer.json` (benchmarks/vllm_peer.py,
vLLM's CPU build against minivllm on a larger workload of its own) is read as it is and shown
beside minivllm's row from that same run, so its ratio never mixes workloads.

On a machine other processes keep busy, OpenMP's default spin-waiting makes a 2-thread torch run
many times slower than it should be (each thread spins at every barrier while the other waits for
a core). Importing minivllm before torch sets its default, `OMP_WAIT_POLICY=PASSIVE` with a short
spin, where none is set (see the package's `__init__`): the threads sleep soon after each op, and
the engine runs on the cores other processes leave it (`runner/threads.py`); the server inherits
it. The JSON records the policy.

Prints a table and writes benchmarks/results/scoreboard.json (a --quick smoke run writes nothing
unless --out is given). Not part of `make test`; the book's scoreboard page renders the JSON.
"""

from __future__ import annotations

import minivllm  # noqa: F401 -- before torch: it sets OMP_WAIT_POLICY, read as torch loads

# isort: split
import argparse
import asyncio
import json
import re
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

import httpx
import torch
from _common import Request, load_str, machine_record, make_workload, start_server, write_results

from minivllm.attention.storage import PagedKVStorage
from minivllm.engine.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.kv.block_manager import BlockManager
from minivllm.model.checkpoint import load_model
from minivllm.model.tokenizer import ByteTokenizer
from minivllm.model.transformer import ModelConfig, Transformer
from minivllm.runner.speculative import SpeculativeConfig
from minivllm.sched.scheduler import SchedulerConfig
from minivllm.sched.sequence import SamplingParams
from minivllm.serving.client import run_clients
from minivllm.stages.contiguous import ContiguousKVCache, generate_cached
from minivllm.stages.naive import generate_naive
from minivllm.stages.paged import stream_paged

RESULTS = Path(__file__).parent / "results" / "scoreboard.json"
VLLM_PEER = Path(__file__).parent / "results" / "vllm_peer.json"
THREADS = 2
BLOCK_SIZE = 16
MAX_NUM_SEQS, BUDGET = 64, 512  # the engines' and the server's scheduler
SPEC_K = 4  # draft tokens per step, the speculative row (chapter 06's headline k)
OUTPUT_TOKENS = (24, 64)
POLL_S = 0.1  # how often the server's /metrics is read for its KV-cache usage

# key, label, chapter, what it adds
ROWS = [
    ("naive", "naive generation", "00", "no KV cache: every token re-runs the whole prefix"),
    ("kv_cache", "contiguous KV cache", "02", "keys and values kept: one token per forward"),
    ("paged", "paged KV cache", "03", "K/V in 16-token blocks through a block table"),
    ("continuous", "continuous batching", "04", "every request in one batched forward per step"),
    ("speculative", "speculative decoding", "06", f"draft model proposes k = {SPEC_K}, one verify"),
    ("numba", "CPU paged-attention kernel", "07", "numba kernel reads the paged cache in place"),
    ("http", "served over HTTP", "09", "OpenAI API, one streaming client per request"),
]


# -- memory ----------------------------------------------------------------------------------------
def token_bytes(config: ModelConfig) -> int:
    """K and V of one token in every layer, float32."""
    return config.n_layers * 2 * config.n_kv_heads * config.head_dim * 4


def blocks_for(requests: list[Request], extra: int = 0) -> int:
    """A pool that holds every request at its full length (+ `extra` lookahead slots) at once."""
    return sum(-(-(len(r.prompt_ids) + r.max_tokens + extra) // BLOCK_SIZE) for r in requests)


# -- the rows --------------------------------------------------------------------------------------
def run_naive(model: Transformer, requests: list[Request]) -> tuple[list[list[int]], dict]:
    tokens = [generate_naive(model, r.prompt_ids, r.max_tokens) for r in requests]
    return tokens, {"reserved_bytes": 0, "peak_used_bytes": 0}


def run_contiguous(model: Transformer, requests: list[Request]) -> tuple[list[list[int]], dict]:
    tokens, reserved, used = [], 0, 0
    for r in requests:  # a fresh cache per request, as a server would reserve: the whole context
        cache = ContiguousKVCache(model.config, "preallocate", max_len=model.config.max_seq_len)
        tokens.append(generate_cached(model, r.prompt_ids, r.max_tokens, cache))
        reserved, used = max(reserved, cache.reserved_bytes), max(used, cache.used_bytes)
    return tokens, {"reserved_bytes": reserved, "peak_used_bytes": used}


def run_paged(model: Transformer, requests: list[Request]) -> tuple[list[list[int]], dict]:
    num_blocks = max(-(-(len(r.prompt_ids) + r.max_tokens) // BLOCK_SIZE) for r in requests)
    manager = BlockManager(num_blocks=num_blocks, block_size=BLOCK_SIZE)
    storage = PagedKVStorage(model.config, num_blocks, BLOCK_SIZE)
    tokens, peak = [], 0
    for r in requests:
        out = []
        for token in stream_paged(model, r.prompt_ids, r.max_tokens, manager, storage, r.index):
            out.append(token)
            peak = max(peak, manager.num_used)
        tokens.append(out)
    block = BLOCK_SIZE * token_bytes(model.config)
    return tokens, {"reserved_bytes": storage.bytes, "peak_used_bytes": peak * block}


def engine_config(requests: list[Request], backend: str, spec: SpeculativeConfig | None = None):
    return EngineConfig(
        num_blocks=blocks_for(requests, SPEC_K if spec else 0),
        block_size=BLOCK_SIZE,
        scheduler=SchedulerConfig(max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=BUDGET),
        attention_backend=backend,
        speculative=spec,
    )


def run_engine(
    model: Transformer,
    requests: list[Request],
    backend: str,
    draft: Transformer | None = None,
) -> tuple[list[list[int]], dict]:
    spec = None
    if draft is not None:
        spec = SpeculativeConfig(method="draft", num_speculative_tokens=SPEC_K, draft_model=draft)
    engine = LLMEngine(model, engine_config(requests, backend, spec))
    params = [
        SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True) for r in requests
    ]
    outputs = engine.generate([r.prompt_ids for r in requests], params)
    block = BLOCK_SIZE * token_bytes(model.config)
    reserved, peak = engine.storage.bytes, engine.peak_blocks_used * block
    if draft is not None:  # the draft model keeps its own K/V, in blocks of the same tables
        reserved += engine.drafter.storage.bytes
        peak += engine.peak_blocks_used * BLOCK_SIZE * token_bytes(draft.config)
    memory = {"reserved_bytes": reserved, "peak_used_bytes": peak, "steps": len(engine.trace)}
    return [list(o.token_ids) for o in outputs], memory


# -- the server (benchmarks/_common.start_server) --------------------------------------------------
USAGE = re.compile(r"^minivllm:kv_cache_usage_perc(?:\{[^}]*\})? (\S+)$", re.M)


async def clients_and_poll(url: str, bodies: list[dict]) -> tuple[float, list, float]:
    """Every request a streaming client at once; /metrics read every POLL_S meanwhile."""
    peak, done = 0.0, asyncio.Event()

    async def poll() -> None:
        nonlocal peak
        async with httpx.AsyncClient(timeout=30) as client:
            while not done.is_set():
                text = (await client.get(url + "/metrics")).text
                peak = max([peak, *(float(v) for v in USAGE.findall(text))])
                try:
                    await asyncio.wait_for(done.wait(), POLL_S)
                except TimeoutError:
                    pass

    poller = asyncio.create_task(poll())
    seconds, streams = await run_clients(url + "/v1", bodies, len(bodies))
    done.set()
    await poller
    return seconds, streams, peak


def run_http(url: str, requests: list[Request], pool_bytes: int) -> tuple[list[str], dict]:
    bodies = [
        {
            "model": "target",
            "prompt": r.prompt_ids,  # token ids, BOS first: the same prompts as every other row
            "max_tokens": r.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }
        for r in requests
    ]
    seconds, streams, peak = asyncio.run(clients_and_poll(url, bodies))
    memory = {
        "reserved_bytes": pool_bytes,
        "peak_used_bytes": round(peak * pool_bytes),
        "tokens": sum(s.completion_tokens for s in streams),
        "seconds": seconds,
    }
    return [s.text for s in streams], memory


# -- timing and the report -------------------------------------------------------------------------
def timed(work: Callable[[], tuple[list, dict]]) -> dict:
    load_before, started = load_str(), time.perf_counter()
    outputs, memory = work()
    seconds = time.perf_counter() - started
    # the server's row brings its own: usage's token count, the clients' wall clock
    tokens = memory.pop("tokens", None) or sum(map(len, outputs))
    return {
        "seconds": memory.pop("seconds", None) or seconds,
        "tokens": tokens,
        "load_before": load_before,
        "load_after": load_str(),
        "memory": memory,
        "_outputs": outputs,
    }


def summary(runs: list[dict], reference: list[list[int]], tokenizer: ByteTokenizer) -> dict:
    """A row of the table from its runs: median and best throughput, memory, greedy agreement."""
    tokens = runs[0]["tokens"]
    rates = [r["tokens"] / r["seconds"] for r in runs]
    outputs = runs[0]["_outputs"]
    if outputs and isinstance(outputs[0], str):  # the server's texts
        expected = [tokenizer.decode(t) for t in reference]
    else:
        expected = reference
    differing = sum(a != b for a, b in zip(outputs, expected))
    every_run_same = all(r["_outputs"] == outputs for r in runs)
    memory = {k: max(r["memory"][k] for r in runs) for k in runs[0]["memory"]}
    return {
        "tokens": tokens,
        "tokens_per_s_median": round(statistics.median(rates), 2),
        "tokens_per_s_best": round(max(rates), 2),
        "seconds_median": round(statistics.median(r["seconds"] for r in runs), 4),
        "kv_reserved_bytes": memory.pop("reserved_bytes"),
        "kv_peak_used_bytes": memory.pop("peak_used_bytes"),
        **memory,
        "requests_differing_from_naive": differing,
        "identical_to_naive": differing == 0,
        "every_run_identical": every_run_same,
        "runs": [
            {
                "seconds": round(r["seconds"], 4),
                "tokens_per_s": round(r["tokens"] / r["seconds"], 2),
                "load_before": r["load_before"],
                "load_after": r["load_after"],
            }
            for r in runs
        ],
    }


def mib(n: int) -> str:
    return f"{n / 2**20:8.2f}"


def print_table(rows: dict[str, dict]) -> None:
    naive = rows["naive"]["tokens_per_s_median"]
    print(
        f"\n{'layer':<28} {'ch':>2} {'tok/s':>8} {'best':>8} {'x naive':>8} "
        f"{'KV MiB reserved':>15} {'peak used':>9}  same tokens"
    )
    for key, label, chapter, _ in ROWS:
        if key not in rows:
            continue
        r = rows[key]
        print(
            f"{label:<28} {chapter:>2} {r['tokens_per_s_median']:>8.1f} "
            f"{r['tokens_per_s_best']:>8.1f} {r['tokens_per_s_median'] / naive:>8.1f} "
            f"{mib(r['kv_reserved_bytes']):>15} {mib(r['kv_peak_used_bytes']):>9}  "
            f"{'yes' if r['identical_to_naive'] else str(r['requests_differing_from_naive'])}"
            + ("" if r["identical_to_naive"] else " differ")
        )


def vllm_row() -> dict | None:
    """vLLM's CPU build and minivllm from the same run of benchmarks/vllm_peer.py, as recorded."""
    if not VLLM_PEER.exists():
        return None
    peer = json.loads(VLLM_PEER.read_text())
    results = peer["results"]
    vllm_key = next((k for k in results if k.startswith("vllm/")), None)
    vllm, mini = results.get(vllm_key), results.get("minivllm/numba")
    if vllm is None or mini is None:
        return None

    def variant(key: str) -> dict | None:
        """Another minivllm system of the same run, where it had one."""
        if key not in results:
            return None
        row = results[key]
        return {
            "system": row["system"],
            "tokens_per_s_median": row["tokens_per_second_median"],
            "tokens_per_s_best": row["tokens_per_second_best"],
            "over_vllm_median": round(
                row["tokens_per_second_median"] / vllm["tokens_per_second_median"], 3
            ),
            "greedy_agreement": peer.get("greedy_agreement", {}).get(f"{key} vs {vllm_key}"),
        }

    return {
        "source": "benchmarks/results/vllm_peer.json",
        "workload": peer["workload"],
        "config": peer["config"],
        "vllm": {
            "system": vllm["system"],
            "tokens_per_s_median": vllm["tokens_per_second_median"],
            "tokens_per_s_best": vllm["tokens_per_second_best"],
        },
        "minivllm": variant("minivllm/numba"),
        "minivllm_over_vllm_median": round(
            mini["tokens_per_second_median"] / vllm["tokens_per_second_median"], 3
        ),
        "greedy_agreement": peer.get("greedy_agreement", {}).get(f"minivllm/numba vs {vllm_key}"),
        "minivllm_split": variant("minivllm/numba/2p"),  # forward_processes=2
        "minivllm_compiled": variant("minivllm/numba/compiled"),  # compile_forward=True
        "minivllm_data_parallel": variant("minivllm/numba/dp2"),  # data_parallel_size=2
        # vLLM's own data parallelism (two vllm.LLM of one thread each), where it was run: one
        # process per replica as minivllm's, else as vLLM's example runs it
        "vllm_data_parallel": next(
            (
                {
                    "system": results[key]["system"],
                    "tokens_per_s_median": results[key]["tokens_per_second_median"],
                }
                for key in ("vllm/compiled-dp2-1proc", "vllm/compiled-dp2")
                if key in results
            ),
            None,
        ),
        "load_average": peer.get("load_average"),
        # When and at which commit vllm_peer.py ran (its record has no date before it wrote one):
        # the scoreboard page shows it under the table, since that run is not this one.
        "date": peer.get("date"),
        "machine": {
            k: peer["machine"].get(k) for k in ("cpus", "torch", "vllm", "platform", "source")
        },
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3, help="alternating rounds of every row")
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: 4 requests, 8-16 tokens, one round"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="JSON path (default benchmarks/results/scoreboard.json; --quick writes nothing "
        "unless given)",
    )
    args = parser.parse_args()
    args.output_tokens = OUTPUT_TOKENS
    if args.quick:
        args.requests, args.repeats, args.output_tokens = min(args.requests, 4), 1, (8, 16)
    args.out_path = args.out if args.out is not None else (None if args.quick else RESULTS)
    return args


def main() -> None:
    args = parse_args()
    load_at_start, started = load_str(), time.perf_counter()
    torch.manual_seed(args.seed)
    torch.set_num_threads(THREADS)
    model, draft, tokenizer = load_model("target"), load_model("draft"), ByteTokenizer()
    requests = make_workload(args.requests, args.seed, output_tokens=args.output_tokens)
    prompt_lens, out_lens = [len(r.prompt_ids) for r in requests], [r.max_tokens for r in requests]
    print(
        f"workload: {len(requests)} requests (seed {args.seed}), prompts "
        f"{min(prompt_lens)}-{max(prompt_lens)} tokens, outputs {min(out_lens)}-{max(out_lens)} "
        f"(total {sum(out_lens)}); torch {torch.__version__}, {THREADS} threads, "
        f"load average {load_at_start}",
        flush=True,
    )
    num_blocks = blocks_for(requests)
    pool_bytes = num_blocks * BLOCK_SIZE * token_bytes(model.config)
    process, url = start_server(  # the engine of the numba row, behind HTTP
        "--threads",
        str(THREADS),
        "--max-num-seqs",
        str(MAX_NUM_SEQS),
        "--num-blocks",
        str(num_blocks),
    )

    systems: dict[str, Callable[[list[Request]], tuple[list, dict]]] = {
        "naive": lambda reqs: run_naive(model, reqs),
        "kv_cache": lambda reqs: run_contiguous(model, reqs),
        "paged": lambda reqs: run_paged(model, reqs),
        "continuous": lambda reqs: run_engine(model, reqs, "torch"),
        "speculative": lambda reqs: run_engine(model, reqs, "torch", draft),
        "numba": lambda reqs: run_engine(model, reqs, "numba"),
        "http": lambda reqs: run_http(url, reqs, pool_bytes),
    }
    runs: dict[str, list[dict]] = defaultdict(list)
    try:
        warm = [Request(r.index, r.prompt, r.prompt_ids, 4) for r in requests[:2]]
        for run in systems.values():  # thread pools, allocator growth, the numba kernel's cache
            run(warm)
        for repeat in range(args.repeats):
            for key, run in systems.items():
                runs[key].append(result := timed(lambda run=run: run(requests)))
                print(
                    f"  [{repeat + 1}/{args.repeats}] {key:<12} "
                    f"{result['tokens'] / result['seconds']:8.1f} tokens/s "
                    f"({result['seconds']:6.2f} s, load {result['load_before']} -> "
                    f"{result['load_after']})",
                    flush=True,
                )
    finally:
        process.terminate()
        process.wait(30)
    reference = runs["naive"][0]["_outputs"]
    rows = {key: summary(rs, reference, tokenizer) for key, rs in runs.items()}
    # the server counts its tokens (usage); every row must have generated the same number
    assert len({r["tokens"] for r in rows.values()}) == 1, {k: r["tokens"] for k, r in rows.items()}
    print_table(rows)
    peer = vllm_row()
    if peer is not None:
        print(
            f"\nvLLM (from {peer['source']}, its own workload: {peer['workload']['requests']} "
            f"requests, {peer['workload']['output_tokens_total']} output tokens): "
            f"{peer['vllm']['system']} {peer['vllm']['tokens_per_s_median']:.1f} tokens/s, "
            f"{peer['minivllm']['system']} {peer['minivllm']['tokens_per_s_median']:.1f} tokens/s "
            f"in the same run: minivllm / vLLM = {peer['minivllm_over_vllm_median']:.2f}"
        )
        for other in (peer["minivllm_split"], peer["minivllm_compiled"]):
            if other is not None:
                print(
                    f"  {other['system']} {other['tokens_per_s_median']:.1f} tokens/s: "
                    f"minivllm / vLLM = {other['over_vllm_median']:.2f}"
                )
    elapsed = time.perf_counter() - started
    print(f"\nload average {load_at_start} -> {load_str()}; {elapsed:.0f} s in all")
    if args.out_path is None:
        print("quick run: no JSON written (give --out to write one)")
        return
    write_json(args, requests, rows, peer, load_at_start, elapsed)


def write_json(args, requests, rows, peer, load_at_start: str, elapsed: float) -> None:
    prompt_lens, out_lens = [len(r.prompt_ids) for r in requests], [r.max_tokens for r in requests]
    versions = {
        name: metadata.version(name) for name in ("minivllm", "numba", "fastapi", "uvicorn")
    }
    record = {
        "benchmark": "scoreboard",
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "machine": machine_record(
            "wall clock on a shared machine; the rows alternate and each run keeps its load "
            "averages; the server runs in a process of its own, its clients in this one",
            load_average_at_start=load_at_start,
            versions=versions,
        ),
        "seconds_in_all": round(elapsed, 1),
        "workload": {
            "seed": args.seed,
            "requests": len(requests),
            "quick": args.quick,
            "prompt_source": "byte slices (16-200 bytes) of "
            "minivllm.training.corpus.shipped_validation_text(), cut at UTF-8 character "
            "boundaries; ByteTokenizer with BOS",
            "output_tokens": list(args.output_tokens),
            "prompt_tokens_total": sum(prompt_lens),
            "output_tokens_total": sum(out_lens),
            "sampling": "greedy (temperature 0), ignore_eos",
            "requests_list": [[p, o] for p, o in zip(prompt_lens, out_lens)],
            "requests_list_columns": ["prompt_tokens", "max_tokens"],
        },
        "config": {
            "threads": THREADS,
            "repeats": args.repeats,
            "order": "alternating: every row once per round, in table order",
            "block_size": BLOCK_SIZE,
            "engine": {
                "max_num_seqs": MAX_NUM_SEQS,
                "max_num_batched_tokens": BUDGET,
                "num_blocks": blocks_for(requests),
                "num_blocks_speculative": blocks_for(requests, SPEC_K),
            },
            "speculative": {"method": "draft", "num_speculative_tokens": SPEC_K},
            "server": f"minivllm serve --threads {THREADS} --max-num-seqs {MAX_NUM_SEQS} "
            f"--num-blocks {blocks_for(requests)} (numba attention, the CPU default); one "
            "streaming client per request, all at once; prompts sent as token ids",
            "throughput": "generated tokens / wall seconds of the whole workload",
            "kv_reserved": "bytes of K/V the layer allocates while it runs (float32)",
            "kv_peak_used": "the most bytes of K/V holding live tokens at once (block granular "
            "for paged rows; the server's is sampled from /metrics every "
            f"{POLL_S} s)",
            "identical": "greedy tokens equal the naive row's, request by request (the server: "
            "text equal to the naive tokens decoded)",
        },
        "rows": [
            {"key": key, "layer": label, "chapter": chapter, "adds": adds, **rows[key]}
            for key, label, chapter, adds in ROWS
            if key in rows
        ],
        "vllm_peer": peer,
    }
    write_results(args.out_path, record)


if __name__ == "__main__":
    main()
