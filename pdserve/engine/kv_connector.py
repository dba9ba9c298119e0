"""The scheduler's only window onto KV transfer: a connector called at named hooks.

The engine has no notion of prefill or decode roles. A node's role is the connector it
is given: the launcher passes a `KVConnectorFactory` (P/D nodes: the one of
`pdserve.disagg.connectors`), which the engine calls once its KV pool exists; without one
the engine uses `NoKVConnector`. Every hook runs in the engine process, on the engine
loop thread, synchronously inside `Scheduler`/`LLMEngine` calls, so it must not block on
I/O: a connector hands slow work (control messages, transfers) to its own thread and
reports the results through `on_step_finished`.

The life of a request whose prompt KV comes from elsewhere (a decode node's request):

    add_request ─▶ on_request_added        (connector may start side work, e.g. lease renewals)
    admission   ─▶ get_num_remote_tokens   (>0: blocks are allocated for them, and)
                ─▶ on_admitted             (the connector starts filling those blocks)
    each step   ─▶ on_step_finished        (reports loads that ended → the request runs,
                                             from the remote node's next token if it sent one)
    end         ─▶ on_request_finished     (True: keep the blocks, e.g. a read still lands)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from pdserve.engine.kv_types import (
    NO_EVENTS,
    NO_STATS,
    ConnectorEvents,
    KVConnectorStats,
    KVHandshakeInfo,
)

if TYPE_CHECKING:
    import torch

    from pdserve.batch import SchedulerOutput
    from pdserve.engine.request import Request
    from pdserve.model.loader import LoadedModel


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

    def on_free_held(self, request_ids: Sequence[str]) -> Sequence[str]:
        """Called by `LLMEngine.free_held` with the internal ids of held requests whose
        owner is done with their blocks (a prefill node's handoff ended). Returns the ids
        whose blocks may be freed now; blocks a transfer may still write stay held.
        Side-effect free."""
        return ()

    def on_step_finished(self, output: SchedulerOutput) -> ConnectorEvents:
        """Called at the end of every engine step (and of every idle tick): loads that
        ended, and held requests that may be freed."""
        return NO_EVENTS

    def handshake_info(self) -> KVHandshakeInfo | None:
        """Called once by the engine process, after the engine is built, for its `Ready`
        message: what peers need to reach this node's KV (layout, transport address).
        None: nothing to publish. Side-effect free."""
        return None

    def take_stats(self) -> KVConnectorStats:
        """Called by the engine process after every loop iteration (engine thread): what
        happened since the last call, for the metrics. Resets the counts."""
        return NO_STATS

    def close(self) -> None:
        """Called once by `LLMEngine.close` when the engine stops: end threads and
        transfers (bounded), after the final aborts were handled."""


class NoKVConnector(KVConnector):
    """A single node: no transfers, nothing held."""


class KVConnectorFactory(Protocol):
    """Builds a node's connector in the engine process, once its KV pool exists. Passed by
    the launcher through the engine process's spawn, so an implementation must pickle."""

    def __call__(
        self, loaded: LoadedModel, kv_cache: torch.Tensor, block_size: int
    ) -> KVConnector: ...
