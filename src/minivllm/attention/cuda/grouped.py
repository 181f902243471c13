"""v3: grouped flash-decoding, one pass over the context per K/V head (chapter 08).

v1 and v2 (`kernels.py`) are latency-bound: per token a dependent block-table load, then the key
load, then a five-shuffle reduction; a second, serial walk for the values; and each query head of a
grouped-query (GQA) group re-reads the same keys and values. v3 changes four things:

* **One thread block per (sequence, K/V head, partition)** serves the whole query-head group: each
  K/V row is read once for all `group` heads that share it.
* **The block table is staged in shared memory** once per block, so a token's address costs a
  shared-memory load, not a dependent global one.
* **One pass with an online softmax** (flash-decoding): each team of lanes keeps a running max, a
  running sum and a running output per query head, rescaled when the max grows; keys and values of
  a token are loaded together, and there is no scores array and no second walk.
* **Several tokens in flight per warp**: a warp is split into teams of `lanes_per_token` lanes;
  each team takes its own token, its lanes split head_dim (lane j reads elements j, j + lanes, ...:
  neighbouring lanes read neighbouring elements, coalesced), and a reduction needs only
  log2(lanes_per_token) shuffles.

At the end the teams' states merge by the log-sum-exp rule (through shared memory: one barrier),
and the block writes its partition's normalised output, max and sum -- the layout of
v2's partials, so `merge_partitions` combines several partitions (split-KV, for few and long
sequences). With a single partition that output *is* the attention.

The kernel is compiled per (head_dim, group, lanes_per_token, block_size), as vLLM instantiates a
C++ template per head and block size: the loops over head_dim and over the group have constant trip
counts, so the per-lane query, accumulators and K/V elements live in registers (no local memory),
and a token's block and slot are a shift and a mask. The caches arrive flattened, one offset per row
computed from those constants: numba's 4-D indexing keeps each array's shape and strides live in
registers: CUDA 13.0's ptxas for sm_90 (fp16, head_dim 128, group 4) gave an earlier draft of this
kernel 158 registers with 4-D caches and 128 flat -- a compiler count, not a GPU measurement.
"""

from __future__ import annotations

import functools
import math

from numba import cuda, float32, int32

from minivllm.attention.cuda.simulator import SIMULATOR, WARP_SIZE

FULL_MASK = 0xFFFFFFFF
# float32 constants: a float64 one (0.0, -math.inf) would pull the arithmetic around it into
# double precision, which a GPU runs many times slower and in twice the registers.
NEG_INF, ZERO = float32(-math.inf), float32(0.0)


def default_lanes_per_token(head_dim: int) -> int:
    """Lanes that share one token: enough that each lane holds 8 elements of head_dim (a 16-byte
    stretch of an fp16 row per team-mate), at most a warp."""
    lanes = 1
    while lanes < WARP_SIZE and head_dim // (2 * lanes) >= 8 and head_dim % (2 * lanes) == 0:
        lanes *= 2
    return lanes


def shared_words(
    table_entries: int, head_dim: int, group: int, threads: int, lanes_per_token: int
) -> int:
    """4-byte words of dynamic shared memory one v3 block needs: its block-table entries, then per
    team of lanes and per query head a (max, sum, output row) state for the final merge."""
    teams = threads // lanes_per_token
    return table_entries + teams * group * (head_dim + 2)


@functools.cache
def grouped_decode_kernel(
    head_dim: int,
    group: int,
    lanes_per_token: int,
    block_size: int,
    max_registers: int | None = None,
):
    """The v3 kernel for one (head_dim, group, lanes_per_token, block_size); compiled once, on
    first launch. Grid (sequences, K/V heads, partitions); see `launch.grouped_paged_attention`.
    `max_registers` caps the registers per thread (ptxas spills the rest to local memory): fewer
    registers, more resident warps to hide memory latency -- an experiment of
    `benchmarks/paged_attention.py` (the simulator has no registers and ignores it)."""
    lanes = lanes_per_token
    per_lane = head_dim // lanes  # elements of a row each lane holds
    teams_per_warp = WARP_SIZE // lanes
    state_width = head_dim + 2  # max, sum, output row
    # A local array's length must be a constant (a closure variable), not an expression.
    group_per_lane = group * per_lane

    options = {} if SIMULATOR or max_registers is None else {"max_registers": max_registers}

    @cuda.jit(**options)
    def paged_attention_v3(
        partial_out,  # [seqs, heads, partitions, head_dim]: each partition's normalised output
        max_logits,  # [seqs, heads, partitions]
        exp_sums,  # [seqs, heads, partitions]
        q,  # [seqs, heads, head_dim]
        key_cache,  # [num_blocks * block_size * kv_heads * head_dim]: the cache, flattened
        value_cache,
        block_tables,  # [seqs, max_blocks] int32
        context_lens,  # [seqs] int32
        max_context_len,  # what the host promised: no context is longer
        scale,
        partition_size,  # tokens per partition, a multiple of block_size
    ):
        seq, kv_head, part = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
        tid, threads = cuda.threadIdx.x, cuda.blockDim.x
        warp, lane = tid // WARP_SIZE, tid % WARP_SIZE
        num_warps = threads // WARP_SIZE
        team_lane = lane % lanes  # this lane's slice of head_dim: team_lane + i * lanes
        # Which token of each round this lane's team takes.
        team = warp * teams_per_warp + lane // lanes
        teams = num_warps * teams_per_warp
        num_kv_heads = cuda.gridDim.y
        first_head = kv_head * group
        length = context_lens[seq]
        if length < 1 or length > max_context_len:
            # The host's promise is broken: the table staging below would overrun shared memory.
            # No read; NaN rows (with sum 1 and max 0 so that the merge passes the NaN on).
            for index in range(tid, group * head_dim, threads):
                g, d = index // head_dim, index % head_dim
                partial_out[seq, first_head + g, part, d] = math.nan
                if d == 0:
                    max_logits[seq, first_head + g, part] = 0.0
                    exp_sums[seq, first_head + g, part] = 1.0
            return
        start = part * partition_size
        end = min(start + partition_size, length)
        if start >= end:  # the context is shorter than this partition: it weighs nothing
            for g in range(tid, group, threads):
                max_logits[seq, first_head + g, part] = -math.inf
                exp_sums[seq, first_head + g, part] = 0.0
            return

        # The partition's slice of the block table, into shared memory once. Dynamic shared arrays
        # all start at the same address: the int32 table first, float32 states after it.
        first_block = start // block_size
        table_entries = partition_size // block_size
        table = cuda.shared.array(0, dtype=int32)
        states = cuda.shared.array(0, dtype=float32)
        for i in range(tid, (end - 1) // block_size - first_block + 1, threads):
            table[i] = block_tables[seq, first_block + i]

        # This lane's share of the group's queries (pre-scaled) and its running state per head.
        q_part = cuda.local.array(group_per_lane, float32)
        out_part = cuda.local.array(group_per_lane, float32)
        run_max = cuda.local.array(group, float32)
        run_sum = cuda.local.array(group, float32)
        score = cuda.local.array(group, float32)
        key_part = cuda.local.array(per_lane, float32)
        value_part = cuda.local.array(per_lane, float32)
        for g in range(group):
            for i in range(per_lane):
                q_part[g * per_lane + i] = float32(q[seq, first_head + g, team_lane + i * lanes])
                q_part[g * per_lane + i] *= float32(scale)
                out_part[g * per_lane + i] = 0.0
            run_max[g] = NEG_INF
            run_sum[g] = ZERO
        cuda.syncthreads()  # the table is staged

        # One pass: each round, every team takes one token. Every lane runs every round, so the
        # shuffles stay uniform; a team past the end adds nothing.
        for first in range(start, end, teams):
            t = first + team
            live = t < end
            if live:  # key and value rows issued together: two loads in flight per lane
                block = table[t // block_size - first_block]
                slot = t % block_size
                row = ((block * block_size + slot) * num_kv_heads + kv_head) * head_dim
                for i in range(per_lane):
                    key_part[i] = float32(key_cache[row + team_lane + i * lanes])
                    value_part[i] = float32(value_cache[row + team_lane + i * lanes])
            for g in range(group):
                dot = ZERO
                if live:
                    for i in range(per_lane):
                        dot += q_part[g * per_lane + i] * key_part[i]
                offset = lanes // 2
                while offset > 0:  # the team's lanes add their pieces
                    dot += cuda.shfl_xor_sync(FULL_MASK, dot, offset)
                    offset //= 2
                score[g] = dot
            # EXERCISE ch08.3: online softmax -- fold score[g] into run_max, run_sum and out_part
            ### BEGIN SOLUTION
            if live:
                for g in range(group):
                    # Online softmax: a new max rescales what was summed so far.
                    new_max = max(run_max[g], score[g])
                    rescale = math.exp(run_max[g] - new_max)
                    weight = math.exp(score[g] - new_max)
                    run_sum[g] = run_sum[g] * rescale + weight
                    for i in range(per_lane):
                        k = g * per_lane + i
                        out_part[k] = out_part[k] * rescale + weight * value_part[i]
                    run_max[g] = new_max
            ### END SOLUTION

        # Merge the teams by the log-sum-exp rule: each posts its state per query head to shared
        # memory (one barrier, where shuffles would take a round per halving), then each thread
        # combines one (head, element). A team that saw no token has max -inf and weighs nothing.
        for g in range(group):
            base = table_entries + (team * group + g) * state_width
            if team_lane == 0:
                states[base] = run_max[g]
                states[base + 1] = run_sum[g]
            for i in range(per_lane):
                states[base + 2 + team_lane + i * lanes] = out_part[g * per_lane + i]
        cuda.syncthreads()
        for index in range(tid, group * head_dim, threads):
            g, d = index // head_dim, index % head_dim
            total_max = NEG_INF
            for other in range(teams):
                total_max = max(
                    total_max, states[table_entries + (other * group + g) * state_width]
                )
            total_sum, total = ZERO, ZERO
            for other in range(teams):
                base = table_entries + (other * group + g) * state_width
                if states[base] > NEG_INF:
                    weight = math.exp(states[base] - total_max)
                    total_sum += states[base + 1] * weight
                    total += states[base + 2 + d] * weight
            partial_out[seq, first_head + g, part, d] = total / total_sum
            if d == 0:
                max_logits[seq, first_head + g, part] = total_max
                exp_sums[seq, first_head + g, part] = total_sum

    return paged_attention_v3
