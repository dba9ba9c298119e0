"""Test seams: pauses that hold a race window open long enough for a test to hit it.

Not configuration: no field of a config dataclass, no line in `--help`. A test that starts
processes turns one on with its hidden flag (`pdserve serve --debug-kv-read-delay-s`,
`--debug-step-delay-s`; `pdserve proxy --debug-delay-between-legs-s`); an in-process test
passes a `Seams` to the object it builds. Production runs with `NO_SEAMS`.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.errors import ConfigError


@dataclass(frozen=True)
class Seams:
    kv_read_delay_s: float = 0.0
    """A decode node waits this long between a granted claim and its read (opens the
    "claimed, reading" window of S6 and S10)."""
    step_delay_s: float = 0.0
    """A node uses each engine output this late (a slow decode)."""
    between_legs_s: float = 0.0
    """The proxy pauses this long between the legs (opens window S3)."""

    def __post_init__(self) -> None:
        if min(self.kv_read_delay_s, self.step_delay_s, self.between_legs_s) < 0:
            raise ConfigError(f"test delays must be >= 0: {self}")


NO_SEAMS = Seams()
