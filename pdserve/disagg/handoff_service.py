"""API process (prefill node): the handoff service, the `HandoffTable`, its sweep, and the
link to the engine that frees released handoffs' blocks.

Why here and not in the engine process: control messages (claim, renew, release, abort)
are answered at once, even while the engine is in a long prefill step; the engine only
ever hears "free this request's blocks" (`FreeHeld`), applied before its next step, and,
for a leg still prefilling, "abort it". Life of a handoff through this service:

    prefill leg admitted ─▶ begin()          (PREFILLING; an abort now aborts the request)
    its one token out    ─▶ commit(output)   (HELD with the engine's pinned block ids, or
                                               freed at once if a release won the race, S2)
    claim/renew/done/failed/release/abort    (table transitions, answered immediately)
    every SWEEP_INTERVAL_S ─▶ sweep()        (lease and claim deadlines)
    any release          ─▶ _flush()         (FreeHeld → blocks freed; the engine's
                                               `freed_held` report closes the timing)
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pdserve.disagg.handoff import Handoff, HandoffState, HandoffTable
from pdserve.disagg.messages import AbortOutcome, Handshake, Outcome, ReleaseReason
from pdserve.disagg.params import KVTransferParams, NodeKVInfo, first_token_params
from pdserve.engine.async_client import AsyncEngineClient
from pdserve.errors import StatusError
from pdserve.outputs import RequestOutput

logger = logging.getLogger(__name__)

SWEEP_INTERVAL_S = 0.02


@dataclass(frozen=True)
class ReleaseObserver:
    """Metrics hooks: a handoff ended (reason), and its blocks were free after `seconds`."""

    released: Callable[[ReleaseReason], None]
    freed: Callable[[ReleaseReason, float], None]
    """(reason, seconds)"""


class HandoffService:
    def __init__(
        self,
        client: AsyncEngineClient,
        host: str,
        port: int,
        lease_s: float,
        claim_timeout_s: float,
        observer: ReleaseObserver | None = None,
    ) -> None:
        self.client = client
        self.host, self.port = host, port
        self.table = HandoffTable(lease_s=lease_s, claim_timeout_s=claim_timeout_s)
        self.engine_id = f"pdserve-prefill-{secrets.token_hex(6)}"
        self.observer = observer
        self._freeing: dict[str, tuple[ReleaseReason, float]] = {}
        """Request id → (reason, when its release was triggered), until the engine reports
        the blocks freed."""
        client.on_freed_held = self._on_freed

    # -- the prefill leg -------------------------------------------------------------

    def begin(
        self, request_id: str, client_request_id: str = "", release_token: str | None = None
    ) -> Handoff:
        return self.table.begin(request_id, client_request_id, release_token)

    async def commit(self, handoff: Handoff, output: RequestOutput) -> bool:
        """The leg's final output: pin its blocks under the handoff. False when the
        handoff was released meanwhile (its blocks are then freed)."""
        outcome = Outcome.UNKNOWN
        if output.held_block_ids and not output.error:
            outcome = self.table.hold(
                handoff.handoff_id, output.held_block_ids, len(output.prompt_token_ids)
            )
        if outcome is not Outcome.OK:
            self.table.release(handoff.handoff_id, None, admin=True, reason=ReleaseReason.ABORTED)
            await self._flush()
            await self.client.free_held([handoff.request_id])  # whatever the engine kept
        return outcome is Outcome.OK

    async def cancel(self, handoff: Handoff) -> None:
        """The prefill leg ended without a response (client gone, error). Its request may
        still have finished in the engine with its blocks kept: a release by token that
        came after `begin` but before the request reached the engine ended the handoff
        and freed nothing, and the leg's abort is ignored by a finished request. So free
        whatever the engine kept, as `commit` does (found by `bench chaos`)."""
        self.table.release(handoff.handoff_id, None, admin=True, reason=ReleaseReason.ABORTED)
        await self._flush()
        await self.client.free_held([handoff.request_id])

    def transfer_params(self, handoff: Handoff, output: RequestOutput) -> KVTransferParams:
        return KVTransferParams(
            do_remote_prefill=True,
            do_remote_decode=False,
            remote_engine_id=self.engine_id,
            remote_request_id=handoff.handoff_id,
            remote_block_ids=list(handoff.block_ids),
            remote_host=self.host,
            remote_port=self.port,
            remote_num_tokens=handoff.num_tokens,
            epoch=self.table.epoch,
            release_token=handoff.release_token,
            lease_s=self.table.lease_s,
            **first_token_params(output),
        )

    # -- control messages ------------------------------------------------------------

    def handshake(self) -> Handshake:
        info = self.client.kv_handshake
        if not isinstance(info, NodeKVInfo):  # the engine is not ready yet
            raise StatusError(
                "the node is starting: its engine has not published its KV layout yet",
                status=503,
                error_type="service_unavailable",
            )
        return Handshake(self.engine_id, self.table.epoch, info.layout, info.transport)

    async def apply(self, action: Callable[[HandoffTable], Outcome]) -> Outcome:
        """Run one table transition and free whatever it released."""
        outcome = action(self.table)
        await self._flush()
        return outcome

    async def abort(
        self, ids: list[str], token: str | None, admin: bool
    ) -> dict[str, AbortOutcome]:
        """`POST /v1/abort_requests` on a prefill node: release handoffs (by handoff id,
        server request id or X-Request-Id; with a token, only those it was minted for) and
        abort their running prefill legs."""
        results = self.table.abort(ids, token, admin)
        await self._flush()
        return results

    # -- time and freeing ------------------------------------------------------------

    async def run_sweeper(self) -> None:
        while True:
            self.table.sweep()
            await self._flush()
            await asyncio.sleep(SWEEP_INTERVAL_S)

    async def _flush(self) -> None:
        released = self.table.take_released()
        for handoff in released:
            reason = handoff.release_reason or ReleaseReason.RELEASED  # set by every release
            logger.info(
                "handoff %s (request %s) released: %s",
                handoff.handoff_id,
                handoff.request_id,
                reason,
            )
            if self.observer:
                self.observer.released(reason)
            if handoff.block_ids:
                self._freeing[handoff.request_id] = (reason, time.monotonic())
        # Released before its blocks were pinned here: the leg may still be prefilling (abort
        # it), or have finished with its blocks held by the engine (the free covers that).
        unpinned = [h.request_id for h in released if not h.block_ids]
        if unpinned:
            await self.client.abort(unpinned)
        if released:
            await self.client.free_held([h.request_id for h in released])

    def _on_freed(self, request_ids: list[str]) -> None:
        now = time.monotonic()
        for request_id in request_ids:
            freeing = self._freeing.pop(request_id, None)
            if freeing is not None and self.observer:
                reason, started = freeing
                self.observer.freed(reason, now - started)

    def snapshot(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        rows = []
        for h in self.table.live():
            deadline = h.claim_deadline_s if h.state is HandoffState.CLAIMED else h.lease_deadline_s
            rows.append(
                {
                    "handoff_id": h.handoff_id,
                    "request_id": h.request_id,
                    "client_request_id": h.client_request_id,
                    "state": h.state.value,
                    "num_blocks": len(h.block_ids),
                    "num_tokens": h.num_tokens,
                    "age_s": round(now - h.created_s, 3),
                    "time_left_s": round(deadline - now, 3) if deadline else None,
                }
            )
        return rows
