"""Chapter 09's metrics: hand-written Prometheus text that a Prometheus parser reads back
exactly."""

from __future__ import annotations

import math

import pytest

from minivllm.serving.metrics import (
    Counter,
    Gauge,
    Histogram,
    ServingMetrics,
    format_labels,
    format_value,
    render,
)


def test_counter_gauge_and_histogram_text() -> None:
    counter, gauge = Counter("minivllm:things_total", "Things."), Gauge("minivllm:level", "Level.")
    counter.inc(2, kind="a")
    counter.inc(kind="a")
    gauge.set(0.25)
    histogram = Histogram("minivllm:wait_seconds", "Waits.", (0.1, 1.0))
    for value in (0.05, 0.1, 0.5, 3.0):
        histogram.observe(value)
    assert render([counter, gauge, histogram]) == (
        "# HELP minivllm:things_total Things.\n# TYPE minivllm:things_total counter\n"
        'minivllm:things_total{kind="a"} 3\n'
        "# HELP minivllm:level Level.\n# TYPE minivllm:level gauge\nminivllm:level 0.25\n"
        "# HELP minivllm:wait_seconds Waits.\n# TYPE minivllm:wait_seconds histogram\n"
        'minivllm:wait_seconds_bucket{le="0.1"} 2\n'  # cumulative, and a bound is inclusive (<=)
        'minivllm:wait_seconds_bucket{le="1"} 3\n'
        'minivllm:wait_seconds_bucket{le="+Inf"} 4\n'
        "minivllm:wait_seconds_sum 3.65\nminivllm:wait_seconds_count 4\n"
    )


def test_values_and_labels_are_escaped() -> None:
    assert [format_value(v) for v in (3, 3.0, 0.5, math.inf)] == ["3", "3", "0.5", "+Inf"]
    assert format_labels((("reason", 'a"b\\c\nd'),)) == '{reason="a\\"b\\\\c\\nd"}'


def test_misuse_is_refused() -> None:
    with pytest.raises(ValueError, match="only goes up"):
        Counter("x_total", "x").inc(-1)
    with pytest.raises(ValueError, match="increasing"):
        Histogram("x", "x", (1.0, 0.5))


def test_serving_metrics_parse_back_with_prometheus_client() -> None:
    parser = pytest.importorskip("prometheus_client.parser")
    metrics = ServingMetrics("shakespeare")
    metrics.engine_state(running=3, waiting=1, kv_cache_usage=0.5)
    metrics.scheduled(0.002)
    metrics.first_token(0.03, prompt_tokens=10, cached_tokens=4, prefill_seconds=0.028)
    metrics.tokens(1, since_last=None)
    metrics.tokens(2, since_last=0.02)
    metrics.speculated(draft_tokens=4, accepted_tokens=3)
    metrics.finished("length", 0.2, generation_tokens=3, decode_seconds=0.17)
    metrics.preemptions.inc(2)
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in parser.text_string_to_metric_families(metrics.render())
        for s in family.samples
    }
    model = ("model_name", "shakespeare")  # on every series, as vLLM's

    def value(name: str, *labels: tuple[str, str]) -> float:
        return samples[(name, tuple(sorted([model, *labels])))]

    assert all(model in labels for _, labels in samples)
    assert value("minivllm:engine_alive") == 1
    assert value("minivllm:num_requests_running") == 3
    assert value("minivllm:kv_cache_usage_perc") == 0.5
    assert value("minivllm:num_preemptions_total") == 2
    assert value("minivllm:prefix_cache_hit_rate") == 0.4
    assert value("minivllm:generation_tokens_total") == 3
    assert value("minivllm:request_success_total", ("finished_reason", "length")) == 1
    assert value("minivllm:request_success_total", ("finished_reason", "stop")) == 0
    assert value("minivllm:time_to_first_token_seconds_bucket", ("le", "0.04")) == 1
    assert value("minivllm:inter_token_latency_seconds_count") == 1
    assert value("minivllm:e2e_request_latency_seconds_sum") == 0.2
    assert value("minivllm:request_queue_time_seconds_bucket", ("le", "0.001")) == 0
    assert value("minivllm:request_queue_time_seconds_bucket", ("le", "0.005")) == 1
    assert value("minivllm:request_prefill_time_seconds_sum") == 0.028
    assert value("minivllm:request_decode_time_seconds_sum") == 0.17
    assert value("minivllm:request_prompt_tokens_bucket", ("le", "10")) == 1
    assert value("minivllm:request_prompt_tokens_bucket", ("le", "5")) == 0
    assert value("minivllm:request_generation_tokens_bucket", ("le", "5")) == 1
    assert value("minivllm:spec_decode_num_drafts_total") == 1
    assert value("minivllm:spec_decode_num_draft_tokens_total") == 4
    assert value("minivllm:spec_decode_num_accepted_tokens_total") == 3
    metrics.engine_alive.set(0)
    assert 'minivllm:engine_alive{model_name="shakespeare"} 0' in metrics.render()


def test_constant_labels_go_first() -> None:
    counter = Counter("minivllm:things_total", "Things.")
    counter.inc(kind="a")
    text = render([counter], labels=(("model_name", "m"),))
    assert 'minivllm:things_total{model_name="m",kind="a"} 1' in text
