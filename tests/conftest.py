"""Shared test setup.

`pytest --exercise ch01.1` runs only the tests that grade one exercise (repeat the option for more).
`one_torch_thread` (module scope) runs a test module's torch work on one thread, and `target` loads
the shipped model once per module.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest


def pytest_configure(config: pytest.Config) -> None:
    """Refuse to test a `minivllm` other than this project's own: in a student copy, a reference
    package found first on the import path would be graded instead of the student's code."""
    if config.getoption("exercise") and config.option.tbstyle == "auto":
        config.option.tbstyle = "short"  # a student reads one exercise's failures, not frames
    own = Path(__file__).resolve().parents[1] / "src" / "minivllm"
    if not own.is_dir():  # a project without the package (test_student_mode's toy project)
        return
    spec = importlib.util.find_spec("minivllm")
    found = Path(spec.origin).parent.resolve() if spec and spec.origin else None
    if found is None:  # most often a pytest from outside the project's environment
        venv = own.parents[1] / ".venv"
        hint = (
            f"activate the project's environment first (`. {venv}/bin/activate`, the one `make "
            f"book` and `make test` create), or run `{venv}/bin/python -m pytest ...`"
            if (venv / "bin" / "python").exists()
            else "install this copy in a virtualenv (`pip install -e .` here) and run its pytest"
        )
        raise pytest.UsageError(
            f"this pytest runs on {sys.executable}, which cannot import minivllm: {hint}."
        )
    if found != own:
        raise pytest.UsageError(
            f"these tests belong to the package in {own}, but `import minivllm` finds {found}. "
            f"Install this copy (`pip install -e .` here, in its own virtualenv) or run with "
            f"PYTHONPATH={own.parent}."
        )


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--exercise",
        action="append",
        default=[],
        metavar="ID",
        help="run only the tests marked exercise(ID); may be given more than once",
    )


def exercise_ids(item: pytest.Item) -> set[str]:
    return {mark.args[0] for mark in item.iter_markers("exercise") if mark.args}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    wanted = set(config.getoption("exercise"))
    if not wanted:
        return
    carried = set().union(*(exercise_ids(item) for item in items))
    # A typo would otherwise select nothing and "pass"; say so instead.
    if unknown := wanted - carried:
        raise pytest.UsageError(
            f"no collected test is marked exercise({', '.join(sorted(unknown))}); "
            f"collected exercises: {', '.join(sorted(carried)) or 'none'}"
        )
    kept = [item for item in items if exercise_ids(item) & wanted]
    config.hook.pytest_deselected(items=[item for item in items if not exercise_ids(item) & wanted])
    items[:] = kept


# The message of a stub in a student copy (tools/student.py); numba's CUDA simulator puts the
# thread's coordinates in front of it.
STUB_MESSAGE = re.compile(r"\bexercise ([\w.-]+): ")
_STUBS_REPORTED = pytest.StashKey[set]()  # the stubs whose first failure was reported in full


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """A test stopped by an exercise's stub reports it in two lines, and a further test stopped by
    the same stub in one: a dozen tracebacks of the same `raise` tell a student nothing more."""
    report = yield
    excinfo = call.excinfo
    if not (report.failed and excinfo and excinfo.errisinstance(NotImplementedError)):
        return report
    stub = STUB_MESSAGE.search(str(excinfo.value))
    if stub is None:
        return report
    seen = item.config.stash.setdefault(_STUBS_REPORTED, set())
    message = f"NotImplementedError: {str(excinfo.value)[stub.start() :]}"
    if stub[1] in seen:
        # "exercise <id>:" as the stub says it: tools/student.py reads which stub stopped a test
        report.longrepr = f"NotImplementedError: exercise {stub[1]}: the same stub as above"
    else:
        seen.add(stub[1])
        where = excinfo.traceback[-1]
        path = Path(where.path)
        if path.is_relative_to(item.config.rootpath):
            path = path.relative_to(item.config.rootpath)
        report.longrepr = (
            f"{path}:{where.lineno + 1}: {message}\n"
            f"exercise {stub[1]} is not solved yet: this test runs its code"
        )
    return report


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for the module: on a small shared machine two BLAS threads can make a small
    matmul hundreds of times slower, and the engine's steps are many small matmuls."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def target():
    from minivllm.model.checkpoint import load_model

    return load_model("target")


# -- a checkpoint as Hugging Face publishes one, built offline -------------------------------------

# What the tests' BPE tokenizers learn from: multi-byte characters that the merges split across
# tokens (a token may end inside `日`), which is what incremental detokenizing must get right.
BPE_CORPUS = (
    "Hello world, café crème brûlée. 日本語のテキスト、日本の本。 emoji 🙂🎉 are fun! "
    "The quick brown fox jumps over the lazy dog. naïve façade, Ελληνικά, русский текст. "
)


def train_bpe(special_tokens: list[str], vocab_size: int = 400):
    """A tiny byte-level BPE tokenizer (GPT-2's, Llama 3's and Qwen's kind) trained on
    `BPE_CORPUS` by the package's builder (chapter 10 trains its own with it), its special tokens
    first in the vocabulary."""
    from minivllm.book.tiny_checkpoint import train_bpe_tokenizer

    return train_bpe_tokenizer([BPE_CORPUS] * 10, vocab_size, special_tokens)


@pytest.fixture(scope="session")
def bpe_trainer():
    """`train_bpe`, for test modules (a conftest is not imported by name)."""
    return train_bpe


# Qwen's ChatML layout, with the check a Mistral or Llama 2 template makes: a system message may
# only come first, and user and assistant must alternate (else raise_exception, as they do).
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}"
    "{%- if not loop.first %}{{ raise_exception('A system message must come first') }}{%- endif %}"
    "{%- elif (message['role'] == 'user') != "
    "((loop.index0 - (1 if messages[0]['role'] == 'system' else 0)) % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
CHATML_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@pytest.fixture(scope="session")
def chat_checkpoint(tmp_path_factory):
    """A Qwen3 chat model as it is published: random weights (float32, q/k norms, its own head
    size, tied embeddings; logits spread over a few units, so greedy choices are rarely ties) with
    an embedding padded past the tokenizer's vocabulary as Qwen's is, `tokenizer.json` (a BPE
    trained here), `tokenizer_config.json` with a ChatML chat template, and
    `generation_config.json`: `<|im_end|>` ends a turn."""
    import json

    import torch

    transformers = pytest.importorskip("transformers")
    tok = train_bpe(CHATML_TOKENS)
    ids = {token: tok.token_to_id(token) for token in CHATML_TOKENS}
    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        vocab_size=448,  # the tokenizer's 400 rounded up to a multiple of 64
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        initializer_range=0.2,
        bos_token_id=None,
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    folder = tmp_path_factory.mktemp("qwen3-chat")
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tok.save(str(folder / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": CHATML_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return folder
