"""Property-based tests of the nodes' HTTP surface: the OpenAI routes on each role, the
abort API and the control channel (`/kv/*`), with requests from `tests/api/http_fuzz.py`.

For every generated request:
- never a 5xx: neither the status nor an error event in a stream; a 4xx is in the OpenAI
  error schema;
- an answer within `REQUEST_BOUND_S` (a hang fails the test);
- afterwards every node is healthy and holds nothing (`/admin/kv`), once the protocol's
  own cleanup ran for the handoffs the test made itself (a release, `failed` after a claim).
Plus what the design promises of the abort API (nothing released without a credential) and
of a P/D answer (a greedy decode leg says what the single node says).

The suite runs Hypothesis' `ci` profile (tests/conftest.py: a few derandomized examples per
property); `bench/fuzz_http.sh` runs the `soak` profile for longer.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import time
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.api.conftest import API_KEY
from tests.api.http_fuzz import (
    ADMIN,
    OPENAI_PATHS,
    Call,
    any_route_calls,
    assert_answered,
    assert_settled,
    chat_bodies,
    cleanup,
    completion_bodies,
    encode,
    json_values,
    make_handoff,
    maybe,
    messages_bodies,
    perturbed,
    post_calls,
    responses_bodies,
    send,
    some_of,
    token_ids,
)
from tests.disagg.conftest import Cluster, kv_state
from tests.disagg.conftest import cluster as cluster  # the shared session fixture

pytestmark = pytest.mark.timeout(600)
KV_PATHS = ["/kv/renew", "/kv/claim", "/kv/done", "/kv/failed", "/kv/release"]
ROUTES = [
    *OPENAI_PATHS,
    "/v1/models",
    "/health",
    "/metrics",
    "/admin/kv",
    "/v1/abort_requests",
    "/kv/handshake",
    "/openapi.json",
    *KV_PATHS,
]


# -- the OpenAI routes on each role ---------------------------------------------------------

openai_bodies = completion_bodies | chat_bodies
any_leg_bodies = st.builds(
    lambda body, kv: {**body, **kv},
    openai_bodies,
    some_of(
        kv_transfer_params=some_of(do_remote_decode=st.booleans(), do_remote_prefill=st.booleans())
    ),
)
prefill_leg_bodies = st.builds(
    lambda body, kv: {**body, "kv_transfer_params": kv},
    openai_bodies,
    perturbed(
        {"do_remote_decode": st.just(True)},
        {"release_token": st.just(secrets.token_urlsafe(24)) | st.text(max_size=30)},
    ),
)


@given(call=post_calls(OPENAI_PATHS, any_leg_bodies, API_KEY))
def test_a_whole_node_answers_every_body_with_a_result_or_a_4xx(
    cluster: Cluster, call: Call
) -> None:
    assert_answered(send(cluster.single.url, call), call)
    assert_settled(cluster.single)


@given(call=post_calls(OPENAI_PATHS, prefill_leg_bodies, API_KEY))
def test_a_prefill_node_answers_every_leg_and_holds_only_what_it_answered(
    cluster: Cluster, call: Call
) -> None:
    with cleanup(cluster.prefill):
        response = send(cluster.prefill.url, call)
        assert_answered(response, call)
        live = kv_state(cluster.prefill)["num_handoffs"]
        answered = response.status_code == 200 and "kv_transfer_params" in response.text
        assert live <= int(answered), "a handoff is held that no answer named"
    assert_settled(cluster.prefill)


def mutated(kv: dict[str, Any], prefill_port: int) -> st.SearchStrategy[dict[str, Any]]:
    """A prefill answer's params with some fields dropped or changed (the host stays on
    loopback: a decode node connects to what it is told)."""
    changes = {
        "remote_request_id": st.text(max_size=12),
        "release_token": st.just(secrets.token_urlsafe(24)) | st.text(max_size=8),
        "epoch": st.text(max_size=8),
        "remote_block_ids": st.lists(st.integers(-1, 200), max_size=4),
        "remote_num_tokens": st.integers(-1, 600),
        "remote_port": st.sampled_from([prefill_port, 1, 0, -1, 70000]),
        "remote_host": st.sampled_from(["127.0.0.1", "localhost", ""]) | st.none(),
        "do_remote_prefill": st.booleans(),
        "do_remote_decode": st.booleans(),
        "remote_engine_id": st.text(max_size=8),
    }
    drop = st.sets(st.sampled_from(sorted(kv)), max_size=2)
    change = st.fixed_dictionaries({}, optional={k: maybe(v) for k, v in changes.items()})
    return st.builds(
        lambda gone, new: {**{k: v for k, v in kv.items() if k not in gone}, **new}, drop, change
    )


@given(data=st.data())
def test_a_decode_node_takes_any_params_without_holding_or_misreading(
    cluster: Cluster, data: st.DataObject
) -> None:
    with cleanup(cluster.prefill):
        decode_any_params(cluster, data)
    assert_settled(cluster.prefill, cluster.decode)


def decode_any_params(cluster: Cluster, data: st.DataObject) -> None:
    prompt = data.draw(token_ids, "prompt")
    kv = make_handoff(cluster.prefill, prompt)
    port = int(cluster.prefill.url.rsplit(":", 1)[1])
    params = data.draw(st.just(kv) | mutated(kv, port), "kv_transfer_params")
    changes = some_of(
        stream=st.booleans(),
        max_tokens=st.integers(0, 8),
        prompt=token_ids,
        return_token_ids=st.just(True),
    )
    extra = data.draw(changes, "extra")
    body = {
        "prompt": prompt,
        "max_tokens": 4,
        "temperature": 0,
        "return_token_ids": True,
        **extra,
        "kv_transfer_params": params,
    }
    call = Call("POST", "/v1/completions", encode(body), ADMIN)
    response = send(cluster.decode.url, call)
    assert_answered(response, call)
    plain = {k: v for k, v in body.items() if k != "kv_transfer_params"}
    if response.status_code == 200 and not plain.get("stream") and plain["prompt"] == prompt:
        expected = httpx.post(f"{cluster.single.url}/v1/completions", json=plain, headers=ADMIN)
        assert texts(response) == texts(expected), f"{params} read the wrong KV"


def texts(response: httpx.Response) -> list[Any]:
    return [(c.get("text"), c.get("token_ids")) for c in response.json()["choices"]]


# -- the control channel and the abort API --------------------------------------------------


@given(data=st.data())
def test_control_messages_in_any_order_leave_nothing_held(
    cluster: Cluster, data: st.DataObject
) -> None:
    kv = make_handoff(cluster.prefill, data.draw(token_ids, "prompt"))
    real = {
        "handoff_id": kv["remote_request_id"],
        "release_token": kv["release_token"],
        "epoch": kv["epoch"],
    }
    ref = maybe(
        some_of(
            **{k: st.just(v) | st.text(max_size=8) for k, v in real.items()},
            block_ids=st.just(kv["remote_block_ids"]) | st.lists(st.integers(-1, 200), max_size=3),
            reason=st.sampled_from(["rejected", "released"]),
        )
    )
    bodies = st.one_of(ref, some_of(handoffs=st.lists(ref, max_size=3)), json_values)
    calls = st.builds(
        Call,
        st.just("POST"),
        st.sampled_from(KV_PATHS),
        bodies.map(encode),
        st.just(ADMIN) | st.just({}),
    )
    with cleanup(cluster.prefill):
        for call in [
            *data.draw(st.lists(calls, min_size=1, max_size=4), "calls"),
            Call("GET", "/kv/handshake", b"", ADMIN),
        ]:
            assert_answered(send(cluster.prefill.url, call), call)
    assert_settled(cluster.prefill)


@given(data=st.data())
def test_the_abort_api_releases_only_with_a_credential(
    cluster: Cluster, data: st.DataObject
) -> None:
    client_id = data.draw(st.sampled_from(["", "client-a"]), "x-request-id")
    with cleanup(cluster.prefill):
        abort_with_any_credential(cluster, data, client_id)
    assert_settled(cluster.prefill)


def abort_with_any_credential(cluster: Cluster, data: st.DataObject, client_id: str) -> None:
    kv = make_handoff(cluster.prefill, data.draw(token_ids, "prompt"), client_id)
    handoff_id, token = kv["remote_request_id"], kv["release_token"]
    names = st.sampled_from([handoff_id, client_id or "nobody", "cmpl-x"]) | st.text(max_size=8)
    body = data.draw(
        some_of(
            request_ids=st.lists(names, max_size=3),
            release_token=st.sampled_from([token, secrets.token_urlsafe(24)]),
        ),
        "body",
    )
    admin = data.draw(st.booleans(), "admin")
    node = data.draw(st.sampled_from([cluster.prefill, cluster.decode, cluster.single]), "node")
    call = Call("POST", "/v1/abort_requests", encode(body), ADMIN if admin else {})
    response = send(node.url, call)
    assert_answered(response, call)
    credential = admin or (body.get("release_token") == token and node is cluster.prefill)
    if not credential:
        live = [h["handoff_id"] for h in kv_state(cluster.prefill)["handoffs"]]
        assert handoff_id in live, f"released without a credential: {body}"


@given(data=st.data())
def test_any_method_on_any_path_is_answered(cluster: Cluster, data: st.DataObject) -> None:
    node = data.draw(st.sampled_from([cluster.prefill, cluster.decode, cluster.single]), "node")
    call = data.draw(any_route_calls(ROUTES, API_KEY), "call")
    with cleanup(cluster.prefill):
        assert_answered(send(node.url, call), call)
    assert_settled(node)


# -- the agent APIs on a whole node -----------------------------------------------------------


@given(call=post_calls(["/v1/responses"], responses_bodies, API_KEY))
def test_a_whole_node_answers_every_responses_body_with_a_result_or_a_4xx(
    cluster: Cluster, call: Call
) -> None:
    """The Responses API (`agent_api/`): never a 5xx, nothing held afterwards (a background
    response included, once it ended)."""
    response = send(cluster.single.url, call)
    assert_answered(response, call)
    if response.status_code == 200 and b'"background": true' in response.content[:2000]:
        _wait_background(cluster.single.url, response.json()["id"])
    assert_settled(cluster.single)


def _wait_background(url: str, response_id: str) -> None:
    deadline = time.monotonic() + 30
    headers = {"Authorization": f"Bearer {API_KEY}"}
    while httpx.get(f"{url}/v1/responses/{response_id}", headers=headers).json()["status"] in (
        "queued",
        "in_progress",
    ):
        assert time.monotonic() < deadline
        time.sleep(0.02)


@given(call=post_calls(["/v1/messages"], messages_bodies, API_KEY))
def test_a_whole_node_answers_every_messages_body_with_a_result_or_a_4xx(
    cluster: Cluster, call: Call
) -> None:
    """The Messages API: never a 5xx; a 4xx in Anthropic's error schema; an error event in a
    stream never a server error; nothing held afterwards."""
    call = dataclasses.replace(call, body=call.body.replace(b'"MODEL"', json.dumps(
        str(cluster.model)).encode()))  # fmt: skip
    response = send(cluster.single.url, call)
    what = f"{call.path} {call.body[:300]!r} → {response.status_code}"
    assert response.status_code < 500, f"{what}: {response.text[:500]}"
    if response.status_code >= 400:
        body = response.json()
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, what
    elif response.headers.get("content-type", "").startswith("text/event-stream"):
        for line in response.text.splitlines():
            if line.startswith("data: ") and '"type": "error"' in line:
                kind = json.loads(line[len("data: ") :])["error"]["type"]
                assert kind not in ("api_error",), f"{what}: {line}"
    assert_settled(cluster.single)
