"""Tensor parallelism (model/parallel.py, runner/tensor_parallel.py): one model split over ranks.

Without processes: every rank's slices tile each checkpoint tensor (K/V heads replicated when
there are fewer than ranks), and a rank that reads its shard from the files gets exactly the
slices of the whole model. With two gloo ranks on 127.0.0.1: the logits of a sequence of steps
(prefill chunks, then decodes over the paged cache) against one process's, for the shipped model
and tiny checkpoints of the families with q/k/v biases (Qwen2), q/k norms and a tied head (Qwen3),
q/k/v/o biases and RoPE scaling (Llama 3), and one K/V head for two ranks, on every CPU attention
backend (at four ranks too: slow); then whole engines, TP = 1 against
TP = 2, greedy and seeded tokens; a rank killed mid-run ends the engine with a clear error and
leaves no process behind, as do Ctrl-C, a rank that stops answering (a timeout) and an engine
killed outright; and the same tokens through `torchrun --nproc-per-node 2`.

Tolerance: the row-parallel layers add partial sums in another order than one matmul does, so a
logit moves in its last bits: within 1e-4 of logits a few units wide (`LOGIT_TOLERANCE`).
"""

from __future__ import annotations

import _thread
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from minivllm import EngineConfig, LLMEngine, SamplingParams, SchedulerConfig
from minivllm.attention.backend import get_backend
from minivllm.attention.storage import PagedKVStorage
from minivllm.book.tiny_checkpoint import save_random_weights
from minivllm.cli import main
from minivllm.kv.block_manager import BlockManager
from minivllm.model.checkpoint import hf_config, load_model
from minivllm.model.fused import fuse_model
from minivllm.model.parallel import Shard, check_shardable, shard_from_model, shard_slices
from minivllm.model.transformer import ModelConfig, RopeScaling
from minivllm.runner.batch import BatchPiece, pack_batch, run_model
from minivllm.runner.launcher import LOOPBACK, free_port
from minivllm.runner.tensor_parallel import RankSettings, RankState, WeightsSource

LOGIT_TOLERANCE = 1e-4
TORCHRUN = Path(sys.executable).parent / "torchrun"
BACKENDS = ("torch", "numba")
# Tiny checkpoints: an odd vocabulary (the last rank's rows are padded), 2 layers.
TINY = dict(vocab_size=97, d_model=32, n_layers=2, n_heads=4, d_ff=64, max_seq_len=128)
TINY.update(bos_token_id=None, eos_token_id=None)  # greedy runs to max_tokens
FAMILIES = {
    "qwen2": ModelConfig(
        **TINY, n_kv_heads=2, architecture="Qwen2ForCausalLM", attention_bias=True
    ),
    "qwen3": ModelConfig(
        **TINY,
        n_kv_heads=2,
        architecture="Qwen3ForCausalLM",
        qk_norm=True,
        explicit_head_dim=16,
        tie_word_embeddings=True,
    ),
    "llama3-biases": ModelConfig(  # biases on q, k, v and o (o's added once, after the sum)
        **TINY,
        n_kv_heads=2,
        attention_bias=True,
        o_proj_bias=True,
        rope_scaling=RopeScaling(4.0, 1.0, 4.0, 16),
    ),
    "one-kv-head": ModelConfig(**TINY, n_kv_heads=1),  # fewer K/V heads than ranks
}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """The shipped target model's folder and a random checkpoint of each tiny family."""
    found = {"target": load_model("target").checkpoint_folder}
    for seed, (name, config) in enumerate(FAMILIES.items()):
        hf = hf_config(config)
        if config.architecture == "Qwen3ForCausalLM":
            hf["head_dim"] = config.head_dim
        found[name] = save_random_weights(tmp_path_factory.mktemp(name), hf, seed)
    return found


def children() -> set[int]:
    """This process's live child processes (psutil if installed, else /proc), but for the one
    resource tracker that multiprocessing keeps for the life of any process that spawned."""
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        found = {
            p.pid: " ".join(p.cmdline())
            for p in psutil.Process().children(recursive=True)
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        }
    else:
        found, mine = {}, str(os.getpid())
        for entry in Path("/proc").iterdir():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except (OSError, IndexError):
                continue
            if fields[1] == mine and fields[0] != "Z":
                found[int(entry.name)] = command
    return {pid for pid, command in found.items() if "resource_tracker" not in command}


def no_children_left(timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while children() and time.monotonic() < deadline:
        time.sleep(0.1)
    return not children()


# -- without processes -------------------------------------------------------------------------


@pytest.mark.exercise("ch11.2")  # the rank layout decides every slice
@pytest.mark.parametrize("name", ["target", *FAMILIES])
@pytest.mark.parametrize("world", [2, 4])
def test_the_ranks_slices_tile_every_tensor(folders, name, world) -> None:
    model = load_model(folders[name])
    config = model.config
    shards = [shard_from_model(model, Shard(r, world)) for r in range(world)]
    slices = shard_slices(config, Shard(0, world))
    for name_, whole in model.named_parameters():
        parts = [dict(s.named_parameters())[name_] for s in shards]
        cut = slices.get(name_)
        if cut is None:  # held whole on every rank
            assert all(torch.equal(p, whole) for p in parts), name_
            continue
        kv = name_.endswith(("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias"))
        if kv and config.n_kv_heads < world:  # each rank holds the K/V head its queries read
            group = config.n_heads // config.n_kv_heads
            for rank, part in enumerate(parts):
                first_query = rank * config.n_heads // world
                head = first_query // group
                rows = slice(head * config.head_dim, (head + 1) * config.head_dim)
                assert torch.equal(part, whole[rows]), (name_, rank)
            continue
        joined = torch.cat(parts, dim=cut.dim)
        assert torch.equal(joined.narrow(cut.dim, 0, whole.shape[cut.dim]), whole), name_
        extra = joined.shape[cut.dim] - whole.shape[cut.dim]
        padding = joined.narrow(cut.dim, whole.shape[cut.dim], extra)
        assert not padding.any(), name_  # the vocabulary's padding rows are zeros


@pytest.mark.parametrize("name", ["target", "qwen2", "qwen3", "llama3-biases"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rank_reads_exactly_its_slices_from_the_checkpoint(folders, name, dtype) -> None:
    """Rows from where they start, columns through the conversion buffer; in the file's dtype and
    converted to another one."""
    whole = load_model(folders[name], dtype)
    for rank in range(2):
        read = load_model(folders[name], dtype, shard=Shard(rank, 2))
        sliced = shard_from_model(whole, Shard(rank, 2))
        for (n, a), (_, b) in zip(read.named_parameters(), sliced.named_parameters()):
            assert a.dtype == dtype and torch.equal(a, b), (n, rank)


def test_models_that_do_not_split_are_refused() -> None:
    config = ModelConfig(n_heads=8, n_kv_heads=2, d_ff=512)
    check_shardable(config, 2)
    check_shardable(config, 8)  # 2 K/V heads, each held by 4 ranks
    with pytest.raises(ValueError, match="3 tensor-parallel ranks.*query heads"):
        check_shardable(config, 3)
    with pytest.raises(ValueError, match="K/V heads"):
        check_shardable(ModelConfig(n_heads=12, n_kv_heads=3, d_model=96), 4)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an int >= 1"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="choose one"):
        EngineConfig(tensor_parallel_size=2, forward_processes=2)


# -- two ranks, layer by layer -----------------------------------------------------------------


def step_batches(config: ModelConfig, manager: BlockManager):
    """Three steps over four sequences: two prefills, then one chunk more of a third with two
    decodes, then four decodes, laid out as the runner lays them (decodes first)."""
    generator = torch.Generator().manual_seed(1)

    def ids(n):
        return torch.randint(1, config.vocab_size, (n,), generator=generator).tolist()

    lengths = {0: 0, 1: 0, 2: 0, 3: 0}

    def piece(seq_id, n, logits=1):
        start = lengths[seq_id]
        if start == 0:
            manager.allocate(seq_id, start + n)
        else:
            manager.append(seq_id, n)
        lengths[seq_id] += n
        return BatchPiece(seq_id, start, ids(n), logits)

    yield pack_batch([piece(0, 9), piece(1, 21, logits=21)], manager)
    yield pack_batch([piece(0, 1), piece(1, 1), piece(2, 17), piece(3, 5)], manager)
    yield pack_batch([piece(i, 1) for i in range(4)], manager)


def _rank_logits(rank: int, world: int, init_method: str, cases: list, out: str) -> None:
    """One rank of `test_the_ranks_compute_one_processs_logits`: every case's steps through this
    rank's shard; rank 0 saves the logits."""
    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = LOOPBACK
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    try:
        for name, folder, backend in cases:
            settings = RankSettings(world, 64, 4, torch.float32, "cpu", backend)
            state = RankState.build(
                WeightsSource(folder=folder, dtype=torch.float32), settings, rank
            )
            manager = BlockManager(64, 4)
            logits = [state.step(b, []) for b in step_batches(state.model.config, manager)]
            if rank == 0:
                torch.save(logits, Path(out) / f"{name}-{backend}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "world",
    [2, pytest.param(4, marks=pytest.mark.slow)],  # 4: ranks share the cores
)
def test_the_ranks_compute_one_processs_logits(folders, tmp_path, world) -> None:
    """With 4 ranks every model here has fewer K/V heads than ranks (replicated)."""
    cases = [(name, str(folder), b) for name, folder in folders.items() for b in BACKENDS]
    init_method = f"tcp://127.0.0.1:{free_port()}"
    mp.start_processes(
        _rank_logits,
        (world, init_method, cases, str(tmp_path)),
        nprocs=world,
        start_method="spawn",
    )
    for name, folder, backend in cases:
        model = fuse_model(load_model(folder))
        manager = BlockManager(64, 4)
        storage = PagedKVStorage(model.config, 64, 4)
        factory = get_backend(backend)
        expected = [
            run_model(model, storage, b, factory) for b in step_batches(model.config, manager)
        ]
        got = torch.load(tmp_path / f"{name}-{backend}.pt")
        for step, (a, b) in enumerate(zip(got, expected)):
            assert a.shape == b.shape, (name, backend, step)
            torch.testing.assert_close(a, b, rtol=0, atol=LOGIT_TOLERANCE)
            assert torch.equal(a.argmax(-1), b.argmax(-1)), (name, backend, step)


# -- engines -----------------------------------------------------------------------------------

PROMPTS = ["ROMEO:", "JULIET: O Romeo, Romeo!", "To be, or not to be", "KING HENRY:\n"]


def workload() -> list[SamplingParams]:
    """Greedy, seeded, and a request of two samples (its second forks the first's blocks: a
    copy-on-write on every rank)."""
    return [
        SamplingParams(max_tokens=24, temperature=0),
        SamplingParams(max_tokens=24, temperature=0.8, seed=7),
        SamplingParams(max_tokens=24, temperature=1.0, top_k=20, seed=3, n=2),
        SamplingParams(max_tokens=24, temperature=0),
    ]


def tokens_of(outputs) -> list[list[list[int]]]:
    return [[list(c.token_ids) for c in out.outputs] for out in outputs]


def test_an_engine_at_tp_2_gives_tp_1s_tokens_and_dies_cleanly(target) -> None:
    """Greedy and seeded tokens identical (chunked prefills, a prefix-cache hit, forks); then rank
    1 is killed: the next step raises, naming it, and no process is left."""
    scheduler = SchedulerConfig(
        max_num_seqs=8, max_num_batched_tokens=16, enable_prefix_caching=True
    )
    base = dict(scheduler=scheduler, num_blocks=64, attention_backend="numba")
    with LLMEngine(target, EngineConfig(**base)) as one:
        expected = tokens_of(one.generate(PROMPTS + PROMPTS[:1], workload() + workload()[:1]))
    engine = LLMEngine(target, EngineConfig(**base, tensor_parallel_size=2))
    try:
        got = tokens_of(engine.generate(PROMPTS + PROMPTS[:1], workload() + workload()[:1]))
        assert got == expected
        assert len(engine.parallel.pids) == 1 and engine.parallel.alive
        os.kill(engine.parallel.pids[0], 9)
        with pytest.raises(RuntimeError, match=r"rank 1 \(exit code -9\) died"):
            engine.generate(["ROMEO:"], SamplingParams(max_tokens=4, temperature=0))
        assert not engine.parallel.alive
    finally:
        engine.close()
    assert no_children_left()


def test_a_checkpoint_at_tp_2_each_rank_loading_its_shard(folders) -> None:
    """Qwen3 (q/k norms, its own head size, a tied head) from its folder: the engine process holds
    no weights (the meta device), each rank reads its shard; the reference backend."""
    folder = folders["qwen3"]
    prompts = [[5, 17, 33], list(range(1, 19)), [90, 3, 44, 8]]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    config = dict(num_blocks=32, attention_backend="torch")
    with LLMEngine(load_model(folder), EngineConfig(**config)) as one:
        expected = tokens_of(one.generate(prompts, params))
    meta = load_model(folder, weights=False)
    assert next(meta.parameters()).device.type == "meta"
    with LLMEngine(meta, EngineConfig(**config, tensor_parallel_size=2)) as two:
        assert tokens_of(two.generate(prompts, params)) == expected
        # Ctrl-C in the middle of a run: the interrupt reaches the caller, `close()` (the with
        # block's end) stops the ranks
        long = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
        # interrupt_main does nothing where SIGINT is ignored, as in a pytest-xdist worker: Python's
        # own handler, as in a terminal, for the length of the test
        ignored = signal.signal(signal.SIGINT, signal.default_int_handler)
        timer = threading.Timer(0.5, _thread.interrupt_main)
        try:
            timer.start()
            with pytest.raises(KeyboardInterrupt):
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:  # until the interrupt lands, in some step
                    two.generate([[1, 2, 3]] * 4, long)
        finally:
            timer.cancel()
            signal.signal(signal.SIGINT, ignored)
    assert no_children_left()


@pytest.mark.slow  # waits out a collective's timeout
def test_a_rank_that_stops_answering_times_out(folders) -> None:
    meta = load_model(folders["qwen2"], weights=False)
    config = EngineConfig(
        num_blocks=32, attention_backend="torch", tensor_parallel_size=2, distributed_timeout_s=5
    )
    engine = LLMEngine(meta, config)
    try:
        os.kill(engine.parallel.pids[0], signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="a rank failed or timed out"):
            engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0))
        assert time.monotonic() - started < 60
    finally:
        engine.close()
    assert no_children_left()


@pytest.mark.slow  # three interpreters start: the torchrun agent and two ranks
@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed beside this python")
def test_torchrun_starts_the_same_ranks(capsys) -> None:
    """`torchrun --nproc-per-node 2 -m minivllm.cli generate ... --tensor-parallel-size 2` on
    localhost: rank 0 prints what one process prints, rank 1 exits with it, nothing is left."""
    args = ["generate", "ROMEO:", "--max-tokens", "12", "--temperature", "0"]
    assert main(args) == 0
    expected = capsys.readouterr().out
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": LOOPBACK}
    two = subprocess.run(
        [
            str(TORCHRUN), "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
            "--master-port", str(free_port()), "-m", "minivllm.cli", *args,
            "--tensor-parallel-size", "2",
        ],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert two.returncode == 0, two.stderr
    assert two.stdout == expected
    assert no_children_left()


ENGINE_THEN_WAIT = """
import sys, time
from minivllm import EngineConfig, LLMEngine
from minivllm.model.checkpoint import load_model
if __name__ == "__main__":
    engine = LLMEngine(load_model("target", weights=False), EngineConfig(
        num_blocks=16, attention_backend="torch", tensor_parallel_size=2))
    print(*engine.parallel.pids, flush=True)
    time.sleep(300)
"""


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.slow  # an interpreter and its rank start
def test_ranks_do_not_outlive_an_engine_killed_outright(tmp_path) -> None:
    """SIGKILL on the engine's process closes nothing: each rank exits by itself (its wait for
    the next step fails as the engine's sockets close, or its watchdog sees the parent gone)."""
    script = tmp_path / "engine.py"
    script.write_text(ENGINE_THEN_WAIT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    engine = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, env=env)
    try:
        ranks = [int(pid) for pid in engine.stdout.readline().split()]
        assert len(ranks) == 1 and alive(ranks[0])
    finally:
        engine.kill()
        engine.wait()
    deadline = time.monotonic() + 10
    while any(map(alive, ranks)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(map(alive, ranks))
