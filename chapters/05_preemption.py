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
# # Chapter 05 — Preemption: when the cache runs out mid-flight
#
# :::{admonition} At a glance
# - **Builds:** preemption by recompute, its victim policies, and its cost against cache size.
# - **Needs:** chapter 04.
# - **Runs in:** about 1–2 min on a 2-core laptop CPU, start to end.
# :::
#
# Chapter 04's scheduler admits a request when there are blocks for its prompt. It cannot know how
# long the answer will be, so it bets that the running sequences will find blocks as they grow. With
# a big cache the bet is safe. With a small one, or a burst of long answers, every block ends up
# held by a sequence that needs one more — and nobody can move. This chapter makes the engine take a
# block back: it **preempts** a running sequence, throws its {term}`KV cache` away, and recomputes
# it later (recomputation, one of the two recovery policies of {cite}`kwon2023pagedattention`; the
# other swaps the blocks out to host memory).

# %%
import copy
import time

import matplotlib.pyplot as plt
import numpy as np
import torch

from minivllm import EngineConfig, LLMEngine, SamplingParams, SchedulerConfig
from minivllm.book import sequence_color, show, use_book_style
from minivllm.book.figures.blocks import draw_block_pool, draw_block_tables
from minivllm.book.figures.timelines import draw_gantt
from minivllm.book.modes import Stall
from minivllm.book.stepper import Stepper
from minivllm.model.checkpoint import load_model
from minivllm.sched.preemption import (
    CountingPolicy,
    Preemption,
    RecomputePreemption,
    least_progressed,
    newest_first,
)
from minivllm.sched.scheduler import Scheduler, SchedulerStalled
from minivllm.training.corpus import shipped_validation_text

torch.manual_seed(0)
torch.set_num_threads(2)
use_book_style()
model = load_model("target")
text = shipped_validation_text()

# %% [markdown]
# ## Why: chapter 04's engine in a small cache
#
# A burst of 12 requests, each a line of a play and 120 new tokens, into a cache of 24 blocks of 16
# tokens. Chapter 04's `schedule()` hands a running sequence that gets no slots to a *preemption
# policy*. Here it gets the book's `Stall` (in `minivllm.book.modes`), which never preempts: the
# sequence is *stalled* for the step and waits for someone else to finish — all that chapter 04's
# engine could do without this chapter.

# %%
rng = np.random.default_rng(0)
burst = [text[s : s + 40] for s in rng.integers(0, len(text) - 40, size=12)]
long_answers = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)


def small_engine(preemption, num_blocks=24, block_size=16, **scheduler):
    scheduler.setdefault("max_num_seqs", 16)
    config = SchedulerConfig(preemption=preemption, **scheduler)
    return LLMEngine(
        model, EngineConfig(num_blocks=num_blocks, block_size=block_size, scheduler=config)
    )


stuck = small_engine(preemption=Stall())
try:
    stuck.generate(burst, long_answers)
except SchedulerStalled as error:
    print(f"step {stuck.scheduler.step}: SchedulerStalled: {error}")

# %% [markdown]
# Every block belongs to a sequence that needs one more. None can finish, so none will ever free a
# block: a **{term}`deadlock <deadlock (scheduler)>`**. Here is the pool at that moment — every
# colour is a request that is half done and stuck:

# %% tags=["hide-input"] mystnb={"figure": {"caption": "The deadlocked pool (left) and the block tables (right), one colour per request: every block is held by a request that needs one more, and none is free.", "name": "fig-05-deadlock"}}
fig, (pool_ax, table_ax) = plt.subplots(
    1, 2, figsize=(10, 3.6), gridspec_kw={"width_ratios": [1, 1.4]}
)
centres = draw_block_pool(pool_ax, stuck.manager, columns=6, title="the pool, deadlocked")
draw_block_tables(table_ax, stuck.manager)
plt.show()

# %% [markdown]
# Waiting longer cannot help. Something must give a block back, and the only blocks are in use.
#
# ## Build: preemption by recompute
#
# vLLM's answer is to **preempt**: pick a running sequence (the *victim*), free *all* of its blocks,
# and put it back at the front of the waiting queue. Its tokens — prompt and the output so far — are
# kept; only their keys and values are thrown away. When it is admitted again it prefills prompt and
# output together (one {term}`chunked prefill`, fast: all positions in parallel) and carries on
# where it was. Because sampling depends only on (request seed, position), it produces exactly the
# tokens it would have produced without the interruption.
#
# `Scheduler.preempt` is that move, on the {term}`scheduler`'s queues and the block manager:

# %%
show(Scheduler.preempt)

# %% [markdown]
# Preemption enters the scheduler through **one seam**: the policy object that
# `SchedulerConfig(preemption=...)` names. When `schedule()` needs slots for a running sequence it
# calls `_reserve`, which packs the block manager's question (`allocate_slots`, chapter 04) into an
# `allocate` function and asks it once. Only when the answer is no (and the sequence may preempt)
# does it hand `allocate` to the policy's `make_room`, which answers with the tokens granted and the
# victims it preempted on the way. Nothing else in the scheduler knows how room is made.

# %%
show(Scheduler._reserve)

# %%
show(Preemption)

# %% [markdown]
# The policy that ships, `RecomputePreemption`, asks once; while the answer is "no room" and the
# sequence is not alone, it picks a victim among the running sequences not yet scheduled in this
# step, preempts it and asks again — until the sequence fits or is itself the victim. (vLLM's V1
# scheduler does the same inside its `schedule()`, in `vllm/v1/core/sched/scheduler.py`.)

# %%
show(RecomputePreemption.make_room)

# %% [markdown]
# Three rules, in `schedule()` (chapter 04 showed it), keep this from doing harm:
#
# - A step that preempted admits no one: the freed blocks are for the running batch.
# - A *prompt chunk* that finds no block waits (is stalled) instead of preempting, once the step has
#   other work (`may_preempt`). Preempting for it would throw away keys and values — often its own
#   half-computed prompt — to run a few prompt tokens one step sooner. Decodes do preempt: a user is
#   waiting on them.
# - A sequence that is **alone** and still does not fit can never fit: `make_room` gives up and
#   `schedule()` ends it with finish reason `"cache_full"` instead of looping forever.
#
# The seam is also where other ways of making room plug in. The book's `Stall` from the top of the
# chapter is a `make_room` that only asks. **Swap-to-host** preemption would be a policy whose
# `make_room` copies the victim's blocks to CPU memory (plus a block copy in `attention/storage.py`)
# instead of dropping them, and copies them back when it is readmitted: no recompute, but a copy
# each way. vLLM V0 had it (`PreemptionMode.SWAP` in `vllm/core/scheduler.py`); V1 dropped it. On a
# CPU there is nowhere cheaper to swap to.
#
# Whom to evict is a *{term}`victim policy`*, a plain function from the candidates to the victim.
# Two ship:
#
# - **newest first** (LIFO) — the most recently admitted; vLLM's and nano-vllm's choice. The newest
#   has waited least, and usually has the least computed.
# - **least progressed** — the fewest output tokens, ties to the higher id: it throws away the least
#   generated work, whoever arrived first.

# %%
show(newest_first)

# %%
show(least_progressed)

# %% [markdown]
# The same 12 requests, now with {term}`preemption <preemption (by recompute)>`: all finish.

# %%
for policy in ["newest", "least_progressed"]:
    engine = small_engine(policy)
    outs = engine.generate(burst, long_answers)
    preemptions = sum(len(r.preempted) for r in engine.trace)
    print(
        f"{policy:>16}: {sum(o.finish_reason == 'length' for o in outs)} of 12 finished in "
        f"{len(engine.trace)} steps, {preemptions} preemptions, "
        f"{sum(r.recomputed_tokens for r in engine.trace)} tokens recomputed, "
        f"{engine.manager.num_free} of 24 blocks free at the end"
    )

# %% [markdown]
# ## A worked example, step by step
#
# Small enough to follow by hand: a cache of **6 blocks of 1 token**, a {term}`token budget` of 4
# per step, and three requests. A arrives first (3 prompt tokens, 2 new), C at step 1 (3 prompt
# tokens, 3 new), B at step 2 (1 prompt token, 3 new). Each step's log says who was admitted,
# preempted, resumed or finished, and what the queues and the pool look like after it.

# %%
WORKED = {  # request id: (name, arrival step, prompt ids, max_tokens)
    0: ("A", 0, [256, 65, 66], 2),
    1: ("B", 2, [256], 3),
    2: ("C", 1, [256, 67, 68], 3),
}


def run_worked(policy):
    """Run the worked example; return one snapshot per step (the pool and queues after it)."""
    engine = small_engine(
        policy, num_blocks=6, block_size=1, max_num_batched_tokens=4, max_num_seqs=4
    )
    names, snapshots = {i: name for i, (name, *_) in WORKED.items()}, []
    for step in range(40):
        for request_id, (_, arrival, ids, max_tokens) in WORKED.items():
            if arrival == step:
                params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
                engine.add_request(ids, params, request_id=request_id)
        if not engine.has_unfinished():
            break
        engine.step()
        snapshots.append((copy.deepcopy(engine.manager), engine.trace[-1]))
    return names, snapshots


def describe(names, record):
    said = [f"admit {names[i]}" for i in record.admitted if i not in record.resumed]
    said += [f"resume {names[i]}" for i in record.resumed]
    said += [f"preempt {names[i]}" for i in record.preempted]
    said += [f"finish {names[i]}" for i, _ in record.finished]
    return ", ".join(said) or "decode"


for policy in ["newest", "least_progressed"]:
    names, snapshots = run_worked(policy)
    print(f"{policy}:")
    for _, record in snapshots:
        running = " ".join(names[i] for i in record.running) or "-"
        waiting = " ".join(names[i] for i in record.waiting) or "-"
        print(
            f"  step {record.step}: {describe(names, record):34s} running [{running}] waiting [{waiting}] "
            f"free {record.blocks_free}"
        )

# %% [markdown]
# Read the two logs side by side. Until the pool is full they are the same run. Then two running
# sequences need a block and none is free, and the policies part ways: newest-first evicts the one
# admitted last; least-progressed evicts the one with the fewest output tokens (on a tie, the higher
# id). The victim loses its blocks and waits at the front of the queue; when the other finishes, the
# victim is admitted again, recomputes prompt and output in one {term}`prefill`, and finishes.
#
# The pool at each step under `newest` (one colour per request; the block tables below each pool):

# %% tags=["hide-input"] mystnb={"figure": {"caption": "The worked example under the newest-first policy, one column per step: the block pool on top, the block tables below, titled with what happened in that step; colours follow the sequence ids.", "name": "fig-05-worked-newest"}}
names, snapshots = run_worked("newest")


def draw_worked_step(axes, manager, record):
    pool_ax, table_ax = axes
    draw_block_pool(pool_ax, manager, columns=6, title=f"step {record.step}")
    draw_block_tables(table_ax, manager)
    table_ax.set_title(describe(names, record), fontsize=8)


fig, axes = plt.subplots(
    2, len(snapshots), figsize=(1.6 * len(snapshots), 3.2), gridspec_kw={"height_ratios": [1, 2]}
)
for column, (manager, record) in enumerate(snapshots):
    draw_worked_step(axes[:, column], manager, record)
plt.show()
print("sequence ids:", {i: n for i, n in names.items()}, "(colours follow the ids)")

# %% [markdown]
# ## Step through a bigger run
#
# The burst from the top of the chapter, with preemption (`newest`). The slider picks a step and
# shows the pool, the {term}`block tables <block table>` and the queues after it.

# %%
burst_engine = small_engine("newest")
burst_snapshots = []
for prompt in burst:
    burst_engine.add_request(prompt, long_answers)
while burst_engine.has_unfinished():
    burst_engine.step()
    burst_snapshots.append((copy.deepcopy(burst_engine.manager), burst_engine.trace[-1]))


def draw_burst_step(fig, manager, record):
    pool_ax, table_ax = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1, 1.5]})
    draw_block_pool(pool_ax, manager, columns=6, title=f"step {record.step}")
    draw_block_tables(table_ax, manager)
    events = f"preempted {list(record.preempted)}  " if record.preempted else ""
    events += f"resumed {list(record.resumed)}  " if record.resumed else ""
    table_ax.set_title(f"{events}waiting {list(record.waiting)}", fontsize=8)


def burst_figure(step: int):
    fig = plt.figure(figsize=(9, 3.4))
    draw_burst_step(fig, *burst_snapshots[step - 1])
    return fig


# Every 20th step, and the first 12 steps where someone is preempted or resumed: each frame is a
# PNG embedded in the page, so all of them would make it megabytes.
first_preemption = next(r.step for _, r in burst_snapshots if r.preempted)
events = [r.step for _, r in burst_snapshots if r.preempted or r.resumed][:12]
frames = sorted(set(range(1, len(burst_snapshots) + 1, 20)) | set(events))
Stepper(burst_figure, steps=frames, start=first_preemption)

# %% [markdown]
# Side by side, four moments of the same run: just before the first preemption, at it, at the
# first resumption, and near the end.

# %% tags=["hide-input"] mystnb={"figure": {"caption": "Four moments of the burst with preemption: just before the first preemption, at it, at the first resumption, and near the end; each shows the pool, the block tables and the queues.", "name": "fig-05-burst-moments"}}
first_resume = next(r.step for _, r in burst_snapshots if r.resumed)
moments = [first_preemption - 1, first_preemption, first_resume, len(burst_snapshots) - 5]
fig = plt.figure(figsize=(10, 13))
for subfig, step in zip(fig.subfigures(len(moments), 1), moments):
    draw_burst_step(subfig, *burst_snapshots[step - 1])
plt.show()

# %% [markdown]
# ## Check: preemption never changes a token
#
# The load-bearing promise: a request's tokens are the same whether it was preempted five times or
# never — greedy and sampled. Run a seeded workload in a cache large enough that nobody is
# preempted, and in one small enough that many are:

# %%
mixed = [
    SamplingParams(max_tokens=int(n), temperature=0.8, top_p=0.95, seed=i, ignore_eos=True)
    for i, n in enumerate(rng.integers(40, 120, size=12))
]
roomy = small_engine("newest", num_blocks=512)
reference = [o.token_ids for o in roomy.generate(burst, mixed)]
assert not any(r.preempted for r in roomy.trace)
for policy in ["newest", "least_progressed"]:
    tight = small_engine(policy, num_blocks=16)
    assert [o.token_ids for o in tight.generate(burst, mixed)] == reference
    print(f"{policy}: {sum(len(r.preempted) for r in tight.trace)} preemptions, identical tokens")

# %% [markdown]
# And the one request that can never fit: 200 tokens of answer in a cache of 8 blocks of 16 (128
# tokens). It ends with `cache_full` and says why; the request beside it is served normally.

# %%
engine = small_engine("newest", num_blocks=8)
too_long, normal = engine.generate(
    ["ROMEO:\n", "JULIET:\n"],
    [
        SamplingParams(max_tokens=200, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=30, temperature=0),
    ],
)
print(too_long.finish_reason, "-", too_long.finish_message)
print(normal.finish_reason, repr(normal.text))

# %% [markdown]
# ## See: every request's timeline, per policy
#
# The burst again, one row per request: grey while waiting, hatched while prefilling, solid while
# decoding, crossed grey once preempted (and waiting again), back-hatched while recomputing.

# %% tags=["hide-input"] mystnb={"figure": {"caption": "Every request's timeline under each preemption policy, newest first (top) and least progressed (bottom): grey while waiting, hatched while prefilling, solid while decoding, crossed grey once preempted, back-hatched while recomputing.", "name": "fig-05-policy-timelines"}}
fig, axes = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
timelines = {}
for ax, policy in zip(axes, ["newest", "least_progressed"]):
    engine = small_engine(policy)
    engine.generate(burst, long_answers)
    timelines[policy] = [r.to_dict(timings=False) for r in engine.trace]
    preemptions = sum(len(r.preempted) for r in engine.trace)
    draw_gantt(ax, engine.trace, f"{policy}: {len(engine.trace)} steps, {preemptions} preemptions")
plt.tight_layout()
plt.show()
print(
    "the two policies produced the same schedule:",
    timelines["newest"] == timelines["least_progressed"],
)

# %% [markdown]
# Preempted requests are the late ones: they lose their blocks, wait at the front of the queue while
# the leaders finish, then recompute and catch up. If the two schedules above are the same, that is
# not a bug — the measurement below counts how rarely the two policies would choose differently.
#
# ## Measure: recompute overhead and throughput against cache size
#
# 16 requests with prompts of 16–240 bytes and 30–90 new tokens, a token budget of 64 per step (so
# long prompts are chunked), in caches of 20 to 40 blocks of 16 tokens. The **recompute overhead**
# is the tokens computed again after a preemption, as a share of the useful tokens (prompts plus
# outputs). A counting wrapper (`CountingPolicy`) also asks, at every preemption, whether the
# *other* policy would have chosen the same victim.

# %%
prompt_bytes = rng.integers(16, 241, size=16)
workload = [
    text[s : s + int(n)] for s, n in zip(rng.integers(0, len(text) - 300, size=16), prompt_bytes)
]
workload_params = [
    SamplingParams(max_tokens=int(n), temperature=0, ignore_eos=True)
    for n in rng.integers(30, 91, size=16)
]
measured = {}
for num_blocks in [20, 28, 40]:
    for name, policy in [("newest", newest_first), ("least_progressed", least_progressed)]:
        counter = CountingPolicy(policy)
        engine = small_engine(counter, num_blocks=num_blocks, max_num_batched_tokens=64)
        started = time.perf_counter()
        outs = engine.generate(workload, workload_params)
        seconds = time.perf_counter() - started
        useful = sum(len(o.prompt_token_ids) + len(o.token_ids) for o in outs)
        measured[num_blocks, name] = dict(
            steps=len(engine.trace),
            preemptions=counter.calls,
            disagreements=counter.disagreements,
            overhead=sum(r.recomputed_tokens for r in engine.trace) / useful,
            tokens=sum(len(o.token_ids) for o in outs),
            seconds=seconds,
        )
print(
    f"{'blocks':>6} {'policy':>16} {'steps':>6} {'preemptions':>11} {'other would differ':>18} "
    f"{'recompute overhead':>18}"
)
for (num_blocks, name), m in measured.items():
    print(
        f"{num_blocks:6d} {name:>16} {m['steps']:6d} {m['preemptions']:11d} {m['disagreements']:18d} "
        f"{m['overhead']:18.1%}"
    )

# %% mystnb={"figure": {"caption": "Both policies against the number of cache blocks: recomputed tokens per useful token (left) and throughput in tokens per second on the machine that built this page (right).", "name": "fig-05-overhead-throughput"}}
# NBVAL_IGNORE_OUTPUT
for (num_blocks, policy), m in measured.items():
    print(f"{num_blocks:3d} blocks, {policy:>16}: {m['tokens'] / m['seconds']:6.0f} tokens/s")
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.2))
for color, policy in enumerate(["newest", "least_progressed"]):
    sizes = sorted({b for b, _ in measured})
    ax1.plot(
        sizes,
        [measured[b, policy]["overhead"] for b in sizes],
        "o-",
        color=sequence_color(color),
        label=policy,
    )
    ax2.plot(
        sizes,
        [measured[b, policy]["tokens"] / measured[b, policy]["seconds"] for b in sizes],
        "o-",
        color=sequence_color(color),
        label=policy,
    )
ax1.set_xlabel("cache blocks (16 tokens each)")
ax1.set_ylabel("recomputed / useful tokens")
ax2.set_xlabel("cache blocks (16 tokens each)")
ax2.set_ylabel("tokens / s (this machine)")
ax1.legend()
plt.show()

# %% [markdown]
# A small cache costs twice: every preemption recomputes a sequence, and fewer sequences fit in a
# step. The "other would differ" column explains why the two policies' rows look so alike: with
# first-come-first-served admission and one token per step for everyone, the sequence admitted last
# is nearly always also the one with the fewest output tokens. The policies part only when progress
# is uneven — a resumed sequence re-admitted with many tokens, a long prompt still being prefilled
# in chunks — which is exactly where "fewest *output* tokens" and "least *computed*" stop meaning
# the same thing.
#
# An overhead above 100 % means sequences were recomputed more than once. In a cache this small a
# readmitted sequence's prefill takes every block the decodes will need a few steps later, so it is
# preempted again: *thrashing*. vLLM's V0 block manager damped it with a *watermark* — admit only
# while some blocks stay free for the running batch to grow into (exercise 4); V1 dropped the
# watermark and preempts the newest running request when one finds no block.
#
# ## Exercises
#
# Solutions live between `### BEGIN SOLUTION` and `### END SOLUTION` in
# `src/minivllm/sched/preemption.py` (ch05.1) and `src/minivllm/sched/scheduler.py` (ch05.2); run
# one exercise's tests with `pytest tests --exercise ch05.1`.
#
# 1. **ch05.1 — least progressed.** Return the candidate with the fewest output tokens; on a tie,
#    the one with the higher `seq_id`. The tests pin the worked example's victims.
#
#    *Hint:* A single `min` with a tuple key compares the fields in order; choose the second field
#    so that a higher `seq_id` counts as smaller. Do not rely on the candidates' order.
# 2. **ch05.2 — preempt.** In `Scheduler.preempt`, give back every block of the victim, take it out
#    of the running list, reset what it has computed (its tokens stay) and put it at the *front* of
#    the waiting queue. The tests check output identity under heavy preemption.
#
#    *Hint:* The block manager frees all of a sequence's blocks in one call. "Reset what it has
#    computed" is the status back to `Status.WAITING` and `num_computed_tokens` to 0, so its next
#    admission prefills prompt and output again; `waiting` is a deque, with `appendleft`.
# 3. *(Explore, no test.)* Write a third policy — *longest remaining* (evict the sequence furthest
#    from its `max_tokens`) — pass the function as `SchedulerConfig(preemption=...)`, and compare
#    its {term}`recompute overhead` with the two above.
#
#    *Hint:* A victim policy is any function from the candidate list to one sequence, like
#    `least_progressed`; the distance is `params.max_tokens` minus `num_output_tokens`. Give it a
#    fixed tie-break, and compare on the same workload and cache size.
# 4. *(Explore, no test.)* Add a watermark to `Scheduler._admit`: admit only while, after the
#    allocation, at least one free block per running decode would remain. Rerun the measurement: how
#    do the preemption count, the recompute overhead and the steps move, and at what cache size does
#    the watermark start to cost more than it saves?
#
#    *Hint:* Check just before `allocate_slots` and `break` like the other refusals, so nobody
#    overtakes the head of the queue; `manager.blocks_needed` and `manager.num_free` give the blocks
#    the admission takes and those left. One free block per decode lets each cross into a new block
#    next step.

# %% [markdown]
# ## Summary
#
# When the cache runs out, the engine takes blocks back: it preempts a running sequence, frees its
# blocks, and later recomputes its cache from its tokens — the sequence continues with exactly the
# tokens it would have produced, which the check above verifies. The price is recomputation, and in
# a cache that is too small, thrashing; the recompute-overhead measurement shows where that starts.
#
# **The same idea in vLLM.** In `vllm/v1/core/sched/scheduler.py`, `Scheduler.schedule` preempts
# the last request in its running queue when `KVCacheManager.allocate_slots` finds no block for a
# running one, and puts it back at the front of the waiting queue to be recomputed. nano-vllm does
# the same in `nanovllm/engine/scheduler.py` (`preempt`).
