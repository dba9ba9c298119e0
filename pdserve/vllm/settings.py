"""`PdserveConnector`'s settings: keys of vLLM's `kv_connector_extra_config`, read once."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from pdserve.errors import ConfigError
from pdserve.tls import TLSConfig

PREFIX = "pdserve_"
SECRET_ENV = "PDSERVE_CLUSTER_SECRET"


@dataclass(frozen=True)
class Settings:
    lease_s: float = 5.0
    """A held handoff's lease on the prefill node, renewed by the decode node from the moment
    it accepts the request (`pdserve_lease_s`). An unrenewed handoff (decode node dead, its
    client gone with nobody to release) is freed this long after the prefill."""
    claim_timeout_s: float = 30.0
    """How long a claimed handoff's blocks stay pinned for the decode node's read
    (`pdserve_claim_timeout_s`). Longer than a pdserve node's 10 s: vLLM's worker cannot cut
    a read short at a deadline, so this must outlast any read (they take milliseconds)."""
    control_port: int = 0
    """The prefill node's control endpoint port (`pdserve_control_port`; 0: any free port,
    advertised in every prefill answer's `control_url`)."""
    cluster_secret: str | None = None
    """The node credential for `/kv/*` and admin aborts: `pdserve_cluster_secret`, else the
    environment's PDSERVE_CLUSTER_SECRET. Unset: `/kv/*` needs only the release tokens."""
    tls: TLSConfig = field(default_factory=TLSConfig)
    """The same PEM files as pdserve's nodes' `--ssl-certfile/--ssl-keyfile/--ssl-ca-certs`
    (`pdserve_ssl_certfile`, `pdserve_ssl_keyfile`, `pdserve_ssl_ca_certs`): a prefill node
    with a certificate serves its control endpoint over HTTPS (its `control_url` says so); a
    decode node verifies prefill nodes' certificates against the CA bundle."""

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> Settings:
        extra = extra or {}
        unknown = sorted(
            k for k in extra if k.startswith(PREFIX) and k[len(PREFIX) :] not in _FIELDS
        )
        if unknown:
            raise ConfigError(
                f"unknown kv_connector_extra_config keys {unknown}; PdserveConnector takes "
                + ", ".join(PREFIX + f for f in _FIELDS)
            )
        settings = cls(
            lease_s=_number(extra, "lease_s", cls.lease_s),
            claim_timeout_s=_number(extra, "claim_timeout_s", cls.claim_timeout_s),
            control_port=int(_number(extra, "control_port", cls.control_port)),
            cluster_secret=extra.get(PREFIX + "cluster_secret")
            or os.environ.get(SECRET_ENV)
            or None,
            tls=TLSConfig(*(_path(extra, f"ssl_{f}") for f in ("certfile", "keyfile", "ca_certs"))),
        )
        if settings.lease_s <= 0 or settings.claim_timeout_s <= 0:
            raise ConfigError("pdserve_lease_s and pdserve_claim_timeout_s must be > 0")
        if not 0 <= settings.control_port < 65536:
            raise ConfigError(f"pdserve_control_port must be a port, got {settings.control_port}")
        return settings


_FIELDS = (
    "lease_s", "claim_timeout_s", "control_port", "cluster_secret",
    "ssl_certfile", "ssl_keyfile", "ssl_ca_certs",
)  # fmt: skip


def _path(extra: dict[str, Any], name: str) -> str | None:
    value = extra.get(PREFIX + name)
    if value is not None and not isinstance(value, str):
        raise ConfigError(f"{PREFIX}{name} must be a file path, got {value!r}")
    return value


def _number(extra: dict[str, Any], name: str, default: float) -> float:
    value = extra.get(PREFIX + name, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{PREFIX}{name} must be a number, got {value!r}")
    return float(value)
