"""Launcher: a node's P/D configuration (DESIGN §2), and the role, policy and transport
enums. Built once by `pdserve serve` from its flags; the engine never sees it: the role
reaches the engine only as the connector factory the launcher picks
(`pdserve.disagg.connectors.connector_factory`), and the API process as the node's legs
(`pdserve.api.pd_legs.node_legs`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pdserve.errors import ConfigError
from pdserve.tls import TLSConfig

E = TypeVar("E", bound=enum.Enum)


class Role(str, enum.Enum):
    """What a node does with prompts' KV."""

    BOTH = "both"
    """One node serves everything; no KV leaves it."""
    PREFILL = "prefill"
    """Computes prompts and holds their KV for remote decode nodes."""
    DECODE = "decode"
    """Pulls prompts' KV from prefill nodes and generates the rest."""

    def __str__(self) -> str:
        return self.value


class KVLoadFailurePolicy(str, enum.Enum):
    """A decode node's answer to a refused claim or a failed read."""

    RECOMPUTE = "recompute"
    """Compute the prompt locally: the same output, later."""
    FAIL = "fail"
    """Fail the request (502 `kv_transfer_error`)."""

    def __str__(self) -> str:
        return self.value


class KVTransportKind(str, enum.Enum):
    NIXL = "nixl"
    """NIXL over UCX: the real data plane."""
    INPROCESS = "inprocess"
    """A fake between transports of one process: unit tests only."""

    def __str__(self) -> str:
        return self.value


def as_enum(kind: type[E], value: Any, name: str) -> E:
    """`value` as a member of `kind` (a member, or its value); ConfigError otherwise."""
    try:
        return kind(value)
    except ValueError:
        choices = ", ".join(str(m.value) for m in kind)
        raise ConfigError(f"{name} must be one of {choices}, got {value!r}") from None


@dataclass(frozen=True)
class KVTransferConfig:
    """Prefill/decode disaggregation. Unused on a `both` node."""

    role: Role = Role.BOTH
    """`both`, `prefill` or `decode` (see `Role`)."""
    lease_s: float = 5.0
    """Prefill node: a held handoff not renewed for this long is released (crashed decode).
    Also what a decode node assumes when a prefill answer names no lease."""
    claim_timeout_s: float = 10.0
    """Prefill node: a claimed handoff whose read has not ended by then is released; the
    decode node stops trusting its read a margin before that."""
    kv_load_failure: KVLoadFailurePolicy = KVLoadFailurePolicy.RECOMPUTE
    """Decode node, when a claim is refused or a read fails (see `KVLoadFailurePolicy`)."""
    transport: KVTransportKind = KVTransportKind.NIXL
    """The data plane (see `KVTransportKind`)."""
    cluster_secret: str | None = None
    """Bearer credential for node-to-node control calls; default: the node's API key."""
    advertise_host: str | None = None
    """Prefill node: the address decode nodes use to reach it (`remote_host`); default: the
    host it listens on, or this machine's address when that is 0.0.0.0."""
    tls: TLSConfig = field(default_factory=TLSConfig)
    """The node's own TLS (`pdserve/tls.py`): a node that serves HTTPS calls prefill
    nodes' `/kv/*` over HTTPS, verified against `tls.ca_certs`."""

    def __post_init__(self) -> None:
        # Strings are accepted for the enums (a config file, a test): converted here, once.
        object.__setattr__(self, "role", as_enum(Role, self.role, "role"))
        object.__setattr__(
            self,
            "kv_load_failure",
            as_enum(KVLoadFailurePolicy, self.kv_load_failure, "kv_load_failure"),
        )
        object.__setattr__(self, "transport", as_enum(KVTransportKind, self.transport, "transport"))
        if not self.lease_s > 0:
            raise ConfigError(f"lease_s must be > 0, got {self.lease_s}")
        if not self.claim_timeout_s > 1:
            raise ConfigError(
                f"claim_timeout_s must be > 1 s (the decode node keeps a margin), "
                f"got {self.claim_timeout_s}"
            )
