"""One client request as the proxy's legs share it (`legs.py`): the body, the routed prompt,
the handoff its prefill leg made (`Held`, with the answer's `kv_transfer_params` as they
came and as the proxy reads them), and the release of a handoff on a prefill node."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx
from pydantic import ConfigDict

from pdserve.disagg.params import KVTransferParams
from pdserve.proxy.client import Client
from pdserve.proxy.pool import Backend
from pdserve.proxy.routing import Prompt

if TYPE_CHECKING:
    from pdserve.proxy.state import ProxyState

logger = logging.getLogger(__name__)


class HandoffParams(KVTransferParams):
    """A prefill answer's `kv_transfer_params`, as the proxy reads them: vLLM's fields and
    pdserve's, and the handoff id and control URL of pdserve's vLLM connector. The decode
    leg gets the answer's own dict, whatever else it holds."""

    model_config = ConfigDict(extra="allow")

    remote_block_ids: Any = None
    """Not read here, so not checked here: vLLM sends one list per KV cache group, a pdserve
    node one list; the decode node checks them for its own kind."""
    handoff_id: str | None = None
    control_url: str | None = None

    @property
    def id(self) -> str | None:
        """A pdserve node's handoff id is `remote_request_id`; the vLLM connector names its
        own (`handoff_id`)."""
        return self.handoff_id or self.remote_request_id


@dataclass
class Held:
    """The handoff a decode leg reads, let go if the leg will not (none: a request that
    runs whole on one node)."""

    prefill: Backend | None = None
    raw: dict[str, Any] | None = None
    """The prefill answer's kv_transfer_params, passed on as they came."""
    params: HandoffParams | None = None


@dataclass
class ProxyRequest:
    """One client request and what its legs share."""

    state: ProxyState
    client: Client
    path: str
    body: dict[str, Any]
    prompt: Prompt | None
    held: Held = field(default_factory=Held)
    prefill_usage: dict[str, Any] = field(default_factory=dict)

    async def release_held(self) -> None:
        """Let go of the held handoff, named by the prefill answer's params."""
        held = self.held
        if held.prefill is not None and held.params is not None and held.params.id:
            await release(self.state, held.prefill, held.params.id, held.params.release_token)

    async def release_attempt(self, backend: Backend, token: str) -> None:
        """Let go of what a prefill attempt may hold, by the request's X-Request-Id and the
        attempt's token: its answer, and the handoff id, may never have arrived."""
        await release(self.state, backend, self.client.request_id, token)


async def release(state: ProxyState, backend: Backend, request_id: str, token: str | None) -> None:
    """Release what `request_id` names on a prefill node (a handoff id, or a leg's
    X-Request-Id): by its release token, else with the node key (a node that mints no
    tokens). Refused when the node does not know it (the leg never arrived, or has ended),
    which is fine: nothing of it is held. A vLLM node takes it at its connector's endpoint
    (`Backend.control_url`); a stock vLLM node has none, and its own lease frees it."""
    body: dict[str, Any] = {"request_ids": [request_id]}
    if token:
        body["release_token"] = token
    state.metrics.releases.inc()
    url = backend.control_url or backend.url
    try:
        await state.http.post(
            f"{url}/v1/abort_requests", json=body, headers=state.node_headers, timeout=2.0
        )
    except httpx.HTTPError as e:  # its lease frees it
        logger.warning("release of %s on %s failed: %s", request_id, url, e)
