"""`GET /openapi.json` on every node role and on the proxy: open without a key, every path
it lists answers (and every route is listed), its references resolve, and the chat body's
schema is the one the server checks."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.api.conftest import API_KEY, Server, stop_server
from tests.disagg.conftest import Cluster
from tests.disagg.conftest import cluster as cluster  # the shared session fixture
from tests.proxy.conftest import start_proxy

HEADERS = {"Authorization": f"Bearer {API_KEY}"}


def refs(value: Any) -> list[str]:
    if isinstance(value, dict):
        return [r for k, v in value.items() for r in ([v] if k == "$ref" else refs(v))]
    if isinstance(value, list):
        return [r for v in value for r in refs(v)]
    return []


def assert_accurate(server: Server) -> dict[str, Any]:
    doc: dict[str, Any] = httpx.get(f"{server.url}/openapi.json", timeout=10).json()
    assert doc["openapi"] == "3.1.0"
    schemas = doc["components"]["schemas"]
    assert {r.removeprefix("#/components/schemas/") for r in refs(doc)} == set(schemas)
    for path, operations in doc["paths"].items():
        for method in operations:
            answer = httpx.request(
                method.upper(), f"{server.url}{path}", json={}, headers=HEADERS, timeout=10
            )
            routed = answer.status_code != 404 or ("{" in path and "no route" not in answer.text)
            assert routed and answer.status_code != 405, (method, path, answer.text)
    return doc


@pytest.mark.timeout(120)
def test_every_node_and_the_proxy_describe_what_they_serve(cluster: Cluster) -> None:
    prefill = assert_accurate(cluster.prefill)
    assert {"/kv/claim", "/kv/renew", "/v1/abort_requests"} <= set(prefill["paths"])
    for node in (cluster.decode, cluster.single):
        doc = assert_accurate(node)
        assert not [p for p in doc["paths"] if p.startswith("/kv/")]
    chat = prefill["components"]["schemas"]["ChatCompletionRequest"]
    message = chat["properties"]["messages"]["items"]
    assert message["required"] == ["role"]  # content may be absent beside tool_calls only
    assert set(message["properties"]["role"]["enum"]) == {
        "system",
        "developer",
        "user",
        "assistant",
        "tool",
    }
    assert {"tool_calls", "tool_call_id"} <= set(message["properties"])
    assert {"tools", "tool_choice", "parallel_tool_calls"} <= set(chat["properties"])
    proxy = start_proxy([cluster.prefill.url], [cluster.decode.url])
    try:
        doc = assert_accurate(proxy)
        assert "/admin/departures" in doc["paths"] and "/admin/kv" not in doc["paths"]
        assert doc["paths"]["/health"]["get"]["security"] == []  # open, as the route is
    finally:
        stop_server(proxy)
