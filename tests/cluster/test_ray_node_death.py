"""A whole Ray node dies under `pdserve ray up` (`ray.cluster_utils.Cluster`: raylets on
this machine, tiny model): the decode node on it is gone, the prefill node ends idle
within the lease, Ray restarts the decode actor on a node that has room, it rejoins the
proxy's pools, and the cluster serves again."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from pdserve.launch import health_status
from tests.cluster.test_ray import (
    HEADERS,
    LEASE_S,
    RayCluster,
    local_ray,
    node_idle,
    wait_until,
)
from tests.disagg.conftest import completion, make_prompt

pytestmark = [pytest.mark.timeout(600), pytest.mark.system]


@pytest.fixture(scope="module")
def three_raylets(tiny_model_dir: Any) -> Iterator[tuple[Any, RayCluster]]:
    """A head without CPUs (the driver and its controller) and two workers of 1 CPU: the
    prefill node on one, the decode node on the other."""
    with local_ray(tiny_model_dir("llama"), head_cpus=0, workers=2) as cluster_and_ray_up:
        yield cluster_and_ray_up


def test_a_dead_ray_node_s_decode_node_is_restarted_elsewhere_and_rejoins(
    three_raylets: tuple[Any, RayCluster],
) -> None:
    cluster, ray_up = three_raylets
    rows = {r["role"]: r for r in ray_up.nodes()}
    assert rows["decode"]["ray_node"] != rows["prefill"]["ray_node"]  # 1 CPU each
    [worker] = [n for n in cluster.worker_nodes if n.node_id == rows["decode"]["ray_node"]]
    body = completion(make_prompt(30, seed=140), max_tokens=6)
    assert ray_up.ask(body).status_code == 200

    cluster.remove_node(worker, allow_graceful=False)  # the machine is gone
    wait_until(lambda: health_status(rows["decode"]["url"]) == 0, 60, "the decode node to end")
    wait_until(lambda: node_idle(rows["prefill"]["url"]), LEASE_S + 5, "the prefill node idle")
    cluster.add_node(num_cpus=1, num_gpus=0)  # room for the restarted actor
    wait_until(
        lambda: any(r["role"] == "decode" and r["alive"] for r in ray_up.nodes()),
        240,
        "the decode actor to be restarted on the new Ray node",
    )
    [decode] = [r for r in ray_up.nodes() if r["role"] == "decode"]
    assert decode["ray_node"] != worker.node_id and decode["restarted"] is True
    wait_until(lambda: ray_up.ask(body).status_code == 200, 60, "the cluster to serve again")
    answer = httpx.post(f"{ray_up.proxy_url}/v1/completions", json=body, headers=HEADERS,
                        timeout=60)  # fmt: skip
    assert answer.json()["usage"]["completion_tokens"] == 6
