"""The keeper of a foreign server (`pdserve_bench.keeper`, for vLLM's in `bench serve
--compare`): the server ends when the benchmark that started it is SIGKILLed, and the keeper
ends when the server does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

BENCHMARK = """
import subprocess, sys, time
from pdserve_bench.keeper import keep
server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
keeper = keep(server)
print(server.pid, keeper.pid, flush=True)
if sys.argv[1] == "stop-server":
    server.kill()
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def _wait_gone(pid: int, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while _alive(pid):
        assert time.monotonic() < deadline, f"process {pid} still running"
        time.sleep(0.05)


def _start(mode: str) -> tuple[subprocess.Popen[str], int, int]:
    bench = subprocess.Popen([sys.executable, "-c", BENCHMARK, mode], stdout=subprocess.PIPE,
                             text=True)  # fmt: skip
    assert bench.stdout is not None
    server, keeper = (int(pid) for pid in bench.stdout.readline().split())
    return bench, server, keeper


def test_a_killed_benchmark_s_server_is_stopped_by_its_keeper() -> None:
    bench, server, keeper = _start("run")
    try:
        time.sleep(0.5)
        assert _alive(server) and _alive(keeper)
        bench.kill()
        bench.wait()
        _wait_gone(server, 3)
        _wait_gone(keeper, 3)
    finally:
        for pid in (server, keeper):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_the_keeper_ends_with_its_server() -> None:
    bench, _, keeper = _start("stop-server")
    try:
        _wait_gone(keeper, 3)
        assert bench.poll() is None  # the benchmark itself was left alone
    finally:
        bench.kill()
        bench.wait()
