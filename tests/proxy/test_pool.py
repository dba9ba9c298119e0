"""The proxy's node choice and health hysteresis, and its usage arithmetic (no processes)."""

from __future__ import annotations

from pdserve.proxy.answers import merge_usage
from pdserve.proxy.pool import DOWN_AFTER, UP_AFTER, BackendPool, _kv_usage


def test_a_node_goes_down_after_consecutive_failures_and_up_after_consecutive_successes() -> None:
    pool = BackendPool("decode", ["http://127.0.0.1:1", "http://127.0.0.1:2"])
    node = pool.backends[0]
    for _ in range(DOWN_AFTER - 1):
        node.record(False)
    assert node.up  # one failure is not enough
    node.record(True)
    for _ in range(DOWN_AFTER - 1):
        node.record(False)
    assert node.up  # a success in between resets the count
    node.record(False)
    assert not node.up and pool.num_up == 1
    assert pool.choose() is pool.backends[1]
    for _ in range(UP_AFTER - 1):
        node.record(True)
    assert not node.up
    node.record(True)
    assert node.up and pool.num_up == 2


def test_choice_prefers_fewest_outstanding_then_lowest_kv_usage_and_honours_exclusions() -> None:
    pool = BackendPool("prefill", [f"http://127.0.0.1:{p}" for p in (1, 2, 3)])
    a, b, c = pool.backends
    a.num_outstanding, b.num_outstanding, c.num_outstanding = 2, 1, 1
    b.kv_usage, c.kv_usage = 0.9, 0.1
    assert pool.choose() is c
    assert pool.choose({c.url}) is b
    assert pool.choose({b.url, c.url}) is a
    assert pool.choose({a.url, b.url, c.url}) is None
    c.up = b.up = a.up = False
    assert pool.choose() is None


def test_kv_usage_is_read_from_the_vllm_metric() -> None:
    text = '# HELP x\nvllm:kv_cache_usage_perc{model_name="m"} 0.25\nother 3\n'
    assert _kv_usage(text) == 0.25
    assert _kv_usage("nothing here\n") == 0.0


def test_usage_combines_prompt_and_cache_of_the_prefill_leg_with_the_decode_completion() -> None:
    prefill = {
        "prompt_tokens": 40,
        "completion_tokens": 1,
        "total_tokens": 41,
        "prompt_tokens_details": {"cached_tokens": 32},
    }
    decode = {
        "prompt_tokens": 40,
        "completion_tokens": 12,
        "total_tokens": 52,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert merge_usage(prefill, decode) == {
        "prompt_tokens": 40,
        "completion_tokens": 12,
        "total_tokens": 52,
        "prompt_tokens_details": {"cached_tokens": 32},
    }
    assert merge_usage({}, {"prompt_tokens": 5, "completion_tokens": 2})["total_tokens"] == 7


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_breaker_opens_after_failed_legs_probes_once_and_closes_on_success() -> None:
    from pdserve.proxy.pool import BREAK_AFTER, BREAK_S, Breaker, BreakerState

    clock = FakeClock()
    breaker = Breaker(clock)
    for _ in range(BREAK_AFTER - 1):
        breaker.record(False)
    breaker.record(True)  # a success resets the count
    for _ in range(BREAK_AFTER - 1):
        assert not breaker.record(False)
    assert breaker.record(False) and not breaker.allows()
    clock.now += BREAK_S
    assert breaker.allows() and breaker.state is BreakerState.HALF_OPEN
    breaker.sent()  # the probe
    assert not breaker.allows()  # one probe at a time
    assert breaker.record(False) and not breaker.allows()  # it failed: open again
    clock.now += BREAK_S
    assert breaker.allows()
    breaker.sent()
    clock.now += BREAK_S  # a probe that never reported back stops blocking
    assert breaker.allows()
    breaker.record(True)
    assert breaker.state is BreakerState.CLOSED and breaker.allows()


def test_an_open_breaker_takes_the_node_out_of_the_choice() -> None:
    from pdserve.proxy.pool import BREAK_AFTER

    pool = BackendPool("decode", ["http://127.0.0.1:1", "http://127.0.0.1:2"])
    a, b = pool.backends
    b.num_outstanding = 3
    for _ in range(BREAK_AFTER):
        a.record_leg(False)
    assert a.up and pool.choose() is b  # healthy by its checks, but failing its legs


def test_a_malformed_summary_is_ignored_and_counted_and_a_node_that_goes_down_forgets() -> None:
    from pdserve.kv_cache.prefix_summary import PrefixIndex

    node = BackendPool("prefill", ["http://127.0.0.1:1"]).backends[0]
    index = PrefixIndex(16)
    index.apply([(True, b"x" * 16)])
    node.take_summary(index.summary().model_dump())
    assert node.cached.hashes == {b"x" * 8}
    node.take_summary({"version": 1, "unchanged": True})
    node.take_summary({"block_size": 16, "hashes": 5})
    node.take_summary(None)
    assert node.malformed_summaries == 2 and node.cached.hashes == {b"x" * 8}
    for _ in range(DOWN_AFTER):
        node.record(False)
    assert not node.cached.hashes and node.cached.version < 0


def test_members_join_and_leave_and_a_kept_node_keeps_its_state() -> None:
    """A discovery source (Ray) names the nodes: new ones join up, missing ones leave, and
    one still named keeps its counters (legs in flight, breaker, summary)."""
    pool = BackendPool("decode", ["http://a:1", "http://b:2"])
    kept = pool.backends[1]
    kept.num_outstanding = 3
    pool.set_members(["http://b:2/", "http://c:3", "http://c:3"])
    assert [b.url for b in pool.backends] == ["http://b:2", "http://c:3"]
    assert pool.backends[0] is kept and kept.num_outstanding == 3
    assert pool.backends[1].up and pool.backends[1].role == "decode"
    pool.set_members([])
    assert pool.backends == [] and pool.choose() is None
