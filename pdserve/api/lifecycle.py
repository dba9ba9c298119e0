"""Start, drain and stop one node's server.

    listening (health 503) → engine ready (health 200) → SIGTERM/SIGINT:
    draining (health 503, new requests 503, in-flight ones continue) → all done, or
    `drain_timeout_s` passed and the requests left are aborted, each answered 503 (a
    started stream: an error event, then [DONE]) → uvicorn closes connections → engine
    process stopped → exit status 0.

P/D nodes (S22): a prefill node's drain also waits until every handoff was read or has
expired (new prefill legs get 503 meanwhile); a decode node first aborts the decode legs
that have not loaded their KV yet, which releases their handoffs on the prefill nodes, and
answers them 503 (the proxy releases its side too and passes the 503 on).

Whatever the drain aborts ends in `ServerShuttingDownError` for its caller, never in the
engine's aborted output: that would be a 200 with an empty or cut completion.

The HTTP listener comes up before the engine so that load balancers see a 503 while the
model loads instead of a refused connection.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
import time
from typing import Any

import uvicorn

from pdserve import logs
from pdserve.api.metrics import MetricsRecorder
from pdserve.api.pd_legs import node_legs
from pdserve.api.server import create_app
from pdserve.api.state import ServerState
from pdserve.config import ServerConfig
from pdserve.disagg.config import KVTransferConfig
from pdserve.engine.async_client import AsyncEngineClient
from pdserve.errors import ServerShuttingDownError
from pdserve.heap import freeze_startup_objects
from pdserve.parent_watch import ParentWatch
from pdserve.seams import NO_SEAMS, Seams
from pdserve.tls import warn_if_exposed

logger = logging.getLogger(__name__)

# After draining, uvicorn's own grace period only has to flush what is left.
_FINAL_GRACE_S = 1


class _DrainingServer(uvicorn.Server):
    """uvicorn stops listening at once on SIGTERM and re-raises the signal afterwards (the
    process would die 'killed by SIGTERM'). Here the first signal starts a drain that keeps
    answering (503 to new work) and exits cleanly; a second SIGINT forces the exit."""

    def __init__(self, config: uvicorn.Config, state: ServerState, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.state = state
        self.drain_timeout_s = drain_timeout_s
        self._loop = asyncio.get_running_loop()

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.state.draining:
            if sig == signal.SIGINT:
                self.force_exit = True
            return
        self.state.draining = True
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))

    async def _drain(self) -> None:
        state = self.state
        deadline = time.monotonic() + self.drain_timeout_s
        logger.info("draining %d in-flight requests", state.num_inflight)
        unloaded = state.legs.unloaded_decode_legs
        if unloaded:
            logger.info("releasing %d handoffs not read yet", len(unloaded))
            error = ServerShuttingDownError(
                "the server is shutting down: this decode leg had not loaded its KV yet"
            )
            await state.client.abort(sorted(unloaded), error)
        while self._busy() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        running = state.live.request_ids()
        if running:
            # Answered by their handlers within uvicorn's grace period (`_FINAL_GRACE_S`).
            logger.warning("drain timeout: aborting %d requests", len(running))
            error = ServerShuttingDownError(
                f"the server is shutting down: the request was still running after the "
                f"{self.drain_timeout_s:g} s drain"
            )
            await state.client.abort(sorted(running), error)
        self.should_exit = True

    def _busy(self) -> bool:
        return self.state.num_inflight > 0 or self.state.legs.num_live_handoffs > 0


async def run_server(
    client: AsyncEngineClient,
    config: ServerConfig,
    kv_transfer: KVTransferConfig | None = None,
    seams: Seams = NO_SEAMS,
) -> None:
    """Serve until SIGINT/SIGTERM (or, with `config.parent_pid`, until that process is
    gone), drain, stop the engine process. `kv_transfer`: the node's P/D settings (its
    role); the engine's connector was chosen with them (`client.connector_factory`)."""
    kv_transfer = kv_transfer or KVTransferConfig()
    model_name = config.served_model_name or client.config.model.model
    metrics = MetricsRecorder(model_name)
    cluster_secret = kv_transfer.cluster_secret or config.api_key
    legs = node_legs(kv_transfer, client, metrics, config.host, config.port, cluster_secret)
    state = ServerState(
        client, legs, metrics, model_name, config.api_key, seams, config.response_store
    )
    warn_if_exposed(config.host, config.tls, "the node")
    server = _DrainingServer(_uvicorn_config(state, config), state, config.drain_timeout_s)
    serving = asyncio.create_task(server.serve())
    sweeper = watcher = None
    if config.parent_pid is not None:
        stop = functools.partial(server.handle_exit, signal.SIGTERM, None)
        watcher = asyncio.create_task(ParentWatch(config.parent_pid).stop_when_gone(stop, "node"))
    try:
        await client.start()
        freeze_startup_objects()
        if legs.handoffs is not None:
            sweeper = asyncio.create_task(legs.handoffs.run_sweeper())
        state.ready = True
        logger.info(
            "serving %s on %s://%s:%d", model_name, config.tls.scheme, config.host, config.port
        )
        await serving
    finally:
        state.draining = True
        server.should_exit = True
        await serving
        for task in (sweeper, watcher):
            if task is not None:
                task.cancel()
        for close in state.closers:
            await close()
        await client.shutdown()


def _uvicorn_config(state: ServerState, config: ServerConfig) -> uvicorn.Config:
    return uvicorn.Config(
        create_app(state),
        host=config.host,
        port=config.port,
        log_level=logs.uvicorn_level(),
        lifespan="off",
        timeout_graceful_shutdown=_FINAL_GRACE_S,
        **config.tls.uvicorn_options(),
    )
