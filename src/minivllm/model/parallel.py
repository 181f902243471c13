"""Tensor parallelism's layers: one model split across ranks, Megatron-style (Shoeybi et al., 2019,
"Megatron-LM"), as nano-vllm's `layers/linear.py` and vLLM's `QKVParallelLinear`,
`RowParallelLinear` and `VocabParallelEmbedding` split it.

Each of `world` ranks holds a share of every layer and runs the whole forward pass over the whole
batch; they meet in three collectives:

    embedding      vocabulary-parallel: rank r holds rows [r V/W, (r+1) V/W) of the table, looks
                   up the ids that fall there (zeros elsewhere), then ALL-REDUCE sums the rows
    q, k, v        column-parallel: rank r holds its query heads and their K/V heads, so attention
                   runs on each rank over its own heads, with its own K/V pool, and needs nothing
                   from the others
    o_proj         row-parallel: its input is this rank's heads, so it takes the matching columns
                   of the weight; the partial sums are added by an ALL-REDUCE (bias after it)
    gate, up       column-parallel: rank r holds d_ff / W of the hidden units, SiLU is elementwise
    down_proj      row-parallel again, then ALL-REDUCE
    LM head        vocabulary-parallel: each rank's logits for its rows of the vocabulary, GATHERed
                   on rank 0, which samples

So a layer costs two all-reduces of `[tokens, d_model]`, whatever W is. Norms, RoPE and the
residual stream are computed on every rank, identically. With fewer K/V heads than ranks, each
K/V head is held by the W / n_kv_heads ranks whose query heads read it (replicated). The
vocabulary is padded to a multiple of W: the last rank's padding rows are zeros, and their logits
are cut off after the gather.

`shard_slices` says which part of each checkpoint tensor a rank holds; `build_shard` makes a
rank's model (the book's modules, with the classes below swapped in and the split shapes), and
`shard_from_model` fills one from a whole model in memory; `model/checkpoint.py` fills one from the
files, reading only the rank's slices. `fuse_model` then stacks the shards of q, k, v and of gate,
up as it stacks whole projections. The collectives go through `torch.distributed`'s default
group, which the runner sets up (`runner/tensor_parallel.py`: gloo on a CPU, NCCL on GPUs).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from minivllm.model.families import model_class
from minivllm.model.transformer import ModelConfig, Transformer


@dataclass
class CommCounter:
    """What this process spent in collectives: calls, bytes sent in, seconds waited (on a CPU,
    gloo's calls return when done; on a GPU a NCCL call is only queued, so its seconds mean
    little without a synchronize)."""

    calls: int = 0
    bytes: int = 0
    seconds: float = 0.0

    def reset(self) -> None:
        self.calls, self.bytes, self.seconds = 0, 0, 0.0


COMM = CommCounter()


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the ranks, in place, counted in `COMM`."""
    started = time.perf_counter()
    dist.all_reduce(x)
    COMM.seconds += time.perf_counter() - started
    COMM.calls += 1
    COMM.bytes += x.numel() * x.element_size()
    return x


@dataclass(frozen=True)
class Shard:
    """Rank `rank` of `world`: which heads, hidden units and vocabulary rows it holds."""

    rank: int
    world: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} is outside a world of {self.world}")

    def query_heads(self, config: ModelConfig) -> tuple[int, int]:
        """(first, count) of this rank's query heads: an equal, contiguous share (ValueError if
        they do not split over the ranks)."""
        # EXERCISE ch11.2: rank layout -- this rank's equal, contiguous share of the query heads
        ### BEGIN SOLUTION
        if config.n_heads % self.world:
            raise ValueError(f"{config.n_heads} query heads do not split over {self.world} ranks")
        count = config.n_heads // self.world
        return self.rank * count, count
        ### END SOLUTION

    def kv_heads(self, config: ModelConfig) -> tuple[int, int]:
        """(first, count) of this rank's K/V heads: its share, or -- with fewer K/V heads than
        ranks -- the one head its query heads read (the same head on W / n_kv_heads ranks).
        ValueError unless the K/V heads are a multiple of the ranks or divide them."""
        # EXERCISE ch11.2: rank layout -- a share of the K/V heads, or the one its query heads read
        ### BEGIN SOLUTION
        kv, world = config.n_kv_heads, self.world
        if kv >= world:
            if kv % world:
                raise ValueError(f"{kv} K/V heads do not split over {world} ranks")
            count = kv // world
            return self.rank * count, count
        if world % kv:  # a rank's query heads would read parts of two K/V heads
            raise ValueError(f"{kv} K/V heads do not divide {world} ranks")
        return self.rank * kv // world, 1
        ### END SOLUTION

    def vocab_rows(self, config: ModelConfig) -> tuple[int, int, int]:
        """(first row, rows of the checkpoint, rows held) of the vocabulary: every rank holds
        ceil(V / W) rows, the last one's past V being padding."""
        held = -(-config.vocab_size // self.world)
        first = self.rank * held
        return first, max(0, min(held, config.vocab_size - first)), held


def check_shardable(config: ModelConfig, world: int) -> None:
    """ValueError, saying what to change, unless `config`'s heads and MLP split over `world`."""
    if world < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {world}")
    problems = []
    if config.n_heads % world:
        problems.append(f"its {config.n_heads} query heads")
    kv = config.n_kv_heads
    if (kv >= world and kv % world) or (kv < world and world % kv):
        problems.append(f"its {kv} K/V heads (a multiple of the ranks, or a divisor of them)")
    if config.d_ff % world:
        problems.append(f"its {config.d_ff} MLP units")
    if problems:
        raise ValueError(
            f"the model cannot be split over {world} tensor-parallel ranks: "
            + ", ".join(problems)
            + f" do not divide by {world}"
        )


def local_config(config: ModelConfig, shard: Shard) -> ModelConfig:
    """The config of what one rank holds: its heads and hidden units (its K/V pool's shape)."""
    return replace(
        config,
        n_heads=shard.query_heads(config)[1],
        n_kv_heads=shard.kv_heads(config)[1],
        d_ff=config.d_ff // shard.world,
        explicit_head_dim=config.head_dim,
    )


@dataclass(frozen=True)
class Slice:
    """A rank's part of a checkpoint tensor: `length` entries from `start` along `dim`, into a
    parameter `size` long there (longer only for the vocabulary's padding, zero-filled)."""

    dim: int
    start: int
    length: int
    size: int


def shard_slices(config: ModelConfig, shard: Shard) -> dict[str, Slice]:
    """Every split tensor's slice for this rank, by checkpoint name; a tensor not named is held
    whole (norms, o_proj's bias, q/k norms)."""
    head_dim = config.head_dim
    q_first, q_count = shard.query_heads(config)
    kv_first, kv_count = shard.kv_heads(config)
    units = config.d_ff // shard.world
    vocab_first, vocab_length, vocab_held = shard.vocab_rows(config)
    q = Slice(0, q_first * head_dim, q_count * head_dim, q_count * head_dim)
    kv = Slice(0, kv_first * head_dim, kv_count * head_dim, kv_count * head_dim)
    hidden = Slice(0, shard.rank * units, units, units)
    slices = {"model.embed_tokens.weight": Slice(0, vocab_first, vocab_length, vocab_held)}
    if not config.tie_word_embeddings:
        slices["lm_head.weight"] = slices["model.embed_tokens.weight"]
    for i in range(config.n_layers):
        attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        for kind in ("weight", "bias") if config.attention_bias else ("weight",):
            slices[f"{attn}.q_proj.{kind}"] = q
            slices[f"{attn}.k_proj.{kind}"] = kv
            slices[f"{attn}.v_proj.{kind}"] = kv
        slices[f"{attn}.o_proj.weight"] = replace(q, dim=1)
        slices[f"{mlp}.gate_proj.weight"] = hidden
        slices[f"{mlp}.up_proj.weight"] = hidden
        slices[f"{mlp}.down_proj.weight"] = replace(hidden, dim=1)
    return slices


class RowParallelLinear(nn.Linear):
    """A linear layer holding the columns of its weight that match this rank's share of the
    input: its outputs are partial sums, added over the ranks; the bias, held whole, is added
    once, after the sum."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # EXERCISE ch11.1: row-parallel -- partial products summed over the ranks, bias added once
        ### BEGIN SOLUTION
        out = all_reduce(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias
        ### END SOLUTION


class VocabParallelEmbedding(nn.Embedding):
    """The rows `vocab_first ..` of the embedding: ids elsewhere look up zeros, and the sum over
    the ranks is every id's row (one rank adds it, the others add zeros: exact)."""

    vocab_first: int = 0

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.vocab_first
        mine = (local >= 0) & (local < self.num_embeddings)
        rows = F.embedding(torch.where(mine, local, 0), self.weight)
        return all_reduce(rows * mine[..., None].to(rows.dtype))


class VocabParallelLMHead(nn.Linear):
    """This rank's rows of the vocabulary; the logits are gathered on rank 0 (the only rank that
    samples: the others return their own part, which nobody reads). The model hands it the rows
    whose logits are wanted only (`Transformer.forward`'s `rows`)."""

    vocab_size: int = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = F.linear(x, self.weight).contiguous()
        started = time.perf_counter()
        if dist.get_rank() == 0:
            parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
            dist.gather(local, parts, dst=0)
            out = torch.cat(parts, dim=-1)[..., : self.vocab_size]
        else:
            dist.gather(local, None, dst=0)
            out = local
        COMM.seconds += time.perf_counter() - started
        COMM.calls += 1
        COMM.bytes += local.numel() * local.element_size()
        return out


def _resize(module: nn.Module, name: str, dim: int, size: int) -> None:
    """Give `module.name` (a parameter on the meta device) `size` entries along `dim`."""
    param = getattr(module, name)
    shape = list(param.shape)
    shape[dim] = size
    setattr(module, name, nn.Parameter(torch.empty(shape, dtype=param.dtype, device="meta")))


def build_shard(
    config: ModelConfig, dtype: torch.dtype, shard: Shard, device: str | torch.device = "cpu"
) -> Transformer:
    """Rank `shard.rank`'s model, its memory allocated on `device` but not filled: the book's
    model (or `HFTransformer`, as `load_model` would pick) with this rank's heads, hidden units
    and vocabulary rows, and the parallel layers above where the ranks meet."""
    check_shardable(config, shard.world)
    q_count = shard.query_heads(config)[1]
    kv_count = shard.kv_heads(config)[1]
    units = config.d_ff // shard.world
    vocab_first, _, vocab_held = shard.vocab_rows(config)
    head_dim = config.head_dim
    with torch.device("meta"):
        model = model_class(config, dtype)(config)
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.n_heads, attn.n_kv_heads = q_count, kv_count
        for proj, heads in (
            (attn.q_proj, q_count),
            (attn.k_proj, kv_count),
            (attn.v_proj, kv_count),
        ):
            proj.out_features = heads * head_dim
            _resize(proj, "weight", 0, heads * head_dim)
            if proj.bias is not None:
                _resize(proj, "bias", 0, heads * head_dim)
        attn.o_proj.in_features = q_count * head_dim
        _resize(attn.o_proj, "weight", 1, q_count * head_dim)
        attn.o_proj.__class__ = RowParallelLinear
        for proj in (mlp.gate_proj, mlp.up_proj):
            proj.out_features = units
            _resize(proj, "weight", 0, units)
        mlp.down_proj.in_features = units
        _resize(mlp.down_proj, "weight", 1, units)
        mlp.down_proj.__class__ = RowParallelLinear
    embedding = model.model.embed_tokens
    embedding.num_embeddings = vocab_held
    _resize(embedding, "weight", 0, vocab_held)
    embedding.__class__ = VocabParallelEmbedding
    embedding.vocab_first = vocab_first
    head = model.lm_head
    head.out_features = vocab_held
    _resize(head, "weight", 0, vocab_held)
    head.__class__ = VocabParallelLMHead
    head.vocab_size = config.vocab_size
    model = model.to(dtype).to_empty(device=device)
    model.tie_weights()
    model.shard = shard
    return model.eval()


def zero_padding(param: torch.Tensor, part: Slice) -> None:
    """Zeros in a parameter's entries past what the checkpoint gives it (vocabulary padding)."""
    if part.length < part.size:
        param.data.narrow(part.dim, part.length, part.size - part.length).zero_()


def shard_from_model(
    model: Transformer, shard: Shard, device: str | torch.device = "cpu"
) -> Transformer:
    """Rank `shard.rank`'s model with its slices of `model`'s weights (a whole, unfused model in
    memory, e.g. the shipped one): each slice is copied, the whole model is left as it was."""
    if not hasattr(model.model.layers[0].self_attn, "q_proj"):
        raise ValueError(
            "tensor parallelism splits a model's separate q/k/v and gate/up projections: give "
            "the unfused model (an engine's own fused copy cannot be split)"
        )
    dtype = next(model.parameters()).dtype
    part = build_shard(model.config, dtype, shard, device)
    slices = shard_slices(model.config, shard)
    whole = dict(model.named_parameters())
    with torch.no_grad():
        for name, param in part.named_parameters():
            cut = slices.get(name)
            source = whole[name]
            if cut is None:
                param.copy_(source)
                continue
            param.narrow(cut.dim, 0, cut.length).copy_(
                source.narrow(cut.dim, cut.start, cut.length)
            )
            zero_padding(param, cut)
    return part
