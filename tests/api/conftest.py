"""A real `pdserve serve` process on loopback, shared by the API tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import httpx
import pytest

API_KEY = "test-key"


@dataclass
class Server:
    url: str
    process: subprocess.Popen[bytes]

    def kv(self) -> dict[str, int]:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        return httpx.get(f"{self.url}/admin/kv", headers=headers, timeout=5).json()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch_server(
    *extra: str, env: dict[str, str] | None = None, port: int | None = None
) -> Server:
    """Start `pdserve serve` without waiting for it (see `wait_healthy`)."""
    port = port or free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PDSERVE_LOG_LEVEL": "WARNING", **(env or {})}
    cmd = [sys.executable, "-m", "pdserve.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
    return Server(f"http://127.0.0.1:{port}", subprocess.Popen([*cmd, *extra], env=env))


def wait_healthy(server: Server, on_health: Callable[[int], None] | None = None) -> Server:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"server exited with {server.process.returncode}")
        try:
            status = httpx.get(f"{server.url}/health", timeout=1).status_code
        except httpx.HTTPError:
            status = 0
        if status and on_health is not None:
            on_health(status)
        if status == 200:
            return server
        time.sleep(0.05)
    server.process.kill()
    raise RuntimeError("server did not become healthy")


def start_server(
    *extra: str,
    on_health: Callable[[int], None] | None = None,
    env: dict[str, str] | None = None,
    port: int | None = None,
) -> Server:
    return wait_healthy(launch_server(*extra, env=env, port=port), on_health)


def start_servers(*arg_lists: list[str], env: dict[str, str] | None = None) -> list[Server]:
    """Several servers started side by side (each start is mostly imports and loading)."""
    servers = [launch_server(*args, env=env) for args in arg_lists]
    try:
        return [wait_healthy(s) for s in servers]
    except BaseException:
        for s in servers:
            stop_server(s)
        raise


def stop_server(server: Server, timeout_s: float = 60) -> int:
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGTERM)
        try:
            server.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait()
    return server.process.returncode


@pytest.fixture(scope="session")
def server() -> Iterator[Server]:
    """SmolLM2 in fp32 (to match the offline fixture), with an API key."""
    s = start_server(
        "--dtype", "float32", "--num-kv-blocks", "512", "--max-model-len", "2048",
        "--api-key", API_KEY,
    )  # fmt: skip
    try:
        yield s
    finally:
        assert stop_server(s) == 0
