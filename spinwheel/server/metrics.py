"""Prometheus metrics of the server (names after vLLM's, prefixed ``spinwheel_``).

Engine state (running / waiting / swapped requests, KV usage, preemptions, prefix-cache hit rate, token counters)
is read from the engine when ``/metrics`` is scraped; step time, time to first token, inter-token and end-to-end
latency are observed from the engine thread after every step (:meth:`ServerMetrics.observe_step`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from spinwheel.engine import LLMEngine, RequestOutput
from spinwheel.server.transport import ConnectionStats

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)


class _EngineCollector:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine

    def collect(self):
        s = self.engine.stats()
        for name, doc, value in (
            ("spinwheel_num_requests_running", "Requests in the running batch.", s.num_running),
            ("spinwheel_num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting),
            ("spinwheel_num_requests_swapped", "Requests preempted to the CPU swap pool.", s.num_swapped),
            ("spinwheel_kv_cache_usage_ratio", "Fraction of KV-cache blocks in use (0..1).", s.kv_usage),
            ("spinwheel_num_free_kv_blocks", "Free KV-cache blocks on the device.", s.num_free_blocks),
            ("spinwheel_num_kv_blocks", "KV-cache blocks on the device.", s.num_blocks),
            (
                "spinwheel_prefix_cache_hit_rate",
                "Prompt blocks served from the prefix cache (0..1).",
                s.prefix_cache_hit_rate,
            ),
            ("spinwheel_generation_tokens_per_second", "Recent generation throughput.", s.generation_tokens_per_s),
        ):
            yield GaugeMetricFamily(name, doc, value=value)
        for name, doc, value in (
            ("spinwheel_num_preemptions", "Preemptions since start.", s.num_preemptions),
            ("spinwheel_prompt_tokens", "Prompt tokens computed (prefix-cache hits excluded).", s.num_prompt_tokens),
            ("spinwheel_generation_tokens", "Tokens generated.", s.num_generated_tokens),
        ):
            yield CounterMetricFamily(name, doc, value=value)


class _ServerCollector:
    """The server's own state, read at scrape time: unread outputs and what the connection guard did."""

    def __init__(
        self, unread_outputs: Callable[[], int], connections: Callable[[], tuple[int, ConnectionStats]]
    ) -> None:
        self.unread_outputs, self.connections = unread_outputs, connections

    def collect(self):
        yield GaugeMetricFamily(
            "spinwheel_unread_outputs",
            "Requests whose latest output waits for a slow client.",
            value=self.unread_outputs(),
        )
        num_open, stats = self.connections()
        yield GaugeMetricFamily("spinwheel_open_connections", "Open HTTP connections.", value=num_open)
        closed = CounterMetricFamily(
            "spinwheel_connections_closed", "Connections the server closed, by reason.", labels=["reason"]
        )
        for reason, value in (
            ("refused", stats.num_refused),
            ("evicted", stats.num_evicted),
            ("header_timeout", stats.num_header_timeouts),
            ("write_stall", stats.num_write_stalls),
            ("header_too_large", stats.num_headers_too_large),
        ):
            closed.add_metric([reason], value)
        yield closed


class ServerMetrics:
    """The server's registry. ``observe_step`` runs on the engine thread only (it alone touches
    ``_last_token``); prometheus_client's metrics are thread-safe for the scrape from the event loop."""

    def __init__(self, engine: LLMEngine) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine))  # type: ignore[arg-type]
        r = self.registry
        self.requests = Counter(
            "spinwheel_requests", "Finished requests by finish reason.", ["finished_reason"], registry=r
        )
        self.http_errors = Counter(
            "spinwheel_http_errors", "Requests answered with an error, by status.", ["status"], registry=r
        )
        self.ttft = Histogram(
            "spinwheel_time_to_first_token_seconds",
            "Arrival to first generated token.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "spinwheel_inter_token_latency_seconds",
            "Time between streamed tokens.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "spinwheel_e2e_request_latency_seconds", "Arrival to finish.", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.step_time = Histogram(
            "spinwheel_engine_step_seconds", "Duration of one engine step.", buckets=_LATENCY_BUCKETS, registry=r
        )
        self._last_token: dict[str, tuple[float, int]] = {}  # request id -> (time, tokens generated) at last step

    def watch(self, unread_outputs: Callable[[], int], connections: Callable[[], tuple[int, ConnectionStats]]) -> None:
        """Report the server's own state too (called once the async engine and the connection guard exist)."""
        self.registry.register(_ServerCollector(unread_outputs, connections))  # type: ignore[arg-type]

    def count_error(self, status: int) -> None:
        self.http_errors.labels(str(status)).inc()

    def observe_step(self, outputs: list[RequestOutput], step_s: float) -> None:
        """Latencies from one step's outputs: a request's first tokens give its TTFT, each later step that adds
        tokens an inter-token gap, its last output the finish reason and end-to-end time."""
        self.step_time.observe(step_s)
        now = time.monotonic()
        for out in outputs:
            num = sum(len(o.token_ids) for o in out.outputs)
            last = self._last_token.get(out.request_id)
            if num and (last is None or num > last[1]):
                if last is not None:
                    self.itl.observe(now - last[0])
                elif "first_token_time" in out.metrics:
                    self.ttft.observe(out.metrics["first_token_time"] - out.metrics["arrival_time"])
                self._last_token[out.request_id] = (now, num)
            if out.finished:
                self._last_token.pop(out.request_id, None)
                reason = out.outputs[0].finish_reason if out.outputs else ("error" if out.error else "abort")
                self.requests.labels(reason or "abort").inc()
                self.e2e.observe(out.metrics.get("finish_time", now) - out.metrics["arrival_time"])
