"""LLMEngine: the scheduler, the paged cache and the model runner, connected (chapter 04).

The engine owns no policy of its own. A step is

    plan = scheduler.schedule()                   # who runs, how many tokens (pure Python)
    logits = runner.forward(build_batch(plan))    # ONE forward pass over all of them
    tokens = runner.sample(plan, logits)          # one batched sampling call
    finished = scheduler.update(plan, tokens)     # append, stop checks, free blocks

plus a `StepRecord` for the trace. With a `SpeculativeConfig` (chapter 06) a drafter proposes tokens
for every decoding sequence between `schedule()` and the forward pass, the same single pass verifies
them, and `verify` turns its logits into runs of accepted tokens. Requests come in with
`add_request` (checked there, so a bad one never reaches the scheduler) and leave as
`RequestOutput`s. `generate` runs a list of prompts to the end; `stream` yields text deltas as they
are produced; `LLM` is the two-line front door.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, replace

import torch

from minivllm.attention.storage import PagedKVStorage
from minivllm.attention.torch_backend import TorchPagedAttention
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
from minivllm.model.transformer import ModelConfig, Transformer
from minivllm.runner.batch import build_batch
from minivllm.runner.model_runner import ModelRunner
from minivllm.runner.sampler import derive_seed
from minivllm.runner.speculative import (
    Proposal,
    SpeculativeConfig,
    make_drafter,
    verify,
)
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
        self.model, self.config = model.eval(), config or EngineConfig()
        self.tokenizer = tokenizer or ByteTokenizer()
        config = self.config
        self.device = _resolve_device(config.device)
        self.model.to(
            self.device
        )  # in place: the engine runs the caller's model where its cache lives
        backend = _attention_backend(config.attention_backend, self.device)
        self.manager = BlockManager(config.num_blocks, config.block_size)
        self.storage = PagedKVStorage(
            model.config, config.num_blocks, config.block_size, config.dtype, self.device
        )
        scheduler_config, self.drafter = config.scheduler, None
        if (
            config.speculative is not None
        ):  # reserve k lookahead slots after every decode for the drafts
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
        self.runner = ModelRunner(model, self.storage, self.manager, backend)
        self.inputs = InputProcessor(self.tokenizer, request_limits(model.config, config))
        self.outputs = OutputProcessor()
        self.trace: list[StepRecord] = []
        self._next_id = 0

    # -- requests
    # ------------------------------------------------------------------------------------
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

    # -- the step
    # ------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; return an output for every request that got a token or finished."""
        if not self.has_unfinished():
            return []  # nothing queued: no plan, no forward pass, no trace record
        started = time.perf_counter()
        plan = self.scheduler.schedule()
        sequences = self.scheduler.sequences
        tokens, proposals, forward_s, draft_s = {}, {}, 0.0, 0.0
        if (
            plan.chunks
        ):  # a plan can be empty when all it did was end a sequence too big for the cache
            draft_started = time.perf_counter()
            proposals = self._propose(plan, sequences)
            draft_s = time.perf_counter() - draft_started
            batch = build_batch(
                plan, sequences, self.manager, {i: p.tokens for i, p in proposals.items()}
            )
            forward_started = time.perf_counter()
            logits = self.runner.forward(batch)
            forward_s = time.perf_counter() - forward_started
            tokens = self._sample(plan, sequences, logits, proposals)
        stepped = [sequences[i] for i in plan.sampling_seq_ids]
        stepped += [
            sequences[i] for i in plan.finished
        ]  # ended by the scheduler without a new token
        speculated = tuple((i, len(p.tokens), len(tokens[i]) - 1) for i, p in proposals.items())
        finished = self.scheduler.update(plan, tokens)
        self.trace.append(
            self._record(
                plan, finished, speculated, forward_s, draft_s, time.perf_counter() - started
            )
        )
        return [self.outputs.output(seq) for seq in stepped]

    def _propose(self, plan: StepPlan, sequences: Mapping[int, Sequence]) -> dict[int, Proposal]:
        """The drafter's tokens for every chunk with lookahead slots (none without speculation)."""
        chunks = [c for c in plan.chunks if c.num_lookahead]
        if self.drafter is None or not chunks:
            return {}
        proposals = self.drafter.propose(
            [sequences[c.seq_id] for c in chunks], [c.num_lookahead for c in chunks]
        )
        return {c.seq_id: p for c, p in zip(chunks, proposals)}

    def _sample(
        self,
        plan: StepPlan,
        sequences: Mapping[int, Sequence],
        logits: torch.Tensor,
        proposals: Mapping[int, Proposal],
    ) -> dict[int, int | list[int]]:
        if self.drafter is None:
            return self.runner.sample(plan, sequences, logits)
        ids = plan.sampling_seq_ids
        runs = verify(
            logits, [sequences[i] for i in ids], [proposals.get(i, Proposal()) for i in ids]
        )
        return dict(zip(ids, runs))

    def _record(
        self,
        plan: StepPlan,
        finished: list[Sequence],
        speculated: tuple[tuple[int, int, int], ...],
        forward_s: float,
        draft_s: float,
        step_s: float,
    ) -> StepRecord:
        scheduler, blocks_used = self.scheduler, self.manager.allocator.num_used
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
            speculated=speculated,
            forward_s=forward_s,
            draft_s=draft_s,
            step_s=step_s,
        )

    # -- whole workloads
    # -----------------------------------------------------------------------------
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


def _attention_backend(name: str, device: str) -> type:
    """The attention class for the runner. The CUDA kernel's module is imported only when chosen:
    importing it switches numba's simulator on when there is no GPU."""
    if name == "auto":
        name = "cuda" if device == "cuda" else "torch"
    if name == "torch":
        return TorchPagedAttention
    from minivllm.attention.cuda.backend import CudaPagedAttention

    return CudaPagedAttention


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
        if isinstance(
            config.get("speculative"), dict
        ):  # vLLM style: speculative={"method": "ngram", ...}
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
    return RequestLimits(
        vocab_size=model_config.vocab_size,
        max_model_len=model_config.max_seq_len,
        max_prompt_blocks=config.num_blocks,
        block_size=config.block_size,
        max_unchunked_prompt=None if scheduler.chunked_prefill else scheduler.max_num_batched_tokens,
    )
