"""vLLM EngineCore (decode node): a decode leg's claim, lease renewals and releases, for
params a `PdserveConnector` prefill node wrote (they name a `handoff_id` and a
`control_url`; others take vLLM's own path).

    on_new_request              ─▶ NEW: its lease renewed every lease/4 (no NIXL heartbeat)
    get_num_new_matched_tokens  ─▶ CLAIMING: the claim goes out; vLLM asks again each step
                                   (None: "not yet") until the answer is in:
        GRANTED ─▶ vLLM's path: blocks allocated, NIXL READ, its notification frees P's
        REFUSED ─▶ nothing is read: the prompt is computed here (expired, released, unknown,
                   stale epoch, prefill node unreachable: no read is ever unclaimed)
    request_finished            ─▶ let go of what it still holds: a handoff not yet claimed
                                   is released; one claimed but never read is reported failed
    failed_recving              ─▶ reported failed: the prefill node frees at once instead of
                                   at its claim deadline
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from pdserve.disagg.control import ControlClient, ControlError
from pdserve.disagg.messages import Outcome, ReleaseReason
from pdserve.disagg.params import HandoffRef
from pdserve.disagg.renewer import LeaseRenewer
from pdserve.vllm.producer import flat_block_ids
from pdserve.vllm.settings import Settings

logger = logging.getLogger(f"vllm.{__name__}")  # under vLLM's logging: its format, its level

NUM_CLAIM_WORKERS = 4


class ClaimState(enum.Enum):
    NEW = "new"
    CLAIMING = "claiming"
    GRANTED = "granted"
    REFUSED = "refused"


@dataclass
class _Load:
    url: str
    ref: HandoffRef
    block_ids: tuple[int, ...]
    lease_s: float
    state: ClaimState = ClaimState.NEW
    reading: bool = False
    """vLLM started the read (blocks allocated for it)."""
    ended: bool = False
    """The request finished before the claim's answer came."""


def remote_handoff(params: dict[str, Any] | None) -> _Load | None:
    """A decode leg's handoff, if a PdserveConnector prefill node wrote its params."""
    if not params or not params.get("do_remote_prefill"):
        return None
    fields = (params.get(k) for k in ("handoff_id", "release_token", "control_url"))
    handoff_id, token, url = fields
    if not all(isinstance(v, str) and v for v in (handoff_id, token, url)):
        return None
    epoch = params.get("epoch")
    ref = HandoffRef(str(handoff_id), str(token), epoch if isinstance(epoch, str) else None)
    lease_s = params.get("lease_s")
    lease_s = float(lease_s) if isinstance(lease_s, int | float) and lease_s > 0 else 5.0
    return _Load(str(url), ref, flat_block_ids(params.get("remote_block_ids")), lease_s)


class Consumer:
    def __init__(self, settings: Settings) -> None:
        self.control = ControlClient(settings.cluster_secret, settings.tls)
        self.renewer = LeaseRenewer(self.control, name="pdserve-renew")
        self._workers = ThreadPoolExecutor(NUM_CLAIM_WORKERS, thread_name_prefix="pdserve-claim")
        self._loads: dict[str, _Load] = {}
        self._lock = threading.Lock()

    # -- the scheduler's hooks (engine thread) -------------------------------------------

    def track(self, request: Any) -> None:
        load = remote_handoff(request.kv_transfer_params)
        if load is not None:
            with self._lock:
                self._loads[request.request_id] = load
            self.renewer.add(request.request_id, load.url, load.ref, load.lease_s)

    def claim(self, request: Any) -> ClaimState | None:
        """Where the request's claim stands (None: not a pdserve handoff); the first call
        sends it."""
        with self._lock:
            load = self._loads.get(request.request_id)
            if load is None:
                return None
            if load.state is ClaimState.NEW:
                load.state = ClaimState.CLAIMING
                self.renewer.discard(request.request_id)
                self._workers.submit(self._claim, load)
            return load.state

    def reading(self, request_id: str) -> None:
        """vLLM allocated blocks for the read and starts it."""
        with self._lock:
            load = self._loads.get(request_id)
            if load is not None:
                load.reading = True

    def finished(self, request_id: str) -> None:
        """The request ended (any way): let go of what its handoff still holds."""
        self.renewer.discard(request_id)
        with self._lock:
            load = self._loads.pop(request_id, None)
            if load is None:
                return
            load.ended = True
            state, reading = load.state, load.reading
        if state is ClaimState.NEW:
            self._workers.submit(self._release, load, ReleaseReason.CANCELLED)
        elif state is ClaimState.GRANTED and not reading:
            self._workers.submit(self._abandon, load)
        # CLAIMING: `_claim` lets go when its answer comes. A read that ran: its
        # notification freed the blocks, or `failed` reported it.

    def failed(self, request_ids: set[str]) -> None:
        """Reads that failed (`failed_recving`): the prefill node frees at once."""
        with self._lock:
            loads = [load for r in request_ids if (load := self._loads.get(r)) is not None]
        for load in loads:
            self._workers.submit(self._abandon, load)

    def close(self) -> None:
        self.renewer.close()
        self._workers.shutdown(wait=True)
        self.control.close()

    # -- control messages (worker threads) ------------------------------------------------

    def _claim(self, load: _Load) -> None:
        started = time.monotonic()
        try:
            outcome, _ = self.control.claim(load.url, load.ref, load.block_ids)
            logger.info(
                "claim of %s: %s in %.3f s",
                load.ref.handoff_id,
                outcome,
                time.monotonic() - started,
            )
        except ControlError as e:
            # Unknown whether it landed: never read (fail closed); the prefill node frees
            # the handoff at its claim deadline or lease end.
            logger.warning("claim of %s failed: %s; computing locally", load.ref.handoff_id, e)
            outcome = None
        granted = outcome is Outcome.OK
        if not granted:
            logger.info("claim of %s refused (%s): computing locally", load.ref.handoff_id, outcome)
        with self._lock:
            load.state = ClaimState.GRANTED if granted else ClaimState.REFUSED
            ended = load.ended
        if granted and ended:
            self._abandon(load)
        elif outcome is Outcome.WRONG_BLOCKS:  # still held, for nobody
            self._release(load, ReleaseReason.REJECTED)

    def _abandon(self, load: _Load) -> None:
        try:
            self.control.finish_read(load.url, load.ref, ok=False)
        except ControlError as e:  # the claim deadline frees it
            logger.warning("could not report %s failed: %s", load.ref.handoff_id, e)

    def _release(self, load: _Load, reason: ReleaseReason) -> None:
        try:
            self.control.release(load.url, load.ref, reason)
        except ControlError as e:  # the lease frees it
            logger.warning("release of %s failed: %s", load.ref.handoff_id, e)
