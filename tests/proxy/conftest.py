"""A real `pdserve proxy` process in front of the P/D test cluster, and a stub node whose
answers a test sets (for upstream errors and hung or broken nodes)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tests.api.conftest import API_KEY, Server, free_port, stop_server
from tests.disagg.conftest import cluster  # noqa: F401  (the shared session fixture)


def start_proxy(prefill: list[str], decode: list[str], *extra: str) -> Server:
    port = free_port()
    cmd = [sys.executable, "-m", "pdserve.cli", "proxy", "--port", str(port),
           "--api-key", API_KEY, "--health-interval-s", "0.2"]  # fmt: skip
    for url in prefill:
        cmd += ["--prefill", url]
    for url in decode:
        cmd += ["--decode", url]
    env = {**os.environ, "PDSERVE_LOG_LEVEL": "WARNING"}
    server = Server(f"http://127.0.0.1:{port}", subprocess.Popen([*cmd, *extra], env=env))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert server.process.poll() is None, "the proxy exited"
        try:
            if httpx.get(f"{server.url}/health", timeout=1).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    stop_server(server)
    raise RuntimeError("the proxy did not become healthy")


@pytest.fixture
def proxy_for() -> Iterator[Any]:
    """Start proxies for a test (stopped afterwards): `proxy_for(prefill_urls, decode_urls)`."""
    started: list[Server] = []

    def start(prefill: list[str], decode: list[str], *extra: str) -> Server:
        started.append(start_proxy(prefill, decode, *extra))
        return started[-1]

    yield start
    for server in started:
        stop_server(server)


@dataclass
class Stub:
    """A node that answers every completion with `status` and `body` (after `delay_s`), and
    /health with 200. `calls` records the bodies it received."""

    url: str = ""
    status: int = 200
    body: dict[str, Any] = field(default_factory=dict)
    delay_s: float = 0.0
    calls: list[dict[str, Any]] = field(default_factory=list)


@pytest.fixture
def stub() -> Iterator[Stub]:
    state = Stub()

    async def completion(request: Request) -> Response:
        state.calls.append(await request.json())
        if state.delay_s:
            await asyncio.sleep(state.delay_s)
        return JSONResponse(state.body, status_code=state.status)

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    app = Starlette(routes=[
        Route("/v1/completions", completion, methods=["POST"]),
        Route("/v1/chat/completions", completion, methods=["POST"]),
        Route("/health", health), Route("/v1/abort_requests", health, methods=["POST"]),
    ])  # fmt: skip
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    state.url = f"http://127.0.0.1:{port}"
    yield state
    server.should_exit = True
    thread.join(timeout=5)
