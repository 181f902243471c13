"""What a server tells its monitoring: metrics in Prometheus's text format (chapter 09).

Prometheus scrapes `GET /metrics` every few seconds and keeps each number as a time series. The text
format is simple enough to write by hand: per metric a `# HELP` line, a `# TYPE` line, then one
`name{label="value"} number` line per series. Three kinds are enough for a server:

* a **counter** only goes up (tokens generated, requests finished); Prometheus derives rates from
  it, so a restart or a missed scrape loses nothing;
* a **gauge** is a value now (requests running, share of the KV cache in use);
* a **histogram** counts observations per bucket: `_bucket{le="x"}` is how many were <= x
  (cumulative, ending at `le="+Inf"`), with `_sum` and `_count` beside. Quantiles -- p50 or p99 time
  to first token -- are estimated from the buckets, and buckets from many servers can simply be
  added.

Names start with `minivllm:` as vLLM's start with `vllm:` (the rest of each name is vLLM's); a colon
is legal in a metric name (`[a-zA-Z_:][a-zA-Z0-9_:]*`). Every series carries vLLM's `model_name`
label, so one Prometheus can scrape several servers. Nothing here knows the engine:
`ServingMetrics` is told plain numbers.

**One unit per family: the sample.** A request with `n > 1` is n samples, and every family that
counts or times requests counts each sample as one, as vLLM V1 does (it runs such a request as n
child requests, each queued, timed and finished on its own; see its `parallel_sampling.py`). So an
`n=4` request that finishes is 4 in `request_success_total`, 4 observations in every
`request_*`, `e2e_request_latency_seconds` and `time_to_first_token_seconds` histogram, and its
prompt counts 4 times in `prompt_tokens_total` and the prefix-cache counters (a fork shares its
parent's prompt blocks and reports its parent's cache hits, so the hit rate is that of the
prompts). An `n=8` request aborted before it finishes is 8 aborts (only the samples still running
when it is aborted: a sample that finished already counted under its own reason). The gauges count
samples too: a running or waiting request with n samples is n. Generated tokens are counted one
by one; the speculative-decoding counters count verifications of one sample's draft. Every HELP
line says its unit.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable
from collections.abc import Sequence as SequenceOf

Labels = tuple[tuple[str, str], ...]


def format_value(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def format_labels(labels: Labels) -> str:
    if not labels:
        return ""
    escaped = (v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") for _, v in labels)
    return "{" + ",".join(f'{k}="{v}"' for (k, _), v in zip(labels, escaped)) + "}"


class Counter:
    kind = "counter"

    def __init__(self, name: str, help: str) -> None:
        self.name, self.help = name, help
        self.values: dict[Labels, float] = {}

    def inc(self, amount: float = 1, **labels: str) -> None:
        if amount < 0:
            raise ValueError(f"{self.name}: a counter only goes up, got inc({amount})")
        key = tuple(sorted(labels.items()))
        self.values[key] = self.values.get(key, 0) + amount

    def total(self) -> float:
        return sum(self.values.values())

    def samples(self) -> Iterable[tuple[str, Labels, float]]:
        for labels, value in sorted(self.values.items()):
            yield self.name, labels, value
        if not self.values:
            yield self.name, (), 0


class Gauge:
    kind = "gauge"

    def __init__(self, name: str, help: str) -> None:
        self.name, self.help, self.value = name, help, 0.0

    def set(self, value: float) -> None:
        self.value = value

    def samples(self) -> Iterable[tuple[str, Labels, float]]:
        yield self.name, (), self.value


class Histogram:
    kind = "histogram"

    def __init__(self, name: str, help: str, buckets: SequenceOf[float]) -> None:
        if list(buckets) != sorted(set(buckets)):
            raise ValueError(f"{name}: bucket bounds must be increasing, got {list(buckets)}")
        self.name, self.help = name, help
        self.bounds = (*buckets, math.inf)
        self.counts = [0] * len(self.bounds)  # per bucket, not cumulative: observe() touches one
        self.sum = 0.0

    def observe(self, value: float) -> None:
        # the first bucket with value <= bound
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def samples(self) -> Iterable[tuple[str, Labels, float]]:
        cumulative = 0
        for bound, count in zip(self.bounds, self.counts):
            cumulative += count
            yield f"{self.name}_bucket", (("le", format_value(bound)),), cumulative
        yield f"{self.name}_sum", (), self.sum
        yield f"{self.name}_count", (), cumulative


def render(metrics: Iterable[Counter | Gauge | Histogram], labels: Labels = ()) -> str:
    """The Prometheus text exposition of `metrics` (content type `text/plain; version=0.0.4`);
    `labels` go first on every series (the server's `model_name`)."""
    lines = []
    for metric in metrics:
        lines += [f"# HELP {metric.name} {metric.help}", f"# TYPE {metric.name} {metric.kind}"]
        lines += [
            f"{name}{format_labels((*labels, *own))} {format_value(value)}"
            for name, own, value in metric.samples()
        ]
    return "\n".join(lines) + "\n"


# Bucket bounds in seconds, spanning this CPU engine's range (a decode step of a few ms to tens of
# ms).
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0)
PHASE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# Tokens per request: vLLM's 1-2-5 series, up to past this model's 512-token context.
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)
FINISH_REASONS = ("stop", "length", "abort", "cache_full")  # the engine's, see sched/sequence.py


class ServingMetrics:
    """The metrics of one server. The engine thread reports events as plain numbers; `render` writes
    them out. Not thread-safe: call it from one thread (the AsyncEngine's engine thread)."""

    def __init__(self, model_name: str = "target") -> None:
        self.model_name = model_name
        self.engine_alive = Gauge(
            "minivllm:engine_alive", "Whether the engine thread is alive (0 once it has died)."
        )
        self.engine_alive.set(1)
        self.running = Gauge(
            "minivllm:num_requests_running",
            "Samples in the running batch (a request with n samples is n).",
        )
        self.waiting = Gauge(
            "minivllm:num_requests_waiting",
            "Samples waiting to be admitted or re-admitted (a request with n samples is n).",
        )
        self.kv_cache_usage = Gauge(
            "minivllm:kv_cache_usage_perc", "Share of KV-cache blocks in use (1 = full)."
        )
        self.preemptions = Counter(
            "minivllm:num_preemptions_total",
            "Samples preempted (their K/V thrown away), per preemption.",
        )
        self.prefix_queries = Counter(
            "minivllm:prefix_cache_queries_total",
            "Prompt tokens looked up in the prefix cache, per sample "
            "(n samples: n times the prompt).",
        )
        self.prefix_hits = Counter(
            "minivllm:prefix_cache_hits_total",
            "Of those, tokens found in the prefix cache (per sample, as the queries).",
        )
        self.prefix_hit_rate = Gauge(
            "minivllm:prefix_cache_hit_rate", "Prefix cache hits / queries, since start."
        )
        self.prompt_tokens = Counter(
            "minivllm:prompt_tokens_total",
            "Prompt tokens of samples that got their first token (n samples: n times the prompt).",
        )
        self.generation_tokens = Counter(
            "minivllm:generation_tokens_total", "Tokens generated, all samples together."
        )
        self.request_success = Counter(
            "minivllm:request_success_total",
            "Samples finished, by finish reason (an n=4 request is 4; an abort counts each "
            "sample still running).",
        )
        # every series exists from the start, so a rate never has a gap
        for reason in FINISH_REASONS:
            self.request_success.inc(0, finished_reason=reason)
        self.spec_drafts = Counter(
            "minivllm:spec_decode_num_drafts_total",
            "Speculative verifications, one per sample per step.",
        )
        self.spec_draft_tokens = Counter(
            "minivllm:spec_decode_num_draft_tokens_total",
            "Draft tokens proposed, all samples together.",
        )
        self.spec_accepted_tokens = Counter(
            "minivllm:spec_decode_num_accepted_tokens_total", "Of those, tokens accepted."
        )
        self.e2e_latency = Histogram(
            "minivllm:e2e_request_latency_seconds",
            "Arrival to last token (or abort), per sample.",
            E2E_BUCKETS,
        )
        self.queue_time = Histogram(
            "minivllm:request_queue_time_seconds",
            "Arrival to the start of the step that first schedules the sample (a fork: its "
            "parent), per sample.",
            PHASE_BUCKETS,
        )
        self.prefill_time = Histogram(
            "minivllm:request_prefill_time_seconds",
            "First scheduled to first token: the prefill, in one step or in chunks, per sample.",
            PHASE_BUCKETS,
        )
        self.decode_time = Histogram(
            "minivllm:request_decode_time_seconds",
            "First token to last token, per finished sample.",
            PHASE_BUCKETS,
        )
        self.ttft = Histogram(
            "minivllm:time_to_first_token_seconds",
            "Arrival to first token, per sample.",
            TTFT_BUCKETS,
        )
        self.itl = Histogram(
            "minivllm:inter_token_latency_seconds",
            "Time between a sample's consecutive outputs (a speculative step may bring several "
            "tokens at once), per output.",
            ITL_BUCKETS,
        )
        self.request_prompt_tokens = Histogram(
            "minivllm:request_prompt_tokens", "Prompt tokens, per sample.", TOKEN_BUCKETS
        )
        self.request_generation_tokens = Histogram(
            "minivllm:request_generation_tokens",
            "Tokens generated, per finished sample.",
            TOKEN_BUCKETS,
        )

    def engine_state(self, running: int, waiting: int, kv_cache_usage: float) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_cache_usage.set(kv_cache_usage)

    def scheduled(self, queue_seconds: float) -> None:
        """A sample's first step began `queue_seconds` after its request arrived."""
        self.queue_time.observe(queue_seconds)

    def first_token(
        self,
        seconds: float,
        prompt_tokens: int,
        cached_tokens: int,
        prefill_seconds: float | None = None,
    ) -> None:
        """A sample's prefill is done (its first token is out): its prompt has been looked up in
        the prefix cache and run. `prefill_seconds`: since it was first scheduled, when known."""
        self.ttft.observe(seconds)
        if prefill_seconds is not None:
            self.prefill_time.observe(prefill_seconds)
        self.prompt_tokens.inc(prompt_tokens)
        self.request_prompt_tokens.observe(prompt_tokens)
        self.prefix_queries.inc(prompt_tokens)
        self.prefix_hits.inc(cached_tokens)

    def tokens(self, count: int, since_last: float | None) -> None:
        """`count` new tokens of one sample; `since_last` is the time since its previous output."""
        self.generation_tokens.inc(count)
        if since_last is not None:
            self.itl.observe(since_last)

    def speculated(self, draft_tokens: int, accepted_tokens: int) -> None:
        """One verification of one sequence's draft."""
        self.spec_drafts.inc()
        self.spec_draft_tokens.inc(draft_tokens)
        self.spec_accepted_tokens.inc(accepted_tokens)

    def finished(
        self,
        reason: str,
        seconds: float,
        generation_tokens: int | None = None,
        decode_seconds: float | None = None,
    ) -> None:
        """One sample finished (or was aborted) `seconds` after its request arrived."""
        self.request_success.inc(finished_reason=reason)
        self.e2e_latency.observe(seconds)
        if generation_tokens is not None:
            self.request_generation_tokens.observe(generation_tokens)
        if decode_seconds is not None:
            self.decode_time.observe(decode_seconds)

    def render(self) -> str:
        queries = self.prefix_queries.total()
        self.prefix_hit_rate.set(self.prefix_hits.total() / queries if queries else 0.0)
        return render(
            [
                self.engine_alive,
                self.running,
                self.waiting,
                self.kv_cache_usage,
                self.preemptions,
                self.prefix_queries,
                self.prefix_hits,
                self.prefix_hit_rate,
                self.prompt_tokens,
                self.generation_tokens,
                self.request_success,
                self.spec_drafts,
                self.spec_draft_tokens,
                self.spec_accepted_tokens,
                self.e2e_latency,
                self.queue_time,
                self.prefill_time,
                self.decode_time,
                self.ttft,
                self.itl,
                self.request_prompt_tokens,
                self.request_generation_tokens,
            ],
            labels=(("model_name", self.model_name),),
        )
