"""Real P/D nodes on loopback: prefill, decode and a single reference node, NIXL between
them. Helpers drive the two legs over HTTP, as a proxy would."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdserve.launch import stop_all
from tests.api.conftest import API_KEY, Server, start_servers

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
BLOCK_SIZE = 16
NUM_BLOCKS = 96
RELEASE_BOUND_S = 0.05
"""DESIGN §3: held blocks are back within 50 ms of a cancel."""
POLL_SLACK_S = 0.05
"""What the observation itself may add on a shared 2-core machine: each /admin/kv poll
is an HTTP round trip to a process competing for the same cores."""


def node_args(model: Path | str, *extra: str) -> list[str]:
    return [
        "--model",
        str(model),
        "--dtype",
        "float32",
        "--num-kv-blocks",
        str(NUM_BLOCKS),
        "--block-size",
        str(BLOCK_SIZE),
        "--max-model-len",
        "512",
        "--api-key",
        API_KEY,
        *extra,
    ]


def make_prompt(length: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed * 7919 + length)
    return [rng.randrange(3, 300) for _ in range(length)]


_HTTP = httpx.Client(headers=HEADERS)
"""Pooled: a fresh httpx client per call costs ~30 ms here (TLS context), which would swamp
the release times the tests bound."""


def post(server: Server, path: str, body: dict[str, Any], timeout: float = 60) -> httpx.Response:
    return _HTTP.post(f"{server.url}{path}", json=body, timeout=timeout)


def completion(prompt: list[int] | str, max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    return {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "return_token_ids": True,
        **extra,
    }


def prefill_leg(server: Server, body: dict[str, Any]) -> dict[str, Any]:
    response = post(
        server, "/v1/completions", {**body, "kv_transfer_params": {"do_remote_decode": True}}
    )
    assert response.status_code == 200, response.text
    data: dict[str, Any] = response.json()
    assert data["kv_transfer_params"]["do_remote_prefill"] is True
    return data


def decode_leg(server: Server, body: dict[str, Any], kv: dict[str, Any]) -> httpx.Response:
    return post(server, "/v1/completions", {**body, "kv_transfer_params": kv})


def token_ids(data: dict[str, Any]) -> list[int]:
    return list(data["choices"][0]["token_ids"])


def kv_state(server: Server) -> dict[str, Any]:
    data: dict[str, Any] = _HTTP.get(f"{server.url}/admin/kv", timeout=5).json()
    return data


def is_idle(state: dict[str, Any]) -> bool:
    return bool(
        state["num_free_blocks"] == state["num_blocks"]
        and state["num_handoffs"] == 0
        and state["num_running"] == state["num_waiting"] == state["num_loading"] == 0
    )


def wait_idle(server: Server, within_s: float) -> float:
    """Seconds until the node holds nothing (asserted to be within `within_s`)."""
    start = time.monotonic()
    while True:
        state = kv_state(server)
        elapsed = time.monotonic() - start
        if is_idle(state):
            return elapsed
        assert elapsed < within_s, f"{server.url} still holds KV after {elapsed:.3f} s: {state}"
        time.sleep(0.005)


def metric(server: Server, name: str) -> float:
    text = _HTTP.get(f"{server.url}/metrics", timeout=5).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            key = line.split(" ")[0]
            if key == name or key.startswith(name + "{"):
                total += float(line.rsplit(" ", 1)[1])
    return total


@dataclass
class Cluster:
    prefill: Server
    decode: Server
    single: Server
    model: Path


@pytest.fixture(scope="session")
def cluster(tiny_model_dir: Any) -> Iterator[Cluster]:
    """One prefill, one decode and one single node on the tiny model (lease 2 s)."""
    model = tiny_model_dir("llama")
    servers = start_servers(
        node_args(model, "--role", "prefill", "--lease-s", "2", "--claim-timeout-s", "3"),
        node_args(model, "--role", "decode"),
        node_args(model),
    )
    try:
        yield Cluster(*servers, model=model)  # type: ignore[misc]
    finally:
        stop_all(servers)  # side by side: each drains
