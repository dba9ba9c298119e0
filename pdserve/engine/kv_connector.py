"""The scheduler's only window onto KV transfer: a connector called at named hooks.

The scheduler has no notion of prefill or decode roles. A node's role is the connector it
is given: `NoKVConnector` on a plain node; the prefill and decode connectors of
`pdserve.disagg` on P/D nodes. Every hook runs in the engine process, on the engine loop
thread, synchronously inside `Scheduler` calls, so it must not block on I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.engine.request import Request
    from pdserve.engine.scheduler import SchedulerOutput


class KVConnector:
    """Base class: every hook is a no-op, so a subclass overrides only what it needs."""

    def on_request_added(self, request: Request) -> None:
        """Called by `Scheduler.add_request` when a request enters the waiting queue.

        May start side activity about the request (e.g. a decode node renewing the lease
        of the handoff it will read), but must not touch blocks: none are allocated yet.
        """

    def on_blocks_allocated(self, request: Request, block_ids: Sequence[int]) -> None:
        """Called by `Scheduler.schedule` after the request's blocks grew to `block_ids`.

        The blocks are the request's; the connector may fill them (a remote read) before
        the model step that uses them.
        """

    def on_request_finished(self, request: Request, block_ids: Sequence[int]) -> bool:
        """Called once when a request finishes, is aborted, or is dropped before admission.

        Returns True to keep its blocks pinned (e.g. a prefill node holding them for a
        remote decode): the scheduler then keeps them until `on_step_finished` names the
        request as releasable. Returns False to let the scheduler free them now.
        """
        return False

    def on_step_finished(self, output: SchedulerOutput) -> Sequence[str]:
        """Called at the end of every engine step (and of every idle tick).

        Returns ids of requests whose held blocks may now be freed. Unknown or already
        freed ids are ignored by the scheduler.
        """
        return ()


class NoKVConnector(KVConnector):
    """A single node: no transfers, nothing held."""
