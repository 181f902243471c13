"""A checkpoint's own tokenizer (`HFTokenizer`) and text in the engine with it.

The tokenizer is trained offline with `tokenizers` (conftest's `train_bpe`, through
`minivllm.book.tiny_checkpoint`, the builder chapter 10 uses too): a tiny byte-level BPE with
Llama-3-like special tokens, saved as tokenizer.json + tokenizer_config.json
(+ generation_config.json) in a temporary folder. Its merges split multi-byte characters across
tokens (a token may end inside `日`), which is what the incremental detokenizer must get right.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm.book.tiny_checkpoint import save_tokenizer
from minivllm.engine.config import EngineConfig
from minivllm.engine.llm_engine import LLM, LLMEngine
from minivllm.engine.processing import OutputProcessor
from minivllm.model.chat_template import ChatTemplateError
from minivllm.model.hf_tokenizer import HFTokenizer, IncrementalDetokenizer, load_tokenizer
from minivllm.model.tokenizer import ByteTokenizer, Tokenizer
from minivllm.model.transformer import ModelConfig, Transformer
from minivllm.runner.speculative import SpeculativeConfig
from minivllm.sched.scheduler import SchedulerConfig
from minivllm.sched.sequence import LENGTH, STOP, SamplingParams, Sequence

tokenizers = pytest.importorskip("tokenizers")

BOS, END, EOT = "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"
TEXTS = ["Hello world", "café 日本 🙂", "日本語のテキスト🎉🎉", "naïve façade — Ελληνικά!", ""]


def save(
    tok: tokenizers.Tokenizer,
    folder: Path,
    bos_first: bool,
    config: dict,
    generation: dict | None = None,
) -> Path:
    """A checkpoint's tokenizer files: Llama 3's post-processor puts BOS first, Qwen's none."""
    return save_tokenizer(folder, tok, config, generation, BOS if bos_first else None)


@pytest.fixture(scope="module")
def folders(tmp_path_factory, bpe_trainer) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokenizers")
    bos = {"content": BOS, "special": True, "__type": "AddedToken"}  # as transformers saves it
    tok = bpe_trainer([BOS, END, EOT])
    return {
        "llama": save(
            tok,
            root / "llama",
            True,
            {"bos_token": bos, "eos_token": EOT},
            {"eos_token_id": [1, 2]},
        ),
        "qwen": save(tok, root / "qwen", False, {"bos_token": None, "eos_token": END}),
        "forced": save(tok, root / "forced", False, {"bos_token": BOS, "add_bos_token": True}),
        "dropped": save(tok, root / "dropped", True, {"bos_token": BOS, "add_bos_token": False}),
        "chat": save(
            tok,
            root / "chat",
            True,
            {"bos_token": bos, "eos_token": EOT, "chat_template": CHAT_TEMPLATE},
        ),
    }


# A chat template in the manner of Llama 3's: BOS once, each turn's role and text, the turn's end
# token, the generation prompt; a role it does not know is refused through raise_exception.
CHAT_TEMPLATE = (
    "{{- bos_token }}{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "{{ message['role'] }}: {{ message['content'] | trim }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)
CONVERSATION = [
    {"role": "system", "content": "Answer in French. "},
    {"role": "user", "content": "café? 日本"},
    {"role": "assistant", "content": "Oui 🙂"},
    {"role": "user", "content": "naïve façade"},
]


@pytest.fixture(scope="module")
def llama(folders) -> HFTokenizer:
    return HFTokenizer.from_folder(folders["llama"])


def test_it_is_a_tokenizer_with_the_special_tokens_its_files_name(llama, folders) -> None:
    assert isinstance(llama, Tokenizer) and isinstance(ByteTokenizer(), Tokenizer)
    ids = {name: llama.tokenizer.token_to_id(name) for name in (BOS, END, EOT)}
    assert llama.bos_id == ids[BOS] and llama.vocab_size == 400
    # tokenizer_config's eos_token first, then generation_config's others
    assert llama.eos_ids == (ids[EOT], ids[END]) and llama.eos_id == ids[EOT]
    qwen = HFTokenizer.from_folder(folders["qwen"])
    assert (qwen.bos_id, qwen.eos_ids) == (None, (ids[END],))
    assert load_tokenizer(folders["qwen"]) is not None and load_tokenizer("target") is None
    assert llama.token_repr(ids[EOT]) == EOT
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llama.token_repr(400)


def test_prompt_ids_are_the_checkpoint_tokenizers(folders) -> None:
    """Llama 3 puts BOS first, Qwen nothing: the same ids as transformers' tokenizer."""
    transformers = pytest.importorskip("transformers")
    for name in ("llama", "qwen"):
        theirs = transformers.AutoTokenizer.from_pretrained(str(folders[name]))
        ours = HFTokenizer.from_folder(folders[name])
        for text in TEXTS:
            assert ours.encode(text, add_bos=True) == theirs(text)["input_ids"], (name, text)
            assert ours.encode(text) == theirs(text, add_special_tokens=False)["input_ids"]
            assert ours.decode(ours.encode(text, add_bos=True)) == text


def test_add_bos_token_overrides_the_post_processor(folders) -> None:
    """tokenizer_config's add_bos_token wins where the post-processor disagrees (transformers'
    LlamaTokenizerFast rebuilds its post-processor from it)."""
    forced, dropped = (HFTokenizer.from_folder(folders[n]) for n in ("forced", "dropped"))
    plain = forced.tokenizer.encode("café").ids
    assert forced.encode("café", add_bos=True) == [forced.bos_id, *plain]
    assert dropped.encode("café", add_bos=True) == plain == dropped.encode("café")


def stream(detokenizer, ids: list[int]) -> list[str]:
    pieces = [detokenizer.push(i) for i in ids]
    return [*pieces, detokenizer.flush()]


@pytest.mark.exercise("ch10.1")
def test_a_token_can_split_a_character(llama) -> None:
    """The trained merges end some tokens inside a multi-byte character: decoded alone they show
    U+FFFD, streamed they never do."""
    ids = llama.encode("日本語のテキスト🎉")
    assert any("\ufffd" in llama.decode([i]) for i in ids)
    pieces = stream(llama.detokenizer(), ids)
    assert "".join(pieces) == "日本語のテキスト🎉" and not any("\ufffd" in p for p in pieces)


@pytest.mark.exercise("ch10.1")
def test_the_window_worked_by_hand() -> None:
    """Two toy decoders, no tokenizer files. One id per UTF-8 byte: a character comes out with its
    last byte, never before. And a decoder that drops the space a text starts with (as
    SentencePiece's does): the window keeps the handed-out word as the new word's left neighbour,
    so the space between the words survives."""
    by_bytes = IncrementalDetokenizer(lambda ids: bytes(ids).decode("utf-8", errors="replace"))
    assert [by_bytes.push(b) for b in "a日🙂".encode()] == ["a", "", "", "日", "", "", "", "🙂"]
    assert (by_bytes.prefix_offset, by_bytes.read_offset, by_bytes.flush()) == (4, 8, "")
    cut = IncrementalDetokenizer(lambda ids: bytes(ids).decode("utf-8", errors="replace"))
    assert [cut.push(b) for b in "é".encode()[:1]] == [""] and cut.flush() == "\ufffd"
    words = [" Hello", " world", "!"]
    spaced = IncrementalDetokenizer(lambda ids: "".join(words[i] for i in ids).removeprefix(" "))
    assert [spaced.push(i) for i in range(3)] == ["Hello", " world", "!"]
    assert (spaced.prefix_offset, spaced.read_offset) == (2, 3)


@pytest.mark.exercise("ch10.1")
@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_is_the_decoded_text(llama, text: str) -> None:
    ids = llama.encode(text, add_bos=True) + [llama.eos_id]
    pieces = stream(llama.detokenizer(), ids)
    assert "".join(pieces) == llama.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)


@pytest.mark.exercise("ch10.1")
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_any_ids_stream_to_their_decoded_text(llama, data) -> None:
    """Random ids (broken characters, special tokens, a stream cut mid-character): the pieces are
    decode(all ids), and no piece is ever taken back."""
    ids = data.draw(st.lists(st.integers(0, llama.vocab_size - 1), max_size=20))
    detokenizer, text = IncrementalDetokenizer(llama.decode), ""
    for count, token in enumerate(ids, start=1):
        text += detokenizer.push(token)
        assert llama.decode(ids[:count]).startswith(text)
    assert text + detokenizer.flush() == llama.decode(ids)


def sequence(tokenizer: HFTokenizer, prompt: str, **params) -> Sequence:
    ids = tokenizer.encode(prompt, add_bos=True)
    return Sequence(0, ids, SamplingParams(**params), seed=0, eos_token_id=tokenizer.eos_ids)


def feed(processor: OutputProcessor, seq: Sequence, ids: list[int]) -> list[str]:
    """Append `ids` one at a time as the scheduler does; decode them as the engine's step does."""
    deltas = []
    for token in ids:
        seq.append_token(token)
        for hit in processor.detokenize([seq]):
            seq.stop_at(hit.num_output_tokens, hit.stop)
        deltas.append(processor.output(seq).new_text)
        if seq.is_finished:
            break
    return deltas


@pytest.mark.parametrize(
    "answer, stop, want",
    [
        ("Hello world, café crème", "é c", "Hello world, caf"),
        ("日本語のテキスト、日本の本。", "本の", "日本語のテキスト、日"),
        ("emoji 🙂🎉 are fun!", "🎉 a", "emoji 🙂"),
    ],
)
def test_stop_strings_are_found_in_the_decoded_text(llama, answer, stop, want) -> None:
    processor = OutputProcessor(llama)
    seq = sequence(llama, "Q:", max_tokens=64, stop=[stop])
    ids = llama.encode(answer)
    deltas = feed(processor, seq, ids)
    out = processor.output(seq)
    assert (out.text, out.finish_reason, out.stop_reason) == (want, STOP, stop)
    assert "".join(deltas) == want and not any("\ufffd" in d for d in deltas)
    # it ended on the token that completed the stop string
    assert want + stop in llama.decode(seq.output_token_ids)
    assert want + stop not in llama.decode(seq.output_token_ids[:-1])


def test_eos_ids_from_generation_config_end_a_sequence(llama) -> None:
    for eos in llama.eos_ids:
        seq = sequence(llama, "Q:", max_tokens=8)
        seq.append_token(llama.encode("Hi")[0])
        seq.append_token(eos)
        assert (seq.finish_reason, seq.stop_reason) == (STOP, None)


def tiny_model(tokenizer: HFTokenizer) -> Transformer:
    torch.manual_seed(0)
    config = ModelConfig(
        vocab_size=tokenizer.vocab_size,
        d_model=32,
        n_layers=1,
        n_heads=4,
        n_kv_heads=2,
        d_ff=48,
        max_seq_len=128,
        bos_token_id=tokenizer.bos_id,
        eos_token_id=tokenizer.eos_id,
    )
    return Transformer(config).eval()


def engine(model, tokenizer, speculative: SpeculativeConfig | None = None) -> LLMEngine:
    config = EngineConfig(
        num_blocks=64,
        block_size=8,
        device="cpu",
        speculative=speculative,
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
    )
    return LLMEngine(model, config, tokenizer=tokenizer)


@pytest.mark.usefixtures("one_torch_thread")
def test_the_engine_encodes_and_decodes_with_the_checkpoints_tokenizer(llama) -> None:
    model = tiny_model(llama)
    prompts = ["Hello world", "日本語の", "emoji 🙂"]
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    outs = engine(model, llama).generate(prompts, greedy)
    for prompt, out in zip(prompts, outs):
        assert out.prompt_token_ids == llama.encode(prompt, add_bos=True)
        assert (out.finish_reason, len(out.token_ids)) == (LENGTH, 24)
        assert out.text == llama.decode(out.token_ids)
    # streamed: the deltas are the same text
    pieces: dict[int, str] = {}
    for delta in engine(model, llama).stream(prompts, greedy):
        pieces[delta.request_id] = pieces.get(delta.request_id, "") + delta.text
    assert [pieces[i] for i in range(3)] == [o.text for o in outs]
    # a stop string in the middle of the answer: cut there, finished on the token completing it
    text, tokens = outs[0].text, outs[0].token_ids
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    if not stop.strip():
        pytest.skip("the random model's answer has no usable stop string")
    with_stop = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=stop)
    [cut] = engine(model, llama).generate(prompts[:1], with_stop)
    assert (cut.text, cut.stop_reason) == (text[: text.index(stop)], stop)
    assert cut.token_ids == tokens[: len(cut.token_ids)]
    # speculative decoding (the target drafts for itself: every draft accepted, several tokens a
    # step): the same cut, the tokens after the stop string dropped
    self_draft = SpeculativeConfig("draft", 4, draft_model=model)
    speculative = engine(model, llama, self_draft)
    [spec] = speculative.generate(prompts[:1], with_stop)
    assert (spec.text, spec.stop_reason, spec.token_ids) == (cut.text, stop, cut.token_ids)
    appended = 1 + sum(accepted + 1 for r in speculative.trace for _, _, accepted in r.speculated)
    assert appended > len(spec.token_ids)  # the stop string was inside a run: its tail dropped


def test_llm_loads_a_folders_tokenizer(folders, monkeypatch) -> None:
    import minivllm.engine.llm_engine as llm_engine

    tokenizer = HFTokenizer.from_folder(folders["llama"])
    model = tiny_model(tokenizer)
    monkeypatch.setattr(llm_engine, "load_model", lambda name, dtype="auto": model)
    llm = LLM(str(folders["llama"]), num_blocks=16, device="cpu")
    assert isinstance(llm.engine.tokenizer, HFTokenizer)
    assert llm.engine.eos_token_ids == tokenizer.eos_ids
    # a tokenizer that does not belong to the model is refused
    small = Transformer(ModelConfig(vocab_size=200, d_model=32, n_layers=1, n_heads=4, d_ff=48))
    with pytest.raises(ValueError, match="the ByteTokenizer has a vocabulary of 259 tokens, but"):
        LLMEngine(small, EngineConfig(num_blocks=16, device="cpu"), ByteTokenizer())


def test_a_tokenizer_larger_than_the_embedding_is_refused_when_the_engine_is_built(
    chat_checkpoint,
) -> None:
    """Its ids past the embedding's rows would index past it: one error naming tokenizer.json
    and both sizes. A larger embedding (Qwen's padding: 448 rows for 400 ids here) is fine."""
    folder = chat_checkpoint
    tokenizer = HFTokenizer.from_folder(folder)
    assert tokenizer.vocab_size == 400 and tokenizer.source == str(folder / "tokenizer.json")
    small = Transformer(ModelConfig(vocab_size=300, d_model=32, n_layers=1, n_heads=4, d_ff=48))
    message = (
        f"{folder / 'tokenizer.json'} has a vocabulary of 400 tokens, but the model's embedding "
        "has 300 rows"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        LLM(small, tokenizer=str(folder), num_blocks=16, device="cpu")
    llm = LLM(str(folder), num_blocks=16, device="cpu")  # 448 rows for 400 ids
    assert llm.engine.model.config.vocab_size == 448 and llm.engine.tokenizer.vocab_size == 400


def test_a_folder_without_a_tokenizer_is_refused_unless_one_is_given(
    chat_checkpoint, tmp_path, capsys
) -> None:
    """A Hugging Face folder with no tokenizer.json would have its text read as bytes: refused,
    naming the folder, what is missing and how to give one. The book's byte-level models (the
    shipped ones, and a folder save_checkpoint wrote) keep the byte tokenizer."""
    from minivllm.cli import main
    from minivllm.model.checkpoint import CheckpointError, save_checkpoint

    folder = tmp_path / "no-tokenizer"
    shutil.copytree(chat_checkpoint, folder)
    (folder / "tokenizer.json").unlink()
    message = f"{folder} has no tokenizer.json (it has tokenizer_config.json)"
    with pytest.raises(CheckpointError, match=re.escape(message)) as refused:
        LLM(str(folder), num_blocks=16, device="cpu")
    assert f"LLM('{folder}', tokenizer=" in str(refused.value)
    assert main(["generate", "Hi", "--model", str(folder), "--max-tokens", "2"]) == 2
    assert message in capsys.readouterr().err
    # given one, it runs
    llm = LLM(str(folder), tokenizer=str(chat_checkpoint), num_blocks=16, device="cpu")
    assert llm.engine.tokenizer.source == str(chat_checkpoint / "tokenizer.json")
    assert load_tokenizer("target") is None and load_tokenizer("draft") is None
    book = tmp_path / "book-model"
    save_checkpoint(Transformer(ModelConfig(d_model=32, n_layers=1, n_heads=4, d_ff=48)), book)
    assert load_tokenizer(book) is None


@pytest.mark.usefixtures("one_torch_thread")
def test_generate_returns_vllms_output_types(llama) -> None:
    """`RequestOutput(request_id, prompt, prompt_token_ids, outputs=[CompletionOutput...],
    finished)`, with the first sample's fields on the output itself as before."""
    params = SamplingParams(max_tokens=6, n=2, seed=3, logprobs=1, ignore_eos=True)
    [out] = LLM(tiny_model(llama), tokenizer=llama, num_blocks=32, device="cpu").generate(
        "日本", params
    )
    assert (out.prompt, out.prompt_token_ids, out.finished) == (
        "日本",
        llama.encode("日本", add_bos=True),
        True,
    )
    assert [c.index for c in out.outputs] == [0, 1] and out.outputs[0].text == out.text
    for sample, completion in zip(out.samples, out.outputs):
        assert (completion.text, completion.token_ids) == (sample.text, sample.token_ids)
        assert completion.text == llama.decode(completion.token_ids)
        assert completion.finish_reason == LENGTH and len(completion.logprobs) == 6
        want = sum(entry[t] for t, entry in zip(sample.token_ids, sample.logprobs))
        assert completion.cumulative_logprob == pytest.approx(want) and want < 0


def test_the_chat_template_renders_as_transformers_does(folders) -> None:
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoTokenizer.from_pretrained(str(folders["chat"]))
    ours = HFTokenizer.from_folder(folders["chat"])
    for generation_prompt in (True, False):
        text = theirs.apply_chat_template(
            CONVERSATION, add_generation_prompt=generation_prompt, tokenize=False
        )
        ids = theirs.apply_chat_template(
            CONVERSATION, add_generation_prompt=generation_prompt, tokenize=True
        )
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids  # transformers 5: a BatchEncoding
        assert ours.apply_chat_template(CONVERSATION, generation_prompt, tokenize=False) == text
        assert ours.apply_chat_template(CONVERSATION, generation_prompt) == list(ids)
    with pytest.raises(ChatTemplateError, match="unknown role tool"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}])
    with pytest.raises(ValueError, match="no chat template"):
        HFTokenizer.from_folder(folders["qwen"]).apply_chat_template(CONVERSATION)


@pytest.mark.usefixtures("one_torch_thread")
def test_llm_chat_answers_in_the_models_layout(folders) -> None:
    from minivllm.chat import TemplateFormat, chat_format_for

    tokenizer = HFTokenizer.from_folder(folders["chat"])
    llm = LLM(tiny_model(tokenizer), tokenizer=tokenizer, num_blocks=32, device="cpu")
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    [out] = llm.chat(CONVERSATION, params)
    assert out.prompt_token_ids == tokenizer.apply_chat_template(CONVERSATION)
    assert out.prompt == tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    assert out.prompt.endswith("assistant:") and len(out.outputs[0].token_ids) == 4
    both = llm.chat([CONVERSATION, CONVERSATION[:2]], params)
    assert both[0].outputs[0].token_ids == out.outputs[0].token_ids  # greedy: the same answer
    assert isinstance(chat_format_for(tokenizer), TemplateFormat)  # `minivllm chat` uses it too
    with pytest.raises(ValueError, match="no chat template"):
        LLM(tiny_model(tokenizer), num_blocks=32, device="cpu").chat(CONVERSATION)
