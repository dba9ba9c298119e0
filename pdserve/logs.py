"""Logging of pdserve's commands, configured once by `cli.main`.

pdserve's own loggers log at the chosen level (`--log-level`, else PDSERVE_LOG_LEVEL,
default INFO). Third-party clients log one line per request at INFO (httpx: the proxy's
health checks, two lines a second for two nodes; uvicorn's access log): those are kept at
WARNING unless the level is DEBUG, so that the lines that matter (ready, a node going
down or coming back, a handoff expiring) do not scroll away.
"""

from __future__ import annotations

import logging
import os

LEVELS = ("debug", "info", "warning", "error")
PER_REQUEST_LOGGERS = ("httpx", "httpcore")
"""Clients that log every request they make."""
ENGINE_FORMAT = "%(asctime)s %(levelname)s engine: %(message)s"
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure(level: str, fmt: str = FORMAT) -> None:
    """This process's logging. The level also goes to the processes it starts (an engine
    process, `pdserve up`'s nodes) through PDSERVE_LOG_LEVEL, unless they are given one."""
    logging.basicConfig(level=level.upper(), format=fmt)
    os.environ["PDSERVE_LOG_LEVEL"] = level.upper()
    if not debugging():
        for name in PER_REQUEST_LOGGERS:
            logging.getLogger(name).setLevel(logging.WARNING)
        # NIXL logs every agent it makes at INFO, on its own handler (NIXL_LOG_LEVEL).
        os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")


def debugging() -> bool:
    return logging.getLogger().isEnabledFor(logging.DEBUG)


def uvicorn_level() -> str:
    """uvicorn's `log_level`: its access log (a line per request) only when debugging."""
    return "debug" if debugging() else "warning"
