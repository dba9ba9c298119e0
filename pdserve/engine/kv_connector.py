"""The scheduler's only window onto KV transfer: a connector called at named hooks.

The scheduler has no notion of prefill or decode roles. A node's role is the connector it
is given: `NoKVConnector` on a plain node; the prefill and decode connectors of
`pdserve.disagg.connectors` on P/D nodes. Every hook runs in the engine process, on the
engine loop thread, synchronously inside `Scheduler`/`LLMEngine` calls, so it must not
block on I/O: a connector hands slow work (control messages, transfers) to its own thread
and reports the results through `on_step_finished`.

The life of a request whose prompt KV comes from elsewhere (a decode node's request):

    add_request ─▶ on_request_added        (connector may start side work, e.g. lease renewals)
    admission   ─▶ get_num_remote_tokens   (>0: blocks are allocated for them, and)
                ─▶ on_admitted             (the connector starts filling those blocks)
    each step   ─▶ on_step_finished        (reports loads that ended → the request runs)
    end         ─▶ on_request_finished     (True: keep the blocks, e.g. a read still lands)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.engine.request import Request
    from pdserve.engine.scheduler import SchedulerOutput


@dataclass(frozen=True)
class LoadResult:
    """A remote load ended (the destination blocks are no longer being written)."""

    request_id: str
    ok: bool
    """True: the promised tokens' KV is in the blocks. False: recompute them locally,
    unless `error` is set."""
    error: str | None = None
    """Set: the request fails with this message instead of recomputing."""


@dataclass(frozen=True)
class ConnectorEvents:
    loads_finished: tuple[LoadResult, ...] = ()
    releasable: tuple[str, ...] = ()
    """Finished requests whose held blocks may now be freed. Unknown ids are ignored."""


NO_EVENTS = ConnectorEvents()


class KVConnector:
    """Base class: every hook is a no-op, so a subclass overrides only what it needs."""

    def on_request_added(self, request: Request) -> None:
        """Called by `Scheduler.add_request` when a request enters the waiting queue.

        May start side activity about the request (e.g. a decode node renewing the lease
        of the handoff it will read), but must not touch blocks: none are allocated yet.
        """

    def get_num_remote_tokens(self, request: Request, num_local_tokens: int) -> int:
        """Called by `Scheduler.schedule` when it considers admitting `request`, whose first
        `num_local_tokens` have KV in the local prefix cache. Returns how many of the
        following tokens the connector will load from elsewhere (0: compute them).

        Side-effect free: it may be asked again if the request does not fit this step.
        """
        return 0

    def on_admitted(self, request: Request, block_ids: Sequence[int], num_remote: int) -> None:
        """Called once per admission (again after a preemption), with the request's blocks
        and the `get_num_remote_tokens` answer it was admitted with.

        With `num_remote > 0` the request now waits (WAITING_FOR_REMOTE_KV) until a
        `LoadResult` for it comes back from `on_step_finished`; the connector fills
        `block_ids` meanwhile. With 0, it runs normally; a connector that had planned a
        remote load for it gives that up now.
        """

    def on_request_finished(self, request: Request, block_ids: Sequence[int]) -> bool:
        """Called once when a request finishes, is aborted, or fails (any state).

        Returns True to keep its blocks pinned (a prefill node holding them for a remote
        decode; a decode node whose read into them has not ended): the scheduler then keeps
        them until `on_step_finished` names the request as releasable. Returns False to let
        the scheduler free them now.
        """
        return False

    def on_abort(self, request_ids: Sequence[str]) -> Sequence[str]:
        """Called by `LLMEngine.abort` with the internal ids of aborted user requests that
        had already finished. Returns the ids whose held blocks may be freed now (a
        prefill node releasing a handoff); blocks still being written stay held."""
        return ()

    def on_step_finished(self, output: SchedulerOutput) -> ConnectorEvents:
        """Called at the end of every engine step (and of every idle tick): loads that
        ended, and held requests that may be freed."""
        return NO_EVENTS

    def close(self) -> None:
        """Called once by `LLMEngine.close` when the engine stops: end threads and
        transfers (bounded), after the final aborts were handled."""


class NoKVConnector(KVConnector):
    """A single node: no transfers, nothing held."""
