"""Offline batched inference as vLLM's quickstart does it (vLLM's
`examples/offline_inference/basic/basic.py`): a list of prompts, one `SamplingParams`,
`LLM.generate`, and each `RequestOutput` read back through `prompt` and `outputs[0].text`.

    python examples/basic.py                                     # the shipped Shakespeare model
    MINIVLLM_MODEL=/path/to/Qwen3-0.6B python examples/basic.py  # a Hugging Face model folder

The calls are vLLM's, unchanged: a vLLM script made of them runs here with `vllm` replaced by
`minivllm` in its import and its model pointed at this disk. What this file picks for itself: the
model, a shipped one's name or a folder read from MINIVLLM_MODEL (the book's variable for "a
checkpoint of yours"; "target" when unset), since with no network there is no "facebook/opt-125m"
to download; and prompts that suit the shipped model, which has only ever read plays. The rest is
vLLM's defaults: 16 new tokens per prompt, a progress bar on stderr.
"""

import os

from minivllm import LLM, SamplingParams

prompts = [
    "ROMEO:\n",
    "To be, or not to be",
    "Now is the winter of",
    "The king is",
]
sampling_params = SamplingParams(temperature=0.8, top_p=0.95)


def main():
    llm = LLM(model=os.environ.get("MINIVLLM_MODEL", "target"))
    # one RequestOutput per prompt, in the prompts' order
    outputs = llm.generate(prompts, sampling_params)
    for output in outputs:
        prompt = output.prompt
        generated_text = output.outputs[0].text
        print(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")


if __name__ == "__main__":
    main()
