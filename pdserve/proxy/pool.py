"""The proxy's view of its nodes: health with hysteresis, a circuit breaker, load, and
what each node's prefix cache holds.

A backend starts up (the proxy may start before its nodes; the first failed call or
check counts against it). `DOWN_AFTER` consecutive failures — failed health checks or
requests that could not reach it — mark it down; `UP_AFTER` consecutive successful health
checks mark it up again.

Legs also feed each node's circuit breaker, which catches a node that answers its health
checks but fails its requests (5xx, timeouts, broken streams):

    closed ──BREAK_AFTER failed legs in a row──▶ open ──BREAK_S later──▶ half-open
      ▲                                           ▲                        │ one leg (probe)
      └────────────── the probe succeeds ─────────┼────────────────────────┤
                                                  └──── the probe fails ───┘

A node is a candidate while it is up and its breaker lets a leg through (`available`).
`routing.py` chooses among candidates; `choose` here (least loaded) serves the rest.

The health checks also poll each node's `/admin/prefix_cache?since=V` (cheap while
nothing changed). A summary that does not parse is ignored, counted in
`malformed_summaries` and logged once per node.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import ssl
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import httpx

from pdserve.kv_cache.prefix_summary import EMPTY, CachedPrefixes, MalformedSummary, parse_summary
from pdserve.openai_api.prometheus import read_metrics
from pdserve.proxy.upstream import Node, UpstreamResponse

logger = logging.getLogger(__name__)

DOWN_AFTER = 2
UP_AFTER = 2
KV_USAGE_METRIC = "vllm:kv_cache_usage_perc"
NUM_RECENT_BLOCKS_KEPT = 65_536
"""Block hashes of prompts sent lately, per node (about 3 MB): ~1,000 prompts of 64 blocks."""
BREAK_AFTER = 5
BREAK_S = 5.0


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass
class Breaker:
    """One node's circuit breaker (diagram above); `clock` is injectable for tests."""

    clock: Callable[[], float] = time.monotonic
    state: BreakerState = BreakerState.CLOSED
    num_failures: int = 0
    _opened_s: float = 0.0
    _probe_s: float | None = None

    def allows(self) -> bool:
        """Whether a leg may go to the node now (a half-open breaker: one probe at a time;
        a probe that never reported back counts as ended after BREAK_S)."""
        now = self.clock()
        if self.state is BreakerState.OPEN and now - self._opened_s >= BREAK_S:
            self.state, self._probe_s = BreakerState.HALF_OPEN, None
        if self.state is BreakerState.HALF_OPEN:
            return self._probe_s is None or now - self._probe_s >= BREAK_S
        return self.state is BreakerState.CLOSED

    def sent(self) -> None:
        if self.state is BreakerState.HALF_OPEN:
            self._probe_s = self.clock()

    def record(self, ok: bool) -> bool:
        """A leg's outcome; True when it opened the breaker."""
        if ok:
            self.state, self.num_failures = BreakerState.CLOSED, 0
            return False
        self.num_failures += 1
        if self.state is BreakerState.HALF_OPEN or (
            self.state is BreakerState.CLOSED and self.num_failures >= BREAK_AFTER
        ):
            self.state, self._opened_s = BreakerState.OPEN, self.clock()
            return True
        return False


@dataclass
class Backend:
    url: str
    role: str
    up: bool = True
    num_outstanding: int = 0
    """Legs in flight to the node from this proxy (only `post_json` counts them)."""
    pending_tokens: int = 0
    """Prompt tokens the node computes for legs this proxy sent that have not produced
    their first token (`post_json`'s `compute_tokens`, until its response head)."""
    kv_usage: float = 0.0
    _failures: int = 0
    _successes: int = 0
    upstream: Node = field(init=False)
    """Keep-alive connections for the legs."""
    breaker: Breaker = field(default_factory=Breaker)
    cached: CachedPrefixes = EMPTY
    """The node's prefix cache, from its latest summary."""
    malformed_summaries: int = 0
    control_url: str | None = None
    """Where the node takes releases when that is not its own URL: a vLLM node running
    `PdserveConnector` answers prefill legs with its connector's endpoint (`control_url`),
    learned from its answers (docs/vllm.md)."""
    _recent: OrderedDict[bytes, float] = field(default_factory=OrderedDict)
    """Block-hash cut → when a prompt with that block was last sent, oldest first: cached
    there soon, maybe not yet in a summary."""

    ssl_context: ssl.SSLContext | None = None
    """Verifies an https node's certificate (`pdserve/tls.py`)."""

    def __post_init__(self) -> None:
        self.upstream = Node(self.url, self.ssl_context)

    async def post_json(
        self,
        path: str,
        body: bytes,
        headers: dict[str, str],
        timeout_s: float | None,
        compute_tokens: int = 0,
    ) -> UpstreamResponse:
        """POST a leg through this node's connections. It counts in `num_outstanding` from
        now until its response is closed, or until the POST fails; its `compute_tokens`
        count in `pending_tokens` until the response head arrives (a node sends it with
        the first token)."""
        self.num_outstanding += 1
        self.pending_tokens += compute_tokens
        self.breaker.sent()
        try:
            response = await self.upstream.post_json(path, body, headers, timeout_s)
        except BaseException:
            self.num_outstanding -= 1
            raise
        finally:
            self.pending_tokens -= compute_tokens
        response.on_close(self._request_ended)
        return response

    def _request_ended(self) -> None:
        self.num_outstanding -= 1

    def available(self) -> bool:
        return self.up and self.breaker.allows()

    def record_leg(self, ok: bool) -> None:
        """A leg's outcome for the breaker: False for a 5xx, a timeout, a broken leg."""
        if self.breaker.record(ok):
            logger.warning("%s node %s: circuit open after failed legs", self.role, self.url)

    def remember(self, chain: Sequence[bytes], now_s: float) -> dict[bytes, float | None]:
        """A prompt with these block-hash cuts (`prompt_chain`) was sent to the node.
        Returns when each cut was last sent before, for `forget`."""
        before = {cut: self._recent.get(cut) for cut in chain}
        for cut in chain:
            self._recent[cut] = now_s
            self._recent.move_to_end(cut)
        while len(self._recent) > NUM_RECENT_BLOCKS_KEPT:
            self._recent.popitem(last=False)
        return before

    def forget(self, before: Mapping[bytes, float | None], sent_s: float) -> None:
        """The prompt `remember`ed at `sent_s` never reached the node's cache: each cut no
        later prompt was sent with counts from its earlier send again, or not at all."""
        for cut, when in before.items():
            if self._recent.get(cut) != sent_s:
                continue
            if when is None:
                del self._recent[cut]
            else:
                self._recent[cut] = when

    def sent_since(self, cut: bytes, since_s: float) -> bool:
        """A prompt with this block went to the node at or after `since_s`."""
        when = self._recent.get(cut)
        return when is not None and when >= since_s

    def take_summary(self, data: object) -> None:
        """A `/admin/prefix_cache` body: a new summary, `unchanged`, or junk (ignored)."""
        if isinstance(data, dict) and data.get("unchanged") is True:
            return
        try:
            self.cached = parse_summary(data)
        except MalformedSummary as e:
            self.malformed_summaries += 1
            if self.malformed_summaries == 1:
                logger.warning(
                    "%s node %s: malformed prefix summary ignored: %s", self.role, self.url, e
                )

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
                self.cached = EMPTY  # a node that comes back is empty
                self._recent.clear()
                logger.warning("%s node %s is down", self.role, self.url)


class BackendPool:
    def __init__(
        self, role: str, urls: Iterable[str], ssl_context: ssl.SSLContext | None = None
    ) -> None:
        self.role = role
        self._ssl = ssl_context
        self.backends = [Backend(url.rstrip("/"), role, ssl_context=ssl_context) for url in urls]

    def set_members(self, urls: Iterable[str]) -> None:
        """The nodes, from a discovery source (`pdserve/cluster/`): a new URL joins (a node
        Ray started or restarted on a new port), a missing one leaves (removed, or gone).
        A leg in flight to a node that left keeps its `Backend` until it ends; the handoffs
        of a node that is gone are covered by leases (S10/S11)."""
        wanted = list(dict.fromkeys(url.rstrip("/") for url in urls))
        current = {b.url: b for b in self.backends}
        for url in wanted:
            if url not in current:
                logger.info("%s node %s joined", self.role, url)
        for url, backend in current.items():
            if url not in wanted:
                logger.info("%s node %s left", self.role, url)
                backend.upstream.close()
        self.backends = [
            current.get(url) or Backend(url, self.role, ssl_context=self._ssl) for url in wanted
        ]

    def candidates(self, exclude: Collection[str] = frozenset()) -> list[Backend]:
        """The nodes a leg may go to now: up, breaker letting legs through, not excluded."""
        return [b for b in self.backends if b.available() and b.url not in exclude]

    def choose(self, exclude: Collection[str] = frozenset()) -> Backend | None:
        """The least loaded candidate: fewest legs in flight, then the lowest KV use."""
        return min(self.candidates(exclude), key=_load, default=None)

    @property
    def num_up(self) -> int:
        return sum(b.up for b in self.backends)


def _load(backend: Backend) -> tuple[int, float]:
    return backend.num_outstanding, backend.kv_usage


async def check_health(
    pools: list[BackendPool],
    http: httpx.AsyncClient,
    interval_s: float,
    headers: dict[str, str],
    summaries: bool,
    metrics_every: int = 5,
) -> None:
    """Forever: GET /health of every backend each `interval_s` (and its prefix summary
    with `summaries`), /metrics every few rounds."""
    round_ = 0
    while True:
        backends = [b for pool in pools for b in pool.backends]
        scrape = round_ % metrics_every == 0
        await asyncio.gather(*(_check(b, http, scrape, headers, summaries) for b in backends))
        round_ += 1
        await asyncio.sleep(interval_s)


async def _check(
    backend: Backend, http: httpx.AsyncClient, scrape: bool, headers: dict[str, str],
    summaries: bool,
) -> None:  # fmt: skip
    try:
        response = await http.get(f"{backend.url}/health", timeout=2.0)
        backend.record(response.status_code == 200)
        if response.status_code != 200:
            return
        if scrape:
            metrics = await http.get(f"{backend.url}/metrics", timeout=2.0)
            backend.kv_usage = _kv_usage(metrics.text)
        if summaries:
            await _poll_summary(backend, http, headers)
    except httpx.HTTPError:
        backend.record(False)


async def _poll_summary(backend: Backend, http: httpx.AsyncClient, headers: dict[str, str]) -> None:
    params = {"since": str(backend.cached.version)} if backend.cached.version >= 0 else {}
    response = await http.get(
        f"{backend.url}/admin/prefix_cache", params=params, headers=headers, timeout=2.0
    )
    if response.status_code == 404:
        return  # a node without summaries (another server): routed by load alone
    try:
        data = response.json() if response.status_code == 200 else None
    except ValueError:
        data = None
    backend.take_summary(data)


def _kv_usage(text: str) -> float:
    return read_metrics(text, (KV_USAGE_METRIC,)).get(KV_USAGE_METRIC, 0.0)
