"""The control plane's two HTTP adapters pass the same tests: a pdserve prefill node's routes
(`api/disagg_routes.py`) and the endpoint `PdserveConnector` opens inside vLLM's process
(`vllm/control_server.py`, here over a bare `HandoffTable`: no vLLM needed). Hostile bodies
and wrong credentials get the same 4xx from both, in the OpenAI error schema, and release
nothing; the rules' words come from `disagg/control_plane.py`, once.

The vLLM side runs inside the inference engine's process, so it also proves it cannot be
made to hold threads: idle and slow connections are cut, and no more than `MAX_CONNECTIONS`
are ever served at once. And it serves TLS with the files pdserve's nodes take.
"""

from __future__ import annotations

import secrets
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdserve.disagg import control_plane
from pdserve.disagg.control import ControlClient
from pdserve.disagg.handoff import HandoffTable
from pdserve.disagg.messages import Outcome, ReleaseReason
from pdserve.disagg.params import HandoffRef
from pdserve.tls import TLSConfig, make_cluster_certs
from pdserve.vllm import control_server
from pdserve.vllm.control_server import ControlServer
from tests.api.http_fuzz import ADMIN, make_handoff
from tests.disagg.conftest import Cluster, kv_state
from tests.disagg.conftest import cluster as cluster  # the shared session fixture

SECRET = ADMIN["authorization"].removeprefix("Bearer ")
"""The pdserve test nodes' API key, which is also their cluster secret; the vLLM-side
endpoint is given the same one."""
KV_PATHS = list(control_plane.ROUTES)
ABORT = "/v1/abort_requests"
DEADLINE_S = 5.0


@dataclass
class Endpoint:
    """One adapter, and how to make and inspect real handoffs on it."""

    url: str
    new_handoff: Callable[[], dict[str, str]]
    """A HELD handoff: its handoff_id, release_token and epoch."""
    live: Callable[[], set[str]]
    made: list[dict[str, str]] = field(default_factory=list)

    def handoff(self) -> dict[str, str]:
        self.made.append(self.new_handoff())
        return self.made[-1]


def pdserve_endpoint(cluster: Cluster) -> Endpoint:
    def new() -> dict[str, str]:
        kv = make_handoff(cluster.prefill, [5, 6, 7, 8])
        return {
            "handoff_id": kv["remote_request_id"],
            "release_token": kv["release_token"],
            "epoch": kv["epoch"],
        }

    return Endpoint(
        cluster.prefill.url,
        new,
        lambda: {h["handoff_id"] for h in kv_state(cluster.prefill)["handoffs"]},
    )


@dataclass
class VllmSide:
    table: HandoffTable
    lock: threading.Lock
    server: ControlServer

    def new_handoff(self) -> dict[str, str]:
        with self.lock:
            handoff = self.table.begin(f"cmpl-{secrets.token_hex(4)}")
            assert self.table.hold(handoff.handoff_id, (1, 2), 32) is Outcome.OK
        return {
            "handoff_id": handoff.handoff_id,
            "release_token": handoff.release_token,
            "epoch": self.table.epoch,
        }

    def live(self) -> set[str]:
        with self.lock:
            return {h.handoff_id for h in self.table.live() if h.state.value != "released"}


def vllm_side(tls: ssl.SSLContext | None = None) -> VllmSide:
    table, lock = HandoffTable(lease_s=60, claim_timeout_s=30), threading.Lock()
    return VllmSide(table, lock, ControlServer(table, lock, "127.0.0.1", 0, SECRET, tls=tls))


@pytest.fixture(params=["pdserve-node", "vllm-connector"])
def endpoint(request: pytest.FixtureRequest) -> Iterator[Endpoint]:
    if request.param == "pdserve-node":
        found = pdserve_endpoint(request.getfixturevalue("cluster"))
        yield found
        release_all(found)
        return
    side = vllm_side()
    try:
        found = Endpoint(f"http://127.0.0.1:{side.server.port}", side.new_handoff, side.live)
        yield found
        release_all(found)
    finally:
        side.server.close()


def release_all(endpoint: Endpoint) -> None:
    for ref in endpoint.made:
        body = {**ref, "reason": ReleaseReason.RELEASED.value}
        httpx.post(f"{endpoint.url}/kv/release", json=body, headers=ADMIN, timeout=DEADLINE_S)
    assert not endpoint.live() & {ref["handoff_id"] for ref in endpoint.made}


def raw_post(url: str, path: str, body: bytes, headers: dict[str, str]) -> httpx.Response:
    return httpx.post(f"{url}{path}", content=body, headers=headers, timeout=DEADLINE_S)


def assert_refused(response: httpx.Response, status: int | None = None) -> dict[str, Any]:
    assert 400 <= response.status_code < 500, response.text[:300]
    if status is not None:
        assert response.status_code == status, response.text[:300]
    error: dict[str, Any] = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}, error
    return error


HOSTILE = {
    "nested arrays": b"[" * 100_000,
    "nested objects": b'{"a":' * 5_000 + b"1" + b"}" * 5_000,
    "garbage": b"\x00\xff not json at all {",
    "not utf-8": b'{"handoff_id": "\xff\xfe"}',
    "not an object": b'["handoff_id"]',
    "oversized": b'{"pad": "' + b"x" * control_plane.MAX_BODY_BYTES + b'"}',
}


@pytest.mark.parametrize("path", ["/kv/release", ABORT])  # each adapter reads every body alike
@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_bodies_are_a_4xx_and_release_nothing(
    endpoint: Endpoint, path: str, name: str
) -> None:
    ref = endpoint.handoff()
    error = assert_refused(raw_post(endpoint.url, path, HOSTILE[name], ADMIN))
    if name == "oversized":
        assert error["code"] == 413
    assert ref["handoff_id"] in endpoint.live()


def test_a_bad_body_names_the_field(endpoint: Endpoint) -> None:
    ref = endpoint.handoff()
    body = {**ref, "epoch": 7}
    error = assert_refused(httpx.post(f"{endpoint.url}/kv/release", json=body, headers=ADMIN), 400)
    assert error["param"] == "epoch"
    assert ref["handoff_id"] in endpoint.live()


@pytest.mark.parametrize("headers", [{}, {"authorization": "Bearer wrong"}, {"authorization": "x"}])
def test_control_messages_without_the_credential_are_401_with_the_same_words(
    endpoint: Endpoint, headers: dict[str, str]
) -> None:
    ref = endpoint.handoff()
    body = {**ref, "handoffs": [ref], "block_ids": [1, 2], "reason": "released"}
    for path in KV_PATHS:
        answer = httpx.post(f"{endpoint.url}{path}", json=body, headers=headers)
        assert control_plane.credential_required().message == assert_refused(answer, 401)["message"]
    assert ref["handoff_id"] in endpoint.live()


def test_aborts_without_a_credential_or_with_another_s_token_release_nothing(
    endpoint: Endpoint,
) -> None:
    mine, other = endpoint.handoff(), endpoint.handoff()
    ids = [mine["handoff_id"]]
    missing = httpx.post(f"{endpoint.url}{ABORT}", json={"request_ids": ids})
    assert "release token is required" in assert_refused(missing, 401)["message"]
    forged = {"request_ids": ids, "release_token": other["release_token"]}
    wrong = httpx.post(f"{endpoint.url}{ABORT}", json=forged, headers={"authorization": "x"})
    assert "does not cover" in assert_refused(wrong, 403)["message"]
    assert {mine["handoff_id"], other["handoff_id"]} <= endpoint.live()
    endpoint.made.remove(mine)  # released here, with its own token
    own = {"request_ids": ids, "release_token": mine["release_token"]}
    answer = httpx.post(f"{endpoint.url}{ABORT}", json=own)
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"results": [{"id": ids[0], "outcome": "released"}]}
    assert mine["handoff_id"] not in endpoint.live()


def test_a_release_with_its_token_frees_and_a_second_is_already_released(
    endpoint: Endpoint,
) -> None:
    ref = endpoint.handoff()
    endpoint.made.remove(ref)
    body = {**ref, "reason": "released"}
    first = httpx.post(f"{endpoint.url}/kv/release", json=body, headers=ADMIN)
    again = httpx.post(f"{endpoint.url}/kv/release", json=body, headers=ADMIN)
    assert first.json() == {"outcome": "ok"} and again.json() == {"outcome": "already_released"}
    assert ref["handoff_id"] not in endpoint.live()


# -- the vLLM side cannot be made to hold threads ------------------------------------------


@pytest.fixture
def tight(monkeypatch: pytest.MonkeyPatch) -> Iterator[VllmSide]:
    monkeypatch.setattr(control_server, "MAX_CONNECTIONS", 8)
    monkeypatch.setattr(control_server, "IDLE_TIMEOUT_S", 0.5)
    monkeypatch.setattr(control_server, "REQUEST_DEADLINE_S", 1.0)
    side = vllm_side()
    try:
        yield side
    finally:
        side.server.close()


def control_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name == control_server.CONNECTION_THREAD)


def wait_for(condition: Callable[[], bool], what: str, within_s: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + within_s
    while not condition():
        assert time.monotonic() < deadline, f"no {what} within {within_s} s"
        time.sleep(0.01)


def closed_by_peer(s: socket.socket) -> bool:
    s.settimeout(DEADLINE_S)
    try:
        return s.recv(1) == b""
    except OSError:  # reset: closed as well
        return True


def test_idle_and_trickling_connections_are_cut_and_threads_stay_bounded(
    tight: VllmSide,
) -> None:
    port = tight.server.port
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(40)]
    try:
        for s in idle:
            s.sendall(b"POST /kv/renew HTTP/1.1\r\nHost: x\r\n")  # half a request
        time.sleep(0.2)
        assert 0 < control_threads() <= control_server.MAX_CONNECTIONS
        wait_for(lambda: control_threads() == 0, "idle connections cut")
        assert all(closed_by_peer(s) for s in idle)
    finally:
        for s in idle:
            s.close()
    trickle = socket.create_connection(("127.0.0.1", port))
    try:
        started = time.monotonic()
        while not closed_by_peer_nowait(trickle):  # a byte every 0.2 s: never idle
            assert time.monotonic() - started < 3 * control_server.REQUEST_DEADLINE_S
            trickle.sendall(b"X")
            time.sleep(0.2)
        assert time.monotonic() - started >= control_server.REQUEST_DEADLINE_S * 0.9
    finally:
        trickle.close()
    ref = tight.new_handoff()  # served again: a real message answers
    answer = httpx.post(
        f"http://127.0.0.1:{port}/kv/renew", json={"handoffs": [ref]}, headers=ADMIN
    )
    assert answer.json() == {"outcomes": ["ok"]}


def closed_by_peer_nowait(s: socket.socket) -> bool:
    s.settimeout(0)
    try:
        return s.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


# -- TLS ------------------------------------------------------------------------------------


def test_over_tls_a_real_client_renews_and_forged_releases_are_refused(tmp_path: Path) -> None:
    certs = make_cluster_certs(tmp_path)
    tls = TLSConfig(certs.certfile, certs.keyfile, certs.ca_certs)
    side = vllm_side(tls.server_context())
    try:
        url = f"https://127.0.0.1:{side.server.port}"
        ref = side.new_handoff()
        client = ControlClient(SECRET, tls)
        handoff = HandoffRef(ref["handoff_id"], ref["release_token"], ref["epoch"])
        try:
            assert client.renew(url, [handoff]) == [Outcome.OK]
        finally:
            client.close()
        verify = tls.client_context()
        forged = {**ref, "release_token": secrets.token_urlsafe(24), "reason": "released"}
        refused = httpx.post(f"{url}/kv/release", json=forged, headers=ADMIN, verify=verify)
        assert refused.json() == {"outcome": "bad_token"}
        anonymous = httpx.post(f"{url}{ABORT}", json={"request_ids": [ref["handoff_id"]]},
                               verify=verify)  # fmt: skip
        assert_refused(anonymous, 401)
        with pytest.raises(httpx.TransportError):  # plain HTTP to the TLS port
            httpx.post(f"http://127.0.0.1:{side.server.port}/kv/renew", json={}, timeout=2)
        assert ref["handoff_id"] in side.live()
    finally:
        side.server.close()
