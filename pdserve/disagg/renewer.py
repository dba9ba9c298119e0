"""Decode side (engine process, or a vLLM EngineCore): the lease renewals of handoffs a
decode node has accepted but not yet claimed.

From the moment a decode node accepts a request (waiting queue included) until it claims
the handoff or lets it go, it renews the handoff's lease on the prefill node every quarter
of the lease, a new one at once; the renewals due together go out as one `/kv/renew` per
prefill node. So the lease can be short (a dead decode node strands nothing for long, S10)
without freeing blocks a live one still waits for. One thread; callers only `add` and
`discard`.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from pdserve.disagg.control import ControlClient, ControlError
from pdserve.disagg.params import HandoffRef

logger = logging.getLogger(__name__)


@dataclass
class _Lease:
    url: str
    ref: HandoffRef
    lease_s: float
    renewed_s: float = 0.0
    """When last renewed (0: not yet, so at once)."""

    @property
    def due_s(self) -> float:
        return self.renewed_s + self.lease_s / 4


class LeaseRenewer:
    def __init__(self, control: ControlClient, name: str = "kv-renew") -> None:
        self.control = control
        self._leases: dict[str, _Lease] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        """Set when a lease is added: its first renewal must not wait a whole period."""
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def add(self, key: str, url: str, ref: HandoffRef, lease_s: float) -> None:
        """Renew `ref` on the prefill node at `url` until `discard(key)`."""
        with self._lock:
            self._leases[key] = _Lease(url, ref, lease_s)
        self._wake.set()

    def discard(self, key: str) -> None:
        """Stop renewing (claimed, released, or never needed). Unknown keys are ignored; a
        renewal already under way may still land."""
        with self._lock:
            self._leases.pop(key, None)

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.is_set():
            now = time.monotonic()
            with self._lock:
                leases = list(self._leases.values())
            by_node: dict[str, list[HandoffRef]] = {}
            for lease in leases:
                if now >= lease.due_s:
                    lease.renewed_s = now
                    by_node.setdefault(lease.url, []).append(lease.ref)
            for url, refs in by_node.items():
                try:
                    self.control.renew(url, refs)
                except ControlError as e:
                    logger.warning("lease renewal to %s failed: %s", url, e)
            next_due_s = min((lease.due_s for lease in leases), default=now + 1)
            self._wake.wait(min(max(0.01, next_due_s - time.monotonic()), 1.0))
            self._wake.clear()
