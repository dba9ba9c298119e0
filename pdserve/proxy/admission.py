"""Admission: how many client requests the proxy lets through at once, and who waits.

Life of a completion request at the door (`AdmissionGate`, an ASGI middleware on the two
completion routes; a stream holds its slot until it ends):

    its API key already has `max_concurrency_per_key` in flight → 429 at once
    a slot free, nobody waiting → in
    `max_queue` already waiting → 429 at once
    else wait in line (FIFO) → a slot within `max_queue_wait_s` → in; else 429
    in: the request runs (`legs.py`); a client that left while it waited is noticed there
    at once, before any leg is sent

Every 429 is an OpenAI error (`rate_limit_exceeded`) with `Retry-After` in seconds, and
is counted by reason. A slot that is handed to a waiter the moment it gives up is passed
on, never lost (`_Line.hand_on`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from starlette.types import ASGIApp, Receive, Scope, Send

from pdserve.config import ProxyConfig
from pdserve.openai_api.errors import error_response

logger = logging.getLogger(__name__)

GATED_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages")


class Overloaded(Exception):
    def __init__(self, reason: str, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.reason = reason
        self.retry_after_s = retry_after_s


@dataclass
class _Line:
    """The slots and the waiters' queue (one event loop: no locks)."""

    max_in_flight: int
    in_flight: int = 0
    waiters: deque[asyncio.Future[None]] = field(default_factory=deque)

    def try_enter(self) -> bool:
        if self.in_flight < self.max_in_flight and not self.waiters:
            self.in_flight += 1
            return True
        return False

    def leave(self) -> None:
        self.in_flight -= 1
        self.hand_on()

    def hand_on(self) -> None:
        """Give free slots to the first waiters still waiting."""
        while self.waiters and self.in_flight < self.max_in_flight:
            waiter = self.waiters.popleft()
            if not waiter.done():
                self.in_flight += 1
                waiter.set_result(None)


class Admission:
    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.line = _Line(config.max_concurrency)
        self.per_key: dict[str, int] = {}
        self.num_admitted = 0

    @property
    def num_waiting(self) -> int:
        return sum(1 for w in self.line.waiters if not w.done())

    async def enter(self, key: str) -> None:
        """Take a slot for a request with this API key (a digest), or raise Overloaded."""
        limit = self.config.max_concurrency_per_key
        if limit and self.per_key.get(key, 0) >= limit:
            raise Overloaded("per_key", f"this API key already has {limit} requests in flight", 1.0)
        self.per_key[key] = self.per_key.get(key, 0) + 1  # waiters count against their key
        try:
            if not self.line.try_enter():
                await self._wait()
        except BaseException:
            self._key_done(key)
            raise
        self.num_admitted += 1

    async def _wait(self) -> None:
        wait_s = self.config.max_queue_wait_s
        if self.num_waiting >= self.config.max_queue:
            raise Overloaded("queue_full", "the proxy is at capacity: too many requests", wait_s)
        waiter = asyncio.get_running_loop().create_future()
        self.line.waiters.append(waiter)
        try:
            await asyncio.wait_for(asyncio.shield(waiter), wait_s)
        except (asyncio.TimeoutError, asyncio.CancelledError) as e:
            if waiter.done():  # the slot came as it gave up: pass it on
                self.line.leave()
            else:
                waiter.cancel()
            if isinstance(e, asyncio.CancelledError):
                raise
            raise Overloaded("queue_timeout", f"no capacity within {wait_s:g} s", wait_s) from None

    def leave(self, key: str) -> None:
        self._key_done(key)
        self.line.leave()

    @contextlib.asynccontextmanager
    async def slot(self, headers: list[tuple[bytes, bytes]]) -> AsyncIterator[None]:
        """A slot held for work that runs after its HTTP request was answered (a background
        response), as the gate holds one for a request: it waits in the same line and
        raises Overloaded where the gate would answer 429."""
        key = _key_digest(dict(headers).get(b"authorization", b""))
        await self.enter(key)
        try:
            yield
        finally:
            self.leave(key)

    def _key_done(self, key: str) -> None:
        n = self.per_key.get(key, 0) - 1
        if n > 0:
            self.per_key[key] = n
        else:
            self.per_key.pop(key, None)


class AdmissionGate:
    """ASGI middleware: the completion routes pass `Admission` first."""

    def __init__(
        self,
        app: ASGIApp,
        admission: Admission,
        on_reject: Callable[[str], None],
        on_admit: Callable[[float], None] = lambda wait_s: None,
    ) -> None:
        self.app = app
        self.admission = admission
        self.on_reject = on_reject
        self.on_admit = on_admit
        """Called with the seconds each admitted request waited for its slot."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in GATED_PATHS:
            await self.app(scope, receive, send)
            return
        key = _key_digest(dict(scope["headers"]).get(b"authorization", b""))
        started = time.perf_counter()
        try:
            await self.admission.enter(key)
        except Overloaded as e:
            self.on_reject(e.reason)
            response = error_response(429, str(e), "rate_limit_exceeded")
            response.headers["Retry-After"] = str(max(1, math.ceil(e.retry_after_s)))
            await response(scope, receive, send)
            return
        self.on_admit(time.perf_counter() - started)
        try:
            await self.app(scope, receive, send)
        finally:
            self.admission.leave(key)


def _key_digest(authorization: bytes) -> str:
    """Per-key counts are kept by a digest: the proxy holds no client secret in memory."""
    return hashlib.blake2b(authorization, digest_size=8).hexdigest()
