"""Where one decode step's time goes: minivllm and vLLM's CPU build, component by component, each
against this machine's roofline (issue 32, item 1).

    python benchmarks/step_profile.py [--batches 1 16 64] [--steps 8] [--warmup 3] [--rounds 2]
    [--engines vllm vllm-passive vllm-compiled minivllm] [--vllm-python PATH] [--threads 2]
    [--out PATH] [--checkpoint FOLDER] [--dtype float32|bfloat16]
    python benchmarks/step_profile.py --report    # the tables of --out again, what they say

The shipped target model (src/minivllm/weights/target, float32) -- or any Hugging Face checkpoint
folder both engines load (`--checkpoint`; benchmarks/real_model.py builds the real-shaped Qwen3
one, under /tmp/minivllm-real-model) in `--dtype` -- the same requests in both engines:
`--batch` prompts of `make_workload(batch, seed)` (16-200-byte slices of the validation text, as
token ids), greedy, `ignore_eos`. Each engine takes them in, steps until every one has its first
token (the prefill chunks, not timed), runs `--warmup` decode steps, then times `--steps` decode
steps with the wall clock alone (no hooks, no profiler: the step as it runs) and `--steps` more
under torch.profiler, in two alternating halves, each step with every sequence decoding one token.
So both engines profile steps at the same context lengths.

The profile attributes each step's time to components by the ranges around them (the profiler's
`record_function`, entered by wrappers this script puts around the engines' functions and modules
while it profiles: no engine code changes, and nothing is left wrapped afterwards) and by the ops
inside the forward pass, an event's own time going to the nearest range or op that names a
component:

* host work: schedule; batch build (minivllm: sampling metadata, `build_batch`, the attention
  backend's per-step set-up; vLLM: the runner's `preprocess` scope and the rest of `execute_model`
  around its forward); sampling (minivllm: `sample` with its checks of the logits; vLLM: its
  `sample` scope and `sample_tokens`); update (minivllm: `Scheduler.update`; vLLM:
  `Scheduler.update_from_output` and the runner's bookkeeping); output processing (minivllm:
  detokenize, stop strings, `RequestOutput`s, the step trace; vLLM: `process_outputs` and the
  front end's rest of `LLMEngine.step`); other host (the step's own Python between those);
* the forward pass: matmuls (q/k/v, o, gate/up, down, LM head: each projection module, or
  `F.linear` or packed oneDNN call, named by its weight's shape), attention (the backend's call
  per layer: the K/V cache write and the attention), norms, RoPE (with minivllm's cos/sin
  tables), SiLU*mul, residual adds, the embedding, other ops (views, splits, the logits rows'
  copy), and "forward: Python and gaps", the forward's own time between all of those. vLLM adds
  the residual inside its norm (`fused_add_rms_norm`): its "norms" hold its residual adds, which
  read 0.

vLLM runs in its own virtualenv (`--vllm-python`, as benchmarks/vllm_peer.py drives it), eager
(`enforce_eager`, so its modules can be wrapped; its default compiles the forward with inductor,
whose fused kernels no longer map onto modules) and with its engine core in the calling process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`, so one profiler sees the whole step; by default the engine
core is a process of its own and the front end's output processing overlaps its next step). Its
own profiling scopes are on (`VLLM_CUSTOM_SCOPES_FOR_PROFILING=1`). Three vLLM runs by default:
`vllm` as it ships (libgomp's idle OpenMP threads spin before they sleep) and `vllm-passive`
(`OMP_WAIT_POLICY=PASSIVE`, vLLM's recommended setting): on a machine with more
runnable threads than cores a spinning thread can hold the core the thread it waits for needs. A
third, `vllm-compiled`, is vLLM as it runs by default, and in vllm_peer.py: as it ships, its
forward compiled. Only its host work is wrapped there (a wrapper inside the graph would fail the
graph's guards, and it would compile again); its forward splits by op: the matmuls the graph calls
("matmuls (in a graph)": oneDNN's, not told apart by projection; the LM head's, after the graph,
still named), its attention ops, and the graph's own time ("fused graph kernels": the norms,
residual adds, RoPE and SiLU*mul inductor fused, and the code calling them). Against it, minivllm
is compared on coarser sums: every matmul as one, every elementwise op as one. The
engines alternate -- vLLM's processes, then minivllm, for `--rounds` rounds -- and each component's
number is the median over every profiled step of every round.

The roofline: the script measures this machine's stream bandwidth (a large float32 copy and add,
GB/s of bytes read and written) and matmul FLOP/s (a large GEMM in `--dtype`; and the small-M GEMMs
of this model at each batch size, reported beside it), then gives each component the bytes it must
move and the FLOPs it must do, from the shapes (`minivllm.book.roofline`, which chapter 07 uses),
and the time neither limit allows it to beat: max(bytes / bandwidth, FLOPs / peak), with each
limit the best of its readings (at the start and after every round: the machine is shared). Host
components move a few hundred bytes of metadata: their floor is essentially zero, so their ratio
is not given. Writes
benchmarks/results/step_profile.json with the machine (CPU model and flags, load before and after,
torch, threads), the limits' readings, the tables and
"what the table says", computed from them.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from vllm_peer import DEFAULT_VLLM_PYTHON, MARKER, TARGET, cpu_bind, load_str, run_as_group

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).parent / "results" / "step_profile.json"
THREADS, SEED, MAX_MODEL_LEN, MAX_NUM_BATCHED_TOKENS = 2, 0, 512, 512
PREFIX = "sp:"  # this script's profiler ranges
ENGINES = ["vllm", "vllm-passive", "vllm-compiled", "minivllm"]

# Components, in the table's order. Host work first, then the forward pass's parts.
HOST = ["schedule", "batch build", "sampling", "update", "output processing", "other host"]
MATMULS = ["qkv matmul", "o matmul", "gate/up matmul", "down matmul", "LM head"]
# vLLM compiled (`vllm-compiled`): its layers' matmuls, called by inductor's graph, are ops of no
# module this script can wrap, so not told apart by projection; the graph's own time is its fused
# kernels (norms, residual adds, RoPE, SiLU*mul) and the code that calls them
GRAPH_MATMULS, GRAPH = "matmuls (in a graph)", "fused graph kernels"
FORWARD = MATMULS + [
    GRAPH_MATMULS,
    "attention",
    "norms",
    "RoPE",
    "SiLU*mul",
    "residual adds",
    GRAPH,
    "embedding",
    "other ops",
    "forward: Python and gaps",
]
COMPONENTS = HOST[:2] + FORWARD + HOST[2:]
# ranges whose events' own time is the forward's Python; ops under them are named by what they do
GENERIC = {"forward", "postprocess"}
# vLLM's own profiling scopes (VLLM_CUSTOM_SCOPES_FOR_PROFILING=1) -> component
VLLM_SCOPES = {
    "gpu_model_runner: preprocess": "batch build",
    "gpu_model_runner: forward": "forward",
    "gpu_model_runner: postprocess": "postprocess",
    "gpu_model_runner: sample": "sampling",
    "gpu_model_runner: bookkeep": "update",
    "gpu_model_runner: ModelRunnerOutput": "update",
    "llm_engine step: process_outputs": "output processing",
    "llm_engine step: abort_requests": "output processing",
    "llm_engine step: record_stats": "output processing",
}


# -- attribution: shared by both sides (no minivllm import: vLLM's venv runs it too) ---------------
def op_component(name: str, scope: str | None = None) -> str:
    """What an op the forward calls outside every named range does (`scope`: the generic range or
    compiled graph it runs under). A compiled vLLM's ops are named here: its graph, the oneDNN
    matmuls the graph calls (the LM head's, after the graph, in the `postprocess` scope) and its
    attention ops."""
    if name.startswith("## Call CompiledFxGraph"):
        return GRAPH
    op = name.split("::")[-1]
    if op == "onednn_mm":
        return "LM head" if scope == "postprocess" else GRAPH_MATMULS
    if op in ("unified_attention_with_output", "unified_kv_cache_update"):
        return "attention"
    if op in ("silu", "silu_", "mul", "mul_", "silu_and_mul"):
        return "SiLU*mul"
    if op in ("add", "add_"):
        return "residual adds"
    if op == "embedding":
        return "embedding"
    return "other ops"


def range_component(name: str) -> str | None:
    """The component a range names (ours, or one of vLLM's scopes), None for an op."""
    if name.startswith(PREFIX):
        return name[len(PREFIX) :]
    return VLLM_SCOPES.get(name)


def attribute(events) -> list[dict[str, float]]:
    """Per profiled step (a `sp:step` range), milliseconds per component: every event's own time
    (its duration less its children's) goes to the component of the nearest range above it (or
    itself) that names one; an op under a generic range (the forward) or a compiled graph is named
    by `op_component`, the generic range's own time is the forward's Python. Events outside every
    step are left out."""
    memo: dict[int, tuple[str | None, int | None]] = {}

    def place(evt) -> tuple[str | None, int | None]:
        """(component, step id) of an event."""
        key = id(evt)
        if key in memo:
            return memo[key]
        parent = evt.cpu_parent
        above, step = place(parent) if parent is not None else (None, None)
        own = range_component(evt.name)
        if own == "step":
            result = ("other host", key)
        elif own is not None:
            result = (own, step)
        elif above in GENERIC or above == GRAPH:
            result = (op_component(evt.name, above), step)
        else:
            result = (above, step)
        memo[key] = result
        return result

    steps: dict[int, dict[str, float]] = {}
    order: list[int] = []
    for evt in events:
        component, step = place(evt)
        if step is None:
            continue
        if step not in steps:
            steps[step] = {}
            order.append(step)
        if component in GENERIC:
            component = "forward: Python and gaps"
        children = sum(c.time_range.elapsed_us() for c in evt.cpu_children)
        own_us = evt.time_range.elapsed_us() - children
        steps[step][component] = steps[step].get(component, 0.0) + own_us / 1e3
        if range_component(evt.name) == "step":
            steps[step]["step (profiled)"] = evt.time_range.elapsed_us() / 1e3
    return [steps[s] for s in order]


@contextlib.contextmanager
def wrapped(patches: list[tuple[object, str, object]]):
    """Replace `owner.attr` by `make(original)` for each patch; put every original back after."""
    saved = []
    try:
        for owner, attr, make in patches:
            own = vars(owner)  # a class's own attribute (not inherited), a module's, an object's
            saved.append((owner, attr, own.get(attr), attr in own))
            setattr(owner, attr, make(getattr(owner, attr)))
        yield
    finally:
        for owner, attr, original, had in reversed(saved):
            if had:
                setattr(owner, attr, original)
            else:
                delattr(owner, attr)


def ranged(name: str):
    """A wrapper maker: the function, inside a profiler range `sp:<name>`."""
    from torch.profiler import record_function

    def make(function):
        def inner(*args, **kwargs):
            with record_function(PREFIX + name):
                return function(*args, **kwargs)

        return inner

    return make


def profile_steps(step, n: int) -> list[dict[str, float]]:
    """`n` calls of `step` under torch.profiler (CPU), each in a `sp:step` range; attributed. One
    more step runs first under the profiler, left out: it pays for the profiler's start."""
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(n + 1):
            with record_function(PREFIX + "step"):
                step()
    return attribute(prof.events())[1:]


def timed_and_profiled(step, n: int, patches: list) -> tuple[list[float], list[dict]]:
    """`n` steps timed by the wall clock and `n` profiled, in two alternating halves (wall,
    profiled, wall, profiled), so that a burst of load on the shared machine falls on both."""
    wall: list[float] = []
    profiled: list[dict[str, float]] = []
    for half in (n - n // 2, n // 2):
        if half:
            wall += wall_steps(step, half)
            with wrapped(patches):
                profiled += profile_steps(step, half)
    return wall, profiled


def max_tokens_for(prompts: list[list[int]], warmup: int, steps: int) -> int:
    """Enough output tokens that no request ends before the last profiled step: the first
    requests' prompts are done (and decode) while the prefill chunks of the others still run."""
    prefill_steps = -(-sum(map(len, prompts)) // MAX_NUM_BATCHED_TOKENS) + 1
    return prefill_steps + warmup + 2 * steps + 2 + 8  # + the profiler's first step, twice


def to_decode(step, ids: list, warmup: int) -> dict:
    """Step until every request has its first token, then `warmup` more steps: from here on each
    step decodes one token of every request. Returns each request's output tokens so far."""
    generated: dict = {}
    while len(generated) < len(ids) or warmup > 0:
        if len(generated) == len(ids):
            warmup -= 1
        for output in step():
            if output.outputs[0].token_ids:
                generated[output.request_id] = len(output.outputs[0].token_ids)
    return generated


def context_tokens(prompts: list[list[int]], generated: dict, ids: list, steps: int) -> float:
    """The cached tokens all requests attend, summed, at the middle of the timed and profiled
    steps (`timed_and_profiled`: 2 `steps` and the profiler's first step of each half): prompt and
    output so far, then half of those steps."""
    later = (2 * steps + 2) / 2
    return sum(len(p) + generated[i] + later for p, i in zip(prompts, ids))


def wall_steps(step, n: int) -> list[float]:
    """Milliseconds of each of `n` calls of `step`, nothing wrapped, no profiler."""
    times = []
    for _ in range(n):
        started = time.perf_counter()
        step()
        times.append((time.perf_counter() - started) * 1e3)
    return times


# -- the vLLM side: runs in vLLM's venv ------------------------------------------------------------
def vllm_worker(spec_path: Path) -> None:
    """Build `vllm.LLM` (eager, or compiled where the spec says so; engine core in this process),
    then per batch size: add the requests, step to their first tokens, warm up, time steps,
    profile steps. One JSON line out."""
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    spec = json.loads(spec_path.read_text())
    compiled = spec.get("compiled", False)
    llm = LLM(
        model=spec["model"],
        skip_tokenizer_init=True,
        dtype=spec.get("dtype", "float32"),
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=max(spec["batches"]),
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        enable_prefix_caching=False,
        enforce_eager=not compiled,
        seed=0,
    )
    engine = llm.llm_engine
    # each projection's shape -> its component, from the minivllm side (no minivllm here)
    shapes = {(n_out, n_in): name for n_out, n_in, name in spec["matmul_shapes"]}
    patches = vllm_patches(shapes, host_only=compiled)
    results = {}
    for batch in spec["batches"]:
        prompts = spec["prompts"][str(batch)]
        total = max_tokens_for(prompts, spec["warmup"], spec["steps"])
        params = SamplingParams(
            temperature=0.0, max_tokens=total, ignore_eos=True, detokenize=False
        )
        ids = [f"{batch}-{i}" for i in range(len(prompts))]
        for request_id, prompt in zip(ids, prompts):
            engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
        generated = to_decode(engine.step, ids, spec["warmup"])
        context = context_tokens(prompts, generated, ids, spec["steps"])
        wall, profiled = timed_and_profiled(engine.step, spec["steps"], patches)
        engine.abort_request(ids)
        while engine.has_unfinished_requests():
            engine.step()
        results[str(batch)] = {"wall_ms": wall, "profiled": profiled, "context_sum": context}
    vconfig = engine.vllm_config
    out = {
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "block_size": vconfig.cache_config.block_size,
        "async_scheduling": getattr(vconfig.scheduler_config, "async_scheduling", None),
        "compilation_mode": getattr(
            getattr(vconfig.compilation_config, "mode", None), "name", None
        ),
        "results": results,
    }
    print(MARKER + json.dumps(out), flush=True)


def vllm_patches(shapes: dict[tuple[int, int], str], host_only: bool = False) -> list:
    """Ranges around vLLM's scheduler, runner and layers (eager modules: `forward` of each class
    that defines one). `host_only`: the scheduler's and runner's alone, for a compiled forward --
    a module's `forward` changed under a compiled graph fails its guards, and it compiles again."""
    from vllm.model_executor.layers import activation, layernorm, linear, logits_processor
    from vllm.model_executor.layers.attention import attention
    from vllm.model_executor.layers.rotary_embedding import base as rotary
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    def by_shape(function):
        from torch.profiler import record_function

        def inner(self, *args, **kwargs):
            name = shapes.get((self.output_size, self.input_size), "other ops")
            with record_function(PREFIX + name):
                return function(self, *args, **kwargs)

        return inner

    patches = [
        (Scheduler, "schedule", ranged("schedule")),
        (Scheduler, "update_from_output", ranged("update")),
        (GPUModelRunner, "execute_model", ranged("batch build")),  # its rest: input prep
        (GPUModelRunner, "sample_tokens", ranged("sampling")),
    ]
    if host_only:
        return patches
    patches += [
        (logits_processor.LogitsProcessor, "forward", ranged("LM head")),
        (attention.Attention, "forward", ranged("attention")),
        (layernorm.RMSNorm, "forward", ranged("norms")),
        (rotary.RotaryEmbedding, "forward", ranged("RoPE")),
        (activation.SiluAndMul, "forward", ranged("SiLU*mul")),
    ]
    for cls in (
        linear.ColumnParallelLinear,
        linear.MergedColumnParallelLinear,
        linear.QKVParallelLinear,
        linear.RowParallelLinear,
    ):
        if "forward" in vars(cls):
            patches.append((cls, "forward", lambda f: by_shape(f)))
    return patches


def run_vllm(
    python: str, spec: dict, threads: int, timeout: float, passive: bool, compiled: bool = False
) -> dict:
    """One vLLM process: every batch size, timed and profiled. `passive`: OpenMP's idle threads
    sleep at once (vLLM's recommended setting) instead of libgomp's default spin-then-sleep.
    `compiled`: its forward compiled by inductor, as vLLM runs by default (and vllm_peer.py)."""
    spec = {**spec, "compiled": compiled}
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_bind(threads))
    # room for every sequence of the largest batch at the longest context, as minivllm has
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(spec.get("kv_cache_gib", 1)))
    env["OMP_NUM_THREADS"] = str(threads)
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    env["VLLM_CUSTOM_SCOPES_FOR_PROFILING"] = "1"
    # vLLM as it ships, or with its recommended passive threads (see vllm_peer.vllm_thread_policy):
    # never with a spin count exported for minivllm
    env.pop("GOMP_SPINCOUNT", None)
    if passive:
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    else:
        env.pop("OMP_WAIT_POLICY", None)
    env.pop("PYTHONPATH", None)
    env.pop("VIRTUAL_ENV", None)
    with tempfile.TemporaryDirectory() as tmp:
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        command = [python, str(Path(__file__).resolve()), "--worker", "vllm"]
        command += ["--spec", str(spec_path)]
        done = run_as_group(command, timeout, cwd=ROOT, env=env)
    found = [line for line in done.stdout.splitlines() if line.startswith(MARKER)]
    if done.returncode != 0 or not found:
        tail = "\n".join((done.stdout + "\n" + done.stderr).splitlines()[-40:])
        raise RuntimeError(f"vLLM worker failed (exit {done.returncode}):\n{tail}")
    return json.loads(found[-1][len(MARKER) :])


# -- the minivllm side -----------------------------------------------------------------------------
def minivllm_run(model, prompts_by_batch: dict[str, list[list[int]]], warmup: int, steps: int):
    """minivllm's engine, per batch size as the vLLM worker does it."""
    import torch.nn.functional as F

    from minivllm.book.roofline import matmul_names, model_dims
    from minivllm.engine.config import EngineConfig
    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.model import cpu_kernels, families, fused, transformer
    from minivllm.runner import model_runner
    from minivllm.runner.sampler import SamplingMetadata
    from minivllm.sched.scheduler import SchedulerConfig
    from minivllm.sched.sequence import SamplingParams

    shapes = matmul_names(model_dims(model))
    results = {}
    for key, prompts in prompts_by_batch.items():
        batch = int(key)
        config = EngineConfig(
            num_blocks=max(256, batch * (MAX_MODEL_LEN // 16 + 1)),
            scheduler=SchedulerConfig(
                max_num_seqs=batch, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS
            ),
            dtype=next(model.parameters()).dtype,
            device="cpu",  # the CPU step, also on a machine with a GPU
        )
        engine = LLMEngine(model, config)
        total = max_tokens_for(prompts, warmup, steps)
        params = SamplingParams(max_tokens=total, temperature=0.0, ignore_eos=True)
        ids = [engine.add_request(p, params) for p in prompts]
        generated = to_decode(engine.step, ids, warmup)
        context = context_tokens(prompts, generated, ids, steps)
        runner = engine.runner

        def linear(function):
            from torch.profiler import record_function

            def inner(x, weight, bias=None):
                with record_function(PREFIX + shapes.get(tuple(weight.shape), "other ops")):
                    return function(x, weight, bias)

            return inner

        def backend(factory):
            def make(storage, batch_):
                with torch_range("batch build"):
                    attend = factory(storage, batch_)
                return ranged("attention")(attend)

            return make

        patches = [
            (engine.scheduler, "schedule", ranged("schedule")),
            (engine.scheduler, "update", ranged("update")),
            (SamplingMetadata, "from_sequences", lambda f: staticmethod(ranged("batch build")(f))),
            (model_runner, "build_batch", ranged("batch build")),
            (runner, "forward", ranged("forward")),
            (runner, "backend", backend),
            (model_runner, "_set_aside_undrawable", ranged("sampling")),
            (runner, "sample", ranged("sampling")),
            (engine.outputs, "detokenize", ranged("output processing")),
            (engine.outputs, "output", ranged("output processing")),
            (engine, "_record", ranged("output processing")),
            (F, "linear", linear),
            (fused, "_packed_linear", linear),  # a weight the engine packed (oneDNN's layout)
            (transformer.RMSNorm, "forward", ranged("norms")),
            (fused.FusedRMSNorm, "forward", ranged("norms")),  # the engine's (torch's one op)
            (fused, "apply_rope", ranged("RoPE")),
            (cpu_kernels, "rope_qk", ranged("RoPE")),  # the engine's on the CPU in float32
            (transformer, "rope_cos_sin", ranged("RoPE")),
            # a Hugging Face checkpoint's model (HFTransformer): its norms, in bfloat16 too
            (families.HFRMSNorm, "forward", ranged("norms")),
            (fused.FusedHFRMSNorm, "forward", ranged("norms")),
            (cpu_kernels, "rope_qk_bfloat16", ranged("RoPE")),
            (families.HFTransformer, "rope_cos_sin", ranged("RoPE")),
        ]
        wall, profiled = timed_and_profiled(engine.step, steps, patches)
        for i in ids:
            engine.abort(i)
        results[key] = {"wall_ms": wall, "profiled": profiled, "context_sum": context}
    return results


@contextlib.contextmanager
def torch_range(name: str):
    from torch.profiler import record_function

    with record_function(PREFIX + name):
        yield


# -- the machine's limits and each component's floor -----------------------------------------------
def measure_machine(config: dict, batches: list[int], dtype: str = "float32") -> dict:
    """`measure_limits` at full size (float32 copy and add of 64 Mi elements, a 2048^3 GEMM), and
    this model's gate/up GEMM at each batch size: the machine's limits, as this process sees them
    with its threads. In bfloat16 the GEMMs are bfloat16's, and `gemm_2048_GFLOPs` the bfloat16
    GEMM's (the float32 one kept beside it): the matmul peak the engines can reach."""
    import torch

    from minivllm.book.roofline import best_seconds, measure_limits

    limits = measure_limits(elements=64 * 2**20, gemm_size=2048)
    kind = getattr(torch, dtype)
    if kind != torch.float32:
        x, w = (torch.rand(2048, 2048, dtype=kind) for _ in range(2))
        seconds = best_seconds(lambda: torch.mm(x, w), 3)
        limits["gemm_2048_float32_GFLOPs"] = limits["gemm_2048_GFLOPs"]
        limits["gemm_2048_GFLOPs"] = round(2 * 2048**3 / seconds / 1e9, 2)
    d, ff = config["hidden_size"], config["intermediate_size"]
    weight = torch.rand(2 * ff, d, dtype=kind)
    small = {}
    calls = max(5, min(200, 2**26 // (d * ff)))  # fewer calls of a real model's larger weight
    for m in batches:
        inputs = torch.rand(m, d, dtype=kind)
        seconds = best_seconds(
            lambda x=inputs, n=calls: [torch.nn.functional.linear(x, weight) for _ in range(n)], 3
        )
        small[str(m)] = round(2 * m * d * 2 * ff * calls / seconds / 1e9, 2)
    return {
        **limits,
        "small_m_gemm_GFLOPs": {
            "shape": f"[M, {d}] x [{d}, {2 * ff}] (the gate/up projection, {dtype}), M = batch",
            **small,
        },
    }


def best_limits(a: dict, b: dict) -> dict:
    """Each limit's higher reading of two measurements (nested dicts likewise)."""
    return {
        k: best_limits(v, b[k]) if isinstance(v, dict) else max(v, b[k]) if v != b[k] else v
        for k, v in a.items()
    }


# -- the report ------------------------------------------------------------------------------------
def median_of(steps: list[dict[str, float]], key: str) -> float:
    return statistics.median(s.get(key, 0.0) for s in steps)


def table(
    engine: str,
    batch: int,
    record: dict,
    limits: dict,
    config: dict,
    context_sum: float,
    element_bytes: int = 4,
):
    """The rows of one engine at one batch size: measured ms (median over profiled steps),
    roofline ms, ratio. `element_bytes`: of the dtype the engines compute in."""
    from minivllm.book.roofline import floor_seconds, floors

    steps = record["profiled"]
    bandwidth, peak = limits["bandwidth_GBps"], limits["gemm_2048_GFLOPs"]
    floor = floors(config, batch, context_sum, element_bytes)
    rows = []
    for component in COMPONENTS:
        measured = median_of(steps, component)
        if component in floor:
            bytes_, flops = floor[component]
            roof = floor_seconds(bytes_, flops, bandwidth, peak) * 1e3
        else:
            bytes_ = flops = roof = None
        rows.append(
            {
                "component": component,
                "measured_ms": round(measured, 4),
                "roofline_ms": None if roof is None else round(roof, 5),
                "ratio": None if not roof else round(measured / roof, 1),
                "bytes": bytes_,
                "flops": flops,
            }
        )
    roof_total = sum(r["roofline_ms"] or 0.0 for r in rows)
    # the same floor were every byte read at the cache-resident copy's speed (JSON only)
    cache_bandwidth = limits["cache_copy_GBps"]
    roof_cache = 1e3 * sum(floor_seconds(b, f, cache_bandwidth, peak) for b, f in floor.values())
    profiled = median_of(steps, "step (profiled)")
    wall = statistics.median(record["wall_ms"])
    rows.append(
        {
            "component": "step (profiled)",
            "measured_ms": round(profiled, 4),
            "roofline_ms": round(roof_total, 5),
            "ratio": round(profiled / roof_total, 1),
            "roofline_ms_at_cache_bandwidth": round(roof_cache, 5),
            "context_tokens_per_sequence": round(context_sum / batch, 1),
        }
    )
    rows.append(
        {
            "component": "step (wall, no profiler)",
            "measured_ms": round(wall, 4),
            "roofline_ms": round(roof_total, 5),
            "ratio": round(wall / roof_total, 1),
            "roofline_ms_at_cache_bandwidth": round(roof_cache, 5),
        }
    )
    return rows


def print_table(title: str, rows: list[dict]) -> None:
    print(f"\n{title}")
    print(f"| {'component':<26} | {'measured ms':>11} | {'roofline ms':>11} | {'ratio':>8} |")
    print(f"|{'-' * 28}|{'-' * 13}|{'-' * 13}|{'-' * 10}|")
    for r in rows:
        roof = "-" if r["roofline_ms"] is None else f"{r['roofline_ms']:.4f}"
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.1f}x"
        print(f"| {r['component']:<26} | {r['measured_ms']:>11.3f} | {roof:>11} | {ratio:>8} |")


# vLLM adds the residual inside its norm: the two engines compare on their sum. Against a compiled
# vLLM, whose graph fuses those ops and whose matmuls are not told apart, on coarser sums.
MERGED = "norms + residual adds"
MERGED_PARTS = {MERGED: ["norms", "residual adds"]}
COARSE_PARTS = {
    "matmuls": [*MATMULS, GRAPH_MATMULS],
    "elementwise (norms, adds, RoPE, SiLU*mul)": [
        "norms",
        "residual adds",
        "RoPE",
        "SiLU*mul",
        GRAPH,
    ],
}
TOTALS = ("step (profiled)", "step (wall, no profiler)")


def compared(rows: list[dict], coarse: bool = False) -> dict[str, float]:
    """An engine's measured ms by component, norms and residual adds as one -- or, `coarse`, every
    matmul as one and every elementwise op as one (against a compiled engine)."""
    ms = {r["component"]: r["measured_ms"] for r in rows}
    if ms:
        for merged, parts in (COARSE_PARTS if coarse else MERGED_PARTS).items():
            ms[merged] = sum(ms.pop(part, 0.0) for part in parts)
    return ms


def findings(tables: dict[str, dict[str, list[dict]]]) -> list[str]:
    """What the tables say, in sentences built from their numbers."""
    lines = []
    for batch, engines in tables.items():
        for engine, rows in engines.items():
            parts = [r for r in rows if r["component"] in COMPONENTS]
            total = next(r for r in rows if r["component"] == "step (profiled)")
            excess = sorted(
                parts, key=lambda r: r["measured_ms"] - (r["roofline_ms"] or 0), reverse=True
            )[:3]
            far = sorted((r for r in parts if r["ratio"]), key=lambda r: r["ratio"], reverse=True)
            host = sum(r["measured_ms"] for r in parts if r["component"] in HOST)
            fixed = host + sum(
                r["measured_ms"] for r in parts if r["component"] == "forward: Python and gaps"
            )
            wall = next(r for r in rows if r["component"] == "step (wall, no profiler)")
            lines.append(
                f"batch {batch}, {engine}: profiled step {total['measured_ms']:.2f} ms against a "
                f"roofline of {total['roofline_ms']:.3f} ms ({total['ratio']:.0f}x); most time "
                "above the floor: "
                + ", ".join(
                    f"{r['component']} {r['measured_ms'] - (r['roofline_ms'] or 0):.2f} ms"
                    for r in excess
                )
                + f"; host work {host:.2f} ms ({100 * host / total['measured_ms']:.0f}%), and "
                f"with the forward's Python {fixed:.2f} ms "
                f"({100 * fixed / total['measured_ms']:.0f}%); "
                "farthest from its roofline: "
                + ", ".join(f"{r['component']} {r['ratio']:.0f}x" for r in far[:3])
                + f"; unprofiled, the step takes {wall['measured_ms']:.2f} ms "
                f"({wall['ratio']:.1f}x its roofline)"
            )
        peers = [e for e in engines if e.startswith("vllm")]
        if "minivllm" not in engines:
            peers = []
        for peer in peers:
            coarse = peer == "vllm-compiled"
            mine, theirs = compared(engines["minivllm"], coarse), compared(engines[peer], coarse)
            parts = [c for c in mine if c in theirs and c not in TOTALS]
            faster = sorted(
                (c for c in parts if theirs[c] < mine[c]),
                key=lambda c: mine[c] - theirs[c],
                reverse=True,
            )
            slower = sorted(
                (c for c in parts if theirs[c] > mine[c]),
                key=lambda c: theirs[c] - mine[c],
                reverse=True,
            )
            totals = (("profiled", "step (profiled)"), ("wall", "step (wall, no profiler)"))
            for label, key in totals:
                lines.append(
                    f"batch {batch}: minivllm / {peer} step time ({label}) "
                    f"{mine[key]:.2f} / {theirs[key]:.2f} ms = {mine[key] / theirs[key]:.2f}"
                )
            lines.append(
                f"batch {batch}: {peer} is faster at "
                + (
                    ", ".join(f"{c} (by {mine[c] - theirs[c]:.2f} ms)" for c in faster[:4])
                    or "nothing"
                )
                + "; minivllm is faster at "
                + (
                    ", ".join(f"{c} (by {theirs[c] - mine[c]:.2f} ms)" for c in slower[:4])
                    or "nothing"
                )
            )
    return lines


def load_note(runs: list[dict], limits: dict, cpus: int) -> str:
    """How busy the machine was while the engines ran (1-minute load averages), and how far apart
    the two readings of its limits were: on a shared machine, context for every number above."""
    loads = [float(r[k].split()[0]) for r in runs for k in ("load_before", "load_after")]
    start, end = limits["start"], limits["end"]
    spread = ", ".join(
        f"{k} {start[k]:.1f} / {end[k]:.1f}"
        for k in ("bandwidth_GBps", "cache_copy_GBps", "gemm_2048_GFLOPs")
    )
    busy = max(loads) > cpus
    return (
        f"load average (1 min) {min(loads):.1f}-{max(loads):.1f} on {cpus} CPUs while the engines "
        f"ran{': oversubscribed, so these times hold contention as well as work' if busy else ''};"
        f" the limits read at the start / end: {spread}"
    )


def report(path: Path) -> int:
    """The tables of a results file printed again, and what they say recomputed into it."""
    data = json.loads(path.read_text())
    for batch, engines in data["tables"].items():
        for engine, rows in engines.items():
            print_table(f"batch {batch}, {engine}", rows)
    cpus = data["machine"]["cpus"]
    data["what_the_table_says"] = [load_note(data["runs"], data["limits"], cpus)]
    data["what_the_table_says"] += findings(data["tables"])
    print("\nwhat the table says:")
    for line in data["what_the_table_says"]:
        print(f"  {line}")
    path.write_text(json.dumps(data, indent=2) + "\n")
    return 0


def lscpu_record() -> dict:
    import subprocess

    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return {}
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    wanted = ("Model name", "CPU(s)", "Thread(s) per core", "L2 cache", "L3 cache", "Flags")
    return {k: fields[k] for k in wanted if k in fields}


def main() -> int:
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 16, 64])
    parser.add_argument("--steps", type=int, default=8, help="decode steps timed, then profiled")
    parser.add_argument("--warmup", type=int, default=3, help="decode steps before the timed ones")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of vLLM, minivllm")
    parser.add_argument(
        "--engines",
        nargs="+",
        choices=ENGINES,
        default=ENGINES,
        help="vllm: as it ships (libgomp's spinning idle threads), eager; vllm-passive: with "
        "OMP_WAIT_POLICY=PASSIVE (vLLM's recommended setting); vllm-compiled: as it ships, its "
        "forward compiled (vLLM's default, and vllm_peer.py's)",
    )
    parser.add_argument(
        "--vllm-python", default=os.environ.get("VLLM_PEER_PYTHON", DEFAULT_VLLM_PYTHON)
    )
    parser.add_argument("--threads", type=int, default=THREADS)
    parser.add_argument("--vllm-timeout", type=float, default=900.0)
    parser.add_argument(
        "--checkpoint",
        type=Path,
        default=TARGET,
        help="a Hugging Face checkpoint folder both engines load (default: the shipped target "
        "model)",
    )
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="what both engines compute in, the model and the K/V cache (default %(default)s)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--report",
        action="store_true",
        help="measure nothing: print the tables of --out again and recompute what they say",
    )
    parser.add_argument("--worker", choices=["vllm"], help=argparse.SUPPRESS)
    parser.add_argument("--spec", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "vllm":
        vllm_worker(args.spec)
        return 0
    if args.report:
        return report(args.out)
    # minivllm came in with vllm_peer's _common, before torch: its thread policy holds
    import torch
    from _common import machine_record, make_workload, write_results

    from minivllm.book.roofline import matmul_names, model_dims
    from minivllm.model.checkpoint import load_model
    from minivllm.model.fused import fuse_model

    engines = args.engines
    if not os.access(args.vllm_python, os.X_OK) and engines != ["minivllm"]:
        print(f"no vLLM at {args.vllm_python}: profiling minivllm alone")
        engines = ["minivllm"]
    load_before = load_str()
    torch.set_num_threads(args.threads)
    model = fuse_model(load_model(args.checkpoint, args.dtype), in_place=True)
    config = model_dims(model)
    element_bytes = next(model.parameters()).element_size()
    name = "target model" if args.checkpoint == TARGET else str(args.checkpoint)
    prompts = {str(b): [r.prompt_ids for r in make_workload(b, SEED)] for b in args.batches}
    print(
        f"{name}, {args.dtype}, batches {args.batches}, {args.warmup} warm-up + {args.steps} "
        f"timed + {args.steps} profiled decode steps, {args.rounds} rounds of {engines}; "
        f"{args.threads} threads; load average {load_before}",
        flush=True,
    )
    limits_start = measure_machine(config, args.batches, args.dtype)
    print(f"machine limits at the start: {limits_start}", flush=True)
    readings = [limits_start]

    kv_bytes = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"]
    kv_bytes *= element_bytes * max(args.batches) * MAX_MODEL_LEN
    spec = {
        "model": str(args.checkpoint),
        "dtype": args.dtype,
        "kv_cache_gib": max(1, -(-kv_bytes // 2**30)),
        "batches": args.batches,
        "warmup": args.warmup,
        "steps": args.steps,
        "prompts": prompts,
        "matmul_shapes": [
            [n_out, n_in, name] for (n_out, n_in), name in matmul_names(config).items()
        ],
    }
    records: dict[str, dict[str, list]] = {e: {} for e in engines}
    runs, vllm_meta = [], {}
    for round_ in range(args.rounds):
        for engine in engines:
            before, started = load_str(), time.perf_counter()
            if engine.startswith("vllm"):
                passive, compiled = engine == "vllm-passive", engine == "vllm-compiled"
                got = run_vllm(
                    args.vllm_python, spec, args.threads, args.vllm_timeout, passive, compiled
                )
                results = got.pop("results")
                vllm_meta = got
            else:
                results = minivllm_run(model, prompts, args.warmup, args.steps)
            runs.append(
                {
                    "round": round_ + 1,
                    "engine": engine,
                    "seconds": round(time.perf_counter() - started, 1),
                    "load_before": before,
                    "load_after": load_str(),
                    "step_wall_ms_median": {
                        b: round(statistics.median(r["wall_ms"]), 3) for b, r in results.items()
                    },
                }
            )
            print(f"  round {round_ + 1}: {engine}: {runs[-1]}", flush=True)
            for b, r in results.items():
                pooled = records[engine].setdefault(
                    b, {"wall_ms": [], "profiled": [], "context_sum": []}
                )
                pooled["wall_ms"] += r["wall_ms"]
                pooled["profiled"] += r["profiled"]
                pooled["context_sum"].append(r["context_sum"])
        # measured again after every round: the machine is shared, a limit is the best seen
        readings.append(measure_machine(config, args.batches, args.dtype))
        print(f"machine limits after round {round_ + 1}: {readings[-1]}", flush=True)

    limits_end = readings[-1]
    limits = functools.reduce(best_limits, readings)
    print(f"machine limits used (the best of {len(readings)} readings): {limits}", flush=True)

    tables: dict[str, dict[str, list[dict]]] = {}
    for b in map(str, args.batches):
        tables[b] = {}
        for engine in engines:
            # the tokens its requests attend at a profiled step (an engine's prefill chunks may
            # give the first requests a few more tokens than the other's did)
            context_sum = statistics.median(records[engine][b]["context_sum"])
            rows = table(
                engine, int(b), records[engine][b], limits, config, context_sum, element_bytes
            )
            tables[b][engine] = rows
            print_table(
                f"batch {b}, {engine} (median of {len(records[engine][b]['profiled'])} profiled "
                f"steps; context {context_sum / int(b):.0f} tokens per sequence on average)",
                rows,
            )
    said = [load_note(runs, {"start": limits_start, "end": limits_end}, os.cpu_count() or 1)]
    said += findings(tables)
    print("\nwhat the table says:")
    for line in said:
        print(f"  {line}")
    load_after = load_str()
    print(f"\nload average {load_before} before, {load_after} after ({os.cpu_count()} CPUs)")

    write_results(
        args.out,
        {
            "benchmark": "step_profile",
            "machine": machine_record(
                "torch.profiler on a shared 2-core machine: the profiler's own cost per op "
                "inflates every forward component (compare 'step (profiled)' with 'step "
                "(wall, no profiler)'); medians over every profiled step of every round",
                lscpu=lscpu_record(),
                load_average_before=load_before,
                vllm=vllm_meta or None,
            ),
            "limits": {
                "used": limits,
                "start": limits_start,
                "end": limits_end,
                "readings": readings,
            },
            "workload": {
                "model": str(
                    args.checkpoint.relative_to(ROOT)
                    if args.checkpoint.is_relative_to(ROOT)
                    else args.checkpoint
                ),
                "model_config": config,
                "dtype": args.dtype,
                "seed": SEED,
                "batches": args.batches,
                "prompt_tokens": {b: [len(p) for p in ps] for b, ps in prompts.items()},
                "warmup_steps": args.warmup,
                "timed_steps": args.steps,
                "profiled_steps": args.steps,
                "rounds": args.rounds,
                "order": "alternating per round: " + ", ".join(engines),
                "vllm_settings": "enforce_eager (vllm-compiled: not), "
                "VLLM_ENABLE_V1_MULTIPROCESSING=0, "
                "VLLM_CUSTOM_SCOPES_FOR_PROFILING=1, skip_tokenizer_init (no detokenizing: "
                "the shipped model has no tokenizer files; minivllm detokenizes bytes)",
            },
            "runs": runs,
            "tables": tables,
            "what_the_table_says": said,
            "load_average": {"before": load_before, "after": load_after},
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
