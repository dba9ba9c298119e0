"""API process: a node's side of the P/D legs, by role (the server itself has none).

Every node takes a completion body's `kv_transfer_params` through `NodeLegs.parse`: a leg
the node's role does not serve is a 400, a neutral object is no leg at all.

- Prefill node: a prefill leg (`RemoteDecode`) runs for exactly one token; its answer
  carries the handoff that now pins the prompt's KV (`serve_prefill_leg`). The node's
  `HandoffService` owns the handoff from the leg's admission on.
- Decode node: a decode leg (`RemotePrefill`) takes the server's ordinary path. Until its
  first output it is *unloaded* (a drain aborts it, which releases its handoff); rejected
  before the engine admitted it, it releases its handoff on the prefill node at once (S4).
  After admission the engine's `DecodeConnector` owns the handoff.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections import Counter
from collections.abc import AsyncGenerator
from dataclasses import replace
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pdserve.api.metrics import MetricsRecorder
from pdserve.disagg.config import KVTransferConfig, Role
from pdserve.disagg.control import ControlClient, ControlError
from pdserve.disagg.handoff_service import HandoffService, ReleaseObserver
from pdserve.disagg.messages import ReleaseReason
from pdserve.disagg.params import (
    KVTransferParams,
    RemoteDecode,
    RemotePrefill,
    remote_decode_from,
    remote_prefill_from,
)
from pdserve.engine.async_client import AsyncEngineClient
from pdserve.engine.kv_types import KVTransferSpec
from pdserve.errors import InvalidRequestError, KVTransferError, PdserveError, RequestAbortedError
from pdserve.openai_api.caller import request_span, unless_gone_closing
from pdserve.openai_api.errors import from_exception, validate_body
from pdserve.openai_api.responses import ChoiceBuilder
from pdserve.outputs import RequestOutput
from pdserve.tls import TLSConfig

logger = logging.getLogger(__name__)


class NodeLegs:
    def __init__(
        self,
        role: Role,
        client: AsyncEngineClient,
        metrics: MetricsRecorder,
        cluster_secret: str | None = None,
        handoffs: HandoffService | None = None,
        tls: TLSConfig | None = None,
    ) -> None:
        self.role = role
        self.tls = tls or TLSConfig()
        """The node's TLS: its scheme is also the one for prefill nodes' `/kv/*`."""
        self.client = client
        self.metrics = metrics
        self.cluster_secret = cluster_secret
        """Credential for node-to-node calls (`/kv/*`, releases)."""
        self.handoffs = handoffs
        """Prefill nodes: the handoff table and its service."""
        self.unloaded_decode_legs: set[str] = set()
        """Decode legs without a first output yet: a decode node's drain aborts them."""
        self._control: ControlClient | None = None

    # -- every leg ---------------------------------------------------------------------

    def parse(self, data: dict[str, Any]) -> KVTransferSpec | None:
        """The P/D leg this body asks for, checked against the node's role (400 otherwise)."""
        raw = data.get("kv_transfer_params")
        if raw is None:
            return None
        if not isinstance(raw, dict):
            raise InvalidRequestError(
                "kv_transfer_params must be an object", param="kv_transfer_params"
            )
        params = validate_body(raw, KVTransferParams)
        if not params.do_remote_decode and not params.do_remote_prefill:
            return None  # a neutral object, as some vLLM proxies send
        if params.do_remote_decode and params.do_remote_prefill:
            raise InvalidRequestError(
                "kv_transfer_params: do_remote_decode and do_remote_prefill are exclusive",
                param="kv_transfer_params",
            )
        wanted = Role.PREFILL if params.do_remote_decode else Role.DECODE
        if self.role is not wanted:
            raise InvalidRequestError(
                f"this is a {self.role.value!r} node: a {wanted} leg needs a node started "
                f"with --role {wanted}",
                param="kv_transfer_params",
            )
        if params.do_remote_decode:
            return remote_decode_from(params)
        return remote_prefill_from(params, self.tls.scheme)

    async def refused(self, kv: KVTransferSpec | None, error: PdserveError) -> None:
        """A leg failed before or in the engine with `error`. A decode leg the engine never
        admitted gives its handoff back at once (S4); once admitted (it was then aborted,
        or its load failed) the engine's connector has released it."""
        admitted = isinstance(error, RequestAbortedError | KVTransferError)
        if isinstance(kv, RemotePrefill) and not admitted:
            await self._release_rejected(kv)

    # -- decode legs -------------------------------------------------------------------

    def loading(self, request_id: str, kv: KVTransferSpec | None) -> None:
        """A decode leg goes to the engine: unloaded until its first output."""
        if isinstance(kv, RemotePrefill):
            self.unloaded_decode_legs.add(request_id)

    def loaded(self, request_id: str) -> None:
        """The leg produced its first output (or ended): its KV is no longer pending."""
        self.unloaded_decode_legs.discard(request_id)

    async def _release_rejected(self, remote: RemotePrefill) -> None:
        if self._control is None:  # one pooled client: a new one costs ~30 ms (TLS setup)
            self._control = ControlClient(self.cluster_secret, self.tls)
        try:
            await asyncio.to_thread(
                self._control.release, remote.control_url, remote.ref, ReleaseReason.REJECTED
            )
        except ControlError as e:
            logger.warning(
                "could not release handoff %s: %s (its lease frees it)",
                remote.ref.handoff_id,
                e,
            )

    # -- prefill legs ------------------------------------------------------------------

    async def serve_prefill_leg(
        self,
        request: Request,
        inputs: dict[str, Any],
        builder: ChoiceBuilder,
        kv: RemoteDecode,
        client_request_id: str,
    ) -> Response:
        """One token, then the prompt's KV stays pinned under a new handoff whose params
        the answer carries, with that token: the decode node continues from it. So it is
        sampled exactly as one node would sample the request's first token (`min_tokens`
        still masks EOS and the stop token ids), but nothing ends the leg before it holds
        its KV: EOS and stop strings are ignored (S18)."""
        service = self.handoffs
        if service is None:  # unreachable: `parse` takes prefill legs on prefill nodes only
            raise InvalidRequestError("not a prefill node", param="kv_transfer_params")
        params = builder.params
        builder.params = replace(
            params, max_tokens=1, min_tokens=min(params.min_tokens, 1), ignore_eos=True, stop=()
        )
        handoff = service.begin(builder.request_id, client_request_id, kv.release_token)
        outputs = self.metrics.track(
            self.client.generate(builder.request_id, builder.params, **inputs, kv_transfer=kv),
            request_span(request, builder.request_id),
        )
        try:
            final = await unless_gone_closing(request, last_output(outputs), outputs)
        except PdserveError as e:
            await service.cancel(handoff)
            self.metrics.request_failed(f"http_{e.http_status}")
            return from_exception(e)
        if final is None or await request.is_disconnected():
            # Client gone before its answer (S1/S2): nothing stays held. If it leaves after
            # this check, while the answer is in flight, it can release by its own token
            # (the proxy does), else the lease frees the handoff.
            await service.cancel(handoff)
            return Response(status_code=499)
        answer = builder.full_response(final)
        if await service.commit(handoff, final):
            answer["kv_transfer_params"] = service.transfer_params(handoff, final).model_dump()
        return JSONResponse(answer)

    # -- the node's state ----------------------------------------------------------------

    @property
    def num_live_handoffs(self) -> int:
        """Handoffs not yet released (a prefill node's drain waits for none to be left)."""
        return self.handoffs.table.num_live if self.handoffs is not None else 0

    def handoff_states(self) -> dict[str, int] | None:
        """Live handoffs by state (prefill nodes), for the metrics."""
        if self.handoffs is None:
            return None
        return dict(Counter(h.state.value for h in self.handoffs.table.live()))

    def admin_view(self) -> dict[str, Any]:
        """The P/D part of `GET /admin/kv`."""
        service = self.handoffs
        handoffs = service.snapshot() if service else []
        return {
            "num_handoffs": len(handoffs),
            "handoffs": handoffs,
            "handoff_counters": dict(service.table.counters) if service else {},
        }


def node_legs(
    config: KVTransferConfig,
    client: AsyncEngineClient,
    metrics: MetricsRecorder,
    host: str,
    port: int,
    cluster_secret: str | None,
) -> NodeLegs:
    """The legs of a node with `config.role`; a prefill node's come with its handoff service
    (at `config.advertise_host` or `host`, `port`: where decode nodes reach it)."""
    handoffs = None
    if config.role is Role.PREFILL:
        observer = ReleaseObserver(
            lambda reason: metrics.handoffs_released.labels(reason).inc(),
            lambda reason, seconds: metrics.release_seconds.labels(reason).observe(seconds),
        )
        handoffs = HandoffService(
            client,
            config.advertise_host or advertised_host(host),
            port,
            config.lease_s,
            config.claim_timeout_s,
            observer,
        )
    return NodeLegs(config.role, client, metrics, cluster_secret, handoffs, config.tls)


def advertised_host(host: str) -> str:
    """The address peers use to reach this node (`remote_host` in kv_transfer_params)."""
    if host in ("0.0.0.0", "::", ""):
        return socket.gethostbyname(socket.gethostname())
    return host


async def last_output(outputs: AsyncGenerator[RequestOutput, None]) -> RequestOutput:
    """The engine's outputs of a request, waited through to the finished one."""
    last = await outputs.__anext__()
    while not last.finished:
        last = await outputs.__anext__()
    return last
