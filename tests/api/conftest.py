"""A real `pdserve serve` process on loopback, shared by the API tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import httpx
import pytest

from pdserve.launch import Node, launch, stop, stop_all, wait_healthy
from pdserve.launch import free_port as free_port  # re-exported for the tests

API_KEY = "test-key"


Server = Node
ENV = {"HF_HUB_OFFLINE": "1", "PDSERVE_LOG_LEVEL": "WARNING"}


def launch_server(
    *extra: str, env: dict[str, str] | None = None, port: int | None = None
) -> Server:
    """Start `pdserve serve` without waiting for it (see `wait_healthy`)."""
    return launch(list(extra), env={**ENV, **(env or {})}, port=port)


def start_server(
    *extra: str,
    on_health: Callable[[int], None] | None = None,
    env: dict[str, str] | None = None,
    port: int | None = None,
) -> Server:
    return wait_healthy(launch_server(*extra, env=env, port=port), 180, on_health)


def start_servers(*arg_lists: list[str], env: dict[str, str] | None = None) -> list[Server]:
    """Several servers started side by side (each start is mostly imports and loading)."""
    servers = [launch_server(*args, env=env) for args in arg_lists]
    try:
        return [wait_healthy(s, 180) for s in servers]
    except BaseException:
        stop_all(servers)
        raise


def stop_server(server: Server, timeout_s: float = 60) -> int:
    return stop(server, timeout_s)


def kv_counters(server: Server) -> dict[str, int]:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    return httpx.get(f"{server.url}/admin/kv", headers=headers, timeout=5).json()  # type: ignore[no-any-return]


@pytest.fixture(scope="session")
def server() -> Iterator[Server]:
    """SmolLM2 in fp32 (to match the offline fixture), with an API key."""
    s = start_server(
        "--dtype",
        "float32",
        "--num-kv-blocks",
        "512",
        "--max-model-len",
        "2048",
        "--api-key",
        API_KEY,
    )
    try:
        yield s
    finally:
        assert stop_server(s) == 0
