"""vLLM's sampling parameters (issue 18): each one checked at the door, each one doing what vLLM's
does, batched in the sampler's metadata, and none of them making a request's tokens depend on its
neighbours.

The first half needs no model: `apply_logit_rules` and `token_probs` on hand-made logits, with the
formulas written out. The second half runs the shipped target model: logit_bias, min_tokens,
stop_token_ids, include_stop_str_in_output and bad_words through the engine; logprobs and prompt
logprobs against a direct forward pass; and a penalised, seeded request giving the same tokens
alone, among 40 others and under preemption.
"""

from __future__ import annotations

import pytest
import torch

from minivllm.engine.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.model.tokenizer import EOS_ID, ByteTokenizer
from minivllm.runner.sampler import (
    LogitRules,
    SamplingMetadata,
    UndrawableLogitsError,
    apply_logit_rules,
    logprob_dicts,
    sample,
    token_probs,
    undrawable_rows,
)
from minivllm.runner.speculative import SpeculativeConfig
from minivllm.sched.scheduler import SchedulerConfig
from minivllm.sched.sequence import MIN_REPETITION_PENALTY, SamplingParams, Sequence

tok = ByteTokenizer()
VOCAB = 259

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def seq_with(params: SamplingParams, prompt: list[int], output: list[int] = ()) -> Sequence:
    bad_word_ids = tuple(tuple(ByteTokenizer().encode(w)) for w in params.bad_words)
    seq = Sequence(0, prompt, params, seed=1, eos_token_id=EOS_ID, bad_word_ids=bad_word_ids)
    seq.token_ids += output
    return seq


def rules_of(params: SamplingParams, prompt: list[int], output: list[int] = ()) -> LogitRules:
    rules = LogitRules.of(seq_with(params, prompt, list(output)))
    assert rules is not None
    return rules


# -- the door: every field, bad values named ------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n", 0),
        ("n", 17),
        ("n", 2.0),
        ("presence_penalty", 2.5),
        ("presence_penalty", float("nan")),
        ("frequency_penalty", -3),
        ("frequency_penalty", "1"),
        ("repetition_penalty", 0),
        ("repetition_penalty", float("inf")),
        ("repetition_penalty", float("nan")),
        ("repetition_penalty", 1e-320),  # a logit divided by it overflows to inf (issue 30)
        ("repetition_penalty", 1e-4),
        ("min_p", -0.1),
        ("min_p", 1.5),
        ("logit_bias", {5: 101}),
        ("logit_bias", {-1: 1}),
        ("logit_bias", {"a": 1}),
        ("logit_bias", 7),
        ("logit_bias", [(3, 1.0), (3, 2.0)]),
        ("min_tokens", -1),
        ("min_tokens", 17),  # above max_tokens (16)
        ("include_stop_str_in_output", 1),
        ("logprobs", -1),
        ("logprobs", 21),
        ("logprobs", True),
        ("prompt_logprobs", 21),
        ("bad_words", [""]),
        ("bad_words", [3]),
        ("allowed_token_ids", []),
        ("allowed_token_ids", [-1]),
        ("stop_token_ids", [1.5]),
    ],
)
def test_bad_values_raise_naming_the_field(field, value):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}"):
        SamplingParams(**{field: value})


def test_params_are_stored_immutably():
    params = SamplingParams(logit_bias={9: -1.5, 3: 2}, bad_words="xy", allowed_token_ids=[4, 2])
    assert params.logit_bias == ((3, 2), (9, -1.5))  # a dict becomes sorted pairs
    assert params.bad_words == ("xy",) and params.allowed_token_ids == (4, 2)
    assert hash(params) == hash(
        SamplingParams(logit_bias={3: 2, 9: -1.5}, bad_words=["xy"], allowed_token_ids=(4, 2))
    )


def test_long_bad_values_are_cut_in_the_message():
    with pytest.raises(ValueError) as error:
        SamplingParams(stop_token_ids=[-1] * 10_000)
    assert len(str(error.value)) < 200


def test_the_engine_checks_token_ids_against_the_vocabulary(target):
    engine = LLMEngine(target, EngineConfig(num_blocks=32))
    for params in (
        SamplingParams(stop_token_ids=[VOCAB]),
        SamplingParams(logit_bias={VOCAB + 5: 1}),
        SamplingParams(allowed_token_ids=[1, 10_000]),
    ):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            engine.add_request("x", params)
    assert not engine.has_unfinished()


@pytest.mark.parametrize(
    "params, message",
    [
        (SamplingParams(allowed_token_ids=[65], bad_words=["A"]), "one-token bad word"),
        (SamplingParams(allowed_token_ids=[65, 66], bad_words=["A", "B"]), "one-token bad word"),
        (SamplingParams(allowed_token_ids=[EOS_ID], min_tokens=2), "only stop tokens"),
        (
            SamplingParams(allowed_token_ids=[10], stop_token_ids=[10], min_tokens=1),
            "only stop tokens",
        ),
    ],
)
def test_rules_that_leave_no_token_are_refused_at_the_door(target, params, message):
    engine = LLMEngine(target, EngineConfig(num_blocks=8))
    with pytest.raises(ValueError, match=message):
        engine.add_request("ROMEO:", params)
    assert not engine.has_unfinished()


def test_rules_that_leave_some_token_are_accepted(target):
    engine = LLMEngine(target, EngineConfig(num_blocks=8))
    out = engine.generate(
        ["ROMEO:"], SamplingParams(allowed_token_ids=[65, 66], bad_words=["A"], max_tokens=3)
    )[0]
    assert out.token_ids == [66, 66, 66]
    ignored = SamplingParams(allowed_token_ids=[EOS_ID], min_tokens=1, ignore_eos=True)
    engine.add_request("ROMEO:", ignored)  # EOS is not a stop token here: nothing is banned


def test_a_sequence_does_not_stop_before_min_tokens():
    params = SamplingParams(min_tokens=2, stop_token_ids=[7], max_tokens=5)
    seq = seq_with(params, [1])
    seq.append_token(EOS_ID)
    seq.append_token(7)
    assert not seq.is_finished  # two tokens so far: a stop may only come as the third or later
    seq.append_token(7)
    assert seq.is_finished and seq.stop_reason == 7


# -- the rules, no model --------------------------------------------------------------------------


def test_rows_without_rules_are_untouched_and_greedy_stays_argmax():
    logits = torch.randn(3, VOCAB)
    plain = SamplingMetadata.from_sequences([seq_with(SamplingParams(temperature=0), [1, 2])] * 3)
    assert not plain.rules and not plain.min_ps and not plain.logprobs
    assert sample(logits, plain) == logits.argmax(-1).tolist()
    ruled = rules_of(SamplingParams(logit_bias={5: 1}), [1])
    out = apply_logit_rules(logits, [None, ruled, None], [1, 1, 1])
    assert torch.equal(out[[0, 2]], logits[[0, 2]].double())
    assert out[1, 5] == logits[1, 5].double() + 1


def test_logit_bias_bans_and_favours():
    logits = torch.zeros(1, VOCAB)
    logits[0, 7] = 5.0
    params = SamplingParams(temperature=0, logit_bias={7: -100, 9: 0.5})
    meta = SamplingMetadata.from_sequences([seq_with(params, [1])])
    assert sample(logits, meta) == [9]


def test_frequency_and_presence_penalties_follow_the_formula():
    prompt, output = [1, 2, 3], [4, 4, 4, 5]
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    logits = torch.randn(1, VOCAB, dtype=torch.float64)
    out = apply_logit_rules(logits, [rules_of(params, prompt, output)], [7])
    expected = logits.clone()
    expected[0, 4] -= 3 * 0.5 + 0.25  # three earlier occurrences in the output
    expected[0, 5] -= 1 * 0.5 + 0.25
    # prompt tokens are not penalised by frequency / presence (vLLM: output only)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    # and the probability of the repeated token falls by exactly exp(-penalty) relative to an
    # untouched one
    p, q = out[0].softmax(-1), logits[0].softmax(-1)
    ratio = (p[4] / p[0]) / (q[4] / q[0])
    assert abs(ratio.item() - torch.exp(torch.tensor(-1.75, dtype=torch.float64)).item()) < 1e-12


def test_repetition_penalty_covers_prompt_and_output():
    params = SamplingParams(repetition_penalty=2.0)
    logits = torch.zeros(1, VOCAB, dtype=torch.float64)
    logits[0, 1], logits[0, 4], logits[0, 6] = 3.0, -3.0, 3.0
    out = apply_logit_rules(logits, [rules_of(params, [1, 2], [4])], [3])
    assert out[0, 1] == 1.5 and out[0, 4] == -6.0  # divided when positive, multiplied otherwise
    assert out[0, 6] == 3.0  # never seen: untouched


def test_penalties_see_only_tokens_before_the_drawn_position():
    params = SamplingParams(frequency_penalty=1.0)
    logits = torch.zeros(1, VOCAB, dtype=torch.float64)
    rules = rules_of(params, [1], [9, 9, 9])
    assert apply_logit_rules(logits, [rules], [2])[0, 9] == -1  # draws position 2: one 9 before
    assert apply_logit_rules(logits, [rules], [4])[0, 9] == -3


def test_min_tokens_bans_eos_and_stop_tokens_until_reached():
    params = SamplingParams(min_tokens=2, stop_token_ids=[33])
    rules = rules_of(params, [1, 2, 3])
    logits = torch.zeros(1, VOCAB)
    for position, banned in ((3, True), (4, True), (5, False)):  # outputs 0, 1, 2 so far
        out = apply_logit_rules(logits, [rules], [position])
        assert bool(torch.isneginf(out[0, EOS_ID])) is banned
        assert bool(torch.isneginf(out[0, 33])) is banned
        assert torch.isfinite(out[0, :33]).all()


def test_min_tokens_keeps_eos_when_eos_is_ignored_only_stop_ids_banned():
    rules = rules_of(SamplingParams(min_tokens=3, ignore_eos=True, stop_token_ids=[7]), [1])
    out = apply_logit_rules(torch.zeros(1, VOCAB), [rules], [1])
    assert torch.isfinite(out[0, EOS_ID]) and torch.isneginf(out[0, 7])


def test_bad_words_ban_the_last_token_after_the_others():
    params = SamplingParams(bad_words=["ab", "z"])
    a, b, z = (ord(c) for c in "abz")
    logits = torch.zeros(2, VOCAB)
    after_a = rules_of(params, [1], [a])
    after_x = rules_of(params, [1], [ord("x")])
    out = apply_logit_rules(logits, [after_a, after_x], [2, 2])
    assert torch.isneginf(out[0, b]) and torch.isfinite(out[1, b])  # "b" only right after "a"
    assert torch.isneginf(out[:, z]).all()  # a one-token word: always banned
    # the prompt does not count (vLLM checks the generated tokens only)
    in_prompt = rules_of(params, [1, a])
    assert torch.isfinite(apply_logit_rules(logits[:1], [in_prompt], [2])[0, b])


def test_allowed_token_ids_leave_only_those():
    rules = rules_of(SamplingParams(allowed_token_ids=[10, 20]), [1])
    out = apply_logit_rules(torch.randn(2, VOCAB), [rules, None], [1, 1])
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [10, 20]
    assert torch.isfinite(out[1]).all()


def test_rules_that_ban_everything_fall_back_instead_of_nan():
    rules = rules_of(SamplingParams(allowed_token_ids=[EOS_ID], min_tokens=1), [1])
    out = apply_logit_rules(torch.randn(1, VOCAB), [rules], [1])
    assert torch.isfinite(out).all()


# -- a step's work is the request's real size, not its JSON's (issue 30) -------------------------


def test_repeated_ids_and_words_collapse_at_the_door():
    params = SamplingParams(
        allowed_token_ids=[65] * 1000 + [66, 65, 67],
        stop_token_ids=[0] * 500 + [3, 0],
        bad_words=["zz", "zz", "q"],
        logit_bias={66: 1.5},
    )
    assert params.allowed_token_ids == (65, 66, 67)
    assert params.stop_token_ids == (0, 3) and params.stop_token_set == {0, 3}
    assert params.bad_words == ("zz", "q")
    assert params == SamplingParams(
        allowed_token_ids=[65, 66, 67],
        stop_token_ids=[0, 3],
        bad_words=["zz", "q"],
        logit_bias={66: 1.5},
    )


def test_repeated_ids_give_the_same_logits_as_the_ids_once():
    a, z = ord("a"), ord("z")
    repeated = dict(
        allowed_token_ids=[a] * 300 + [z, EOS_ID, 7] * 100,
        stop_token_ids=[7] * 200,
        bad_words=["z"] * 50,
        min_tokens=2,
    )
    once = dict(
        allowed_token_ids=[a, z, EOS_ID, 7], stop_token_ids=[7], bad_words=["z"], min_tokens=2
    )
    logits = torch.randn(1, VOCAB)
    for position in (1, 2, 3):  # before min_tokens, and after
        out = [
            apply_logit_rules(logits, [rules_of(SamplingParams(**kw), [1], [a, a])], [position])
            for kw in (repeated, once)
        ]
        assert torch.equal(out[0], out[1])
        assert torch.isfinite(out[0][0]).nonzero().flatten().tolist() == (
            [a] if position < 3 else sorted([a, EOS_ID, 7])
        )


class _NoIteration(tuple):
    """An id list that fails the test if anything walks it."""

    def __iter__(self):
        raise AssertionError("a step walked a request's id list")

    def __contains__(self, item):
        raise AssertionError("a step scanned a request's id list")


def test_a_step_never_walks_the_request_lists_again(monkeypatch):
    """The rules (masks, biases, bans as tensors) are built once per sequence; after that a step
    reads only them, so its work does not grow with the lists the request sent."""
    import minivllm.runner.sampler as sampler

    builds = []
    real_build = sampler.build_logit_rules
    monkeypatch.setattr(sampler, "build_logit_rules", lambda s: builds.append(s) or real_build(s))
    params = SamplingParams(
        temperature=0.8,
        seed=3,
        max_tokens=12,
        allowed_token_ids=list(range(40, 60)) * 50,
        stop_token_ids=[5, 6] * 100,
        logit_bias={41: 2.0, 42: -1.0},
        bad_words=["zz"],
    )
    seq = seq_with(params, [1, 2])
    logits = torch.randn(12, VOCAB, generator=torch.Generator().manual_seed(0))
    sample(logits[:1], SamplingMetadata.from_sequences([seq]))  # the build
    for name in ("allowed_token_ids", "stop_token_ids", "bad_words"):
        object.__setattr__(params, name, _NoIteration(getattr(params, name)))
    object.__setattr__(params, "logit_bias", _NoIteration(params.logit_bias))
    for step in range(12):
        if seq.is_finished:
            break
        meta = SamplingMetadata.from_sequences([seq])
        seq.append_token(sample(logits[step : step + 1], meta)[0])
    assert builds == [seq] and len(seq.output_token_ids) > 1


def test_the_smallest_repetition_penalty_keeps_logits_finite():
    params = SamplingParams(repetition_penalty=MIN_REPETITION_PENALTY)
    logits = torch.full((1, VOCAB), torch.finfo(torch.float32).max)  # the worst a model can give
    out = apply_logit_rules(logits, [rules_of(params, [1, 2], [3])], [3])
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("poison", [float("nan"), float("inf"), float("-inf")])
def test_a_row_with_nothing_to_draw_is_named_never_sampled(poison):
    logits = torch.randn(3, VOCAB)
    logits[1, 5] = poison
    if poison == float("-inf"):
        logits[1] = poison  # -inf alone is a ban; a row of nothing but bans has nothing to draw
    seqs = [seq_with(SamplingParams(temperature=t, seed=1), [1]) for t in (0, 0.7, 0.7)]
    for seq_id, seq in enumerate(seqs):
        seq.seq_id = seq_id
    meta = SamplingMetadata.from_sequences(seqs)
    with pytest.raises(UndrawableLogitsError, match=r"sequence\(s\) \[1\] hold NaN") as error:
        sample(logits, meta)
    assert error.value.seq_ids == (1,)
    assert undrawable_rows(logits) == [1]


def test_an_undrawable_request_ends_with_a_reason_and_the_others_go_on(target, monkeypatch):
    """A model whose logits for one request turn NaN: that request ends "abort" with the reason,
    no token drawn; the request beside it gets the tokens it gets alone."""
    marker = 7  # the poisoned request's prompt ends with it; the other's never holds it
    params = SamplingParams(max_tokens=8, temperature=0.8, seed=4)
    alone = LLMEngine(target).generate([[1, 82, 79]], params)[0].token_ids
    engine = LLMEngine(target)
    real_forward = engine.runner.forward

    def poisoned(batch):
        logits = real_forward(batch)
        logits[batch.input_ids[batch.logits_indices] == marker] = float("nan")
        return logits

    monkeypatch.setattr(engine.runner, "forward", poisoned)
    outputs = engine.generate([[1, 82, 79], [1, 82, marker]], params)
    assert outputs[0].token_ids == alone and outputs[0].finish_reason == "length"
    assert (outputs[1].token_ids, outputs[1].finish_reason) == ([], "abort")
    assert "NaN" in outputs[1].finish_message
    assert not engine.has_unfinished() and engine.manager.num_used == 0


def test_min_p_drops_tokens_below_a_fraction_of_the_likeliest():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]], dtype=torch.float64))
    one = torch.ones(1, dtype=torch.float64)
    probs = token_probs(logits, one, torch.zeros(1, dtype=torch.long), one, torch.tensor([0.4]))
    # threshold 0.4 * 0.5 = 0.2: only the first two stay, renormalised
    torch.testing.assert_close(probs[0], torch.tensor([0.625, 0.375, 0, 0], dtype=torch.float64))
    unchanged = token_probs(logits, one, torch.zeros(1, dtype=torch.long), one, torch.zeros(1))
    torch.testing.assert_close(unchanged, logits.softmax(-1))


def test_rules_of_a_row_do_not_depend_on_the_batch():
    params = SamplingParams(
        frequency_penalty=0.7, repetition_penalty=1.3, logit_bias={3: 2}, min_tokens=2
    )
    mine = rules_of(params, [5, 6, 7], [7, 8])
    others = [rules_of(SamplingParams(presence_penalty=-1.0), [9], [1, 2, 2]), None]
    logits = torch.randn(3, VOCAB)
    alone = apply_logit_rules(logits[1:2], [mine], [5])
    batched = apply_logit_rules(logits, [others[0], mine, None], [4, 5, 1])
    assert torch.equal(alone[0], batched[1])


def test_logprob_dicts_are_sorted_and_hold_the_chosen_token():
    logits = torch.randn(2, VOCAB)
    chosen = [int(logits[0].argmin()), int(logits[1].argmax())]
    dicts = logprob_dicts(logits, chosen, [3, 0])
    exact = torch.log_softmax(logits.double(), -1)
    assert len(dicts[0]) == 4 and list(dicts[1]) == [chosen[1]]
    values = list(dicts[0].values())[:3]
    assert values == sorted(values, reverse=True)
    assert list(dicts[0])[:3] == exact[0].topk(3).indices.tolist()
    for r, token in enumerate(chosen):
        assert dicts[r][token] == pytest.approx(exact[r, token].item(), abs=1e-12)


# -- through the engine, with the shipped model ---------------------------------------------------


def make_engine(model, num_blocks: int = 128, **scheduler) -> LLMEngine:
    scheduler.setdefault("max_num_seqs", 48)
    scheduler.setdefault("max_num_batched_tokens", 64)
    config = EngineConfig(
        num_blocks=num_blocks, block_size=16, scheduler=SchedulerConfig(**scheduler)
    )
    return LLMEngine(model, config)


PROMPT = "ROMEO:\nWhat light"


def test_logit_bias_bans_a_token_in_the_engine(target):
    greedy = SamplingParams(max_tokens=12, temperature=0)
    first = make_engine(target).generate([PROMPT], greedy)[0].token_ids
    banned = first[0]
    params = SamplingParams(max_tokens=12, temperature=0, logit_bias={banned: -100})
    out = make_engine(target).generate([PROMPT], params)[0].token_ids
    assert banned not in out and out != first


def test_min_tokens_holds_back_stop_tokens(target):
    first = make_engine(target).generate([PROMPT], SamplingParams(max_tokens=8, temperature=0))[0]
    stop = first.token_ids[0]
    stops_at_once = SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[stop])
    out = make_engine(target).generate([PROMPT], stops_at_once)[0]
    assert out.token_ids == [stop] and out.stop_reason == stop
    held = SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[stop], min_tokens=4)
    out = make_engine(target).generate([PROMPT], held)[0]
    assert len(out.token_ids) >= 4 and stop not in out.token_ids[:4]


def test_include_stop_str_in_output(target):
    text = make_engine(target).generate([PROMPT], SamplingParams(max_tokens=12, temperature=0))
    stop = text[0].text[2:4]
    cut, kept = make_engine(target).generate(
        [PROMPT, PROMPT],
        [
            SamplingParams(max_tokens=12, temperature=0, stop=[stop]),
            SamplingParams(
                max_tokens=12, temperature=0, stop=[stop], include_stop_str_in_output=True
            ),
        ],
    )
    assert cut.finish_reason == kept.finish_reason == "stop"
    assert kept.text == cut.text + stop


def test_bad_words_in_the_engine(target):
    out = make_engine(target).generate([PROMPT], SamplingParams(max_tokens=24, temperature=0))[0]
    word = out.text[:2]
    params = SamplingParams(max_tokens=24, temperature=0, bad_words=[word])
    assert word not in make_engine(target).generate([PROMPT], params)[0].text


def test_logprobs_match_a_direct_forward(target):
    params = SamplingParams(max_tokens=10, temperature=0.9, seed=3, logprobs=5, prompt_logprobs=3)
    # a small budget: the prompt is prefilled in several chunks
    engine = make_engine(target, max_num_seqs=4, max_num_batched_tokens=8)
    out = engine.generate([PROMPT], params)[0]
    ids = out.prompt_token_ids + out.token_ids
    with torch.no_grad():
        exact = torch.log_softmax(target(torch.tensor(ids)).double(), dim=-1)
    assert len(out.logprobs) == len(out.token_ids)
    for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        row = exact[len(out.prompt_token_ids) - 1 + i]
        assert entry[token] == pytest.approx(row[token].item(), abs=1e-5)
        top = list(entry)[:5]
        assert top == row.topk(5).indices.tolist()
        assert list(entry.values())[:5] == sorted(list(entry.values())[:5], reverse=True)
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
    for p in range(1, len(out.prompt_token_ids)):
        entry, token = out.prompt_logprobs[p], out.prompt_token_ids[p]
        assert entry[token] == pytest.approx(exact[p - 1, token].item(), abs=1e-5)
        assert list(entry)[:3] == exact[p - 1].topk(3).indices.tolist()


def test_streamed_logprobs_line_up_with_the_tokens(target):
    engine = make_engine(target)
    params = SamplingParams(max_tokens=9, temperature=0.7, seed=1, logprobs=0)
    deltas = list(engine.stream([PROMPT], params))
    tokens = [t for d in deltas for t in d.token_ids]
    logprobs = [lp for d in deltas for lp in d.logprobs]
    assert len(tokens) == len(logprobs) == 9
    assert all(list(lp) == [t] for t, lp in zip(tokens, logprobs))  # 0: the sampled token only


def test_prompt_logprobs_skip_the_prefix_cache(target):
    engine = make_engine(target, enable_prefix_caching=True)
    long_prompt = "First Citizen:\nBefore we proceed any further, hear me speak."
    engine.generate([long_prompt], SamplingParams(max_tokens=2))
    out = engine.generate([long_prompt], SamplingParams(max_tokens=2, prompt_logprobs=0))[0]
    assert out.num_cached_tokens == 0 and len(out.prompt_logprobs) == len(out.prompt_token_ids)


def test_speculative_decoding_refuses_what_it_cannot_honour(target):
    config = EngineConfig(num_blocks=64, speculative=SpeculativeConfig(method="ngram"))
    engine = LLMEngine(target, config)
    for field, value in (
        ("n", 2),
        ("logprobs", 1),
        ("prompt_logprobs", 0),
        ("frequency_penalty", 0.5),
        ("repetition_penalty", 1.2),
        ("bad_words", ["ab"]),
    ):
        with pytest.raises(ValueError, match=rf"SamplingParams\.{field} is not supported"):
            engine.add_request("x", SamplingParams(**{field: value}))
    # position-only rules work with it
    out = engine.generate(["ROMEO:"], SamplingParams(max_tokens=6, logit_bias={32: 3}, min_p=0.1))
    assert len(out[0].token_ids) <= 6


PENALISED = SamplingParams(
    max_tokens=24,
    temperature=0.9,
    top_p=0.95,
    min_p=0.02,
    seed=11,
    frequency_penalty=0.4,
    presence_penalty=0.3,
    repetition_penalty=1.1,
    logit_bias={101: 1.5},
    bad_words=["th"],
    min_tokens=5,
)


def test_penalised_tokens_alone_among_many_and_preempted(target):
    alone = make_engine(target).generate([PROMPT], PENALISED)[0].token_ids
    others = [  # some of them with parallel samples
        SamplingParams(
            max_tokens=20, temperature=0.8, seed=i, frequency_penalty=(i % 3) / 2, n=1 + i % 2
        )
        for i in range(40)
    ]
    crowd = make_engine(target).generate(
        [f"Line {i}: {PROMPT}" for i in range(20)] + [PROMPT] + [f"x{i}" for i in range(20)],
        others[:20] + [PENALISED] + others[20:],
    )
    assert crowd[20].token_ids == alone
    # a tiny cache: preemption by recompute throws K/V away, and the tokens must not change
    tiny = make_engine(target, num_blocks=12, max_num_seqs=8, max_num_batched_tokens=32)
    squeezed = tiny.generate(
        [PROMPT] + [f"Line {i}: {PROMPT}" for i in range(7)], [PENALISED] + others[:7]
    )
    assert sum(o.num_preemptions for o in squeezed) > 0
    assert squeezed[0].token_ids == alone


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_position_rules_under_speculation_keep_greedy_tokens(target, method):
    first = make_engine(target).generate([PROMPT], SamplingParams(max_tokens=8, temperature=0))[0]
    params = SamplingParams(
        max_tokens=20,
        temperature=0,
        logit_bias={first.token_ids[1]: -100, 101: 2.0},
        stop_token_ids=[first.token_ids[0]],
        min_tokens=6,
    )
    plain = make_engine(target).generate([PROMPT], params)[0]
    speculative = SpeculativeConfig(method=method, num_speculative_tokens=3)
    config = EngineConfig(num_blocks=128, speculative=speculative)
    assert LLMEngine(target, config).generate([PROMPT], params)[0].token_ids == plain.token_ids
    assert len(plain.token_ids) >= 6 and first.token_ids[1] not in plain.token_ids
