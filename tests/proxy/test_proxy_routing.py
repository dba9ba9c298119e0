"""The proxy's routing end to end on real P/D nodes (tiny model, token-id prompts): prefix
summaries polled, selective P/D (short prompts and prompts the decode node holds run whole
there, with the single node's answer), a failed prefill leg's prompt no longer counted as
cached on its node, and overload answered 429."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import pytest

from tests.disagg.conftest import (
    BLOCK_SIZE,
    Cluster,
    completion,
    kv_state,
    make_prompt,
    metric,
    post,
    token_ids,
    wait_idle,
)
from tests.proxy.conftest import Stub

pytestmark = pytest.mark.timeout(120)


def computed(server: Any) -> int:
    return int(kv_state(server)["num_prompt_tokens_computed"])


def test_short_and_held_prompts_run_whole_on_the_decode_node(
    cluster: Cluster, proxy_for: Any
) -> None:
    proxy = proxy_for(
        [cluster.prefill.url], [cluster.decode.url],
        "--model", str(cluster.model), "--disagg-min-tokens", "24",
    )  # fmt: skip
    paths = "pdserve_proxy_disaggregation_total"
    short = completion(make_prompt(20, seed=60), max_tokens=6)
    before = computed(cluster.prefill)
    answer = post(proxy, "/v1/completions", short).json()
    assert token_ids(answer) == token_ids(post(cluster.single, "/v1/completions", short).json())
    assert answer["usage"]["prompt_tokens"] == 20
    assert computed(cluster.prefill) == before  # no prefill leg
    assert metric(proxy, paths + '{path="decode_only"}') == 1

    history = make_prompt(80, seed=61)
    post(proxy, "/v1/completions", completion(history, max_tokens=4))  # P/D: too long
    assert metric(proxy, paths + '{path="pd"}') == 1
    assert computed(cluster.prefill) == before + 80
    # The decode node now holds the history's blocks (read from the prefill node): the
    # next turn, 10 tokens more, has 10 + (80 % 16) uncached tokens there: run whole.
    turn = completion([*history, *make_prompt(10, seed=62)], max_tokens=6)
    decode_before = computed(cluster.decode)
    answer = post(proxy, "/v1/completions", turn).json()
    assert token_ids(answer) == token_ids(post(cluster.single, "/v1/completions", turn).json())
    assert metric(proxy, paths + '{path="decode_only"}') == 2
    assert computed(cluster.decode) - decode_before == 90 - 80  # only the new tokens
    wait_idle(cluster.prefill, 3.0)
    wait_idle(cluster.decode, 3.0)


def test_a_failed_prefill_leg_does_not_draw_the_next_prompt_to_its_node(
    cluster: Cluster, proxy_for: Any, stub: Stub
) -> None:
    """The stub fails every leg. Nothing is cached anywhere, so the first prompt tries the
    first node, the stub, then the real one. The proxy counted the prompt as cached on the
    stub when it sent the leg; the failure takes that back, so a longer prompt sharing it
    goes straight to the node that holds it (it went to the stub again before)."""
    stub.status, stub.body = 500, {"error": {"message": "broken", "type": "server_error"}}
    stub.summary = {"block_size": BLOCK_SIZE, "version": 0, "num_hashes": 0, "hashes": ""}
    proxy = proxy_for(
        [stub.url, cluster.prefill.url], [cluster.decode.url], "--model", str(cluster.model)
    )
    deadline = time.monotonic() + 10
    while stub.num_summaries < 2:  # the first one taken: its block size is known
        assert time.monotonic() < deadline, "the proxy never polled the stub's summary"
        time.sleep(0.05)
    history = make_prompt(80, seed=70)
    first = post(proxy, "/v1/completions", completion(history, max_tokens=2))
    assert first.status_code == 200 and len(stub.calls) == 1
    turn = completion([*history, *make_prompt(20, seed=71)], max_tokens=2)
    assert post(proxy, "/v1/completions", turn).status_code == 200
    assert len(stub.calls) == 1
    wait_idle(cluster.prefill, 3.0)
    wait_idle(cluster.decode, 3.0)


def test_beyond_capacity_the_proxy_answers_429_at_once_and_serves_the_rest(
    cluster: Cluster, proxy_for: Any
) -> None:
    proxy = proxy_for(
        [cluster.prefill.url], [cluster.decode.url],
        "--max-concurrency", "2", "--max-queue", "1", "--max-queue-wait-s", "30",
    )  # fmt: skip
    body = completion(make_prompt(30, seed=63), max_tokens=40)
    results: list[tuple[int, float, dict[str, str]]] = []

    def send() -> None:
        start = time.monotonic()
        r = httpx.post(f"{proxy.url}/v1/completions", json=body, timeout=60,
                       headers={"Authorization": "Bearer test-key"})  # fmt: skip
        results.append((r.status_code, time.monotonic() - start, dict(r.headers)))

    threads = [threading.Thread(target=send) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    statuses = sorted(s for s, _, _ in results)
    assert statuses.count(200) >= 3 and set(statuses) <= {200, 429}
    rejected = [(elapsed, headers) for s, elapsed, headers in results if s == 429]
    assert rejected and all(int(h["retry-after"]) >= 1 for _, h in rejected)
    assert max(elapsed for elapsed, _ in rejected) < 1.0  # at once, not after a wait
    assert metric(proxy, 'pdserve_proxy_rejected_total{reason="queue_full"}') == len(rejected)
    wait_idle(cluster.prefill, 3.0)
    wait_idle(cluster.decode, 3.0)
