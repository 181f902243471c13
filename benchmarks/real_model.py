"""A real-shaped model: minivllm against Hugging Face `generate` and vLLM's CPU build (issue 29).

    python benchmarks/real_model.py [--shape 100m|qwen3-0.6b|tiny] [--dtype float32|bfloat16]
    [--checkpoint-dtype bfloat16] [--dir DIR] [--requests 8] [--seed 0] [--repeats 3]
    [--vllm-modes compiled eager] [--compiled] [--vllm-python PATH] [--memory-baseline-src DIR]
    [--skip-hf] [--skip-vllm] [--skip-memory] [--quick] [--out PATH]

The checkpoint. `make_checkpoint(folder, shape, dtype)` builds a Hugging Face Qwen3 folder with
`transformers` (a `Qwen3Config` of the shape's sizes, seeded random weights, `save_pretrained` in
bfloat16 unless asked) and a byte-level BPE tokenizer trained with `tokenizers` on the shipped
validation plays (8192 tokens: tokenizer.json, tokenizer_config.json), once: the folder under
`--dir` (default: the system's temp folder) is reused while the recipe it records matches.
`--shape qwen3-0.6b` is Qwen3-0.6B's config; the default `100m` is the same family at ~110 M
parameters, because on this 2-core machine the 0.6 B model takes minutes per system and round
(its own run: `--shape qwen3-0.6b`, results/real_model_qwen3-0.6b.json); `tiny` is for `--quick`.
Random weights make flat logits; here the embedding (and so the tied LM head) rows of the
tokenizer's tokens are drawn larger and the rest near zero, so greedy choices are seldom near-ties
and the model writes tokens the tokenizer decodes (the JSON records the logits' spread and the
smallest top-two gap of one prompt).
benchmarks/gpu_engine.py can build the same folder on a GPU machine with `make_checkpoint`.

The workload. `--requests` prompts cut from the validation plays as the checkpoint's tokenizer
encodes them, of a seeded uniform number of tokens, each with a seeded uniform output length;
greedy, `ignore_eos`, in `--dtype` (float32 by default: a CPU without bfloat16 arithmetic -- no
AVX-512 BF16, no AMX, as the Intel machine this was first run on -- emulates bfloat16 matmuls, in
every system; where the machine JSON's flags show `avx512_bf16` or `amx_bf16`, `--dtype bfloat16`
is the comparison to make too). Run by

* minivllm: `LLMEngine` on the default attention backend ("auto": the numba kernel for a float32
  or bfloat16 cache, the torch reference otherwise) and on the torch reference, both on one loaded
  model (fused in place once), 64 sequences and 512 tokens per step, the folder's tokenizer
  detokenizing as it goes. Every request is added, then `step()` runs until none is left. With
  `--compiled`, also on the default backend with `compile_forward` (the forward under
  torch.compile, as vLLM's default mode runs it), compiled as the engine starts (not timed);
* Hugging Face `generate` (`AutoModelForCausalLM`, the same dtype): every request in one batch,
  left padding, greedy, run to the longest request's max_tokens (only each request's own tokens
  count: a static batch pays for the longest). Every request's first token comes with the
  first step, when a stopping criterion sees it;
* vLLM's CPU build, where its virtualenv exists (benchmarks/vllm_peer.py says how to build one):
  the same folder, prompts as token ids, the same dtype, sequences and tokens per step, prefix
  caching off, detokenizing, its own tokenizer loaded from the folder; in a fresh process per run
  (start-up and warm-up not timed), `--vllm-modes` compiled (its default) and eager.

Output tokens/s is every request's output tokens over the wall clock from the first request added
to the last token; time to first token (TTFT) is, per request, from that same start to the step
that returned its first token (so it includes waiting behind other prompts' prefill). The systems
alternate for `--repeats` rounds after a warm-up; the table gives the median tokens/s (and the
best round), TTFT's median and 90th percentile over every request of every round, and the ratios
of medians. Every request arrives at the start, so the run splits in two where the last request's
first token comes: the prefill phase (every prompt's prefill, and the decodes of requests already
started, in the same steps) and the decode phase after it; each run's two times, and their
medians, are in the JSON (`last_first_token_s`, `after_last_first_token_s`): where one system is
slower, they say whether it is in the prompts or in the decoding. Each minivllm run also records
how many of its passes ran on fewer threads than torch has because other processes kept the
cores busy (`core_watch`, as vllm_peer.py records it: its threads spin, so it watches its
cores). Greedy tokens are compared between every pair of systems (first round): identical
sequences, and where each other one first differs.

Loading memory, each case in a fresh interpreter: ru_maxrss after the load less ru_maxrss of the
interpreter with torch (and minivllm) imported, over the weights' bytes in the dtype loaded, for
the bfloat16 checkpoint loaded as bfloat16 and as float32, by `load_model` alone and by
`LLM(folder)`'s whole start (load, fuse, a 16-block K/V cache, the torch backend: no kernel
compilation in the number). `--memory-baseline-src` measures another checkout's src/ beside this
one (a before/after). The goal: at most 1.2x the weights, no second copy.

Prints tables and writes benchmarks/results/real_model.json with the CPU model and the load
average (a --quick smoke run -- the tiny shape, three short requests, one round, no vLLM --
writes nothing unless --out is given).
"""

from __future__ import annotations

import minivllm  # noqa: F401 -- before torch: it sets OMP_WAIT_POLICY, read as torch loads

# isort: split
import argparse
import copy
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from _common import (
    Request,
    core_watch_record,
    cpu_model,
    load_str,
    machine_record,
    print_run,
    write_results,
)
from vllm_peer import DEFAULT_VLLM_PYTHON, run_vllm, write_workload

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"
RESULTS = Path(__file__).parent / "results" / "real_model.json"
THREADS = 2
MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS = 64, 512  # minivllm's defaults, given to vLLM too
MAX_MODEL_LEN = 512  # vLLM's context: the longest prompt and output fit
PROMPT_TOKENS, OUTPUT_TOKENS = (32, 320), (16, 96)  # uniform, per request
VLLM_TIMEOUT = 1800.0  # seconds for one vLLM run (start-up, compilation, warm-up, the run)
DEFAULT_SHAPE, DEFAULT_DTYPE = "100m", "float32"

TOKENIZER_VOCAB = 8192  # a byte-level BPE trained on the shipped validation text (~190 kB)
# Real shapes. qwen3-0.6b is Qwen3-0.6B's config.json (hidden 1024, 28 layers, 16 query and 8 K/V
# heads of 128, MLP 3072, a 151936-token vocabulary, LM head tied to the embedding); 100m is the
# same family at about 110 M parameters (heads of 128, GQA 2:1, tied, a 32768-token vocabulary),
# the default: on 2 shared cores the 0.6 B model takes minutes per system per round.
SHAPES = {
    "qwen3-0.6b": dict(
        hidden_size=1024,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=3072,
        vocab_size=151936,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
    # the --quick smoke run's: Qwen3's layout at a size that builds and runs in seconds
    "tiny": dict(
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # vLLM's CPU attention takes no smaller head
        intermediate_size=256,
        vocab_size=TOKENIZER_VOCAB + 64,
        max_position_embeddings=4096,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
    "100m": dict(
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=128,
        intermediate_size=2048,
        vocab_size=32768,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
BUILDER_VERSION = 1  # bump when make_checkpoint would build something else: the cache is rebuilt
MARKER = "minivllm_benchmark.json"  # what the cached folder was built as
END_OF_TEXT = "<|endoftext|>"
# The random model's logit scale: with the embedding rows of the tokenizer's vocabulary drawn at
# this standard deviation, the tied LM head's logits spread over several units (see `logit_spread`)
EMBED_STD = 0.1
DEFAULT_DIR = Path(tempfile.gettempdir()) / "minivllm-real-model"


def train_tokenizer(vocab_size: int = TOKENIZER_VOCAB):
    """A byte-level BPE (GPT-2's and Qwen's kind: every string encodes, and a multi-byte character
    may span tokens) trained with `tokenizers` on the shipped validation plays, by the book's own
    builder (chapter 10's)."""
    from minivllm.book.tiny_checkpoint import train_bpe_tokenizer
    from minivllm.training.corpus import shipped_validation_text

    paragraphs = shipped_validation_text().split("\n\n")
    return train_bpe_tokenizer(paragraphs, vocab_size, [END_OF_TEXT])


def make_checkpoint(
    folder: str | Path, shape: str = "qwen3-0.6b", dtype: str = "bfloat16", seed: int = 0
) -> Path:
    """A Hugging Face Qwen3 checkpoint folder with `shape`'s real sizes and random weights in
    `dtype` (config.json, model.safetensors, generation_config.json, tokenizer.json,
    tokenizer_config.json), built once under `folder` and reused while its recorded recipe
    matches. Returns the checkpoint's folder.

    The weights are `transformers`' own initialisation (seeded), except the embedding (and so the
    tied LM head): the rows of the tokenizer's tokens at `EMBED_STD`, so greedy choices are rarely
    near-ties, and the rows past the tokenizer's vocabulary near zero, so a random model still
    writes text the tokenizer can decode (a real Qwen3 also has embedding rows no token uses). The
    model computes the full vocabulary's logits either way."""
    import transformers

    if shape not in SHAPES:
        raise ValueError(f"shape {shape!r} is not one of {', '.join(SHAPES)}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    recipe = {
        "builder": BUILDER_VERSION,
        "shape": shape,
        "config": SHAPES[shape],
        "dtype": dtype,
        "seed": seed,
    }
    path = Path(folder) / f"qwen3-{shape.removeprefix('qwen3-')}-{dtype}-seed{seed}"
    marker = path / MARKER
    if marker.exists() and json.loads(marker.read_text()) == recipe:
        return path
    if path.exists():  # half-built, or another recipe's: stale shards must not stay beside it
        shutil.rmtree(path)
    path.mkdir(parents=True)

    tokenizer = train_tokenizer()
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": END_OF_TEXT,
                "pad_token": END_OF_TEXT,
                "add_bos_token": False,  # Qwen's: no BOS
            },
            indent=2,
        )
    )
    config = transformers.Qwen3Config(
        **SHAPES[shape],
        bos_token_id=None,
        eos_token_id=None,  # greedy runs to max_tokens in every system
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM._from_config(config, dtype=DTYPES[dtype]).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        embed = model.model.embed_tokens.weight
        rows = tokenizer.get_vocab_size()
        embed[:rows] = torch.randn(embed[:rows].shape, generator=generator) * EMBED_STD
        embed[rows:] = torch.randn(embed[rows:].shape, generator=generator) * 1e-4
    model.save_pretrained(path)
    marker.write_text(json.dumps(recipe))
    return path


def logit_spread(model, prompt_ids: list[int], vocab: int) -> dict:
    """How far apart the random model's choices are, over one prompt's positions (medians): the
    standard deviation of the logits of the tokenizer's `vocab` tokens (the rest are near zero),
    and the gap between the top two."""
    with torch.no_grad():
        logits = model(torch.tensor(prompt_ids)).float()
    top = logits.topk(2, dim=-1).values
    gap = top[:, 0] - top[:, 1]
    return {
        "logit_std_median": round(logits[:, :vocab].std(dim=-1).median().item(), 3),
        "top2_gap_median": round(gap.median().item(), 3),
        "top2_gap_min": round(gap.min().item(), 4),
    }


# -- the workload ----------------------------------------------------------------------------------
def make_requests(
    tokenizer,
    num_requests: int,
    seed: int,
    prompt_tokens: tuple[int, int],
    output_tokens: tuple[int, int],
) -> list[Request]:
    """Seeded requests: a prompt of a uniform number of tokens, cut from the shipped validation text
    as the checkpoint's tokenizer encodes it, and a uniform output length."""
    from minivllm.training.corpus import shipped_validation_text

    ids = tokenizer.encode(shipped_validation_text())
    rng = np.random.default_rng(seed)
    requests = []
    for index in range(num_requests):
        length = int(rng.integers(prompt_tokens[0], prompt_tokens[1] + 1))
        start = int(rng.integers(0, len(ids) - length))
        prompt_ids = ids[start : start + length]
        max_tokens = int(rng.integers(output_tokens[0], output_tokens[1] + 1))
        requests.append(Request(index, tokenizer.decode(prompt_ids), prompt_ids, max_tokens))
    return requests


# -- the systems -----------------------------------------------------------------------------------
def warmed(run, warm: list[Request], requests: list[Request]):
    """A system's timed run: `run(requests)` right after `run(warm)`, whose result is dropped. The
    first pass pays for thread pools, allocator growth, a kernel's compilation; and every round
    warms up again, as each vLLM run does in its fresh process just before it is timed. An engine
    built once and left idle while the other systems ran had gone cold: on the book's VM (an AMD
    EPYC, Qwen3-0.6B's shape) minivllm's rounds after vLLM's took 23.0-24.0 s against 20.3-21.7 s
    for the round right after the one warm-up there was."""

    def timed() -> dict:
        run(warm)
        return run(requests)

    return timed


def run_engine(engine, requests: list[Request], label: str) -> dict:
    """All requests added at once, then `LLMEngine.step()` until none is left; each request's first
    token is timed when the step that made it returns (as vLLM's worker times its own)."""
    from minivllm.sched.sequence import SamplingParams

    load_before, watch = load_str(), core_watch_record()
    started = time.perf_counter()
    ids = [
        engine.add_request(
            r.prompt_ids, SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True)
        )
        for r in requests
    ]
    row = {request_id: i for i, request_id in enumerate(ids)}
    first_token: list[float | None] = [None] * len(requests)
    tokens: list[list[int]] = [[] for _ in requests]
    while engine.has_unfinished():
        for out in engine.step():
            i = row[out.request_id]
            if out.new_token_ids and first_token[i] is None:
                first_token[i] = time.perf_counter() - started
            tokens[i] = list(out.token_ids)
    seconds = time.perf_counter() - started
    watched = core_watch_record()  # passes given fewer threads: other processes held the cores
    return {
        "system": label,
        "seconds": seconds,
        "tokens": sum(map(len, tokens)),
        "load_before": load_before,
        "load_after": load_str(),
        "core_watch": {
            "watching": watched["watching"],
            **{k: watched[k] - watch[k] for k in ("passes", "narrowed")},
        },
        "_tokens": tokens,
        "_ttft": first_token,
    }


def run_hf(hf, requests: list[Request]) -> dict:
    """Hugging Face `generate`, greedy, every request in one batch (left padding), run to the
    longest request's max_tokens: each request's own first max_tokens count. Every request's first
    token comes back with the first step (a stopping criterion sees it)."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class FirstToken(StoppingCriteria):
        at: float | None = None

        def __call__(self, input_ids, scores, **kwargs):
            self.at = self.at or time.perf_counter()
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    width = max(len(r.prompt_ids) for r in requests)
    pad = [width - len(r.prompt_ids) for r in requests]
    input_ids = torch.tensor([[0] * n + r.prompt_ids for n, r in zip(pad, requests)])
    mask = torch.tensor([[0] * n + [1] * len(r.prompt_ids) for n, r in zip(pad, requests)])
    first = FirstToken()
    load_before = load_str()
    started = time.perf_counter()
    with torch.no_grad():
        out = hf.generate(
            input_ids=input_ids,
            attention_mask=mask,
            max_new_tokens=max(r.max_tokens for r in requests),
            do_sample=False,
            pad_token_id=0,
            stopping_criteria=StoppingCriteriaList([first]),
        )
    seconds = time.perf_counter() - started
    tokens = [out[i, width : width + r.max_tokens].tolist() for i, r in enumerate(requests)]
    return {
        "system": "Hugging Face generate (one batch)",
        "seconds": seconds,
        "tokens": sum(map(len, tokens)),
        "load_before": load_before,
        "load_after": load_str(),
        "_tokens": tokens,
        "_ttft": [first.at - started] * len(requests),
    }


# -- loading memory --------------------------------------------------------------------------------
MEMORY_PROBE = r"""
import json, resource, sys, time
import minivllm, torch  # the baseline: an interpreter that imported torch (and minivllm)
from minivllm.engine.llm_engine import LLM
from minivllm.model import fused
from minivllm.model.checkpoint import load_model

def status(field):  # VmRSS (resident now) or VmHWM (its peak), in bytes
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(field + ":"))

def reset_peak():
    # ru_maxrss (VmHWM) keeps the imports' transient peak, which can hide a small model's load:
    # writing 5 to clear_refs sets the peak back to what is resident now (Linux 4.0+)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False

def distinct_bytes(*models):  # what the models' tensors hold (a released weight holds nothing)
    tensors = [t for m in models for t in (*m.parameters(), *m.buffers()) if not t.is_meta]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())

def model_bytes(model):  # one model's weights, by their shapes, whatever holds them
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())

folder, dtype, what = sys.argv[1:4]
torch.set_num_threads(2)
# The first module built on the meta device (as load_model builds one) imports torch's Python
# meta kernels, tens of MB of code whatever the model's size: imported here, and reported apart.
before_import = status("VmRSS")
with torch.device("meta"):
    torch.nn.Embedding(1, 1)
meta_import = status("VmRSS") - before_import
reset = reset_peak()
base = status("VmHWM") if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
rss_base = status("VmRSS")
started = time.perf_counter()
if what == "load_model":
    model = load_model(folder, dtype)
    weights = held = distinct_bytes(model)
    kv_bytes = 0
else:  # the engine's start: LLM(folder) loads, places and fuses the model, makes the K/V cache
    llm = LLM(folder, dtype=dtype, num_blocks=16, attention_backend="torch", device="cpu")
    engine = llm.engine
    weights = model_bytes(engine.runner.model)  # the model the engine runs
    # all the engine keeps: its models' tensors and the weights packed for oneDNN (model/fused.py)
    # (an older src, --memory-baseline-src, kept (reference, version, packed) tuples in a dict)
    entries = fused._PACKED.values()
    packed = sum((e[2] if isinstance(e, tuple) else e).nbytes for e in entries)
    held = distinct_bytes(engine.model, engine.runner.model) + packed
    kv_bytes = engine.storage.bytes
seconds = time.perf_counter() - started
peak = status("VmHWM") if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({
    "peak_growth_bytes": peak - base,
    "peak_reset": reset,
    "meta_kernels_import_bytes": meta_import,
    "rss_growth_after_bytes": status("VmRSS") - rss_base,
    "weights_bytes": weights,
    "weights_held_bytes": held,
    "kv_cache_bytes": kv_bytes,
    "seconds": round(seconds, 2),
}))
"""


def measure_memory(folder: Path, dtype: str, what: str, src: Path) -> dict:
    """Peak resident memory of loading `folder` in `dtype` in a fresh interpreter whose minivllm
    comes from `src`: `load_model` alone, or `LLM(folder)`'s whole start ("engine"). The peak
    (ru_maxrss, as /proc's VmHWM, reset to the resident size once torch and minivllm are
    imported) after the load less the peak before, over the weights' bytes in `dtype` (one
    model's: the distinct storages of the model that runs). `weights_held_bytes` counts every
    weight the engine keeps: twice the weights where it keeps a copy. The one-time import of
    torch's meta kernels is measured apart (`with_import_over_weights` counts it too)."""
    env = dict(os.environ, PYTHONPATH=str(src), OMP_NUM_THREADS="2")
    done = subprocess.run(
        [sys.executable, "-c", MEMORY_PROBE, str(folder), dtype, what],
        capture_output=True,
        text=True,
        env=env,
    )
    if done.returncode != 0:
        raise RuntimeError(f"memory probe failed:\n{done.stderr[-2000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    weights, peak = result["weights_bytes"], result["peak_growth_bytes"]
    result["peak_over_weights"] = round(peak / weights, 3)
    result["with_import_over_weights"] = round(
        (peak + result["meta_kernels_import_bytes"]) / weights, 3
    )
    return result


def source_commit(src: Path) -> str | None:
    done = subprocess.run(
        ["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True, text=True
    )
    return done.stdout.strip() or None


# -- the report ------------------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=float), q))


def summarize(runs: list[dict]) -> dict:
    """A system's rounds: tokens/s (median, best), and time to first token over every request of
    every round (median, p90)."""
    rates = [r["tokens"] / r["seconds"] for r in runs]
    ttft = [t for r in runs for t in r["_ttft"] if t is not None]
    # the prefill phase ends with the last request's first token; the decode phase is the rest
    prefill = [max((t for t in r["_ttft"] if t is not None), default=None) for r in runs]
    decode = [None if p is None else r["seconds"] - p for r, p in zip(runs, prefill)]
    return {
        "system": runs[0]["system"],
        "tokens": runs[0]["tokens"],
        "repeats": len(runs),
        "median_seconds": round(statistics.median(r["seconds"] for r in runs), 3),
        "tokens_per_second_median": round(statistics.median(rates), 2),
        "tokens_per_second_best": round(max(rates), 2),
        "ttft_median_s": round(statistics.median(ttft), 3) if ttft else None,
        "ttft_p90_s": round(percentile(ttft, 90), 3) if ttft else None,
        "last_first_token_s_median": _median_of(prefill),
        "after_last_first_token_s_median": _median_of(decode),
        "runs": [
            {
                "seconds": round(r["seconds"], 3),
                "tokens_per_second": round(rate, 2),
                "load_before": r["load_before"],
                "load_after": r["load_after"],
                "last_first_token_s": None if first is None else round(first, 3),
                "after_last_first_token_s": None if rest is None else round(rest, 3),
                **({"startup_seconds": r["startup_seconds"]} if "startup_seconds" in r else {}),
                **({"core_watch": r["core_watch"]} if "core_watch" in r else {}),
            }
            for r, rate, first, rest in zip(runs, rates, prefill, decode)
        ],
    }


def _median_of(values: list[float | None]) -> float | None:
    """The median of the values that exist, rounded; None if none do."""
    known = [v for v in values if v is not None]
    return round(statistics.median(known), 3) if known else None


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """Identical greedy sequences, and where each other one first differs (request, position)."""
    differ = []
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            at = next((k for k, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
            differ.append({"request": i, "first_differing_position": at, "length": len(x)})
    return {"requests": len(a), "identical": len(a) - len(differ), "differ": differ}


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default=DEFAULT_SHAPE)
    parser.add_argument(
        "--checkpoint-dtype", choices=sorted(DTYPES), default="bfloat16", help="on disk"
    )
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=DEFAULT_DTYPE,
        help="what every system computes in (the model and the K/V cache); default %(default)s",
    )
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="where checkpoints are kept")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3, help="rounds over every system")
    parser.add_argument(
        "--data-parallel",
        type=int,
        default=1,
        help="with N > 1, also minivllm as N engine replicas (EngineConfig.data_parallel_size, "
        "each on THREADS / N threads, holding its own copy of the weights)",
    )
    parser.add_argument(
        "--compiled",
        action="store_true",
        help="also minivllm with EngineConfig(compile_forward=True) (the default backend): its "
        "forward under torch.compile, as vLLM's default mode runs; compiled as it starts",
    )
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument(
        "--vllm-modes",
        nargs="+",
        choices=["compiled", "eager", "compiled-passive", "compiled-spin"],
        default=["compiled", "eager"],
        help="as vllm_peer.py's (vllm_thread_policy: -passive, -spin)",
    )
    parser.add_argument(
        "--vllm-python",
        default=os.environ.get("VLLM_PEER_PYTHON", DEFAULT_VLLM_PYTHON),
        help="python of vLLM's virtualenv (env VLLM_PEER_PYTHON; default %(default)s)",
    )
    parser.add_argument(
        "--memory-baseline-src",
        type=Path,
        help="another checkout's src/ (e.g. main's) whose loading memory is measured beside this "
        "one's, for a before/after",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run: the tiny shape, 3 short requests, one round, no vLLM, no JSON",
    )
    parser.add_argument(
        "--out",
        type=Path,
        help=f"JSON path (default {RESULTS.relative_to(ROOT)}, or real_model_SHAPE.json beside it "
        "for another shape)",
    )
    args = parser.parse_args()
    if args.quick:
        args.shape, args.requests, args.repeats, args.skip_vllm = "tiny", 3, 1, True
    prompt_tokens, output_tokens = (
        ((8, 32), (4, 8)) if args.quick else (PROMPT_TOKENS, OUTPUT_TOKENS)
    )
    default_out = (
        RESULTS if args.shape == DEFAULT_SHAPE else RESULTS.with_stem(f"real_model_{args.shape}")
    )
    out_path = args.out if args.out is not None else (None if args.quick else default_out)
    torch.set_num_threads(THREADS)
    dtype = DTYPES[args.dtype]

    from minivllm.engine.config import EngineConfig
    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.model.checkpoint import load_model
    from minivllm.model.fused import fuse_model
    from minivllm.model.hf_tokenizer import load_tokenizer
    from minivllm.sched.scheduler import SchedulerConfig

    started = time.perf_counter()
    folder = make_checkpoint(args.dir, args.shape, args.checkpoint_dtype, args.seed)
    built_s = time.perf_counter() - started
    tokenizer = load_tokenizer(folder)
    requests = make_requests(tokenizer, args.requests, args.seed, prompt_tokens, output_tokens)
    prompt_lens = [len(r.prompt_ids) for r in requests]
    out_lens = [r.max_tokens for r in requests]
    load_start = load_str()
    print(
        f"checkpoint: {folder} (Qwen3, {args.shape}, {args.checkpoint_dtype} on disk; "
        f"{built_s:.0f} s to build or find); tokenizer: byte-level BPE, {tokenizer.vocab_size} "
        f"tokens\nworkload: {len(requests)} requests (seed {args.seed}), prompts "
        f"{min(prompt_lens)}-{max(prompt_lens)} tokens, outputs {min(out_lens)}-{max(out_lens)} "
        f"(total {sum(out_lens)}), greedy, ignore_eos; {args.dtype}; {THREADS} threads; "
        f"CPU {cpu_model()}; load average {load_start}",
        flush=True,
    )

    # -- loading memory, each in a fresh interpreter --
    memory = {}
    if not args.skip_memory:
        sources = {"this": SRC}
        if args.memory_baseline_src is not None:
            sources["baseline"] = args.memory_baseline_src.resolve()
        print("\nloading memory (peak RSS growth over an interpreter with torch imported):")
        for source, src in sources.items():
            for what in ("load_model", "engine"):
                for target in ("bfloat16", "float32"):
                    m = measure_memory(folder, target, what, src)
                    key = f"{source}/{what}/{args.checkpoint_dtype}->{target}"
                    memory[key] = {**m, "src": str(src), "commit": source_commit(src)}
                    print(
                        f"  {key:<40} peak +{gib(m['peak_growth_bytes'])} = "
                        f"{m['peak_over_weights']:.2f}x the weights ({gib(m['weights_bytes'])}; "
                        f"{m['with_import_over_weights']:.2f}x with torch's meta kernels' import "
                        f"of {gib(m['meta_kernels_import_bytes'])}); "
                        f"weights held {gib(m['weights_held_bytes'])}, RSS after "
                        f"+{gib(m['rss_growth_after_bytes'])}, K/V {gib(m['kv_cache_bytes'])}, "
                        f"{m['seconds']:.1f} s",
                        flush=True,
                    )

    # -- the systems --
    model = load_model(folder, dtype)
    parameters = sum(p.numel() for p in model.parameters())
    model = fuse_model(model, in_place=True)  # both engines run these weights, neither copies
    spread = logit_spread(model, requests[0].prompt_ids, tokenizer.vocab_size)
    print(f"\nrandom model's logits: {spread}")
    blocks = sum(-(-(n + m) // 16) for n, m in zip(prompt_lens, out_lens)) + 16
    scheduler = SchedulerConfig(
        max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS
    )
    engines = {}
    for backend, compiled in [("auto", False), ("torch", False)] + [("auto", True)] * args.compiled:
        config = EngineConfig(
            num_blocks=blocks,
            scheduler=scheduler,
            dtype=dtype,
            attention_backend=backend,
            compile_forward=compiled,
        )
        engine = LLMEngine(model, config, tokenizer)
        name = f"minivllm ({backend}: {engine.runner.backend.__name__}"
        name += ", compiled)" if compiled else ")"
        engines[f"minivllm/{backend}" + ("/compiled" if compiled else "")] = engine, name
    if args.data_parallel > 1:  # replicas of the default backend, on a copy of the weights
        from minivllm.engine.data_parallel import DataParallelEngine

        config = EngineConfig(
            num_blocks=blocks,
            scheduler=scheduler,
            dtype=dtype,
            data_parallel_size=args.data_parallel,
        )
        replicas = DataParallelEngine(copy.deepcopy(model), config, tokenizer)
        name = f"minivllm (auto, data parallel {args.data_parallel})"
        engines[f"minivllm/auto/dp{args.data_parallel}"] = replicas, name
    warm = [replace(r, max_tokens=2) for r in requests[:2]]
    systems = {
        key: warmed(lambda rs, e=engine, n=name: run_engine(e, rs, n), warm, requests)
        for key, (engine, name) in engines.items()
    }
    hf = None
    if not args.skip_hf:
        import transformers

        hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
        systems["hf"] = warmed(lambda rs: run_hf(hf, rs), warm, requests)
    vllm_note = None
    tmp = tempfile.TemporaryDirectory()
    if args.skip_vllm:
        vllm_note = "skipped (--skip-vllm or --quick)"
    elif not os.access(args.vllm_python, os.X_OK):
        vllm_note = f"skipped: no vLLM virtualenv at {args.vllm_python} (see vllm_peer.py)"
    else:
        workload_path = Path(tmp.name) / "workload.json"
        write_workload(
            workload_path,
            folder,
            args.dtype,
            [(r.prompt_ids, r.max_tokens) for r in requests],
            max_model_len=MAX_MODEL_LEN,
            max_num_seqs=MAX_NUM_SEQS,
            max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        )
        for mode in args.vllm_modes:
            systems[f"vllm/{mode}"] = lambda m=mode: run_vllm(
                args.vllm_python, workload_path, m, THREADS, VLLM_TIMEOUT
            )
    if vllm_note:
        print(f"vLLM {vllm_note}")

    # the system column: as wide as the longest name (the compiled engine's runs past 38)
    width = max(38, *(len(name) for _, name in engines.values()))
    runs: dict[str, list[dict]] = {}
    try:
        for repeat in range(args.repeats):
            for key, run in systems.items():  # alternating: every system once per round
                r = run()
                runs.setdefault(key, []).append(r)
                ttft = [t for t in r["_ttft"] if t is not None]
                extra = f", TTFT median {statistics.median(ttft):.2f} s, last {max(ttft):.2f} s"
                if "startup_seconds" in r:
                    extra += f", start-up {r['startup_seconds']:.0f} s"
                if r.get("core_watch", {}).get("watching"):
                    watch = r["core_watch"]
                    extra += f", passes on fewer threads {watch['narrowed']}/{watch['passes']}"
                print_run(repeat, args.repeats, r, width, extra)
    finally:
        tmp.cleanup()
    results = {key: summarize(rs) for key, rs in runs.items()}

    # -- the table --
    refs = [k for k in ("hf", *(f"vllm/{m}" for m in args.vllm_modes)) if k in results]
    heads = ["/ HF" if k == "hf" else f"/ vLLM {k.split('/')[1]}" for k in refs]
    print(
        f"\n| {'system':<{width}} | {'tokens':>6} | {'tokens/s':>8} | {'best':>8} | "
        f"{'TTFT med':>8} | {'TTFT p90':>8} | " + " | ".join(f"{h:>14}" for h in heads) + " |"
    )
    print(
        f"|{'-' * (width + 2)}|{'-' * 8}|{'-' * 10}|{'-' * 10}|{'-' * 10}|{'-' * 10}|"
        + "|".join("-" * 16 for _ in heads)
        + "|"
    )
    ratios = {}
    for key, r in results.items():
        cells = []
        for ref in refs:
            ratio = r["tokens_per_second_median"] / results[ref]["tokens_per_second_median"]
            cells.append(f"{ratio:>13.2f}x")
            if key.startswith("minivllm"):
                ratios[f"{key} / {ref}"] = round(ratio, 3)
        print(
            f"| {r['system']:<{width}} | {r['tokens']:>6} | "
            f"{r['tokens_per_second_median']:>8.2f} | "
            f"{r['tokens_per_second_best']:>8.2f} | {r['ttft_median_s']:>8.2f} | "
            f"{r['ttft_p90_s']:>8.2f} | " + " | ".join(f"{c:>14}" for c in cells) + " |"
        )
    print(
        f"(output tokens/s: median of {args.repeats} rounds, ratios of medians; TTFT in seconds "
        "over every request of every round)"
    )

    # -- greedy tokens (each system's first round) --
    print("\ngreedy tokens, identical sequences (reported, not asserted):")
    keys = list(runs)
    agree = {}
    for i, a in enumerate(keys):
        for b in keys[i + 1 :]:
            found = agreement(runs[a][0]["_tokens"], runs[b][0]["_tokens"])
            agree[f"{a} vs {b}"] = found
            where = ", ".join(
                f"#{d['request']} at {d['first_differing_position']}/{d['length']}"
                for d in found["differ"]
            )
            print(
                f"  {a + ' vs ' + b:<40} {found['identical']}/{found['requests']}"
                + (f" (first differ: {where})" if where else "")
            )
    for key, rs in runs.items():
        if len(rs) > 1 and any(r["_tokens"] != rs[0]["_tokens"] for r in rs[1:]):
            print(f"  note: {key} gave different tokens in different rounds")
            agree[f"{key} run to run"] = {"all_runs_identical": False}

    load_end = load_str()
    print(f"\nload average: {load_start} at the start, {load_end} at the end; CPU {cpu_model()}")
    if out_path is None:
        print("quick run: no JSON written (give --out to write one)")
        return 0
    record = {
        "benchmark": "real_model",
        "machine": machine_record(
            "wall clock on a shared machine: each run keeps its load averages",
            load_average_at_start=load_start,
            vllm=next(
                (runs[k][0]["vllm"] for k in runs if k.startswith("vllm/")), vllm_note or None
            ),
        ),
        "checkpoint": {
            "shape": args.shape,
            "family": "Qwen3ForCausalLM",
            "dtype_on_disk": args.checkpoint_dtype,
            "parameters": parameters,
            "config": SHAPES[args.shape],
            "tokenizer": f"byte-level BPE trained with tokenizers on the shipped validation text, "
            f"{tokenizer.vocab_size} tokens",
            "weights": "transformers' seeded initialisation; the embedding (tied LM head) rows of "
            f"the tokenizer's tokens at std {EMBED_STD}, the rest near zero",
            "logits": spread,
        },
        "workload": {
            "seed": args.seed,
            "requests": len(requests),
            "prompt_tokens": prompt_lens,
            "output_tokens": out_lens,
            "sampling": "greedy (temperature 0), ignore_eos",
            "dtype": args.dtype,
        },
        "config": {
            "threads": THREADS,
            "max_num_seqs": MAX_NUM_SEQS,
            "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
            "vllm_max_model_len": MAX_MODEL_LEN,
            "repeats": args.repeats,
            "order": "alternating: " + ", ".join(systems) + " per round",
            "warmup": "before every timed run, 2 requests x 2 tokens (vLLM: in its fresh process)",
            "hf": "one generate call over every request (left padding), to the longest "
            "max_tokens; each request's own max_tokens count; TTFT: the first step, for all",
        },
        "results": results,
        "minivllm_over": ratios,
        "greedy_agreement": agree,
        "load_memory": memory,
        "load_average": {"start": load_start, "end": load_end},
    }
    write_results(out_path, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
