"""Reading a server's Prometheus text (`/metrics`): what the proxy and the autoscaler read
from nodes."""

from __future__ import annotations

import contextlib
from collections.abc import Collection


def read_metrics(text: str, names: Collection[str]) -> dict[str, float]:
    """The values of `names` in a node's `/metrics` text (Prometheus format; the sample's
    labels ignored, the last sample of each name kept). A name missing, or whose value does
    not parse, is absent: what the proxy and the autoscaler read from nodes."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in names:
            with contextlib.suppress(ValueError, IndexError):
                values[name] = float(line.rsplit(" ", 1)[1])
    return values
