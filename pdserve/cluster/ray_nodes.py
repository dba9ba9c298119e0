"""The Ray actors of a pdserve cluster, and the proxy's view of them.

    pdserve ray up (the driver: waits, or sends one --ask)
      ├─ ProxyActor  (the proxy, on the driver's Ray node; restarted by Ray)
      └─ Controller  (named actor `controller` in the cluster's namespace: `ray scale` and
           │           `ray status` find it; on the driver's Ray node, lives as long as it)
           ├─ NodeActor(prefill) ─ runs `pdserve serve --role prefill` on its Ray node
           └─ NodeActor(decode)  ─ …                                     (restarted by Ray)

- A `NodeActor` starts one node process on its Ray node, bound to that node's IP (which
  it advertises for KV over NIXL/UCX), and waits until it is healthy. The node watches the
  actor's pid (`--parent-pid`): if the actor dies, the node drains and exits on its own.
- Ray restarts a dead `NodeActor` (`max_restarts=-1`), on any node with the resources;
  a node process that ends unasked ends its actor, so Ray restarts that too. A restart
  starts a fresh node process on a new port, with a new epoch, so handoffs of the old
  one are refused (S11) and freed by their leases (S10).
- `Controller.members()` lists the nodes that answer now: the proxy's `RayMembership`
  polls it every health interval and its pools follow (`BackendPool.set_members`). A
  node that is gone or restarting leaves; once restarted it joins under its new URL.
- `Controller.scale(role, n)` adds actors, or takes the newest out of `members()` first,
  waits until the proxy has stopped sending it legs (two polls), then drains it (SIGTERM
  semantics: in-flight requests finish, held handoffs are read or released) and kills it.
- Placement: `SPREAD` across Ray nodes, each actor reserving its role's resources.
- `Controller.start_autoscaling` (`ray up --autoscale`): the counts follow the nodes' own
  metrics within bounds and a cool-down (`autoscale.py`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from pdserve.cluster.autoscale import AutoscaleConfig, Autoscaler, NodeLoad, parse_load
from pdserve.config import ProxyConfig
from pdserve.launch import Node, launch, stop, wait_healthy
from pdserve.proxy.app import proxy_uvicorn_config
from pdserve.proxy.state import ProxyState
from pdserve.tls import ClusterCA, TLSConfig, write_certs

logger = logging.getLogger(__name__)

DEFAULT_NAME = "pdserve"
"""A cluster's name is the Ray namespace of its named actors (`--cluster-name`): several
pdserve clusters can share one Ray cluster."""
CONTROLLER = "controller"
PROXY = "proxy"
LEAVE_WAIT_S = 2.5
"""How long a node taken out of the membership keeps serving before its drain starts: two
proxy polls at the default health interval (1 s) and some slack."""


@dataclass(frozen=True)
class RoleSpec:
    """What each node of a role runs on: its `pdserve serve` flags (with `--role`) and Ray
    resources."""

    args: tuple[str, ...]
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    env: dict[str, str] = field(default_factory=dict)
    tls: bool = False
    """Serve HTTPS with a certificate the controller's CA issues for this node's IP."""


@dataclass
class Member:
    name: str
    """`decode-3`: unique in the cluster, kept across the actor's restarts."""
    actor: Any


class NodeActor:
    """One pdserve node process on this actor's Ray node (module docstring)."""

    def __init__(self, name: str, role: str, spec: RoleSpec, controller: Any) -> None:
        self.name, self.role = name, role
        self.ip = ray.util.get_node_ip_address()
        self.ray_node = ray.get_runtime_context().get_node_id()
        self.restarted = ray.get_runtime_context().was_current_actor_reconstructed
        args = ["--advertise-host", self.ip, *spec.args]
        env = {"UCX_MODULES": "^ib", **spec.env}
        tls = issued_tls(controller, (self.ip,)) if spec.tls else None
        self.node: Node = launch(args, env, host=self.ip, tls=tls)
        self._draining = False
        wait_healthy(self.node, timeout_s=600)
        logger.info("%s node %s up on Ray node %s", role, self.node.url, self.ray_node)
        threading.Thread(target=self._watch, name="node-watch", daemon=True).start()

    def _watch(self) -> None:
        """A node process that ends unasked (killed, crashed, SIGTERMed from outside) ends
        this actor too, so that Ray restarts both: an actor left alive over a dead node
        would hold its place in the cluster and never be restarted."""
        status = self.node.process.wait()
        if not self._draining:
            logger.error("%s node %s exited (%s) unasked: restarting", self.role,
                         self.node.url, status)  # fmt: skip
            os._exit(1)

    def info(self) -> dict[str, Any]:
        alive = self.node.process.poll() is None
        return {
            "name": self.name,
            "role": self.role,
            "url": self.node.url,
            "ray_node": self.ray_node,
            "pid": self.node.process.pid,
            "actor_pid": os.getpid(),
            "alive": alive,
            "restarted": self.restarted,
        }

    def drain(self, timeout_s: float = 30.0) -> int:
        """SIGTERM the node (it refuses new work, finishes what it has) and wait."""
        self._draining = True
        return stop(self.node, timeout_s)


class Controller:
    """Owns the node actors: their membership, scaling and status (module docstring)."""

    def __init__(self, specs: dict[str, RoleSpec], tls: bool = False) -> None:
        self.specs = specs
        self.actors: dict[str, list[Member]] = {role: [] for role in specs}
        self._started = {role: 0 for role in specs}
        self._autoscaling: asyncio.Task[None] | None = None
        self._ca = ClusterCA() if tls else None
        """The cluster's CA (`ray up --tls`): its key never leaves this actor."""

    def ca_pem(self) -> bytes:
        if self._ca is None:
            raise RuntimeError("the cluster runs without TLS")
        return self._ca.ca_pem()

    def issue_cert(self, hosts: tuple[str, ...]) -> tuple[bytes, bytes]:
        """A server certificate and key (PEM) for `hosts`, signed by the cluster's CA."""
        if self._ca is None:
            raise RuntimeError("the cluster runs without TLS")
        return self._ca.issue(hosts)

    def start_autoscaling(self, config: AutoscaleConfig) -> None:
        """From now on the counts follow the nodes' metrics (`autoscale.py`)."""
        if self._autoscaling is None:
            self._autoscaling = asyncio.get_running_loop().create_task(self._autoscale(config))

    async def _autoscale(self, config: AutoscaleConfig) -> None:
        scaler = Autoscaler(config)
        async with httpx.AsyncClient(timeout=2.0) as http:
            while True:
                await asyncio.sleep(config.interval_s)
                try:
                    loads = await self._loads(http)
                    counts = {role: len(actors) for role, actors in self.actors.items()}
                    for role, n in scaler.decide(loads, counts).items():
                        if n != counts[role]:
                            logger.info("autoscaling %s: %d -> %d nodes", role, counts[role], n)
                            await self.scale(role, n)
                except Exception:  # keep scaling on the next round
                    logger.exception("autoscaling round failed")

    async def _loads(self, http: httpx.AsyncClient) -> list[NodeLoad]:
        loads = []
        for role, urls in (await self.members()).items():
            for url in urls:
                try:
                    loads.append(parse_load(role, (await http.get(f"{url}/metrics")).text))
                except httpx.HTTPError:
                    continue  # gone or restarting: it leaves the members soon
        return loads

    async def scale(self, role: str, count: int) -> dict[str, int]:
        if role not in self.specs or count < 0 or (count < 1 and role in ("prefill", "decode")):
            raise ValueError(f"{role} count must be >= 1, got {count}")
        actors = self.actors[role]
        while len(actors) < count:
            actors.append(self._start(role))
        leaving = []
        while len(actors) > count:
            leaving.append(actors.pop())  # newest first: out of members() from now on
        if leaving:
            await asyncio.sleep(LEAVE_WAIT_S)  # the proxy stops sending it legs
            await asyncio.gather(*(self._remove(a) for a in leaving))
        await self._ready(actors)
        return {r: len(a) for r, a in self.actors.items()}

    async def members(self) -> dict[str, list[str]]:
        """The URLs of the nodes that answer now, by role."""
        found: dict[str, list[str]] = {}
        for role, actors in self.actors.items():
            infos = await asyncio.gather(*(_info(m.actor) for m in actors))
            found[role] = [i["url"] for i in infos if i is not None and i["alive"]]
        return found

    async def status(self) -> list[dict[str, Any]]:
        rows = []
        for role, actors in self.actors.items():
            for m in actors:
                info = await _info(m.actor)
                rows.append(info or {"name": m.name, "role": role, "url": None, "alive": False})
        return rows

    def _start(self, role: str) -> Member:
        spec = self.specs[role]
        self._started[role] += 1
        name = f"{role}-{self._started[role]}"
        actor = (
            ray.remote(NodeActor)
            .options(
                num_cpus=spec.num_cpus,
                num_gpus=spec.num_gpus,
                max_restarts=-1,
                scheduling_strategy="SPREAD",
            )
            .remote(name, role, spec, ray.get_runtime_context().current_actor)
        )
        return Member(name, actor)

    async def _ready(self, actors: list[Member]) -> None:
        await asyncio.gather(*(_info(m.actor, timeout_s=600) for m in actors))

    async def _remove(self, member: Member) -> None:
        try:
            await asyncio.wait_for(member.actor.drain.remote(), 60)
        except Exception as e:  # gone already, or stuck: killing it ends its node too
            logger.warning("drain of %s failed: %s", member.name, e)
        ray.kill(member.actor, no_restart=True)


async def _info(actor: Any, timeout_s: float = 2.0) -> dict[str, Any] | None:
    """The actor's node, or None while it is dead or restarting."""
    try:
        info: dict[str, Any] = await asyncio.wait_for(actor.info.remote(), timeout_s)
        return info
    except Exception:
        return None


class ProxyActor:
    """The proxy, restarted by Ray like the nodes: it serves in a thread of this actor,
    pinned to the `ray up` driver's Ray node so that a restart binds the same address, and
    its pools follow the controller (`RayMembership`)."""

    def __init__(self, config: ProxyConfig, controller: Any, tls: bool = False) -> None:
        import uvicorn

        if tls:  # HTTPS to clients, and the cluster's CA to verify the nodes
            hosts = (config.host, ray.util.get_node_ip_address())
            config = dataclasses.replace(config, tls=issued_tls(controller, hosts))
        state = ProxyState(config, membership=RayMembership(controller))
        self.server = uvicorn.Server(proxy_uvicorn_config(state))
        self.thread = threading.Thread(target=self.server.run, name="proxy", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 120
        while not self.server.started:  # a port that cannot be bound ends the thread
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the proxy could not serve on {config.host}:{config.port}")
            time.sleep(0.05)
        self.restarted = ray.get_runtime_context().was_current_actor_reconstructed

    def info(self) -> dict[str, Any]:
        """A `ray status` row."""
        config = self.server.config
        scheme = "https" if config.ssl_certfile else "http"
        return {
            "role": "proxy",
            "url": f"{scheme}://{config.host}:{config.port}",
            "ray_node": ray.get_runtime_context().get_node_id(),
            "actor_pid": os.getpid(),
            "alive": self.thread.is_alive(),
            "restarted": self.restarted,
        }


class RayMembership:
    """The proxy's discovery source (`proxy/app.py` `Membership`): the controller's list."""

    def __init__(self, controller: Any) -> None:
        self.controller = controller

    async def members(self) -> dict[str, list[str]] | None:
        try:
            members: dict[str, list[str]] = await asyncio.wait_for(
                self.controller.members.remote(), 5.0
            )
            return members
        except Exception as e:
            logger.warning("the cluster controller did not answer: %s", e)
            return None


def start_controller(specs: dict[str, RoleSpec], tls: bool = False) -> Any:
    """The named controller, owned by the calling driver (it dies with it) and pinned to
    the driver's Ray node: the node actors it owns die with it, so it must not sit on a
    node that can die under a cluster that survives (found by the node-death test)."""
    options = {"name": CONTROLLER, "max_concurrency": 64}
    return _on_this_node(Controller, **options).remote(specs, tls)


def issued_tls(controller: Any, hosts: tuple[str, ...]) -> TLSConfig:
    """This process's TLS files, issued by the cluster's CA for `hosts`, in a new private
    folder of this Ray node."""
    cert, key = ray.get(controller.issue_cert.remote(hosts))
    folder = Path(tempfile.mkdtemp(prefix="pdserve-tls-"))
    return write_certs(folder, ray.get(controller.ca_pem.remote()), cert, key).config()


def start_proxy(config: ProxyConfig, controller: Any, tls: bool = False) -> Any:
    """The proxy actor on the driver's Ray node, restarted when it dies."""
    return _on_this_node(ProxyActor, name=PROXY, max_restarts=-1).remote(config, controller, tls)


def _on_this_node(cls: type, **options: Any) -> Any:
    """`cls` as an actor on the calling driver's Ray node, reserving no CPU."""
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    return ray.remote(cls).options(num_cpus=0, scheduling_strategy=here, **options)


def find_controller() -> Any:
    return ray.get_actor(CONTROLLER)


def status_rows() -> list[dict[str, Any]]:
    """The proxy's row (when it answers), then each node's."""
    rows: list[dict[str, Any]] = []
    try:
        proxy: Any = ray.get(ray.get_actor(PROXY).info.remote(), timeout=5)
        rows.append(proxy)
    except Exception:  # restarting, or not started yet
        rows.append({"role": "proxy", "url": None, "alive": False})
    rows += ray.get(find_controller().status.remote())
    return rows


def connect(address: str | None, name: str = DEFAULT_NAME, num_cpus: int | None = None) -> None:
    """Join the Ray cluster at `address` (`auto`: the local one `ray start` made), or start
    a local one (None) with `num_cpus` logical CPUs (default: the machine's), in the
    namespace of the pdserve cluster `name`."""
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    ray.init(
        address=address,
        namespace=name,
        include_dashboard=False,
        log_to_driver=False,
        num_cpus=num_cpus if address is None else None,
    )


def wait_members(controller: Any, counts: dict[str, int], timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        members = ray.get(controller.members.remote())
        if all(len(members.get(r, [])) >= n for r, n in counts.items()):
            return
        time.sleep(0.5)
    raise TimeoutError(f"the cluster did not reach {counts} nodes in {timeout_s:.0f} s")
