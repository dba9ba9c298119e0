"""The chaos harness's cluster: prefill and decode nodes, a reference node and a proxy,
each a process the harness can kill, stop and restart, and a sampler of their KV pools.

Life of a node slot: launched → healthy → (SIGKILL: the whole node, API and engine
processes, as when a machine dies | SIGTERM: it drains and exits) → restarted on the same
port with the same flags → healthy again. The proxy keeps the slot's URL throughout.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import httpx

from pdserve.proxy.launch import Node, kill, launch, stop, wait_healthy


@dataclass
class Slot:
    name: str
    role: str
    args: list[str]
    port: int = 0
    node: Node | None = None
    restarts: int = 0
    down_since_s: float | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass
class Sample:
    t_s: float
    node: str
    num_used: int
    num_held: int
    num_blocks: int


@dataclass
class LocalCluster:
    node_args: list[str]
    num_prefill: int
    num_decode: int
    api_key: str
    env: dict[str, str] = field(default_factory=dict)
    slots: list[Slot] = field(default_factory=list)
    proxy: Node | None = None
    reference: Node | None = None
    samples: list[Sample] = field(default_factory=list)
    _stop_sampling: threading.Event = field(default_factory=threading.Event)
    _started_s: float = field(default_factory=time.monotonic)

    def start(self, lease_s: float) -> None:
        roles = ["prefill"] * self.num_prefill + ["decode"] * self.num_decode
        counts = {"prefill": 0, "decode": 0}
        for role in roles:
            counts[role] += 1
            extra = ["--lease-s", str(lease_s)] if role == "prefill" else []
            self.slots.append(Slot(f"{role}-{counts[role]}", role, ["--role", role, *extra]))
        for slot in self.slots:
            slot.node = launch([*self.node_args, *slot.args], self.env)
            slot.port = int(slot.node.url.rsplit(":", 1)[1])
        self.reference = launch(self.node_args, self.env)
        for node in [s.node for s in self.slots] + [self.reference]:
            assert node is not None
            wait_healthy(node)
        proxy_args = ["--api-key", self.api_key, "--health-interval-s", "0.2"]
        for slot in self.slots:
            proxy_args += [f"--{slot.role}", slot.url]
        self.proxy = wait_healthy(launch(proxy_args, self.env, command="proxy"), 60)
        self._started_s = time.monotonic()
        threading.Thread(target=self._sample_loop, daemon=True).start()

    def now_s(self) -> float:
        return time.monotonic() - self._started_s

    # -- faults --------------------------------------------------------------------------

    def kill(self, slot: Slot) -> None:
        """SIGKILL the whole node: its API process and its engine process."""
        assert slot.node is not None
        kill(slot.node)
        slot.down_since_s = self.now_s()

    def terminate(self, slot: Slot, timeout_s: float = 60.0) -> int:
        """SIGTERM: the node drains and exits; returns its exit status."""
        assert slot.node is not None
        slot.down_since_s = self.now_s()
        return stop(slot.node, timeout_s)

    def restart(self, slot: Slot) -> None:
        slot.node = wait_healthy(launch([*self.node_args, *slot.args], self.env, port=slot.port))
        slot.restarts += 1
        slot.down_since_s = None

    # -- observation ---------------------------------------------------------------------

    def _sample_loop(self) -> None:
        headers = {"Authorization": f"Bearer {self.api_key}"}
        with httpx.Client(headers=headers, timeout=2.0) as http:
            while not self._stop_sampling.wait(0.1):
                for slot in self.slots:
                    try:
                        kv = http.get(f"{slot.url}/admin/kv").json()
                    except (httpx.HTTPError, ValueError):
                        continue  # down or restarting
                    total, held = kv["num_blocks"], kv["num_held_blocks"]
                    used = total - kv["num_free_blocks"]
                    self.samples.append(Sample(self.now_s(), slot.name, used, held, total))

    def stop(self) -> None:
        self._stop_sampling.set()
        for node in [self.proxy, self.reference] + [s.node for s in self.slots]:
            if node is not None:
                stop(node, 30)
