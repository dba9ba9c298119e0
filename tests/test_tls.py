"""TLS on every HTTP hop (pdserve/tls.py): bad files are refused at start, a P/D request
runs over HTTPS end to end (client → proxy → nodes, decode → prefill `/kv/*`), peers'
certificates are verified, and a capture of loopback traffic holds no secret."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cryptography  # noqa: F401  (the tls extra: requirements-dev.txt)
import httpx
import pytest

from pdserve.errors import ConfigError
from pdserve.launch import health_status, launch, wait_healthy
from pdserve.tls import ClusterCerts, TLSConfig, make_cluster_certs, warn_if_exposed
from tests.api.conftest import ENV, Server, stop_server
from tests.disagg.conftest import (
    Cluster,
    cluster,  # noqa: F401  (the shared session fixture)
    completion,
    decode_leg,
    make_prompt,
    node_args,
    prefill_leg,
    token_ids,
)

API_KEY = "test-key"  # node_args' key
CLUSTER_SECRET = "cluster-secret-b7e1c04f9d"


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> ClusterCerts:
    return make_cluster_certs(tmp_path_factory.mktemp("tls"))


# -- configuration -------------------------------------------------------------------------


def test_missing_or_broken_files_are_refused_at_start(certs: ClusterCerts, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        TLSConfig(certfile=str(tmp_path / "absent.pem"))
    with pytest.raises(ConfigError, match="needs --ssl-certfile"):
        TLSConfig(keyfile=certs.keyfile)
    other = make_cluster_certs(tmp_path / "other")
    with pytest.raises(ConfigError, match="cannot be loaded"):
        TLSConfig(certfile=certs.certfile, keyfile=other.keyfile)  # not this cert's key
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate")
    with pytest.raises(ConfigError, match="--ssl-ca-certs cannot be loaded"):
        TLSConfig(ca_certs=str(garbage))
    assert certs.config().scheme == "https" and TLSConfig().scheme == "http"
    assert oct(Path(certs.keyfile).stat().st_mode & 0o777) == "0o600"


def test_a_plain_server_on_a_non_loopback_address_warns(
    certs: ClusterCerts, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="pdserve.tls"):
        warn_if_exposed("127.0.0.1", TLSConfig(), "the node")
        warn_if_exposed("localhost", TLSConfig(), "the node")
        warn_if_exposed("0.0.0.0", certs.config(), "the node")
        assert not caplog.records
        warn_if_exposed("0.0.0.0", TLSConfig(), "the node")
    assert len(caplog.records) == 1 and "without TLS" in caplog.records[0].message


# -- a cluster over TLS --------------------------------------------------------------------


class LoopbackCapture:
    """Every packet on `lo` while open (an eavesdropper's copy of the traffic): an
    AF_PACKET socket, so it needs CAP_NET_RAW."""

    def __init__(self) -> None:
        try:
            self._sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))
        except (PermissionError, AttributeError) as e:
            pytest.skip(f"capturing loopback packets needs CAP_NET_RAW on Linux: {e}")
        self._sock.bind(("lo", 0))
        self._sock.settimeout(0.05)
        self.data = bytearray()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.data += self._sock.recv(1 << 17)
            except TimeoutError:
                continue

    def stop(self) -> bytes:
        self._stop.set()
        self._thread.join()
        self._sock.close()
        return bytes(self.data)


@pytest.fixture(scope="module")
def tls_nodes(tiny_model_dir: Any, certs: ClusterCerts) -> Iterator[list[Server]]:
    """A prefill and a decode node over TLS, with a cluster secret of their own."""
    model = tiny_model_dir("llama")
    tls = certs.config()
    extra = ("--cluster-secret", CLUSTER_SECRET, *tls.as_args())
    nodes = [
        launch(node_args(model, "--role", role, *extra), env=ENV, tls=tls)
        for role in ("prefill", "decode")
    ]
    try:
        yield [wait_healthy(n, 180) for n in nodes]
    finally:
        for n in nodes:
            stop_server(n)


def proxy_args(prefill: Server, decode: Server) -> list[str]:
    """A proxy on the node URLs (https), routing by load alone (no tokenizer needed)."""
    return [
        "--api-key", API_KEY, "--health-interval-s", "0.2", "--model", "none",
        "--routing", "least-loaded", "--prefill", prefill.url, "--decode", decode.url,
    ]  # fmt: skip


def secrets_in(traffic: bytes, *secrets: str) -> list[str]:
    return [s for s in secrets if s.encode() in traffic]


def test_legs_over_plain_http_are_readable_on_the_wire(cluster: Cluster) -> None:  # noqa: F811
    """The capture's control: without TLS it does see the release token and the key."""
    body = completion(make_prompt(30, seed=90), max_tokens=4)
    capture = LoopbackCapture()
    kv = prefill_leg(cluster.prefill, body)["kv_transfer_params"]
    decode_leg(cluster.decode, body, kv)
    traffic = capture.stop()
    assert secrets_in(traffic, kv["release_token"], f"Bearer {API_KEY}") == [
        kv["release_token"],
        f"Bearer {API_KEY}",
    ]


def test_pd_over_tls_works_and_the_wire_holds_no_secret(
    tls_nodes: list[Server],
    certs: ClusterCerts,
    cluster: Cluster,  # noqa: F811
) -> None:
    prefill, decode = tls_nodes
    assert prefill.url.startswith("https://") and decode.url.startswith("https://")
    body = completion(make_prompt(30, seed=91), max_tokens=6)
    expected = token_ids(httpx.post(f"{cluster.single.url}/v1/completions", json=body,
                                    headers={"Authorization": f"Bearer {API_KEY}"},
                                    timeout=60).json())  # fmt: skip
    headers = {"Authorization": f"Bearer {API_KEY}"}
    ca = certs.config().client_context()
    with httpx.Client(verify=ca, headers=headers, timeout=60) as client:
        capture = LoopbackCapture()
        prefill_answer = client.post(
            f"{prefill.url}/v1/completions",
            json={**body, "kv_transfer_params": {"do_remote_decode": True}},
        ).json()
        kv = prefill_answer["kv_transfer_params"]
        # The decode node claims and finishes the handoff over HTTPS (/kv/*, cluster secret).
        answer = client.post(
            f"{decode.url}/v1/completions", json={**body, "kv_transfer_params": kv}
        ).json()
        traffic = capture.stop()
    assert token_ids(answer) == expected
    assert len(traffic) > 20_000  # the capture saw the exchange (encrypted)
    assert secrets_in(traffic, kv["release_token"], CLUSTER_SECRET, f"Bearer {API_KEY}") == []
    assert b"kv_transfer_params" not in traffic


def test_a_proxy_over_tls_serves_clients_with_the_ca_and_fails_others_cleanly(
    tls_nodes: list[Server], certs: ClusterCerts
) -> None:
    prefill, decode = tls_nodes
    tls = certs.config()
    args = proxy_args(prefill, decode)
    proxy = wait_healthy(launch(args, env=ENV, command="proxy", tls=tls), 60)
    try:
        body = completion(make_prompt(20, seed=92), max_tokens=4)
        headers = {"Authorization": f"Bearer {API_KEY}"}
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx.post(f"{proxy.url}/v1/completions", json=body, headers=headers, timeout=10)
        r = httpx.post(f"{proxy.url}/v1/completions", json=body, headers=headers, timeout=60,
                       verify=tls.client_context())  # fmt: skip
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    finally:
        stop_server(proxy)


def test_a_proxy_that_cannot_verify_the_nodes_refuses_them(tls_nodes: list[Server]) -> None:
    """Without the cluster CA the nodes' certificates do not verify: their health checks
    fail, they go down, and requests get a 503 in the OpenAI schema, never a leg sent to an
    unverified peer."""
    prefill, decode = tls_nodes
    args = proxy_args(prefill, decode)
    proxy = launch(args, env=ENV, command="proxy")
    try:
        deadline = time.monotonic() + 60
        while health_status(proxy.url) != 503:  # 0: not listening yet
            assert time.monotonic() < deadline, "the unverified nodes never went down"
            time.sleep(0.1)
        r = httpx.post(f"{proxy.url}/v1/completions", json=completion([5, 6, 7], max_tokens=2),
                       headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)  # fmt: skip
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
    finally:
        stop_server(proxy)
