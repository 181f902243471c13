"""LLMEngine: the scheduler, the paged cache and the model runner, connected (chapter 04).

The engine owns no policy of its own. A step is

    plan = scheduler.schedule()                      # who runs, how many tokens (pure Python)
    result = runner.execute(plan, sequences)         # ONE forward pass, one sampling call
    finished = scheduler.update(plan, result.tokens) # append, stop checks, free blocks
    outputs.detokenize(stepped)                      # their text; a stop string ends one

plus a `StepRecord` for the trace. With a `SpeculativeConfig` (chapter 06) the runner's drafter
proposes tokens for every decoding sequence before the forward pass, the same single pass verifies
them, and `verify` turns its logits into runs of accepted tokens. Requests come in with
`add_request` (checked there, so a bad one never reaches the scheduler) and leave as
`RequestOutput`s. `generate` runs a list of prompts to the end; `stream` yields text deltas as they
are produced; `LLM` is the two-line front door.

The engine's tokenizer (the byte tokenizer, or a checkpoint's own: `HFTokenizer`) encodes prompts
and bad words (`InputProcessor`) and decodes outputs (`OutputProcessor`); the scheduler below sees
token ids only, and the EOS ids the tokenizer names.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Iterator, Mapping
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from tqdm import tqdm

from minivllm.attention.backend import get_backend, resolve_backend_name, warm_up_backend
from minivllm.attention.storage import PagedKVStorage
from minivllm.engine.config import EngineConfig, _resolve_device, resolve_capacity
from minivllm.engine.conversation import render_conversation
from minivllm.engine.processing import (
    EngineRequest,
    InputProcessor,
    OutputProcessor,
    RequestLimits,
    RequestOutput,
    TextDelta,
)
from minivllm.engine.trace import StepRecord
from minivllm.kv.block_manager import BlockManager
from minivllm.kv.sizing import kv_bytes_per_token
from minivllm.model.checkpoint import (
    CheckpointError,
    load_model,
    model_folder,
    resolve_dtype,
    sampling_defaults,
)
from minivllm.model.fused import fuse_model, pack_weights
from minivllm.model.hf_tokenizer import HFTokenizer, load_tokenizer
from minivllm.model.parallel import check_shardable
from minivllm.model.tokenizer import ByteTokenizer, Tokenizer
from minivllm.model.transformer import ModelConfig, Transformer, placed_on
from minivllm.runner.cuda_graph import DecodeGraphs
from minivllm.runner.model_runner import ModelRunner, RunnerOutput
from minivllm.runner.sampler import derive_seed
from minivllm.runner.speculative import SpeculativeConfig, make_drafter
from minivllm.runner.tensor_parallel import (
    QueuedCopies,
    RankSettings,
    TensorParallelGroup,
    WeightsSource,
)
from minivllm.runner.workers import ForwardWorkers
from minivllm.sched.plan import StepPlan
from minivllm.sched.scheduler import Scheduler, SchedulerConfig
from minivllm.sched.sequence import SamplingParams, Sequence, Status


class LLMEngine:
    def __init__(
        self,
        model: Transformer,
        config: EngineConfig | None = None,
        tokenizer: Tokenizer | None = None,
        default_params: SamplingParams | None = None,
        *,
        own_model: bool = False,
    ) -> None:
        """`default_params`: what a request without SamplingParams of its own gets (vLLM's
        `get_default_sampling_params`; `LLM` and the command line pass a checkpoint's
        generation_config.json settings, `default_sampling_params`); None: `SamplingParams()`.

        `own_model`: `model` is the engine's alone (loaded for it, as `LLM(folder)` and the CLI
        do), so it is moved to the device and its projections fused in place rather than in a
        copy -- the weights live once. By default the caller's model is left as it was.

        The cache and the context are settled here, before anything large is allocated
        (`resolve_capacity`); `self.config` is the config with `num_blocks` and `max_model_len`
        filled in, and `self.cache` says what the blocks hold."""
        config = config or EngineConfig()
        if config.data_parallel_size > 1:
            raise ValueError(
                f"an LLMEngine is one replica: build a DataParallelEngine "
                f"(minivllm.engine.data_parallel) or LLM(..., data_parallel_size="
                f"{config.data_parallel_size}) for data_parallel_size > 1"
            )
        if tokenizer is not None:  # a tokenizer given must fit the model (not the default one)
            check_vocabulary(model.config, tokenizer)
        self.tokenizer = tokenizer or ByteTokenizer()
        self.eos_token_ids = eos_token_ids(model.config, tokenizer)
        speculative = loaded_draft(config.speculative)  # its K/V shares the cache's budget
        self.cache, max_model_len = resolve_capacity(
            config, model.config, cache_bytes_per_token(model, speculative, config.dtype)
        )
        self.config = config = replace(
            config, num_blocks=self.cache.num_blocks, max_model_len=max_model_len
        )
        self.default_params = InputProcessor.params(default_params)
        self.device = _resolve_device(config)
        parallel = config.tensor_parallel_size > 1
        if parallel:  # the ranks hold the weights, in shards; this model only describes them
            check_shardable(model.config, config.tensor_parallel_size)
        else:  # the caller's model stays where it was, and as it was (unless own_model)
            model = placed_on(model, self.device, in_place=own_model)
        self.model = model
        backend_name = resolve_backend_name(
            config.attention_backend, self.device, config.dtype, next(model.parameters()).dtype
        )
        backend = get_backend(backend_name)
        warm_up_backend(backend, dtype=config.dtype)
        self.manager = BlockManager(
            config.num_blocks,
            config.block_size,
            layout=config.kv_layout,
            max_model_len=max_model_len,
        )
        # With CUDA graphs the storage has one block more than the manager hands out: the sink
        # that a graph's padding rows write to (runner/cuda_graph.py).
        graphs = uses_cuda_graphs(config, self.device)
        self.parallel: TensorParallelGroup | None = None
        if parallel:  # rank 0's shard and K/V pool are this process's
            self.parallel = start_ranks(model, config, backend_name, self.device)
            self.storage = self.parallel.storage
        else:
            self.storage = PagedKVStorage(
                model.config,
                config.num_blocks + graphs,
                config.block_size,
                config.dtype,
                self.device,
                heads_outer=getattr(backend, "heads_outer", False),
            )
        scheduler_config, self.drafter = config.scheduler, None
        if speculative is not None:  # reserve k lookahead slots after each decode for drafts
            self.drafter = make_drafter(
                speculative,
                model,
                self.manager,
                config.num_blocks,
                config.dtype,
                self.device,
                backend,
                max_model_len,
            )
            scheduler_config = replace(
                scheduler_config, num_lookahead_slots=config.speculative.num_speculative_tokens
            )
        self.scheduler = Scheduler(scheduler_config, self.manager)
        self.packed_weight_bytes = 0  # the weights held in oneDNN's layout too (model/fused.py)
        if parallel:
            runner_model = self.parallel.model
        else:
            runner_model = fuse_model(model, own_model) if config.fuse_projections else model
            # The big weights in oneDNN's layout now, not in a step; where the model run is the
            # engine's alone (loaded for it, or the fused copy), only that layout is kept.
            # Forward workers map the weights themselves, and a compiled graph holds them.
            private = own_model or runner_model is not model
            release = private and config.forward_processes == 1 and not config.compile_forward
            self.packed_weight_bytes = pack_weights(runner_model, release=release)
        # with tensor parallelism the runner's block copies go to every rank with the next step
        runner_storage = QueuedCopies(self.parallel) if parallel else self.storage
        self.runner = ModelRunner(runner_model, runner_storage, self.manager, backend, self.drafter)
        self.runner.parallel = self.parallel
        if config.compile_forward:
            from minivllm.runner.compiled import CompiledForward

            self.runner.compiled = CompiledForward(runner_model)
            self.runner.compiled.warm_up(self.storage, self.manager, backend)  # compiles here
        if config.forward_processes > 1:  # ForwardWorkers refuses a cache off the CPU
            self.runner.workers = ForwardWorkers(
                runner_model,
                self.storage,
                backend_name,
                config.forward_processes,
                backend,
                timeout_s=config.distributed_timeout_s,
            )
        if graphs:
            self.runner.graphs = DecodeGraphs(
                runner_model,
                self.storage,
                backend,
                sink_block=config.num_blocks,
                max_num_seqs=scheduler_config.max_num_seqs,
                max_model_len=max_model_len,
                capture=self.device == "cuda",  # always, but where a test forces graphs on a CPU
            )
        limits = request_limits(model.config, config)
        self.inputs = InputProcessor(
            self.tokenizer, limits, self.eos_token_ids, self.default_params
        )
        self.outputs = OutputProcessor(self.tokenizer)
        self.trace: list[StepRecord] = []
        self._next_id = 0
        # request id -> the seq ids of its samples, for requests with n > 1 (a lone request's
        # seq id is its request id)
        self.groups: dict[int, tuple[int, ...]] = {}
        self.peak_blocks_used = 0  # the most KV-cache blocks in use after any step
        self.num_requests = 0  # requests added since the engine was built (n samples: one)

    # -- requests ----------------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | SequenceOf[int] | EngineRequest,
        params: SamplingParams | None = None,
        request_id: int | None = None,
        group: Hashable | None = None,
    ) -> int:
        """Queue a request and return its id. Everything is checked first; a bad request raises
        ValueError saying what to change, and the engine is left exactly as it was.

        With `params.n > 1` the request is n samples (parallel sampling): one id, n sequences.
        Sample 0 is the request as it would run alone; samples 1..n-1 get seq ids of their own
        and seeds derived from (seed, index), wait for sample 0's prompt, then fork its block
        table, sharing the prompt's KV blocks. Each reports as a `RequestOutput` with this
        request_id and its `index`.

        `group` names the client request it is part of (default: its own request id): the
        scheduler admits waiting groups in turns (sched/waiting.py), so give every prompt of one
        client request the same group, and one big request cannot hold back a small one.

        `prompt` may be an `EngineRequest` that `self.inputs.process` made (params None): it was
        checked then and is queued as it is."""
        request = self.inputs.process(prompt, params)
        prompt_ids, params = list(request.prompt_ids), request.params
        request_id = checked_request_id(self._next_id if request_id is None else request_id)
        first_sibling = max(self._next_id, request_id + 1)
        seq_ids = [request_id, *range(first_sibling, first_sibling + params.n - 1)]
        if request_id in self.groups or any(i in self.scheduler.sequences for i in seq_ids):
            raise ValueError(f"request id {request_id} is already in use by an unfinished request")
        seed = params.seed if params.seed is not None else derive_seed(self.config.seed, request_id)
        bad_word_ids = request.bad_word_ids
        samples = [
            Sequence(
                seq_id,
                prompt_ids,
                params,
                seed if index == 0 else derive_seed(seed, index),
                self.eos_token_ids,
                request_id=request_id,
                index=index,
                group=group,
                bad_word_ids=bad_word_ids,
            )
            for index, seq_id in enumerate(seq_ids)
        ]
        parent = samples[0]
        if self.drafter is not None and self.drafter.uses_cache:
            parent.num_draft_computed_tokens = 0
        if self.manager.shares_blocks:  # the samples fork sample 0's blocks after its prompt
            parent.forks = samples[1:]
            self.scheduler.add(parent)
        else:  # nothing shared (contiguous layout): n sequences, each computes the prompt
            for sample in samples:
                self.scheduler.add(sample)
        if params.n > 1:
            self.groups[request_id] = tuple(seq_ids)
        self._next_id = first_sibling + params.n - 1
        self.num_requests += 1
        return request_id

    def abort(self, request_id: int) -> RequestOutput:
        """Stop a request now, all its samples; their blocks go back to the pool at once.
        Returns the output of its first sample still unfinished (the others end "abort" too)."""
        seq_ids = self.groups.pop(request_id, (request_id,))
        sequences = self.scheduler.sequences
        alive = [sequences[i] for i in seq_ids if i in sequences]
        if not alive:
            self.scheduler.abort(request_id)  # raises KeyError, saying why
        for seq in alive:
            if not seq.is_finished:  # a parent's abort has ended its waiting forks already
                self.scheduler.abort(seq.seq_id)
        return self.outputs.output(alive[0])

    def close(self) -> None:
        """Stop the engine's forward workers or tensor-parallel ranks, if it has any
        (`EngineConfig.forward_processes`, `tensor_parallel_size`); an engine without them has
        nothing to release. Also on leaving a `with` block."""
        if self.runner.workers is not None:
            self.runner.workers.close()
        if self.parallel is not None:
            self.parallel.close()

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def describe_capacity(self) -> str:
        """The start-up line: what the K/V cache holds and the longest sequence served, e.g.
        "KV cache: 2048 blocks of 16 = 32768 tokens (96.0 MiB of K/V) in float32;
        max_model_len 512"."""
        dtype = str(self.config.dtype).removeprefix("torch.")
        ranks = self.config.tensor_parallel_size
        split = f", split by K/V heads over {ranks} ranks" if ranks > 1 else ""
        return (
            f"KV cache: {self.cache.describe()} in {dtype}{split}; "
            f"max_model_len {self.config.max_model_len}"
        )

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> EngineStats:
        """How the engine stands between two steps, for metrics (the server's /metrics and
        /stats). Not thread-safe, like the rest of the engine: a server reads it on the engine's
        own thread (`AsyncEngine.stats`)."""
        used = self.manager.num_used
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_blocks=self.config.num_blocks,
            blocks_used=used,
            kv_cache_usage=used / self.config.num_blocks,
            peak_blocks_used=self.peak_blocks_used,
            num_requests=self.num_requests,
            num_generated_tokens=self.outputs.num_tokens,
        )

    # -- the step ----------------------------------------------------------------------------------
    def step(self, final_only: bool = False) -> list[RequestOutput]:
        """Run one scheduled step: an output for each request that got a token or finished (with
        `final_only`, each that finished: vLLM's FINAL_ONLY, what `generate` asks for)."""
        if not self.has_unfinished():
            return []  # nothing queued: no plan, no forward pass, no trace record
        started = time.perf_counter()
        plan = self.scheduler.schedule()
        self.peak_blocks_used = max(self.peak_blocks_used, self.manager.num_used)
        sequences = self.scheduler.sequences
        result = self.runner.execute(plan, sequences)
        # The scheduler ends some sequences itself, without a new token; update() may drop them.
        stepped = [sequences[i] for i in (*plan.sampling_seq_ids, *plan.finished)]
        # parallel sampling: siblings that fork (or end) with their parent in this update
        forks = [f for seq in stepped for f in seq.forks]
        self._record_logprobs(result, sequences)
        failed = [self._end_failed(seq_id, why) for seq_id, why in result.failed.items()]
        finished = self.scheduler.update(plan, result.tokens) + [s for s in failed if s]
        stepped += [f for f in forks if f.status is not Status.WAITING]
        # stop strings: the text's own finish (the others' text is decoded when it is output)
        for hit in self.outputs.detokenize(s for s in stepped if s.params.stop):
            if self.scheduler.stop(hit.seq, hit.stop, hit.num_output_tokens):
                finished.append(hit.seq)
        for seq in finished:
            if seq.request_id in self.groups and all(
                i not in self.scheduler.sequences for i in self.groups[seq.request_id]
            ):
                del self.groups[seq.request_id]
        self.trace.append(self._record(plan, finished, result, time.perf_counter() - started))
        return [self.outputs.output(s) for s in stepped if s.is_finished or not final_only]

    def _end_failed(self, seq_id: int, why: str) -> Sequence | None:
        """A sequence the sampler could draw nothing for (its logits hold NaN or +inf) ends now,
        "abort" with the reason in its finish_message, rather than emit arbitrary tokens. None if
        it had ended already."""
        seq = self.scheduler.sequences.get(seq_id)
        if seq is None:
            return None
        seq.finish_message = why  # before the abort: its waiting forks inherit it
        return self.scheduler.abort(seq_id)

    @staticmethod
    def _record_logprobs(result: RunnerOutput, sequences: dict[int, Sequence]) -> None:
        """Keep this step's logprobs on their sequences, before update() appends the tokens
        (one token per sampling sequence: logprobs are refused with speculation)."""
        for seq_id, entry in result.logprobs.items():
            sequences[seq_id].output_logprobs.append(entry)
        for seq_id, entries in result.prompt_logprobs.items():
            recorded = sequences[seq_id].prompt_logprobs
            for position, entry in entries:
                if position == len(recorded):  # a recompute after preemption adds nothing twice
                    recorded.append(entry)

    def _record(
        self, plan: StepPlan, finished: list[Sequence], result: RunnerOutput, step_s: float
    ) -> StepRecord:
        scheduler, memory = self.scheduler, self.manager.memory()
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
            blocks_used=memory.blocks_used,
            blocks_free=memory.num_blocks - memory.blocks_used,
            slots_reserved=memory.slots_reserved,
            slots_empty=memory.slots_empty,
            blocks_saved=memory.blocks_saved,
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
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run every prompt to the end; one output per prompt, in the order of the prompts.

        A request with n > 1 samples returns the output of sample 0, with all n finished samples
        in its `samples` (index order); with n == 1 `samples` stays empty. Either way `outputs`
        lists them as vLLM's `CompletionOutput`s, and `prompt` is a text prompt's text. With
        `use_tqdm`, a progress bar on stderr counts the finished requests (vLLM's)."""
        ids = self._add_all(prompts, params)
        wanted = {i: len(self.groups.get(i, (i,))) for i in ids}
        done: dict[int, dict[int, RequestOutput]] = {i: {} for i in ids}
        bar = ProgressBar(total=len(ids), desc="Processed prompts") if use_tqdm else None
        try:
            while any(len(done[i]) < wanted[i] for i in ids):
                for out in self.step(final_only=True):
                    if out.finished and out.request_id in done:
                        done[out.request_id][out.index] = out
                        if bar is not None and len(done[out.request_id]) == wanted[out.request_id]:
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        results = []
        for i, prompt in zip(ids, [prompts] if isinstance(prompts, str) else prompts):
            first = done[i][0]
            if wanted[i] > 1:
                first.samples = [done[i][index] for index in range(wanted[i])]
            first.prompt = prompt if isinstance(prompt, str) else None
            results.append(first)
        return results

    def stream(
        self,
        prompts: SequenceOf[str | SequenceOf[int]],
        params: SamplingParams | SequenceOf[SamplingParams] | None = None,
    ) -> Iterator[TextDelta]:
        """Yield each request's new text as the steps produce it (whole characters only, and never a
        piece of a stop string); the last delta of a request carries its finish reason. With
        n > 1 each sample streams on its own, its deltas marked with its `index`."""
        ids = set(self._add_all(prompts, params))
        unfinished = {(i, index) for i in ids for index in range(len(self.groups.get(i, (i,))))}
        try:
            while unfinished:
                for out in self.step():
                    if out.request_id in ids:
                        if out.finished:
                            unfinished.discard((out.request_id, out.index))
                        yield out.delta()
        finally:  # a consumer that stops early must not leave its requests holding blocks
            for i in {i for i, _ in unfinished}:
                if self._is_running(i):
                    self.abort(i)

    def _is_running(self, request_id: int) -> bool:
        """Whether a request still holds sequences here (what `stream` aborts when left early)."""
        return request_id in self.scheduler.sequences or request_id in self.groups

    def _add_all(self, prompts, params) -> list[int]:
        if isinstance(prompts, str):
            prompts = [prompts]
        param_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(param_list) != len(prompts):
            raise ValueError(
                f"{len(prompts)} prompts but {len(param_list)} SamplingParams: give one, or one "
                "each"
            )
        # every one checked before any is queued, and each checked once
        requests = [self.inputs.process(prompt, p) for prompt, p in zip(prompts, param_list)]
        return [self.add_request(request) for request in requests]


class LLM:
    """The front door: `LLM("target").generate(["ROMEO:"], SamplingParams(max_tokens=50))`.

    vLLM's arguments, by vLLM's names: `model` (a shipped model's name, a Hugging Face checkpoint
    folder, or a `Transformer`); `tokenizer` (a `Tokenizer`, or a folder; None: a folder's own
    tokenizer.json, else the byte tokenizer -- a Hugging Face folder without one needs it,
    `load_tokenizer` says so); `dtype` (the model's and the K/V cache's; "auto": the checkpoint's
    own); `seed`; `max_model_len` (None: the model's context, capped by the cache);
    `kv_cache_memory_bytes` (the K/V budget; None: `EngineConfig`'s default);
    `generation_config` ("auto": a request without SamplingParams gets the checkpoint's
    generation_config.json settings, `get_default_sampling_params`; "vllm": SamplingParams()
    alone; or a folder holding a generation_config.json). Any other `EngineConfig` or
    `SchedulerConfig` field by its name (`num_blocks=64`, `max_num_seqs=8`, `speculative={...}`)."""

    def __init__(
        self,
        model: str | Path | Transformer = "target",
        tokenizer: str | Path | Tokenizer | None = None,
        *,
        dtype: str | torch.dtype = "auto",
        seed: int = 0,
        max_model_len: int | None = None,
        kv_cache_memory_bytes: int | None = None,
        generation_config: str | Path = "auto",
        **config,
    ) -> None:
        if isinstance(tokenizer, (str, Path)):
            tokenizer = HFTokenizer.from_folder(tokenizer)
        elif tokenizer is None and isinstance(model, (str, Path)):
            tokenizer = load_tokenizer(model)  # None for the shipped models: the byte tokenizer
        folder = model if isinstance(model, (str, Path)) else None
        default_params = default_sampling_params(folder, generation_config)
        if folder is not None:  # a shipped model's name, or a Hugging Face folder
            # with tensor parallelism each rank reads its own shard: here, only the shapes
            if config.get("tensor_parallel_size", 1) == 1:
                model = load_model(folder, dtype)
            else:
                model = load_model(folder, dtype, weights=False)
            dtype = "auto"  # the engine's own
        auto = dtype == "auto"
        config["dtype"] = next(model.parameters()).dtype if auto else resolve_dtype(dtype)
        config.update(
            seed=seed, max_model_len=max_model_len, kv_cache_memory_bytes=kv_cache_memory_bytes
        )
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
        engine_config = EngineConfig(scheduler=scheduler, **config)
        engine_class = LLMEngine
        if engine_config.data_parallel_size > 1:  # replicas, each an LLMEngine
            from minivllm.engine.data_parallel import DataParallelEngine as engine_class
        self.engine = engine_class(
            model, engine_config, tokenizer, default_params, own_model=folder is not None
        )

    def get_tokenizer(self) -> Tokenizer:
        """The tokenizer prompts are encoded and outputs decoded with (vLLM's name)."""
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` use when given no SamplingParams (vLLM's name): the
        checkpoint's generation_config.json settings over SamplingParams' defaults."""
        return self.engine.default_params

    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | SequenceOf[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """vLLM's `LLM.generate`: every prompt run to its end, the outputs in the prompts' order;
        `use_tqdm` (vLLM's default: on) shows a progress bar on stderr."""
        return self.engine.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def chat(
        self,
        messages,
        sampling_params: SamplingParams | SequenceOf[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """vLLM's `LLM.chat`: one conversation (a list of `{"role", "content"}` messages, a content
        being text or a list of text parts) or a list of them, each laid out by the tokenizer's
        chat template -- or `chat_template`, jinja source that replaces it -- and answered
        (engine/conversation.py, the server's layout too). A model whose tokenizer has no
        template (the shipped byte-level ones, which read a chat as a play: `minivllm chat`) is
        refused: give it a prompt, or a template."""
        single = bool(messages) and isinstance(messages[0], Mapping)
        conversations = [messages] if single else list(messages)
        tokenizer = self.engine.tokenizer
        layout = dict(add_generation_prompt=add_generation_prompt, chat_template=chat_template)
        prompts = [render_conversation(tokenizer, c, **layout) for c in conversations]
        outputs = self.engine.generate(prompts, sampling_params, use_tqdm=use_tqdm)
        for output, conversation in zip(outputs, conversations):
            output.prompt = render_conversation(tokenizer, conversation, tokenize=False, **layout)
        return outputs


class ProgressBar(tqdm):
    """vLLM's `use_tqdm` bar, without tqdm's monitor thread (it would outlive the bar: a
    notebook that checks for threads left behind would find it)."""

    monitor_interval = 0


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_blocks: int
    blocks_used: int  # blocks held by a sequence; a block shared by forked samples counts once
    kv_cache_usage: float  # fraction of the KV-cache blocks in use
    peak_blocks_used: int = 0  # the most blocks in use after any step's schedule
    num_requests: int = 0  # requests added since the engine was built (n samples count once)
    num_generated_tokens: int = 0  # tokens generated since then, every sample's


def checked_request_id(request_id) -> int:
    """A caller's request id, refused unless it is an int >= 0."""
    if not isinstance(request_id, int) or isinstance(request_id, bool) or request_id < 0:
        raise ValueError(f"request_id must be an int >= 0, got {request_id!r}")
    return request_id


def uses_cuda_graphs(config: EngineConfig, device: str) -> bool:
    """Whether an engine's decode steps replay CUDA graphs: on a CUDA device, unless
    `enforce_eager` (or forward workers, which run on a CPU only, or tensor parallelism, whose
    collectives are not captured)."""
    return (
        device == "cuda"
        and not config.enforce_eager
        and config.forward_processes == 1
        and config.tensor_parallel_size == 1
    )


def start_ranks(
    model: Transformer, config: EngineConfig, backend_name: str, device: str
) -> TensorParallelGroup:
    """The tensor-parallel ranks of an engine (`config.tensor_parallel_size` > 1), each with its
    shard of `model` -- sliced from its weights, or read from its checkpoint folder when it has
    none (`load_model(..., weights=False)`) -- and a K/V pool of `config.num_blocks` blocks for
    its heads. Torch's threads are shared out between the ranks on a CPU."""
    world = config.tensor_parallel_size
    settings = RankSettings(
        world=world,
        num_blocks=config.num_blocks,
        block_size=config.block_size,
        cache_dtype=config.dtype,
        device=device,
        backend=backend_name,
        fuse=config.fuse_projections,
        threads=max(1, torch.get_num_threads() // world),
        timeout_s=config.distributed_timeout_s,
    )
    return TensorParallelGroup(WeightsSource.of(model), settings)


def check_vocabulary(model_config: ModelConfig, tokenizer: Tokenizer) -> None:
    """A tokenizer may produce ids 0..vocab_size-1, and each indexes a row of the model's
    embedding: refuse one with more ids than rows. (Fewer is common: checkpoints pad their
    embedding past the tokenizer's vocabulary, Qwen3's 151936 rows for 151669 ids.) Only a
    tokenizer the caller gives is checked: without one, a model of another vocabulary (a random
    test checkpoint) still takes token-id prompts, its text read as bytes."""
    rows = model_config.vocab_size
    if tokenizer.vocab_size > rows:
        source = getattr(tokenizer, "source", None) or f"the {type(tokenizer).__name__}"
        raise ValueError(
            f"{source} has a vocabulary of {tokenizer.vocab_size} tokens, but the model's "
            f"embedding has {rows} rows (config.json's vocab_size): token ids {rows} and up would "
            "index past it. The tokenizer does not belong to this model: use the checkpoint's "
            "own tokenizer.json"
        )


def eos_token_ids(model_config: ModelConfig, tokenizer: Tokenizer | None) -> tuple[int, ...]:
    """The ids that end a request: the tokenizer's (a checkpoint's tokenizer may name several), or
    without one -- or where it names none -- the model config's, which the shipped models share
    with the byte tokenizer."""
    named = tokenizer.eos_ids if tokenizer is not None else None
    ids = named if named else model_config.eos_token_id
    ids = () if ids is None else (ids,) if isinstance(ids, int) else tuple(ids)
    if bad := [i for i in ids if not 0 <= i < model_config.vocab_size]:
        raise ValueError(
            f"EOS token id {bad[0]} is outside the model's vocabulary 0.."
            f"{model_config.vocab_size - 1}: the tokenizer does not belong to this model"
        )
    return ids


def default_sampling_params(
    model: str | Path | None, generation_config: str | Path = "auto"
) -> SamplingParams:
    """vLLM's `generation_config`: "auto", the settings `model`'s generation_config.json
    recommends (temperature, top_k, top_p, min_p, repetition_penalty, and max_new_tokens as
    max_tokens; `sampling_defaults`) over SamplingParams' own defaults -- none for a shipped model,
    or a model given as a `Transformer` (`model` None); "vllm", SamplingParams() alone; anything
    else, the folder whose generation_config.json to read."""
    if generation_config == "vllm" or (generation_config == "auto" and model is None):
        return SamplingParams()
    folder = model if generation_config == "auto" else generation_config
    settings = sampling_defaults(folder)  # a setting that is no number: CheckpointError
    try:
        return SamplingParams(**settings)
    except ValueError as error:  # a number out of range: name the file it came from
        where = model_folder(folder) / "generation_config.json"
        raise CheckpointError(f"{where}: {error}") from None


def loaded_draft(speculative: SpeculativeConfig | None) -> SpeculativeConfig | None:
    """The config with a draft model named by path loaded, so that its K/V (kept at the target's
    slots, in blocks of the same pool) can be counted in the cache's size before the cache is
    built."""
    if speculative is None or speculative.method != "draft":
        return speculative
    if isinstance(speculative.draft_model, (str, Path)):
        return replace(speculative, draft_model=load_model(speculative.draft_model))
    return speculative


def cache_bytes_per_token(
    model: Transformer, speculative: SpeculativeConfig | None, dtype: torch.dtype
) -> int:
    """K/V bytes one token takes in the engine's cache dtype: the model's, plus a draft model's
    (`loaded_draft`), which keeps its own K/V for every slot."""
    configs = [model.config]
    if speculative is not None and speculative.method == "draft":
        configs.append(speculative.draft_model.config)
    return sum(kv_bytes_per_token(c.n_layers, c.n_kv_heads, c.head_dim, dtype) for c in configs)


def request_limits(model_config: ModelConfig, config: EngineConfig) -> RequestLimits:
    """What a request may ask of this engine (its config as resolved, `LLMEngine.config`): the
    model's vocabulary, the engine's context (max_model_len), the cache."""
    scheduler = config.scheduler
    unchunked = None if scheduler.chunked_prefill else scheduler.max_num_batched_tokens
    return RequestLimits(
        vocab_size=model_config.vocab_size,
        max_model_len=config.max_model_len,
        max_prompt_blocks=config.num_blocks,
        block_size=config.block_size,
        max_unchunked_prompt=unchunked,
        max_num_seqs=scheduler.max_num_seqs,
        speculative=config.speculative is not None,
    )
