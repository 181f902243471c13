# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Scoreboard — one workload through every layer
#
# Each chapter adds one idea to the engine and measures it on a workload of its own. This page runs
# *one* seeded workload through all of them, in the order the book builds them: naive generation,
# a KV cache, a paged cache, continuous batching, speculative decoding, the CPU attention kernel,
# and the whole engine served over HTTP. The same prompts, the same output lengths, greedy
# decoding, the same model, two CPU threads — so each row differs from the one before it by its
# chapter's idea alone, and the greedy tokens can be compared row by row.
#
# The numbers are **not** measured when this page is built: the whole workload takes minutes.
# `benchmarks/scoreboard.py` measures them and writes `benchmarks/results/scoreboard.json`; the
# cells below read that record, and say the date and the minivllm commit each table was recorded
# at, so a reader knows which code the numbers belong to. Run the script again (`make bench`) and
# re-execute this page to see your own machine's scoreboard.

# %% tags=["hide-input"]
import json
from pathlib import Path

import matplotlib.pyplot as plt
from IPython.display import display

import minivllm
from minivllm.book import sequence_color, use_book_style
from minivllm.book.stats import speed_change
from minivllm.book.tables import Table

use_book_style()
ROOT = Path(minivllm.__file__).resolve().parents[2]  # the repository (an editable install)
record = json.loads((ROOT / "benchmarks" / "results" / "scoreboard.json").read_text())
rows, workload, machine = record["rows"], record["workload"], record["machine"]
naive_tps = rows[0]["tokens_per_s_median"]
print(
    f"{workload['requests']} requests (seed {workload['seed']}): "
    f"{workload['prompt_tokens_total']} prompt tokens, {workload['output_tokens_total']} output "
    f"tokens ({workload['output_tokens'][0]}-{workload['output_tokens'][1]} each), "
    f"{workload['sampling']}"
)


def recorded_at(source: dict, date: str | None) -> str:
    """When and at which commit a record was measured, as the record itself says."""
    commit = (source or {}).get("commit")
    edited = " with uncommitted changes to src/" if (source or {}).get("src_modified") else ""
    return f"recorded at minivllm commit {commit[:12] if commit else 'unknown'}{edited}, " + (
        f"on {date}" if date else "date not recorded"
    )


scoreboard_recorded = recorded_at(machine["source"], record["date"])
print(
    f"{scoreboard_recorded}; {machine['platform']}, {machine['cpus']} CPUs, "
    f"torch {machine['torch']} with {machine['torch_threads']} threads "
    f"(OMP_WAIT_POLICY {machine.get('OMP_WAIT_POLICY') or 'unset'}), "
    f"{record['seconds_in_all']:.0f} s to measure"
)
print(
    f"load average (1, 5, 15 min): {machine['load_average_at_start']} at the start, "
    f"{machine['load_average_at_end']} at the end; "
    f"{record['config']['repeats']} alternating rounds, the median run of each row shown"
)

# %% [markdown]
# ## The table
#
# Throughput is generated tokens over wall-clock seconds for the whole workload. *KV reserved* is
# what the layer allocates for keys and values while it runs; *KV peak used* is the most of it that
# held live tokens at one moment (see the script's docstring for each layer's definition). The last
# column says whether the row's greedy tokens are the naive row's, request for request.


# %% tags=["hide-input"]
def mib(n: int) -> str:
    return f"{n / 2**20:.2f}" if n else "—"


def same(row: dict) -> str:
    differing = row["requests_differing_from_naive"]
    return "yes" if differing == 0 else f"no: {differing} of {workload['requests']} differ"


header = [
    "layer",
    "chapter",
    "tokens/s",
    "throughput / naive",
    "KV reserved (MiB)",
    "KV peak used (MiB)",
    "tokens identical",
]
body = [
    [
        row["layer"],
        row["chapter"],
        f"{row['tokens_per_s_median']:,.1f}",
        f"{row['tokens_per_s_median'] / naive_tps:,.1f}×",
        mib(row["kv_reserved_bytes"]),
        mib(row["kv_peak_used_bytes"]),
        same(row),
    ]
    for row in rows
]
display(Table(header, body, right={2, 3, 4, 5}, caption=scoreboard_recorded))

# %% tags=["hide-input"] mystnb={"figure": {"caption": "Output tokens per second of each layer on the same seeded workload (log scale, the median of the alternating runs; the thin line spans the slowest to the fastest run). Each bar is one chapter's idea added to the bar above it.", "name": "fig-scoreboard"}}
fig, ax = plt.subplots(figsize=(7.5, 3.8))
labels = [f"{row['layer']} ({row['chapter']})" for row in rows]
medians = [row["tokens_per_s_median"] for row in rows]
spreads = [[r["tokens_per_s"] for r in row["runs"]] for row in rows]
y = range(len(rows))
ax.barh(y, medians, color=[sequence_color(i) for i in y])
ax.hlines(y, [min(s) for s in spreads], [max(s) for s in spreads], color="black", linewidth=1)
for i, (value, spread) in enumerate(zip(medians, spreads)):
    ax.text(max(value, *spread) * 1.1, i, f"{value:,.0f}", va="center", fontsize=9)
ax.set_xscale("log")
ax.set_xlim(min(medians) / 2, max(max(s) for s in spreads) * 4)
ax.set_yticks(list(y), labels)
ax.invert_yaxis()
ax.set_xlabel("output tokens per second (log scale)")
plt.show()

# %% [markdown]
# ## What each layer changes
#
# Each row against the one before it (the CPU kernel against continuous batching on the torch
# backend, since the speculative row is a branch beside it), faster or slower by the ratio's sign:

# %% tags=["hide-input"]
by_key = {row["key"]: row for row in rows}
previous = {
    "kv_cache": "naive",
    "paged": "kv_cache",
    "continuous": "paged",
    "speculative": "continuous",
    "numba": "continuous",
    "http": "numba",
}
steps = [
    [
        by_key[key]["layer"],
        by_key[before]["layer"],
        speed_change(by_key[key]["tokens_per_s_median"] / by_key[before]["tokens_per_s_median"]),
    ]
    for key, before in previous.items()
]
display(Table(["layer", "against", "throughput ratio"], steps, caption=scoreboard_recorded))

# %% [markdown]
# - **Naive generation** ({doc}`chapters/00_model`) is the baseline: every new token re-runs the
#   model over the whole sequence so far, so a token costs a forward pass over hundreds of
#   positions, and a request costs the square of its length.
# - **The contiguous KV cache** ({doc}`chapters/02_contiguous_cache`) keeps every layer's keys and
#   values, so a step feeds the model one token and reads the history instead of recomputing it.
#   Its price is memory: it reserves the model's whole context for a request however short the
#   request turns out to be, which is the gap between its two memory columns.
# - **The paged cache** ({doc}`chapters/03_paged_cache`) does not make one request faster — the
#   history is gathered through a block table, a little more work per step than a slice — but it
#   holds only the blocks a request has filled, so the reserved memory falls to what is used. That
#   is what lets many requests share one pool, which the next row needs.
# - **Continuous batching** ({doc}`chapters/04_engine`) runs every request in one batched forward
#   pass per step and fills a finished request's place at once. A matrix product over a few dozen
#   rows costs little more than over one, so the cost of a step is shared by the whole batch; the
#   pool now holds every request at once, which is why its memory columns grow.
# - **Speculative decoding** ({doc}`chapters/06_speculative`) lets the draft model propose a few
#   tokens and the target verify them in one pass, trading spare compute for fewer target passes.
#   At one request on a CPU that spare compute exists; with a whole batch already in every pass it
#   mostly does not, and the verify's extra tokens and the draft passes cost something whatever
#   they save: the ratio above says, by its sign, which side won in this record — compare chapter
#   06's batch-1 and batch-16 measurements. The draft model's own cache adds to the memory.
# - **The CPU paged-attention kernel** ({doc}`chapters/07_cpu_kernel`) attends over the
#   paged cache in place: each K/V row is read once per group of query heads, with no gathered copy
#   of the history and no padding, its arithmetic on 8-lane vectors written by hand, the next
#   block prefetched, and the work dealt to both cores by cost. Same blocks, same memory; less time
#   in attention.
# - **Served over HTTP** ({doc}`chapters/09_server`) is that engine behind the OpenAI API, every
#   request a streaming client. It is not meant to be faster: what it adds is the work of the
#   server — HTTP, a JSON chunk per token, an event loop sharing the interpreter with the engine
#   thread — and the row shows what that costs of the engine's throughput. On a busy machine
#   it can even come out ahead: the server is a process of its own, and the operating system shares
#   the cores among processes, so server and clients together get a larger slice than the single
#   process that ran the row above. Its text is compared with the naive row's tokens decoded, since
#   a stream carries text, not token ids.

# %% [markdown]
# ## Against vLLM
#
# vLLM's own CPU build was measured by `benchmarks/vllm_peer.py` on a *different*, larger workload
# (the throughput benchmark's, at 256 requests), alternating with minivllm's engine in the same run.
# Its row is shown with minivllm's row from that same record, so the ratio compares two systems on
# one workload; neither number compares with the rows above.

# %% tags=["hide-input"]
peer = record["vllm_peer"]
if peer is None:
    print("no vLLM run recorded (benchmarks/results/vllm_peer.json is absent)")
else:
    peer_workload = peer["workload"]
    agreement = peer["greedy_agreement"]
    peer_rows = [
        [peer["vllm"]["system"], f"{peer['vllm']['tokens_per_s_median']:,.1f}", "", ""],
        [
            peer["minivllm"]["system"],
            f"{peer['minivllm']['tokens_per_s_median']:,.1f}",
            speed_change(peer["minivllm_over_vllm_median"], than="vLLM"),
            f"{agreement['identical']} of {agreement['requests']}",
        ],
    ]
    # the same engine with each pass split between 2 processes, with its forward compiled, and as
    # two replicas (data parallel)
    others = ("minivllm_split", "minivllm_compiled", "minivllm_data_parallel")
    for other in (peer.get(key) for key in others):
        if other is not None:
            peer_rows.append(
                [
                    other["system"],
                    f"{other['tokens_per_s_median']:,.1f}",
                    speed_change(other["over_vllm_median"], than="vLLM"),
                    f"{other['greedy_agreement']['identical']} of "
                    f"{other['greedy_agreement']['requests']}",
                ]
            )
    if peer.get("vllm_data_parallel") is not None:  # vLLM as two replicas too
        theirs = peer["vllm_data_parallel"]
        peer_rows.append([theirs["system"], f"{theirs['tokens_per_s_median']:,.1f}", "", ""])
    peer_recorded = recorded_at(peer["machine"].get("source"), peer.get("date"))
    display(
        Table(
            ["system (its own workload)", "tokens/s", "minivllm / vLLM", "tokens identical"],
            peer_rows,
            right={1, 2},
            caption=f"{peer_recorded} (benchmarks/vllm_peer.py)",
        )
    )
    print(
        f"vLLM's workload: {peer_workload['requests']} requests (seed {peer_workload['seed']}), "
        f"{peer_workload['prompt_tokens_total']} prompt and {peer_workload['output_tokens_total']} "
        f"output tokens, {peer_workload['sampling']}; {peer['config']['max_num_seqs']} sequences "
        f"and {peer['config']['max_num_batched_tokens']} tokens per step in both systems; "
        f"vLLM {peer['machine']['vllm']}, load average {peer['load_average']['start']} at the "
        f"start, {peer['load_average']['end']} at the end"
    )

# %% [markdown]
# The numbers are wall clock on whatever machine ran the script, with the load average beside
# them: on a shared machine a run can be much slower than the next, so read the ratios, which come
# from runs taken minutes apart, rather than the absolute rates.
