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
from dataclasses import replace

from minivllm.attention.backend import get_backend, resolve_backend_name
from minivllm.attention.storage import PagedKVStorage
from minivllm.engine.config import EngineConfig, _resolve_device
from minivllm.engine.outputs import RequestOutput, TextDelta
from minivllm.engine.trace import StepRecord
from minivllm.kv.block_manager import BlockManager
from minivllm.model.checkpoint import load_model
from minivllm.model.tokenizer import ByteTokenizer
from minivllm.model.transformer import Transformer
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
        self.model, self.config = model.eval(), config or EngineConfig()
        self.tokenizer = tokenizer or ByteTokenizer()
        config = self.config
        self.device = _resolve_device(config.device)
        self.model.to(self.device)  # in place: the caller's model runs where its cache lives
        backend = get_backend(resolve_backend_name(config.attention_backend, self.device))
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
        params = self._params(params)
        prompt_ids = self._prompt_ids(prompt)
        self._check_fits(prompt_ids, params)
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

    @staticmethod
    def _params(params: SamplingParams | None) -> SamplingParams:
        if params is None:
            return SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        return params

    def _prompt_ids(self, prompt: str | SequenceOf[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_bos=True)
        elif isinstance(prompt, (list, tuple)) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            ids = list(prompt)
        else:
            raise TypeError("prompt must be a string or a list of token ids (ints)")
        if not ids:
            raise ValueError(
                "the prompt is empty: give at least one token (a string prompt gets BOS first)"
            )
        vocab = self.model.config.vocab_size
        if bad := [t for t in ids if not 0 <= t < vocab]:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary 0..{vocab - 1}")
        return ids

    def _check_fits(self, prompt_ids: list[int], params: SamplingParams) -> None:
        total = len(prompt_ids) + params.max_tokens
        context = self.model.config.max_seq_len
        if total > context:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} "
                f"exceeds the model's context of {context} tokens: shorten the prompt or lower "
                "max_tokens"
            )
        scheduler = self.config.scheduler
        if not scheduler.chunked_prefill and len(prompt_ids) > scheduler.max_num_batched_tokens:
            raise ValueError(
                f"the prompt ({len(prompt_ids)} tokens) is longer than max_num_batched_tokens "
                f"({scheduler.max_num_batched_tokens}) and chunked prefill is off, so it could "
                "never "
                f"be scheduled: raise the budget or turn chunked_prefill on"
            )
        # The prompt must fit the whole cache with room for one new token. Beyond that max_tokens is
        # an upper bound (EOS may come first); a sequence that outgrows the cache alone ends
        # "cache_full".
        blocks = self.manager.blocks_needed(0, len(prompt_ids) + 1)
        if blocks > self.config.num_blocks:
            raise ValueError(
                f"the prompt ({len(prompt_ids)} tokens) needs {blocks} KV-cache blocks with its "
                "first "
                f"new token, but the whole cache has {self.config.num_blocks}: it could never run; "
                f"build a bigger cache or shorten the prompt"
            )

    def abort(self, request_id: int) -> RequestOutput:
        """Stop a request now; its blocks go back to the pool at once."""
        return self._output(self.scheduler.abort(request_id))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step
    # ------------------------------------------------------------------------------------
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
        return [self._output(seq) for seq in stepped]

    def _record(
        self, plan: StepPlan, finished: list[Sequence], result: RunnerOutput, step_s: float
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
            speculated=result.speculated,
            forward_s=result.forward_s,
            draft_s=result.draft_s,
            step_s=step_s,
        )

    @staticmethod
    def _output(seq: Sequence) -> RequestOutput:
        return RequestOutput(
            request_id=seq.seq_id,
            prompt_token_ids=list(seq.prompt_token_ids),
            token_ids=seq.output_token_ids,
            text=seq.output_text,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            num_cached_tokens=seq.num_cached_tokens,
            num_preemptions=seq.num_preemptions,
            finish_message=seq.finish_message,
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
        sequences = dict(self.scheduler.sequences)
        try:
            while any(not sequences[i].is_finished for i in ids):
                for out in self.step():
                    if out.request_id in ids:
                        seq = sequences[out.request_id]
                        yield TextDelta(
                            seq.seq_id,
                            seq.take_text_delta(),
                            seq.take_new_token_ids(),
                            seq.finish_reason,
                        )
        finally:  # a consumer that stops early must not leave its requests holding blocks
            for i in ids:
                if not sequences[i].is_finished:
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
            self._check_fits(self._prompt_ids(prompt), self._params(p))
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
        if isinstance(
            config.get("speculative"), dict
        ):  # vLLM style: speculative={"method": "ngram", ...}
            config["speculative"] = SpeculativeConfig(**config["speculative"])
        self.engine = LLMEngine(model, EngineConfig(scheduler=scheduler, **config))

    def generate(
        self, prompts, sampling_params: SamplingParams | SequenceOf[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        return self.engine.generate(prompts, sampling_params)
