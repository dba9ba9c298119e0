"""`pdserve ray up --autoscale`: each role's node count from the nodes' own metrics.

Every `interval_s` the controller scrapes each node's `/metrics` into a `NodeLoad` and asks
`Autoscaler.decide` for the counts; a changed count goes to `Controller.scale` (a removed
node leaves the proxy's pools, then drains). One step at a time per role:

    decode  up:   mean KV use > kv_high, or mean requests waiting > waiting_high
            down: mean KV use < kv_low and nothing waiting anywhere
    prefill up:   mean prompt tokens owed > tokens_high (waiting + unfinished prefills)
            down: every node owes < tokens_low

always within [min, max] per role, and never within `cooldown_s` of that role's last
change (a new node needs time to load and take load; a drained one to finish).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pdserve.errors import ConfigError
from pdserve.openai_api.prometheus import read_metrics


@dataclass(frozen=True)
class AutoscaleConfig:
    min_prefill: int = 1
    max_prefill: int = 4
    min_decode: int = 1
    max_decode: int = 4
    interval_s: float = 5.0
    """Between two looks at the nodes' metrics."""
    cooldown_s: float = 60.0
    """After a role's count changed, how long before it may change again."""
    kv_high: float = 0.8
    kv_low: float = 0.3
    waiting_high: float = 2.0
    """Decode: requests waiting per node that call for one more."""
    tokens_high: int = 4096
    """Prefill: prompt tokens owed per node that call for one more."""
    tokens_low: int = 256

    def __post_init__(self) -> None:
        for role in ("prefill", "decode"):
            low, high = getattr(self, f"min_{role}"), getattr(self, f"max_{role}")
            if not 1 <= low <= high:
                raise ConfigError(f"need 1 <= --min-{role} <= --max-{role}, got {low}, {high}")
        if not 0 <= self.kv_low < self.kv_high <= 1:
            raise ConfigError("need 0 <= kv_low < kv_high <= 1")
        if not 0 <= self.tokens_low < self.tokens_high:
            raise ConfigError("need 0 <= tokens_low < tokens_high")
        if self.interval_s <= 0 or self.cooldown_s < 0:
            raise ConfigError("interval_s must be > 0 and cooldown_s >= 0")

    def bounds(self, role: str) -> tuple[int, int]:
        return getattr(self, f"min_{role}"), getattr(self, f"max_{role}")


@dataclass(frozen=True)
class NodeLoad:
    """One node's metrics, as its `/metrics` says."""

    role: str
    num_waiting: float
    kv_usage: float
    prompt_tokens_pending: float


class Autoscaler:
    def __init__(self, config: AutoscaleConfig, clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.clock = clock
        self._changed_s: dict[str, float] = {}

    def decide(self, loads: Sequence[NodeLoad], counts: dict[str, int]) -> dict[str, int]:
        """The counts to run now (`counts` unchanged when nothing calls for a change)."""
        wanted = dict(counts)
        now = self.clock()
        for role, count in counts.items():
            if now - self._changed_s.get(role, -float("inf")) < self.config.cooldown_s:
                continue
            mine = [load for load in loads if load.role == role]
            step = self._step(role, mine) if mine else 0
            low, high = self.config.bounds(role)
            target = min(max(count + step, low), high)
            if target != count:
                wanted[role] = target
                self._changed_s[role] = now
        return wanted

    def _step(self, role: str, loads: list[NodeLoad]) -> int:
        c, n = self.config, len(loads)
        if role == "decode":
            kv = sum(load.kv_usage for load in loads) / n
            waiting = sum(load.num_waiting for load in loads) / n
            if kv > c.kv_high or waiting > c.waiting_high:
                return 1
            if kv < c.kv_low and all(load.num_waiting == 0 for load in loads):
                return -1
            return 0
        owed = [load.prompt_tokens_pending for load in loads]
        if sum(owed) / n > c.tokens_high:
            return 1
        if all(tokens < c.tokens_low for tokens in owed):
            return -1
        return 0


METRICS = {
    "vllm:num_requests_waiting": "num_waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "pdserve_prompt_tokens_pending": "prompt_tokens_pending",
}


def parse_load(role: str, text: str) -> NodeLoad:
    """A node's `/metrics` (Prometheus text) as its load; a metric missing reads 0."""
    values = read_metrics(text, METRICS)
    return NodeLoad(role, **{field: values.get(name, 0.0) for name, field in METRICS.items()})
