"""The vLLM connector's protocol halves without vLLM: `Producer` (prefill: handoff table,
control endpoint, what each step frees) and `Consumer` (decode: claim, renewals, releases),
talking over real HTTP on loopback. vLLM's requests are stand-ins with the two attributes
the connector reads; vLLM itself runs in `test_vllm_nodes.py` (`make test-vllm`).

A Producer's output to vLLM is what it writes into `reqs_to_send` each step: a deadline in
the past frees the request's blocks in that step, a later one re-arms vLLM's own lease.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from pdserve.disagg.handoff import HandoffState
from pdserve.errors import ConfigError
from pdserve.vllm.consumer import ClaimState, Consumer
from pdserve.vllm.producer import ARM_AHEAD_S, Producer, client_request_id, flat_block_ids
from pdserve.vllm.settings import Settings
from pdserve.vllm.signals import SignalFilter

SECRET = "cluster-secret"
TOKEN = "T" * 32
DEADLINE_S = 3.0


@dataclass
class FakeRequest:
    """What the connector reads of vLLM's `Request`."""

    request_id: str
    kv_transfer_params: dict[str, Any] | None = field(default_factory=dict)


def vllm_params(request_id: str, blocks: list[int]) -> dict[str, Any]:
    """vLLM's own answer params for a held prefill (NixlPullConnectorScheduler's)."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [blocks],
        "remote_request_id": request_id,
        "remote_num_tokens": 4 * len(blocks),
    }


@pytest.fixture
def make_producer() -> Iterator[Callable[..., Producer]]:
    made: list[Producer] = []

    def make(**settings: Any) -> Producer:
        producer = Producer(Settings(cluster_secret=SECRET, **settings), "127.0.0.1", 30.0)
        made.append(producer)
        return producer

    yield make
    for producer in made:
        producer.close()


def hold(
    producer: Producer, request_id: str = "cmpl-abc-0-0123abcd", token: str = TOKEN
) -> dict[str, Any]:
    """A prefill leg through `begin` and `finished`: the answer's params."""
    request = FakeRequest(request_id, {"do_remote_decode": True, "release_token": token})
    producer.begin(request)
    params = producer.finished(request, True, vllm_params(request_id, [3, 7]))
    assert params is not None
    return params


def step(producer: Producer) -> dict[str, float]:
    """One engine step's `reqs_to_send` entries (scheduler clock 1000.0)."""
    reqs_to_send: dict[str, float] = {}
    producer.free_released(reqs_to_send, 1000.0)
    return reqs_to_send


def freed(reqs_to_send: dict[str, float]) -> set[str]:
    return {r for r, deadline in reqs_to_send.items() if deadline < 1000.0}


def abort(
    producer: Producer, body: dict[str, Any], headers: dict[str, str] | None = None
) -> httpx.Response:
    return httpx.post(f"{producer.control_url}/v1/abort_requests", json=body, headers=headers)


# -- prefill side ----------------------------------------------------------------------------


def test_a_held_prefill_answers_with_its_handoff_and_where_to_release_it(
    make_producer: Callable[..., Producer],
) -> None:
    producer = make_producer()
    params = hold(producer)
    assert params["release_token"] == TOKEN  # the proxy's, so it can release unanswered legs
    assert params["control_url"] == producer.control_url
    assert params["remote_request_id"] == "cmpl-abc-0-0123abcd"  # vLLM's own stay as they are
    handoff = producer.table.get(params["handoff_id"])
    assert handoff is not None and handoff.state is HandoffState.HELD
    assert handoff.block_ids == (3, 7) and handoff.client_request_id == "abc"
    assert freed(step(producer)) == set()


def test_a_hybrid_model_s_groups_hold_their_blocks_and_never_the_null_block() -> None:
    # Gemma 3's layout in vLLM: one group per kind of layer; a sliding group names the null
    # block (0) for each block that fell out of its window.
    groups = [[0, 0, 13], [0, 0, 14], [11, 12, 18]]
    assert flat_block_ids(groups) == (13, 14, 11, 12, 18)
    assert flat_block_ids(None) == ()


def test_s3_a_release_by_token_frees_the_blocks_at_the_next_step(
    make_producer: Callable[..., Producer],
) -> None:
    producer = make_producer()
    params = hold(producer)
    response = abort(producer, {"request_ids": [params["handoff_id"]], "release_token": TOKEN})
    assert response.status_code == 200
    assert response.json()["results"] == [{"id": params["handoff_id"], "outcome": "released"}]
    assert freed(step(producer)) == {"cmpl-abc-0-0123abcd"}
    assert freed(step(producer)) == set()  # once
    producer.sent({"cmpl-abc-0-0123abcd"})  # vLLM reports it freed (as an expiry, its way)
    admin = {"Authorization": f"Bearer {SECRET}"}
    report = httpx.get(f"{producer.control_url}/kv/handoffs", headers=admin).json()
    assert report["freed_total"] == {"aborted": 1}  # pdserve's record tells the two apart


def test_a_release_names_the_leg_by_its_x_request_id_too(
    make_producer: Callable[..., Producer],
) -> None:
    """The proxy releases a leg whose answer it never read by the leg's X-Request-Id."""
    producer = make_producer()
    hold(producer, "cmpl-client-7-0-00ff00ff")
    response = abort(producer, {"request_ids": ["client-7"], "release_token": TOKEN})
    assert response.json()["results"][0]["outcome"] == "released"
    assert freed(step(producer)) == {"cmpl-client-7-0-00ff00ff"}


def test_s20_a_release_without_the_token_or_with_another_is_refused(
    make_producer: Callable[..., Producer],
) -> None:
    producer = make_producer()
    params = hold(producer)
    other = hold(producer, "cmpl-other-0-11112222", token="U" * 32)
    ids = {"request_ids": [params["handoff_id"]]}
    assert abort(producer, ids).status_code == 401
    assert abort(producer, {**ids, "release_token": other["release_token"]}).status_code == 403
    forged = {"Authorization": "Bearer wrong"}
    assert abort(producer, ids, forged).status_code == 401
    kv = httpx.post(
        f"{producer.control_url}/kv/release",
        json={"handoff_id": params["handoff_id"], "release_token": TOKEN},
    )
    assert kv.status_code == 401  # /kv/* needs the cluster credential
    assert freed(step(producer)) == set()
    assert producer.table.get(params["handoff_id"]).state is HandoffState.HELD  # type: ignore[union-attr]


def test_s15_the_admin_credential_aborts_a_finished_held_request(
    make_producer: Callable[..., Producer],
) -> None:
    producer = make_producer()
    params = hold(producer)
    admin = {"Authorization": f"Bearer {SECRET}"}
    response = abort(producer, {"request_ids": [params["remote_request_id"]]}, admin)
    assert response.json()["results"][0]["outcome"] == "released"
    assert freed(step(producer)) == {params["remote_request_id"]}


def test_an_unrenewed_lease_frees_the_blocks(make_producer: Callable[..., Producer]) -> None:
    producer = make_producer(lease_s=0.2)
    hold(producer)
    assert freed(step(producer)) == set()
    time.sleep(0.25)
    assert freed(step(producer)) == {"cmpl-abc-0-0123abcd"}


def test_a_handoff_released_while_prefilling_is_freed_once_vllm_holds_it(
    make_producer: Callable[..., Producer],
) -> None:
    """S2: the proxy's client left while the prefill ran; vLLM still finishes it and holds
    the blocks: they go at the next step."""
    producer = make_producer()
    request = FakeRequest(
        "cmpl-early-0-0badcafe", {"do_remote_decode": True, "release_token": TOKEN}
    )
    producer.begin(request)
    assert abort(producer, {"request_ids": ["early"], "release_token": TOKEN}).status_code == 200
    assert freed(step(producer)) == set()  # nothing held yet
    producer.finished(request, True, vllm_params(request.request_id, [5]))
    assert freed(step(producer)) == {request.request_id}


def test_an_aborted_prefill_ends_its_handoff_and_frees_nothing_itself(
    make_producer: Callable[..., Producer],
) -> None:
    producer = make_producer()
    request = FakeRequest("cmpl-gone-0-12345678", {"do_remote_decode": True})
    producer.begin(request)
    assert producer.finished(request, False, None) is None  # vLLM frees an aborted request
    assert producer.table.num_live == 0 and step(producer) == {}


def test_vllm_s_lease_is_kept_behind_the_table_s(make_producer: Callable[..., Producer]) -> None:
    """vLLM frees a held request at its own deadline: renewals that carry the table's
    lease past it re-arm it, so the table decides."""
    producer = make_producer(lease_s=25.0)
    params = hold(producer)
    [(request_id, deadline)] = step(producer).items()  # 25 s left + 10 s > vLLM's 30 s
    assert request_id == params["remote_request_id"]
    assert deadline == pytest.approx(1000.0 + 25.0 + ARM_AHEAD_S, abs=0.5)
    assert step(producer) == {}  # armed far enough ahead now


def test_a_read_s_notification_ends_a_claimed_handoff(
    make_producer: Callable[..., Producer],
) -> None:
    producer = make_producer()
    params = hold(producer)
    consumer = Consumer(Settings(cluster_secret=SECRET))
    try:
        request = FakeRequest("d-1", dict(params))
        consumer.track(request)
        assert wait_claim(consumer, request) is ClaimState.GRANTED
        handoff = producer.table.get(params["handoff_id"])
        assert handoff is not None and handoff.state is HandoffState.CLAIMED
        # A release while the read runs waits for it (invariant 2).
        late = abort(producer, {"request_ids": [params["handoff_id"]], "release_token": TOKEN})
        assert late.json()["results"][0]["outcome"] == "released"
        assert freed(step(producer)) == set()
        producer.sent({params["remote_request_id"]})  # vLLM freed the blocks after the read
        assert handoff.state is HandoffState.RELEASED
        assert freed(step(producer)) == set()  # nothing to free twice
    finally:
        consumer.close()


# -- decode side -----------------------------------------------------------------------------


def wait_claim(consumer: Consumer, request: FakeRequest) -> ClaimState | None:
    deadline = time.monotonic() + DEADLINE_S
    while (state := consumer.claim(request)) is ClaimState.CLAIMING:
        assert time.monotonic() < deadline, "no answer to the claim"
        time.sleep(0.005)
    return state


@pytest.fixture
def consumer() -> Iterator[Consumer]:
    c = Consumer(Settings(cluster_secret=SECRET))
    yield c
    c.close()


def test_params_without_a_handoff_are_left_to_vllm(consumer: Consumer) -> None:
    request = FakeRequest("d-1", {"do_remote_prefill": True, "remote_block_ids": [[1]]})
    consumer.track(request)
    assert consumer.claim(request) is None


def test_s9_a_claim_after_the_lease_is_refused_and_nothing_is_read(
    make_producer: Callable[..., Producer], consumer: Consumer
) -> None:
    producer = make_producer(lease_s=0.2)
    params = hold(producer)
    time.sleep(0.25)
    request = FakeRequest("d-1", dict(params))
    consumer.track(request)
    assert wait_claim(consumer, request) is ClaimState.REFUSED
    assert producer.table.counters["claim_expired"] == 1


def test_s11_a_claim_from_an_older_incarnation_is_refused(
    make_producer: Callable[..., Producer], consumer: Consumer
) -> None:
    producer = make_producer()
    params = {**hold(producer), "epoch": "an-older-epoch"}
    request = FakeRequest("d-1", params)
    consumer.track(request)
    assert wait_claim(consumer, request) is ClaimState.REFUSED


def test_a_claim_to_an_unreachable_node_is_refused(consumer: Consumer) -> None:
    params = {**vllm_params("x", [1]), "handoff_id": "ho-x", "release_token": TOKEN,
              "control_url": "http://127.0.0.1:9"}  # fmt: skip
    request = FakeRequest("d-1", params)
    consumer.track(request)
    assert wait_claim(consumer, request) is ClaimState.REFUSED


def test_a_waiting_decode_leg_renews_its_lease(
    make_producer: Callable[..., Producer], consumer: Consumer
) -> None:
    producer = make_producer(lease_s=0.4)
    params = hold(producer)
    consumer.track(FakeRequest("d-1", dict(params)))  # queued, never scheduled here
    time.sleep(1.0)
    assert freed(step(producer)) == set()
    assert producer.table.get(params["handoff_id"]).state is HandoffState.HELD  # type: ignore[union-attr]


def test_s5_a_decode_leg_that_ends_before_its_claim_releases_the_handoff(
    make_producer: Callable[..., Producer], consumer: Consumer
) -> None:
    producer = make_producer()
    params = hold(producer)
    consumer.track(FakeRequest("d-1", dict(params)))
    consumer.finished("d-1")
    wait_for(lambda: freed(step(producer)) == {params["remote_request_id"]}, "the release")


def test_a_claim_granted_but_never_read_is_reported_failed(
    make_producer: Callable[..., Producer], consumer: Consumer
) -> None:
    """The decode leg ended between its claim and its read: the prefill node frees at
    once, not at the claim deadline."""
    producer = make_producer()
    params = hold(producer)
    request = FakeRequest("d-1", dict(params))
    consumer.track(request)
    assert wait_claim(consumer, request) is ClaimState.GRANTED
    consumer.finished("d-1")
    wait_for(lambda: freed(step(producer)) == {params["remote_request_id"]}, "the failed report")


def test_a_failed_read_is_reported_and_frees_at_once(
    make_producer: Callable[..., Producer], consumer: Consumer
) -> None:
    producer = make_producer()
    params = hold(producer)
    request = FakeRequest("d-1", dict(params))
    consumer.track(request)
    assert wait_claim(consumer, request) is ClaimState.GRANTED
    consumer.reading("d-1")
    consumer.failed({"d-1"})
    wait_for(lambda: freed(step(producer)) == {params["remote_request_id"]}, "the failed report")


def wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, f"no {what} within {DEADLINE_S} s"
        time.sleep(0.005)


# -- signals and settings ------------------------------------------------------------------


@dataclass
class FakeOutput:
    finished_sending: set[str] | None = None
    finished_recving: set[str] | None = None


def test_s8_late_and_duplicate_signals_are_dropped_before_vllm_sees_them() -> None:
    signals = SignalFilter()
    signals.expect_sending("p-1")
    signals.expect_recving("d-1")
    output = FakeOutput({"p-1", "p-unknown"}, {"d-1"})
    assert signals.admit(output) == {"p-1"}
    assert output.finished_sending == {"p-1"} and output.finished_recving == {"d-1"}
    again = FakeOutput({"p-1"}, {"d-1", "d-late"})
    assert signals.admit(again) == set()
    assert again.finished_sending == set() and again.finished_recving == set()
    assert signals.num_dropped == 4
    assert signals.admit(FakeOutput()) == set()  # vLLM sends None when there is nothing


def test_settings_come_from_the_extra_config_and_bad_ones_fail_at_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PDSERVE_CLUSTER_SECRET", "from-env")
    settings = Settings.from_extra_config({"pdserve_lease_s": 2, "kv_lease_duration": 30})
    assert settings.lease_s == 2.0 and settings.cluster_secret == "from-env"
    with pytest.raises(ConfigError, match="pdserve_lease_s"):
        Settings.from_extra_config({"pdserve_lease": 2})
    with pytest.raises(ConfigError, match="must be a number"):
        Settings.from_extra_config({"pdserve_lease_s": "5"})
    with pytest.raises(ConfigError, match="> 0"):
        Settings.from_extra_config({"pdserve_claim_timeout_s": 0})


@pytest.mark.parametrize(
    ("vllm_id", "client"),
    [("cmpl-abc-0-0123abcd", "abc"), ("cmpl-a-b-1-3-deadbeef", "a-b-1"),
     ("chatcmpl-xyz-0a1b2c3d", "xyz"), ("something-else", "")],
)  # fmt: skip
def test_the_client_s_request_id_is_read_from_vllm_s(vllm_id: str, client: str) -> None:
    assert client_request_id(vllm_id) == client
