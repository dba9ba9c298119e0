"""What the proxy's routes and legs share: its config, the node pools and router, admission,
metrics, the departures record and the background releases. Its own module so the app
(`app.py`) and the request path (`legs.py`, `answers.py`, `batched.py`) all name it
without importing each other."""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdserve.config import ProxyConfig
from pdserve.proxy.admission import Admission
from pdserve.proxy.client import Stage
from pdserve.proxy.membership import Membership
from pdserve.proxy.pool import BackendPool
from pdserve.proxy.routing import Router, make_router
from pdserve.seams import NO_SEAMS, Seams

logger = logging.getLogger(__name__)

NUM_DEPARTURES_KEPT = 10_000
_LEG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                5.0, 10.0, 30.0, 60.0)  # fmt: skip


class ProxyMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "pdserve_proxy_requests", "Client requests by outcome", ["outcome"], registry=r
        )
        self.leg_seconds = Histogram(
            "pdserve_proxy_leg_seconds",
            "Duration of one leg",
            ["leg"],
            buckets=_LEG_BUCKETS,
            registry=r,
        )
        self.releases = Counter("pdserve_proxy_releases", "Handoff releases sent", registry=r)
        self.attempts = Counter(
            "pdserve_proxy_attempts",
            "Leg attempts on one node, by leg and how each ended (proxy/attempts.py)",
            ["leg", "end"],
            registry=r,
        )
        self.retries = Counter(
            "pdserve_proxy_retries", "Legs retried on another node", ["leg"], registry=r
        )
        self.departures = Counter(
            "pdserve_proxy_departures",
            "Clients that left, by the stage their request was in",
            ["stage"],
            registry=r,
        )
        self.backend_up = Gauge(
            "pdserve_proxy_backend_up", "1 if the node is up", ["role", "url"], registry=r
        )
        self.backend_outstanding = Gauge(
            "pdserve_proxy_backend_outstanding",
            "Requests in flight to the node",
            ["role", "url"],
            registry=r,
        )
        self.backend_breaker_open = Gauge(
            "pdserve_proxy_backend_breaker_open",
            "1 if the node's circuit breaker is open or half-open",
            ["role", "url"],
            registry=r,
        )
        self.backend_cached_blocks = Gauge(
            "pdserve_proxy_backend_cached_blocks",
            "Blocks in the node's latest prefix-cache summary",
            ["role", "url"],
            registry=r,
        )
        self.malformed_summaries = Gauge(
            "pdserve_proxy_malformed_summaries",
            "Prefix-cache summaries from the node that did not parse (ignored)",
            ["role", "url"],
            registry=r,
        )
        self.routed = Counter(
            "pdserve_proxy_routed", "Legs sent, by leg and policy", ["leg", "policy"], registry=r
        )
        self.paths = Counter(
            "pdserve_proxy_disaggregation",
            "Requests by path: pd (both legs), decode_only (run whole on a decode node) or "
            "prefill_only (a completion scoring its prompt, run whole on a prefill node)",
            ["path"],
            registry=r,
        )
        for path in ("pd", "decode_only", "prefill_only"):
            self.paths.labels(path)
        self.rejected = Counter(
            "pdserve_proxy_rejected", "Requests answered 429, by reason", ["reason"], registry=r
        )
        self.queue_wait_seconds = Histogram(
            "pdserve_proxy_queue_wait_seconds",
            "Wait for an admission slot, of requests admitted",
            buckets=(0.0001, *_LEG_BUCKETS),
            registry=r,
        )
        self.waiting = Gauge("pdserve_proxy_waiting", "Requests waiting for a slot", registry=r)
        self.in_flight = Gauge(
            "pdserve_proxy_in_flight", "Requests admitted, not ended", registry=r
        )


@dataclass
class ProxyState:
    config: ProxyConfig
    seams: Seams = NO_SEAMS
    membership: Membership | None = None
    """Where the nodes come from while serving (`membership.py`); None: the fixed URLs."""
    node_ssl: ssl.SSLContext = field(init=False)
    """Verifies https nodes (legs, health checks, releases)."""
    prefill: BackendPool = field(init=False)
    decode: BackendPool = field(init=False)
    router: Router = field(init=False)
    admission: Admission = field(init=False)
    metrics: ProxyMetrics = field(default_factory=ProxyMetrics)
    departures: deque[dict[str, object]] = field(
        default_factory=lambda: deque(maxlen=NUM_DEPARTURES_KEPT)
    )
    """The latest clients that left: X-Request-Id, stage, when (`GET /admin/departures`)."""
    http: httpx.AsyncClient = field(init=False)
    background: set[asyncio.Task[None]] = field(default_factory=set)
    """Releases that must not hold up a request (a retry elsewhere, a 499), awaited at
    shutdown so that none is dropped."""
    closers: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    """Run at shutdown before the legs' client closes (the agent APIs' background
    responses end as cancelled, their store closes)."""

    def __post_init__(self) -> None:
        self.node_ssl = self.config.tls.client_context()
        self.prefill = BackendPool("prefill", self.config.prefill_urls, self.node_ssl)
        self.decode = BackendPool("decode", self.config.decode_urls, self.node_ssl)
        self.router = make_router(self.config)
        self.admission = Admission(self.config)

    @property
    def node_headers(self) -> dict[str, str]:
        key = self.config.node_api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    def spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(work)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    def record_departure(self, request_id: str, stage: Stage) -> None:
        self.metrics.departures.labels(stage.value).inc()
        self.departures.append(
            {"request_id": request_id, "stage": stage.value, "monotonic_s": time.monotonic()}
        )
        logger.info("request %s: client left during %s", request_id or "-", stage.value)
