"""A small CPU pass runs torch's ops on one thread, its attention kernel on every thread
(`runner/threads.py`, issue 32)."""

from __future__ import annotations

import pytest
import torch

from minivllm import EngineConfig, LLMEngine, SamplingParams
from minivllm.attention import numba_cpu
from minivllm.attention.numba_cpu import NumbaPagedAttention
from minivllm.runner import threads as threads_module
from minivllm.runner.threads import largest_weight, pass_threads, torch_threads
from minivllm.training.corpus import shipped_validation_text


@pytest.fixture
def two_torch_threads(monkeypatch):
    """torch on two threads that sleep between ops (the rule's case, whatever this process's
    environment says), and its own count again after."""
    monkeypatch.setattr(threads_module, "THREADS_SLEEP", True)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_a_pass_gets_one_thread_below_the_threshold_and_every_thread_from_it(
    target, two_torch_threads
):
    cpu = torch.device("cpu")
    largest = largest_weight(target)
    assert largest == 512 * 256  # the MLP's gate (unfused): d_ff x d_model
    below = -(-threads_module.ONE_THREAD_BELOW_MACS // largest) - 1
    assert pass_threads(target, 1, cpu) == pass_threads(target, below, cpu) == 1
    assert pass_threads(target, below + 1, cpu) == 2
    assert pass_threads(target, 1, torch.device("cuda")) == 2  # the rule is the CPU's
    with torch_threads(1):
        assert pass_threads(target, below + 1, cpu) == 1  # never more than torch has


def test_torch_threads_gives_the_count_back_even_when_the_block_raises(two_torch_threads):
    with pytest.raises(RuntimeError, match="inside"):
        with torch_threads(1):
            assert torch.get_num_threads() == 1
            raise RuntimeError("inside")
    assert torch.get_num_threads() == 2


def test_a_small_pass_runs_the_model_on_one_thread_and_the_kernel_on_two(
    target, two_torch_threads, monkeypatch
):
    """Each pass of an engine's generate: the threads torch had while the model ran, and the
    kernel the numba backend was set up with. Decodes of a few sequences are small passes; a
    512-token prefill chunk is not. The tokens are those of an engine whose passes all keep
    both threads (the threshold at 0)."""
    kernels = []
    original_init = NumbaPagedAttention.__init__

    def recording_init(self, storage, batch):
        original_init(self, storage, batch)
        kernels.append(self.kernel)

    monkeypatch.setattr(NumbaPagedAttention, "__init__", recording_init)
    monkeypatch.setattr(numba_cpu, "PARALLEL_MIN_COST", 0)  # every pass worth the pool
    text = shipped_validation_text()
    prompts = [text[:400], text[1000:1040], text[2000:2030]]
    params = SamplingParams(max_tokens=6, temperature=0)
    config = EngineConfig(num_blocks=128, attention_backend="numba", device="cpu")
    engine = LLMEngine(target, config)
    passes = []  # (rows, torch's threads while the model ran)
    engine.runner.model.register_forward_pre_hook(
        lambda _, args: passes.append((args[0].numel(), torch.get_num_threads()))
    )
    tokens = [o.token_ids for o in engine.generate(prompts, params)]
    assert torch.get_num_threads() == 2  # given back after every pass
    assert len(passes) == len(kernels) and all(
        k is numba_cpu._paged_attention_kernel for k in kernels
    )
    threshold = threads_module.ONE_THREAD_BELOW_MACS / largest_weight(engine.runner.model)
    assert any(rows < threshold for rows, _ in passes) and any(
        rows >= threshold for rows, _ in passes
    )
    assert all(threads == (1 if rows < threshold else 2) for rows, threads in passes)
    monkeypatch.setattr(threads_module, "ONE_THREAD_BELOW_MACS", 0)
    again = [o.token_ids for o in LLMEngine(target, config).generate(prompts, params)]
    assert again == tokens


def test_threads_that_spin_keep_every_thread(target, two_torch_threads, monkeypatch):
    """With a spin before the threads sleep (the short-spin opt-in, or OpenMP's active default),
    waking them costs nothing and every pass keeps torch's count."""
    cpu = torch.device("cpu")
    for policy, spin, sleeps in [
        ("PASSIVE", None, True),
        ("PASSIVE", "0", True),
        ("PASSIVE", "20000", False),
        (None, None, False),
    ]:
        for name, value in (("OMP_WAIT_POLICY", policy), ("GOMP_SPINCOUNT", spin)):
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, value)
        assert threads_module.threads_sleep_at_once() is sleeps
    monkeypatch.setattr(threads_module, "THREADS_SLEEP", False)
    assert pass_threads(target, 1, cpu) == 2
