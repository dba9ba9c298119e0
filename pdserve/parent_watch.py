"""A child process's tie to the process that started it.

When a process dies, whatever the cause (SIGKILL and crashes included), Linux hands its
children to a new parent (init, or a subreaper), so `os.getppid()` changes: the one sign
that cannot be missed. Two kinds of child watch for it:
- the engine process watches its node's API process (`engine/core_process.py`): an orphaned
  engine would keep pinning blocks and renewing leases;
- a node or proxy started by a launcher (`pdserve up`, `bench chaos`, the benchmarks and
  the tests, all through `proxy/launch.py`) watches the launcher when given `--parent-pid`:
  an orphaned node keeps its port, its memory and its NIXL agent.

The parent's pid is passed in where a child may start after its parent died (a launcher
SIGKILLed while its nodes import): the watch then fires at once instead of adopting init.

Why not prctl(PR_SET_PDEATHSIG): it fires when the *thread* that forked the child exits
(a launcher's worker thread restarting a node), it needs a `preexec_fn`, which is unsafe
in a threaded parent, and it is Linux only.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable

logger = logging.getLogger(__name__)

POLL_S = 0.2
"""How often an asyncio watcher looks: a node outlives its launcher by at most this."""


class ParentWatch:
    def __init__(self, parent_pid: int | None = None) -> None:
        self.parent_pid = os.getppid() if parent_pid is None else parent_pid

    @property
    def parent_gone(self) -> bool:
        return os.getppid() != self.parent_pid

    async def wait_gone(self, poll_s: float = POLL_S) -> None:
        """Returns once the parent is gone (never, while it lives)."""
        while not self.parent_gone:
            await asyncio.sleep(poll_s)

    async def stop_when_gone(self, stop: Callable[[], None], what: str) -> None:
        """Run `stop` (the same path as SIGTERM) once the parent is gone."""
        await self.wait_gone()
        logger.warning("%s: the process that started it (pid %d) is gone: stopping",
                       what, self.parent_pid)  # fmt: skip
        stop()
