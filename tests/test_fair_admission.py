"""Fair admission (issue 30, item 3): waiting client requests take turns, and one request may not
ask for more sequences than a batch holds.

The waiting queue on its own, then the scheduler with no model (a big group and a small one behind
it), then the engine with the tiny shipped model (first token within a bounded number of steps,
every request's tokens as when it runs alone), then the server's cap on prompts x n.
"""

from __future__ import annotations

import pytest

from minivllm.engine.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.kv.block_manager import BlockManager
from minivllm.sched.scheduler import Scheduler, SchedulerConfig
from minivllm.sched.sequence import SamplingParams, Sequence
from minivllm.sched.waiting import WaitingQueue
from minivllm.serving.limits import (
    RequestError,
    ServerLimits,
    check_sequences,
    max_seqs_per_request,
)

EOS = 257
SMALL_PROMPT = "KING LEAR:\n"


def seq(seq_id: int, group=None, max_tokens: int = 4, prompt_len: int = 5) -> Sequence:
    ids = [(seq_id * 31 + i) % 200 for i in range(prompt_len)]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Sequence(seq_id, ids, params, seed=seq_id, eos_token_id=EOS, group=group)


def ids(queue) -> list[int]:
    return [s.seq_id for s in queue]


# -- the waiting queue -----------------------------------------------------------------------------
def test_each_sequence_alone_in_its_group_is_first_come_first_served() -> None:
    queue = WaitingQueue()
    for i in range(5):
        queue.append(seq(i))  # group: its own request id
    assert ids(queue) == [0, 1, 2, 3, 4] and len(queue) == 5
    assert [queue.popleft().seq_id for _ in range(5)] == [0, 1, 2, 3, 4] and not queue


def test_groups_take_turns_and_a_newcomer_goes_before_the_group_just_served() -> None:
    queue = WaitingQueue()
    for i in range(4):
        queue.append(seq(i, group="big"))
    assert queue.popleft().seq_id == 0
    queue.append(seq(10, group="small"))  # arrives after big's turn: goes first
    assert queue[0].seq_id == 10 and ids(queue) == [10, 1, 2, 3]
    assert queue.popleft().seq_id == 10
    queue.append(seq(20, group="late"))  # arrives after small's turn: big's turn comes first
    assert ids(queue) == [1, 20, 2, 3]
    assert [queue.popleft().seq_id for _ in range(4)] == [1, 20, 2, 3]


def test_two_big_groups_alternate() -> None:
    queue = WaitingQueue()
    for i in range(3):
        queue.append(seq(i, group="a"))
    for i in range(3, 6):
        queue.append(seq(i, group="b"))
    assert ids(queue) == [0, 3, 1, 4, 2, 5]
    assert [queue.popleft().seq_id for _ in range(6)] == [0, 3, 1, 4, 2, 5]


def test_a_preempted_sequence_comes_back_before_every_group() -> None:
    queue = WaitingQueue()
    a, b, resumed = seq(0, group="a"), seq(1, group="b"), seq(2, group="a")
    queue.append(a), queue.append(b), queue.appendleft(resumed)
    assert queue[0] is resumed and ids(queue) == [2, 0, 1] and resumed in queue
    queue.remove(a)
    assert a not in queue and ids(queue) == [2, 1] and queue[-1] is b and len(queue) == 2
    with pytest.raises(ValueError, match="sequence 0 is not waiting"):
        queue.remove(a)
    with pytest.raises(IndexError):
        queue[2]


# -- the scheduler, no model -----------------------------------------------------------------------
MAX_TOKENS = 8  # every big sequence's answer: a seat frees at most this many steps after it starts


def steps_until_admitted(small_group) -> int:
    """64 sequences of one request fill a 4-seat batch; a one-sequence request arrives two steps
    later. Steps from its arrival to its admission."""
    s = Scheduler(SchedulerConfig(max_num_seqs=4), BlockManager(256, 4))
    for i in range(64):
        s.add(seq(i, group="big", max_tokens=MAX_TOKENS))
    for _ in range(2):
        plan = s.schedule()
        s.update(plan, dict.fromkeys(plan.sampling_seq_ids, 7))
    small = seq(100, group=small_group, max_tokens=2)
    s.add(small)
    arrival = s.step
    while True:
        plan = s.schedule()
        s.update(plan, dict.fromkeys(plan.sampling_seq_ids, 7))
        if small.seq_id in plan.admitted:
            return s.step - arrival
        assert s.step < 1000, "the small request was never admitted"


def test_a_small_request_behind_a_big_one_is_admitted_when_the_first_seat_frees() -> None:
    # The bound from the policy: the small group is the only one to arrive, so it is the head
    # after at most one admission (the big group's); it waits only for a free seat, and a running
    # sequence frees one within MAX_TOKENS steps of the small one's arrival.
    assert steps_until_admitted("small") <= MAX_TOKENS
    # In the big group (first come first served) it waits for all 64: 16 batches of 4.
    assert steps_until_admitted("big") > 10 * MAX_TOKENS


# -- the engine, with the tiny shipped model -------------------------------------------------------
BIG_PROMPTS = ["ROMEO:\n", "JULIET:\n", "HAMLET:\n", "First Citizen:\n"]
BIG = SamplingParams(max_tokens=6, temperature=0.9, seed=11, n=4, ignore_eos=True)
SMALL = SamplingParams(max_tokens=4, temperature=0.9, seed=5)


def small_engine(model) -> LLMEngine:
    scheduler = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64)
    return LLMEngine(model, EngineConfig(num_blocks=64, block_size=16, scheduler=scheduler))


def run(model, big: bool, small: bool, fair: bool = True) -> tuple[dict, int | None]:
    """The big request (4 prompts x n=4: four batches of 4 seats), then after one step the small
    one. Tokens by (prompt, sample), and the steps from the small request's arrival to its first
    token."""
    engine = small_engine(model)
    prompt_of, tokens = {}, {}
    for prompt in BIG_PROMPTS if big else ():  # fair: one group; else each prompt its own
        prompt_of[engine.add_request(prompt, BIG, group="big" if fair else None)] = prompt
    if big:
        engine.step()
    if small:
        prompt_of[engine.add_request(SMALL_PROMPT, SMALL)] = SMALL_PROMPT
    arrival, first_token = engine.scheduler.step, None
    while engine.has_unfinished():
        for out in engine.step():
            prompt = prompt_of[out.request_id]
            tokens[prompt, out.index] = list(out.token_ids)
            if prompt == SMALL_PROMPT and first_token is None:
                first_token = engine.scheduler.step - arrival
    return tokens, first_token


@pytest.mark.usefixtures("one_torch_thread")
def test_a_small_request_gets_its_first_token_soon_and_nobody_s_tokens_change(target) -> None:
    together, first_token = run(target, big=True, small=True)
    # It is admitted when the first big batch (6 tokens) is done: its first token comes with its
    # prefill, within 6 + 1 steps of arriving.
    assert first_token <= BIG.max_tokens + 1
    _, first_token_in_line = run(target, big=True, small=True, fair=False)
    assert first_token_in_line > 3 * BIG.max_tokens  # behind all four big batches
    big_alone, _ = run(target, big=True, small=False)
    small_alone, _ = run(target, big=False, small=True)
    assert together == {**big_alone, **small_alone}
    assert len(together) == len(BIG_PROMPTS) * BIG.n + 1


# -- the server's cap on one request's sequences ---------------------------------------------------
def test_a_request_may_not_ask_for_more_sequences_than_a_batch() -> None:
    check_sequences(32, 2, 64)  # 64: exactly one batch
    check_sequences(1, 16, 64)
    with pytest.raises(RequestError, match="32 prompt.* x n=16 samples is 512 sequences") as error:
        check_sequences(32, 16, 64)
    assert "at most 64" in str(error.value) and "smaller n" in str(error.value)
    assert error.value.status == 400 and error.value.param == "n"
    with pytest.raises(RequestError, match="at most 8") as error:
        check_sequences(9, 1, 8)
    assert error.value.param == "prompt"
    assert max_seqs_per_request(ServerLimits(), max_num_seqs=64) == 64
    assert max_seqs_per_request(ServerLimits(max_seqs_per_request=16), max_num_seqs=64) == 16
    with pytest.raises(ValueError, match="max_seqs_per_request must be an int >= 1"):
        ServerLimits(max_seqs_per_request=0)


def test_serve_takes_max_seqs_per_request() -> None:
    from minivllm.cli import build_parser, server_limits

    default = server_limits(build_parser().parse_args(["serve"]))
    assert default.max_seqs_per_request is None  # the engine's max_num_seqs
    args = build_parser().parse_args(["serve", "--max-seqs-per-request", "24"])
    assert server_limits(args).max_seqs_per_request == 24
