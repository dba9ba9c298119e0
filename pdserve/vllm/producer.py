"""vLLM EngineCore (prefill node): the handoffs of the prompts this node holds for decode
nodes, kept in pdserve's `HandoffTable` and served on the `ControlServer`.

The life of a prefill request, and what frees its blocks:

    on_new_request   ─▶ begin: PREFILLING, with the proxy's release token (or a minted one)
    request_finished ─▶ hold: HELD, lease started; vLLM keeps the blocks (delay_free) and the
                         answer's kv_transfer_params gain handoff_id, release_token, epoch,
                         lease_s and control_url
    control messages ─▶ renew / claim (CLAIMED) / done / failed / release / abort, at once
    every step       ─▶ free_released: the table's sweep (lease, claim deadline), and every
                         handoff it released whose blocks vLLM still holds is freed in this
                         step: its worker deadline (`reqs_to_send`) is set in the past, and
                         the worker returns it in this step's `finished_sending`
    finished_sending ─▶ sent: vLLM freed the blocks (the decode node's read notification, or
                         the release above); the handoff ends if it had not

vLLM's own lease (`kv_lease_duration`, 30 s) stays underneath as a backstop: each handoff's
worker deadline is kept well past the table's own (re-armed as renewals extend it), so the
table decides, never vLLM's clock.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import Counter, deque
from typing import Any

from pdserve.disagg.handoff import Handoff, HandoffState, HandoffTable
from pdserve.disagg.messages import Outcome, ReleaseReason
from pdserve.disagg.params import is_valid_release_token
from pdserve.vllm.control_server import ControlServer
from pdserve.vllm.settings import Settings

logger = logging.getLogger(f"vllm.{__name__}")  # under vLLM's logging: its format, its level

ARM_AHEAD_S = 30.0
"""How far past the table's deadline a handoff's vLLM worker deadline is set."""
ARM_MIN_AHEAD_S = 10.0
"""Re-armed when the table's deadline comes within this of the worker's."""

_VLLM_REQUEST_ID = re.compile(r"^(?:chat)?cmpl-(?P<client>.+?)(?:-\d+)?-[0-9a-f]{8}$")
"""vLLM's engine request id: `cmpl-<X-Request-Id or random>-<prompt index>-<8 hex>` (chat:
`chatcmpl-...`). The client's X-Request-Id names the handoff in an abort, as on pdserve."""


def client_request_id(vllm_request_id: str) -> str:
    match = _VLLM_REQUEST_ID.match(vllm_request_id)
    return match.group("client") if match else ""


NULL_BLOCK_ID = 0
"""vLLM's null block (its block pool's first): where a sliding-window layer's group names a
block that fell out of its window. It holds nothing and is never freed."""


def flat_block_ids(remote_block_ids: Any) -> tuple[int, ...]:
    """vLLM's `remote_block_ids` (one list per KV cache group: several for a hybrid model)
    as one tuple of the blocks held, without the null block: what a claim names and what
    `num_held_blocks` counts."""
    return tuple(
        int(b) for group in remote_block_ids or () for b in group if int(b) != NULL_BLOCK_ID
    )


class Producer:
    def __init__(self, settings: Settings, host: str, vllm_lease_s: float) -> None:
        self.table = HandoffTable(settings.lease_s, settings.claim_timeout_s)
        self.lock = threading.Lock()
        """Guards the table: the engine thread and the control server's threads share it."""
        self.vllm_lease_s = vllm_lease_s
        self.server = ControlServer(
            self.table,
            self.lock,
            host,
            settings.control_port,
            settings.cluster_secret,
            self._report,
            settings.tls.server_context(),
        )
        self.control_url = f"{settings.tls.scheme}://{host}:{self.server.port}"
        self._handoff_of: dict[str, str] = {}
        """vLLM request id → its handoff, until vLLM has freed the request's blocks."""
        self._holding: dict[str, float] = {}
        """vLLM request id → its worker deadline (perf_counter), while vLLM holds its blocks."""
        self._free_next: set[str] = set()
        self.freed_total: Counter[str] = Counter()
        """Every handoff vLLM freed, by why (release, abort, lease expiry, ...): vLLM counts
        them all in its expired-request metric, this tells them apart."""
        self.freed: deque[tuple[float, float, str]] = deque(maxlen=10_000)
        """For each handoff the table released (a release, an abort, a lease or claim
        deadline): when (time.monotonic, the same clock in every process of the host), the
        seconds until vLLM reported its blocks freed, and why. `GET /kv/handoffs`."""
        logger.info("pdserve handoffs: control endpoint %s", self.control_url)

    # -- the scheduler's hooks (engine thread) -------------------------------------------

    def begin(self, request: Any) -> None:
        """A prefill leg arrived: its handoff starts PREFILLING."""
        params = request.kv_transfer_params or {}
        if not params.get("do_remote_decode"):
            return
        token = params.get("release_token")
        if token is not None and not (isinstance(token, str) and is_valid_release_token(token)):
            logger.warning("request %s: release_token is too weak; minting one", request.request_id)
            token = None
        with self.lock:
            handoff = self.table.begin(
                request.request_id, client_request_id(request.request_id), token
            )
        self._handoff_of[request.request_id] = handoff.handoff_id

    def finished(
        self, request: Any, delay_free: bool, params: dict[str, Any] | None
    ) -> dict[str, Any] | None:
        """vLLM decided whether to hold the finished request's blocks (`delay_free`, with the
        answer's `params`). Returns the params the answer carries."""
        handoff_id = self._handoff_of.get(request.request_id)
        if handoff_id is None:
            return params
        if not delay_free or params is None:  # aborted or failed: vLLM frees the blocks now
            del self._handoff_of[request.request_id]
            with self.lock:
                self.table.ended(handoff_id, ReleaseReason.ABORTED)
            return params
        block_ids = flat_block_ids(params.get("remote_block_ids"))
        with self.lock:
            outcome = self.table.hold(
                handoff_id, block_ids, int(params.get("remote_num_tokens") or 0)
            )
            handoff = self.table.get(handoff_id)
        self._holding[request.request_id] = time.perf_counter() + self.vllm_lease_s
        if outcome is not Outcome.OK or handoff is None:  # released while prefilling
            self._free_next.add(request.request_id)  # freed at the next step, as any release
        return params if handoff is None else {**params, **self._params_of(handoff)}

    def free_released(self, reqs_to_send: dict[str, float], scheduler_clock: float) -> None:
        """Before the worker runs this step: free what the table released (a deadline in
        the past: the worker reaps it now) and keep vLLM's lease behind the table's."""
        with self.lock:
            self.table.sweep()
            released = self.table.take_released()
            live = [(h.request_id, _time_left_s(h)) for h in self.table.live() if h.block_ids]
        for handoff in released:
            logger.info(
                "handoff %s (request %s) released: %s",
                handoff.handoff_id,
                handoff.request_id,
                handoff.release_reason,
            )
        to_free = self._free_next | {h.request_id for h in released}
        self._free_next = set()
        for request_id in to_free & self._holding.keys():
            del self._holding[request_id]
            reqs_to_send[request_id] = scheduler_clock - 1.0
        now = time.perf_counter()
        for request_id, time_left_s in live:
            armed = self._holding.get(request_id)
            if armed is not None and now + time_left_s + ARM_MIN_AHEAD_S > armed:
                self._holding[request_id] = now + time_left_s + ARM_AHEAD_S
                reqs_to_send[request_id] = scheduler_clock + time_left_s + ARM_AHEAD_S

    def sent(self, request_ids: set[str]) -> None:
        """vLLM freed these requests' blocks (`finished_sending`)."""
        for request_id in request_ids:
            self._holding.pop(request_id, None)
            handoff_id = self._handoff_of.pop(request_id, None)
            if handoff_id is None:
                continue
            with self.lock:
                handoff = self.table.get(handoff_id)
                if handoff is not None and handoff.state is HandoffState.RELEASED:
                    after_s = time.monotonic() - handoff.released_at_s
                    reason = str(handoff.release_reason)
                    self.freed.append((handoff.released_at_s, after_s, reason))
                    self.freed_total[reason] += 1
                elif handoff is not None:
                    claimed = handoff.state is HandoffState.CLAIMED
                    # Without a claim, only vLLM's own lease frees a held request.
                    reason = ReleaseReason.TRANSFERRED if claimed else ReleaseReason.EXPIRED
                    self.table.ended(handoff_id, reason)
                    self.freed_total[reason.value] += 1

    def close(self) -> None:
        self.server.close()

    def _report(self) -> dict[str, Any]:
        freed = list(self.freed)
        return {
            "freed_total": dict(self.freed_total),
            "freed_after_release_s": [after for _, after, _ in freed],
            "releases": [
                {"at_s": at, "freed_after_s": after, "reason": why} for at, after, why in freed
            ],
        }

    def _params_of(self, handoff: Handoff) -> dict[str, Any]:
        return {
            "handoff_id": handoff.handoff_id,
            "release_token": handoff.release_token,
            "epoch": self.table.epoch,
            "lease_s": self.table.lease_s,
            "control_url": self.control_url,
        }


def _time_left_s(handoff: Handoff) -> float:
    deadline = (
        handoff.claim_deadline_s
        if handoff.state is HandoffState.CLAIMED
        else handoff.lease_deadline_s
    )
    return max(0.0, deadline - time.monotonic())
