"""The tie of a child process to the one that started it (no pdserve processes: a `sleep`
stands in for the launcher)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from pdserve.parent_watch import ParentWatch


def test_the_direct_parent_is_watched_through_getppid() -> None:
    assert not ParentWatch().parent_gone  # this process's parent: alive
    assert not ParentWatch(os.getppid()).parent_gone


def test_a_launcher_behind_a_forking_wrapper_is_watched_by_pid_and_start_time() -> None:
    """As `ip netns exec` runs a node: the launcher is not the node's parent."""
    launcher = subprocess.Popen(["sleep", "30"])
    watch = ParentWatch(launcher.pid)
    try:
        assert not watch.parent_gone
        launcher.kill()
        launcher.wait()
        assert watch.parent_gone
    finally:
        launcher.kill()
        launcher.wait()


def test_a_dead_launcher_is_gone_even_before_it_is_reaped() -> None:
    launcher = subprocess.Popen([sys.executable, "-c", "pass"])
    watch = ParentWatch(launcher.pid)
    while _state(launcher.pid) != "Z":  # exited, not yet waited for: a zombie
        time.sleep(0.01)
    assert watch.parent_gone
    launcher.wait()


def test_a_launcher_gone_before_the_child_looked_is_gone() -> None:
    launcher = subprocess.Popen(["true"])
    launcher.wait()
    assert ParentWatch(launcher.pid).parent_gone


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
