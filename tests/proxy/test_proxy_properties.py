"""Property-based tests of the proxy's HTTP surface, in front of the tiny P/D cluster, with
requests from `tests/api/http_fuzz.py`. For every generated request: never a 5xx (status or
stream error event), a 4xx in the OpenAI schema, an answer within the bound, and afterwards
the proxy healthy and both nodes holding nothing: the proxy itself released every handoff
(no cleanup runs before the check, and the bound is under the lease).
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from hypothesis import given

from tests.api.conftest import API_KEY, Server, stop_server
from tests.api.http_fuzz import (
    OPENAI_PATHS,
    Call,
    any_route_calls,
    assert_answered,
    assert_settled,
    chat_bodies,
    completion_bodies,
    post_calls,
    release_all,
    send,
)
from tests.disagg.conftest import Cluster
from tests.disagg.conftest import cluster as cluster  # the shared session fixture
from tests.proxy.conftest import start_proxy

pytestmark = pytest.mark.timeout(600)
ROUTES = [*OPENAI_PATHS, "/v1/models", "/health", "/metrics", "/admin/departures", "/openapi.json"]


@pytest.fixture(scope="module")
def proxy(cluster: Cluster) -> Iterator[Server]:
    server = start_proxy([cluster.prefill.url], [cluster.decode.url])
    try:
        yield server
    finally:
        stop_server(server)


def check(cluster: Cluster, proxy: Server, call: Call) -> None:
    try:
        assert_answered(send(proxy.url, call), call)
        assert httpx.get(f"{proxy.url}/health", timeout=5).status_code == 200
        assert_settled(cluster.prefill, cluster.decode)
    finally:
        release_all(cluster.prefill)  # a failing example must not spill into the next


@given(call=post_calls(OPENAI_PATHS, completion_bodies | chat_bodies, API_KEY))
def test_the_proxy_answers_every_body_with_a_result_or_a_4xx(
    cluster: Cluster, proxy: Server, call: Call
) -> None:
    check(cluster, proxy, call)


@given(call=any_route_calls(ROUTES, API_KEY))
def test_any_method_on_any_proxy_path_is_answered(
    cluster: Cluster, proxy: Server, call: Call
) -> None:
    check(cluster, proxy, call)
