"""The forward under torch.compile against the eager one, step by step (issue 32).

    python benchmarks/compiled_forward.py [--requests 256] [--seed 0] [--backend numba] [--out PATH]

`EngineConfig(compile_forward=True)` (runner/compiled.py) runs the model's forward as one inductor
graph, with attention as an opaque op. Whole-run throughputs on a shared two-core machine drift by
more than the difference (benchmarks/vllm_peer.py runs both ways, round after round); this puts
the two engines in one process, each with the whole workload of vllm_peer.py (256 requests, its
scheduler limits), and steps them **alternately**: step n of one, then step n of the other, so
both see the same moments of noise. Both schedule the same steps (greedy, the same cache), so each
step pairs with its twin: the table gives the median step and forward pass by kind of step
(with a prefill chunk; decodes only, by batch size), the sums, and the ratio. The compiled engine's
build compiles (or loads inductor's cache) before the timed steps; both builds are timed. The
tokens of the two engines are compared at the end.
"""

from __future__ import annotations

import minivllm  # noqa: F401 -- before torch: it sets OMP_WAIT_POLICY, read as torch loads

# isort: split
import argparse
import statistics
import time
from pathlib import Path

import torch
from _common import load_str, machine_record, make_workload, write_results
from vllm_peer import MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS, peer_config

from minivllm import LLMEngine, SamplingParams
from minivllm.model.checkpoint import load_model

RESULTS = Path(__file__).parent / "results" / "compiled_forward.json"
MODES = {"eager": False, "compiled": True}


def step_kind(record) -> str:
    """A step's kind: with a prefill chunk, or decodes only by batch size (16 wide bands)."""
    if record.prefilled:
        return "with prefill"
    low = len(record.decoded) // 16 * 16
    return f"decode {max(low, 1)}-{low + 15}"


def band_order(kind: str) -> tuple[bool, int]:
    """Prefill steps first, then decode bands from the largest batch down."""
    return kind != "with prefill", -int(kind.split()[-1].split("-")[0]) if "-" in kind else 0


def build(model, requests, backend: str, compiled: bool) -> LLMEngine:
    """vllm_peer.py's engine, every request added."""
    config = peer_config(requests, backend, torch.float32, compiled=compiled)
    engine = LLMEngine(model, config)
    for r in requests:
        params = SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True)
        engine.add_request(r.prompt_ids, params)
    return engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", default="numba")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    model = load_model("target")
    requests = make_workload(args.requests, args.seed)
    load_before = load_str()
    engines, build_s, first_step_s = {}, {}, {}
    for mode, compiled in MODES.items():  # the compiled engine compiles as it is built
        started = time.perf_counter()
        engines[mode] = build(model, requests, args.backend, compiled)
        build_s[mode] = round(time.perf_counter() - started, 2)
    for mode, engine in engines.items():
        started = time.perf_counter()
        engine.step()
        first_step_s[mode] = round(time.perf_counter() - started, 2)
    times: dict[str, dict[str, list[tuple[float, float]]]] = {mode: {} for mode in MODES}
    tokens: dict[str, dict[int, list[int]]] = {mode: {} for mode in MODES}
    while any(engine.has_unfinished() for engine in engines.values()):
        for mode, engine in engines.items():
            started = time.perf_counter()
            outputs = engine.step(final_only=True)
            step_ms = 1e3 * (time.perf_counter() - started)
            record = engine.trace[-1]
            times[mode].setdefault(step_kind(record), []).append((step_ms, 1e3 * record.forward_s))
            tokens[mode].update((o.request_id, list(o.token_ids)) for o in outputs)
    kinds = sorted(times["eager"], key=band_order)
    rows = []
    print(f"{'steps':<16}{'n':>5}  {'eager ms':>9}{'compiled':>9}  {'forward':>8}{'compiled':>9}")
    for kind in kinds:
        eager, compiled = times["eager"][kind], times["compiled"].get(kind, [])
        row = {"steps": kind, "count": len(eager)}
        for mode, pairs in (("eager", eager), ("compiled", compiled)):
            row[f"{mode}_step_ms_median"] = round(statistics.median(s for s, _ in pairs), 3)
            row[f"{mode}_forward_ms_median"] = round(statistics.median(f for _, f in pairs), 3)
            row[f"{mode}_step_ms_sum"] = round(sum(s for s, _ in pairs), 1)
        rows.append(row)
        print(
            f"{kind:<16}{len(eager):>5}  {row['eager_step_ms_median']:>9.2f}"
            f"{row['compiled_step_ms_median']:>9.2f}  {row['eager_forward_ms_median']:>8.2f}"
            f"{row['compiled_forward_ms_median']:>9.2f}"
        )
    total = {mode: sum(s for pairs in times[mode].values() for s, _ in pairs) for mode in MODES}
    same = sum(tokens["eager"][i] == tokens["compiled"].get(i) for i in tokens["eager"])
    speedup = total["eager"] / total["compiled"]
    print(
        f"all steps: eager {total['eager'] / 1e3:.2f} s, compiled {total['compiled'] / 1e3:.2f} s "
        f"= {speedup:.2f}x; engines built in {build_s['eager']:.1f} s eager, "
        f"{build_s['compiled']:.1f} s compiled (the compile); first steps "
        f"{first_step_s['eager']:.2f} / {first_step_s['compiled']:.2f} s; greedy tokens "
        f"identical {same}/{len(tokens['eager'])}; load {load_before} -> {load_str()}"
    )
    record = {
        "benchmark": "compiled_forward",
        "machine": machine_record("eager and compiled engines stepped alternately, one process"),
        "workload": {
            "requests": args.requests,
            "seed": args.seed,
            "backend": args.backend,
            "max_num_seqs": MAX_NUM_SEQS,
            "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
            "output_tokens": sum(r.max_tokens for r in requests),
        },
        "build_s": build_s,
        "first_step_s": first_step_s,
        "rows": rows,
        "total_step_s": {mode: round(t / 1e3, 3) for mode, t in total.items()},
        "eager_over_compiled": round(speedup, 3),
        "greedy_identical": {"requests": len(tokens["eager"]), "identical": same},
        "load_average": {"before": load_before, "after": load_str()},
    }
    write_results(args.out, record)


if __name__ == "__main__":
    main()
