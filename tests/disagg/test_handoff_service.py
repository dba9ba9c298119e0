"""HandoffService's prefill-leg paths against a recording engine client (no processes)."""

from __future__ import annotations

import asyncio
from typing import Any

from pdserve.disagg.handoff_service import HandoffService


class RecordingEngine:
    """What the service tells the engine, in order."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, list[str]]] = []
        self.on_freed_held: Any = None

    async def abort(self, request_ids: list[str]) -> None:
        self.sent.append(("abort", list(request_ids)))

    async def free_held(self, request_ids: list[str]) -> None:
        self.sent.append(("free_held", list(request_ids)))


def test_s2_a_leg_released_by_token_before_its_request_reached_the_engine_frees_what_it_kept() -> (
    None
):
    """The release by token lands after `begin` but before the engine sees the request: it
    ends the handoff and frees nothing (the engine does not know the id yet). The request
    then runs, finishes and keeps its blocks; the leg's own abort comes too late for a
    finished request. The leg's cancel must still free them."""

    async def scenario() -> list[tuple[str, list[str]]]:
        engine = RecordingEngine()
        service = HandoffService(engine, "127.0.0.1", 1, lease_s=5, claim_timeout_s=5)  # type: ignore[arg-type]
        handoff = service.begin("cmpl-1", "client-1", "token-1")
        await service.apply(lambda table: table.release(handoff.handoff_id, "token-1"))
        engine.sent.clear()  # the release's abort and free went before the request existed
        await service.cancel(handoff)
        return engine.sent

    assert ("free_held", ["cmpl-1"]) in asyncio.run(scenario())
