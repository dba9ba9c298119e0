"""Optional OpenTelemetry traces: one client request, its legs and each node's phases as one
trace. Configured once per process by `cli.main` (`--otlp-endpoint URL`), like logging.

Off by default, and then out of the hot path: `start_span` returns `NULL_SPAN`, whose
methods do nothing, and the OpenTelemetry SDK is never imported. On, spans go in batches
from the SDK's background thread to `URL/v1/traces` (OTLP over HTTP, protobuf): an
OpenTelemetry Collector, Jaeger or Tempo. `pip install pdserve[otel]` installs the SDK.

One request through `pdserve up`:

    pdserve-proxy    POST /v1/chat/completions ─┬─ prefill leg ─┐   (one per attempt)
                                                └─ decode leg ──┼─┐
    pdserve-prefill  prefill leg ◀──── traceparent ─────────────┘ │
                       └─ queue, prefill                          │
    pdserve-decode   decode leg ◀───── traceparent ───────────────┘
                       └─ queue, kv_load, prefill, decode

Legs carry the W3C `traceparent` header; a client's own `traceparent` makes the proxy's
span a child of the client's. A node's phases come from the engine's `RequestTimes` and
are placed backwards from the moment the API process saw the request finish: they are
off by the engine-to-API hop (well under a millisecond), and say where the time went.
"""

from __future__ import annotations

import argparse
import enum
import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pdserve.errors import ConfigError

if TYPE_CHECKING:
    from pdserve.outputs import RequestTimes

logger = logging.getLogger(__name__)


class SpanKind(enum.Enum):
    SERVER = "server"
    """Handles a request that came in (the proxy's client request, a node's leg)."""
    CLIENT = "client"
    """A request sent out (a leg, from the proxy)."""
    INTERNAL = "internal"


class Span:
    """A span that records nothing: what every call gets while tracing is off."""

    def child(self, name: str, kind: SpanKind = SpanKind.INTERNAL) -> Span:
        return self

    def headers(self) -> dict[str, str]:
        """Headers that make the receiver's span a child of this one (`traceparent`)."""
        return {}

    def set(self, key: str, value: str | int | float | bool) -> None:
        pass

    def add_phases(self, times: RequestTimes) -> None:
        """Child spans for the engine's phases of a request that just finished."""

    def end(self) -> None:
        pass


NULL_SPAN = Span()


class _OtelSpan(Span):
    def __init__(self, tracing: _Tracing, span: Any) -> None:
        self._tracing, self._span = tracing, span

    def child(self, name: str, kind: SpanKind = SpanKind.INTERNAL) -> Span:
        return self._tracing.start(name, self._context(), kind)

    def headers(self) -> dict[str, str]:
        carrier: dict[str, str] = {}
        self._tracing.propagator.inject(carrier, context=self._context())
        return carrier

    def set(self, key: str, value: str | int | float | bool) -> None:
        self._span.set_attribute(key, value)

    def add_phases(self, times: RequestTimes) -> None:
        end_ns = time.time_ns()
        phases = [
            ("decode", times.decode_s),
            ("prefill", times.prefill_s),
            ("kv_load", times.kv_load_s),
            ("queue", times.queued_s),
        ]
        for name, seconds in phases:  # backwards from the end
            if name == "kv_load" and not seconds:
                continue
            start_ns = end_ns - int(seconds * 1e9)
            span = self._tracing.tracer.start_span(
                name, context=self._context(), start_time=start_ns
            )
            span.end(end_time=end_ns)
            end_ns = start_ns

    def end(self) -> None:
        self._span.end()

    def _context(self) -> Any:
        from opentelemetry import trace

        return trace.set_span_in_context(self._span)


class _Tracing:
    """The SDK's tracer and exporter for this process."""

    def __init__(self, endpoint: str, service_name: str) -> None:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.trace import SpanKind as OtelKind
            from opentelemetry.trace.propagation.tracecontext import (
                TraceContextTextMapPropagator,
            )
        except ImportError as e:
            raise ConfigError(
                f"--otlp-endpoint needs the OpenTelemetry SDK ({e}): pip install pdserve[otel]"
            ) from e
        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        exporter = OTLPSpanExporter(endpoint=f"{endpoint.rstrip('/')}/v1/traces", timeout=5)
        self.provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=500))
        self.tracer = self.provider.get_tracer("pdserve")
        self.propagator = TraceContextTextMapPropagator()
        self.kinds = {
            SpanKind.SERVER: OtelKind.SERVER,
            SpanKind.CLIENT: OtelKind.CLIENT,
            SpanKind.INTERNAL: OtelKind.INTERNAL,
        }

    def start(self, name: str, context: Any, kind: SpanKind) -> Span:
        span = self.tracer.start_span(name, context=context, kind=self.kinds[kind])
        return _OtelSpan(self, span)


_tracing: _Tracing | None = None


def add_otlp_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--otlp-endpoint",
        default=None,
        metavar="URL",
        help="send OpenTelemetry traces to URL/v1/traces (OTLP over HTTP: a collector, "
        "Jaeger, Tempo); needs pip install pdserve[otel]. Default: off",
    )


def configure(endpoint: str | None, service_name: str) -> None:
    """Export this process's spans to `endpoint` (an OTLP/HTTP base URL); None: off."""
    global _tracing
    if not endpoint:
        return
    if not endpoint.startswith(("http://", "https://")):
        raise ConfigError(f"--otlp-endpoint must be an http(s) URL, got {endpoint!r}")
    _tracing = _Tracing(endpoint, service_name)
    logger.info("tracing: spans of %s go to %s/v1/traces", service_name, endpoint.rstrip("/"))


def start_span(
    name: str, headers: Mapping[str, str] | None = None, kind: SpanKind = SpanKind.SERVER
) -> Span:
    """A new span, the child of the one that `headers` (a request's) name if any."""
    if _tracing is None:
        return NULL_SPAN
    context = _tracing.propagator.extract(dict(headers)) if headers else None
    return _tracing.start(name, context, kind)


def shutdown() -> None:
    """Send the spans still queued (at exit)."""
    global _tracing
    if _tracing is not None:
        _tracing.provider.shutdown()
        _tracing = None
