"""The chaos workload: seeded requests through the proxy, each with a plan for how it ends,
and the record of what happened to it.

Plans (drawn per request from the seed):
- `complete`: runs to the end (stream or not, chat or completion, greedy or sampled);
- `cancel`: the client leaves after a log-uniform delay of 1 ms–2 s, which lands in every
  stage of a request's life (queued or running on the prefill node, between the legs,
  queued on the decode node, during the transfer, during decode);
- `stream_cancel`: a streaming client leaves after a few chunks (during decode);
- `between_legs`: the harness plays proxy: a prefill leg on a node, then it releases the
  handoff with its token, or abandons it to its lease;
- `unauthenticated_abort`: an abort without credentials, or with a forged token, that every
  node must refuse (401/403).

Every request through the proxy carries `X-Request-Id: chaos-<seed>-<index>`. When its
client leaves, `ReleaseWatcher` times how long a prefill node still lists a handoff for it,
and the proxy's record of the departure (`/admin/departures`) says which stage it hit.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from pdserve_bench.chaos.cluster import bearer

PLANS = ("complete", "complete", "complete", "cancel", "cancel", "stream_cancel",
         "between_legs", "unauthenticated_abort")  # fmt: skip


@dataclass
class RequestRecord:
    index: int
    plan: str
    start_s: float
    chat: bool = False
    stream: bool = False
    greedy: bool = True
    body: dict[str, Any] = field(default_factory=dict)
    end_s: float = 0.0
    status: int = 0
    """HTTP status; 0 when the client left (cancelled) or the connection failed."""
    token_ids: list[int] | None = None
    error: str = ""
    request_id: str = ""
    """Its X-Request-Id (requests through the proxy)."""
    departed_s: float | None = None
    """When the client left before the end of its answer."""
    prefill_release_s: float | None = None
    """Departure → no prefill node lists a handoff for it (None: not within the watch)."""


POLL_S = 0.01


@dataclass
class ReleaseWatcher:
    """Polls the prefill nodes' handoff lists (`handoffs_url`: pdserve's `/admin/kv`, or
    a vLLM node's connector endpoint) while some departed request is watched, and
    answers, per request, the time from its departure to the first poll, sent after the
    departure, in which no prefill node lists a handoff with its X-Request-Id: an upper
    bound on the release (by up to a poll round), for the stages that hold a handoff.

    A node that refuses connections is down and holds nothing; any other failed poll
    concludes nothing."""

    prefill_urls: list[str]
    headers: dict[str, str]
    timeout_s: float
    clock: Any = time.monotonic
    handoffs_url: Callable[[str], str] = lambda url: f"{url}/admin/kv"
    _waiting: dict[str, tuple[float, asyncio.Future[float | None]]] = field(default_factory=dict)
    _task: asyncio.Task[None] | None = None

    async def released_after(self, http: httpx.AsyncClient, request_id: str,
                             departed_s: float) -> float | None:  # fmt: skip
        """Seconds from `departed_s` (on `clock`) to the release; None: not within the
        timeout."""
        future: asyncio.Future[float | None] = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = (departed_s, future)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._poll(http))
        return await future

    async def _poll(self, http: httpx.AsyncClient) -> None:
        while self._waiting:
            started = self.clock()
            held = await self._held(http)
            now = self.clock()
            for request_id, (departed, future) in list(self._waiting.items()):
                if held is not None and started >= departed and request_id not in held:
                    future.set_result(now - departed)
                elif now - departed > self.timeout_s:
                    future.set_result(None)
                else:
                    continue
                del self._waiting[request_id]
            await asyncio.sleep(POLL_S)

    async def _held(self, http: httpx.AsyncClient) -> set[str] | None:
        """X-Request-Ids with a live handoff on some prefill node (None: unknown)."""
        held: set[str] = set()
        for node in await asyncio.gather(*(self._held_on(http, u) for u in self.prefill_urls)):
            if node is None:
                return None
            held |= node
        return held

    async def _held_on(self, http: httpx.AsyncClient, url: str) -> set[str] | None:
        try:
            response = await http.get(self.handoffs_url(url), headers=self.headers, timeout=2)
            return {row.get("client_request_id") or "" for row in response.json()["handoffs"]}
        except httpx.ConnectError:
            return set()  # down: holds nothing
        except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
            return None


@dataclass
class Workload:
    proxy_url: str
    api_key: str
    node_headers: dict[str, str]
    """For legs and releases sent straight to a node (the `between_legs` plan)."""
    seed: int
    chat: bool
    long_prompt_tokens: int
    clock: Any
    """Seconds since the run started (the cluster's clock)."""
    watcher: ReleaseWatcher
    admin_url: Callable[[str], str] = lambda url: url
    """Where a prefill node takes aborts (a vLLM node: its connector's endpoint)."""
    seeded: bool = True
    """Sampled requests carry a `seed` (`--unseeded`: not; vLLM CPU 0.32's engine dies on a
    seeded request whose prompt is prefilled in chunks: "CPU Generator does not use
    offset")."""
    records: list[RequestRecord] = field(default_factory=list)
    refused_unauthenticated: int = 0
    accepted_unauthenticated: int = 0
    watches: list[asyncio.Task[None]] = field(default_factory=list)

    def make(self, index: int, rng: random.Random, burst: bool = False) -> RequestRecord:
        """A request and its plan; `burst`: a long one that runs to the end."""
        plan = "complete" if burst else rng.choice(PLANS)
        chat = self.chat and rng.random() < 0.3
        long = burst or rng.random() < 0.3
        length = rng.randint(self.long_prompt_tokens // 2, self.long_prompt_tokens) if long \
            else rng.randint(4, 40)  # fmt: skip
        greedy = rng.random() < 0.7
        body: dict[str, Any] = {"max_tokens": rng.randint(4, 32), "return_token_ids": True,
                                "temperature": 0 if greedy else 0.8}  # fmt: skip
        seed = rng.randrange(1 << 30)  # drawn either way: the plans stay those of the seed
        if not greedy and self.seeded:
            body["seed"] = seed
        if chat:
            words = " ".join(rng.choice(("sea", "sky", "river", "stone", "tree", "cloud"))
                             for _ in range(length))  # fmt: skip
            body["messages"] = [{"role": "user", "content": words}]
        else:
            body["prompt"] = [rng.randrange(3, 300) for _ in range(length)]
        stream = plan == "stream_cancel" or (plan == "complete" and rng.random() < 0.4)
        return RequestRecord(index, plan, self.clock(), chat, stream, greedy, body,
                             request_id=f"chaos-{self.seed}-{index}")  # fmt: skip

    async def run(self, http: httpx.AsyncClient, record: RequestRecord, rng: random.Random,
                  prefill_urls: list[str]) -> None:  # fmt: skip
        try:
            if record.plan == "between_legs":
                await self._between_legs(http, record, rng, prefill_urls)
            elif record.plan == "unauthenticated_abort":
                await self._unauthenticated_abort(http, record, rng, prefill_urls)
            elif record.plan == "cancel":
                delay_s = math.exp(rng.uniform(math.log(0.001), math.log(2.0)))
                try:
                    await asyncio.wait_for(self._send(http, record), delay_s)
                except asyncio.TimeoutError:
                    record.departed_s = self.clock()
            else:
                await self._send(http, record, stop_after_chunks=rng.randint(1, 6)
                                 if record.plan == "stream_cancel" else None)  # fmt: skip
        except httpx.HTTPError as e:
            record.error = f"{type(e).__name__}: {e}"
        record.end_s = self.clock()
        self.records.append(record)
        if record.departed_s is not None:
            self.watches.append(asyncio.create_task(self._watch_release(http, record)))

    async def _watch_release(self, http: httpx.AsyncClient, record: RequestRecord) -> None:
        assert record.departed_s is not None
        record.prefill_release_s = await self.watcher.released_after(
            http, record.request_id, record.departed_s
        )

    async def _send(self, http: httpx.AsyncClient, record: RequestRecord,
                    stop_after_chunks: int | None = None) -> None:  # fmt: skip
        path = "/v1/chat/completions" if record.chat else "/v1/completions"
        body = {**record.body, "stream": record.stream}
        url = f"{self.proxy_url}{path}"
        headers = {"X-Request-Id": record.request_id}
        if not record.stream:
            response = await http.post(url, json=body, headers=headers)
            record.status = response.status_code
            if response.status_code == 200:
                record.token_ids = response.json()["choices"][0].get("token_ids")
            else:
                record.error = response.text[:300]
            return
        tokens: list[int] = []
        async with http.stream("POST", url, json=body, headers=headers) as response:
            record.status = response.status_code
            num_chunks = 0
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    record.status, record.error = 502, json.dumps(chunk)[:300]
                    return
                if chunk.get("choices"):
                    tokens += chunk["choices"][0].get("token_ids") or []
                num_chunks += 1
                if stop_after_chunks is not None and num_chunks >= stop_after_chunks:
                    record.status = 0  # the client leaves mid-stream
                    record.departed_s = self.clock()
                    return
        record.token_ids = tokens if record.status == 200 else None

    async def _between_legs(self, http: httpx.AsyncClient, record: RequestRecord,
                            rng: random.Random, prefill_urls: list[str]) -> None:  # fmt: skip
        record.chat = False
        record.body = {"prompt": record.body.get("prompt") or [5, 6, 7], "max_tokens": 4,
                       "kv_transfer_params": {"do_remote_decode": True}}  # fmt: skip
        node = rng.choice(prefill_urls)
        response = await http.post(f"{node}/v1/completions", json=record.body,
                                   headers=self.node_headers)  # fmt: skip
        record.status = response.status_code
        if response.status_code != 200:
            return
        kv = response.json().get("kv_transfer_params") or {}
        await asyncio.sleep(rng.uniform(0, 0.2))
        if rng.random() < 0.7:  # a proxy whose client left: release with the token
            release = {"request_ids": [kv.get("remote_request_id")],
                       "release_token": kv.get("release_token")}  # fmt: skip
            await http.post(f"{self.admin_url(node)}/v1/abort_requests", json=release,
                            headers={"Authorization": ""})  # fmt: skip
        # else: a proxy that died: the lease frees it

    async def _unauthenticated_abort(
        self, http: httpx.AsyncClient, record: RequestRecord, rng: random.Random,
        prefill_urls: list[str],
    ) -> None:  # fmt: skip
        node = rng.choice(prefill_urls)
        body: dict[str, Any] = {"request_ids": [f"ho-forged-{rng.randrange(1 << 30)}"]}
        if rng.random() < 0.5:
            body["release_token"] = "forged"
            body["request_ids"] = ["cmpl-anything"]
        response = await http.post(f"{self.admin_url(node)}/v1/abort_requests", json=body,
                                    headers={"Authorization": "Bearer wrong"})  # fmt: skip
        record.status = response.status_code
        if response.status_code in (401, 403):
            self.refused_unauthenticated += 1
        else:
            self.accepted_unauthenticated += 1
            record.error = response.text[:300]


async def generate_load(workload: Workload, duration_s: float, rate: float, max_inflight: int,
                        prefill_urls: list[str], burst_at: list[float]) -> None:  # fmt: skip
    """Poisson arrivals at `rate`/s for `duration_s`, at most `max_inflight` at once; at each
    time in `burst_at`, 3 x `max_inflight` long requests at once (KV exhaustion)."""
    rng = random.Random(workload.seed)
    headers = bearer(workload.api_key)
    limits = httpx.Limits(max_connections=4 * max_inflight)
    inflight = asyncio.Semaphore(max_inflight)
    tasks: set[asyncio.Task[None]] = set()
    bursts = sorted(burst_at)
    async with httpx.AsyncClient(headers=headers, timeout=120, limits=limits) as http:

        async def one(index: int, plan_rng: random.Random, burst: bool) -> None:
            record = workload.make(index, plan_rng, burst)
            if burst:  # past the in-flight cap: the point is to exhaust KV blocks
                await workload.run(http, record, plan_rng, prefill_urls)
                return
            async with inflight:
                if workload.clock() < end_s:  # arrivals still queued at the end are dropped
                    await workload.run(http, record, plan_rng, prefill_urls)

        index = 0
        end_s = workload.clock() + duration_s
        while workload.clock() < end_s:
            await asyncio.sleep(rng.expovariate(rate))
            while bursts and workload.clock() >= bursts[0]:
                bursts.pop(0)
                for _ in range(3 * max_inflight):
                    index += 1
                    burst_rng = random.Random(workload.seed * 1_000_003 + index)
                    tasks.add(asyncio.create_task(one(index, burst_rng, burst=True)))
            index += 1
            plan_rng = random.Random(workload.seed * 1_000_003 + index)
            tasks.add(asyncio.create_task(one(index, plan_rng, burst=False)))
            tasks = {t for t in tasks if not t.done()}
        await asyncio.gather(*tasks)
        await asyncio.gather(*workload.watches)
