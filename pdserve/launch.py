"""Start and stop local `pdserve serve` nodes as subprocesses (`pdserve up`, benchmarks).

launch (returns at once) → wait_healthy (polls /health until 200, or the process dies)
→ … → stop (SIGTERM: the node drains and exits 0; SIGKILL after the timeout)

A launched node never outlives its launcher. A launcher that is stopped (Ctrl-C, or
SIGTERM inside `sigterm_as_interrupt`) stops its nodes in its `finally`; one that dies
without a chance to (SIGKILL, a crash) leaves them watching its pid (`--parent-pid`,
`pdserve/parent_watch.py`): each drains and exits on its own within a fraction of a second.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import httpx

from pdserve.errors import PdserveError
from pdserve.tls import TLSConfig


class NodeError(PdserveError):
    """A node exited or never became healthy."""


@dataclass
class Node:
    url: str
    process: subprocess.Popen[bytes]
    verify: ssl.SSLContext | bool = True
    """How its certificate is checked when it serves HTTPS (`launch`'s `tls`)."""


_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST_PICKED = 20_000
"""Above the ports Ray keeps for its workers (10002-19999 by default)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing holds now, for a server about to bind it.

    Picked below the kernel's ephemeral range when there is room. The kernel hands out
    ports from that range on its own: every outgoing connection's source port, every bind
    to port 0 (UCX's listeners). One of those could take a port picked there in the second
    before the server binds it; CI lost a run to that ("address already in use").

    Never the same port twice in one process: a cluster's nodes are launched one after
    another, each binding its port a second or more after it was picked.
    """
    low = _ephemeral_low()
    for _ in range(100):
        port = random.randrange(_LOWEST_PICKED, low) if low > _LOWEST_PICKED else 0
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            picked = int(s.getsockname()[1])
        if picked not in _handed_out:
            _handed_out.add(picked)
            return picked
    raise NodeError(f"no free port on {host}")


_handed_out: set[int] = set()


def _ephemeral_low() -> int:
    """The lowest port of the kernel's ephemeral range; 0 where it cannot be read."""
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def launch(
    args: list[str],
    env: dict[str, str] | None = None,
    host: str = "127.0.0.1",
    port: int | None = None,
    command: str = "serve",
    output: IO[bytes] | None = None,
    tls: TLSConfig | None = None,
) -> Node:
    """`pdserve <command> --host H --port P <args>` in a subprocess, tied to this process
    (`--parent-pid`); returns at once. Its stdout and stderr go to `output` (default: this
    process's). With `tls`, it serves HTTPS with those files."""
    tls = tls or TLSConfig()
    port = port or free_port(host)
    cmd = [
        sys.executable,
        "-m",
        "pdserve.cli",
        command,
        "--host",
        host,
        "--port",
        str(port),
        "--parent-pid",
        str(os.getpid()),
    ]
    process = subprocess.Popen(
        [*cmd, *tls.as_args(), *args], env={**os.environ, **(env or {})}, stdout=output,
        stderr=output,
    )  # fmt: skip
    verify = tls.client_context() if tls.serves else True  # no CA bundle read for plain HTTP
    return Node(f"{tls.scheme}://{host}:{port}", process, verify)


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Inside, SIGTERM takes Ctrl-C's path: KeyboardInterrupt, so the launcher's `finally`
    stops its nodes. Python's default for SIGTERM ends the process on the spot (as
    systemd, a container runtime, `kill PID` or a CI timeout would have it), and uvicorn
    re-raises a SIGTERM it caught once it has shut down.

    SIGINT raises KeyboardInterrupt inside too, even where the parent left it ignored: a
    shell starts a background job (`cmd &` in a script) with SIGINT ignored, and Python
    then never installs its handler, so `kill -INT` did nothing (`pdserve ray up` outlived
    it; `pdserve up`'s servers were spared only because uvicorn installs its own)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)


_terminated = threading.Event()


def _on_sigterm(signum: int, frame: object) -> None:
    _terminated.set()
    raise KeyboardInterrupt


def was_terminated() -> bool:
    """A SIGTERM reached `sigterm_as_interrupt` (a stop asked for, so exit 0; Ctrl-C is
    an interruption, 130)."""
    return _terminated.is_set()


def wait_healthy(
    node: Node, timeout_s: float = 300.0, on_status: Callable[[int], None] | None = None
) -> Node:
    """Poll /health until 200; `on_status` sees every status answered on the way."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if node.process.poll() is not None:
            raise NodeError(f"node {node.url} exited with {node.process.returncode}")
        status = health_status(node.url, node.verify)
        if status and on_status is not None:
            on_status(status)
        if status == 200:
            return node
        time.sleep(0.05)
    node.process.kill()
    raise NodeError(f"node {node.url} did not become healthy in {timeout_s:.0f} s")


def health_status(url: str, verify: ssl.SSLContext | bool = True) -> int:
    """The status of `url`/health, or 0 when nothing answers within a second."""
    try:
        return httpx.get(f"{url}/health", timeout=1, verify=verify).status_code
    except httpx.HTTPError:
        return 0


def stop(node: Node, timeout_s: float = 30.0) -> int:
    """SIGTERM (the node drains and exits), SIGKILL after `timeout_s`; the exit status."""
    if node.process.poll() is None:
        node.process.send_signal(signal.SIGTERM)
        try:
            node.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            node.process.kill()
            node.process.wait()
    return int(node.process.returncode)


def stop_all(nodes: list[Node], timeout_s: float = 30.0) -> None:
    """SIGTERM to every node at once (each drains), then wait for each as `stop` does. An
    interrupt while waiting (a second Ctrl-C) SIGKILLs what is left."""
    for node in nodes:
        if node.process.poll() is None:
            node.process.terminate()
    try:
        for node in nodes:
            stop(node, timeout_s)
    except KeyboardInterrupt:
        for node in nodes:
            kill(node)
        raise


def kill(node: Node) -> None:
    """SIGKILL the whole node, its API process and its engine process, as when the machine
    dies (killing only the API process would leave the engine to notice and clean up)."""
    signal_whole(node, signal.SIGKILL)
    node.process.wait()


def signal_whole(node: Node, sig: signal.Signals) -> None:
    """Send `sig` to the node's engine process and its API process (SIGSTOP / SIGCONT
    freeze and thaw the whole node)."""
    if node.process.poll() is None:
        signal_tree(node.process.pid, sig)


def signal_tree(pid: int, sig: signal.Signals) -> None:
    """Send `sig` to every descendant of process `pid` (a node's engine; a vLLM node's
    EngineCore and its worker), deepest first, then to `pid` (its API process): a node by
    pid, from a process that did not start it."""
    for process in [*reversed(_descendants(pid)), pid]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process, sig)


def _descendants(pid: int) -> list[int]:
    """Every process below `pid`, parents before their children."""
    found, frontier = [], [pid]
    while frontier:
        children = _children(frontier.pop(0))
        found += children
        frontier += children
    return found


def _children(pid: int) -> list[int]:
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                children.append(int(stat.parent.name))
    return children
