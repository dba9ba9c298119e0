"""OpenTelemetry traces (pdserve/tracing.py): off, nothing is imported or sent; on, one
request through the proxy and both P/D nodes is one trace, as an OTLP/HTTP receiver on
loopback decodes it."""

from __future__ import annotations

import http.server
import itertools
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from pdserve import tracing
from pdserve.errors import ConfigError
from pdserve.outputs import RequestTimes
from tests.api.conftest import Server, free_port, start_servers, stop_server
from tests.disagg.conftest import completion, make_prompt, node_args
from tests.proxy.conftest import start_proxy

CLIENT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]


@dataclass
class Collector:
    """An OTLP/HTTP trace receiver: decodes every export into `spans`."""

    url: str = ""
    spans: list[ReceivedSpan] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def receive(self, body: bytes) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
        )

        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        received = []
        for resource_spans in request.resource_spans:
            resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for s in scope_spans.spans:
                    attributes = {a.key: _value(a.value) for a in s.attributes}
                    received.append(
                        ReceivedSpan(
                            resource["service.name"],
                            s.name,
                            s.trace_id.hex(),
                            s.span_id.hex(),
                            s.parent_span_id.hex(),
                            s.start_time_unix_nano,
                            s.end_time_unix_nano,
                            attributes,
                        )
                    )
        with self.lock:
            self.spans += received

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self.lock:
            return [s for s in self.spans if s.trace_id == trace_id]


def _value(value: Any) -> Any:
    return getattr(value, value.WhichOneof("value")) if value.WhichOneof("value") else None


@pytest.fixture
def collector() -> Iterator[Collector]:
    import opentelemetry.sdk  # noqa: F401  (the otel extra: requirements-dev.txt)

    state = Collector()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            state.receive(body)
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    port = free_port()
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
    httpd.daemon_threads, httpd.block_on_close = True, False  # never wait on an exporter
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    state.url = f"http://127.0.0.1:{port}"
    try:
        yield state
    finally:
        httpd.shutdown()
        httpd.server_close()


def wait_for_spans(
    collector: Collector,
    trace_id: str,
    names: set[str],
    sent_by: frozenset[tuple[str, str]] = frozenset(),
) -> list[ReceivedSpan]:
    """The trace's spans once every name in `names`, and every (service, name) in
    `sent_by`, arrived: each process sends its spans in batches of its own, so a name
    that several services use (`POST /v1/completions`) may arrive from one before another."""
    deadline = time.monotonic() + 15
    while True:
        spans = collector.trace(trace_id)
        arrived = names <= {s.name for s in spans} and sent_by <= {
            (s.service, s.name) for s in spans
        }
        if arrived or time.monotonic() > deadline:
            return spans
        time.sleep(0.1)


def one(spans: list[ReceivedSpan], service: str, name: str) -> ReceivedSpan:
    found = [s for s in spans if s.service == service and s.name == name]
    assert len(found) == 1, f"{service} {name}: {found}"
    return found[0]


def test_tracing_is_off_by_default_and_costs_no_import() -> None:
    code = (
        "import sys; from pdserve import tracing; "
        "s = tracing.start_span('x', {'traceparent': '00-' + '1' * 32 + '-' + '2' * 16 + '-01'}); "
        "s.child('y').end(); s.end(); "
        "assert s is tracing.NULL_SPAN and s.headers() == {}; "
        "assert not any(m.startswith('opentelemetry') for m in sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_an_endpoint_that_is_not_a_url_is_refused_at_start() -> None:
    with pytest.raises(ConfigError, match="otlp-endpoint"):
        tracing.configure("localhost:4318", "pdserve-test")


def test_one_pd_request_is_one_trace_across_proxy_and_nodes(
    tiny_model_dir: Any, collector: Collector
) -> None:
    model = tiny_model_dir("llama")
    otlp = ("--otlp-endpoint", collector.url)
    nodes = start_servers(
        node_args(model, "--role", "prefill", *otlp), node_args(model, "--role", "decode", *otlp)
    )
    proxy: Server | None = None
    try:
        prefill, decode = nodes
        proxy = start_proxy([prefill.url], [decode.url], "--model", str(model), *otlp)
        traceparent = f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"
        headers = {"Authorization": "Bearer test-key", "traceparent": traceparent}
        body = completion(make_prompt(40, seed=80), max_tokens=5)
        r = httpx.post(f"{proxy.url}/v1/completions", json=body, headers=headers, timeout=60)
        assert r.status_code == 200

        phases = {"queue", "kv_load", "prefill", "decode"}
        posts = frozenset((f"pdserve-{r}", "POST /v1/completions") for r in ("prefill", "decode"))
        spans = wait_for_spans(
            collector, CLIENT_TRACE_ID, {"prefill leg", "decode leg"} | phases, posts
        )
        root = one(spans, "pdserve-proxy", "POST /v1/completions")
        assert root.parent_id == CLIENT_SPAN_ID  # the client's trace goes on
        assert root.attributes["pdserve.path"] == "pd"
        for leg, service in (("prefill leg", "pdserve-prefill"), ("decode leg", "pdserve-decode")):
            sent = one(spans, "pdserve-proxy", leg)
            assert sent.parent_id == root.span_id
            assert sent.attributes["pdserve.node"] in (prefill.url, decode.url)
            node_span = one(spans, service, "POST /v1/completions")
            assert node_span.parent_id == sent.span_id  # over the legs' traceparent
            assert root.start_ns <= sent.start_ns <= sent.end_ns <= root.end_ns
        on_decode = one(spans, "pdserve-decode", "POST /v1/completions")
        children = {s.name: s for s in spans if s.parent_id == on_decode.span_id}
        assert set(children) == phases
        # Back to back, in order: queue, the KV read, the first token, the rest.
        order = [children[p] for p in ("queue", "kv_load", "prefill", "decode")]
        for before, after in itertools.pairwise(order):
            assert before.end_ns == after.start_ns
        on_prefill = one(spans, "pdserve-prefill", "POST /v1/completions")
        assert {s.name for s in spans if s.parent_id == on_prefill.span_id} == {
            "queue", "prefill", "decode"
        }  # fmt: skip

        # A streamed answer: the request's span ends with the stream, not before it.
        r = httpx.post(f"{proxy.url}/v1/completions", json={**body, "stream": True},
                       headers={"Authorization": "Bearer test-key"}, timeout=60)  # fmt: skip
        assert r.status_code == 200 and "[DONE]" in r.text
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            streamed = [s for s in collector.spans if s.name == "decode leg"
                        and s.trace_id != CLIENT_TRACE_ID]  # fmt: skip
            if streamed:
                break
            time.sleep(0.1)
        trace = wait_for_spans(collector, streamed[0].trace_id, {"POST /v1/completions"})
        stream_root = one(trace, "pdserve-proxy", "POST /v1/completions")
        assert stream_root.end_ns >= streamed[0].end_ns
        assert stream_root.parent_id == ""  # no traceparent from this client: a new trace
    finally:
        if proxy is not None:
            stop_server(proxy)
        for node in nodes:
            stop_server(node)


def test_phases_are_placed_back_to_back_before_the_end(collector: Collector) -> None:
    """The unit under the end-to-end test: `add_phases` in this process."""
    tracing.configure(collector.url, "pdserve-unit")
    try:
        span = tracing.start_span("request")
        span.add_phases(RequestTimes(queued_s=0.5, kv_load_s=0.0, prefill_s=0.25, decode_s=1.0))
        span.end()
    finally:
        tracing.shutdown()  # flushes
    spans = {s.name: s for s in collector.spans}
    assert set(spans) == {"request", "queue", "prefill", "decode"}  # no empty kv_load
    durations = {n: (s.end_ns - s.start_ns) / 1e9 for n, s in spans.items() if n != "request"}
    assert durations == pytest.approx({"queue": 0.5, "prefill": 0.25, "decode": 1.0})
    assert spans["queue"].end_ns == spans["prefill"].start_ns
    assert spans["prefill"].end_ns == spans["decode"].start_ns
