"""P/D end to end over HTTP and NIXL, one test per failure window of DESIGN §3 that lives
on the two nodes (the proxy's windows, S1/S3/S17/S19, are the proxy's tests).

Every test ends with both nodes holding nothing (`wait_idle`) within the design's bound.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from typing import Any

import httpx
import pytest

from tests.api.conftest import start_server, stop_server
from tests.disagg.conftest import (
    BLOCK_SIZE,
    HEADERS,
    POLL_SLACK_S,
    RELEASE_BOUND_S,
    Cluster,
    completion,
    decode_leg,
    is_idle,
    kv_state,
    make_prompt,
    metric,
    node_args,
    post,
    prefill_leg,
    token_ids,
    wait_idle,
)

pytestmark = pytest.mark.timeout(120)
RELEASED_WITHIN_S = RELEASE_BOUND_S + POLL_SLACK_S


def reference(cluster: Cluster, body: dict[str, Any]) -> list[int]:
    response = post(cluster.single, "/v1/completions", body)
    assert response.status_code == 200, response.text
    return token_ids(response.json())


def assert_both_idle(cluster: Cluster, within_s: float = RELEASED_WITHIN_S) -> None:
    wait_idle(cluster.prefill, within_s)
    wait_idle(cluster.decode, within_s)


# -- the happy path ---------------------------------------------------------------------


@pytest.mark.parametrize("length", [1, 5, 16, 17, 100, 300])
def test_pd_greedy_output_equals_the_single_node(cluster: Cluster, length: int) -> None:
    body = completion(make_prompt(length, seed=1), max_tokens=12)
    expected = reference(cluster, body)
    bytes_before = metric(cluster.decode, "pdserve_kv_transfer_bytes_total")

    first = prefill_leg(cluster.prefill, body)
    kv = first["kv_transfer_params"]
    assert kv["remote_num_tokens"] == length
    assert len(kv["remote_block_ids"]) == -(-length // BLOCK_SIZE)
    assert kv["first_token_id"] == expected[0] == token_ids(first)[0]
    assert kv_state(cluster.prefill)["num_held_blocks"] == len(kv["remote_block_ids"])

    response = decode_leg(cluster.decode, body, kv)
    assert response.status_code == 200, response.text
    assert token_ids(response.json()) == expected
    read = metric(cluster.decode, "pdserve_kv_transfer_bytes_total") - bytes_before
    assert read > 0  # every prompt position's KV, the last one's too (design §8)
    assert_both_idle(cluster)


def test_pd_streaming_decode_leg_equals_the_single_node(cluster: Cluster) -> None:
    body = completion(make_prompt(40, seed=2), max_tokens=10)
    expected = reference(cluster, body)
    kv = prefill_leg(cluster.prefill, body)["kv_transfer_params"]
    streamed: list[int] = []
    stream_body = {**body, "stream": True, "kv_transfer_params": kv}
    with httpx.stream(
        "POST",
        f"{cluster.decode.url}/v1/completions",
        json=stream_body,
        headers=HEADERS,
        timeout=60,
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                streamed += json.loads(line[6:])["choices"][0]["token_ids"]
    assert streamed == expected
    assert_both_idle(cluster)


def test_a_handoff_is_listed_with_its_state_blocks_and_deadline(cluster: Cluster) -> None:
    body = completion(make_prompt(33, seed=3))
    kv = prefill_leg(cluster.prefill, body)["kv_transfer_params"]
    [row] = kv_state(cluster.prefill)["handoffs"]
    assert row["handoff_id"] == kv["remote_request_id"] and row["state"] == "held"
    assert row["num_blocks"] == 3 and 0 < row["time_left_s"] <= 2
    assert decode_leg(cluster.decode, body, kv).status_code == 200
    assert_both_idle(cluster)


# -- cancellations and rejections -------------------------------------------------------


def test_s2_cancelled_prefill_legs_hold_nothing(cluster: Cluster) -> None:
    """Clients leaving at every moment of a prefill leg: whatever state each reached, no
    block stays held past the bound (or, if the answer was already on its way when the
    client left, past the lease)."""
    body = completion(make_prompt(400, seed=4), kv_transfer_params={"do_remote_decode": True})
    for timeout_s in (0.001, 0.003, 0.006, 0.01, 0.02, 0.04):
        with contextlib.suppress(httpx.TimeoutException):
            post(cluster.prefill, "/v1/completions", body, timeout=timeout_s)
    wait_idle(cluster.prefill, 2.0 + 0.5)  # the lease bounds the answer-in-flight case


def test_s4_decode_node_rejecting_a_leg_releases_its_handoff(cluster: Cluster) -> None:
    body = completion(make_prompt(20, seed=5))
    for bad in ({"temperature": -1}, {"max_tokens": 5000}, {"model": "no-such-model"}):
        kv = prefill_leg(cluster.prefill, body)["kv_transfer_params"]
        response = decode_leg(cluster.decode, {**body, **bad}, kv)
        assert 400 <= response.status_code < 500 and "error" in response.json()
        wait_idle(cluster.prefill, RELEASED_WITHIN_S)
    assert metric(cluster.prefill, 'pdserve_handoffs_released_total{reason="rejected"}') >= 3


def test_s6_cancel_while_the_decode_node_reads(cluster: Cluster) -> None:
    """The read is held open (debug delay): the client leaves mid-read; the decode node
    keeps its destination blocks until the read has ended, then both sides free them."""
    slow = start_server(
        *node_args(cluster.model, "--role", "decode", "--debug-kv-read-delay-s", "1.0")
    )
    try:
        body = completion(make_prompt(64, seed=6), max_tokens=4)
        kv = prefill_leg(cluster.prefill, body)["kv_transfer_params"]
        with pytest.raises(httpx.TimeoutException):  # the client leaves mid-read
            post(slow, "/v1/completions", {**body, "kv_transfer_params": kv}, timeout=0.4)
        time.sleep(0.1)
        during = kv_state(slow)
        assert during["num_held_blocks"] > 0  # aborted, but the read may still land
        assert kv_state(cluster.prefill)["handoffs"][0]["state"] == "claimed"
        wait_idle(slow, 2.0)
        wait_idle(cluster.prefill, RELEASED_WITHIN_S)
        assert slow.process.poll() is None
    finally:
        stop_server(slow)


def test_s7_cancel_mid_generation_frees_the_decode_node(cluster: Cluster) -> None:
    body = completion(make_prompt(50, seed=7), max_tokens=400, ignore_eos=True, stream=True)
    kv = prefill_leg(cluster.prefill, {**body, "stream": False})["kv_transfer_params"]
    with httpx.stream(
        "POST",
        f"{cluster.decode.url}/v1/completions",
        headers=HEADERS,
        json={**body, "kv_transfer_params": kv},
        timeout=60,
    ) as response:
        lines = response.iter_lines()
        for _ in range(6):
            next(lines)
        assert kv_state(cluster.prefill)["num_handoffs"] == 0  # read done: already released
    assert_both_idle(cluster)


def test_s8_done_and_release_twice_are_answered_and_ignored(cluster: Cluster) -> None:
    kv = prefill_leg(cluster.prefill, completion(make_prompt(20, seed=8)))["kv_transfer_params"]
    ref = {
        "handoff_id": kv["remote_request_id"],
        "release_token": kv["release_token"],
        "epoch": kv["epoch"],
        "block_ids": kv["remote_block_ids"],
    }
    outcomes = [
        post(cluster.prefill, f"/kv/{path}", ref).json()["outcome"]
        for path in ("claim", "done", "done", "release", "failed", "claim")
    ]
    assert outcomes == [
        "ok",
        "ok",
        "already_released",
        "already_released",
        "already_released",
        "already_released",
    ]
    counters = kv_state(cluster.prefill)["handoff_counters"]
    assert counters["done_late"] >= 1 and counters["release_late"] >= 1
    wait_idle(cluster.prefill, RELEASED_WITHIN_S)
    assert httpx.get(f"{cluster.prefill.url}/health").status_code == 200


def test_s9_lease_expired_before_the_decode_leg_recomputes_correctly(cluster: Cluster) -> None:
    body = completion(make_prompt(48, seed=9), max_tokens=8)
    expected = reference(cluster, body)
    kv = prefill_leg(cluster.prefill, body)["kv_transfer_params"]
    wait_idle(cluster.prefill, 2.0 + 0.5)  # lease 2 s, nobody renewed it
    response = decode_leg(cluster.decode, body, kv)
    assert response.status_code == 200 and token_ids(response.json()) == expected
    assert_both_idle(cluster)


@pytest.mark.parametrize("blocks", ["other", "too_few"])
def test_decode_legs_naming_other_blocks_read_nothing_and_recompute(
    cluster: Cluster, blocks: str
) -> None:
    """Found by the HTTP properties: the decode node read whatever blocks the leg's params
    named (block 0 here: free, or another request's) and answered with the wrong tokens;
    blocks too few for the prompt were a 502. Now the claim names the blocks and the
    prefill node refuses others; either way the decode node recomputes and releases."""
    body = completion(make_prompt(40, seed=21), max_tokens=8)  # three blocks
    expected = reference(cluster, body)
    kv = prefill_leg(cluster.prefill, body)["kv_transfer_params"]
    named = [b + 1 for b in kv["remote_block_ids"]] if blocks == "other" else [0]
    refused_before = kv_state(cluster.prefill)["handoff_counters"].get("claim_wrong_blocks", 0)
    bytes_before = metric(cluster.decode, "pdserve_kv_transfer_bytes_total")
    response = decode_leg(cluster.decode, body, {**kv, "remote_block_ids": named})
    assert response.status_code == 200 and token_ids(response.json()) == expected
    assert metric(cluster.decode, "pdserve_kv_transfer_bytes_total") == bytes_before
    refused = kv_state(cluster.prefill)["handoff_counters"].get("claim_wrong_blocks", 0)
    assert refused == refused_before + (blocks == "other")
    assert_both_idle(cluster, 1.0)  # released by the decode node, not by the 2 s lease


def test_s12_unreachable_control_channel_fails_closed(cluster: Cluster) -> None:
    """The decode node cannot reach the prefill node's control port: it never reads (no
    claim) and recomputes; the prefill node frees the handoff when its lease ends."""
    body = completion(make_prompt(48, seed=12), max_tokens=8)
    expected = reference(cluster, body)
    kv = prefill_leg(cluster.prefill, body)["kv_transfer_params"]
    dead_port = {**kv, "remote_port": 9}  # discard port: nothing listens
    bytes_before = metric(cluster.decode, "pdserve_kv_transfer_bytes_total")
    response = decode_leg(cluster.decode, body, dead_port)
    assert response.status_code == 200 and token_ids(response.json()) == expected
    assert metric(cluster.decode, "pdserve_kv_transfer_bytes_total") == bytes_before
    assert kv_state(cluster.prefill)["handoffs"][0]["state"] == "held"
    wait_idle(cluster.prefill, 2.0 + 0.5)
    wait_idle(cluster.decode, RELEASED_WITHIN_S)


def test_s14_duplicate_client_ids_get_their_own_handoffs(cluster: Cluster) -> None:
    body = completion(make_prompt(20, seed=14))
    headers = {**HEADERS, "X-Request-Id": "same-id"}
    legs = [
        httpx.post(
            f"{cluster.prefill.url}/v1/completions",
            headers=headers,
            timeout=30,
            json={**body, "kv_transfer_params": {"do_remote_decode": True}},
        ).json()
        for _ in range(2)
    ]
    a, b = (leg["kv_transfer_params"] for leg in legs)
    assert a["remote_request_id"] != b["remote_request_id"]
    assert a["release_token"] != b["release_token"]
    release = {"request_ids": [a["remote_request_id"]], "release_token": a["release_token"]}
    outcome = httpx.post(f"{cluster.prefill.url}/v1/abort_requests", json=release, timeout=5)
    assert outcome.json()["results"] == [{"id": a["remote_request_id"], "outcome": "released"}]
    [left] = kv_state(cluster.prefill)["handoffs"]
    assert left["handoff_id"] == b["remote_request_id"]
    assert decode_leg(cluster.decode, body, b).status_code == 200
    n2 = post(
        cluster.prefill,
        "/v1/completions",
        {**body, "n": 2, "kv_transfer_params": {"do_remote_decode": True}},
    )
    assert n2.status_code == 400 and n2.json()["error"]["param"] == "n"
    assert_both_idle(cluster)


def test_s15_abort_releases_a_finished_request_by_its_client_id(cluster: Cluster) -> None:
    body = completion(make_prompt(30, seed=15), kv_transfer_params={"do_remote_decode": True})
    headers = {**HEADERS, "X-Request-Id": "client-15"}
    httpx.post(f"{cluster.prefill.url}/v1/completions", json=body, headers=headers, timeout=30)
    assert kv_state(cluster.prefill)["num_held_blocks"] == 2
    start = time.monotonic()
    response = post(cluster.prefill, "/v1/abort_requests", {"request_ids": ["client-15"]})
    assert response.json()["results"] == [{"id": "client-15", "outcome": "released"}]
    wait_idle(cluster.prefill, RELEASED_WITHIN_S)
    assert time.monotonic() - start < RELEASED_WITHIN_S + 0.1
    again = post(cluster.prefill, "/v1/abort_requests", {"request_ids": ["client-15"]})
    assert again.json()["results"] == [{"id": "client-15", "outcome": "already_released"}]


def test_s16_abort_of_unknown_ids_and_bad_bodies(cluster: Cluster) -> None:
    kv = prefill_leg(cluster.prefill, completion(make_prompt(20, seed=16)))["kv_transfer_params"]
    ok = post(cluster.prefill, "/v1/abort_requests", {"request_ids": ["nope", "ho-nope"]})
    assert [r["outcome"] for r in ok.json()["results"]] == ["not_found", "not_found"]
    for bad in ({}, {"request_ids": []}, {"request_ids": "x"}, {"request_ids": [1]}):
        response = post(cluster.prefill, "/v1/abort_requests", bad)
        assert response.status_code == 400 and response.json()["error"]["param"] == "request_ids"
    raw = httpx.post(
        f"{cluster.prefill.url}/v1/abort_requests", content=b"{nope", headers=HEADERS, timeout=5
    )
    assert raw.status_code == 400
    assert kv_state(cluster.prefill)["num_handoffs"] == 1  # untouched
    assert decode_leg(cluster.decode, completion(make_prompt(20, seed=16)), kv).status_code == 200
    assert_both_idle(cluster)


def test_s18_prefill_token_hitting_a_stop_condition_still_hands_off(cluster: Cluster) -> None:
    prompt = make_prompt(25, seed=18)
    first_token = reference(cluster, completion(prompt, max_tokens=1))[0]
    body = completion(prompt, max_tokens=8, stop_token_ids=[first_token])
    expected = reference(cluster, body)
    assert expected == [first_token]  # one node stops at once
    leg = prefill_leg(cluster.prefill, body)  # ends on its one token, its KV held anyway
    assert leg["choices"][0]["finish_reason"] == "stop"
    assert leg["kv_transfer_params"]["first_token_id"] == first_token
    response = decode_leg(cluster.decode, body, leg["kv_transfer_params"])
    assert token_ids(response.json()) == expected
    assert response.json()["choices"][0]["finish_reason"] == "stop"
    assert_both_idle(cluster)


def test_s20_release_and_abort_without_credentials_are_refused(cluster: Cluster) -> None:
    body = completion(make_prompt(20, seed=20))
    kv = prefill_leg(cluster.prefill, body)["kv_transfer_params"]
    other = prefill_leg(cluster.prefill, completion(make_prompt(21, seed=20)))["kv_transfer_params"]
    url = f"{cluster.prefill.url}/v1/abort_requests"
    ids = {"request_ids": [kv["remote_request_id"]]}
    assert httpx.post(url, json=ids, timeout=5).status_code == 401
    bad_key = {"Authorization": "Bearer wrong"}
    assert httpx.post(url, json=ids, headers=bad_key, timeout=5).status_code == 401
    foreign = {**ids, "release_token": other["release_token"]}
    assert httpx.post(url, json=foreign, timeout=5).status_code == 403
    unknown = {"request_ids": ["cmpl-anything"], "release_token": kv["release_token"]}
    assert httpx.post(url, json=unknown, timeout=5).status_code == 403  # found by bench chaos
    ref = {"handoff_id": kv["remote_request_id"], "release_token": kv["release_token"]}
    assert httpx.post(f"{cluster.prefill.url}/kv/release", json=ref, timeout=5).status_code == 401
    wrong = {**ref, "release_token": other["release_token"]}
    assert post(cluster.prefill, "/kv/release", wrong).json()["outcome"] == "bad_token"
    assert kv_state(cluster.prefill)["num_handoffs"] == 2  # nothing released
    for params in (kv, other):
        assert decode_leg(cluster.decode, body, params).status_code == 200
    assert_both_idle(cluster)


def test_s14_a_leg_with_its_own_token_is_released_by_it_and_its_request_id(
    cluster: Cluster,
) -> None:
    """The proxy's way to let go of an attempt whose answer it never read: the token it
    chose, with the X-Request-Id it sent. Client ids repeat; the token picks the handoff."""
    body = completion(make_prompt(20, seed=14))
    url = f"{cluster.prefill.url}/v1/completions"
    headers = {**HEADERS, "X-Request-Id": "same-id"}
    tokens = ["A" * 22, "b-_" * 10]
    legs = [
        {**body, "kv_transfer_params": {"do_remote_decode": True, "release_token": t}}
        for t in tokens
    ]
    answers = [httpx.post(url, headers=headers, json=leg, timeout=30).json() for leg in legs]
    assert [a["kv_transfer_params"]["release_token"] for a in answers] == tokens
    release = {"request_ids": ["same-id"], "release_token": tokens[0]}
    outcome = httpx.post(f"{cluster.prefill.url}/v1/abort_requests", json=release, timeout=5)
    assert outcome.json()["results"] == [{"id": "same-id", "outcome": "released"}]
    [left] = kv_state(cluster.prefill)["handoffs"]
    assert left["handoff_id"] == answers[1]["kv_transfer_params"]["remote_request_id"]
    assert decode_leg(cluster.decode, body, answers[1]["kv_transfer_params"]).status_code == 200
    for weak in ("short", "x" * 129, "has space" * 3, 7):
        leg = {**body, "kv_transfer_params": {"do_remote_decode": True, "release_token": weak}}
        refused = httpx.post(url, headers=headers, json=leg, timeout=30)
        assert refused.status_code == 400, refused.text
        assert "release_token" in refused.json()["error"]["param"]
    assert_both_idle(cluster)


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_aborted_by_the_admin_is_an_error_never_a_completion(
    cluster: Cluster, stream: bool
) -> None:
    """An operator's abort answers 409 `request_aborted`; a stream that already sent
    tokens ends with that error event, then [DONE]. Never a 200 that looks finished.

    The tiny model writes its 400 tokens in well under a second, so on a busy machine the
    request can finish before the abort lands. That is a lost race, not a failure: the
    request then must have finished normally, and we try again with a new id. (CI once
    saw `not_found` here: the old loop aborted again on each blank line between events.)"""
    body = completion(make_prompt(10, seed=21), max_tokens=400, ignore_eos=True, stream=stream)
    url = f"{cluster.single.url}/v1/completions"

    def abort(request_id: str) -> str:
        answer = post(cluster.single, "/v1/abort_requests", {"request_ids": [request_id]})
        [result] = answer.json()["results"]
        assert result["id"] == request_id
        outcome: str = result["outcome"]
        return outcome

    def attempt(request_id: str) -> tuple[str, dict[str, Any] | None]:
        """(the abort's outcome, the error the client saw, or None if it finished)."""
        headers = {**HEADERS, "X-Request-Id": request_id}
        with httpx.Client(timeout=30) as client:
            if stream:
                events: list[str] = []
                with client.stream("POST", url, json=body, headers=headers) as response:
                    assert response.status_code == 200
                    for line in response.iter_lines():
                        if not line:  # the blank line between events
                            continue
                        events.append(line)
                        if len(events) == 1:  # a token was sent: the request is running
                            outcome = abort(request_id)
                assert events[-1] == "data: [DONE]"
                chunks = [json.loads(e[6:]) for e in events[:-1]]
                if "error" not in chunks[-1]:
                    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
                    return outcome, None
                assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
                return outcome, chunks[-1]["error"]
            result: dict[str, Any] = {}
            thread = threading.Thread(
                target=lambda: result.update(r=client.post(url, json=body, headers=headers))
            )
            thread.start()
            deadline = time.monotonic() + 10
            while thread.is_alive() and kv_state(cluster.single)["num_running"] == 0:
                assert time.monotonic() < deadline, "the request never ran"
                time.sleep(0.005)
            outcome = abort(request_id)
            thread.join()
            if result["r"].status_code == 200:
                assert result["r"].json()["choices"][0]["finish_reason"] == "length"
                return outcome, None
            assert result["r"].status_code == 409, result["r"].text
            return outcome, result["r"].json()["error"]

    for n in range(5):
        outcome, error = attempt(f"long-{n}")
        if error is None:  # finished before the abort arrived
            assert outcome == "not_found"
            continue
        assert outcome == "aborted", (outcome, error)
        assert (error["type"], error["code"]) == ("request_aborted", 409)
        assert "aborted by the server" in error["message"]
        break
    else:
        pytest.fail("the request finished before the abort five times in a row")
    wait_idle(cluster.single, RELEASED_WITHIN_S)


def test_legs_on_the_wrong_role_are_400(cluster: Cluster) -> None:
    body = completion(make_prompt(5))
    wrong = [
        (cluster.decode, {"do_remote_decode": True}),
        (cluster.single, {"do_remote_decode": True}),
        (cluster.prefill, {"do_remote_prefill": True, "remote_request_id": "x"}),
        (cluster.decode, {"do_remote_prefill": True}),  # lacks the remote fields
    ]
    for server, params in wrong:
        response = post(server, "/v1/completions", {**body, "kv_transfer_params": params})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "kv_transfer_params"
    streaming_leg = {**body, "stream": True, "kv_transfer_params": {"do_remote_decode": True}}
    stream = post(cluster.prefill, "/v1/completions", streaming_leg)
    assert stream.status_code == 400
    assert all(is_idle(kv_state(s)) for s in (cluster.prefill, cluster.decode, cluster.single))


@pytest.mark.parametrize(
    "prompt_fields",
    [{"prompt": ""}, {"prompt": [[1, 2], [3]]}, {"prompt": [1, 2], "echo": True}],
    ids=["empty", "batched", "echo"],
)
def test_a_prefill_leg_with_an_unusable_prompt_is_a_400_and_holds_nothing(
    cluster: Cluster, prompt_fields: dict[str, Any]
) -> None:
    """Found by the HTTP properties: the prompt was checked after the handoff was minted,
    so these legs were a 500 and left a PREFILLING handoff without a deadline (a drain
    then waited for it until --drain-timeout-s)."""
    body = {"max_tokens": 4, **prompt_fields, "kv_transfer_params": {"do_remote_decode": True}}
    response = post(cluster.prefill, "/v1/completions", body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] in ("prompt", "echo")
    assert kv_state(cluster.prefill)["num_handoffs"] == 0


def test_chat_on_a_model_without_a_tokenizer_is_a_400(cluster: Cluster) -> None:
    """Found by the HTTP properties: a 500 `internal_error`."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for server in (cluster.single, cluster.prefill):
        response = post(server, "/v1/chat/completions", body)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "messages"
    assert is_idle(kv_state(cluster.prefill)) and is_idle(kv_state(cluster.single))
