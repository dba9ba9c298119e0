"""The chaos harness's cluster on Ray (`bench chaos --ray`): the nodes are the node actors
of `pdserve ray up` (`pdserve/cluster/ray_nodes.py`), placed by Ray, the proxy is its
proxy actor following the controller's membership, and the reference node runs here.

A slot is a node actor, by its name (`decode-3`). Unlike a local slot, its URL changes
when Ray restarts it (a new port, a new epoch): a refresher thread follows the
controller's status and updates each slot's URL, restart count and down time, and the
list of prefill URLs the workload aims its direct legs at, in place.

Faults reach a node on its own Ray node, through a Ray task pinned there:
- kill: SIGKILL the node's processes and its actor at once, as when the machine dies;
  Ray restarts the actor, which starts a fresh node;
- sigterm: SIGTERM the node process from outside; it drains and exits, its actor sees it
  go and ends, and Ray restarts both;
- scale: the controller's `scale` (as `pdserve ray scale`): an added node joins the
  proxy's pools; a removed one leaves them, then drains.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from pdserve.cluster import ray_nodes
from pdserve.config import ProxyConfig
from pdserve.launch import (
    Node,
    NodeError,
    free_port,
    health_status,
    launch,
    signal_tree,
    stop,
    wait_healthy,
)
from pdserve_bench.chaos.cluster import Cluster, Slot

NAMESPACE = "pdserve-chaos"
"""The harness's pdserve cluster on the Ray cluster (`--cluster-name` of `ray up`): it
leaves any other pdserve cluster there alone."""
RESTART_TIMEOUT_S = 600.0


class RayCluster(Cluster):
    """P prefill and D decode node actors on the Ray cluster at `address` (None: a local
    one started here), a proxy actor, and a reference node launched here."""

    mode = "local cluster"  # its flags; the report adds where it ran
    launched_here = True

    def __init__(
        self,
        node_args: list[str],
        num_prefill: int,
        num_decode: int,
        api_key: str,
        env: dict[str, str],
        address: str | None,
        node_cpus: float,
    ) -> None:
        super().__init__(api_key, api_key)
        self.node_args, self.env = node_args, env
        self.counts = {"prefill": num_prefill, "decode": num_decode}
        self.address, self.node_cpus = address, node_cpus
        self.controller: Any = None
        self._proxy: Any = None
        self._rows: dict[str, dict[str, Any]] = {}
        """Each slot's latest row from the controller's status."""
        self._reference: Node | None = None
        self._lock = threading.Lock()
        self._stop_refresh = threading.Event()

    @property
    def owns_processes(self) -> bool:
        return True

    def start(self, lease_s: float) -> None:
        # A local Ray gets a logical CPU per node (and room to scale up): placement, not
        # a promise of cores.
        needed = math.ceil((sum(self.counts.values()) + 2) * self.node_cpus)
        num_cpus = None if self.address else max(os.cpu_count() or 1, needed)
        ray_nodes.connect(self.address, NAMESPACE, num_cpus=num_cpus)
        lease = ["--lease-s", str(lease_s)]
        specs = {
            role: ray_nodes.RoleSpec(
                (*self.node_args, "--role", role, *(lease if role == "prefill" else [])),
                num_cpus=self.node_cpus,
                env=self.env,
            )
            for role in self.counts
        }
        self.controller = ray_nodes.start_controller(specs)
        self._reference = launch(self.node_args, self.env)
        ray.get([self.controller.scale.remote(r, n) for r, n in self.counts.items()])
        members = ray.get(self.controller.members.remote())
        model = self.node_args[self.node_args.index("--model") + 1]
        config = ProxyConfig(
            prefill_urls=tuple(members["prefill"]),
            decode_urls=tuple(members["decode"]),
            port=free_port(),
            api_key=self.api_key,
            node_api_key=self.api_key,
            model=model,
            health_interval_s=0.2,
        )
        # Held: Ray ends an actor nobody refers to (the first version's proxy died so).
        self._proxy = ray_nodes.start_proxy(config, self.controller)
        self.proxy_url = ray.get(self._proxy.info.remote())["url"]
        wait_healthy(self._reference)
        self.reference_url = self._reference.url
        self.refresh()
        self.start_sampling()
        threading.Thread(target=self._refresh_loop, name="ray-slots", daemon=True).start()

    # -- the slots follow the controller -------------------------------------------------

    def refresh(self) -> None:
        """Each slot's URL, restarts and down time from the controller's status; slots of
        nodes scaled away are dropped, new ones added."""
        rows = ray.get(self.controller.status.remote(), timeout=30)
        now = self.now_s()
        with self._lock:
            by_name = {s.name: s for s in self.slots}
            slots = []
            for row in rows:
                slot = by_name.get(row["name"]) or Slot(row["name"], row["role"], [])
                if row["alive"] and row["url"] != slot.url:
                    slot.restarts += bool(slot.url)
                    slot.url, slot.down_since_s = row["url"], None
                elif not row["alive"] and slot.down_since_s is None:
                    slot.down_since_s = now
                self._rows[slot.name] = row
                slots.append(slot)
            self.slots = slots
            up = [s for s in slots if s.url and s.down_since_s is None]
            self.prefill_urls[:] = [s.url for s in up if s.role == "prefill"]

    def _refresh_loop(self) -> None:
        while not self._stop_refresh.wait(0.2):
            try:
                self.refresh()
            except Exception:  # the controller busy scaling: next time
                continue

    # -- faults --------------------------------------------------------------------------

    def kill(self, slot: Slot) -> None:
        """SIGKILL the node's processes and its actor on their Ray node."""
        row = self._rows[slot.name]
        _on_ray_node(row["ray_node"], [row["pid"], row["actor_pid"]], signal.SIGKILL, whole=True)
        slot.down_since_s = self.now_s()

    def terminate(self, slot: Slot, timeout_s: float = 60.0) -> int:
        """SIGTERM the node process from outside: it drains and exits; 0 once it has."""
        row = self._rows[slot.name]
        slot.down_since_s = self.now_s()
        _on_ray_node(row["ray_node"], [row["pid"]], signal.SIGTERM, whole=False)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if health_status(row["url"]) == 0:
                return 0
            time.sleep(0.1)
        return 1

    def restart(self, slot: Slot) -> None:
        """Ray restarts it: wait until the slot has a new URL that answers."""
        restarts = slot.restarts
        deadline = time.monotonic() + RESTART_TIMEOUT_S

        def back() -> bool:
            new = slot.restarts > restarts and slot.down_since_s is None
            return new and health_status(slot.url) == 200

        while not back():
            if time.monotonic() > deadline:
                raise NodeError(f"Ray did not restart {slot.name} in {RESTART_TIMEOUT_S:.0f} s")
            time.sleep(0.2)

    def scale(self, role: str, count: int) -> None:
        """The controller's `scale`: returns once the added nodes are healthy or the
        removed ones have drained."""
        ray.get(self.controller.scale.remote(role, count))
        self.refresh()

    def stop(self) -> None:
        """The controller and the proxy end with this driver: each node sees its actor
        gone and drains (`--parent-pid`)."""
        super().stop()
        self._stop_refresh.set()
        if self._reference is not None:
            stop(self._reference)
        if ray.is_initialized():
            ray.shutdown()


def _on_ray_node(ray_node: str, pids: list[int], sig: signal.Signals, whole: bool) -> None:
    """Signal processes on a Ray node, from a task there; `whole`: each with its children
    (a node's engine)."""
    here = NodeAffinitySchedulingStrategy(ray_node, soft=False)
    ray.get(_signal.options(scheduling_strategy=here).remote(pids, sig, whole), timeout=60)


@ray.remote(num_cpus=0)
def _signal(pids: list[int], sig: signal.Signals, whole: bool) -> None:
    for pid in pids:
        if whole:
            signal_tree(pid, sig)
        else:
            os.kill(pid, sig)
