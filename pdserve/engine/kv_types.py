"""What crosses the KV connector's boundary, as values (`kv_connector.py` holds the hooks):
what a request asks of the connector, what a connector publishes for its peers and counts,
and what it reports when a load ends. Requests carry them, so they live apart from the
connector contract, which names the request type."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.outputs import TokenLogprob


@dataclass(frozen=True)
class KVTransferSpec:
    """Base of what a request asks of the KV connector (`Request.kv_transfer`): hold the
    prompt's KV for another node, or load it from one. The scheduler never looks inside;
    a connector acts on its own subclasses (`pdserve.disagg.params`) and ignores others."""


@dataclass(frozen=True)
class KVHandshakeInfo:
    """Base of what a connector publishes for its peers (`KVConnector.handshake_info`):
    the engine process sends it to the API process once, in `Ready`."""


@dataclass(frozen=True)
class KVConnectorStats:
    """What a connector counted since it was last asked (`KVConnector.take_stats`)."""

    transfers: tuple[tuple[int, float], ...] = ()
    """KV reads completed: (bytes, seconds) each."""
    claims_s: tuple[float, ...] = ()
    """Claims answered OK: the round trip to the prefill node, seconds each."""

    @property
    def is_empty(self) -> bool:
        return not self.transfers and not self.claims_s


@dataclass(frozen=True)
class RemoteToken:
    """A token another node sampled right after the tokens whose KV was loaded: a prefill
    node's first output token, sampled from the logits of the very prefill that computed
    the KV. The request continues from it instead of recomputing its last prompt position
    in another kernel shape (which rounds differently in bf16 and can flip a near-tie)."""

    token_id: int
    logprob: TokenLogprob | None = None
    """Its logprob entry, for a request that asked for logprobs."""


@dataclass(frozen=True)
class LoadResult:
    """A remote load ended (the destination blocks are no longer being written)."""

    request_id: str
    ok: bool
    """True: the promised tokens' KV is in the blocks. False: recompute them locally,
    unless `error` is set."""
    error: str | None = None
    """Set: the request fails with this message instead of recomputing."""
    next_token: RemoteToken | None = None
    """With `ok`: the KV of every known token was loaded and this is the next token, as if
    the request had sampled it here (the scheduler appends it; no step computes it)."""


@dataclass(frozen=True)
class ConnectorEvents:
    loads_finished: tuple[LoadResult, ...] = ()
    releasable: tuple[str, ...] = ()
    """Finished requests whose held blocks may now be freed. Unknown ids are ignored."""


NO_EVENTS = ConnectorEvents()
NO_STATS = KVConnectorStats()
