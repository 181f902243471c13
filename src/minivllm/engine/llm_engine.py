"""LLMEngine: the scheduler, the paged cache and the model runner, connected (chapter 04).

The engine owns no policy of its own. A step is

    plan = scheduler.schedule()                      # who runs, how many tokens (pure Python)
    result = runner.execute(plan, sequences)         # ONE forward pass, one sampling call
    finished = scheduler.update(plan, result.tokens) # append, stop checks, free blocks

plus a `StepRecord` for the trace. With a `SpeculativeConfig` (chapter 06) the runner's drafter
proposes tokens for every decoding sequence before the forward pass, the same single pass verifies
them, and `verify` turns its logits into runs of accepted tokens. Requests come in with
`add_request` (checked there, so a bad one never reaches the scheduler) and leave as
`RequestOutput`s. `generate` runs a list of prompts to the end; `stream` yields text deltas as they
are produced; `LLM` is the two-line front door.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, replace

from minivllm.attention.backend import get_backend, resolve_backend_name
from minivllm.attention.storage import PagedKVStorage
from minivllm.engine.config import EngineConfig, _resolve_device
from minivllm.engine.processing import (
    InputProcessor,
    OutputProcessor,
    RequestLimits,
    RequestOutput,
    TextDelta,
)
from minivllm.engine.trace import StepRecord
from minivllm.kv.block_manager import BlockManager
from minivllm.model.checkpoint import load_model
from minivllm.model.tokenizer import ByteTokenizer
from minivllm.model.transformer import ModelConfig, Transformer, placed_on
from minivllm.runner.model_runner import ModelRunner, RunnerOutput
from minivllm.runner.sampler import derive_seed
from minivllm.runner.speculative import SpeculativeConfig, make_drafter
from minivllm.sched.plan import StepPlan
from minivllm.sched.scheduler import Scheduler, SchedulerConfig
from minivllm.sched.sequence import SamplingParams, Sequence


class LLMEngine:
    def __init__(
        self,
        model: Transformer,
        config: EngineConfig | None = None,
        tokenizer: ByteTokenizer | None = None,
    ) -> None:
        self.config = config = config or EngineConfig()
        self.tokenizer = tokenizer or ByteTokenizer()
        self.device = _resolve_device(config.device)
        self.model = model = placed_on(model, self.device)  # the caller's stays where it was
        backend = get_backend(
            resolve_backend_name(config.attention_backend, self.device, config.dtype)
        )
        self.manager = BlockManager(config.num_blocks, config.block_size)
        self.storage = PagedKVStorage(
            model.config, config.num_blocks, config.block_size, config.dtype, self.device
        )
        scheduler_config, self.drafter = config.scheduler, None
        if config.speculative is not None:  # reserve k lookahead slots after each decode for drafts
            self.drafter = make_drafter(
                config.speculative,
                model,
                self.manager,
                config.num_blocks,
                config.dtype,
                self.device,
                backend,
            )
            scheduler_config = replace(
                scheduler_config, num_lookahead_slots=config.speculative.num_speculative_tokens
            )
        self.scheduler = Scheduler(scheduler_config, self.manager)
        self.runner = ModelRunner(model, self.storage, self.manager, backend, self.drafter)
        self.inputs = InputProcessor(self.tokenizer, request_limits(model.config, config))
        self.outputs = OutputProcessor()
        self.trace: list[StepRecord] = []
        self._next_id = 0

    # -- requests ----------------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | SequenceOf[int],
        params: SamplingParams | None = None,
        request_id: int | None = None,
    ) -> int:
        """Queue a request and return its id. Everything is checked first; a bad request raises
        ValueError saying what to change, and the engine is left exactly as it was."""
        prompt_ids, params = self.inputs.process(prompt, params)
        request_id = self._next_id if request_id is None else request_id
        if request_id in self.scheduler.sequences:
            raise ValueError(f"request id {request_id} is already in use by an unfinished request")
        seed = params.seed if params.seed is not None else derive_seed(self.config.seed, request_id)
        seq = Sequence(request_id, prompt_ids, params, seed, self.model.config.eos_token_id)
        if self.drafter is not None and self.drafter.uses_cache:
            seq.num_draft_computed_tokens = 0
        self.scheduler.add(seq)
        self._next_id = max(self._next_id, request_id + 1)
        return request_id

    def abort(self, request_id: int) -> RequestOutput:
        """Stop a request now; its blocks go back to the pool at once."""
        return self.outputs.output(self.scheduler.abort(request_id))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> EngineStats:
        """How the engine stands between two steps, for metrics (the server's /metrics)."""
        used = self.config.num_blocks - self.manager.num_free
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_blocks=self.config.num_blocks,
            blocks_used=used,
            kv_cache_usage=used / self.config.num_blocks,
        )

    # -- the step ----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduled step: an output for each request that got a token or finished."""
        if not self.has_unfinished():
            return []  # nothing queued: no plan, no forward pass, no trace record
        started = time.perf_counter()
        plan = self.scheduler.schedule()
        sequences = self.scheduler.sequences
        result = self.runner.execute(plan, sequences)
        # The scheduler ends some sequences itself, without a new token; update() may drop them.
        stepped = [sequences[i] for i in (*plan.sampling_seq_ids, *plan.finished)]
        finished = self.scheduler.update(plan, result.tokens)
        self.trace.append(self._record(plan, finished, result, time.perf_counter() - started))
        return [self.outputs.output(seq) for seq in stepped]

    def _record(
        self, plan: StepPlan, finished: list[Sequence], result: RunnerOutput, step_s: float
    ) -> StepRecord:
        scheduler, blocks_used = self.scheduler, self.config.num_blocks - self.manager.num_free
        return StepRecord(
            step=plan.step,
            admitted=plan.admitted,
            decoded=tuple(c.seq_id for c in plan.decodes),
            prefilled=tuple((c.seq_id, c.num_tokens) for c in plan.prefills),
            finished=tuple((s.seq_id, s.finish_reason) for s in finished),
            stalled=plan.stalled,
            preempted=plan.preempted,
            resumed=plan.resumed,
            running=tuple(s.seq_id for s in scheduler.running),
            waiting=tuple(s.seq_id for s in scheduler.waiting),
            num_batched_tokens=plan.num_batched_tokens,
            prefix_hit_tokens=plan.prefix_hit_tokens,
            recomputed_tokens=plan.recomputed_tokens,
            blocks_used=blocks_used,
            blocks_free=self.config.num_blocks - blocks_used,
            speculated=result.speculated,
            forward_s=result.forward_s,
            draft_s=result.draft_s,
            step_s=step_s,
        )

    # -- whole workloads ---------------------------------------------------------------------------
    def generate(
        self,
        prompts: SequenceOf[str | SequenceOf[int]],
        params: SamplingParams | SequenceOf[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to the end; outputs in the order of the prompts."""
        ids = self._add_all(prompts, params)
        done: dict[int, RequestOutput] = {}
        while any(i not in done for i in ids):
            for out in self.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[i] for i in ids]

    def stream(
        self,
        prompts: SequenceOf[str | SequenceOf[int]],
        params: SamplingParams | SequenceOf[SamplingParams] | None = None,
    ) -> Iterator[TextDelta]:
        """Yield each request's new text as the steps produce it (whole characters only, and never a
        piece of a stop string); the last delta of a request carries its finish reason."""
        ids = set(self._add_all(prompts, params))
        unfinished = set(ids)
        try:
            while unfinished:
                for out in self.step():
                    if out.request_id in ids:
                        if out.finished:
                            unfinished.discard(out.request_id)
                        yield out.delta()
        finally:  # a consumer that stops early must not leave its requests holding blocks
            for i in unfinished:
                self.abort(i)

    def _add_all(self, prompts, params) -> list[int]:
        if isinstance(prompts, str):
            prompts = [prompts]
        param_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(param_list) != len(prompts):
            raise ValueError(
                f"{len(prompts)} prompts but {len(param_list)} SamplingParams: give one, or one "
                "each"
            )
        for prompt, p in zip(prompts, param_list):  # check them all before queueing any
            self.inputs.process(prompt, p)
        return [self.add_request(prompt, p) for prompt, p in zip(prompts, param_list)]


class LLM:
    """The front door: `LLM("target").generate(["ROMEO:"], SamplingParams(max_tokens=50))`."""

    def __init__(self, model: str | Transformer = "target", **config) -> None:
        if isinstance(model, str):
            model = load_model(model)
        scheduler_keys = {
            "max_num_seqs",
            "max_num_batched_tokens",
            "chunked_prefill",
            "batching",
            "enable_prefix_caching",
            "preemption",
        }
        scheduler = SchedulerConfig(
            **{k: config.pop(k) for k in list(config) if k in scheduler_keys}
        )
        # vLLM style: speculative={"method": "ngram", ...}
        if isinstance(config.get("speculative"), dict):
            config["speculative"] = SpeculativeConfig(**config["speculative"])
        self.engine = LLMEngine(model, EngineConfig(scheduler=scheduler, **config))

    def generate(
        self, prompts, sampling_params: SamplingParams | SequenceOf[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        return self.engine.generate(prompts, sampling_params)


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_blocks: int
    blocks_used: int
    kv_cache_usage: float  # fraction of the KV-cache blocks in use


def request_limits(model_config: ModelConfig, config: EngineConfig) -> RequestLimits:
    """What a request may ask of this engine: the model's vocabulary and context, the cache."""
    scheduler = config.scheduler
    unchunked = None if scheduler.chunked_prefill else scheduler.max_num_batched_tokens
    return RequestLimits(
        vocab_size=model_config.vocab_size,
        max_model_len=model_config.max_seq_len,
        max_prompt_blocks=config.num_blocks,
        block_size=config.block_size,
        max_unchunked_prompt=unchunked,
    )
