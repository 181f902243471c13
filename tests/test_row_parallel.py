"""The row-parallel layer (exercise ch11.1, `RowParallelLinear` in model/parallel.py), on two gloo
ranks on 127.0.0.1: each rank holds half the columns of a weight and multiplies its half of the
input; the all-reduce makes every rank's output the whole layer's, the bias added once. The whole
model at TP 2 (tests/test_tensor_parallel.py) rests on it, twice a layer."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from minivllm.model.parallel import COMM, RowParallelLinear

WORLD, TOKENS, IN, OUT = 2, 5, 12, 7


def whole_layer(bias: bool) -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(IN, OUT, bias=bias)


def inputs() -> torch.Tensor:
    return torch.randn(TOKENS, IN, generator=torch.Generator().manual_seed(1))


def _rank(rank: int, init_method: str, interface: str, out: str) -> None:
    """One rank: its columns of the weight, its half of the input; saves what its layer gave and
    what the collectives counted. (The spawned rank imports this module: it stays light, no
    attention backends.)"""
    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = interface
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=WORLD)
    try:
        columns = slice(rank * IN // WORLD, (rank + 1) * IN // WORLD)
        results = {}
        for bias in (False, True):
            whole = whole_layer(bias)
            part = RowParallelLinear(IN // WORLD, OUT, bias=bias)
            with torch.no_grad():
                part.weight.copy_(whole.weight[:, columns])
                if bias:
                    part.bias.copy_(whole.bias)
            COMM.reset()
            with torch.no_grad():
                got = part(inputs()[:, columns])
            results[bias] = (got, COMM.calls, COMM.bytes)
        torch.save(results, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.exercise("ch11.1")
def test_row_parallel_halves_add_up_to_the_whole_layer(tmp_path) -> None:
    """Every rank ends with x @ W.T (+ b, once), after exactly one all-reduce of the output."""
    from minivllm.runner.tensor_parallel import LOOPBACK, free_port

    init_method = f"tcp://127.0.0.1:{free_port()}"
    args = (init_method, LOOPBACK, str(tmp_path))
    mp.start_processes(_rank, args, nprocs=WORLD, start_method="spawn")
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    for bias in (False, True):
        with torch.no_grad():
            expected = whole_layer(bias)(inputs())
        for rank, results in enumerate(ranks):
            got, calls, sent = results[bias]
            where = f"rank {rank}, bias={bias}"
            assert got.shape == expected.shape, where
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, msg=where)
            assert calls == 1, f"{where}: {calls} collectives, one all_reduce expected"
            assert sent == TOKENS * OUT * 4, f"{where}: the all-reduce carries the output"
        assert torch.equal(ranks[0][bias][0], ranks[1][bias][0]), "every rank holds the same sum"
