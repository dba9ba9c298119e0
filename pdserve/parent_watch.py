"""A child process's tie to the process that started it.

When a process dies, whatever the cause (SIGKILL and crashes included), Linux hands its
children to a new parent (init, or a subreaper), so `os.getppid()` changes: the one sign
that cannot be missed. Two kinds of child watch for it:
- the engine process watches its node's API process (`engine/core_process.py`): an orphaned
  engine would keep pinning blocks and renewing leases;
- a node or proxy started by a launcher (`pdserve up`, `bench chaos`, the benchmarks and
  the tests, all through `launch.py`) watches the launcher when given `--parent-pid`:
  an orphaned node keeps its port, its memory and its NIXL agent.

The parent's pid is passed in where a child may start after its parent died (a launcher
SIGKILLed while its nodes import): the watch then fires at once instead of adopting init.
A launcher may also start its nodes through a wrapper that forks (`ip netns exec` for
`bench chaos --netns`): the node's parent is then the wrapper, and the launcher is watched
by its pid and start time (`/proc`) instead, which a reused pid does not fool.

Why not prctl(PR_SET_PDEATHSIG): it fires when the *thread* that forked the child exits
(a launcher's worker thread restarting a node), it needs a `preexec_fn`, which is unsafe
in a threaded parent, and it is Linux only.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

POLL_S = 0.2
"""How often an asyncio watcher looks: a node outlives its launcher by at most this."""


class ParentWatch:
    def __init__(self, parent_pid: int | None = None) -> None:
        self.parent_pid = os.getppid() if parent_pid is None else parent_pid
        self._direct = os.getppid() == self.parent_pid
        self._identity = None if self._direct else _identity(self.parent_pid)

    @property
    def parent_gone(self) -> bool:
        if self._direct:
            return os.getppid() != self.parent_pid
        return self._identity is None or _identity(self.parent_pid) != self._identity

    async def wait_gone(self, poll_s: float = POLL_S) -> None:
        """Returns once the parent is gone (never, while it lives)."""
        while not self.parent_gone:
            await asyncio.sleep(poll_s)

    async def stop_when_gone(self, stop: Callable[[], None], what: str) -> None:
        """Run `stop` (the same path as SIGTERM) once the parent is gone."""
        await self.wait_gone()
        logger.warning(
            "%s: the process that started it (pid %d) is gone: stopping", what, self.parent_pid
        )
        stop()


_HAS_PROC = Path("/proc/self/stat").exists()


def _identity(pid: int) -> str | None:
    """A running process's start time (None once it has exited, zombies included); where
    there is no /proc, only whether the pid exists."""
    if not _HAS_PROC:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return "running"
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else fields[19]
