"""Admission: slots, the line, per-key limits, and the 429 (in one event loop, no processes)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pdserve.config import ProxyConfig
from pdserve.proxy.admission import Admission, AdmissionGate, Overloaded

URLS = {"prefill_urls": ("http://a",), "decode_urls": ("http://b",)}


def make_admission(**fields: object) -> Admission:
    return Admission(ProxyConfig(**URLS, **fields))  # type: ignore[arg-type]


def test_waiters_get_freed_slots_in_order_and_the_line_is_bounded() -> None:
    async def scenario() -> None:
        adm = make_admission(max_concurrency=1, max_queue=2, max_queue_wait_s=5)
        await adm.enter("k")
        order: list[str] = []

        async def wait(name: str) -> None:
            await adm.enter("k")
            order.append(name)

        first, second = asyncio.create_task(wait("first")), asyncio.create_task(wait("second"))
        await asyncio.sleep(0)
        with pytest.raises(Overloaded) as full:
            await adm.enter("k")
        assert full.value.reason == "queue_full"
        adm.leave("k")
        await first
        adm.leave("k")
        await second
        assert order == ["first", "second"]
        adm.leave("k")
        assert adm.line.in_flight == 0 and adm.per_key == {}

    asyncio.run(scenario())


def test_a_waiter_that_times_out_or_is_cancelled_loses_no_slot() -> None:
    async def scenario() -> None:
        adm = make_admission(max_concurrency=1, max_queue=4, max_queue_wait_s=0.05)
        await adm.enter("a")
        with pytest.raises(Overloaded) as late:
            await adm.enter("b")
        assert late.value.reason == "queue_timeout"
        gone = asyncio.create_task(adm.enter("c"))
        await asyncio.sleep(0)
        gone.cancel()
        adm.leave("a")  # the slot goes past the cancelled waiter
        with pytest.raises(asyncio.CancelledError):
            await gone
        await adm.enter("d")  # free, not leaked
        adm.leave("d")
        assert adm.line.in_flight == 0 and adm.per_key == {} and adm.num_waiting == 0

    asyncio.run(scenario())


def test_one_key_is_held_to_its_limit_while_others_go_in() -> None:
    async def scenario() -> None:
        adm = make_admission(max_concurrency=8, max_concurrency_per_key=2)
        await adm.enter("k")
        await adm.enter("k")
        with pytest.raises(Overloaded) as busy:
            await adm.enter("k")
        assert busy.value.reason == "per_key"
        await adm.enter("other")
        adm.leave("k")
        await adm.enter("k")

    asyncio.run(scenario())


def test_the_gate_answers_429_in_the_openai_schema_with_retry_after() -> None:
    release = asyncio.Event()

    async def slow(request: Request) -> Response:
        await release.wait()
        return JSONResponse({"ok": True})

    async def scenario() -> None:
        adm = make_admission(max_concurrency=1, max_queue=0)
        rejected: list[str] = []
        waits: list[float] = []
        app = Starlette(routes=[Route("/v1/completions", slow, methods=["POST"])])
        app.add_middleware(
            AdmissionGate, admission=adm, on_reject=rejected.append, on_admit=waits.append
        )
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
            held = asyncio.create_task(client.post("/v1/completions", json={}))
            while adm.line.in_flight == 0:
                await asyncio.sleep(0.001)
            refused = await client.post("/v1/completions", json={})
            release.set()
            assert (await held).status_code == 200
        assert refused.status_code == 429
        assert int(refused.headers["retry-after"]) >= 1
        error = refused.json()["error"]
        assert error["type"] == "rate_limit_exceeded" and error["code"] == 429
        assert rejected == ["queue_full"] and adm.line.in_flight == 0
        assert len(waits) == 1 and 0 <= waits[0] < 1

    asyncio.run(scenario())
