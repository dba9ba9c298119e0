"""What a node's HTTP side shares between its routes: the engine client, the node's P/D
legs, metrics, the requests in flight, readiness and draining. Its own module so the route
modules (`server`, `batched`, `disagg_routes`, `edge`) all name it without importing each
other."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from pdserve.api.live import LiveRequests
from pdserve.api.metrics import MetricsRecorder
from pdserve.api.pd_legs import NodeLegs
from pdserve.api.tokenize import Tokenization
from pdserve.engine.async_client import AsyncEngineClient
from pdserve.seams import NO_SEAMS, Seams


class ServerState:
    def __init__(
        self,
        client: AsyncEngineClient,
        legs: NodeLegs,
        metrics: MetricsRecorder,
        model_name: str,
        api_key: str | None = None,
        seams: Seams = NO_SEAMS,
        response_store: str | None = None,
    ) -> None:
        self.client = client
        self.legs = legs
        """The node's side of P/D legs (its role; a prefill node's handoffs)."""
        self.metrics = metrics
        self.model_name = model_name
        self.api_key = api_key
        self.cluster_secret = legs.cluster_secret or api_key
        """Credential for node-to-node calls, both ways (`/kv/*`, releases)."""
        self.seams = seams
        self.response_store = response_store
        self.closers: list[Callable[[], Awaitable[None]]] = []
        """Run once the server stopped serving, before the engine stops (the agent APIs'
        background responses end as cancelled, their store closes)."""
        self.live = LiveRequests()
        self.ready = False
        self.draining = False
        self.num_inflight = 0
        """HTTP requests whose handling (streams included) has not ended."""
        self.started_s = time.time()
        self.tokenization = Tokenization(client.config.model.model, model_name)
        client.on_connector_stats = metrics.record_connector_stats
