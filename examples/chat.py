"""A conversation, offline, as vLLM's chat example has it (vLLM's
`examples/offline_inference/basic/chat.py`, `examples/offline_inference/chat.py` before v0.8):
`LLM.chat` with OpenAI-style messages, laid out by the model's own chat template, then a batch of
conversations in one call. `output.prompt` is the conversation as the template rendered it.

    MINIVLLM_MODEL=/path/to/Qwen3-0.6B python examples/chat.py

The calls are vLLM's, unchanged (the conversation is this book's own). The model is a folder on
this disk (no network to download "meta-llama/Llama-3.2-1B-Instruct"), read from MINIVLLM_MODEL,
and it must be a chat model, whose tokenizer has a chat template. The shipped models have none
(they read a chat as a play: `minivllm chat`, or the server's /v1/chat/completions), so there is no
default.
"""

import os
import sys

from minivllm import LLM, SamplingParams

sampling_params = SamplingParams(temperature=0.5)


def print_outputs(outputs):
    for output in outputs:
        prompt = output.prompt
        generated_text = output.outputs[0].text
        print(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")
    print("-" * 80)


def main():
    model = os.environ.get("MINIVLLM_MODEL")
    if not model:
        sys.exit(
            "set MINIVLLM_MODEL to a chat model's folder (one whose tokenizer has a chat "
            "template, e.g. Qwen3-0.6B); the shipped models chat as a play: `minivllm chat`"
        )
    llm = LLM(model=model)

    conversation = [
        {"role": "system", "content": "You answer in one sentence."},
        {"role": "user", "content": "What does a KV cache hold?"},
        {"role": "assistant", "content": "The keys and values of every token read so far."},
        {"role": "user", "content": "And why split it into blocks?"},
    ]
    outputs = llm.chat(conversation, sampling_params, use_tqdm=False)
    print_outputs(outputs)

    # Several conversations in one call run as one batch; the bar counts them as they finish.
    conversations = [conversation, conversation[:2]]
    outputs = llm.chat(conversations, sampling_params=sampling_params, use_tqdm=True)
    print_outputs(outputs)


if __name__ == "__main__":
    main()
