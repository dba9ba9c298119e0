"""The namespace test bed (`pdserve_bench.chaos.netns`): two hosts on one machine, the
decode namespace reaching the prefill one only over their link, which a partition cuts
and netem degrades. Nodes across it (KV over UCX TCP, S12 failing closed and healing under
load, netem) run in `bench chaos --netns` (tests/bench/test_chaos.py).

Skipped, saying why, where namespaces cannot be created (no root, no iproute2).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from pdserve.launch import free_port
from pdserve_bench.chaos.netns import (
    PREFILL_LINK_IP,
    PREFILL_ROOT_IP,
    NamespaceBed,
    NamespaceUnavailable,
    remove_stale_beds,
)

pytestmark = pytest.mark.timeout(60)
LISTENER = """
import socket, sys, time
s = socket.socket()
s.bind(("0.0.0.0", int(sys.argv[1])))
s.listen()
print("ready", flush=True)
time.sleep(120)
"""


@pytest.fixture(scope="module")
def bed() -> Iterator[NamespaceBed]:
    try:
        bed = NamespaceBed.create()
    except NamespaceUnavailable as e:
        pytest.skip(str(e))
    try:
        yield bed
    finally:
        bed.remove()


@pytest.fixture(scope="module")
def port(bed: NamespaceBed) -> Iterator[int]:
    """A TCP listener in the prefill namespace, on all its addresses."""
    port = free_port()
    cmd = ["ip", "netns", "exec", bed.prefill_ns, sys.executable, "-c", LISTENER, str(port)]
    listener = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        assert listener.stdout is not None and listener.stdout.readline().strip() == "ready"
        yield port
    finally:
        listener.kill()
        listener.wait()


def connects(ns: str | None, host: str, port: int) -> float | None:
    """Seconds a TCP connect from namespace `ns` (None: this one) took; None if it failed."""
    code = (
        f"import socket, time; t = time.monotonic(); "
        f"socket.create_connection(({host!r}, {port}), timeout=1); "
        f"print(time.monotonic() - t)"
    )
    if ns is None:
        start = time.monotonic()
        try:
            socket.create_connection((host, port), timeout=1).close()
        except OSError:
            return None
        return time.monotonic() - start
    done = subprocess.run(
        ["ip", "netns", "exec", ns, sys.executable, "-c", code], capture_output=True, text=True
    )
    return float(done.stdout) if done.returncode == 0 else None


def test_the_decode_namespace_reaches_the_prefill_one_only_over_their_link(
    bed: NamespaceBed, port: int
) -> None:
    assert connects(bed.decode_ns, PREFILL_LINK_IP, port) is not None
    assert connects(bed.decode_ns, PREFILL_ROOT_IP, port) is None  # no way around the link
    assert connects(None, PREFILL_ROOT_IP, port) is not None  # the proxy's way in


def test_a_partition_cuts_the_link_and_heals(bed: NamespaceBed, port: int) -> None:
    bed.set_link(up=False)
    try:
        assert connects(bed.decode_ns, PREFILL_LINK_IP, port) is None
        assert connects(None, PREFILL_ROOT_IP, port) is not None  # the proxy still reaches it
    finally:
        bed.set_link(up=True)
    assert connects(bed.decode_ns, PREFILL_LINK_IP, port) is not None


def test_netem_delays_the_link_or_says_why_it_cannot(bed: NamespaceBed, port: int) -> None:
    try:
        bed.set_netem("delay", "50ms")
    except NamespaceUnavailable as e:
        assert "netem" in str(e)
        pytest.skip(str(e))
    try:
        took = connects(bed.decode_ns, PREFILL_LINK_IP, port)
        assert took is not None and took >= 0.05
    finally:
        bed.clear_netem()
    took = connects(bed.decode_ns, PREFILL_LINK_IP, port)
    assert took is not None and took < 0.05


def test_namespaces_a_killed_run_left_behind_are_removed_by_the_next(bed: NamespaceBed) -> None:
    """A run that was SIGKILLed never deleted its namespaces: the next one deletes those
    whose process is gone (their pid is in their name), and only those."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    orphans = [f"pd{dead}x0-p", f"pd{dead}x0-d"]
    for name in orphans:
        subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        assert sorted(remove_stale_beds()) == sorted(orphans)
        listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert not any(name in listing for name in orphans)
        assert bed.prefill_ns in listing and bed.decode_ns in listing  # a live run's stay
    finally:
        for name in orphans:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
