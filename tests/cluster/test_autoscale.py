"""The autoscaling policy (pdserve/cluster/autoscale.py), on made-up loads and a fake clock."""

from __future__ import annotations

import pytest

from pdserve.cluster.autoscale import AutoscaleConfig, Autoscaler, NodeLoad, parse_load
from pdserve.errors import ConfigError


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def decode(kv: float, waiting: float = 0) -> NodeLoad:
    return NodeLoad("decode", waiting, kv, 0)


def prefill(tokens: float) -> NodeLoad:
    return NodeLoad("prefill", 0, 0.1, tokens)


def make(**overrides: float) -> tuple[Autoscaler, Clock]:
    clock = Clock()
    config = AutoscaleConfig(max_prefill=3, max_decode=3, cooldown_s=60, **overrides)  # type: ignore[arg-type]
    return Autoscaler(config, clock), clock


def test_decode_grows_on_kv_use_or_a_queue_and_shrinks_when_idle() -> None:
    scaler, clock = make()
    counts = {"prefill": 1, "decode": 1}
    assert scaler.decide([decode(0.5)], counts) == counts  # between the marks: no change
    assert scaler.decide([decode(0.9)], counts)["decode"] == 2
    clock.now += 61
    assert scaler.decide([decode(0.5, waiting=3), decode(0.5, 3)], {**counts, "decode": 2}) == {
        "prefill": 1, "decode": 3
    }  # fmt: skip
    clock.now += 61
    loads = [decode(0.1), decode(0.2), decode(0.1)]
    assert scaler.decide(loads, {**counts, "decode": 3})["decode"] == 2
    clock.now += 61
    busy = [decode(0.1), decode(0.1, waiting=1)]  # something waits: no shrinking
    assert scaler.decide(busy, {**counts, "decode": 2})["decode"] == 2


def test_prefill_follows_the_prompt_tokens_owed() -> None:
    scaler, clock = make()
    counts = {"prefill": 1, "decode": 1}
    assert scaler.decide([prefill(5000)], counts)["prefill"] == 2
    clock.now += 61
    assert scaler.decide([prefill(1000), prefill(100)], {**counts, "prefill": 2}) == {
        **counts, "prefill": 2
    }  # fmt: skip
    assert scaler.decide([prefill(10), prefill(0)], {**counts, "prefill": 2})["prefill"] == 1


def test_bounds_and_the_cooldown_hold() -> None:
    scaler, clock = make()
    counts = {"prefill": 1, "decode": 3}
    assert scaler.decide([decode(0.99)], counts)["decode"] == 3  # at the maximum
    assert scaler.decide([prefill(0)], counts)["prefill"] == 1  # at the minimum
    grown = scaler.decide([prefill(10_000)], counts)
    assert grown["prefill"] == 2
    clock.now += 30  # within the cooldown: no second step, however loaded
    assert scaler.decide([prefill(90_000)] * 2, grown)["prefill"] == 2
    clock.now += 31
    assert scaler.decide([prefill(90_000)] * 2, grown)["prefill"] == 3


def test_no_metrics_for_a_role_change_nothing_and_bad_settings_are_refused() -> None:
    scaler, _ = make()
    assert scaler.decide([], {"prefill": 2, "decode": 2}) == {"prefill": 2, "decode": 2}
    with pytest.raises(ConfigError, match="min-decode"):
        AutoscaleConfig(min_decode=3, max_decode=2)
    with pytest.raises(ConfigError, match="kv_low"):
        AutoscaleConfig(kv_low=0.9, kv_high=0.8)


def test_a_nodes_metrics_are_read_from_its_prometheus_text() -> None:
    text = "\n".join([
        "# HELP vllm:num_requests_waiting Requests waiting",
        'vllm:num_requests_waiting{model_name="m"} 3.0',
        'vllm:kv_cache_usage_perc{model_name="m"} 0.25',
        'pdserve_prompt_tokens_pending{model_name="m"} 812.0',
        'pdserve_prompt_tokens_computed{model_name="m"} 99.0',
    ])  # fmt: skip
    assert parse_load("decode", text) == NodeLoad("decode", 3.0, 0.25, 812.0)
    assert parse_load("prefill", "garbage") == NodeLoad("prefill", 0.0, 0.0, 0.0)
