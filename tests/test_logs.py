"""What `pdserve proxy` prints (`pdserve up` runs the same proxy): nothing while idle, one line
when a node goes down and one when it is back; every health check with --log-level debug."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdserve.launch import Node, kill, launch, wait_healthy
from tests.api.conftest import API_KEY, start_server, stop_server
from tests.disagg.conftest import Cluster, node_args
from tests.disagg.conftest import cluster as cluster  # the shared session fixture

pytestmark = pytest.mark.timeout(120)
HEALTH_INTERVAL_S = 0.2


def start_proxy(cluster: Cluster, decode_url: str, log: Path, *extra: str) -> Node:
    args = [
        "--api-key",
        API_KEY,
        "--health-interval-s",
        str(HEALTH_INTERVAL_S),
        "--prefill",
        cluster.prefill.url,
        "--decode",
        decode_url,
        *extra,
    ]
    with log.open("wb") as output:  # the child keeps its own descriptor
        proxy = launch(args, env={"PDSERVE_LOG_LEVEL": "INFO"}, command="proxy", output=output)
    return wait_healthy(proxy, timeout_s=60)


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.05)


def num_decode_up(proxy: Node) -> Any:
    return httpx.get(f"{proxy.url}/health", timeout=5).json()["num_decode_up"]


def test_an_idle_proxy_is_quiet_and_a_restarted_node_logs_one_down_and_one_up(
    cluster: Cluster, tmp_path: Path
) -> None:
    decode = start_server(*node_args(cluster.model, "--role", "decode"))
    log = tmp_path / "proxy.log"
    proxy = start_proxy(cluster, decode.url, log)
    try:
        time.sleep(10 * HEALTH_INTERVAL_S)  # ten rounds of health checks of two nodes
        idle = log.read_text().splitlines()
        assert len(idle) == 1 and "proxy on http://" in idle[0], idle  # the start, then nothing
        kill(decode)
        wait_until(lambda: num_decode_up(proxy) == 0, "the proxy sees the node down")
        decode = start_server(
            *node_args(cluster.model, "--role", "decode"), port=int(decode.url.rsplit(":", 1)[1])
        )
        wait_until(lambda: num_decode_up(proxy) == 1, "the proxy sees the node up again")
        time.sleep(5 * HEALTH_INTERVAL_S)
        lines = log.read_text().splitlines()[1:]
        assert [line.split(": ", 1)[1] for line in lines] == [
            f"decode node {decode.url} is down",
            f"decode node {decode.url} is up",
        ], lines
    finally:
        stop_server(proxy)
        stop_server(decode)


def test_log_level_debug_shows_every_health_check(cluster: Cluster, tmp_path: Path) -> None:
    log = tmp_path / "proxy.log"
    proxy = start_proxy(cluster, cluster.decode.url, log, "--log-level", "debug")
    try:
        wait_until(lambda: log.read_text().count("/health") >= 4, "health checks are logged", 10)
    finally:
        stop_server(proxy)


@pytest.mark.parametrize("level", ["warning", "info"])
def test_a_node_s_engine_process_logs_at_the_node_s_level(
    cluster: Cluster, tmp_path: Path, level: str
) -> None:
    """`--log-level` reaches the engine process too (it logged at INFO whatever was asked),
    and NIXL's own INFO lines (an agent made) show only when debugging."""
    log = tmp_path / "node.log"
    args = node_args(cluster.model, "--role", "decode", "--log-level", level)
    with log.open("wb") as output:
        node = launch(args, env={"PDSERVE_LOG_LEVEL": "DEBUG"}, output=output)
    try:
        wait_healthy(node, 120)
    finally:
        stop_server(node)
    text = log.read_text()
    assert ("INFO engine:" in text) == (level == "info"), text[-2000:]
    assert "NIXL INFO" not in text
