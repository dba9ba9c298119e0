"""P/D windows that need nodes of their own: queued decode legs (S5), killed nodes (S10),
a restarted prefill node (S11), incompatible nodes (S13), preemption after a transfer
(S21), graceful shutdown (S22), UCX over TCP, and a randomized storm of cancellations."""

from __future__ import annotations

import contextlib
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from pdserve.launch import kill, stop_all
from tests.api.conftest import Server, free_port, start_server, start_servers, stop_server
from tests.disagg.conftest import (
    HEADERS,
    RELEASE_BOUND_S,
    Cluster,
    completion,
    decode_leg,
    kv_state,
    make_prompt,
    metric,
    node_args,
    post,
    prefill_leg,
    token_ids,
    wait_idle,
)

pytestmark = pytest.mark.timeout(180)
LEASE_S = 2.0  # the shared cluster's prefill node
CLAIM_TIMEOUT_S = 3.0
SLACK_S = 0.5
RELEASED_WITHIN_S = RELEASE_BOUND_S + 0.1


@contextlib.contextmanager
def node(model: Any, *extra: str, env: dict[str, str] | None = None) -> Iterator[Server]:
    with nodes((model, extra), env=env) as [server]:
        yield server


@contextlib.contextmanager
def nodes(
    *specs: tuple[Any, Sequence[str]], env: dict[str, str] | None = None
) -> Iterator[list[Server]]:
    """A node per (model, extra flags), started side by side, all stopped afterwards."""
    servers = start_servers(*(node_args(model, *extra) for model, extra in specs), env=env)
    try:
        yield servers
    finally:
        stop_all(servers)


def reference(cluster: Cluster, body: dict[str, Any]) -> list[int]:
    return token_ids(post(cluster.single, "/v1/completions", body).json())


def in_background(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = fn()
        except Exception as e:  # the test inspects it
            result["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


def wait_for(condition: Callable[[], bool], within_s: float, what: str) -> None:
    deadline = time.monotonic() + within_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def occupy(server: Server) -> tuple[threading.Thread, dict[str, Any]]:
    """A long plain request that keeps a `--max-num-seqs 1` node busy; abort it by id."""
    body = completion(make_prompt(8, seed=99), max_tokens=400, ignore_eos=True)
    headers = {**HEADERS, "X-Request-Id": "occupier"}
    return in_background(
        lambda: httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=60)
    )


def handoff_state(cluster: Cluster, kv: dict[str, Any]) -> str | None:
    rows = kv_state(cluster.prefill)["handoffs"]
    return next((r["state"] for r in rows if r["handoff_id"] == kv["remote_request_id"]), None)


# -- S5 and S10: a busy decode node --------------------------------------------------------


def test_s5_cancel_while_queued_on_the_decode_node(cluster: Cluster) -> None:
    # The only seat is taken by a decode leg whose read is held open for 1.5 s (a plain
    # 400-token request, the seat before, could end within the 0.5 s this test waits on an
    # idle machine: the queued leg then ran and answered).
    args = ("--role", "decode", "--max-num-seqs", "1", "--debug-kv-read-delay-s", "1.5")
    with node(cluster.model, *args) as busy:
        seat = completion(make_prompt(20, seed=98), max_tokens=4)
        seat_kv = prefill_leg(cluster.prefill, seat)["kv_transfer_params"]
        seated, _ = in_background(lambda: decode_leg(busy, seat, seat_kv))
        wait_for(lambda: kv_state(busy)["num_loading"] == 1, 10, "the seat to be taken")
        body = completion(make_prompt(40, seed=5), max_tokens=4)
        kv = prefill_leg(cluster.prefill, body)["kv_transfer_params"]
        with pytest.raises(httpx.TimeoutException):
            post(busy, "/v1/completions", {**body, "kv_transfer_params": kv}, timeout=0.5)
        assert kv_state(busy)["num_waiting"] <= 1
        # Released well before the 2 s lease (the seat's own handoff is still being read).
        wait_for(
            lambda: handoff_state(cluster, kv) is None,
            RELEASED_WITHIN_S + 0.2,
            "the queued leg's handoff to be released",
        )
        seated.join()
        wait_idle(busy, RELEASED_WITHIN_S)
        wait_idle(cluster.prefill, RELEASED_WITHIN_S)


def test_s10_killed_decode_node_with_a_queued_leg_frees_within_the_lease(cluster: Cluster) -> None:
    # The only seat is taken by a decode leg whose read is held open for 30 s.
    args = ("--role", "decode", "--max-num-seqs", "1", "--debug-kv-read-delay-s", "30")
    with node(cluster.model, *args) as busy:
        seat = completion(make_prompt(20, seed=99), max_tokens=4)
        seat_kv = prefill_leg(cluster.prefill, seat)["kv_transfer_params"]
        in_background(lambda: decode_leg(busy, seat, seat_kv))
        wait_for(lambda: kv_state(busy)["num_loading"] == 1, 10, "the seat to be taken")
        body = completion(make_prompt(40, seed=10), max_tokens=4)
        kv = prefill_leg(cluster.prefill, body)["kv_transfer_params"]
        in_background(lambda: decode_leg(busy, body, kv))
        wait_for(lambda: kv_state(busy)["num_waiting"] == 1, 10, "the leg to queue")
        time.sleep(LEASE_S)  # the queued leg's lease is renewed meanwhile
        states = [row["state"] for row in kv_state(cluster.prefill)["handoffs"]]
        assert "held" in states
        kill(busy)
        killed_at = time.monotonic()
        wait_idle(cluster.prefill, LEASE_S + SLACK_S)
        assert time.monotonic() - killed_at <= LEASE_S + SLACK_S


def test_s10_killed_decode_node_mid_read_frees_at_the_claim_deadline(cluster: Cluster) -> None:
    with node(cluster.model, "--role", "decode", "--debug-kv-read-delay-s", "30") as slow:
        body = completion(make_prompt(40, seed=11), max_tokens=4)
        kv = prefill_leg(cluster.prefill, body)["kv_transfer_params"]
        in_background(lambda: decode_leg(slow, body, kv))
        wait_for(lambda: handoff_state(cluster, kv) == "claimed", 10, "the claim")
        kill(slow)
        wait_idle(cluster.prefill, CLAIM_TIMEOUT_S + SLACK_S)
    assert httpx.get(f"{cluster.prefill.url}/health").status_code == 200


# -- S11, S13: a restarted or incompatible peer ---------------------------------------------


def test_s11_params_from_a_restarted_prefill_node_are_refused_then_recomputed(
    cluster: Cluster,
) -> None:
    port = free_port()
    args = node_args(cluster.model, "--role", "prefill", "--lease-s", "1")  # quick drain
    body = completion(make_prompt(50, seed=11), max_tokens=6)
    expected = reference(cluster, body)
    old = start_server(*args, port=port)
    try:
        warm = prefill_leg(old, body)["kv_transfer_params"]  # the decode node learns this node
        assert token_ids(decode_leg(cluster.decode, body, warm).json()) == expected
        stale = prefill_leg(old, body)["kv_transfer_params"]
    finally:
        stop_server(old, timeout_s=10)
    new = start_server(*args, port=port)
    try:
        response = decode_leg(cluster.decode, body, stale)
        assert response.status_code == 200 and token_ids(response.json()) == expected
        counters = kv_state(new)["handoff_counters"]
        assert counters.get("claim_stale_epoch", 0) + counters.get("renew_stale_epoch", 0) >= 1
        fresh = prefill_leg(new, body)["kv_transfer_params"]
        assert fresh["epoch"] != stale["epoch"]
        assert token_ids(decode_leg(cluster.decode, body, fresh).json()) == expected
        wait_idle(new, RELEASED_WITHIN_S)
        wait_idle(cluster.decode, RELEASED_WITHIN_S)
    finally:
        stop_server(new)


@pytest.fixture(scope="module")
def incompatible_decode_nodes(cluster: Cluster, tiny_model_dir: Any) -> Iterator[dict[str, Server]]:
    """A decode node per way of not matching the shared prefill node, started side by side."""
    mismatches = {
        "block_size": (["--block-size", "8"], cluster.model),
        "kv_cache_dtype": (["--kv-cache-dtype", "int8"], cluster.model),
        "model": ([], tiny_model_dir("qwen2")),
    }
    specs = [(model, ("--role", "decode", *extra)) for extra, model in mismatches.values()]
    with nodes(*specs) as servers:
        yield dict(zip(mismatches, servers, strict=True))


@pytest.mark.parametrize("mismatch", ["block_size", "kv_cache_dtype", "model"])
def test_s13_incompatible_nodes_fail_clearly_and_release(
    cluster: Cluster, incompatible_decode_nodes: dict[str, Server], mismatch: str
) -> None:
    other = incompatible_decode_nodes[mismatch]
    body = completion(make_prompt(40, seed=13), max_tokens=4)
    kv = prefill_leg(cluster.prefill, body)["kv_transfer_params"]
    response = decode_leg(other, body, kv)
    assert response.status_code == 502, response.text
    error = response.json()["error"]
    assert error["type"] == "kv_transfer_error" and "incompatible" in error["message"]
    expected_field = "model_fingerprint" if mismatch == "model" else mismatch
    assert expected_field in error["message"]
    wait_idle(cluster.prefill, RELEASED_WITHIN_S)
    wait_idle(other, RELEASED_WITHIN_S)
    assert httpx.get(f"{other.url}/health").status_code == 200


def test_int8_kv_pd_output_equals_its_single_node_in_fewer_bytes(cluster: Cluster) -> None:
    """Nodes with the 8-bit cache: P/D greedy output equals a single node's with the same
    format, and the decode node reads (head_dim + 4) / (4 head_dim) of float32's bytes for
    the same prompt (the scales travel inside the blocks)."""
    transfer_bytes = "pdserve_kv_transfer_bytes_total"
    int8 = ("--kv-cache-dtype", "int8")
    roles = [("--role", "prefill", *int8), ("--role", "decode", *int8), int8]
    with nodes(*[(cluster.model, role) for role in roles]) as [prefill, decode, single]:
        body = completion(make_prompt(70, seed=17), max_tokens=8)
        expected = token_ids(post(single, "/v1/completions", body).json())
        kv = prefill_leg(prefill, body)["kv_transfer_params"]
        assert token_ids(decode_leg(decode, body, kv).json()) == expected
        int8_bytes = metric(decode, transfer_bytes)
        wait_idle(prefill, RELEASED_WITHIN_S)

    before = metric(cluster.decode, transfer_bytes)
    kv = prefill_leg(cluster.prefill, body)["kv_transfer_params"]
    assert decode_leg(cluster.decode, body, kv).status_code == 200
    float32_bytes = metric(cluster.decode, transfer_bytes) - before
    head_dim = 16  # the tiny model's
    assert int8_bytes > 0 and int8_bytes / float32_bytes == (head_dim + 4) / (4 * head_dim)


# -- S21: preemption after the transfer -----------------------------------------------------


def test_s21_preempted_after_the_transfer_recomputes_without_a_second_read(
    cluster: Cluster,
) -> None:
    with node(cluster.model, "--role", "decode", "--num-kv-blocks", "14") as small:
        bodies = [
            completion(make_prompt(40, seed=21 + i), max_tokens=60, ignore_eos=True)
            for i in range(4)
        ]
        expected = [reference(cluster, b) for b in bodies]
        params = [prefill_leg(cluster.prefill, b)["kv_transfer_params"] for b in bodies]
        with ThreadPoolExecutor(4) as pool:
            responses = list(
                pool.map(lambda bk: decode_leg(small, *bk), zip(bodies, params, strict=True))
            )
        assert [token_ids(r.json()) for r in responses] == expected
        assert metric(small, "pdserve_preemptions") > 0
        assert metric(small, "pdserve_kv_transfer_seconds_count") == len(bodies)
        # Per-phase timing: one claim and one KV load per leg, a decode phase for each.
        assert metric(small, "pdserve_handoff_claim_seconds_count") == len(bodies)
        assert metric(small, "pdserve_request_kv_load_seconds_count") == len(bodies)
        assert metric(small, "vllm:request_decode_time_seconds_count") == len(bodies)
        wait_idle(small, RELEASED_WITHIN_S)
        wait_idle(cluster.prefill, RELEASED_WITHIN_S)


# -- S22: graceful shutdown -----------------------------------------------------------------


def test_s22_prefill_node_drains_its_handoffs_before_exiting(cluster: Cluster) -> None:
    prefill = start_server(*node_args(cluster.model, "--role", "prefill", "--lease-s", "20"))
    try:
        body = completion(make_prompt(40, seed=22), max_tokens=4)
        kv = prefill_leg(prefill, body)["kv_transfer_params"]
        prefill.process.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        refused = post(
            prefill, "/v1/completions", {**body, "kv_transfer_params": {"do_remote_decode": True}}
        )
        assert refused.status_code == 503
        assert prefill.process.poll() is None  # still holding the handoff for its reader
        assert decode_leg(cluster.decode, body, kv).status_code == 200
        start = time.monotonic()
        assert prefill.process.wait(10) == 0
        assert time.monotonic() - start < 5  # left once the handoff was read, not at 20 s
    finally:
        stop_server(prefill)
    wait_idle(cluster.decode, RELEASED_WITHIN_S)


def test_s22_decode_node_releases_unread_handoffs_when_stopped(cluster: Cluster) -> None:
    """The drain releases the queued legs' handoffs and answers those legs 503, streaming
    or not (never a 200 with an empty completion). The running request would finish; an
    admin abort ends it sooner, answered 409."""
    busy = start_server(
        *node_args(
            cluster.model, "--role", "decode", "--max-num-seqs", "1", "--drain-timeout-s", "10"
        )
    )
    try:
        occupier, occupied = occupy(busy)
        wait_for(lambda: kv_state(busy)["num_running"] == 1, 10, "the occupier to run")
        queued = []
        for seed, stream in ((23, False), (24, True)):
            body = completion(make_prompt(40, seed=seed), max_tokens=4, stream=stream)
            kv = prefill_leg(cluster.prefill, {**body, "stream": False})["kv_transfer_params"]
            queued.append(in_background(lambda b=body, k=kv: decode_leg(busy, b, k)))
        wait_for(lambda: kv_state(busy)["num_waiting"] == 2, 10, "the queued legs")
        busy.process.send_signal(signal.SIGTERM)
        wait_idle(cluster.prefill, RELEASED_WITHIN_S + 0.3)  # released at drain start
        for thread, result in queued:
            thread.join(10)
            response = result["value"]
            assert response.status_code == 503, response.text
            error = response.json()["error"]
            assert error["type"] == "service_unavailable" and "shutting down" in error["message"]
        assert busy.process.poll() is None  # still draining: the occupier runs
        post(busy, "/v1/abort_requests", {"request_ids": ["occupier"]})
        occupier.join(10)
        assert occupied["value"].status_code == 409, occupied["value"].text
        assert busy.process.wait(10) == 0
    finally:
        stop_server(busy)


# -- UCX over TCP (the cross-host path) ------------------------------------------------------


def test_pd_over_ucx_tcp_equals_the_single_node(cluster: Cluster) -> None:
    prefill, decode = start_servers(
        node_args(cluster.model, "--role", "prefill"),
        node_args(cluster.model, "--role", "decode"),
        env={"UCX_TLS": "tcp"},
    )
    try:
        for length in (17, 200):
            body = completion(make_prompt(length, seed=30), max_tokens=8)
            kv = prefill_leg(prefill, body)["kv_transfer_params"]
            response = decode_leg(decode, body, kv)
            assert token_ids(response.json()) == reference(cluster, body)
        assert metric(decode, "pdserve_kv_transfer_bytes_total") > 0
        wait_idle(prefill, RELEASED_WITHIN_S)
        wait_idle(decode, RELEASED_WITHIN_S)
    finally:
        stop_server(prefill)
        stop_server(decode)


# -- a randomized storm ------------------------------------------------------------------


def test_random_cancellations_and_failures_leak_nothing_and_corrupt_nothing(
    cluster: Cluster,
) -> None:
    """Concurrent P/D requests, each cancelled at a random moment or failing a random leg;
    afterwards nothing is held, no engine died, and every completed output is right."""
    rng = random.Random(1234)
    plans = [(i, rng.choice(PLANS), rng.choice([3, 17, 40, 90])) for i in range(36)]
    bodies = {i: completion(make_prompt(n, seed=100 + i), max_tokens=6) for i, _, n in plans}
    expected = {i: reference(cluster, b) for i, b in bodies.items()}

    def run(plan: tuple[int, Callable[..., list[int] | None], int]) -> tuple[int, Any]:
        i, action, _ = plan
        return i, action(cluster, bodies[i], random.Random(i))

    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(run, plans))
    completed = [(i, out) for i, out in results if out is not None]
    assert completed, "no request completed"
    for i, out in completed:
        assert out == expected[i], f"request {i} ({plans[i][1].__name__}) was corrupted"
    wait_idle(cluster.prefill, LEASE_S + SLACK_S)  # an answer lost in flight: lease
    wait_idle(cluster.decode, RELEASED_WITHIN_S)
    for server in (cluster.prefill, cluster.decode):
        assert httpx.get(f"{server.url}/health").status_code == 200


def _complete(cluster: Cluster, body: dict[str, Any], rng: random.Random) -> list[int] | None:
    kv = prefill_leg(cluster.prefill, body)["kv_transfer_params"]
    time.sleep(rng.uniform(0, 0.05))
    return token_ids(decode_leg(cluster.decode, body, kv).json())


def _cancel_prefill(cluster: Cluster, body: dict[str, Any], rng: random.Random) -> None:
    leg = {**body, "kv_transfer_params": {"do_remote_decode": True}}
    with contextlib.suppress(httpx.TimeoutException):
        post(cluster.prefill, "/v1/completions", leg, timeout=rng.uniform(0.001, 0.03))


def _release_between_legs(cluster: Cluster, body: dict[str, Any], rng: random.Random) -> None:
    kv = prefill_leg(cluster.prefill, body)["kv_transfer_params"]
    release = {"request_ids": [kv["remote_request_id"]], "release_token": kv["release_token"]}
    httpx.post(f"{cluster.prefill.url}/v1/abort_requests", json=release, timeout=10)


def _cancel_decode(cluster: Cluster, body: dict[str, Any], rng: random.Random) -> None:
    kv = prefill_leg(cluster.prefill, body)["kv_transfer_params"]
    with contextlib.suppress(httpx.TimeoutException):
        post(
            cluster.decode,
            "/v1/completions",
            {**body, "kv_transfer_params": kv},
            timeout=rng.uniform(0.001, 0.05),
        )


def _bad_decode_leg(cluster: Cluster, body: dict[str, Any], rng: random.Random) -> None:
    kv = prefill_leg(cluster.prefill, body)["kv_transfer_params"]
    assert decode_leg(cluster.decode, {**body, "top_p": 7}, kv).status_code == 400


def _unreachable_control(cluster: Cluster, body: dict[str, Any], rng: random.Random) -> list[int]:
    kv = prefill_leg(cluster.prefill, body)["kv_transfer_params"]
    return token_ids(decode_leg(cluster.decode, body, {**kv, "remote_port": 9}).json())


PLANS = [
    _complete,
    _complete,
    _cancel_prefill,
    _release_between_legs,
    _cancel_decode,
    _bad_decode_leg,
    _unreachable_control,
]
