"""`pdserve proxy` end to end: the official openai client through a real proxy, real P/D
nodes (tiny model) and NIXL; the proxy's cancellation windows (S1, S3, S7), retries (S17,
S19), dead nodes, and upstream errors forwarded with their status."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any
from unittest.mock import ANY

import httpx
import openai
import pytest

from pdserve.launch import signal_whole
from pdserve.proxy.assembler import StreamAssembler
from pdserve.proxy.pool import DOWN_AFTER
from tests.api.conftest import API_KEY, Server, start_server, stop_server
from tests.disagg.conftest import (
    HEADERS,
    RELEASE_BOUND_S,
    Cluster,
    completion,
    kv_state,
    make_prompt,
    metric,
    node_args,
    post,
    token_ids,
    wait_idle,
)
from tests.proxy.conftest import Stub

_HTTP_STREAM = httpx.Client(headers=HEADERS, timeout=60)

pytestmark = pytest.mark.timeout(120)
RELEASED_WITHIN_S = RELEASE_BOUND_S + 0.1
DEAD_URL = "http://127.0.0.1:9"  # the discard port: nothing listens


def reference(cluster: Cluster, body: dict[str, Any]) -> list[int]:
    return token_ids(post(cluster.single, "/v1/completions", body).json())


def assert_cluster_idle(cluster: Cluster) -> None:
    wait_idle(cluster.prefill, RELEASED_WITHIN_S)
    wait_idle(cluster.decode, RELEASED_WITHIN_S)


def openai_client(proxy: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{proxy.url}/v1", api_key=API_KEY, max_retries=0)


# -- answers --------------------------------------------------------------------------------


def test_openai_client_through_the_proxy_equals_the_single_node(
    cluster: Cluster, proxy_for: Any
) -> None:
    proxy = proxy_for([cluster.prefill.url], [cluster.decode.url])
    client = openai_client(proxy)
    prompt = make_prompt(37, seed=50)
    expected = reference(cluster, completion(prompt, max_tokens=10))
    answer = client.completions.create(
        model=str(cluster.model),
        prompt=prompt,
        max_tokens=10,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    assert answer.choices[0].model_extra["token_ids"] == expected
    assert answer.usage.prompt_tokens == 37 and answer.usage.completion_tokens == 10
    streamed: list[int] = []
    usage = None
    for chunk in client.completions.create(
        model=str(cluster.model),
        prompt=prompt,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"return_token_ids": True},
    ):
        if chunk.choices:
            streamed += chunk.choices[0].model_extra["token_ids"]
        if chunk.usage:
            usage = chunk.usage
    assert streamed == expected
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (37, 10)
    assert_cluster_idle(cluster)


def test_usage_takes_cached_prompt_tokens_from_the_prefill_leg(
    cluster: Cluster, proxy_for: Any
) -> None:
    proxy = proxy_for([cluster.prefill.url], [cluster.decode.url])
    body = completion(make_prompt(40, seed=51), max_tokens=5)
    post(proxy, "/v1/completions", body)
    usage = post(proxy, "/v1/completions", body).json()["usage"]  # the prefill node caches
    assert usage["prompt_tokens"] == 40 and usage["completion_tokens"] == 5
    assert usage["total_tokens"] == 45
    assert usage["prompt_tokens_details"]["cached_tokens"] == 32  # two full blocks of 16


def test_n_samples_come_from_one_handoff_and_equal_a_single_node(
    cluster: Cluster, proxy_for: Any
) -> None:
    """n > 1 through the proxy: one prefill leg (its prompt computed once), the decode node
    samples all n (the first continues from the prefill leg's token, the others find the
    loaded blocks in its prefix cache), seeded draws as one node draws them."""
    proxy = proxy_for([cluster.prefill.url], [cluster.decode.url])
    for stream in (False, True):
        body = completion(make_prompt(40, seed=52 + stream), max_tokens=6, n=3, temperature=0.9,
                          seed=7, logprobs=1)  # fmt: skip
        before = kv_state(cluster.prefill)["num_prompt_tokens_computed"]
        via = _assembled(proxy, body) if stream else post(proxy, "/v1/completions", body).json()
        assert kv_state(cluster.prefill)["num_prompt_tokens_computed"] - before == 40
        one = post(cluster.single, "/v1/completions", body).json()
        assert [c["index"] for c in via["choices"]] == [0, 1, 2]
        for field in ("token_ids", "logprobs"):
            assert [c[field] for c in via["choices"]] == [c[field] for c in one["choices"]]
        assert len({tuple(c["token_ids"]) for c in via["choices"]}) > 1  # distinct draws
        assert via["usage"] == one["usage"] | {"prompt_tokens_details": ANY}
    assert_cluster_idle(cluster)


def _assembled(server: Server, body: dict[str, Any]) -> dict[str, Any]:
    assembler = StreamAssembler()
    with _HTTP_STREAM.stream("POST", f"{server.url}/v1/completions",
                             json={**body, "stream": True,
                                   "stream_options": {"include_usage": True}}) as r:  # fmt: skip
        for line in r.iter_lines():
            if line.startswith("data: {"):
                assembler.add(json.loads(line[6:]))
    return assembler.answer()


def test_proxy_requires_its_key_and_refuses_bad_bodies(cluster: Cluster, proxy_for: Any) -> None:
    proxy = proxy_for([cluster.prefill.url], [cluster.decode.url])
    body = completion(make_prompt(5))
    assert httpx.post(f"{proxy.url}/v1/completions", json=body, timeout=10).status_code == 401
    raw = httpx.post(f"{proxy.url}/v1/completions", content=b"{x", headers=HEADERS, timeout=10)
    assert raw.status_code == 400 and raw.json()["error"]["type"] == "invalid_request_error"
    nested = b'{"a":' * 5000 + b"1" + b"}" * 5000  # a 500 before the depth cap
    for path in ("/v1/completions", "/v1/chat/completions"):
        deep = httpx.post(f"{proxy.url}{path}", content=nested, headers=HEADERS, timeout=10)
        assert deep.status_code == 400, deep.text
        assert set(deep.json()["error"]) == {"message", "type", "param", "code"}
        assert "nested deeper" in deep.json()["error"]["message"]
    huge = httpx.post(
        f"{proxy.url}/v1/completions", content=b"x" * (5 << 20), headers=HEADERS, timeout=30
    )
    assert huge.status_code == 413
    for method, path, status in (("GET", "/v1/completions", 405), ("GET", "/v2/nothing", 404)):
        routing = httpx.request(method, f"{proxy.url}{path}", headers=HEADERS, timeout=5)
        assert routing.status_code == status  # in the OpenAI schema, as on the nodes
        assert set(routing.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(f"{proxy.url}/health", timeout=5).json()["num_decode_up"] == 1
    models = httpx.get(f"{proxy.url}/v1/models", headers=HEADERS, timeout=5).json()
    assert models["data"][0]["id"] == str(cluster.model)
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [5, 6]})):
        through = httpx.post(f"{proxy.url}{path}", json=body, headers=HEADERS, timeout=10)
        direct = httpx.post(f"{cluster.decode.url}{path}", json=body, headers=HEADERS, timeout=10)
        assert (through.status_code, through.json()) == (direct.status_code, direct.json())


# -- cancellation windows -----------------------------------------------------------------


def departures(proxy: Server, *request_ids: str) -> dict[str, str]:
    """The proxy's record of these requests' clients leaving: id → stage (waits for all)."""
    deadline = time.monotonic() + 5
    while True:
        rows = httpx.get(f"{proxy.url}/admin/departures", headers=HEADERS, timeout=5).json()
        found = {
            r["request_id"]: r["stage"]
            for r in rows["departures"]
            if r["request_id"] in request_ids
        }
        if len(found) == len(request_ids) or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def test_s1_client_gone_during_the_prefill_leg(cluster: Cluster, proxy_for: Any) -> None:
    proxy = proxy_for([cluster.prefill.url], [cluster.decode.url])
    body = completion(make_prompt(400, seed=52), max_tokens=50)
    for timeout_s in (0.002, 0.005, 0.01, 0.02):
        with contextlib.suppress(httpx.TimeoutException):
            httpx.post(
                f"{proxy.url}/v1/completions",
                json=body,
                timeout=timeout_s,
                headers={**HEADERS, "X-Request-Id": f"s1-{timeout_s}"},
            )
    assert_cluster_idle(cluster)  # an answer in flight too: released by its token
    stages = departures(proxy, "s1-0.002", "s1-0.005", "s1-0.01", "s1-0.02")
    assert stages["s1-0.002"] == "prefill"  # a 400-token prefill takes longer than 2 ms
    assert set(stages.values()) <= {"prefill", "between_legs", "decode", "streaming"}, stages
    assert len(stages) == 4


def test_s2_client_gone_while_the_prefill_answer_is_in_flight_releases_it(
    cluster: Cluster, proxy_for: Any, slow_link: Any
) -> None:
    """The node has answered, so it holds the handoff; the answer is still on its way when
    the client leaves, so the proxy never learns the handoff id. The proxy releases the
    attempt by the token it chose for it: nothing waits for the lease (found by chaos)."""
    link = slow_link(cluster.prefill.url, delay_s=0.6)
    proxy = proxy_for([link.url], [cluster.decode.url])
    body = completion(make_prompt(40, seed=57))

    def send() -> None:
        with contextlib.suppress(httpx.TimeoutException):
            httpx.post(
                f"{proxy.url}/v1/completions",
                json=body,
                timeout=0.4,
                headers={**HEADERS, "X-Request-Id": "in-flight"},
            )

    client = threading.Thread(target=send)
    client.start()
    deadline = time.monotonic() + 0.35
    while not [h for h in kv_state(cluster.prefill)["handoffs"] if h["state"] == "held"]:
        assert time.monotonic() < deadline, "the prefill node never held the handoff"
        time.sleep(0.01)
    client.join()  # left 0.4 s in, the answer due at the proxy about 0.6 s in
    assert kv_state(cluster.prefill)["num_handoffs"] <= 1
    wait_idle(cluster.prefill, RELEASED_WITHIN_S)
    assert departures(proxy, "in-flight") == {"in-flight": "prefill"}
    assert kv_state(cluster.decode)["num_running"] == 0


def test_s3_client_gone_between_the_legs_releases_the_handoff(
    cluster: Cluster, proxy_for: Any
) -> None:
    pause_s = 2.0
    proxy = proxy_for(
        [cluster.prefill.url], [cluster.decode.url], "--debug-delay-between-legs-s", str(pause_s)
    )
    released_before = metric(proxy, "pdserve_proxy_releases_total")

    async def leave_once_held() -> list[dict[str, Any]]:
        """The client leaves in the middle of the proxy's pause between the legs: half the
        pause after the prefill node holds its handoff (the node holds it just before it
        answers, so leaving at once could still find the proxy in the prefill leg; a fixed
        client timeout would leave during a slow prefill leg)."""
        async with httpx.AsyncClient() as client:
            request = asyncio.create_task(
                client.post(f"{proxy.url}/v1/completions",
                            json=completion(make_prompt(40, seed=53)),
                            headers={**HEADERS, "X-Request-Id": "s3-client"}, timeout=30)
            )  # fmt: skip
            deadline = time.monotonic() + 30
            while not (
                handoffs := (await asyncio.to_thread(kv_state, cluster.prefill))["handoffs"]
            ):
                assert not request.done() and time.monotonic() < deadline, "no handoff held"
                await asyncio.sleep(0.02)
            await asyncio.sleep(pause_s / 2)
            request.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await request
            return list(handoffs)

    handoffs = asyncio.run(leave_once_held())
    assert [h["client_request_id"] for h in handoffs] == ["s3-client"]  # the proxy passed it on
    wait_idle(cluster.prefill, pause_s / 2 + RELEASED_WITHIN_S)  # the pause ends: client gone
    assert metric(proxy, "pdserve_proxy_releases_total") == released_before + 1
    assert kv_state(cluster.decode)["num_running"] == 0  # no decode leg was sent
    assert departures(proxy, "s3-client") == {"s3-client": "between_legs"}


def test_s7_client_gone_during_decode_frees_both_nodes(cluster: Cluster, proxy_for: Any) -> None:
    proxy = proxy_for([cluster.prefill.url], [cluster.decode.url])
    body = completion(make_prompt(30, seed=54), max_tokens=400, ignore_eos=True, stream=True)
    headers = {**HEADERS, "X-Request-Id": "s7-client"}
    with httpx.stream(
        "POST", f"{proxy.url}/v1/completions", json=body, headers=headers, timeout=30
    ) as response:
        lines = response.iter_lines()
        for _ in range(6):
            next(lines)
    assert_cluster_idle(cluster)
    assert departures(proxy, "s7-client") == {"s7-client": "streaming"}


# -- long and stalled decode legs ---------------------------------------------------------

IDLE_BOUND_S = 1.0
"""The proxies' --decode-timeout-s here: the longest silence a decode leg may keep."""


@pytest.fixture(scope="module")
def slow_decode(cluster: Cluster) -> Iterator[Server]:
    """A decode node that answers each step 50 ms late: slow but steady."""
    node = start_server(
        *node_args(cluster.model, "--role", "decode", "--debug-step-delay-s", "0.05")
    )
    try:
        yield node
    finally:
        signal_whole(node, signal.SIGCONT)
        stop_server(node)


def test_a_non_streaming_answer_longer_than_the_decode_timeout_completes(
    cluster: Cluster, proxy_for: Any, slow_decode: Server
) -> None:
    proxy = proxy_for(
        [cluster.prefill.url], [slow_decode.url], "--decode-timeout-s", str(IDLE_BOUND_S)
    )
    body = completion(make_prompt(30, seed=62), max_tokens=60, ignore_eos=True)
    started = time.monotonic()
    response = post(proxy, "/v1/completions", body)
    assert response.status_code == 200, response.text
    assert time.monotonic() - started > 2 * IDLE_BOUND_S  # 60 steps, 50 ms apart
    assert token_ids(response.json()) == reference(cluster, body)
    assert response.json()["usage"]["completion_tokens"] == 60
    wait_idle(cluster.prefill, RELEASED_WITHIN_S)
    wait_idle(slow_decode, RELEASED_WITHIN_S)


def test_a_decode_node_that_stops_producing_is_cut_and_its_handoff_freed(
    cluster: Cluster, proxy_for: Any, slow_decode: Server
) -> None:
    """SIGSTOP freezes the decode node: before the leg reaches it (the handoff is still
    held: the proxy releases it, well before its 2 s lease), then mid-answer. Each time the
    client gets a 504 once the leg was silent for the idle bound."""
    proxy = proxy_for(
        [cluster.prefill.url], [slow_decode.url], "--decode-timeout-s", str(IDLE_BOUND_S)
    )
    released_before = metric(proxy, "pdserve_proxy_releases_total")
    signal_whole(slow_decode, signal.SIGSTOP)
    try:
        frozen_s = time.monotonic()
        response = post(proxy, "/v1/completions", completion(make_prompt(30, seed=63)))
        assert_cut(response, time.monotonic() - frozen_s)
        wait_idle(cluster.prefill, RELEASED_WITHIN_S)
        assert metric(proxy, "pdserve_proxy_releases_total") == released_before + 1
    finally:
        signal_whole(slow_decode, signal.SIGCONT)
    wait_idle(slow_decode, 10)  # thawed, it finds its client gone

    body = completion(make_prompt(30, seed=64), max_tokens=400, ignore_eos=True)
    answers: list[tuple[httpx.Response, float]] = []
    client = threading.Thread(
        target=lambda: answers.append((post(proxy, "/v1/completions", body), time.monotonic()))
    )
    client.start()
    deadline = time.monotonic() + 10
    while kv_state(slow_decode)["num_running"] == 0:  # the KV was read: it decodes
        assert time.monotonic() < deadline, "the decode leg never started"
        time.sleep(0.02)
    time.sleep(0.3)  # a few chunks on their way
    signal_whole(slow_decode, signal.SIGSTOP)
    try:
        frozen_s = time.monotonic()
        client.join(10)
        [(response, answered_s)] = answers
        assert_cut(response, answered_s - frozen_s)
        wait_idle(cluster.prefill, RELEASED_WITHIN_S)
    finally:
        signal_whole(slow_decode, signal.SIGCONT)
    wait_idle(slow_decode, 10)


def assert_cut(response: httpx.Response, silent_s: float) -> None:
    assert response.status_code == 504, response.text
    assert response.json()["error"]["type"] == "upstream_error"
    assert IDLE_BOUND_S - 0.1 < silent_s < IDLE_BOUND_S + 2, silent_s


# -- retries, dead nodes -------------------------------------------------------------------


def test_s17_s19_prefill_failures_retry_elsewhere_or_fail_clearly(
    cluster: Cluster, proxy_for: Any, stub: Stub
) -> None:
    stub.status, stub.body = 500, {"error": {"message": "boom", "type": "internal_error"}}
    proxy = proxy_for([DEAD_URL, stub.url, cluster.prefill.url], [cluster.decode.url])
    body = completion(make_prompt(20, seed=55), max_tokens=6)
    expected = reference(cluster, body)
    for _ in range(3):  # whichever node is chosen first, the request lands on the real one
        response = post(proxy, "/v1/completions", body)
        assert response.status_code == 200 and token_ids(response.json()) == expected
    assert metric(proxy, "pdserve_proxy_retries_total") >= 1
    only_bad = proxy_for([DEAD_URL, stub.url], [cluster.decode.url])
    failed = post(only_bad, "/v1/completions", body)
    assert failed.status_code in (500, 502) and "error" in failed.json()
    assert kv_state(cluster.decode)["num_running"] == 0  # no decode leg without a prefill
    assert_cluster_idle(cluster)


def test_a_hung_prefill_node_times_out_and_the_request_moves_on(
    cluster: Cluster, proxy_for: Any, stub: Stub
) -> None:
    stub.delay_s = 30
    proxy = proxy_for([stub.url], [cluster.decode.url], "--prefill-timeout-s", "0.5")
    response = post(proxy, "/v1/completions", completion(make_prompt(20, seed=56)))
    assert response.status_code == 504 and response.json()["error"]["type"] == "upstream_error"


def test_unreachable_decode_node_is_skipped_and_all_gone_releases(
    cluster: Cluster, proxy_for: Any
) -> None:
    proxy = proxy_for([cluster.prefill.url], [DEAD_URL, cluster.decode.url])
    body = completion(make_prompt(20, seed=57), max_tokens=6)
    expected = reference(cluster, body)
    for _ in range(3):
        assert token_ids(post(proxy, "/v1/completions", body).json()) == expected
    no_decode = proxy_for([cluster.prefill.url], [DEAD_URL])
    failed = post(no_decode, "/v1/completions", body)
    assert failed.status_code == 503
    assert_cluster_idle(cluster)  # the handoff was released, not left to its lease


@pytest.mark.parametrize("status", [400, 401, 404, 429, 503, 500])
def test_decode_node_errors_reach_the_client_with_their_status(
    cluster: Cluster, proxy_for: Any, stub: Stub, status: int
) -> None:
    stub.status = status
    stub.body = {
        "error": {
            "message": f"stub says {status}",
            "type": "stub_error",
            "param": None,
            "code": status,
        }
    }
    proxy = proxy_for([cluster.prefill.url], [stub.url])
    for stream in (False, True):
        body = completion(make_prompt(20, seed=58), stream=stream)
        response = post(proxy, "/v1/completions", body)
        assert response.status_code == status
        assert response.json()["error"]["message"] == f"stub says {status}"
    assert stub.calls[0]["kv_transfer_params"]["do_remote_prefill"] is True
    wait_idle(cluster.prefill, RELEASED_WITHIN_S)  # released by the proxy


@pytest.mark.parametrize("status", [400, 404, 429])
def test_prefill_node_client_errors_are_forwarded_without_retry(
    cluster: Cluster, proxy_for: Any, stub: Stub, status: int
) -> None:
    stub.status, stub.body = status, {"error": {"message": "no", "type": "x", "code": status}}
    proxy = proxy_for([stub.url, cluster.prefill.url], [cluster.decode.url])
    for _ in range(3):
        response = post(proxy, "/v1/completions", completion(make_prompt(20, seed=59)))
        if stub.calls:
            break
    assert response.status_code == status and response.json()["error"]["message"] == "no"


def test_killed_nodes_leave_the_cluster_serving_and_leak_nothing(
    cluster: Cluster, proxy_for: Any
) -> None:
    extra_prefill = start_server(*node_args(cluster.model, "--role", "prefill"))
    extra_decode = start_server(*node_args(cluster.model, "--role", "decode"))
    try:
        proxy = proxy_for(
            [cluster.prefill.url, extra_prefill.url], [cluster.decode.url, extra_decode.url]
        )
        body = completion(make_prompt(30, seed=60), max_tokens=6)
        expected = reference(cluster, body)
        assert token_ids(post(proxy, "/v1/completions", body).json()) == expected
        for node in (extra_decode, extra_prefill):
            node.process.send_signal(signal.SIGKILL)
            node.process.wait()
        results = [post(proxy, "/v1/completions", body) for _ in range(6)]
        assert all(r.status_code == 200 and token_ids(r.json()) == expected for r in results)
        # The six requests may all end before the proxy's health checks see the deaths
        # (routing need not send a leg to a dead node), so its view gets a bound of its own:
        # `DOWN_AFTER` checks 0.2 s apart, with slack for a loaded CI machine.
        deadline = time.monotonic() + DOWN_AFTER * 0.2 + 3.0
        while True:
            health = httpx.get(f"{proxy.url}/health", timeout=5).json()
            if health["num_prefill_up"] == 1 and health["num_decode_up"] == 1:
                break
            assert time.monotonic() < deadline, f"the proxy still counts dead nodes: {health}"
            time.sleep(0.05)
        assert_cluster_idle(cluster)
    finally:
        stop_server(extra_prefill)
        stop_server(extra_decode)


def test_upstream_stream_broken_midway_ends_with_an_error_event(
    cluster: Cluster, proxy_for: Any
) -> None:
    decode = start_server(*node_args(cluster.model, "--role", "decode"))
    try:
        proxy = proxy_for([cluster.prefill.url], [decode.url])
        body = completion(make_prompt(30, seed=61), max_tokens=400, ignore_eos=True, stream=True)
        events = []
        with httpx.stream(
            "POST", f"{proxy.url}/v1/completions", json=body, headers=HEADERS, timeout=30
        ) as response:
            for line in response.iter_lines():
                events.append(line)
                if len(events) == 6:
                    decode.process.send_signal(signal.SIGKILL)
        data = [json.loads(e[6:]) for e in events if e.startswith("data: {")]
        assert data[-1]["error"]["type"] == "upstream_error"
        assert [e for e in events if e][-1] == "data: [DONE]"
    finally:
        stop_server(decode)
    wait_idle(cluster.prefill, RELEASED_WITHIN_S)


def _send_half_a_request(url: str) -> None:
    """A client that declares a body and leaves before sending all of it."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n"
            b"authorization: Bearer " + API_KEY.encode() + b"\r\nx-request-id: half\r\n"
            b"content-type: application/json\r\ncontent-length: 1000\r\n\r\n"
            b'{"prompt": [1, 2'
        )


def _count(server: Server, needle: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=5).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if not line.startswith("#") and needle in line
    )


def test_a_client_gone_before_its_body_arrived_is_counted_not_a_crash(
    cluster: Cluster, proxy_for: Any
) -> None:
    """Found by the chaos soak: the proxy and the node raised on a half-sent body."""
    proxy = proxy_for([cluster.prefill.url], [cluster.decode.url])
    for server, needle in (
        (proxy, 'pdserve_proxy_requests_total{outcome="client_gone"}'),
        (cluster.single, 'outcome="http_499"'),
    ):
        before = _count(server, needle)
        _send_half_a_request(server.url)
        deadline = time.monotonic() + 5
        while _count(server, needle) == before:
            assert time.monotonic() < deadline, f"{server.url} did not count the departure"
            time.sleep(0.05)
        assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
    assert departures(proxy, "half") == {"half": "receiving"}
