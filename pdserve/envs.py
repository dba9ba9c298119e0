"""Every environment variable pdserve reads, in one place."""

from __future__ import annotations

import os


def log_level() -> str:
    """PDSERVE_LOG_LEVEL: logging level name for pdserve's loggers (default INFO)."""
    return os.environ.get("PDSERVE_LOG_LEVEL", "INFO").upper()


def force_hub_offline() -> None:
    """pdserve never downloads models: make sure HF libraries it touches cannot either."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


def api_key() -> str | None:
    """PDSERVE_API_KEY: bearer key the server requires (the --api-key flag wins)."""
    return os.environ.get("PDSERVE_API_KEY") or None
