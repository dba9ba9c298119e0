"""A foreign server tied to the benchmark that started it.

pdserve's own nodes watch their launcher (`--parent-pid`, `pdserve/parent_watch.py`); vLLM's
OpenAI server has no such flag, so a benchmark SIGKILLed while measuring it would leave it
running, holding its port, its memory and its cores. `keep(process)` starts a small keeper
process beside it: once the benchmark is gone, the keeper sends SIGTERM to the server and
all its processes, SIGKILL after `GRACE_S`; once the server is gone, the keeper ends too.
Both are watched by pid and start time, which a reused pid does not fool.

    python -m pdserve_bench.keeper BENCHMARK_PID SERVER_PID
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from pdserve.launch import signal_tree
from pdserve.parent_watch import POLL_S, ParentWatch

GRACE_S = 10.0


def keep(server: subprocess.Popen[bytes]) -> subprocess.Popen[bytes]:
    """Start the keeper of `server` (a process this one started); it ends by itself."""
    cmd = [sys.executable, "-m", "pdserve_bench.keeper", str(os.getpid()), str(server.pid)]
    return subprocess.Popen(cmd, stdin=subprocess.DEVNULL)


def main(argv: list[str]) -> int:
    benchmark, server = ParentWatch(int(argv[0])), ParentWatch(int(argv[1]))
    while not server.parent_gone:
        if benchmark.parent_gone:
            _stop(server)
            return 0
        time.sleep(POLL_S)
    return 0


def _stop(server: ParentWatch) -> None:
    pid = server.parent_pid
    print(f"keeper: the benchmark is gone: stopping process {pid}", file=sys.stderr)
    signal_tree(pid, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while not server.parent_gone and time.monotonic() < deadline:
        time.sleep(POLL_S)
    if not server.parent_gone:
        signal_tree(pid, signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
