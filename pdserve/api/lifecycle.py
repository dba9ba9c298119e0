"""Start, drain and stop one node's server.

    listening (health 503) → engine ready (health 200) → SIGTERM/SIGINT:
    draining (health 503, new requests 503, in-flight ones continue) → all done or
    `drain_timeout_s` passed → uvicorn closes connections (unfinished requests are cancelled,
    which aborts them in the engine) → engine process stopped → exit status 0.

The HTTP listener comes up before the engine so that load balancers see a 503 while the
model loads instead of a refused connection.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from typing import Any

import uvicorn

from pdserve.api.server import ServerState, create_app
from pdserve.engine.async_client import AsyncEngineClient

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
        deadline = time.monotonic() + self.drain_timeout_s
        logger.info("draining %d in-flight requests", self.state.num_inflight)
        while self.state.num_inflight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if self.state.num_inflight:
            logger.warning("drain timeout: aborting %d requests", self.state.num_inflight)
        self.should_exit = True


async def run_server(
    client: AsyncEngineClient,
    host: str,
    port: int,
    api_key: str | None,
    model_name: str,
    drain_timeout_s: float,
) -> None:
    """Serve until SIGINT/SIGTERM, drain, stop the engine process."""
    state = ServerState(client, api_key, model_name)
    config = uvicorn.Config(
        create_app(state), host=host, port=port, log_level="warning", lifespan="off",
        timeout_graceful_shutdown=_FINAL_GRACE_S,
    )  # fmt: skip
    server = _DrainingServer(config, state, drain_timeout_s)
    serving = asyncio.create_task(server.serve())
    try:
        await client.start()
        state.ready = True
        logger.info("serving %s on http://%s:%d", model_name, host, port)
        await serving
    finally:
        state.draining = True
        server.should_exit = True
        await serving
        await client.shutdown()
