"""free_port: a port for a server about to start, out of the kernel's way."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve import launch


def _range(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, text: str) -> None:
    path = tmp_path / "ip_local_port_range"
    path.write_text(text)
    monkeypatch.setattr(launch, "_EPHEMERAL_RANGE", path)


def test_free_ports_come_from_below_the_kernel_s_ephemeral_range(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _range(monkeypatch, tmp_path, "40000\t60999\n")
    ports = {launch.free_port() for _ in range(50)}
    assert all(20_000 <= p < 40_000 for p in ports)
    assert len(ports) > 1  # picked at random, so two launches rarely try the same one


def test_a_port_something_holds_is_never_picked(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        held.listen()
        _range(monkeypatch, tmp_path, f"{port + 1} 60999")
        monkeypatch.setattr(launch, "_LOWEST_PICKED", port)  # the only candidate is held
        with pytest.raises(launch.NodeError, match="no free port"):
            launch.free_port()


def test_a_port_is_handed_out_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Nodes launched one after another bind their ports a second or more after picking
    them: the second pick must not be the first, still unbound."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    _range(monkeypatch, tmp_path, f"{port + 1} 60999")
    monkeypatch.setattr(launch, "_LOWEST_PICKED", port)  # the only candidate
    monkeypatch.setattr(launch, "_handed_out", set())
    assert launch.free_port() == port
    with pytest.raises(launch.NodeError, match="no free port"):
        launch.free_port()


@pytest.mark.parametrize("text", ["1024 65535", "not a range", ""])
def test_without_room_below_the_range_the_kernel_picks(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, text: str
) -> None:
    _range(monkeypatch, tmp_path, text)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", launch.free_port()))  # free, and bindable


STOPPABLE = """
import sys, time
from pdserve.launch import sigterm_as_interrupt, was_terminated
try:
    with sigterm_as_interrupt():
        print("ready", flush=True)
        time.sleep(60)
except KeyboardInterrupt:
    sys.exit(0 if was_terminated() else 130)
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_launcher_stops_on_sigint_and_sigterm_even_when_its_parent_ignored_sigint(
    sig: signal.Signals,
) -> None:
    """A shell starts a background job (`pdserve ray up &` in a script, a CI step) with
    SIGINT ignored; the launchers' stop path must not depend on what they inherited."""
    process = subprocess.Popen(
        [sys.executable, "-c", STOPPABLE],
        stdout=subprocess.PIPE,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    assert process.stdout is not None and process.stdout.readline() == b"ready\n"
    process.send_signal(sig)
    assert process.wait(10) == (130 if sig == signal.SIGINT else 0)
