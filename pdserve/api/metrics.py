"""Prometheus metrics of one node, with vLLM's names where vLLM has one.

Gauges about the engine (running, waiting, KV usage) are refreshed from the engine's latest
stats when `/metrics` is scraped; request metrics are observed in the API process as each
request's outputs stream through `MetricsRecorder.track`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pdserve.disagg.messages import ReleaseReason
from pdserve.engine.core_messages import EngineStats
from pdserve.engine.kv_types import KVConnectorStats
from pdserve.errors import PdserveError
from pdserve.outputs import RequestOutput, RequestTimes
from pdserve.tracing import NULL_SPAN, Span

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                    5.0, 10.0, 20.0, 40.0, 80.0)  # fmt: skip


class MetricsRecorder:
    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry
        self.running = Gauge(
            "vllm:num_requests_running", "Requests in the running batch", labels, registry=r
        )
        self.waiting = Gauge(
            "vllm:num_requests_waiting", "Requests waiting to be scheduled", labels, registry=r
        )
        self.kv_usage = Gauge(
            "vllm:kv_cache_usage_perc", "Fraction of KV blocks in use (0-1)", labels, registry=r
        )
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Prompt tokens processed", labels, registry=r
        )
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Tokens generated", labels, registry=r
        )
        self.prompt_tokens.labels(model_name)  # export zeros from the start
        self.generation_tokens.labels(model_name)
        self.ttft = self._histogram("vllm:time_to_first_token_seconds", "Time to first token")
        self.itl = self._histogram("vllm:inter_token_latency_seconds", "Time between tokens")
        self.e2e = self._histogram("vllm:e2e_request_latency_seconds", "Request latency")
        self.requests = Counter(
            "pdserve_requests", "Requests by outcome", [*labels, "outcome"], registry=r
        )
        self.kv_blocks_free = Gauge("pdserve_kv_blocks_free", "Free KV blocks", labels, registry=r)
        self.kv_blocks_held = Gauge(
            "pdserve_kv_blocks_held", "KV blocks held for remote decodes", labels, registry=r
        )
        self.preemptions = Gauge(
            "pdserve_preemptions", "Preemptions since start", labels, registry=r
        )
        self.prompt_tokens_computed = Gauge(
            "pdserve_prompt_tokens_computed",
            "Prompt tokens the model ran on since start (not prefix hits, not KV read)",
            labels,
            registry=r,
        )
        self.prompt_tokens_pending = Gauge(
            "pdserve_prompt_tokens_pending",
            "Prompt tokens waiting or admitted, not computed yet (the prefill work owed)",
            labels,
            registry=r,
        )
        self.handoffs = Gauge(
            "pdserve_handoffs", "Live handoffs on a prefill node by state", ["state"], registry=r
        )
        self.handoffs_released = Counter(
            "pdserve_handoffs_released", "Handoffs ended, by reason", ["reason"], registry=r
        )
        for reason in ReleaseReason.handoff_ends():  # export zeros: rates work from the start
            self.handoffs_released.labels(reason)
        self.release_seconds = Histogram(
            "pdserve_handoff_release_seconds",
            "Release trigger to blocks free, by reason",
            ["reason"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.transfer_bytes = Counter(
            "pdserve_kv_transfer_bytes", "KV bytes read from prefill nodes", registry=r
        )
        self.transfer_seconds = Histogram(
            "pdserve_kv_transfer_seconds",
            "Duration of one KV read",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.claim_seconds = Histogram(
            "pdserve_handoff_claim_seconds",
            "A decode node's claim of a handoff: round trip to the prefill node",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        # Where a finished request's time went in the engine (engine/request.py RequestTimes)
        self.queue_time = self._histogram(
            "vllm:request_queue_time_seconds", "Arrival to admission (blocks allocated)"
        )
        self.kv_load_time = self._histogram(
            "pdserve_request_kv_load_seconds",
            "Admission to the prompt's KV read from a prefill node (handshake, claim, read)",
        )
        self.prefill_time = self._histogram(
            "vllm:request_prefill_time_seconds", "Admission (or KV loaded) to the first token"
        )
        self.decode_time = self._histogram(
            "vllm:request_decode_time_seconds", "First token to the last"
        )

    def record_connector_stats(self, stats: KVConnectorStats) -> None:
        for num_bytes, seconds in stats.transfers:
            self.transfer_bytes.inc(num_bytes)
            self.transfer_seconds.observe(seconds)
        for seconds in stats.claims_s:
            self.claim_seconds.observe(seconds)

    def _record_times(self, times: RequestTimes) -> None:
        m = self.model_name
        self.queue_time.labels(m).observe(times.queued_s)
        if times.kv_load_s:
            self.kv_load_time.labels(m).observe(times.kv_load_s)
        self.prefill_time.labels(m).observe(times.prefill_s)
        self.decode_time.labels(m).observe(times.decode_s)

    def set_handoff_states(self, counts: dict[str, int]) -> None:
        for state in ("prefilling", "held", "claimed"):
            self.handoffs.labels(state).set(counts.get(state, 0))

    def _histogram(self, name: str, doc: str) -> Histogram:
        histogram = Histogram(
            name, doc, ["model_name"], buckets=_LATENCY_BUCKETS, registry=self.registry
        )
        histogram.labels(self.model_name)  # export zeros from the start
        return histogram

    def render(self, stats: EngineStats) -> bytes:
        m = self.model_name
        self.running.labels(m).set(stats.num_running)
        self.waiting.labels(m).set(stats.num_waiting)
        used = stats.num_blocks - stats.num_free_blocks
        self.kv_usage.labels(m).set(used / stats.num_blocks if stats.num_blocks else 0.0)
        self.kv_blocks_free.labels(m).set(stats.num_free_blocks)
        self.kv_blocks_held.labels(m).set(stats.num_held_blocks)
        self.preemptions.labels(m).set(stats.num_preemptions)
        self.prompt_tokens_computed.labels(m).set(stats.num_prompt_tokens_computed)
        self.prompt_tokens_pending.labels(m).set(stats.num_prompt_tokens_pending)
        return generate_latest(self.registry)

    def request_failed(self, outcome: str) -> None:
        self.requests.labels(self.model_name, outcome).inc()

    async def track(
        self, outputs: AsyncGenerator[RequestOutput, None], span: Span = NULL_SPAN
    ) -> AsyncGenerator[RequestOutput, None]:
        """Pass outputs through, observing latencies and token counts, and the engine's
        phases in `span` (the request's, ended here); closing this closes `outputs`
        (which aborts the request)."""
        m = self.model_name
        start = last = time.monotonic()
        num_tokens = 0
        outcome: str | None = "aborted"
        try:
            async for output in outputs:
                now = time.monotonic()
                new = sum(len(c.token_ids) for c in output.outputs) - num_tokens
                if new > 0:
                    (self.ttft if num_tokens == 0 else self.itl).labels(m).observe(now - last)
                    for _ in range(new - 1):
                        self.itl.labels(m).observe(0.0)  # several tokens arrived in one step
                    num_tokens += new
                    last = now
                if output.finished:
                    outcome = "finished"
                    self.prompt_tokens.labels(m).inc(len(output.prompt_token_ids))
                    self.generation_tokens.labels(m).inc(num_tokens)
                    self.e2e.labels(m).observe(now - start)
                    if output.times is not None:
                        self._record_times(output.times)
                        span.add_phases(output.times)
                yield output
        except PdserveError:
            outcome = None  # refused by the engine: the HTTP layer counts it with its status
            raise
        finally:
            if outcome is not None:
                self.requests.labels(m, outcome).inc()
            span.set("pdserve.outcome", outcome or "refused")
            span.end()
            await outputs.aclose()
