"""Every environment variable pdserve reads, in one place."""

from __future__ import annotations

import os
from pathlib import Path


def log_level() -> str:
    """PDSERVE_LOG_LEVEL: logging level name for pdserve's loggers (default INFO)."""
    return os.environ.get("PDSERVE_LOG_LEVEL", "INFO").upper()


def force_hub_offline() -> None:
    """pdserve never downloads models: make sure HF libraries it touches cannot either."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


def api_key() -> str | None:
    """PDSERVE_API_KEY: bearer key the server requires (the --api-key flag wins)."""
    return os.environ.get("PDSERVE_API_KEY") or None


def cluster_secret() -> str | None:
    """PDSERVE_CLUSTER_SECRET: bearer credential between P/D nodes (--cluster-secret wins)."""
    return os.environ.get("PDSERVE_CLUSTER_SECRET") or None


def cache_dir() -> Path:
    """PDSERVE_CACHE_DIR: where built artefacts (the CPU kernels) are kept; default
    $XDG_CACHE_HOME/pdserve or ~/.cache/pdserve."""
    explicit = os.environ.get("PDSERVE_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pdserve"


def huge_pages() -> bool:
    """PDSERVE_HUGE_PAGES: 0 keeps weights and the KV cache on ordinary 4 KiB pages
    (default 1: ask Linux for transparent huge pages; see pdserve/model/huge_pages.py)."""
    return os.environ.get("PDSERVE_HUGE_PAGES", "1") != "0"


def cpu_isa() -> str:
    """PDSERVE_CPU_ISA: cap the CPU level the fused kernels and the default dtype use
    (`auto`, `none`, `avx2`, `avx512`, `avx512_bf16`, `amx`; see pdserve/model/cpu_isa.py).
    `avx2` runs the AVX2 path on a bigger CPU, for tests and benchmarks."""
    return os.environ.get("PDSERVE_CPU_ISA", "auto").strip().lower() or "auto"
