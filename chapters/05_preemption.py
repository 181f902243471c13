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
# - **Runs in:** about 1 min 40 s, start to end (`make book` on a quiet 2-core AMD EPYC).
# :::
#
# Chapter 04's scheduler admits a request when there are blocks for its prompt. It cannot know how
# long the answer will be, so it bets that the running sequences will find blocks as they grow. With
# a big cache the bet is safe. With a small one, or a burst of long answers, every block ends up
# held by a sequence that needs one more — and nobody can move. This chapter makes the engine take a
# block back: it **preempts** a running sequence, throws its {term}`KV cache` away, and recomputes
# it later (recomputation, one of the two recovery policies of {cite}`kwon2023pagedattention`; the
# other swaps the blocks out to host memory).

# %% tags=["remove-input"] mystnb={"image": {"alt": "The roadmap of the engine, chapter 05 highlighted: the chapters before it built, those after it to come"}}
from minivllm.book.figures.roadmap import roadmap

roadmap(5)

# %%
import copy
import time

import matplotlib.pyplot as plt
import numpy as np
import torch

from minivllm import EngineConfig, LLMEngine, SamplingParams, SchedulerConfig
from minivllm.book import sequence_color, show, use_book_style
from minivllm.book.figures.blocks import block_legend, draw_block_pool, draw_block_tables
from minivllm.book.figures.preemption import draw_step_pool
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
    1, 2, figsize=(7.5, 3.6), gridspec_kw={"width_ratios": [1, 1.4]}, layout="constrained"
)
centres = draw_block_pool(pool_ax, stuck.manager, columns=6, title="the pool, deadlocked")
draw_block_tables(table_ax, stuck.manager)
block_legend(fig, tables=True, loc="outside lower center")
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
# scheduler does the same inside its `schedule()`, in `vllm/v1/core/sched/scheduler.py`.) This loop
# is the chapter's core exercise, ch05.3: its solution is folded.

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
burst_traces = {}  # policy -> the run's trace, for the timelines further down
for policy in ["newest", "least_progressed"]:
    engine = small_engine(policy)
    outs = engine.generate(burst, long_answers)
    burst_traces[policy] = engine.trace
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
# preempted, resumed or finished, and what the queues and the pool look like after it. At a
# preemption it also lists the candidates the victim policy chose from, with their output tokens.

# %%
WORKED = {  # request id: (name, arrival step, prompt ids, max_tokens)
    0: ("A", 0, [256, 65, 66], 2),
    1: ("B", 2, [256], 3),
    2: ("C", 1, [256, 67, 68], 3),
}
names = {i: name for i, (name, *_) in WORKED.items()}


def watched(policy, choices):
    """The victim policy `policy`, noting each choice: the candidates' output tokens, the victim."""

    def choose(candidates):
        victim = policy(candidates)
        choices.append(({c.seq_id: c.num_output_tokens for c in candidates}, victim.seq_id))
        return victim

    return choose


def run_worked(policy):
    """Run the worked example. Returns the trace, the victim policy's choices, and a copy of the
    pool as each step's forward pass saw it (after `schedule()`, before finished sequences let go
    of their blocks)."""
    choices, pools = [], []
    engine = small_engine(
        watched(policy, choices),
        num_blocks=6,
        block_size=1,
        max_num_batched_tokens=4,
        max_num_seqs=4,
    )
    schedule = engine.scheduler.schedule

    def schedule_and_copy_pool():
        plan = schedule()
        pools.append(copy.deepcopy(engine.manager))
        return plan

    engine.scheduler.schedule = schedule_and_copy_pool  # a book-only hook: look, don't change
    for step in range(40):
        for request_id, (_, arrival, ids, max_tokens) in WORKED.items():
            if arrival == step:
                params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
                engine.add_request(ids, params, request_id=request_id)
        if not engine.has_unfinished():
            break
        engine.step()
    return engine.trace, choices, pools


def describe(record):
    said = [f"admit {names[i]}" for i in record.admitted if i not in record.resumed]
    said += [f"resume {names[i]}" for i in record.resumed]
    said += [f"preempt {names[i]}" for i in record.preempted]
    said += [f"finish {names[i]}" for i, _ in record.finished]
    return ", ".join(said) or "decode"


worked = {policy: run_worked(policy) for policy in (newest_first, least_progressed)}
for policy, (trace, choices, _) in worked.items():
    print(f"{policy.__name__}:")
    pending = iter(choices)
    for record in trace:
        running = " ".join(names[i] for i in record.running) or "-"
        waiting = " ".join(names[i] for i in record.waiting) or "-"
        print(
            f"  step {record.step}: {describe(record):22s} running [{running}] "
            f"waiting [{waiting}] free {record.blocks_free}"
        )
        for _ in record.preempted:
            candidates, victim = next(pending)
            among = ", ".join(f"{names[i]} {n} out" for i, n in candidates.items())
            print(f"          candidates {among} -> victim {names[victim]}")
    print(f"  {len(trace)} steps, {sum(r.recomputed_tokens for r in trace)} tokens recomputed")

# %% [markdown]
# Read the two logs side by side. Until the pool is full they are the same run. In the step after
# it filled, C needs a block for its next token and none is free, so the policy picks a victim
# among the running sequences — and here the policies part ways. Look at the candidates line: C
# and B have the same number of output tokens. Newest-first takes B, admitted after C in the same
# step. Least-progressed sees a tie and breaks it towards the higher id, which is C — the very
# sequence asking for room, so C preempts itself. Either way the victim loses all its blocks and
# waits at the front of the queue; once the other has finished, it is admitted again, prefills
# prompt and output in one {term}`prefill` (in chunks when they exceed the budget of 4), and
# finishes. Which victim is cheaper shows in the last line of each log: steps and tokens
# recomputed.
#
# Here is the run under newest-first around its preemption, one panel per step, read left to
# right and then down:

# %% tags=["hide-input"] mystnb={"figure": {"caption": "The worked example under newest-first, the two steps before its preemption, the preemption, and the step after. Each panel shows the pool of 6 one-token blocks as that step's forward pass used it (labelled with the request holding each block), what happened to blocks in the step, and the queues after it. In the preemption step (shaded) B's two blocks are outlined in its colour: one is free again, C takes the other; B is back in the waiting queue, and in the next step it prefills its prompt and output again.", "name": "fig-05-worked-newest"}}
trace, _, pools = worked[newest_first]
preempting = next(i for i, r in enumerate(trace) if r.preempted)
fig, axes = plt.subplots(2, 2, figsize=(7.5, 5.4))
for ax, index in zip(axes.flat, range(preempting - 2, preempting + 2)):
    draw_step_pool(ax, pools[index], trace[index], names, pools[index - 1], describe(trace[index]))
plt.show()

# %% [markdown]
# ## Step through a bigger run
#
# The burst from the top of the chapter, with preemption (`newest`). The slider picks a step and
# shows the pool, the {term}`block tables <block table>` and the queues after it.

# %%
burst_engine = small_engine("newest")
burst_snapshots = []
progress = []  # after each step: the running sequences' output tokens, in admission order
for prompt in burst:
    burst_engine.add_request(prompt, long_answers)
while burst_engine.has_unfinished():
    burst_engine.step()
    burst_snapshots.append((copy.deepcopy(burst_engine.manager), burst_engine.trace[-1]))
    progress.append([seq.num_output_tokens for seq in burst_engine.scheduler.running])


# Every frame's tables as wide as the run's longest table and as tall as its most tables, and the
# two panels as wide as their cells: one cell size in both panels and every frame, labels 10 pt.
widest = max(len(t.blocks) for manager, _ in burst_snapshots for t in manager.tables.values())
most = max(len(manager.tables) for manager, _ in burst_snapshots)


def draw_burst_step(fig, manager, record):
    pool_ax, table_ax = fig.subplots(1, 2, gridspec_kw={"width_ratios": [6.1, widest + 1.6]})
    draw_block_pool(pool_ax, manager, columns=6, title=f"step {record.step}", label_points=10)
    draw_block_tables(table_ax, manager, width=widest, rows=most, label_points=10)
    events = f"preempted {list(record.preempted)}  " if record.preempted else ""
    events += f"resumed {list(record.resumed)}  " if record.resumed else ""
    table_ax.set_title(f"{events}waiting {list(record.waiting)}", fontsize=10)


def burst_figure(step: int):
    fig = plt.figure(figsize=(7.5, 4.1), layout="constrained")
    draw_burst_step(fig, *burst_snapshots[step - 1])
    block_legend(fig, tables=True, loc="outside lower center")
    return fig


# Every 20th step, and the first 12 steps where someone is preempted or resumed: each frame is a
# PNG embedded in the page, so all of them would make it megabytes.
first_preemption = next(r.step for _, r in burst_snapshots if r.preempted)
events = [r.step for _, r in burst_snapshots if r.preempted or r.resumed][:12]
frames = sorted(set(range(1, len(burst_snapshots) + 1, 20)) | set(events))

# %% mystnb={"figure": {"caption": "Step through the burst under newest-first preemption, every 20th step and the first steps that preempt or resume a request: the pool (left), the block tables (right), and above them the requests preempted or resumed in the step and the waiting queue after it. Drag the slider, or step with the buttons or the arrow keys.", "name": "fig-05-burst-stepper"}}
Stepper(burst_figure, steps=frames, start=first_preemption)

# %% [markdown]
# Side by side, four moments of the same run: just before the first preemption, at it, at the
# first resumption, and near the end.

# %% tags=["hide-input"] mystnb={"figure": {"caption": "Four moments of the burst with preemption: just before the first preemption, at it, at the first resumption, and near the end; each shows the pool, the block tables and the queues.", "name": "fig-05-burst-moments"}}
first_resume = next(r.step for _, r in burst_snapshots if r.resumed)
moments = [first_preemption - 1, first_preemption, first_resume, len(burst_snapshots) - 5]
fig = plt.figure(figsize=(7.5, 15), layout="constrained")
for subfig, step in zip(fig.subfigures(len(moments), 1), moments):
    draw_burst_step(subfig, *burst_snapshots[step - 1])
block_legend(fig, tables=True, loc="outside lower center")
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
# ## See: every request's timeline
#
# The burst again, under newest-first, one row per request: grey while waiting, hatched while
# prefilling, solid while decoding, crossed grey once preempted (and waiting again), back-hatched
# while recomputing.

# %% tags=["hide-input"] mystnb={"figure": {"caption": "Every request's timeline in the burst under newest-first: grey while waiting, hatched while prefilling, solid while decoding, crossed grey once preempted, back-hatched while recomputing.", "name": "fig-05-burst-timeline"}}
fig, ax = plt.subplots(figsize=(7.5, 4.2))
trace = burst_traces["newest"]
preemptions = sum(len(r.preempted) for r in trace)
draw_gantt(ax, trace, f"newest first: {len(trace)} steps, {preemptions} preemptions")
ax.tick_params(labelsize=10)
plt.show()

# %% [markdown]
# Preempted requests are the late ones: they lose their blocks, wait at the front of the queue while
# the leaders finish, then recompute and catch up.
#
# ### Does the victim policy matter?
#
# Not on this burst. Least-progressed makes the very same choice at every preemption:

# %%
same_schedule = [r.to_dict(timings=False) for r in burst_traces["newest"]] == [
    r.to_dict(timings=False) for r in burst_traces["least_progressed"]
]
by_progress = all(a >= b for step in progress for a, b in zip(step, step[1:]))
print("newest-first and least-progressed gave the burst the same schedule:", same_schedule)
print("after every step, output tokens never increase along the running list:", by_progress)

# %% [markdown]
# The second line is the reason. The running list is kept in admission order; admission is first
# come first served; every running sequence gains one token per step; and a preempted sequence waits
# at the front of the queue while those still running keep decoding, so when it is admitted again
# it is behind all of them. The sequence admitted last is therefore always one with the fewest
# output tokens, and the two policies can only part on a **tie** — equal output tokens, with the
# newest not the one with the highest id. With ids handed out in arrival order even that cannot
# happen. The worked example was built to have one: B got id 1 but arrived after C, id 2. Here are
# its two schedules:

# %% tags=["hide-input"] mystnb={"figure": {"caption": "The worked example under each policy. Newest-first (top) preempts B, which recomputes in one step; least-progressed (bottom) breaks the tie between B and C towards the higher id and preempts C, whose prompt and output exceed one step's token budget, so it needs two steps to come back. Grey: waiting; hatched: prefill; solid: decode; crossed grey: preempted; back-hatched: recompute.", "name": "fig-05-policy-timelines"}}
fig, axes = plt.subplots(2, 1, figsize=(7.5, 3.8), sharex=True)
for ax, (policy, (trace, choices, _)) in zip(axes, worked.items()):
    recomputed = sum(r.recomputed_tokens for r in trace)
    victims = " ".join(names[victim] for _, victim in choices)
    title = f"{policy.__name__}: preempts {victims}, {len(trace)} steps, {recomputed} recomputed"
    draw_gantt(ax, trace, title)
    ax.set_yticks(ax.get_yticks(), [names[int(t.get_text()[4:])] for t in ax.get_yticklabels()])
    ax.tick_params(labelsize=11)
    ax.title.set_fontsize(11)
plt.tight_layout()
plt.show()

# %% [markdown]
# Anything that lets progress drift from admission order would make the choice matter more: a step
# that gives some sequences several tokens, or requests admitted out of order by priority. The
# measurement below asks, at every preemption of a more varied workload, whether the other policy
# would have chosen a different victim.
#
# ## Measure: recompute overhead and throughput against cache size
#
# 16 requests with prompts of 16–240 bytes and 30–90 new tokens, a token budget of 64 per step (so
# long prompts are chunked), in caches of 20 to 40 blocks of 16 tokens, under newest-first. The
# **recompute overhead** is the tokens computed again after a preemption, as a share of the useful
# tokens (prompts plus outputs). A counting wrapper (`CountingPolicy`) asks at every preemption
# whether least-progressed would have chosen another victim, and a second run under
# least-progressed checks that schedule and tokens come out the same.

# %%
prompt_bytes = rng.integers(16, 241, size=16)
workload = [
    text[s : s + int(n)] for s, n in zip(rng.integers(0, len(text) - 300, size=16), prompt_bytes)
]
workload_params = [
    SamplingParams(max_tokens=int(n), temperature=0, ignore_eos=True)
    for n in rng.integers(30, 91, size=16)
]


def schedule_of(engine):
    return [r.to_dict(timings=False) for r in engine.trace]


measured = {}
for num_blocks in [20, 28, 40]:
    counter = CountingPolicy(newest_first)
    engine = small_engine(counter, num_blocks=num_blocks, max_num_batched_tokens=64)
    started = time.perf_counter()
    outs = engine.generate(workload, workload_params)
    seconds = time.perf_counter() - started
    other = small_engine(least_progressed, num_blocks=num_blocks, max_num_batched_tokens=64)
    other_outs = other.generate(workload, workload_params)
    assert [o.token_ids for o in other_outs] == [o.token_ids for o in outs]  # greedy: same tokens
    useful = sum(len(o.prompt_token_ids) + len(o.token_ids) for o in outs)
    recomputed = sum(r.recomputed_tokens for r in engine.trace)
    measured[num_blocks] = dict(
        steps=len(engine.trace),
        preemptions=counter.calls,
        disagreements=counter.disagreements,
        same_schedule=schedule_of(other) == schedule_of(engine),
        twice=sum(o.num_preemptions > 1 for o in outs),
        per_preemption=recomputed / max(counter.calls, 1),
        overhead=recomputed / useful,
        tokens=sum(len(o.token_ids) for o in outs),
        seconds=seconds,
    )
print(
    f"{'blocks':>6} {'steps':>5} {'preemptions':>11} {'other differs':>13} {'same schedule':>13} "
    f"{'preempted 2+':>12} {'recomputed/preemption':>21} {'overhead':>8}"
)
for num_blocks, m in measured.items():
    print(
        f"{num_blocks:6d} {m['steps']:5d} {m['preemptions']:11d} {m['disagreements']:13d} "
        f"{str(m['same_schedule']):>13} {m['twice']:12d} {m['per_preemption']:21.0f} "
        f"{m['overhead']:8.1%}"
    )

# %% mystnb={"figure": {"caption": "Newest-first against the number of cache blocks: recomputed tokens per useful token (left) and throughput in tokens per second on the machine that built this page (right). Least-progressed gives the same schedule at every size (the table above), so only its timing noise would differ.", "name": "fig-05-overhead-throughput"}}
# NBVAL_IGNORE_OUTPUT
for num_blocks, m in measured.items():
    print(f"{num_blocks:3d} blocks: {m['tokens'] / m['seconds']:6.0f} tokens/s")
sizes = sorted(measured)
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(7.5, 3.0))
ax1.plot(sizes, [measured[b]["overhead"] for b in sizes], "o-", color=sequence_color(0))
ax2.plot(
    sizes,
    [measured[b]["tokens"] / measured[b]["seconds"] for b in sizes],
    "o-",
    color=sequence_color(0),
)
ax1.set_xlabel("cache blocks (16 tokens each)")
ax1.set_ylabel("recomputed / useful tokens")
ax2.set_xlabel("cache blocks (16 tokens each)")
ax2.set_ylabel("tokens / s (this machine)")
plt.tight_layout()
plt.show()

# %% [markdown]
# A small cache costs twice: every preemption recomputes a sequence, and fewer sequences fit in a
# step. Preemptions fall as the cache grows; the overhead need not fall with them, since fewer
# preemptions can each throw away more (the recomputed-per-preemption column). The "other differs"
# column counts the preemptions at which least-progressed would have picked another victim:
# prompts of different lengths, chunked prefill and long recomputes change nothing in the argument
# above, and the runs under least-progressed come out step for step the same.
#
# An overhead above 100 % means more tokens were computed again than the workload holds: some
# sequences were recomputed more than once (the "preempted 2+" column counts them). In a cache this
# small a readmitted sequence's prefill takes blocks the decodes will need a few steps later, so it
# is preempted again: *thrashing*. vLLM's V0 block manager damped it with a *watermark* — admit
# only while some blocks stay free for the running batch to grow into (exercise 5); V1 dropped the
# watermark and preempts the newest running request when one finds no block.
#
# ## Exercises
#
# Solutions live between `### BEGIN SOLUTION` and `### END SOLUTION` in
# `src/minivllm/sched/preemption.py` (ch05.3, ch05.1) and `src/minivllm/sched/scheduler.py`
# (ch05.2); run one exercise's tests with `pytest tests --exercise ch05.3`.
#
# 1. **ch05.3 — make room** (this chapter's core). Write `RecomputePreemption.make_room`: ask
#    `allocate()` for the sequence's slots; while it answers 0 and `seq` is not alone in the
#    running batch, let `self.victim_policy` choose a victim among the running sequences not in
#    `served` (in the running list's order, which is admission order), preempt it with
#    `scheduler.preempt`, and ask again. Stop as soon as the sequence is granted slots, when it is
#    alone (the scheduler then ends it as `"cache_full"`), or when it was itself the victim (it
#    waits now: do not ask for its slots again). Return the tokens granted (0 if none) and the
#    victims in the order they were preempted. The tests call it with a counted `allocate` —
#    asked once, then once after each victim — and check the candidates offered, the victims and
#    the queues; the worked example, the burst and a hypothesis test over tiny caches then run it
#    inside the scheduler. Three hints, from a nudge to nearly the answer, are folded below the
#    list.
# 2. **ch05.1 — least progressed.** Return the candidate with the fewest output tokens; on a tie,
#    the one with the higher `seq_id`. The tests pin the worked example's victims.
#
#    *Hint:* A single `min` with a tuple key compares the fields in order; choose the second field
#    so that a higher `seq_id` counts as smaller. Do not rely on the candidates' order.
# 3. **ch05.2 — preempt.** In `Scheduler.preempt`, give back every block of the victim, take it out
#    of the running list, reset what it has computed (its tokens stay) and put it at the *front* of
#    the waiting queue. The tests check output identity under heavy preemption.
#
#    *Hint:* The block manager frees all of a sequence's blocks in one call. "Reset what it has
#    computed" is the status back to `Status.WAITING` and `num_computed_tokens` to 0, so its next
#    admission prefills prompt and output again; `waiting` is a deque, with `appendleft`.
# 4. *(Explore, no test.)* Write a third policy — *longest remaining* (evict the sequence furthest
#    from its `max_tokens`) — pass the function as `SchedulerConfig(preemption=...)`, and compare
#    its {term}`recompute overhead` with the two above.
#
#    *Hint:* A victim policy is any function from the candidate list to one sequence, like
#    `least_progressed`; the distance is `params.max_tokens` minus `num_output_tokens`. Give it a
#    fixed tie-break, and compare on the same workload and cache size.
# 5. *(Explore, no test.)* Add a watermark to `Scheduler._admit`: admit only while, after the
#    allocation, at least one free block per running decode would remain. Rerun the measurement: how
#    do the preemption count, the recompute overhead and the steps move, and at what cache size does
#    the watermark start to cost more than it saves?
#
#    *Hint:* Check just before `allocate_slots` and `break` like the other refusals, so nobody
#    overtakes the head of the queue; `manager.blocks_needed` and `manager.num_free` give the blocks
#    the admission takes and those left. One free block per decode lets each cross into a new block
#    next step.

# %% [markdown]
# The hints for ch05.3, the chapter's core, are folded: open one at a time.
#
# :::{admonition} Hint 1 for ch05.3 — a nudge
# :class: dropdown
# It is one loop around `allocate()`: ask, and while the answer is no and someone else could give
# blocks back, free one victim's blocks and ask again. The victim policy only chooses; preempting
# is the scheduler's move, and its running list shrinks by one each time.
# :::
#
# :::{admonition} Hint 2 for ch05.3 — the approach
# :class: dropdown
# Keep the latest answer of `allocate()` and a list of victims. The loop's condition has two
# parts: nothing granted yet, and more than one sequence running. In the body, build the
# candidates from `scheduler.running`, leaving out every sequence in `served`, hand them to the
# victim policy, preempt its choice and record it. If the choice is `seq` itself, leave the loop
# without asking again; otherwise ask again. Return the pair.
# :::
#
# :::{admonition} Hint 3 for ch05.3 — nearly there
# :class: dropdown
# Start with `granted = allocate()` and `victims = []`. Loop `while` `granted` is 0 and
# `len(scheduler.running)` exceeds 1: the victim is the policy applied to the list of running
# sequences that are `not in served`; call `scheduler.preempt` on it and append it to `victims`;
# `break` if it `is seq`, else set `granted` to a fresh `allocate()`. After the loop, return
# `granted` and `victims`.
# :::

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
