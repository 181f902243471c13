"""v4: tiled grouped flash-decoding, with fewer live values per thread (chapter 08).

Nsight Compute saw v3 (`grouped.py`) at 128 registers a thread on an H100: 4 blocks of 128 threads
per SM, 25 % theoretical occupancy, too few loads in flight to fill the memory system; capping the
registers spilled and was slower. And it is busy as much as it is starved: each team of lanes keeps
its own running output for every query head of the group (head_dim x group / lanes_per_token
floats a lane, 32 of v3's 128 registers at head_dim 128, group 4, on top of 32 for the query), and
every lane of a team pays, per token, two exponentials per head and an element-by-element rescale
of that output, on top of a two-byte load with 64-bit address arithmetic per element. v4 keeps
v3's grid (one block per sequence, K/V head and partition, the block table staged in shared memory)
and splits each tile of `tile` tokens into three phases:

1. **Scores.** Teams of `key_lanes` lanes take a token each (`tile / teams` tokens a team, their
   loads issued `key_batch` tokens at a time); a lane reads its stretch of the key row as one
   8-byte vector (`vectors.py`: one load where numba would issue four, without its 64-bit index
   arithmetic), dots it with its stretch of each query head (pre-scaled by scale x log2(e), so
   that softmax runs on `exp2`), and the team adds the pieces by a reduce-scatter: at each shuffle
   a lane hands half of its heads to its partner, so group 4 over 32 lanes costs 6 shuffles a
   token, not 20. The scores, and each token's cache row, go to shared memory.
2. **Prefetch, then softmax once per (head, token).** The block asks for this tile's value rows
   and the next tile's key rows to come into L2 (a prefetch holds no register while in flight, so
   the memory system gets a tile's worth of requests whatever the occupancy). Then a warp per
   query head takes the tile's max, rescales the head's running max and sum (held in shared
   memory) and turns the scores into weights in place: one `exp2` per score, not one per lane.
3. **Values, each output element owned by one thread.** Teams of `value_lanes` lanes take a token
   each and split head_dim between them, an 8-byte vector a lane; each lane keeps only its
   elements' running output for the group's heads (group x head_dim / value_lanes floats: 16 at
   head_dim 128, group 4), rescaled once a tile. Every team shares the block's running max, so at
   the end the teams' outputs add up (through shared memory), no log-sum-exp merge between them.

Two barriers a tile: the scores and the weights are double-buffered so that the next tile's
scores may be written while a slow warp still reads this tile's weights. The output is v3's:
each partition's normalised output, max (in natural-log units) and sum, for `merge_partitions`.

Compiled per (head_dim, group, block_size) and layout (threads, element size, the knobs): every
loop has a constant trip count, so the per-thread arrays live in registers. Shared-memory indices
are cast to unsigned and the thread and block indices widened from unsigned, which spares numba's
negative-index and signed-division fix-ups and the 64-bit registers they hold. For the benchmark's
shape (float16, head_dim 128, group 4, 128 threads) CUDA 13's ptxas for sm_90 gives this kernel 70
registers to v3's 128, and 64 with no spill when capped there (`tools/kernel_registers.py`,
`benchmarks/results/kernel_registers.json`): compiler counts; the bandwidth is measured on a GPU
by `benchmarks/paged_attention.py`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from numba import cuda, float32, int32, int64, uint32, uint64

from minivllm.attention.cuda.simulator import SIMULATOR, WARP_SIZE
from minivllm.attention.cuda.vectors import (
    LINE_BYTES,
    prefetch_l2,
    vector_elements,
    vector_loader,
)

FULL_MASK = 0xFFFFFFFF
NEG_INF, ZERO = float32(-math.inf), float32(0.0)
LOG2E, LN2 = float32(math.log2(math.e)), float32(math.log(2.0))


@dataclass(frozen=True)
class TiledLayout:
    """How v4's threads split a tile: from the shapes and `tiled_layout`'s knobs (the width of a
    lane's loads, tokens per tile, loads issued together, the prefetches)."""

    head_dim: int
    itemsize: int  # bytes per cache element
    threads: int
    key_vector: int  # elements per key load
    key_lanes: int  # lanes sharing one key row
    value_vector: int
    value_lanes: int
    tile: int
    key_batch: int  # a team's key loads issued together (tokens)
    value_batch: int
    prefetch: bool  # ask for the next rows into L2 ahead of their loads

    @property
    def key_teams(self) -> int:
        return self.threads // self.key_lanes

    @property
    def value_teams(self) -> int:
        return self.threads // self.value_lanes


def tiled_layout(
    head_dim: int,
    itemsize: int,
    threads: int,
    key_bytes: int = 8,
    value_bytes: int = 8,
    tile: int = 64,
    key_batch: int = 1,
    value_batch: int = 1,
    prefetch: bool = True,
) -> TiledLayout:
    """The layout for one shape: as many lanes per row as reading `key_bytes` (`value_bytes`) a lane
    takes, at most a warp; a tile a multiple of every team count and of a warp."""
    if threads % WARP_SIZE or not WARP_SIZE <= threads <= 1024:
        raise ValueError(
            f"threads per block must be a multiple of {WARP_SIZE} up to 1024, got {threads}"
        )
    for name, value in (("tile", tile), ("key_batch", key_batch), ("value_batch", value_batch)):
        if value < 1:
            raise ValueError(f"{name} must be a positive number of tokens, got {value}")
    key_vector = vector_elements(head_dim, itemsize, key_bytes)
    value_vector = vector_elements(head_dim, itemsize, value_bytes)
    key_lanes = min(WARP_SIZE, head_dim // key_vector)
    value_lanes = min(WARP_SIZE, head_dim // value_vector)
    tile = math.lcm(tile, threads // key_lanes, threads // value_lanes, WARP_SIZE)
    return TiledLayout(
        head_dim,
        itemsize,
        threads,
        key_vector,
        key_lanes,
        value_vector,
        value_lanes,
        tile,
        math.gcd(key_batch, tile // (threads // key_lanes)),  # a whole number of batches a tile
        math.gcd(value_batch, tile // (threads // value_lanes)),
        prefetch,
    )


def tiled_shared_words(table_entries: int, group: int, layout: TiledLayout) -> int:
    """4-byte words of dynamic shared memory one v4 block needs: the block table; per tile buffer
    (two) each token's cache row and per head its scores; per head the running max and sum and the
    tile's rescale; the value teams' outputs for the final sum."""
    buffers = 2 * (layout.tile + group * layout.tile)
    return table_entries + buffers + 3 * group + layout.value_teams * group * layout.head_dim


@functools.cache
def tiled_decode_kernel(
    head_dim: int,
    group: int,
    block_size: int,
    layout: TiledLayout,
    max_registers: int | None = None,
):
    """The v4 kernel for one shape and layout; compiled once per cache dtype, on first launch.
    Same arguments and grid as v3 (`grouped.grouped_decode_kernel`); `max_registers` caps the
    registers per thread as there (the simulator ignores it)."""
    threads, tile = layout.threads, layout.tile
    num_warps = threads // WARP_SIZE
    key_vector, key_lanes, key_teams = layout.key_vector, layout.key_lanes, layout.key_teams
    key_per_lane = head_dim // key_lanes
    key_chunks = key_per_lane // key_vector  # vectors a lane reads of one key row
    key_rounds = tile // key_teams  # tokens per team per tile
    key_batch = layout.key_batch
    value_vector, value_lanes = layout.value_vector, layout.value_lanes
    value_teams = layout.value_teams
    value_per_lane = head_dim // value_lanes
    value_chunks = value_per_lane // value_vector
    value_rounds = tile // value_teams
    value_batch = layout.value_batch
    # The reduce-scatter of the scores works on a power-of-two number of heads (padded with
    # zeros); a lane ends up holding heads_per_lane of them, shared by lanes_per_head lanes.
    padded_group = 1 << (group - 1).bit_length()
    heads_per_lane = max(1, padded_group // key_lanes)
    lanes_per_head = max(1, key_lanes // padded_group)
    pieces_length = key_batch * padded_group
    head_rounds = -(-group // num_warps)  # heads per warp in the softmax phase
    scores_per_lane = tile // WARP_SIZE
    # Local arrays need constant lengths (closure variables, not expressions).
    query_length = group * key_per_lane
    key_length = key_batch * key_per_lane
    value_length = value_batch * value_per_lane
    output_length = group * value_per_lane
    unsigned_block_size = uint64(block_size)
    prefetch = layout.prefetch
    line_elements = LINE_BYTES // layout.itemsize
    row_lines = -(-head_dim // line_elements)  # cache lines of one row
    prefetch_rounds = -(-tile * row_lines // threads)
    load_key = vector_loader(key_vector)
    load_value = vector_loader(value_vector)

    options = {} if SIMULATOR or max_registers is None else {"max_registers": max_registers}

    @cuda.jit(**options)
    def paged_attention_v4(
        partial_out,  # [seqs, heads, partitions, head_dim]
        max_logits,  # [seqs, heads, partitions]
        exp_sums,  # [seqs, heads, partitions]
        q,  # [seqs, heads, head_dim]
        key_cache,  # [num_blocks * block_size * kv_heads * head_dim]: flattened
        value_cache,
        block_tables,  # [seqs, max_blocks] int32
        context_lens,  # [seqs] int32
        max_context_len,
        scale,
        partition_size,
    ):
        # numba reads the thread and block indices as signed: widened from unsigned, the compiler
        # knows them non-negative, so `// 32` is a shift, not a shift with a sign fix-up.
        seq, kv_head = int64(uint32(cuda.blockIdx.x)), int64(uint32(cuda.blockIdx.y))
        part, tid = int64(uint32(cuda.blockIdx.z)), int64(uint32(cuda.threadIdx.x))
        warp, lane = tid // WARP_SIZE, tid % WARP_SIZE
        num_kv_heads = int64(uint32(cuda.gridDim.y))
        first_head = kv_head * group
        length = context_lens[seq]
        if length < 1 or length > max_context_len:  # as v3: NaN rows, nothing read
            for index in range(tid, group * head_dim, threads):
                g, d = index // head_dim, index % head_dim
                partial_out[seq, first_head + g, part, d] = math.nan
                if d == 0:
                    max_logits[seq, first_head + g, part] = 0.0
                    exp_sums[seq, first_head + g, part] = 1.0
            return
        start = part * partition_size
        end = min(start + partition_size, length)
        if start >= end:
            for g in range(tid, group, threads):
                max_logits[seq, first_head + g, part] = -math.inf
                exp_sums[seq, first_head + g, part] = 0.0
            return

        # Shared memory, in words: the table, then per buffer the tile's rows and scores, then the
        # running max, sum and the tile's rescale per head, then the value teams' outputs.
        first_block = start // block_size
        table_entries = partition_size // block_size
        words = cuda.shared.array(0, dtype=int32)
        floats = cuda.shared.array(0, dtype=float32)
        rows_at = table_entries
        scores_at = rows_at + 2 * tile
        max_at = scores_at + 2 * group * tile
        sum_at = max_at + group
        rescale_at = sum_at + group
        outputs_at = rescale_at + group
        for i in range(tid, (end - 1) // block_size - first_block + 1, threads):
            words[uint64(i)] = block_tables[seq, first_block + i]
        for g in range(tid, group, threads):
            floats[uint64(max_at + g)] = NEG_INF
            floats[uint64(sum_at + g)] = ZERO

        # This lane's stretches of the group's queries (scaled into log2 units) for the scores,
        # and its output elements' running sums for the values.
        key_team, key_lane = tid // key_lanes, tid % key_lanes
        value_team, value_lane = tid // value_lanes, tid % value_lanes
        query = cuda.local.array(query_length, float32)
        keys = cuda.local.array(key_length, float32)
        pieces = cuda.local.array(pieces_length, float32)
        values = cuda.local.array(value_length, float32)
        output = cuda.local.array(output_length, float32)
        query_scale = float32(scale) * LOG2E
        for g in range(group):
            for c in range(key_chunks):
                for e in range(key_vector):
                    d = (c * key_lanes + key_lane) * key_vector + e
                    query[g * key_per_lane + c * key_vector + e] = (
                        float32(q[seq, first_head + g, d]) * query_scale
                    )
            for i in range(value_per_lane):
                output[g * value_per_lane + i] = ZERO
        cuda.syncthreads()  # the table and the running state are in place

        buffer = 0
        for tile_start in range(start, end, tile):
            rows = rows_at + buffer * tile
            scores = scores_at + buffer * group * tile
            # 1. Scores: each key team takes tokens key_team, key_team + key_teams, ... of the
            # tile, loading key_batch of them before using any. Every lane runs every round, so
            # the shuffles stay uniform; a token past the end is neither read nor written.
            for batch in range(key_rounds // key_batch):
                for u in range(key_batch):
                    token = (batch * key_batch + u) * key_teams + key_team
                    t = tile_start + token
                    if t < end:
                        # The partition starts on a block boundary; unsigned: no sign fix-ups.
                        offset = uint64(t - start)
                        block = words[offset // unsigned_block_size]
                        slot = int64(offset % unsigned_block_size)
                        row = (block * block_size + slot) * num_kv_heads + kv_head
                        if key_lane == 0:
                            words[uint64(rows + token)] = row
                        for c in range(key_chunks):
                            load_key(
                                keys,
                                u * key_per_lane + c * key_vector,
                                key_cache,
                                row * head_dim + (c * key_lanes + key_lane) * key_vector,
                            )
                for u in range(key_batch):
                    token = (batch * key_batch + u) * key_teams + key_team
                    live = tile_start + token < end
                    at = u * padded_group
                    for g in range(padded_group):
                        dot = ZERO
                        if live and g < group:
                            for i in range(key_per_lane):
                                dot += query[g * key_per_lane + i] * keys[u * key_per_lane + i]
                        pieces[at + g] = dot
                    # Reduce-scatter: at each step a lane keeps half of its heads and swaps the
                    # other half with its partner, so log2(group) + log2(key_lanes / group)
                    # shuffles add up every head, not group x log2(key_lanes).
                    half, offset = padded_group // 2, key_lanes // 2
                    while half > 0 and offset > 0:
                        upper = key_lane & offset != 0
                        for i in range(half):
                            low, high = pieces[at + i], pieces[at + i + half]
                            keep = high if upper else low
                            give = low if upper else high
                            pieces[at + i] = keep + cuda.shfl_xor_sync(FULL_MASK, give, offset)
                        half //= 2
                        offset //= 2
                    while offset > 0:  # lanes still sharing a head add their sums
                        pieces[at] += cuda.shfl_xor_sync(FULL_MASK, pieces[at], offset)
                        offset //= 2
                    if live and key_lane % lanes_per_head == 0:
                        first_of_lane = key_lane // lanes_per_head * heads_per_lane
                        for i in range(heads_per_lane):
                            if first_of_lane + i < group:
                                g = first_of_lane + i
                                floats[uint64(scores + g * tile + token)] = pieces[at + i]
            cuda.syncthreads()

            # 2. Prefetch, then softmax. Each thread asks for a line or so of this tile's value rows
            # (for step 3) and of the next tile's key rows (for the next step 1) to come into L2:
            # the whole block's next reads in flight at once, at no register cost.
            if prefetch:
                for prefetch_round in range(prefetch_rounds):
                    index = prefetch_round * threads + tid
                    token, line = index // row_lines, index % row_lines
                    if index < tile * row_lines and tile_start + token < end:
                        row = words[uint64(rows + token)]
                        prefetch_l2(value_cache, row * head_dim + line * line_elements)
                    ahead = tile_start + tile + token
                    if index < tile * row_lines and ahead < end:
                        offset = uint64(ahead - start)
                        block = words[offset // unsigned_block_size]
                        slot = int64(offset % unsigned_block_size)
                        row = (block * block_size + slot) * num_kv_heads + kv_head
                        prefetch_l2(key_cache, row * head_dim + line * line_elements)
            # Softmax: warp w takes heads w, w + num_warps, ...: the tile's max, the head's new
            # running max, the weights exp2(score - max) in place of the scores, their sum.
            for head_round in range(head_rounds):
                g = head_round * num_warps + warp
                active = g < group
                tile_max = NEG_INF
                if active:
                    for i in range(scores_per_lane):
                        token = i * WARP_SIZE + lane
                        if tile_start + token < end:
                            tile_max = max(tile_max, floats[uint64(scores + g * tile + token)])
                offset = WARP_SIZE // 2
                while offset > 0:
                    tile_max = max(tile_max, cuda.shfl_xor_sync(FULL_MASK, tile_max, offset))
                    offset //= 2
                tile_sum = ZERO
                old_max = new_max = ZERO
                if active:
                    old_max = floats[uint64(max_at + g)]
                    new_max = max(old_max, tile_max)
                    for i in range(scores_per_lane):
                        token = i * WARP_SIZE + lane
                        weight = ZERO
                        if tile_start + token < end:
                            weight = math.exp2(floats[uint64(scores + g * tile + token)] - new_max)
                        floats[uint64(scores + g * tile + token)] = weight
                        tile_sum += weight
                offset = WARP_SIZE // 2
                while offset > 0:  # also keeps every lane's read of old_max before lane 0's write
                    tile_sum += cuda.shfl_xor_sync(FULL_MASK, tile_sum, offset)
                    offset //= 2
                if active and lane == 0:
                    rescale = math.exp2(old_max - new_max)  # 0 on the first tile (old is -inf)
                    floats[uint64(rescale_at + g)] = rescale
                    floats[uint64(sum_at + g)] = floats[uint64(sum_at + g)] * rescale + tile_sum
                    floats[uint64(max_at + g)] = new_max
            cuda.syncthreads()

            # 3. Values: each value team takes tokens value_team, value_team + value_teams, ...;
            # a lane adds its elements of each value row, weighted, into its share of the output.
            for g in range(group):
                rescale = floats[uint64(rescale_at + g)]
                for i in range(value_per_lane):
                    output[g * value_per_lane + i] *= rescale
            for batch in range(value_rounds // value_batch):
                for u in range(value_batch):
                    token = (batch * value_batch + u) * value_teams + value_team
                    if tile_start + token < end:
                        row = words[uint64(rows + token)]
                        for c in range(value_chunks):
                            load_value(
                                values,
                                u * value_per_lane + c * value_vector,
                                value_cache,
                                row * head_dim + (c * value_lanes + value_lane) * value_vector,
                            )
                for u in range(value_batch):
                    token = (batch * value_batch + u) * value_teams + value_team
                    if tile_start + token < end:
                        for g in range(group):
                            weight = floats[uint64(scores + g * tile + token)]
                            for i in range(value_per_lane):
                                output[g * value_per_lane + i] += (
                                    weight * values[u * value_per_lane + i]
                                )
            buffer = 1 - buffer

        # The value teams' outputs share one running max: their sum is the partition's output.
        for g in range(group):
            for c in range(value_chunks):
                for e in range(value_vector):
                    d = (c * value_lanes + value_lane) * value_vector + e
                    floats[uint64(outputs_at + (value_team * group + g) * head_dim + d)] = output[
                        g * value_per_lane + c * value_vector + e
                    ]
        cuda.syncthreads()
        for index in range(tid, group * head_dim, threads):
            g, d = index // head_dim, index % head_dim
            total = ZERO
            for team in range(value_teams):
                total += floats[uint64(outputs_at + (team * group + g) * head_dim + d)]
            total_sum = floats[uint64(sum_at + g)]
            partial_out[seq, first_head + g, part, d] = total / total_sum
            if d == 0:
                max_logits[seq, first_head + g, part] = floats[uint64(max_at + g)] * LN2
                exp_sums[seq, first_head + g, part] = total_sum

    return paged_attention_v4
