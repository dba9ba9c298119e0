"""`pdserve up`: `--ask`, what `make run` runs (a whole local cluster on the default model),
and no node outliving it whichever signal stops it."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.api.conftest import free_port


def _cpu_levels() -> list[Any]:
    """The machine's level as the environment leaves it (what `make run` uses), and the AVX2
    path forced where that level is above it: each with the dtype `auto` picks there (bf16
    only where it is native)."""
    from pdserve.model.cpu_isa import CpuIsa, effective

    own = os.environ.get("PDSERVE_CPU_ISA", "auto")
    reason = f"the level here is already {effective().label}: the first case runs it"
    skip = pytest.mark.skipif(effective() <= CpuIsa.AVX2, reason=reason)
    return [
        pytest.param(own, False, id=own),
        pytest.param("avx2", False, id="forced-avx2", marks=skip),
        pytest.param(own, True, id=f"{own}-tls"),  # every hop over HTTPS (pdserve/tls.py)
    ]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("cpu_level", "tls"), _cpu_levels())
def test_up_answers_a_chat_request_through_the_proxy_and_stops_everything(
    cpu_level: str, tls: bool
) -> None:
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "pdserve.cli",
        "up",
        "--port",
        str(port),
        "--max-tokens",
        "16",
        "--ask",
        "What is the capital of France?",
        *(["--tls"] if tls else []),
    ]
    env = {**os.environ, "PDSERVE_LOG_LEVEL": "WARNING", "PDSERVE_CPU_ISA": cpu_level}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Paris" in done.stdout
    [listing] = [line for line in done.stdout.splitlines() if line.startswith("nodes: ")]
    urls = re.findall(r"https?://[0-9.:]+", listing)
    assert len(urls) == 2 and all(u.startswith("https://" if tls else "http://") for u in urls)
    for url in urls:  # every node was stopped
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/health", timeout=2, verify=False)


def _descendants(pid: int) -> dict[int, str]:
    """Every process under `pid`, by pid, with its start time (a reused pid is not it)."""
    found: dict[int, str] = {}
    frontier = [pid]
    while frontier:
        parent = frontier.pop()
        for stat in Path("/proc").glob("[0-9]*/stat"):
            with contextlib.suppress(OSError, IndexError, ValueError):
                fields = stat.read_text().rsplit(")", 1)[1].split()
                if int(fields[1]) == parent:
                    child = int(stat.parent.name)
                    found[child] = fields[19]
                    frontier.append(child)
    return found


def _alive(pid: int, started: str) -> bool:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] != "Z" and fields[19] == started


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL], ids=["sigterm", "sigint", "sigkill"]
)
def test_no_node_outlives_pdserve_up(
    sig: signal.Signals, tiny_model_dir: Any, tmp_path: Path
) -> None:
    """Only `pdserve up` gets the signal, as from systemd, `kill PID` or a CI timeout: its
    nodes' API and engine processes all end too (SIGKILL: they notice their parent gone).
    Idle before that, at the default log level, it prints nothing (it printed the health
    checks, two lines a second)."""
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "pdserve.cli",
        "up",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--model",
        str(tiny_model_dir("llama")),
        "--num-kv-blocks",
        "64",
    ]
    env = {k: v for k, v in os.environ.items() if k != "PDSERVE_LOG_LEVEL"}
    console = tmp_path / "console.txt"
    with console.open("wb") as output:
        up = subprocess.Popen(cmd, env=env, stdout=output, stderr=output)
    tree: dict[int, str] = {}
    try:
        deadline = time.monotonic() + 180
        while not _healthy(f"http://127.0.0.1:{port}"):
            assert up.poll() is None and time.monotonic() < deadline, "pdserve up did not start"
            time.sleep(0.2)
        time.sleep(1)  # the ready banner
        ready = console.read_text()
        time.sleep(2)  # two rounds of health checks of both nodes
        assert console.read_text() == ready, console.read_text()[len(ready) :]
        tree = _descendants(up.pid)
        assert len(tree) >= 4, tree  # two nodes, each an API and an engine process
        up.send_signal(sig)
        up.wait(60)
        deadline = time.monotonic() + 20
        while survivors := [pid for pid, started in tree.items() if _alive(pid, started)]:
            assert time.monotonic() < deadline, f"{sig.name}: still running: {survivors}"
            time.sleep(0.1)
        assert up.returncode == (-signal.SIGKILL if sig == signal.SIGKILL else 130)
    finally:
        up.kill()
        up.wait()
        for pid, started in tree.items():
            if _alive(pid, started):
                os.kill(pid, signal.SIGKILL)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
