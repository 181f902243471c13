"""A small CPU pass runs torch's ops on one thread, its attention kernel on every thread
(`runner/threads.py`, issue 32)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

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


@pytest.fixture
def kernels(monkeypatch) -> list:
    """The kernel each numba backend set up (one per pass) was given, in order."""
    kernels = []
    original_init = NumbaPagedAttention.__init__

    def recording_init(self, storage, batch):
        original_init(self, storage, batch)
        kernels.append(self.kernel)

    monkeypatch.setattr(NumbaPagedAttention, "__init__", recording_init)
    return kernels


TEXT = shipped_validation_text()
PROMPTS = [TEXT[:400], TEXT[1000:1040], TEXT[2000:2030]]  # a 512-token chunk and small passes
PARAMS = SamplingParams(max_tokens=6, temperature=0)
CONFIG = EngineConfig(num_blocks=128, attention_backend="numba", device="cpu")


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
    target, two_torch_threads, kernels, monkeypatch
):
    """Each pass of an engine's generate: the threads torch had while the model ran, and the
    kernel the numba backend was set up with. Decodes of a few sequences are small passes; a
    512-token prefill chunk is not. The tokens are those of an engine whose passes all keep
    both threads (the threshold at 0)."""
    monkeypatch.setattr(numba_cpu, "PARALLEL_MIN_COST", 0)  # every pass worth the pool
    engine = LLMEngine(target, CONFIG)
    passes = []  # (rows, torch's threads while the model ran)
    engine.runner.model.register_forward_pre_hook(
        lambda _, args: passes.append((args[0].numel(), torch.get_num_threads()))
    )
    tokens = [o.token_ids for o in engine.generate(PROMPTS, PARAMS)]
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
    again = [o.token_ids for o in LLMEngine(target, CONFIG).generate(PROMPTS, PARAMS)]
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


class FakeMachine:
    """/proc/stat and the process's CPU time as a test sets them: `busy` ticks of every CPU
    together (100 a second, as Linux counts them), `own` seconds, `now` on the clock."""

    def __init__(self) -> None:
        self.busy, self.own, self.now = 0, 0.0, 0.0

    def watch(self, cpus=frozenset({0, 1}), window=0.5) -> threads_module.CoreWatch:
        watch = threads_module.CoreWatch(
            window, cpus, lambda _: self.busy, lambda: self.own, lambda: self.now
        )
        watch._tick = 0.01  # Linux's USER_HZ, whatever this machine says
        return watch

    def run(self, seconds: float, own_cores: float, other_cores: float) -> None:
        """`seconds` pass with this process busy on `own_cores` and others on `other_cores`."""
        self.now += seconds
        self.own += seconds * own_cores
        self.busy += round(100 * seconds * (own_cores + other_cores))


def test_the_watch_leaves_the_cores_other_processes_keep_busy():
    machine = FakeMachine()
    watch = machine.watch()
    assert watch.cores(2) == 2  # before a whole window: every core
    machine.run(0.3, own_cores=2.0, other_cores=1.0)
    assert watch.cores(2) == 2  # still inside the first window
    machine.run(0.3, own_cores=2.0, other_cores=1.0)
    assert watch.cores(2) == 1 and watch.others_busy == pytest.approx(1.0)
    # the other process goes on beside a one-thread pass, then stops
    machine.run(0.6, own_cores=1.0, other_cores=1.0)
    assert watch.cores(2) == 1
    machine.run(0.6, own_cores=1.0, other_cores=0.0)
    assert watch.cores(2) == 2 and watch.others_busy == pytest.approx(0.0)
    # a little background work (a shell, the kernel's own threads) does not take a core away
    machine.run(0.6, own_cores=2.0, other_cores=0.3)
    assert watch.cores(2) == 2
    # never fewer than one thread, never more than asked for
    machine.run(0.6, own_cores=1.0, other_cores=2.0)
    assert watch.cores(2) == 1 and watch.cores(1) == 1
    assert (watch.asked, watch.narrowed) == (8, 3)  # three calls got fewer than they asked for


def test_on_a_bigger_machine_the_watch_takes_only_what_the_others_leave():
    machine = FakeMachine()
    watch = machine.watch(cpus=frozenset(range(16)))
    machine.run(1.0, own_cores=4.0, other_cores=11.0)
    assert watch.cores(4) == 4  # 5 cores free: enough for 4 threads
    machine.run(1.0, own_cores=4.0, other_cores=13.6)
    assert watch.cores(4) == 2 and watch.cores(16) == 2


def test_the_watch_never_gives_more_threads_than_the_process_has_cpus(monkeypatch):
    machine = FakeMachine()
    assert machine.watch(cpus=frozenset({0, 1})).cores(4) == 2  # four spinning on two: no
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)  # macOS: no affinity to read
    monkeypatch.setattr(os, "cpu_count", lambda: 3)
    assert threads_module.CoreWatch(0.5).cpus == frozenset({0, 1, 2})


def test_the_watch_gives_every_core_where_proc_stat_cannot_be_read():
    watch = threads_module.CoreWatch(0.5, frozenset({0, 1}), lambda _: None)
    watch._last = (watch._last[0] - 1.0, None, watch._last[2])
    assert watch.cores(2) == 2 and watch.others_busy == 0.0


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="/proc/stat is Linux's")
def test_busy_ticks_reads_this_machines_cpus():
    cpus = frozenset(os.sched_getaffinity(0))
    before = threads_module._busy_ticks(cpus)
    deadline = time.process_time() + 0.1
    while time.process_time() < deadline:  # a tenth of a second busy: ten ticks, about
        pass
    after = threads_module._busy_ticks(cpus)
    assert isinstance(before, int) and after >= before + 5
    assert threads_module._busy_ticks(frozenset()) == 0


def test_free_threads_watches_only_where_torch_threads_spin(two_torch_threads, monkeypatch):
    cpu = torch.device("cpu")

    class OneCoreLeft:
        def cores(self, wanted: int) -> int:
            return 1

    monkeypatch.setattr(threads_module, "_WATCH", OneCoreLeft())
    assert threads_module.free_threads(cpu) == 2  # threads that sleep at once need no watch
    monkeypatch.setattr(threads_module, "THREADS_SLEEP", False)
    assert threads_module.free_threads(cpu) == 1
    assert threads_module.free_threads(torch.device("cuda")) == 2  # the GPU's threads are not ours
    monkeypatch.setattr(threads_module, "WATCH_CORES", False)  # MINIVLLM_WATCH_CORES=0
    assert threads_module.free_threads(cpu) == 2


def test_while_others_keep_the_cores_busy_a_spinning_engine_runs_on_one_thread(
    target, two_torch_threads, kernels, monkeypatch
):
    """Threads that spin, and a watch that says one core is left: every pass -- the model's ops
    and the attention kernel -- runs on one thread, with the tokens of every core."""
    monkeypatch.setattr(threads_module, "THREADS_SLEEP", False)
    monkeypatch.setattr(numba_cpu, "PARALLEL_MIN_COST", 0)  # every pass worth the pool

    class Watch:
        left = 1

        def cores(self, wanted: int) -> int:
            return min(wanted, self.left)

    watch = Watch()
    monkeypatch.setattr(threads_module, "_WATCH", watch)
    runs = {}
    for left in (1, 2):
        watch.left, passes = left, []
        kernels.clear()
        engine = LLMEngine(target, CONFIG)
        engine.runner.model.register_forward_pre_hook(
            lambda _, args, passes=passes: passes.append(torch.get_num_threads())
        )
        runs[left] = [o.token_ids for o in engine.generate(PROMPTS, PARAMS)]
        assert passes and set(passes) == {left}
        serial = numba_cpu._paged_attention_serial
        assert all((k is serial) == (left == 1) for k in kernels)
        assert torch.get_num_threads() == 2  # given back after every pass
    assert runs[1] == runs[2]


def policy_in_a_fresh_process(environment: dict[str, str], torch_first: bool = False) -> list:
    """[OMP_WAIT_POLICY, GOMP_SPINCOUNT, THREADS_SLEEP] in a process started with `environment`
    for those two, which imports minivllm (and torch after it, or before it)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(environment)
    imports = "torch, minivllm" if torch_first else "minivllm, torch"
    code = (
        f"import json, os, {imports}\n"
        "from minivllm.runner.threads import THREADS_SLEEP\n"
        "print(json.dumps([os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'),"
        " THREADS_SLEEP]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.parametrize(
    ("environment", "expected"),
    [
        ({}, ["PASSIVE", "20000", False]),  # minivllm's default: passive, with a short spin first
        ({"OMP_WAIT_POLICY": "PASSIVE"}, ["PASSIVE", None, True]),  # what the Makefile exports
        ({"OMP_WAIT_POLICY": "ACTIVE"}, ["ACTIVE", None, False]),  # yours wins
        ({"GOMP_SPINCOUNT": "5000"}, ["PASSIVE", "5000", False]),
    ],
)
def test_importing_minivllm_before_torch_sets_the_thread_policy(environment, expected):
    assert policy_in_a_fresh_process(environment) == expected


def test_importing_torch_first_leaves_the_thread_policy_as_it_was():
    """libgomp has read the environment already: minivllm then says nothing it did not get."""
    assert policy_in_a_fresh_process({}, torch_first=True) == [None, None, False]
