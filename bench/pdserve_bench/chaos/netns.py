"""Two hosts on one machine: prefill nodes in one network namespace, decode nodes in
another, joined by a veth pair, so KV moves over UCX TCP exactly as between two hosts;
netem adds latency and loss where the kernel has it; taking the link down partitions
the control channel (S12).

    root ns (harness, proxy, reference node)
      ├── veth 10.78.1.1 ─ 10.78.1.2 ── ns "<prefix>-p": prefill nodes (0.0.0.0:PORT,
      │                                   │              advertising 10.77.0.1)
      │                                   └── veth 10.77.0.1 ─┐
      └── veth 10.78.2.1 ─ 10.78.2.2 ── ns "<prefix>-d": decode nodes │ the node-to-node
                                          └── veth 10.77.0.2 ─┘  link (control + NIXL)

Life of a bed: `NamespaceBed.create()` (or `NamespaceUnavailable` saying why: no root, no
iproute2) → nodes launched inside with `launch_in` → `partition`/`heal`, `set_netem` /
`clear_netem` → `remove()` (deleting a namespace deletes its veth ends and their peers).
Only these private namespaces and addresses are ever touched.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from pdserve.errors import PdserveError
from pdserve.launch import Node, free_port

PREFILL_LINK_IP = "10.77.0.1"
"""The prefill namespace's end of the node-to-node link: what prefill nodes advertise."""
DECODE_LINK_IP = "10.77.0.2"
PREFILL_ROOT_IP = "10.78.1.2"
"""Where the root namespace (proxy, harness) reaches the prefill namespace."""
DECODE_ROOT_IP = "10.78.2.2"


_beds = itertools.count()
"""Names stay unique within a process (device names: at most 15 characters)."""


class NamespaceUnavailable(PdserveError):
    """Network namespaces cannot be created here (the message says why)."""


_BED_NAME = re.compile(r"^pd(?P<pid>\d+)x\d+-[pd]$")


def remove_stale_beds() -> list[str]:
    """Delete the namespaces of beds whose process is gone (a run that was SIGKILLed never
    removed its own; they would hold the fixed 10.78.x addresses a new bed needs). Returns
    the names deleted. The pid is in each name: `pd<pid>x<n>-p|d`."""
    try:
        listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    except OSError:
        return []
    stale = [
        name
        for name in (line.split()[0] for line in listing.splitlines() if line.strip())
        if (match := _BED_NAME.match(name)) and not Path(f"/proc/{match['pid']}").exists()
    ]
    for name in stale:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return stale


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


@dataclass
class NamespaceBed:
    prefix: str

    @property
    def prefill_ns(self) -> str:
        return f"{self.prefix}-p"

    @property
    def decode_ns(self) -> str:
        return f"{self.prefix}-d"

    @property
    def prefill_link_dev(self) -> str:
        return f"{self.prefix}pd"

    @property
    def decode_link_dev(self) -> str:
        """The decode side of the node-to-node link: partitions and netem act here."""
        return f"{self.prefix}dp"

    @classmethod
    def create(cls, prefix: str | None = None) -> NamespaceBed:
        if shutil.which("ip") is None:
            raise NamespaceUnavailable("iproute2 (`ip`) is not installed")
        remove_stale_beds()
        bed = cls(prefix or f"pd{os.getpid()}x{next(_beds)}")
        try:
            bed._build()
        except (subprocess.CalledProcessError, OSError) as e:
            bed.remove()
            detail = e.stderr.strip() if isinstance(e, subprocess.CalledProcessError) else str(e)
            raise NamespaceUnavailable(f"cannot create network namespaces here ({detail})") from e
        return bed

    def _build(self) -> None:
        x, p, d = self.prefix, self.prefill_ns, self.decode_ns
        sh("ip", "netns", "add", p)
        sh("ip", "netns", "add", d)
        pairs = [  # (root side, namespace side, namespace, root address, namespace address)
            (f"{x}rp", f"{x}pr", p, "10.78.1.1", PREFILL_ROOT_IP),
            (f"{x}rd", f"{x}dr", d, "10.78.2.1", DECODE_ROOT_IP),
        ]
        for root_dev, ns_dev, name, root_ip, ns_ip in pairs:
            sh("ip", "link", "add", root_dev, "type", "veth", "peer", "name", ns_dev)
            sh("ip", "link", "set", ns_dev, "netns", name)
            sh("ip", "addr", "add", f"{root_ip}/24", "dev", root_dev)
            sh("ip", "link", "set", root_dev, "up")
            self._in(name, "ip", "addr", "add", f"{ns_ip}/24", "dev", ns_dev)
            self._in(name, "ip", "link", "set", ns_dev, "up")
            self._in(name, "ip", "link", "set", "lo", "up")
        sh("ip", "link", "add", self.prefill_link_dev, "type", "veth", "peer", "name",
           self.decode_link_dev)  # fmt: skip
        sh("ip", "link", "set", self.prefill_link_dev, "netns", p)
        sh("ip", "link", "set", self.decode_link_dev, "netns", d)
        for name, dev, ip in ((p, self.prefill_link_dev, PREFILL_LINK_IP),
                              (d, self.decode_link_dev, DECODE_LINK_IP)):  # fmt: skip
            self._in(name, "ip", "addr", "add", f"{ip}/24", "dev", dev)
            self._in(name, "ip", "link", "set", dev, "up")

    def remove(self) -> None:
        """Both at once: deleting a namespace waits out the kernel's network teardown."""
        deletions = [subprocess.Popen(["ip", "netns", "del", name], stderr=subprocess.DEVNULL)
                     for name in (self.prefill_ns, self.decode_ns)]  # fmt: skip
        for deletion in deletions:
            deletion.wait()

    @staticmethod
    def _in(ns: str, *cmd: str) -> None:
        sh("ip", "netns", "exec", ns, *cmd)

    # -- network faults ------------------------------------------------------------------

    def set_link(self, up: bool) -> None:
        """Down: the decode namespace cannot reach the prefill namespace (S12)."""
        self._in(self.decode_ns, "ip", "link", "set", self.decode_link_dev,
                 "up" if up else "down")  # fmt: skip

    def set_netem(self, *spec: str) -> None:
        """`tc qdisc replace … netem SPEC` on the link (e.g. "delay", "20ms", "loss", "1%");
        raises `NamespaceUnavailable` where tc or the netem qdisc is missing."""
        if shutil.which("tc") is None:
            raise NamespaceUnavailable("tc (iproute2) is not installed")
        try:
            self._in(self.decode_ns, "tc", "qdisc", "replace", "dev", self.decode_link_dev,
                     "root", "netem", *spec)  # fmt: skip
        except subprocess.CalledProcessError as e:
            raise NamespaceUnavailable(f"tc netem is unavailable ({e.stderr.strip()})") from e

    def clear_netem(self) -> None:
        subprocess.run(["ip", "netns", "exec", self.decode_ns, "tc", "qdisc", "del", "dev",
                        self.decode_link_dev, "root"], capture_output=True)  # fmt: skip

    # -- nodes ---------------------------------------------------------------------------

    def launch_in(self, role: str, args: list[str], env: dict[str, str] | None = None,
                  port: int | None = None) -> Node:  # fmt: skip
        """`pdserve serve` inside the role's namespace, on all its addresses; its URL is the
        root-namespace view. Prefill nodes advertise their end of the node-to-node link."""
        ns, host, dev = ((self.prefill_ns, PREFILL_ROOT_IP, self.prefill_link_dev)
                         if role == "prefill" else
                         (self.decode_ns, DECODE_ROOT_IP, self.decode_link_dev))  # fmt: skip
        extra = ["--advertise-host", PREFILL_LINK_IP] if role == "prefill" else []
        port = port or free_port()
        cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "pdserve.cli", "serve",
               "--host", "0.0.0.0", "--port", str(port), "--parent-pid", str(os.getpid()),
               *args, *extra]  # fmt: skip
        node_env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {}),
                    "UCX_TLS": "tcp", "UCX_NET_DEVICES": dev}  # fmt: skip
        return Node(f"http://{host}:{port}", subprocess.Popen(cmd, env=node_env))
