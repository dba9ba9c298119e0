"""The proxy's view of its nodes: health with hysteresis, load, and the choice of a node.

A backend starts up (the proxy may start before its nodes; the first failed call or
check counts against it). `DOWN_AFTER` consecutive failures — failed health checks or
requests that could not reach it — mark it down; `UP_AFTER` consecutive successful health
checks mark it up again. `choose` picks the up backend with the fewest requests in flight
from this proxy, then the lowest KV usage reported by its `/metrics`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

import httpx

from pdserve.proxy.upstream import Node, UpstreamResponse

logger = logging.getLogger(__name__)

DOWN_AFTER = 2
UP_AFTER = 2
KV_USAGE_METRIC = "vllm:kv_cache_usage_perc"


@dataclass
class Backend:
    url: str
    role: str
    up: bool = True
    num_outstanding: int = 0
    """Legs in flight to the node from this proxy (only `post_json` counts them)."""
    kv_usage: float = 0.0
    _failures: int = 0
    _successes: int = 0
    upstream: Node = field(init=False)
    """Keep-alive connections for the legs."""

    def __post_init__(self) -> None:
        self.upstream = Node(self.url)

    async def post_json(
        self, path: str, body: bytes, headers: dict[str, str], timeout_s: float | None
    ) -> UpstreamResponse:
        """POST a leg through this node's connections. It counts in `num_outstanding` from
        now until its response is closed, or until the POST fails."""
        self.num_outstanding += 1
        try:
            response = await self.upstream.post_json(path, body, headers, timeout_s)
        except BaseException:
            self.num_outstanding -= 1
            raise
        response.on_close(self._request_ended)
        return response

    def _request_ended(self) -> None:
        self.num_outstanding -= 1

    def record(self, ok: bool) -> None:
        if ok:
            self._failures, self._successes = 0, self._successes + 1
            if not self.up and self._successes >= UP_AFTER:
                self.up = True
                logger.info("%s node %s is up", self.role, self.url)
        else:
            self._failures, self._successes = self._failures + 1, 0
            if self.up and self._failures >= DOWN_AFTER:
                self.up = False
                logger.warning("%s node %s is down", self.role, self.url)


class BackendPool:
    def __init__(self, role: str, urls: Iterable[str]) -> None:
        self.role = role
        self.backends = [Backend(url.rstrip("/"), role) for url in urls]

    def choose(self, exclude: set[str] = frozenset()) -> Backend | None:  # type: ignore[assignment]
        candidates = [b for b in self.backends if b.up and b.url not in exclude]
        if not candidates:
            return None
        return min(candidates, key=lambda b: (b.num_outstanding, b.kv_usage))

    @property
    def num_up(self) -> int:
        return sum(b.up for b in self.backends)


async def check_health(
    pools: list[BackendPool], http: httpx.AsyncClient, interval_s: float, metrics_every: int = 5
) -> None:
    """Forever: GET /health of every backend each `interval_s`, /metrics every few rounds."""
    round_ = 0
    while True:
        backends = [b for pool in pools for b in pool.backends]
        await asyncio.gather(*(_check(b, http, round_ % metrics_every == 0) for b in backends))
        round_ += 1
        await asyncio.sleep(interval_s)


async def _check(backend: Backend, http: httpx.AsyncClient, scrape: bool) -> None:
    try:
        response = await http.get(f"{backend.url}/health", timeout=2.0)
        backend.record(response.status_code == 200)
        if scrape and response.status_code == 200:
            metrics = await http.get(f"{backend.url}/metrics", timeout=2.0)
            backend.kv_usage = _kv_usage(metrics.text)
    except httpx.HTTPError:
        backend.record(False)


def _kv_usage(text: str) -> float:
    for line in text.splitlines():
        if line.startswith(KV_USAGE_METRIC):
            try:
                return float(line.rsplit(" ", 1)[1])
            except ValueError:
                return 0.0
    return 0.0
